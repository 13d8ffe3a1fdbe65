"""Spend a step's answer budget where it teaches: which prompts, and how many answers each.

Given each prompt's posterior over its pass rate (``posterior.PassRateTracker``), a budget of
answers per step and a group size range [min_size, max_size], ``allocate`` chooses prompts i
and group sizes n_i (sum n_i <= budget) to maximise an objective over the chosen prompts:

- ``live_groups`` (default): sum_i (1 - D_i(n_i)), the expected number of live (mixed) groups,
  where D_i(n) = E[p^n + (1-p)^n] is the chance a group of n answers to prompt i is dead. A
  prompt predicted near p = 1/2 gets min_size answers (it is live almost surely); a hard or
  easy one gets a larger group only when that buys more live-group chance per answer than
  opening another prompt would; a prompt predicted dead with high confidence gets nothing.
- ``live_answers``: sum_i n_i (1 - D_i(n_i)), the expected answers in live groups (the
  gradient's mass under std-scaled advantages). It favours few large groups.

Greedy on the marginal gain per answer: at each move either open a prompt at min_size answers
(gain (value at min_size) / min_size per answer) or add one answer to an open group (gain
value(n+1) - value(n)), whichever is larger, until the budget is spent or no move fits. Ties
(e.g. the many prompts not seen yet, which share the prior) are broken at random.

Exploration, so a prompt that became learnable is found again: a share ``explore`` of the
budget goes to groups of min_size answers on prompts drawn uniformly at random, whatever their
posterior; and since old evidence decays toward the prior (``PassRateTracker.decay``), a
prompt's "dead" verdict weakens with the steps since it was last seen.

Per kind (``allocate_by_kind``): each kind of prompt (e.g. a difficulty) keeps the share of the
budget uniform sampling would give it (its share of the prompts) and the allocation runs within
each kind. The objectives above value this step's live groups alike wherever they are, so on
their own they move answers from a skill the model lacks (rare successes) to one it has (many
live groups); the quota keeps the hard kinds' answers and spends them on their likeliest
prompts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpolab.predict.posterior import dead_probability

# (group sizes [S] float64, P(dead) [N, S]) -> value of a group of each size [N, S]
ALLOCATION_OBJECTIVES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "live_groups": lambda n, dead: 1.0 - dead,
    "live_answers": lambda n, dead: n * (1.0 - dead),
}


def size_axis(min_size: int, max_size: int) -> Tensor:
    """The group sizes [S] an allocation may use: min_size .. max_size, float64."""
    return torch.arange(min_size, max_size + 1, dtype=torch.float64)


def allocate(a: Tensor, b: Tensor, budget: int, min_size: int, max_size: int, *,
             objective: str = "live_groups", explore: float = 0.0,
             generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """Prompts and group sizes for one step: (indices [K], sizes [K]), sum(sizes) <= budget.

    ``a``, ``b`` [N]: each prompt's Beta posterior (``allocate_table`` takes any predictor's
    P(dead) table instead). Every size is in [min_size, max_size]; a prompt is chosen at most
    once. ``explore`` in [0, 1): share of the budget given first to random prompts at min_size
    (on average: whole groups, the fraction drawn).
    The result is exactly ``budget`` answers whenever the prompts and max_size allow it (the
    remainder of budget / min_size is added to open groups).
    """
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    dead = dead_probability(a[:, None], b[:, None], size_axis(min_size, max_size)[None, :])
    return allocate_table(dead, budget, min_size, max_size, objective=objective,
                          explore=explore, generator=generator)


def allocate_table(dead: Tensor, budget: int, min_size: int, max_size: int, *,
                   objective: str = "live_groups", explore: float = 0.0,
                   generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """``allocate`` from ``dead`` [N, S]: P(a group of size_axis(min_size, max_size)[s] answers
    to prompt i is dead)."""
    if not 2 <= min_size <= max_size:
        raise ValueError(f"need 2 <= min_size <= max_size (got {min_size}, {max_size})")
    value_fn = ALLOCATION_OBJECTIVES.get(objective)
    if value_fn is None:
        raise ValueError(f"unknown allocation objective {objective!r}")
    sizes_axis = size_axis(min_size, max_size)  # [S]
    if dead.dim() != 2 or dead.shape[1] != sizes_axis.numel():
        raise ValueError(f"dead must be [prompts, {sizes_axis.numel()}] (one column per size "
                         f"{min_size}..{max_size}), got {list(dead.shape)}")
    n_prompts = dead.shape[0]
    order = torch.randperm(n_prompts, generator=generator)  # random tie-breaking
    value = value_fn(sizes_axis[None, :], dead.to(torch.float64)[order])  # [N, S]
    size = torch.zeros(n_prompts, dtype=torch.long)  # 0 = not chosen
    left = budget
    # exploration: random prompts at min_size, whatever their posterior; explore x budget /
    # min_size groups, the fraction a coin of that weight (so explore is the share on average;
    # rounded down, 0.1 of a 16-answer kind at size 4 explored nothing)
    want = explore * budget / min_size
    n_explore = int(want)
    if want > n_explore and float(torch.rand((), generator=generator)) < want - n_explore:
        n_explore += 1
    n_explore = min(n_explore, n_prompts, budget // min_size)
    if n_explore:
        size[:n_explore] = min_size  # the order is already a random permutation
        left -= n_explore * min_size
    neg = torch.tensor(-float("inf"), dtype=torch.float64)
    while left > 0:
        closed = size == 0
        open_gain = torch.where(closed, value[:, 0] / min_size, neg) if left >= min_size else (
            torch.full_like(value[:, 0], -float("inf")))
        growable = (size > 0) & (size < max_size)
        col = (size - min_size).clamp(min=0, max=max(max_size - min_size - 1, 0))
        nxt = value.gather(1, (col + 1).clamp(max=value.shape[1] - 1)[:, None]).squeeze(1)
        cur = value.gather(1, col[:, None]).squeeze(1)
        grow_gain = torch.where(growable, nxt - cur, neg)
        best_open, i_open = open_gain.max(0)
        best_grow, i_grow = grow_gain.max(0)
        if not (torch.isfinite(best_open) or torch.isfinite(best_grow)):
            break  # every prompt chosen at max_size, or the remainder fits nowhere
        if torch.isfinite(best_open) and best_open >= best_grow:
            size[i_open] = min_size
            left -= min_size
        else:
            size[i_grow] += 1
            left -= 1
    chosen = torch.nonzero(size).flatten()
    return order[chosen].tolist(), size[chosen].tolist()


def kind_quotas(kinds: Tensor, budget: int, min_size: int) -> list[int]:
    """Answers [K] for each kind id 0..K-1 of ``kinds`` [N]: its share of the prompts times
    ``budget``, in whole groups of ``min_size`` (largest remainder); what is left under one
    group goes to the largest kind. Sums to ``budget``."""
    counts = torch.bincount(kinds).to(torch.float64)
    units = budget // min_size
    want = counts / counts.sum() * units
    quota = want.floor().long()
    for k in torch.argsort(want - quota, descending=True, stable=True)[:units - int(quota.sum())]:
        quota[k] += 1
    quota = quota * min_size
    quota[int(counts.argmax())] += budget - int(quota.sum())
    return quota.tolist()


def allocate_by_kind(dead: Tensor, kinds: Tensor, budget: int, min_size: int, max_size: int, *,
                     objective: str = "live_groups", explore: float = 0.0,
                     generator: torch.Generator | None = None,
                     free: Tensor | None = None) -> tuple[list[int], list[int]]:
    """``allocate_table`` within each kind: prompts of kind k (``kinds`` [N]) share
    ``kind_quotas(kinds, budget, min_size)[k]`` answers, chosen among the ``free`` [N] ones
    (default all). Returns (indices [K], sizes [K])."""
    idx: list[int] = []
    sizes: list[int] = []
    for k, quota in enumerate(kind_quotas(kinds, budget, min_size)):
        mine = torch.nonzero((kinds == k) & (True if free is None else free)).flatten()
        if quota < min_size or mine.numel() == 0:
            continue
        i, n = allocate_table(dead[mine], quota, min_size, max_size, objective=objective,
                              explore=explore, generator=generator)
        idx += mine[i].tolist()
        sizes += n
    return idx, sizes
