"""The built-in world's policy backend: TinyGPT and the character tokenizer behind ``LMBackend``.

TinyGPT (``grpolab.world.model``) keeps its own KV cache; ``TinyForward`` and ``TinyDecoder`` give it
the ``sampling.Forward`` interface, so the world samples with the same decode loop and is scored
by the same pass as a Hugging Face model. Its prompts all have one length (no padding).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpolab.rollout.backend import LMBackend, frozen_copy
from grpolab.rollout.batch import Rollout
from grpolab.rollout.logprobs import completion_logits
from grpolab.rollout.sampling import NO_FILTERS, Filters, decode, multinomial_next, sampled_logprobs
from grpolab.world.model import CharTokenizer, TinyGPT, adapters_disabled, add_lora


class TinyDecoder:
    """Decode state of TinyGPT: one prefill over the prompts, then one cached step per token."""

    def __init__(self, model: TinyGPT, ids: Tensor) -> None:
        self.model, self.start = model, ids.shape[1]
        logits, self.cache = model(ids)
        self.logits = logits[:, -1, :]

    def step(self, tokens: Tensor) -> Tensor:
        logits, self.cache = self.model(tokens[:, None], self.cache, start=self.start)
        self.start += 1
        return logits[:, -1, :]


class TinyForward:
    """TinyGPT as a ``sampling.Forward`` (unpadded prompts: masks and positions are implied)."""

    def __init__(self, model: TinyGPT) -> None:
        self.model = model

    def decoder(self, ids: Tensor, mask: Tensor, max_new: int,
                shared: Any = None) -> TinyDecoder:
        return TinyDecoder(self.model, ids)

    def logits(self, ids: Tensor, attn: Tensor, pos: Tensor, keep: int) -> Tensor:
        logits, _ = self.model(ids)
        return logits[:, -keep:, :]


class TinyBackend(LMBackend):
    """The built-in world's policy: TinyGPT + character tokenizer.

    With ``lora`` the policy trains rank-``lora_r`` adapters and the reference is the same model
    with its adapters off; without, every weight trains and the reference is a frozen copy.
    """

    def __init__(
        self, model: TinyGPT, lora: bool = False, lora_r: int = 8, lora_alpha: float = 16,
        seed: int = 0, filters: Filters = NO_FILTERS,
    ) -> None:
        self.model, self.filters = model, filters
        self.lora = lora
        self.ref: TinyGPT | None = None  # None with lora: the reference is adapters-off
        if lora:
            add_lora(model, lora_r, lora_alpha, seed)
        else:
            self.ref = frozen_copy(model)
        self.tok = CharTokenizer()
        self.pad_id = self.tok.PAD
        self.eos_ids = [self.tok.EOS]

    def encode_prompts(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        ids = [self.tok.encode(p) for p in prompts]
        if len({len(i) for i in ids}) != 1:
            raise ValueError("world prompts must all have the same length")
        t = torch.tensor(ids, dtype=torch.long)
        return t, torch.ones_like(t)

    def sample(self, prompt_ids: Tensor, prompt_mask: Tensor, temperature: float, max_new: int,
               generator: torch.Generator | None) -> Tensor:
        """The decode loop with ``torch.multinomial`` draws from ``generator``, kept at the full
        ``max_new`` width (PAD after the end); temperature == 0 is greedy."""
        max_new = min(max_new, self.model.config.max_len - prompt_ids.shape[1])
        dec = TinyForward(self.model).decoder(prompt_ids, prompt_mask, max_new)
        out = decode(dec, max_new, temperature, self.eos_ids, self.pad_id, generator,
                     draw=multinomial_next, filters=self.filters, prompts=(prompt_ids, prompt_mask))
        return F.pad(out, (0, max_new - out.shape[1]), value=self.pad_id)

    def decode_text(self, ids: Tensor, mask: Tensor) -> str:
        return self.tok.decode(ids.tolist())

    def forward_of(self, model: nn.Module, length: int) -> TinyForward:
        return TinyForward(model)

    def adapters_off(self) -> contextlib.AbstractContextManager:
        return adapters_disabled(self.model)

    @torch.no_grad()
    def pass_probability(self, rows: list[dict], temperature: float) -> Tensor:
        """Exact probability that one sampled answer is right: the world has one right string
        (under the run's ``filters`` where it has any).

        This turns the dead-group prediction p^G + (1-p)^G into a number with no sampling noise.
        """
        prompt_ids, prompt_mask = self.encode_prompts([r["prompt"] for r in rows])
        width = max(len(r["answer"]) for r in rows) + 1
        ans = torch.full((len(rows), width), self.tok.PAD, dtype=torch.long)
        for i, r in enumerate(rows):
            a = self.tok.encode_answer(r["answer"])
            ans[i, : len(a)] = torch.tensor(a)
        mask = (ans != self.tok.PAD).long()
        ro = Rollout(rows, prompt_ids, prompt_mask, ans, mask, [])
        if self.filters == NO_FILTERS or temperature == 0:
            lp = self.logprobs(ro, temperature)
        else:
            logits = completion_logits(TinyForward(self.model), ro, self.device, False)
            lp = sampled_logprobs(logits, ro.completion_ids, temperature, self.filters,
                                  (prompt_ids, prompt_mask))
        return torch.exp(torch.where(ro.completion_mask.bool(), lp, 0.0).sum(-1))

    def state_dict(self) -> dict[str, Any]:
        st = {"model": self.model.state_dict()}
        if self.ref is not None:
            st["ref"] = self.ref.state_dict()
        return st

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if ("ref" in state) != (self.ref is not None):
            raise ValueError("checkpoint and run disagree on lora (adapters vs full weights)")
        self.model.load_state_dict(state["model"])
        if self.ref is not None:
            self.ref.load_state_dict(state["ref"])

    def save_pretrained(self, out_dir: str, state_dict: dict | None = None) -> None:
        """The weights as ``tiny_gpt.pt`` (``state_dict``: a sharded model's, gathered)."""
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        torch.save(self.model.state_dict() if state_dict is None else state_dict,
                   Path(out_dir) / "tiny_gpt.pt")
