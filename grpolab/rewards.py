"""Reward functions and a scorer that never lets one bad reward crash a training run.

A reward function is a plain callable ``(prompts, completions, **columns) -> list[float]``
(TRL's ``reward_funcs`` convention): ``columns`` holds extra dataset columns, each a list
aligned with ``completions`` (e.g. ``answer=[...]``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

RewardFn = Callable[..., Sequence[Any]]

logger = logging.getLogger("grpolab.rewards")

THINK_ANSWER_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"

# math-verify's default timeouts use signal.alarm, which only works in the main thread.
MATH_TIMEOUT_SECONDS = 5
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


# --------------------------------------------------------------------------- built-ins


def exact_answer(
    prompts: list[Any], completions: list[str], answer: list[Any], **_: Any
) -> list[float]:
    """1.0 when the stripped completion equals the stripped gold answer (arithmetic world)."""
    return [1.0 if str(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def _math_timeout() -> int | None:
    """Signal-based timeouts only work in the main thread; elsewhere run without them."""
    on_main = threading.current_thread() is threading.main_thread()
    return MATH_TIMEOUT_SECONDS if on_main else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None) -> tuple[Any, ...]:
    """Parse a gold answer once: in GRPO every group repeats the same gold G times."""
    from math_verify import parse

    text = gold if ("$" in gold or "\\boxed" in gold) else f"${gold}$"
    parsed = parse(text, parsing_timeout=timeout)
    if not parsed:  # e.g. plain words: let math-verify try without the LaTeX wrapper
        parsed = parse(gold, parsing_timeout=timeout)
    return tuple(parsed)


def _math_score(completion: str, gold: str, timeout: int | None) -> float:
    from math_verify import parse, verify

    gold_parsed = _parse_gold(gold.strip(), timeout)
    if not gold_parsed:
        return 0.0
    # math-verify does not look inside <answer> tags; the last tagged answer is the final one.
    tagged = _ANSWER_TAG.findall(completion)
    text = tagged[-1] if tagged else completion
    pred = parse(text, parsing_timeout=timeout)
    if not pred:
        return 0.0
    return 1.0 if verify(list(gold_parsed), pred, timeout_seconds=timeout) else 0.0


def math_answer(
    prompts: list[Any], completions: list[str], answer: list[Any], **_: Any
) -> list[float]:
    """1.0 when math-verify judges the completion's final answer equal to the gold answer.

    Handles ``\\boxed{}``, plain numbers and ``<answer>...</answer>`` tags. Uses math-verify's
    signal timeouts on the main thread and none elsewhere (signals are main-thread only).
    """
    timeout = _math_timeout()
    out = []
    for completion, gold in zip(completions, answer):
        if gold is None:
            out.append(0.0)
        else:
            out.append(_math_score(str(completion), str(gold), timeout))
    return out


def format_reward(pattern: str = THINK_ANSWER_PATTERN) -> RewardFn:
    """Build a reward that is 1.0 when the whole stripped completion matches ``pattern``."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"format pattern {pattern!r} is not a valid regex: {e}") from e

    def format_reward(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
        return [1.0 if compiled.fullmatch(str(c).strip()) else 0.0 for c in completions]

    format_reward.pattern = pattern  # type: ignore[attr-defined]
    return format_reward


# --------------------------------------------------------------------------- loading

BUILTIN_REWARDS = ("exact", "math", "format")


def _import_module(spec: str, modname: str) -> Any:
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as e:
        # Console scripts do not put the cwd on sys.path; users expect `my_rewards:fn` to work.
        if e.name and modname.split(".")[0] == e.name.split(".")[0] and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
            return _import_module(spec, modname)
        if e.name and (modname == e.name or modname.startswith(e.name + ".")):
            raise ValueError(f"reward spec {spec!r}: module {modname!r} not found") from e
        raise ValueError(f"reward spec {spec!r}: importing {modname!r} failed: {_error(e)}") from e
    except Exception as e:
        raise ValueError(f"reward spec {spec!r}: importing {modname!r} failed: {_error(e)}") from e


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
    except Exception as e:
        del sys.modules[modname]
        raise ValueError(f"reward spec {spec!r}: executing {path!r} failed: {_error(e)}") from e
    return module


def load_reward(spec: str, format_pattern: str | None = None) -> RewardFn:
    """Resolve a reward spec to a callable.

    ``spec`` is a built-in name (``exact``, ``math``, ``format``), ``pkg.module:function``,
    ``pkg.module.function`` or ``path/to/file.py:function``. Failures are one-line ValueErrors
    so the CLI can show them without a traceback.
    """
    spec = spec.strip()
    if spec == "exact":
        return exact_answer
    if spec == "math":
        return math_answer
    if spec == "format":
        return format_reward(format_pattern or THINK_ANSWER_PATTERN)

    if spec.endswith(".py") and ":" not in spec:
        raise ValueError(f"reward spec {spec!r}: name the function too, as 'file.py:function'")
    if ":" in spec:
        where, _, attr = spec.rpartition(":")
    elif "." in spec:
        where, _, attr = spec.rpartition(".")
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
        if not hasattr(obj, part):
            raise ValueError(f"reward spec {spec!r}: {where!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):  # ValueError, not TypeError: the CLI reports every bad spec alike
        msg = f"reward spec {spec!r}: {attr!r} is a {type(obj).__name__}, not callable"
        raise ValueError(msg)  # noqa: TRY004
    return obj


# --------------------------------------------------------------------------- scoring


@dataclass
class ScoreResult:
    """Scores for one batch: weighted total, per-function scores and what went wrong."""

    total: torch.Tensor  # float32 [B]
    per_fn: torch.Tensor  # float32 [B, K]
    names: list[str]
    problems: list[str]

    def success(self, threshold: float) -> torch.Tensor:
        """Which answers are right: the first reward (the verifier) >= ``threshold``.

        Not the weighted total: with [correctness, format] rewards a well-formatted wrong answer
        can reach the threshold, and accuracy would count it.
        """
        return self.per_fn[:, 0] >= threshold


def reward_name(fn: Any) -> str:
    """Human-readable name for logs and metrics (functions, partials, callable objects)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _short(obj: Any, limit: int = 80) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _to_float(value: Any) -> float | None:
    """A finite float, or None when the value is missing, non-numeric or non-finite."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return out if math.isfinite(out) else None


def _as_list(value: Any) -> list[Any] | None:
    if value is None or isinstance(value, (str, bytes, dict)):
        return None
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist() if value.dim() == 1 else None
    try:
        return list(value)
    except TypeError:
        return None


_LOGGED: set[str] = set()
_REPORTED = object()  # per-sample failure that already has a problem message


def _log_once(message: str) -> None:
    """Warn once per distinct problem so a bad reward does not flood every step's log."""
    if message in _LOGGED:
        return
    if len(_LOGGED) > 10_000:
        _LOGGED.clear()
    _LOGGED.add(message)
    logger.warning(message)


def _score_one_fn(
    fn: RewardFn,
    name: str,
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, list[Any]],
    on_error: float,
    problems: list[str],
) -> list[float]:
    n = len(completions)
    if n == 0:
        return []

    def where(i: int) -> str:
        return f"sample {i} (prompt={_short(prompts[i])}, completion={_short(completions[i])})"

    try:
        raw = fn(prompts, completions, **columns)
    except Exception as e:  # noqa: BLE001 - reward code is user code; isolate it
        values = _score_singly(fn, name, prompts, completions, columns, problems, where)
        if all(v is not _REPORTED for v in values):
            problems.append(
                f"reward {name!r} raised {_error(e)} on the batch of {n} but on no single "
                "sample; used per-sample scores"
            )
    else:
        values = _as_list(raw)
        if values is None or len(values) != n:
            # No way to tell which value belongs to which sample: the whole batch is suspect.
            got = _short(raw, 40) if values is None else f"{len(values)} values"
            problems.append(
                f"reward {name!r} returned {got} for {n} samples (expected a list of {n} "
                f"numbers); samples 0..{n - 1} get on_error={on_error}"
            )
            return [on_error] * n

    out = []
    for i, value in enumerate(values):
        number = None if value is _REPORTED else _to_float(value)
        if number is None:
            if value is not _REPORTED:
                problems.append(f"reward {name!r} returned {_short(value, 40)} on {where(i)}")
            out.append(on_error)
        else:
            out.append(number)
    return out


def _score_singly(
    fn: RewardFn,
    name: str,
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, list[Any]],
    problems: list[str],
    where: Callable[[int], str],
) -> list[Any]:
    """Re-run a failing reward one sample at a time so only the culprits are penalised."""
    values: list[Any] = []
    for i in range(len(completions)):
        one_cols = {key: [col[i]] for key, col in columns.items()}
        try:
            single = _as_list(fn([prompts[i]], [completions[i]], **one_cols))
        except Exception as e:  # noqa: BLE001
            problems.append(f"reward {name!r} raised {_error(e)} on {where(i)}")
            values.append(_REPORTED)
            continue
        if single is None or len(single) != 1:
            got = "a non-list" if single is None else f"{len(single)} values"
            problems.append(f"reward {name!r} returned {got} for 1 sample on {where(i)}")
            values.append(_REPORTED)
        else:
            values.append(single[0])
    return values


def _error(e: BaseException, limit: int = 160) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def row_columns(rows: list[dict]) -> dict[str, list]:
    """Every field of the rows but the prompt, as the columns rewards receive (answer=[...])."""
    keys = [k for k in rows[0] if k != "prompt"] if rows else []
    return {k: [r.get(k) for r in rows] for k in keys}


def score(
    reward_fns: Sequence[RewardFn],
    prompts: Sequence[Any],
    completions: Sequence[str],
    columns: dict[str, Sequence[Any]] | None = None,
    weights: Sequence[float] | None = None,
    on_error: float = 0.0,
) -> ScoreResult:
    """Run every reward function on a batch, isolating failures to the samples that caused them.

    A function that raises is re-run one sample at a time; samples that still raise, and
    values that are None/NaN/inf/non-numeric, get ``on_error`` and a problem message. Raises
    only for caller mistakes (mismatched lengths or weights), never for reward failures.
    """
    prompts, completions = list(prompts), list(completions)
    cols = {k: list(v) for k, v in (columns or {}).items()}
    n, k = len(completions), len(reward_fns)
    if len(prompts) != n:
        raise ValueError(f"score: {len(prompts)} prompts but {n} completions")
    for key, col in cols.items():
        if len(col) != n:
            raise ValueError(f"score: column {key!r} has {len(col)} values for {n} completions")
    w = [1.0] * k if weights is None else [float(x) for x in weights]
    if len(w) != k:
        raise ValueError(f"score: {len(w)} weights for {k} reward functions")

    names = _unique([reward_name(fn) for fn in reward_fns])
    problems: list[str] = []
    per_fn = torch.zeros(n, k, dtype=torch.float32)
    for j, (fn, name) in enumerate(zip(reward_fns, names)):
        vals = _score_one_fn(fn, name, prompts, completions, cols, on_error, problems)
        per_fn[:, j] = torch.tensor(vals, dtype=torch.float32)
    for message in problems:
        _log_once(message)
    total = per_fn @ torch.tensor(w, dtype=torch.float32) if k else torch.zeros(n)
    return ScoreResult(total=total, per_fn=per_fn, names=names, problems=problems)


def _unique(names: list[str]) -> list[str]:
    """Suffix duplicates (two format rewards, say) so metric names stay distinct."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out
