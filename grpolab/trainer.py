"""The GRPO loop: draw prompts, sample groups, score, compute advantages, update, measure.

The trainer is backend-agnostic (see ``sampling.Backend``): the built-in world and Hugging Face
models run the same code, so every switch measured in the workshop means the same for a real
model.
"""

from __future__ import annotations

import io
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from . import advantages as adv_mod
from .config import Config, to_dict
from .curriculum import PromptSampler
from .losses import grpo_loss
from .report import MetricsWriter
from .rewards import score
from .sampling import Backend, Rollout, cat_rollouts

log = logging.getLogger("grpolab")


class TrainingError(RuntimeError):
    """A run cannot go on (for example a non-finite loss); checkpoints and metrics are intact."""


class CheckpointError(RuntimeError):
    """A checkpoint file is unreadable."""


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
    sampled_rows: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _columns(rows: list[dict]) -> dict[str, list]:
    keys = [k for k in rows[0] if k != "prompt"] if rows else []
    return {k: [r.get(k) for r in rows] for k in keys}


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
    ) -> None:
        if not train_rows:
            raise ValueError("no training prompts")
        self.cfg = cfg
        self.backend = backend
        self.train_rows = train_rows
        self.heldout_rows = heldout_rows or []
        self.reward_fns = reward_fns
        self.out_dir = Path(out_dir or cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.rng = random.Random(cfg.seed)
        self.sampler = PromptSampler(
            len(train_rows),
            torch.Generator().manual_seed(cfg.seed + 1),
            curriculum=cfg.curriculum,
            floor=cfg.curriculum_floor,
            decay=cfg.curriculum_decay,
        )
        params = [p for p in backend.model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(params, lr=cfg.lr)
        self.step_num = 0
        self.metrics: MetricsWriter | None = None
        self.ckpt_dir = self.out_dir / "checkpoints"

    # ------------------------------------------------------------ sampling --
    def _sample_groups(self, idx: list[int]) -> tuple[Rollout, list[dict], torch.Tensor, list[str]]:
        g = self.cfg.group_size
        rows = [self.train_rows[i] for i in idx for _ in range(g)]
        ro = self.backend.generate(
            [r["prompt"] for r in rows], self.cfg.temperature, self.cfg.max_new_tokens, self.gen
        )
        res = score(
            self.reward_fns,
            ro.prompts,
            ro.completions,
            _columns(rows),
            weights=self.cfg.reward_weights or None,
            on_error=self.cfg.reward_on_error,
        )
        return ro, rows, res.total, res.problems

    def collect(self) -> Batch:
        """Sample this step's groups; with dynamic sampling, refill until every group is mixed."""
        cfg, g = self.cfg, self.cfg.group_size
        n = cfg.prompts_per_step
        idx = self.sampler.draw(n)
        ro, rows, rewards, problems = self._sample_groups(idx)
        self._update_stats(idx, rewards)
        batch = Batch(ro, rows, rewards, answers_generated=len(rows),
                      sampled_rewards=[rewards], sampled_rows=list(rows), problems=problems)
        if not cfg.dynamic_sampling:
            return batch
        keep_ro: list[Rollout] = []
        keep_rows: list[dict] = []
        keep_r: list[torch.Tensor] = []
        kept = 0
        while True:
            live = ~adv_mod.dead_mask(rewards, g)
            for j in torch.nonzero(live).flatten().tolist():
                if kept == n:
                    break
                sl = list(range(j * g, (j + 1) * g))
                keep_ro.append(ro.select(sl))
                keep_rows += rows[j * g : (j + 1) * g]
                keep_r.append(rewards[j * g : (j + 1) * g])
                kept += 1
            if kept == n or batch.rounds > cfg.max_sampling_rounds:
                break
            idx = self.sampler.draw(n)
            ro, rows, rewards, more = self._sample_groups(idx)
            self._update_stats(idx, rewards)
            batch.rounds += 1
            batch.answers_generated += len(rows)
            batch.sampled_rewards.append(rewards)
            batch.sampled_rows += rows
            batch.problems += more
        batch.cap_hit = kept < n
        if batch.cap_hit:
            log.warning(
                "dynamic sampling: cap of %d extra rounds hit at step %d; training on %d of %d "
                "mixed groups", cfg.max_sampling_rounds, self.step_num + 1, kept, n,
            )
        if kept:
            batch.rollout = cat_rollouts(keep_ro, self.backend.pad_id)
            batch.rows = keep_rows
            batch.rewards = torch.cat(keep_r)
        else:
            batch.rollout, batch.rows, batch.rewards = ro.select([]), [], rewards[:0]
        return batch

    def _update_stats(self, idx: list[int], rewards: torch.Tensor) -> None:
        ok = (rewards >= self.cfg.success_threshold).float().reshape(-1, self.cfg.group_size)
        self.sampler.update(idx, ok.mean(1).tolist())

    # -------------------------------------------------------------- update --
    def update(self, batch: Batch) -> dict[str, float]:
        """mu optimisation passes over one batch with the clipped GRPO objective."""
        cfg = self.cfg
        if not batch.rows:
            return {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clip_frac": 0.0,
                    "grad_norm": 0.0}
        adv = adv_mod.group_advantages(
            batch.rewards.float(), cfg.group_size, baseline=cfg.baseline, scale=cfg.scale,
            std=cfg.std, std_eps=cfg.std_eps, min_std=cfg.min_std,
        )
        ro, mask = batch.rollout, batch.rollout.completion_mask
        ref_lp = None
        with torch.no_grad():
            if cfg.beta > 0:
                ref_lp = self.backend.logprobs(ro, cfg.temperature, reference=True)
            old_lp = self.backend.logprobs(ro, cfg.temperature) if cfg.epochs > 1 else None
        self.backend.model.train()
        out: dict[str, float] = {}
        for _ in range(cfg.epochs):
            lp = self.backend.logprobs(ro, cfg.temperature)
            res = grpo_loss(
                lp, lp.detach() if old_lp is None else old_lp, ref_lp, adv, mask,
                beta=cfg.beta, eps_low=cfg.eps_low, eps_high=cfg.eps_high, agg=cfg.loss_agg,
                norm_len=cfg.max_new_tokens,
            )
            if not torch.isfinite(res.loss):
                raise TrainingError(
                    f"non-finite loss ({float(res.loss)}) at step {self.step_num + 1}; "
                    f"last checkpoint and metrics in {self.out_dir} are intact"
                )
            self.opt.zero_grad(set_to_none=True)
            res.loss.backward()
            params = [p for p in self.backend.model.parameters() if p.requires_grad]
            gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            self.opt.step()
            out = {"loss": float(res.loss.detach()), "policy_loss": res.policy_loss, "kl": res.kl,
                   "clip_frac": res.clip_frac, "grad_norm": float(gn)}
        self.backend.model.eval()
        return out

    # ---------------------------------------------------------- measuring --
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Greedy held-out accuracy: share of answers whose reward reaches success_threshold."""
        rows = self.heldout_rows[: self.cfg.eval_size]
        if not rows:
            return None
        ro = self.backend.generate([r["prompt"] for r in rows], 0.0, self.cfg.max_new_tokens)
        res = score(self.reward_fns, ro.prompts, ro.completions, _columns(rows),
                    weights=self.cfg.reward_weights or None, on_error=self.cfg.reward_on_error)
        return float((res.total >= self.cfg.success_threshold).float().mean())

    def _predicted_dead(self, rows: list[dict]) -> float | None:
        p = self.backend.pass_probability(rows, self.cfg.temperature)
        return None if p is None else adv_mod.predicted_dead_share(p, self.cfg.group_size)

    def step(self) -> dict[str, Any]:
        """One GRPO step; returns the metrics record written for it."""
        cfg, g = self.cfg, self.cfg.group_size
        t0 = time.perf_counter()
        batch = self.collect()
        # Predicted from the same (not yet updated) policy that produced the measured groups.
        predicted = self._predicted_dead(batch.sampled_rows[::g])
        sampled = torch.cat(batch.sampled_rewards)
        ds = adv_mod.dead_stats(sampled, g, cfg.success_threshold)
        t_sample = time.perf_counter() - t0
        upd = self.update(batch)
        self.step_num += 1
        batch_rows = len(batch.rows)
        acc = self.evaluate() if (self.step_num % cfg.eval_every == 0
                                  or self.step_num == cfg.steps) else None
        useful = batch_rows if cfg.dynamic_sampling else int(
            (~adv_mod.dead_mask(batch.rewards, g)).sum()) * g
        rec = {
            "step": self.step_num,
            "reward_mean": float(sampled.float().mean()),
            "reward_std": float(sampled.float().std()) if sampled.numel() > 1 else 0.0,
            "accuracy_train": float((sampled >= cfg.success_threshold).float().mean()),
            "heldout_acc": acc,
            "groups": ds.groups,
            "dead_share": ds.dead_share,
            "dead_all_right_share": ds.all_right_share,
            "dead_all_wrong_share": ds.all_wrong_share,
            "predicted_dead_share": predicted,
            "trained_groups": batch_rows // g,
            "answers_generated": batch.answers_generated,
            "useful_answers": useful,
            "answers_per_useful": (batch.answers_generated / useful) if useful else None,
            "sampling_rounds": batch.rounds,
            "sampling_cap_hit": batch.cap_hit,
            "completion_len": float(batch.rollout.completion_mask.sum(1).float().mean())
            if batch_rows else 0.0,
            "reward_problems": len(batch.problems),
            **upd,
            "time_sample_s": t_sample,
            "time_step_s": time.perf_counter() - t0,
        }
        if self.metrics:
            self.metrics.write(rec)
        return rec

    def train(self, resume: bool = False, on_step: Callable[[dict], None] | None = None) -> list:
        """Run to ``cfg.steps``; with ``resume`` continue from the last checkpoint in out_dir."""
        cfg = self.cfg
        start = 0
        if resume:
            start = self.load_checkpoint()
        self.metrics = MetricsWriter(self.out_dir / "metrics.jsonl",
                                     resume_after_step=start if resume else None)
        records = []
        if start == 0:
            rec0 = {"step": 0, "heldout_acc": self.evaluate()}
            self.metrics.write(rec0)
            records.append(rec0)
        it = range(start, cfg.steps)
        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(it, desc=f"GRPO G={cfg.group_size}", initial=start, total=cfg.steps)
            it = bar
        for _ in it:
            rec = self.step()
            records.append(rec)
            if bar is not None:
                bar.set_postfix(reward=f"{rec['reward_mean']:.2f}",
                                dead=f"{rec['dead_share']:.2f}",
                                acc="-" if rec["heldout_acc"] is None else f"{rec['heldout_acc']:.2f}")
            if on_step:
                on_step(rec)
            if cfg.checkpoint_every and (self.step_num % cfg.checkpoint_every == 0
                                         or self.step_num == cfg.steps):
                self.save_checkpoint()
        return records

    # --------------------------------------------------------- checkpoints --
    def state(self) -> dict[str, Any]:
        return {
            "step": self.step_num,
            "config": to_dict(self.cfg),
            "backend": self.backend.state_dict(),
            "optimizer": self.opt.state_dict(),
            "gen": self.gen.get_state(),
            "sampler_gen": self.sampler.generator.get_state(),
            "sampler": self.sampler.state_dict(),
            "rng": self.rng.getstate(),
            "torch_rng": torch.get_rng_state(),
        }

    def save_checkpoint(self) -> Path:
        """Write atomically (temp file, fsync, rename); the previous checkpoint becomes prev.pt."""
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        last, prev = self.ckpt_dir / "last.pt", self.ckpt_dir / "prev.pt"
        buf = io.BytesIO()
        torch.save(self.state(), buf)
        tmp = self.ckpt_dir / f".last.pt.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        if last.exists():
            os.replace(last, prev)
        os.replace(tmp, last)
        return last

    def load_checkpoint(self, path: str | os.PathLike | None = None) -> int:
        """Restore everything a bitwise-identical continuation needs; returns the step reached."""
        candidates = [Path(path)] if path else [self.ckpt_dir / "last.pt", self.ckpt_dir / "prev.pt"]
        errors = []
        for p in candidates:
            if not p.exists():
                continue
            try:
                st = torch.load(p, map_location="cpu", weights_only=False)
                self._restore(st)
            except Exception as e:  # noqa: BLE001 - any unreadable file is reported the same way
                errors.append(f"{p}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                log.warning("checkpoint %s is unreadable (%s); trying the previous one", p,
                            errors[-1])
                continue
            return self.step_num
        if errors:
            raise CheckpointError("no readable checkpoint: " + "; ".join(errors))
        raise CheckpointError(f"no checkpoint to resume from in {self.ckpt_dir}")

    def _restore(self, st: dict[str, Any]) -> None:
        self.backend.load_state_dict(st["backend"])
        self.opt.load_state_dict(st["optimizer"])
        self.gen.set_state(st["gen"])
        self.sampler.generator.set_state(st["sampler_gen"])
        self.sampler.load_state_dict(st["sampler"])
        self.rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        self.step_num = int(st["step"])
