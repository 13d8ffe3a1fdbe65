"""What a policy backend must do (``Backend``), and ``LMBackend``, which does it once for every
model stack.

The trainer only speaks to a ``Backend``: generate answers for prompts, score completion tokens
under the policy and under the frozen reference. Every model stack (the world's TinyGPT, a
Hugging Face model's forward, ``grpolab.rollout.fastlm``) drives the same code through one small
interface, ``Forward``:

* ``decoder(ids, mask, max_new, shared)`` prefills prompts and returns a ``Decoder``, whose
  ``logits`` predict the first new token and whose ``step(tokens)`` feeds one token per row;
  ``sampling.decode`` is the sampling loop over it;
* ``logits(ids, attn, pos, keep)`` is one teacher-forced forward; ``prefill`` and ``extend`` run
  each distinct prompt once and hand its keys and values to the rows that share it
  (``logprobs.shared_prefix_logits``, GRPO's G answers of a group).

``LMBackend`` builds ``generate`` and ``logprobs`` on them once: the reference-model choice (a
frozen copy, or the policy with its LoRA adapters off) and the score-a-rollout pass live here.
Backends: ``grpolab.world.backend`` (the built-in world), ``rollout.hf`` (Hugging Face, with
``fastlm``), ``rollout.vllm``. Which prompts a step samples is ``grpolab.run.collect``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from grpolab.config.speed import Speed
from grpolab.rollout.batch import Rollout, first_eos_mask
from grpolab.rollout.head import head_logprobs, token_logprobs, token_logprobs_and_entropy
from grpolab.rollout.logprobs import (
    BUCKET_COST,
    BUCKET_COST_ACCEL,
    answer_lengths,
    bucketed_hidden,
    completion_logits,
    length_buckets,
)
from grpolab.rollout.packed import packed_linear
from grpolab.rollout.sampling import Filters, Forward


class Backend(Protocol):
    """What the trainer needs of a policy (``LMBackend`` implements it for model stacks)."""

    model: nn.Module
    pad_id: int

    def generate(
        self, prompts: list[Any], temperature: float, max_new_tokens: int, generator: torch.Generator
    ) -> Rollout: ...

    def logprobs(self, rollout: Rollout, temperature: float, reference: bool = False) -> Tensor: ...

    def pass_probability(self, rows: list[dict], temperature: float) -> Tensor | None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_pretrained(self, out_dir: str, state_dict: dict | None = None) -> None: ...




def frozen_copy(model: nn.Module) -> nn.Module:
    """The reference of a full fine-tune: a copy of the initial weights, in eval mode, frozen."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class LMBackend:
    """``generate`` and ``logprobs`` written once for every model stack.

    A subclass sets ``model``, ``ref`` (None with LoRA), ``lora``, ``eos_ids``, ``pad_id`` and
    ``device`` (and ``filters`` where its ``sample`` applies them), and provides
    ``encode_prompts`` (-> ids, mask), ``sample`` (-> completion ids),
    ``decode_text``, ``forward_of(model, length)`` (its ``Forward``) and ``adapters_off()``.
    """

    model: nn.Module
    ref: nn.Module | None = None
    lora: bool = False
    eos_ids: list[int]
    pad_id: int
    device: torch.device = torch.device("cpu")
    share_prompts: bool = False  # score each distinct prompt once (needs a Forward.prefill)
    logit_chunk: int = 0  # answer tokens through a plain linear LM head at a time (0: all)
    speed: Speed = Speed(cpu_pack=False)  # the speed paths this backend takes (config's speed)
    # what ``sample`` does to the logits besides the temperature; None: a subclass whose
    # ``sample`` applies no filters (one that does sets them, NO_FILTERS by default)
    filters: Filters | None = None

    @torch.no_grad()
    def generate(self, prompts: list[Any], temperature: float, max_new_tokens: int,
                 generator: torch.Generator | None = None) -> Rollout:
        """Sample one answer per prompt; temperature == 0 decodes greedily."""
        prompt_ids, prompt_mask = self.encode_prompts(list(prompts))
        was_training = self.model.training
        if was_training:  # (a module-tree walk each way: skipped when already in eval mode)
            self.model.eval()
        try:
            completion = self.sample(prompt_ids, prompt_mask, temperature, int(max_new_tokens),
                                     generator)
        finally:
            if was_training:
                self.model.train()
        ids, mask, cut = first_eos_mask(completion.cpu(), self.eos_ids, self.pad_id)
        texts = [self.decode_text(row, m) for row, m in zip(ids, mask)]
        return Rollout(list(prompts), prompt_ids, prompt_mask, ids, mask, texts, cut)

    @contextlib.contextmanager
    def scoring_model(self, reference: bool) -> Iterator[nn.Module]:
        """The policy, or the reference: the frozen copy, else the policy with adapters off."""
        if not reference:
            yield self.model
        elif self.ref is not None:
            yield self.ref
        elif self.lora:
            with self.adapters_off():
                yield self.model
        else:
            raise RuntimeError("no reference model (beta == 0); nothing to compare against")

    def logprobs(self, rollout: Rollout, temperature: float, reference: bool = False) -> Tensor:
        """log pi(answer token | prompt, earlier answer tokens) at every completion position,
        [B, Tc] on the CPU, logits divided by the sampling temperature."""
        with self.scoring_model(reference) as model:
            return self.score(model, rollout, temperature)

    def logprobs_and_entropy(self, rollout: Rollout, temperature: float,
                             entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
        """The policy's ``logprobs`` (the same numbers) and the entropy of its next-token
        distribution at each completion position [B, Tc], from the same forward."""
        return self.score(self.model, rollout, temperature, entropy=entropy_grad)

    def score(self, model: nn.Module, ro: Rollout, temperature: float,
              entropy: bool | None = None) -> Any:
        """The score-a-rollout pass: log-probs [B, Tc]; with ``entropy`` not None also the
        entropies (with autograd when True), as a pair."""
        tc = ro.completion_ids.shape[1]
        if tc == 0:
            zero = torch.zeros(ro.completion_ids.shape)
            return zero if entropy is None else (zero, zero.clone())
        lm = self.forward_of(model, ro.prompt_ids.shape[1] + tc)
        t = temperature if temperature > 0 else 1.0
        share = self.share_prompts and getattr(lm, "shares", True)
        head = lm.linear_head() if self.logit_chunk and hasattr(lm, "linear_head") else None
        if head is not None and not entropy:  # (an entropy bonus needs the full logits)
            linear = packed_linear(*head, self.logit_chunk) if self.speed.cpu_pack else None
            lengths = answer_lengths(ro.completion_mask)
            cost = BUCKET_COST if self.device.type == "cpu" else BUCKET_COST_ACCEL
            buckets = (length_buckets(lengths, cost) if getattr(lm, "rescores", False)
                       and self.speed.length_buckets else [])
            if len(buckets) > 1 or (buckets and sum(lengths) < len(lengths) * tc):
                # answers of unequal length: only their real positions, in a few forwards
                hidden, where = bucketed_hidden(lm.trunk(), ro, self.device, share, buckets,
                                                lengths)
                targets = ro.completion_ids.to(hidden.device).reshape(-1)[where]
                lp, ent = head_logprobs(hidden, *head, targets, 1.0 / t, self.logit_chunk,
                                        entropy=entropy is not None, linear=linear,
                                        grad_in_forward=self.speed.head_grad_in_forward)
                n = ro.completion_ids.numel()
                lp, ent = (x.new_zeros(n).index_copy(0, where, x).view(ro.completion_ids.shape)
                           for x in (lp, ent))
            else:
                hidden = completion_logits(lm.trunk(), ro, self.device, share)
                lp, ent = head_logprobs(hidden, *head, ro.completion_ids.to(hidden.device),
                                        1.0 / t, self.logit_chunk,
                                        entropy=entropy is not None, linear=linear,
                                        grad_in_forward=self.speed.head_grad_in_forward)
        else:
            logits = completion_logits(lm, ro, self.device, share)
            if t != 1.0:  # x / 1 == x: skip a [B, Tc, V] copy
                logits = logits / t
            targets = ro.completion_ids.to(logits.device)
            if entropy is None:
                lp, ent = token_logprobs(logits, targets), None
            else:
                lp, ent = token_logprobs_and_entropy(logits, targets, entropy)
        # Every path scores 0 where the mask is 0 (after an answer's end), so log-probs from
        # different paths (the policy's with an entropy bonus, the reference's) never meet
        # there: exp of their difference could overflow, and inf x mask 0 is NaN.
        real = ro.completion_mask.to(lp.device).bool()
        lp = torch.where(real, lp, 0.0).cpu()
        return lp if entropy is None else (lp, torch.where(real, ent, 0.0).cpu())

    # -- what a subclass provides --
    def encode_prompts(self, prompts: list[Any]) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def sample(self, prompt_ids: Tensor, prompt_mask: Tensor, temperature: float, max_new: int,
               generator: torch.Generator | None) -> Tensor:
        raise NotImplementedError

    def decode_text(self, ids: Tensor, mask: Tensor) -> str:
        raise NotImplementedError

    def forward_of(self, model: nn.Module, length: int) -> Forward:
        """The Forward that runs ``model`` on sequences of ``length`` tokens."""
        raise NotImplementedError

    def adapters_off(self) -> contextlib.AbstractContextManager:
        raise NotImplementedError
