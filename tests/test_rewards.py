"""Reward built-ins, spec loading and the failure-isolating scorer."""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import pytest
import torch

from grpolab.rewards.builtin import (
    THINK_ANSWER_PATTERN,
    exact_answer,
    format_reward,
    load_reward,
    math_answer,
)
from grpolab.rewards.scorer import ScoreResult, score


def test_exact_answer_strips_whitespace_and_stringifies_gold() -> None:
    completions = [" 42\n", "42.0", "41", "7"]
    assert exact_answer([""] * 4, completions, answer=[42, "42", "42", " 7 "]) == [
        1.0,
        0.0,
        0.0,
        1.0,
    ]


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("so it is 0.5", "\\frac{1}{2}", 1.0),  # its last stated result (test_verifiers.py)
        ("so it is 0.5 or 0.25", "\\frac{1}{2}", 0.0),
        ("so the answer is 0.5", "\\frac{1}{2}", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("The answer is \\boxed{1000}", "1,000", 1.0),
        ("<think>2+2</think> <answer>4</answer>", "4", 1.0),
        ("<think>the answer is 4</think> <answer>5</answer>", "4", 0.0),
        ("no idea", "4", 0.0),
        ("", "4", 0.0),
    ],
)
def test_math_answer(completion: str, gold: str, expected: float) -> None:
    assert math_answer(["q"], [completion], answer=[gold]) == [expected]


def test_math_answer_missing_gold_scores_zero() -> None:
    assert math_answer(["q"], ["\\boxed{1}"], answer=[None]) == [0.0]


def test_math_answer_works_off_the_main_thread() -> None:
    # math-verify's signal-based timeout raises ValueError outside the main thread.
    results: list[object] = []

    def run() -> None:
        try:
            results.append(math_answer(["q", "q"], ["\\boxed{7}", "\\boxed{8}"], answer=["7", "7"]))
        except Exception as e:  # noqa: BLE001 - surface the failure to the test thread
            results.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert results == [[1.0, 0.0]]


def test_format_reward_default_and_custom_pattern() -> None:
    fn = format_reward(THINK_ANSWER_PATTERN)
    good = "<think>\n2+2 is 4\n</think>\n<answer>4</answer>\n"
    assert fn([], [good, "<answer>4</answer>", good + " trailing"]) == [1.0, 0.0, 0.0]
    digits = format_reward(r"\d+")
    assert digits([], ["12", "12a"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="not a valid regex"):
        format_reward("(")


def test_load_builtins() -> None:
    assert load_reward("exact") is exact_answer
    assert load_reward("math") is math_answer
    assert load_reward("format")([], ["<think>a</think><answer>b</answer>"]) == [1.0]
    assert load_reward("format", format_pattern=r"x+")([], ["xxx", "<think>"]) == [1.0, 0.0]


def test_load_dotted_module_paths() -> None:
    assert load_reward("grpolab.rewards.builtin:exact_answer") is exact_answer
    assert load_reward("grpolab.rewards.builtin.math_answer") is math_answer


def test_load_from_file(tmp_path: Path) -> None:
    file = tmp_path / "my_rewards.py"
    file.write_text(
        "def length_reward(prompts, completions, **kw):\n"
        "    return [float(len(c)) for c in completions]\n"
        "NOT_CALLABLE = 3\n"
    )
    fn = load_reward(f"{file}:length_reward")
    assert fn(["p", "p"], ["ab", "abcd"]) == [2.0, 4.0]
    with pytest.raises(ValueError, match="no attribute 'missing'"):
        load_reward(f"{file}:missing")
    with pytest.raises(ValueError, match="not callable"):
        load_reward(f"{file}:NOT_CALLABLE")
    broken = tmp_path / "broken.py"
    broken.write_text("def oops(:\n    pass\n")
    with pytest.raises(ValueError, match="executing .* failed: SyntaxError") as info:
        load_reward(f"{broken}:oops")
    assert "\n" not in str(info.value)
    leaving = tmp_path / "leaving.py"  # (an exit at import ended grpolab without a word)
    leaving.write_text("import sys\nsys.exit(5)\n")
    with pytest.raises(ValueError, match="executing .* failed: SystemExit: 5"):
        load_reward(f"{leaving}:f")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nonsense", "unknown reward 'nonsense'"),
        ("no_such_module_xyz:fn", "module 'no_such_module_xyz' not found"),
        ("grpolab.rewards.builtin:no_such_fn", "has no attribute 'no_such_fn'"),
        ("grpolab.rewards.builtin:THINK_ANSWER_PATTERN", "is a str, not callable"),
        ("/no/such/file.py:fn", "file '/no/such/file.py' not found"),
        ("my_rewards.py", "name the function too"),
    ],
)
def test_bad_specs_raise_one_line_value_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        load_reward(spec)
    assert "\n" not in str(info.value)
    assert repr(spec) in str(info.value)


def _length(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    return [float(len(c)) for c in completions]


def _explodes_on_boom(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    if "boom" in completions:
        raise RuntimeError("kaboom")
    return [1.0] * len(completions)


def test_score_weighted_total_and_columns() -> None:
    res = score(
        [exact_answer, _length],
        ["p1", "p2"],
        ["3", "44"],
        {"answer": ["3", "5"]},
        weights=[10.0, 0.5],
    )
    assert isinstance(res, ScoreResult)
    assert res.names == ["exact_answer", "_length"]
    assert res.per_fn.dtype == torch.float32
    assert res.per_fn.tolist() == [[1.0, 1.0], [0.0, 2.0]]
    assert res.total.tolist() == [10.5, 1.0]
    assert res.problems == []


def test_raising_sample_only_penalises_that_sample(caplog: pytest.LogCaptureFixture) -> None:
    completions = ["fine", "boom", "also fine", "x" * 200]
    with caplog.at_level(logging.WARNING, logger="grpolab.rewards.builtin"):
        res = score([_explodes_on_boom], ["a", "b", "c", "d"], completions, {}, on_error=-1.0)
    assert res.total.tolist() == [1.0, -1.0, 1.0, 1.0]
    assert len(res.problems) == 1
    problem = res.problems[0]
    assert "_explodes_on_boom" in problem
    assert "RuntimeError: kaboom" in problem
    assert "sample 1" in problem
    assert "'boom'" in problem
    assert problem in caplog.text


def test_long_inputs_are_truncated_in_problem_messages() -> None:
    prompt, completion = "P" * 500, "boom"
    res = score([_explodes_on_boom], [prompt, "ok"], [completion, "ok"], {})
    assert res.total.tolist() == [0.0, 1.0]
    (problem,) = res.problems
    assert "P" * 100 not in problem
    assert len(problem) < 300


def test_bad_values_are_replaced_and_reported() -> None:
    def mixed(prompts: list[str], completions: list[str], **_: object) -> list[object]:
        return [math.nan, None, "high", math.inf, 0.25]

    res = score([mixed], ["p"] * 5, ["a", "b", "c", "d", "e"], {}, on_error=-2.0)
    assert res.per_fn[:, 0].tolist() == [-2.0, -2.0, -2.0, -2.0, 0.25]
    assert len(res.problems) == 4
    for index, problem in zip([0, 1, 2, 3], res.problems):
        assert f"sample {index} " in problem
        assert "'mixed'" in problem


def test_wrong_length_and_non_list_penalise_whole_batch() -> None:
    def too_short(prompts: list[str], completions: list[str], **_: object) -> list[float]:
        return [1.0]

    def scalar(prompts: list[str], completions: list[str], **_: object) -> float:
        return 1.0

    res = score([too_short, scalar, _length], ["p"] * 3, ["a", "bb", "ccc"], {}, on_error=-1.0)
    assert res.per_fn.tolist() == [[-1.0, -1.0, 1.0], [-1.0, -1.0, 2.0], [-1.0, -1.0, 3.0]]
    assert len(res.problems) == 2
    assert "'too_short' returned 1 values for 3 samples" in res.problems[0]
    assert "'scalar'" in res.problems[1]


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


class _NoRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no")


class _NoLen(list):
    def __len__(self) -> int:
        raise RuntimeError("no")


def test_hostile_errors_and_values_are_problems_not_crashes() -> None:
    """A reward's exception whose __str__ raises, values whose __repr__ raises, a list whose
    __len__ raises: scored on_error and reported, the scorer itself never raises."""
    def unprintable(prompts, completions, **_):
        raise _Unprintable

    def no_repr(prompts, completions, **_):
        return [_NoRepr() for _ in completions]

    def no_len(prompts, completions, **_):
        return _NoLen([1.0] * len(completions))

    res = score([unprintable, no_repr, no_len], ["p"] * 2, ["a", "b"], {}, on_error=-1.0,
                fail_on_all_errors=False)
    assert res.per_fn.tolist() == [[-1.0] * 3] * 2
    assert any("_Unprintable: (its message could not be read)" in p for p in res.problems)
    assert any("<a _NoRepr>" in p for p in res.problems)


def test_batch_only_failure_falls_back_to_per_sample_scores() -> None:
    def no_batches(prompts: list[str], completions: list[str], **_: object) -> list[float]:
        if len(completions) > 1:
            raise MemoryError("batch too big")
        return [3.0]

    res = score([no_batches], ["p", "q"], ["a", "b"], {})
    assert res.total.tolist() == [3.0, 3.0]
    assert len(res.problems) == 1
    assert "on no single sample" in res.problems[0]


def test_numpy_and_tensor_returns_are_accepted() -> None:
    def as_tensor(prompts: list[str], completions: list[str], **_: object) -> torch.Tensor:
        return torch.tensor([0.5] * len(completions), dtype=torch.float64)

    res = score([as_tensor, as_tensor], ["p", "q"], ["a", "b"], {})
    assert res.names == ["as_tensor", "as_tensor_2"]
    assert res.total.tolist() == [1.0, 1.0]
    assert res.problems == []


def test_caller_mistakes_still_raise() -> None:
    with pytest.raises(ValueError, match="weights"):
        score([_length], ["p"], ["a"], {}, weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="column 'answer'"):
        score([_length], ["p"], ["a"], {"answer": ["1", "2"]})
