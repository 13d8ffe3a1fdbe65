"""The no-signal alarm: a step that can teach nothing is said so on the console, with the cause.

GRPO learns only from mixed groups. A step whose groups are all dead (every answer of each
group got the same reward), or whose answers are nearly all cut off by ``max_new_tokens``
(cut-off answers rarely hold a final answer, so they all score the same), has a zero gradient
apart from the KL term: a run can spend its whole budget that way without an error. ``diagnose``
is the pure check; ``NoSignalAlarm`` rate-limits the warnings of a run.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("grpolab")

REPEAT_EVERY = 10  # after the first warning, repeat at most once per this many steps


def diagnose(groups: int, dead: int, all_right: int, all_wrong: int,
             truncated_share: float | None, max_new_tokens: int,
             truncated_threshold: float = 0.9,
             unscored_share: float = 0.0) -> tuple[str, str] | None:
    """(cause, message) when a step has no learning signal, else None.

    ``groups``, ``dead``, ``all_right``, ``all_wrong``: the step's sampled groups and how many
    were dead (all right / all wrong); ``truncated_share``: share of its sampled answers cut off
    at ``max_new_tokens`` (None when the backend does not know). Causes, checked in order:
    "truncated" (share >= ``truncated_threshold``, which above 1 turns off), "all_wrong"
    (every group dead below success_threshold: a reward constant at 0.5 is one), "all_right",
    "polarised" (every group dead, some all right and some all wrong); before them all
    "unscored": every group dead, most answers (``unscored_share`` >= 0.5) scored by no reward
    (each said None). A dead group is all right or all wrong (``dead_stats``), so these cover
    every step whose groups are all dead.
    """
    if groups and dead == groups and unscored_share >= 0.5:
        return "unscored", (
            f"{unscored_share:.0%} of the answers were scored by no reward (each returned None, "
            "TRL's 'cannot score'), and every group is dead. Likely: the rewards do not apply "
            "to these prompts (one that returns None for other tasks' rows), or the rows' gold "
            "answers do not parse")
    cut = (truncated_share is not None and truncated_threshold <= 1.0
           and truncated_share >= truncated_threshold)
    if cut:
        cut_off = (f"{truncated_share:.0%} of the answers hit max_new_tokens={max_new_tokens} "
                   "without finishing")
        if groups and dead == groups:
            why = (f"{cut_off} and every group is dead: cut-off answers rarely contain a final "
                   "answer, so their rewards are equal and the advantages zero")
        else:  # live groups have advantages: say what they can come from, not that none exist
            few = " and from the few answers that finished" if truncated_share < 1 else ""
            why = (f"{cut_off} ({dead}/{groups} groups dead): cut-off answers rarely contain a "
                   f"final answer, so the {groups - dead} live group(s) draw their advantages "
                   f"mostly from rewards that need none (length, format){few}")
        return "truncated", (
            f"{why}. Raise max_new_tokens, or ask for shorter answers (prompt_template / system "
            "prompt); mask_truncated drops them from the loss but does not bring the signal back")
    if not groups or dead < groups:
        return None
    if all_wrong == groups:
        return "all_wrong", (
            f"all {groups} groups are all wrong: the reward never counted an answer right. "
            "Likely: the answers are not in the form the reward parses (check samples.jsonl; "
            "e.g. \\boxed{} vs an 'Answer:' line, answer_sources, the chat template), the task "
            "is too hard for the starting model (easier prompts, a larger group_size, curriculum "
            "or allocate), the temperature is too low to ever find a right answer, or the reward "
            "is constant (it ignores the completion; below success_threshold it counts as wrong)")
    if all_right == groups:
        return "all_right", (
            f"all {groups} groups are all right: every answer gets full reward. Likely: the task "
            "is too easy for the model (harder prompts), or the reward does not read the answer "
            "(it ignores its completions, or compares the wrong column)")
    return "polarised", (
        f"all {groups} groups are dead ({all_right} all right, {all_wrong} all wrong): each "
        "prompt was either always or never solved. Likely: the policy's pass rates sit near "
        "0 and 1 (a larger group_size, curriculum, allocate or dynamic_sampling find the "
        "prompts in between), or a temperature too low to vary the answers")


class NoSignalAlarm:
    """Warns (logger "grpolab", WARNING, prefixed "NO LEARNING SIGNAL", or "LITTLE LEARNING
    SIGNAL" for cut-off answers beside live groups) the first time each cause is found, then
    about that cause at most once every ``REPEAT_EVERY`` steps, whatever the other causes did
    in between (a run whose cause flips between two, say "truncated" and "all_wrong", would
    otherwise warn at every flip)."""

    def __init__(self, truncated_threshold: float = 0.9) -> None:
        self.truncated_threshold = truncated_threshold
        self.last_warned: dict[str, int] = {}  # cause -> the step it was last warned of
        self.steps_without = 0

    def check(self, step: int, groups: int, dead: int, all_right: int, all_wrong: int,
              truncated_share: float | None, max_new_tokens: int, warn: bool = True,
              unscored_share: float = 0.0) -> str | None:
        """The cause (see ``diagnose``) or None; logs the warning when due and ``warn``."""
        found = diagnose(groups, dead, all_right, all_wrong, truncated_share, max_new_tokens,
                         self.truncated_threshold, unscored_share)
        if found is None:
            return None
        cause, message = found
        self.steps_without += 1
        last = self.last_warned.get(cause)
        # (kept on every rank, so that any rank's state resumes as rank 0 would)
        if last is None or step - last >= REPEAT_EVERY:
            if warn:  # (live groups beside cut-off answers: some signal, mostly not the task's)
                banner = "NO LEARNING SIGNAL" if dead == groups else "LITTLE LEARNING SIGNAL"
                log.warning("%s at step %d (%d step(s) so far): %s", banner, step,
                            self.steps_without, message)
            self.last_warned[cause] = step
        return cause

    def state_dict(self) -> dict[str, Any]:
        """What decides the next warning, so a resumed run warns as an uninterrupted one."""
        return {"last_warned": dict(self.last_warned), "steps_without": self.steps_without}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        warned = state.get("last_warned")
        if warned is None and state.get("last_cause") is not None:  # a checkpoint of before
            warned = {state["last_cause"]: state["last_step"]}  # (it kept the last cause only)
        self.last_warned = {str(k): int(v) for k, v in (warned or {}).items()}
        self.steps_without = int(state.get("steps_without", 0))
