"""Rollouts: what a policy backend must do, and the KV-cache sampler of the built-in world.

The trainer only speaks to a ``Backend``: generate answers for text prompts, score completion
tokens under the policy and under the frozen reference. The tiny world and Hugging Face models
(see ``grpolab.hf``) implement the same protocol, so GRPO is written once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .losses import token_logprobs, token_logprobs_and_entropy
from .world import CharTokenizer, TinyGPT, adapters_disabled, add_lora


@dataclass
class Rollout:
    """A batch of sampled answers, row i answering ``prompts[i]``."""

    prompts: list[Any]
    prompt_ids: Tensor  # [B, Tp], left-padded where prompts differ in length
    prompt_mask: Tensor  # [B, Tp] 1 on real prompt tokens
    completion_ids: Tensor  # [B, Tc], PAD after the end
    completion_mask: Tensor  # [B, Tc] 1 on answer tokens, EOS included
    completions: list[str]
    truncated: Tensor | None = None  # [B] bool: cut off at max_new_tokens, no EOS (if known)

    def select(self, idx: list[int]) -> Rollout:
        t = torch.as_tensor(idx, dtype=torch.long)
        return Rollout(
            prompts=[self.prompts[i] for i in idx],
            prompt_ids=self.prompt_ids[t],
            prompt_mask=self.prompt_mask[t],
            completion_ids=self.completion_ids[t],
            completion_mask=self.completion_mask[t],
            completions=[self.completions[i] for i in idx],
            truncated=None if self.truncated is None else self.truncated[t],
        )


def cat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Join rollouts whose prompt/completion widths may differ (left-pad prompts, right-pad answers)."""
    tp = max(r.prompt_ids.shape[1] for r in parts)
    tc = max(r.completion_ids.shape[1] for r in parts)

    def lpad(x: Tensor, w: int, v: int) -> Tensor:
        return torch.nn.functional.pad(x, (w - x.shape[1], 0), value=v)

    def rpad(x: Tensor, w: int, v: int) -> Tensor:
        return torch.nn.functional.pad(x, (0, w - x.shape[1]), value=v)

    return Rollout(
        prompts=[p for r in parts for p in r.prompts],
        prompt_ids=torch.cat([lpad(r.prompt_ids, tp, pad_id) for r in parts]),
        prompt_mask=torch.cat([lpad(r.prompt_mask, tp, 0) for r in parts]),
        completion_ids=torch.cat([rpad(r.completion_ids, tc, pad_id) for r in parts]),
        completion_mask=torch.cat([rpad(r.completion_mask, tc, 0) for r in parts]),
        completions=[c for r in parts for c in r.completions],
        truncated=(None if any(r.truncated is None for r in parts)
                   else torch.cat([r.truncated for r in parts])),
    )


class Backend(Protocol):
    model: nn.Module
    pad_id: int

    def generate(
        self, prompts: list[Any], temperature: float, max_new_tokens: int, generator: torch.Generator
    ) -> Rollout: ...

    def logprobs(self, rollout: Rollout, temperature: float, reference: bool = False) -> Tensor: ...

    def pass_probability(self, rows: list[dict], temperature: float) -> Tensor | None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_pretrained(self, out_dir: str) -> None: ...


def first_eos_mask(ids: Tensor, eos_ids: list[int],
                   pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mask completion tokens up to and including the first EOS (any of ``eos_ids``).

    Returns the ids with PAD after the first EOS and the 0/1 mask, both [B, Tc], and which rows
    have no EOS at all [B] (cut off by the length limit).
    """
    is_eos = torch.isin(ids, torch.as_tensor(eos_ids, dtype=ids.dtype, device=ids.device))
    after = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
    return ids.masked_fill(after, pad_id), (~after).long(), ~is_eos.any(dim=1)


class TinyBackend:
    """The built-in world's policy: TinyGPT + character tokenizer.

    With ``lora`` the policy trains rank-``lora_r`` adapters and the reference is the same model
    with its adapters off; without, every weight trains and the reference is a frozen copy.
    """

    def __init__(
        self, model: TinyGPT, lora: bool = False, lora_r: int = 8, lora_alpha: float = 16,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.ref: TinyGPT | None = None  # None with lora: the reference is adapters-off
        if lora:
            add_lora(model, lora_r, lora_alpha, seed)
        else:
            self.ref = copy.deepcopy(model).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.tok = CharTokenizer()
        self.pad_id = self.tok.PAD

    def encode_prompts(self, prompts: list[str]) -> Tensor:
        ids = [self.tok.encode(p) for p in prompts]
        if len({len(i) for i in ids}) != 1:
            raise ValueError("world prompts must all have the same length")
        return torch.tensor(ids, dtype=torch.long)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        temperature: float,
        max_new_tokens: int,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        """Sample with a KV cache: one prefill, then one single-token step per new token.

        temperature == 0 means greedy decoding (used for held-out accuracy).
        """
        model = self.model
        was_training = model.training
        model.eval()
        prompt_ids = self.encode_prompts(prompts)
        b, tp = prompt_ids.shape
        max_new = min(max_new_tokens, model.config.max_len - tp)
        logits, cache = model(prompt_ids)
        out = torch.full((b, max_new), self.tok.PAD, dtype=torch.long)
        done = torch.zeros(b, dtype=torch.bool)
        for t in range(max_new):
            last = logits[:, -1, :].float()
            if temperature == 0:
                nxt = last.argmax(-1)
            else:
                probs = torch.softmax(last / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            nxt = torch.where(done, torch.full_like(nxt, self.tok.PAD), nxt)
            out[:, t] = nxt
            done |= nxt == self.tok.EOS
            if bool(done.all()) or t == max_new - 1:
                break
            logits, cache = model(nxt[:, None], cache, start=tp + t)
        model.train(was_training)
        ids, mask, cut = first_eos_mask(out, [self.tok.EOS], self.tok.PAD)
        return Rollout(
            prompts=list(prompts),
            prompt_ids=prompt_ids,
            prompt_mask=torch.ones_like(prompt_ids),
            completion_ids=ids,
            completion_mask=mask,
            completions=[self.tok.decode(r.tolist()) for r in ids],
            truncated=cut,
        )

    def logprobs(self, rollout: Rollout, temperature: float, reference: bool = False) -> Tensor:
        """log pi(answer token | prefix) for every completion position, [B, Tc]."""
        return token_logprobs(self._logits(rollout, temperature, reference),
                              rollout.completion_ids)

    def logprobs_and_entropy(self, rollout: Rollout, temperature: float,
                             entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
        """The policy's ``logprobs`` (the same numbers) and the entropy of its next-token
        distribution at each completion position [B, Tc], from one forward."""
        return token_logprobs_and_entropy(self._logits(rollout, temperature, False),
                                          rollout.completion_ids, entropy_grad)

    def _logits(self, rollout: Rollout, temperature: float, reference: bool) -> Tensor:
        full = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
        tp = rollout.prompt_ids.shape[1]
        if not reference:
            logits, _ = self.model(full[:, :-1])
        elif self.ref is not None:
            logits, _ = self.ref(full[:, :-1])
        else:
            with adapters_disabled(self.model):
                logits, _ = self.model(full[:, :-1])
        return logits[:, tp - 1 :, :] / temperature

    @torch.no_grad()
    def pass_probability(self, rows: list[dict], temperature: float) -> Tensor:
        """Exact probability that one sampled answer is right: the world has one right string.

        This turns the dead-group prediction p^G + (1-p)^G into a number with no sampling noise.
        """
        prompt_ids = self.encode_prompts([r["prompt"] for r in rows])
        width = max(len(r["answer"]) for r in rows) + 1
        ans = torch.full((len(rows), width), self.tok.PAD, dtype=torch.long)
        for i, r in enumerate(rows):
            a = self.tok.encode_answer(r["answer"])
            ans[i, : len(a)] = torch.tensor(a)
        mask = (ans != self.tok.PAD).long()
        ro = Rollout(rows, prompt_ids, torch.ones_like(prompt_ids), ans, mask, [])
        lp = self.logprobs(ro, temperature)
        return torch.exp((lp * ro.completion_mask).sum(-1))

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

    def save_pretrained(self, out_dir: str) -> None:
        from pathlib import Path

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        torch.save(self.model.state_dict(), Path(out_dir) / "tiny_gpt.pt")
