"""The GRPO loop: draw prompts, sample groups, score, compute advantages, update, measure.

The trainer is backend-agnostic (see ``sampling.Backend``): the built-in world and Hugging Face
models run the same code, so every switch measured in the workshop means the same for a real
model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import advantages as adv_mod
from . import checkpoint, dist
from .checkpoint import CheckpointError
from .config import Config, ConfigError, to_dict
from .curriculum import PromptSampler
from .losses import KL_ESTIMATORS, TOKEN_WEIGHTED_AGGS, grpo_loss
from .report import MetricsWriter, read_metrics
from .reward_pool import RewardPool, pool_for
from .rewards import ScoreResult, reward_name, row_columns, score
from .sampling import Backend, Rollout, cat_rollouts
from .watch import hacking_suspected, reward_rise

log = logging.getLogger("grpolab")

# Each rank samples answers from its own stream (rank 0 keeps the single-process seed).
RANK_SEED_STRIDE = 1_000_003
# Config keys that may change between a run and its resumption without changing the maths
# (micro_batch splits the same step differently: resuming an out-of-memory run with smaller
# micro-batches is what it is for; float rounding then differs in the last bits).
RESUME_FREE_KEYS = {"steps", "out_dir", "progress", "cache_dir", "checkpoint_every", "eval_every",
                    "micro_batch", "log_samples", "overwrite", "reward_timeout", "reward_workers",
                    "fail_on_reward_errors"}
# What a cluster scheduler sends before it preempts a job (SIGUSR1 where asked to, e.g. Slurm's
# --signal): finish the step, checkpoint, exit. SIGINT (Ctrl-C) stays an immediate stop.
STOP_SIGNALS = tuple(getattr(signal, s) for s in ("SIGTERM", "SIGUSR1") if hasattr(signal, s))
# Config keys that change the trained weights' shapes: a checkpoint of another value cannot load.
SHAPE_KEYS = ("lora", "lora_r", "lora_target_modules", "model_path")


def lr_factor(step: int, steps: int, schedule: str, warmup: int) -> float:
    """Multiplier of the base lr for GRPO step ``step`` (0-based) of ``steps``.

    Warm-up ramps linearly over the first ``warmup`` steps ((step + 1) / warmup); then
    ``constant`` stays at 1, ``linear`` falls to 0 and ``cosine`` follows half a cosine to 0 at
    ``steps`` (as transformers' schedulers do). A function of the step alone, so a resumed run
    continues the schedule exactly.
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class TrainingError(RuntimeError):
    """A run cannot go on (for example a non-finite loss); checkpoints and metrics are intact."""


class RunStopped(BaseException):
    """SIGTERM/SIGUSR1 stopped the run; ``exit_code`` is 128 + the signal, as a shell reports.

    A BaseException so that no handler meant for reward or model errors swallows it.
    """

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + int(signum)


@dataclass
class Batch:
    """The groups one optimisation step trains on, plus what sampling them cost."""

    rollout: Rollout
    rows: list[dict]
    rewards: torch.Tensor
    answers_generated: int = 0
    rounds: int = 1
    cap_hit: bool = False
    sampled_rewards: list[torch.Tensor] = field(default_factory=list)
    sampled_success: list[torch.Tensor] = field(default_factory=list)  # bool, as sampled_rewards
    sampled_rows: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    trained_groups: int = 0
    reward_sums: dict[str, float] = field(default_factory=dict)  # per function, sampled answers
    rewards_per_fn: torch.Tensor | None = None  # [B, K] each reward function's, as rewards
    advantages: torch.Tensor | None = None  # [B] what update() trained with (this rank's rows)

    # Under torchrun, rollout/rows/rewards/sampled_rows/problems/reward_sums are this rank's;
    # sampled_rewards and sampled_success (every rank's, in prompt order), answers_generated
    # and trained_groups are global.

    def add_scores(self, res: ScoreResult) -> None:
        for j, name in enumerate(res.names):
            self.reward_sums[name] = self.reward_sums.get(name, 0.0) + float(res.per_fn[:, j].sum())


class GRPOTrainer:
    """Owns the optimiser, the RNGs and the metrics file of one run."""

    def __init__(
        self,
        cfg: Config,
        backend: Backend,
        train_rows: list[dict],
        reward_fns: list[Callable],
        heldout_rows: list[dict] | None = None,
        out_dir: str | os.PathLike | None = None,
        watch_fn: Callable | None = None,
    ) -> None:
        if not train_rows:
            raise ValueError("no training prompts")
        self.cfg = cfg
        self.backend = backend
        self.train_rows = train_rows
        self.heldout_rows = heldout_rows or []
        self.reward_fns = reward_fns
        self.watch_fn = watch_fn  # strict held-out check of the reward-hacking watch
        self.check_acc: list[float] = []  # its held-out accuracy at each evaluation
        self.reward_history: list[float] = []  # training reward per step (for the watch)
        self._watch_fired = False
        self.out_dir = Path(out_dir or cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        world = dist.world_size()
        if cfg.prompts_per_step % world:
            raise ConfigError(
                f"prompts_per_step {cfg.prompts_per_step} (budget {cfg.budget} / group_size "
                f"{cfg.group_size}) cannot be split into whole groups across {world} ranks"
            )
        torch.manual_seed(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed + RANK_SEED_STRIDE * dist.rank())
        self.sampler = PromptSampler(
            len(train_rows),
            torch.Generator().manual_seed(cfg.seed + 1),
            curriculum=cfg.curriculum,
            floor=cfg.curriculum_floor,
            decay=cfg.curriculum_decay,
        )
        dist.broadcast_module(backend.model)  # every rank starts from rank 0's weights
        self.params = [p for p in backend.model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(self.params, lr=cfg.lr)
        self.step_num = 0
        self.metrics: MetricsWriter | None = None
        self.samples: MetricsWriter | None = None  # samples.jsonl (cfg.log_samples groups a step)
        self.ckpt_dir = self.out_dir / "checkpoints"

    # ------------------------------------------------------------ sampling --
    def _sample_groups(self, idx: list[int]) -> tuple[Rollout, list[dict], ScoreResult]:
        g = self.cfg.group_size
        rows = [self.train_rows[i] for i in idx for _ in range(g)]
        ro = self.backend.generate(
            [r["prompt"] for r in rows], self.cfg.temperature, self.cfg.max_new_tokens, self.gen
        )
        return ro, rows, self._score(ro, rows)

    def _score(self, ro: Rollout, rows: list[dict]) -> ScoreResult:
        """The configured rewards (weights, on_error, timeout) for the answers in ``ro``."""
        return score(self.reward_fns, ro.prompts, ro.completions, row_columns(rows),
                     weights=self.cfg.reward_weights or None, on_error=self.cfg.reward_on_error,
                     pool=self._reward_pool(), fail_on_all_errors=self.cfg.fail_on_reward_errors,
                     group_size=self.cfg.group_size)

    _pool: RewardPool | None = None
    _pool_checked = False

    def _reward_pool(self) -> RewardPool | None:
        """Worker processes for the rewards that are not grpolab's own (forked on first use,
        so they hold the functions); None when reward_timeout is 0 or none needs one."""
        if self._pool is None and not self._pool_checked:
            self._pool = pool_for(self.reward_fns, self.cfg.reward_timeout,
                                  self.cfg.reward_workers)
            self._pool_checked = True
        return self._pool

    def close(self) -> None:
        """Stop the reward workers (train() does this when it returns or fails)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._pool_checked = False

    def _sample_round(
        self, n: int
    ) -> tuple[Rollout, list[dict], ScoreResult, torch.Tensor, torch.Tensor, int]:
        """Every rank draws the same n prompts and samples its contiguous shard of whole groups.

        Returns this rank's rollout, rows and scores, every rank's rewards and successes in
        prompt order (for statistics and group selection), and where this rank's groups start.
        """
        idx = self.sampler.draw(n)
        lo, hi = dist.shard(len(idx))
        ro, rows, res = self._sample_groups(idx[lo:hi])
        everyone = dist.gather_cat(res.total)
        ok = dist.gather_cat(res.success(self.cfg.success_threshold).float()).bool()
        self._update_stats(idx, ok)  # identical on every rank: samplers stay in step
        return ro, rows, res, everyone, ok, lo

    def collect(self) -> Batch:
        """Sample this step's groups; with dynamic sampling, refill until every group is mixed."""
        cfg, g = self.cfg, self.cfg.group_size
        n = cfg.prompts_per_step
        ro, rows, res, everyone, ok, lo = self._sample_round(n)
        rewards = res.total
        batch = Batch(ro, rows, rewards, answers_generated=everyone.numel(),
                      sampled_rewards=[everyone], sampled_success=[ok], sampled_rows=list(rows),
                      problems=list(res.problems), trained_groups=everyone.numel() // g,
                      rewards_per_fn=res.per_fn)
        batch.add_scores(res)
        if not cfg.dynamic_sampling:
            return batch
        keep_ro: list[Rollout] = []
        keep_rows: list[dict] = []
        keep_r: list[torch.Tensor] = []
        keep_pf: list[torch.Tensor] = []
        kept = 0
        while True:
            # The choice is made on every rank's rewards, so all ranks agree on it.
            live = ~adv_mod.dead_mask(everyone, g)
            mine = range(lo, lo + len(rows) // g)
            for j in torch.nonzero(live).flatten().tolist():
                if kept == n:
                    break
                kept += 1
                if j not in mine:
                    continue
                sl = list(range((j - lo) * g, (j - lo + 1) * g))
                keep_ro.append(ro.select(sl))
                keep_rows += [rows[i] for i in sl]
                keep_r.append(rewards[sl[0] : sl[-1] + 1])
                keep_pf.append(res.per_fn[sl[0] : sl[-1] + 1])
            if kept == n or batch.rounds > cfg.max_sampling_rounds:
                break
            ro, rows, res, everyone, ok, lo = self._sample_round(n)
            rewards = res.total
            batch.rounds += 1
            batch.answers_generated += everyone.numel()
            batch.sampled_rewards.append(everyone)
            batch.sampled_success.append(ok)
            batch.sampled_rows += rows
            batch.problems += res.problems
            batch.add_scores(res)
        batch.trained_groups = kept
        batch.cap_hit = kept < n
        if batch.cap_hit and dist.is_main():
            log.warning(
                "dynamic sampling: cap of %d extra rounds hit at step %d; training on %d of %d "
                "mixed groups", cfg.max_sampling_rounds, self.step_num + 1, kept, n,
            )
        if keep_ro:
            batch.rollout = cat_rollouts(keep_ro, self.backend.pad_id)
            batch.rows = keep_rows
            batch.rewards = torch.cat(keep_r)
            batch.rewards_per_fn = torch.cat(keep_pf)
        else:
            batch.rollout, batch.rows, batch.rewards = ro.select([]), [], rewards[:0]
            batch.rewards_per_fn = res.per_fn[:0]
        return batch

    def _update_stats(self, idx: list[int], ok: torch.Tensor) -> None:
        rate = ok.float().reshape(-1, self.cfg.group_size).mean(1)
        self.sampler.update(idx, rate.tolist())

    # -------------------------------------------------------------- update --
    def _advantages(self, rewards: Tensor, per_fn: Tensor | None = None,
                    reduce: Callable[[list[float]], list[float]] | None = None) -> Tensor:
        """Each answer's advantage within its group, as the config's baseline and scaling say.

        ``rewards`` is the weighted total; with ``per_fn`` (each reward function's [B, K]) a
        reward_aggregation other than sum_then_normalize (GDPO) combines the functions itself.
        ``reduce`` sums over ranks, for batch-level statistics (scale: batch, GDPO).
        """
        cfg = self.cfg
        opts: dict[str, Any] = {"baseline": cfg.baseline, "scale": cfg.scale, "std": cfg.std,
                                "std_eps": cfg.std_eps, "min_std": cfg.min_std, "reduce": reduce}
        if per_fn is None or cfg.reward_aggregation == "sum_then_normalize":
            return adv_mod.group_advantages(rewards.float(), cfg.group_size, **opts)
        weights = torch.tensor(cfg.reward_weights or [1.0] * per_fn.shape[1])
        return adv_mod.REWARD_AGGREGATIONS[cfg.reward_aggregation](
            per_fn, weights, cfg.group_size, **opts)

    @torch.no_grad()
    def _reward_with_kl(self, ro: Rollout, rewards: Tensor) -> tuple[Tensor, Tensor]:
        """kl_in: reward (verl's use_kl_in_reward): each answer's reward minus beta x its
        per-token KL estimate (kl_estimator) to the reference, summed over its tokens, under the
        policy that sampled it. Returns the new rewards and the penalties [B]."""
        cfg = self.cfg
        kl_fn = KL_ESTIMATORS[cfg.kl_estimator]
        pens = []
        for part, _ in self._micro_batches(ro, rewards):
            lp = self.backend.logprobs(part, cfg.temperature)
            ref = self.backend.logprobs(part, cfg.temperature, reference=True)
            pens.append((kl_fn(lp, ref) * part.completion_mask.to(lp.dtype)).sum(-1))
        pen = cfg.beta * torch.cat(pens)
        return rewards.float() - pen.float(), pen

    def _micro_batches(self, ro: Rollout, adv: Tensor) -> list[tuple[Rollout, Tensor]]:
        """The local batch in runs of ``micro_batch`` rows (all at once when 0), each cut to
        its longest answer: the update's memory is bounded by one of them."""
        n, mb = len(ro.prompts), self.cfg.micro_batch
        if not mb or mb >= n:
            return [(ro, adv)]
        out = []
        for lo in range(0, n, mb):
            part = ro.select(list(range(lo, min(lo + mb, n))))
            width = max(int(part.completion_mask.sum(1).max()), 1)
            part.completion_ids = part.completion_ids[:, :width]
            part.completion_mask = part.completion_mask[:, :width]
            out.append((part, adv[lo : lo + mb]))
        return out

    def update(self, batch: Batch) -> dict[str, float]:
        """mu optimisation passes over one batch with the clipped GRPO objective.

        The loss of each micro-batch (``micro_batch`` rows) and, under torchrun, of each rank is
        its share of the global loss (replies or tokens over the global count, per
        ``loss_agg``); gradients accumulate over micro-batches and are summed over ranks, so
        any split takes the step one pass over the whole batch in one process takes.
        """
        cfg = self.cfg
        ro = batch.rollout
        if cfg.mask_truncated and ro.truncated is not None and bool(ro.truncated.any()):
            # DAPO's overlong filtering: a cut-off answer is no evidence either way. Its reward
            # still enters its group's statistics; its tokens leave the loss and its counts.
            ro = dataclasses.replace(ro, completion_mask=ro.completion_mask
                                     * (~ro.truncated)[:, None].to(ro.completion_mask.dtype))
        n_loc = len(batch.rows)
        t_loc = int(ro.completion_mask.sum()) if n_loc else 0
        rewards, kl_pen = batch.rewards, None
        if cfg.kl_in == "reward" and cfg.beta > 0 and n_loc:
            rewards, kl_pen = self._reward_with_kl(ro, batch.rewards)
        # score() lets no non-finite or huge reward in; checked again, on every rank together.
        # Batch-level statistics (scale: batch, GDPO) are over every rank: all ranks take part.
        reduce = dist.all_reduce_sum if dist.is_dist() else None
        adv = (self._advantages(rewards, batch.rewards_per_fn, reduce)
               if n_loc or reduce is not None else None)
        adv = adv if n_loc else None
        batch.advantages = adv  # samples.jsonl logs these, not a recomputation
        bad = float(adv is not None and not bool(torch.isfinite(adv).all()))
        n_all, t_all, bad = (int(v) for v in dist.all_reduce_sum([n_loc, t_loc, bad]))
        if bad:
            raise TrainingError(f"non-finite advantages at step {self.step_num + 1}; last "
                                f"checkpoint and metrics in {self.out_dir} are intact")
        lr = cfg.lr * lr_factor(self.step_num, cfg.steps, cfg.lr_schedule, cfg.warmup_steps)
        if not n_all:
            return {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clip_frac": 0.0,
                    "grad_norm": 0.0, "lr": lr}
        extra: dict[str, float] = {}
        if cfg.kl_in == "reward" and cfg.beta > 0:  # mean penalty per trained answer
            pen_sum = dist.all_reduce_sum([float(kl_pen.sum()) if kl_pen is not None else 0.0])
            extra["kl_reward"] = pen_sum[0] / n_all
        # (micro-batch, advantages, reference log-probs, old-policy log-probs)
        parts: list[tuple[Rollout, Tensor, Tensor | None, Tensor | None]] = []
        if adv is not None:
            with torch.no_grad():  # all before the first optimizer step: the old policy
                for part, a in self._micro_batches(ro, adv):
                    ref_lp = (self.backend.logprobs(part, cfg.temperature, reference=True)
                              if cfg.beta > 0 and cfg.kl_in == "loss" else None)
                    old_lp = self.backend.logprobs(part, cfg.temperature) if cfg.epochs > 1 else None
                    parts.append((part, a, ref_lp, old_lp))
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.backend.model.train()
        out: dict[str, float] = {}
        for _ in range(cfg.epochs):
            self.opt.zero_grad(set_to_none=True)
            # loss, policy loss, kl, clip frac, non-finite, entropy, share of tokens trained
            stats = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
            with_entropy = hasattr(self.backend, "logprobs_and_entropy")
            for part, a, ref_lp, old_lp in parts:
                mask = part.completion_mask
                # This part of the global count (exactly 1.0 for one part in one process).
                tok_share = int(mask.sum()) / t_all if t_all else 1.0
                share = (tok_share if cfg.loss_agg in TOKEN_WEIGHTED_AGGS
                         else len(part.prompts) / n_all)
                if with_entropy:  # the same log-probs, plus each position's entropy
                    lp, ent = self.backend.logprobs_and_entropy(
                        part, cfg.temperature, entropy_grad=bool(cfg.entropy_coef))
                else:
                    lp, ent = self.backend.logprobs(part, cfg.temperature), None
                res = grpo_loss(
                    lp, lp.detach() if old_lp is None else old_lp, ref_lp, a, mask,
                    beta=cfg.beta, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                    agg=cfg.loss_agg, norm_len=cfg.max_new_tokens,
                    policy_loss=cfg.policy_loss, kl_estimator=cfg.kl_estimator,
                    kl_is_correction=cfg.kl_is_correction, dual_clip=cfg.dual_clip,
                    cispo_max=cfg.cispo_max, entropy=ent, entropy_coef=cfg.entropy_coef,
                    top_entropy_quantile=cfg.top_entropy_quantile,
                )
                loss = res.loss * share
                if torch.isfinite(res.loss):
                    loss.backward()
                else:
                    stats[4] = 1.0
                stats[0] += float(loss.detach())
                stats[1] += res.policy_loss * share
                stats[2] += res.kl * tok_share
                stats[3] += res.clip_frac * tok_share
                stats[5] += (res.entropy or 0.0) * tok_share
                stats[6] += res.entropy_share * tok_share
            stats = dist.all_reduce_sum(stats)  # all ranks raise together, none hangs
            if stats[4]:
                raise TrainingError(
                    f"non-finite loss ({stats[0]}) at step {self.step_num + 1}; "
                    f"last checkpoint and metrics in {self.out_dir} are intact"
                )
            dist.sum_grads(self.params)
            gn = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip))
            if not math.isfinite(gn):
                raise TrainingError(
                    f"non-finite gradient norm ({gn}) at step {self.step_num + 1}; the update "
                    f"was skipped; last checkpoint and metrics in {self.out_dir} are intact"
                )
            self.opt.step()
            out = {"loss": stats[0], "policy_loss": stats[1], "kl": stats[2],
                   "clip_frac": stats[3], "grad_norm": gn, "lr": lr, **extra}
            if with_entropy:  # mean over the completion tokens, of the policy being trained
                out["entropy"] = stats[5]
            if cfg.top_entropy_quantile < 1.0:  # share of tokens the policy loss trained on
                out["entropy_token_share"] = stats[6]
        self.backend.model.eval()
        return out

    # ---------------------------------------------------------- measuring --
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Greedy held-out accuracy: share of answers the first reward counts as right.

        With a watch reward the same answers are also judged by it; its accuracy is appended
        to ``check_acc``.
        """
        rows = self.heldout_rows[: self.cfg.eval_size]
        if not rows:
            return None
        if not dist.is_dist():
            ok, check = self._heldout_ok(rows)
            if check is not None:
                self.check_acc.append(float(check.mean()))
            return float(ok.mean())
        lo, hi = dist.shard(len(rows))  # each rank scores a slice; shares are over all of them
        ok, check = self._heldout_ok(rows[lo:hi]) if hi > lo else (torch.zeros(0), None)
        sums = dist.all_reduce_sum([float(ok.sum()), hi - lo,
                                    float(check.sum()) if check is not None else 0.0])
        if self.watch_fn is not None:
            self.check_acc.append(sums[2] / sums[1])
        return sums[0] / sums[1]

    def _heldout_ok(self, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Which greedy answers the first reward, and the watch reward, count as right."""
        ro = self.backend.generate([r["prompt"] for r in rows], 0.0, self.cfg.max_new_tokens)
        thr = self.cfg.success_threshold
        ok = self._score(ro, rows).success(thr).float()
        if self.watch_fn is None:
            return ok, None
        checked = score([self.watch_fn], ro.prompts, ro.completions, row_columns(rows))
        return ok, checked.success(thr).float()

    def _watch(self, rec: dict[str, Any]) -> None:
        """The reward-hacking watch's fields of a step's record (see ``grpolab.watch``)."""
        cfg = self.cfg
        self.reward_history.append(rec["reward_mean"])
        if self.watch_fn is None:
            return
        train_rise = reward_rise(self.reward_history, cfg.watch_window)
        check_rise = self.check_acc[-1] - self.check_acc[0] if len(self.check_acc) > 1 else None
        # judged at evaluations; between them a step carries the last verdict
        fired = (hacking_suspected(train_rise, check_rise, cfg.watch_margin)
                 if rec["heldout_acc"] is not None else self._watch_fired)
        rec["heldout_check_acc"] = self.check_acc[-1] if rec["heldout_acc"] is not None else None
        rec["watch_train_rise"] = train_rise
        rec["watch_check_rise"] = check_rise
        rec["hacking_suspected"] = fired
        if fired and not self._watch_fired and dist.is_main():
            log.warning("reward hacking suspected at step %d: training reward rose %+.3f over "
                        "the run, the strict held-out check (%s) %+.3f", self.step_num,
                        train_rise, reward_name(self.watch_fn), check_rise)
        self._watch_fired = fired

    @torch.no_grad()
    def heldout_pass_prob(self) -> float | None:
        """Mean exact probability that one temperature-T answer to a held-out prompt is right.

        Only backends that can compute it (the world has one right string per prompt) report
        it; it is the sampled-answer accuracy without sampling noise.
        """
        rows = self.heldout_rows[: self.cfg.eval_size]
        p = self.backend.pass_probability(rows, self.cfg.temperature) if rows else None
        return None if p is None else float(p.mean())

    def _predicted_dead(self, rows: list[dict]) -> float | None:
        p = self.backend.pass_probability(rows, self.cfg.temperature)
        if p is None:
            return None
        return adv_mod.predicted_dead_share(dist.gather_cat(p), self.cfg.group_size)

    def step(self) -> dict[str, Any]:
        """One GRPO step; returns the metrics record written for it."""
        cfg, g = self.cfg, self.cfg.group_size
        t0 = time.perf_counter()
        batch = self.collect()
        # Predicted from the same (not yet updated) policy that produced the measured groups.
        predicted = self._predicted_dead(batch.sampled_rows[::g])
        sampled = torch.cat(batch.sampled_rewards)
        sampled_ok = torch.cat(batch.sampled_success)
        ds = adv_mod.dead_stats(sampled, g, sampled_ok)
        t_sample = time.perf_counter() - t0
        upd = self.update(batch)
        self.step_num += 1
        do_eval = self.step_num % cfg.eval_every == 0 or self.step_num == cfg.steps
        acc = self.evaluate() if do_eval else None
        pass_prob = self.heldout_pass_prob() if do_eval else None
        # Without dynamic sampling the trained batch is the one sampled round (every rank's).
        useful = (batch.trained_groups if cfg.dynamic_sampling else ds.groups - ds.dead) * g
        lens = dist.gather_cat(batch.rollout.completion_mask.sum(1))
        cut = batch.rollout.truncated
        cut_all = dist.gather_cat(cut.float()) if cut is not None else None
        problems = int(dist.all_reduce_sum([len(batch.problems)])[0])
        names = list(batch.reward_sums)
        fn_sums = dist.all_reduce_sum([batch.reward_sums[k] for k in names]) if names else []
        rec = {
            "step": self.step_num,
            "reward_mean": float(sampled.float().mean()),
            "reward_std": float(sampled.float().std()) if sampled.numel() > 1 else 0.0,
            "accuracy_train": float(sampled_ok.float().mean()),
            "heldout_acc": acc,
            "heldout_pass_prob": pass_prob,
            "groups": ds.groups,
            "dead_share": ds.dead_share,
            "dead_all_right_share": ds.all_right_share,
            "dead_all_wrong_share": ds.all_wrong_share,
            "predicted_dead_share": predicted,
            "trained_groups": batch.trained_groups,
            "answers_generated": batch.answers_generated,
            "useful_answers": useful,
            "answers_per_useful": (batch.answers_generated / useful) if useful else None,
            "sampling_rounds": batch.rounds,
            "sampling_cap_hit": batch.cap_hit,
            "completion_len": float(lens.float().mean()) if lens.numel() else 0.0,
            # trained answers cut off by max_new_tokens (no EOS)
            "truncated_share": (float(cut_all.mean()) if cut_all is not None and cut_all.numel()
                                else None),
            "reward_problems": problems,
            # each reward function's mean over every answer sampled (before weighting)
            **{f"rewards/{k}": v / batch.answers_generated for k, v in zip(names, fn_sums)},
            **upd,
            "time_sample_s": t_sample,
            "time_step_s": time.perf_counter() - t0,
        }
        self._watch(rec)
        if self.metrics:
            self.metrics.write(rec)
        if self.samples:
            self.samples.write({"step": self.step_num, "groups": self._sample_record(batch)})
        return rec

    def _sample_record(self, batch: Batch) -> list[dict[str, Any]]:
        """The first ``log_samples`` groups trained on (this rank's): what the policy wrote, its
        rewards and the advantages they gave, for reading a run, not just its averages."""
        g = self.cfg.group_size
        n = min(self.cfg.log_samples, len(batch.rows) // g) * g
        if not n:
            return []
        rewards = batch.rewards[:n].float()
        adv = (batch.advantages[:n] if batch.advantages is not None
               else self._advantages(rewards))
        out = []
        for lo in range(0, n, g):
            row = batch.rows[lo]
            out.append({
                "prompt": row["prompt"],
                **({"answer": str(row["answer"])} if row.get("answer") is not None else {}),
                "completions": batch.rollout.completions[lo : lo + g],
                "rewards": rewards[lo : lo + g].tolist(),
                "advantages": adv[lo : lo + g].tolist(),
                "dead": bool(adv_mod.dead_mask(rewards[lo : lo + g], g)[0]),
            })
        return out

    def train(self, resume: bool = False, on_step: Callable[[dict], None] | None = None) -> list:
        """Run to ``cfg.steps``; with ``resume`` continue from the last checkpoint in out_dir.

        A new run refuses an out_dir that already holds a run unless ``cfg.overwrite`` (then
        that run's metrics and checkpoints are deleted first), so two runs never mix.
        SIGTERM/SIGUSR1 let the current step finish, write a checkpoint and raise RunStopped;
        a second one abandons the step at once (the last checkpoint stays). The reward workers
        are stopped on the way out.
        """
        with self._stop_signals(), contextlib.closing(self):
            return self._run(resume, on_step)

    run_id: str | None = None  # the run's id: in every metrics line and checkpoint
    _stop: int = 0  # the stop signal received, 0 if none

    def _run(self, resume: bool, on_step: Callable[[dict], None] | None) -> list:
        cfg = self.cfg
        self._check_start()
        start = 0
        if resume:
            start = self.load_checkpoint()
        else:
            self._claim_out_dir()
            self.run_id = checkpoint.new_run_id()
        if dist.is_main():  # one writer; every rank computes the same global records
            self.metrics = MetricsWriter(self.out_dir / "metrics.jsonl", run_id=self.run_id,
                                         resume_after_step=start if resume else None)
            if cfg.log_samples:
                self.samples = MetricsWriter(self.out_dir / "samples.jsonl", run_id=self.run_id,
                                             resume_after_step=start if resume else None)
        records = []
        if start == 0 and not resume:  # (a run stopped at step 0 has its line already)
            rec0 = {"step": 0, "heldout_acc": self.evaluate(),
                    "heldout_pass_prob": self.heldout_pass_prob()}
            if self.check_acc:
                rec0["heldout_check_acc"] = self.check_acc[-1]
            if self.metrics:
                self.metrics.write(rec0)
            records.append(rec0)
        self._stop_if_asked(saved=False)
        it = range(start, cfg.steps)
        bar = None
        if cfg.progress and dist.is_main():
            from tqdm import tqdm

            bar = tqdm(it, desc=f"GRPO G={cfg.group_size}", initial=start, total=cfg.steps)
            it = bar
        for _ in it:
            rec = self.step()
            records.append(rec)
            if bar is not None:
                acc = rec["heldout_acc"]
                bar.set_postfix(reward=f"{rec['reward_mean']:.2f}",
                                dead=f"{rec['dead_share']:.2f}",
                                acc="-" if acc is None else f"{acc:.2f}")
            if on_step:
                on_step(rec)
            saved = bool(cfg.checkpoint_every) and (self.step_num % cfg.checkpoint_every == 0
                                                    or self.step_num == cfg.steps)
            if saved:
                self.save_checkpoint()
            self._stop_if_asked(saved)
        return records

    # ------------------------------------------------------- run lifecycle --
    def _check_start(self) -> None:
        """What would waste or wreck the run, checked before anything is written."""
        cfg = self.cfg
        if len(self.train_rows) < cfg.prompts_per_step:
            raise ConfigError(
                f"the training set has {len(self.train_rows)} prompts but a step needs "
                f"{cfg.prompts_per_step} distinct ones (budget {cfg.budget} / group_size "
                f"{cfg.group_size}); lower budget, or add prompts"
            )
        # Backends that know their model's positions (HFBackend) get told the answer room.
        positions = getattr(self.backend, "max_positions", None)
        if positions and cfg.max_new_tokens >= positions:
            raise ConfigError(f"max_new_tokens {cfg.max_new_tokens} does not fit the model's "
                              f"{positions} positions with room for a prompt; lower it")
        if hasattr(self.backend, "max_new_tokens"):
            self.backend.max_new_tokens = max(self.backend.max_new_tokens or 0,
                                              cfg.max_new_tokens)

    def _claim_out_dir(self) -> None:
        """A new run's folder must not hold another run: refuse, or clear it on overwrite."""
        held = dist.all_reduce_sum([float(checkpoint.holds_run(self.out_dir))])[0]
        if not held:  # (every rank looked before rank 0 may clear anything)
            return
        if not self.cfg.overwrite:
            last = (read_metrics(self.out_dir / "metrics.jsonl") or [{}])[-1]
            what = (f" (run {last['run_id']}, step {last.get('step')})" if last.get("run_id")
                    else "")
            raise ConfigError(f"out_dir {self.out_dir} already holds a run{what}; continue it "
                              "with --resume, replace it with --overwrite, or choose another "
                              "--out-dir")
        if dist.is_main():
            checkpoint.clear_run(self.out_dir)
        dist.all_reduce_sum([0.0])  # no rank starts before rank 0 has cleared the folder

    @contextlib.contextmanager
    def _stop_signals(self) -> Iterator[None]:
        """SIGTERM/SIGUSR1 handlers for the length of a run (main thread only): the first
        signal asks the loop to stop after the current step, a second abandons the step."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self._stop:
                raise RunStopped(signum, (
                    f"stopped by a second {signal.Signals(signum).name}: the step in flight "
                    f"was abandoned; the checkpoints and metrics already in {self.out_dir} "
                    "are kept; continue with --resume"))
            self._stop = signum

        self._stop = 0
        old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _stop_if_asked(self, saved: bool) -> None:
        """Between steps: when a stop signal came (on any rank), checkpoint and stop."""
        asked = self._stop
        if dist.is_dist():
            asked = int(dist.all_reduce_sum([float(asked)])[0])
        if not asked:
            return
        signum = self._stop or signal.SIGTERM
        path = self.ckpt_dir / checkpoint.LAST
        if not saved:
            path = self.save_checkpoint()
        raise RunStopped(signum, (
            f"stopped by {signal.Signals(signum).name} after step {self.step_num} of "
            f"{self.cfg.steps}: checkpoint {path} written, metrics flushed; continue with "
            "--resume"))

    # --------------------------------------------------------- checkpoints --
    def state(self) -> dict[str, Any]:
        """Everything a bitwise-identical continuation needs (collective under torchrun)."""
        rank_rng = dist.all_gather_object(
            {"gen": self.gen.get_state(), "torch_rng": torch.get_rng_state()}
        )
        return {
            "step": self.step_num,
            "config": to_dict(self.cfg),
            "backend": self.backend.state_dict(),
            "optimizer": self.opt.state_dict(),
            "gen": self.gen.get_state(),
            "sampler_gen": self.sampler.generator.get_state(),
            "sampler": self.sampler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "world_size": dist.world_size(),
            "rank_rng": rank_rng,  # each rank samples from its own stream
            "run_id": self.run_id,  # the run whose metrics.jsonl goes with this file
            "watch": {"check_acc": list(self.check_acc),  # the reward-hacking watch's history
                      "reward_history": list(self.reward_history),
                      "fired": self._watch_fired},
        }

    def save_checkpoint(self) -> Path:
        """Write last.pt atomically, with its content hash and run id; the checkpoint it
        replaces becomes prev.pt (see ``checkpoint.save``: a kill at any point loses at most
        the newest one). Every rank must call this (the RNG states are gathered); only rank 0
        writes."""
        st = self.state()
        if not dist.is_main():
            return self.ckpt_dir / checkpoint.LAST
        return checkpoint.save(st, self.ckpt_dir)

    def load_checkpoint(self, path: str | os.PathLike | None = None) -> int:
        """Restore the newest good checkpoint (last.pt, else prev.pt); returns its step.

        Files are read with ``weights_only`` (a file carrying code is refused, never run) and
        their content hash is checked. Once a good one is found, each bad one is moved aside
        as ``<name>.corrupt`` and named in a warning; when none is good, the error names every
        file and nothing on disk changes. A good file written for another model shape (a
        changed lora_r, say) is an error naming the setting, not "unreadable".
        """
        candidates = ([Path(path)] if path
                      else [self.ckpt_dir / checkpoint.LAST, self.ckpt_dir / checkpoint.PREV])
        errors: list[str] = []
        bad: list[Path] = []
        for p in candidates:
            if not p.exists():
                continue
            try:
                st = checkpoint.read(p)
            except CheckpointError as e:
                errors.append(f"{p}: {e}")
                bad.append(p)
                continue
            self._restore(st, p)
            if errors and dist.is_main():
                moved = [checkpoint.move_aside(b).name for b in bad]
                log.warning("checkpoint unusable (%s), moved aside as %s; resumed from %s "
                            "(step %d) instead", "; ".join(errors), ", ".join(moved), p,
                            self.step_num)
            if "sha256" not in st and dist.is_main():
                log.warning("checkpoint %s has no content hash (written by an older grpolab): "
                            "loaded without that check", p)
            return self.step_num
        if errors:
            raise CheckpointError("no readable checkpoint to resume from: " + "; ".join(errors))
        raise CheckpointError(f"no checkpoint to resume from in {self.ckpt_dir}")

    def _restore(self, st: dict[str, Any], path: Path | None = None) -> None:
        saved = st.get("config") or {}
        now = to_dict(self.cfg)
        free = RESUME_FREE_KEYS - ({"steps"} if self.cfg.lr_schedule != "constant" else set())
        changed = sorted(k for k in now if k in saved and k not in free and saved[k] != now[k])
        try:
            self.backend.load_state_dict(st["backend"])
            self.opt.load_state_dict(st["optimizer"])
        except (ValueError, RuntimeError, KeyError) as e:
            shape = [f"{k}={saved[k]!r} (this run: {now[k]!r})" for k in SHAPE_KEYS
                     if k in changed]
            why = (f"it was written with {', '.join(shape)}" if shape
                   else " ".join(str(e).split())[:160])
            raise CheckpointError(f"checkpoint {path or 'given'} does not fit this model: {why}; "
                                  "resume with the run's settings, or start a new run") from e
        if changed and dist.is_main():
            log.warning("resuming with changed config keys %s: the continuation will differ "
                        "from the original run", changed)
        gen, torch_rng = st["gen"], st["torch_rng"]
        per_rank = st.get("rank_rng") or []
        if len(per_rank) == dist.world_size():
            gen, torch_rng = per_rank[dist.rank()]["gen"], per_rank[dist.rank()]["torch_rng"]
        elif dist.rank() > 0:  # saved with another world size: keep the streams distinct
            gen = torch.Generator().manual_seed(
                self.cfg.seed + RANK_SEED_STRIDE * dist.rank() + int(st["step"])
            ).get_state()
        self.gen.set_state(gen)
        self.sampler.generator.set_state(st["sampler_gen"])
        self.sampler.load_state_dict(st["sampler"])
        torch.set_rng_state(torch_rng)
        self.step_num = int(st["step"])
        watch = st.get("watch") or {}
        self.check_acc = [float(x) for x in watch.get("check_acc", [])]
        self.reward_history = [float(x) for x in watch.get("reward_history", [])]
        self._watch_fired = bool(watch.get("fired", False))
        self.run_id = st.get("run_id") or checkpoint.new_run_id()  # (older files had none)

