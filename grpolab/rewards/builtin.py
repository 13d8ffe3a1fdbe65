"""Reward functions, and ``load_reward``, which turns a reward spec into one.

A reward function is a plain callable ``(prompts, completions, **columns) -> list[float]``
(TRL's ``reward_funcs`` convention): ``columns`` holds extra dataset columns, each a list
aligned with ``completions`` (e.g. ``answer=[...]``). Running them on a batch, safely, is
``grpolab.rewards.scorer``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grpolab.rewards import verifiers
from grpolab.rewards.pool import error_text

RewardFn = Callable[..., Sequence[Any]]

# A reward beyond this size is an error: its square overflows the float32 advantage maths.
REWARD_LIMIT = 1e9

logger = logging.getLogger("grpolab.rewards.builtin")

THINK_ANSWER_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


# --------------------------------------------------------------------------- built-ins


def exact_answer(
    prompts: list[Any], completions: list[str], answer: list[Any], **_: Any
) -> list[float]:
    """1.0 when the stripped completion equals the stripped gold answer (arithmetic world)."""
    return [1.0 if str(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def _lenient_score(completion: str, gold: str, timeout: int | None) -> float:
    from math_verify import parse, verify

    gold_parsed = verifiers.parse_math(gold.strip(), timeout)
    if not gold_parsed:
        return 0.0
    tagged = _ANSWER_TAG.findall(completion)
    text = tagged[-1] if tagged else completion
    pred = parse(text, parsing_timeout=timeout)
    if not pred:
        return 0.0
    return 1.0 if verify(list(gold_parsed), pred, timeout_seconds=timeout) else 0.0


def math_lenient(
    prompts: list[Any], completions: list[str], answer: list[Any], **_: Any
) -> list[float]:
    """math-verify's own answer finding over the whole completion: GAMEABLE, for demonstrations.

    It pays "To solve 62 + 82, we ..." for the gold 144 (it evaluates the restated question);
    kept to show the reward-hacking watch catching exactly that. Train with ``math``.
    """
    timeout = verifiers.math_timeout()
    return [0.0 if gold is None else _lenient_score(str(c), str(gold), timeout)
            for c, gold in zip(completions, answer)]


def math_reward(sources: Sequence[str] = verifiers.SOURCES) -> RewardFn:
    """Build the strict ``math`` reward: 1.0 when the completion's one final answer equals the
    gold answer (see ``grpolab.rewards.verifiers`` for the rule), else 0.0."""
    unknown = [s for s in sources if s not in verifiers.SOURCES]
    if unknown or not sources:
        raise ValueError(f"answer_sources {list(sources)!r}: choose from "
                         f"{', '.join(verifiers.SOURCES)}")
    sources = tuple(sources)

    def math_answer(prompts: list[Any], completions: list[str], answer: list[Any],
                    **_: Any) -> list[float]:
        timeout = verifiers.math_timeout()
        asked = prompts if prompts and len(prompts) == len(completions) else [""] * len(completions)
        return [0.0 if gold is None else float(verifiers.judge(verifiers.final_answer(
                    str(c), sources, verifiers.prompt_text(p)), str(gold), timeout))
                for p, c, gold in zip(asked, completions, answer)]

    return math_answer


math_answer = math_reward()


def think_answer_format(text: str) -> bool:
    """``re.fullmatch(THINK_ANSWER_PATTERN, text, re.DOTALL)`` in linear time.

    The regex backtracks: with many ``</think><answer>`` pairs and no final ``</answer>`` it
    takes quadratic time (41 s on a 320 KB completion). Its lazy ``.*?`` parts match anything,
    so the text matches iff it starts with ``<think>``, ends with ``</answer>``, and somewhere
    after the opening tag a ``</think>``, whitespace and ``<answer>`` end before that final
    ``</answer>``; the first such ``</think>`` gives the earliest ``<answer>``, so it decides.
    """
    if not (text.startswith("<think>") and text.endswith("</answer>")):
        return False
    end = len(text) - len("</answer>")
    k = text.find("</think>", len("<think>"))
    while k != -1:
        m = k + len("</think>")
        while m < len(text) and text[m].isspace():
            m += 1
        if text.startswith("<answer>", m):
            return m + len("<answer>") <= end
        k = text.find("</think>", k + 1)
    return False


def format_reward(pattern: str = THINK_ANSWER_PATTERN) -> RewardFn:
    """Build a reward that is 1.0 when the whole stripped completion matches ``pattern``.

    The default pattern is checked in linear time (``think_answer_format``). Another pattern
    runs as a regex, whose time on some inputs can grow fast, so that reward is marked to run
    in a reward worker with the timeout (``in_process = False``).
    """
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"format pattern {pattern!r} is not a valid regex: {e}") from e
    linear = pattern == THINK_ANSWER_PATTERN

    def format_reward(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
        if linear:
            return [1.0 if think_answer_format(str(c).strip()) else 0.0 for c in completions]
        return [1.0 if compiled.fullmatch(str(c).strip()) else 0.0 for c in completions]

    format_reward.pattern = pattern  # type: ignore[attr-defined]
    format_reward.in_process = linear  # type: ignore[attr-defined]
    return format_reward


# --------------------------------------------------------------------------- loading


def _import_module(spec: str, modname: str) -> Any:
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as e:
        # Console scripts do not put the working directory on sys.path, and users expect
        # `my_rewards:fn` to work. It goes LAST: first, a stray `math_verify.py` there would
        # shadow the installed package and run in its place.
        cwd = os.getcwd()
        if e.name and modname.split(".")[0] == e.name.split(".")[0] and cwd not in sys.path:
            sys.path.append(cwd)
            return _import_module(spec, modname)
        if e.name and (modname == e.name or modname.startswith(e.name + ".")):
            raise ValueError(f"reward spec {spec!r}: module {modname!r} not found") from e
        raise ValueError(f"reward spec {spec!r}: importing {modname!r} failed: {error_text(e)}") from e
    except (Exception, SystemExit) as e:
        raise ValueError(f"reward spec {spec!r}: importing {modname!r} failed: {error_text(e)}") from e


def _import_file(spec: str, path: str) -> Any:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ValueError(f"reward spec {spec!r}: file {path!r} not found")
    modname = f"grpolab_user_rewards.{file.stem}_{abs(hash(str(file))):x}"
    if modname in sys.modules:
        return sys.modules[modname]
    mod_spec = importlib.util.spec_from_file_location(modname, file)
    if mod_spec is None or mod_spec.loader is None:
        raise ValueError(f"reward spec {spec!r}: cannot import file {path!r}")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[modname] = module  # needed for pickling and dataclasses inside the file
    try:
        mod_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # (an exit() at import ended grpolab without a word)
        del sys.modules[modname]
        raise ValueError(f"reward spec {spec!r}: executing {path!r} failed: {error_text(e)}") from e
    return module


def overlong_punishment(max_len: int, buffer: int) -> RewardFn:
    """DAPO's soft overlong punishment (its Eq. 13; TRL's ``get_soft_overlong_punishment``,
    verl's ``overlong_buffer``): 0 up to ``max_len - buffer`` tokens (EOS included), then a
    linear fall to -1 at ``max_len``; -1 beyond."""
    edge = max_len - buffer

    def overlong(prompts: list, completions: list, completion_ids: list[list[int]],
                 **_: Any) -> list[float]:
        return [0.0 if len(ids) <= edge else -1.0 if len(ids) > max_len
                else (edge - len(ids)) / buffer for ids in completion_ids]

    return overlong


def _overlong(spec: str, max_new_tokens: int | None) -> RewardFn:
    """``overlong:BUFFER`` (its length limit: max_new_tokens) or ``overlong:MAX:BUFFER``."""
    parts = spec.split(":")[1:]
    try:
        nums = [int(x) for x in parts]
    except ValueError:
        nums = []
    if len(nums) == 1:  # (the length limit: the run's)
        nums = [max_new_tokens or 0, *nums]
    limit, buffer = nums if len(nums) == 2 else (0, 0)
    if not (0 < buffer <= limit or (buffer == 0 < limit and len(parts) == 2)):
        raise ValueError(f"reward spec {spec!r}: write overlong:BUFFER (its length limit "
                         f"max_new_tokens, {max_new_tokens}) or overlong:MAX:BUFFER, 0 < BUFFER "
                         "<= MAX tokens (MAX:0: -1 past MAX only, open-r1's soft_punish_cache 0)")
    return overlong_punishment(limit, buffer)


# a question's tests, in a sandbox (rewards.sandbox; open-r1's: rewards.open_r1)
CODE_REWARDS = ("code", "code_all", "open-r1:code", "open-r1:binary_code")
BUILTIN_REWARDS = ("exact", "math", "math_lenient", "format", "reasoning_gym", "code",
                   "code_all", "overlong:BUFFER", "open-r1:NAME")


def load_reward(spec: str, format_pattern: str | None = None,
                answer_sources: Sequence[str] | None = None,
                max_new_tokens: int | None = None) -> RewardFn:
    """Resolve a reward spec to a callable.

    ``spec`` is a built-in name (``BUILTIN_REWARDS``), ``pkg.module:function``,
    ``pkg.module.function`` or ``path/to/file.py:function``. Failures are one-line ValueErrors
    so the CLI can show them without a traceback. ``answer_sources`` narrows where the strict
    ``math`` and ``reasoning_gym`` rewards look for the final answer (``verifiers.SOURCES``).
    """
    spec = spec.strip()
    if spec.startswith(("verl:", "verl-batch:")):  # verl's signature (rewards.verl_compat)
        from grpolab.rewards.verl_compat import adapt_verl

        batch = spec.startswith("verl-batch:")
        return adapt_verl(_load_callable(spec, spec.split(":", 1)[1]), batch)
    if spec.startswith("rm:"):  # a local Hugging Face sequence-classification reward model
        from grpolab.rewards.reward_models import load_reward_model

        return load_reward_model(spec[3:])
    sources = tuple(answer_sources) if answer_sources else verifiers.SOURCES
    if spec == "exact":
        return exact_answer
    if spec == "math":
        return math_answer if sources == verifiers.SOURCES else math_reward(sources)
    if spec == "math_lenient":
        return math_lenient
    if spec == "format":
        return format_reward(format_pattern or THINK_ANSWER_PATTERN)
    if spec == "overlong" or spec.startswith("overlong:"):
        return _overlong(spec, max_new_tokens)
    if spec == "reasoning_gym":
        from grpolab.data.tasks import task_reward

        return task_reward(sources)
    if spec.startswith("open-r1:"):  # open-r1's reward registry, for its recipes
        from grpolab.rewards.open_r1 import open_r1_reward

        return open_r1_reward(spec)

    if spec in ("code", "code_all"):
        from grpolab.rewards.sandbox import code_all_reward, code_reward

        return code_reward if spec == "code" else code_all_reward

    from grpolab.rewards.trl_compat import (
        adapt,  # TRL reward hook: keywords, None, chat completions
    )

    return adapt(_load_callable(spec, spec))


def _load_callable(spec: str, where_fn: str) -> Any:
    """The function ``where_fn`` names (``pkg.module:function``, ``pkg.module.function`` or
    ``path/to/file.py:function``); one-line ValueErrors naming ``spec``."""
    if where_fn.endswith(".py") and ":" not in where_fn:
        raise ValueError(f"reward spec {spec!r}: name the function too, as 'file.py:function'")
    if ":" in where_fn:
        where, _, attr = where_fn.rpartition(":")
    elif "." in where_fn:
        where, _, attr = where_fn.rpartition(".")
    else:
        raise ValueError(
            f"unknown reward {spec!r}: expected one of {', '.join(BUILTIN_REWARDS)}, "
            "'module:function' or 'file.py:function'"
        )
    if not where or not attr:
        raise ValueError(f"reward spec {spec!r}: expected 'module:function' or 'file.py:function'")

    is_file = where.endswith(".py") or "/" in where or os.sep in where
    module = _import_file(spec, where) if is_file else _import_module(spec, where)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part) and where == "grpolab.app.api":  # (a run's config.json)
            raise ValueError(f"reward {attr.split('.')[-1]!r} was a Python callable given to "
                             "grpolab.train: continue the run from Python, with it given again")
        if not hasattr(obj, part):
            raise ValueError(f"reward spec {spec!r}: {where!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):  # ValueError, not TypeError: the CLI reports every bad spec alike
        msg = f"reward spec {spec!r}: {attr!r} is a {type(obj).__name__}, not callable"
        raise ValueError(msg)  # noqa: TRY004
    return obj
