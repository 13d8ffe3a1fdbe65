"""The GRPO loop. ``GRPOTrainer.step`` reads as the algorithm:

1. ``collect``: which prompts, their G answers and rewards (``grpolab.run.collect``), and the
   dead groups, measured and predicted;
2. ``score``: the scoring pass: overlong answers masked, KL in the reward, the reference's and
   old policy's log-probs (``grpolab.run.update``);
3. ``advantages``: each answer's advantage within its group (``grpolab.core.advantages``);
4. ``optimize``: the objective (``grpolab.core.losses.grpo_loss``) over micro-batches, ranks
   and epochs;
5. ``evaluate`` and ``record``: held-out accuracy and the metrics line
   (``grpolab.run.report.step_record``).

The trainer is backend-agnostic (``rollout.backend.Backend``): the built-in world and Hugging Face
models run the same code, so every switch measured in the workshop means the same for a real
model. Its state (``state_dict``) is made of each component's own; ``grpolab.run.checkpoint``
writes and reads the files. Stopping on a signal is ``grpolab.run.stopping``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grpolab.config import Config, ConfigError, to_dict
from grpolab.config.validate import every, validate_ranks
from grpolab.core import advantages as adv_mod
from grpolab.predict.curriculum import PromptSampler
from grpolab.rewards.scorer import Scorer, make_scorer
from grpolab.rollout.backend import Backend
from grpolab.rollout.critic import Critic
from grpolab.run import checkpoint, dist, export, resume, shard, update
from grpolab.run.checkpoint import CheckpointError
from grpolab.run.collect import Batch, Collector
from grpolab.run.heldout import score_answers
from grpolab.run.optim import EntropyControl, lr_factor, optimizer
from grpolab.run.report import MetricsWriter, by_difficulty, sample_record, step_record
from grpolab.run.stopping import RunStopped, StopSignals
from grpolab.run.trackers import Reporter, finishing
from grpolab.run.update import TrainingError
from grpolab.run.watch import Watch

log = logging.getLogger("grpolab")
# Each rank samples answers from its own stream (rank 0 keeps the single-process seed).
RANK_SEED_STRIDE = 1_000_003
__all__ = ["Batch", "CheckpointError", "GRPOTrainer", "RunStopped", "TrainingError", "lr_factor"]


class GRPOTrainer:
    """Owns the optimiser, the RNGs and the metrics file of one run."""

    run_id: str | None = None  # the run's id: in every metrics line and checkpoint
    reporter: Reporter | None = None  # trackers, live PNG, status line (grpolab.run.trackers)
    last_samples: list[dict] | None = None  # the last step's sample groups (as samples.jsonl)

    def __init__(self, cfg: Config, backend: Backend, train_rows: list[dict],
                 reward_fns: list[Callable], heldout_rows: list[dict] | None = None,
                 out_dir: str | os.PathLike | None = None, watch_fn: Callable | None = None,
                 ) -> None:
        if not train_rows:
            raise ValueError("no training prompts")
        self.cfg, self.backend, self.train_rows = cfg, backend, train_rows
        self.heldout_rows = heldout_rows or []
        self.heldout_by_difficulty: dict[str, float] | None = None  # the last evaluation's
        self.scorer: Scorer = make_scorer(cfg, reward_fns)
        self.watch_fn, self.watch = watch_fn, Watch(watch_fn, cfg.watch_margin, cfg.watch_window)
        self.out_dir = Path(out_dir or cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.out_dir / "checkpoints"
        validate_ranks(cfg, dist.world_size())  # whole groups, equal mini-batches per rank
        torch.manual_seed(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed + RANK_SEED_STRIDE * dist.rank())
        self.sampler = PromptSampler(len(train_rows), torch.Generator().manual_seed(cfg.seed + 1),
                                     curriculum=cfg.curriculum, floor=cfg.curriculum_floor,
                                     decay=cfg.curriculum_decay, order=cfg.prompt_order)
        self.rollouts = Collector(cfg, backend, train_rows, self.scorer, self.gen, self.sampler)
        self.tracker = self.rollouts.tracker  # the pass-rate posteriors (grpolab.predict.posterior)
        dist.broadcast_module(backend.model)  # every rank starts from rank 0's weights
        if cfg.shard == "fsdp":  # before the optimizer: sharding replaces the parameters
            shard.shard_backend(backend)
        self.sharded = shard.is_sharded(backend.model)
        self.params, self.opt = optimizer(backend.model, cfg)
        # PPO's value model: a copy of the policy as it starts, with a value head
        self.critic = Critic(backend.model, cfg.critic_lr) if cfg.estimator == "ppo" else None
        self.entropy_control = EntropyControl(cfg)  # the entropy bonus's coefficient
        self.step_num, self.claimed = 0, False  # claimed: a new run's (freed by a mistake before step 1)
        self.metrics: MetricsWriter | None = None  # metrics.jsonl, and samples.jsonl (cfg.
        self.samples: MetricsWriter | None = None  # log_samples groups a step)
        self.stop = StopSignals()
        # settings a resume changed: {key: (the checkpoint's value, this run's)}
        self.resumed_changes: dict[str, tuple[Any, Any]] = {}

    # ---------------------------------------------------------------------- the run --
    def train(self, resume: bool = False, on_step: Callable[[dict], None] | None = None) -> list:
        """Run to ``cfg.steps``; with ``resume`` continue from the last checkpoint in out_dir.

        A new run refuses an out_dir that already holds a run unless ``cfg.overwrite`` (then
        that run's metrics and checkpoints are deleted first), and any run refuses one that a
        live run holds (``checkpoint.out_dir_lock``), so two runs never mix.
        SIGTERM/SIGUSR1 let the current step finish, write a checkpoint and raise RunStopped;
        a second one abandons the step at once. The reward workers stop on the way out.
        """
        with (checkpoint.out_dir_lock(self.out_dir), self.stop.handlers(self.out_dir),
              contextlib.closing(self), finishing(self.reporter)):  # the reporter's finish, told whether the run failed
            try:
                return self._run(resume, on_step)
            except ValueError:  # (a reward failing at its first call: the rerun has the folder)
                if self.claimed and self.step_num == 0 and dist.is_main():
                    checkpoint.unclaim(self.out_dir)
                raise

    def _run(self, resume: bool, on_step: Callable[[dict], None] | None) -> list:
        cfg = self.cfg
        self._check_start()
        start = self.load_checkpoint() if resume else 0
        if resume and dist.is_main():  # where the run goes on from (as the out_dir notice)
            export.drop_after(self.out_dir, start, self.run_id)  # model folders it will redo
            left = "" if start < cfg.steps else "; nothing left to run (raise --steps to go on)"
            print(f"grpolab: resumed {self.out_dir} at step {start} of {cfg.steps}{left}",
                  flush=True)
        if not resume:
            checkpoint.claim_out_dir(self.out_dir, cfg.overwrite)
            self.run_id = checkpoint.new_run_id()
        if cfg.save_model_every:  # (every rank reads it: all refuse together)
            export.check_free(self.out_dir, self.run_id)
        if dist.is_main():  # one writer; every rank computes the same global records
            after = start if resume else None
            self.metrics = MetricsWriter(self.out_dir / "metrics.jsonl", after, self.run_id)
            if cfg.log_samples:
                self.samples = MetricsWriter(self.out_dir / "samples.jsonl", after, self.run_id, 1)
            checkpoint.write_config(self.out_dir, to_dict(cfg), start if resume else None,
                                    changed=bool(self.resumed_changes))
            self.claimed = not resume  # (its files written: a mistake before step 1 takes them)
        if self.reporter:
            self.reporter.start(self)
        records = []
        if start == 0 and not resume:  # (a run stopped at step 0 has its line already)
            rec0 = {"step": 0, "heldout_acc": self.evaluate(),
                    "heldout_pass_prob": self.heldout_pass_prob(),
                    "train_pass_prob": self.train_pass_prob()}
            if cfg.model_path:  # the paths a real model's run takes (the world has none)
                rec0["speed"] = dataclasses.asdict(cfg.speed)
            if self.watch.check_acc:
                rec0["heldout_check_acc"] = self.watch.check_acc[-1]
            if self.heldout_by_difficulty:
                rec0["heldout_acc_by_difficulty"] = self.heldout_by_difficulty
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
                dead = {} if cfg.group_size == 1 else {"dead": f"{rec['dead_share']:.2f}"}
                it.set_postfix(reward=f"{rec['reward_mean']:.2f}", **dead,
                               acc="-" if acc is None else f"{acc:.2f}")
            if on_step:
                on_step(rec)
            last = self.step_num == cfg.steps  # (each pass's saves: a part pass's end too)
            if cfg.save_model_every and (self.step_num % every(cfg, "save_model_every") == 0
                                         or (cfg.save_each_pass and last)):
                self.save_model()  # before the checkpoint: a kill between them redoes both
            saved = bool(cfg.checkpoint_every) and (
                self.step_num % every(cfg, "checkpoint_every") == 0 or last)
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
        scored = self.score(batch)
        adv = self.advantages(batch, scored)
        upd = self.optimize(scored, adv)
        self.step_num += 1
        do_eval = self.step_num % every(cfg, "eval_every") == 0 or self.step_num == cfg.steps
        acc = self.evaluate() if do_eval else None
        pass_prob = self.heldout_pass_prob() if do_eval else None
        rec = step_record(cfg, self.step_num, batch, sampled, sampled_ok, ds, predicted, acc,
                          pass_prob, upd, t0, t_sample, posterior)
        rec["train_pass_prob"] = self.train_pass_prob() if do_eval else None
        if do_eval and self.heldout_by_difficulty:
            rec["heldout_acc_by_difficulty"] = self.heldout_by_difficulty
        self.record(rec, batch, adv, ds)
        return rec

    def collect(self) -> Batch:
        """This step's groups (see ``grpolab.run.collect``: prompts, answers, dynamic sampling)."""
        return self.rollouts.collect(self.step_num)

    def score(self, batch: Batch) -> update.Scored:
        """The scoring pass (``grpolab.run.update.score``)."""
        with self._intact():
            return update.score(self.cfg, self.backend, batch, self.critic, self.step_num)

    def advantages(self, batch: Batch, scored: update.Scored) -> Tensor | None:
        """Each answer's advantage within its group (None when this rank has no answers)."""
        with self._intact():
            return update.batch_advantages(self.cfg, batch, scored, self.step_num)

    def optimize(self, scored: update.Scored, adv: Tensor | None) -> dict[str, float]:
        """``epochs`` passes over the scored batch, an optimiser step per mini-batch; the
        update's metrics."""
        with self._intact():
            return update.optimize(self.cfg, self.backend, self.opt, self.params, scored, adv,
                                   self.step_num, self.sharded, self.critic,
                                   self.entropy_control)

    def update(self, batch: Batch) -> dict[str, float]:
        """``step`` without the sampling and the measuring: score, advantages, optimize."""
        scored = self.score(batch)
        return self.optimize(scored, self.advantages(batch, scored))

    def record(self, rec: dict[str, Any], batch: Batch, adv: Tensor | None,
               ds: adv_mod.DeadStats) -> None:
        """The step's line in metrics.jsonl, its groups in samples.jsonl, and what watches
        the run (the reward-hacking watch, the no-signal alarm, the posteriors' decay)."""
        self.watch.record(rec, self.step_num)
        self.rollouts.end_step(self.step_num, rec, ds)
        if self.metrics:
            self.metrics.write(rec)
        per_answer = update.answer_advantages(adv, batch.rollout.completion_mask)
        self.last_samples = (sample_record(batch, self.cfg.group_size, self.cfg.log_samples,
                                           per_answer) if self.samples else [])
        if self.samples:
            self.samples.write({"step": self.step_num, "groups": self.last_samples})

    @contextlib.contextmanager
    def _intact(self) -> Iterator[None]:
        """A TrainingError says what was kept."""
        try:
            yield
        except update.TrainingError as e:
            raise update.TrainingError(f"{e}; last checkpoint and metrics in {self.out_dir} "
                                       "are intact") from None

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
            self.heldout_by_difficulty = by_difficulty(rows, ok)
            if check is not None:
                self.watch.check_acc.append(float(check.mean()))
            return float(ok.mean())
        lo, hi = dist.shard(len(rows))  # each rank scores a slice; shares are over all of them
        ok, check = self._heldout_ok(rows[lo:hi]) if hi > lo else (torch.zeros(0), None)
        self.heldout_by_difficulty = by_difficulty(rows, ok, lo)
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

    # ------------------------------------------------------------------ lifecycle --
    def _check_start(self) -> None:
        """What would waste or wreck the run, checked before anything is written."""
        cfg = self.cfg
        if len(self.train_rows) < cfg.prompts_per_step:
            raise ConfigError(
                f"the training set has {len(self.train_rows)} prompts but a step needs "
                f"{cfg.prompts_per_step} distinct ones (budget {cfg.budget} / group_size "
                f"{cfg.group_size}); lower budget (TRL's per_device_train_batch_size x "
                f"gradient_accumulation_steps), or add prompts")
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

    # ----------------------------------------------------------------------- state --
    def state_dict(self) -> dict[str, Any]:
        """Everything a bitwise-identical continuation needs, from each component's own state
        (collective under torchrun: every rank's RNG streams are gathered; FSDP weights go to
        their own folder, which the state names)."""
        rank_rng = dist.all_gather_object({"gen": self.gen.get_state(),
                                           "torch_rng": torch.get_rng_state()})
        if self.cfg.shard == "fsdp":  # weights and Adam state: one DCP folder, a file per rank
            weights = checkpoint.save_sharded(self.ckpt_dir, self.backend.model, self.opt,
                                              self.step_num, self.run_id)
        else:
            weights = {"backend": self.backend.state_dict(), "optimizer": self.opt.state_dict()}
        return {
            "step": self.step_num,
            "config": to_dict(self.cfg),
            **weights,
            "gen": self.gen.get_state(),
            "sampler_gen": self.sampler.generator.get_state(),
            "sampler": self.sampler.state_dict(),
            **self.rollouts.state_dict(),  # the pass-rate posteriors, the rows' fingerprint
            "torch_rng": torch.get_rng_state(),
            "world_size": dist.world_size(),
            "rank_rng": rank_rng,  # each rank samples from its own stream
            "run_id": self.run_id,  # the run whose metrics.jsonl goes with this state
            "watch": self.watch.state_dict(),  # the reward-hacking watch's history
            "alarm": self.rollouts.alarm.state_dict(),  # when the no-signal alarm last spoke
            "entropy_control": self.entropy_control.state_dict(),  # (adaptive: it moves)
            **({"reference": {k: v.detach().cpu() for k, v in self.backend.ref.state_dict()
                              .items()}} if self.cfg.sync_ref_model else {}),  # it moves
            **({"critic": self.critic.state_dict()} if self.critic else {}),  # PPO's value model
        }

    def load_state_dict(self, st: dict[str, Any], path: Path | None = None) -> None:
        """Put a checkpoint's content back (weights, optimiser, RNGs, sampler, posteriors,
        watch, alarm). A state written for another model shape (a changed lora_r, say) is a
        ConfigError naming the setting; other changed settings are warned about."""
        changed = resume.changed_settings(resume.check_state(st, path), self.cfg,
                                          self.train_rows, path, self.rollouts.rows_digest)
        try:
            if st.get("dcp"):
                checkpoint.load_sharded(st, path or self.ckpt_dir / checkpoint.LAST,
                                        self.backend.model, self.opt)
            else:
                self.backend.load_state_dict(st["backend"])
                self.opt.load_state_dict(st["optimizer"])
        except CheckpointError:
            raise
        except (ValueError, RuntimeError, KeyError) as e:
            raise resume.load_error(e, changed, path) from e
        self.resumed_changes = changed
        if changed and dist.is_main():
            log.warning("resuming at step %d with changed settings (%s): the steps after it "
                        "differ from the original run's", int(st["step"]),
                        ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
        gen, torch_rng = st["gen"], st["torch_rng"]
        per_rank = st.get("rank_rng") or []
        if len(per_rank) == dist.world_size():
            gen, torch_rng = per_rank[dist.rank()]["gen"], per_rank[dist.rank()]["torch_rng"]
        elif dist.rank() > 0:  # saved with another world size: keep the streams distinct
            gen = torch.Generator().manual_seed(
                self.cfg.seed + RANK_SEED_STRIDE * dist.rank() + int(st["step"])).get_state()
        self.gen.set_state(gen)
        self.sampler.generator.set_state(st["sampler_gen"])
        self.sampler.load_state_dict(st["sampler"])
        self.rollouts.load_state_dict(st)
        torch.set_rng_state(torch_rng)
        self.step_num = int(st["step"])
        self.watch.load_state_dict(st.get("watch") or {})
        self.rollouts.alarm.load_state_dict(st.get("alarm") or {})
        self.entropy_control.load_state_dict(st.get("entropy_control") or {})
        if self.cfg.sync_ref_model and "reference" in st:  # (a synced reference moves)
            self.backend.ref.load_state_dict(st["reference"])
        if self.critic is not None:
            if "critic" not in st:
                raise CheckpointError(f"checkpoint {path or 'given'} has no value model: it was "
                                      "not written by an estimator ppo run")
            self.critic.load_state_dict(st["critic"])
        self.run_id = st.get("run_id") or checkpoint.new_run_id()  # (older files had none)

    def save_checkpoint(self) -> Path:
        """last.pt, atomically: the old one becomes prev.pt, so a kill at any point loses at
        most the newest (collective under torchrun; rank 0 writes)."""
        st = self.state_dict()
        if not dist.is_main():
            return self.ckpt_dir / checkpoint.LAST
        path = checkpoint.save(st, self.ckpt_dir)
        checkpoint.prune_dcp(self.ckpt_dir, st)
        return path

    def save_model(self) -> Path:
        """``checkpoint-<step>/``, a model folder as final/ is (``grpolab.run.export``); past
        ``save_total_limit``, older ones go. Collective under FSDP: every rank gathers the
        weights, rank 0 writes. A stop signal meanwhile waits for it, as for a step."""
        full = shard.full_state_dict(self.backend.model) if self.sharded else None
        failed = ""
        if dist.is_main():
            try:
                export.save_step(self.backend, self.out_dir, self.step_num, self.run_id, full,
                                 self.cfg.save_total_limit)
            except OSError as e:  # (a full disk: every rank stops, none waits on rank 0)
                failed = f"{type(e).__name__}: {e}"
        if dist.all_reduce_sum([float(bool(failed))])[0]:
            raise TrainingError(f"the model folder of step {self.step_num} could not be written"
                                f"{': ' + failed if failed else ' (rank 0)'}")
        return self.out_dir / f"{export.PREFIX}{self.step_num}"

    def load_checkpoint(self, path: str | os.PathLike | None = None) -> int:
        """The newest good checkpoint restored (``checkpoint.load_newest``); its step."""
        checkpoint.load_newest(self.ckpt_dir, self.load_state_dict, path)
        return self.step_num

    def close(self) -> None:
        """Stop the reward workers (train() does this when it returns or fails)."""
        self.scorer.close()
