"""reasoning-gym as a dataset and reward source: splits, and agreement with its own scorers."""

from __future__ import annotations

import pytest
import reasoning_gym

from grpolab.app import cli
from grpolab.config import make_config
from grpolab.data.files import run_rows
from grpolab.data.tasks import task_reward, task_rows
from grpolab.rewards.builtin import load_reward

ARITH = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
         "operators": ["+", "-", "*"], "allow_parentheses": False, "allow_negation": False}
# Tasks whose gold answers are single numbers or short strings.
TASKS = ["basic_arithmetic", "chain_sum", "leg_counting", "gcd", "lcm", "count_bits",
         "letter_counting", "spell_backward"]


def test_rows_are_deterministic_per_seed() -> None:
    a = task_rows("reasoning_gym:basic_arithmetic", 20, seed=3, task_config=ARITH)
    b = task_rows("reasoning_gym:basic_arithmetic", 20, seed=3, task_config=ARITH)
    c = task_rows("reasoning_gym:basic_arithmetic", 20, seed=4, task_config=ARITH)
    assert a == b and a != c
    assert set(a[0]) == {"prompt", "question", "answer", "metadata"}


def test_heldout_split_never_repeats_a_training_question() -> None:
    cfg = make_config(overrides={
        "dataset": "reasoning_gym:basic_arithmetic", "eval_dataset": "reasoning_gym:basic_arithmetic",
        "dataset_size": 150, "eval_size": 200, "task_config": ARITH,
        "prompt_template": "{prompt} End with 'The answer is N.'"})
    train, held = run_rows(cfg)
    assert len(train) == 150 and len(held) == 200
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    assert held[0]["prompt"] == held[0]["question"] + " End with 'The answer is N.'"


@pytest.mark.parametrize("task", TASKS)
def test_our_reward_and_the_library_agree_on_gold_answers(task: str) -> None:
    rows = task_rows(f"reasoning_gym:{task}", 12, seed=0)
    scorer = reasoning_gym.get_score_answer_fn(task)
    reward = task_reward()
    for row in rows:
        entry = {"question": row["question"], "answer": row["answer"], "metadata": row["metadata"]}
        assert scorer(answer=row["answer"], entry=entry) == 1.0
    completions = [f"Some work.\nThe answer is {r['answer']}" for r in rows]
    got = reward([r["prompt"] for r in rows], completions, answer=[r["answer"] for r in rows],
                 metadata=[r["metadata"] for r in rows], question=[r["question"] for r in rows])
    assert got == [1.0] * len(rows)


def test_numeric_tasks_agree_with_the_math_reward() -> None:
    math = load_reward("math")
    for task in ("basic_arithmetic", "chain_sum", "gcd", "lcm", "leg_counting"):
        rows = task_rows(f"reasoning_gym:{task}", 10, seed=1)
        assert math([r["prompt"] for r in rows], [f"\\boxed{{{r['answer']}}}" for r in rows],
                    answer=[r["answer"] for r in rows]) == [1.0] * len(rows)


def test_the_library_scorer_only_sees_the_final_answer() -> None:
    """reasoning-gym pays partial credit to any text holding the gold; we hand it one answer."""
    row = task_rows("reasoning_gym:basic_arithmetic", 1, seed=0, task_config=ARITH)[0]
    gold = row["answer"]
    hedge = f"{int(gold) + 1} or {gold}"
    entry = {"question": row["question"], "answer": gold, "metadata": row["metadata"]}
    assert reasoning_gym.get_score_answer_fn("basic_arithmetic")(answer=hedge, entry=entry) > 0
    reward = task_reward()
    cols = {"answer": [gold] * 3, "metadata": [row["metadata"]] * 3}
    got = reward([row["prompt"]] * 3, [f"The answer is {hedge}.", row["question"],
                                       f"The answer is {gold}."], **cols)
    assert got == [0.0, 0.0, 1.0]


def test_bad_task_specs_fail_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="no task 'nope'"):
        task_rows("reasoning_gym:nope", 5, seed=0)
    with pytest.raises(ValueError, match="bad task_config"):
        task_rows("reasoning_gym:basic_arithmetic", 5, seed=0, task_config={"min_terms": 0})
    code = cli.main(["eval", "--model-path", "smollm2-135m-instruct", "--dataset",
                     "reasoning_gym:nope", "--rewards", "reasoning_gym", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no task 'nope'" in err[0]


# ----------------------------------------------------------------------------- grpolab:arithmetic


def _columns(q: str) -> tuple[int, str, int]:
    a, op, b = q.removeprefix("Calculate ").rstrip(".").split()
    return int(a), op, int(b)


def test_arithmetic_difficulties_are_what_they_say() -> None:
    """Every row's answer is its sum or difference, never negative; "2-digit" has no carry or
    borrow in any column, "2-digit-carry" one in the units and a 2-digit sum; the four kinds
    come in turn."""
    rows = task_rows("grpolab:arithmetic", 400, seed=5)
    assert [r["difficulty"] for r in rows[:8]] == [
        "1-digit", "2-digit", "2-digit-carry", "3-digit"] * 2
    for r in rows:
        a, op, b = _columns(r["question"])
        assert int(r["answer"]) == (a + b if op == "+" else a - b) >= 0
        units = (a % 10 + b % 10 >= 10) if op == "+" else (a % 10 < b % 10)
        tens = (a // 10 + b // 10 + units >= 10) if op == "+" else False
        kind = r["difficulty"]
        if kind == "1-digit":
            assert a < 10 and b < 10
        elif kind == "3-digit":
            assert 100 <= min(a, b) and max(a, b) < 1000
        else:
            assert 10 <= min(a, b) and max(a, b) < 100 and not tens
            assert units == (kind == "2-digit-carry")
    assert len({r["question"] for r in rows}) == 400  # distinct


def test_arithmetic_split_config_and_errors() -> None:
    cfg = make_config(overrides={"dataset": "grpolab:arithmetic",
                                 "eval_dataset": "grpolab:arithmetic", "dataset_size": 80,
                                 "eval_size": 40,
                                 "task_config": {"difficulties": ["2-digit-carry"],
                                                 "operators": ["+"]}})
    train, held = run_rows(cfg)
    assert len(train) == 80 and len(held) == 40
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    assert {r["difficulty"] for r in train + held} == {"2-digit-carry"}
    assert all(" + " in r["question"] for r in train)
    with pytest.raises(ValueError, match="unknown"):
        task_rows("grpolab:arithmetic", 4, 0, {"difficulties": ["4-digit"]})
    with pytest.raises(ValueError, match="no task"):
        task_rows("grpolab:algebra", 4, 0)
