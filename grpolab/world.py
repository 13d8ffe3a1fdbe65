"""The built-in task world: arithmetic prompts with an exact checker, a tiny GPT, and its SFT.

Everything is generated from a seed, so the workshop needs no download: the same seed gives
the same splits, the same fine-tuned start and (on CPU) the same run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import random
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ---------------------------------------------------------------- task ----

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


class CharTokenizer:
    """Character vocabulary of the world; ids 0-2 are PAD, BOS, EOS."""

    PAD, BOS, EOS = 0, 1, 2
    chars = "0123456789+-*="  # - and * unused since the world is addition only

    def __init__(self) -> None:
        self.stoi = {c: i + 3 for i, c in enumerate(self.chars)}
        self.itos = {i: c for c, i in self.stoi.items()}
        self.vocab_size = len(self.chars) + 3

    def encode(self, text: str) -> list[int]:
        return [self.BOS] + [self.stoi[c] for c in text]

    def encode_answer(self, text: str) -> list[int]:
        """An answer's ids as the model should produce them: its characters, then EOS."""
        return [self.stoi[c] for c in text] + [self.EOS]

    def decode(self, ids: list[int]) -> str:
        out = []
        for i in ids:
            if i == self.EOS or i == self.PAD:
                break
            out.append(self.itos.get(int(i), "?"))
        return "".join(out)


# --------------------------------------------------------------- model ----


@dataclass
class TinyConfig:
    vocab_size: int = 17
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 16


class Block(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(c.d_model, 4 * c.d_model), nn.GELU(), nn.Linear(4 * c.d_model, c.d_model)
        )
        self.n_heads = c.n_heads

    def forward(self, x: Tensor, cache: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        h = self.n_heads
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        # Queries at the end of a cached prefix see every key; a fresh block is causal.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None and t > 1)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.ln2(x))
        return x, (k, v)


class TinyGPT(nn.Module):
    """A pre-LayerNorm decoder-only transformer with a KV cache for fast sampling."""

    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.max_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(
        self, ids: Tensor, cache: list | None = None, start: int = 0
    ) -> tuple[Tensor, list]:
        """Logits for ``ids`` placed at positions start.., and the extended cache."""
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        new_cache = []
        for i, blk in enumerate(self.blocks):
            x, kv = blk(x, None if cache is None else cache[i])
            new_cache.append(kv)
        return self.head(self.ln(x)), new_cache


class LoRALinear(nn.Module):
    """y = W x + (alpha / r) B A x with W frozen; B starts at zero, so training starts at W.

    Why the workshop uses adapters: full-parameter Adam at step size 0.001 moves every weight
    by about 0.001 per step whatever the gradient's size, which on a model this small is a
    large, mostly random change (measured: held-out accuracy collapses); a rank-r adapter
    confines the same step size to a small, smooth subspace.
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(
            torch.randn(r, base.in_features, generator=generator) / math.sqrt(base.in_features)
        )
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = alpha / r
        self.enabled = True

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        if self.enabled:
            y = y + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale
        return y


def add_lora(model: TinyGPT, r: int, alpha: float, seed: int) -> None:
    """Wrap every linear layer of the blocks in a LoRA adapter and freeze everything else."""
    g = torch.Generator().manual_seed(seed)
    for blk in model.blocks:
        blk.qkv = LoRALinear(blk.qkv, r, alpha, g)
        blk.proj = LoRALinear(blk.proj, r, alpha, g)
        blk.mlp[0] = LoRALinear(blk.mlp[0], r, alpha, g)
        blk.mlp[2] = LoRALinear(blk.mlp[2], r, alpha, g)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model, i.e. the frozen reference, without keeping a second copy."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True


# ----------------------------------------------------------------- SFT ----


def encode_batch(tok: CharTokenizer, rows: list[dict[str, str]], max_len: int) -> tuple:
    """Teacher-forcing tensors: ids [B, L] and a loss mask that covers answer + EOS only."""
    ids, mask = [], []  # built as lists, one tensor each (a tensor per row costs the SFT ~5 s)
    for r in rows:
        p = tok.encode(r["prompt"])
        seq = (p + tok.encode_answer(r["answer"]))[:max_len]
        pad = max_len - len(seq)
        ids.append(seq + [tok.PAD] * pad)
        mask.append([False] * len(p) + [True] * (len(seq) - len(p)) + [False] * pad)
    return (torch.tensor(ids, dtype=torch.long).reshape(len(rows), max_len),
            torch.tensor(mask, dtype=torch.bool).reshape(len(rows), max_len))


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


def default_cache_dir() -> Path:
    return Path(os.environ.get("GRPOLAB_CACHE", Path.home() / ".cache" / "grpolab"))


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
    path = Path(cache_dir or default_cache_dir()) / f"sft-{digest}.pt"
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
