"""Scoring a batch of answers: every reward function, safely, and the run's ``Scorer``.

``score`` never lets one bad reward crash a training run: a function that raises is re-run one
answer at a time, bad values score ``on_error`` and are reported, user rewards run in worker
processes with a timeout (``reward_pool``). ``make_scorer`` is the one factory the commands
(``workshop``, ``train``, ``eval``) and the trainer use: the config's rewards, weights and
error policy behind one call.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpolab.core.advantages import total_reward, unscored
from grpolab.rewards.builtin import REWARD_LIMIT, RewardFn
from grpolab.rewards.pool import (
    RewardPool,
    await_if_needed,
    error_text,
    pool_for,
    runs_in_process,
)
from grpolab.rewards.trl_compat import takes

logger = logging.getLogger("grpolab.rewards.builtin")


@dataclass
class ScoreResult:
    """Scores for one batch: weighted total, per-function scores and what went wrong."""

    total: torch.Tensor  # float32 [B]
    per_fn: torch.Tensor  # float32 [B, K]
    names: list[str]
    problems: list[str]
    # "NAME/KEY": the numbers beside a verl reward's score ({"score": 1, "acc": True}), [B]
    # float32, NaN where an answer's dict had none
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def scored_total(self) -> torch.Tensor:
        """``total``, NaN where every function said None (what group statistics leave out)."""
        return torch.where(unscored(self.per_fn), torch.nan, self.total)

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
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - a value whose __repr__ raises: its type alone
        text = f"<a {type(obj).__name__}>"
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


def _is_nan(value: Any) -> bool:
    try:
        return not isinstance(value, (str, bytes)) and math.isnan(float(value))
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return False


def _as_list(value: Any) -> list[Any] | None:
    if value is None or isinstance(value, (str, bytes, dict)):
        return None
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist() if value.dim() == 1 else None
    try:
        return list(value)
    except Exception:  # noqa: BLE001 - not a list, or one whose __len__/__iter__ raises
        return None


_LOGGED: set[str] = set()
LOGGED_PER_BATCH = 3  # problem lines a reward logs per batch (then a count)


class _Failed:
    """No usable score for one sample (the call raised, timed out, ended its process, or gave
    no value for it); ``message`` is already in the problems."""

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
) -> tuple[list[float], int, str, dict[str, list[float]]]:
    """This function's score for every sample, how many samples it gave no usable score for
    (failed calls and unusable values alike), the first such failure's message, and the other
    numbers of a verl reward's dicts (``fn.dict_scores``) by key."""
    n = len(completions)
    if n == 0:
        return [], 0, "", {}

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
            if not any(isinstance(v, _Failed) for v in values):
                problems.append(
                    f"reward {name!r} raised {error_text(e)} on the batch of {n} but on no single "
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
                return [on_error] * n, n, problems[-1], {}

    failures = []
    out = []
    extras: dict[str, list[float]] = {}
    skips = getattr(fn, "none_unscored", False)  # (TRL's rewards: None is "cannot score")
    for i, value in enumerate(values):
        if isinstance(value, dict) and getattr(fn, "dict_scores", False):
            for key, x in value.items():
                if key != "score" and (v := _to_float(x)) is not None:
                    extras.setdefault(str(key), [math.nan] * n)[i] = v
            value = value.get("score")
        number = None if isinstance(value, _Failed) else _to_float(value)
        if skips and (value is None or _is_nan(value)):  # (TRL holds a None as NaN: alike)
            out.append(math.nan)
        elif number is None:
            if not isinstance(value, _Failed):
                problems.append(f"reward {name!r} returned {_short(value, 40)} on {where(i)}")
            failures.append(value.message if isinstance(value, _Failed) else problems[-1])
            out.append(on_error)
        else:
            out.append(number)
    return out, len(failures), failures[0] if failures else "", extras


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
            problems.append(f"reward {name!r} raised {error_text(e)} on {where(i)}")
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
            values[lo:hi] = [_Failed(problems[-1])] * (hi - lo)
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
    if retry and not any(isinstance(values[i], _Failed) for i in retry):
        problems.append(f"reward {name!r} {first} but on no single one; used per-answer scores")
    return values


def _single(values: list[Any] | None, name: str, where: str, problems: list[str]) -> Any:
    """The one value of a one-sample call, or _Failed (with a problem) when it is not one."""
    if values is None or len(values) != 1:
        got = "a non-list" if values is None else f"{len(values)} values"
        problems.append(f"reward {name!r} returned {got} for 1 sample on {where}")
        return _Failed(problems[-1])
    return values[0]


class RewardError(ValueError):
    """A reward function failed on every answer of a batch: almost surely the function (its
    signature, a missing package), not the answers. One line; the CLI exits with 2."""


def row_columns(rows: list[dict], fns: Sequence[RewardFn] = (),
                ids: Callable[[], list] | None = None) -> dict[str, list]:
    """Every field of the rows but the prompt, as the columns rewards receive (answer=[...]);
    with ``ids`` the answers' token ids too, read only when one of ``fns`` takes them."""
    keys = [k for k in rows[0] if k != "prompt"] if rows else []
    cols = {k: [r.get(k) for r in rows] for k in keys}
    if ids is not None and any(takes(fn, "completion_ids") for fn in fns):
        cols["completion_ids"] = ids()
    return cols


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
    ``on_error`` and a problem (a TRL reward's None or NaN: not scored, as TRL reads both).
    ``async def`` rewards are awaited. With a ``pool``, its functions that are not grpolab's own
    run there, in parts of whole groups (``group_size`` answers), in parallel, each call within
    the pool's timeout (``_score_in_pool``). With ``fail_on_all_errors``, a function that gave
    no usable score for any sample raises RewardError (one line: the function and its first
    failure). Otherwise raises only for caller mistakes (mismatched lengths or weights).
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
    extras: dict[str, torch.Tensor] = {}
    for j, (fn, name) in enumerate(zip(reward_fns, names)):
        start = len(problems)
        fn_cols = cols if takes(fn, "completion_ids") else {  # (TRL's trainer argument)
            k: v for k, v in cols.items() if k != "completion_ids"}
        vals, failed, first, more = _score_one_fn(fn, name, prompts, completions, fn_cols,
                                                  on_error, problems, pool, group_size)
        extras.update({f"{name}/{key}": torch.tensor(v, dtype=torch.float32)
                       for key, v in more.items()})
        if fail_on_all_errors and n and failed == n:
            raise RewardError(
                f"reward {name!r} failed on all {n} answers of the batch; the first: "
                f"{first.removeprefix(f'reward {name!r} ')} (fix the reward, or set "
                "fail_on_reward_errors: false, --no-fail-on-reward-errors, to score such answers "
                "reward_on_error)"
            )
        mine = problems[start:]  # a reward failing on many answers: its first few, a count
        for message in mine[:LOGGED_PER_BATCH]:
            _log_once(message)
        if len(mine) > LOGGED_PER_BATCH:
            logger.warning("... and %d more problems of reward %r in this batch (all counted "
                           "in reward_problems)", len(mine) - LOGGED_PER_BATCH, name)
        per_fn[:, j] = torch.tensor(vals, dtype=torch.float32)
    total = total_reward(per_fn, torch.tensor(w)) if k else torch.zeros(n)
    return ScoreResult(total=total, per_fn=per_fn, names=names, problems=problems,
                       extras=extras)


def _unique(names: list[str]) -> list[str]:
    """Suffix duplicates (two format rewards, say) so metric names stay distinct."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out



class Scorer:
    """The run's rewards as one call: weights, ``reward_on_error``, the fail-on-all-errors
    check and the worker pool (forked on first use, so the workers hold the functions; None
    when ``reward_timeout`` is 0 or no reward needs one). ``close()`` stops the workers."""

    def __init__(self, cfg: Any, reward_fns: Sequence[RewardFn]) -> None:
        self.cfg = cfg
        self.reward_fns = list(reward_fns)
        self.pool: RewardPool | None = None
        self._pool_checked = False

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], rows: list[dict],
                 group_size: int = 1, ids: Callable[[], list] | None = None) -> ScoreResult:
        """``ids``: the answers' token ids (read only when a reward takes ``completion_ids``)."""
        cfg = self.cfg
        return score(self.reward_fns, prompts, completions,
                     row_columns(rows, self.reward_fns, ids),
                     weights=cfg.reward_weights or None, on_error=cfg.reward_on_error,
                     pool=self._pool(), fail_on_all_errors=cfg.fail_on_reward_errors,
                     group_size=group_size)

    def _pool(self) -> RewardPool | None:
        if self.pool is None and not self._pool_checked:
            self.pool = pool_for(self.reward_fns, self.cfg.reward_timeout,
                                 self.cfg.reward_workers)
            self._pool_checked = True
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self._pool_checked = False


def load_rewards(cfg: Any) -> tuple[list[RewardFn], RewardFn | None]:
    """The config's reward functions and its reward-hacking watch check (None when off)."""
    from grpolab.rewards.builtin import load_reward

    def one(spec: str) -> RewardFn:
        return load_reward(spec, cfg.format_pattern or None, cfg.answer_sources,
                           cfg.max_new_tokens)

    return [one(s) for s in cfg.rewards], (one(cfg.watch_reward) if cfg.watch_reward else None)


def make_scorer(cfg: Any, reward_fns: Sequence[RewardFn] | None = None) -> Scorer:
    """The one scorer factory: ``reward_fns`` (the world's exact answer), or the config's."""
    return Scorer(cfg, load_rewards(cfg)[0] if reward_fns is None else reward_fns)
