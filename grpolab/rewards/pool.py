"""Worker processes that run reward functions with a per-call timeout that can stop them.

A thread cannot be stopped and ``signal.alarm`` only works on the main thread and only between
bytecodes, so a reward that loops in C, sleeps or waits on a socket can only be stopped by
ending its process. The workers are forked from the trainer when first needed, so they already
hold the reward functions (lambdas, closures and functions defined in ``__main__`` included):
only the arguments of each call and its result cross the pipe. A call that runs past the
timeout, or whose worker dies (``os._exit``, a segfault, the OOM killer), fails for that call
alone; the worker is replaced and the run goes on. ``sys.exit`` in a reward is an ordinary
failure (SystemExit is caught in the worker).

What a reward does to global state in a worker is not seen by the trainer, and the workers
ignore SIGINT/SIGTERM/SIGUSR1: the trainer decides when they stop, and they die with it. The
ignoring is a Python handler, not SIG_IGN, so a program a reward starts gets the default
dispositions back (exec resets handlers, and forked children are reset at the fork); each
worker leads its own process group, and stopping a worker kills that group, so nothing a
reward started outlives the pool.

Trust: a reward is user code with the trainer's rights. Its worker is a fork of the trainer:
it sees the trainer's environment variables (tokens included), files and user, can signal the
trainer and can delete its out_dir. Run only reward code you trust; untrusted answers are
what the ``code`` verifier's sandbox is for.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import functools
import inspect
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

Call = tuple[tuple[Any, ...], dict[str, Any]]  # (args, kwargs) of one reward call
# ("ok", returned value), or ("raised" | "timeout" | "died", what went wrong, in words)
Outcome = tuple[str, Any]

MAX_WORKERS = 8


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def default_workers() -> int:
    return max(2, min(MAX_WORKERS, os.cpu_count() or 1))


def await_if_needed(value: Any) -> Any:
    """The result of an ``async def`` reward: its coroutine run to completion on a fresh event
    loop (on a helper thread when this thread already runs one, as in a notebook)."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, wait()).result()


def error_text(e: BaseException, limit: int = 160) -> str:
    """``Type: message`` on one line, cut at ``limit``, and where in the reward's own code it
    was raised (the innermost frame outside grpolab and installed packages: ``(at r.py:12)``)."""
    try:
        said = str(e)
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises: its type alone
        said = "(its message could not be read)"
    text = " ".join(f"{type(e).__name__}: {said}".split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    here, lib = os.path.dirname(os.path.dirname(__file__)), os.path.dirname(os.__file__)
    ours = [f for f in traceback.extract_tb(e.__traceback__)
            if not f.filename.startswith((here, lib, "<")) and "-packages" not in f.filename]
    return f"{text} (at {os.path.basename(ours[-1].filename)}:{ours[-1].lineno})" if ours else text


def _plain(value: Any) -> Any:
    """Tensors and arrays as lists: small to send back, and unpicklable types never cross."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the trainer dies, even by SIGKILL (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


STOP_SIGNALS = tuple(getattr(signal, s) for s in ("SIGINT", "SIGTERM", "SIGUSR1")
                     if hasattr(signal, s))


def _ignore(signum: int, frame: Any) -> None:
    """The workers' handler: ignored here, yet not inherited as SIG_IGN by what they start."""


def _default_dispositions() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def _kill_group(pgid: int) -> None:
    """SIGKILL a worker's process group: the worker, and what its rewards started."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in it (or it was never made: then it is not ours)


def _worker_loop(conn: Any, fns: Sequence[Callable], parent: int) -> None:
    try:
        os.setpgid(0, 0)  # its own group, killed whole on stop (the parent sets it too)
    except OSError:
        pass
    for sig in STOP_SIGNALS:
        signal.signal(sig, _ignore)
    os.register_at_fork(after_in_child=_default_dispositions)  # a reward's forks: defaults
    _die_with_parent()
    if os.getppid() != parent:  # the trainer died before the line above took effect
        return
    torch = sys.modules.get("torch")
    if torch is not None:  # forked OpenMP pools are not safe to use: one thread
        torch.set_num_threads(1)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        j, args, kwargs = msg
        try:
            out: Outcome = ("ok", _plain(await_if_needed(fns[j](*args, **kwargs))))
        except BaseException as e:  # noqa: BLE001 - SystemExit too: a reward cannot end a run
            out = ("raised", f"raised {error_text(e)}")
        try:
            conn.send(out)
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
            why = f"returned a value that cannot be sent back ({error_text(e)})"
            conn.send(("raised", why))


class _Worker:
    def __init__(self, fns: Sequence[Callable]) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_loop, args=(child, fns, os.getpid()), daemon=True,
                                name="grpolab-reward-worker")
        self.proc.start()
        try:  # (as the child does: whichever runs first, the group exists before a kill)
            os.setpgid(self.proc.pid, self.proc.pid)
        except OSError:
            pass
        child.close()
        self.job: int | None = None
        self.deadline = 0.0

    def stop(self, kill: bool = False) -> None:
        if not kill:
            try:
                self.conn.send(None)
            except OSError:
                pass
            else:  # waits without reaping: the group id cannot be reused before the kill
                multiprocessing.connection.wait([self.proc.sentinel], 1.0)
        _kill_group(self.proc.pid)
        self.proc.join()
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop()
    workers.clear()


class RewardPool:
    """Runs calls of a fixed list of reward functions in forked workers, in parallel, each
    call limited to ``timeout`` seconds of wall time."""

    def __init__(self, fns: Sequence[Callable], timeout: float, workers: int = 0) -> None:
        if not can_fork():
            raise RuntimeError("reward worker processes need os.fork (not on this platform)")
        self.fns = list(fns)
        self.timeout = float(timeout)
        self.size = workers or default_workers()
        self._workers: list[_Worker] = []
        # Workers are stopped when the pool is closed, collected, or the interpreter exits
        # (before multiprocessing's own exit handler, which would wait on them).
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def index(self, fn: Callable) -> int | None:
        return next((i for i, f in enumerate(self.fns) if f is fn), None)

    def close(self) -> None:
        self._finalizer()

    def map(self, fn: Callable, calls: Sequence[Call]) -> list[Outcome]:
        """``fn(*args, **kwargs)`` for every call, in parallel; outcomes in call order."""
        j = self.index(fn)
        if j is None:
            raise ValueError("this function was not given to the pool")
        out: list[Outcome | None] = [None] * len(calls)
        todo = collections.deque(range(len(calls)))
        while len(self._workers) < min(self.size, len(calls)):
            self._workers.append(_Worker(self.fns))
        busy: dict[Any, _Worker] = {}
        while todo or busy:
            for w in self._workers:
                if todo and w.job is None:
                    i = todo.popleft()
                    args, kwargs = calls[i]
                    try:
                        w.conn.send((j, args, kwargs))
                    except OSError:  # the worker is gone: replace it and try again
                        self._replace(w)
                        todo.appendleft(i)
                        continue
                    except Exception as e:  # noqa: BLE001 - unpicklable arguments
                        why = f"got arguments that cannot be sent ({error_text(e)})"
                        out[i] = ("raised", why)
                        continue
                    w.job, w.deadline = i, time.monotonic() + self.timeout
                    busy[w.conn] = w
            if not busy:
                continue
            wait = max(0.0, min(w.deadline for w in busy.values()) - time.monotonic())
            for conn in multiprocessing.connection.wait(list(busy), timeout=wait):
                w = busy.pop(conn)
                try:
                    out[w.job] = conn.recv()
                except (EOFError, OSError):
                    w.proc.join(1.0)
                    code = w.proc.exitcode
                    out[w.job] = ("died", f"ended its worker process (exit code {code})")
                    self._replace(w)
                    continue
                w.job = None
            now = time.monotonic()
            for conn, w in list(busy.items()):
                if now >= w.deadline:
                    del busy[conn]
                    out[w.job] = ("timeout", f"timed out after {self.timeout:g} s")
                    self._replace(w)
        return out  # type: ignore[return-value]

    def _replace(self, w: _Worker) -> None:
        w.stop(kill=True)
        self._workers[self._workers.index(w)] = _Worker(self.fns)

def runs_in_process(fn: Any) -> bool:
    """Whether a reward runs in the trainer's process even when a RewardPool is given.

    grpolab's own rewards are bounded-time and run in-process; any other function runs in a
    worker, unless it sets ``fn.in_process = True`` (trusted, fast code: no timeout then).
    """
    flag = getattr(fn, "in_process", None)
    if flag is not None:
        return bool(flag)
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    return module == "grpolab" or module.startswith("grpolab.")


_warned_no_fork = False


def pool_for(fns: Sequence[Callable], timeout: float, workers: int = 0) -> RewardPool | None:
    """Worker processes for the rewards among ``fns`` that are not grpolab's own, or None when
    ``timeout`` is 0, none needs one, or this platform cannot fork (warned once)."""
    global _warned_no_fork
    if timeout <= 0 or all(runs_in_process(f) for f in fns):
        return None
    if not can_fork():
        if not _warned_no_fork:
            logging.getLogger("grpolab").warning(
                "no os.fork on this platform: rewards run in the calling process without "
                "reward_timeout")
        _warned_no_fork = True
        return None
    return RewardPool(fns, timeout, workers)
