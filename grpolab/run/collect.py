"""Rollout collection: which prompts a step samples, their groups, scores, and dynamic sampling.

``Collector.collect`` is one step's sampling: draw ``prompts_per_step`` prompts
(``choose_prompts``: uniform, or the curriculum's weights), sample G answers to each through the
backend, score them, and with dynamic sampling (DAPO) sample further rounds until the batch
holds that many mixed-reward groups (or the round cap is hit). Under torchrun every rank draws
the same prompts and samples its own contiguous shard of whole groups.

Every group's P(dead) is predicted from per-prompt Beta pass-rate posteriors before it is
scored (``grpolab.predict.posterior``), for any backend; with ``allocate`` the posteriors also choose the
prompts and their group sizes (``grpolab.predict.allocate``: ragged groups). ``outcomes`` measures a
step's groups against those predictions, and ``end_step`` raises the no-signal alarm
(``grpolab.predict.alarm``).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from grpolab.config import Config, ConfigError
from grpolab.core import advantages as adv_mod
from grpolab.data.files import fingerprint
from grpolab.predict.alarm import NoSignalAlarm
from grpolab.predict.allocate import allocate_by_kind, allocate_table, size_axis
from grpolab.predict.curriculum import PromptSampler
from grpolab.predict.posterior import PASS_RATE_PRIORS
from grpolab.rewards.scorer import Scorer, ScoreResult
from grpolab.rollout.backend import Backend
from grpolab.rollout.batch import Rollout, cat_rollouts
from grpolab.rollout.sampling import NO_FILTERS, Filters
from grpolab.run import dist

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
    reward_counts: dict[str, float] = field(default_factory=dict)  # the answers it scored
    rewards_per_fn: torch.Tensor | None = None  # [B, K] each reward function's, as rewards
    group_sizes: list[int] | None = None  # trained groups' sizes (this rank's); None = group_size
    reward_names: list[str] = field(default_factory=list)  # rewards_per_fn's columns

    # Under torchrun, rollout/rows/rewards/sampled_rows/problems/reward_sums are this rank's;
    # sampled_rewards and sampled_success (every rank's, in prompt order), answers_generated
    # and trained_groups are global.

    def add_scores(self, res: ScoreResult) -> None:
        self.reward_names = list(res.names)
        cols = {**{name: res.per_fn[:, j] for j, name in enumerate(res.names)}, **res.extras}
        for name, col in cols.items():  # (a None, NaN here, is left out: TRL's nanmean)
            self.reward_sums[name] = self.reward_sums.get(name, 0.0) + float(col.nansum())
            self.reward_counts[name] = (self.reward_counts.get(name, 0.0)
                                        + float((~col.isnan()).sum()))


def first_judged(res: ScoreResult, on: str) -> torch.Tensor:
    """[B] what dynamic sampling judges a group by, besides the total: the first reward's score
    (``first``), or (``acc``) its verl dict's ``acc`` where an answer's dict gave one."""
    acc = res.extras.get(f"{res.names[0]}/acc") if on == "acc" and res.names else None
    return res.per_fn[:, 0] if acc is None else torch.where(acc.isnan(), res.per_fn[:, 0], acc)


def kinds_of(rows: list[dict], column: str) -> tuple[torch.Tensor | None, list[str]]:
    """[N] the kind id of each row by its ``column`` value, and the values by id (None, []
    without a column)."""
    if not column:
        return None, []
    missing = sum(column not in r for r in rows)
    if missing:
        raise ConfigError(f"predict_group_by {column!r}: {missing} of the {len(rows)} training "
                          "rows have no such column")
    names = sorted({str(r[column]) for r in rows})
    ids = {name: i for i, name in enumerate(names)}
    return torch.tensor([ids[str(r[column])] for r in rows], dtype=torch.long), names


class Collector:
    """Samples and scores each step's groups. Of its state only the pass-rate posteriors
    (``tracker``) go into a checkpoint (the prompt sampler and the sampling generator are the
    trainer's)."""

    def __init__(self, cfg: Config, backend: Backend, rows: list[dict], scorer: Scorer,
                 generator: torch.Generator, sampler: PromptSampler) -> None:
        self.cfg, self.backend, self.rows, self.scorer = cfg, backend, rows, scorer
        self._digest: str | None = None  # (the rows' fingerprint, once asked: state_dict)
        self.gen, self.sampler = generator, sampler
        # the config's sampling settings are what the backend draws with
        filters, built = Filters.of(cfg), getattr(backend, "filters", None)
        if built is None and filters != NO_FILTERS:
            raise ConfigError(f"{type(backend).__name__} applies no sampling filters (top_k, "
                              "top_p, min_p, repetition_penalty); leave them at their defaults")
        if built not in (None, NO_FILTERS, filters):
            raise ConfigError(f"the backend was built to sample with {built}, the config says "
                              f"{filters}; give the config's")
        if built is not None:
            backend.filters = filters
        kinds, self.kind_names = kinds_of(rows, cfg.predict_group_by)
        self.tracker = PASS_RATE_PRIORS[cfg.predict_prior](len(rows), cfg.predict_decay,
                                                           cfg.predict_prior_strength, kinds)
        self.alarm = NoSignalAlarm(cfg.alarm_truncated_share)
        # this step's sampled groups, per round: (global sizes [N], P(dead) predicted before
        # scoring [N], truncated answers [B] or None)
        self.rounds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.local_sizes: list[list[int]] = []  # this rank's group sizes, per round
        self.told_unscored = False  # (answers no reward scored: said once a run)

    def choose_prompts(self, n: int, taken: set[int] | None = None
                       ) -> tuple[list[int], list[int]]:
        """A round's prompts (indices into the training rows) and group sizes, the same on
        every rank: n distinct prompts from the sampler at group_size each, or with
        ``allocate`` what the allocator buys with ``budget`` answers from the posteriors,
        among the prompts not ``taken`` (the step's earlier rounds': the posteriors have just
        seen those live and would choose them again), adding its choice to them."""
        cfg = self.cfg
        if not cfg.allocate:
            return self.sampler.draw(n), [cfg.group_size] * n
        lo, hi = cfg.allocate_min_group, cfg.allocate_max_group
        taken = set() if taken is None else taken
        free = torch.ones(len(self.rows), dtype=torch.bool)
        free[list(taken)] = False
        if not bool(free.any()):  # (every prompt had: any again)
            free[:] = True
        dead = self.tracker.dead_table(size_axis(lo, hi))
        how: dict[str, Any] = {"objective": cfg.allocate_objective,
                               "explore": cfg.allocate_explore,
                               "generator": self.sampler.generator}
        for _ in range(2):  # (a kind's prompts all had, the others' quota none: any again)
            if cfg.allocate_by_kind:
                idx, sizes = allocate_by_kind(dead, self.tracker.kinds, cfg.budget, lo, hi,
                                              free=free, **how)
            else:
                cand = torch.nonzero(free).flatten()
                i, sizes = allocate_table(dead[cand], cfg.budget, lo, hi, **how)
                idx = cand[i].tolist()
            if idx:
                break
            free[:] = True
        taken.update(idx)
        return idx, sizes

    def observe(self, idx: list[int], ok: torch.Tensor, sizes: list[int]) -> None:
        """Each drawn prompt's group pass rate, for the curriculum's running statistics; each
        group's P(dead) predicted from the posteriors, then its outcome added to them."""
        g = self.cfg.group_size
        right = adv_mod.group_successes(ok, sizes)
        rate = (ok.float().reshape(-1, g).mean(1) if all(n == g for n in sizes)
                else right / torch.as_tensor(sizes, dtype=torch.float64))
        self.sampler.update(idx, rate.tolist())
        self.rounds.append((torch.as_tensor(sizes), self.tracker.dead_probability(idx, sizes),
                            None))
        self.tracker.observe(idx, right, sizes)

    def sample_groups(self, idx: list[int], sizes: list[int] | None = None,
                      ) -> tuple[Rollout, list[dict], ScoreResult]:
        """G answers (or ``sizes[k]``) to each prompt in ``idx``, scored (user rewards see
        whole groups; ragged groups are scored as one)."""
        cfg, g = self.cfg, self.cfg.group_size
        sizes = sizes or [g] * len(idx)
        rows = [self.rows[i] for i, n in zip(idx, sizes) for _ in range(n)]
        ro = self.backend.generate([r["prompt"] for r in rows], cfg.temperature,
                                   cfg.max_new_tokens, self.gen)
        ragged = any(n != g for n in sizes)
        return ro, rows, self.scorer(ro.prompts, ro.completions, rows,
                                     len(rows) if ragged else g, ro.answer_ids)

    def sample_round(
        self, n: int, taken: set[int] | None = None
    ) -> tuple[Rollout, list[dict], ScoreResult, torch.Tensor, torch.Tensor, int]:
        """Every rank draws the same n prompts and samples its contiguous shard of whole groups.

        Returns this rank's rollout, rows and scores, every rank's rewards and successes in
        prompt order (for statistics and group selection), and where this rank's groups start.
        """
        idx, sizes = self.choose_prompts(n, taken)
        lo, hi = dist.shard(len(idx))
        self.local_sizes.append(sizes[lo:hi])
        ro, rows, res = self.sample_groups(idx[lo:hi], sizes[lo:hi])
        everyone = dist.gather_cat(res.scored_total)  # (NaN: no reward scored the answer)
        if not self.told_unscored and bool(everyone.isnan().any()) and dist.is_main():
            log.warning("%d of %d answers were scored by no reward (each returned None): they "
                        "are left out of their groups, advantage 0, as in TRL; unscored_answers "
                        "counts them a step", int(everyone.isnan().sum()), everyone.numel())
            self.told_unscored = True
        ok = dist.gather_cat(res.success(self.cfg.success_threshold).float()).bool()
        self.observe(idx, ok, sizes)  # identical on every rank: samplers stay in step
        cut = dist.gather_cat(ro.truncated.float()) if ro.truncated is not None else None
        self.rounds[-1] = (*self.rounds[-1][:2], cut)  # for the no-signal alarm
        return ro, rows, res, everyone, ok, lo

    def collect(self, step: int = 0) -> Batch:
        """Sample step ``step + 1``'s groups; with dynamic sampling, refill until every group is
        mixed: ``prompts_per_step`` groups, or with ``allocate`` (ragged groups) until live
        groups fill the budget of answers (a group that would overflow it is left out)."""
        cfg, g = self.cfg, self.cfg.group_size
        n = cfg.prompts_per_step
        self.rounds, self.local_sizes = [], []
        taken: set[int] = set()  # the step's prompts so far
        ro, rows, res, everyone, ok, lo = self.sample_round(n, taken)
        rewards = res.total
        batch = Batch(ro, rows, rewards, answers_generated=everyone.numel(),
                      sampled_rewards=[everyone], sampled_success=[ok], sampled_rows=list(rows),
                      problems=list(res.problems), trained_groups=everyone.numel() // g,
                      rewards_per_fn=res.per_fn)
        batch.add_scores(res)
        ragged = cfg.allocate
        if ragged:
            batch.trained_groups = len(self.rounds[-1][0])
            batch.group_sizes = list(self.local_sizes[-1])
        if not cfg.dynamic_sampling:
            return batch
        keep_ro: list[Rollout] = []
        keep_rows: list[dict] = []
        keep_r: list[torch.Tensor] = []
        keep_pf: list[torch.Tensor] = []
        keep_sizes: list[int] = []
        kept = kept_answers = 0

        def full() -> bool:
            if ragged:
                return cfg.budget - kept_answers < cfg.allocate_min_group
            return kept == n

        while True:
            # The choice is made on every rank's rewards, so all ranks agree on it.
            sizes = self.rounds[-1][0].tolist()  # this round's groups, every rank's
            judged = everyone if cfg.dynamic_sampling_on == "total" else dist.gather_cat(
                first_judged(res, cfg.dynamic_sampling_on))  # (verl's filter on acc / score)
            live = ~adv_mod.dead_mask_ragged(judged, adv_mod.group_ids_from_sizes(sizes))
            starts = [0, *itertools.accumulate(sizes)]
            hi = lo + len(self.local_sizes[-1])
            for j in torch.nonzero(live).flatten().tolist():
                if full():
                    break
                if ragged and kept_answers + sizes[j] > cfg.budget:
                    continue
                kept += 1
                kept_answers += sizes[j]
                if not lo <= j < hi:
                    continue
                a = starts[j] - starts[lo]
                sl = list(range(a, a + sizes[j]))
                keep_ro.append(ro.select(sl))
                keep_rows += [rows[i] for i in sl]
                keep_r.append(rewards[a : a + sizes[j]])
                keep_pf.append(res.per_fn[a : a + sizes[j]])
                keep_sizes.append(sizes[j])
            if full() or batch.rounds > cfg.max_sampling_rounds:
                break
            ro, rows, res, everyone, ok, lo = self.sample_round(n, taken)
            rewards = res.total
            batch.rounds += 1
            batch.answers_generated += everyone.numel()
            batch.sampled_rewards.append(everyone)
            batch.sampled_success.append(ok)
            batch.sampled_rows += rows
            batch.problems += res.problems
            batch.add_scores(res)
        batch.trained_groups = kept
        batch.cap_hit = not full()
        if ragged:
            batch.group_sizes = keep_sizes
        if batch.cap_hit and dist.is_main():
            what = (f"{kept_answers} of {cfg.budget} answers in mixed groups" if ragged
                    else f"{kept} of {n} mixed groups")
            log.warning("dynamic sampling: cap of %d extra rounds hit at step %d; training on %s",
                        cfg.max_sampling_rounds, step + 1, what)
        if keep_ro:
            batch.rollout = cat_rollouts(keep_ro, self.backend.pad_id)
            batch.rows = keep_rows
            batch.rewards = torch.cat(keep_r)
            batch.rewards_per_fn = torch.cat(keep_pf)
        else:
            batch.rollout, batch.rows, batch.rewards = ro.select([]), [], rewards[:0]
            batch.rewards_per_fn = res.per_fn[:0]
        return batch

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it: the pass-rate posteriors, the fingerprint of the
        rows they are of (``resume.changed_settings`` compares it), whether the unscored
        answers were said."""
        return {"pass_rates": self.tracker.state_dict(), "rows_sha256": self.rows_digest(),
                "told_unscored": self.told_unscored}

    def rows_digest(self) -> str:
        """The training rows' fingerprint, computed once (every checkpoint keeps it, and a
        resume compares the checkpoint's with it)."""
        if self._digest is None:
            self._digest = fingerprint(self.rows)
        return self._digest

    def load_state_dict(self, st: dict[str, Any]) -> None:
        """From a checkpoint's state (the trainer's, which holds this one's keys)."""
        if "pass_rates" in st:  # (older files have none: the posteriors start afresh)
            self.tracker.load_state_dict(st["pass_rates"])
        self.told_unscored = bool(st.get("told_unscored", False))  # (said once a run)

    # ------------------------------------------------------------ measuring the groups --
    def outcomes(self, batch: Batch, sampled: torch.Tensor, sampled_ok: torch.Tensor,
                 ) -> tuple[adv_mod.DeadStats, float | None, dict[str, Any]]:
        """The step's sampled groups (every round, every rank): dead counts, the exact
        predicted dead share (backends with exact pass rates: the world) from the same, not yet
        updated, policy, and the metrics of the posterior prediction, per group (P(dead), dead,
        size when ragged) and for the step."""
        cfg, g = self.cfg, self.cfg.group_size
        sizes = torch.cat([r[0] for r in self.rounds])
        dead_prob = torch.cat([r[1] for r in self.rounds])
        cuts = [r[2] for r in self.rounds]
        if cfg.allocate:
            ids = adv_mod.group_ids_from_sizes(sizes)
            ds = adv_mod.dead_stats_ragged(sampled, ids, sampled_ok)
            dead = adv_mod.dead_mask_ragged(sampled, ids)
            mine = [n for r in self.local_sizes for n in r]  # this rank's sampled groups
            firsts, at = [], 0  # the first answer of each
            for n in mine:
                firsts.append(batch.sampled_rows[at])
                at += n
            predicted = self.predicted_dead(firsts, mine)
        else:
            ds = adv_mod.dead_stats(sampled, g, sampled_ok)
            dead = adv_mod.dead_mask(sampled, g)
            predicted = self.predicted_dead(batch.sampled_rows[::g])
        cut = (float(torch.cat(cuts).mean()) if cuts and all(c is not None for c in cuts)
               and sum(c.numel() for c in cuts) else None)
        rec = {
            "posterior_dead_share": float(dead_prob.mean()) if dead_prob.numel() else None,
            "posterior_prior": self.tracker.prior_summary(),
            **({"posterior_kind_priors": {name: self.tracker.prior_summary(k) for k, name in
                                          enumerate(self.kind_names)}} if self.kind_names else {}),
            "group_dead_prob": [round(float(x), 4) for x in dead_prob],
            "group_dead": dead.int().tolist(),
            "sampled_truncated_share": cut,
            **({"group_sizes": sizes.tolist()} if cfg.allocate else {}),
        }
        return ds, predicted, rec

    def predicted_dead(self, rows: list[dict], sizes: torch.Tensor | None = None,
                       ) -> float | None:
        """Mean exact P(dead) of the groups whose prompts are ``rows`` (this rank's), from
        backends that know each answer's pass probability; None from the others."""
        p = self.backend.pass_probability(rows, self.cfg.temperature)
        if p is None:
            return None
        if sizes is not None:  # ragged groups: this rank's, so each rank's P(dead), then all
            dead = dist.gather_cat(adv_mod.group_dead_probability(p, sizes))
            return float(dead.mean()) if dead.numel() else 0.0
        return adv_mod.predicted_dead_share(dist.gather_cat(p), self.cfg.group_size)

    def end_step(self, step: int, rec: dict[str, Any], ds: adv_mod.DeadStats) -> None:
        """After the step's record: the loud no-signal alarm (``rec["no_signal"]``), then the
        posteriors' evidence fades."""
        # (PPO's and REINFORCE++'s baselines are not the group's: equal rewards are no alarm)
        grouped = self.cfg.estimator not in ("ppo", "reinforce_pp")
        rec["no_signal"] = (self.alarm.check(
            step, ds.groups, ds.dead, ds.all_right, ds.all_wrong,
            rec["sampled_truncated_share"], self.cfg.max_new_tokens, warn=dist.is_main(),
            unscored_share=rec.get("unscored_answers", 0) / max(rec["answers_generated"], 1))
            if grouped else None)
        self.tracker.end_step()
