"""TRL reward functions, used unchanged.

TRL calls a reward as ``fn(prompts=..., completions=..., **columns)`` (keywords, so
``accuracy_reward(completions, solution, **kwargs)`` works with its parameters in any order), a
``None`` in the returned list means "cannot score this one" (TRL holds it as NaN: 0 in the
weighted sum, left out of means and group statistics), and for conversational data each
completion is a list of one message, ``[{"role": "assistant", "content": text}]`` (TRL's
built-ins, ``accuracy_reward`` and ``think_format_reward``, read ``completion[0]["content"]``
whatever the data).

``adapt(fn)`` wraps a user reward so grpolab's scorer, which calls ``fn(prompts, completions,
**columns)`` with text completions, gives it all three:

* keywords when the function names ``completions`` (or takes only ``**kwargs``); else
  positionally, as before (``def r(p, c, **kw)`` keeps working);
* conversational completions when its ``completions`` annotation says messages (``list[list[
  dict]]``, as TRL's built-ins), when the function sets ``completion_format =
  "conversational"``, or when a call with text fails (TypeError, KeyError, IndexError,
  AttributeError) and the same call with messages succeeds; the format found is kept;
* ``None`` (or NaN, which TRL holds it as) is "cannot score", as in TRL 1.16, not a failure
  (logged once per function): it
  counts 0 in the weighted total (TRL's nansum) and is left out of the function's logged mean;
  an answer no function scores is left out of its group's statistics and gets advantage 0.

``completion_ids`` (each answer's token ids, its EOS included, as TRL passes them) reaches the
rewards that name it or take ``**kwargs`` (``takes``), so TRL's ``get_soft_overlong_punishment``
and ``get_repetition_penalty_reward`` run unchanged. Not provided: ``trainer_state``,
``log_extra`` and ``log_metric``; a reward that requires one is refused in one line
(``check_columns``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Any

from grpolab.config import ConfigError

log = logging.getLogger("grpolab.rewards.builtin")

TEXT, CONVERSATIONAL = "text", "conversational"
_RETRY_ERRORS = (TypeError, KeyError, IndexError, AttributeError)


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def wants_keywords(fn: Any) -> bool:
    """Whether ``fn`` is called as TRL calls it (``prompts=``, ``completions=``, keywords)."""
    sig = _signature(fn)
    if sig is None:
        return False
    params = sig.parameters
    if "completions" in params:
        return params["completions"].kind is not inspect.Parameter.POSITIONAL_ONLY
    if "completion_ids" in params:  # (TRL's token-id rewards name only it; after two others,
        ahead = list(params)[:list(params).index("completion_ids")]  # grpolab's (p, c, ...))
        return params["completion_ids"].kind is not inspect.Parameter.POSITIONAL_ONLY and sum(
            params[k].kind in (inspect.Parameter.POSITIONAL_ONLY,
                               inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in ahead) < 2
    named = [p for p in params.values()
             if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    return not named and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def declared_format(fn: Any) -> str | None:
    """``conversational``/``text`` when the function says which completions it reads, else
    None (found on the first call)."""
    flag = getattr(fn, "completion_format", None)
    if flag in (TEXT, CONVERSATIONAL):
        return flag
    sig = _signature(fn)
    if sig is None or "completions" not in sig.parameters:
        return None
    ann = sig.parameters["completions"].annotation
    if ann is inspect.Parameter.empty:
        return None
    return CONVERSATIONAL if "dict" in str(ann) else None


def as_messages(completions: list[Any]) -> list[Any]:
    """Text completions as TRL's conversational ones: a list of one assistant message each."""
    return [c if isinstance(c, list) else [{"role": "assistant", "content": c}]
            for c in completions]


class TRLReward:
    """A user reward behind grpolab's calling convention (see the module docstring).

    Keeps the wrapped function's name (metrics say ``rewards/accuracy_reward``) and its
    ``in_process`` flag; picklable (a reward worker may receive it).
    """

    none_unscored = True  # (the scorer reads a None from it as NaN: not scored)

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.keywords = wants_keywords(fn)
        self.format = declared_format(fn)
        self._warned_none = False
        sig = _signature(fn)  # (a **kwargs reward that forwards them somewhere strict, as it
        self.drop_ids = False  # did before rewards were given completion_ids: without them)
        self._may_drop = sig is not None and "completion_ids" not in sig.parameters
        functools.update_wrapper(self, fn, assigned=("__module__", "__qualname__", "__doc__"),
                                 updated=())
        inner = fn
        while isinstance(inner, functools.partial):
            inner = inner.func
        self.__name__ = getattr(inner, "__name__", None) or type(inner).__name__
        if hasattr(fn, "in_process"):
            self.in_process = fn.in_process

    def _call(self, prompts: list[Any], completions: list[Any], columns: dict[str, Any],
              fmt: str) -> Any:
        comps = as_messages(completions) if fmt == CONVERSATIONAL else completions
        if self.keywords:
            return self.fn(prompts=prompts, completions=comps, **columns)
        return self.fn(prompts, comps, **columns)

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> Any:
        if self.drop_ids:
            columns.pop("completion_ids", None)
        try:
            return self._score(prompts, completions, columns)
        except TypeError as e:
            if not (self._may_drop and "completion_ids" in columns
                    and "'completion_ids'" in str(e)):
                raise
            columns.pop("completion_ids")
            out = self._score(prompts, completions, columns)
        self.drop_ids = True
        log.info("reward %s fails when given completion_ids (through its **kwargs): it is "
                 "called without them from now on", self.__name__)
        return out

    def _score(self, prompts: list[Any], completions: list[Any], columns: dict[str, Any]
               ) -> Any:
        from grpolab.rewards.pool import await_if_needed

        if self.format is not None:
            out = await_if_needed(self._call(prompts, completions, columns, self.format))
        else:
            try:
                out = await_if_needed(self._call(prompts, completions, columns, TEXT))
            except _RETRY_ERRORS as text_error:
                try:
                    out = await_if_needed(self._call(prompts, completions, columns,
                                                     CONVERSATIONAL))
                except Exception:  # noqa: BLE001 - the text call's error is the one to show
                    raise text_error from None
                self.format = CONVERSATIONAL
                log.info("reward %s reads conversational completions (TRL's format): it gets "
                         "[{'role': 'assistant', 'content': ...}] from now on", self.__name__)
            else:
                self.format = TEXT
        if (not self._warned_none and isinstance(out, (list, tuple))
                and any(v is None or (isinstance(v, float) and math.isnan(v)) for v in out)):
            log.info("reward %s returned None or NaN (cannot score) for some answers: 0 in the "
                     "total, left out of its mean (and of the group when no reward scores), as "
                     "in TRL", self.__name__)
            self._warned_none = True
        return out

    def __repr__(self) -> str:
        return f"TRLReward({self.fn!r})"


def missing_columns(fn: Any, columns: set[str]) -> list[str]:
    """The parameters reward ``fn`` requires that a call with these dataset ``columns`` would
    leave unfilled (TRL's ``accuracy_reward`` on rows without ``solution``, say)."""
    inner = fn.fn if isinstance(fn, TRLReward) else fn
    sig = _signature(inner)
    if sig is None:
        return []
    keywords = wants_keywords(inner)
    params = list(sig.parameters.values())[0 if keywords else 2:]  # (else prompts, completions)
    given = columns | ({"prompts", "completions"} if keywords else set())
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params
            if p.default is p.empty and p.kind in kinds and p.name not in given]


def takes(fn: Any, name: str) -> bool:
    """Whether reward ``fn`` can be given keyword ``name``: it names it or takes ``**kwargs``."""
    inner = fn.fn if isinstance(fn, TRLReward) else fn
    sig = _signature(inner)
    return sig is not None and (name in sig.parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()))


def check_columns(reward_fns: Any, rows: list[dict]) -> None:
    """A reward that needs a column the rows do not have would fail on every answer, after the
    model loads: refused at once, naming the column."""
    have = {k for k in (rows[0] if rows else {}) if k != "prompt"} | {"completion_ids"}
    trainer_args = {"trainer_state", "log_extra", "log_metric"}
    for fn in reward_fns:
        missing = missing_columns(fn, have)
        name = getattr(fn, "__name__", fn)
        if set(missing) & trainer_args:
            raise ConfigError(f"reward {name!r} needs TRL's trainer argument(s) "
                              f"{', '.join(sorted(set(missing) & trainer_args))}, which "
                              "grpolab does not pass")
        if missing:
            fix = ("answer_column names the column that becomes answer" if missing == ["answer"]
                   else "add or rename that column in the data")
            raise ConfigError(
                f"reward {name!r} needs the column(s) {', '.join(missing)}, which the rows do "
                f"not have (they have {', '.join(sorted(have - {'completion_ids'})) or 'none'}): "
                f"{fix}, or use a reward that reads the rows' answer")


def adapt(fn: Any) -> Any:
    """``fn`` behind TRLReward (grpolab's own rewards and reward models are returned as is)."""
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    module = getattr(inner, "__module__", None) or type(inner).__module__ or ""
    if isinstance(fn, TRLReward) or module == "grpolab" or module.startswith("grpolab."):
        return fn
    return TRLReward(fn)
