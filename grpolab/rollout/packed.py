"""Projections for the decode loop: LoRA merged into its base weight, big weights prepacked.

Sampling feeds one token per row through every projection, 64-512 times per step, with the
same weights each time. Two things make that cheaper than the training forward's matmuls:

* a peft LoRA layer becomes one matmul on W + scale * B @ A (built once per sampling call)
  instead of three matmuls, an add and peft's Python per token; float32 adapters on a
  bfloat16 base stay apart (their sum rounded to bfloat16 would lose the adapters' small
  updates) and run as peft runs them, on the prepacked base;
* on a GPU, where a replayed decode step costs about a launch per kernel, such adapters are
  folded into a float32 copy of their base instead (``merged_weight(upcast=True)``: one
  matmul in float32 between two casts, not seven kernels), and projections that read the same
  input are stacked into one matmul (``stacked_linear``: q, k and v);
* on CPU, a float32 weight of at least ``PACK_MIN`` elements (bfloat16: ``PACK_MIN_BF16``, on
  CPUs with bfloat16 instructions) is reordered once for oneDNN (``torch.ops.mkldnn``), whose
  small-batch matmul beats MKL's on such shapes (measured on a 2-core EPYC at 32 rows:
  SmolLM2's 49152 x 576 head 2.4x in float32, 1.5x in bfloat16; its MLP 1.1-1.3x; smaller
  float32 weights lose to the call overhead, so they stay on ``F.linear``).

Both compute the same maths with another rounding order. The sampled tokens are scored
afterwards by the training forward, so the loss never mixes the two.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Fn = Callable[[Tensor], Tensor]
log = logging.getLogger(__name__)

PACK_MIN = 1 << 19  # elements; below it oneDNN's per-call overhead outweighs its gain
PACK_MIN_BF16 = 1 << 16  # bfloat16 (Zen 4, 32 rows: even SmolLM2's 576 x 192 gains 1.17x)


def lora_parts(m: nn.Module) -> tuple[Tensor, Tensor | None, list[tuple[str, float]]] | None:
    """(base weight [out, in], bias, [(adapter, scaling)] active) of ``m``: a plain
    ``nn.Linear`` (no adapters) or a peft LoRA layer around one whose active adapters are plain
    LoRA; None for anything else (DoRA, dropout that is on, quantised bases, adapters merged
    in place: the module itself runs)."""
    if type(m) is nn.Linear:
        return m.weight, m.bias, []
    base = getattr(m, "base_layer", None)
    if type(base) is not nn.Linear or not hasattr(m, "get_delta_weight"):
        return None
    if getattr(m, "merged", False):
        return None  # adapters folded into the base in place: peft's own forward knows how
    if getattr(m, "disable_adapters", False):
        return base.weight, base.bias, []  # adapters off: the reference
    names = []
    for name in m.active_adapters:
        if name not in m.lora_A:
            continue
        drop = m.lora_dropout[name]
        if (name in (getattr(m, "lora_variant", None) or {})  # DoRA, aLoRA, ...: own forward
                or getattr(m, "use_dora", {}).get(name) or getattr(m, "lora_bias", {}).get(name)
                or (drop.training and isinstance(drop, nn.Dropout) and drop.p > 0)):
            return None
        names.append((name, float(m.scaling[name])))
    return base.weight, base.bias, names


def merged_weight(m: nn.Module, upcast: bool = False) -> tuple[Tensor, Tensor | None] | None:
    """(weight [out, in], bias) of the map ``m`` computes, LoRA adapters folded in; None where
    ``lora_parts`` is None or an adapter's dtype is not the base's (float32 adapters on a
    bfloat16 base: rounding the sum to bfloat16 would drop the adapters' small updates), unless
    ``upcast``: then the base and its bias in the adapters' dtype, the adapters added there."""
    parts = lora_parts(m)
    if parts is None:
        return None
    w, b, names = parts
    for name, _ in names:
        delta = m.get_delta_weight(name)
        if delta.dtype != w.dtype:
            if not upcast:
                return None
            w, b = w.to(delta.dtype), None if b is None else b.to(delta.dtype)
        w = w + delta
    return w, b


def cast_linear(w: Tensor, b: Tensor | None) -> Fn:
    """x -> x @ w.T + b computed in ``w``'s dtype, returned in ``x``'s."""
    return lambda x: F.linear(x.to(w.dtype), w, b).to(x.dtype)


def stacked_linear(mods: list[nn.Module], upcast: bool = False) -> Fn | None:
    """One matmul for projections that read the same input: their ``merged_weight``s stacked
    by rows (outputs side by side, in ``mods``' order); None where one has none."""
    parts = [merged_weight(m, upcast) for m in mods]
    if any(p is None for p in parts):
        return None
    return cast_linear(*_side_by_side(parts))


def _side_by_side(parts: list[tuple]) -> tuple[Tensor, Tensor | None]:
    """Weights [out_i, in] and their biases (each part: (weight, bias, ...); zeros for a
    missing bias) stacked by rows, in the widest of their dtypes."""
    if len(parts) == 1:  # (no copy)
        return parts[0][0], parts[0][1]
    dtype = functools.reduce(torch.promote_types, [p[0].dtype for p in parts])
    w = torch.cat([p[0].to(dtype) for p in parts])
    b = (None if all(p[1] is None for p in parts) else torch.cat(
        [p[1].to(dtype) if p[1] is not None else w.new_zeros(p[0].shape[0]) for p in parts]))
    return w, b


def lowrank_linear(m: nn.Module, base: Fn) -> Fn | None:
    """``m``'s map as ``base`` (its base layer's, e.g. prepacked) plus each adapter's
    B(A(x)) * scaling in the adapters' dtype, the sum rounded to the base's output dtype:
    peft's own sequence of operations, for adapters that cannot be merged (``merged_weight``);
    None where ``lora_parts`` is None."""
    parts = lora_parts(m)
    if parts is None:
        return None
    terms = [(m.lora_A[n].weight, m.lora_B[n].weight, s) for n, s in parts[2]]
    if not terms:
        return base

    def f(x: Tensor) -> Tensor:
        out = base(x)
        dt = out.dtype
        for a, bw, s in terms:
            out = out + F.linear(F.linear(x.to(a.dtype), a), bw) * s
        return out.to(dt)

    return f


def can_pack(w: Tensor) -> bool:
    """Whether ``w`` goes through oneDNN: a big float32 CPU weight, or a bfloat16 one of at
    least ``PACK_MIN_BF16`` elements on a CPU with bfloat16 instructions; oneDNN built in."""
    if (w.device.type != "cpu" or not torch.backends.mkldnn.is_available()
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if w.dtype == torch.float32:
        return w.numel() >= PACK_MIN
    return w.dtype == torch.bfloat16 and w.numel() >= PACK_MIN_BF16 and _bf16_cpu()


@functools.cache
def _bf16_cpu() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check is not None and check())


# (id(frozen weight), transposed?) -> (weak reference to it, (version counter, address), its
# oneDNN copy, the copy's bytes); an entry goes when its weight does (a tensor's == is
# elementwise: no WeakKeyDictionary)
_PACKED: dict[tuple[int, bool], tuple[weakref.ref, tuple[int, int], Tensor, int]] = {}

# Kept copies stop at this share of the machine's memory: each costs its weight's bytes again,
# which is little beside a small model's activations but, for a 1.4B-parameter float32 model,
# 9 GB of forward and W.T copies beside 5.5 GB of weights (where TRL peaks at 9 GB). Forward
# copies are made first (sampling and both scoring passes use them), the input gradient's after.
KEEP_SHARE = 0.25


@functools.cache
def keep_budget() -> float:
    """Bytes the kept copies may take: ``KEEP_SHARE`` of this process's memory (the machine's,
    or its cgroup's limit where lower); unbounded where neither can be read."""
    try:
        total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        total = float("inf")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit) as f:
                total = min(total, float(f.read()))
        except (OSError, ValueError):  # absent, or "max"
            pass
    return KEEP_SHARE * total


@functools.cache
def _say_budget_reached(budget: float) -> None:  # once a process
    log.warning("oneDNN copies of frozen weights stop at %.1f GB (%d%% of the memory this "
                "process may use): the other weights run without one (slower); --speed "
                "cpu_pack=false makes none", budget / 2**30, round(100 * KEEP_SHARE))


def packed_weight(w: Tensor, rows: int, transposed: bool = False) -> Tensor | None:
    """A oneDNN copy of ``w`` laid out for about ``rows`` rows a call, or None (``can_pack``
    false, oneDNN refused it, or the kept copies' ``keep_budget()`` is spent). A frozen weight
    keeps its copy, checked against its version counter and address, so the head and base
    weights under LoRA are reordered once a run; weights being trained are reordered per call
    rather than holding a second copy between steps. Writes through ``.data`` bypass the
    version counter: call ``clear_packed()`` after them."""
    if not can_pack(w):
        return None
    keep = not w.requires_grad and not w.is_inference()
    key = (w._version, w.data_ptr()) if keep else None
    slot = (id(w), transposed)
    nbytes = w.numel() * w.element_size()
    if keep:
        hit = _PACKED.get(slot)
        if hit is not None and hit[0]() is w and hit[1] == key:
            return hit[2]
        if sum(e[3] for s, e in _PACKED.items() if s != slot) + nbytes > keep_budget():
            _say_budget_reached(keep_budget())
            return None
    try:
        src = w.detach().t().contiguous() if transposed else w.detach()
        wp = torch.ops.mkldnn._reorder_linear_weight(src, rows)
    except RuntimeError:
        return None
    if keep:
        _PACKED[slot] = (weakref.ref(w, lambda _, s=slot: _PACKED.pop(s, None)), key, wp,
                         nbytes)
    return wp


def clear_packed() -> None:
    """Forget every kept oneDNN copy (after changing frozen weights through ``.data``)."""
    _PACKED.clear()


def packed_linear(w: Tensor, b: Tensor | None, rows: int) -> Fn:
    """x [..., in] -> x @ w.T + b (no autograd) on ``packed_weight(w, rows)``; ``F.linear``
    where there is none."""
    wp = packed_weight(w, rows)
    if wp is None:
        return lambda x: F.linear(x, w, b)
    bp = None if b is None else b.detach()
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, wp, bp, "none", [], "")


class _FrozenLinear(torch.autograd.Function):
    """x @ W.T + b on oneDNN copies of a frozen W: forward on W's, backward (the input's
    gradient only, g @ W) on W.T's, made at the first backward (inference needs none)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, wp: Tensor, b: Tensor | None,
                rows: int) -> Tensor:
        ctx.w, ctx.rows = w, rows
        return torch.ops.mkldnn._linear_pointwise(x, wp, b, "none", [], "")

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        wtp = packed_weight(ctx.w, ctx.rows, transposed=True)
        gx = (g @ ctx.w if wtp is None
              else torch.ops.mkldnn._linear_pointwise(g.contiguous(), wtp, None, "none", [], ""))
        return gx, None, None, None, None


def frozen_linear(w: Tensor, b: Tensor | None, rows: int) -> Fn | None:
    """x [..., in] -> x @ w.T + b with autograd to x, on oneDNN copies of a frozen ``w`` (and
    ``b``) kept for the run; None where ``w`` trains, or cannot be packed."""
    if w.requires_grad or (b is not None and b.requires_grad):
        return None
    wp = packed_weight(w, rows)
    if wp is None:
        return None
    bd = None if b is None else b.detach()
    return lambda x: _FrozenLinear.apply(x, w, wp, bd, rows)  # w: its kept W.T copy


class _CastInputLinear(torch.autograd.Function):
    """F.linear(x.to(a.dtype), a) keeping x in its own dtype for a's gradient (the cast is
    redone in backward): autograd's gradients bit for bit, half the bytes kept for a bfloat16
    x under float32 adapters."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, a: Tensor) -> Tensor:
        ctx.save_for_backward(x, a)
        return F.linear(x.to(a.dtype), a)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, a = ctx.saved_tensors
        gx = F.linear(g, a.t()).to(x.dtype) if ctx.needs_input_grad[0] else None
        ga = None
        if ctx.needs_input_grad[1]:
            ga = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(a.dtype)
        return gx, ga


def _adapters_in(x: Tensor, a: Tensor) -> Tensor:
    if torch.is_grad_enabled() and x.dtype != a.dtype:
        return _CastInputLinear.apply(x, a)
    return F.linear(x.to(a.dtype), a)


def stacked_lora(mods: list[nn.Module]) -> Fn | None:
    """Projections that read the same input (q, k, v) as one function for the training forward
    on a GPU: their bases stacked into one matmul, and every adapter's A stacked into one matmul
    on one cast of the input, which autograd then keeps once for backward instead of once per
    projection; each B apart. peft's maths otherwise (each adapter's B(A(x)) * scaling in the
    adapters' dtype, added to the base's output, the sum rounded to the base's dtype). Weights
    keep their autograd (LoRA or full fine-tuning). None where ``lora_parts`` is None."""
    parts = [lora_parts(m) for m in mods]
    if any(p is None for p in parts):
        return None
    w, b = _side_by_side(parts)
    adapters = [(i, m.lora_A[n].weight, m.lora_B[n].weight, s)
                for i, (m, p) in enumerate(zip(mods, parts)) for n, s in p[2]]
    if not adapters:
        return lambda x: F.linear(x, w, b)
    a = torch.cat([t[1] for t in adapters])
    ranks = [t[1].shape[0] for t in adapters]
    widths = [p[0].shape[0] for p in parts]

    def f(x: Tensor) -> Tensor:
        out = F.linear(x, w, b)
        z = _adapters_in(x, a).split(ranks, -1)
        delta: list[Tensor | None] = [None] * len(mods)
        for (i, _, bw, s), zi in zip(adapters, z):
            term = F.linear(zi, bw) * s
            delta[i] = term if delta[i] is None else delta[i] + term
        full = [d if d is not None else z[0].new_zeros(*x.shape[:-1], n)
                for d, n in zip(delta, widths)]
        return (out + torch.cat(full, -1)).to(out.dtype)

    return f


def decode_proj(m: nn.Module, rows: int, fallback: Callable[[nn.Module], Fn],
                upcast: bool = False) -> Fn:
    """The decode loop's function for projection ``m`` at ``rows`` rows a call (see module
    docstring; ``upcast``: the GPU's float32 merge); ``fallback(m)`` where ``m`` is neither a
    linear nor a plain LoRA linear."""
    wb = merged_weight(m, upcast)
    if wb is not None:
        if upcast:
            return cast_linear(*wb)
        return packed_linear(*wb, rows)
    parts = lora_parts(m)
    if parts is None:
        return fallback(m)
    return lowrank_linear(m, packed_linear(parts[0], parts[1], rows))  # parts: never None


__all__ = ["PACK_MIN", "PACK_MIN_BF16", "can_pack", "cast_linear", "clear_packed",
           "decode_proj", "frozen_linear", "keep_budget", "lora_parts", "lowrank_linear",
           "merged_weight", "packed_linear", "packed_weight", "stacked_linear", "stacked_lora"]
