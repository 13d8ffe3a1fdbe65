"""The ``code`` verifier: run a completion's code against a question's tests, in a sandbox.

A coding question carries its tests (asserts such as ``"assert add(2, 3) == 5"``, or
stdin/stdout cases, in the columns of any dataset format ``code_data`` reads); the reward is
the share of them that pass. The verdict is
reached here, never in the answer's process: each test is parsed into the expressions the
answer must compute (``add(2, 3)``) and the checks on them (``== 5``, ``abs(_ - 2.5) < 1e-6``,
``math.isclose``, ``in``, ``not``, ...); the sandbox runs the answer, evaluates only those
expressions and sends back their values as plain JSON (numbers, strings, bools, None, lists,
dicts, tuples, sets, bytes; a subclass of one as its base type's value, anything else fails;
a builtin name the answer defines is its own); the checks run here on
values decoded here, against expected values computed here from literals. The sandbox never
sees an expected value, so no ``__eq__``, patched builtin or tampered harness can turn a wrong
value into a pass. An iterator the test only iterates (``list(gen())``, ``sum(map(...))``) comes
back as a list of at most 100,000 items; a comprehension over literals (``all(f(i) == 2 * i for
i in range(3))``) is unrolled, its calls sent there, its comparisons made here. A str, list
or dict method the test calls on a value is applied here; a library call's arguments that call
the answer's code are evaluated first, as plain values, and the call after, with the standard
library put back as it was before the answer ran. A test whose
expected side is not a literal, that would need a judgement made there (a comparison, ``all``,
``not`` or a conditional in an expression sent to the sandbox or in its setup), or that has a
``def``, a loop other than ``for x in <literal>: assert ...`` or no ``assert``, cannot be judged
this way and counts as not passed (see ``Verdict.note``). A program's output on a case's stdin
is sent back as text and compared here (``code_data.same_output``).

The answer (its last fenced code block, or the whole text) runs in a fresh ``python -I -S``
(grpolab/rewards/sandbox_child.py) in new mount, network and IPC namespaces (as root, or in a
user namespace where the kernel allows): a read-only root with only the system libraries, the
standard library, /dev/null, /dev/urandom and its own /proc, plus the scratch folder, a tmpfs of
``disk_mb``. As root it becomes ``nobody``; resource limits (CPU, memory, file size, open files,
no core dumps, no new processes) and an audit hook (paths resolved, no ``..``, links, directory
descriptors, sockets, processes, signals to others, ``ctypes`` or frames) follow; a minimal
environment, a wall-clock kill of its process group, death with its parent. Without a mount
namespace the audit hook is the filesystem boundary (``Verdict.boundary``) and the quota is a
cap on files created, each smaller. Scratch folders are named after the trainer's pid; those
of dead processes (killed runs) are removed at the next start.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from grpolab.rewards.code_data import (
    COLUMNS,
    Case,
    bind_solution,
    broken_json,
    column_of,
    row_case,
)
from grpolab.rewards.fold import NAMES
from grpolab.rewards.sandbox_judge import SHADOWABLE, Plan, passes, plan_test
from grpolab.rewards.shapes import defined_names

logger = logging.getLogger("grpolab.rewards.sandbox")
MAX_CODE_CHARS = 100_000
MAX_TESTS = 1_000
NOBODY = 65534  # uid and gid of `nobody` on Linux
SCRATCH_PREFIX = "grpolab-sandbox-"  # then "<pid>-": a dead pid's folder is a killed run's
# the child's program: its values' encoding, then the child (run as one text, never imported)
RUNNER = "".join(Path(__file__).with_name(f"sandbox_{part}.py").read_text()
                 for part in ("values", "child"))


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 5  # CPU time of the whole process (SIGKILL a second later)
    wall_seconds: float = 10.0  # then the process group is killed
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # largest file it may write (in its scratch directory)
    open_files: int = 64
    python_guard: bool = True  # the audit hook; off only to test the OS layers on their own
    disk_mb: int = 64  # all of its scratch folder together
    mount_namespace: bool = True  # False: the audit hook alone is the boundary (the fallback)


@dataclass
class Verdict:
    passed: int
    total: int
    note: str = ""  # why it stopped early: "timed out", "the code failed to run", ...
    boundary: str = ""  # the filesystem boundary that held: "mount" (namespace) or the hook's

    @property
    def share(self) -> float:
        return self.passed / self.total if self.total else 0.0


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced code block (python/py or unlabelled), else the whole completion."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
    python = [body for lang, body in blocks if lang in ("python", "py", "python3", "")]
    return python[-1] if python else completion


def run_tests(code: str, tests: Sequence[str], limits: Limits = Limits()) -> Verdict:
    """Run ``code`` in a sandboxed process, evaluate the tests' expressions there and check
    their values here: how many tests passed."""
    shadow = defined_names(code) & (SHADOWABLE | NAMES)
    return _run(code, [plan_test(str(t), shadow) for t in list(tests)[:MAX_TESTS]], limits,
                False)


def run_io(code: str, cases: Sequence[tuple[str, str]], limits: Limits = Limits()) -> Verdict:
    """Run ``code`` as a program on each case's stdin, in one sandboxed process (a fresh
    namespace, ``__name__ == "__main__"``, each time), and compare its output with the case's
    expected stdout here (``code_data.same_output``): how many cases passed."""
    return _run(code, [_io_plan(str(i), str(o)) for i, o in list(cases)[:MAX_TESTS]], limits,
                True)


def _io_plan(stdin: str, stdout: str) -> Plan:
    """A stdin/stdout case: the program run on ``stdin`` there, its output checked here."""
    return Plan([("stdio", stdin)], [("stdout", ("val", 0), stdout)])


def run_case(code: str, case: Case, limits: Limits = Limits()) -> Verdict:
    """A row's tests (``code_data.row_case``) on the answer's code: after the prompt's code
    (``case.prelude``), or, where it does not define the function the prompt begins, as
    that function's continuation (a base model's)."""
    if case.entry and case.prompt and case.entry not in defined_names(code):
        code = case.prompt + code
    code = f"{case.prelude}\n\n{code}" if case.prelude else code
    if case.io:
        return run_io(code, case.io, limits)
    code = bind_solution(code, case.fn_name) if case.fn_name else code
    return run_tests(f"{code}\n\n{case.setup}" if case.setup.strip() else code, case.tests,
                     limits)


def _run(code: str, plans: list[Plan | None], limits: Limits, stdio: bool) -> Verdict:
    if not plans:
        return Verdict(0, 0, "no tests")
    if len(code) > MAX_CODE_CHARS:
        return Verdict(0, len(plans), f"code over {MAX_CODE_CHARS} characters")
    if os.name != "posix":
        raise RuntimeError("the code verifier needs a POSIX system (resource limits)")
    sweep_scratch()
    scratch = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    nonce = secrets.token_hex(16)
    r, w = os.pipe()
    note, too_big = "", False
    try:
        if os.geteuid() == 0:
            os.chown(scratch, NOBODY, NOBODY)
        program = [p.steps if p else [] for p in plans]
        job = json.dumps({"scratch": scratch, "nonce": nonce, "fd": w, "code": code,
                          "program": program, "stdio": stdio, "limits": asdict(limits),
                          "nobody": NOBODY, "mount": limits.mount_namespace,
                          "ppid": os.getpid()}).encode()
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch,
               "PYTHONDONTWRITEBYTECODE": "1"}
        chunks: list[bytes] = []
        cap = (2 << 20) * len(plans) if stdio else 4 << 20  # a program's output: 1 MB a case
        reader = threading.Thread(target=_read_all, args=(r, chunks, cap), daemon=True)
        reader.start()  # read as it writes: a full pipe would stall it until the timeout
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", RUNNER], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(w,),
            start_new_session=True, cwd=scratch, env=env,
        )
        os.close(w)
        w = -1
        try:
            proc.communicate(job, timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            note = "timed out"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # and anything it may have started
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        reader.join(5)  # every writer is gone: EOF
        text = b"".join(chunks).decode("utf-8", "replace")
        too_big = _size(scratch) > limits.disk_mb << 20
    finally:
        if w >= 0:
            os.close(w)
        shutil.rmtree(scratch, ignore_errors=True)
    verdict = _verdict(text, nonce, plans, note)
    if too_big:  # only where the hook was the boundary; a tmpfs cannot grow past it
        return Verdict(0, len(plans), f"over its disk quota ({limits.disk_mb} MB)",
                       verdict.boundary)
    return verdict


def _read_all(fd: int, chunks: list[bytes], cap: int = 4 << 20) -> None:
    """What the pipe brings until every writer has closed it; past ``cap`` it is dropped."""
    size = 0
    try:
        while chunk := os.read(fd, 65536):
            if size < cap:
                chunks.append(chunk)
                size += len(chunk)
    finally:
        os.close(fd)


def _size(folder: str) -> int:
    total = 0
    for top, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                pass
    return total


def sweep_scratch() -> None:
    """Remove the scratch folders of runs whose process is gone (killed before cleaning up)."""
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(re.escape(SCRATCH_PREFIX) + r"(\d+)-.+", name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # someone else's, or no pid at all
        pass
    return True


def _verdict(text: str, nonce: str, plans: list[Plan | None], note: str) -> Verdict:
    values: dict[int, dict[int, Any]] = {}
    started, failed, done, boundary, raised = False, "", False, "", ""
    seen: set[tuple[str, ...]] = set()
    for line in text.splitlines():
        parts = line.split(" ", 4)
        if len(parts) < 2 or parts[0] != nonce:  # anything the answer wrote itself
            continue
        if parts[1] == "start":
            started, boundary = True, "mount" if parts[2:3] == ["mount"] else "hook"
        elif parts[1] == "failed":
            failed = " ".join(parts[2:3]) or "error"
        elif parts[1] == "done":
            done = True
        elif parts[1] == "e" and len(parts) == 5 and not raised:  # a test's step raised
            raised = parts[4][:60]
        elif parts[1] == "v" and len(parts) == 5 and parts[2].isdigit() and parts[3].isdigit():
            if (parts[2], parts[3]) in seen:  # the child says each once: someone else spoke
                failed = "a value reported twice"
            seen.add((parts[2], parts[3]))
            got = values.setdefault(int(parts[2]), {})
            if int(parts[3]) not in got and parts[4] != "!":  # the first word stands
                try:
                    got[int(parts[3])] = decode(json.loads(parts[4]))
                except Exception:  # noqa: BLE001, S110 - malformed, too deep, unhashable
                    pass
    passed = sum(passes(plan, values.get(i, {})) for i, plan in enumerate(plans))
    unjudged = sum(plan is None for plan in plans)
    if failed:
        note = f"the code failed to run ({failed})"
    elif not started:
        note = note or "the sandbox did not start"
    elif not done and not note:
        note = "stopped early (a limit was hit)"
    if unjudged and not note:
        note = f"{unjudged} test(s) not checkable outside the sandbox (counted as failed)"
    if raised and not note:  # (a RuntimeError of a thread: no new threads or processes)
        note = f"a test's code raised {raised}"
    return Verdict(passed if started and not failed else 0, len(plans), note, boundary)


def decode(x: Any) -> Any:
    """A value from the sandbox's JSON, back to plain Python (tuples, sets, dicts, bytes and
    complex numbers come tagged)."""
    if isinstance(x, list):
        return [decode(v) for v in x]
    if isinstance(x, dict):
        ((tag, body),) = x.items()
        if tag == "b":
            return bytes.fromhex(body)
        if tag == "c":
            return complex(*(_number(v) for v in body))
        out = {decode(k): decode(v) for k, v in body} if tag == "d" else \
            {"t": tuple, "s": set, "f": frozenset}[tag](decode(v) for v in body)
        if len(out) != len(body):  # items the answer's set held apart (str subclasses equal
            raise ValueError("a set or dict that is not one here")  # only to themselves)
        return out
    return x


def _number(x: Any) -> int | float:
    if type(x) not in (int, float):
        raise TypeError("not a number")
    return x


def code_reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """Share of a question's tests that the code in the completion passes, each completion in
    its own sandbox, several at once. The tests come from the row's columns in any format
    ``code_data`` reads (``tests``, MBPP, HumanEval, APPS, code_contests, ..., else ``answer``)."""
    n = len(completions)
    rows = [{"prompt": prompts[i] if i < len(prompts) else "",  # (HumanEval's has its code)
             **{k: v[i] for k, v in columns.items() if isinstance(v, list) and len(v) == n}}
            for i in range(n)]
    if n and column_of(rows[0]) is None:
        raise ValueError(f"the code reward needs the tests in a column: {', '.join(COLUMNS)}")
    jobs = [(extract_code(str(c)), row_case(row)) for c, row in zip(completions, rows)]
    _warn_unjudged([case for _, case in jobs])
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        return [v.share for v in ex.map(lambda job: run_case(*job), jobs)]


def code_all_reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """1.0 where the code passes every test of its question, else 0.0 (the sparse reward of
    DeepCoder and others; ``code`` gives the share)."""
    return [float(r == 1.0) for r in code_reward(prompts, completions, **columns)]


_WARNED: set[str] = set()  # what was said once already: per process, i.e. per run
HOW = ("a test is an assert on values the answer computes, with a literal expected side, "
       "such as 'assert add(2, 3) == 5', or a stdin/stdout case (a helper def, a loop over "
       "the answer's values and comparisons of two of the answer's values are not supported)")


def _warn_unjudged(cases: list[Case], where: str = "") -> None:
    """Tests the verifier cannot judge score 0 whatever the answer: a reward of 0 would look
    like a verdict on the answers, so say so (once a run, or once per file checked)."""
    if "unjudged" in _WARNED and not where:
        return
    tests = [t for case in cases for t in case.tests]
    bad = [t for t in tests if plan_test(t) is None]
    empty = sum(not case.count for case in cases)
    if bad or empty:
        _WARNED.add("unjudged")
        what = [(f"{len(bad)} of the {len(tests)} tests{where} not checkable outside the "
                 f"sandbox (e.g. {_short(bad[0])})")] if bad else []
        unit = f"rows{where}" if where else "answers"
        what += [f"{empty} of the {len(cases)} {unit} with no tests"] if empty else []
        logger.warning("code reward: %s; they count as failed, so reward 0 there says nothing "
                       "about the answers. %s", " and ".join(what), HOW[0].upper() + HOW[1:])


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def check_tests(rows: list[dict[str, Any]], where: str, sample: int = 200,
                warn: bool = True) -> None:
    """Refuse (ValueError: exit 2, before anything is written) rows whose tests the ``code``
    reward can judge none of: no column of tests, answers that are not tests, or tests of a
    shape it does not support. Judged on the first ``sample`` rows."""
    if not rows:
        return
    column = column_of(rows[0])
    if column is None:
        raise ValueError(f"the code reward needs the tests in a column ({', '.join(COLUMNS)}; "
                         f"'test' with 'entry_point'); {where} has: {', '.join(map(str, rows[0]))}")
    for i, row in enumerate(rows[:sample]):
        if (name := broken_json(row)) is not None:
            raise ValueError(
                f"{where}: row {i + 1}'s {name!r} is not valid JSON ({_short(row[name])}); a "
                "list written by pandas' to_csv is Python's text, not JSON: write the column "
                "with json.dumps, or the file with to_json(orient='records', lines=True)")
    cases = [row_case(row) for row in rows[:sample]]
    if any(case.io for case in cases):
        if warn:  # (rows without tests, say of another language, beside stdin/stdout ones)
            _warn_unjudged(cases, f" of {where}")
        return
    tests = [t for case in cases for t in case.tests]
    if not any(plan_test(t) is not None for t in tests[:MAX_TESTS * 4]):
        shown = f"e.g. {_short(tests[0])}" if tests else "all empty"
        raise ValueError(f"the code reward can judge none of the tests of {where} (column "
                         f"{column!r}, first {min(sample, len(rows))} rows: {shown}); {HOW}")
    if warn:  # the count per file now, not once for whichever batch came first
        _warn_unjudged(cases, f" of {where}" + (f" (its first {sample} rows)"
                                                 if len(rows) > sample else ""))
