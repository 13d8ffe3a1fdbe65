"""The 2-digit arithmetic comparison (bench/arith_compare.sh): one markdown row per method,
pooled over seeds, and the per-difficulty learning curves.

Gains are paired per held-out prompt: a method's final greedy answer against the start's (and,
in "vs GRPO", against plain GRPO's final answer to the same prompt of the same seed); the
standard error is that of the mean of those paired differences over every prompt of every seed.
"s.e. over seeds" is the mean of each seed's paired difference and its standard error across
seeds, which also counts how differently two trainings of one seed's data can go.

Usage: python bench/arith_table.py OUT [--methods grpo ...] [--seeds 0 1] [--figure F.png]
       [--rejudge] [--estimators]
       python bench/arith_table.py OUT --operators EVAL_DIR ... [--eval-size 600] [--seeds 0]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

KINDS = ("1-digit", "2-digit", "2-digit-carry", "3-digit")
CONFIG = "examples/smollm2_addition.yaml"


def _load(run: Path) -> tuple[list[dict], dict]:
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return steps, json.loads((run / "eval-final" / "eval.json").read_text())


def _gain(diffs: list[float]) -> str:
    """Mean of paired per-prompt differences ± its standard error (grpolab eval's own)."""
    import torch

    from grpolab.core.passk import standard_error

    return f"{sum(diffs) / len(diffs):+.3f} ± {standard_error(torch.tensor(diffs, dtype=torch.float64)):.3f}"


@functools.cache
def heldout(seed: int, config: str = CONFIG, eval_size: int | None = None) -> list[dict]:
    """The held-out rows a seed's evals judged, in their order (the task's own rows,
    regenerated from the run's config; ``eval_size`` as the eval was given it)."""
    from grpolab.config import make_config
    from grpolab.data.files import run_rows

    cfg = make_config(config, {"seed": seed, **({"eval_size": eval_size} if eval_size else {})},
                      "eval")
    return run_rows(cfg)[1][: cfg.eval_size]


def operator_table(folders: list[Path], seed: int, eval_size: int) -> list[str]:
    """Greedy accuracy ± s.e. per difficulty and operator of evals run with ``--eval-size``
    (each folder holds an eval's completions.jsonl)."""
    import torch

    from grpolab.core.passk import standard_error

    rows = heldout(seed, CONFIG, eval_size)
    cells = [(k, op) for k in KINDS for op in "+-"]
    out = ["| eval | prompts | " + " | ".join(f"{k} {op}" for k, op in cells) + " |",
           "|" + "---|" * (len(cells) + 2)]
    for f in folders:
        greedy = [json.loads(x) for x in (f / "completions.jsonl").read_text().splitlines()]
        greedy = [x for x in greedy if x["greedy"]]
        assert [x["prompt"] for x in greedy] == [r["prompt"] for r in rows[:len(greedy)]], f
        by = by_kind_and_operator([x["right"] for x in greedy], rows)
        out.append(f"| {f.name} | {len(greedy)} | " + " | ".join(
            f"{sum(v) / len(v):.2f} ± {float(standard_error(torch.tensor(v))):.2f} ({len(v)})"
            for v in (by.get(c, [0.0]) for c in cells)) + " |")
    return out


def rejudge(ev: dict, folder: Path, rows: list[dict]) -> dict:
    """``ev`` with its greedy verdicts (and their split by the ``rows``' difficulty) given again
    by today's ``math`` reward, from the answers the eval wrote down (completions.jsonl)."""
    from grpolab.rewards.builtin import load_reward

    judge = load_reward("math")
    lines = [json.loads(x) for x in (folder / "completions.jsonl").read_text().splitlines()]
    greedy = [x for x in lines if x["greedy"]]
    assert [x["prompt"] for x in greedy] == [r["prompt"] for r in rows], f"{folder}: other rows"
    kinds = [r["difficulty"] for r in rows]
    ok = [int(v == 1.0) for v in judge([x["prompt"] for x in greedy],
                                       [x["completion"] for x in greedy],
                                       answer=[x["gold"] for x in greedy])]
    by: dict[str, list[int]] = {}
    for k, o in zip(kinds, ok):
        by.setdefault(k, []).append(o)
    return {**ev, "greedy_correct": ok, "greedy_accuracy": sum(ok) / len(ok),
            "greedy_accuracy_by_difficulty": {k: sum(v) / len(v) for k, v in by.items()}}


def by_kind_and_operator(ok: list, rows: list[dict]) -> dict[tuple[str, str], list[float]]:
    """The per-row verdicts ``ok`` (aligned with ``rows``) grouped by (difficulty, "+" or "-")."""
    by: dict[tuple[str, str], list[float]] = {}
    for o, r in zip(ok, rows):
        by.setdefault((r["difficulty"], "+" if "+" in r["prompt"] else "-"), []).append(float(o))
    return by


def carry_by_operator(ok: list[int], rows: list[dict]) -> tuple[float, float]:
    """Greedy accuracy on the 2-digit-carry rows [addition, subtraction] from the per-row
    verdicts ``ok`` (aligned with ``rows``): a carry in addition, a borrow in subtraction."""
    by = by_kind_and_operator(ok, rows)
    add, sub = by.get(("2-digit-carry", "+"), []), by.get(("2-digit-carry", "-"), [])
    return (sum(add) / max(len(add), 1), sum(sub) / max(len(sub), 1))


def _judged(out: Path, m: str, s: int, against: str,
            again: bool) -> tuple[list[dict], dict, dict, dict | None]:
    """Method ``m``'s seed ``s``: its metrics and final eval, the start's eval and ``against``'s
    final eval (None for ``against`` itself or when it was not run), each judged again by
    today's ``math`` when ``again``."""
    run = out / f"{m}-s{s}"
    steps, ev = _load(run)
    start = out / f"base-s{s}"
    base = json.loads((start / "eval.json").read_text())
    other = out / f"{against}-s{s}" / "eval-final"
    ref = (json.loads((other / "eval.json").read_text())
           if m != against and (other / "eval.json").exists() else None)
    if again:
        rows = heldout(s)
        ev, base = rejudge(ev, run / "eval-final", rows), rejudge(base, start, rows)
        ref = rejudge(ref, other, rows) if ref is not None else None
    return steps, ev, base, ref


def table(out: Path, methods: list[str], seeds: list[int], again: bool = False,
          against: str = "grpo") -> list[str]:
    rows = [(f"| method | held-out start | end | gain (paired) | vs {against} (paired) | "
             f"vs {against}, s.e. over seeds | "
             "2-digit carry end | carry: addition / subtraction end | "
             "1-digit / 2-digit / 3-digit end | answers generated | "
             "generated per live answer | dead all right / all wrong |"),
            "|" + "---|" * 12]
    for m in methods:
        gains, vs, start, end, carry, kinds = [], [], [], [], [], {k: [] for k in KINDS}
        carry_ops: list[tuple[float, float]] = []
        per_seed: list[float] = []  # each seed's mean paired difference against ``against``
        generated = useful = 0
        dead_r, dead_w = [], []
        for s in seeds:
            if not (out / f"{m}-s{s}" / "eval-final" / "eval.json").exists():
                continue
            steps, ev, base, ref = _judged(out, m, s, against, again)
            ok = ev["greedy_correct"]
            gains += [a - b for a, b in zip(ok, base["greedy_correct"])]
            if ref is not None:
                d = [a - b for a, b in zip(ok, ref["greedy_correct"])]
                vs += d
                per_seed.append(sum(d) / len(d))
            start.append(base["greedy_accuracy"])
            end.append(ev["greedy_accuracy"])
            by = ev.get("greedy_accuracy_by_difficulty", {})
            carry.append(by.get("2-digit-carry", float("nan")))
            carry_ops.append(carry_by_operator(ok, heldout(s)))
            for k in KINDS:
                kinds[k].append(by.get(k, float("nan")))
            trained = [r for r in steps if r["step"] > 0]
            generated += sum(r["answers_generated"] for r in trained)
            useful += sum(r["useful_answers"] for r in trained)
            dead_r += [r["dead_all_right_share"] for r in trained]
            dead_w += [r["dead_all_wrong_share"] for r in trained]
        if not end:
            continue
        n = len(end)
        v = _gain(vs) if vs else ""
        # the runs' own randomness is shared by every prompt of a seed: the spread of the
        # seeds' differences is the honest error bar once there are a few seeds
        over = _gain(per_seed) if len(per_seed) > 1 else ""
        rows.append(
            f"| {m} ({n} seed{'s' if n > 1 else ''}) | {sum(start) / n:.3f} | {sum(end) / n:.3f} "
            f"| {_gain(gains)} | {v} | {over} | {sum(carry) / n:.3f} | "
            f"{sum(a for a, _ in carry_ops) / n:.3f} / {sum(b for _, b in carry_ops) / n:.3f} | "
            + " / ".join(f"{sum(kinds[k]) / n:.3f}" for k in ("1-digit", "2-digit", "3-digit"))
            + f" | {generated // n} | {generated / max(useful, 1):.2f} | "
            f"{sum(dead_r) / len(dead_r):.2f} / {sum(dead_w) / len(dead_w):.2f} |")
    return rows


def _peak_mib(out: Path, run: str, steps: list[dict]) -> float | None:
    """The run's peak resident memory: its metrics' own high-water mark, else what GNU time
    wrote beside the run (``<run>.time``, ``/usr/bin/time -v``)."""
    peaks = [r["peak_rss_mib"] for r in steps if "peak_rss_mib" in r]
    if peaks:
        return max(peaks)
    f = out / f"{run}.time"
    for line in f.read_text().splitlines() if f.exists() else []:
        if "Maximum resident set size" in line:
            return int(line.rsplit(":", 1)[1]) / 1024
    return None


def estimator_table(out: Path, methods: list[str], seeds: list[int],
                    against: str = "grpo") -> list[str]:
    """GRPO against the token-level estimators (REINFORCE++, PPO): paired gains, the answers
    that gave no signal (GRPO: its dead groups' answers; the others: answers whose advantage is
    0 at every token), the critic's explained variance (the median over those of the last 10
    steps with a right answer, one number per seed), the median step time and the peak resident memory."""
    import statistics

    rows = [(f"| method | answers a step | held-out end | gain (paired) | vs {against} (paired) | "
             "2-digit carry end | answers with no signal | critic's explained variance (median, "
             "last 10 steps) | step time (median) | peak memory |"), "|" + "---|" * 10]
    for m in methods:
        gains, vs, end, carry, quiet, ev_last, times, peaks = [], [], [], [], [], [], [], []
        shape = ""
        for s in seeds:
            run = out / f"{m}-s{s}"
            if not (run / "eval-final" / "eval.json").exists():
                continue
            steps, ev, base, ref = _judged(out, m, s, against, again=True)
            gains += [a - b for a, b in zip(ev["greedy_correct"], base["greedy_correct"])]
            if ref is not None:
                vs += [a - b for a, b in zip(ev["greedy_correct"], ref["greedy_correct"])]
            end.append(ev["greedy_accuracy"])
            carry.append(ev["greedy_accuracy_by_difficulty"].get("2-digit-carry", float("nan")))
            trained = [r for r in steps if r["step"] > 0]
            cfg = json.loads((run / "config.json").read_text())
            g = cfg["group_size"]
            shape = f"{cfg['budget'] // g} prompts x {g}"
            quiet += [r.get("zero_advantage_share", r["dead_share"]) for r in trained]
            if any("explained_variance" in r for r in trained):
                # steps with a right answer: when every answer fails the returns are the KL
                # penalty alone (variance ~1e-5) and the ratio reads -1000
                last = [r["explained_variance"] for r in trained[-10:] if r["reward_mean"] > 0]
                ev_last.append(f"{statistics.median(last):+.2f}" if last else "-")
            times += [r["time_step_s"] for r in trained]
            peak = _peak_mib(out, f"{m}-s{s}", steps)
            if peak is not None:
                peaks.append(peak)
        if not end:
            continue
        n = len(end)
        rows.append(
            f"| {m} ({n} seed{'s' if n > 1 else ''}) | {shape} | {sum(end) / n:.3f} | "
            f"{_gain(gains)} | {_gain(vs) if vs else ''} | {sum(carry) / n:.3f} | "
            f"{sum(quiet) / len(quiet):.3f} | {', '.join(ev_last)} | "
            f"{statistics.median(times):.1f} s | "
            + (f"{max(peaks):.0f} MiB |" if peaks else "|"))
    return rows


SMOOTH = 6  # steps in the dead-group panel's running mean (a step has only 4-8 groups)


def _smooth(ys: list[float], k: int) -> list[float]:
    """Trailing running mean over up to ``k`` points."""
    return [sum(ys[max(0, i - k + 1): i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(ys))]


def figure(out: Path, methods: list[str], seeds: list[int], path: Path) -> None:
    """Held-out greedy accuracy per difficulty against the answers generated so far (mean over
    seeds), one panel per difficulty, and each step's dead share split into all right and all
    wrong."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 3, figsize=(13, 7), constrained_layout=True)
    axes = list(grid.flat)[: len(KINDS) + 1]
    grid.flat[-1].axis("off")
    for i, m in enumerate(methods):
        curves: dict[int, dict[str, list[float]]] = {}
        right: dict[int, list[float]] = {}
        wrong: dict[int, list[float]] = {}
        for s in seeds:
            f = out / f"{m}-s{s}" / "metrics.jsonl"
            if not f.exists():
                continue
            spent = 0
            for r in map(json.loads, f.read_text().splitlines()):
                spent += r.get("answers_generated", 0)
                if r.get("heldout_acc_by_difficulty"):
                    for k, v in r["heldout_acc_by_difficulty"].items():
                        curves.setdefault(spent, {}).setdefault(k, []).append(v)
                if r["step"] > 0:
                    right.setdefault(spent, []).append(r["dead_all_right_share"])
                    wrong.setdefault(spent, []).append(r["dead_all_wrong_share"])
        if not curves:
            continue
        color = f"C{i}"
        xs = sorted(curves)
        for ax, k in zip(axes, KINDS):
            ys = [sum(curves[x].get(k, [0])) / max(len(curves[x].get(k, [])), 1) for x in xs]
            ax.plot(xs, ys, marker="o", color=color, label=m)
        ds = sorted(wrong)
        for share, ls in ((wrong, "-"), (right, ":")):
            per_step = [sum(share[x]) / len(share[x]) for x in ds]
            axes[-1].plot(ds, _smooth(per_step, SMOOTH), color=color, ls=ls,
                          label=m if ls == "-" else None)
    for ax, k in zip(axes, KINDS):
        ax.set(title=f"held-out {k}", xlabel="answers generated", ylabel="greedy accuracy",
               ylim=(-0.02, 1))
        ax.grid(alpha=0.3)
    axes[-1].set(title=f"dead groups, {SMOOTH}-step mean (solid all wrong, dotted all right)",
                 xlabel="answers generated", ylabel="share of the step's groups", ylim=(-0.02, 1.02))
    axes[-1].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--methods", nargs="+",
                    default=["grpo", "grpo-g4", "allocate-kind", "allocate-kind-grid",
                             "allocate-kind-grid-groups", "allocate-kind-answers",
                             "allocate-by-kind", "curriculum", "allocate", "dynamic"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--figure", type=Path)
    ap.add_argument("--rejudge", action="store_true",
                    help="judge the evals' written answers again with today's math reward")
    ap.add_argument("--against", default="grpo", help="the method the paired gains compare to")
    ap.add_argument("--estimators", action="store_true",
                    help="the estimators' table (step time, memory, critic), judged by today's math")
    ap.add_argument("--operators", nargs="+", type=Path, metavar="EVAL_DIR",
                    help="instead: accuracy per difficulty and operator of these evals (run with "
                         "--eval-size EVAL_SIZE and --seed of --seeds' first)")
    ap.add_argument("--eval-size", type=int, default=600)
    a = ap.parse_args()
    if a.operators:
        print("\n".join(operator_table(a.operators, a.seeds[0], a.eval_size)))
    elif a.estimators:
        print("\n".join(estimator_table(a.out, a.methods, a.seeds, a.against)))
    else:
        print("\n".join(table(a.out, a.methods, a.seeds, a.rejudge, a.against)))
    if a.figure:
        figure(a.out, a.methods, a.seeds, a.figure)
        print(f"wrote {a.figure}")


if __name__ == "__main__":
    main()
