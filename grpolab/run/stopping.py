"""Stopping a run on a scheduler's signal: finish the step, checkpoint, exit 128 + signal.

SIGTERM (what a cluster scheduler sends before it preempts a job) or SIGUSR1 (Slurm's
``--signal``) asks the loop to stop after the current step; a second one abandons the step at
once. SIGINT (Ctrl-C) stays an immediate stop.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpolab.run import dist

STOP_SIGNALS = tuple(getattr(signal, s) for s in ("SIGTERM", "SIGUSR1") if hasattr(signal, s))


class RunStopped(BaseException):
    """SIGTERM/SIGUSR1 stopped the run; ``exit_code`` is 128 + the signal, as a shell reports.

    A BaseException so that no handler meant for reward or model errors swallows it.
    """

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + int(signum)


def stop_before_start(command: str) -> dict[int, Any]:
    """Where a run's own handlers are not in place (loading the model; ``eval`` throughout):
    SIGTERM/SIGUSR1 stop at once with one line (they ended the process without a word).
    Returns the handlers they replace."""
    said = ("the evaluation writes its files at its end: none were written" if command == "eval"
            else "outside a training step (loading, or between runs): what was written before "
                 "is kept whole")

    def handler(signum: int, frame: Any) -> None:
        raise RunStopped(signum, f"stopped by {signal.Signals(signum).name}: {said}")

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in STOP_SIGNALS}  # (the handlers before: put
    # back by the caller, so that one in-process call leaves none behind)


class StopSignals:
    """The stop signal received during a run (0 if none), and the handlers that record it."""

    def __init__(self) -> None:
        self.signum = 0

    @contextlib.contextmanager
    def handlers(self, out_dir: Path, doing: str = "the step in flight") -> Iterator[None]:
        """SIGTERM/SIGUSR1 handlers for the length of a run (main thread only); ``doing``: what
        a second signal abandons."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self.signum:
                raise RunStopped(signum, (
                    f"stopped by a second {signal.Signals(signum).name}: {doing} was "
                    f"abandoned; the checkpoints and metrics already in {out_dir} are kept; "
                    "continue with --resume"))
            self.signum = signum

        self.signum = 0
        old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    @contextlib.contextmanager
    def finishing(self, out_dir: Path) -> Iterator[None]:
        """The writes after the last step (the final model, plots, summary): a stop signal waits
        for them, as one during a step waits for the step, then stops the run; a second one
        abandons them (``--resume`` writes them again)."""
        with self.handlers(out_dir, "writing the final model and summary"):
            yield
        if self.signum:
            raise RunStopped(self.signum, (
                f"stopped by {signal.Signals(self.signum).name} after the last step, once the "
                f"final files in {out_dir} were written: the run is complete"))

    def asked(self) -> int:
        """The signal to stop for, asked on any rank (collective under torchrun), or 0."""
        asked = self.signum
        if dist.is_dist():
            asked = int(dist.all_reduce_sum([float(asked)])[0])
        return (self.signum or signal.SIGTERM) if asked else 0

    def stopped(self, signum: int, step: int, steps: int, path: Path) -> RunStopped:
        return RunStopped(signum, (
            f"stopped by {signal.Signals(signum).name} after step {step} of {steps}: "
            f"checkpoint {path} written, metrics flushed; continue with --resume"))
