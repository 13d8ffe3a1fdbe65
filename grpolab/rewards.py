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

from . import verifiers
from .reward_pool import RewardPool, await_if_needed, error_text

RewardFn = Callable[..., Sequence[Any]]

# A reward beyond this size is an error: its square overflows the float32 advantage maths.
REWARD_LIMIT = 1e9

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
    timeout = _math_timeout()
    return [0.0 if gold is None else _lenient_score(str(c), str(gold), timeout)
            for c, gold in zip(completions, answer)]


def math_reward(sources: Sequence[str] = verifiers.SOURCES) -> RewardFn:
    """Build the strict ``math`` reward: 1.0 when the completion's one final answer equals the
    gold answer (see ``grpolab.verifiers`` for the rule), else 0.0."""
    unknown = [s for s in sources if s not in verifiers.SOURCES]
    if unknown or not sources:
        raise ValueError(f"answer_sources {list(sources)!r}: choose from "
                         f"{', '.join(verifiers.SOURCES)}")
    sources = tuple(sources)

    def math_answer(prompts: list[Any], completions: list[str], answer: list[Any],
                    **_: Any) -> list[float]:
        timeout = _math_timeout()
        return [0.0 if gold is None else
                float(verifiers.judge(verifiers.final_answer(str(c), sources), str(gold), timeout))
                for c, gold in zip(completions, answer)]

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


BUILTIN_REWARDS = ("exact", "math", "math_lenient", "format", "reasoning_gym", "code")


def load_reward(spec: str, format_pattern: str | None = None,
                answer_sources: Sequence[str] | None = None) -> RewardFn:
    """Resolve a reward spec to a callable.

    ``spec`` is a built-in name (``BUILTIN_REWARDS``), ``pkg.module:function``,
    ``pkg.module.function`` or ``path/to/file.py:function``. Failures are one-line ValueErrors
    so the CLI can show them without a traceback. ``answer_sources`` narrows where the strict
    ``math`` and ``reasoning_gym`` rewards look for the final answer (``verifiers.SOURCES``).
    """
    spec = spec.strip()
    if spec.startswith("rm:"):  # a local Hugging Face sequence-classification reward model
        from .reward_models import load_reward_model

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
    if spec == "reasoning_gym":
        from .tasks import task_reward

        return task_reward(sources)

    if spec == "code":  # a coding question's tests, run in a sandbox (grpolab.sandbox)
        from .sandbox import code_reward

        return code_reward

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
    """A finite float within +-REWARD_LIMIT, or None when the value is missing, non-numeric,
    non-finite or so large that float32 advantages would overflow (1e39 is inf in float32)."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None
    return out if math.isfinite(out) and abs(out) <= REWARD_LIMIT else None


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
_REPORTED = object()  # a bad value for one sample that already has a problem message


class _Failed:
    """The call failed for one sample (raised, timed out, ended its process)."""

    def __init__(self, message: str) -> None:
        self.message = message


def _log_once(message: str) -> None:
    """Warn once per distinct problem so a bad reward does not flood every step's log."""
    if message in _LOGGED:
        return
    if len(_LOGGED) > 10_000:
        _LOGGED.clear()
    _LOGGED.add(message)
    logger.warning(message)


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


def _score_one_fn(
    fn: RewardFn,
    name: str,
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, list[Any]],
    on_error: float,
    problems: list[str],
    pool: RewardPool | None = None,
    group: int = 1,
) -> tuple[list[float], int, str]:
    """This function's score for every sample, how many samples its calls failed on, and the
    first such failure's message."""
    n = len(completions)
    if n == 0:
        return [], 0, ""

    def where(i: int) -> str:
        return f"sample {i} (prompt={_short(prompts[i])}, completion={_short(completions[i])})"

    if pool is not None and pool.index(fn) is not None and not runs_in_process(fn):
        values = _score_in_pool(fn, name, prompts, completions, columns, problems, where, pool,
                                group, on_error)
    else:
        try:
            raw = await_if_needed(fn(prompts, completions, **columns))
        except (Exception, SystemExit) as e:  # noqa: BLE001 - reward code is user code
            values = _score_singly(fn, name, prompts, completions, columns, problems, where)
            if all(v is not _REPORTED and not isinstance(v, _Failed) for v in values):
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
                return [on_error] * n, 0, ""

    failures = [v.message for v in values if isinstance(v, _Failed)]
    out = []
    for i, value in enumerate(values):
        bad = value is _REPORTED or isinstance(value, _Failed)
        number = None if bad else _to_float(value)
        if number is None:
            if not bad:
                problems.append(f"reward {name!r} returned {_short(value, 40)} on {where(i)}")
            out.append(on_error)
        else:
            out.append(number)
    return out, len(failures), failures[0] if failures else ""


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
            single = _as_list(await_if_needed(fn([prompts[i]], [completions[i]], **one_cols)))
        except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit() cannot end the run
            problems.append(f"reward {name!r} raised {_error(e)} on {where(i)}")
            values.append(_Failed(problems[-1]))
            continue
        values.append(_single(single, name, where(i), problems))
    return values


def _parts(n: int, group: int, count: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges splitting n answers into at most ``count`` parts of whole groups."""
    groups = -(-n // max(1, group))
    per = -(-groups // max(1, min(count, groups))) * max(1, group)
    return [(lo, min(lo + per, n)) for lo in range(0, n, per)]


def _score_in_pool(
    fn: RewardFn,
    name: str,
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, list[Any]],
    problems: list[str],
    where: Callable[[int], str],
    pool: RewardPool,
    group: int,
    on_error: float,
) -> list[Any]:
    """The batch in parts of whole groups, one call per part, parts in parallel in the pool.

    A reward sees whole groups (group-relative rewards work), as under TRL with several
    processes. A part whose call raises or is stopped is scored again one answer at a time,
    in parallel, so only the culprits fail; when every part was stopped (timed out or killed
    its worker) the reward itself is stuck, and its answers fail without a second wait.
    """
    def call(lo: int, hi: int) -> Any:
        return ((prompts[lo:hi], completions[lo:hi]), {k: c[lo:hi] for k, c in columns.items()})

    parts = _parts(len(completions), group, pool.size)
    outcomes = pool.map(fn, [call(lo, hi) for lo, hi in parts])
    stuck = all(kind in ("timeout", "died") for kind, _ in outcomes)
    values: list[Any] = [None] * len(completions)
    retry: list[int] = []
    first = ""
    for (lo, hi), (kind, value) in zip(parts, outcomes):
        got = _as_list(value) if kind == "ok" else None
        if kind == "ok" and got is not None and len(got) == hi - lo:
            values[lo:hi] = got
        elif kind == "ok":
            shown = _short(value, 40) if got is None else f"{len(got)} values"
            problems.append(f"reward {name!r} returned {shown} for samples {lo}..{hi - 1} "
                            f"(expected a list of {hi - lo} numbers); they get on_error="
                            f"{on_error}")
            values[lo:hi] = [_REPORTED] * (hi - lo)
        elif stuck or hi - lo == 1:  # (a one-answer part is already isolated)
            for i in range(lo, hi):
                problems.append(f"reward {name!r} {value} on {where(i)}")
                values[i] = _Failed(problems[-1])
        else:
            first = first or f"{value} on samples {lo}..{hi - 1}"
            retry.extend(range(lo, hi))
    singles = pool.map(fn, [call(i, i + 1) for i in retry])
    for i, (kind, value) in zip(retry, singles):
        if kind != "ok":
            problems.append(f"reward {name!r} {value} on {where(i)}")
            values[i] = _Failed(problems[-1])
        else:
            values[i] = _single(_as_list(value), name, where(i), problems)
    if retry and not any(isinstance(values[i], _Failed) or values[i] is _REPORTED
                         for i in retry):
        problems.append(f"reward {name!r} {first} but on no single one; used per-answer scores")
    return values


def _single(values: list[Any] | None, name: str, where: str, problems: list[str]) -> Any:
    """The one value of a one-sample call, or _REPORTED (with a problem) when it is not one."""
    if values is None or len(values) != 1:
        got = "a non-list" if values is None else f"{len(values)} values"
        problems.append(f"reward {name!r} returned {got} for 1 sample on {where}")
        return _REPORTED
    return values[0]


_error = error_text


class RewardError(ValueError):
    """A reward function failed on every answer of a batch: almost surely the function (its
    signature, a missing package), not the answers. One line; the CLI exits with 2."""


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
    pool: RewardPool | None = None,
    fail_on_all_errors: bool = False,
    group_size: int = 1,
) -> ScoreResult:
    """Run every reward function on a batch, isolating failures to the samples that caused them.

    In-process, a function that raises (``sys.exit`` included) is re-run one sample at a time;
    samples that still raise, and values that are None/NaN/inf/beyond +-1e9/non-numeric, get
    ``on_error`` and a problem message. ``async def`` rewards are awaited. With a ``pool``
    (``reward_pool.RewardPool``), its functions that are not grpolab's own run there: the batch
    in parts of whole groups (``group_size`` answers each), in parallel, each call limited to
    the pool's timeout (see ``_score_in_pool``). With
    ``fail_on_all_errors``, a function whose calls failed on every sample raises RewardError
    (one line: the function and its first failure). Otherwise raises only for caller mistakes
    (mismatched lengths or weights).
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
        vals, failed, first = _score_one_fn(fn, name, prompts, completions, cols, on_error,
                                            problems, pool, group_size)
        if fail_on_all_errors and n and failed == n:
            raise RewardError(
                f"reward {name!r} failed on all {n} answers of the batch; the first: "
                f"{first.removeprefix(f'reward {name!r} ')} (fix the reward, or set "
                "fail_on_reward_errors: false to score such answers reward_on_error)"
            )
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
