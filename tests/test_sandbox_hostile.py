"""Hostile answers against the `code` verifier: none that does not solve the task scores > 0.

Each answer below gets `add` wrong (or right only if its attack worked) and attacks the
verifier: frames (reaching the harness to rewrite its results), signals, builtins (objects
whose ``__eq__`` is always True, patched ``abs``/``math.isclose``/``AssertionError``), links
and directory descriptors out of the scratch folder, device files, disk filling and forged
output. Every one is run against both filesystem boundaries: the mount namespace (where this
machine allows it) and the audit hook alone (the fallback). The right answer scores 1 in each.

The ``test_defect*`` tests are the issue's defects 1 and 2 as they were on the starting
commit: there, the verifier compared inside the answer's process and checked paths lexically.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from grpolab.rewards import sandbox
from grpolab.rewards.sandbox import Limits, Verdict

pytestmark = pytest.mark.slow  # ~150 sandboxed processes: the full suite runs them

TESTS = ["assert add(2, 3) == 5", "assert add(-1, 4) == 3", "assert add(10, 5) == 15"]
RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
QUICK = Limits(cpu_seconds=2, wall_seconds=4)
NO_GUARD = Limits(cpu_seconds=2, wall_seconds=4, python_guard=False)
NOBODY = 65534
ROOT = Path(__file__).resolve().parents[1]


def _sandbox_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,user,args"], check=False, capture_output=True,
                         text=True).stdout
    return [line for line in out.splitlines() if "_main(json.loads" in line]


MOUNT = {"on": True}  # the boundary the tests ask for: off, the audit hook alone (the fallback)


def run_tests(code: str, tests: list[str], limits: Limits | None = None) -> Verdict:
    return sandbox.run_tests(code, tests, dataclasses.replace(limits or Limits(),
                                                              mount_namespace=MOUNT["on"]))


# The verdict's tests (frames, signals, builtins, forged output) run once, on the default
# boundary: the verdict is reached in the parent whatever the filesystem boundary; the
# filesystem's tests run under both.
@pytest.fixture(params=["mount", "hook"])
def boundary(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "hook":
        monkeypatch.setitem(MOUNT, "on", False)
    elif getattr(run_tests(RIGHT, TESTS, QUICK), "boundary", "") != "mount":
        pytest.skip("no mount namespace here (not root, no user namespaces)")
    return request.param


@pytest.fixture
def checkpoint() -> Iterator[Path]:
    """The trainer's checkpoint, next to the scratch folders; owned by the sandbox's user, as
    a trainer running under one account would own it, so only the verifier protects it."""
    folder = Path(tempfile.mkdtemp(prefix="grpolab-ckpt-"))
    ckpt = folder / "ckpt.pt"
    ckpt.write_bytes(b"weights")
    if os.geteuid() == 0:
        for p in (folder, ckpt):
            os.chown(p, NOBODY, NOBODY)
    yield ckpt
    shutil.rmtree(folder, ignore_errors=True)


def _intact(ckpt: Path) -> bool:
    return ckpt.exists() and ckpt.read_bytes() == b"weights" and \
        sorted(p.name for p in ckpt.parent.iterdir()) == ["ckpt.pt"]


def _attack(body: str) -> str:
    """An answer that is right only if ``body`` (which sets ``ok``) got through."""
    return ("import os, sys\nok = False\ntry:\n"
            + "".join(f"    {line}\n" for line in body.strip().splitlines())
            + "except BaseException:\n    pass\n"
            + "def add(a, b):\n    return a + b if ok else 0\n")


# ---- the right answer ----

def test_right_answer_scores_one(boundary: str) -> None:
    v = run_tests(RIGHT, TESTS, QUICK)
    assert v.share == 1.0 and v.boundary == boundary, v
    assert run_tests(WRONG, TESTS, QUICK).passed == 0
    assert run_tests("def add(a, b):\n    return 3", TESTS, QUICK).passed == 1
    typed = ["assert pair(1) == (1, 2)", "assert pair(1) != [1, 2]",
             "assert hist('aab') == {'a': 2, 'b': 1}", "assert set(pair(3)) == {3, 4}",
             "assert abs(half(1) - 0.5) < 1e-9", "import math\nassert math.isclose(half(3), 1.5)",
             "assert raw() == b'x'",
             "assert sorted(pair(2), reverse=True) == [3, 2]", "assert len(pair(0)) == 2",
             "assert pair(5)[1] == 6", "assert half(2) in (1, 1.0)", "assert not empty()",
             "x = [3, 1, 2]\nx.sort()\nassert pair(x[0]) == (1, 2)"]
    code = ("def pair(n): return (n, n + 1)\ndef hist(s): return {c: s.count(c) for c in s}\n"
            "def half(x): return x / 2\ndef raw(): return b'x'\ndef empty(): return []\n")
    v = run_tests(code, typed, QUICK)
    assert (v.passed, v.note) == (len(typed), ""), v


def test_tests_that_cannot_be_judged_outside_count_as_failed() -> None:
    v = run_tests(RIGHT, ["assert False", "for i in range(3):\n    x = add(i, 0)\n    assert x == i",
                          "assert add(1, 1) == add(2, 0)", "add(1, 2)", "assert add(1, 1) == 2",
                          "for i in range(3):\n    assert add(i, 0) == i"],  # = all(...): judged
                  QUICK)
    assert (v.passed, v.total) == (2, 6) and "not checkable" in v.note


# ---- frames: reaching the harness to rewrite its results ----

FORGE = """
def _forge(nonce, write):  # the values TESTS expect, as the child reports them
    for i, value in enumerate((5, 3, 15)):
        write(nonce + " v " + str(i) + " 0 " + str(value) + "\\n")
    write(nonce + " done\\n")
    os._exit(0)
def _from_frame(f):
    while f is not None:
        loc = f.f_locals
        if "nonce" in loc and "write" in loc:
            _forge(loc["nonce"], loc["write"])
        f = f.f_back
"""
FRAMES = {
    "sys._getframe": "_from_frame(sys._getframe())",
    "inspect": "import inspect\n_from_frame(inspect.currentframe())",
    "traceback": "try:\n    raise ValueError\nexcept ValueError as e:\n"
                 "    _from_frame(e.__traceback__.tb_frame)",
    "current_frames": "_from_frame(list(sys._current_frames().values())[0])",
    "gc": ("import gc\nfound = {}\nfor o in gc.get_objects():\n"
           "    if type(o).__name__ == 'cell':\n        try: c = o.cell_contents\n"
           "        except ValueError: continue\n"
           "        if isinstance(c, str) and len(c) == 32: found['n'] = c\n"
           "        if getattr(c, '__name__', '') == 'write': found['w'] = c\n"
           "if len(found) == 2: _forge(found['n'], found['w'])"),
    "settrace": ("def tr(frame, event, arg):\n    _from_frame(frame)\n    return tr\n"
                 "sys.settrace(tr)"),
}


@pytest.mark.parametrize("route", list(FRAMES))
def test_frames_cannot_forge_results(route: str) -> None:
    code = "import os, sys\n" + FORGE + FRAMES[route] + "\n" + WRONG
    assert run_tests(code, TESTS, QUICK).passed == 0


def test_the_forger_forges_where_frames_are_open() -> None:
    """FORGE wrote ``true`` for every value until the third red-team pass: no test compares
    to it, so the frame tests above could not have seen a forgery, and the audit hook's absence
    looked safe. It is not: the frames are the hook's to keep out."""
    code = "import os, sys\n" + FORGE + FRAMES["sys._getframe"] + "\n" + WRONG
    assert run_tests(code, TESTS, NO_GUARD).passed == 3


# ---- signals ----

SIGNALS = {
    "kill-parent": "import signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "pidfd-parent": "import signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 9)",
    "kill-own-group": "import signal\nos.killpg(0, signal.SIGKILL)",
    "stop-self": "import signal\nsignal.raise_signal(signal.SIGSTOP)",
    "alarm": "import signal\nsignal.alarm(1)\nwhile True: pass",
    "ignore-cpu-limit": "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                        "while True: pass",
    "ignore-all-then-stop": "import signal\nfor s in (1, 2, 3, 15, 24, 14):\n"
                            "    signal.signal(s, signal.SIG_IGN)\nsignal.raise_signal(19)",
}


@pytest.mark.parametrize("name", list(SIGNALS))
@pytest.mark.parametrize("guard", [QUICK, NO_GUARD], ids=["all-layers", "no-audit-hook"])
def test_signals_reach_nothing(name: str, guard: Limits) -> None:
    code = "import os\n" + WRONG + "try:\n" + "".join(
        f"    {line}\n" for line in SIGNALS[name].splitlines()) + "except OSError:\n    pass\n"
    t0 = time.monotonic()
    v = run_tests(code, TESTS, Limits(cpu_seconds=1, wall_seconds=2,
                                      python_guard=guard.python_guard))
    assert v.passed == 0 and time.monotonic() - t0 < 6  # we are still here, on time
    time.sleep(0.1)
    assert _sandbox_processes() == []


# ---- builtins: making `==` (or the test's own names) lie ----

EQUAL = "class Yes:\n    def __eq__(self, other): return True\n    __hash__ = None\n"
BUILTINS = {
    "always-equal": EQUAL + "def add(a, b): return Yes()",
    "int-subclass": "class I(int):\n    def __eq__(self, o): return True\n"
                    "def add(a, b): return I(0)",
    "list-subclass": "class L(list):\n    def __eq__(self, o): return True\n"
                     "def add(a, b): return L()",
    "patched-builtins": EQUAL + "import builtins\nbuiltins.abs = lambda x: 0\n"
                        "__builtins__['abs'] = lambda x: 0\n"
                        "def add(a, b): return Yes()",
    "assertion-error": "import builtins\nclass E(Exception): pass\nbuiltins.AssertionError = E\n"
                       "__builtins__['AssertionError'] = E\ndef add(a, b): return -a",
    "patched-name-in-test": EQUAL + "import math\nmath.isclose = lambda *a, **k: True\n"
                            "__builtins__['len'] = lambda x: 2\n"
                            "__builtins__['sorted'] = lambda *a, **k: [2, 3]\n"
                            "def add(a, b): return Yes()",
    "exec-replaced": "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
                     "builtins.eval = lambda *a, **k: 5\n__builtins__['eval'] = builtins.eval\n"
                     "def add(a, b): return 0",
}
TOLERANT = ["assert abs(add(0.1, 0.2) - 0.3) < 1e-9",
            "import math\nassert math.isclose(add(1.5, 1.5), 3.0)", "assert len(add(1, 1)) == 2",
            "assert sorted(add(2, 1)) == [2, 3]"]


@pytest.mark.parametrize("name", list(BUILTINS))
def test_builtins_cannot_make_a_wrong_answer_pass(name: str) -> None:
    assert run_tests(BUILTINS[name], TESTS, QUICK).passed == 0, name
    assert run_tests(BUILTINS[name], TESTS[:1] + TOLERANT, QUICK).passed == 0, name


def test_a_builtin_name_the_answer_defines_is_its_own() -> None:
    """A test's ``max(10, 5)`` on literals was computed here with the builtin: an answer
    defining a wrong ``max`` passed, a right ``sum(a, b)`` (MBPP 126) could not be judged.
    Now a builtin name the answer defines is its function under test on literals; around
    the answer's values it would be the answer's own judge, so the test is not checkable."""
    assert run_tests("def max(a, b):\n    return a - b", ["assert max(10, 5) == 10"],
                     QUICK).passed == 0
    assert run_tests("def sum(a, b):\n    return a + b", ["assert sum(10, 15) == 25"],
                     QUICK).passed == 1
    judge = "def sorted(x):\n    return [2, 3]\ndef add(a, b):\n    return 0\n"
    v = run_tests(judge, ["assert sorted(add(2, 1)) == [2, 3]"], QUICK)
    assert v.passed == 0 and "not checkable" in v.note
    # without the answer's own sorted the builtin sorts the answer's value
    assert run_tests("def add(a, b):\n    return [b, a]", ["assert sorted(add(3, 2)) == [2, 3]"],
                     QUICK).passed == 1


def test_judgements_are_never_made_in_the_sandbox() -> None:
    """A comparison (or all, any, not, a conditional) inside an expression the sandbox would
    evaluate, or in a test's setup, would be the answer's to make: such tests are not
    checkable, and the always-equal object scores 0 on them."""
    code = EQUAL + "def add(a, b): return Yes()\ndef many(n): return [Yes()] * n\n"
    judged_there = ["assert (True if add(1, 1) == 2 else False)",
                    "assert [x == 2 for x in many(2)] == [True, True]",
                    "assert all(x == 2 for x in many(2))", "ok = add(1, 1) == 2\nassert ok",
                    "assert list(filter(lambda x: x == 2, many(2))) != []"]
    assert run_tests(code, judged_there, QUICK).passed == 0
    right = RIGHT + "def many(n): return [2] * n\n"
    v = run_tests(right, judged_there, QUICK)
    assert v.passed == 0 and "5 test(s) not checkable" in v.note, v
    # judged here, they pass for the right answer and not for the forgery
    here = ["assert [add(i, 1) == i + 1 for i in range(2)] == [True, True]",
            "assert {add(1, 1) == 2} == {True}", "assert list(x * 1 for x in many(2)) == [2, 2]"]
    assert run_tests(right, here, QUICK).passed == len(here)
    assert run_tests(code, here, QUICK).passed == 0


# ---- links, directory descriptors, device files: out of the scratch folder ----

def _escapes(ckpt: Path) -> dict[str, str]:
    folder, name = str(ckpt.parent), ckpt.parent.name
    return {
        "symlink-absolute": f"os.symlink({folder!r}, 'l')\nos.remove('l/ckpt.pt')\nok = True",
        "symlink-write": f"os.symlink({str(ckpt)!r}, 'l')\nopen('l', 'w').write('x')\nok = True",
        # a relative link made from deep inside looks inside to a lexical check
        "symlink-relative": ("os.makedirs('a/b/c')\nos.chdir('a/b/c')\n"
                             f"os.symlink('../{name}', '../../../l')\nos.chdir('../../..')\n"
                             "os.remove('l/ckpt.pt')\nok = True"),
        "hardlink": f"os.link({str(ckpt)!r}, 'h')\nopen('h', 'w').write('x')\nok = True",
        "rename-over": f"open('x', 'w').write('x')\nos.replace('x', {str(ckpt)!r})\nok = True",
        "dirfd-root": (f"fd = os.open('/', os.O_RDONLY)\nos.unlink({str(ckpt)[1:]!r}, "
                       "dir_fd=fd)\nok = True"),
        # the scratch folder's fd, then '..' judged from a deeper working directory
        "dirfd-scratch": ("fd = os.open('.', os.O_RDONLY)\nos.makedirs('a/b')\nos.chdir('a/b')\n"
                          f"os.remove('../{name}/ckpt.pt', dir_fd=fd)\nok = True"),
        "dirfd-folder": (f"fd = os.open({folder!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
                         "os.unlink('ckpt.pt', dir_fd=fd)\nok = True"),
        "fchdir": ("fd = os.open('.', os.O_RDONLY)\nos.makedirs('a/b')\nos.chdir('a/b')\n"
                   f"os.fchdir(fd)\nos.remove('../{name}/ckpt.pt')\nok = True"),
        "listdir-fd": f"fd = os.open({folder!r}, os.O_RDONLY)\nok = 'ckpt.pt' in os.listdir(fd)",
        "dotdot": f"os.remove('../{name}/ckpt.pt')\nok = True",
        "shutil": f"import shutil\nshutil.rmtree({folder!r})\nok = True",
        "mkfifo": f"os.mkfifo({folder + '/fifo'!r})\nok = True",
        "shm": "open('/dev/shm/grpolab-escape', 'w').write('x')\nok = True",
        "tarfile": ("import tarfile, io\nt = tarfile.open('t.tar', 'w')\n"
                    f"i = tarfile.TarInfo('l')\ni.type = tarfile.SYMTYPE\ni.linkname = {folder!r}"
                    "\nt.addfile(i)\nt.close()\ntarfile.open('t.tar').extractall('.')\n"
                    "os.remove('l/ckpt.pt')\nok = True"),
    }


@pytest.mark.parametrize("name", ["symlink-absolute", "symlink-write", "symlink-relative",
                                  "hardlink", "rename-over", "dirfd-root", "dirfd-scratch",
                                  "dirfd-folder", "fchdir", "listdir-fd", "dotdot", "shutil",
                                  "mkfifo", "shm", "tarfile"])
def test_nothing_outside_the_scratch_folder_is_touched(boundary: str, checkpoint: Path,
                                                       name: str) -> None:
    v = run_tests(_attack(_escapes(checkpoint)[name]), TESTS, QUICK)
    assert v.passed == 0, (name, v)
    assert _intact(checkpoint), name
    assert not Path("/dev/shm/grpolab-escape").exists()


def test_the_mount_namespace_alone_keeps_them_in(checkpoint: Path) -> None:
    """The same escapes with the audit hook off: the OS layer holds on its own."""
    if getattr(run_tests(RIGHT, TESTS, NO_GUARD), "boundary", "") != "mount":
        pytest.skip("no mount namespace here")
    for name, body in _escapes(checkpoint).items():
        assert run_tests(_attack(body), TESTS, NO_GUARD).passed == 0, name
        assert _intact(checkpoint), name
    assert not Path("/dev/shm/grpolab-escape").exists()


DEVICES = {
    "dev-zero": "open('/dev/zero', 'rb').read(2 * 2**30)\nok = True",
    "dev-zero-fd": "fd = os.open('/dev/zero', os.O_RDONLY)\nok = len(os.read(fd, 10)) == 10",
    "dev-tty": "open('/dev/tty', 'w').write('hello')\nok = True",
    "dev-urandom-all": "open('/dev/urandom', 'rb').read(2 * 2**30)\nok = True",
    "dev-mem": "open('/dev/mem', 'rb').read(16)\nok = True",
    "proc-parent-environ": "ok = len(open(f'/proc/{os.getppid()}/environ').read()) > 0",
    "proc-self-mem": "open('/proc/self/mem', 'rb')\nok = True",
}


@pytest.mark.parametrize("name", list(DEVICES))
def test_device_files_give_nothing(boundary: str, name: str) -> None:
    assert run_tests(_attack(DEVICES[name]), TESTS, QUICK).passed == 0, name


# ---- disk filling ----

DISK = {
    "big-files": ("for i in range(8):\n    with open(f'f{i}', 'wb') as f:\n"
                  "        f.write(b'x' * (15 << 20))\nok = True"),
    "many-files": "for i in range(5000):\n    open(f'f{i}', 'w').write('x' * 100)\nok = True",
    "one-huge-file": "open('f', 'wb').write(b'x' * (40 << 20))\nok = True",
}


@pytest.mark.parametrize("name", list(DISK))
def test_disk_cannot_be_filled(boundary: str, name: str) -> None:
    assert run_tests(_attack(DISK[name]), TESTS, Limits(wall_seconds=10)).passed == 0, name


# ---- forged output ----

FORGED = {
    "print-lines": ("for n in ('0' * 32, 'x'):\n    for i in range(5):\n"
                    "        print(n, i, 1); print(n, 'v', i, 0, 5)\nprint('0' * 32, 'done')"),
    "stderr-lines": "for i in range(5):\n    print('0' * 32, 'v', i, 0, 5, file=sys.stderr)",
    "write-every-fd": ("for fd in range(3, 30):\n    try:\n"
                       "        os.write(fd, b'x 0 1\\nx v 0 0 5\\nx v 1 0 0\\nx done\\n')\n"
                       "    except OSError:\n        pass"),
    "close-every-fd": "os.closerange(3, 100)",
    "exit-zero": "sys.exit(0)",
    "os-exit": "os._exit(0)",
    "system-exit-in-add": "def add(a, b):\n    raise SystemExit(0)",
    "keyboard-interrupt-in-add": "def add(a, b):\n    raise KeyboardInterrupt",
    "huge-value": "def add(a, b):\n    return 'x' * (50 << 20)",
    "deep-value": "def add(a, b):\n    x = []\n    for _ in range(10000): x = [x]\n    return x",
    "self-referencing": "def add(a, b):\n    x = []\n    x.append(x)\n    return x",
}


@pytest.mark.parametrize("name", list(FORGED))
def test_forged_output_is_ignored(name: str) -> None:
    code = "import os, sys\n" + WRONG.replace("def add", "def _unused") + FORGED[name] + "\n"
    if "def add" not in code:
        code += "def add(a, b):\n    return 0\n"
    assert run_tests(code, TESTS, QUICK).passed == 0, name


# ---- defect 1: the verdict was written inside the answer's process ----

def test_defect1_an_object_equal_to_everything_does_not_pass() -> None:
    assert run_tests(BUILTINS["always-equal"], TESTS).passed == 0
    assert run_tests(BUILTINS["patched-name-in-test"], TOLERANT).passed == 0


def test_defect1_a_harness_in_the_answers_hands_cannot_forge_a_pass() -> None:
    # (with the audit hook off every frame is the answer's, and so is the harness's nonce:
    # test_the_forger_forges_where_frames_are_open)
    code = "import os, sys\n" + FORGE + FRAMES["sys._getframe"] + "\n" + WRONG
    assert run_tests(code, TESTS, QUICK).passed == 0


# ---- defect 2: the filesystem boundary was lexical, unbounded and left folders behind ----

def test_defect2_links_and_directory_descriptors_cannot_delete_a_checkpoint(
        checkpoint: Path) -> None:
    for name in ("symlink-relative", "dirfd-scratch"):
        v = run_tests(_attack(_escapes(checkpoint)[name]), TESTS)
        assert _intact(checkpoint) and v.passed == 0, name


def test_defect2_the_scratch_folder_has_a_disk_quota() -> None:
    assert run_tests(_attack(DISK["big-files"]), TESTS).passed == 0  # 120 MB > 64 MB


def test_defect2_a_killed_runs_scratch_folder_is_removed_at_the_next_start() -> None:
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("grpolab-sandbox-*"))
    script = ("from grpolab.rewards.sandbox import run_tests, Limits\n"
              "run_tests('import time\\ntime.sleep(60)', ['assert f() == 1'], "
              "Limits(wall_seconds=60))\n")
    trainer = subprocess.Popen([sys.executable, "-c", script],
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 20
        while not (set(tmp.glob("grpolab-sandbox-*")) - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = set(tmp.glob("grpolab-sandbox-*")) - before
        assert left, "the run never started"
        time.sleep(0.3)
    finally:
        trainer.kill()  # SIGKILL: no cleanup of its own
        trainer.wait()
    assert all(p.exists() for p in left)
    assert run_tests(RIGHT, TESTS, QUICK).share == 1.0  # the next start
    assert not any(p.exists() for p in left)
    time.sleep(0.2)
    assert _sandbox_processes() == []  # its sandbox died with it
    live = tmp / f"grpolab-sandbox-{os.getppid()}-keep"  # a live process's folder stays
    live.mkdir(exist_ok=True)
    try:
        run_tests(RIGHT, TESTS, QUICK)
        assert live.exists()
    finally:
        live.rmdir()


def test_the_library_the_tests_call_is_the_librarys(boundary: str) -> None:
    """A test's own calls of the standard library run after the answer's code: patched there
    (math.floor, re.split, an imported module, the builtins the test names), they are put back
    first, so they cannot say what the test expects; unpatched, they work as written."""
    tests = ["import math\nassert math.floor(f()) == 3", "from math import floor\nassert floor(f()) == 3",
             "import re\nassert re.split('b', h()) == ['a', 'c']",
             "import html\nassert html.escape(h()) == '&lt;'",
             "assert list(reversed(g())) == [3, 2, 1]"]
    forged = ("import math, re\nmath.floor = lambda x: 3\nre.split = lambda *a: ['a', 'c']\n"
              "try:\n    import html\n    html.escape = lambda s: '&lt;'\n"
              "except ImportError:\n    pass\n"
              "__builtins__['reversed'] = lambda x: [3, 2, 1]\n"
              "def f():\n    return 9.5\ndef g():\n    return [0]\ndef h():\n    return 'zzz'\n")
    assert run_tests(forged, tests, QUICK).passed == 0
    right = "def f():\n    return 3.5\ndef g():\n    return [1, 2, 3]\ndef h():\n    return 'abc'\n"
    v = run_tests(right, tests[:3] + tests[4:], QUICK)
    assert (v.passed, v.note) == (4, ""), v
    if boundary == "mount":  # (as nobody without it, a module not preloaded may be unreadable)
        assert run_tests("def h():\n    return '<'\n", tests[3:4], QUICK).passed == 1
    # a class the library defines, patched; a library function's code rewritten in place
    deeper = ["from collections import Counter\nassert Counter(h()).most_common(1) == [('a', 2)]",
              "import re\nassert re.split('b', h()) == ['a', 'c']"]
    forged = ("import collections, re\n"
              "collections.Counter.most_common = lambda self, n=None: [('a', 2)]\n"
              "code = compile('def s(*a):\\n    return [\"a\", \"c\"]', 'x', 'exec')\n"
              "try:\n    re.split.__code__ = code.co_consts[0]\nexcept PermissionError:\n    pass\n"
              "def h():\n    return 'zzz'\n")
    assert run_tests(forged, deeper, QUICK).passed == 0
    assert run_tests("def h():\n    return 'aba'\n", deeper, QUICK).passed == 1  # (split: a, a)


def test_the_harness_is_out_of_reach(boundary: str) -> None:
    """Two routes to the child's own reporting, found by a red team: a signal handler is handed
    the frame it interrupts (the harness's, with its nonce and pipe), and json's encoder is
    library code the answer could patch after it ran. Neither forges a pass now; a test that
    names a module the answer replaced by its own object gets the module."""
    signal_route = ("import signal\ngot = {}\ndef h(sig, frame):\n    fr = frame\n"
                    "    while fr is not None:\n        loc = fr.f_locals\n"
                    "        if 'nonce' in loc and 'write' in loc:\n"
                    "            got['n'], got['w'] = loc['nonce'], loc['write']\n"
                    "        fr = fr.f_back\nsignal.signal(signal.SIGUSR1, h)\n"
                    "signal.raise_signal(signal.SIGUSR1)\n"
                    "if got:\n    got['w'](got['n'] + ' v 0 0 5\\n')\n")
    for route in (signal_route, signal_route.replace("import signal", "import _signal as signal")):
        assert run_tests(route + "def add(a, b):\n    return 0\n", TESTS[:1], QUICK).passed == 0
    encoder = "import json\njson._default_encoder.encode = lambda o: '5'\n"
    assert run_tests(encoder + "def add(a, b):\n    return 0\n", TESTS[:1], QUICK).passed == 0
    assert run_tests(encoder + RIGHT, TESTS, QUICK).passed == 3  # (the values still go back)
    named = ("class M:\n    floor = staticmethod(lambda x: 3)\nmath = M()\n"
             "def f():\n    return 10.5\n")
    assert run_tests(named, ["assert math.floor(f()) == 3"], QUICK).passed == 0
    assert run_tests("import math\ndef f():\n    return 3.5\n", ["assert math.floor(f()) == 3"],
                     QUICK).passed == 1
    # what answers do honestly is still theirs: their own functions' defaults, join over a
    # generator, a test's own variable named like a module
    honest = ("from typing import NamedTuple\nclass P(NamedTuple):\n    x: int\n    y: int = 2\n"
              "def g(a, b=1):\n    return a + b\ng.__defaults__ = (2,)\n"
              "def f():\n    return P(1).y + g(1)\ndef chars():\n    return (c for c in 'ab')\n"
              "def total(xs):\n    return sum(xs)\ndef copy(x):\n    return [*x, 0]\n")
    tests = ["assert f() == 5", "assert ''.join(chars()) == 'ab'",
             "array = [1, 2, 3]\nassert total(array) == 6", "assert copy([1]) == [1, 0]"]
    v = run_tests(honest, tests, QUICK)
    assert (v.passed, v.note) == (4, ""), v


def test_library_calls_run_without_the_answer(boundary: str) -> None:
    """The red team's second round: the answer's function, called inside a library call's
    arguments, patched the library mid-step (heapq's globals, re._compile, builtins.sorted);
    and library state the first restore missed (re's pattern cache, classes with a metaclass,
    an import finder) spoke for the test. The arguments now run first, as steps of their own
    that must give plain values, and the library call after, with the library put back."""
    forged = {
        "midstep": (("import heapq, builtins, re\nclass Fake:\n"
                    "    def findall(self, s, *a):\n        return ['a']\n"
                    "def f():\n    heapq.sorted = lambda it, key=None: [1, 2]\n"
                    "    builtins.sorted = lambda it, key=None: [1, 2]\n"
                    "    re._compile = lambda *a: Fake()\n    return [9, 8]\n"
                    "def h():\n    f()\n    return 'zzz'\n"),
                    ["import heapq\nassert heapq.nsmallest(2, f()) == [1, 2]",
                     "import re\nassert re.findall('a', h()) == ['a']"]),
        "state": (("import re, fractions, sys\nclass Fake:\n"
                  "    def findall(self, s, *a):\n        return ['a']\n"
                  "for key in list(re._cache):\n    del re._cache[key]\n"
                  "re._cache[(str, 'a', 0)] = Fake()\n"
                  "fractions.Fraction.__truediv__ = lambda a, b: fractions.Fraction(2)\n"
                  "class Finder:\n    def find_spec(self, name, path=None, target=None):\n"
                  "        return None\nsys.meta_path.insert(0, Finder())\n"
                  "def f():\n    return [10, 20]\ndef h():\n    return 'zzz'\n"),
                  ["import re\nassert re.findall('a', h()) == ['a']",
                   "import statistics\nassert statistics.mean(f()) == 2"]),
    }
    for name, (code, tests) in forged.items():
        assert run_tests(code, tests, QUICK).passed == 0, name
    honest = ("def f():\n    return [3, 1, 2]\ndef h():\n    return 'banana'\n"
              "def gen():\n    yield from range(4)\n")
    tests = ["import heapq\nassert heapq.nsmallest(2, f()) == [1, 2]",
             "import re\nassert re.findall('a', h()) == ['a', 'a', 'a']",
             "import statistics\nassert statistics.mean(f()) == 2",
             "import heapq\nassert heapq.nlargest(2, gen()) == [3, 2]",
             "import re\nassert len(re.findall('n', re.sub('b', 'n', h()))) == 3"]
    v = run_tests(honest, tests, QUICK)
    assert (v.passed, v.note) == (len(tests), ""), v


# ---- the red team's third round (2026-12-06): today's moved boundaries ----

def test_the_audit_hook_uses_nothing_the_answer_can_replace(boundary: str) -> None:
    """The hook read CODE (the attribute reads it lets through) from the child's module at each
    event: an answer that put its own CODE into sys.modules['__main__'] read tb_frame, walked
    to the harness's frame and wrote a full pass with its nonce. builtins.bool, posix.stat and
    MAX_NEW_FILES were read at each event too (a write outside, a directory fd, the quota)."""
    forge = ("import os, sys\nclass Every:\n    def __contains__(self, name):\n        return True\n"
             "sys.modules['__main__'].CODE = Every()\n" + FORGE + FRAMES["traceback"])
    assert run_tests(forge + "\n" + WRONG, TESTS, QUICK).passed == 0
    probe = "fd = os.open(os.path.dirname(os.__file__) + '/zz.py', os.O_WRONLY | os.O_CREAT)"
    replaced = {
        "bool": ("import builtins\nbuiltins.bool = lambda x: False\ntry:\n    " + probe +
                 "\nexcept OSError as e:\n    ok = 'sandbox' not in str(e)"),
        "posix.stat": ("import posix\nclass File:\n    st_mode = 0o100644\n"
                       "posix.stat = lambda *a, **k: File()\nfd = os.open('.', os.O_RDONLY)\n"
                       "ok = True"),
    }
    if boundary == "hook":  # (a tmpfs of disk_mb is the quota in a mount namespace)
        replaced["MAX_NEW_FILES"] = ("sys.modules['__main__'].MAX_NEW_FILES = 10**6\n"
                                     "for i in range(80):\n    open(f'f{i}', 'w').close()\n"
                                     "ok = True")
    for name, body in replaced.items():
        assert run_tests(_attack(body), TESTS, QUICK).passed == 0, name


def test_an_exception_is_a_builtin_one_only_by_identity() -> None:
    """The child named the builtin exception classes in type(e).__mro__ by ``c in errors``: a
    metaclass whose __eq__ is always true and whose __hash__ is ValueError's made an exception
    no ``except ValueError`` catches pass ``pytest.raises(ValueError)``. A class whose mro()
    puts ValueError in its __mro__ is one to Python (``except ValueError`` catches it): it
    passes, as it would under pytest."""
    tests = ["import pytest\nwith pytest.raises(ValueError, match='positive'):\n    check(-1)",
             "try:\n    check(-1)\n    assert False\nexcept ValueError:\n    pass"]
    fake = ("import builtins\nclass M(type):\n    def __eq__(cls, other):\n        return True\n"
            "    def __hash__(cls):\n        return hash(builtins.ValueError)\n"
            "class ValueError(Exception, metaclass=M):\n    pass\n"
            "def check(x):\n    raise ValueError('must be positive')\n")
    assert run_tests(fake, tests, QUICK).passed == 0
    assert run_tests("def check(x):\n    raise ValueError('must be positive')\n", tests,
                     QUICK).passed == 2
    mro = ("class M(type):\n    def mro(cls):\n"
           "        return (cls, ValueError, Exception, BaseException, object)\n"
           "class E(Exception, metaclass=M):\n    pass\n"
           "def check(x):\n    raise E('must be positive')\n")
    assert run_tests(mro, tests, QUICK).passed == 2


def test_a_set_or_dict_is_not_deduplicated_here() -> None:
    """A str subclass equal only to itself is a plain str here: a set (or dict) of several
    equal ones collapsed when decoded, so an answer that never removed duplicates passed
    ``== {'a', 'b'}`` and ``len(...) == 1``, which Python fails. Such a value fails now."""
    code = ("class S(str):\n    __hash__ = object.__hash__\n    def __eq__(a, b):\n"
            "        return a is b\ndef uniq(xs):\n    return {S(x) for x in xs}\n"
            "def index(xs):\n    return {S(x): 0 for x in xs}\n")
    tests = ["assert uniq(['a', 'b', 'a']) == {'a', 'b'}", "assert len(uniq(['a', 'a'])) == 1",
             "assert index(['a', 'a']) == {'a': 0}"]
    assert run_tests(code, tests, QUICK).passed == 0
    right = "def uniq(xs):\n    return set(xs)\ndef index(xs):\n    return dict.fromkeys(xs, 0)\n"
    assert run_tests(right, tests, QUICK).passed == 3


def test_a_predicate_is_never_the_answers_own() -> None:
    """``f().startswith('ab')`` (and endswith, isdigit, ...) is str's judgement: the 'keep'
    steps made it in the sandbox on the answer's own object, or on a str subclass too big to
    send, so an object saying yes to everything passed every such test."""
    tests = ["assert f().startswith('ab')", "assert f().endswith('yz') and f().isdigit()",
             "assert f().isalpha()"]
    own = ("class Yes:\n    def __getattr__(self, name):\n        return lambda *a, **k: True\n"
           "def f():\n    return Yes()\n")
    big = ("class S(str):\n    def __getattribute__(self, name):\n"
           "        return lambda *a, **k: True\ndef f():\n    return S('z' * 300_000)\n")
    for code in (own, big):
        assert run_tests(code, tests, QUICK).passed == 0, code
    assert run_tests("def f():\n    return 'abyz'\n", tests[:1], QUICK).passed == 1


def test_a_library_judge_stays_the_librarys() -> None:
    """An answer's ``from math import isclose`` (or its own isclose) made a test's
    ``math.isclose(half(3), 1.5)``, and its own ``from math import isclose``, not checkable:
    the right answer scored 0. Names the test reads from a module, or binds itself, are not
    the answer's."""
    tests = ["import math\nassert math.isclose(half(3), 1.5)",
             "from math import isclose\nassert isclose(half(3), 1.5)"]
    for code in ("from math import isclose\n", "def isclose(a, b):\n    return True\n"):
        v = run_tests(code + "def half(x):\n    return x / 2\n", tests, QUICK)
        assert (v.passed, v.note) == (2, ""), (code, v)
        assert run_tests(code + "def half(x):\n    return x\n", tests, QUICK).passed == 0


def test_an_exceptions_text_cannot_stall_the_trainer() -> None:
    """``match=`` is the dataset's pattern, searched here in the answer's text: 256 KB of it
    made a pattern such as '.*positive' take half a minute per test (quadratic)."""
    plan = sandbox.plan_test("import pytest\nwith pytest.raises(ValueError, match='.*positive'):"
                             "\n    check(-1)")
    t0 = time.monotonic()
    assert not sandbox.passes(plan, {0: [["ValueError"], "x" * 250_000]})
    assert time.monotonic() - t0 < 2
    assert sandbox.passes(plan, {0: [["ValueError", "Exception"], "must be positive"]})


def test_a_pytest_files_helpers_are_not_the_answers() -> None:
    """A pytest file's own helper (``def is_sorted``) was dropped with the file's other defs:
    the test then called the answer's function of that name, which said yes. A test that uses
    one now has it, and a def cannot be judged here."""
    row = {"test": "from solution import sort_list\n\ndef is_sorted(xs):\n"
                   "    return all(a <= b for a, b in zip(xs, xs[1:]))\n\n"
                   "def test_sort():\n    assert is_sorted(sort_list([3, 1, 2]))\n\n"
                   "def test_plain():\n    assert sort_list([2, 1]) == [1, 2]\n"}
    case = sandbox.row_case(row)
    wrong = "def sort_list(xs):\n    return xs\ndef is_sorted(xs):\n    return True\n"
    v = sandbox.run_case(wrong, case, QUICK)
    assert v.passed == 0 and "not checkable" in v.note, v
    assert sandbox.run_case("def sort_list(xs):\n    return sorted(xs)\n", case, QUICK).passed == 1


def test_a_name_bound_to_a_literal_is_read_as_it_is_then() -> None:
    """``expected[0][0] = 0`` or a change through another name (``alias = expected``) left the
    literal read here as it was written: the right answer failed and the one returning the
    literal passed. Such a name is the sandbox's value now (the check then compares two)."""
    tests = ["expected = [[1, 2], [3, 4]]\nexpected[0][0] = 0\nassert build() == expected",
             "expected = [1, 2]\nalias = expected\nalias.append(3)\nassert grow() == expected"]
    stale = "def build():\n    return [[1, 2], [3, 4]]\ndef grow():\n    return [1, 2]\n"
    assert run_tests(stale, tests, QUICK).passed == 0
