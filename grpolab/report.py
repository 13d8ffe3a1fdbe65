"""Metrics on disk (JSONL, one line per step, flushed) and the plots a person reads."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


class MetricsWriter:
    """Append-only JSONL; each line is flushed and fsynced so a killed run loses nothing."""

    def __init__(self, path: str | os.PathLike, resume_after_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_after_step is None:
            self.path.write_text("")
        else:
            keep = [r for r in read_metrics(self.path) if r.get("step", -1) <= resume_after_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
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


def plot_run(rows: list[dict], out_png: str | os.PathLike, title: str = "") -> None:
    """Left: training reward and held-out accuracy. Right: dead-group share per step."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    steps, rew = _series(rows, "reward_mean")
    ax1.plot(steps, rew, label="training reward (mean of the step)", color="tab:blue", alpha=0.35)
    ax1.plot(steps, _rolling(rew, 5), label="training reward (5-step mean)", color="tab:blue")
    ax1.plot(*_series(rows, "heldout_acc"), "o-", ms=3, label="held-out accuracy (greedy)",
             color="tab:green")
    ax1.plot(*_series(rows, "heldout_pass_prob"), "--", label="held-out accuracy (T=1, exact)",
             color="tab:green")
    ax1.set_xlabel("step")
    ax1.set_ylim(0, 1)
    ax1.set_title("Reward and held-out accuracy")
    ax1.legend(loc="lower right")
    ax1.grid(alpha=0.3)
    steps, right = _series(rows, "dead_all_right_share")
    _, wrong = _series(rows, "dead_all_wrong_share")
    if steps:
        ax2.bar(steps, wrong, color="tab:red", label="dead: all wrong")
        ax2.bar(steps, right, bottom=wrong, color="tab:orange", label="dead: all right")
    ax2.plot(*_series(rows, "predicted_dead_share"), "k--", lw=1.2,
             label="predicted  mean p^G+(1-p)^G")
    ax2.set_xlabel("step")
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("share of groups")
    ax2.set_title("Dead groups (advantage 0, no gradient)")
    ax2.legend(loc="upper right", fontsize=8)
    ax2.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def summarize(rows: list[dict]) -> dict[str, Any]:
    """The numbers a sweep table shows for one run."""
    steps = [r for r in rows if r.get("step", 0) >= 1]
    accs = [r for r in rows if r.get("heldout_acc") is not None]
    dead = [r["dead_share"] for r in steps if "dead_share" in r]
    pred = [r["predicted_dead_share"] for r in steps if r.get("predicted_dead_share") is not None]
    return {
        "steps": len(steps),
        "mean_dead_share": sum(dead) / len(dead) if dead else float("nan"),
        "mean_predicted_dead_share": sum(pred) / len(pred) if pred else float("nan"),
        "start_heldout_acc": accs[0]["heldout_acc"] if accs else float("nan"),
        "final_heldout_acc": accs[-1]["heldout_acc"] if accs else float("nan"),
        "start_heldout_pass_prob": _first_last(rows, "heldout_pass_prob", 0),
        "final_heldout_pass_prob": _first_last(rows, "heldout_pass_prob", -1),
        "answers_generated": sum(r.get("answers_generated", 0) for r in steps),
        "mean_reward": (sum(r["reward_mean"] for r in steps) / len(steps)) if steps else float("nan"),
    }


def _first_last(rows: list[dict], key: str, i: int) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return vals[i] if vals else float("nan")


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (readable in a terminal, pasteable into the README)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.3f}" if abs(v) < 10 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def plot_sweep(runs: dict[str, list[dict]], out_png: str | os.PathLike, title: str = "") -> None:
    """One figure comparing runs: held-out accuracy, training reward, dead share per step."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    cmap = plt.get_cmap("viridis")
    for i, (label, rows) in enumerate(runs.items()):
        color = cmap(i / max(1, len(runs) - 1))
        axes[0].plot(*_series(rows, "heldout_acc"), color=color, label=label)
        axes[1].plot(*_series(rows, "reward_mean"), color=color, label=label)
        axes[2].plot(*_series(rows, "dead_share"), color=color, label=label)
    for ax, name in zip(axes, ("held-out accuracy", "training reward", "dead-group share")):
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
