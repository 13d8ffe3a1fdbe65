"""What a person reads: the run's plot, the sweep's plot and table, the calibration plot.

matplotlib is imported on the first plot (``_pyplot``), so runs that only write metrics skip it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from grpolab.predict.posterior import _pairs, brier_score, reliability_table


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, imported on first plot: runs that only write
    metrics (every torchrun rank but 0, tests, benchmarks) skip its ~0.3 s import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
                 label="predicted from the posteriors")
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
    start = next((s.get("start_heldout_acc", math.nan) for _, _, s in results), None)
    start_p = next((s.get("start_heldout_pass_prob", math.nan) for _, _, s in results), None)
    for i, variant in enumerate(variants):
        pts = sorted((g, s) for v, g, s in results if v == variant)
        gs = [g for g, _ in pts]
        c = cmap(i % 10)
        axes[0].plot(gs, [s.get("mean_dead_share", math.nan) for _, s in pts], "o-", color=c,
                     label=f"{variant}: measured")
        axes[0].plot(gs, [s.get("mean_predicted_dead_share", math.nan) for _, s in pts], "x--", color=c,
                     alpha=0.7, label=f"{variant}: predicted")
        axes[1].plot(gs, [s.get("final_heldout_acc", math.nan) for _, s in pts], "o-", color=c,
                     label=f"{variant}: greedy")
        axes[1].plot(gs, [s.get("final_heldout_pass_prob", math.nan) for _, s in pts], "s:", color=c,
                     alpha=0.7, label=f"{variant}: T=1 (exact)")
        axes[2].plot(gs, [s.get("answers_per_useful", math.nan) for _, s in pts], "o-", color=c,
                     label=variant)
    if start is not None and not math.isnan(start):  # (undefined: no held-out rows)
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


def plot_calibration(rows: list[dict], out_png: str | os.PathLike, title: str = "") -> bool:
    """calibration.png: the reliability diagram of the posterior's P(dead) (left) and the
    predicted vs measured dead share per step (right). False (nothing written) without data."""
    pred, dead = _pairs(rows)
    if not pred.numel():
        return False
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    table = reliability_table(pred, dead)
    ax1.plot([0, 1], [0, 1], color="grey", lw=1, ls="--", label="perfect calibration")
    xs = [b["mean_predicted"] for b in table]
    ys = [b["measured"] for b in table]
    sizes = [20 + 200 * b["groups"] / max(1, pred.numel()) for b in table]
    ax1.plot(xs, ys, "-", color="tab:blue", alpha=0.6)
    ax1.scatter(xs, ys, s=sizes, color="tab:blue", zorder=3, label="groups binned by prediction")
    ax1.set_xlim(0, 1)
    ax1.set_ylim(0, 1)
    ax1.set_xlabel("predicted P(group dead)")
    ax1.set_ylabel("measured dead share")
    ax1.set_title(f"Reliability (Brier {brier_score(pred, dead):.3f}, "
                  f"base rate {brier_score(torch.full_like(dead, float(dead.mean())), dead):.3f})")
    ax1.legend(loc="upper left", fontsize=8)
    ax1.grid(alpha=0.3)
    steps = [r["step"] for r in rows if r.get("posterior_dead_share") is not None]
    ax2.plot(steps, [r["posterior_dead_share"] for r in rows
                     if r.get("posterior_dead_share") is not None],
             "k--", label="predicted (pass-rate posteriors)")
    ax2.plot([r["step"] for r in rows if r.get("dead_share") is not None and r.get("step")],
             [r["dead_share"] for r in rows if r.get("dead_share") is not None and r.get("step")],
             color="tab:red", label="measured")
    exact = [(r["step"], r["predicted_dead_share"]) for r in rows
             if r.get("predicted_dead_share") is not None]
    if exact:
        ax2.plot(*zip(*exact), ":", color="tab:gray", label="predicted (exact, world only)")
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("step")
    ax2.set_ylabel("dead share of the step's groups")
    ax2.set_title("Dead share: predicted before sampling vs measured")
    ax2.legend(loc="upper right", fontsize=8)
    ax2.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return True
