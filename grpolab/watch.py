"""The reward-hacking watch: training reward climbing while a strict held-out check does not.

A policy that games its reward (restating the question to a lenient verifier, padding a format
reward) raises the training reward without getting better at the task. The watch compares two
rises at every evaluation: the training reward's (mean of the last ``window`` steps minus the
mean of the first ``window``) and the strict check's held-out accuracy (now minus at step 0,
greedy answers scored by ``watch_reward``). When the first exceeds the second by ``margin`` the
run is flagged: ``hacking_suspected`` in the metrics and one warning line.
"""

from __future__ import annotations

from collections.abc import Sequence


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
