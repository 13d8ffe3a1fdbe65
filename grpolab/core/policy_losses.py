"""The policy-loss term of the GRPO objective: each variant one pure function and one entry
in ``POLICY_LOSSES`` (the config's ``policy_loss``, the CLI's choices and the workshop's
presets are read from it).

Shapes: per-token tensors are [B, T] over completion tokens, ``mask`` is 1 on real completion
tokens and 0 on padding; ``advantages`` is [B] (one per answer) or [B, T] (one per token).
Each function is (logp, old_logp, advantages, mask, **knobs) -> PolicyTerms (per-token loss,
where a clip or cap bit, the importance ratio); its keyword-only knobs are config fields of
the same names (``policy_knobs``). The whole objective is ``grpolab.core.losses.grpo_loss``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor


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
    uses 3e-4 / 4e-4); every token of the answer gets the answer's loss.

    With token-level advantages [B, T] (REINFORCE++, PPO) it is the paper's GSPO-token, as
    verl's ``gspo``: token t's ratio is sg[s] pi_t / sg[pi_t] (s's value, the token's own
    gradient), so each token's gradient is weighted by its own advantage; with one advantage
    per answer the two forms have the same value and gradient. (Differentiating s itself, as
    TRL's sequence level does, would give every token its answer's mean advantage.)"""
    seq = _log_ratio(logp, old_logp, mask, "sequence")  # [B, 1]
    ratio = torch.exp(seq)
    if advantages.dim() == 2:  # GSPO-token (verl 0.9.1's compute_policy_loss_gspo)
        token_ratio = torch.exp(logp - logp.detach() + seq.detach())
        loss, hit = _ppo_clip(token_ratio, advantages, eps_low, eps_high, dual_clip)
        return PolicyTerms(loss, hit, ratio)
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


def _token_cov(adv: Tensor, logp: Tensor, real: Tensor) -> Tensor:
    """[B, T] (A - mean A)(log pi - mean log pi) over the real tokens (means over them too):
    a token's share of the covariance that drives the policy's entropy down."""
    adv, logp, n = adv.float(), logp.detach().float(), real.sum() + 1e-8  # (float32, as verl)
    a_mean = (adv * real).sum() / n
    lp_mean = (logp * real).sum() / n
    return (adv - a_mean) * (logp - lp_mean)


def kl_cov_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                kl_cov_ratio: float = 0.0002, kl_cov_coef: float = 0.1,
                **_: float) -> PolicyTerms:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models"; verl's kl_cov): the unclipped surrogate -r A on every token, plus
    ``kl_cov_coef`` x |log r| on the ``kl_cov_ratio`` share (at least one) of the real tokens
    with the largest ``_token_cov``, which would drive the entropy down fastest. The share is
    of the tokens this call sees: verl's micro-batch, grpolab's ``micro_batch`` rows (the whole
    batch by default). ``clipped`` marks the penalised tokens."""
    d = logp - old_logp
    ratio = torch.exp(d)
    adv = _per_token(advantages).expand_as(logp)
    real = mask.bool()
    hit = torch.zeros(real.shape, dtype=torch.bool, device=real.device)
    if real.any():
        cov = _token_cov(adv, logp, real)[real]
        top = torch.topk(cov, max(1, int(cov.numel() * kl_cov_ratio))).indices
        hit.view(-1)[real.flatten().nonzero().squeeze(-1)[top]] = True
    loss = -adv * ratio + kl_cov_coef * d.abs() * hit
    return PolicyTerms(loss, hit, ratio)


def clip_cov_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                  eps_low: float = 0.2, eps_high: float = 0.2, clip_cov_ratio: float = 0.0002,
                  clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
                  **_: float) -> PolicyTerms:
    """Clip-Cov (the same paper; verl's clip_cov): PPO's clip, and of the tokens it left
    unclipped whose ``_token_cov`` lies in (``clip_cov_lb``, ``clip_cov_ub``) a random
    ``clip_cov_ratio`` share of the real tokens (at least one) gets no loss and no gradient,
    drawn with torch's global generator as verl draws them. The share is of the tokens this
    call sees (as ``kl_cov_loss``). ``clipped`` marks both kinds."""
    ratio = torch.exp(logp - old_logp)
    adv = _per_token(advantages).expand_as(logp)
    real = mask.bool()
    loss, by_clip = _ppo_clip(ratio, adv, eps_low, eps_high, 0.0)
    by_clip = by_clip & real
    cov = _token_cov(adv, logp, real).masked_fill(~real | by_clip, -math.inf)
    pick = ((cov < clip_cov_ub) & (cov > clip_cov_lb) & real).nonzero()
    pick = pick[torch.randperm(len(pick))[:max(int(clip_cov_ratio * float(real.sum())), 1)]]
    keep = torch.ones_like(logp)
    keep[pick[:, 0], pick[:, 1]] = 0
    return PolicyTerms(loss * keep, by_clip | (keep == 0), ratio)


def _dppo(logp: Tensor, old_logp: Tensor, advantages: Tensor, keep_pos: Tensor,
          keep_neg: Tensor, cap: float) -> PolicyTerms:
    """DPPO's loss: REINFORCE -w A log pi with the importance weight w = min(r, cap) held
    constant, on the tokens inside the trust region (``keep_pos`` where A > 0, else
    ``keep_neg``); ``clipped`` marks the tokens outside it."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    adv = _per_token(advantages)
    keep = torch.where(adv > 0, keep_pos, keep_neg).detach()
    w = torch.clamp(ratio, max=cap).detach()
    return PolicyTerms(-adv * w * logp * keep, ~keep, ratio)


def dppo_tv_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                 eps_low: float = 0.2, eps_high: float = 0.2, dppo_cap: float = 3.0,
                 **_: float) -> PolicyTerms:
    """DPPO-Binary-TV (arXiv 2602.04879; verl's dppo_tv): the trust region is on the sampled
    token's probability, not its ratio: a token leaves the loss once pi - pi_old passes
    ``eps_high`` (A > 0) or falls below -``eps_low`` (A <= 0); the rest get REINFORCE weighted
    by min(r, ``dppo_cap``) (verl's clip_ratio_c, 3 by default; the paper suggests a large cap)."""
    diff = torch.exp(logp) - torch.exp(old_logp)
    return _dppo(logp, old_logp, advantages, diff <= eps_high, diff >= -eps_low, dppo_cap)


def dppo_kl_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                 eps_low: float = 0.2, eps_high: float = 0.2, dppo_cap: float = 3.0,
                 **_: float) -> PolicyTerms:
    """DPPO-Binary-KL (the same paper; verl's dppo_kl): as ``dppo_tv_loss`` with the binary KL
    of the sampled token (p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))) as the
    divergence, bounding only moves in the advantage's direction."""
    p, q = torch.exp(logp), torch.exp(old_logp)
    kl = q * (old_logp - logp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
    return _dppo(logp, old_logp, advantages, (kl <= eps_high) | (p <= q),
                 (kl <= eps_low) | (p >= q), dppo_cap)


def dro_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
             dro_beta: float = 0.1, **_: float) -> PolicyTerms:
    """DRO (verl's dro): REINFORCE with a quadratic penalty on the log-ratio,
    -(A log pi - dro_beta / 2 (log pi - log pi_old)^2); nothing is clipped."""
    d = logp - old_logp
    loss = -(logp * _per_token(advantages) - 0.5 * dro_beta * d.square())
    return PolicyTerms(loss, torch.zeros_like(logp, dtype=torch.bool), torch.exp(d))


def gpg_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
             **_: float) -> PolicyTerms:
    """GPG (Chu et al. 2025, verl's gpg): plain REINFORCE, -A log pi, no ratio and no clip (its
    advantage: ``scale: gpg``). Its gradient is the clipped surrogate's at ratio 1; on later
    passes (``epochs`` > 1) nothing keeps it near the policy that sampled."""
    loss = -logp * _per_token(advantages)
    return PolicyTerms(loss, torch.zeros_like(logp, dtype=torch.bool),
                       torch.exp(logp - old_logp))


POLICY_LOSSES: dict[str, Callable[..., PolicyTerms]] = {
    "clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "sapo": sapo_loss,
    "vespo": vespo_loss,
    "gmpo": gmpo_loss,
    "kl_cov": kl_cov_loss,
    "clip_cov": clip_cov_loss,
    "dppo_tv": dppo_tv_loss,
    "dppo_kl": dppo_kl_loss,
    "dro": dro_loss,
    "gpg": gpg_loss,
}


def policy_knobs(name: str) -> tuple[str, ...]:
    """The settings policy loss ``name`` reads: its keyword-only parameters, each a config
    field of the same name."""
    params = inspect.signature(POLICY_LOSSES[name]).parameters.values()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)
