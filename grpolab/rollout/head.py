"""Log-probs (and entropies) of answer tokens from logits, or from hidden states through the LM
head a chunk of tokens at a time (``head_logprobs``): no [tokens, vocabulary] tensor is kept
for backward, and under a frozen head the hidden states' gradient is made in forward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) per position; logits [B, T, V], targets [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logp(logp_all: Tensor) -> Tensor:
    """Shannon entropy in nats, -sum_v p log p, of each row of full log-probs [..., V].

    A token of probability 0 (log-prob -inf, e.g. a masked vocabulary entry) adds 0, not NaN.
    Without autograd the sum is one fused product (no [..., V] product tensor); rows where it
    meets 0 * -inf (NaN) are summed again with -inf clamped. With autograd the clamped form is
    used throughout, since the fused product's backward would turn 0 * -inf into NaN gradients.
    """
    finite = lambda: logp_all.clamp(min=torch.finfo(logp_all.dtype).min)
    if logp_all.requires_grad and torch.is_grad_enabled():
        return -(logp_all.exp() * finite()).sum(-1)
    ent = -torch.linalg.vecdot(logp_all.exp(), logp_all)
    bad = ent.isnan()
    if bool(bad.any()):
        ent = torch.where(bad, -(logp_all.exp() * finite()).sum(-1), ent)
    return ent


def token_logprobs_and_entropy(logits: Tensor, targets: Tensor, entropy_grad: bool = False,
                               chunk: int = 16) -> tuple[Tensor, Tensor]:
    """``token_logprobs`` (the same numbers, bit for bit) plus each position's entropy [B, T].

    Without ``entropy_grad`` the entropy is computed without autograd, ``chunk`` rows at a time,
    so it costs at most [chunk, T, V] extra memory; with it (for an entropy bonus) the entropy
    back-propagates.
    """
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    lp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if entropy_grad:
        return lp, entropy_from_logp(logp_all)
    with torch.no_grad():
        parts = [entropy_from_logp(c) for c in logp_all.detach().split(chunk, dim=0)]
        ent = torch.cat(parts) if parts else logp_all.new_zeros(logp_all.shape[:-1])
    return lp, ent


def _at_least_f32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(linear: Callable[[Tensor], Tensor], h: Tensor, dtype: torch.dtype,
                  scale: float) -> Tensor:
    """scale * linear(h) [n, V] in ``dtype``, scaled in place (the tensor is this call's own)."""
    z = linear(h).to(dtype)
    return z.mul_(scale) if scale != 1.0 else z


class _HeadLogprobs(torch.autograd.Function):
    """log p(target) and entropy from hidden states through the LM head, ``chunk`` rows of
    [rows, V] logits at a time (see ``head_logprobs``).

    When only ``hidden`` needs a gradient (LoRA: the head is frozen), forward also computes
    d log p(y) / d hidden = scale * (W[y] - softmax(z) @ W) per row, which backward only scales
    by the incoming gradient; otherwise backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                scale: float, chunk: int, entropy: bool,
                linear: Callable[[Tensor], Tensor] | None, grad: bool,
                grad_in_forward: bool) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        if linear is None:
            linear = functools.partial(F.linear, weight=weight, bias=bias)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        eager = grad and need_h and not need_w and not need_b and grad_in_forward
        lp = hidden.new_empty(n, dtype=_at_least_f32(hidden.dtype))
        lse = None if eager else torch.empty_like(lp)  # for the recomputing backward's softmax
        ent = torch.empty_like(lp) if entropy else lp.new_zeros(n)
        jac = torch.empty_like(hidden, dtype=lp.dtype) if eager else None  # (float32 or wider)
        # One [chunk, V] log-softmax buffer for all chunks: a fresh one per chunk is page-faulted
        # anew (50 MB at 256 x 49152 lies above glibc's mmap threshold), slower than the op.
        buf = None
        for s in range(0, n, chunk):
            t = targets[s:s + chunk, None]
            z = _chunk_logits(linear, hidden[s:s + chunk], lp.dtype, scale)
            buf = z.new_empty(z.shape) if buf is None else buf
            logp = torch._log_softmax(z, -1, False, out=buf[:z.shape[0]])
            lp[s:s + chunk] = logp.gather(-1, t).squeeze(-1)
            if lse is not None:
                lse[s:s + chunk] = z.gather(-1, t).squeeze(-1) - lp[s:s + chunk]
            if not (entropy or eager):
                continue
            p = torch.exp(logp, out=z)  # z is spent: softmax in its place
            if entropy:  # -sum p log p, with 0 * log 0 = 0 (a -inf logit adds nothing)
                logp.clamp_(min=torch.finfo(logp.dtype).min)
                ent[s:s + chunk] = logp.mul_(p).sum(-1).neg_()
            if eager:  # d log p(y) / dz = onehot(y) - softmax(z)
                gz = p.neg_().scatter_add_(-1, t, torch.ones_like(t, dtype=p.dtype))
                jac[s:s + chunk] = gz.to(hidden.dtype) @ weight
        if eager:
            if scale != 1.0:
                jac.mul_(scale)
            ctx.save_for_backward(jac)
        else:
            ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.eager, ctx.scale, ctx.chunk, ctx.hidden_dtype = eager, scale, chunk, hidden.dtype
        ctx.linear = None if eager else linear
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_lp: Tensor, g_ent: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.eager:
            (jac,) = ctx.saved_tensors
            g_h = (jac * g_lp[:, None].to(jac.dtype)).to(ctx.hidden_dtype)
            return (g_h, *[None] * 9)
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_h = torch.empty_like(hidden) if need_h else None
        acc = _at_least_f32(weight.dtype)  # accumulate the head's gradient over chunks
        g_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        g_b = torch.zeros_like(bias, dtype=acc) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            z = _chunk_logits(ctx.linear, h, g_lp.dtype, scale)
            g = g_lp[s:s + chunk, None]
            # d log p(y) / dz = onehot(y) - softmax(z), chained through z = scale * logits;
            # softmax(z) = exp(z - lse) in place (a -inf target's lse is NaN: softmax proper)
            c = lse[s:s + chunk, None]
            gz = (z.sub_(c).exp_() if bool(c.isfinite().all()) else torch.softmax(z, -1))
            gz.mul_(-g)
            gz.scatter_add_(-1, targets[s:s + chunk, None], g)
            if scale != 1.0:
                gz.mul_(scale)
            gz = gz.to(hidden.dtype)
            if g_h is not None:
                g_h[s:s + chunk] = gz @ weight
            if g_w is not None:
                g_w += gz.t().to(acc) @ h.to(acc)
            if g_b is not None:
                g_b += gz.to(acc).sum(0)
        return (g_h, None if g_w is None else g_w.to(weight.dtype),
                None if g_b is None else g_b.to(bias.dtype), *[None] * 7)


def head_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                  scale: float = 1.0, chunk: int = 256, entropy: bool = True,
                  linear: Callable[[Tensor], Tensor] | None = None,
                  grad_in_forward: bool = True) -> tuple[Tensor, Tensor]:
    """``token_logprobs`` and the entropy of ``log_softmax(scale * (hidden @ weight.T + bias))``
    without ever holding the [N, V] logits: hidden [..., D], weight [V, D], targets [...] ->
    log-probs (float32, with autograd into ``hidden``, ``weight``, ``bias``) and entropies
    (no autograd; zeros without ``entropy``), both shaped like ``targets``.

    The full-vocabulary logits of a scoring pass are [tokens, V] float32, and autograd keeps
    them and their log-softmax for backward: 0.4 GB each for 2,048 answer tokens of a
    49,152-word vocabulary. Here ``chunk`` rows are materialised at a time. With a frozen head
    (and bias) the gradient into ``hidden`` is finished in forward, a [N, D] tensor, for a head
    matmul in forward whether or not backward runs; when the head trains, backward materialises
    each chunk again, for one extra head matmul. ``linear``: h [n, D] -> h @ weight.T + bias
    computed another way (a prepacked weight; no autograd needed), else ``F.linear``.
    ``grad_in_forward`` False: backward always recomputes the chunks (``speed.head_grad_in_forward``).
    """
    shape = targets.shape
    lp, ent = _HeadLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                  targets.reshape(-1), float(scale), max(1, int(chunk)),
                                  bool(entropy), linear, torch.is_grad_enabled(),
                                  bool(grad_in_forward))
    return lp.view(shape), ent.view(shape)
