"""Procedural task libraries as datasets and rewards: ``dataset: reasoning_gym:<task>``, and
grpolab's own ``dataset: grpolab:arithmetic`` (addition and subtraction by difficulty).

reasoning-gym (Apache-2.0) generates questions with gold answers from a seed and scores an
answer with each task's own ``score_answer``. Here a task becomes rows (``prompt``, ``answer``,
``metadata``) and its scorer becomes the ``reasoning_gym`` reward. The scorer is handed only the
completion's one final answer, found by ``grpolab.rewards.verifiers.final_answer``: several tasks'
scorers give partial credit to any text containing the gold answer ("150 or 144" would earn
3/10 for 144), so they never see the raw completion.

The held-out split is generated from another seed and loses every question the training split
also asks (small tasks repeat questions).
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

from grpolab.rewards import verifiers

PREFIX = "reasoning_gym:"
OWN = "grpolab:"
HELDOUT_SEED_OFFSET = 1_000_003

log = logging.getLogger("grpolab")


def is_task(spec: str) -> bool:
    return spec.startswith((PREFIX, OWN))


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("reasoning_gym datasets need the reasoning-gym package: "
                         "pip install -e '.[hf,tasks]'") from None
    return reasoning_gym


def task_rows(spec: str, size: int, seed: int, task_config: dict[str, Any] | None = None,
              exclude: Sequence[str] = ()) -> list[dict[str, Any]]:
    """``size`` rows of task ``spec`` (``reasoning_gym:<name>``) generated from ``seed``.

    Rows whose question is in ``exclude`` are dropped and replaced from further draws, so a
    held-out split never repeats a training question. Raises ValueError with one line for an
    unknown task or a bad task config.
    """
    if spec.startswith(OWN):
        return arithmetic_rows(spec, size, seed, task_config, exclude)
    rg = _library()
    name = spec[len(PREFIX):].strip()
    cfg = dict(task_config or {})
    if name not in rg.factory.DATASETS:
        raise ValueError(f"dataset {spec!r}: reasoning-gym has no task {name!r}")
    banned = set(exclude)
    rows: list[dict[str, Any]] = []
    # A task is one stream of questions (seed s, item i is seed 0, item s + i): draw from it
    # until `size` new questions, or until a long run of repeats says the task is exhausted.
    try:
        ds = rg.create_dataset(name, size=max(100 * size, 10_000), seed=seed, **cfg)
    except (TypeError, AssertionError, ValueError) as e:
        raise ValueError(f"dataset {spec!r}: bad task_config {cfg}: "
                         f"{type(e).__name__}: {e}") from None
    repeats = 0
    for i in range(len(ds)):
        entry = ds[i]
        q = entry["question"]
        if q in banned:
            repeats += 1
            if repeats > 20 * size + 1000:
                break
            continue
        repeats = 0
        banned.add(q)
        rows.append({"prompt": q, "question": q, "answer": str(entry["answer"]),
                     "metadata": entry.get("metadata") or {}})
        if len(rows) == size:
            break
    if len(rows) < size:
        log.warning("dataset %s: only %d distinct questions of %d asked for (task too small "
                    "for this size)", spec, len(rows), size)
    if not rows:
        raise ValueError(f"dataset {spec!r}: no questions generated")
    return rows


@functools.lru_cache(maxsize=64)
def _scorer(source: str) -> Callable[..., float]:
    return _library().get_score_answer_fn(source)


def task_reward(sources: Sequence[str] = verifiers.SOURCES) -> Callable[..., list[float]]:
    """The ``reasoning_gym`` reward: each row's task scorer applied to its one final answer."""
    sources = tuple(sources)

    def reasoning_gym_score(prompts: list[Any], completions: list[str], answer: list[Any],
                            metadata: list[dict] | None = None, question: list[str] | None = None,
                            **_: Any) -> list[float]:
        if metadata is None:
            raise ValueError("the reasoning_gym reward needs rows from a reasoning_gym: dataset "
                             "(no metadata column)")
        out = []
        for p, c, a, m in zip(question or prompts, completions, answer, metadata):
            final = verifiers.final_answer(str(c), sources, verifiers.prompt_text(p))
            if final is None or a is None or verifiers.hedged(final, str(a)):
                out.append(0.0)
                continue
            entry = {"question": p, "answer": a, "metadata": m}
            out.append(float(_scorer(m["source_dataset"])(answer=final, entry=entry)))
        return out

    return reasoning_gym_score


# ----------------------------------------------------------------------------- grpolab:arithmetic

DIFFICULTIES = ("1-digit", "2-digit", "2-digit-carry", "3-digit")


def _operands(kind: str, op: str, rng: random.Random) -> tuple[int, int]:
    """Two operands of one difficulty; a difference is never negative. "2-digit" has no carry
    (addition) or borrow (subtraction) in any column; "2-digit-carry" has one in the units."""
    while True:
        if kind == "1-digit":
            a, b = rng.randint(1, 9), rng.randint(1, 9)
        elif kind == "3-digit":
            a, b = rng.randint(100, 999), rng.randint(100, 999)
        else:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
        if op == "-" and a < b:
            a, b = b, a
        if kind.startswith("2-digit"):
            if op == "+":
                carry = a % 10 + b % 10 >= 10
                if a // 10 + b // 10 + carry >= 10:  # a 3-digit sum is another skill
                    continue
            else:
                carry = a % 10 < b % 10
            if carry != (kind == "2-digit-carry"):
                continue
        return a, b


def arithmetic_rows(spec: str, size: int, seed: int, task_config: dict[str, Any] | None = None,
                    exclude: Sequence[str] = ()) -> list[dict[str, Any]]:
    """``grpolab:arithmetic``: "Calculate a + b." / "Calculate a - b." rows, the difficulties
    (``task_config: {difficulties: [...], operators: [+, -]}``, default all) in turn; each row's
    ``difficulty`` column splits held-out accuracy by difficulty."""
    name = spec[len(OWN):].strip()
    if name != "arithmetic":
        raise ValueError(f"dataset {spec!r}: grpolab has no task {name!r} (only 'arithmetic')")
    cfg = dict(task_config or {})
    kinds = list(cfg.pop("difficulties", DIFFICULTIES))
    ops = list(cfg.pop("operators", ["+", "-"]))
    bad = [k for k in kinds if k not in DIFFICULTIES] + [o for o in ops if o not in "+-"]
    if cfg or bad or not kinds or not ops:
        raise ValueError(f"dataset {spec!r}: bad task_config (unknown {sorted(cfg) or bad}; "
                         f"difficulties are {list(DIFFICULTIES)}, operators + and -)")
    rng, banned, rows = random.Random(seed), set(exclude), []
    for _ in range(100 * size + 1000):
        kind = kinds[len(rows) % len(kinds)]
        op = rng.choice(ops)
        a, b = _operands(kind, op, rng)
        q = f"Calculate {a} {op} {b}."
        if q in banned:
            continue
        banned.add(q)
        rows.append({"prompt": q, "question": q, "answer": str(a + b if op == "+" else a - b),
                     "difficulty": kind})
        if len(rows) == size:
            break
    return rows
