"""The building blocks of the lean forward (``fastlm``): each projection, norm and rotation as a
plain function resolved once from the model's own modules, and the per-layer bundle of them that
a forward calls (``Layer``, ``Weights``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from grpolab.rollout.packed import frozen_linear, lora_parts, lowrank_linear

Fn = Callable[[Tensor], Tensor]


def plain_proj(m: nn.Module) -> Fn:
    """A projection as a function: ``F.linear`` on a plain ``nn.Linear``'s own weights, GPT-2's
    Conv1D as its addmm, anything else (peft LoRA layers, quantised linears) the module."""
    if type(m) is nn.Linear:
        w, b = m.weight, m.bias
        return lambda x: F.linear(x, w, b)
    if type(m).__name__ == "Conv1D" and hasattr(m, "nf"):  # x @ W + b
        w, b, nf = m.weight, m.bias, m.nf
        return lambda x: torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], nf)
    return m


# With ``pack`` and ``score_pack`` on, scoring forwards run frozen linears of at least
# packed.PACK_MIN elements on oneDNN copies, forward and input gradient (packed.frozen_linear):
# faster where MKL's float32 matmuls lag oneDNN's, for one more copy of each such weight.
SCORE_ROWS = 256  # the row count oneDNN lays the copies out for (any serves every count)


def frozen_proj(m: nn.Module) -> Fn:
    """Scoring's function for projection ``m``: a frozen plain linear, or a LoRA layer's frozen
    base with its adapters beside it as peft runs them, on oneDNN copies; else ``plain_proj(m)``."""
    parts = lora_parts(m)
    if parts is not None:
        f = frozen_linear(parts[0], parts[1], SCORE_ROWS)
        if f is not None:
            return lowrank_linear(m, f) if parts[2] else f
    return plain_proj(m)


def identity(x: Tensor) -> Tensor:
    return x


def call(f: Callable[..., Tensor], *args: Any) -> Tensor:
    return f(*args)


class _KeptLowRMSNorm(torch.autograd.Function):
    """HF's RMSNorm of a low-precision x (normalised in float32, rounded, times the weight) that
    keeps x itself for backward, not its float32 copy (half the bytes); the gradients are the
    same maths in float32 in another order."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, eps: float) -> Tensor:
        xf = x.to(torch.float32)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, r)
        return w * (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w, r = ctx.saved_tensors
        xf = x.to(torch.float32)
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (g * (xf * r).to(x.dtype)).reshape(-1, x.shape[-1]).sum(0)
        gy = (g * w).to(torch.float32)
        gx = gy * r - xf * r.pow(3) * (gy * xf).mean(-1, keepdim=True)
        return gx.to(x.dtype), gw, None


def rms_norm(m: nn.Module, fused: bool = False, keep_low: bool = False) -> Fn:
    """Llama-style RMSNorm: weight * x / sqrt(mean(x^2) + eps), computed in float32 (``fused``:
    low-precision x normalised by one ``F.rms_norm``, which computes in float32 and rounds
    once, as HF's five operations do: two operations, not six;
    ``keep_low``: with autograd, low-precision x kept as it is for backward)."""
    w, eps = m.weight, m.variance_epsilon

    def norm(x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and w.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        if fused:
            return w * F.rms_norm(x, (x.shape[-1],), None, eps)
        if keep_low and torch.is_grad_enabled():
            return _KeptLowRMSNorm.apply(x, w, eps)
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    return norm


def layer_norm(m: nn.LayerNorm) -> Fn:
    shape, w, b, eps = m.normalized_shape, m.weight, m.bias, m.eps
    return lambda x: F.layer_norm(x, shape, w, b, eps)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, D/2) * (+-sin).

    ``sin`` is the signed table (first half negated): bit-identical to HF's rotate_half form.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


class _SiluMul(torch.autograd.Function):
    """silu(g) * u that keeps only g and u for backward, recomputing silu(g) there: autograd's
    own operations in its order (the same gradients, bit for bit), one [tokens, intermediate]
    tensor less per layer."""

    @staticmethod
    def forward(ctx: Any, g: Tensor, u: Tensor) -> Tensor:
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        g, u = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * u, g), grad * F.silu(g)


def silu_mul(g: Tensor, u: Tensor) -> Tensor:
    return _SiluMul.apply(g, u) if torch.is_grad_enabled() else F.silu(g) * u


def recomputed(f: Callable[..., Tensor], random: bool = False) -> Callable[..., Tensor]:
    """``f`` that, under autograd, keeps only its inputs for backward and runs again there
    (``torch.utils.checkpoint``, non-reentrant): the tensors ``f`` would keep, for one more
    forward of ``f`` in backward. ``random``: ``f`` draws random numbers (dropout), replayed in
    backward from the saved generator state (which on CUDA costs a host sync a call)."""

    def run(*args: Any) -> Tensor:
        if not torch.is_grad_enabled():
            return f(*args)
        return checkpoint(f, *args, use_reentrant=False, preserve_rng_state=random)

    return run


def has_dropout(m: nn.Module) -> bool:
    return any(isinstance(d, nn.Dropout) and d.p > 0 for d in m.modules())


class Layer:
    """One decoder layer's functions, resolved once per forward (no module lookups inside)."""

    __slots__ = ("act", "down", "ffn", "gate", "k", "mix", "norm1", "norm2", "o", "q", "qkv",
                 "scale", "up", "v")

    def gated(self, x: Tensor) -> Tensor:
        """The MLP up to its down projection: act(gate(h)) * up(h), h = norm2(x)."""
        h = self.norm2(x)
        return self.mix(self.gate(h), self.up(h))


class Weights:
    """Everything a forward calls: embeddings, layers, final norm and head."""

    def __init__(self, embed: Fn, layers: list[Layer], norm: Fn, head: Fn,
                 wpe: Fn | None = None) -> None:
        self.embed, self.layers, self.norm, self.head, self.wpe = embed, layers, norm, head, wpe
