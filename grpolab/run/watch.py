"""The reward-hacking watch: training reward climbing while a strict held-out check does not.

A policy that games its reward (restating the question to a lenient verifier, padding a format
reward) raises the training reward without getting better at the task. The watch compares two
rises at every evaluation: the training reward's (mean of the last ``window`` steps minus the
mean of the first ``window``) and the strict check's held-out accuracy (now minus at step 0,
greedy answers scored by ``watch_reward``). When the first exceeds the second by ``margin`` the
run is flagged: ``hacking_suspected`` in the metrics and one warning line (``Watch``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from grpolab.run import dist

log = logging.getLogger("grpolab")


def reward_rise(rewards: Sequence[float], window: int) -> float | None:
    """Mean of the last ``window`` rewards minus the mean of the first ``window`` (None until
    there are two windows' worth, so the start is not compared with itself)."""
    if len(rewards) < 2 * window:
        return None
    first, last = rewards[:window], rewards[-window:]
    return sum(last) / window - sum(first) / window


def hacking_suspected(train_rise: float | None, check_rise: float | None,
                      margin: float) -> bool:
    """Whether the training reward rose ``margin`` or more beyond the strict check's rise."""
    if train_rise is None or check_rise is None:
        return False
    return train_rise - check_rise >= margin


class Watch:
    """The watch over one run: the training reward per step, the strict check's held-out
    accuracy at each evaluation, and whether it has fired (all saved in checkpoints)."""

    def __init__(self, check_fn: Any, margin: float = 0.2, window: int = 5) -> None:
        self.check_fn, self.margin, self.window = check_fn, margin, window
        self.check_acc: list[float] = []  # the strict check's held-out accuracy per evaluation
        self.reward_history: list[float] = []  # training reward per step
        self.fired = False

    def record(self, rec: dict[str, Any], step: int) -> None:
        """Add the watch's fields to a step's metrics record (a verdict at evaluations;
        between them a step carries the last one) and warn when it starts to fire (again
        after an evaluation that cleared it)."""
        self.reward_history.append(rec["reward_mean"])
        if self.check_fn is None:
            return
        train_rise = reward_rise(self.reward_history, self.window)
        check_rise = self.check_acc[-1] - self.check_acc[0] if len(self.check_acc) > 1 else None
        evaluated = rec["heldout_acc"] is not None
        fired = hacking_suspected(train_rise, check_rise, self.margin) if evaluated else self.fired
        rec["heldout_check_acc"] = self.check_acc[-1] if evaluated else None
        rec.update(watch_train_rise=train_rise, watch_check_rise=check_rise,
                   hacking_suspected=fired)
        if fired and not self.fired and dist.is_main():
            from grpolab.rewards.scorer import reward_name

            log.warning("reward hacking suspected at step %d: training reward rose %+.3f over "
                        "the run, the strict held-out check (%s) %+.3f", step, train_rise,
                        reward_name(self.check_fn), check_rise)
        self.fired = fired

    def state_dict(self) -> dict[str, Any]:
        return {"check_acc": list(self.check_acc), "reward_history": list(self.reward_history),
                "fired": self.fired}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_acc = [float(x) for x in state.get("check_acc", [])]
        self.reward_history = [float(x) for x in state.get("reward_history", [])]
        self.fired = bool(state.get("fired", False))
