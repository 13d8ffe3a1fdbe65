"""Sampling: the next-token draw (two-level inverse CDF, one uniform per row from the run's
generator), the ``Filters`` TRL and vLLM users set (top-k, top-p, min-p, repetition penalty),
and ``decode``, the one sampling loop every model stack runs, over a ``Decoder``.

``Forward`` is what a model stack provides; finished rows leave a decoder that can ``shrink``
(``early_exit``) once they are a ``DROP_SHARE`` of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

SAMPLE_BLOCK = 256  # vocabulary entries per block of sample_next's two-level search


@dataclass(frozen=True)
class Filters:
    """What sampling does to the next-token logits besides the temperature, as HF ``generate``'s
    logits processors do it (TRL's names; TRL passes them to ``generate``): the
    ``repetition_penalty`` on each token already in the row (its prompt's real tokens, then its
    answer's), before the temperature; then ``top_k``, ``top_p`` and ``min_p``, in that order,
    on the scaled logits (``warp``). The defaults change nothing. Answers are drawn from what is
    left; the loss scores them under the plain softmax at T, as TRL and verl do."""

    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the most likely tokens holding this much probability
    min_p: float = 0.0  # drop tokens under min_p x the most likely token's probability
    repetition_penalty: float = 1.0  # divide seen tokens' positive logits, multiply negative

    @classmethod
    def of(cls, cfg: Any) -> Filters:
        """A config's filters (its fields of the same names)."""
        return cls(int(cfg.top_k), float(cfg.top_p), float(cfg.min_p),
                   float(cfg.repetition_penalty))

    @property
    def warps(self) -> bool:
        """Whether top-k, top-p or min-p removes anything."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def penalises(self) -> bool:
        return self.repetition_penalty != 1.0


NO_FILTERS = Filters()
Draw = Callable[[Tensor, float, "torch.Generator | None", Filters], Tensor]


def warp(logits: Tensor, temperature: float, f: Filters, fixed_shape: bool = False) -> Tensor:
    """float32 logits [B, V] / T with the tokens top-k, top-p and min-p remove at -inf, as HF's
    ``TopKLogitsWarper``, ``TopPLogitsWarper`` and ``MinPLogitsWarper`` compute it (ties at the
    k-th logit kept; ``top_p_drop``; with ``fixed_shape``, for a captured step, top-p's full
    sort only)."""
    x = logits.float()
    x = x / temperature if temperature != 1 else x
    if f.top_k > 0:
        kth = torch.topk(x, min(f.top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if f.top_p < 1.0:  # (the search pays on the CPU's slow sort; a GPU sorts in full)
        search = TOP_P_SEARCH if x.device.type == "cpu" and not fixed_shape else ()
        x = x.masked_fill(top_p_drop(x, f.top_p, search), float("-inf"))
    if f.min_p > 0.0:
        probs = x.softmax(dim=-1)  # (the most likely token is never under min_p <= 1 of itself)
        x = x.masked_fill(probs < f.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return x


TOP_P_SEARCH = (256, 4096)  # the most likely tokens top_p_drop looks among before a full sort


def top_p_drop(x: Tensor, top_p: float, search: tuple[int, ...] = TOP_P_SEARCH) -> Tensor:
    """[B, V] bool: the tokens top-p removes from logits ``x`` [B, V], by HF's rule: a token
    goes when the tokens more likely than it already hold ``top_p`` of the probability; the
    most likely stays. A row's boundary is looked for among its ``search`` most likely tokens
    first (HF's full sort costs 66-90 ms a draw at 32 x 49152 on 2 CPU cores, this 7-10 ms on
    an LM's peaked rows); rows where those do not hold top_p, or where a token's share lies
    within float rounding of the boundary (ties), are sorted in full as HF does. The two sum
    in another order, so a token within HF's float32 rounding of it may still fall otherwise."""
    if not search:
        return _hf_top_p_drop(x, top_p)
    b, v = x.shape
    drop = torch.ones_like(x, dtype=torch.bool)
    rows = torch.arange(b, device=x.device)
    probs = x.softmax(dim=-1)
    for k in search:
        if k >= v or not len(rows):
            break
        top, where = probs[rows].topk(k, dim=-1)  # descending
        cum = top.cumsum(dim=-1)
        before = cum - top  # the share of the tokens more likely than each
        inside = (cum[:, -1] >= top_p) & ((before - top_p).abs() > 1e-6).all(dim=-1)
        keep = before < top_p
        keep[:, 0] = True
        drop[rows[inside]] = drop[rows[inside]].scatter(-1, where[inside], ~keep[inside])
        rows = rows[~inside]
    if len(rows):
        drop[rows] = _hf_top_p_drop(x[rows], top_p)
    return drop


def _hf_top_p_drop(x: Tensor, top_p: float) -> Tensor:
    """HF's own: the ascending sort, its cumulative sums, the most likely token kept."""
    ordered, where = torch.sort(x, dim=-1)
    gone = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    gone[..., -1:] = False
    return gone.scatter(-1, where, gone)


def penalise(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """HF's ``RepetitionPenaltyLogitsProcessor``: float32 logits [B, V] where ``seen`` [B, V]
    (bool) is set divided by ``penalty`` if positive, multiplied by it if not."""
    x = logits.float()
    return torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)


def prompt_tokens(ids: Tensor, mask: Tensor, vocab: int) -> Tensor:
    """[B, vocab] bool: the tokens of each row's prompt ``ids`` [B, Tp] where ``mask`` is 1 (a
    left pad is not the row's: transformers >= 5 leaves it out of the penalty too)."""
    seen = torch.zeros((ids.shape[0], vocab + 1), dtype=torch.bool, device=ids.device)
    seen.scatter_(1, ids.masked_fill(mask == 0, vocab), True)
    return seen[:, :vocab]


def penalty_start(filters: Filters, prompts: tuple[Tensor, Tensor] | None, vocab: int,
                  device: torch.device) -> Tensor | None:
    """[B, vocab] bool on ``device``: the tokens a repetition penalty starts from, each row's
    prompt's (``prompt_tokens`` of ``prompts`` (ids, mask)); None without a penalty."""
    if not filters.penalises:
        return None
    if prompts is None:
        raise ValueError("a repetition penalty needs the prompts' tokens")
    return prompt_tokens(prompts[0].to(device), prompts[1].to(device), vocab)


def next_probs(logits: Tensor, temperature: float, filters: Filters = NO_FILTERS,
               fixed_shape: bool = False) -> Tensor:
    """float32 softmax(logits / T) [B, V], over what ``filters`` leave (T > 0)."""
    logits = logits.float()
    if filters.warps:
        return torch.softmax(warp(logits, temperature, filters, fixed_shape), dim=-1)
    return torch.softmax(logits / temperature if temperature != 1 else logits, dim=-1)


def sampled_logprobs(logits: Tensor, targets: Tensor, temperature: float, filters: Filters,
                     prompts: tuple[Tensor, Tensor]) -> Tensor:
    """log P(target) [B, T] under the distribution each draw of ``decode`` samples from: the
    logits [B, T, V] predicting ``targets`` [B, T] (an answer, after ``prompts`` (ids, mask)),
    penalised for the tokens before and filtered; -inf where a target is filtered out."""
    n, v = logits.shape[1:]
    seen = penalty_start(filters, prompts, v, logits.device)
    out = []
    for t in range(n):
        x = logits[:, t] if seen is None else penalise(logits[:, t], seen,
                                                      filters.repetition_penalty)
        x = warp(x, temperature, filters)
        out.append(x.log_softmax(dim=-1).gather(1, targets[:, t:t + 1]))
        if seen is not None:
            seen.scatter_(1, targets[:, t:t + 1], True)
    return torch.cat(out, dim=1)


def sample_next(logits: Tensor, temperature: float,
                generator: torch.Generator | None = None,
                filters: Filters = NO_FILTERS) -> Tensor:
    """One token per row of ``logits`` [B, V] from exactly softmax(logits / T) over the tokens
    ``filters`` leave; argmax if T == 0.

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
    probs = next_probs(logits, temperature, filters)
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
                     generator: torch.Generator | None = None,
                     filters: Filters = NO_FILTERS) -> Tensor:
    """The same distribution as ``sample_next`` drawn with ``torch.multinomial``: the world's
    sampler (its recorded runs come from this random stream)."""
    if temperature == 0:
        return logits.float().argmax(-1)
    probs = next_probs(logits, temperature, filters)
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
           generator: torch.Generator | None = None, draw: Draw = sample_next,
           early_exit: bool = True, filters: Filters = NO_FILTERS,
           prompts: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The decode loop: draw a token per row, feed it, until every row has ended or max_new.

    ``filters`` shape each draw; a repetition penalty needs the ``prompts`` (ids, mask) [B, Tp]
    the decoder was built on (and applies at T = 0 too, as in HF ``generate``).

    Rows stop at their first EOS (PAD after it). Returns the completion ids [B, steps taken].
    With ``early_exit``, finished rows leave the decoder's batch where it can ``shrink``; every
    row is still drawn
    for (finished ones on their last logits, then masked), so the random stream is that of the
    loop without early exit, and so is every answer up to float rounding (a matmul over fewer
    rows may round differently, and a draw at a probability boundary could then flip).
    """
    logits = dec.logits
    b, dev = logits.shape[0], logits.device
    eos = torch.as_tensor(eos_ids, device=dev)
    out = torch.full((b, max_new), pad_id, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    shrink = getattr(dec, "shrink", None) if early_exit else None
    live: Tensor | None = None  # the rows the decoder still computes (None: all)
    steps = max_new
    seen = penalty_start(filters, prompts, logits.shape[-1], dev)
    for t in range(max_new):
        scores = logits if seen is None else penalise(logits, seen, filters.repetition_penalty)
        nxt = draw(scores, temperature, generator, filters).masked_fill(done, pad_id)
        out[:, t] = nxt
        if seen is not None:
            seen.scatter_(1, nxt[:, None], True)
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
