"""The ``code`` verifier: run a completion's code against a question's tests, in a sandbox.

A coding question carries its tests (a ``tests`` column: a list of snippets such as
``"assert add(2, 3) == 5"``); the reward is the share of them that pass. The completion's code
(its last fenced code block, or the whole text) runs in a fresh Python process (``-I -S``: the
standard library only) that, before it runs anything of the answer's:

* on Linux drops into a new network namespace (as root, or in a new user namespace where the
  kernel allows it): no network at all;
* as root, switches to the ``nobody`` user, so the OS keeps it out of root's files and the
  process limit below applies;
* sets resource limits: CPU seconds, address space (memory), file size, open files, no core
  dumps, no new processes;
* installs a Python audit hook that refuses writes outside its scratch directory, reads
  outside that directory and the standard library, sockets, new processes, signals to other
  processes, ``ctypes`` and the garbage collector's object lists;

and runs in its own session in a scratch directory that is deleted afterwards, with a minimal
environment (no secrets of the trainer's), under a wall-clock timeout after which its whole
process group is killed. Results come back over a private pipe, each line tagged with a random
nonce, so printing or exit codes cannot fake a pass; code that deliberately tampers with the
harness from inside its own process is reward hacking this does not prevent (see the
reward-hacking watch). Without namespaces or root, the network and filesystem limits rest on
the audit hook alone, which native code could bypass; ``ctypes`` is refused for that reason.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

MAX_CODE_CHARS = 100_000
MAX_TESTS = 1_000
NOBODY = 65534  # uid and gid of `nobody` on Linux


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 5  # CPU time of the whole process (SIGKILL a second later)
    wall_seconds: float = 10.0  # then the process group is killed
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # largest file it may write (in its scratch directory)
    open_files: int = 64
    python_guard: bool = True  # the audit hook; off only to test the OS layers on their own


@dataclass
class Verdict:
    passed: int
    total: int
    note: str = ""  # why it stopped early: "timed out", "the code failed to run", ...

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


# The program the sandboxed interpreter runs. It reads its job from stdin, fences itself in,
# then runs the answer and one test at a time, writing "<nonce> <test> <1|0>" lines. Everything
# it relies on after the answer has run is held in local variables captured beforehand: the
# answer shares the interpreter and could replace module attributes (os.getcwd, builtins.exec).
RUNNER = r"""
import json, os, sys
def _main(job):
    import builtins, posix, resource
    for name in ("math", "cmath", "random", "re", "string", "collections", "collections.abc",
                 "itertools", "functools", "operator", "heapq", "bisect", "array", "copy",
                 "statistics", "fractions", "decimal", "numbers", "typing", "dataclasses",
                 "enum", "datetime", "_strptime", "time", "textwrap", "unicodedata", "hashlib",
                 "struct", "io", "abc", "contextlib", "types", "weakref", "keyword", "base64",
                 "binascii", "zlib", "calendar", "difflib", "pprint", "queue", "threading",
                 "traceback", "secrets", "inspect", "ast", "tokenize", "pathlib", "json"):
        try:  # as `nobody`, the standard library may not be readable any more
            __import__(name)
        except Exception:
            pass
    import pathlib
    nonce, code, tests, lim = job["nonce"], job["code"], job["tests"], job["limits"]
    write = os.fdopen(job["fd"], "w", buffering=1).write
    scratch = job["scratch"]
    if sys.platform.startswith("linux"):  # a network namespace of its own: no network at all
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            if posix.geteuid() == 0:
                libc.unshare(0x40000000)
            elif libc.unshare(0x10000000 | 0x40000000) == 0:  # user + network namespace
                uid, gid = posix.getuid(), posix.getgid()
                for path, text in (("/proc/self/setgroups", "deny"),
                                   ("/proc/self/uid_map", f"{uid} {uid} 1"),
                                   ("/proc/self/gid_map", f"{gid} {gid} 1")):
                    try:
                        with open(path, "w") as f:
                            f.write(text)
                    except OSError:
                        pass
            del libc, ctypes
        except Exception:
            pass
        for m in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
            del sys.modules[m]
    if posix.geteuid() == 0:
        posix.setgroups([]); posix.setgid(job["nobody"]); posix.setuid(job["nobody"])
    posix.chdir(scratch)
    for what, soft, hard in ((resource.RLIMIT_CPU, lim["cpu_seconds"], lim["cpu_seconds"] + 1),
                             (resource.RLIMIT_AS, lim["memory_mb"] << 20, lim["memory_mb"] << 20),
                             (resource.RLIMIT_FSIZE, lim["file_mb"] << 20, lim["file_mb"] << 20),
                             (resource.RLIMIT_NOFILE, lim["open_files"], lim["open_files"]),
                             (resource.RLIMIT_CORE, 0, 0),
                             (getattr(resource, "RLIMIT_NPROC", None), 0, 0)):
        if what is not None:
            try:
                resource.setrlimit(what, (soft, hard))
            except (ValueError, OSError):
                pass
    getcwd, stat, isinstance_, type_, str_, bytes_ = posix.getcwd, posix.stat, isinstance, type, str, bytes
    plain_paths = (str, bytes, pathlib.PosixPath, pathlib.PurePosixPath)
    S_IFDIR, S_IFMT = 0o040000, 0o170000
    def norm(path):
        if type_(path) not in plain_paths:
            raise PermissionError("sandbox: only str, bytes and pathlib paths")
        if isinstance_(path, pathlib.PurePath):
            path = str_(path)
        if isinstance_(path, bytes_):
            path = path.decode("utf-8", "surrogateescape")
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        parts = []
        for part in path.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)
    def under(p, roots):
        return any(p == r or p.startswith(r + "/") for r in roots)
    home = norm(os.path.realpath(scratch))
    reads = (home, norm(os.path.realpath(os.path.dirname(os.__file__))), "/dev/null",
             "/dev/urandom", "/dev/random")
    denied = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn",
              "os.fork", "os.forkpty", "os.system", "os.kill", "os.killpg", "os.startfile",
              "signal.pthread_kill", "gc.get_", "pty.", "sys._getframe", "sys._current_frames",
              "sys.settrace", "sys.setprofile", "object.__getattr__", "sys.remote_exec")
    no_import = {"ctypes", "_ctypes", "_posixsubprocess", "subprocess", "socket", "_socket",
                 "ssl", "_ssl", "multiprocessing", "_multiprocessing", "pty", "fcntl", "mmap"}
    changes = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
               "os.truncate", "os.utime", "os.link", "os.symlink", "shutil.")
    looks = ("os.listdir", "os.scandir", "os.chdir", "glob.glob", "os.chroot")
    W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    def paths(args):
        return [a for a in args if not isinstance_(a, int) and a is not None
                and type_(a) is not dict]
    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance_(path, int):
                return
            writing = bool(flags & W) if mode is None else any(c in mode for c in "wax+")
            p = norm(path)
            if under(p, (home,)):
                return
            if writing:
                raise PermissionError(f"sandbox: no writing outside its folder ({p})")
            if not under(p, reads):
                raise PermissionError(f"sandbox: no reading {p}")
            try:
                if stat(p).st_mode & S_IFMT == S_IFDIR:  # a dir fd would anchor dir_fd= paths
                    raise PermissionError(f"sandbox: no opening directory {p}")
            except OSError:
                pass
        elif event.startswith(denied):
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event == "import":
            if args[0].split(".")[0] in no_import:
                raise ImportError(f"sandbox: module {args[0]} is not available")
        elif event.startswith(changes):
            if not all(under(norm(p), (home,)) for p in paths(args)):
                raise PermissionError(f"sandbox: {event} outside its folder")
        elif event.startswith(looks):
            if not all(under(norm(p), reads) for p in paths(args)):
                raise PermissionError(f"sandbox: {event} outside its folder")
    if lim["python_guard"]:
        sys.addaudithook(hook)
    exec_, compile_, dict_, enumerate_, base = exec, compile, dict, enumerate, BaseException
    def say(text):
        try:
            write(nonce + " " + text + "\n")
        except base:
            pass
    ns = {"__name__": "__solution__", "__builtins__": dict_(builtins.__dict__)}
    del job
    say("start")
    try:
        exec_(compile_(code, "<solution>", "exec"), ns)
    except base as e:
        say("failed " + type_(e).__name__)
        return
    for i, test in enumerate_(tests):
        ok = "1"
        try:
            exec_(compile_(test, "<test>", "exec"), dict_(ns))
        except base:
            ok = "0"
        say(str_(i) + " " + ok)
    say("done")
_main(json.loads(sys.stdin.buffer.read()))
"""


def run_tests(code: str, tests: Sequence[str], limits: Limits = Limits()) -> Verdict:
    """Run ``code`` then each of ``tests`` in a sandboxed process; how many passed."""
    tests = [str(t) for t in tests][:MAX_TESTS]
    if not tests:
        return Verdict(0, 0, "no tests")
    if len(code) > MAX_CODE_CHARS:
        return Verdict(0, len(tests), f"code over {MAX_CODE_CHARS} characters")
    if os.name != "posix":
        raise RuntimeError("the code verifier needs a POSIX system (resource limits)")
    scratch = tempfile.mkdtemp(prefix="grpolab-sandbox-")
    nonce = secrets.token_hex(16)
    r, w = os.pipe()
    note = ""
    try:
        if os.geteuid() == 0:
            os.chown(scratch, NOBODY, NOBODY)
        job = json.dumps({"scratch": scratch, "nonce": nonce, "fd": w, "code": code,
                          "tests": tests, "limits": asdict(limits), "nobody": NOBODY}).encode()
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch,
               "PYTHONDONTWRITEBYTECODE": "1"}
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
        text = _drain(r)
    finally:
        if w >= 0:
            os.close(w)
        os.close(r)
        shutil.rmtree(scratch, ignore_errors=True)
    return _verdict(text, nonce, len(tests), note)


def _drain(fd: int, cap: int = 1 << 20) -> str:
    """What the pipe holds, without waiting for writers that may still hold it open."""
    os.set_blocking(fd, False)
    chunks, size = [], 0
    while size < cap:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def _verdict(text: str, nonce: str, total: int, note: str) -> Verdict:
    passed, started, failed, done = set(), False, "", False
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2 or parts[0] != nonce:  # anything the answer wrote itself
            continue
        if parts[1] == "start":
            started = True
        elif parts[1] == "failed":
            failed = " ".join(parts[2:3]) or "error"
        elif parts[1] == "done":
            done = True
        elif len(parts) == 3 and parts[1].isdigit() and parts[2] == "1":
            passed.add(int(parts[1]))
    if failed:
        note = f"the code failed to run ({failed})"
    elif not started:
        note = note or "the sandbox did not start"
    elif not done and not note:
        note = "stopped early (a limit was hit)"
    return Verdict(len({i for i in passed if i < total}), total, note)


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
