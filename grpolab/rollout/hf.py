"""Hugging Face causal LMs as GRPO policies (the backend of ``grpolab train`` and ``eval``).

``HFBackend`` implements ``rollout.backend.Backend`` for any ``AutoModelForCausalLM`` checkpoint in a
local directory, so the same ``GRPOTrainer`` that runs the workshop trains real models.

* Prompts are strings or chat message lists. Chat messages are rendered with the tokenizer's
  chat template (``add_generation_prompt=True``, ``chat_template_kwargs``); a plain string too
  as one user message with ``use_chat_template``, else as written (TRL's way).
* Rollouts are sampled from ``softmax(logits / temperature)`` with the run's ``Filters``
  only (the checkpoint's own sampling defaults are ignored). Scoring uses the same left padding
  and ``position_ids`` as sampling.
* Sampling is ``sampling.decode`` (the one decode loop) over the model's forward with its KV
  cache (``HF generate``'s per-token overhead is a large share of a step on small models);
  identical prompts (the G answers of a group) share one prefill, and their prompt is also run
  once when scoring (``logprobs.shared_prefix_logits``). ``HFForward`` is the HF forward behind
  the ``sampling.Forward`` interface. Models whose forward takes no cache or ``position_ids``
  fall back to HF ``generate``.
* For Llama-family (llama, mistral, qwen2) and GPT-2 models, plain or LoRA, both sampling and
  scoring skip the HF forward altogether and run ``grpolab.rollout.fastlm``: the same maths over the
  model's own modules, with a static KV cache (the HF forward's own overhead is most of a
  tiny model's step). Other models use the HF forward; ``speed.lean_forward`` off forces it.
* Scoring through fastlm with a plain linear head never holds the [tokens, vocabulary] logits:
  ``logit_chunk`` answer tokens go through the head at a time (``head.head_logprobs``).
* Each call draws a seed from the trainer's generator and samples with a private
  ``torch.Generator``: runs are reproducible and the caller's global RNG is untouched.
* Dropout in the model is off (LoRA's, if configured, is kept): the policy is scored in train
  mode, the reference in eval mode, and dropout noise would leak into the ratio and the KL.
* Reference model: without LoRA a frozen copy of the initial weights (none when ``beta == 0``);
  with LoRA the same model with its adapters disabled, so there is no second copy.
* ``rollout_backend: vllm`` samples with vLLM on a CUDA GPU (``grpolab.rollout.vllm``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpolab.config import ConfigError, Speed
from grpolab.rollout.backend import LMBackend, frozen_copy
from grpolab.rollout.batch import pos_ids, shared_prompts
from grpolab.rollout.fastlm import FastLM, base_model
from grpolab.rollout.graphdecode import GraphSampler
from grpolab.rollout.models import disable_dropout, eos_ids, wrap_lora
from grpolab.rollout.sampling import NO_FILTERS, Filters, decode, draw_seed, drop_due

log = logging.getLogger("grpolab")


# ----------------------------------------------------------------------------- helpers


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ----------------------------------------------------------------------------- HF forward


class HFForward:
    """A transformers model's own forward behind ``sampling.Forward`` (KV cache, left padding
    through ``attention_mask`` and ``position_ids``)."""

    def __init__(self, backend: HFBackend, model: nn.Module) -> None:
        self.model, self.cache_kw, self.keep_kw = model, backend._cache_kw, backend._keep
        self.config = backend._hf_model().config
        # HF turns caches off in training forwards when checkpointing: then each row is scored
        # in one pass, its prompt included
        self.shares = not backend.checkpointing

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.config)  # sliding/hybrid layer types
        except TypeError:  # transformers 4.x
            return DynamicCache()

    def decoder(self, ids: Tensor, mask: Tensor, max_new: int,
                shared: tuple[Tensor, Tensor, Tensor] | None = None) -> HFDecoder:
        return HFDecoder(self, ids, mask, max_new, shared)

    def logits(self, ids: Tensor, attn: Tensor, pos: Tensor, keep: int) -> Tensor:
        # only the positions that predict answer tokens
        kwargs: dict[str, Any] = {"use_cache": False,
                                  **({"logits_to_keep": keep} if self.keep_kw else {})}
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, **kwargs)
        return out.logits[:, -keep:, :]  # prompts are never empty, so tp - 1 >= 0

    def prefill(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, Any]:
        cache = self.new_cache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos_ids(mask),
                         use_cache=True, **({"logits_to_keep": 1} if self.keep_kw else {}),
                         **{self.cache_kw: cache})
        return out.logits[:, -1:, :], cache

    def extend(self, cache: Any, rows: Tensor, ids: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
        cache.batch_select_indices(rows)
        return self.model(input_ids=ids, attention_mask=attn[:, :-1], position_ids=pos,
                          use_cache=True, **{self.cache_kw: cache}).logits


class HFDecoder:
    """Decode state over the HF forward: a DynamicCache, each distinct prompt prefilled once."""

    def __init__(self, fwd: HFForward, ids: Tensor, mask: Tensor, max_new: int,
                 shared: tuple[Tensor, Tensor, Tensor] | None) -> None:
        self.fwd = fwd
        p_ids, p_mask = (shared[0], shared[1]) if shared else (ids, mask)
        logits, self.cache = fwd.prefill(p_ids, p_mask)
        logits = logits[:, -1]
        if shared:  # copy each distinct prompt's cache and logits to its rows
            self.cache.batch_select_indices(shared[2])
            logits = logits[shared[2]]
        self.logits = logits
        b, self.tp = ids.shape
        self.full_mask = torch.cat([mask, mask.new_ones((b, max_new))], dim=1)
        self.pos = mask.sum(dim=1, keepdim=True)  # position of the first new token
        self.t = 0

    def shrink(self, done: Tensor) -> Tensor | None:
        """Stop computing finished rows (see ``sampling.Decoder``)."""
        if not drop_due(done):
            return None
        keep = ~done
        idx = keep.nonzero().squeeze(1)
        self.cache.batch_select_indices(idx)
        self.full_mask, self.pos = self.full_mask[idx], self.pos[idx]
        return keep

    def step(self, tokens: Tensor) -> Tensor:
        t = self.t
        self.t += 1
        return self.fwd.model(input_ids=tokens[:, None],
                              attention_mask=self.full_mask[:, : self.tp + t + 1],
                              position_ids=self.pos + t, use_cache=True,
                              **{self.fwd.cache_kw: self.cache}).logits[:, -1]


# ----------------------------------------------------------------------------- backend


class HFBackend(LMBackend):
    """A Hugging Face causal LM (optionally with LoRA adapters) behind the ``Backend`` protocol.

    ``model`` is what the trainer optimises: the plain model, or the ``PeftModel`` whose only
    trainable parameters are the adapters. Rollout tensors live on the CPU; the model may sit on
    a GPU (logprobs are returned on the CPU, gradients flow back through the copy).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        lora: bool = False,
        lora_r: int = 8,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        lora_target_modules: list[str] | None = None,
        lora_options: dict[str, Any] | None = None,
        use_chat_template: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        reference: bool = True,
        seed: int = 0,
        gradient_checkpointing: bool = False,
        max_prompt_tokens: int = 0,
        max_new_tokens: int = 0,
        logit_chunk: int = 256,
        speed: Speed | None = None,
        filters: Filters = NO_FILTERS,
    ) -> None:
        self.tokenizer = tokenizer  # left untouched: prompts are padded here, not by it
        self.logit_chunk = logit_chunk
        self.speed, self.filters = speed or Speed(), filters
        self.max_prompt_tokens = max_prompt_tokens
        self._warned_long = False
        # Prompt + answer must fit the model's positions (GPT-2 has 1024 and fails past them;
        # a RoPE model runs on, untrained). The trainer raises max_new_tokens to its own.
        self.max_positions: int | None = getattr(getattr(model, "config", None),
                                                 "max_position_embeddings", None)
        self.max_new_tokens = max_new_tokens
        if self.max_positions and max_new_tokens >= self.max_positions:
            raise ConfigError(f"max_new_tokens {max_new_tokens} does not fit the model's "
                              f"{self.max_positions} positions with room for a prompt; lower it")
        self.eos_ids = eos_ids(tokenizer, model)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        self.use_chat_template, self.template_kwargs = use_chat_template, chat_template_kwargs or {}
        self.device = next(model.parameters()).device
        disable_dropout(model)
        self.checkpointing = gradient_checkpointing
        if gradient_checkpointing:  # recompute activations in backward: memory for time
            kw = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        self.lora = lora
        self.ref: nn.Module | None = None
        if lora:
            model = wrap_lora(model, lora_r, lora_alpha, lora_dropout,
                              lora_target_modules or None, seed, **(lora_options or {}))
        else:
            for p in model.parameters():
                p.requires_grad_(True)
            if reference:
                self.ref = frozen_copy(model)
        self.model = model
        self.model.eval()
        fwd = self._hf_model().forward
        # transformers 5 renamed ``past_key_values`` to ``cache``; either drives the lean sampler.
        self._cache_kw = next((k for k in ("cache", "past_key_values") if _accepts(fwd, k)), None)
        self._lean = (self._cache_kw is not None and _accepts(fwd, "position_ids")
                      and not getattr(self._hf_model().config, "is_encoder_decoder", False))
        self._keep = _accepts(fwd, "logits_to_keep")
        # The lean forward (grpolab.rollout.fastlm) for supported architectures, else None: HF forward.
        self._fast: FastLM | None = None
        self._fast_ref: FastLM | None = None
        self._graphs = GraphSampler()  # CUDA: graph decoding's state, kept between calls
        if self._lean and self.speed.lean_forward:
            try:
                self._fast = FastLM(self.model)  # with LoRA also the reference (adapters off)
            except ValueError as why:  # unsupported architecture: the HF forward
                log.debug("fastlm: using the HF forward (%s)", why)
            else:
                self._fast.pack, self._fast.score_pack = self.speed.cpu_pack, self.speed.score_pack
                if self.ref is not None:  # a deep copy of the model: supported as well
                    self._fast_ref = FastLM(self.ref)
                    self._fast_ref.pack = self.speed.cpu_pack
                    self._fast_ref.score_pack = self.speed.score_pack

    # ------------------------------------------------------------------ prompts --
    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, prompt: Any) -> tuple[str, bool]:
        """Prompt -> (text, whether the text already holds the special tokens)."""
        chat = self.use_chat_template and self.has_chat_template
        if isinstance(prompt, str) and not chat:
            return prompt, False
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not self.has_chat_template:  # (chat messages take it even when text prompts do not)
            raise ValueError("prompts are chat messages but the tokenizer has no chat template; "
                             "use plain-text prompts, or set chat_template")
        try:
            text = self.tokenizer.apply_chat_template(prompt, tokenize=False,
                                                      add_generation_prompt=True,
                                                      **self.template_kwargs)
        except Exception as e:  # the template's own failure (a SecurityError, say): one line
            if not type(e).__module__.startswith("jinja2"):
                raise
            raise ValueError(f"the tokenizer's chat template failed: {type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]}") from None
        return text, True

    def encode_prompts(self, prompts: list[Any]) -> tuple[Tensor, Tensor]:
        """Left-padded prompt ids and attention mask, [B, Tp] each (CPU)."""
        rendered = [self.render(p) for p in prompts]
        known: dict[tuple[str, bool], list[int]] = {}  # a group's G prompts are tokenized once
        seqs = []
        for text, templated in rendered:
            ids = known.get((text, templated))
            if ids is None:
                ids = self.tokenizer(text, add_special_tokens=not templated)["input_ids"]
                if not ids:
                    raise ValueError(f"prompt {text[:60]!r} tokenizes to nothing")
                limit, why = self.max_prompt_tokens, f"max_prompt_tokens={self.max_prompt_tokens}"
                room = (self.max_positions - self.max_new_tokens) if self.max_positions else 0
                if room > 0 and (not limit or room < limit):
                    limit, why = room, (f"the model's {self.max_positions} positions less "
                                        f"max_new_tokens {self.max_new_tokens}")
                if limit and len(ids) > limit:  # keep the end: the question, the turn to answer
                    if not self._warned_long:
                        log.warning("prompts over %d tokens (%s) are cut from the left; the "
                                    "first had %d tokens (raise --max-prompt-tokens, or 0 for "
                                    "the model's own limit)", limit, why, len(ids))
                        self._warned_long = True
                    ids = ids[-limit:]
                known[(text, templated)] = ids
            seqs.append(ids)
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
        return ids, mask

    # --------------------------------------------------------------- generation --
    def _hf_model(self) -> nn.Module:
        """The transformers model under any peft wrapper (its generation_config is used)."""
        return base_model(self.model)

    @contextlib.contextmanager
    def _plain_sampling(self) -> Iterator[None]:
        """Sample from softmax(logits / T) only: hide the checkpoint's generation defaults."""
        from transformers import GenerationConfig

        hf = self._hf_model()
        saved = hf.generation_config
        hf.generation_config = GenerationConfig(
            eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
            bos_token_id=getattr(saved, "bos_token_id", None),
        )
        try:
            yield
        finally:
            hf.generation_config = saved

    @property
    def share_prompts(self) -> bool:  # type: ignore[override]
        """Score each distinct prompt once (``HFForward.shares`` says whether the HF forward
        can)."""
        return self._lean

    def forward_of(self, model: nn.Module, length: int) -> Any:
        """fastlm for the policy or the reference copy when it can run them, else (and for any
        other model, such as PPO's critic) the HF forward (with LoRA the reference is the policy
        with adapters off, as fastlm is)."""
        fast = {id(self.model): self._fast, id(self.ref): self._fast_ref}.get(id(model))
        if fast is not None and fast.fits(length):  # (built only when self._lean)
            return fast
        return HFForward(self, model)

    def adapters_off(self) -> contextlib.AbstractContextManager:
        return self.model.disable_adapter()

    def decode_text(self, ids: Tensor, mask: Tensor) -> str:
        return self.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)

    def sample(self, prompt_ids: Tensor, prompt_mask: Tensor, temperature: float, max_new: int,
               generator: torch.Generator | None) -> Tensor:
        """Completion ids [B, steps]. A seed is drawn from ``generator`` (without it, read from
        the global RNG, which is left as it was): the same generator state gives the same
        answers."""
        seed = draw_seed(generator, 2**62)
        if self._lean:
            completion = self._sample(prompt_ids, prompt_mask, temperature, max_new, seed)
        else:
            completion = self._hf_generate(prompt_ids, prompt_mask, temperature, max_new, seed)
        if completion.shape[1] == 0:  # nothing generated (max_new_tokens reached by prompt)
            completion = torch.full((len(prompt_ids), 1), self.eos_ids[0], dtype=torch.long)
        return completion

    def _sample(self, prompt_ids: Tensor, prompt_mask: Tensor, temperature: float,
                max_new: int, seed: int) -> Tensor:
        """``sampling.decode`` over fastlm or the HF forward, from a private generator; on the
        GPU's layout the fixed-shape loop of kept CUDA graphs (``graphdecode.GraphSampler``)."""
        dev = self.device
        ids, mask = prompt_ids.to(dev), prompt_mask.to(dev)
        b, tp = ids.shape
        if max_new <= 0:
            return ids.new_zeros((b, 0))
        gen = torch.Generator(device=dev).manual_seed(seed)
        lm = self.forward_of(self.model, tp + max_new)
        with torch.inference_mode():
            if self.speed.graph_decode and isinstance(lm, FastLM) and lm.on_cuda_layout():
                out = self._graphs.sample(lm, ids, mask, max_new, temperature, self.eos_ids,
                                          self.pad_id, gen, self.filters)
            else:
                dec = lm.decoder(ids, mask, max_new, shared_prompts(ids, mask))
                out = decode(dec, max_new, temperature, self.eos_ids, self.pad_id, gen,
                             early_exit=self.speed.early_exit, filters=self.filters,
                             prompts=(ids, mask))
        return out.clone()  # a normal tensor, usable outside inference mode

    def _hf_generate(self, prompt_ids: Tensor, prompt_mask: Tensor, temperature: float,
                     max_new: int, seed: int) -> Tensor:
        """HF ``generate`` (fallback for models the lean loop cannot drive); global RNG restored."""
        f = self.filters
        kwargs: dict[str, Any] = {"do_sample": False, "repetition_penalty": f.repetition_penalty}
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=float(temperature), top_k=f.top_k,
                          top_p=f.top_p, min_p=f.min_p or None)
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self._plain_sampling():
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=prompt_ids.to(self.device),
                attention_mask=prompt_mask.to(self.device),
                max_new_tokens=max_new,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_ids,
                use_cache=True,
                **kwargs,
            )
        return out[:, prompt_ids.shape[1]:]

    def pass_probability(self, rows: list[dict], temperature: float) -> None:
        return None  # open-ended answers (many strings can be right): no exact prediction

    # -------------------------------------------------------------- checkpoints --
    def _trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def state_dict(self) -> dict[str, Any]:
        """The trainable weights (LoRA adapters, or the whole model). The reference is not
        saved: it is the initial checkpoint (or the adapter-free model)."""
        return {"lora": self.lora,
                "trainable": {n: p.detach().cpu().clone() for n, p in self._trainable().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if bool(state.get("lora")) != self.lora:
            raise ValueError(f"checkpoint was written with lora={state.get('lora')}, "
                             f"this run has lora={self.lora}")
        want = self._trainable()
        got = state["trainable"]
        missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        with torch.no_grad():
            for n, p in want.items():
                p.copy_(got[n])

    def merged_model(self) -> nn.Module:
        """A plain transformers model with the trained weights (LoRA merged into a copy)."""
        if not self.lora:
            return self.model
        return copy.deepcopy(self.model).merge_and_unload()

    def save_pretrained(self, out_dir: str, state_dict: dict | None = None) -> None:
        """Save a model ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads, and the tokenizer.

        With LoRA the adapters are merged into a copy of the base; the adapters alone are also
        saved under ``out_dir/adapter`` (load with ``peft.PeftModel.from_pretrained``).
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # The checkpoint's generation_config (only hidden during rollouts) is saved as it was.
        # (state_dict: the full weights of a sharded model, gathered by the caller)
        self.merged_model().save_pretrained(str(out), state_dict=state_dict)
        self.tokenizer.save_pretrained(str(out))
        if self.lora:
            self.model.save_pretrained(str(out / "adapter"))
