"""What a run reports: each step's metrics record, the JSONL it goes to, plots and tables.

``step_record`` builds the line ``metrics.jsonl`` gets for every GRPO step (the place to add a
metric); ``sample_record`` the groups ``samples.jsonl`` shows; ``MetricsWriter`` writes them
(flushed and fsynced, one run per file); ``plot_run``, ``summarize`` and ``plot_sweep`` read
them back.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpolab.run import dist
from grpolab.run.plots import plot_run

log = logging.getLogger("grpolab")

if TYPE_CHECKING:
    from torch import Tensor

    from grpolab.config import Config
    from grpolab.core.advantages import DeadStats
    from grpolab.run.collect import Batch


def step_record(cfg: Config, step: int, batch: Batch, sampled: Tensor, sampled_ok: Tensor,
                ds: DeadStats, predicted: float | None, heldout_acc: float | None,
                heldout_pass_prob: float | None, update: dict[str, float], t0: float,
                t_sample: float, posterior: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metrics line of GRPO step ``step``: rewards and accuracy of every answer sampled,
    held-out accuracy, dead groups (measured and predicted; ``posterior``: the pass-rate
    posteriors' P(dead) per group, ``Collector.outcomes``), what sampling cost, the update's
    numbers (``update``) and timings. Collective under torchrun (every rank gets the global
    record)."""
    g = cfg.group_size
    posterior = posterior or {}
    # The answers of the live groups trained on: with dynamic sampling the kept groups,
    # without it the one sampled round's live groups (every rank's).
    if cfg.dynamic_sampling and batch.group_sizes is not None:  # ragged groups kept
        useful = int(dist.all_reduce_sum([float(sum(batch.group_sizes))])[0])
    elif cfg.dynamic_sampling:
        useful = batch.trained_groups * g
    elif "group_sizes" in posterior:  # ragged groups: the live groups' answers
        useful = sum(n for n, d in zip(posterior["group_sizes"], posterior["group_dead"]) if not d)
    else:
        useful = (ds.groups - ds.dead) * g
    if "zero_advantage_answers" in update:  # token-level estimators: answers with a signal
        useful = round(update["trained_answers"] - update["zero_advantage_answers"])
    lens = dist.gather_cat(batch.rollout.completion_mask.sum(1))
    cut = batch.rollout.truncated
    cut_all = dist.gather_cat(cut.float()) if cut is not None else None
    problems = int(dist.all_reduce_sum([len(batch.problems)])[0])
    names = list(batch.reward_sums)
    if dist.is_dist():  # (a verl dict's numbers may reach some ranks only: every rank's names)
        names = sorted(set().union(*dist.all_gather_object(names)))
    fn_sums = dist.all_reduce_sum([batch.reward_sums.get(k, 0.0) for k in names]
                                  + [batch.reward_counts.get(k, 0.0) for k in names]
                                  ) if names else []
    scored = sampled[~sampled.isnan()].float()  # (every answer, but those no reward scored)
    return {
        "step": step,
        "reward_mean": float(scored.mean()) if scored.numel() else 0.0,
        "reward_std": float(scored.std()) if scored.numel() > 1 else 0.0,
        "accuracy_train": float(sampled_ok.float().mean()),
        "heldout_acc": heldout_acc,
        "heldout_pass_prob": heldout_pass_prob,
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
        "unscored_answers": int(sampled.isnan().sum()),  # (every reward said None)
        **posterior,  # P(dead) from the pass-rate posteriors vs dead, per group
        # each reward function's mean over the answers it scored (before weighting)
        **{f"rewards/{k}": v / n if n else None
           for k, v, n in zip(names, fn_sums, fn_sums[len(names):])},
        **update,
        "time_sample_s": t_sample,
        "time_step_s": time.perf_counter() - t0,
        **peak_memory(),
    }


def peak_memory() -> dict[str, float]:
    """This process's high-water marks so far, in MiB: resident memory (model, optimizer,
    activations, imports: what a CPU run needs) and, once CUDA is in use, the GPU's peak
    allocated by torch (what limits a GPU run)."""
    import resource

    import torch

    out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def by_difficulty(rows: list[dict], ok: Tensor, lo: int = 0) -> dict[str, float] | None:
    """Held-out accuracy per value of the rows' ``difficulty`` column (None without one);
    ``ok`` scores ``rows[lo:lo + len(ok)]`` (this rank's slice; collective under torchrun)."""
    kinds = sorted({str(r["difficulty"]) for r in rows if r.get("difficulty") is not None})
    if not kinds:
        return None
    ids = {k: i for i, k in enumerate(kinds)}
    sums = [0.0] * (2 * len(kinds))
    for r, o in zip(rows[lo:lo + len(ok)], ok.tolist()):
        if r.get("difficulty") is not None:
            i = ids[str(r["difficulty"])]
            sums[2 * i] += float(o)
            sums[2 * i + 1] += 1.0
    sums = dist.all_reduce_sum(sums)
    return {k: sums[2 * i] / sums[2 * i + 1] for i, k in enumerate(kinds) if sums[2 * i + 1]}


def sample_record(batch: Batch, group_size: int, groups: int,
                  advantages: Tensor | None) -> list[dict[str, Any]]:
    """The first ``groups`` groups trained on (this rank's): what the policy wrote, its rewards
    and the ``advantages`` [B] they gave, for reading a run, not just its averages. Groups may
    differ in size (``batch.group_sizes``)."""
    import torch

    from grpolab.core.advantages import dead_mask, unscored
    from grpolab.run.heldout import plain

    sizes = (batch.group_sizes or [group_size] * (len(batch.rows) // group_size))[:groups]
    n = sum(sizes)
    if not n:
        return []
    rewards = batch.rewards[:n].float()
    per_fn = batch.rewards_per_fn
    if per_fn is not None:  # (null: no reward scored the answer)
        rewards = torch.where(unscored(per_fn[:n]), torch.nan, rewards)
    names = batch.reward_names if per_fn is not None and len(batch.reward_names) > 1 else []
    adv = advantages[:n]
    out = []
    lo = 0
    for k in sizes:
        row, hi = batch.rows[lo], lo + k
        out.append({
            "prompt": row["prompt"],
            **({"answer": str(row["answer"])} if row.get("answer") is not None else {}),
            "completions": batch.rollout.completions[lo:hi],
            "rewards": plain(rewards[lo:hi]),
            **({"per_reward": {name: plain(per_fn[lo:hi, j].float()) for j, name in enumerate(names)}}
               if names else {}),
            "advantages": adv[lo:hi].tolist(),
            "dead": bool(dead_mask(rewards[lo:hi], k)[0]),
        })
        lo = hi
    return out


class RunMismatchError(ValueError):
    """A metrics file holds lines of another run: writing here would mix two runs."""


class MetricsWriter:
    """Append-only JSONL of one run; each line is flushed and fsynced so a killed run loses
    nothing, and carries ``run_id`` so lines of two runs can never pass for one.

    A new run (``resume_after_step`` None) starts an empty file and refuses to wipe one that
    holds lines (the caller clears the folder first when the user asked to overwrite). A
    resumed run keeps its own lines up to the checkpoint's step and refuses a file with lines
    of another run.
    """

    def __init__(self, path: str | os.PathLike, resume_after_step: int | None = None,
                 run_id: str | None = None, first: int = 0) -> None:
        self.path = Path(path)
        self.run_id = run_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        old = read_metrics(self.path)
        if resume_after_step is None:
            if old:
                raise RunMismatchError(f"{self.path} already holds {len(old)} lines of another "
                                       "run; not overwriting them")
            self.path.write_text("")
            return
        others = sorted({str(r["run_id"]) for r in old if r.get("run_id") not in (None, run_id)})
        if run_id is not None and others:
            raise RunMismatchError(f"{self.path} holds lines of run {', '.join(others)}, the "
                                   f"checkpoint is of run {run_id}: they are not one run")
        keep = [r for r in old if r.get("step", -1) <= resume_after_step]
        lost = sorted(set(range(first, resume_after_step + 1)) - {r.get("step") for r in keep})
        if lost and (old or not first):  # (a damaged or deleted log: said, not silently
            # short; ``first``: its first step; a samples log with no line: one just turned on)
            log.warning(
                "%s has no readable line of step%s %s (damaged or removed?); the run goes on "
                "from step %d without them", self.path, "s" * (len(lost) > 1),
                ", ".join(map(str, lost[:10])) + (" ..." if len(lost) > 10 else ""),
                resume_after_step)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        if self.run_id is not None:
            record = {**record, "run_id": self.run_id}
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())


# the fields summaries and plots compute with: a line where one is not a number is not read
_NUMBERS = ("reward_mean", "heldout_acc", "heldout_pass_prob", "train_pass_prob",
            "heldout_check_acc", "dead_share", "dead_all_right_share", "dead_all_wrong_share",
            "predicted_dead_share", "posterior_dead_share", "completion_len", "useful_answers",
            "answers_generated", "peak_rss_mib", "peak_gpu_mib")


def _sound(record: Any) -> bool:
    """A metrics (or samples) line as the writer writes them: an object with an integer step,
    and numbers (or null) where summaries and plots compute (a line edited or damaged into
    another shape would stop them, after the training, with a traceback); ``groups``: a count
    (metrics) or the groups themselves (samples)."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    return (isinstance(record, dict) and number(step := record.get("step"))
            and isinstance(step, int)
            and all(record.get(k) is None or number(record[k]) for k in _NUMBERS)
            and isinstance(record.get("groups", 0), (int, float, list))
            and all(record.get(k) is None or isinstance(record[k], list)
                    and all(map(number, record[k])) for k in ("group_dead_prob", "group_dead")))


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete, sound line of a metrics file (a torn last line from a kill is skipped,
    and so is a line that is not a metrics record: ``_sound``)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if _sound(record):
            out.append(record)
    return out


def summarize(rows: list[dict]) -> dict[str, Any]:
    """The numbers a sweep table shows for one run."""
    from grpolab.predict.posterior import calibration_summary
    steps = [r for r in rows if r.get("step", 0) >= 1]
    dead = [r["dead_share"] for r in steps if "dead_share" in r]
    pred = [r["predicted_dead_share"] for r in steps if r.get("predicted_dead_share") is not None]
    acc0, acc1 = _first_last(rows, "heldout_acc")
    p0, p1 = _first_last(rows, "heldout_pass_prob")
    t0, t1 = _first_last(rows, "train_pass_prob")
    watch = {}
    if any(r.get("heldout_check_acc") is not None for r in rows):
        c0, c1 = _first_last(rows, "heldout_check_acc")
        watch = {"start_heldout_check_acc": c0, "final_heldout_check_acc": c1,
                 "hacking_suspected_steps": [r["step"] for r in steps
                                             if r.get("hacking_suspected")]}
    useful = sum(r.get("useful_answers") or 0 for r in steps)
    generated = sum(r.get("answers_generated", 0) for r in steps)
    return {
        **watch,
        **_waste_vs_success(steps),
        "useful_answers": useful,
        "answers_per_useful": generated / useful if useful else float("nan"),
        "steps": len(steps),
        "mean_dead_share": sum(dead) / len(dead) if dead else float("nan"),
        # of all dead groups over the run, the share that was all right
        "all_right_share_of_dead": _all_right_of_dead(steps),
        "mean_predicted_dead_share": sum(pred) / len(pred) if pred else float("nan"),
        "start_heldout_acc": acc0,
        "final_heldout_acc": acc1,
        "start_heldout_pass_prob": p0,
        "final_heldout_pass_prob": p1,
        "answers_generated": sum(r.get("answers_generated", 0) for r in steps),
        "heldout_acc_gain": acc1 - acc0,
        "heldout_pass_prob_gain": p1 - p0,
        "start_train_pass_prob": t0,
        "final_train_pass_prob": t1,
        "mean_reward": (sum(r["reward_mean"] for r in steps) / len(steps)) if steps else float("nan"),
        **calibration_summary(steps),  # the posteriors' Brier score and reliability table
        **{k: max(r[k] for r in steps if k in r)
           for k in ("peak_rss_mib", "peak_gpu_mib") if any(k in r for r in steps)},
    }


def _all_right_of_dead(steps: list[dict]) -> float:
    steps = [r for r in steps if not isinstance(r.get("groups"), list)]  # (a samples line)
    right = sum((r.get("dead_all_right_share") or 0.0) * r.get("groups", 0) for r in steps)
    dead = sum((r.get("dead_share") or 0.0) * r.get("groups", 0) for r in steps)
    return right / dead if dead else float("nan")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _corr(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation (None, written as JSON null, when a series is constant or too short)."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def _waste_vs_success(steps: list[dict], k: int = 10) -> dict[str, float]:
    """Does the waste grow as training succeeds? Dead share, its all-right part and training
    reward over the first and last ``k`` steps, and the per-step correlation of the all-right
    dead share with held-out accuracy (T=1 exact where the world reports it, else greedy)."""
    rows = [r for r in steps if "dead_share" in r]
    first, last = rows[:k], rows[-k:]
    out = {}
    for key, name in (("dead_share", "dead_share"), ("dead_all_right_share", "dead_all_right"),
                      ("reward_mean", "reward")):
        out[f"{name}_first{k}"] = _mean([r[key] for r in first if key in r])
        out[f"{name}_last{k}"] = _mean([r[key] for r in last if key in r])
    acc_key = ("heldout_pass_prob" if any(r.get("heldout_pass_prob") is not None for r in rows)
               else "heldout_acc")
    pairs = [(r["dead_all_right_share"], r[acc_key]) for r in rows
             if r.get(acc_key) is not None and "dead_all_right_share" in r]
    out["corr_all_right_dead_vs_acc"] = _corr([a for a, _ in pairs], [b for _, b in pairs])
    pairs = [(r["dead_share"], r[acc_key]) for r in rows if r.get(acc_key) is not None]
    out["corr_dead_vs_acc"] = _corr([a for a, _ in pairs], [b for _, b in pairs])
    return out


def _first_last(rows: list[dict], key: str) -> tuple[float, float]:
    """The first and last recorded value of ``key`` (NaN, NaN when it was never recorded)."""
    vals = [r[key] for r in rows if r.get(key) is not None]
    return (vals[0], vals[-1]) if vals else (float("nan"), float("nan"))


def finish_run(out: Path, plot_name: str, title: str, lengths: bool = False,
               calibration_title: str = "", **fields: Any) -> dict[str, Any]:
    """The end of every run: its plot (``plot_name``), ``calibration.png`` (the pass-rate
    posteriors' P(dead) against the groups' outcomes, ``plots.plot_calibration``) and
    ``summary.json`` (``fields`` then the numbers of ``report.summarize``), from the metrics on
    disk; returns the summary."""
    from grpolab.run.plots import plot_calibration

    rows = read_metrics(out / "metrics.jsonl")
    plot_run(rows, out / plot_name, title, lengths=lengths)
    plot_calibration(rows, out / "calibration.png", calibration_title or title)
    summary = {**fields, **summarize(rows)}
    (out / "summary.json").write_text(json.dumps(_no_nan(summary), indent=2))  # (valid JSON)
    return summary


def _no_nan(value: Any) -> Any:
    """``value`` with every float NaN (an undefined mean: no steps, no dead group) as None."""
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value
