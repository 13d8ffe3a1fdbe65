"""The ``code`` verifier: run a completion's code against a question's tests, in a sandbox.

A coding question carries its tests (a ``tests`` column: a list of snippets such as
``"assert add(2, 3) == 5"``); the reward is the share of them that pass. The verdict is
reached here, never in the answer's process: each test is parsed into the expressions the
answer must compute (``add(2, 3)``) and the checks on them (``== 5``, ``abs(_ - 2.5) < 1e-6``,
``math.isclose``, ``in``, ``not``, ...); the sandbox runs the answer, evaluates only those
expressions and sends back their values as plain JSON (numbers, strings, bools, None, lists,
dicts, tuples, sets, bytes; anything else, a subclass included, fails); the checks run here on
values decoded here, against expected values computed here from literals. The sandbox never
sees an expected value, so no ``__eq__``, patched builtin or tampered harness can turn a wrong
value into a pass. A test whose expected side is not a literal, or that has a loop, a ``def``
or no ``assert``, cannot be judged this way and counts as not passed (see ``Verdict.note``).

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

import ast
import concurrent.futures
import json
import math
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

MAX_CODE_CHARS = 100_000
MAX_TESTS = 1_000
NOBODY = 65534  # uid and gid of `nobody` on Linux
SCRATCH_PREFIX = "grpolab-sandbox-"  # then "<pid>-": a dead pid's folder is a killed run's
RUNNER = (Path(__file__).with_name("sandbox_child.py")).read_text()


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


def parse_tests(value: Any) -> list[str]:
    """A row's tests: a list of snippets, or a string holding a JSON list (CSV/parquet
    columns), or one snippet."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except ValueError:
                return [value]
        else:
            return [value] if text else []
    if isinstance(value, (list, tuple)):
        return [str(t) for t in value if str(t).strip()]
    return []


class _Unjudgeable(Exception):
    """A test that cannot be judged outside the answer's process."""


# Functions a check may apply here to a value from the sandbox (bounded work on plain values)
_FUNCS = {"len": len, "sorted": sorted, "set": set, "frozenset": frozenset, "tuple": tuple,
          "list": list, "abs": abs, "round": round, "sum": sum, "min": min, "max": max,
          "bool": bool, "int": int, "float": float, "str": str, "any": any, "all": all,
          "dict": dict}
_CONSTS = {"inf": math.inf, "nan": math.nan, "pi": math.pi, "e": math.e, "tau": math.tau}
_CMP = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
        ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
        ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
        ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
        ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b}
_ARITH = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
          ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
          ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
          ast.Pow: lambda a, b: a ** _small(b)}
_NUMBER = (int, float)


@dataclass
class _Plan:
    steps: list[tuple[str, str]]  # ("exec", statement) / ("eval", expression), in order
    checks: list[Any]  # one term per assert, over the values of the "eval" steps


def _plan(test: str) -> _Plan | None:
    """The test as steps for the sandbox and checks for here, or None if it cannot be
    judged outside the answer's process."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    plan = _Plan([], [])
    try:
        for node in tree.body:
            if isinstance(node, ast.Assert):
                plan.checks.append(_term(node.test, plan, top=True))
            elif isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign,
                                   ast.AugAssign, ast.Expr)):
                plan.steps.append(("exec", ast.unparse(node)))  # sets up the calls' inputs
            else:
                return None
    except (_Unjudgeable, RecursionError):
        return None
    return plan if plan.checks else None


def _is_val(term: Any) -> bool:  # holds a value from the sandbox
    return isinstance(term, tuple) and term[0] != "lit" and (
        term[0] == "val" or any(_is_val(t) for t in term[1:]))


def _term(node: ast.expr, plan: _Plan, top: bool = False) -> Any:
    return _fold(_term_raw(node, plan, top))


def _term_raw(node: ast.expr, plan: _Plan, top: bool = False) -> Any:
    """A check over sandbox values; sub-expressions it cannot compute here are evaluated
    by the sandbox (as long as the expected side stays here)."""
    try:  # a literal, computed here
        return ("lit", ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "math" and node.attr in _CONSTS:
        return ("lit", _CONSTS[node.attr])
    if isinstance(node, ast.Compare) and all(type(op) in _CMP for op in node.ops):
        operands = [_term(n, plan) for n in (node.left, *node.comparators)]
        if sum(_is_val(t) for t in operands) > 1:  # both sides the answer's: forgeable
            raise _Unjudgeable
        return ("cmp", tuple(type(op) for op in node.ops), *operands)
    if isinstance(node, ast.BoolOp):
        return ("and" if isinstance(node.op, ast.And) else "or",
                *[_term(v, plan, top) for v in node.values])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ("not", _term(node.operand, plan, top))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return ("neg" if isinstance(node.op, ast.USub) else "pos", _term(node.operand, plan))
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        return ("arith", type(node.op), _term(node.left, plan), _term(node.right, plan))
    if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
        index = _term(node.slice, plan)
        if index[0] == "lit":
            return ("item", _term(node.value, plan), index)
    if isinstance(node, ast.Call) and not any(k.arg is None for k in node.keywords):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else (
            func.attr if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id == "math" else None)
        kwargs = {k.arg: _term(k.value, plan) for k in node.keywords}
        if name == "isclose" and len(node.args) == 2 and all(
                k in ("rel_tol", "abs_tol") and v[0] == "lit" for k, v in kwargs.items()):
            a, b = (_term(n, plan) for n in node.args)
            if _is_val(a) and _is_val(b):
                raise _Unjudgeable
            return ("isclose", a, b, {k: v[1] for k, v in kwargs.items()})
        if isinstance(func, ast.Name) and name in _FUNCS and not kwargs \
                and not any(isinstance(a, ast.Starred) for a in node.args):
            return ("call", name, *[_term(a, plan) for a in node.args])
    if isinstance(node, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
        raise _Unjudgeable
    plan.steps.append(("eval", ast.unparse(node)))
    return ("val", sum(kind == "eval" for kind, _ in plan.steps) - 1)


def _fold(term: Any) -> Any:
    """A term with no value of the sandbox's in it, computed now (``float('inf')``,
    ``10**9 + 7``, ``set()``)."""
    if term[0] in ("lit", "val") or _is_val(term):
        return term
    try:
        return ("lit", _eval(term, {}))
    except Exception as e:
        raise _Unjudgeable from e


def _eval(term: Any, values: dict[int, Any]) -> Any:
    kind = term[0]
    if kind == "lit":
        return term[1]
    if kind == "val":
        return values[term[1]]  # a KeyError if it raised or sent nothing usable
    if kind == "cmp":
        operands = [_eval(t, values) for t in term[2:]]
        return all(_CMP[op](a, b) for op, a, b in zip(term[1], operands, operands[1:]))
    if kind in ("and", "or"):
        results = [bool(_eval(t, values)) for t in term[1:]]  # every value must have come
        return all(results) if kind == "and" else any(results)
    if kind == "not":
        return not _eval(term[1], values)
    if kind in ("neg", "pos"):
        x = _num(_eval(term[1], values))
        return -x if kind == "neg" else x
    if kind == "arith":  # numbers only: a list times a number could be made huge here
        return _ARITH[term[1]](_num(_eval(term[2], values)), _num(_eval(term[3], values)))
    if kind == "item":
        return _eval(term[1], values)[_eval(term[2], values)]
    if kind == "isclose":
        a, b = _num(_eval(term[1], values)), _num(_eval(term[2], values))
        return math.isclose(a, b, **term[3])
    if kind == "call":
        args = [_eval(t, values) for t in term[2:]]
        if term[1] == "round" and len(args) == 2:
            _small(args[1])
        return _FUNCS[term[1]](*args)
    raise ValueError(kind)


def _small(x: Any) -> Any:
    """An exponent or ndigits that keeps the work here bounded."""
    if not isinstance(x, _NUMBER) or abs(x) > 4096:
        raise ValueError("too large")
    return x


def _num(x: Any) -> int | float:
    if not isinstance(x, _NUMBER):
        raise TypeError("not a number")
    return x


def _decode(x: Any) -> Any:
    """A value from the sandbox's JSON, back to plain Python (tuples, sets, dicts, bytes and
    complex numbers come tagged)."""
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if isinstance(x, dict):
        ((tag, body),) = x.items()
        if tag == "d":
            return {_decode(k): _decode(v) for k, v in body}
        if tag == "b":
            return bytes.fromhex(body)
        if tag == "c":
            return complex(_num(body[0]), _num(body[1]))
        return {"t": tuple, "s": set, "f": frozenset}[tag](_decode(v) for v in body)
    return x


def _passes(plan: _Plan | None, values: dict[int, Any]) -> bool:
    if plan is None:
        return False
    try:
        return all(bool(_eval(check, values)) for check in plan.checks)
    except Exception:  # noqa: BLE001 - a missing value, a type mismatch: not a pass
        return False


def run_tests(code: str, tests: Sequence[str], limits: Limits = Limits()) -> Verdict:
    """Run ``code`` in a sandboxed process, evaluate the tests' expressions there and check
    their values here: how many tests passed."""
    tests = [str(t) for t in tests][:MAX_TESTS]
    if not tests:
        return Verdict(0, 0, "no tests")
    if len(code) > MAX_CODE_CHARS:
        return Verdict(0, len(tests), f"code over {MAX_CODE_CHARS} characters")
    if os.name != "posix":
        raise RuntimeError("the code verifier needs a POSIX system (resource limits)")
    plans = [_plan(t) for t in tests]
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
                          "program": program, "limits": asdict(limits),
                          "nobody": NOBODY, "mount": limits.mount_namespace,
                          "ppid": os.getpid()}).encode()
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch,
               "PYTHONDONTWRITEBYTECODE": "1"}
        chunks: list[bytes] = []
        reader = threading.Thread(target=_read_all, args=(r, chunks), daemon=True)
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
        return Verdict(0, len(tests), f"over its disk quota ({limits.disk_mb} MB)",
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


def _verdict(text: str, nonce: str, plans: list[_Plan | None], note: str) -> Verdict:
    values: dict[int, dict[int, Any]] = {}
    started, failed, done, boundary = False, "", False, ""
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
        elif parts[1] == "v" and len(parts) == 5 and parts[2].isdigit() and parts[3].isdigit():
            got = values.setdefault(int(parts[2]), {})
            if int(parts[3]) not in got and parts[4] != "!":  # the first word stands
                try:
                    got[int(parts[3])] = _decode(json.loads(parts[4]))
                except Exception:  # noqa: BLE001, S110 - malformed, too deep, unhashable
                    pass
    passed = sum(_passes(plan, values.get(i, {})) for i, plan in enumerate(plans))
    unjudged = sum(plan is None for plan in plans)
    if failed:
        note = f"the code failed to run ({failed})"
    elif not started:
        note = note or "the sandbox did not start"
    elif not done and not note:
        note = "stopped early (a limit was hit)"
    if unjudged and not note:
        note = f"{unjudged} test(s) not checkable outside the sandbox (counted as failed)"
    return Verdict(passed if started and not failed else 0, len(plans), note, boundary)


def code_reward(prompts: list[Any], completions: list[str], tests: list[Any] | None = None,
                answer: list[Any] | None = None, **_: Any) -> list[float]:
    """Share of a question's tests (the ``tests`` column, else ``answer``) that the code in
    the completion passes, each completion in its own sandbox, several at once."""
    cases = tests if tests is not None else answer
    if cases is None:
        raise ValueError("the code reward needs a 'tests' column (or answer_column: tests)")
    jobs = [(extract_code(str(c)), parse_tests(t)) for c, t in zip(completions, cases)]
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        return [v.share for v in ex.map(lambda job: run_tests(*job), jobs)]
