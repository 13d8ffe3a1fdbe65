"""Code datasets as they come (grpolab.rewards.code_data): MBPP, HumanEval, APPS/TACO,
open-r1, code_contests rows read into tests, and stdin/stdout programs judged here on their
output (grpolab.rewards.sandbox.run_io)."""

from __future__ import annotations

import ast
import json
import logging

import pytest

from grpolab.rewards.builtin import load_reward
from grpolab.rewards.code_data import (
    APPS_IMPORTS,
    Case,
    bind_solution,
    humaneval_tests,
    row_case,
    same_output,
)
from grpolab.rewards.sandbox import Limits, check_tests, code_reward, run_case, run_io

QUICK = Limits(cpu_seconds=2, wall_seconds=5)

# HumanEval/0's test, as the dataset has it
HE_TEST = """

METADATA = {
    'author': 'jt',
    'dataset': 'test'
}


def check(candidate):
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True
    x = [1.0, 2.0, 5.9, 4.0, 5.0]
    assert candidate(x, 0.8) == False
    assert True, "This prints if this assert fails 1 (good for debugging!)"
    for t in [0.1, 0.05]:
        assert candidate([1.0, 2.0, 3.0], t) == False

"""
HE_RIGHT = ("def has_close_elements(numbers, threshold):\n"
            "    return any(abs(a - b) < threshold for i, a in enumerate(numbers)\n"
            "               for j, b in enumerate(numbers) if i != j)\n")


PYTEST = """import math
import pytest
from solution import two_sum, add

def test_basic():
    \"\"\"A docstring.\"\"\"
    assert two_sum([2, 7, 11, 15], 9) == [0, 1]

def test_other():
    res = two_sum([3, 2, 4], 6)
    assert res == [1, 2]

@pytest.mark.parametrize("a,b,expected", [(1, 2, 3), (2, 3, 5)])
def test_add(a, b, expected):
    assert add(a, b) == expected

@pytest.mark.parametrize("x", [1, 2])
def test_zero(x):
    assert add(x, 0) == x

def helper():
    return 1
"""


def test_each_datasets_columns_read_as_its_own_harness_reads_them() -> None:
    assert row_case({"tests": ["assert f(1) == 2", " "]}) == Case(("assert f(1) == 2",))
    assert row_case({"answer": '["assert f(1) == 2"]'}) == Case(("assert f(1) == 2",))
    # MBPP sanitized: imports before each test; MBPP: setup code after the answer's code
    assert row_case({"test_list": ["assert area(1) > 3"], "test_imports": ["import math"],
                     "test_setup_code": "X = 1"}) == Case(("import math\nassert area(1) > 3",),
                                                          setup="X = 1")
    # HumanEval: asserts on candidate, on the entry point; `assert True` dropped; the
    # assignment before an assert kept with it; the loop one test
    assert humaneval_tests(HE_TEST, "has_close_elements") == (
        "assert has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True",
        "assert has_close_elements([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True",
        "x = [1.0, 2.0, 5.9, 4.0, 5.0]\nassert has_close_elements(x, 0.8) == False",
        ("x = [1.0, 2.0, 5.9, 4.0, 5.0]\nfor t in [0.1, 0.05]:\n"
         "    assert has_close_elements([1.0, 2.0, 3.0], t) == False"))
    assert row_case({"test": HE_TEST}) == Case()  # no entry_point: not HumanEval's format
    # APPS/TACO: stdin/stdout, lines given as a list sometimes; or calls of fn_name, the
    # expected value being the output or its first item
    io = {"inputs": ["1 2\n", ["3 4", "5"]], "outputs": ["3\n", ["7", "5"]]}
    assert row_case({"input_output": json.dumps(io)}) == Case(
        io=(("1 2\n", "3\n"), ("3 4\n5", "7\n5")), prelude=APPS_IMPORTS)
    calls = {"inputs": [[[2, 7], 9], ["ab"]], "outputs": [[[0, 1]], "ba"], "fn_name": "f"}
    assert row_case({"input_output": calls}) == Case(
        ("assert f([2, 7], 9) in [[[0, 1]], [0, 1], (0, 1)]", "assert f('ab') == 'ba'"),
        fn_name="f", prelude=APPS_IMPORTS)
    # open-r1: stdin_stdout cases only; code_contests: public then private tests
    info = {"language": "python", "test_cases": [
        {"input": "2\n", "output": "4\n", "type": "stdin_stdout"},
        {"input": "f(2)", "output": "4", "type": "function_call"}]}
    assert row_case({"verification_info": json.dumps(info)}) == Case(io=(("2\n", "4\n"),))
    assert row_case({"public_tests": {"input": ["1\n"], "output": ["1\n"]},
                     "private_tests": {"input": ["2\n"], "output": ["4\n"]}}) == Case(
        io=(("1\n", "1\n"), ("2\n", "4\n")))
    assert row_case({"tests": [{"input": "1\n", "output": "2\n"}]}) == Case(io=(("1\n", "2\n"),))
    # AceCode's test_cases (asserts), open-r1/codeforces' official_tests (stdin/stdout)
    assert row_case({"test_cases": ["assert f(1) == 2"]}) == Case(("assert f(1) == 2",))
    assert row_case({"official_tests": [{"input": "1\n", "output": "2\n"}]}).io == (
        ("1\n", "2\n"),)
    # a pytest file (KodCode): its test functions; `from solution import` dropped; parametrize
    # expanded, a case a test
    assert row_case({"test": PYTEST}) == Case((
        "import math\nimport pytest\nassert two_sum([2, 7, 11, 15], 9) == [0, 1]",
        "import math\nimport pytest\nres = two_sum([3, 2, 4], 6)\nassert res == [1, 2]",
        "import math\nimport pytest\na, b, expected = (1, 2, 3)\nassert add(a, b) == expected",
        "import math\nimport pytest\na, b, expected = (2, 3, 5)\nassert add(a, b) == expected",
        "import math\nimport pytest\nx = 1\nassert add(x, 0) == x",
        "import math\nimport pytest\nx = 2\nassert add(x, 0) == x"))
    assert row_case({"prompt": "q"}) == Case()


def test_a_pytest_file_and_the_names_its_tests_bind_are_judged() -> None:
    """A test's own names bound to literals (``expected = ...``, parametrize's arguments) are
    those literals here; one the test could change in place (``x.sort()``, passed to a call)
    stays the sandbox's, and a check on it cannot be judged."""
    code = ("def two_sum(xs, t):\n    seen = {}\n    for i, x in enumerate(xs):\n"
            "        if t - x in seen:\n            return [seen[t - x], i]\n"
            "        seen[x] = i\ndef add(a, b):\n    return a + b\n")
    assert run_case(code, row_case({"test": PYTEST}), QUICK).share == 1.0
    assert run_case(code.replace("a + b", "a * b"), row_case({"test": PYTEST}),
                    QUICK).passed == 2  # two_sum's; add(x, 0) == x is wrong for x = 1, 2
    changed = ["x = [3, 1, 2]\nx.sort()\nassert two_sum(x, 3) == x",
               "x = [3, 1]\nassert add(x, [2]) == x"]
    v = run_case(code, Case(tuple(changed)), QUICK)
    assert v.passed == 0 and "2 test(s) not checkable" in v.note


def test_humaneval_rows_train_on_their_entry_point() -> None:
    cols = {"test": [HE_TEST] * 3, "entry_point": ["has_close_elements"] * 3}
    wrong = "def has_close_elements(numbers, threshold):\n    return True\n"
    got = code_reward(["q"] * 3, [f"```python\n{HE_RIGHT}```", wrong, "x = 1"], **cols)
    assert got == [1.0, 0.5, 0.0]  # the wrong one passes the two `== True` tests
    assert load_reward("code_all")(["q"] * 2, [HE_RIGHT, wrong], **{
        k: v[:2] for k, v in cols.items()}) == [1.0, 0.0]


HE_PROMPT = ("from typing import List\n\n\ndef has_close_elements(numbers: List[float], "
             "threshold: float) -> bool:\n    \"\"\" Check if any two numbers are closer than "
             "threshold.\"\"\"\n")


def test_humaneval_answers_get_the_prompts_code() -> None:
    """A chat answer that writes only the entry point leans on the prompt's imports (its
    `List`); a base model's answer continues the prompt's function: both are judged on the
    prompt's code, as HumanEval's harness runs prompt + completion."""
    cols = {"test": [HE_TEST] * 3, "entry_point": ["has_close_elements"] * 3}
    body = HE_RIGHT.split("\n", 1)[1]  # the function's body only
    chat = "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n" + body
    got = code_reward([HE_PROMPT] * 3, [f"```python\n{chat}```", body, "    return True\n"],
                      **cols)
    assert got == [1.0, 1.0, 0.5]
    # a prompt that is not code (a template's words around it) is neither prelude nor start
    worded = row_case({"prompt": "Write it:\n" + HE_PROMPT, **{k: v[0] for k, v in cols.items()}})
    assert (worded.prelude, worded.prompt) == ("", "")


def test_a_leetcode_solution_class_answers_apps_call_tests() -> None:
    code = ("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
            "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
            "                return [seen[target - x], i]\n            seen[x] = i\n")
    row = {"input_output": {"inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]],
                            "outputs": [[[0, 1]], [[1, 2]]], "fn_name": "twoSum"}}
    assert run_case(code, row_case(row), QUICK).share == 1.0
    assert bind_solution(code, "twoSum").endswith("twoSum = Solution().twoSum\n")
    assert bind_solution("def twoSum(a, b): pass\n" + code, "twoSum").startswith("def twoSum")
    assert run_case(code.replace("[seen[target - x], i]", "[i, i]"), row_case(row),
                    QUICK).passed == 0
    # APPS's checker puts its imports first (List), reads fn_name beside input_output too
    typed = code.replace("def twoSum(self, nums, target)",
                         "def twoSum(self, nums: List[int], target: int) -> List[int]")
    beside = {"input_output": {k: v for k, v in row["input_output"].items() if k != "fn_name"},
              "fn_name": "twoSum"}
    assert run_case(typed, row_case(beside), QUICK).share == 1.0
    # APPS's checker reads a returned tuple as a list
    tuples = code.replace("[seen[target - x], i]", "(seen[target - x], i)")
    assert run_case(tuples, row_case(row), QUICK).share == 1.0


CASES = [("1 2\n", "3\n"), ("10 20\n", "30"), ("0.5 0.25\n", "0.75")]
SUMS = {  # the ways a program reads its input and writes its output
    "input": "a, b = map(float, input().split())\nprint(f'{a + b:g}')",
    "sys.stdin.read": "import sys\na, b = map(float, sys.stdin.read().split())\nprint(f'{a + b:g}')",
    "open(0)": "a, b = map(float, open(0).read().split())\nprint(f'{a + b:g}')",
    "buffer, exit(0)": ("import sys\na, b = map(float, sys.stdin.buffer.readline().split())\n"
                        "sys.stdout.write(f'{a + b:g}\\n')\nsys.exit(0)"),
    "main guard": ("def main():\n    a, b = map(float, input().split())\n    print(f'{a + b:g}')\n"
                   "if __name__ == '__main__':\n    main()"),
    "exit()": "a, b = map(float, input().split())\nprint(f'{a + b:g}')\nexit()",
    "os.write": ("import os\na, b = map(float, input().split())\n"
                 "os.write(1, f'{a + b:g}\\n'.encode())"),
}


@pytest.mark.parametrize("how", list(SUMS))
def test_a_program_is_run_on_each_input_and_its_output_judged_here(how: str) -> None:
    assert run_io(SUMS[how], CASES, QUICK).share == 1.0


def test_programs_that_fail_or_cheat_do_not_pass() -> None:
    assert run_io("print(3)", CASES, QUICK).passed == 1  # right on one case only
    v = run_io("print(3)\nexit(1)", CASES, QUICK)  # an error exit
    assert v.passed == 0 and v.note == "a test's code raised SystemExit", v
    threads = "import threading\nthreading.Thread(target=lambda: print(3)).start()"
    assert "RuntimeError" in run_io(threads, CASES, QUICK).note  # no new threads
    assert run_io("input()\ninput()", CASES, QUICK).passed == 0  # EOFError
    assert "SyntaxError" in run_io("print(", CASES, QUICK).note
    # each case starts afresh: what one run left in a module is gone in the next
    fresh = ("import sys\nif hasattr(sys, 'seen'):\n    print('stale')\nelse:\n"
             "    sys.seen = 1\n    a, b = map(float, input().split())\n    print(f'{a + b:g}')")
    assert run_io(fresh, CASES, QUICK).share == 1.0
    forge = ("import os\nfor fd in range(3, 20):\n    try:\n"
             "        os.write(fd, b'x v 0 0 \"3\"\\nx v 1 0 \"30\"\\n')\n    except OSError:\n"
             "        pass\nprint(0)")
    assert run_io(forge, CASES, QUICK).passed == 0


def test_outputs_are_compared_as_judges_compare_them() -> None:
    assert same_output("3 \n\n\n", "3")  # trailing spaces and blank lines
    assert same_output("1  2\n3", "1 2\n3\n")  # spaces between tokens
    assert same_output("0.3333333", "0.333333333")  # within 1e-6
    assert same_output("1e-7", "0.0")
    assert not same_output("0.34", "0.333333333")
    assert not same_output("3.0", "3")  # an integer answer is read as text
    assert not same_output("1_0.5", "10.5")
    assert not same_output("YES", "yes")
    assert not same_output("1\n\n2", "1\n2")  # a blank line between lines counts
    assert not same_output("nan", "nan.0") and not same_output("1", "inf.")
    assert not same_output(3, "3")  # not text: not a program's output


def test_tests_it_cannot_judge_are_counted_per_file_at_the_start(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpolab.rewards import sandbox

    monkeypatch.setattr(sandbox, "_WARNED", set())
    rows = [{"tests": ["assert f(1) == 1", "def g():\n    return 2\nassert f(2) == g()"]},
            {"tests": []}]
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        check_tests(rows, "'train.jsonl'")
        check_tests(rows[:1], "'test.jsonl'")
        check_tests(rows[:1], "'quiet.jsonl'", warn=False)  # (torchrun's other ranks)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "1 of the 2 tests of 'train.jsonl' not checkable" in said[0]  # a helper def
    assert "1 of the 2 rows of 'train.jsonl' with no tests" in said[0]
    assert "'test.jsonl'" in said[1]


def test_data_in_any_known_format_is_accepted_and_none_refused() -> None:
    check_tests([{"prompt": "q", "test": HE_TEST, "entry_point": "has_close_elements"}], "he")
    check_tests([{"question": "q", "input_output": json.dumps({"inputs": ["1\n"],
                                                                "outputs": ["1\n"]})}], "apps")
    check_tests([{"prompt": "q", "test_list": ["assert f(1) == 1"]}], "mbpp")
    with pytest.raises(ValueError, match="needs the tests in a column.*test_list"):
        check_tests([{"prompt": "q", "solutions": "[]"}], "data")
    # JSON text that does not parse (a list pandas' to_csv wrote) is named, not read as no tests
    for row in ({"tests": '["assert f(1) == 1",'}, {"input_output": "{'inputs': ['1']}"}):
        with pytest.raises(ValueError, match=r"row 2's '(tests|input_output)' is not valid JSON"):
            check_tests([{"tests": ["assert f(1) == 1"]} if "tests" in row else
                         {"input_output": {"inputs": ["1"], "outputs": ["1"]}}, row], "d.csv")


def test_a_humaneval_file_loads_and_trains_as_it_is(tmp_path, capsys) -> None:
    from helpers import run_cli

    from grpolab.config.load import make_config
    from grpolab.data.files import run_rows
    from grpolab.rewards.scorer import row_columns, score
    from grpolab.rollout.tinyhf import make_tiny_model

    data = tmp_path / "humaneval.jsonl"
    row = {"task_id": "HumanEval/0", "prompt": "def has_close_elements(numbers, threshold):\n",
           "canonical_solution": HE_RIGHT, "test": HE_TEST, "entry_point": "has_close_elements"}
    data.write_text("".join(json.dumps({**row, "task_id": f"HumanEval/{i}"}) + "\n"
                            for i in range(4)))
    # the docs' YAML: answer_column: null reads no answer column (it read a column 'None')
    (tmp_path / "run.yaml").write_text(f"dataset: {data}\nanswer_column: null\n")
    cfg = make_config(str(tmp_path / "run.yaml"), command="train")
    assert cfg.answer_column == ""
    rows = run_rows(cfg)[0]
    res = score([code_reward], [r["prompt"] for r in rows[:2]], [HE_RIGHT, "pass"],
                row_columns(rows[:2]))
    assert res.per_fn[:, 0].tolist() == [1.0, 0.0]
    model = make_tiny_model(tmp_path / "model", arch="llama", hidden=32, heads=4)
    capsys.readouterr()
    code, err = run_cli(["train", "--model-path", model, "--dataset", str(data),
                         "--answer-column", "", "--rewards", "code", "--steps", "1",
                         "--budget", "8", "--group-size", "4", "--max-new-tokens", "8",
                         "--out-dir", str(tmp_path / "run")], capsys)
    assert code == 0, err
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])
    assert step["step"] == 1 and step["reward_problems"] == 0  # the tests reached the reward
    assert step["rewards/code_reward"] == 0.0  # (a random model's answers)


def test_expected_exceptions_are_judged_here_from_the_builtin_classes_raised() -> None:
    """``pytest.raises`` (and ``try: ...; assert False / except E: pass``): the sandbox sends
    back which builtin exception classes the raised one is an instance of, and its text; the
    check is made here. A class of the answer's own named ValueError is not one."""
    code = ("def root(x):\n    if x < 0:\n        raise ValueError('negative input')\n"
            "    return x ** 0.5\nclass Missing(KeyError):\n    pass\n"
            "def look(k):\n    raise Missing(k)\n")
    right = ["with pytest.raises(ValueError):\n    root(-1)",
             "with pytest.raises(ValueError, match='neg.*input'):\n    root(-1)",
             "try:\n    root(-4)\n    assert False\nexcept ValueError:\n    pass",
             "with pytest.raises((LookupError, TypeError)):\n    look(1)"]
    wrong = ["with pytest.raises(ValueError, match='positive'):\n    root(-1)",
             "with pytest.raises(TypeError):\n    root(-1)",
             "with pytest.raises(ValueError):\n    root(1)"]  # nothing raised
    case = Case(tuple(f"import pytest\n{t}" for t in right + wrong))
    v = run_case(code, case, QUICK)
    assert (v.passed, v.total, v.note) == (4, 7, ""), v
    own = "class ValueError(Exception):\n    pass\ndef root(x):\n    raise ValueError('negative')\n"
    assert run_case(own, Case(tuple(right[:2])), QUICK).passed == 0
    # in a pytest file, alike
    file = "import pytest\nfrom solution import root\n\ndef test_neg():\n" \
           "    with pytest.raises(ValueError):\n        root(-1)\n    assert root(4) == 2\n"
    assert run_case(code, row_case({"test": file}), QUICK).share == 1.0


# HumanEval+ (evalplus): inputs and results in check, compared by its assertion helper
PLUS = """
import numpy as np

def assertion(out, exp, atol):
    exact_match = out == exp
    if atol == 0 and isinstance(exp, float):
        atol = 1e-6
    if not exact_match and atol != 0:
        np.testing.assert_allclose(out, exp, atol=atol)
    else:
        assert exact_match

def check(candidate):
    inputs = [[1.0, 2.0], [3, 4], [[1, 2], 0]]
    results = [1.5, 3.5, [1, 2]]
    for i, (inp, exp) in enumerate(zip(inputs, results)):
        assertion(candidate(*inp), exp, 0)
"""


def test_humaneval_plus_rows_give_a_test_an_input() -> None:
    assert humaneval_tests(PLUS, "mid") == (
        "assert math.isclose(mid(1.0, 2.0), 1.5, rel_tol=1e-07, abs_tol=1e-06)",
        "assert math.isclose(mid(3, 4), 3.5, rel_tol=1e-07, abs_tol=1e-06)",
        "assert mid([1, 2], 0) == [1, 2]")  # no numpy import: the helper's, not the tests'
    row = {"test": PLUS, "entry_point": "mid"}
    code = "def mid(a, b):\n    return a if isinstance(a, list) else (a + b) / 2{}\n"
    assert run_case(code.format(" + 1e-9"), row_case(row), QUICK).share == 1.0  # within 1e-6
    assert run_case(code.format(" + 1e-3"), row_case(row), QUICK).passed == 1


def test_humaneval_plus_lists_of_floats_are_compared_within_its_tolerance() -> None:
    """evalplus compares a list of floats with numpy's allclose (1e-6 when atol is 0): an
    answer that rounds differently passes, a wrong item, a short list or an error does not."""
    xs = [-1.01, 3.03, 5.77, -8.12, -9.43]
    want = [(x - min(xs)) / (max(xs) - min(xs)) for x in xs]
    plus = PLUS.replace("isinstance(exp, float)", "is_floats(exp)").replace(
        "inputs = [[1.0, 2.0], [3, 4], [[1, 2], 0]]", f"inputs = [[{xs}], [[2.0, 2.0]]]").replace(
        "results = [1.5, 3.5, [1, 2]]", f"results = [{want}, []]")
    case = row_case({"test": plus, "entry_point": "unit"})
    assert case.tests[0].splitlines()[:2] == [
        f"evalplus_0, evalplus_1, evalplus_2, evalplus_3, evalplus_4 = unit({xs})",
        f"assert math.isclose(evalplus_0, {want[0]!r}, rel_tol=1e-07, abs_tol=1e-06)"]
    assert case.tests[1] == "assert unit([2.0, 2.0]) == []"  # an empty list: exactly
    body = ("def unit(xs):\n    lo, hi = min(xs), max(xs)\n    if lo == hi:\n"
            "        return []\n    {}\n")
    exact = body.format("return [(x - lo) / (hi - lo) for x in xs]")
    other = body.format("s = 1.0 / (hi - lo)\n    return [(x - lo) * s for x in xs]")
    assert [(x - min(xs)) * (1.0 / (max(xs) - min(xs))) for x in xs] != want  # rounds apart
    for code, passed in ((exact, 2), (other, 2), (other.replace("* s", "* s + 1e-3"), 1),
                         (other.replace("for x in xs]", "for x in xs][:4]"), 1),
                         (other.replace("s = 1.0", "s = 1 / 0 if xs[0] < 0 else 1.0"), 1)):
        assert run_case(code, case, QUICK).passed == passed, code


# MBPP+ (evalplus): the row keeps MBPP's test_list and adds its test program
MBPP_PLUS = {
    "task_id": 2, "code": "def similar(a, b):\n    return tuple(sorted(set(a) & set(b)))",
    "test_imports": [], "test_list": ["assert set(similar((3, 4), (4, 5))) == set((4,))"],
    "test": "import numpy as np\nfrom math import inf\n\ndef assertion(out, exp, atol):\n"
            "    assert out == exp\n\ninputs = [[(3, 4), (4, 5)], [(1, inf), (inf, 2)], "
            "[(0.5, 1), (0.5,)]]\nresults = [(4,), (inf,), (0.5,)]\n"
            "for i, (inp, exp) in enumerate(zip(inputs, results)):\n"
            "    assertion(similar(*inp), exp, 0)\n"}


def test_mbpp_plus_rows_give_a_test_an_input_of_their_program() -> None:
    """The plus program's inputs (MBPP's among them) are read, not test_list's three; inf
    in them survives; a program whose expected values are computed (one of evalplus's
    special oracles) leaves the row to test_list."""
    case = row_case(MBPP_PLUS)
    assert case.tests == (
        "assert similar((3, 4), (4, 5)) == (4,)",
        ("evalplus_0, = similar((1, float('inf')), (float('inf'), 2))\n"
        "assert math.isclose(evalplus_0, float('inf'), rel_tol=1e-07, abs_tol=1e-06)"),
        ("evalplus_0, = similar((0.5, 1), (0.5,))\n"
        "assert math.isclose(evalplus_0, 0.5, rel_tol=1e-07, abs_tol=1e-06)"))
    assert run_case(MBPP_PLUS["code"], case, QUICK).share == 1.0
    assert run_case("def similar(a, b):\n    return (5,) if 4 in a else tuple(set(a) & set(b))",
                    case, QUICK).passed == 2
    oracle = {**MBPP_PLUS, "test": MBPP_PLUS["test"].replace(
        "results = [(4,), (inf,), (0.5,)]", "results = [ref(*x) for x in inputs]")}
    assert row_case(oracle).tests == ("assert set(similar((3, 4), (4, 5))) == set((4,))",)


def test_mbpp_plus_set_tasks_and_long_float_lists() -> None:
    """evalplus's evaluator compares similar_elements' (and 7 other tasks') outputs as sets,
    so the reference's own order is not required; a list of 1,000 floats is sent back once,
    not once an item (4 MB of output would stop the row)."""
    row = {**MBPP_PLUS, "test": MBPP_PLUS["test"].replace("similar", "similar_elements")}
    case = row_case(row)
    assert case.tests[0] == "assert set(similar_elements((3, 4), (4, 5))) == set((4,))"
    code = "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b), reverse=True))"
    assert run_case(code, case, QUICK).share == 1.0
    n = 1000
    plus = PLUS.replace("inputs = [[1.0, 2.0], [3, 4], [[1, 2], 0]]",
                        f"inputs = [[{n}], [{n}]]").replace(
        "results = [1.5, 3.5, [1, 2]]", f"results = {[[i / 3 for i in range(n)]] * 2}")
    long = row_case({"test": plus, "entry_point": "thirds"})
    assert long.tests[0].startswith("evalplus_0, evalplus_1, ")
    v = run_case("def thirds(n):\n    return [i * (1 / 3) for i in range(n)]", long)
    assert (v.passed, v.total) == (2, 2), v.note


def test_expected_sides_built_from_constants_are_folded_here() -> None:
    """``[0] * 3``, ``'a' * 3``, ``(1 << 31) - 1``, ``list(range(5))``, ``'abc'[::-1]``,
    ``math.sqrt(2)``, ``sorted(..., reverse=True)``: computed in the trainer, within bounds
    (``'x' * 10 ** 9`` is left alone, and the test cannot be judged)."""
    from grpolab.rewards.fold import fold

    def folded(src: str) -> str:
        return ast.unparse(fold(ast.parse(src), frozenset()))

    assert folded("assert f(3) == [0] * 3") == "assert f(3) == [0, 0, 0]"
    assert folded("assert g() == (1 << 31) - 1 and h() == 'abc'[::-1]") == \
        "assert g() == 2147483647 and h() == 'cba'"
    assert folded("assert f() == list(range(3)) + [math.inf]") == \
        "assert f() == [0, 1, 2, float('inf')]"
    assert folded("assert f() == 'x' * 10 ** 9") == "assert f() == 'x' * 1000000000"
    # shared inner lists count all through: 10**10 items are not walked, nor written
    assert folded("assert f() == [[0] * 10 ** 5] * 10 ** 5") == \
        "assert f() == [[0] * 100000] * 100000"
    assert folded("assert f() == sum([[1]] * 3, [])") == "assert f() == sum([[1], [1], [1]], [])"
    assert ast.unparse(fold(ast.parse("assert f() == len([1])"), frozenset({"len"}))) == \
        "assert f() == len([1])"  # the answer's own len
    code = "def f(n):\n    return [0] * n\ndef h():\n    return 2 ** 31 - 1\n"
    tests = ("assert f(3) == [0] * 3", "assert h() == (1 << 31) - 1", "assert f(2) == [0] * 3",
             "assert f(1) == [0] * 10 ** 9")
    v = run_case(code, Case(tests), QUICK)
    assert (v.passed, v.total) == (2, 4) and "1 test(s) not checkable" in v.note
