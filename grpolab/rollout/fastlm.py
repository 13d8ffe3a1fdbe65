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
  and every step reads them once per group, not once per row (``SharedKV``); finished rows
  leave the batch (``Decoder.shrink``);
* scoring with gradients: one forward over [prompt | completion], or a shared prompt run once
  and its keys/values (with their autograd history) handed to the G completions of its group;
  with the model's gradient checkpointing on, each layer is recomputed in backward
  (``torch.utils.checkpoint``, non-reentrant): what stays for backward is each layer's input
  and the shared prompts' keys and values.

Supported: ``llama``, ``mistral``, ``qwen2`` and ``gpt2`` models (``model_type``) with default
RoPE, no module hooks, no cross-attention, plain or LoRA-wrapped
(peft). Sliding-window attention is exact full attention while the sequence fits in the window;
``FastLM.fits`` tells the caller. ``unsupported(model)`` names the reason otherwise, and the
caller falls back to the HF forward.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from grpolab.rollout.batch import pos_ids
from grpolab.rollout.blocks import (
    Fn,
    Layer,
    Weights,
    call,
    frozen_proj,
    has_dropout,
    identity,
    layer_norm,
    plain_proj,
    recomputed,
    rms_norm,
    rope,
    silu_mul,
)
from grpolab.rollout.kvcache import (
    ConcatKV,
    Decoder,
    SharedKV,
    StaticKV,
    chunk_mask4d,
    prompt_mask4d,
)
from grpolab.rollout.logprobs import shared_prefix_logits
from grpolab.rollout.packed import decode_proj, stacked_linear, stacked_lora

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


def checkpointing(hf: nn.Module) -> bool:
    """Whether the transformers model ``hf`` has gradient (activation) checkpointing on."""
    new = getattr(type(hf), "is_activation_checkpointing", None) is not None  # transformers 5
    return bool(getattr(hf, "is_activation_checkpointing" if new
                        else "is_gradient_checkpointing", False))


def _grads_hook(hook: Any) -> bool:
    """transformers' ``enable_input_require_grads`` hook (gradient checkpointing, peft): it
    makes the embeddings' output require grad and changes no value."""
    return getattr(hook, "__qualname__", "").startswith("PreTrainedModel.enable_input_require")


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
    for m in hf.modules():
        if (any(not _grads_hook(h) for h in m._forward_hooks.values()) or m._forward_pre_hooks
                or hasattr(m, "_hf_hook")):
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


# ----------------------------------------------------------------------------- model


def _repeated_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float,
                        rep: int) -> Tensor:
    """Masked attention over grouped keys with each key head repeated ``rep`` times, as SDPA's
    fused CUDA kernels need them."""
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


_recomputed_attention = recomputed(_repeated_attention)


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
        self.head_off = False  # True in ``trunk()``: forwards return hidden states, not logits
        # the model's gradient checkpointing: forwards with autograd keep each layer's input
        # only and recompute the layer in backward
        self.checkpoint = checkpointing(hf)
        # the decode loop on merged, prepacked weights (decode_weights) and, for bfloat16
        # models on CPU, a float32 cache (kvcache.decode_kv_dtype); scoring's frozen linears
        # on oneDNN copies (score_pack); off: HF's operations
        self.pack = True
        self.score_pack = True
        self.rescores = True  # one prefill's state serves several extends (length buckets)
        # The GPU's layout (None: where the model is on CUDA; True or False forces it, as the
        # tests do on the CPU, whose runs and measurements are on the other): masked attention
        # over grouped key heads in a form SDPA's fused kernels take (``_attention``), and a
        # decode step of fewer kernels, since a replayed step costs about a launch per kernel
        # (``decode_weights``).
        self.cuda_layout: bool | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def fits(self, length: int) -> bool:
        """Whether sequences of ``length`` tokens see every earlier token (sliding windows)."""
        return self.window is None or length <= self.window

    def trunk(self) -> FastLM:
        """This forward without the LM head: ``logits``, ``prefill`` and ``extend`` return the
        final normed hidden states [..., hidden] (for ``head.head_logprobs``)."""
        view = copy.copy(self)
        view.head_off = True
        return view

    def linear_head(self) -> tuple[Tensor, Tensor | None] | None:
        """(weight [V, D], bias) of a plain ``nn.Linear`` LM head, else None."""
        h = self.lm_head
        return (h.weight, h.bias) if type(h) is nn.Linear else None

    def on_cuda_layout(self) -> bool:
        return self.embed.weight.is_cuda if self.cuda_layout is None else self.cuda_layout

    def decode_weights(self, rows: int) -> Weights:
        """``weights()`` for the decode loop at ``rows`` rows a step: LoRA merged, big CPU
        weights prepacked (``grpolab.rollout.packed``; ``pack`` False: ``weights()``). On the
        CUDA layout: float32 adapters folded into float32 copies of their bases, q, k and v
        one matmul, RMSNorm fused (``weights(decode_layout=True)``)."""
        if not self.pack:
            return self.weights(plain_proj)
        if self.on_cuda_layout():
            return self.weights(lambda m: decode_proj(m, rows, plain_proj, upcast=True),
                                decode_layout=True)
        return self.weights(lambda m: decode_proj(m, rows, plain_proj))

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

    def weights(self, proj: Callable[[nn.Module], Fn] | None = None,
                decode_layout: bool = False) -> Weights:
        """The functions a forward calls, resolved from the model's current modules, each
        projection through ``proj`` (default: ``frozen_proj`` with ``pack`` and ``score_pack``
        on, else ``plain_proj``). ``decode_layout`` (Llama family): q, k and v stacked into one
        matmul (``qkv``; their merged weights, float32 where adapters are), RMSNorm fused. The
        default on the CUDA layout: q, k and v one function with their adapters' input cast
        once (``packed.stacked_lora``).

        Prepared once per scoring or sampling call (module lookups are slow in a decode loop).
        """
        # the training forward on the CUDA layout: q, k and v one function (stacked_lora),
        # RMSNorm keeping its low-precision input for backward
        training_layout = proj is None and self.pack and self.on_cuda_layout()
        if proj is None:
            proj = frozen_proj if self.pack and self.score_pack else plain_proj
        layers = []
        for lay in self.layers:
            r = Layer()
            if self.arch == "llama":
                at, mlp = lay.self_attn, lay.mlp
                r.norm1, r.norm2 = (
                    rms_norm(lay.input_layernorm, decode_layout, training_layout),
                    rms_norm(lay.post_attention_layernorm, decode_layout, training_layout))
                qkv = at.q_proj, at.k_proj, at.v_proj
                r.qkv = (stacked_linear(list(qkv), upcast=True) if decode_layout
                         else stacked_lora(list(qkv)) if training_layout else None)
                r.q, r.k, r.v = (None,) * 3 if r.qkv else (proj(m) for m in qkv)
                r.o = (stacked_lora([at.o_proj]) if training_layout else None) or proj(
                    at.o_proj)
                r.gate, r.up, r.down = (proj(m) for m in (mlp.gate_proj, mlp.up_proj,
                                                           mlp.down_proj))
                r.act = F.silu if self.silu else mlp.act_fn
                # act(gate) * up; on the CUDA layout silu's output is not kept for backward
                r.mix = (silu_mul if self.silu and self.on_cuda_layout()
                         else lambda g, u, act=r.act: act(g) * u)
                # training on the CUDA layout keeps the MLP's input for backward, not its
                # [tokens, 2 x intermediate] gate and up: recomputed there (a GPU runs short
                # of memory before it runs short of time in the update). Given the layer: a
                # bound method would make the layer hold itself (freed only by gc.collect)
                r.ffn = (recomputed(Layer.gated, has_dropout(mlp))
                         if training_layout and not self.checkpoint else Layer.gated)
            else:
                at, mlp = lay.attn, lay.mlp
                r.norm1, r.norm2 = layer_norm(lay.ln_1), layer_norm(lay.ln_2)
                r.qkv, r.o = proj(at.c_attn), proj(at.c_proj)
                r.up, r.down, r.act = proj(mlp.c_fc), proj(mlp.c_proj), mlp.act
            r.scale = at.scaling
            layers.append(r)
        head = identity if self.head_off else proj(self.lm_head)
        if self.arch == "llama":
            norm = rms_norm(self.norm, decode_layout, training_layout)
            return Weights(self.embed, layers, norm, head)
        return Weights(self.embed, layers, layer_norm(self.norm), head, self.wpe)

    def _attention(self, i: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                   kv: Any, scale: float) -> Tensor:
        """q [B, T, H, D], k/v [B, T, Hkv, D] -> attention output [B, T, H * D]."""
        b, t = q.shape[:2]
        if isinstance(kv, SharedKV):
            return kv.attend(i, q, k, v, scale)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k, v = kv.update(i, k, v)
        dt = q.dtype  # a float32 decode cache under a bfloat16 model (kvcache.decode_kv_dtype)
        q = q.to(k.dtype)
        grouped = self.kv_heads != self.heads
        if grouped and mask is not None and self.on_cuda_layout():
            # SDPA's fused CUDA kernels take grouped heads only without a mask; its fallback
            # copies the keys to every head, computes in float32 and keeps the float32
            # probabilities for backward. One query: its group's heads become query positions
            # over the same keys; longer queries: the keys repeated per head in their dtype.
            rep = self.heads // self.kv_heads
            if t == 1:
                o = F.scaled_dot_product_attention(q.reshape(b, self.kv_heads, rep, -1), k, v,
                                                   attn_mask=mask, scale=scale)
                return o.to(dt).reshape(b, t, self.heads * self.head_dim)
            # for backward keep q, k and v as they are, not the repeated keys and the
            # output: the attention (no dropout) is recomputed there
            attend = _repeated_attention if self.checkpoint else _recomputed_attention
            o = attend(q, k, v, mask, scale, rep)
            return o.to(dt).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        causal = mask is None and t > 1 and k.shape[2] == t
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           scale=scale, enable_gqa=grouped)
        return o.to(dt).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)

    def _llama_layer(self, i: int, r: Layer, x: Tensor, cos: Tensor, sin: Tensor,
                     mask: Tensor | None, kv: Any) -> Tensor:
        b, t = x.shape[:2]
        hh, hk, d = self.heads, self.kv_heads, self.head_dim
        h = r.norm1(x)
        if r.qkv is not None:  # one matmul; q and k rotated together
            qkv = r.qkv(h).view(b, t, hh + 2 * hk, d)
            qk = rope(qkv[:, :, : hh + hk], cos, sin)
            q, k, v = qk[:, :, :hh], qk[:, :, hh:], qkv[:, :, hh + hk:]
        else:
            q = rope(r.q(h).view(b, t, hh, d), cos, sin)
            k = rope(r.k(h).view(b, t, hk, d), cos, sin)
            v = r.v(h).view(b, t, hk, d)
        x = x + r.o(self._attention(i, q, k, v, mask, kv, r.scale))
        return x + r.down(r.ffn(r, x))

    def _gpt2_layer(self, i: int, r: Layer, x: Tensor, mask: Tensor | None,
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
                rot: tuple[Tensor, Tensor] | None = None, w: Weights | None = None,
                rows: Tensor | None = None) -> Tensor:
        """Logits [B, T or keep, V] for ``ids`` [B, T] at positions ``pos`` [B, T].

        ``mask``: additive [B, 1, T, keys], 0 or -inf (None = causal, nothing padded);
        ``kv``: where keys and values come from and go (``ConcatKV`` or ``StaticKV``); ``keep``:
        only the last keep positions get logits; ``rot``: precomputed ``rotary(pos)``; ``w``:
        ``weights()``; ``rows``: the logits of these rows, in this order (reordering the hidden
        states, not the [B, V] logits).
        """
        w = w or self.weights()
        x = w.embed(ids)
        run = (functools.partial(checkpoint, use_reentrant=False)
               if self.checkpoint and torch.is_grad_enabled() else call)
        if w.wpe is None:
            cos, sin = rot if rot is not None else self.rotary(pos, x)
            for i, r in enumerate(w.layers):
                x = run(self._llama_layer, i, r, x, cos, sin, mask, kv)
        else:
            x = x + w.wpe(pos)
            for i, r in enumerate(w.layers):
                x = run(self._gpt2_layer, i, r, x, mask, kv)
        if keep:
            x = x[:, -keep:]
        if rows is not None:
            x = x[rows]
        return w.head(w.norm(x))

    # ----------------------------------------------------------------- scoring --
    def logits(self, ids: Tensor, attn: Tensor, pos: Tensor, keep: int) -> Tensor:
        """One forward over left-padded ``ids`` [B, T] (mask ``attn``): the last keep logits."""
        return self.forward(ids, pos, prompt_mask4d(attn, self.dtype), ConcatKV(keep=False),
                            keep=keep)

    def prefill(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, Any]:
        """Logits [U, 1, V] at the last position of left-padded prompts, and their keys and
        values (with their autograd history) for ``extend``."""
        pre, w = ConcatKV(), self.weights()
        return self.forward(ids, pos_ids(mask), prompt_mask4d(mask, self.dtype), pre, keep=1,
                            w=w), (pre, w)

    def extend(self, state: Any, rows: Tensor, ids: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
        """Logits for ``ids`` [B, t] after prompt ``rows`` of ``prefill`` (``attn`` [B, P + t +
        1] covers prompt and tokens)."""
        pre, w = state
        mask = chunk_mask4d(attn[:, : attn.shape[1] - ids.shape[1] - 1], ids.shape[1], self.dtype)
        return self.forward(ids, pos, mask, ConcatKV(pre.kv, rows, keep=False), w=w)

    def shared_prefix_logits(self, ids: Tensor, attn: Tensor, pos: Tensor, tc: int,
                             shared: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        """Logits [B, tc, V] predicting the last tc tokens of ``ids``, each prompt run once."""
        return shared_prefix_logits(self, ids, attn, pos, tc, shared)

    # ---------------------------------------------------------------- sampling --
    def decoder(self, ids: Tensor, mask: Tensor, max_new: int,
                shared: tuple[Tensor, Tensor, Tensor] | None = None) -> Decoder:
        """Prefill left-padded prompts [B, Tp] (each distinct one once) for up to max_new steps."""
        return Decoder(self, ids, mask, max_new, shared)


__all__ = ["FastLM", "SharedKV", "StaticKV", "base_model", "pos_ids", "unsupported"]
