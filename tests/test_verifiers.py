"""The strict final-answer verifier: adversarial completions score 0, honest ones 1, in bounded time."""

from __future__ import annotations

import threading
import time

import pytest

from grpolab.rewards.builtin import load_reward, math_answer, math_lenient
from grpolab.rewards.verifiers import final_answer, judge

Q = "What is 62 + 82?"

# (completion, gold, verdict): what the default `math` reward must say.
CASES = [
    # restating the question, which math-verify's own extraction evaluates and pays
    ("To solve the expression 62 + 82, we need to add the numbers 62 and 82.", "144", 0.0),
    ("The answer is 62+82.", "144", 0.0),
    ("The answer is 62 + 82", "144", 0.0),
    ("\\boxed{62+82}", "144", 0.0),
    ("<answer>62 + 82</answer>", "144", 0.0),
    ("\\boxed{288/2}", "144", 0.0),  # an unfinished division
    ("\\boxed{12^2}", "144", 0.0),
    ("\\boxed{2 \\times 72}", "144", 0.0),
    # hedged: several candidate answers
    ("It is 150 or 144", "144", 0.0),
    ("The answer is 150 or 144.", "144", 0.0),
    ("The answer is 144, 150", "144", 0.0),
    ("\\boxed{150} or maybe \\boxed{144}", "144", 0.0),
    ("The answer is 150.\nThe answer is 144.", "144", 0.0),
    ("<answer>144</answer><answer>150</answer>", "144", 0.0),
    ("\\boxed{144 \\text{ or } 150}", "144", 0.0),
    ("\\boxed{\\pm 144}", "144", 0.0),
    # no final answer at all
    ("", "144", 0.0),
    ("62 + 82 = 144 because 60 + 80 = 140", "144", 0.0),
    ("The answer is \\boxed{}.", "144", 0.0),
    ("\\boxed{144", "144", 0.0),
    # wrong
    ("\\boxed{145}", "144", 0.0),
    ("The answer is -144.", "144", 0.0),
    ("The answer is 1440.", "144", 0.0),
    # honest final answers
    ("62 + 82 = 144.\nThe answer is 144.", "144", 1.0),
    # the last stated result, when no answer line exists (last_statement)
    ("so it is 0.5", "\\frac{1}{2}", 1.0),
    ("Work out 4 * 4 = 16.", "16", 1.0),
    ("62 + 82 = 144", "144", 1.0),
    ("We add 62 and 82, so the total is 144.", "144", 1.0),
    ("62 + 82 = 144. Then 144 + 6 = 150.", "144", 0.0),  # more arithmetic after the answer
    ("62 + 82 = 144. Then 144 + 6", "144", 0.0),
    ("62 + 82 = 144, 145, 146", "144", 0.0),  # a list after the answer
    ("62 + 82 = 100 + 44", "144", 0.0),  # unfinished
    ("= 62+82", "144", 0.0),
    ("62 + 82 is about 144.", "144", 0.0),  # hedged
    ("Is it 144?", "144", 0.0),
    ("I do not think 62 + 82 = 144.", "144", 0.0),
    ("62 + 82 = 144.\nThe answer is N.", "144", 1.0),  # the instruction's placeholder echoed
    ("The answer is 144. I hope this helps!", "144", 1.0),
    ("The answer is 144. Or 150.", "144", 0.0),
    ("The answer is 144.", "144", 1.0),
    ("The answer to this classic math problem is 144.\nIn maths, 62 + 82 is a sum.", "144", 1.0),
    ("The answer to 62 + 82 is 144.", "144", 1.0),
    ("The answer to 62 + 82 = 144.", "144", 1.0),
    ("The answer to this is 150 or 144.", "144", 0.0),
    ("I know the answer to this, it is 150. Or 144?", "144", 0.0),
    ("Final answer: 144", "144", 1.0),
    ("**Answer:** $144$", "144", 1.0),
    ("#### 144", "144", 1.0),
    ("144", "144", 1.0),
    ("$144$", "144", 1.0),
    ("We add: 62 + 82 = 144, so \\boxed{144}.", "144", 1.0),
    ("\\boxed{144} and again \\boxed{144}", "144", 1.0),
    ("<think>60+80=140, 2+2=4</think> <answer>144</answer>", "144", 1.0),
    ("The answer is \\boxed{1000}", "1,000", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{144.0}", "144", 1.0),
    ("The answer is -4.", "-4", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 0.0),  # not in lowest terms
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1.0),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 1.0),  # equivalence is math-verify's job
    ("\\boxed{(1, 2)}", "(1, 2)", 1.0),  # the gold itself is a pair: commas allowed
    ("\\boxed{x^2 + 1}", "x^2+1", 1.0),
]


@pytest.mark.parametrize(("completion", "gold", "verdict"), CASES)
def test_math_reward_verdicts(completion: str, gold: str, verdict: float) -> None:
    assert math_answer([Q], [completion], answer=[gold]) == [verdict]


def test_the_lenient_rule_is_gameable_and_the_strict_one_is_not() -> None:
    """The documented exploit: math-verify's answer finding pays a restated question."""
    hacks = ["To solve the expression 62 + 82, we need to add the numbers ...",
             "The answer is 62+82."]
    assert math_lenient([Q] * 2, hacks, answer=["144"] * 2) == [1.0, 1.0]
    assert math_answer([Q] * 2, hacks, answer=["144"] * 2) == [0.0, 0.0]


def test_final_answer_rule() -> None:
    assert final_answer("work... \\boxed{7} text") == "7"
    assert final_answer("\\boxed{\\frac{1}{\\sqrt{2}}}") == "\\frac{1}{\\sqrt{2}}"  # nested braces
    assert final_answer("The answer is 7. <answer>7</answer>") == "7"  # tags outrank lines
    assert final_answer("<answer>8</answer> The answer is 7.") == "8"
    assert final_answer("The answer is 7.\nThe answer is 8.") is None  # two different answers
    assert final_answer("just 7 apples") is None  # prose is not a bare answer
    assert final_answer("The answer is 7.", sources=["boxed"]) is None
    assert final_answer("\\boxed{7}", sources=["boxed"]) == "7"


def test_answer_sources_narrow_the_reward() -> None:
    boxed_only = load_reward("math", answer_sources=["boxed"])
    assert boxed_only([Q] * 2, ["The answer is 144.", "\\boxed{144}"], answer=["144"] * 2) == [
        0.0, 1.0]
    with pytest.raises(ValueError, match="answer_sources"):
        load_reward("math", answer_sources=["anywhere"])


ATTACKS = [
    "\\boxed{9^{9^{9}}}",  # an exponent tower (held math-verify for minutes)
    "\\boxed{9^{99999999}}",
    "\\boxed{" + "{" * 500 + "1" + "}" * 500 + "}",  # deeply nested braces
    "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}",
    "The answer is " + "1+" * 5000 + "1",
    "\\boxed{1" + "0" * 400 + "}",
    "<answer>" * 20000,
    "\\boxed{" * 20000,
    "The answer is " + "9" * 100_000,
    "x" * 1_000_000,
    ("The answer is 144.\n" + "a" * 2000 + "\n") * 200,
    "so it is" + " " * 200_000 + "144",  # the last_statement scan: no backtracking on spaces
    "it is 9" * 100_000,
    "62 + 82 = 144. " * 50_000,
    "so the total is " + "9" * 100_000,
    "= 1 " + "2 " * 100_000,
]


@pytest.mark.parametrize("attack", ATTACKS, ids=range(len(ATTACKS)))
def test_hostile_completions_are_judged_quickly(attack: str) -> None:
    """On any input, on or off the main thread, the verdict takes well under a second."""
    result: list[list[float]] = []
    t = threading.Thread(target=lambda: result.append(math_answer([Q], [attack], answer=["144"])))
    start = time.perf_counter()
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "the verifier hung"
    assert time.perf_counter() - start < 2.0
    assert result[0][0] in (0.0, 1.0)


def test_judge_compares_plain_numbers_exactly() -> None:
    assert judge("0.1", "1/10") and not judge("0.1000001", "0.1")
    assert judge("1,234,567", "1234567") and not judge("1,23", "123")
    assert not judge(None, "1")


def test_the_question_lets_a_remark_name_its_numbers_quickly() -> None:
    """After the answer, the question's own numbers may be named (not computed with); with a
    long question and a long completion the verdict still takes well under a second."""
    q = "Calculate 10 - 6."
    assert math_answer([q], ["10 - 6 = 4. This adds the numbers 10 and 6."], answer=["4"]) == [1.0]
    assert math_answer([q], ["10 - 6 = 4. The numbers 10 and 7."], answer=["4"]) == [0.0]
    assert math_answer([q], ["10 - 6 = 4, not 10 - 6 = 5."], answer=["4"]) == [0.0]
    assert math_answer([q], ["= 0. So, 10 - 6 is undefined."], answer=["0"]) == [0.0]
    assert math_answer([[{"role": "user", "content": q}]], ["10 - 6 = 4, from 10 - 6"],
                       answer=["4"]) == [1.0]
    start = time.perf_counter()
    long_q = "Calculate 1 + 1. " * 1000
    assert math_answer([long_q], ["1 + 1 = 2. " + "1 + 1 " * 100_000], answer=["2"]) == [1.0]
    assert time.perf_counter() - start < 2.0


BAGS = "Each bag has 8 candies. How many candies are in 2 bags?"


@pytest.mark.parametrize(("completion", "verdict"), [
    # a last sentence that restates the question's data states no new result
    ("2 x 8 = 16 candies. There are 2 additional bags of candies.", 1.0),
    ("2 x 8 = 16 candies (there are 2 bags)", 1.0),
    ("2 x 8 = 16 candies. There are 2 bags of 8 candies.", 1.0),
    ("2 x 8 = 15 candies. There are 2 bags.", 0.0),  # the result before it is still judged
    ("There are 2 bags.", 0.0),  # with nothing before it, it is the result
    ("2 x 8 = 16 candies? There are 2 bags.", 0.0),  # a question stays a question
    # ... but one that corrects or concludes does, and so does one about what is asked
    ("2 x 8 = 16 candies. Actually there are 2 bags.", 0.0),
    ("2 x 8 = 16 candies. No, there are 2 bags.", 0.0),
    ("2 x 8 = 16 candies. Wait, it is 2 bags of candies.", 0.0),
    ("2 x 8 = 16 candies. So there are 2 bags.", 0.0),
    ("2 x 8 = 16 candies. There are 8 candies.", 0.0),
    ("2 x 8 = 16 candies. There are 2 bags. There are 3 bags.", 0.0),
    ("2 x 8 = 16 candies." + " There are 2 bags." * 4, 0.0),  # at most 3 are looked past
])
def test_a_restated_quantity_after_the_answer(completion: str, verdict: float) -> None:
    assert math_answer([BAGS], [completion], answer=["16"]) == [verdict]


@pytest.mark.parametrize(("attack", "verdict"), [
    ("2 x 8 = 16 candies." + " There are 2 bags." * 20_000, 0.0),
    ("There are 2 bags " * 20_000, 0.0),
    ("= 16 (there are 2 bags) " * 20_000, 1.0),
], ids=range(3))
def test_restatements_are_judged_quickly(attack: str, verdict: float) -> None:
    start = time.perf_counter()
    assert math_answer([BAGS], [attack], answer=["16"]) == [verdict]
    assert time.perf_counter() - start < 2.0


FARM = "A farmer has 11 cows and 5 sheep. How many animals does he have in total?"


@pytest.mark.parametrize(("completion", "verdict"), [
    # a unit the question names is no part of the answer (math-verify reads "animals" as
    # a*n*i*m*a*l*s); any other word still is
    ("The answer is 11 + 5 = 16 animals.", 1.0),
    ("\\boxed{16 animals}", 1.0),
    ("The answer is 16 cows.", 1.0),
    ("The answer is 16 dogs.", 0.0),
    ("The answer is 16 animals in total.", 0.0),
    ("The answer is 16 times.", 0.0),  # a word that changes the value is no unit
    ("The answer is 16 hundred animals.", 0.0),
    ("The answer is 16 animals.\nThe answer is 17 animals.", 0.0),
])
def test_a_unit_the_question_names(completion: str, verdict: float) -> None:
    assert math_answer([FARM], [completion], answer=["16"]) == [verdict]
