"""The GRPO objective as pure tensor functions, each variant one entry in a registry.

Shapes: per-token tensors are [B, T] over completion tokens, ``mask`` is 1 on real completion
tokens (EOS included) and 0 on padding; ``advantages`` is [B], one value per answer (or
[B, T], one per token, from a token-level estimator).

Registries (name -> function); the config's allowed values, the CLI's choices and the
workshop's presets are read from them, so a new variant is one function and one entry:

- ``POLICY_LOSSES``: (logp, old_logp, advantages, mask, **knobs) -> PolicyTerms
  (per-token loss, where clipping bit, the importance ratio); its keyword-only knobs are
  config fields of the same names (``policy_knobs``).
- ``KL_ESTIMATORS``: (logp, ref_logp) -> per-token estimate of KL(policy || reference).
- ``LOSS_AGGREGATIONS``: (per_token, mask, norm_len) -> scalar.

``grpo_loss`` is the whole objective. Given the global batch's reply and token counts
(``global_rows``, ``global_tokens``, as verl's ``agg_loss`` takes them), it returns a part's
exact share of the global loss and of every logged statistic, so micro-batches and ranks sum to
the one-pass, one-process step: a property of this function, tested as such.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


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
    m = mask.to(logp.dtype)
    kl = ((old_logp - logp.detach()) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(
        min=1)
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


class PolicyTerms(NamedTuple):
    loss: Tensor  # [B, T] per-token policy loss
    clipped: Tensor  # [B, T] bool: where a clip (or cap) changed the value
    ratio: Tensor  # [B, T] per-token or [B, 1] per-sequence importance ratio (differentiable)


def _per_token(advantages: Tensor) -> Tensor:
    """[B] (one per answer, shared by its tokens) or [B, T] (token-level) -> broadcastable
    against [B, T]."""
    return advantages if advantages.dim() == 2 else advantages[:, None]


def _log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """log(pi / pi_old) per token [B, T], or at ``level`` "sequence" one per answer [B, 1]: the
    mean over its tokens (GSPO's; TRL's importance_sampling_level)."""
    d = logp - old_logp
    if level == "token":
        return d
    m = mask.to(logp.dtype)
    return (d * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)


def _ppo_clip(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float,
              dual_clip: float) -> tuple[Tensor, Tensor]:
    """-min(rA, clip(r)A); with ``dual_clip`` c > 1 the loss of a negative advantage is also
    capped at -cA (dual-clip PPO: verl's clip_ratio_c, TRL's delta), where it has no gradient."""
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    hit = clipped < unclipped
    if dual_clip > 0:
        cap = -adv * dual_clip
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(capped, cap.expand_as(loss), loss)
        hit = hit | capped
    return loss, hit


def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                  eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float = 0.0,
                  **_: float) -> PolicyTerms:
    """GRPO/PPO: per-token ratio r_t = pi/pi_old, clipped to [1 - eps_low, 1 + eps_high]."""
    ratio = torch.exp(logp - old_logp)
    loss, hit = _ppo_clip(ratio, _per_token(advantages), eps_low, eps_high, dual_clip)
    return PolicyTerms(loss, hit, ratio)


def gspo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
              eps_low: float = 3e-4, eps_high: float = 4e-4, dual_clip: float = 0.0,
              **_: float) -> PolicyTerms:
    """GSPO (Zheng et al. 2025): one ratio per answer, the geometric mean of its token ratios
    s = exp(mean_t log(pi/pi_old)), clipped as a whole ([1 - eps_low, 1 + eps_high]; the paper
    uses 3e-4 / 4e-4); every token of the answer gets the answer's loss."""
    m = mask.to(logp.dtype)
    log_s = ((logp - old_logp) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_s)  # [B, 1]
    loss, hit = _ppo_clip(ratio, _per_token(advantages), eps_low, eps_high, dual_clip)
    return PolicyTerms(loss.expand_as(logp), hit.expand_as(logp), ratio)


def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
               cispo_max: float = 5.0, cispo_min: float = 0.0, ratio_level: str = "token",
               **_: float) -> PolicyTerms:
    """CISPO (MiniMax-M1): REINFORCE -w A log pi with the importance weight
    w = clip(r, cispo_min, cispo_max) held constant (stop-gradient), so no token's gradient is
    ever clipped away, only weighted (TRL: cispo_min 0; verl: 1 -/+ its clip ratios). At
    ``ratio_level`` "sequence" r is the answer's (TRL's importance_sampling_level)."""
    ratio = torch.exp(_log_ratio(logp, old_logp, mask, ratio_level))
    w = torch.clamp(ratio, min=cispo_min, max=cispo_max).detach()
    hit = ((ratio > cispo_max) | (ratio < cispo_min)).expand_as(logp)
    return PolicyTerms(-w * _per_token(advantages) * logp, hit, ratio)


def sapo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
              sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05, ratio_level: str = "token",
              **_: float) -> PolicyTerms:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): a soft gate in place of the clip. Per token
    -f(r) A with f(r) = sigmoid(tau (r - 1)) 4 / tau: f's slope is 1 at r = 1 (the policy
    gradient) and fades smoothly as r leaves 1, faster for a larger tau (``sapo_tau_neg`` for
    tokens whose advantage is not positive). Nothing is clipped: ``clipped`` is all False.
    As verl, log r is clamped to [-20, 20] (TRL's is not; its gradient is NaN past ~88). At
    ``ratio_level`` "sequence" r is the answer's, its gate shared by its tokens (TRL's)."""
    log_r = torch.clamp(_log_ratio(logp, old_logp, mask, ratio_level), -20.0, 20.0)
    ratio = torch.exp(log_r)  # (verl's clamp: no inf x 0 in the gradient)
    adv = _per_token(advantages)
    tau = torch.where(adv > 0, sapo_tau_pos, sapo_tau_neg)  # float32, as TRL's and verl's
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    loss = torch.broadcast_to(-gate * adv, torch.broadcast_shapes(gate.shape, logp.shape))
    return PolicyTerms(loss, torch.zeros_like(logp, dtype=torch.bool), ratio)


def vespo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
               vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
               vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
               ratio_level: str = "token", **_: float) -> PolicyTerms:
    """VESPO (TRL's loss_type vespo): REINFORCE -phi(w) A log pi with a constant weight
    phi(w) = e^lam w^k e^(-lam w) of the answer's whole-sequence ratio w = prod_t pi/pi_old:
    phi(1) = 1, and phi fades both for w << 1 (w^k) and for w >> 1 (e^(-lam w)); k and lam
    are the ``_pos`` pair for an advantage >= 0, else the ``_neg`` pair. As TRL: each token's
    log-ratio is clamped to [-20, 20] and log w to [log 1e-8, 20]. ``clipped`` is all False;
    ``ratio`` (the KL's correction) is the per-token one, or the answer's at ``ratio_level``
    "sequence" (all the level changes, as in TRL)."""
    ratio = torch.exp(_log_ratio(logp, old_logp, mask, ratio_level))
    m = mask.to(logp.dtype)
    log_r = torch.clamp((logp - old_logp).detach(), -20.0, 20.0)
    log_w = torch.clamp((log_r * m).sum(-1, keepdim=True), math.log(1e-8), 20.0)  # [B, 1]
    adv = _per_token(advantages)
    pos = adv >= 0
    k = torch.where(pos, vespo_k_pos, vespo_k_neg)  # float32, as TRL's
    lam = torch.where(pos, vespo_lambda_pos, vespo_lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return PolicyTerms(-phi * adv * logp, torch.zeros_like(logp, dtype=torch.bool), ratio)


def gmpo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
              eps_low: float = 0.4, eps_high: float = 0.4, **_: float) -> PolicyTerms:
    """GMPO (Zhao et al. 2025, arXiv 2507.20673; verl's geo_mean): one ratio per answer, the
    geometric mean of its token ratios as in GSPO, but each token's log-ratio is clipped
    first, to [-eps_low, eps_high] in log space on the side the advantage's sign says (as PPO
    clips), so one outlier token cannot carry the answer's ratio; the paper's range is
    (e^-0.4, e^0.4). Every token gets the answer's loss -A s, A the mean of its tokens'
    advantages (verl's 1e-8 in both means, in float32); as verl says, it is meant for one
    advantage per answer. ``ratio`` (the KL's correction) is the unclipped geometric mean."""
    d = (logp - old_logp).float()
    adv = _per_token(advantages).float()
    sgn = torch.sign(adv)
    d_clip = torch.clamp(d, -eps_low, eps_high)
    d_min = sgn * torch.minimum(sgn * d, sgn * d_clip)
    m = mask.float()
    n = m.sum(-1, keepdim=True) + 1e-8
    s = torch.exp((d_min * m).sum(-1, keepdim=True) / n)  # [B, 1]
    a = (adv * m).sum(-1, keepdim=True) / n
    ratio = torch.exp((d * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1))
    return PolicyTerms((-a * s).expand_as(logp), sgn * d_clip < sgn * d, ratio)


POLICY_LOSSES: dict[str, Callable[..., PolicyTerms]] = {
    "clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "sapo": sapo_loss,
    "vespo": vespo_loss,
    "gmpo": gmpo_loss,
}


def policy_knobs(name: str) -> tuple[str, ...]:
    """The settings policy loss ``name`` reads: its keyword-only parameters, each a config
    field of the same name."""
    params = inspect.signature(POLICY_LOSSES[name]).parameters.values()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)


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
    top_entropy_quantile: float = 1.0,
    off_policy_mask: float = 0.0,
    global_rows: int | None = None,
    global_tokens: int | None = None,
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
    subtracts coef x the entropy, aggregated like the loss over the tokens trained on; verl
    aggregates it the same way, TRL always takes its token mean). ``off_policy_mask`` > 0
    drops the policy loss of the answers ``off_policy_keep`` drops (the KL term stays).

    With one optimisation pass ``old_logp`` is ``logp.detach()``: the ratio is 1, its gradient
    is the policy gradient, and clipping never bites.

    ``global_rows`` / ``global_tokens``: the reply and token counts of the whole batch (over
    micro-batches and ranks) this part belongs to. The loss and ``policy_loss`` are then this
    part's share of the global values (its replies, or for ``token_mean`` its tokens, over the
    global count) and the token statistics (kl, clip_frac, entropy, the shares) its share
    of the tokens: summing the parts gives the whole batch's numbers and gradient.
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
    per_token = surrogate
    kl_val = 0.0
    if beta > 0 and ref_logp is not None:
        kl_fn = KL_ESTIMATORS.get(kl_estimator)
        if kl_fn is None:
            raise ValueError(f"unknown KL estimator {kl_estimator!r}")
        kl = kl_fn(logp, ref_logp)
        if kl_is_correction:
            kl = kl * terms.ratio
        per_token = per_token + beta * kl
        kl_val = float(((kl * m).sum() / m.sum().clamp(min=1)).detach())
    loss = aggregate(per_token, mask, agg, norm_len)
    if entropy_coef and entropy is not None:
        trained = mask if keep is None else mask * keep.to(mask.dtype)
        loss = loss - entropy_coef * aggregate(entropy, trained, agg, norm_len)
    elif entropy_coef:
        raise ValueError("entropy_coef > 0 needs the per-token entropies")
    denom = m.sum().clamp(min=1)
    ent_val = None if entropy is None else float((entropy.detach() * m).sum() / denom)
    out = LossOut(
        loss=loss,
        policy_loss=float(aggregate(surrogate.detach(), mask, agg, norm_len)),
        kl=kl_val,
        clip_frac=float((clipped.to(m.dtype) * m).sum() / denom),
        entropy=ent_val,
        entropy_share=1.0 if keep is None else float((keep.to(m.dtype) * m).sum() / denom),
        masked_share=0.0 if dropped is None else float(dropped.sum() / denom),
    )
    if global_rows is None and global_tokens is None:
        return out
    return share_of(out, mask, agg, global_rows, global_tokens)


def share_of(out: LossOut, mask: Tensor, agg: str, global_rows: int | None,
             global_tokens: int | None) -> LossOut:
    """A part's numbers as its share of the global batch's: the part's mean times its count
    over the global count (replies, or tokens for token-weighted aggregations)."""
    tok_share = int(mask.sum()) / global_tokens if global_tokens else 1.0
    rows = mask.shape[0] / global_rows if global_rows else 1.0
    share = tok_share if agg in TOKEN_WEIGHTED_AGGS else rows
    return LossOut(
        loss=out.loss * share,
        policy_loss=out.policy_loss * share,
        kl=out.kl * tok_share,
        clip_frac=out.clip_frac * tok_share,
        entropy=None if out.entropy is None else out.entropy * tok_share,
        entropy_share=out.entropy_share * tok_share,
        masked_share=out.masked_share * tok_share,
    )
