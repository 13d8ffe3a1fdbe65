"""Lean forward passes over a Hugging Face causal LM's own modules (Llama family and GPT-2).

On small models a GRPO step is dominated by framework overhead, not arithmetic: every call of
an HF model's forward builds attention masks, cache objects, output dataclasses and kwargs
(about a millisecond of Python on CPU, several times the arithmetic of a tiny model), and the
sampler calls it once per token. ``FastLM`` runs the same maths directly:

* the model's own parameters and submodules, never copies: plain ``nn.Linear`` layers run as
  ``F.linear`` on their weights, anything else (peft's LoRA layers, quantised linears) is called
  as a module, so LoRA adapters, ``disable_adapter()`` and LoRA dropout keep working;
* RMSNorm / LayerNorm, rotary embeddings (default RoPE only), grouped-query attention through
  ``torch.nn.functional.scaled_dot_product_attention``, SiLU-gated or GELU MLPs, optional
  biases, tied embeddings, all as in the HF implementations;
* left padding through a key mask and ``position_ids`` that count only real tokens, exactly as
  ``HFBackend`` drives the HF forward (padded query rows attend to themselves only, so they stay
  finite; no real token ever attends to padding);
* sampling: one prefill per distinct prompt, then single-token decode steps into a
  preallocated static KV cache (``Decoder``), rotations for every step computed up front; when
  G rows share each prompt and its keys are large, the prompt's keys stay in one copy per group
  and every step reads them once per group, not once per row (``_Shared``);
* scoring with gradients: one forward over [prompt | completion], or a shared prompt run once
  and its keys/values (with their autograd history) handed to the G completions of its group.

Supported: ``llama``, ``mistral``, ``qwen2`` and ``gpt2`` models (``model_type``) with default
RoPE, no gradient checkpointing, no module hooks, no cross-attention, plain or LoRA-wrapped
(peft). Sliding-window attention is exact full attention while the sequence fits in the window;
``FastLM.fits`` tells the caller. ``unsupported(model)`` names the reason otherwise, and the
caller falls back to the HF forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LLAMA_TYPES = ("llama", "mistral", "qwen2")
GPT2_TYPES = ("gpt2",)


# ----------------------------------------------------------------------------- support


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under any peft wrapper."""
    get = getattr(model, "get_base_model", None)
    return get() if get is not None else model


def _rope_type(config: Any) -> str:
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if isinstance(params, dict) and params:
            if any(isinstance(v, dict) for v in params.values()):
                return "per layer type"
            return str(params.get("rope_type", params.get("type", "default")))
    return "default"


def unsupported(model: nn.Module) -> str | None:
    """Why ``FastLM`` cannot run ``model`` exactly, or None when it can."""
    peft_cfg = getattr(model, "peft_config", None)
    if isinstance(peft_cfg, dict) and any(getattr(c, "peft_type", None) != "LORA"
                                          for c in peft_cfg.values()):
        return "peft adapters other than LoRA"
    hf = base_model(model)
    config = getattr(hf, "config", None)
    mtype = getattr(config, "model_type", None)
    if mtype not in LLAMA_TYPES + GPT2_TYPES:
        return f"model_type {mtype!r} (supported: {', '.join(LLAMA_TYPES + GPT2_TYPES)})"
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention",
                                                               False):
        return "cross-attention"
    ckpt = getattr(type(hf), "is_activation_checkpointing", None)  # transformers >= 5.x
    if getattr(hf, "is_activation_checkpointing" if ckpt is not None
               else "is_gradient_checkpointing", False):
        return "gradient checkpointing"
    for m in hf.modules():
        if m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook"):
            return f"forward hooks on {type(m).__name__}"
    if mtype in LLAMA_TYPES:
        rope = _rope_type(config)
        if rope != "default":
            return f"rope type {rope!r} (only default RoPE)"
        inner = getattr(hf, "model", None)
        rotary = getattr(inner, "rotary_emb", None)
        if (not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens")
                or getattr(rotary, "rope_type", "default") != "default"
                or not hasattr(rotary, "inv_freq") or not hasattr(hf, "lm_head")):
            return f"unexpected module layout in {type(hf).__name__}"
        types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if not types <= {"full_attention", "sliding_attention"}:
            return f"layer types {sorted(types)}"
        norms = [inner.norm] + [n for lay in inner.layers
                                for n in (lay.input_layernorm, lay.post_attention_layernorm)]
        if any(type(n).__name__ not in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
               for n in norms):
            return "an RMSNorm variant"
        for lay in inner.layers:
            at = lay.self_attn
            if any(not hasattr(at, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
                return f"unexpected attention module {type(at).__name__}"
            if any(not hasattr(lay.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                return f"unexpected MLP module {type(lay.mlp).__name__}"
    else:
        tr = getattr(hf, "transformer", None)
        if tr is None or not hasattr(tr, "h") or not hasattr(hf, "lm_head"):
            return f"unexpected module layout in {type(hf).__name__}"
    return None


# ----------------------------------------------------------------------------- building blocks

Fn = Callable[[Tensor], Tensor]


def _proj(m: nn.Module) -> Fn:
    """A projection as a function: ``F.linear`` on a plain ``nn.Linear``'s own weights, GPT-2's
    Conv1D as its addmm, anything else (peft LoRA layers, quantised linears) the module."""
    if type(m) is nn.Linear:
        w, b = m.weight, m.bias
        return lambda x: F.linear(x, w, b)
    if type(m).__name__ == "Conv1D" and hasattr(m, "nf"):  # x @ W + b
        w, b, nf = m.weight, m.bias, m.nf
        return lambda x: torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], nf)
    return m


def _rms_norm(m: nn.Module) -> Fn:
    """Llama-style RMSNorm: weight * x / sqrt(mean(x^2) + eps), computed in float32."""
    w, eps = m.weight, m.variance_epsilon

    def norm(x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and w.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    return norm


def _layer_norm(m: nn.LayerNorm) -> Fn:
    shape, w, b, eps = m.normalized_shape, m.weight, m.bias, m.eps
    return lambda x: F.layer_norm(x, shape, w, b, eps)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, D/2) * (+-sin).

    ``sin`` is the signed table (first half negated): bit-identical to HF's rotate_half form.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


class _Layer:
    """One decoder layer's functions, resolved once per forward (no module lookups inside)."""

    __slots__ = ("act", "down", "gate", "k", "norm1", "norm2", "o", "q", "qkv", "scale", "up",
                 "v")


class _Weights:
    """Everything a forward calls: embeddings, layers, final norm and head."""

    def __init__(self, embed: Fn, layers: list[_Layer], norm: Fn, head: Fn,
                 wpe: Fn | None = None) -> None:
        self.embed, self.layers, self.norm, self.head, self.wpe = embed, layers, norm, head, wpe


class _Concat:
    """Keys/values of one forward: ``past`` ones (a shared prompt's) in front, own ones kept."""

    def __init__(self, past: list[tuple[Tensor, Tensor]] | None = None) -> None:
        self.past = past
        self.kv: list[tuple[Tensor, Tensor]] = []

    def update(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.past is not None:
            pk, pv = self.past[i]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        self.kv.append((k, v))
        return k, v


class _Static:
    """A preallocated KV cache [B, kv heads, S, head_dim] per layer, filled left to right."""

    def __init__(self, prefix: list[tuple[Tensor, Tensor]], rows: Tensor | None,
                 size: int) -> None:
        k0 = prefix[0][0]
        b = k0.shape[0] if rows is None else rows.shape[0]
        shape = (len(prefix), 2, b, k0.shape[1], size, k0.shape[3])
        self.buf = k0.new_empty(shape)
        self.k = list(self.buf[:, 0].unbind(0))
        self.v = list(self.buf[:, 1].unbind(0))
        self.len = k0.shape[2]
        for i, (k, v) in enumerate(prefix):
            if rows is not None:  # each distinct prompt's keys/values go to its rows
                k, v = k[rows], v[rows]
            self.k[i].narrow(2, 0, self.len).copy_(k)
            self.v[i].narrow(2, 0, self.len).copy_(v)

    def update(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        t, n = k.shape[2], self.len + k.shape[2]
        self.k[i].narrow(2, self.len, t).copy_(k)
        self.v[i].narrow(2, self.len, t).copy_(v)
        return self.k[i].narrow(2, 0, n), self.v[i].narrow(2, 0, n)


# Below this many bytes of prompt keys/values that a plain cache would copy to a group's other
# rows (per layer), its few fused ops beat _Shared's extra small ones (measured crossover on a
# 2-core CPU: 0.7 MB slower, 1.3 MB even, 1.7 MB and up faster, 30% faster at 100-token prompts).
SHARED_MIN_BYTES = 1 << 20


def _copied_bytes(prompt_keys: Tensor, group: int) -> int:
    """Bytes of keys and values a plain cache copies per layer: every prompt to group - 1 rows."""
    return 2 * (group - 1) * prompt_keys.numel() * prompt_keys.element_size()


def _grouped(x: Tensor, u: int) -> Tensor:
    """[B, T, hk, D] of rows in u groups of c -> [U, hk, c, T, D] (a view)."""
    b, t, hk, d = x.shape
    return x.view(u, b // u, t, hk, d).permute(0, 3, 1, 2, 4)


class _Shared:
    """Decode-time keys/values for groups of rows that share a prompt (GRPO's G answers).

    Each distinct prompt's keys and values are kept once ([U, kv heads, Tp, D], no copies) and
    each row's new tokens apart ([U, kv heads, group, S, D]); rows come group by group,
    ``group`` rows per prompt. Copying the prompt to every row, as a plain cache does, makes
    every decode step read it G times, which dominates decoding once prompts are long; here
    each step reads it once per group, and a group's queries meet it in one matmul.
    """

    def __init__(self, prefix: list[tuple[Tensor, Tensor]], prompt_mask: Tensor, group: int,
                 size: int) -> None:
        k0 = prefix[0][0]
        u, hk, _, d = k0.shape
        self.prefix = prefix
        self.group = group
        self.buf = k0.new_empty((len(prefix), 2, u, hk, group, size, d))
        self.k = list(self.buf[:, 0].unbind(0))
        self.v = list(self.buf[:, 1].unbind(0))
        self.len = 0
        # The prompts' left padding as an additive key mask [U, 1, 1, Tp] (None: none padded).
        self.mask = (None if bool(prompt_mask.all())
                     else additive(prompt_mask.bool()[:, None, None, :], k0.dtype))

    def attend(self, i: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q [B, 1, H, D] and this step's k/v [B, 1, kv heads, D] -> output [B, 1, H * D].

        One softmax over [the prompt's keys | the row's own keys]: the maths of attention over
        their concatenation. Head j * rep + r reads kv head j, as HF's repeat_kv.
        """
        kp, vp = self.prefix[i]
        u, hk, tp, d = kp.shape
        b, h, c, n = q.shape[0], q.shape[2], self.group, self.len + 1
        rep = h // hk
        self.k[i].narrow(3, self.len, 1).copy_(_grouped(k, u))
        self.v[i].narrow(3, self.len, 1).copy_(_grouped(v, u))
        kc, vc = self.k[i].narrow(3, 0, n), self.v[i].narrow(3, 0, n)  # [U, hk, c, n, D]
        # A group's queries together, per kv head: [U, hk, c * rep, D].
        qg = (q.view(u, c, hk, rep, d).transpose(1, 2) * scale).reshape(u, hk, c * rep, d)
        sp = torch.matmul(qg, kp.transpose(-1, -2))  # [U, hk, c * rep, Tp]
        if self.mask is not None:
            sp.add_(self.mask)
        sc = torch.matmul(qg.view(u, hk, c, rep, d), kc.transpose(-1, -2))  # [.., rep, n]
        p = torch.softmax(torch.cat([sp.view(u, hk, c, rep, tp), sc], dim=-1), dim=-1)
        o = torch.matmul(p[..., tp:], vc).view(u, hk, c * rep, d)
        o.add_(torch.matmul(p[..., :tp].reshape(u, hk, c * rep, tp), vp))
        return o.view(u, hk, c, rep, d).transpose(1, 2).reshape(b, 1, h * d)


def additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask as the additive one SDPA adds to the scores (0 or -inf).

    Made once per forward: SDPA would convert a boolean mask in every layer.
    """
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf"))


def prompt_mask4d(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """Additive attention mask [B, 1, T, T] for left-padded rows (None: no padding, causal).

    Causal over real keys; a padding query attends to itself only (its output is never used,
    but must be finite: a fully masked row would give NaN, and 0 * NaN poisons real rows).
    """
    if bool(mask.all()):
        return None
    t = mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=mask.device).tril_()
    allowed = causal & mask.bool()[:, None, None, :]
    return additive(allowed | torch.eye(t, dtype=torch.bool, device=mask.device), dtype)


def chunk_mask4d(past_mask: Tensor, t: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Additive mask [B, 1, t, P + t] for t real tokens after P past keys (``past_mask`` [B, P])."""
    b, p = past_mask.shape
    causal = torch.ones(t, t, dtype=torch.bool, device=past_mask.device).tril_()
    past = past_mask.bool()[:, None, None, :].expand(b, 1, t, p)
    return additive(torch.cat([past, causal.expand(b, 1, t, t)], dim=-1), dtype)


# ----------------------------------------------------------------------------- model


class FastLM:
    """The lean forward of one HF model (plain or peft-wrapped); see the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"FastLM cannot run this model: {why}")
        self.model = model
        hf = base_model(model)
        config = hf.config
        self.arch = "gpt2" if config.model_type in GPT2_TYPES else "llama"
        self.heads = int(config.num_attention_heads)
        if self.arch == "llama":
            inner = hf.model
            self.embed = inner.embed_tokens
            self.layers = list(inner.layers)
            self.norm = inner.norm
            self.rotary_emb = inner.rotary_emb
            self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
            self.head_dim = int(self.layers[0].self_attn.head_dim)
            self.silu = str(getattr(config, "hidden_act", "")) in ("silu", "swish")
            sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
            win = getattr(config, "sliding_window", None)
            self.window = int(win) if win and (sliding or config.model_type == "mistral") else None
        else:
            tr = hf.transformer
            self.embed, self.wpe = tr.wte, tr.wpe
            self.layers = list(tr.h)
            self.norm = tr.ln_f
            self.kv_heads = self.heads
            self.head_dim = int(config.hidden_size) // self.heads
            self.window = None
        self.lm_head = hf.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def fits(self, length: int) -> bool:
        """Whether sequences of ``length`` tokens see every earlier token (sliding windows)."""
        return self.window is None or length <= self.window

    # ------------------------------------------------------------------ pieces --
    def rope_tables(self, n: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin [n, head_dim] for positions 0..n-1, as HF's rotary embedding."""
        inv = self.rotary_emb.inv_freq.to(device=like.device, dtype=torch.float32)
        freqs = torch.arange(n, device=like.device, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = getattr(self.rotary_emb, "attention_scaling", 1.0)
        cos, sin = emb.cos() * scale, emb.sin() * scale
        half = inv.shape[0]
        sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        return cos.to(like.dtype), sin.to(like.dtype)

    def weights(self) -> _Weights:
        """The functions a forward calls, resolved from the model's current modules.

        Prepared once per scoring or sampling call (module lookups are slow in a decode loop).
        """
        layers = []
        for lay in self.layers:
            r = _Layer()
            if self.arch == "llama":
                at, mlp = lay.self_attn, lay.mlp
                r.norm1, r.norm2 = _rms_norm(lay.input_layernorm), _rms_norm(
                    lay.post_attention_layernorm)
                r.q, r.k, r.v, r.o = (_proj(m) for m in (at.q_proj, at.k_proj, at.v_proj,
                                                          at.o_proj))
                r.gate, r.up, r.down = (_proj(m) for m in (mlp.gate_proj, mlp.up_proj,
                                                            mlp.down_proj))
                r.act = F.silu if self.silu else mlp.act_fn
            else:
                at, mlp = lay.attn, lay.mlp
                r.norm1, r.norm2 = _layer_norm(lay.ln_1), _layer_norm(lay.ln_2)
                r.qkv, r.o = _proj(at.c_attn), _proj(at.c_proj)
                r.up, r.down, r.act = _proj(mlp.c_fc), _proj(mlp.c_proj), mlp.act
            r.scale = at.scaling
            layers.append(r)
        if self.arch == "llama":
            return _Weights(self.embed, layers, _rms_norm(self.norm), _proj(self.lm_head))
        return _Weights(self.embed, layers, _layer_norm(self.norm), _proj(self.lm_head),
                        self.wpe)

    def _attention(self, i: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                   kv: Any, scale: float) -> Tensor:
        """q [B, T, H, D], k/v [B, T, Hkv, D] -> attention output [B, T, H * D]."""
        b, t = q.shape[:2]
        if isinstance(kv, _Shared):
            return kv.attend(i, q, k, v, scale)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k, v = kv.update(i, k, v)
        causal = mask is None and t > 1 and k.shape[2] == t
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           scale=scale, enable_gqa=self.kv_heads != self.heads)
        return o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)

    def _llama_layer(self, i: int, r: _Layer, x: Tensor, cos: Tensor, sin: Tensor,
                     mask: Tensor | None, kv: Any) -> Tensor:
        b, t = x.shape[:2]
        hh, hk, d = self.heads, self.kv_heads, self.head_dim
        h = r.norm1(x)
        q = _rope(r.q(h).view(b, t, hh, d), cos, sin)
        k = _rope(r.k(h).view(b, t, hk, d), cos, sin)
        v = r.v(h).view(b, t, hk, d)
        x = x + r.o(self._attention(i, q, k, v, mask, kv, r.scale))
        h = r.norm2(x)
        return x + r.down(r.act(r.gate(h)) * r.up(h))

    def _gpt2_layer(self, i: int, r: _Layer, x: Tensor, mask: Tensor | None,
                    kv: Any) -> Tensor:
        b, t = x.shape[:2]
        qkv = r.qkv(r.norm1(x)).view(b, t, 3 * self.heads, self.head_dim)
        q, k, v = qkv.chunk(3, dim=2)
        x = x + r.o(self._attention(i, q, k, v, mask, kv, r.scale))
        return x + r.down(r.act(r.up(r.norm2(x))))

    # ----------------------------------------------------------------- forward --
    def rotary(self, pos: Tensor, like: Tensor,
               tables: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """cos and signed sin [B, T, 1, head_dim] at positions ``pos`` [B, T]."""
        if tables is None:
            tables = self.rope_tables(int(pos.max()) + 1, like)
        return tables[0][pos].unsqueeze(2), tables[1][pos].unsqueeze(2)

    def forward(self, ids: Tensor, pos: Tensor, mask: Tensor | None, kv: Any, keep: int = 0,
                rot: tuple[Tensor, Tensor] | None = None, w: _Weights | None = None) -> Tensor:
        """Logits [B, T or keep, V] for ``ids`` [B, T] at positions ``pos`` [B, T].

        ``mask``: additive [B, 1, T, keys], 0 or -inf (None = causal, nothing padded);
        ``kv``: where keys and values come from and go (``_Concat`` or ``_Static``); ``keep``:
        only the last keep positions get logits; ``rot``: precomputed ``rotary(pos)``; ``w``:
        ``weights()``.
        """
        w = w or self.weights()
        x = w.embed(ids)
        if w.wpe is None:
            cos, sin = rot if rot is not None else self.rotary(pos, x)
            for i, r in enumerate(w.layers):
                x = self._llama_layer(i, r, x, cos, sin, mask, kv)
        else:
            x = x + w.wpe(pos)
            for i, r in enumerate(w.layers):
                x = self._gpt2_layer(i, r, x, mask, kv)
        if keep:
            x = x[:, -keep:]
        return w.head(w.norm(x))

    # ----------------------------------------------------------------- scoring --
    def logits(self, ids: Tensor, attn: Tensor, pos: Tensor, keep: int) -> Tensor:
        """One forward over left-padded ``ids`` [B, T] (mask ``attn``): the last keep logits."""
        return self.forward(ids, pos, prompt_mask4d(attn, self.dtype), _Concat(), keep=keep)

    def shared_prefix_logits(self, ids: Tensor, attn: Tensor, pos: Tensor, tc: int,
                             shared: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        """Logits [B, tc, V] predicting the last tc tokens of ``ids``, each prompt run once.

        ``shared`` = (distinct prompt ids, their mask, row -> distinct index). The prompts'
        keys and values (with their autograd history) are copied to the rows that share them.
        """
        u_ids, u_mask, inv = shared
        tp = ids.shape[1] - tc
        pre = _Concat()
        w = self.weights()
        first = self.forward(u_ids, pos_ids(u_mask), prompt_mask4d(u_mask, self.dtype), pre,
                             keep=1, w=w)[inv]
        if tc == 1:
            return first
        past = [(k[inv], v[inv]) for k, v in pre.kv]
        mask = chunk_mask4d(attn[:, :tp], tc - 1, self.dtype)
        rest = self.forward(ids[:, tp:-1], pos[:, tp:-1], mask, _Concat(past), w=w)
        return torch.cat([first, rest], dim=1)

    # ---------------------------------------------------------------- sampling --
    def decoder(self, ids: Tensor, mask: Tensor, max_new: int,
                shared: tuple[Tensor, Tensor, Tensor] | None = None) -> Decoder:
        """Prefill left-padded prompts [B, Tp] (each distinct one once) for up to max_new steps."""
        return Decoder(self, ids, mask, max_new, shared)


def pos_ids(mask: Tensor) -> Tensor:
    """Position ids that count only real tokens (left padding gets 0), as ``generate`` uses."""
    return (mask.cumsum(dim=1) - 1).masked_fill(mask == 0, 0)


class Decoder:
    """Sampling state: a static KV cache and the logits for the next token.

    ``logits`` [B, V] predicts the first new token after construction; ``step(tokens)`` feeds
    one token per row and returns the logits for the next. Use under ``torch.inference_mode``.
    """

    def __init__(self, lm: FastLM, ids: Tensor, mask: Tensor, max_new: int,
                 shared: tuple[Tensor, Tensor, Tensor] | None) -> None:
        self.lm = lm
        b, tp = ids.shape
        p_ids, p_mask, rows = (shared if shared is not None else (ids, mask, None))
        self.w = lm.weights()
        x = ids.new_empty(0, dtype=lm.embed.weight.dtype)
        tables = lm.rope_tables(tp + max_new, x) if lm.arch == "llama" else None
        pre = _Concat()
        p_pos = pos_ids(p_mask)
        rot = lm.rotary(p_pos, x, tables) if tables is not None else None
        logits = lm.forward(p_ids, p_pos, prompt_mask4d(p_mask, lm.dtype), pre, keep=1,
                            rot=rot, w=self.w)[:, -1]
        self.logits = logits if rows is None else logits[rows]
        # Positions of the new tokens, and their rotations, for every step at once.
        self.pos = mask.sum(dim=1, keepdim=True) + torch.arange(max_new, device=ids.device)
        # Rows that share a prompt in equal numbers (GRPO groups) decode group by group against
        # one copy of each prompt's keys: ``order`` puts rows in that order, ``back`` undoes it.
        self.order = self.back = None
        counts = torch.bincount(rows, minlength=p_ids.shape[0]) if rows is not None else None
        self.cache: _Static | _Shared
        if (counts is not None and bool((counts == counts[0]).all())
                and _copied_bytes(pre.kv[0][0], int(counts[0])) >= SHARED_MIN_BYTES):
            self.order = torch.argsort(rows, stable=True)
            self.back = torch.argsort(self.order)
            self.pos = self.pos[self.order]
            self.cache = _Shared(pre.kv, p_mask, int(counts[0]), max(max_new - 1, 1))
        else:
            self.cache = _Static(pre.kv, rows, tp + max(max_new - 1, 0))
        self.rot = None
        if tables is not None:
            cos, sin = lm.rotary(self.pos, x, tables)
            self.rot = list(zip(cos.split(1, dim=1), sin.split(1, dim=1)))
        # Plain cache, padded prompts: the key mask for every step (padding, then new tokens).
        self.key_mask = None
        if self.order is None and not bool(mask.all()):
            full = torch.cat([mask.bool(), mask.new_ones((b, max_new), dtype=torch.bool)], dim=1)
            self.key_mask = additive(full[:, None, None, :], lm.dtype)
        self.t = 0

    def step(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens`` [B] (one per row); the logits [B, V] for the token after them."""
        c, t = self.cache, self.t
        if self.order is not None:
            tokens = tokens[self.order]
        mask = None if self.key_mask is None else self.key_mask.narrow(3, 0, c.len + 1)
        logits = self.lm.forward(tokens[:, None], self.pos[:, t:t + 1], mask, c,
                                 rot=None if self.rot is None else self.rot[t], w=self.w)
        c.len += 1
        self.t += 1
        return logits[:, -1] if self.back is None else logits[self.back, -1]
