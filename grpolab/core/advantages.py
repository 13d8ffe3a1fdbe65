"""Group-relative advantages and dead-group accounting (pure tensor functions).

Rewards arrive flat, group-contiguous: answers [g*G, (g+1)*G) belong to prompt g. Everything
here is differentiable-free arithmetic so it can be checked against hand-computed numbers. A NaN
reward is an answer no reward scored (TRL's None): it is left out of its group's statistics and
of the batch's, and gets advantage 0; a group with one scored answer or none is dead.

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
    if bool(torch.isnan(r).any()):  # (answers no reward scored: left out)
        return dead_mask_ragged(rewards, torch.arange(rewards.numel()) // group_size)
    return r.max(dim=1).values == r.min(dim=1).values


def unscored(per_fn: Tensor) -> Tensor:
    """[B] bool: the answers no reward function scored (NaN in every column of [B, K])."""
    return torch.isnan(per_fn).all(dim=1) & (per_fn.shape[1] > 0)


def total_reward(per_fn: Tensor, weights: Tensor, unscored_as: float = 0.0) -> Tensor:
    """The weighted sum of [B, K] per-function rewards, a NaN (a function's None) counting 0
    (TRL's nansum); an answer no function scored gets ``unscored_as`` (NaN: left out)."""
    total = torch.nan_to_num(per_fn.float()) @ weights.float()
    return torch.where(unscored(per_fn), unscored_as, total)


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


def gpg_scale(adv: Tensor, r: Tensor, *, reduce: Reduce | None = None, **_: object) -> Tensor:
    """GPG (Chu et al. 2025, verl's adv_estimator gpg): no division by a std; times the batch's
    answers over its answers with a nonzero reward (over every process with ``reduce``), which
    makes up for the gradient the zero-reward answers do not carry."""
    n, nonzero = float(r.numel()), float(torch.count_nonzero(r))
    if reduce is not None:
        n, nonzero = reduce([n, nonzero])
    return adv * (n / max(nonzero, 1.0))


ADVANTAGE_SCALES: dict[str, Callable[..., Tensor]] = {
    "std": group_std_scale,
    "batch": batch_std_scale,
    "none": no_scale,
    "gpg": gpg_scale,
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
    if bool(torch.isnan(r).any()):  # (answers no reward scored: the ragged path drops them)
        return group_advantages_ragged(rewards, torch.arange(rewards.numel()) // group_size,
                                       baseline=baseline, scale=scale, std=std, std_eps=std_eps,
                                       min_std=min_std, reduce=reduce)
    adv = divide(centre(r), r, std=std, std_eps=std_eps, min_std=min_std, reduce=reduce)
    adv = torch.where(dead_mask(rewards, group_size)[:, None], torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


# ----------------------------------------------------- several reward functions --
# (per-function rewards [B, K], weights [K], group size, advantage options) -> advantages [B]


def sum_then_normalize(per_fn: Tensor, weights: Tensor, group_size: int,
                       **adv_opts: Any) -> Tensor:
    """The weighted sum of the rewards, then group advantages of the total (GRPO, TRL's
    default multi_objective_aggregation)."""
    return group_advantages(total_reward(per_fn, weights, torch.nan), group_size, **adv_opts)


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
    out = unscored(per_fn)
    mean, sd = batch_mean_std(x[~out] if bool(out.any()) else x, std, reduce)
    adv = _divide(x - mean, sd, std_eps, min_std)
    adv = torch.where(dead.repeat_interleave(group_size) | out, torch.zeros_like(adv), adv)
    return adv.to(torch.float32)


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

    def _share(self, n: int) -> float:
        return n / self.groups if self.groups else 0.0

    dead_share = property(lambda self: self._share(self.dead))
    all_right_share = property(lambda self: self._share(self.all_right))
    all_wrong_share = property(lambda self: self._share(self.all_wrong))


def dead_stats(rewards: Tensor, group_size: int, success: Tensor | None = None,
               success_threshold: float = 1.0) -> DeadStats:
    """Count dead groups, split into all right and all wrong.

    ``success`` [B] bool says which answers are right (default: reward >= success_threshold);
    a dead group is all right when its first answer is (with several rewards, equal totals
    need not mean equal verdicts: the split follows the first answer).
    """
    if bool(torch.isnan(rewards).any()):  # (split by each group's first scored answer)
        return dead_stats_ragged(rewards, torch.arange(rewards.numel()) // group_size, success,
                                 success_threshold)
    dead = dead_mask(rewards, group_size)
    ok = rewards >= success_threshold if success is None else success.bool()
    right = dead & _groups(ok, group_size)[:, 0].bool()
    return DeadStats(groups=int(dead.numel()), dead=int(dead.sum()), all_right=int(right.sum()),
                     all_wrong=int((dead & ~right).sum()))


def predicted_dead_share(pass_rates: Tensor, group_size: int) -> float:
    """Expected share of dead groups when prompt i is solved with probability p_i: a group of
    G independent answers is dead when all are right (p^G) or all wrong ((1-p)^G)."""
    p = pass_rates.to(torch.float64).clamp(0.0, 1.0)
    if p.numel() == 0:
        return 0.0
    return float((p**group_size + (1 - p) ** group_size).mean())


# --------------------------------------------------------------- ragged groups --
# Groups of different sizes in one batch: answer j belongs to group ``group_ids[j]``. The ids
# need not be contiguous or start at 0; groups are numbered in increasing id order (so for the
# usual group-contiguous layout with ids 0, 0, 1, 1, 1, ... group k is the k-th run).
# Shapes: rewards [B], group_ids [B] long, sizes [N], per-group results [N], per-answer [B].


def group_ids_from_sizes(sizes: Tensor | list[int]) -> Tensor:
    """[B] long: group k repeated sizes[k] times (group-contiguous layout)."""
    s = torch.as_tensor(sizes, dtype=torch.long)
    return torch.repeat_interleave(torch.arange(s.numel()), s)


def _index(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(inverse [B]: each answer's group number 0..N-1, counts [N]: each group's size)."""
    _, inv, counts = torch.unique(torch.as_tensor(group_ids), return_inverse=True,
                                  return_counts=True)
    return inv, counts


def _group_reduce(x: Tensor, inv: Tensor, n: int, how: str) -> Tensor:
    """Per-group sum/amax/amin [N] of per-answer x [B] (float64)."""
    out = torch.zeros(n, dtype=torch.float64)
    if how == "sum":
        return out.index_add_(0, inv, x)
    return out.scatter_reduce_(0, inv, x, reduce=how, include_self=False)


def dead_mask_ragged(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """[N] bool: True where every answer of the group got the same reward (max == min)."""
    inv, counts = _index(group_ids)
    r, n = rewards.to(torch.float64), counts.numel()
    scored = ~torch.isnan(r)
    if bool(scored.all()):
        return _group_reduce(r, inv, n, "amax") == _group_reduce(r, inv, n, "amin")
    hi = _group_reduce(torch.where(scored, r, -torch.inf), inv, n, "amax")
    lo = _group_reduce(torch.where(scored, r, torch.inf), inv, n, "amin")
    return (hi == lo) | (_group_reduce(scored.double(), inv, n, "sum") == 0)


def ragged_mean_baseline(r: Tensor, inv: Tensor, counts: Tensor) -> Tensor:
    """GRPO on ragged groups: r_i - mean of its group. r [B] float64 -> [B]."""
    mean = _group_reduce(r, inv, counts.numel(), "sum") / counts
    return r - mean[inv]


def ragged_rloo_baseline(r: Tensor, inv: Tensor, counts: Tensor) -> Tensor:
    """RLOO on ragged groups: r_i - mean of the other n_g - 1 rewards (a group of one: 0)."""
    total = _group_reduce(r, inv, counts.numel(), "sum")[inv]
    others = (counts[inv] - 1).to(torch.float64)
    return torch.where(others > 0, r - (total - r) / others.clamp(min=1), torch.zeros_like(r))


RAGGED_BASELINES: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "mean": ragged_mean_baseline,
    "rloo": ragged_rloo_baseline,
}


def ragged_group_std(r: Tensor, inv: Tensor, counts: Tensor, std: str = "population") -> Tensor:
    """[B]: the std of each answer's group (population /n_g, sample /(n_g - 1); 0 for n_g = 1)."""
    n = counts.numel()
    mean = _group_reduce(r, inv, n, "sum") / counts
    ss = _group_reduce((r - mean[inv]) ** 2, inv, n, "sum")
    div = (counts - 1).clamp(min=1) if std == "sample" else counts
    return torch.sqrt(ss / div)[inv]


def _ragged_scale(adv: Tensor, r: Tensor, inv: Tensor, counts: Tensor, scale: str, std: str,
                  std_eps: float, min_std: float, reduce: Reduce | None) -> Tensor:
    if scale == "std":
        return _divide(adv, ragged_group_std(r, inv, counts, std), std_eps, min_std)
    if scale == "batch":
        return _divide(adv, batch_mean_std(r, std, reduce)[1], std_eps, min_std)
    if scale == "none":
        return adv
    if scale == "gpg":
        return gpg_scale(adv, r, reduce=reduce)
    raise ValueError(f"scale {scale!r} has no ragged-group version (std, batch, none, gpg)")


def group_advantages_ragged(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    baseline: str = "mean",
    scale: str = "std",
    std: str = "population",
    std_eps: float = 0.0,
    min_std: float = 0.0,
    reduce: Reduce | None = None,
) -> Tensor:
    """``group_advantages`` for groups of different sizes: rewards [B], group_ids [B] -> [B].

    The same options and numbers as the fixed-size path (when every group has one size the
    results agree to float rounding); dead groups (including groups of one answer) get 0.
    """
    if rewards.ndim != 1 or torch.as_tensor(group_ids).shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids "
                         f"{tuple(torch.as_tensor(group_ids).shape)} must both be [B]")
    centre = RAGGED_BASELINES.get(baseline)
    if centre is None:
        raise ValueError(f"baseline {baseline!r} has no ragged-group version")
    if scale != "none" and std not in STD_KINDS:
        raise ValueError(f"unknown std {std!r}")
    if bool((nan := torch.isnan(rewards)).any()):  # (answers no reward scored: 0, left out)
        return torch.zeros_like(rewards).masked_scatter(~nan, group_advantages_ragged(
            rewards[~nan], torch.as_tensor(group_ids)[~nan], baseline=baseline, scale=scale,
            std=std, std_eps=std_eps, min_std=min_std, reduce=reduce).to(rewards.dtype))
    inv, counts = _index(group_ids)
    r = rewards.to(torch.float64)
    adv = _ragged_scale(centre(r, inv, counts), r, inv, counts, scale, std, std_eps, min_std,
                        reduce)
    dead = dead_mask_ragged(rewards, group_ids)[inv]
    adv = torch.where(dead, torch.zeros_like(adv), adv)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def sum_then_normalize_ragged(per_fn: Tensor, weights: Tensor, group_ids: Tensor,
                              **adv_opts: Any) -> Tensor:
    """``sum_then_normalize`` on ragged groups: per_fn [B, K], weights [K] -> [B]."""
    return group_advantages_ragged(total_reward(per_fn, weights, torch.nan), group_ids,
                                   **adv_opts)


def normalize_then_sum_ragged(per_fn: Tensor, weights: Tensor, group_ids: Tensor, *,
                              std: str = "population", std_eps: float = 0.0,
                              min_std: float = 0.0, reduce: Reduce | None = None,
                              **adv_opts: Any) -> Tensor:
    """GDPO (``normalize_then_sum``) on ragged groups: per_fn [B, K], weights [K] -> [B]."""
    per_fn = per_fn.to(torch.float64)
    inv, _ = _index(group_ids)
    x = torch.zeros(per_fn.shape[0], dtype=torch.float64)
    dead = torch.ones(int(inv.max()) + 1 if inv.numel() else 0, dtype=torch.bool)
    for k in range(per_fn.shape[1]):
        x = x + float(weights[k]) * group_advantages_ragged(
            per_fn[:, k], group_ids, std=std, std_eps=std_eps, min_std=min_std, reduce=reduce,
            **adv_opts).to(torch.float64)
        dead = dead & dead_mask_ragged(per_fn[:, k], group_ids)
    out = unscored(per_fn)
    mean, sd = batch_mean_std(x[~out] if bool(out.any()) else x, std, reduce)
    adv = _divide(x - mean, sd, std_eps, min_std)
    return torch.where(dead[inv] | out, torch.zeros_like(adv), adv).to(torch.float32)


RAGGED_REWARD_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "sum_then_normalize": sum_then_normalize_ragged,
    "normalize_then_sum": normalize_then_sum_ragged,
}


def dead_stats_ragged(rewards: Tensor, group_ids: Tensor, success: Tensor | None = None,
                      success_threshold: float = 1.0) -> DeadStats:
    """``dead_stats`` for ragged groups: a dead group is all right when its first answer (in
    batch order) is right; its first scored one when some are not (NaN)."""
    inv, counts = _index(group_ids)
    dead = dead_mask_ragged(rewards, group_ids)
    ok = (rewards >= success_threshold if success is None else success.bool()).to(torch.float64)
    # the first (scored) answer of each group: the smallest position among its answers
    pos = torch.arange(rewards.numel(), dtype=torch.float64)
    at = _group_reduce(torch.where(rewards.isnan(), torch.inf, pos), inv, counts.numel(), "amin")
    first = torch.where(at.isinf(), _group_reduce(pos, inv, counts.numel(), "amin"), at).long()
    right = dead & ok[first].bool()
    return DeadStats(groups=int(dead.numel()), dead=int(dead.sum()), all_right=int(right.sum()),
                     all_wrong=int((dead & ~right).sum()))


def group_successes(success: Tensor, sizes: Tensor | list[int]) -> Tensor:
    """[N] right answers per group of group-contiguous ``success`` [B] (bool or 0/1)."""
    ids = group_ids_from_sizes(sizes)
    n = len(sizes) if isinstance(sizes, list) else int(torch.as_tensor(sizes).numel())
    return torch.zeros(n, dtype=torch.float64).index_add_(0, ids, success.to(torch.float64))


def group_dead_probability(pass_rates: Tensor, sizes: Tensor | list[int]) -> Tensor:
    """P(dead) of group k of sizes[k] answers at pass rate p_k: p^n + (1-p)^n, [K] float64."""
    p = pass_rates.to(torch.float64).clamp(0.0, 1.0)
    n = torch.as_tensor(sizes, dtype=torch.float64)
    return p**n + (1 - p) ** n


