"""Group-relative advantages and dead-group accounting (pure tensor functions).

Rewards arrive flat, group-contiguous: answers [g*G, (g+1)*G) belong to prompt g. Everything
here is differentiable-free arithmetic so it can be checked against hand-computed numbers.

Registries (name -> function), read by the config, the CLI and the workshop's presets:
``ADVANTAGE_BASELINES`` (config ``baseline``), ``ADVANTAGE_SCALES`` (``scale``) and
``REWARD_AGGREGATIONS`` (``reward_aggregation``: how several reward functions combine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


STD_KINDS = ("population", "sample")  # divide by the population std (/G) or the sample std (/(G-1))

# A hook that sums a few floats over every process of a run (``dist.all_reduce_sum``); None in
# one process. Batch-level statistics use it so every rank divides by the same number.
Reduce = Callable[[list[float]], list[float]]


# ----------------------------------------------------------------- baselines --
# (rewards [N, G] float64, one row per group) -> rewards minus the baseline [N, G]


def mean_baseline(r: Tensor) -> Tensor:
    """GRPO: r_i - mean of the group."""
    return r - r.mean(dim=1, keepdim=True)


def rloo_baseline(r: Tensor) -> Tensor:
    """RLOO: r_i - mean of the other G-1 rewards (= G/(G-1) times the mean baseline's)."""
    return r - (r.sum(dim=1, keepdim=True) - r) / (r.shape[1] - 1)


ADVANTAGE_BASELINES: dict[str, Callable[[Tensor], Tensor]] = {
    "mean": mean_baseline,
    "rloo": rloo_baseline,
}

# -------------------------------------------------------------------- scales --
# (centred [N, G], rewards [N, G], std kind, std_eps, min_std, reduce) -> scaled [N, G]


def _divide(adv: Tensor, sd: Tensor, std_eps: float, min_std: float) -> Tensor:
    """adv / max(sd + std_eps, min_std); a zero denominator leaves adv (then 0) as it is."""
    denom = torch.clamp(sd + std_eps, min=min_std) if min_std > 0 else sd + std_eps
    return adv / torch.where(denom > 0, denom, torch.ones_like(denom))


def batch_mean_std(x: Tensor, std: str = "population",
                   reduce: Reduce | None = None) -> tuple[Tensor, Tensor]:
    """Mean and std (population or sample) of every element of ``x``, over all processes when
    ``reduce`` is given (from the count, sum and sum of squares, in float64)."""
    x = x.to(torch.float64)
    if reduce is None:
        n = x.numel()
        if n == 0:
            return x.new_zeros(()), x.new_zeros(())
        sd = x.std(unbiased=(std == "sample")) if n > 1 or std != "sample" else x.new_zeros(())
        return x.mean(), sd
    n, s, ss = reduce([float(x.numel()), float(x.sum()), float((x * x).sum())])
    if n == 0:
        return x.new_zeros(()), x.new_zeros(())
    mean = s / n
    var = max(ss / n - mean * mean, 0.0)
    if std == "sample":
        var = var * n / (n - 1) if n > 1 else 0.0
    return torch.tensor(mean, dtype=torch.float64), torch.tensor(var ** 0.5, dtype=torch.float64)


def group_std_scale(adv: Tensor, r: Tensor, *, std: str = "population", std_eps: float = 0.0,
                    min_std: float = 0.0, reduce: Reduce | None = None) -> Tensor:
    """GRPO: divide by the group's std (TRL scale_rewards group, verl norm_adv_by_std_in_grpo)."""
    sd = r.std(dim=1, keepdim=True, unbiased=(std == "sample"))
    return _divide(adv, sd, std_eps, min_std)


def batch_std_scale(adv: Tensor, r: Tensor, *, std: str = "population", std_eps: float = 0.0,
                    min_std: float = 0.0, reduce: Reduce | None = None) -> Tensor:
    """Divide by the std of every reward of the batch (TRL scale_rewards batch, "PPO Lite"):
    a group's advantages keep their relative size instead of each group becoming unit scale."""
    _, sd = batch_mean_std(r, std, reduce)
    return _divide(adv, sd, std_eps, min_std)


def no_scale(adv: Tensor, r: Tensor, **_: object) -> Tensor:
    """Dr. GRPO: no division (TRL scale_rewards none, verl norm_adv_by_std_in_grpo false)."""
    return adv


ADVANTAGE_SCALES: dict[str, Callable[..., Tensor]] = {
    "std": group_std_scale,
    "batch": batch_std_scale,
    "none": no_scale,
}


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    baseline: str = "mean",
    scale: str = "std",
    std: str = "population",
    std_eps: float = 0.0,
    min_std: float = 0.0,
    reduce: Reduce | None = None,
) -> Tensor:
    """Per-answer advantage, shared by every token of the answer.

    ``baseline`` (ADVANTAGE_BASELINES) "mean": r - mean(group) (GRPO); "rloo": r_i - mean of the
    other G-1 rewards. ``scale`` (ADVANTAGE_SCALES) "std": divide by the group std (population by
    default, "sample" uses G-1), after adding ``std_eps`` and flooring at ``min_std`` (the
    tiny-difference guard); "batch": by the std of the whole batch's rewards (over every process
    when ``reduce`` is given); "none" = Dr. GRPO. Dead groups get exactly 0.
    """
    r = _groups(rewards, group_size)
    centre = ADVANTAGE_BASELINES.get(baseline)
    if centre is None:
        raise ValueError(f"unknown baseline {baseline!r}")
    divide = ADVANTAGE_SCALES.get(scale)
    if divide is None:
        raise ValueError(f"unknown scale {scale!r}")
    if scale != "none" and std not in STD_KINDS:
        raise ValueError(f"unknown std {std!r}")
    adv = divide(centre(r), r, std=std, std_eps=std_eps, min_std=min_std, reduce=reduce)
    adv = torch.where(dead_mask(rewards, group_size)[:, None], torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


# ----------------------------------------------------- several reward functions --
# (per-function rewards [B, K], weights [K], group size, advantage options) -> advantages [B]


def sum_then_normalize(per_fn: Tensor, weights: Tensor, group_size: int,
                       **adv_opts: Any) -> Tensor:
    """The weighted sum of the rewards, then group advantages of the total (GRPO, TRL's
    default multi_objective_aggregation)."""
    total = per_fn.float() @ weights.float()
    return group_advantages(total, group_size, **adv_opts)


def normalize_then_sum(per_fn: Tensor, weights: Tensor, group_size: int, *,
                       std: str = "population", std_eps: float = 0.0, min_std: float = 0.0,
                       reduce: Reduce | None = None, **adv_opts: Any) -> Tensor:
    """GDPO (TRL normalize_then_sum): each reward's own group advantage (baseline and scale as
    configured), their weighted sum, then standardised over the batch ((x - mean) / std).

    A rare reward (say a format bonus most answers get) is no longer drowned by a frequent one
    in the total's group std. A group in which every reward is constant gets exactly 0.
    """
    per_fn = per_fn.to(torch.float64)
    x = torch.zeros(per_fn.shape[0], dtype=torch.float64)
    dead = torch.ones(per_fn.shape[0] // group_size if group_size else 0, dtype=torch.bool)
    for k in range(per_fn.shape[1]):
        x = x + float(weights[k]) * group_advantages(per_fn[:, k], group_size, std=std,
                                                     std_eps=std_eps, min_std=min_std,
                                                     reduce=reduce, **adv_opts)
        dead = dead & dead_mask(per_fn[:, k], group_size)
    mean, sd = batch_mean_std(x, std, reduce)
    adv = _divide(x - mean, sd, std_eps, min_std).reshape(-1, group_size)
    adv = torch.where(dead[:, None], torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(torch.float32)


REWARD_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "sum_then_normalize": sum_then_normalize,
    "normalize_then_sum": normalize_then_sum,
}


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
