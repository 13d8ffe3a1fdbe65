"""Hugging Face causal LMs as GRPO policies: ``grpolab train`` on a local model and dataset.

``HFBackend`` implements ``sampling.Backend`` for any ``AutoModelForCausalLM`` checkpoint in a
local directory, so the same ``GRPOTrainer`` that runs the workshop trains real models.

* Prompts are strings or chat message lists. With ``use_chat_template`` and a tokenizer that has
  a chat template, prompts are rendered with it (``add_generation_prompt=True``; a plain string
  becomes one user message); otherwise the raw text is tokenized.
* Rollouts are sampled from exactly ``softmax(logits / temperature)``: the checkpoint's own
  sampling defaults (top-k, top-p, repetition penalty, ...) are ignored, because the GRPO ratio
  and KL assume the scored distribution is the sampled one. Scoring uses the same left padding
  and ``position_ids`` as sampling.
* Sampling is a lean loop over the model's forward with its KV cache (``HF generate``'s
  per-token overhead is a large share of a step on small models); identical prompts (the G
  answers of a group) share one prefill, and their prompt is also run once when scoring.
  Models whose forward takes no cache or ``position_ids`` fall back to HF ``generate``.
* For Llama-family (llama, mistral, qwen2) and GPT-2 models, plain or LoRA, both sampling and
  scoring skip the HF forward altogether and run ``grpolab.fastlm``: the same maths over the
  model's own modules, with a static KV cache (the HF forward's own overhead is most of a
  tiny model's step). Other models use the HF forward; ``GRPOLAB_FASTLM=0`` forces it.
* Each call draws a seed from the trainer's generator and samples with a private
  ``torch.Generator``: runs are reproducible and the caller's global RNG is untouched.
* Dropout in the model is switched off (LoRA dropout, if configured, is kept): the policy is
  scored in train mode and the reference in eval mode, and dropout noise would leak into the
  ratio and the KL.
* Reference model: without LoRA a frozen copy of the initial weights (none when ``beta == 0``);
  with LoRA the same model with its adapters disabled, so there is no second copy.
* ``rollout_backend: vllm`` samples with vLLM on a CUDA GPU (optional; see ``VLLMBackend``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .config import Config, ConfigError
from .fastlm import FastLM, base_model, pos_ids
from .losses import token_logprobs, token_logprobs_and_entropy
from .sampling import Rollout, first_eos_mask

log = logging.getLogger("grpolab")


# ----------------------------------------------------------------------------- helpers


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability in ``model`` to 0 (modules and float attention rates)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in ("attention_dropout", "attn_dropout", "dropout"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)


def _eos_ids(tokenizer: Any, model: nn.Module) -> list[int]:
    """Every id that ends an answer: the tokenizer's EOS plus the checkpoint's generation EOS."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for v in (tokenizer.eos_token_id, gen_eos):
        for i in v if isinstance(v, (list, tuple)) else [v]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("the tokenizer has no eos_token; set one so answers can end")
    return ids


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def sample_next(logits: Tensor, temperature: float,
                generator: torch.Generator | None = None) -> Tensor:
    """One token per row of ``logits`` [B, V] from exactly softmax(logits / T); argmax if T == 0.

    Inverse-CDF sampling (one uniform per row against the cumulative probabilities, summed in
    float64) draws from the same distribution as ``torch.multinomial``, which HF ``generate``
    calls, at a fraction of its cost on CPU. Zero-probability tokens are never drawn.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    probs = torch.softmax(logits / temperature if temperature != 1 else logits, dim=-1)
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device,
                   dtype=cdf.dtype)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return idx.squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def draw_seed(generator: torch.Generator | None, high: int) -> int:
    """A seed in [0, high) from ``generator``; without one, from the global RNG, left as it was."""
    if generator is not None:
        return int(torch.randint(0, high, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        return int(torch.randint(0, high, (1,)))


def shared_prompts(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """(unique prompt ids, their mask, row -> unique index) when some rows repeat, else None."""
    key = torch.cat([ids, mask], dim=1)
    uniq, inv = torch.unique(key, dim=0, return_inverse=True)
    if uniq.shape[0] == ids.shape[0]:
        return None
    return uniq[:, : ids.shape[1]], uniq[:, ids.shape[1]:], inv


def fastlm_enabled() -> bool:
    """``GRPOLAB_FASTLM=0`` (or false/no/off) turns the lean forward off: HF forward only."""
    return os.environ.get("GRPOLAB_FASTLM", "1").strip().lower() not in ("0", "false", "no",
                                                                          "off")


# ----------------------------------------------------------------------------- backend


class HFBackend:
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
        use_chat_template: bool = True,
        reference: bool = True,
        seed: int = 0,
        gradient_checkpointing: bool = False,
        max_prompt_tokens: int = 0,
        max_new_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer  # left untouched: prompts are padded here, not by it
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
        self.eos_ids = _eos_ids(tokenizer, model)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        self.use_chat_template = use_chat_template
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
            model = self._wrap_lora(model, lora_r, lora_alpha, lora_dropout,
                                    lora_target_modules or None, seed)
        else:
            for p in model.parameters():
                p.requires_grad_(True)
            if reference:
                self.ref = copy.deepcopy(model).eval()
                for p in self.ref.parameters():
                    p.requires_grad_(False)
        self.model = model
        self.model.eval()
        fwd = self._hf_model().forward
        # transformers 5 renamed ``past_key_values`` to ``cache``; either drives the lean sampler.
        self._cache_kw = next((k for k in ("cache", "past_key_values") if _accepts(fwd, k)), None)
        self._lean = (self._cache_kw is not None and _accepts(fwd, "position_ids")
                      and not getattr(self._hf_model().config, "is_encoder_decoder", False))
        self._keep = _accepts(fwd, "logits_to_keep")
        # The lean forward (grpolab.fastlm) for supported architectures, else None: HF forward.
        self._fast: FastLM | None = None
        self._fast_ref: FastLM | None = None
        if self._lean and fastlm_enabled():
            try:
                self._fast = FastLM(self.model)  # with LoRA also the reference (adapters off)
            except ValueError as why:  # unsupported architecture: the HF forward
                log.debug("fastlm: using the HF forward (%s)", why)
            else:
                if self.ref is not None:  # a deep copy of the model: supported as well
                    self._fast_ref = FastLM(self.ref)

    @staticmethod
    def _wrap_lora(model: nn.Module, r: int, alpha: int, dropout: float,
                   targets: list[str] | None, seed: int) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        # GPT-2's Conv1D layers store weights transposed; peft wants to be told.
        conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())

        def wrap(target: Any) -> nn.Module:
            cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                             target_modules=target, task_type="CAUSAL_LM", fan_in_fan_out=conv1d)
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                torch.manual_seed(seed)  # reproducible adapter init
                # peft 0.21 calls a transformers 5 API that warns on every run; not actionable.
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                        category=FutureWarning)
                return get_peft_model(model, cfg)

        if targets:
            return wrap(targets)
        try:
            return wrap(None)  # peft's per-architecture defaults (e.g. q_proj, v_proj)
        except ValueError:  # architecture unknown to peft
            return wrap("all-linear")

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
        if not chat:
            why = ("use_chat_template is off" if self.has_chat_template
                   else "the tokenizer has no chat template")
            raise ValueError(f"prompts are chat messages but {why}; use plain-text prompts or a "
                             "tokenizer with a chat template")
        text = self.tokenizer.apply_chat_template(prompt, tokenize=False,
                                                  add_generation_prompt=True)
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

    @torch.no_grad()
    def generate(
        self,
        prompts: list[Any],
        temperature: float,
        max_new_tokens: int,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        """Sample one answer per prompt; temperature == 0 decodes greedily.

        A seed is drawn from ``generator`` (without it, read from the global RNG, which is left
        as it was): the same generator state gives the same answers.
        """
        prompt_ids, prompt_mask = self.encode_prompts(list(prompts))
        seed = draw_seed(generator, 2**62)
        was_training = self.model.training
        if was_training:  # (a module-tree walk each way: skipped when already in eval mode)
            self.model.eval()
        try:
            if self._lean:
                completion = self._sample(prompt_ids, prompt_mask, temperature,
                                          int(max_new_tokens), seed)
            else:
                completion = self._hf_generate(prompt_ids, prompt_mask, temperature,
                                               int(max_new_tokens), seed)
        finally:
            if was_training:
                self.model.train()
        completion = completion.cpu()
        if completion.shape[1] == 0:  # nothing generated (max_new_tokens reached by prompt)
            completion = torch.full((len(prompts), 1), self.eos_ids[0], dtype=torch.long)
        ids, mask, cut = first_eos_mask(completion, self.eos_ids, self.pad_id)
        texts = [
            self.tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True)
            for row, m in zip(ids, mask)
        ]
        return Rollout(list(prompts), prompt_ids, prompt_mask, ids, mask, texts, cut)

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self._hf_model().config)  # sliding/hybrid layer types
        except TypeError:  # transformers 4.x
            return DynamicCache()

    def _sample(self, prompt_ids: Tensor, prompt_mask: Tensor, temperature: float,
                max_new: int, seed: int) -> Tensor:
        """The sampling loop: one prefill per distinct prompt, then one cached step per token.

        Rows stop at their first EOS (PAD after it); the loop ends when every row has.
        Returns the completion ids [B, steps taken].
        """
        model, dev = self.model, self.device
        ids, mask = prompt_ids.to(dev), prompt_mask.to(dev)
        b, tp = ids.shape
        if max_new <= 0:
            return ids.new_zeros((b, 0))
        gen = torch.Generator(device=dev).manual_seed(seed)
        fast = self._fast if self._fast is not None and self._fast.fits(tp + max_new) else None
        with torch.inference_mode():
            shared = shared_prompts(ids, mask)
            if fast is not None:
                dec = fast.decoder(ids, mask, max_new, shared)
                logits = dec.logits
            else:
                cache = self._new_cache()
                p_ids, p_mask = (shared[0], shared[1]) if shared else (ids, mask)
                keep = {"logits_to_keep": 1} if self._keep else {}
                logits = model(input_ids=p_ids, attention_mask=p_mask,
                               position_ids=pos_ids(p_mask), use_cache=True, **keep,
                               **{self._cache_kw: cache}).logits[:, -1]
                if shared:  # copy each distinct prompt's cache and logits to its rows
                    cache.batch_select_indices(shared[2])
                    logits = logits[shared[2]]
                full_mask = torch.cat([mask, mask.new_ones((b, max_new))], dim=1)
                pos = mask.sum(dim=1, keepdim=True)  # position of the first new token
            eos = torch.as_tensor(self.eos_ids, device=dev)
            out = torch.full((b, max_new), self.pad_id, dtype=torch.long, device=dev)
            done = torch.zeros(b, dtype=torch.bool, device=dev)
            steps = max_new
            for t in range(max_new):
                nxt = sample_next(logits, temperature, gen).masked_fill(done, self.pad_id)
                out[:, t] = nxt
                done |= torch.isin(nxt, eos)
                if t == max_new - 1 or bool(done.all()):
                    steps = t + 1
                    break
                if fast is not None:
                    logits = dec.step(nxt)
                    continue
                logits = model(input_ids=nxt[:, None], attention_mask=full_mask[:, : tp + t + 1],
                               position_ids=pos + t, use_cache=True,
                               **{self._cache_kw: cache}).logits[:, -1]
        return out[:, :steps].clone()  # a normal tensor, usable outside inference mode

    def _hf_generate(self, prompt_ids: Tensor, prompt_mask: Tensor, temperature: float,
                     max_new: int, seed: int) -> Tensor:
        """HF ``generate`` (fallback for models the lean loop cannot drive); global RNG restored."""
        kwargs: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            kwargs = {"do_sample": True, "temperature": float(temperature), "top_k": 0,
                      "top_p": 1.0}
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

    # ------------------------------------------------------------------ scoring --
    def logprobs(self, rollout: Rollout, temperature: float, reference: bool = False) -> Tensor:
        """log pi(answer token | prompt, earlier answer tokens) at every completion position.

        One forward over [left-padded prompt | completion] with position ids counting only real
        tokens (as sampling does), logits divided by the sampling temperature. [B, Tc] on CPU.
        Rows with identical prompts (GRPO groups) run their prompt once and share its KV cache.
        """
        if reference:
            if self.lora:
                with self.model.disable_adapter():
                    return self._logprobs(self.model, rollout, temperature)
            if self.ref is None:
                raise RuntimeError("no reference model (beta == 0); nothing to compare against")
            return self._logprobs(self.ref, rollout, temperature)
        return self._logprobs(self.model, rollout, temperature)

    def logprobs_and_entropy(self, rollout: Rollout, temperature: float,
                             entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
        """The policy's ``logprobs`` (the same numbers) and the entropy of its next-token
        distribution at each completion position [B, Tc], from the same forward."""
        return self._logprobs(self.model, rollout, temperature, entropy=entropy_grad)

    def _logprobs(self, model: nn.Module, ro: Rollout, temperature: float,
                  entropy: bool | None = None) -> Any:
        """Log-probs [B, Tc]; with ``entropy`` not None also the entropies (with autograd when
        True) as a pair."""
        tc = ro.completion_ids.shape[1]
        if tc == 0:
            zero = torch.zeros(ro.completion_ids.shape)
            return zero if entropy is None else (zero, zero.clone())
        ids = torch.cat([ro.prompt_ids, ro.completion_ids], dim=1)
        attn = torch.cat([ro.prompt_mask, torch.ones_like(ro.completion_ids)], dim=1)
        pos = pos_ids(attn)
        dev = self.device
        # Prompt sharing hands a cache between two forwards; HF turns caches off in training
        # forwards when checkpointing, so then each row is scored in one pass.
        shared = (shared_prompts(ro.prompt_ids, ro.prompt_mask)
                  if self._lean and not self.checkpointing else None)
        fast = self._fast_ref if model is self.ref else self._fast
        if fast is not None and fast.fits(ids.shape[1]):  # (built only when self._lean)
            ids, attn, pos = ids.to(dev), attn.to(dev), pos.to(dev)
            if shared is not None:
                logits = fast.shared_prefix_logits(ids, attn, pos, tc,
                                                   tuple(x.to(dev) for x in shared))
            else:
                logits = fast.logits(ids[:, :-1], attn[:, :-1], pos[:, :-1], keep=tc)
        else:
            if shared is not None:
                logits = self._shared_prefix_logits(model, ids.to(dev), attn.to(dev),
                                                    pos.to(dev), shared, tc)
            else:
                # only the positions that predict answer tokens
                kwargs: dict[str, Any] = {"use_cache": False, **({"logits_to_keep": tc}
                                                                  if self._keep else {})}
                out = model(input_ids=ids[:, :-1].to(dev), attention_mask=attn[:, :-1].to(dev),
                            position_ids=pos[:, :-1].to(dev), **kwargs)
                logits = out.logits[:, -tc:, :]  # prompts are never empty, so tp - 1 >= 0
        t = temperature if temperature > 0 else 1.0
        if t != 1.0:  # x / 1 == x: skip a [B, Tc, V] copy
            logits = logits / t
        if entropy is None:
            return token_logprobs(logits, ro.completion_ids.to(dev)).cpu()
        lp, ent = token_logprobs_and_entropy(logits, ro.completion_ids.to(dev), entropy)
        return lp.cpu(), ent.cpu()

    def _shared_prefix_logits(self, model: nn.Module, ids: Tensor, attn: Tensor, pos: Tensor,
                              shared: tuple[Tensor, Tensor, Tensor], tc: int) -> Tensor:
        """Logits predicting the tc answer tokens, with each distinct prompt run only once.

        The prompt's keys and values (with their autograd history) are copied to the rows that
        share it, so the G answers of a group attend to, and backpropagate into, one prompt pass.
        Same maths as the one-pass forward, (G - 1) / G less prompt compute.
        """
        u_ids, u_mask, inv = (x.to(self.device) for x in shared)
        tp = ids.shape[1] - tc
        cache = self._new_cache()
        out = model(input_ids=u_ids, attention_mask=u_mask, position_ids=pos_ids(u_mask),
                    use_cache=True, **({"logits_to_keep": 1} if self._keep else {}),
                    **{self._cache_kw: cache})
        first = out.logits[:, -1:, :][inv]  # the last prompt position predicts answer token 0
        if tc == 1:
            return first
        cache.batch_select_indices(inv)
        rest = model(input_ids=ids[:, tp:-1], attention_mask=attn[:, :-1],
                     position_ids=pos[:, tp:-1], use_cache=True, **{self._cache_kw: cache})
        return torch.cat([first, rest.logits], dim=1)

    def pass_probability(self, rows: list[dict], temperature: float) -> Tensor | None:
        """Unknown for open-ended answers (many strings can be right): no dead-group prediction."""
        return None

    # -------------------------------------------------------------- checkpoints --
    def _trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def state_dict(self) -> dict[str, Any]:
        """The trainable weights (LoRA adapters, or the whole model); the rest is the checkpoint.

        The reference is not saved: it is the initial checkpoint (or the adapter-free model).
        """
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

    def save_pretrained(self, out_dir: str) -> None:
        """Save a model ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads, and the tokenizer.

        With LoRA the adapters are merged into a copy of the base; the adapters alone are also
        saved under ``out_dir/adapter`` (load with ``peft.PeftModel.from_pretrained``).
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # The checkpoint's generation_config (only hidden during rollouts) is saved as it was.
        self.merged_model().save_pretrained(str(out))
        self.tokenizer.save_pretrained(str(out))
        if self.lora:
            self.model.save_pretrained(str(out / "adapter"))


# ----------------------------------------------------------------------------- vLLM


def check_vllm() -> None:
    """Fail fast, on one line, when vLLM rollouts cannot run here."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        ok = False
    else:
        ok = torch.cuda.is_available()
    if not ok:
        raise ValueError("rollout_backend 'vllm' needs the vllm package and a CUDA GPU; "
                         "use rollout_backend: hf (HF generate, works on CPU)")


class VLLMBackend(HFBackend):
    """HFBackend whose rollouts come from a vLLM engine in this process (TRL's "colocate" mode);
    scoring and training stay in PyTorch.

    Before each ``generate`` the current weights (LoRA merged in, then unmerged) are pushed into
    the engine under the plain model's parameter names, and its prefix cache is reset (cached
    prompt keys were computed by the old weights). Every answer gets its own sampling seed,
    drawn from the trainer's generator, so a group's G answers differ and a run repeats.
    Tested here against a stand-in engine (no GPU): the glue, not vLLM itself. The weight push
    goes through ``llm_engine.model_executor.driver_worker.model_runner.model.load_weights``,
    the path TRL uses; other vLLM versions may need another.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, model_path: str, **kwargs: Any) -> None:
        check_vllm()
        from vllm import LLM

        super().__init__(model, tokenizer, **kwargs)
        self.llm = LLM(model=model_path, gpu_memory_utilization=0.4, enable_prefix_caching=True,
                       seed=int(kwargs.get("seed", 0)))

    def engine_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) of every weight under the plain model's names; call with LoRA merged."""
        for name, p in self.model.named_parameters():
            if "lora_" in name:
                continue
            yield name.removeprefix("base_model.model.").replace(".base_layer", ""), p.data

    def _sync_weights(self) -> None:
        if self.lora:
            self.model.merge_adapter()
        try:
            engine = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
            engine.load_weights(self.engine_weights())
        finally:
            if self.lora:
                self.model.unmerge_adapter()
        self.llm.reset_prefix_cache()

    @torch.no_grad()
    def generate(self, prompts: list[Any], temperature: float, max_new_tokens: int,
                 generator: torch.Generator | None = None) -> Rollout:
        from vllm import SamplingParams

        self._sync_weights()
        prompt_ids, prompt_mask = self.encode_prompts(list(prompts))
        base = draw_seed(generator, 2**31)
        # top_k / top_p left at vLLM's defaults: off, so answers come from softmax(logits / T).
        params = [SamplingParams(temperature=float(temperature), max_tokens=int(max_new_tokens),
                                 seed=(base + i) % 2**31, stop_token_ids=list(self.eos_ids))
                  for i in range(len(prompts))]
        reqs = [{"prompt_token_ids": row[m.bool()].tolist()}
                for row, m in zip(prompt_ids, prompt_mask)]
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        seqs = [list(o.outputs[0].token_ids) or [self.eos_ids[0]] for o in outs]
        comp = torch.full((len(seqs), max(len(s) for s in seqs)), self.pad_id, dtype=torch.long)
        for i, seq in enumerate(seqs):
            comp[i, : len(seq)] = torch.tensor(seq)
        ids, mask, cut = first_eos_mask(comp, self.eos_ids, self.pad_id)
        texts = [self.tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
                 for r, m in zip(ids, mask)]
        return Rollout(list(prompts), prompt_ids, prompt_mask, ids, mask, texts, cut)


# ----------------------------------------------------------------------------- loading


def check_paths(cfg: Config, command: str = "train") -> None:
    """One-line errors for a missing model, dataset or reward, before anything loads."""
    from .models import is_model_source
    from .tasks import is_task

    if not cfg.model_path:
        raise ConfigError(f"grpolab {command} needs model_path (a local Hugging Face model "
                          "folder, a .gguf file or smollm2-135m-instruct)")
    mp = Path(cfg.model_path).expanduser()
    if is_model_source(cfg.model_path):
        pass  # a GGUF file or a known name: models.resolve_model checks and converts it
    elif not mp.exists():
        raise FileNotFoundError(f"model_path {str(mp)!r} does not exist")
    elif not (mp / "config.json").is_file():
        raise FileNotFoundError(f"model_path {str(mp)!r} is not a Hugging Face model directory "
                                "(no config.json)")
    if not (cfg.dataset or (command == "eval" and cfg.eval_dataset)):
        raise ConfigError(f"grpolab {command} needs dataset (a local .jsonl/.parquet/.csv file "
                          "or reasoning_gym:<task>)")
    for name in ("dataset", "eval_dataset"):
        value = getattr(cfg, name)
        if value and not is_task(value) and not Path(value).expanduser().exists():
            raise FileNotFoundError(f"{name} {value!r} does not exist")
    if not cfg.rewards:
        raise ConfigError("rewards is empty; name at least one reward (e.g. math, format)")


def load_rewards(cfg: Config) -> tuple[list[Any], Any]:
    """The run's reward functions and its reward-hacking watch check (None when off)."""
    from .rewards import load_reward

    def one(spec: str) -> Any:
        return load_reward(spec, cfg.format_pattern or None, cfg.answer_sources)

    return [one(s) for s in cfg.rewards], (one(cfg.watch_reward) if cfg.watch_reward else None)


def load_model(path: str, device: str | None = None, dtype: str = "float32",
               cache_dir: str = "") -> tuple[nn.Module, Any]:
    """Model (in ``dtype``) and tokenizer from a local folder, a ``.gguf`` file or a known name
    (``grpolab.models``); never touches the network."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import resolve_model

    path = resolve_model(str(path), cache_dir)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                 dtype=getattr(torch, dtype))
    return model.to(dev), tok


def make_backend(cfg: Config, model: nn.Module, tokenizer: Any) -> HFBackend:
    kwargs: dict[str, Any] = {
        "lora": cfg.lora, "lora_r": cfg.lora_r, "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "lora_target_modules": list(cfg.lora_target_modules) or None,
        "use_chat_template": cfg.use_chat_template, "reference": cfg.beta > 0, "seed": cfg.seed,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "max_prompt_tokens": cfg.max_prompt_tokens, "max_new_tokens": cfg.max_new_tokens,
    }
    if cfg.rollout_backend == "vllm":
        return VLLMBackend(model, tokenizer, str(Path(cfg.model_path).expanduser()), **kwargs)
    return HFBackend(model, tokenizer, **kwargs)


def run_train(cfg: Config, resume: bool = False) -> Any:
    """``grpolab train``: GRPO on a local HF model and dataset; returns the ``GRPOTrainer``.

    Writes ``metrics.jsonl``, ``checkpoints/last.pt``, ``train.png``, ``summary.json`` and the
    final model (LoRA merged) plus tokenizer in ``<out_dir>/final``.
    """
    import json

    from . import dist
    from .data import run_rows
    from .report import plot_run, read_metrics, summarize
    from .trainer import GRPOTrainer

    check_paths(cfg)
    if cfg.rollout_backend == "vllm":
        check_vllm()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not cfg.progress:  # --no-progress also quiets the weight loading/saving bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    rows, heldout = run_rows(cfg)
    reward_fns, watch = load_rewards(cfg)

    model, tok = load_model(str(Path(cfg.model_path).expanduser()), dtype=cfg.dtype,
                            cache_dir=cfg.cache_dir)
    if cfg.dtype != "float32" and not cfg.lora and dist.is_main():
        log.warning("full fine-tuning in %s: weights and Adam states stay in %s, and updates "
                    "below its resolution are lost; LoRA adapters train in float32", cfg.dtype,
                    cfg.dtype)
    backend = make_backend(cfg, model, tok)
    backend.render(rows[0]["prompt"])  # chat prompts without a chat template fail here, early
    trainer = GRPOTrainer(cfg, backend, rows, reward_fns, heldout, out_dir=cfg.out_dir,
                          watch_fn=watch)
    trainer.train(resume=resume)
    if not dist.is_main():  # under torchrun rank 0 alone writes the model, plot and summary
        return trainer

    out = trainer.out_dir
    backend.save_pretrained(str(out / "final"))
    metrics = read_metrics(out / "metrics.jsonl")
    name = Path(cfg.model_path).name
    plot_run(metrics, out / "train.png",
             f"GRPO on {name}: G={cfg.group_size}, {cfg.prompts_per_step} prompts per step"
             f"{' (LoRA)' if cfg.lora else ''}", lengths=True)
    summary = {"model_path": cfg.model_path, "lora": cfg.lora, **summarize(metrics)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    acc = (f", held-out accuracy {summary['start_heldout_acc']:.3f} -> "
           f"{summary['final_heldout_acc']:.3f}" if heldout else " (no eval_dataset)")
    if "start_heldout_check_acc" in summary:
        acc += (f"; strict check ({cfg.watch_reward}) {summary['start_heldout_check_acc']:.3f} -> "
                f"{summary['final_heldout_check_acc']:.3f}")
        if summary["hacking_suspected_steps"]:
            acc += f"; REWARD HACKING SUSPECTED at steps {summary['hacking_suspected_steps']}"
    print(f"trained {summary['steps']} steps: mean reward {summary['mean_reward']:.3f}{acc}")
    print(f"wrote {out}/metrics.jsonl, {out}/train.png and the model in {out}/final")
    return trainer
