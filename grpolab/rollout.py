"""Rollouts: what a policy backend must do, the one decode loop and the one scoring pass.

The trainer only speaks to a ``Backend``: generate answers for prompts, score completion tokens
under the policy and under the frozen reference. Every model stack (the world's TinyGPT, a
Hugging Face model's forward, ``grpolab.fastlm``) drives the same code through one small
interface, ``Forward``:

* ``decoder(ids, mask, max_new, shared)`` prefills prompts and returns a ``Decoder``, whose
  ``logits`` predict the first new token and whose ``step(tokens)`` feeds one token per row;
  ``decode`` is the sampling loop over it (the only one; finished rows leave a decoder that
  can ``shrink``);
* ``logits(ids, attn, pos, keep)`` is one teacher-forced forward; ``prefill`` and ``extend`` run
  each distinct prompt once and hand its keys and values to the rows that share it
  (``shared_prefix_logits``, GRPO's G answers of a group). Where one prefill serves several
  extends (``rescores``), answers of unequal length are scored in length buckets, real
  positions only (``bucketed_hidden``).

``LMBackend`` builds ``generate`` and ``logprobs`` on them once: the reference-model choice (a
frozen copy, or the policy with its LoRA adapters off) and the score-a-rollout pass live here.
Backends: ``world_backend`` (the built-in world), ``hf_backend`` (Hugging Face, with ``fastlm``),
``vllm_backend``. Which prompts a step samples, and dynamic sampling, are in ``collect``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .losses import head_logprobs, token_logprobs, token_logprobs_and_entropy
from .packed import packed_linear


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


def micro_batches(ro: Rollout, adv: Tensor, size: int) -> list[tuple[Rollout, Tensor]]:
    """``ro`` and its advantages in runs of ``size`` rows (all at once when 0), each cut to its
    longest answer: an update's memory is bounded by one of them."""
    n = len(ro.prompts)
    if not size or size >= n:
        return [(ro, adv)]
    out = []
    for lo in range(0, n, size):
        part = ro.select(list(range(lo, min(lo + size, n))))
        width = max(int(part.completion_mask.sum(1).max()), 1)
        part.completion_ids = part.completion_ids[:, :width]
        part.completion_mask = part.completion_mask[:, :width]
        out.append((part, adv[lo : lo + size]))
    return out


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


def pos_ids(mask: Tensor) -> Tensor:
    """Position ids that count only real tokens (left padding gets 0), as ``generate`` uses."""
    return (mask.cumsum(dim=1) - 1).masked_fill(mask == 0, 0)


def shared_prompts(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """(unique prompt ids, their mask, row -> unique index) when some rows repeat, else None."""
    key = torch.cat([ids, mask], dim=1)
    uniq, inv = torch.unique(key, dim=0, return_inverse=True)
    if uniq.shape[0] == ids.shape[0]:
        return None
    return uniq[:, : ids.shape[1]], uniq[:, ids.shape[1]:], inv


# ----------------------------------------------------------------------------- sampling

Draw = Callable[[Tensor, float, "torch.Generator | None"], Tensor]


SAMPLE_BLOCK = 256  # vocabulary entries per block of sample_next's two-level search


def sample_next(logits: Tensor, temperature: float,
                generator: torch.Generator | None = None) -> Tensor:
    """One token per row of ``logits`` [B, V] from exactly softmax(logits / T); argmax if T == 0.

    Inverse-CDF sampling (one uniform per row against the cumulative probabilities, summed in
    float64) draws from the same distribution as ``torch.multinomial``, which HF ``generate``
    calls, at a fraction of its cost on CPU. Zero-probability tokens are never drawn.

    Large vocabularies are searched in two levels: ``SAMPLE_BLOCK``-token blocks (each summed in
    float32, the softmax's own precision, then accumulated in float64), then within the chosen
    block in float64. This avoids [B, V] float64 copies, which cost 10-20 ms a step at
    32 x 49152 on a 2-core CPU; a block's mass moves by ~1e-7 of itself at most.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    probs = torch.softmax(logits / temperature if temperature != 1 else logits, dim=-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device,
                   dtype=torch.float64)
    b, v = probs.shape
    blk = SAMPLE_BLOCK
    if v <= 4 * blk:
        return _inverse_cdf(probs, u)
    nb = -(-v // blk)
    padded = probs if v % blk == 0 else F.pad(probs, (0, nb * blk - v))  # zero-prob tail
    blocks = padded.view(b, nb, blk)
    cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [B, nb]
    target = u * cdf[:, -1:]
    j = torch.searchsorted(cdf, target, right=True).clamp_(max=nb - 1)  # [B, 1]
    start = torch.where(j > 0, cdf.gather(1, (j - 1).clamp(min=0)), 0.0)
    inner = blocks.gather(1, j[:, :, None].expand(b, 1, blk))[:, 0].double().cumsum(dim=-1)
    k = torch.searchsorted(inner + start, target, right=True).clamp_(max=blk - 1)
    idx = (j * blk + k).clamp_(max=v - 1)
    bad = probs.gather(1, idx)[:, 0] == 0  # a rounding edge at a block's end: search in full
    if bool(bad.any()):
        idx[bad] = _inverse_cdf(probs[bad], u[bad])[:, None]
    return idx.squeeze(-1)


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Token [B] whose float64 cumulative probability first exceeds u [B, 1] of the total."""
    cdf = probs.double().cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return idx.squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def multinomial_next(logits: Tensor, temperature: float,
                     generator: torch.Generator | None = None) -> Tensor:
    """The same distribution as ``sample_next`` drawn with ``torch.multinomial``: the world's
    sampler (its recorded runs come from this random stream)."""
    last = logits.float()
    if temperature == 0:
        return last.argmax(-1)
    probs = torch.softmax(last / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def draw_seed(generator: torch.Generator | None, high: int) -> int:
    """A seed in [0, high) from ``generator``; without one, from the global RNG, left as it was."""
    if generator is not None:
        return int(torch.randint(0, high, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        return int(torch.randint(0, high, (1,)))


class Decoder(Protocol):
    """Sampling state of one batch: ``logits`` [B, V] predict each row's next token.

    A decoder may also have ``shrink(done) -> keep or None``: told which of the rows it computes
    have finished ([n] bool), it may stop computing them (returning the [n] mask of rows kept,
    after which ``step`` takes and returns those rows only) or carry on (None).
    """

    logits: Tensor

    def step(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens`` [B]; the logits [B, V] for the token after them."""
        ...


# A decoder drops finished rows once they are this share of the rows it computes: dropping
# copies the KV cache, so it is done a few times a call, not at every finished row.
DROP_SHARE = 0.25
# False: the decode loop never asks a decoder to drop finished rows (for benchmarks).
EARLY_EXIT = True


def drop_due(done: Tensor, share: float | None = None) -> bool:
    """Whether the finished rows ``done`` [n] are at least ``share`` (default ``DROP_SHARE``)
    of the n rows, and at least one."""
    share = DROP_SHARE if share is None else share
    return int(done.sum()) >= max(1.0, share * done.shape[0])


class Forward(Protocol):
    """The small interface each model stack gives the decode loop and the scoring pass."""

    def decoder(self, ids: Tensor, mask: Tensor, max_new: int,
                shared: tuple[Tensor, Tensor, Tensor] | None = None) -> Decoder: ...

    def logits(self, ids: Tensor, attn: Tensor, pos: Tensor, keep: int) -> Tensor: ...

    def prefill(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, Any]: ...

    def extend(self, state: Any, rows: Tensor, ids: Tensor, attn: Tensor,
               pos: Tensor) -> Tensor: ...


def decode(dec: Decoder, max_new: int, temperature: float, eos_ids: list[int], pad_id: int,
           generator: torch.Generator | None = None, draw: Draw = sample_next) -> Tensor:
    """The decode loop: draw a token per row, feed it, until every row has ended or max_new.

    Rows stop at their first EOS (PAD after it). Returns the completion ids [B, steps taken].
    Finished rows leave the decoder's batch where it can ``shrink``; every row is still drawn
    for (finished ones on their last logits, then masked), so the random stream is that of the
    loop without early exit, and so is every answer up to float rounding (a matmul over fewer
    rows may round differently, and a draw at a probability boundary could then flip).
    """
    logits = dec.logits
    b, dev = logits.shape[0], logits.device
    eos = torch.as_tensor(eos_ids, device=dev)
    out = torch.full((b, max_new), pad_id, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    shrink = getattr(dec, "shrink", None) if EARLY_EXIT else None
    live: Tensor | None = None  # the rows the decoder still computes (None: all)
    steps = max_new
    for t in range(max_new):
        nxt = draw(logits, temperature, generator).masked_fill(done, pad_id)
        out[:, t] = nxt
        done |= torch.isin(nxt, eos)
        if t == max_new - 1 or bool(done.all()):
            steps = t + 1
            break
        feed = nxt if live is None else nxt[live]
        keep = None if shrink is None else shrink(done if live is None else done[live])
        if keep is not None:
            if live is None:
                live, logits = torch.arange(b, device=dev), logits.clone()
            live, feed = live[keep], feed[keep]
        new = dec.step(feed)
        logits = new if live is None else logits.index_copy_(0, live, new)
    return out[:, :steps]


# ----------------------------------------------------------------------------- scoring


def shared_prefix_logits(lm: Forward, ids: Tensor, attn: Tensor, pos: Tensor, tc: int,
                         shared: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Logits [B, tc, V] predicting the last tc tokens of ``ids``, each distinct prompt run once.

    ``shared`` = (distinct prompt ids, their mask, row -> distinct index). The prompts' keys and
    values (with their autograd history) go to the rows that share them, so the G answers of a
    group attend to, and backpropagate into, one prompt pass: the maths of the one-pass
    forward, (G - 1) / G less prompt compute.
    """
    u_ids, u_mask, inv = shared
    tp = ids.shape[1] - tc
    first, state = lm.prefill(u_ids, u_mask)  # the last prompt position predicts token 0
    first = first[inv]
    if tc == 1:
        return first
    rest = lm.extend(state, inv, ids[:, tp:-1], attn, pos[:, tp:-1])
    return torch.cat([first, rest], dim=1)


def completion_logits(lm: Forward, ro: Rollout, device: torch.device,
                      share_prompts: bool = True) -> Tensor:
    """Logits [B, Tc, V] predicting every completion token of ``ro``: one forward over
    [left-padded prompt | completion] with position ids counting real tokens only (as sampling
    does), or with ``share_prompts`` each distinct prompt run once."""
    tc = ro.completion_ids.shape[1]
    ids, attn, pos, shared = _scoring_inputs(ro, device, share_prompts)
    if shared is not None:
        return shared_prefix_logits(lm, ids, attn, pos, tc, shared)
    return lm.logits(ids[:, :-1], attn[:, :-1], pos[:, :-1], keep=tc)


def _scoring_inputs(ro: Rollout, device: torch.device, share_prompts: bool
                    ) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """[prompt | completion] ids, attention mask and position ids (counting real tokens only,
    as sampling does) on ``device``, and ``shared_prompts`` of the prompts (with
    ``share_prompts``, else None)."""
    ids = torch.cat([ro.prompt_ids, ro.completion_ids], dim=1)
    attn = torch.cat([ro.prompt_mask, torch.ones_like(ro.completion_ids)], dim=1)
    pos = pos_ids(attn)
    shared = shared_prompts(ro.prompt_ids, ro.prompt_mask) if share_prompts else None
    if shared is not None:
        shared = tuple(x.to(device) for x in shared)
    return ids.to(device), attn.to(device), pos.to(device), shared


# Answers of unequal length are scored in a few forwards, each cut to its longest answer; each
# forward costs about this many answer positions on top of its own (per-op overhead; measured
# on a 2-core CPU). On accelerators a forward's launch overhead is worth far more positions:
# BUCKET_COST_ACCEL there, a guess (no GPU measurement yet).
BUCKET_COST = 16
BUCKET_COST_ACCEL = 256
# False: one forward over every row, padded to the longest answer (for benchmarks).
LENGTH_BUCKETS = True


def answer_lengths(mask: Tensor) -> list[int]:
    """Each row's scored length: up to its last real position (0 for a row with none)."""
    tc = mask.shape[1]
    last = torch.arange(1, tc + 1).mul(mask.cpu().bool()).amax(dim=1)
    return [int(x) for x in last]


def length_buckets(lengths: list[int], cost: float | None = None) -> list[list[int]]:
    """Rows with answers (length > 0) in buckets of similar length, longest first: the split of
    the rows sorted by length that minimises the positions scored, sum of (rows x longest +
    ``cost``, default ``BUCKET_COST``) over buckets (exact, by dynamic programming over the
    sorted rows)."""
    cost = BUCKET_COST if cost is None else cost
    order = sorted((r for r, n in enumerate(lengths) if n > 0), key=lambda r: -lengths[r])
    ln = [lengths[r] for r in order]
    n = len(ln)
    best, cut = [0.0] + [math.inf] * n, [0] * (n + 1)
    for i in range(1, n + 1):  # best[i]: the first i rows; a bucket j..i-1 is l[j] long
        for j in range(i):
            c = best[j] + (i - j) * ln[j] + cost
            if c < best[i]:
                best[i], cut[i] = c, j
    out, i = [], n
    while i:
        out.append(order[cut[i]:i])
        i = cut[i]
    return out[::-1]


def bucketed_hidden(lm: Forward, ro: Rollout, device: torch.device, share: bool,
                    buckets: list[list[int]], lengths: list[int]) -> tuple[Tensor, Tensor]:
    """``completion_logits`` of ``lm`` (a trunk: hidden states) at the real answer positions
    only, bucket by bucket: ([N, D] for the N positions where ``ro.completion_mask`` is 1, their
    flat indices row * Tc + column [N]). The prompts are run once for all buckets when shared.
    """
    ids, attn, pos, shared = _scoring_inputs(ro, device, share)
    tp = ro.prompt_ids.shape[1]
    if shared is not None:
        u_ids, u_mask, inv = shared
        first, state = lm.prefill(u_ids, u_mask)
    mask = ro.completion_mask.to(device).bool()
    flat = torch.arange(mask.numel(), device=device).view_as(mask)
    hs, where = [], []
    for rows in buckets:
        n = lengths[rows[0]]
        r = torch.tensor(rows, device=device)
        if shared is not None:
            h = first[inv[r]]
            if n > 1:
                rest = lm.extend(state, inv[r], ids[r, tp:tp + n - 1], attn[r, :tp + n],
                                 pos[r, tp:tp + n - 1])
                h = torch.cat([h, rest], dim=1)
        else:
            h = lm.logits(ids[r, :tp + n - 1], attn[r, :tp + n - 1], pos[r, :tp + n - 1], keep=n)
        m = mask[r, :n]
        hs.append(h[m])
        where.append(flat[r, :n][m])
    return torch.cat(hs), torch.cat(where)


def frozen_copy(model: nn.Module) -> nn.Module:
    """The reference of a full fine-tune: a copy of the initial weights, in eval mode, frozen."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class LMBackend:
    """``generate`` and ``logprobs`` written once for every model stack.

    A subclass sets ``model``, ``ref`` (None with LoRA), ``lora``, ``eos_ids``, ``pad_id`` and
    ``device``, and provides ``encode_prompts`` (-> ids, mask), ``sample`` (-> completion ids),
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
    cpu_pack: bool = False  # big float32 CPU weights prepacked for oneDNN (grpolab.packed)

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
            linear = packed_linear(*head, self.logit_chunk) if self.cpu_pack else None
            lengths = answer_lengths(ro.completion_mask)
            cost = BUCKET_COST if self.device.type == "cpu" else BUCKET_COST_ACCEL
            buckets = (length_buckets(lengths, cost) if getattr(lm, "rescores", False)
                       and LENGTH_BUCKETS else [])
            if len(buckets) > 1 or (buckets and sum(lengths) < len(lengths) * tc):
                # answers of unequal length: only their real positions, in a few forwards
                hidden, where = bucketed_hidden(lm.trunk(), ro, self.device, share, buckets,
                                                lengths)
                targets = ro.completion_ids.to(hidden.device).reshape(-1)[where]
                lp, ent = head_logprobs(hidden, *head, targets, 1.0 / t, self.logit_chunk,
                                        entropy=entropy is not None, linear=linear)
                n = ro.completion_ids.numel()
                lp, ent = (x.new_zeros(n).index_copy(0, where, x).view(ro.completion_ids.shape)
                           for x in (lp, ent))
            else:
                hidden = completion_logits(lm.trunk(), ro, self.device, share)
                lp, ent = head_logprobs(hidden, *head, ro.completion_ids.to(hidden.device),
                                        1.0 / t, self.logit_chunk,
                                        entropy=entropy is not None, linear=linear)
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
