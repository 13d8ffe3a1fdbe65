"""open-r1's reward registry (``src/open_r1/rewards.py``, ``get_reward_funcs``; read at its
commit 1416fa0 of 2026-04-02), so its GRPO recipes keep their rewards: ``open-r1:NAME``.

Each function scores as open-r1's does on the same text, parameters and math-verify calls
(tests/test_open_r1.py checks them on values computed by open-r1's own functions). Where open-r1
matches a regex whose lazy parts backtrack on hostile text, the same language is decided in
linear time (``_sections``). Where it calls a remote judge (E2B, Morph, Piston), ``code`` and
``binary_code`` run the answer's last ```` ```python ```` block in grpolab's sandbox on the
row's ``verification_info`` tests; IOI's and Codeforces' judges are refused.

================================  =================================================  ==========
name (parameters)                 score                                              columns
================================  =================================================  ==========
accuracy                          1/0: math-verify on the boxed answer; None where   solution
                                  the gold does not parse (not scored, as in TRL)
format                            1/0: ``<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>``
tag_count                         0.25 for each of the four tags found exactly once
reasoning_steps                   min(1, step markers / 3)
cosine:MINW:MAXW:MINC:MAXC:LEN    cosine in the answer's characters, by correctness  solution
repetition_penalty:N:MAX          MAX x the share of repeated word N-grams
length                            Kimi 1.5: 0.5 - (len - min) / (max - min) over     solution
                                  the step's answers; wrong ones at most 0
code / binary_code                test share / 1 above 0.99, in grpolab's sandbox    verif._info
code_format:LANGUAGE              format, with a ```` ```LANGUAGE ```` block in the   (language)
                                  answer (a row's language column first)
soft_overlong_punishment          (the spec ``overlong:MAX:CACHE``: the same formula)
================================  =================================================  ==========
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from typing import Any

from grpolab.config.open_r1 import LANGUAGE, REWARD_PARAMS, REWARDS
from grpolab.rewards.trl_compat import TRLReward
from grpolab.rewards.verifiers import math_timeout

RewardFn = Callable[..., list[Any]]

# open-r1's GRPOScriptArguments defaults for the parameterised rewards (the recipe's keys':
# min/max wrong, min/max correct, max_len; n-gram size, max (negative) penalty)
COSINE_DEFAULTS = tuple(default for _, default in REWARD_PARAMS["cosine"])
REPETITION_DEFAULTS = tuple(default for _, default in REWARD_PARAMS["repetition_penalty"])
NAMES = tuple(n for n in REWARDS if n != "soft_overlong_punishment")  # (grpolab's overlong:)
REFUSED = {"ioi_code": "IOI's subtasks on a Piston or Morph judge",
           "cf_code": "Codeforces' checkers on a Piston judge"}
_STEPS = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")


def _sections(text: str, start: str, middle: tuple[str, ...], last: str) -> bool:
    """``re.match(start .*? m1 .*? m2 ... .*? last $, text, DOTALL | MULTILINE)``, linearly.

    The lazy gaps match anything, so taking each middle literal at its earliest place leaves
    the most room for the rest; ``last`` must then occur after them with a line end (``$``
    under MULTILINE: the text's end or a newline) right after it."""
    if not text.startswith(start):
        return False
    pos = len(start)
    for literal in middle:
        at = text.find(literal, pos)
        if at < 0:
            return False
        pos = at + len(literal)
    at = text.find(last, pos)
    while at >= 0:
        end = at + len(last)
        if end == len(text) or text[end] == "\n":
            return True
        at = text.find(last, at + 1)
    return False


def _think_answer(text: str) -> bool:
    return _sections(text, "<think>\n", ("\n</think>\n<answer>\n",), "\n</answer>")


def format_reward(completions: list[str], **_: Any) -> list[float]:
    """open-r1's ``format``: the answer opens with ``<think>\\n``, closes the thought with
    ``\\n</think>\\n<answer>\\n`` and the answer with ``\\n</answer>`` at a line's end."""
    return [1.0 if _think_answer(str(c)) else 0.0 for c in completions]


def tag_count_reward(completions: list[str], **_: Any) -> list[float]:
    """open-r1's ``tag_count``: 0.25 for each of ``<think>\\n``, ``\\n</think>\\n``,
    ``\\n<answer>\\n`` and ``\\n</answer>`` that occurs exactly once."""
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return [sum(0.25 for t in tags if str(c).count(t) == 1) for c in completions]


def reasoning_steps_reward(completions: list[str], **_: Any) -> list[float]:
    """open-r1's ``reasoning_steps``: "Step 1:", a leading "1.", bullets and "First," ...
    counted (three or more: 1.0)."""
    return [min(1.0, len(_STEPS.findall(str(c))) / 3) for c in completions]


def _not_equations_notice(record: logging.LogRecord) -> bool:
    return "equations=True" not in record.getMessage()


def _answer_config(boxed: Any) -> list[Any]:
    """The extraction open-r1 applies to answers: LaTeX only, \\boxed first, an anchor needed
    (with its equations=True, whose deprecation notice on every answer is kept quiet)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    quiet = logging.getLogger("latex2sympy2_extended.math_normalization")
    if _not_equations_notice not in quiet.filters:
        quiet.addFilter(_not_equations_notice)

    return [LatexExtractionConfig(
        normalization_config=NormalizationConfig(nits=False, malformed_operators=False,
                                                 basic_latex=True, equations=True, boxed=boxed,
                                                 units=True),
        boxed_match_priority=0, try_extract_without_anchor=False)]


def _correct(content: str, gold: str, timeout: int | None) -> bool | None:
    """Whether the answer verifies against the gold as open-r1's length rewards ask (its
    ``verify(answer, gold)``, the gold parsed as LaTeX); None where the gold does not parse."""
    from math_verify import LatexExtractionConfig, parse, verify

    gold_parsed = parse(gold, extraction_mode="first_match",
                        extraction_config=[LatexExtractionConfig()], parsing_timeout=timeout)
    if not gold_parsed:
        return None
    answer = parse(content, extraction_config=_answer_config(True), extraction_mode="first_match",
                   parsing_timeout=timeout)
    return bool(verify(answer, gold_parsed, timeout_seconds=timeout))


def accuracy_reward(completions: list[str], solution: list[Any], **_: Any) -> list[float | None]:
    """open-r1's ``accuracy``: 1.0 when math-verify finds the answer (a boxed one first) equal
    to the gold ``solution``; None (cannot score: not scored, as in TRL) where the gold
    does not parse or verification fails."""
    from math_verify import parse, verify

    timeout = math_timeout()
    out: list[float | None] = []
    for content, sol in zip(completions, solution):
        gold = parse(str(sol), extraction_mode="first_match", parsing_timeout=timeout)
        if not gold:
            out.append(None)
            continue
        answer = parse(str(content), extraction_config=_answer_config("all"),
                       extraction_mode="first_match", parsing_timeout=timeout)
        try:
            out.append(float(verify(gold, answer, timeout_seconds=timeout)))
        except Exception:  # noqa: BLE001 - open-r1 scores a failed verification None
            out.append(None)
    return out


def cosine_reward(min_wrong: float, max_wrong: float, min_correct: float, max_correct: float,
                  max_len: int) -> RewardFn:
    """open-r1's ``cosine``: a cosine over the answer's length in characters, from
    ``max_correct`` (empty) to ``min_correct`` (``max_len``) when right, from ``min_wrong`` to
    ``max_wrong`` when wrong; 1.0 where the gold does not parse."""

    def cosine_scaled_reward(completions: list[str], solution: list[Any],
                             **_: Any) -> list[float]:
        timeout = math_timeout()
        out = []
        for content, sol in zip(completions, solution):
            right = _correct(str(content), str(sol), timeout)
            if right is None:
                out.append(1.0)
                continue
            cosine = math.cos(len(str(content)) / max_len * math.pi)
            lo, hi = (min_correct, max_correct) if right else (max_wrong, min_wrong)
            out.append(float(lo + 0.5 * (hi - lo) * (1.0 + cosine)))
        return out

    return cosine_scaled_reward


def repetition_reward(ngram: int, max_penalty: float) -> RewardFn:
    """open-r1's ``repetition_penalty`` (English words): ``max_penalty`` x (1 - distinct
    n-grams / n-grams) of the lower-cased, whitespace-split answer; 0 when shorter than one."""
    if max_penalty > 0:
        raise ValueError(f"repetition_penalty's max penalty {max_penalty} must be <= 0")

    def repetition_penalty_reward(completions: list[str], **_: Any) -> list[float]:
        out = []
        for content in map(str, completions):
            words = content.lower().split()
            if len(words) < ngram:
                out.append(0.0)
                continue
            grams = list(zip(*[words[i:] for i in range(ngram)]))
            out.append((1 - len(set(grams)) / len(grams)) * max_penalty)
        return out

    return repetition_penalty_reward


def len_reward(completions: list[str], solution: list[Any], **_: Any) -> list[float]:
    """open-r1's ``length`` (Kimi 1.5): over the answers of one call (TRL's: a process's
    batch; here: the step's), 0.5 - (len - min) / (max - min) in characters, at most 0 when
    wrong; all 0 when every answer has one length; an unparseable gold counts right."""
    timeout = math_timeout()
    lengths = [len(str(c)) for c in completions]
    if not lengths or max(lengths) == min(lengths):
        return [0.0] * len(lengths)
    lo, hi = min(lengths), max(lengths)
    out = []
    for content, sol, n in zip(completions, solution, lengths):
        right = _correct(str(content), str(sol), timeout)
        value = 0.5 - (n - lo) / (hi - lo)
        out.append(float(value if right is None or right else min(0.0, value)))
    return out


def python_blocks(completion: str, language: str = "python") -> str:
    """The last ```` ```LANGUAGE\\n ... ``` ```` block (open-r1's ``extract_code``), else "".
    Found with ``str.find``: the lazy regex is quadratic on many unclosed openings."""
    opening, found, pos = f"```{language}\n", "", 0
    while (at := completion.find(opening, pos)) >= 0:
        close = completion.find("```", at + len(opening))
        if close < 0:
            break
        found, pos = completion[at + len(opening):close], close + 3
    return found


def code_rewards(binary: bool) -> RewardFn:
    """open-r1's ``code`` (the share of tests passed) or ``binary_code`` (1.0 above 0.99): the
    answer's last ```` ```python ```` block, run in grpolab's sandbox on the row's tests."""
    from grpolab.rewards.sandbox import code_reward

    def run(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
        code = [f"```python\n{python_blocks(str(c))}```" for c in completions]
        shares = code_reward(prompts, code, **columns)
        return [float(s > 0.99) for s in shares] if binary else shares

    run.__name__ = "binary_code_reward" if binary else "code_reward"
    return run


def code_format_reward(language: str) -> RewardFn:
    """open-r1's ``code_format``: ``format`` with a ```` ```LANGUAGE ... ``` ```` block inside
    the answer; a row's ``language`` column, where the data has one, names its language (as
    open-r1 reads it: mixed-language data)."""

    def code_format_reward(completions: list[str], **columns: Any) -> list[float]:
        languages = columns.get("language") or [language] * len(completions)
        return [1.0 if _sections(str(c), "<think>\n", ("\n</think>\n<answer>\n",
                                                       f"```{lang}", "```"), "\n</answer>")
                else 0.0 for c, lang in zip(completions, languages)]

    return code_format_reward


def _numbers(spec: str, parts: list[str], defaults: tuple[Any, ...]) -> list[Any]:
    """The spec's parameters as the defaults' types (a whole 1000.0 as an int), finite."""
    if parts and len(parts) != len(defaults):
        raise ValueError(f"reward spec {spec!r}: give all {len(defaults)} parameters or none")
    out = []
    for default, part in zip(defaults, parts or defaults):
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (isinstance(default, int) and not value.is_integer()):
            kind = "whole numbers" if isinstance(default, int) else "finite numbers"
            raise ValueError(f"reward spec {spec!r}: {part!r} is not one of its {kind}")
        out.append(type(default)(value))
    return out


def open_r1_reward(spec: str) -> RewardFn:
    """``open-r1:NAME[:PARAM...]`` as a reward (the table in the module docstring)."""
    name, *parts = spec.split(":")[1:] or [""]
    if name in REFUSED:
        raise ValueError(f"reward spec {spec!r}: open-r1 scores it with {REFUSED[name]}, which "
                         "grpolab does not run (its sandbox runs Python answers: open-r1:code)")
    if name not in NAMES:
        raise ValueError(f"unknown open-r1 reward {spec!r}: expected open-r1: and one of "
                         f"{', '.join(NAMES)} (soft_overlong_punishment: overlong:MAX:CACHE)")
    if parts and name not in REWARD_PARAMS:
        raise ValueError(f"reward spec {spec!r}: open-r1's {name} takes no parameters")
    plain = {"accuracy": accuracy_reward, "format": format_reward, "tag_count": tag_count_reward,
             "reasoning_steps": reasoning_steps_reward, "length": len_reward}
    if name in plain:
        fn = plain[name]
    elif name == "cosine":
        *values, max_len = _numbers(spec, parts, COSINE_DEFAULTS)
        if max_len < 1:
            raise ValueError(f"reward spec {spec!r}: cosine's max_len must be >= 1")
        fn = cosine_reward(*values, max_len)
    elif name == "repetition_penalty":
        n, penalty = _numbers(spec, parts, REPETITION_DEFAULTS)
        if n < 1:
            raise ValueError(f"reward spec {spec!r}: the n-gram size must be >= 1")
        fn = repetition_reward(n, penalty)
    elif name == "code_format":
        language = parts[0] if len(parts) == 1 else "python" if not parts else ""
        if not LANGUAGE.fullmatch(language):
            raise ValueError(f"reward spec {spec!r}: write open-r1:code_format:LANGUAGE")
        fn = code_format_reward(language)
    else:
        fn = code_rewards(name == "binary_code")
    return TRLReward(fn)  # (keywords, None not scored, as TRL calls open-r1's)
