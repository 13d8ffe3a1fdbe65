"""One GRPO update, in the order the algorithm states it: the scoring pass, then the advantages,
then the optimisation loop.

* ``score`` takes a batch as collected and gives what the loss needs (``Scored``): the answers
  (DAPO's overlong ones masked out), the rewards (minus beta x KL with ``kl_in: reward``) and,
  per micro-batch, the reference's and the old policy's log-probs, all before the first
  optimizer step.
* ``advantages`` is each answer's advantage within its group (``grpolab.core.advantages``), or
  with a token-level ``estimator`` (REINFORCE++) each token's (``grpolab.core.returns``).
* ``optimize`` runs ``epochs`` passes over the batch, each ``minibatches`` optimiser steps
  (PPO's mini-batches: verl's ``ppo_mini_batch_size``), each over micro-batches with
  ``grpo_loss``; each micro-batch on each rank gets its exact share of its mini-batch's loss
  (the mini-batch's global reply and token counts), its gradients accumulate and are summed
  over ranks, so any split into micro-batches or ranks takes the same step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from grpolab.config import Config
from grpolab.core import advantages as adv_mod
from grpolab.core.losses import KL_ESTIMATORS, LossOut, grpo_loss, policy_knobs, sequence_kl
from grpolab.core.returns import ESTIMATORS, explained_variance, gae, token_rewards, value_loss
from grpolab.rollout.backend import Backend
from grpolab.rollout.batch import Rollout, cut_to_longest, micro_batches, minibatch_rows
from grpolab.rollout.critic import Critic
from grpolab.run import dist, shard
from grpolab.run.collect import Batch
from grpolab.run.optim import EntropyControl, lr_at


class TrainingError(RuntimeError):
    """A run cannot go on (for example a non-finite loss); checkpoints and metrics are intact."""


@dataclass
class Part:
    """One micro-batch of a scored batch: its rows, and the frozen log-probs the loss compares
    against ([rows, Tc]; None where the objective needs none)."""

    rows: Tensor  # [n] its rows of the batch
    rollout: Rollout
    ref_logprobs: Tensor | None
    old_logprobs: Tensor | None
    mini: int = 0  # the mini-batch (optimiser step of a pass) it belongs to


@dataclass
class Scored:
    """A batch as the loss sees it (this rank's rows; counts over every rank)."""

    rollout: Rollout  # the answers, overlong ones masked out with mask_truncated
    rewards: Tensor  # [B] the weighted reward, minus beta x KL with kl_in: reward
    kl_penalty: Tensor | None  # [B] what kl_in: reward took off
    rows: int  # answers trained on, over every rank
    tokens: int  # their tokens, over every rank
    parts: list[Part] = field(default_factory=list)
    token_penalty: Tensor | None = None  # [B, Tc] beta x per-token KL (token-level estimators)
    old_values: Tensor | None = None  # [B, Tc] ppo: the critic's values before the update
    returns: Tensor | None = None  # [B, Tc] ppo: what the critic learns (GAE + old values)
    mini_rows: list[int] = field(default_factory=list)  # each mini-batch's, over every rank
    mini_tokens: list[int] = field(default_factory=list)


@dataclass
class UpdateStats:
    """The numbers of one optimisation pass, summed over micro-batches (then over ranks)."""

    loss: float = 0.0
    policy_loss: float = 0.0
    kl: float = 0.0
    clip_frac: float = 0.0
    nonfinite: float = 0.0  # 1 where any micro-batch's loss was not finite
    entropy: float = 0.0
    entropy_share: float = 0.0
    masked_share: float = 0.0
    trained_entropy: float = 0.0  # summed over the tokens trained on, and their count
    trained_tokens: float = 0.0

    def add(self, res: LossOut, finite: bool) -> None:
        self.loss += float(res.loss.detach())
        self.policy_loss += res.policy_loss
        self.kl += res.kl
        self.clip_frac += res.clip_frac
        self.nonfinite = max(self.nonfinite, float(not finite))
        self.entropy += res.entropy or 0.0
        self.entropy_share += res.entropy_share
        self.masked_share += res.masked_share
        self.trained_entropy += res.trained_entropy
        self.trained_tokens += res.trained_tokens

    def summed_over_ranks(self) -> UpdateStats:
        return UpdateStats(*dist.all_reduce_sum(list(dataclasses.astuple(self))))

    @staticmethod
    def mean(stats: list[UpdateStats]) -> UpdateStats:
        """Mini-batches' stats averaged (each is its mini-batch's mean already)."""
        cols = zip(*(dataclasses.astuple(st) for st in stats), strict=True)
        return UpdateStats(*(_avg(list(c)) for c in cols)) if stats else UpdateStats()


def score(cfg: Config, backend: Backend, batch: Batch, critic: Critic | None = None,
          step: int = 0) -> Scored:
    """The scoring pass: every frozen number the loss needs, before the first optimizer step
    (so the old policy is the one that sampled; with ``critic``, PPO's old values), per
    micro-batch of each mini-batch. Collective under torchrun (the counts). ``step``: seeds the
    shuffled mini-batches' deal."""
    ro = batch.rollout
    if cfg.mask_truncated and ro.truncated is not None and bool(ro.truncated.any()):
        # DAPO's overlong filtering: a cut-off answer is no evidence either way. Its reward
        # still enters its group's statistics; its tokens leave the loss and its counts.
        ro = dataclasses.replace(ro, completion_mask=ro.completion_mask
                                 * (~ro.truncated)[:, None].to(ro.completion_mask.dtype))
    n_loc = len(batch.rows)
    t_loc = int(ro.completion_mask.sum()) if n_loc else 0
    rewards, kl_pen, tok_pen = batch.rewards, None, None
    if cfg.kl_in == "reward" and cfg.beta > 0 and n_loc:
        if cfg.estimator == "grpo":  # the answer's summed KL off its one reward
            rewards, kl_pen = kl_rewards(cfg, backend, ro, batch.rewards)
        else:  # each token's KL off that token's reward (REINFORCE++)
            tok_pen = cfg.beta * token_kl(cfg, backend, ro)
            kl_pen = (tok_pen * ro.completion_mask).sum(-1)
    minis = _minibatches(cfg, batch, step)
    counts = [v for rows in minis for v in (len(rows), int(ro.completion_mask[rows].sum()))]
    n_all, t_all, *per_mini = (int(v) for v in dist.all_reduce_sum([n_loc, t_loc, *counts]))
    scored = Scored(ro, rewards, kl_pen, n_all, t_all, token_penalty=tok_pen,
                    mini_rows=per_mini[0::2], mini_tokens=per_mini[1::2])
    if not n_loc:
        return scored
    off_policy = cfg.epochs > 1 or cfg.minibatches > 1  # steps after the first see a new policy
    with torch.no_grad():
        for k, rows in enumerate(minis):
            if not len(rows):
                continue
            mini = ro if cfg.minibatches == 1 else cut_to_longest(ro.select(rows.tolist()))
            lo = 0
            for part, _ in micro_batches(mini, torch.empty(len(rows)), cfg.micro_batch):
                at, lo = rows[lo:lo + len(part.prompts)], lo + len(part.prompts)
                ref_lp = (backend.logprobs(part, cfg.temperature, reference=True)
                          if cfg.beta > 0 and cfg.kl_in == "loss" else None)
                old_lp = backend.logprobs(part, cfg.temperature) if off_policy else None
                scored.parts.append(Part(at, part, ref_lp, old_lp, k))
        if critic is not None:
            scored.old_values = critic.values(backend, ro)
    return scored


def _minibatches(cfg: Config, batch: Batch, step: int) -> list[Tensor]:
    """This rank's rows of each mini-batch (``grpolab.rollout.batch.minibatch_rows``)."""
    n = len(batch.rows)
    if cfg.minibatches == 1:
        return [torch.arange(n)]
    sizes = batch.group_sizes or [cfg.group_size] * (n // cfg.group_size)
    gen = None
    if cfg.minibatch_order == "shuffled":  # its own stream: sampling's is left as it was
        gen = torch.Generator().manual_seed((cfg.seed + 1) * 1_000_003 + step)
    return minibatch_rows(sizes, cfg.minibatches, gen)


@torch.no_grad()
def token_kl(cfg: Config, backend: Backend, ro: Rollout) -> Tensor:
    """The per-token KL estimate of the policy to the reference, [B, Tc] (0 on padding)."""
    out = torch.zeros(ro.completion_ids.shape)
    lo = 0
    for part, _ in micro_batches(ro, torch.empty(len(ro.prompts)), cfg.micro_batch):
        lp = backend.logprobs(part, cfg.temperature)
        ref = backend.logprobs(part, cfg.temperature, reference=True)
        n, w = lp.shape
        out[lo:lo + n, :w] = KL_ESTIMATORS[cfg.kl_estimator](lp, ref) * part.completion_mask
        lo += n
    return out


@torch.no_grad()
def kl_rewards(cfg: Config, backend: Backend, ro: Rollout, rewards: Tensor
               ) -> tuple[Tensor, Tensor]:
    """kl_in: reward (verl's use_kl_in_reward): each answer's reward minus beta x its summed
    per-token KL estimate to the reference. Returns the new rewards and the penalties [B]."""
    pens = []
    for part, _ in micro_batches(ro, rewards, cfg.micro_batch):
        lp = backend.logprobs(part, cfg.temperature)
        ref = backend.logprobs(part, cfg.temperature, reference=True)
        pens.append(sequence_kl(lp, ref, part.completion_mask, cfg.kl_estimator))
    pen = cfg.beta * torch.cat(pens)
    return rewards.float() - pen.float(), pen


def advantages(cfg: Config, rewards: Tensor, per_fn: Tensor | None = None,
               reduce: Callable[[list[float]], list[float]] | None = None,
               sizes: list[int] | None = None) -> Tensor:
    """Each answer's advantage within its group, as the config's baseline and scaling say.

    ``rewards`` is the weighted total; with ``per_fn`` (each reward function's [B, K]) a
    reward_aggregation other than sum_then_normalize (GDPO) combines the functions itself.
    ``reduce`` sums over ranks, for batch-level statistics (scale: batch, GDPO).
    ``sizes``: the groups' sizes when they differ (``allocate``: ragged groups).
    """
    opts: dict[str, Any] = {"baseline": cfg.baseline, "scale": cfg.scale, "std": cfg.std,
                            "std_eps": cfg.std_eps, "min_std": cfg.min_std, "reduce": reduce}
    if per_fn is not None:  # (the answers no reward scored: NaN, left out of their groups)
        rewards = torch.where(adv_mod.unscored(per_fn), torch.nan, rewards.float())
    combine = per_fn is not None and cfg.reward_aggregation != "sum_then_normalize"
    weights = (torch.tensor(cfg.reward_weights or [1.0] * per_fn.shape[1]) if combine
               else None)
    if sizes is not None and any(n != cfg.group_size for n in sizes):
        ids = adv_mod.group_ids_from_sizes(sizes)
        if not combine:
            return adv_mod.group_advantages_ragged(rewards.float(), ids, **opts)
        return adv_mod.RAGGED_REWARD_AGGREGATIONS[cfg.reward_aggregation](
            per_fn, weights, ids, **opts)
    if not combine:
        return adv_mod.group_advantages(rewards.float(), cfg.group_size, **opts)
    return adv_mod.REWARD_AGGREGATIONS[cfg.reward_aggregation](
        per_fn, weights, cfg.group_size, **opts)


def batch_advantages(cfg: Config, batch: Batch, scored: Scored, step: int) -> Tensor | None:
    """The batch's advantages, [B] (one per answer: GRPO) or [B, Tc] (token-level estimators);
    None when this rank holds no answers; checked finite on every rank together. Batch-level
    statistics (scale: batch, GDPO, whitening) are over every rank."""
    n_loc = len(batch.rows)
    reduce = dist.all_reduce_sum if dist.is_dist() else None
    if cfg.estimator != "grpo":
        adv = token_advantages(cfg, batch, scored, reduce)
    else:
        adv = (advantages(cfg, scored.rewards, batch.rewards_per_fn, reduce, batch.group_sizes)
               if n_loc or reduce is not None else None)
    adv = adv if n_loc else None
    bad = float(adv is not None and not bool(torch.isfinite(adv).all()))
    if dist.all_reduce_sum([bad])[0]:  # (score() lets no non-finite reward in; checked again)
        raise TrainingError(f"non-finite advantages at step {step + 1}")
    return adv


def token_advantages(cfg: Config, batch: Batch, scored: Scored,
                     reduce: Callable[[list[float]], list[float]] | None) -> Tensor:
    """``cfg.estimator``'s token-level advantages (``grpolab.core.returns``) [B, Tc]."""
    mask = scored.rollout.completion_mask
    sizes = batch.group_sizes or [cfg.group_size] * (len(batch.rows) // cfg.group_size)
    rewards = token_rewards(scored.rewards, mask, scored.token_penalty)
    ids = adv_mod.group_ids_from_sizes(sizes)
    out = None if batch.rewards_per_fn is None else adv_mod.unscored(batch.rewards_per_fn)
    if out is not None and bool(out.any()):  # answers no reward scored: no token, group of one
        mask = mask * ~out[:, None]  # (advantage 0; the critic's target: its old values)
        ids = torch.where(out, len(ids) + torch.arange(len(ids)), ids)
    if cfg.estimator == "ppo":  # (the returns are what the critic then learns)
        adv, scored.returns = gae(rewards, scored.old_values, mask, cfg.gamma, cfg.lam, reduce)
        return adv * mask
    return ESTIMATORS[cfg.estimator](rewards, mask, ids, gamma=cfg.gamma, reduce=reduce)


def answer_advantages(adv: Tensor | None, mask: Tensor) -> Tensor | None:
    """One advantage per answer, for reading a run: token-level ones averaged over the answer's
    tokens."""
    if adv is None or adv.dim() == 1:
        return adv
    m = mask.to(adv.dtype)
    return (adv * m).sum(-1) / m.sum(-1).clamp(min=1)


def optimize(cfg: Config, backend: Backend, opt: torch.optim.Optimizer, params: list[Tensor],
             scored: Scored, adv: Tensor | None, step: int, sharded: bool = False,
             critic: Critic | None = None,
             control: EntropyControl | None = None) -> dict[str, float]:
    """``epochs`` optimisation passes over the scored batch, each an optimiser step per
    mini-batch (with ``critic``, each pass preceded by one of the value model; the policy's
    skipped in the first ``critic_warmup`` steps); the update's metrics, those of the last
    pass (means over its mini-batches). ``control``: the entropy bonus's coefficient
    (default: ``entropy_coef`` as it is), told each optimiser step's entropy."""
    control = control or EntropyControl(cfg)
    lr = lr_at(cfg, step)
    if not scored.rows:
        return {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clip_frac": 0.0,
                "grad_norm": 0.0, "lr": lr}
    extra: dict[str, float] = {}
    if cfg.kl_in == "reward" and cfg.beta > 0:  # mean penalty per trained answer
        pen = scored.kl_penalty
        pen_sum = dist.all_reduce_sum([float(pen.sum()) if pen is not None else 0.0])
        extra["kl_reward"] = pen_sum[0] / scored.rows
    if adv is not None and adv.dim() == 2:  # answers the estimator gives nothing to learn
        m = scored.rollout.completion_mask.bool()
        flat = (adv.abs() * m).amax(-1) <= 1e-6
        zero = dist.all_reduce_sum([float(flat.sum())])[0]
        extra["zero_advantage_answers"] = zero
        extra["trained_answers"] = float(scored.rows)
        extra["zero_advantage_share"] = zero / scored.rows
    if critic is not None:
        extra["explained_variance"] = explained_variance(scored.returns, scored.old_values,
                                                         scored.rollout.completion_mask)
    for group in opt.param_groups:  # (the config's, also after a resume that changed them)
        group.update(lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                     weight_decay=cfg.weight_decay if group["weight_decay"] else 0.0)
    with_entropy = hasattr(backend, "logprobs_and_entropy")
    train_policy = critic is None or step >= cfg.critic_warmup
    backend.model.train()
    out: dict[str, float] = {}
    per_step = cfg.epochs * cfg.minibatches  # (TRL's sync counts optimiser steps)
    for epoch in range(cfg.epochs):
        if critic is not None:
            extra.update(critic_pass(cfg, backend, critic, scored))
        if not train_policy:
            out = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clip_frac": 0.0,
                   "grad_norm": 0.0, "lr": lr, **extra}
            continue
        done: list[tuple[UpdateStats, float]] = []
        for k in range(cfg.minibatches):
            if not scored.mini_rows[k]:  # (fewer groups than mini-batches: no step)
                continue
            i = epoch * cfg.minibatches + k
            if i:
                lr = lr_at(cfg, step, i)
                for group in opt.param_groups:
                    group["lr"] = lr
            stats, gn = _opt_step(cfg, backend, opt, params, scored, adv, step, sharded, control, k,
                                  with_entropy)
            done.append((stats, gn))
            if cfg.sync_ref_model and (step * per_step + i + 1) % cfg.ref_model_sync_steps == 0:
                sync_reference(backend, cfg.ref_model_mixup_alpha)
        mean = UpdateStats.mean([st for st, _ in done])
        out = {"loss": mean.loss, "policy_loss": mean.policy_loss, "kl": mean.kl,
               "clip_frac": mean.clip_frac, "grad_norm": _avg([gn for _, gn in done]), "lr": lr,
               **extra}
        if cfg.use_adaptive_entropy or cfg.entropy_coef:  # for the next step (TRL's log)
            out["entropy_coef"] = control.coef
        if with_entropy:  # mean over the completion tokens, of the policy being trained
            out["entropy"] = mean.entropy
        if cfg.top_entropy_quantile < 1.0:  # share of tokens the policy loss trained on
            out["entropy_token_share"] = mean.entropy_share
        if cfg.off_policy_mask > 0:  # share of tokens whose policy loss the mask dropped
            out["off_policy_masked"] = mean.masked_share
    backend.model.eval()
    return out


def _opt_step(cfg: Config, backend: Backend, opt: torch.optim.Optimizer, params: list[Tensor],
              scored: Scored, adv: Tensor, step: int, sharded: bool, control: EntropyControl,
              k: int, with_entropy: bool) -> tuple[UpdateStats, float]:
    """One optimiser step on mini-batch ``k``: its micro-batches' losses and gradients, summed
    over ranks, clipped; its stats (summed over ranks) and gradient norm."""
    parts = [p for p in scored.parts if p.mini == k]
    opt.zero_grad(set_to_none=True)
    stats = UpdateStats()
    if sharded and dist.all_reduce_sum([float(not parts)])[0]:
        raise TrainingError(f"a rank has no answers in mini-batch {k + 1} of step {step + 1}; "
                            "fsdp needs every rank in every backward")
    counts = (scored.mini_rows[k], scored.mini_tokens[k],  # (and a token mean's divisor: TRL's
              sum(scored.mini_tokens) / cfg.minibatches if cfg.token_mean_by == "batch" else None)
    for j, part in enumerate(parts):
        if sharded:  # FSDP reduces once, in the last micro-batch's backward
            shard.set_sync(backend.model, j == len(parts) - 1)
        a = adv[part.rows]
        if a.dim() == 2:  # token-level: the micro-batch is cut to its longest answer
            a = a[:, : part.rollout.completion_ids.shape[1]]
        res = _part_loss(cfg, backend, part, a, counts, with_entropy, control.applied())
        finite = bool(torch.isfinite(res.loss))
        if finite or sharded:  # (fsdp: every rank takes part in the reduction)
            res.loss.backward()
        stats.add(res, finite)
    stats = stats.summed_over_ranks()  # all ranks raise together, none hangs
    if stats.nonfinite:
        raise TrainingError(f"non-finite loss ({stats.loss}) at step {step + 1}")
    if not sharded:
        dist.sum_grads(params)
    gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
    if not math.isfinite(gn):
        raise TrainingError(f"non-finite gradient norm ({gn}) at step {step + 1}; the "
                            "update was skipped")
    opt.step()
    control.observe(stats.trained_entropy / max(stats.trained_tokens, 1.0))
    return stats, gn


def _avg(values: list[float]) -> float:
    return values[0] if len(values) == 1 else sum(values) / max(len(values), 1)


@torch.no_grad()
def sync_reference(backend: Backend, alpha: float) -> None:
    """TR-DPO's reference update (TRL's ``sync_ref_model``): every reference parameter becomes
    alpha x the policy's + (1 - alpha) x its own, in place."""
    for ref, p in zip(backend.ref.parameters(), backend.model.parameters(), strict=True):
        ref.mul_(1.0 - alpha).add_(p.detach().to(ref.dtype), alpha=alpha)


def critic_pass(cfg: Config, backend: Backend, critic: Critic, scored: Scored
                ) -> dict[str, float]:
    """One pass of the value model over the scored batch: an Adam step per mini-batch (as
    verl's critic, whose mini-batches are the actor's); the metrics' means over them."""
    done = [_critic_step(cfg, backend, critic, scored, k) for k in range(cfg.minibatches)
            if scored.mini_rows[k]]
    return {key: _avg([d[key] for d in done]) for key in done[0]} if done else {}


def _critic_step(cfg: Config, backend: Backend, critic: Critic, scored: Scored, k: int
                 ) -> dict[str, float]:
    """The clipped value loss against the returns over mini-batch ``k``'s micro-batches,
    aggregated over the mini-batch (every rank) as ``value_agg`` says, one Adam step."""
    critic.opt.zero_grad(set_to_none=True)
    total, clip_hits, tokens = 0.0, 0.0, scored.mini_tokens[k]
    for part in (p for p in scored.parts if p.mini == k):
        w = part.rollout.completion_ids.shape[1]
        v = critic.values(backend, part.rollout)
        loss, hit = value_loss(v, scored.old_values[part.rows, :w], scored.returns[part.rows, :w],
                               part.rollout.completion_mask, cfg.value_clip,
                               (scored.mini_rows[k], tokens), cfg.value_agg,
                               cfg.loss_norm_len or cfg.max_new_tokens)
        loss.backward()
        total += float(loss.detach())
        clip_hits += hit * float(part.rollout.completion_mask.sum())
    total, clip_hits = dist.all_reduce_sum([total, clip_hits])
    dist.sum_grads(critic.params)
    gn = float(torch.nn.utils.clip_grad_norm_(critic.params, cfg.grad_clip))
    if not math.isfinite(total) or not math.isfinite(gn):
        raise TrainingError(f"non-finite value loss ({total}) or its gradient norm ({gn})")
    critic.opt.step()
    return {"value_loss": total, "value_clip_frac": clip_hits / max(tokens, 1),
            "critic_grad_norm": gn}


def _part_loss(cfg: Config, backend: Backend, part: Part, adv: Tensor, counts: tuple,
               with_entropy: bool, entropy_coef: float) -> LossOut:
    """This micro-batch's share of its mini-batch's global GRPO loss (``counts``: the
    mini-batch's answers and tokens over every rank, and a token mean's divisor), with
    autograd."""
    ro = part.rollout
    if with_entropy:  # the same log-probs, plus each position's entropy
        lp, ent = backend.logprobs_and_entropy(ro, cfg.temperature,
                                               entropy_grad=bool(entropy_coef))
    else:
        lp, ent = backend.logprobs(ro, cfg.temperature), None
    old = lp.detach() if part.old_logprobs is None else part.old_logprobs
    return grpo_loss(
        lp, old, part.ref_logprobs, adv, ro.completion_mask, beta=cfg.beta, agg=cfg.loss_agg,
        norm_len=cfg.loss_norm_len or cfg.max_new_tokens, policy_loss=cfg.policy_loss,
        **{k: getattr(cfg, k) for k in policy_knobs(cfg.policy_loss)},
        kl_estimator=cfg.kl_estimator, kl_is_correction=cfg.kl_is_correction, entropy=ent,
        entropy_coef=entropy_coef, top_entropy_quantile=cfg.top_entropy_quantile,
        entropy_agg=cfg.entropy_agg, policy_agg=cfg.policy_agg,
        off_policy_mask=cfg.off_policy_mask, global_rows=counts[0], global_tokens=counts[1],
        loss_tokens=counts[2])
