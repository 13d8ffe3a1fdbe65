"""The world's policy: a character tokenizer, TinyGPT (a two-layer causal transformer) and the
LoRA adapters RL trains on it (``adapters_disabled`` gives the reference without a copy)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
