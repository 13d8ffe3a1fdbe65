"""The GRPO objective as pure tensor functions, each variant one entry in a registry.

Shapes: per-token tensors are [B, T] over completion tokens, ``mask`` is 1 on real completion
tokens (EOS included) and 0 on padding; ``advantages`` is [B], one value per answer (or
[B, T], one per token, from a token-level estimator).

Registries (name -> function); the config's allowed values, the CLI's choices and the
workshop's presets are read from them, so a new variant is one function and one entry:

- ``POLICY_LOSSES`` (``grpolab.core.policy_losses``, re-exported here): (logp, old_logp,
  advantages, mask, **knobs) -> PolicyTerms; its keyword-only knobs are config fields of the
  same names (``policy_knobs``).
- ``KL_ESTIMATORS``: (logp, ref_logp) -> per-token estimate of KL(policy || reference).
- ``LOSS_AGGREGATIONS``: (per_token, mask, norm_len) -> scalar.

``grpo_loss`` is the whole objective. Given the global batch's reply and token counts
(``global_rows``, ``global_tokens``, as verl's ``agg_loss`` takes them), it returns a part's
exact share of the global loss and of every logged statistic, so micro-batches and ranks sum to
the one-pass, one-process step: a property of this function, tested as such (but for
``kl_cov`` and ``clip_cov``, which choose their tokens within the part they are given, as
verl's within its micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpolab.core.policy_losses import (  # re-exported: one place for the objective's terms
    POLICY_LOSSES,
    PolicyTerms,
    _log_ratio,  # (the off-policy mask reads ratios and advantages as the policy losses do)
    _per_token,
    cispo_loss,
    clip_cov_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    dro_loss,
    gmpo_loss,
    gspo_loss,
    kl_cov_loss,
    policy_knobs,
    ppo_clip_loss,
    sapo_loss,
    vespo_loss,
)

__all__ = ["KL_ESTIMATORS", "LOSS_AGGREGATIONS", "POLICY_LOSSES", "TOKEN_WEIGHTED_AGGS",
           "LossOut", "PolicyTerms", "aggregate", "cispo_loss", "clip_cov_loss", "dppo_kl_loss",
           "dppo_tv_loss", "dro_loss", "gmpo_loss",
           "grpo_loss", "gspo_loss", "high_entropy_mask", "k1_kl", "k2_kl", "k3_kl",
           "kl_cov_loss", "off_policy_keep", "policy_knobs", "ppo_clip_loss", "sapo_loss",
           "sequence_kl", "share_of", "vespo_loss"]


def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """[B, T] bool: real tokens whose entropy is at least the ``quantile`` of the real tokens'
    entropies (so ``1 - quantile`` of them are kept: "Beyond the 80/20 rule", TRL's
    ``top_entropy_quantile`` rho = 1 - quantile). Padding is never selected."""
    real = mask.bool()
    vals = entropy.detach()[real].float()
    if vals.numel() == 0:
        return torch.zeros_like(real)
    threshold = torch.quantile(vals, quantile)
    return (entropy.detach() * mask.to(entropy.dtype) >= threshold) & real


def off_policy_keep(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                    threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (TRL's off_policy_mask_threshold): [B, 1]
    (or [B, T] for token-level advantages) 1 where an answer's policy loss is kept, 0 where it
    is dropped: a negative advantage on an answer whose mean per-token log(pi_old / pi) (an
    estimate of KL(pi_old || pi)) exceeds ``threshold``, i.e. a mistake the policy has already
    moved away from."""
    kl = -_log_ratio(logp.detach(), old_logp, mask, "sequence")
    return ((_per_token(advantages) >= 0) | (kl <= threshold)).to(logp.dtype)


def k1_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log pi - log ref: unbiased for KL(pi || ref) on samples from pi, can be negative."""
    return logp - ref_logp


def k2_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = (log pi - log ref)^2 / 2: biased, >= 0, low variance (verl "mse")."""
    return 0.5 * (logp - ref_logp) ** 2


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(d) - d - 1 with d = ref - logp (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": k1_kl,
    "k2": k2_kl,
    "k3": k3_kl,
}


def _seq_mean_token_mean(per_token: Tensor, m: Tensor, norm_len: int | None) -> Tensor:
    per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1)
    return per_seq.mean()


def _token_mean(per_token: Tensor, m: Tensor, norm_len: int | None) -> Tensor:
    return (per_token * m).sum() / m.sum().clamp(min=1)


def _seq_mean_token_sum_norm(per_token: Tensor, m: Tensor, norm_len: int | None) -> Tensor:
    if not norm_len:
        raise ValueError("seq_mean_token_sum_norm needs norm_len (the max completion length)")
    return ((per_token * m).sum(-1) / norm_len).mean()


def _seq_mean_token_sum(per_token: Tensor, m: Tensor, norm_len: int | None) -> Tensor:
    return (per_token * m).sum(-1).mean()


LOSS_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int | None], Tensor]] = {
    # mean over each reply's tokens, then over replies (GRPO; TRL loss_type grpo; favours short
    # wrong answers and long right ones, the length bias Dr. GRPO points out)
    "seq_mean_token_mean": _seq_mean_token_mean,
    # mean over every token of the batch (DAPO; TRL loss_type dapo / bnpo)
    "token_mean": _token_mean,
    # each reply's token sum / a constant (norm_len, the max completion length), mean over
    # replies (Dr. GRPO; TRL loss_type dr_grpo)
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
    # each reply's token sum, mean over replies (verl seq-mean-token-sum)
    "seq_mean_token_sum": _seq_mean_token_sum,
}


# Aggregations whose normaliser is the batch's token count (a micro-batch's share of the loss is
# its share of the tokens); the others normalise per reply (its share of the replies).
TOKEN_WEIGHTED_AGGS = frozenset({"token_mean"})


def sequence_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str = "k3") -> Tensor:
    """Each answer's per-token KL estimate summed over its tokens, [B] (``kl_in: reward``)."""
    return (KL_ESTIMATORS[estimator](logp, ref_logp) * mask.to(logp.dtype)).sum(-1)


def aggregate(per_token: Tensor, mask: Tensor, mode: str, norm_len: int | None = None) -> Tensor:
    """Reduce per-token losses to a scalar as ``LOSS_AGGREGATIONS[mode]`` says."""
    fn = LOSS_AGGREGATIONS.get(mode)
    if fn is None:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return fn(per_token, mask.to(per_token.dtype), norm_len)


@dataclass
class LossOut:
    loss: Tensor
    policy_loss: float
    kl: float
    clip_frac: float
    entropy: float | None = None  # mean entropy over the completion tokens (when given)
    entropy_share: float = 1.0  # share of completion tokens the policy loss trained on
    masked_share: float = 0.0  # share of completion tokens the off-policy mask dropped
    # the entropy summed over the tokens the policy loss trained on, and their count (this
    # part's own, never scaled: what an adaptive entropy coefficient reads)
    trained_entropy: float = 0.0
    trained_tokens: float = 0.0


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    beta: float,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    agg: str = "seq_mean_token_mean",
    norm_len: int | None = None,
    policy_loss: str = "clip",
    kl_estimator: str = "k3",
    kl_is_correction: bool = False,
    dual_clip: float = 0.0,
    cispo_max: float = 5.0,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    entropy_agg: str | None = None,
    policy_agg: str | None = None,
    top_entropy_quantile: float = 1.0,
    off_policy_mask: float = 0.0,
    global_rows: int | None = None,
    global_tokens: int | None = None,
    loss_tokens: float | None = None,
    **knobs: float,
) -> LossOut:
    """Policy loss plus beta * KL per token, aggregated as ``agg`` says, minus an entropy bonus.

    ``policy_loss`` picks from POLICY_LOSSES, ``kl_estimator`` from KL_ESTIMATORS; ``knobs``
    are the other settings a policy loss reads (``policy_knobs``: ``sapo_tau_pos``, ...). With
    ``kl_is_correction`` the per-token KL is multiplied by the policy's importance ratio (TRL's
    use_bias_correction_kl): its value is unchanged on the first pass (ratio 1) but its gradient
    gains a k * grad(log pi) term. ``entropy`` [B, T] (per-token entropies of the policy) is
    needed for ``top_entropy_quantile`` < 1 (the policy loss keeps only that top share of tokens
    by entropy; KL is kept on every token, as in TRL) and for ``entropy_coef`` > 0 (the loss
    subtracts coef x the entropy over the tokens trained on, aggregated as ``entropy_agg``:
    None (or "loss"), like the loss, as verl does; ``token_mean``, as TRL always does).
    ``policy_agg``: the policy term's own aggregation where not ``agg`` (None or "loss": as
    ``agg``); verl's sapo and geo_mean aggregate it as seq_mean_token_mean whatever its
    loss_agg_mode, their KL and entropy terms as ``agg``. ``off_policy_mask`` > 0 drops the
    policy loss of the answers ``off_policy_keep`` drops (the KL term stays).

    With one optimisation pass ``old_logp`` is ``logp.detach()``: the ratio is 1, its gradient
    is the policy gradient, and clipping never bites.

    ``global_rows`` / ``global_tokens``: the reply and token counts of the whole batch (over
    micro-batches and ranks) this part belongs to. The loss and ``policy_loss`` are then this
    part's share of the global values (its replies, or for ``token_mean`` its tokens, over the
    global count) and the token statistics (kl, clip_frac, entropy, the shares) its share
    of the tokens: summing the parts gives the whole batch's numbers and gradient.
    ``loss_tokens``: a token mean's divisor for the loss where it is not ``global_tokens``
    (TRL's dapo, cispo and vespo with several optimiser steps a generation: the generation
    batch's tokens over its steps); the statistics and the entropy bonus keep
    ``global_tokens``.
    """
    fn = POLICY_LOSSES.get(policy_loss)
    if fn is None:
        raise ValueError(f"unknown policy loss {policy_loss!r}")
    unknown = set(knobs).difference(*map(policy_knobs, POLICY_LOSSES))
    if unknown:
        raise TypeError(f"grpo_loss: no policy loss reads {sorted(unknown)}")
    terms = fn(logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
               dual_clip=dual_clip, cispo_max=cispo_max, **knobs)
    surrogate, clipped = terms.loss, terms.clipped
    m = mask.to(logp.dtype)
    keep = None
    if top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropies")
        keep = high_entropy_mask(entropy, mask, 1.0 - top_entropy_quantile)
        surrogate = surrogate * keep.to(surrogate.dtype)
    dropped = None
    if off_policy_mask > 0:
        kept = off_policy_keep(logp, old_logp, advantages, mask, off_policy_mask)
        surrogate = surrogate * kept
        dropped = (1 - kept).expand_as(m) * m
    entropy_agg, policy_agg = (None if x == "loss" else x for x in (entropy_agg, policy_agg))
    main = policy_agg or agg  # the policy term's aggregation
    per_token = surrogate
    kl_val, kl_term = 0.0, None  # kl_term: the KL aggregated apart (as agg, not as main)
    if beta > 0 and ref_logp is not None:
        kl_fn = KL_ESTIMATORS.get(kl_estimator)
        if kl_fn is None:
            raise ValueError(f"unknown KL estimator {kl_estimator!r}")
        kl = kl_fn(logp, ref_logp)
        if kl_is_correction:
            kl = kl * terms.ratio
        if main == agg:
            per_token = per_token + beta * kl
        else:  # (verl: the policy loss + kl_loss_coef x agg_loss(kl, loss_agg_mode))
            kl_term = beta * aggregate(kl, mask, agg, norm_len)
        kl_val = float(((kl * m).sum() / m.sum().clamp(min=1)).detach())
    loss = aggregate(per_token, mask, main, norm_len)
    trained = m if keep is None else m * keep.to(m.dtype)
    bonus = None  # an entropy bonus aggregated otherwise than the loss, subtracted after
    if entropy_coef and entropy is not None:
        bonus = entropy_coef * aggregate(entropy, trained, entropy_agg or agg, norm_len)
        if (entropy_agg or agg) == main and loss_tokens is None:
            loss, bonus = loss - bonus, None
    elif entropy_coef:
        raise ValueError("entropy_coef > 0 needs the per-token entropies")
    denom = m.sum().clamp(min=1)
    ent_val = None if entropy is None else float((entropy.detach() * m).sum() / denom)
    out = LossOut(
        loss=loss,
        policy_loss=float(aggregate(surrogate.detach(), mask, main, norm_len)),
        kl=kl_val,
        clip_frac=float((clipped.to(m.dtype) * m).sum() / denom),
        entropy=ent_val,
        entropy_share=1.0 if keep is None else float((keep.to(m.dtype) * m).sum() / denom),
        masked_share=0.0 if dropped is None else float(dropped.sum() / denom),
        trained_entropy=0.0 if entropy is None else float((entropy.detach() * trained).sum()),
        trained_tokens=float(trained.sum()),
    )
    split = global_rows is not None or global_tokens is not None or loss_tokens is not None
    if split:
        out = share_of(out, mask, main, global_rows, global_tokens, loss_tokens)
    if kl_term is not None:
        if split:
            kl_term = share_of(LossOut(kl_term, 0.0, 0.0, 0.0), mask, agg, global_rows,
                               global_tokens, loss_tokens).loss
        out.loss = out.loss + kl_term
    if bonus is not None:  # its own share of the batch (for a token mean, of the completion
        # tokens: with top_entropy_quantile < 1 each part's trained tokens are its own)
        if split:
            bonus = share_of(LossOut(bonus, 0.0, 0.0, 0.0), mask, entropy_agg or agg,
                             global_rows, global_tokens).loss
        out.loss = out.loss - bonus
    return out


def share_of(out: LossOut, mask: Tensor, agg: str, global_rows: int | None,
             global_tokens: int | None, loss_tokens: float | None = None) -> LossOut:
    """A part's numbers as its share of the global batch's: the part's mean times its count
    over the global count (replies, or tokens for token-weighted aggregations: for the loss,
    over ``loss_tokens`` where given)."""
    tok_share = int(mask.sum()) / global_tokens if global_tokens else 1.0
    rows = mask.shape[0] / global_rows if global_rows else 1.0
    share = rows if agg not in TOKEN_WEIGHTED_AGGS else (
        int(mask.sum()) / loss_tokens if loss_tokens else tok_share)
    return LossOut(
        loss=out.loss * share,
        policy_loss=out.policy_loss * share,
        kl=out.kl * tok_share,
        clip_frac=out.clip_frac * tok_share,
        entropy=None if out.entropy is None else out.entropy * tok_share,
        entropy_share=out.entropy_share * tok_share,
        masked_share=out.masked_share * tok_share,
        trained_entropy=out.trained_entropy,
        trained_tokens=out.trained_tokens,
    )
