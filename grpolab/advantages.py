"""Group-relative advantages and dead-group accounting (pure tensor functions).

Rewards arrive flat, group-contiguous: answers [g*G, (g+1)*G) belong to prompt g. Everything
here is differentiable-free arithmetic so it can be checked against hand-computed numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of {group_size}"
        )
    return rewards.reshape(-1, group_size).to(torch.float64)


def dead_mask(rewards: Tensor, group_size: int) -> Tensor:
    """[num_groups] bool: True where every answer of the group got the same reward.

    Exact equality (max == min) rather than std == 0: a float mean of equal values is not always
    that value, and a dead group must get an advantage of exactly zero.
    """
    r = _groups(rewards, group_size)
    return r.max(dim=1).values == r.min(dim=1).values


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    baseline: str = "mean",
    scale: str = "std",
    std: str = "population",
    std_eps: float = 0.0,
    min_std: float = 0.0,
) -> Tensor:
    """Per-answer advantage, shared by every token of the answer.

    baseline "mean": r - mean(group) (GRPO). "rloo": r_i - mean of the other G-1 rewards.
    scale "std": divide by the group std (population by default, "sample" uses G-1), after
    adding ``std_eps`` and flooring at ``min_std`` (the tiny-difference guard); "none" = Dr. GRPO.
    Dead groups get exactly 0.
    """
    r = _groups(rewards, group_size)
    g = group_size
    mean = r.mean(dim=1, keepdim=True)
    if baseline == "mean":
        adv = r - mean
    elif baseline == "rloo":
        adv = r - (r.sum(dim=1, keepdim=True) - r) / (g - 1)
    else:
        raise ValueError(f"unknown baseline {baseline!r}")
    if scale == "std":
        if std not in ("population", "sample"):
            raise ValueError(f"unknown std {std!r}")
        sd = r.std(dim=1, keepdim=True, unbiased=(std == "sample"))
        denom = torch.clamp(sd + std_eps, min=min_std) if min_std > 0 else sd + std_eps
        adv = adv / torch.where(denom > 0, denom, torch.ones_like(denom))
    elif scale != "none":
        raise ValueError(f"unknown scale {scale!r}")
    adv = torch.where(dead_mask(rewards, group_size)[:, None], torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


@dataclass
class DeadStats:
    groups: int
    dead: int
    all_right: int
    all_wrong: int

    @property
    def dead_share(self) -> float:
        return self.dead / self.groups if self.groups else 0.0

    @property
    def all_right_share(self) -> float:
        return self.all_right / self.groups if self.groups else 0.0

    @property
    def all_wrong_share(self) -> float:
        return self.all_wrong / self.groups if self.groups else 0.0


def dead_stats(rewards: Tensor, group_size: int, success: Tensor | None = None,
               success_threshold: float = 1.0) -> DeadStats:
    """Count dead groups, split into all right and all wrong.

    ``success`` [B] bool says which answers are right (default: reward >= success_threshold);
    a dead group is all right when its first answer is (with several rewards, equal totals
    need not mean equal verdicts: the split follows the first answer).
    """
    dead = dead_mask(rewards, group_size)
    ok = rewards >= success_threshold if success is None else success.bool()
    right = dead & _groups(ok, group_size)[:, 0].bool()
    return DeadStats(
        groups=int(dead.numel()),
        dead=int(dead.sum()),
        all_right=int(right.sum()),
        all_wrong=int((dead & ~right).sum()),
    )


def predicted_dead_share(pass_rates: Tensor, group_size: int) -> float:
    """Expected share of dead groups when prompt i is solved with probability p_i.

    A group of G independent answers is dead when all are right (p^G) or all wrong ((1-p)^G);
    the live (mixed) share is 1 - p^G - (1-p)^G.
    """
    p = pass_rates.to(torch.float64).clamp(0.0, 1.0)
    if p.numel() == 0:
        return 0.0
    return float((p**group_size + (1 - p) ** group_size).mean())
