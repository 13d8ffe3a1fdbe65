"""Rollout collection: which prompts a step samples, their groups, scores, and dynamic sampling.

``Collector.collect`` is one step's sampling: draw ``prompts_per_step`` prompts
(``choose_prompts``: uniform, or the curriculum's weights), sample G answers to each through the
backend, score them, and with dynamic sampling (DAPO) sample further rounds until the batch
holds that many mixed-reward groups (or the round cap is hit). Under torchrun every rank draws
the same prompts and samples its own contiguous shard of whole groups.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from . import advantages as adv_mod
from . import dist
from .config import Config
from .curriculum import PromptSampler
from .rollout import Backend, Rollout, cat_rollouts
from .scoring import Scorer, ScoreResult

log = logging.getLogger("grpolab")


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


class Collector:
    """Samples and scores each step's groups; owns nothing a checkpoint must save (the prompt
    sampler and the sampling generator are the trainer's)."""

    def __init__(self, cfg: Config, backend: Backend, rows: list[dict], scorer: Scorer,
                 generator: torch.Generator, sampler: PromptSampler) -> None:
        self.cfg, self.backend, self.rows, self.scorer = cfg, backend, rows, scorer
        self.gen, self.sampler = generator, sampler

    def choose_prompts(self, n: int) -> list[int]:
        """The n distinct prompts (indices into the training rows) a sampling round uses."""
        return self.sampler.draw(n)

    def observe(self, idx: list[int], ok: torch.Tensor) -> None:
        """Each drawn prompt's group pass rate, for the curriculum's running statistics."""
        rate = ok.float().reshape(-1, self.cfg.group_size).mean(1)
        self.sampler.update(idx, rate.tolist())

    def sample_groups(self, idx: list[int]) -> tuple[Rollout, list[dict], ScoreResult]:
        """G answers to each prompt in ``idx``, scored."""
        cfg = self.cfg
        rows = [self.rows[i] for i in idx for _ in range(cfg.group_size)]
        ro = self.backend.generate([r["prompt"] for r in rows], cfg.temperature,
                                   cfg.max_new_tokens, self.gen)
        return ro, rows, self.scorer(ro.prompts, ro.completions, rows, cfg.group_size)

    def sample_round(
        self, n: int
    ) -> tuple[Rollout, list[dict], ScoreResult, torch.Tensor, torch.Tensor, int]:
        """Every rank draws the same n prompts and samples its contiguous shard of whole groups.

        Returns this rank's rollout, rows and scores, every rank's rewards and successes in
        prompt order (for statistics and group selection), and where this rank's groups start.
        """
        idx = self.choose_prompts(n)
        lo, hi = dist.shard(len(idx))
        ro, rows, res = self.sample_groups(idx[lo:hi])
        everyone = dist.gather_cat(res.total)
        ok = dist.gather_cat(res.success(self.cfg.success_threshold).float()).bool()
        self.observe(idx, ok)  # identical on every rank: samplers stay in step
        return ro, rows, res, everyone, ok, lo

    def collect(self, step: int = 0) -> Batch:
        """Sample step ``step + 1``'s groups; with dynamic sampling, refill until every group is
        mixed."""
        cfg, g = self.cfg, self.cfg.group_size
        n = cfg.prompts_per_step
        ro, rows, res, everyone, ok, lo = self.sample_round(n)
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
            ro, rows, res, everyone, ok, lo = self.sample_round(n)
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
                "mixed groups", cfg.max_sampling_rounds, step + 1, kept, n,
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
