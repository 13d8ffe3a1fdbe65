"""How the ``code`` reward judges a dataset's own reference solutions: a right solution that
scores below 1.0 is a false negative of the verifier (or a test it cannot judge, or a wrong
reference). Reads a local JSONL file in any format grpolab.rewards.code_data reads; nothing is
downloaded.

    python bench/code_reference.py HumanEval.jsonl --code '{prompt}{canonical_solution}'
    python bench/code_reference.py mbpp.jsonl --code '{code}'

Prints the counts and, for each solution below 1.0, why (the verdict's note and the first test
it could not judge).
"""

from __future__ import annotations

import argparse
import json
import time

from grpolab.rewards.code_data import row_case
from grpolab.rewards.sandbox import run_case
from grpolab.rewards.sandbox_judge import plan_test


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="a JSONL file of problems with their reference solutions")
    ap.add_argument("--code", default="{code}",
                    help="the solution, as a format string over the row's columns")
    ap.add_argument("--limit", type=int, default=0, help="the first N rows only")
    args = ap.parse_args()
    with open(args.data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[: args.limit] if args.limit else rows
    t0, full, tests, judged, below = time.monotonic(), 0, 0, 0, []
    for i, row in enumerate(rows):
        case = row_case(row)
        tests += case.count
        judged += len(case.io) + sum(plan_test(t) is not None for t in case.tests)
        verdict = run_case(args.code.format(**row), case)
        full += verdict.share == 1.0
        if verdict.share < 1.0:
            bad = next((t for t in case.tests if plan_test(t) is None), "")
            below.append((row.get("task_id", i), verdict, " ".join(bad.split())[:100]))
    print(f"{len(rows)} problems, {tests} tests, {judged} judgeable; reference solutions "
          f"scoring 1.0: {full} ({full / max(1, len(rows)):.1%}); "
          f"{time.monotonic() - t0:.0f} s")
    for task, verdict, bad in below:
        print(f"  {task}: {verdict.passed}/{verdict.total} {verdict.note}"
              + (f" | e.g. {bad}" if bad else ""))


if __name__ == "__main__":
    main()
