"""verl's reward functions, used unchanged (``rewards: [verl:my_reward.py:compute_score]``, or
verl's ``custom_reward_function.path`` and ``.name``).

verl's reward manager calls ``compute_score(data_source=..., solution_str=...,
ground_truth=..., extra_info=...)`` once per answer and takes a number, or a dict whose
``score`` is the reward (its other numbers, ``acc`` say, are logged as
``rewards/<name>/<key>``). The answer is the completion's text; the gold is the row's
``reward_model.ground_truth`` (verl's data layout),
else its ``answer``; ``data_source`` and ``extra_info`` are the row's columns of those names
(``{}`` for ``extra_info`` where the data has none, as verl passes). A scorer of verl's own
gets only the keywords it names, so ``verl:<verl's folder>/utils/reward_score/gsm8k.py:
compute_score`` runs verl's GSM8K check. ``verl-batch:PATH:NAME`` is a function for verl's
``batch`` reward manager: called once per batch with ``data_sources``, ``solution_strs``,
``ground_truths`` and ``extra_infos`` (lists), it returns one number or dict per answer.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any


def _text(completion: Any) -> str:
    """A chat completion ([{"role": "assistant", "content": ...}]) as its text."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def _accepts(fn: Any) -> set[str] | None:
    """The keywords ``fn`` takes (None: any, it has ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def _score(fn: Any, got: Any) -> float | dict[str, Any]:
    """The answer's score; a dict's with its other keys (the scorer logs their numbers)."""
    whole = got if isinstance(got, dict) else None
    got = got.get("score") if whole is not None else got
    got = got.item() if getattr(got, "ndim", None) == 0 else got  # (numpy, torch scalars)
    if not isinstance(got, numbers.Real):  # (a bool is one, as verl takes it)
        what = (f"a dict without 'score' (keys: {', '.join(map(str, whole))})"
                if whole is not None and "score" not in whole else
                f"a dict whose 'score' is a {type(got).__name__}" if whole is not None else
                f"a {type(got).__name__}")
        raise TypeError(f"a verl reward returns a number or a dict with 'score'; "
                        f"{getattr(fn, '__name__', fn)} returned {what}")
    return float(got) if whole is None else {**whole, "score": float(got)}


def adapt_verl(fn: Any, batch: bool = False) -> Any:
    """``fn`` with verl's signature, as a grpolab reward (prompts, completions, **columns).
    A scorer of verl's own (``verl/utils/reward_score/gsm8k.py:compute_score``, which takes
    ``solution_str`` and ``ground_truth`` only) gets only the keywords it names. ``batch``:
    verl's batch reward manager's signature (the same, plural, as lists)."""
    takes = _accepts(fn)

    def reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[Any]:
        n = len(completions)
        holders = columns.get("reward_model") or [None] * n
        answers = columns.get("answer") or [None] * n
        args = {"data_source": columns.get("data_source") or [None] * n,
                "solution_str": [_text(c) for c in completions],
                "ground_truth": [h.get("ground_truth") if isinstance(h, dict) else a
                                 for h, a in zip(holders, answers)],
                "extra_info": [{} if x is None else x  # (verl passes {} where none)
                               for x in columns.get("extra_info") or [None] * n]}
        if batch:
            got = fn(**{k + "s": v for k, v in args.items()})
            got = got.tolist() if callable(getattr(got, "tolist", None)) else got  # (arrays)
            if not isinstance(got, (list, tuple)) or len(got) != n:
                return got  # (the scorer's "returned ... for n samples": the whole batch off,
                # not retried answer by answer, where one score would pass for each)
            return [_score(fn, g) for g in got]
        return [_score(fn, fn(**{k: v[i] for k, v in args.items() if takes is None or k in takes}))
                for i in range(n)]

    # its name and module (a user's: it runs in the reward workers, under reward_timeout), not
    # its signature (``__wrapped__`` would make the columns check read verl's)
    reward.__name__ = reward.__qualname__ = getattr(fn, "__name__", "verl_reward")
    reward.__module__ = getattr(fn, "__module__", None) or "verl_reward"
    reward.dict_scores = True  # type: ignore[attr-defined]
    return reward
