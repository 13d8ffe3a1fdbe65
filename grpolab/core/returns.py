"""Token-level advantage estimators: an answer's tokens get advantages of their own, from the
rewards placed on its tokens (the outcome reward on its last token, a per-token KL penalty on
every token when the KL is in the reward).

``ESTIMATORS`` maps the config's ``estimator`` to a function
``(token_rewards [B, T], mask [B, T], group_ids [B], gamma, reduce) -> advantages [B, T]``:

* ``reinforce_pp`` (REINFORCE++, Hu et al. 2025): discounted returns, whitened over every
  answer token of the batch;
* ``reinforce_pp_baseline``: each answer's summed reward minus its group's mean (a group of one
  keeps its reward), broadcast to its tokens, whitened over the batch's tokens.

``ppo`` needs the critic's values as well: ``gae`` gives its advantages and returns, and
``value_loss`` trains the critic. ``grpo`` (the default) is not here: it is
``grpolab.core.advantages``, one value per answer.
Whitening is verl's ``masked_whiten``: the mean and the unbiased variance over the mask, then
(x - mean) / sqrt(var + 1e-8). ``reduce`` sums over ranks, so the statistics are the global
batch's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpolab.core.losses import aggregate

Reduce = Callable[[list[float]], list[float]]
WHITEN_EPS = 1e-8


def token_rewards(rewards: Tensor, mask: Tensor, token_penalty: Tensor | None = None) -> Tensor:
    """[B, T]: each answer's reward [B] on its last real token, minus ``token_penalty`` [B, T]
    (beta x per-token KL) on every real token."""
    m = mask.to(torch.float32)
    last = (m.cumsum(1) == m.sum(1, keepdim=True)) & (m > 0)  # the last real token of a row
    out = torch.where(last, rewards.float()[:, None], 0.0)
    if token_penalty is not None:
        out = out - token_penalty.float() * m
    return out * m


def masked_whiten(x: Tensor, mask: Tensor, reduce: Reduce | None = None) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries (unbiased variance); with
    ``reduce``, the mean and variance of every rank's entries together."""
    m = mask.to(x.dtype)
    n, s = m.sum(), (x * m).sum()
    if reduce is not None:
        n, s = (torch.tensor(v, dtype=x.dtype) for v in reduce([float(n), float(s)]))
    mean = s / n
    ss = ((x - mean) ** 2 * m).sum()
    if reduce is not None:
        ss = torch.tensor(reduce([float(ss)])[0], dtype=x.dtype)
    var = ss / (n - 1) if n > 1 else ss * 0
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS)


def reinforce_pp(token_rewards: Tensor, mask: Tensor, group_ids: Tensor | None = None,
                 gamma: float = 1.0, reduce: Reduce | None = None) -> Tensor:
    """REINFORCE++: return_t = r_t + gamma * return_{t+1} over an answer's real tokens, whitened
    over the batch's tokens; 0 on padding. [B, T] -> [B, T]."""
    m = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        new = token_rewards[:, t] + gamma * running
        returns[:, t] = new * m[:, t]
        running = new * m[:, t] + running * (1 - m[:, t])  # padding carries the return through
    return masked_whiten(returns, m, reduce) * m


def reinforce_pp_baseline(token_rewards: Tensor, mask: Tensor, group_ids: Tensor,
                          gamma: float = 1.0, reduce: Reduce | None = None) -> Tensor:
    """REINFORCE++-baseline: each answer's summed reward minus its group's mean (a group of one:
    minus 0), on every token, whitened over the batch's tokens; 0 on padding."""
    m = mask.to(token_rewards.dtype)
    score = token_rewards.sum(-1)
    k = int(group_ids.max()) + 1 if group_ids.numel() else 0
    sums = torch.zeros(k, dtype=score.dtype).index_add_(0, group_ids, score)
    counts = torch.zeros(k, dtype=score.dtype).index_add_(0, group_ids, torch.ones_like(score))
    mean = torch.where(counts > 1, sums / counts.clamp(min=1), 0.0)
    centred = (score - mean[group_ids])[:, None] * m
    return masked_whiten(centred, m, reduce) * m


ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


# ----------------------------------------------------------------------------- PPO


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
        lam: float = 1.0, reduce: Reduce | None = None) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each answer's real tokens: [B, T] rewards and the
    critic's values -> (advantages whitened over the batch's tokens, returns = advantages before
    whitening + values). Padding carries the next real token's value and estimate through."""
    m = mask.to(token_rewards.dtype)
    next_value = torch.zeros_like(token_rewards[:, 0])
    last = torch.zeros_like(token_rewards[:, 0])
    adv = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        new = delta + gamma * lam * last
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last = new * m[:, t] + (1 - m[:, t]) * last
        adv[:, t] = last
    returns = adv + values
    return masked_whiten(adv, m, reduce), returns


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float, counts: tuple[int, int], agg: str = "token_mean",
               norm_len: int | None = None) -> tuple[Tensor, float]:
    """PPO's clipped value loss, 0.5 x max((v - R)^2, (clip(v, v_old +- clip) - R)^2) per token,
    aggregated as ``agg`` (``value_agg``: verl's critic.loss_agg_mode), as this part's share
    of the global batch's (``counts``: its answers and tokens over micro-batches and ranks, so
    the parts add up to the whole); and the share of tokens the clipped term decided."""
    m = mask.to(values.dtype)
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    worst = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    hit = ((clipped - returns) ** 2 > (values - returns) ** 2).to(values.dtype)
    n = m.sum().clamp(min=1)
    if agg == "token_mean":  # this part's tokens over the global batch's
        loss = 0.5 * (worst * m).sum() / max(counts[1], 1)  # (no tokens: every answer masked)
    else:  # a mean over answers: this part's over the global batch's
        loss = aggregate(0.5 * worst, mask, agg, norm_len) * mask.shape[0] / counts[0]
    return loss, float((hit * m).sum() / n)


def explained_variance(returns: Tensor, values: Tensor, mask: Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the real tokens: how much of the returns'
    spread the critic accounts for (1 perfect, 0 no better than their mean, below 0 worse)."""
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    var = r.var(unbiased=False) if r.numel() > 1 else r.new_zeros(())
    return float("nan") if var == 0 else float(1 - (r - v).var(unbiased=False) / var)
