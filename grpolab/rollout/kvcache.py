"""KV caches, attention masks and the decode state of ``grpolab.rollout.fastlm``.

* ``ConcatKV``: keys/values of one forward, a shared prompt's in front (scoring);
* ``StaticKV``: a preallocated cache per layer, filled left to right (decoding);
* ``SharedKV``: decode-time keys/values for GRPO groups: each prompt's keys kept once;
* ``Decoder``: the ``sampling.Decoder`` of a ``FastLM`` (prefill, then one token per step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpolab.rollout.batch import pos_ids
from grpolab.rollout.sampling import drop_due


class ConcatKV:
    """Keys/values of one forward: ``past`` ones (a shared prompt's, rows ``rows`` of them) in
    front; with ``keep`` each layer's own kept in ``kv`` (a prefill's, for what extends it).

    Under gradient checkpointing a layer runs again in backward and calls ``update`` again: the
    first keys of each layer stay, and only the [U, ...] prompt keys are held, not per-row
    copies (the rows are taken inside ``update``).
    """

    def __init__(self, past: list[tuple[Tensor, Tensor]] | None = None,
                 rows: Tensor | None = None, keep: bool = True) -> None:
        self.past, self.rows, self.keep = past, rows, keep
        self.kv: list[tuple[Tensor, Tensor]] = []

    def update(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.past is not None:
            pk, pv = self.past[i]
            if self.rows is not None:
                pk, pv = pk[self.rows], pv[self.rows]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        if self.keep and len(self.kv) == i:
            self.kv.append((k, v))
        return k, v


class StaticKV:
    """A preallocated KV cache [B, kv heads, S, head_dim] per layer, filled left to right."""

    def __init__(self, prefix: list[tuple[Tensor, Tensor]], rows: Tensor | None,
                 size: int, dtype: torch.dtype | None = None) -> None:
        k0 = prefix[0][0]
        b = k0.shape[0] if rows is None else rows.shape[0]
        shape = (len(prefix), 2, b, k0.shape[1], size, k0.shape[3])
        self.buf = k0.new_empty(shape, dtype=dtype or k0.dtype)
        self.k = list(self.buf[:, 0].unbind(0))
        self.v = list(self.buf[:, 1].unbind(0))
        self.fill(prefix, rows)

    def fill(self, prefix: list[tuple[Tensor, Tensor]], rows: Tensor | None) -> None:
        """Write prompts' keys/values ``prefix`` in front, in place (the rest is left as it is)."""
        self.len = prefix[0][0].shape[2]
        for i, (k, v) in enumerate(prefix):
            if rows is not None:  # each distinct prompt's keys/values go to its rows
                k, v = k[rows], v[rows]
            self.k[i].narrow(2, 0, self.len).copy_(k)
            self.v[i].narrow(2, 0, self.len).copy_(v)

    def select(self, idx: Tensor) -> None:
        """Keep rows ``idx`` only (a copy of their part of the cache)."""
        self.buf = self.buf.index_select(2, idx)
        self.k = list(self.buf[:, 0].unbind(0))
        self.v = list(self.buf[:, 1].unbind(0))

    def update(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        t, n = k.shape[2], self.len + k.shape[2]
        self.k[i].narrow(2, self.len, t).copy_(k)
        self.v[i].narrow(2, self.len, t).copy_(v)
        return self.k[i].narrow(2, 0, n), self.v[i].narrow(2, 0, n)


# Below this many bytes of prompt keys/values that a plain cache would copy to a group's other
# rows (per layer), its few fused ops beat SharedKV's extra small ones (measured crossover on a
# 2-core CPU: 0.7 MB slower, 1.3 MB even, 1.7 MB and up faster, 30% faster at 100-token prompts).
SHARED_MIN_BYTES = 1 << 20


def decode_kv_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The decode cache's dtype for a model in ``dtype``: float32 for bfloat16/float16 models on
    CPU, whose fused attention runs one-token queries in those dtypes 7-9x slower than in
    float32 (2-core Zen 4, SmolLM2's decode shapes: 1.8-2.8 ms against 0.26-0.57 ms a call).
    Upcasting keys and values is exact: attention then computes over the same keys in float32,
    as the bfloat16 kernel does inside, and returns its output in the model's dtype."""
    low = dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if low and device.type == "cpu" else dtype


# Sampling calls of more steps than this decode on ``FastLM.decode_weights``: packing SmolLM2's
# weights (~0.3 s) costs what 3-4 decode steps save.
DECODE_PACK_MIN_STEPS = 8


def _copied_bytes(prompt_keys: Tensor, group: int) -> int:
    """Bytes of keys and values a plain cache copies per layer: every prompt to group - 1 rows."""
    return 2 * (group - 1) * prompt_keys.numel() * prompt_keys.element_size()


def _grouped(x: Tensor, u: int) -> Tensor:
    """[B, T, hk, D] of rows in u groups of c -> [U, hk, c, T, D] (a view)."""
    b, t, hk, d = x.shape
    return x.view(u, b // u, t, hk, d).permute(0, 3, 1, 2, 4)


class SharedKV:
    """Decode-time keys/values for groups of rows that share a prompt (GRPO's G answers).

    Each distinct prompt's keys and values are kept once ([U, kv heads, Tp, D], no copies) and
    each row's new tokens apart ([U, kv heads, group, S, D]); rows come group by group,
    ``group`` rows per prompt. Copying the prompt to every row, as a plain cache does, makes
    every decode step read it G times, which dominates decoding once prompts are long; here
    each step reads it once per group, and a group's queries meet it in one matmul.
    """

    def __init__(self, prefix: list[tuple[Tensor, Tensor]], prompt_mask: Tensor, group: int,
                 size: int, dtype: torch.dtype | None = None) -> None:
        k0 = prefix[0][0]
        u, hk, _, d = k0.shape
        dt = dtype or k0.dtype
        self.prefix = [(k.to(dt), v.to(dt)) for k, v in prefix]
        self.group = group
        self.buf = k0.new_empty((len(prefix), 2, u, hk, group, size, d), dtype=dt)
        self.k = list(self.buf[:, 0].unbind(0))
        self.v = list(self.buf[:, 1].unbind(0))
        self.len = 0
        # The prompts' left padding as an additive key mask [U, 1, 1, Tp] (None: none padded).
        self.mask = (None if bool(prompt_mask.all())
                     else additive(prompt_mask.bool()[:, None, None, :], dt))

    def unshared(self, rows: Tensor, where: Tensor) -> StaticKV:
        """A plain cache of some rows: ``rows`` [n] their prompts, ``where`` [n] their places
        in group-by-group order; each gets its own copy of its prompt's keys and values."""
        tp = self.prefix[0][0].shape[2]
        out = StaticKV(self.prefix, rows, tp + self.k[0].shape[3])
        u, j = where // self.group, where % self.group
        for i in range(len(self.k)):
            out.k[i].narrow(2, tp, self.len).copy_(self.k[i][u, :, j, : self.len])
            out.v[i].narrow(2, tp, self.len).copy_(self.v[i][u, :, j, : self.len])
        out.len = tp + self.len
        return out

    def attend(self, i: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q [B, 1, H, D] and this step's k/v [B, 1, kv heads, D] -> output [B, 1, H * D].

        One softmax over [the prompt's keys | the row's own keys]: the maths of attention over
        their concatenation. Head j * rep + r reads kv head j, as HF's repeat_kv.
        """
        kp, vp = self.prefix[i]
        u, hk, tp, d = kp.shape
        b, h, c, n = q.shape[0], q.shape[2], self.group, self.len + 1
        rep = h // hk
        out_dtype, q = q.dtype, q.to(kp.dtype)
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
        return o.view(u, hk, c, rep, d).transpose(1, 2).reshape(b, 1, h * d).to(out_dtype)


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


# ----------------------------------------------------------------------------- decoding


def prefill(lm: Any, ids: Tensor, mask: Tensor, max_new: int,
            shared: tuple[Tensor, Tensor, Tensor] | None, w: Any) -> tuple[Tensor, ConcatKV,
                                                                           tuple, Any, Tensor]:
    """Run the prompts (each distinct one once, ``shared``) with weights ``w``: the logits
    [B, V] for each row's first new token, the prompts' keys and values, (prompt ids, mask,
    rows), the rotary tables for tp + max_new positions (None for GPT-2) and an empty tensor
    of the model's dtype."""
    tp = ids.shape[1]
    p_ids, p_mask, rows = shared if shared is not None else (ids, mask, None)
    x = ids.new_empty(0, dtype=lm.embed.weight.dtype)
    tables = lm.rope_tables(tp + max_new, x) if lm.arch == "llama" else None
    pre = ConcatKV()
    p_pos = pos_ids(p_mask)
    rot = lm.rotary(p_pos, x, tables) if tables is not None else None
    logits = lm.forward(p_ids, p_pos, prompt_mask4d(p_mask, lm.dtype), pre, keep=1,
                        rot=rot, w=w)[:, -1]
    return (logits if rows is None else logits[rows]), pre, (p_ids, p_mask, rows), tables, x


class Decoder:
    """Sampling state: a static KV cache and the logits for the next token.

    ``logits`` [B, V] predicts the first new token after construction; ``step(tokens)`` feeds
    one token per row and returns the logits for the next. Use under ``torch.inference_mode``.
    """

    def __init__(self, lm: Any, ids: Tensor, mask: Tensor, max_new: int,
                 shared: tuple[Tensor, Tensor, Tensor] | None) -> None:
        self.lm = lm
        b, tp = ids.shape
        self.w = lm.weights()
        self.logits, pre, (p_ids, p_mask, rows), tables, x = prefill(lm, ids, mask, max_new,
                                                                      shared, self.w)
        # Positions of the new tokens, and their rotations, for every step at once.
        self.pos = mask.sum(dim=1, keepdim=True) + torch.arange(max_new, device=ids.device)
        # Rows that share a prompt in equal numbers (GRPO groups) decode group by group against
        # one copy of each prompt's keys: ``order`` puts rows in that order, ``back`` undoes it.
        self.order = self.back = None
        counts = torch.bincount(rows, minlength=p_ids.shape[0]) if rows is not None else None
        self.cache: StaticKV | SharedKV
        # (lm.pack off: HF's own operations and dtypes throughout, for exact comparisons)
        self.kv_dtype = (decode_kv_dtype(lm.dtype, ids.device) if getattr(lm, "pack", False)
                         else lm.dtype)
        if (counts is not None and bool((counts == counts[0]).all())
                and _copied_bytes(pre.kv[0][0], int(counts[0])) >= SHARED_MIN_BYTES):
            self.order = torch.argsort(rows, stable=True)
            self.back = torch.argsort(self.order)
            self.pos = self.pos[self.order]
            self.cache = SharedKV(pre.kv, p_mask, int(counts[0]), max(max_new - 1, 1),
                                  self.kv_dtype)
        else:
            self.cache = StaticKV(pre.kv, rows, tp + max(max_new - 1, 0), self.kv_dtype)
        self.rows, self.mask = rows, mask
        self.cos_sin = None if tables is None else lm.rotary(self.pos, x, tables)
        self._rotations()
        # Plain cache, padded prompts: the key mask for every step (padding, then new tokens).
        self.key_mask = None
        if self.order is None:
            self.key_mask = self._key_mask(mask, max_new)
        # The steps' projections: LoRA merged, big weights prepacked for b rows (worth its
        # one-off cost from a few steps on).
        self.ws = lm.decode_weights(b) if max_new > DECODE_PACK_MIN_STEPS else self.w
        self.t = 0

    def _rotations(self) -> None:
        """Each step's (cos, sin) [B, 1, 1, head_dim] from ``cos_sin`` (views, made once)."""
        self.rot = None
        if self.cos_sin is not None:
            cos, sin = self.cos_sin
            self.rot = list(zip(cos.split(1, dim=1), sin.split(1, dim=1)))

    def _key_mask(self, mask: Tensor, max_new: int) -> Tensor | None:
        """Additive key mask [n, 1, 1, Tp + max_new] of rows with prompt ``mask`` [n, Tp]
        (None: no padding)."""
        if bool(mask.all()):
            return None
        n = mask.shape[0]
        full = torch.cat([mask.bool(), mask.new_ones((n, max_new), dtype=torch.bool)], dim=1)
        return additive(full[:, None, None, :], self.kv_dtype)

    def shrink(self, done: Tensor) -> Tensor | None:
        """Stop computing the finished rows ``done`` [n] (caller's order) once they are
        ``DROP_SHARE`` of the rows (half, the first time, when groups share their prompt's keys:
        dropping gives each row its own copy of them). Returns the rows kept, or None."""
        if not drop_due(done, 0.5 if self.order is not None else None):
            return None
        keep = ~done
        idx = keep.nonzero().squeeze(1)
        c = self.cache
        if isinstance(c, SharedKV):  # rows are the caller's own rows: the first drop
            sel = self.back[idx]  # each kept row's place in group-by-group order
            self.cache = c.unshared(self.rows[idx], sel)
            self.key_mask = self._key_mask(self.mask[idx], self.pos.shape[1])
            self.order = self.back = None
        else:
            sel = idx
            c.select(idx)
            if self.key_mask is not None:
                self.key_mask = self.key_mask[idx]
        self.pos = self.pos[sel]  # (pos and rotations are in the cache's row order)
        if self.cos_sin is not None:
            self.cos_sin = tuple(x[sel] for x in self.cos_sin)
        self._rotations()
        return keep

    def step(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens`` [B] (one per row); the logits [B, V] for the token after them."""
        c, t = self.cache, self.t
        if self.order is not None:
            tokens = tokens[self.order]
        mask = None if self.key_mask is None else self.key_mask.narrow(3, 0, c.len + 1)
        logits = self.lm.forward(tokens[:, None], self.pos[:, t:t + 1], mask, c,
                                 rot=None if self.rot is None else self.rot[t], w=self.ws,
                                 rows=self.back)
        c.len += 1
        self.t += 1
        return logits[:, -1]
