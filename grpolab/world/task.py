"""The built-in task world: arithmetic prompts with an exact checker, a tiny GPT, and its SFT.

Everything is generated from a seed, so the workshop needs no download: the same seed gives
the same splits, the same fine-tuned start and (on CPU) the same run.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass

OPS = ("+",)


# The calibrated world (see docs/workshop-calibration.md): most sums stay below 100 and most of
# those carry out of the ones column; the teacher forgets that carry a quarter of the time and
# never writes the leading 1 of a sum of 100 or more.
TOP_SHARE = 0.24  # share of prompts whose sum reaches 100 (the rest sum to 0..99)


CARRY_SHARE = 0.68  # share of the sums below 100 that carry out of the ones column


SLIP = 0.25  # the teacher forgets the carry out of the ones column with this probability


SLIP_TOP = 1.0  # ... and the carry into the hundreds (the leading 1) with this one


def answer_of(a: int, b: int) -> str:
    """The right answer: the sum, written with three digits (``42+17=`` -> ``059``).

    A fixed width puts every answer digit at a fixed distance from the digits it depends on,
    which a 2-layer model learns in a few hundred steps (variable-width answers take it far
    longer).
    """
    return f"{a + b:03d}"


def make_problem(rng: random.Random, top_share: float = TOP_SHARE,
                 carry_share: float = CARRY_SHARE,
                 accept: Callable[[str], bool] | None = None) -> dict[str, str]:
    """One problem: 2-digit + 2-digit addition, ``42+17=`` with answer ``059``.

    With probability ``top_share`` the two numbers are uniform among pairs whose sum reaches
    100; otherwise, with probability ``carry_share``, uniform among pairs whose sum stays below
    100 and carries out of the ones column, else among the carry-free pairs below 100. The
    teacher's slips make the three kinds the three pass-rate bands of the start: no carry
    (solved almost always), a ones carry (1 - slip), a sum of 100 or more (never).
    ``accept``: redraw within the kind until it accepts the prompt (so a caller's filter, such
    as no repeats, does not skew the mix towards the kinds with more pairs).
    """
    top = rng.random() < top_share
    ones = rng.random() < carry_share
    for _ in range(1_000_000):
        a, b = rng.randrange(100), rng.randrange(100)
        if (a + b >= 100) == top and (top or (a % 10 + b % 10 >= 10) == ones):
            prompt = f"{a:02d}+{b:02d}="
            if accept is None or accept(prompt):
                return {"prompt": prompt, "answer": answer_of(a, b)}
    raise ValueError("the world has too few problems of one kind for this request (lower "
                     "world_train_size or world_heldout_size, or move the shares off 0 and 1)")


def carries(prompt: str) -> tuple[bool, bool]:
    """(carry out of the ones column, carry into the hundreds) of a prompt ``ab+cd=``."""
    a, b = int(prompt[:2]), int(prompt[3:5])
    return (a % 10 + b % 10 >= 10, a + b >= 100)


def teacher_pass_rate(prompt: str, slip: float = SLIP, slip_top: float = SLIP_TOP) -> float:
    """Probability that the careless teacher's answer to ``prompt`` is right.

    (1 - slip) if the ones column carries, times (1 - slip_top) if the sum reaches 100: a
    policy that copies the teacher has these pass rates, 1 on carry-free prompts.
    """
    ones, top = carries(prompt)
    return (1 - slip if ones else 1.0) * (1 - slip_top if top else 1.0)


def sloppy_answer(prompt: str, rng: random.Random, slip: float = SLIP,
                  slip_top: float = SLIP_TOP) -> str:
    """The answer of a careless teacher: forgets the carry out of the ones column with
    probability ``slip`` and the carry into the hundreds (writes ``0`` for the leading ``1``)
    with probability ``slip_top``.

    SFT on such demonstrations gives a policy that reproduces the slips: carry-free prompts
    right almost always, prompts with a ones carry right about 1 - slip of the time, sums of
    100 or more about 1 - slip_top of the time (never, at the default 1). Forgetting a carry
    is one shared habit, so what GRPO unlearns on train prompts carries over to held-out ones,
    as RL with verifiable rewards does on real models.
    """
    a, b = int(prompt[:2]), int(prompt[3:5])
    lo = a % 10 + b % 10
    c1 = int(lo >= 10 and rng.random() >= slip)
    hi = a // 10 + b // 10 + c1
    c2 = int(hi >= 10 and rng.random() >= slip_top)
    return f"{c2}{hi % 10}{lo % 10}"


def teacher_answers(prompt: str, slip: float = SLIP,
                    slip_top: float = SLIP_TOP) -> list[tuple[str, float]]:
    """Every answer the careless teacher can give to ``prompt``, with its probability (the
    distribution ``sloppy_answer`` samples from; probabilities sum to 1)."""
    a, b = int(prompt[:2]), int(prompt[3:5])
    lo = a % 10 + b % 10
    out: dict[str, float] = {}
    for c1, q1 in ((1, 1 - slip), (0, slip)) if lo >= 10 else ((0, 1.0),):
        hi = a // 10 + b // 10 + c1
        for c2, q2 in ((1, 1 - slip_top), (0, slip_top)) if hi >= 10 else ((0, 1.0),):
            if q1 * q2 > 0:
                ans = f"{c2}{hi % 10}{lo % 10}"
                out[ans] = out.get(ans, 0.0) + q1 * q2
    return list(out.items())


def check(prompt: str, completion: str) -> bool:
    """The exact verifier, computed from the prompt alone."""
    a, b = int(prompt[:2]), int(prompt[3:5])
    return completion.strip() == answer_of(a, b)


@dataclass
class Splits:
    train: list[dict[str, str]]
    heldout: list[dict[str, str]]


def sft_side(prompt: str) -> bool:
    """Which half of the problems the SFT draws from; the RL splits draw from the other half.

    A fixed partition (by a hash of the prompt) keeps RL prompts out of SFT without the SFT
    depending on the splits: the fine-tuned start of a seed is the same whatever the RL
    prompt mix, so the mix can be fitted on fixed starts.
    """
    return zlib.crc32(prompt.encode()) % 2 == 0


def make_splits(seed: int, train_size: int, heldout_size: int,
                top_share: float = TOP_SHARE, carry_share: float = CARRY_SHARE) -> Splits:
    """Disjoint train and held-out prompt sets off the SFT's half, deterministic in ``seed``."""
    rng = random.Random(f"grpolab-world-{seed}")
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < train_size + heldout_size:
        p = make_problem(rng, top_share, carry_share,
                         accept=lambda q: q not in seen and not sft_side(q))
        seen.add(p["prompt"])
        rows.append(p)
    return Splits(train=rows[heldout_size:], heldout=rows[:heldout_size])
