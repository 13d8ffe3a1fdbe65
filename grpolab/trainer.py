"""The GRPO loop: choose prompts, sample groups, score, compute advantages, update, measure.

One step (``GRPOTrainer.step``) reads top to bottom:

1. ``collect``: which prompts, their G answers and rewards (``grpolab.collect``);
2. ``_advantages``: each answer's advantage within its group (``grpolab.advantages``);
3. ``update``: the objective (``grpolab.losses.grpo_loss``) over micro-batches and ranks;
4. ``evaluate``: held-out accuracy, and the metrics line (``grpolab.report.step_record``).

The trainer is backend-agnostic (``rollout.Backend``): the built-in world and Hugging Face
models run the same code, so every switch measured in the workshop means the same for a real
model. Checkpoints are ``grpolab.checkpoint``; stopping on a signal is ``grpolab.stopping``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import advantages as adv_mod
from . import checkpoint, dist, shard
from .checkpoint import RANK_SEED_STRIDE, CheckpointError
from .collect import Batch, Collector
from .config import Config, ConfigError
from .curriculum import PromptSampler
from .losses import grpo_loss, sequence_kl
from .report import MetricsWriter, sample_record, step_record
from .rollout import Backend, Rollout, micro_batches
from .scoring import Scorer, make_scorer, score_answers
from .stopping import RunStopped, StopSignals
from .trackers import Reporter, finishing
from .watch import Watch

log = logging.getLogger("grpolab")
__all__ = ["Batch", "CheckpointError", "GRPOTrainer", "RunStopped", "TrainingError", "lr_factor"]


def lr_factor(step: int, steps: int, schedule: str, warmup: int) -> float:
    """Multiplier of the base lr for GRPO step ``step`` (0-based) of ``steps``: a linear
    warm-up over ``warmup`` steps, then constant, linear to 0 or half a cosine to 0 at
    ``steps`` (as transformers' schedulers do). A function of the step alone, so a resumed run
    continues the schedule exactly."""
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


class GRPOTrainer:
    """Owns the optimiser, the RNGs and the metrics file of one run."""

    run_id: str | None = None  # the run's id: in every metrics line and checkpoint
    reporter: Reporter | None = None  # trackers, live PNG, status line (grpolab.trackers)
    last_samples: list[dict] | None = None  # the last step's sample groups (as samples.jsonl)

    def __init__(self, cfg: Config, backend: Backend, train_rows: list[dict],
                 reward_fns: list[Callable], heldout_rows: list[dict] | None = None,
                 out_dir: str | os.PathLike | None = None, watch_fn: Callable | None = None,
                 ) -> None:
        if not train_rows:
            raise ValueError("no training prompts")
        self.cfg, self.backend, self.train_rows = cfg, backend, train_rows
        self.heldout_rows = heldout_rows or []
        self.scorer: Scorer = make_scorer(cfg, reward_fns)
        self.watch_fn = watch_fn  # strict held-out check of the reward-hacking watch
        self.watch = Watch(watch_fn, cfg.watch_margin, cfg.watch_window)
        self.out_dir = Path(out_dir or cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.out_dir / "checkpoints"
        if cfg.prompts_per_step % dist.world_size():
            raise ConfigError(
                f"prompts_per_step {cfg.prompts_per_step} (budget {cfg.budget} / group_size "
                f"{cfg.group_size}) cannot be split into whole groups across "
                f"{dist.world_size()} ranks")
        torch.manual_seed(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed + RANK_SEED_STRIDE * dist.rank())
        self.sampler = PromptSampler(len(train_rows), torch.Generator().manual_seed(cfg.seed + 1),
                                     curriculum=cfg.curriculum, floor=cfg.curriculum_floor,
                                     decay=cfg.curriculum_decay)
        self.rollouts = Collector(cfg, backend, train_rows, self.scorer, self.gen, self.sampler)
        self.tracker = self.rollouts.tracker  # the pass-rate posteriors (grpolab.predict)
        dist.broadcast_module(backend.model)  # every rank starts from rank 0's weights
        if cfg.shard == "fsdp":  # before the optimizer: sharding replaces the parameters
            shard.shard_backend(backend)
        self.sharded = shard.is_sharded(backend.model)
        self.params = [p for p in backend.model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(self.params, lr=cfg.lr)
        self.step_num = 0
        self.metrics: MetricsWriter | None = None
        self.samples: MetricsWriter | None = None  # samples.jsonl (cfg.log_samples groups a step)
        self.stop = StopSignals()

    # ---------------------------------------------------------------------- the run --
    def train(self, resume: bool = False, on_step: Callable[[dict], None] | None = None) -> list:
        """Run to ``cfg.steps``; with ``resume`` continue from the last checkpoint in out_dir.

        A new run refuses an out_dir that already holds a run unless ``cfg.overwrite`` (then
        that run's metrics and checkpoints are deleted first), so two runs never mix.
        SIGTERM/SIGUSR1 let the current step finish, write a checkpoint and raise RunStopped;
        a second one abandons the step at once. The reward workers stop on the way out.
        """
        with (self.stop.handlers(self.out_dir), contextlib.closing(self),
              finishing(self.reporter)):  # the reporter's finish, told whether the run failed
            return self._run(resume, on_step)

    def _run(self, resume: bool, on_step: Callable[[dict], None] | None) -> list:
        cfg = self.cfg
        self._check_start()
        start = self.load_checkpoint() if resume else 0
        if not resume:
            checkpoint.claim_out_dir(self.out_dir, cfg.overwrite)
            self.run_id = checkpoint.new_run_id()
        if dist.is_main():  # one writer; every rank computes the same global records
            after = start if resume else None
            self.metrics = MetricsWriter(self.out_dir / "metrics.jsonl", after, self.run_id)
            if cfg.log_samples:
                self.samples = MetricsWriter(self.out_dir / "samples.jsonl", after, self.run_id)
        if self.reporter:
            self.reporter.start(self)
        records = []
        if start == 0 and not resume:  # (a run stopped at step 0 has its line already)
            rec0 = {"step": 0, "heldout_acc": self.evaluate(),
                    "heldout_pass_prob": self.heldout_pass_prob(),
                    "train_pass_prob": self.train_pass_prob()}
            if self.watch.check_acc:
                rec0["heldout_check_acc"] = self.watch.check_acc[-1]
            if self.metrics:
                self.metrics.write(rec0)
            if self.reporter:
                self.reporter.log(rec0)
            records.append(rec0)
        self._stop_if_asked(saved=False)
        it: Any = range(start, cfg.steps)
        if cfg.progress and dist.is_main():
            from tqdm import tqdm

            it = tqdm(it, desc=f"GRPO G={cfg.group_size}", initial=start, total=cfg.steps)
        for _ in it:
            rec = self.step()
            if self.reporter:  # trackers; at an evaluation the PNG and a status line
                self.reporter.log(rec, self.last_samples)
            records.append(rec)
            if hasattr(it, "set_postfix"):  # the progress bar
                acc = rec["heldout_acc"]
                it.set_postfix(reward=f"{rec['reward_mean']:.2f}", dead=f"{rec['dead_share']:.2f}",
                               acc="-" if acc is None else f"{acc:.2f}")
            if on_step:
                on_step(rec)
            saved = bool(cfg.checkpoint_every) and (self.step_num % cfg.checkpoint_every == 0
                                                    or self.step_num == cfg.steps)
            if saved:
                self.save_checkpoint()
            self._stop_if_asked(saved)
        return records

    def step(self) -> dict[str, Any]:
        """One GRPO step; returns the metrics record written for it."""
        cfg = self.cfg
        t0 = time.perf_counter()
        batch = self.collect()
        sampled, sampled_ok = torch.cat(batch.sampled_rewards), torch.cat(batch.sampled_success)
        # dead groups, measured and predicted (before the update), with the posteriors' P(dead)
        ds, predicted, posterior = self.rollouts.outcomes(batch, sampled, sampled_ok)
        t_sample = time.perf_counter() - t0
        upd = self.update(batch)
        self.step_num += 1
        do_eval = self.step_num % cfg.eval_every == 0 or self.step_num == cfg.steps
        acc = self.evaluate() if do_eval else None
        pass_prob = self.heldout_pass_prob() if do_eval else None
        rec = step_record(cfg, self.step_num, batch, sampled, sampled_ok, ds, predicted, acc,
                          pass_prob, upd, t0, t_sample, posterior)
        rec["train_pass_prob"] = self.train_pass_prob() if do_eval else None
        self.watch.record(rec, self.step_num)
        self.rollouts.end_step(self.step_num, rec, ds)  # the no-signal alarm; posteriors fade
        if self.metrics:
            self.metrics.write(rec)
        self.last_samples = self._sample_record(batch) if self.samples else []
        if self.samples:
            self.samples.write({"step": self.step_num, "groups": self.last_samples})
        return rec

    def collect(self) -> Batch:
        """This step's groups (see ``grpolab.collect``: prompts, answers, dynamic sampling)."""
        return self.rollouts.collect(self.step_num)

    # ---------------------------------------------------------------- advantages --
    def _advantages(self, rewards: Tensor, per_fn: Tensor | None = None,
                    reduce: Callable[[list[float]], list[float]] | None = None,
                    sizes: list[int] | None = None) -> Tensor:
        """Each answer's advantage within its group, as the config's baseline and scaling say.

        ``rewards`` is the weighted total; with ``per_fn`` (each reward function's [B, K]) a
        reward_aggregation other than sum_then_normalize (GDPO) combines the functions itself.
        ``reduce`` sums over ranks, for batch-level statistics (scale: batch, GDPO).
        ``sizes``: the groups' sizes when they differ (``allocate``: ragged groups).
        """
        cfg = self.cfg
        opts: dict[str, Any] = {"baseline": cfg.baseline, "scale": cfg.scale, "std": cfg.std,
                                "std_eps": cfg.std_eps, "min_std": cfg.min_std, "reduce": reduce}
        if sizes is not None and any(n != cfg.group_size for n in sizes):
            ids = adv_mod.group_ids_from_sizes(sizes)
            if per_fn is None or cfg.reward_aggregation == "sum_then_normalize":
                return adv_mod.group_advantages_ragged(rewards.float(), ids, **opts)
            return adv_mod.RAGGED_REWARD_AGGREGATIONS[cfg.reward_aggregation](
                per_fn, torch.tensor(cfg.reward_weights or [1.0] * per_fn.shape[1]), ids, **opts)
        if per_fn is None or cfg.reward_aggregation == "sum_then_normalize":
            return adv_mod.group_advantages(rewards.float(), cfg.group_size, **opts)
        weights = torch.tensor(cfg.reward_weights or [1.0] * per_fn.shape[1])
        return adv_mod.REWARD_AGGREGATIONS[cfg.reward_aggregation](
            per_fn, weights, cfg.group_size, **opts)

    @torch.no_grad()
    def _reward_with_kl(self, ro: Rollout, rewards: Tensor) -> tuple[Tensor, Tensor]:
        """kl_in: reward (verl's use_kl_in_reward): each answer's reward minus beta x its summed
        per-token KL estimate to the reference. Returns the new rewards and the penalties [B]."""
        cfg, pens = self.cfg, []
        for part, _ in micro_batches(ro, rewards, cfg.micro_batch):
            lp = self.backend.logprobs(part, cfg.temperature)
            ref = self.backend.logprobs(part, cfg.temperature, reference=True)
            pens.append(sequence_kl(lp, ref, part.completion_mask, cfg.kl_estimator))
        pen = cfg.beta * torch.cat(pens)
        return rewards.float() - pen.float(), pen

    # -------------------------------------------------------------------- update --
    def update(self, batch: Batch) -> dict[str, float]:
        """mu optimisation passes over one batch with the GRPO objective.

        Each micro-batch (``micro_batch`` rows) on each rank gets its exact share of the global
        loss from ``grpo_loss`` (given the global reply and token counts); gradients accumulate
        over micro-batches and are summed over ranks, so any split takes the one-pass step.
        """
        cfg, ro = self.cfg, batch.rollout
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
        # Batch-level statistics (scale: batch, GDPO) are over every rank: all ranks take part.
        reduce = dist.all_reduce_sum if dist.is_dist() else None
        adv = (self._advantages(rewards, batch.rewards_per_fn, reduce, batch.group_sizes)
               if n_loc or reduce is not None else None)
        adv = batch.advantages = adv if n_loc else None  # samples.jsonl logs these
        bad = float(adv is not None and not bool(torch.isfinite(adv).all()))
        n_all, t_all, bad = (int(v) for v in dist.all_reduce_sum([n_loc, t_loc, bad]))
        if bad:  # (score() lets no non-finite reward in; checked again, on every rank together)
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
        parts = []  # (micro-batch, advantages, reference log-probs, old-policy log-probs)
        with torch.no_grad():  # all before the first optimizer step: the old policy
            for part, a in micro_batches(ro, adv, cfg.micro_batch) if adv is not None else []:
                ref_lp = (self.backend.logprobs(part, cfg.temperature, reference=True)
                          if cfg.beta > 0 and cfg.kl_in == "loss" else None)
                old_lp = self.backend.logprobs(part, cfg.temperature) if cfg.epochs > 1 else None
                parts.append((part, a, ref_lp, old_lp))
        for group in self.opt.param_groups:
            group["lr"] = lr
        with_entropy = hasattr(self.backend, "logprobs_and_entropy")
        self.backend.model.train()
        out: dict[str, float] = {}
        for _ in range(cfg.epochs):
            self.opt.zero_grad(set_to_none=True)
            stats = [0.0] * 7  # loss, policy loss, kl, clip frac, non-finite, entropy, share
            if self.sharded and dist.all_reduce_sum([float(not parts)])[0]:
                raise TrainingError("a rank has no answers to train on this step; fsdp needs "
                                    "every rank in every backward")
            for k, (part, a, ref_lp, old_lp) in enumerate(parts):
                if self.sharded:  # FSDP reduces once, in the last micro-batch's backward
                    shard.set_sync(self.backend.model, k == len(parts) - 1)
                if with_entropy:  # the same log-probs, plus each position's entropy
                    lp, ent = self.backend.logprobs_and_entropy(
                        part, cfg.temperature, entropy_grad=bool(cfg.entropy_coef))
                else:
                    lp, ent = self.backend.logprobs(part, cfg.temperature), None
                res = grpo_loss(
                    lp, lp.detach() if old_lp is None else old_lp, ref_lp, a,
                    part.completion_mask, beta=cfg.beta, eps_low=cfg.eps_low,
                    eps_high=cfg.eps_high, agg=cfg.loss_agg, norm_len=cfg.max_new_tokens,
                    policy_loss=cfg.policy_loss, kl_estimator=cfg.kl_estimator,
                    kl_is_correction=cfg.kl_is_correction, dual_clip=cfg.dual_clip,
                    cispo_max=cfg.cispo_max, entropy=ent, entropy_coef=cfg.entropy_coef,
                    top_entropy_quantile=cfg.top_entropy_quantile,
                    global_rows=n_all, global_tokens=t_all)
                finite = bool(torch.isfinite(res.loss))
                if finite or self.sharded:  # (fsdp: every rank takes part in the reduction)
                    res.loss.backward()
                stats[4] = max(stats[4], float(not finite))
                for i, v in enumerate((float(res.loss.detach()), res.policy_loss, res.kl,
                                       res.clip_frac, 0.0, res.entropy or 0.0,
                                       res.entropy_share)):
                    stats[i] += v
            stats = dist.all_reduce_sum(stats)  # all ranks raise together, none hangs
            if stats[4]:
                raise TrainingError(f"non-finite loss ({stats[0]}) at step {self.step_num + 1}; "
                                    f"last checkpoint and metrics in {self.out_dir} are intact")
            if not self.sharded:
                dist.sum_grads(self.params)
            gn = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
            gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
            if not math.isfinite(gn):
                raise TrainingError(
                    f"non-finite gradient norm ({gn}) at step {self.step_num + 1}; the update "
                    f"was skipped; last checkpoint and metrics in {self.out_dir} are intact")
            self.opt.step()
            out = {"loss": stats[0], "policy_loss": stats[1], "kl": stats[2],
                   "clip_frac": stats[3], "grad_norm": gn, "lr": lr, **extra}
            if with_entropy:  # mean over the completion tokens, of the policy being trained
                out["entropy"] = stats[5]
            if cfg.top_entropy_quantile < 1.0:  # share of tokens the policy loss trained on
                out["entropy_token_share"] = stats[6]
        self.backend.model.eval()
        return out

    # ----------------------------------------------------------------- measuring --
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Greedy held-out accuracy: share of answers the first reward counts as right; with a
        watch reward, the same answers' accuracy by it is appended to ``check_acc``."""
        rows = self.heldout_rows[: self.cfg.eval_size]
        if not rows:
            return None
        if not dist.is_dist():
            ok, check = self._heldout_ok(rows)
            if check is not None:
                self.watch.check_acc.append(float(check.mean()))
            return float(ok.mean())
        lo, hi = dist.shard(len(rows))  # each rank scores a slice; shares are over all of them
        ok, check = self._heldout_ok(rows[lo:hi]) if hi > lo else (torch.zeros(0), None)
        sums = dist.all_reduce_sum([float(ok.sum()), hi - lo,
                                    float(check.sum()) if check is not None else 0.0])
        if self.watch_fn is not None:
            self.watch.check_acc.append(sums[2] / sums[1])
        return sums[0] / sums[1]

    def _heldout_ok(self, rows: list[dict]) -> tuple[Tensor, Tensor | None]:
        """Which greedy answers the first reward, and the watch reward, count as right."""
        res = score_answers(self.backend, rows, self.scorer, self.cfg.max_new_tokens,
                            self.cfg.success_threshold, group_size=self.cfg.group_size,
                            check_fn=self.watch_fn)
        return res.ok.float(), None if res.checked is None else res.checked.float()

    @torch.no_grad()
    def _pass_prob(self, rows: list[dict]) -> float | None:
        """Mean exact probability that one temperature-T answer to the first ``eval_size``
        ``rows`` is right, from backends that can compute it (the world: one right string per
        prompt)."""
        rows = rows[: self.cfg.eval_size]
        p = self.backend.pass_probability(rows, self.cfg.temperature) if rows else None
        return None if p is None else float(p.mean())

    def heldout_pass_prob(self) -> float | None:
        """Held-out accuracy at the run's temperature, exact (see ``_pass_prob``)."""
        return self._pass_prob(self.heldout_rows)

    def train_pass_prob(self) -> float | None:
        """The training reward's expectation on the first ``eval_size`` training prompts: the
        trend that the sampled reward_mean shows through the noise of a few prompts a step."""
        return self._pass_prob(self.train_rows)

    def _sample_record(self, batch: Batch) -> list[dict[str, Any]]:
        return sample_record(batch, self.cfg.group_size, self.cfg.log_samples, self._advantages)

    # ------------------------------------------------------------------ lifecycle --
    def _check_start(self) -> None:
        """What would waste or wreck the run, checked before anything is written."""
        cfg = self.cfg
        if len(self.train_rows) < cfg.prompts_per_step:
            raise ConfigError(
                f"the training set has {len(self.train_rows)} prompts but a step needs "
                f"{cfg.prompts_per_step} distinct ones (budget {cfg.budget} / group_size "
                f"{cfg.group_size}); lower budget, or add prompts")
        # Backends that know their model's positions (HFBackend) get told the answer room.
        positions = getattr(self.backend, "max_positions", None)
        if positions and cfg.max_new_tokens >= positions:
            raise ConfigError(f"max_new_tokens {cfg.max_new_tokens} does not fit the model's "
                              f"{positions} positions with room for a prompt; lower it")
        if hasattr(self.backend, "max_new_tokens"):
            self.backend.max_new_tokens = max(self.backend.max_new_tokens or 0,
                                              cfg.max_new_tokens)

    def _stop_if_asked(self, saved: bool) -> None:
        """Between steps: when a stop signal came (on any rank), checkpoint and stop."""
        signum = self.stop.asked()
        if signum:
            path = self.ckpt_dir / checkpoint.LAST if saved else self.save_checkpoint()
            raise self.stop.stopped(signum, self.step_num, self.cfg.steps, path)

    def save_checkpoint(self) -> Path:
        """last.pt, atomically (see ``checkpoint.save_trainer``; collective under torchrun)."""
        return checkpoint.save_trainer(self)

    def load_checkpoint(self, path: str | os.PathLike | None = None) -> int:
        """The newest good checkpoint restored (``checkpoint.load_trainer``); its step."""
        return checkpoint.load_trainer(self, path)

    def close(self) -> None:
        """Stop the reward workers (train() does this when it returns or fails)."""
        self.scorer.close()
