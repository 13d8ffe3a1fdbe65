"""The GRPO objective as pure tensor functions: clipped surrogate, k3 KL, loss aggregation.

Shapes: per-token tensors are [B, T] over completion tokens, ``mask`` is 1 on real completion
tokens (EOS included) and 0 on padding; ``advantages`` is [B], one value per answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) per position; logits [B, T, V], targets [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(d) - d - 1 with d = ref - logp (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss -min(rA, clip(r, 1-eps_low, 1+eps_high)A) and where clipping bit."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped)


def aggregate(per_token: Tensor, mask: Tensor, mode: str, norm_len: int | None = None) -> Tensor:
    """Reduce per-token losses to a scalar.

    seq_mean_token_mean: mean over each reply's tokens, then over replies (GRPO; favours short
      wrong answers and long right ones, the length bias Dr. GRPO points out).
    token_mean: mean over every token of the batch (DAPO token-level loss).
    seq_mean_token_sum_norm: sum over a reply's tokens / a constant (``norm_len``, the max
      completion length), then mean over replies (Dr. GRPO).
    """
    m = mask.to(per_token.dtype)
    if mode == "seq_mean_token_mean":
        per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1)
        return per_seq.mean()
    if mode == "token_mean":
        return (per_token * m).sum() / m.sum().clamp(min=1)
    if mode == "seq_mean_token_sum_norm":
        if not norm_len:
            raise ValueError("seq_mean_token_sum_norm needs norm_len (the max completion length)")
        return ((per_token * m).sum(-1) / norm_len).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}")


@dataclass
class LossOut:
    loss: Tensor
    policy_loss: float
    kl: float
    clip_frac: float


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    beta: float,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    agg: str = "seq_mean_token_mean",
    norm_len: int | None = None,
) -> LossOut:
    """Clipped surrogate plus beta * k3 KL per token, aggregated as ``agg`` says.

    With one optimisation pass ``old_logp`` is ``logp.detach()``: the ratio is 1, its gradient
    is the policy gradient, and clipping never bites.
    """
    surrogate, clipped = clipped_surrogate(logp, old_logp, advantages, eps_low, eps_high)
    per_token = surrogate
    m = mask.to(logp.dtype)
    kl_val = 0.0
    if beta > 0 and ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + beta * kl
        kl_val = float(((kl * m).sum() / m.sum().clamp(min=1)).detach())
    loss = aggregate(per_token, mask, agg, norm_len)
    denom = m.sum().clamp(min=1)
    return LossOut(
        loss=loss,
        policy_loss=float(aggregate(surrogate.detach(), mask, agg, norm_len)),
        kl=kl_val,
        clip_frac=float((clipped.to(m.dtype) * m).sum() / denom),
    )
