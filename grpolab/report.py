"""What a run reports: each step's metrics record, the JSONL it goes to, plots and tables.

``step_record`` builds the line ``metrics.jsonl`` gets for every GRPO step (the place to add a
metric); ``sample_record`` the groups ``samples.jsonl`` shows; ``MetricsWriter`` writes them
(flushed and fsynced, one run per file); ``plot_run``, ``summarize`` and ``plot_sweep`` read
them back.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import dist

if TYPE_CHECKING:
    from torch import Tensor

    from .advantages import DeadStats
    from .collect import Batch
    from .config import Config


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
    lens = dist.gather_cat(batch.rollout.completion_mask.sum(1))
    cut = batch.rollout.truncated
    cut_all = dist.gather_cat(cut.float()) if cut is not None else None
    problems = int(dist.all_reduce_sum([len(batch.problems)])[0])
    names = list(batch.reward_sums)
    fn_sums = dist.all_reduce_sum([batch.reward_sums[k] for k in names]) if names else []
    return {
        "step": step,
        "reward_mean": float(sampled.float().mean()),
        "reward_std": float(sampled.float().std()) if sampled.numel() > 1 else 0.0,
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
        **posterior,  # P(dead) from the pass-rate posteriors vs dead, per group
        # each reward function's mean over every answer sampled (before weighting)
        **{f"rewards/{k}": v / batch.answers_generated for k, v in zip(names, fn_sums)},
        **update,
        "time_sample_s": t_sample,
        "time_step_s": time.perf_counter() - t0,
    }


def sample_record(batch: Batch, group_size: int, groups: int,
                  advantages: Callable[..., Tensor]) -> list[dict[str, Any]]:
    """The first ``groups`` groups trained on (this rank's): what the policy wrote, its rewards
    and the advantages they gave (``batch.advantages``, else ``advantages(rewards,
    sizes=...)``), for reading a run, not just its averages. Groups may differ in size
    (``batch.group_sizes``)."""
    from .advantages import dead_mask

    sizes = (batch.group_sizes or [group_size] * (len(batch.rows) // group_size))[:groups]
    n = sum(sizes)
    if not n:
        return []
    rewards = batch.rewards[:n].float()
    adv = (batch.advantages[:n] if batch.advantages is not None
           else advantages(rewards, sizes=sizes))
    out = []
    lo = 0
    for k in sizes:
        row, hi = batch.rows[lo], lo + k
        out.append({
            "prompt": row["prompt"],
            **({"answer": str(row["answer"])} if row.get("answer") is not None else {}),
            "completions": batch.rollout.completions[lo:hi],
            "rewards": rewards[lo:hi].tolist(),
            "advantages": adv[lo:hi].tolist(),
            "dead": bool(dead_mask(rewards[lo:hi], k)[0]),
        })
        lo = hi
    return out


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, imported on first plot: runs that only write
    metrics (every torchrun rank but 0, tests, benchmarks) skip its ~0.3 s import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
                 run_id: str | None = None) -> None:
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


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete line of a metrics file (a torn last line from a kill is skipped)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _rolling(ys: list[float], k: int) -> list[float]:
    """Trailing mean over up to k points, so a noisy per-step series shows its trend."""
    return [sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1])
            for i in range(len(ys))]


def plot_run(rows: list[dict], out_png: str | os.PathLike, title: str = "",
             lengths: bool = False) -> None:
    """Left: training reward and held-out accuracy (and the watch's strict check). Right:
    dead-group share per step. With ``lengths`` a third panel: completion length per step."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3 if lengths else 2, figsize=(17 if lengths else 12, 4.5))
    ax1, ax2 = axes[0], axes[1]
    steps, rew = _series(rows, "reward_mean")
    ax1.plot(steps, rew, label="training reward (mean of the step)", color="tab:blue", alpha=0.35)
    ax1.plot(steps, _rolling(rew, 5), label="training reward (5-step mean)", color="tab:blue")
    exact = bool(_series(rows, "heldout_pass_prob")[0])  # only the world can compute it
    if _series(rows, "train_pass_prob")[0]:
        ax1.plot(*_series(rows, "train_pass_prob"), "--", color="tab:blue", lw=2,
                 label="training reward, expected (exact, first eval_size train prompts)")
    ax1.plot(*_series(rows, "heldout_acc"), "o:" if exact else "o-", ms=3,
             label="held-out accuracy (greedy)", color="tab:green", alpha=0.6 if exact else 1)
    if exact:
        ax1.plot(*_series(rows, "heldout_pass_prob"), "-", lw=2, color="tab:green",
                 label="held-out accuracy (T=1, exact)")
    if _series(rows, "heldout_check_acc")[0]:
        ax1.plot(*_series(rows, "heldout_check_acc"), "s:", ms=3, color="tab:purple",
                 label="held-out strict check (watch)")
    flagged = [r["step"] for r in rows if r.get("hacking_suspected")]
    if flagged:
        ax1.scatter(flagged, [0.02] * len(flagged), marker="^", color="tab:red", zorder=3,
                    label="reward hacking suspected")
    ax1.set_xlabel("step")
    ax1.set_ylim(0, 1)
    ax1.set_title("Reward and held-out accuracy")
    ax1.legend(loc="upper left", fontsize=8)
    ax1.grid(alpha=0.3)
    steps, right = _series(rows, "dead_all_right_share")
    _, wrong = _series(rows, "dead_all_wrong_share")
    if steps:
        ax2.bar(steps, wrong, color="tab:red", label="dead: all wrong")
        ax2.bar(steps, right, bottom=wrong, color="tab:orange", label="dead: all right")
        ax2.plot(steps, _rolling(right, 10), color="tab:brown", lw=2,
                 label="dead: all right (10-step mean)")
    if _series(rows, "predicted_dead_share")[0]:
        ax2.plot(*_series(rows, "predicted_dead_share"), "k--", lw=1.2,
                 label="predicted  mean p^G+(1-p)^G")
    if _series(rows, "posterior_dead_share")[0]:  # any backend, before sampling
        ax2.plot(*_series(rows, "posterior_dead_share"), ":", color="tab:blue", lw=1.5,
                 label="predicted from Beta posteriors")
    ax2.set_xlabel("step")
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("share of groups")
    ax2.set_title("Dead groups (advantage 0, no gradient)")
    ax2.legend(loc="upper right", fontsize=8)
    ax2.grid(alpha=0.3)
    if lengths:
        steps, lens = _series(rows, "completion_len")
        axes[2].plot(steps, lens, color="tab:gray")
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("tokens")
        axes[2].set_ylim(bottom=0)
        axes[2].set_title("Completion length (mean of the step)")
        axes[2].grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def summarize(rows: list[dict]) -> dict[str, Any]:
    """The numbers a sweep table shows for one run."""
    from .predict import calibration_summary
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
    }


def _all_right_of_dead(steps: list[dict]) -> float:
    right = sum(r.get("dead_all_right_share", 0.0) * r.get("groups", 0) for r in steps)
    dead = sum(r.get("dead_share", 0.0) * r.get("groups", 0) for r in steps)
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


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (readable in a terminal, pasteable into the README)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.3f}" if abs(v) < 10 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def plot_sweep(
    results: list[tuple[str, int, dict[str, Any]]], out_png: str | os.PathLike, title: str = ""
) -> None:
    """Compare runs by group size: dead share (measured vs predicted), held-out accuracy at the
    end of the run, and what sampling cost per answer that carried a gradient (answers in live
    groups; plain GRPO pays 1 / (1 - dead share), dynamic sampling pays for its refills). Per-step curves are in each run's
    workshop.png."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    variants = list(dict.fromkeys(v for v, _, _ in results))
    cmap = plt.get_cmap("tab10")
    start = next((s["start_heldout_acc"] for _, _, s in results), None)
    start_p = next((s["start_heldout_pass_prob"] for _, _, s in results), None)
    for i, variant in enumerate(variants):
        pts = sorted((g, s) for v, g, s in results if v == variant)
        gs = [g for g, _ in pts]
        c = cmap(i % 10)
        axes[0].plot(gs, [s["mean_dead_share"] for _, s in pts], "o-", color=c,
                     label=f"{variant}: measured")
        axes[0].plot(gs, [s["mean_predicted_dead_share"] for _, s in pts], "x--", color=c,
                     alpha=0.7, label=f"{variant}: predicted")
        axes[1].plot(gs, [s["final_heldout_acc"] for _, s in pts], "o-", color=c,
                     label=f"{variant}: greedy")
        axes[1].plot(gs, [s["final_heldout_pass_prob"] for _, s in pts], "s:", color=c,
                     alpha=0.7, label=f"{variant}: T=1 (exact)")
        axes[2].plot(gs, [s.get("answers_per_useful", math.nan) for _, s in pts], "o-", color=c,
                     label=variant)
    if start is not None:
        axes[1].axhline(start, color="grey", lw=1, ls="--", label="greedy at the start")
    if start_p is not None and not math.isnan(start_p):
        axes[1].axhline(start_p, color="grey", lw=1, ls=":", label="T=1 at the start")
    titles = ("mean dead-group share", "held-out accuracy after the run",
              "answers generated per answer in a live group")
    for ax, name in zip(axes, titles):
        ax.set_title(name)
        ax.set_xscale("log", base=2)
        gs_all = sorted({g for _, g, _ in results})
        ax.set_xticks(gs_all, [str(g) for g in gs_all])
        ax.set_xlabel("group size G (prompts per step = budget / G)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylim(0, 1)
    axes[2].set_ylim(bottom=0)
    axes[2].axhline(1, color="grey", lw=1, ls=":")
    axes[2].set_ylabel("generated / useful (1 = nothing wasted)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
