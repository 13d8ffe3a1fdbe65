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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ---------------------------------------------------------------- task ----

OPS = ("+", "-", "*")


def make_problem(rng: random.Random) -> dict[str, str]:
    """One problem: 3-digit addition/subtraction or 3-digit x 1-digit multiplication.

    Carries, borrows and multiplication give prompts of very different difficulty, so a
    partly-trained model solves some prompts almost always and others almost never: the
    bimodal pass rates that make GRPO groups die.
    """
    op = rng.choice(OPS)
    if op == "+":
        a, b = rng.randrange(1000), rng.randrange(1000)
        ans = a + b
    elif op == "-":
        a, b = rng.randrange(1000), rng.randrange(1000)
        a, b = max(a, b), min(a, b)
        ans = a - b
    else:
        a, b = rng.randrange(1000), rng.randrange(10)
        ans = a * b
    return {"prompt": f"{a:03d}{op}{b:03d}=", "answer": str(ans)}


def sloppy_answer(prompt: str, rng: random.Random, slip: float) -> str:
    """The answer of a careless teacher who forgets each carry (or borrow) with prob. ``slip``.

    SFT on such demonstrations gives a policy that reproduces the slips: prompts without
    carries are (almost) always right, prompts with k carries right about (1 - slip)^k of the
    time. Forgetting a carry is one shared habit, so what GRPO unlearns on train prompts
    carries over to held-out ones, as RL with verifiable rewards does on real models.
    """
    a, op, b = prompt[:3], prompt[3], prompt[4:7]
    digits: list[int] = []
    carry = 0
    if op == "*":
        m = int(b)
        for da in reversed(a):
            v = int(da) * m + carry
            digits.append(v % 10)
            carry = v // 10 if rng.random() >= slip else 0
        digits.append(carry)
    else:
        for da, db in zip(reversed(a), reversed(b)):
            if op == "+":
                v = int(da) + int(db) + carry
                digits.append(v % 10)
                carry = v // 10
            else:
                v = int(da) - int(db) - carry
                digits.append(v % 10)
                carry = int(v < 0)
            if carry and rng.random() < slip:
                carry = 0
        if op == "+":
            digits.append(carry)
    return str(int("".join(str(d) for d in reversed(digits))))


def check(prompt: str, completion: str) -> bool:
    """The exact verifier, computed from the prompt alone."""
    a, op, b = int(prompt[:3]), prompt[3], int(prompt[4:7])
    want = a + b if op == "+" else a - b if op == "-" else a * b
    return completion.strip() == str(want)


@dataclass
class Splits:
    train: list[dict[str, str]]
    heldout: list[dict[str, str]]


def make_splits(seed: int, train_size: int, heldout_size: int) -> Splits:
    """Disjoint train and held-out prompt sets, deterministic in ``seed``."""
    rng = random.Random(f"grpolab-world-{seed}")
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < train_size + heldout_size:
        p = make_problem(rng)
        if p["prompt"] not in seen:
            seen.add(p["prompt"])
            rows.append(p)
    return Splits(train=rows[heldout_size:], heldout=rows[:heldout_size])


class CharTokenizer:
    """Character vocabulary of the world; ids 0-2 are PAD, BOS, EOS."""

    PAD, BOS, EOS = 0, 1, 2
    chars = "0123456789+-*="

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
    d_model: int = 96
    n_layers: int = 3
    n_heads: int = 4
    max_len: int = 24


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
    ids = torch.full((len(rows), max_len), tok.PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), max_len), dtype=torch.bool)
    for i, r in enumerate(rows):
        p = tok.encode(r["prompt"])
        seq = (p + tok.encode_answer(r["answer"]))[:max_len]
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, len(p) : len(seq)] = True
    return ids, mask


def sft(
    model: TinyGPT,
    tok: CharTokenizer,
    exclude: set[str],
    steps: int,
    seed: int,
    batch_size: int = 128,
    lr: float = 3e-3,
    slip: float = 0.0,
    progress: bool = False,
) -> None:
    """Supervised fine-tuning on fresh random problems, never a train or held-out prompt.

    Keeping the RL prompts out of SFT makes train and held-out prompts alike to the model, so
    what GRPO gains on one must generalise to the other.

    With ``slip`` > 0 the demonstrations come from ``sloppy_answer``: the workshop starts from
    a partly competent policy whose mistakes RL can fix.
    """
    rng = random.Random(f"grpolab-sft-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    # Warm up, then cosine down to a third of the peak, not to zero: a model that settled at a
    # learning rate of lr/3 (1e-3) is not thrown off by RL updates of that size.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / 100) * (1 + 2 * 0.5 * (1 + math.cos(math.pi * s / steps))) / 3,
    )
    model.train()
    it = range(steps)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="SFT (once, then cached)", leave=False)
    for _ in it:
        rows = []
        while len(rows) < batch_size:
            p = make_problem(rng)
            if p["prompt"] not in exclude:
                if slip > 0:
                    p["answer"] = sloppy_answer(p["prompt"], rng, slip)
                rows.append(p)
        ids, mask = encode_batch(tok, rows, model.config.max_len)
        logits, _ = model(ids[:, :-1])
        loss = F.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()


def default_cache_dir() -> Path:
    return Path(os.environ.get("GRPOLAB_CACHE", Path.home() / ".cache" / "grpolab"))


def sft_model(
    seed: int,
    splits: Splits,
    sft_steps: int,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
    slip: float = 0.0,
) -> TinyGPT:
    """The fine-tuned starting policy, trained once per (seed, steps, slip, model) and cached."""
    tok = CharTokenizer()
    tc = TinyConfig(vocab_size=tok.vocab_size)
    exclude = sorted(r["prompt"] for r in splits.train + splits.heldout)
    key = json.dumps(
        {"v": 4, "seed": seed, "steps": sft_steps, "slip": slip, "model": asdict(tc),
         "exclude": exclude},
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
    sft(model, tok, set(exclude), sft_steps, seed, slip=slip, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    return model
