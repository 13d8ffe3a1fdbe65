"""Precision and recall of four verifiers on tests/data/verifier_fixture.jsonl (markdown table).

    python bench/verifier_table.py [--old-commit REV] [--fixture tests/data/verifier_heldout.jsonl]

Verifiers: grpolab's ``math`` (this checkout), ``math`` as it was at ``--old-commit`` (default
c8e1dd3, before the last_statement source; read with ``git show``), math-verify's own
parse+verify on the whole completion, and TRL's ``accuracy_reward``. A completion is "paid"
when the verifier says 1. Precision = right among paid; recall = paid among right (label true);
"adversarial paid" counts the hand-written attacks a verifier pays (all are labelled wrong).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "verifier_fixture.jsonl"
OLD_COMMIT = "c8e1dd3"


def load_fixture(path: Path = FIXTURE) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


Judge = Callable[[dict], bool]  # a fixture row -> paid


def new_math(row: dict) -> bool:
    """The ``math`` reward as training calls it: prompt, completion, gold."""
    from grpolab.rewards.builtin import math_answer

    return math_answer([row["prompt"]], [row["completion"]], answer=[row["gold"]]) == [1.0]


def old_math(commit: str) -> Judge:
    src = subprocess.run(["git", "show", f"{commit}:grpolab/rewards/verifiers.py"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_verifiers.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_verifiers", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return lambda r: bool(module.judge(module.final_answer(r["completion"]), r["gold"]))


def math_verify_whole(row: dict) -> bool:
    """math-verify's own answer finding and comparison on the whole completion."""
    from math_verify import parse, verify

    return bool(verify(parse(row["gold"]), parse(row["completion"])))


def trl_accuracy(row: dict) -> bool:
    from trl.rewards import accuracy_reward

    content = [[{"role": "assistant", "content": row["completion"]}]]
    return accuracy_reward(content, [row["gold"]])[0] == 1.0


def measure(judge: Judge, rows: list[dict]) -> dict[str, object]:
    paid = [judge(r) for r in rows]
    right = [r["label"] for r in rows]

    def recall(keep: Callable[[dict], bool]) -> str:
        idx = [i for i, r in enumerate(rows) if right[i] and keep(r)]
        return f"{sum(paid[i] for i in idx) / len(idx):.3f} ({len(idx)})" if idx else "-"

    n_paid = sum(paid)
    true_paid = sum(p and t for p, t in zip(paid, right))
    return {
        "precision": f"{true_paid / n_paid:.3f}" if n_paid else "-",
        "recall": recall(lambda r: True),
        "no format": recall(lambda r: r["kind"] == "no_format" or (
            r["kind"] == "word_problem" and not r.get("format"))),
        "equation": recall(lambda r: r.get("style") == "equation"),
        "chain": recall(lambda r: r.get("style") == "chain"),
        "trailing": recall(lambda r: r.get("style") == "trailing"),
        "adversarial paid": f"{sum(p for p, r in zip(paid, rows) if r['kind'] == 'adversarial')}"
                            f" / {sum(r['kind'] == 'adversarial' for r in rows)}",
        "wrong paid": sum(p and not t for p, t in zip(paid, right)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-commit", default=OLD_COMMIT)
    ap.add_argument("--fixture", type=Path, default=FIXTURE,
                    help="labelled completions (the held-out set: tests/data/verifier_heldout.jsonl)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its timeout warnings
    rows = load_fixture(args.fixture)
    judges = {"grpolab `math` (new)": new_math,
              f"grpolab `math` (old, {args.old_commit})": old_math(args.old_commit),
              "math-verify parse+verify, whole completion": math_verify_whole,
              "TRL `accuracy_reward`": trl_accuracy}
    table = {name: measure(j, rows) for name, j in judges.items()}
    cols = list(next(iter(table.values())))
    n_right = sum(r["label"] for r in rows)
    print(f"{len(rows)} completions, {n_right} right, "
          f"{sum(r['kind'] == 'adversarial' for r in rows)} adversarial; recall columns: "
          "recall (right answers in that subset)\n")
    print("| verifier | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, m in table.items():
        print(f"| {name} | " + " | ".join(str(m[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
