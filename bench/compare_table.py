"""One markdown row per run folder: what each variant bought and paid (from summary.json and
metrics.jsonl). Usage: python bench/compare_table.py RUN_DIR..."""

import json
import sys
from pathlib import Path

HEADER = ["variant", "held-out start", "held-out end", "gain", "answers generated",
          "answers in live groups", "generated per live answer", "mean dead share",
          "P(dead) Brier / base rate", "train s"]


def row(run: Path) -> list[str]:
    s = json.loads((run / "summary.json").read_text())
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    secs = sum(r.get("time_step_s", 0.0) for r in steps)

    def num(key: str, fmt: str) -> str:  # (summary.json's null: undefined, shown as -)
        return "-" if s.get(key) is None else format(s[key], fmt)

    return [run.name, num("start_heldout_acc", ".3f"), num("final_heldout_acc", ".3f"),
            num("heldout_acc_gain", "+.3f"), str(s["answers_generated"]),
            str(s["useful_answers"]), num("answers_per_useful", ".2f"),
            num("mean_dead_share", ".3f"),
            f"{num('posterior_dead_brier', '.3f')} / {num('posterior_dead_brier_base_rate', '.3f')}",
            f"{secs:.0f}"]


if __name__ == "__main__":
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for d in sys.argv[1:]:
        print("| " + " | ".join(row(Path(d))) + " |")
