"""bench/arith_table.py on hand-made runs: paired gains, the error over seeds, the carry split."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
arith_table = importlib.import_module("arith_table")


def _run(out: Path, name: str, ok: list[int], steps: int = 2) -> None:
    (out / name / "eval-final").mkdir(parents=True)
    lines = [{"step": 0}] + [{"step": i, "answers_generated": 32, "useful_answers": 16,
                              "dead_all_right_share": 0.25, "dead_all_wrong_share": 0.25}
                             for i in range(1, steps + 1)]
    (out / name / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ev = {"greedy_correct": ok, "greedy_accuracy": sum(ok) / len(ok),
          "greedy_accuracy_by_difficulty": {}}
    (out / name / "eval-final" / "eval.json").write_text(json.dumps(ev))


def test_table_pairs_per_prompt_and_across_seeds(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # the task's held-out rows come from examples/
    rows = arith_table.heldout(0)
    n = len(rows)
    carry_add = [i for i, r in enumerate(rows)
                 if r["difficulty"] == "2-digit-carry" and "+" in r["prompt"]]
    for s in (0, 1):
        (tmp_path / f"base-s{s}").mkdir()
        (tmp_path / f"base-s{s}" / "eval.json").write_text(json.dumps(
            {"greedy_correct": [0] * n, "greedy_accuracy": 0.0}))
        _run(tmp_path, f"grpo-s{s}", [0] * n)
    # the method: in seed 0 right on every 2-digit addition with a carry and the 1-digit
    # prompts among the first 12; in seed 1 on nothing
    first = [int(i in carry_add or (i < 12 and rows[i]["difficulty"] == "1-digit"))
             for i in range(n)]
    _run(tmp_path, "m-s0", first)
    _run(tmp_path, "m-s1", [0] * n)
    table = arith_table.table(tmp_path, ["grpo", "m"], [0, 1])
    cells = [c.strip() for c in table[-1].strip("|").split("|")]
    d0 = sum(first) / n
    assert cells[0] == "m (2 seeds)"
    assert cells[3] == f"{d0 / 2:+.3f} ± {cells[3].split('± ')[1]}"  # paired over 2n prompts
    # over seeds: mean of (d0, 0), s.e. = |d0 - 0| / 2
    assert cells[5] == f"{d0 / 2:+.3f} ± {d0 / 2:.3f}"
    # carry split: seed 0 all additions right, no subtraction; seed 1 none
    assert cells[7] == "0.500 / 0.000"
    assert cells[-3:] == ["64", "2.00", "0.25 / 0.25"]
    assert arith_table.carry_by_operator(first, rows) == (1.0, 0.0)


def test_smooth_is_a_trailing_mean() -> None:
    assert arith_table._smooth([1.0, 0.0, 1.0, 1.0], 2) == [1.0, 0.5, 0.5, 1.0]
