"""The workshop's fine-tuned start: SFT of TinyGPT on a sloppy teacher's answers until its pass
rates land on the teacher's bands, cached under ``cache_root()`` by a digest of its recipe."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import random
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import Tensor

from grpolab.rollout.models import cache_root
from grpolab.world.model import CharTokenizer, TinyConfig, TinyGPT, encode_batch
from grpolab.world.task import (
    SLIP,
    SLIP_TOP,
    Splits,
    make_problem,
    sft_side,
    teacher_answers,
    teacher_pass_rate,
)

# The SFT demonstrations' own mix, whatever the RL prompts' mix: enough carry-free prompts for
# every seed's start to learn them (with the RL mix, 28% carry-free, some seeds' SFT did not).
SFT_TOP_SHARE = 0.22


SFT_CARRY_SHARE = 0.5


SFT_BATCH = 96  # prompts per SFT step (each with every answer the teacher may give)


SFT_LR = 6e-3  # peak SFT step size (warm-up, then cosine down to a tenth of it)


def sft(
    model: TinyGPT,
    tok: CharTokenizer,
    exclude: set[str],
    steps: int,
    seed: int,
    batch_size: int = SFT_BATCH,
    lr: float = SFT_LR,
    slip: float = 0.0,
    progress: bool = False,
    slip_top: float = 0.0,
    top_share: float = SFT_TOP_SHARE,
    carry_share: float = SFT_CARRY_SHARE,
    stream: str = "",
) -> None:
    """Supervised fine-tuning on fresh random problems, never a train or held-out prompt.

    Keeping the RL prompts out of SFT makes train and held-out prompts alike to the model, so
    what GRPO gains on one must generalise to the other.

    With ``slip`` or ``slip_top`` > 0 the demonstrations are the careless teacher's: each
    prompt comes with every answer the teacher may give, weighted by its probability
    (``teacher_answers``), which is the expected loss on ``sloppy_answer``'s samples without
    their noise; the workshop starts from a partly competent policy whose mistakes RL can fix.
    """
    rng = random.Random(f"grpolab-sft-{seed}{stream}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, min(100, steps // 10))
    # Warm up, then cosine down to a tenth of the peak: the teacher's slips make noisy labels,
    # and only a small final step size settles each band at its slip rate.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps))),
    )
    model.train()
    it = range(steps)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="SFT (once, then cached)", leave=False)
    for _ in it:
        rows, weights, prompts = [], [], 0
        while prompts < batch_size:
            p = make_problem(rng, top_share, carry_share)
            if sft_side(p["prompt"]) and p["prompt"] not in exclude:
                prompts += 1  # one prompt: its teacher answers, weights summing to 1
                for ans, q in teacher_answers(p["prompt"], slip, slip_top):
                    rows.append({"prompt": p["prompt"], "answer": ans})
                    weights.append(q)
        w = torch.tensor(weights)
        ids, mask = encode_batch(tok, rows, model.config.max_len)
        width = int(mask.any(0).nonzero().max()) + 1  # drop columns that are padding only
        ids, mask = ids[:, :width], mask[:, :width]
        logits, _ = model(ids[:, :-1])
        ce = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        tok_w = mask[:, 1:].float() * w[:, None]
        loss = (ce * tok_w).sum() / tok_w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()


SFT_ATTEMPTS = 4  # SFT streams tried until the start lands on the teacher's pass-rate bands


SFT_BAND_TOL = 0.06  # how far a band's mean pass rate may sit from the teacher's


@torch.no_grad()
def answer_probability(model: TinyGPT, tok: CharTokenizer, rows: list[dict[str, str]]) -> Tensor:
    """[len(rows)] exact probability that one T=1 sample of ``model`` is each row's answer."""
    ids, mask = encode_batch(tok, rows, model.config.max_len)
    logits, _ = model(ids[:, :-1])
    lp = logits.float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.exp((lp * mask[:, 1:]).sum(-1))


def lands_on_teacher(model: TinyGPT, tok: CharTokenizer, rows: list[dict[str, str]],
                     slip: float, slip_top: float, tol: float = SFT_BAND_TOL) -> bool:
    """Whether every pass-rate band of ``rows`` (prompts grouped by the teacher's pass rate)
    has a mean exact pass rate within ``tol`` of the teacher's."""
    p = answer_probability(model, tok, rows)
    q = torch.tensor([teacher_pass_rate(r["prompt"], slip, slip_top) for r in rows])
    return all(abs(float(p[q == v].mean()) - float(v)) <= tol for v in q.unique())


def sft_check_rows(seed: int, n: int = 256) -> list[dict[str, str]]:
    """Prompts the SFT never sees (off its half), at its own mix, for ``lands_on_teacher``:
    fixed per seed, whatever the RL splits."""
    rng = random.Random(f"grpolab-sft-check-{seed}")
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        p = make_problem(rng, SFT_TOP_SHARE, SFT_CARRY_SHARE)
        if not sft_side(p["prompt"]):
            rows.append(p)
    return rows


def sft_model(
    seed: int,
    splits: Splits,
    sft_steps: int,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
    slip: float = SLIP,
    slip_top: float = SLIP_TOP,
) -> TinyGPT:
    """The fine-tuned starting policy, trained once per (seed, steps, slips, model) and
    cached; it draws from its own half of the problems (``sft_side``), never the splits'.

    A few hundred SFT steps on noisy labels do not always land: now and then (about one
    stream in five, measured) the model has not yet told carry-free prompts from carrying
    ones. A start whose bands miss the teacher's (``lands_on_teacher`` on 256 prompts off the
    SFT's half, ``sft_check_rows``) is trained again from the next stream, up to
    ``SFT_ATTEMPTS`` times, so every seed starts in the calibrated regime; each attempt is a
    function of the seed.
    """
    tok = CharTokenizer()
    tc = TinyConfig(vocab_size=tok.vocab_size)
    exclude = {r["prompt"] for r in splits.train + splits.heldout}
    if any(sft_side(p) for p in exclude):
        raise ValueError("the splits hold prompts from the SFT's half (use make_splits)")
    # Not keyed on the splits: the SFT never sees their half, so it is the same for any mix.
    key = json.dumps(
        {"v": 11, "seed": seed, "steps": sft_steps, "slip": slip, "slip_top": slip_top,
         "top_share": SFT_TOP_SHARE, "carry_share": SFT_CARRY_SHARE, "batch": SFT_BATCH,
         "lr": SFT_LR, "attempts": SFT_ATTEMPTS, "tol": SFT_BAND_TOL, "model": asdict(tc),
         "half": "crc32%2==0"},
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = cache_root(cache_dir or "") / f"sft-{digest}.pt"
    torch.manual_seed(seed)
    model = TinyGPT(tc)
    if path.is_file():
        try:
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            model.eval()
            return model
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
            # A corrupt cache entry is rebuilt, not fatal.
            logging.getLogger("grpolab").warning("rebuilding unreadable SFT cache %s (%s)", path, e)
    check = sft_check_rows(seed)
    for attempt in range(SFT_ATTEMPTS):
        if attempt:
            torch.manual_seed(seed * SFT_ATTEMPTS + attempt)
            model = TinyGPT(tc)
        sft(model, tok, exclude, sft_steps, seed, slip=slip, progress=progress,
            slip_top=slip_top, stream=f"-{attempt}" if attempt else "")
        if not check or lands_on_teacher(model, tok, check, slip, slip_top):
            break
        logging.getLogger("grpolab").info(
            "SFT stream %d of seed %d missed the teacher's pass-rate bands; training again",
            attempt, seed)
    else:
        logging.getLogger("grpolab").warning(
            "the fine-tuned start of seed %d missed the teacher's pass-rate bands in %d "
            "attempts; the workshop's calibration does not hold for it", seed, SFT_ATTEMPTS)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    return model
