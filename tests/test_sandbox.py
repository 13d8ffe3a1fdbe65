"""The `code` verifier: a completion's code runs against its tests in a sandbox.

Containment is shown from outside the sandbox: after an infinite loop, a fork bomb, a 10 GB
allocation, a network attempt, writes outside the scratch folder and reads of the grader's
files, nothing escaped (no process left, no connection made, no file written, no secret read)
and the answer scores 0. The OS layers (network namespace, no new processes, memory and CPU
limits) are also checked on their own, with the Python audit hook switched off.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from grpolab.rewards import sandbox
from grpolab.rewards.builtin import load_reward
from grpolab.rewards.code_data import row_case
from grpolab.rewards.sandbox import (
    Limits,
    check_tests,
    code_reward,
    extract_code,
    run_tests,
)
from grpolab.rewards.scorer import score

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]
QUICK = Limits(cpu_seconds=2, wall_seconds=5)
NO_GUARD = Limits(cpu_seconds=2, wall_seconds=5, python_guard=False)


def _sandbox_processes() -> list[str]:
    """Processes still running the sandbox interpreter (none should outlive a run)."""
    out = subprocess.run(["ps", "-eo", "pid,user,args"], check=False, capture_output=True,
                         text=True).stdout
    return [line for line in out.splitlines() if "_main(json.loads" in line]


def test_right_partial_and_wrong_answers() -> None:
    assert run_tests("def add(a, b):\n    return a + b", ADD_TESTS).share == 1.0
    assert run_tests("def add(a, b):\n    return a * b + (a == -1)", ADD_TESTS).passed == 2
    assert run_tests("def add(a, b):\n    return 1", ADD_TESTS).passed == 0
    bad = run_tests("def add(a, b) return", ADD_TESTS)
    assert bad.passed == 0 and "SyntaxError" in bad.note
    # a failing test does not stop the later ones; a main block is not run
    v = run_tests("def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    input()",
                  ["assert add(1, 1) == 3", "assert add(1, 1) == 2"])
    assert (v.passed, v.total) == (1, 2)


def test_code_extraction_and_tests_column() -> None:
    text = "Here:\n```python\ndef add(a, b):\n    return a - b\n```\nFixed:\n```py\n" \
           "def add(a, b):\n    return a + b\n```\nDone."
    assert extract_code(text).strip() == "def add(a, b):\n    return a + b"
    assert extract_code("def f(): pass") == "def f(): pass"
    assert row_case({"tests": '["assert 1", "assert 2"]'}).tests == ("assert 1", "assert 2")
    assert row_case({"tests": "assert f() == 1"}).tests == ("assert f() == 1",)
    fn = load_reward("code")
    assert fn is code_reward
    res = score([fn], ["q1", "q2", "q3"], [text, "def add(a, b): return 5", "nonsense ("],
                {"tests": [ADD_TESTS, ADD_TESTS, ADD_TESTS]})
    assert res.per_fn[:, 0].tolist() == pytest.approx([1.0, 1 / 3, 0.0])
    assert res.problems == []


def test_infinite_loop_is_stopped() -> None:
    t0 = time.monotonic()
    v = run_tests("def add(a, b):\n    while True:\n        pass", ADD_TESTS,
                  Limits(cpu_seconds=1, wall_seconds=5))
    assert v.passed == 0 and time.monotonic() - t0 < 5
    v = run_tests("import time\ntime.sleep(1000)", ADD_TESTS, Limits(wall_seconds=1))
    assert v.passed == 0 and v.note == "timed out"
    # tests that passed before a later one hangs still count
    v = run_tests("def add(a, b):\n    return a + b", ["assert add(1, 1) == 2", "while 1: pass"],
                  Limits(cpu_seconds=1, wall_seconds=5))
    assert (v.passed, v.total) == (1, 2)
    assert _sandbox_processes() == []


@pytest.mark.parametrize("guard", [QUICK, NO_GUARD], ids=["all-layers", "os-layer-only"])
def test_fork_bomb_starts_no_process(guard: Limits) -> None:
    bomb = ("import os\ndef add(a, b):\n    return a + b\nn = 0\nfor _ in range(50):\n"
            "    try:\n        if os.fork() == 0:\n            while True: pass\n"
            "    except OSError:\n        break\n    n += 1\nassert n == 0, n\n")
    if guard.python_guard:  # the real thing: only safe because it is stopped
        bomb = "import os\nwhile True:\n    os.fork()\n"
    v = run_tests(bomb, ADD_TESTS, guard)
    assert v.passed == 0 or (not guard.python_guard and v.passed == 3)  # n == 0: all forks failed
    if not guard.python_guard:
        assert v.passed == 3, f"a fork succeeded inside the sandbox: {v}"
    for mod in ("subprocess", "multiprocessing", "pty"):
        assert run_tests(f"import {mod}\ndef add(a, b): return a + b", ADD_TESTS).passed == 0
    time.sleep(0.2)
    assert _sandbox_processes() == []


@pytest.mark.parametrize("guard", [QUICK, NO_GUARD], ids=["all-layers", "os-layer-only"])
def test_ten_gigabytes_are_refused(guard: Limits) -> None:
    v = run_tests("x = bytearray(10 * 2**30)\ndef add(a, b): return a + b", ADD_TESTS, guard)
    assert v.passed == 0 and "MemoryError" in v.note
    v = run_tests("def add(a, b):\n    x = [0] * (10**10)\n    return a + b", ADD_TESTS, guard)
    assert v.passed == 0


def _network_isolated() -> bool:
    code = "names = [ln.split(':')[0].strip() for ln in open('/proc/net/dev').readlines()[2:]]"
    v = run_tests(code, ["assert names == ['lo']"], NO_GUARD)
    return v.passed == 1


@pytest.mark.parametrize("guard", [QUICK, NO_GUARD], ids=["all-layers", "os-layer-only"])
def test_network_attempt_reaches_nothing(guard: Limits) -> None:
    if not guard.python_guard and not _network_isolated():
        pytest.skip("no network namespace here (not root, no user namespaces)")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    code = ("import socket\ndef add(a, b):\n"
            f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    s.sendall(b'leak')\n    return a + b\n")
    try:
        v = run_tests(code, ADD_TESTS, guard)
        assert v.passed == 0
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    finally:
        server.close()


def test_writes_stay_in_the_scratch_folder(tmp_path: Path) -> None:
    outside = Path("/tmp") / f"grpolab-escape-{os.getpid()}"
    targets = [str(outside), str(tmp_path / "escape.txt"), "../escape-rel.txt"]
    for target in targets:
        code = (f"def add(a, b):\n    open({target!r}, 'w').write('pwned')\n    return a + b\n")
        assert run_tests(code, ADD_TESTS).passed == 0, target
    code = ("import os, shutil\ndef add(a, b):\n    os.mkdir('d')\n"
            f"    os.symlink({str(outside)!r}, 'd/link')\n    return a + b\n")
    assert run_tests(code, ADD_TESTS).passed == 0
    assert not outside.exists() and not (tmp_path / "escape.txt").exists()
    assert not list(Path("/tmp").glob("escape-rel.txt"))
    # inside its own folder it may write and read back; the folder is deleted afterwards
    code = ("import os\ndef add(a, b):\n    open('x.txt', 'w').write(str(a + b))\n"
            "    return int(open('x.txt').read())\n")
    assert run_tests(code, ADD_TESTS).passed == 3
    assert not list(Path("/tmp").glob("grpolab-sandbox-*"))


def test_grader_files_and_secrets_stay_unread(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    folder = Path("/tmp") / f"grpolab-grader-{os.getpid()}"  # world-readable, like a dataset
    folder.mkdir(mode=0o755, exist_ok=True)
    secret = folder / "answers.jsonl"
    secret.write_text("THE-ANSWERS")
    secret.chmod(0o644)
    monkeypatch.setenv("GRPOLAB_TEST_SECRET", "THE-TOKEN")
    try:
        for path in (secret, Path(__file__), Path(f"/proc/{os.getpid()}/environ")):
            code = f"def add(a, b):\n    return a + b + len(open({str(path)!r}).read()) * 0\n"
            assert run_tests(code, ADD_TESTS).passed == 0, path
        code = ("import os\ndef add(a, b):\n"
                "    assert 'GRPOLAB_TEST_SECRET' not in os.environ\n    return a + b\n")
        assert run_tests(code, ADD_TESTS).passed == 3  # the environment is a fresh one
        code = f"import os\nnames = os.listdir({str(folder)!r})\ndef add(a, b): return a + b\n"
        assert run_tests(code, ADD_TESTS).passed == 0
    finally:
        secret.unlink()
        folder.rmdir()


def test_passes_cannot_be_faked() -> None:
    fakes = [
        "import sys\nfor i in range(3): print('0' * 32, i, 1)\nsys.exit(0)",
        "import os\nos._exit(0)",
        "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: 0",
        ("import os\nfor fd in range(3, 20):\n    try: os.write(fd, b'x 0 1\\nx 1 1\\n')\n"
         "    except OSError: pass"),
        "import sys\nf = sys._getframe(1)",
        "import gc\nobjs = gc.get_objects()",
    ]
    for code in fakes:
        assert run_tests(code, ADD_TESTS).passed == 0, code


def test_answers_using_dataclasses_namedtuples_and_typing_pass() -> None:
    """The standard library asks for the caller's frame (namedtuple, typing, enum's functional
    API) or a function's code (inspect.signature, which dataclass calls), and falls back on a
    ValueError: refused with one, right answers using them pass (frames stay out of reach:
    test_sandbox_hostile.py)."""
    code = ("from dataclasses import dataclass, field, asdict\n"
            "from collections import namedtuple\nfrom typing import NamedTuple, TypeVar\n"
            "import enum, inspect, logging, concurrent.futures\nT = TypeVar('T')\n"
            "@dataclass(frozen=True, order=True)\nclass P:\n    x: int\n"
            "    ys: list = field(default_factory=list)\n"
            "Q = namedtuple('Q', 'a b')\nclass R(NamedTuple):\n    a: int\n"
            "Color = enum.Enum('Color', 'RED GREEN')\n"
            "def add(a, b):\n    return asdict(min(P(a + b), P(a + b + 1)))['x'] + Q(0, 1).a"
            " + R(0).a + Color.RED.value - 1\n"
            "def sig():\n    try:\n        return str(inspect.signature(add))\n"
            "    except ValueError:\n        return 'refused'\n")
    assert run_tests(code, [*ADD_TESTS, "assert sig() == 'refused'"]).share == 1.0


def test_subclasses_of_plain_types_are_judged_as_their_values() -> None:
    """MBPP's reference solutions return a Counter or a defaultdict where the tests compare
    with a dict: sent as the base type's value, read by the base type's own methods (the
    lying list's __iter__ and __eq__ never run), they compare as Python compares them."""
    code = ("from collections import Counter, defaultdict, OrderedDict, namedtuple\n"
            "import enum\nP = namedtuple('P', 'a b')\n"
            "class C(enum.IntEnum):\n    A = 3\nclass S(str, enum.Enum):\n    X = 'x'\n"
            "class L(list):\n    def __iter__(self):\n        return iter([9])\n"
            "    def __eq__(self, other):\n        return True\n"
            "def freq(s):\n    return Counter(s)\n"
            "def group(pairs):\n    d = defaultdict(list)\n    for k, v in pairs:\n"
            "        d[k].append(v)\n    return d\n"
            "def od():\n    return OrderedDict(a=1)\ndef point():\n    return P(1, 2)\n"
            "def enums():\n    return [C.A, S.X]\ndef lying():\n    return L([1, 2])\n")
    tests = ["assert freq('aab') == {'a': 2, 'b': 1}",
             "assert group([(1, 'x'), (1, 'y')]) == {1: ['x', 'y']}", "assert od() == {'a': 1}",
             "assert point() == (1, 2)", "assert enums() == [3, 'x']",
             "assert enums()[1].upper() == 'X'", "assert lying() == [1, 2]"]
    assert run_tests(code, tests).share == 1.0
    assert run_tests(code, ["assert lying() == [9]", "assert freq('ab') == {'a': 2}"]).passed == 0
    # dict() of a Counter is the Counter's items, not its keys paired up
    assert run_tests(code, ["assert dict(freq('aab')) == {'a': 2, 'b': 1}",
                            "assert dict(freq(['ab', 'cd'])) == {'a': 'b', 'c': 'd'}"]).passed == 1


LRU = """
from collections import OrderedDict
class LRUCache:
    def __init__(self, n):
        self.n, self.d = n, OrderedDict()
    def get(self, k):
        if k not in self.d:
            return -1
        self.d.move_to_end(k)
        return self.d[k]
    def put(self, k, v):
        self.d[k] = v
        self.d.move_to_end(k)
        if len(self.d) > self.n:
            self.d.popitem(last=False)
class Stack:
    def __init__(self):
        self.xs = []
    def push(self, x):
        self.xs.append(x)
    def __len__(self):
        return len(self.xs)
    def __getitem__(self, i):
        return self.xs[i]
    def __str__(self):
        return f"Stack{self.xs}"
def squares(n):
    return [i * i for i in range(n)]
"""


def test_the_answers_own_objects_answer_for_themselves() -> None:
    """A method, len(), str() or [i] asked of the answer's own object (a LeetCode design
    class), or of a value too big to send, is made there, as Python would call it; of a plain
    value it is made here with the plain type's own method."""
    tests = ["c = LRUCache(2)\nc.put(1, 1)\nc.put(2, 2)\nassert c.get(1) == 1",
             "c = LRUCache(1)\nc.put(1, 1)\nc.put(2, 2)\nassert c.get(1) == -1",
             "s = Stack()\ns.push(3)\nassert len(s) == 1 and s[0] == 3",
             "s = Stack()\ns.push(3)\nassert str(s) == 'Stack[3]'",
             "assert len(squares(10**5)) == 100000", "assert squares(10**5)[-1] == 9999800001"]
    assert run_tests(LRU, tests).share == 1.0
    forgetful = LRU.replace("return self.d[k]", "return -1")
    assert run_tests(forgetful, tests[:2]).passed == 1
    assert run_tests(LRU, ["assert squares(10**5)[-1] == 0", "assert len(squares(3)) == 2"]
                     ).passed == 0
    lying = "class S(str):\n    def startswith(self, *a):\n        return True\ndef f():\n" \
            "    return S('zzz')\n"
    assert run_tests(lying, ["assert f().startswith('ab')"]).passed == 0  # str's own here


# Common test shapes around an iterator: the answer's generator, map or range is only iterated
# by the test, so it is sent back as a list; a comprehension over literals is unrolled here.
SHAPES = ["assert list(gen()) == [0, 1, 2]", "assert list(m([1, 2])) == [2, 3]",
          "assert list(r(3)) == [0, 1, 2]", "assert sum(gen()) == 3", "assert max(gen()) == 2",
          "assert sorted(set(m([2, 1]))) == [2, 3]",
          "assert all(f(i) == 2 * i for i in range(3))",
          "assert [f(i) for i in range(3) if i] == [2, 4]",
          "assert any(f(a) == b for a, b in [(1, 3), (2, 4)])"]
SHAPES_RIGHT = ("def gen():\n    yield from range(3)\ndef m(xs):\n    return map(lambda x: x + 1, xs)\n"
                "def r(n):\n    return range(n)\ndef f(x):\n    return 2 * x\n")


def test_iterators_and_comprehensions_are_judged() -> None:
    v = run_tests(SHAPES_RIGHT, SHAPES, QUICK)
    assert (v.passed, v.note) == (len(SHAPES), ""), v
    wrong = ("def gen():\n    yield from range(1, 4)\ndef m(xs):\n    return map(str, xs)\n"
             "def r(n):\n    return range(1, n + 1)\ndef f(x):\n    return x * x + 1\n")
    assert run_tests(wrong, SHAPES, QUICK).passed == 0
    # each shape on its own: right passes, wrong fails
    lone = run_tests(SHAPES_RIGHT.replace("yield from range(3)", "yield from range(2)"),
                     SHAPES[:1] + SHAPES[3:5], QUICK)
    assert lone.passed == 0, lone
    # an iterator compared as it is stays unequal to a list, as in Python
    assert run_tests(SHAPES_RIGHT, ["assert r(3) == [0, 1, 2]", "assert gen() == [0, 1, 2]"],
                     QUICK).passed == 0


def test_methods_of_the_answers_values_are_called_here() -> None:
    """``f().startswith('ab')`` is str's startswith on the value sent back, not a method of
    the answer's own (a str subclass's that always says yes); a module's function of the same
    name (re.split) stays the module's."""
    right = "def f():\n    return 'abc'\ndef d():\n    return {'a': 1}\n"
    tests = ["assert f().startswith('ab')", "assert f().upper() == 'ABC'",
             "assert d().get('a') == 1", "assert sorted(d().keys()) == ['a']",
             "assert ','.join(['x', f()]) == 'x,abc'", "assert f().split('b') == ['a', 'c']",
             "import re\nassert re.split('b', f()) == ['a', 'c']"]
    v = run_tests(right, tests, QUICK)
    assert (v.passed, v.note) == (len(tests), ""), v
    forged = ("class S(str):\n    def startswith(self, *a):\n        return True\n"
              "    def upper(self):\n        return 'ABC'\ndef f():\n    return S('zzz')\n"
              "class D(dict):\n    def get(self, *a):\n        return 1\n"
              "    def keys(self):\n        return ['a']\ndef d():\n    return D()\n")
    assert run_tests(forged, tests[:4], QUICK).passed == 0
    assert run_tests("def f():\n    return [1]\n", tests[:1], QUICK).passed == 0  # no such method


def test_an_endless_generator_fails_its_test_only() -> None:
    endless = ("def gen():\n    i = 0\n    while True:\n        yield i\n        i += 1\n"
               "def fin():\n    yield from range(3)\n")
    t0 = time.monotonic()
    v = run_tests(endless, ["assert list(gen()) == [0, 1, 2]", "assert max(gen()) == 2",
                            "assert sum(gen()) > 0", "assert list(fin()) == [0, 1, 2]"], QUICK)
    assert (v.passed, v.total, v.note) == (1, 4, "a test's code raised OverflowError"), v
    assert time.monotonic() - t0 < 5
    assert _sandbox_processes() == []


HUMANEVAL = "def check(candidate):\n    assert candidate(2, 3) == 5\n"


def test_tests_it_cannot_judge_are_warned_about_once(caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_WARNED", set())
    right = "def add(a, b):\n    return a + b"
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        assert code_reward(["q"] * 2, [right] * 2, tests=[[HUMANEVAL], ADD_TESTS]) == [0.0, 1.0]
        assert code_reward(["q"], [right], tests=[[HUMANEVAL]]) == [0.0]
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("grpolab")]
    assert len(warned) == 1, warned
    assert "1 of the 4 tests not checkable" in warned[0] and "def check(candidate)" in warned[0]
    caplog.clear()
    monkeypatch.setattr(sandbox, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        code_reward(["q"], [right], tests=[ADD_TESTS])
    assert not caplog.records  # judgeable tests: nothing to say


def test_data_whose_tests_it_can_judge_none_of_is_refused() -> None:
    check_tests([{"prompt": "q", "tests": ADD_TESTS}], "mbpp")
    check_tests([{"prompt": "q", "answer": json.dumps(ADD_TESTS)}], "mbpp")  # answer_column
    check_tests([{"prompt": "q", "tests": [HUMANEVAL]}, {"prompt": "q", "tests": ADD_TESTS}],
                "mixed")  # some judgeable: run (and warned about at the first step)
    for rows, said in (([{"prompt": "1+1=", "answer": "2"}], "e.g. '2'"),
                       ([{"prompt": "q", "tests": [HUMANEVAL]}], "def check(candidate)"),
                       ([{"prompt": "q", "tests": []}], "all empty"),
                       ([{"prompt": "q"}], "needs the tests in a column")):
        with pytest.raises(ValueError, match="code reward") as e:
            check_tests(rows, "data")
        assert said in str(e.value), str(e.value)


def test_train_with_the_code_reward_on_data_without_tests_exits_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from helpers import run_cli

    from grpolab.rollout.tinyhf import make_tiny_model

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    model = make_tiny_model(tmp_path / "model", arch="llama", hidden=32, heads=4)
    capsys.readouterr()
    code, err = run_cli(["train", "--model-path", model, "--dataset",
                         str(data), "--rewards", "code", "--steps", "1", "--budget", "8",
                         "--group-size", "4", "--out-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and len(err) == 1 and "can judge none of the tests" in err[0], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
