"""The tests of common code datasets, as the ``code`` reward reads them from a row.

The first of these columns that a row has gives its tests:

- ``tests``: asserts (``["assert add(2, 3) == 5", ...]``, or a JSON list in a string), or
  stdin/stdout cases (``[{"input": "1 2\\n", "output": "3\\n"}, ...]``); ``test_cases``
  (AceCode) and ``official_tests`` (open-r1/codeforces) alike;
- ``test`` holding MBPP+'s test program (its ``inputs``, ``results`` and ``assertion`` loop):
  a test an input, as HumanEval+'s below (it holds ``test_list``'s inputs too);
- ``test_list`` (MBPP): asserts; ``test_imports`` (MBPP sanitized) are put before each one and
  ``test_setup_code`` (MBPP) runs after the answer's code;
- ``test`` with ``entry_point`` (HumanEval, HumanEval+): ``def check(candidate)``, each
  assert in it on ``candidate`` one test on the entry point, the assignments and imports before
  it kept; a loop around asserts one test (judged when it runs over literals); HumanEval+'s
  loop over its ``inputs`` and ``results``, a test an input (floats and lists of floats within
  its ``assertion``'s tolerance);
  without ``entry_point``, a pytest file (KodCode): each ``def test_...()`` one test;
- ``input_output`` (APPS, TACO): ``{"inputs": [...], "outputs": [...]}``, stdin/stdout cases, or
  with ``fn_name`` calls of that function (a ``class Solution`` method is bound to the name),
  the expected value being the output or, when that is a list, its first item (as APPS's own
  checker reads it);
- ``verification_info`` (open-r1): its ``test_cases`` of type stdin_stdout;
- ``public_tests``/``private_tests`` (deepmind/code_contests): ``{"input": [...], "output": [...]}``;
- ``answer``: asserts, as ``tests``.

A column may hold JSON text (CSV, parquet) or the value itself. A program's output is compared
with the expected one as judges compare (``same_output``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from grpolab.rewards.fold import source
from grpolab.rewards.shapes import is_literal, parse

# HumanEval+'s list of floats compared item by item up to this length (the answer's value
# unpacked into as many names in the sandbox, each sent back once), exactly beyond it
MAX_CLOSE_ITEMS = 1_000
# MBPP+ tasks whose outputs evalplus's evaluator compares as sets (its _special_oracle.py);
# its not-None tasks (check_str, ...) return re.Match objects, which cannot be judged here
MBPP_SET_EQ = frozenset({"similar_elements", "find_char_long", "common_in_nested_lists",
                         "extract_singly", "larg_nnum", "intersection_array", "find_dissimilar",
                         "Diff"})
COLUMNS = ("tests", "test_cases", "official_tests", "test_list", "test", "input_output",
           "verification_info", "public_tests", "answer")


@dataclass(frozen=True)
class Case:
    """One question's tests: asserts, or (stdin, expected stdout) pairs; never both."""

    tests: tuple[str, ...] = ()
    io: tuple[tuple[str, str], ...] = ()
    setup: str = ""  # run after the answer's code (MBPP's test_setup_code)
    fn_name: str = ""  # a ``class Solution`` method the tests call by this name (APPS)
    prelude: str = ""  # run before it: the prompt's imports and helpers, APPS's imports
    entry: str = ""  # the function the prompt begins (HumanEval's entry point)
    prompt: str = ""  # that prompt, as code: an answer that lacks ``entry`` continues it

    @property
    def count(self) -> int:
        return len(self.io) or len(self.tests)


def column_of(row: Mapping[str, Any]) -> str | None:
    """The column a row's tests come from (see the module's docstring), or None."""
    if "test" in row and "entry_point" not in row and plus_program_tests(str(row["test"])):
        return "test"  # MBPP+: its program's inputs include test_list's
    for name in COLUMNS:
        if name in row and (name != "test" or "entry_point" in row
                            or "def test" in str(row[name])):
            return name
    return None


def row_case(row: Mapping[str, Any]) -> Case:
    """A row's tests, in whichever of the known formats it has them."""
    column = column_of(row)
    value = _json(row.get(column)) if column else None
    if column in ("tests", "test_cases", "official_tests", "answer"):
        return _tests_or_io(value)
    if column == "test_list":
        imports = [str(line) for line in _json(row.get("test_imports")) or [] if str(line).strip()]
        setup = str(row.get("test_setup_code") or "")
        return Case(tuple("\n".join([*imports, t]) for t in asserts(value)), setup=setup)
    if column == "test" and "entry_point" in row:
        entry, prompt = str(row.get("entry_point") or ""), row.get("prompt")
        prelude = _prelude(prompt, entry) if isinstance(prompt, str) else None
        return Case(humaneval_tests(str(value or ""), entry), prelude=prelude or "",
                    entry=entry, prompt=prompt if prelude is not None else "")
    if column == "test":  # (no entry_point): MBPP+'s program, else a pytest file
        text = str(value or "")
        return Case(plus_program_tests(text) or pytest_tests(text))
    if column == "input_output" and isinstance(value, Mapping):
        ins, outs = value.get("inputs") or [], value.get("outputs") or []
        fn_name = value.get("fn_name") or row.get("fn_name")
        case = _calls(str(fn_name), ins, outs) if fn_name else Case(io=_pairs(ins, outs))
        return dataclasses.replace(case, prelude=APPS_IMPORTS)
    if column == "verification_info" and isinstance(value, Mapping):
        if str(value.get("language") or "python").lower() not in ("python", "python3", "py"):
            return Case()  # (another language's program: the sandbox runs Python only)
        cases = [c for c in value.get("test_cases") or [] if isinstance(c, Mapping)
                 and c.get("type", "stdin_stdout") == "stdin_stdout"]
        return Case(io=_pairs([c.get("input") for c in cases], [c.get("output") for c in cases]))
    if column == "public_tests":
        pairs: tuple[tuple[str, str], ...] = ()
        for name in ("public_tests", "private_tests"):
            part = _json(row.get(name))
            if isinstance(part, Mapping):
                pairs += _pairs(part.get("input") or [], part.get("output") or [])
        return Case(io=pairs)
    return Case()


# what APPS's own checker puts before every answer (but numpy, which the sandbox lacks)
APPS_IMPORTS = ("import sys\nimport time\nimport itertools\nfrom itertools import accumulate, "
                "product, permutations, combinations\nimport collections\nfrom collections import "
                "Counter, OrderedDict, deque, defaultdict, ChainMap\nfrom functools import "
                "lru_cache\nimport math\nfrom math import sqrt, sin, cos, tan, ceil, fabs, floor, "
                "gcd, exp, log, log2\nimport fractions\nfrom typing import List, Tuple\n"
                "import random\nimport heapq\nfrom heapq import *\n")


def _prelude(prompt: str, entry: str) -> str | None:
    """A HumanEval prompt's imports and helper functions (``from typing import List``; 10's
    ``is_palindrome``), which a chat answer that writes only the entry point relies on; None
    if the prompt is not code (a chat template's text around it)."""
    if (tree := parse(prompt)) is None:
        return None
    return "\n".join(ast.unparse(n) for n in tree.body if not (
        isinstance(n, ast.FunctionDef) and n.name == entry) and not isinstance(n, ast.Expr))


def broken_json(row: Mapping[str, Any]) -> str | None:
    """The test column of ``row`` that holds JSON text which does not parse, if one does."""
    for name in (column_of(row), "test_imports", "public_tests", "private_tests"):
        value = row.get(name) if name else None
        if _looks_json(value) and isinstance(_parsed(value), str):
            return name
    return None


def asserts(value: Any) -> tuple[str, ...]:
    """A list of snippets (or one snippet) as test texts, empty ones dropped."""
    if isinstance(value, str):
        return (value,) if value.strip() else ()
    if isinstance(value, (list, tuple)):
        return tuple(str(t) for t in value if str(t).strip())
    return ()


def _json(value: Any) -> Any:
    """JSON text (a CSV or parquet column) read; anything else as it is."""
    return _parsed(value) if _looks_json(value) else value


def _looks_json(value: Any) -> bool:
    return isinstance(value, str) and value.lstrip()[:1] in ("[", "{")


@functools.lru_cache(maxsize=64)  # a group's G answers share a row (TACO's: megabytes)
def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _tests_or_io(value: Any) -> Case:
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(c, Mapping) and "input" in c and "output" in c for c in value):
        return Case(io=_pairs([c["input"] for c in value], [c["output"] for c in value]))
    return Case(asserts(value))


def _text(x: Any) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)  # APPS: lines, sometimes


def _pairs(ins: Any, outs: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(ins, list) or not isinstance(outs, list):
        return ()
    return tuple((_text(i), _text(o)) for i, o in zip(ins, outs) if i is not None and
                 o is not None)


def _calls(fn: str, ins: Any, outs: Any) -> Case:
    if not fn.isidentifier() or not isinstance(ins, list) or not isinstance(outs, list):
        return Case()
    tests = []
    for args, out in zip(ins, outs):
        args = args if isinstance(args, list) else [args]
        call = f"{fn}({', '.join(map(source, args))})"
        first = out[0] if isinstance(out, list) and out else None  # APPS: output or its first
        either = first is not None and (  # item; a tuple returned is read as a list
            f"[{source(out)}, {source(first)}, {source(tuple(first))}]"
            if isinstance(first, list) else f"[{source(out)}, {source(first)}]")
        tests.append(f"assert {call} in {either}" if either else
                     f"assert {call} == {source(out)}")
    return Case(tuple(tests), fn_name=fn)


def bind_solution(code: str, fn_name: str) -> str:
    """The answer's code, with ``fn_name`` bound to ``Solution().fn_name`` when it defines that
    method on a ``class Solution`` (LeetCode style) and no function of that name."""
    if (tree := parse(code)) is None:
        return code  # it fails in the sandbox, as it would anyway
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    methods = {m.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Solution"
               for m in n.body if isinstance(m, ast.FunctionDef)}
    if fn_name in methods and fn_name not in top:
        return f"{code}\n\n{fn_name} = Solution().{fn_name}\n"
    return code


@functools.lru_cache(maxsize=1024)
def humaneval_tests(test: str, entry_point: str) -> tuple[str, ...]:
    """The asserts of ``def check(candidate)`` as tests on ``entry_point``: each with the
    imports and assignments before it; an assert that does not use ``candidate``
    (``assert True``) dropped; a statement with asserts inside (a loop) one test of its own."""
    if (tree := parse(test)) is None:
        return ()
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"
                  and n.args.args), None)
    if check is None or not entry_point.isidentifier():
        return ()
    name = check.args.args[0].arg
    rename = _Rename(name, entry_point)
    before = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    others = [n for n in tree.body if n is not check]
    tests, consts = [], {}
    for node in check.body:
        if isinstance(node, ast.For) and (plus := _evalplus(node, consts, name, entry_point)):
            tests += plus  # (its numpy import is the assertion helper's, not theirs)
            continue
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            consts[node.targets[0].id] = node.value
        uses = any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))
        text = ast.unparse(rename.visit(node))
        if isinstance(node, ast.Assert):
            if uses:
                tests.append("\n".join([*before, *_used([node], others), text]))
        elif any(isinstance(n, ast.Assert) for n in ast.walk(node)):  # a loop or an if around
            tests.append("\n".join([*before, *_used([node], others), text]))  # asserts
        elif isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign,
                               ast.AugAssign)):
            before.append(text)
    return tuple(tests)


@functools.lru_cache(maxsize=1024)
def plus_program_tests(test: str) -> tuple[str, ...]:
    """MBPP+'s test program: module-level ``inputs`` and ``results`` and a loop calling
    ``assertion(f(*inp), exp, atol)``, a test an input as HumanEval+'s (``_evalplus``)."""
    if "assertion(" not in test or (tree := parse(test)) is None:
        return ()
    special = {a.asname or a.name: getattr(math, a.name) for n in tree.body
               if isinstance(n, ast.ImportFrom) and n.module == "math" for a in n.names
               if a.name in ("inf", "nan")}  # its ``from math import inf``, as values
    consts = {n.targets[0].id: _Values(special).visit(n.value) for n in tree.body
              if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}
    tests: list[str] = []
    for node in tree.body:
        body = node.body[0] if isinstance(node, ast.For) and node.body else None
        call = body.value.args[0] if isinstance(body, ast.Expr) and isinstance(
            body.value, ast.Call) and body.value.args else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            name = call.func.id
            tests += _evalplus(node, consts, name, name, set_eq=name in MBPP_SET_EQ)
    return tuple(tests)


class _Values(ast.NodeTransformer):
    """Names bound to float values (``inf``) made those values."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return ast.Constant(self.values[node.id]) if node.id in self.values else node


def _evalplus(loop: ast.For, consts: dict[str, ast.expr], name: str, entry: str,
              set_eq: bool = False) -> list[str]:
    """HumanEval+'s ``for i, (inp, exp) in enumerate(zip(inputs, results)):
    assertion(candidate(*inp), exp, atol)`` as one test an input: ``==``, or ``isclose``
    where the expected value is a float or ``atol`` is set (its ``assertion``'s tolerance),
    item by item for a list or tuple of them (its numpy ``allclose``); with ``set_eq`` the
    answer's value and the expected one as sets (evalplus's evaluator, MBPP+'s
    ``MBPP_SET_EQ``)."""
    call = loop.body[0].value if len(loop.body) == 1 and isinstance(loop.body[0], ast.Expr) \
        else None
    zipped = loop.iter.args[0] if isinstance(loop.iter, ast.Call) and getattr(
        loop.iter.func, "id", "") == "enumerate" and loop.iter.args else loop.iter
    if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "assertion"
            and len(call.args) == 3 and isinstance(zipped, ast.Call)
            and getattr(zipped.func, "id", "") == "zip" and len(zipped.args) == 2
            and all(getattr(a, "id", "") in consts and is_literal(consts[a.id])
                    for a in zipped.args) and is_literal(call.args[2])):
        return []
    got = call.args[0]
    if not (isinstance(got, ast.Call) and getattr(got.func, "id", "") == name
            and len(got.args) == 1 and isinstance(got.args[0], ast.Starred)):
        return []
    inputs, results = (ast.literal_eval(consts[a.id]) for a in zipped.args)
    atol, tests = ast.literal_eval(call.args[2]), []
    for args, want in zip(inputs, results):
        call_text = f"{entry}({', '.join(map(source, args))})"
        if set_eq and isinstance(want, (list, tuple, set)):
            tests.append(f"assert set({call_text}) == set({source(want)})")
        elif _tolerant(want, atol):
            tests.append(f"assert math.isclose({call_text}, {source(want)}, rel_tol=1e-07, "
                         f"abs_tol={atol or 1e-6})")
        elif isinstance(want, (list, tuple)) and 0 < len(want) <= MAX_CLOSE_ITEMS and all(
                _tolerant(w, atol) for w in want):  # numpy's allclose, item by item
            names = [f"evalplus_{i}" for i in range(len(want))]  # (as many as expected)
            tests.append("\n".join([
                f"{', '.join(names)}{',' if len(names) == 1 else ''} = {call_text}",
                *(f"assert math.isclose({n}, {source(w)}, rel_tol=1e-07, "
                  f"abs_tol={atol or 1e-6})" for n, w in zip(names, want))]))
        else:
            tests.append(f"assert {call_text} == {source(want)}")
    return tests


def _tolerant(want: Any, atol: float) -> bool:
    """Compared within a tolerance by evalplus's ``assertion``: a float, or with ``atol`` set
    an int (never a bool)."""
    return isinstance(want, float) or bool(atol) and type(want) is int


@functools.lru_cache(maxsize=1024)
def pytest_tests(test: str) -> tuple[str, ...]:
    """A pytest file's ``def test_...()`` functions, each one test: its body, after the
    file's imports (``from solution import f`` dropped: the answer's names are there) and
    its literal constants; ``@pytest.mark.parametrize`` expanded, a case a test, its
    arguments assigned first. A test taking fixtures stays, and cannot be judged."""
    if (tree := parse(test)) is None:
        return ()
    before = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
              and not (isinstance(n, ast.ImportFrom) and n.module == "solution")]
    before += [ast.unparse(n) for n in tree.body
               if isinstance(n, ast.Assign) and is_literal(n.value)]
    tests = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
            continue
        body = [ast.unparse(n) for n in node.body if not (
            isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]  # a docstring
        for setup in _parametrized(node) or [[]]:
            tests.append("\n".join([*before, *_used(node.body, tree.body), *setup, *body]))
    return tuple(tests)


def _used(body: list[ast.stmt], module: list[ast.stmt]) -> list[str]:
    """The test file's own helpers (defs, classes, other assignments) that ``body`` uses, and
    those they use, in the file's order: dropped, the answer's function of that name would
    stand in for the test's (a ``def is_sorted`` that says yes). A def cannot be judged."""
    names = {n.id for s in body for n in ast.walk(s) if isinstance(n, ast.Name)}
    used: list[ast.stmt] = []
    while new := [n for n in module if n not in used and _helper(n) & names]:
        used += new
        names |= {n.id for s in new for n in ast.walk(s) if isinstance(n, ast.Name)}
    return [ast.unparse(n) for n in module if n in used]


def _helper(node: ast.stmt) -> set[str]:
    """The names a test file's statement binds, unless the tests are given it anyway (imports,
    literal constants) or it is a test."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return set() if node.name.startswith("test") else {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and not (
            isinstance(node, ast.Assign) and is_literal(node.value)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _parametrized(fn: ast.FunctionDef) -> list[list[str]] | None:
    """The argument assignments of each case of ``@pytest.mark.parametrize(names, cases)``
    (stacked ones multiply), None without it; a fixture argument left unassigned."""
    cases: list[list[str]] | None = None
    for deco in fn.decorator_list:
        if not (isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("parametrize")
                and len(deco.args) >= 2 and is_literal(deco.args[0])
                and is_literal(deco.args[1])):
            continue
        names = ast.literal_eval(deco.args[0])
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        target = ", ".join(names) + ("," if len(names) == 1 else "")
        rows = [[f"{target} = {source(v)}" if len(names) > 1 else f"{names[0]} = {source(v)}"]
                for v in ast.literal_eval(deco.args[1])]
        cases = rows if cases is None else [a + b for a in cases for b in rows]
    return cases


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(self.new, node.ctx) if node.id == self.old else node


def same_output(got: Any, want: str) -> bool:
    """A program's output against the expected one as judges read it: line by line, each
    line's tokens equal (spaces and blank lines at the end ignored), or numbers within 1e-6
    (absolute or relative) where the expected token has a fraction or exponent."""
    if not isinstance(got, str):
        return False
    g, w = _lines(got), _lines(want)
    return len(g) == len(w) and all(
        len(a) == len(b) and all(x == y or _close(x, y) for x, y in zip(a, b))
        for a, b in zip(g, w))


def _lines(text: str) -> list[list[str]]:
    lines = [line.split() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _close(got: str, want: str) -> bool:
    if not any(c in want for c in ".eE") or "_" in got:  # (float() reads 1_0.5 as 10.5)
        return False
    try:
        a, b = float(got), float(want)
    except ValueError:
        return False
    return math.isfinite(b) and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
