"""grpolab's policy losses against verl 0.9.1's own ``core_algos`` policy losses on identical
inputs (values and gradients): vanilla PPO with its dual clip, GSPO, CISPO, SAPO, GMPO
(verl's ``geo_mean``), KL-Cov, Clip-Cov, DPPO (TV and binary KL), DRO and GPG (with its
advantage), under each aggregation verl names the same way; and the KL estimators. verl's
functions run from its source file as they are (verl_harness.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import agree, pair
from verl_harness import verl_functions

from grpolab.core import losses as L
from grpolab.core.losses import grpo_loss

AGG = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean",
       "seq_mean_token_sum": "seq-mean-token-sum"}


class ActorConfig(SimpleNamespace):
    """The fields of verl's ActorConfig its policy losses read (one process: no global batch
    counts, so agg_loss takes this batch's)."""

    def __init__(self, **over: Any) -> None:
        policy = {k: over.pop(k) for k in list(over) if k.startswith(("kl_cov", "clip_cov"))
                  or k in ("ppo_kl_coef", "dro_beta")}
        super().__init__(**{"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None,
                            "clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05,
                            "global_batch_info": {}, "policy_loss": SimpleNamespace(
                                **{"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0,
                                   "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002,
                                   "ppo_kl_coef": 0.1, **policy}), **over})

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def verl_loss(mode: str, logp, old, adv, mask, agg: str, **config: Any):
    fn = verl_functions(f"compute_policy_loss_{mode}")[f"compute_policy_loss_{mode}"]
    per_token = adv if adv.dim() == 2 else adv[:, None].expand_as(logp)
    loss, _ = fn(old, logp, per_token, mask.float(), AGG[agg], ActorConfig(**config))
    return loss


def token_level(adv: torch.Tensor, t: int) -> torch.Tensor:
    """[B] advantages made [B, T], a different value on each token (REINFORCE++'s shape)."""
    return adv[:, None] * torch.linspace(1.5, -0.5, t)


@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize(("eps_low", "eps_high"), [(0.2, 0.2), (0.2, 0.28)])
def test_vanilla_matches_verl(agg: str, eps_low: float, eps_high: float) -> None:
    """verl's vanilla always applies its dual clip (clip_ratio_c 3): grpolab's dual_clip 3."""
    logp, old, _, adv, mask = pair(30, spread=1.5)  # ratios past the dual clip's cap
    agree(lambda: grpo_loss(logp, old, None, adv, mask, beta=0.0, agg=agg, eps_low=eps_low,
                            eps_high=eps_high, dual_clip=3.0).loss,
          lambda: verl_loss("vanilla", logp, old, adv, mask, agg, clip_ratio_low=eps_low,
                            clip_ratio_high=eps_high),
          logp)


@pytest.mark.parametrize("shape", ["answer", "token"])
@pytest.mark.parametrize("agg", list(AGG))
def test_gspo_matches_verl(agg: str, shape: str) -> None:
    """With token-level advantages verl's GSPO is the paper's GSPO-token (token t's ratio
    sg[s] pi_t / sg[pi_t]): each token's gradient weighted by its own advantage."""
    logp, old, _, adv, mask = pair(31, spread=0.05)
    adv = adv if shape == "answer" else token_level(adv, logp.shape[1])
    assert L.gspo_loss(logp, old, adv, mask, eps_low=0.01, eps_high=0.02).clipped.any()
    agree(lambda: grpo_loss(logp, old, None, adv, mask, beta=0.0, agg=agg, policy_loss="gspo",
                            eps_low=0.01, eps_high=0.02).loss,
          lambda: verl_loss("gspo", logp, old, adv, mask, agg, clip_ratio_low=0.01,
                            clip_ratio_high=0.02),
          logp)


@pytest.mark.parametrize("agg", list(AGG))
def test_cispo_matches_verl(agg: str) -> None:
    """verl clips CISPO's weight on both sides, at 1 -/+ its clip ratios."""
    logp, old, _, adv, mask = pair(32, spread=1.0)
    agree(lambda: grpo_loss(logp, old, None, adv, mask, beta=0.0, agg=agg, policy_loss="cispo",
                            cispo_min=1 - 0.3, cispo_max=1 + 0.5).loss,
          lambda: verl_loss("cispo", logp, old, adv, mask, agg, clip_ratio_low=0.3,
                            clip_ratio_high=0.5),
          logp)


@pytest.mark.parametrize(("tau_pos", "tau_neg"), [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_matches_verl(tau_pos: float, tau_neg: float) -> None:
    """verl's SAPO always takes the per-answer token mean (whatever loss_agg_mode says)."""
    logp, old, _, adv, mask = pair(33, spread=1.0)
    adv[2] = 0.0
    agree(lambda: grpo_loss(logp, old, None, adv, mask, beta=0.0, policy_loss="sapo",
                            agg="seq_mean_token_mean", sapo_tau_pos=tau_pos,
                            sapo_tau_neg=tau_neg).loss,
          lambda: verl_loss("sapo", logp, old, adv, mask, "token_mean", tau_pos=tau_pos,
                            tau_neg=tau_neg),
          logp)


@pytest.mark.parametrize(("eps_low", "eps_high"), [(0.4, 0.4), (0.1, 0.3)])
def test_gmpo_matches_verl_geo_mean(eps_low: float, eps_high: float) -> None:
    """verl's geo_mean takes the mean over answers (whatever loss_agg_mode says): grpolab's
    per-answer token mean of a loss that is the same on every token of the answer."""
    logp, old, _, adv, mask = pair(34, spread=1.0)
    adv[0] = 0.0
    clipped = L.gmpo_loss(logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high).clipped
    assert clipped[mask.bool()].any()  # the clip is exercised
    agree(lambda: grpo_loss(logp, old, None, adv, mask, beta=0.0, policy_loss="gmpo",
                            agg="seq_mean_token_mean", eps_low=eps_low,
                            eps_high=eps_high).loss,
          lambda: verl_loss("geo_mean", logp, old, adv, mask, "token_mean",
                            clip_ratio_low=eps_low, clip_ratio_high=eps_high),
          logp)


def _config_loss(cfg: Any, logp, old, ref, adv, mask, **split: int):
    """grpo_loss as the trainer calls it (run.update._part_loss) with ``cfg``'s settings."""
    from grpolab.core.policy_losses import policy_knobs

    return grpo_loss(logp, old, ref, adv, mask, beta=cfg.beta, agg=cfg.loss_agg,
                     policy_loss=cfg.policy_loss, kl_estimator=cfg.kl_estimator,
                     entropy_agg=cfg.entropy_agg, policy_agg=cfg.policy_agg,
                     **{k: getattr(cfg, k) for k in policy_knobs(cfg.policy_loss)}, **split).loss


@pytest.mark.parametrize(("mode", "extra"), [("sapo", {}), ("geo_mean", {}), ("gspo", {
    "clip_ratio_low": 0.01, "clip_ratio_high": 0.02, "clip_ratio_c": 1.05}), ("vanilla", {})])
def test_a_verl_config_gives_verls_whole_actor_loss(mode: str, extra: dict) -> None:
    """verl's actor loss, read from its config: the policy loss (SAPO's and geo_mean's mean per
    answer whatever loss_agg_mode says; GSPO without the dual clip clip_ratio_c gives the
    vanilla loss) plus kl_loss_coef x its KL aggregated as loss_agg_mode."""
    from grpolab.config import make_config

    a = "actor_rollout_ref.actor."
    extra = {"clip_ratio_c": 2.0, **extra}  # (GSPO's: a cap that would bite, were it applied)
    cfg = make_config(None, {a + "policy_loss.loss_mode": mode, a + "loss_agg_mode": "token-mean",
                             a + "use_kl_loss": True, a + "kl_loss_coef": 0.1,
                             a + "kl_loss_type": "low_var_kl",
                             **{a + k: v for k, v in extra.items()}}, "train")
    logp, old, ref, adv, mask = pair(37, spread=1.0)
    if mode == "gspo":  # a sequence ratio above the cap with a negative advantage
        seq = ((logp - old) * mask).sum(1) / mask.sum(1)
        assert bool(((seq.exp() > 1.05) & (adv < 0)).any())
    kl = verl_functions("kl_penalty", "kl_penalty_forward")["kl_penalty"]
    agg = verl_functions("agg_loss")["agg_loss"]

    def theirs():
        policy = verl_loss(mode, logp, old, adv, mask, "token_mean", **extra)
        return policy + 0.1 * agg(kl(logp, ref, "low_var_kl"), mask.float(), "token-mean")

    agree(lambda: _config_loss(cfg, logp, old, ref, adv, mask), theirs, logp)
    # micro-batches' shares of the whole (the KL's by tokens, the policy term's by answers)
    rows, tokens = mask.shape[0], int(mask.sum())
    parts = [_config_loss(cfg, logp[i], old[i], ref[i], adv[i], mask[i], global_rows=rows,
                          global_tokens=tokens) for i in (slice(0, 2), slice(2, None))]
    assert float(sum(parts).detach()) == pytest.approx(float(theirs().detach()), rel=1e-5)


@pytest.mark.parametrize(("ours", "theirs"), [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_estimators_match_verl(ours: str, theirs: str) -> None:
    """grpolab's KL estimators against verl's kl_penalty (actor.kl_loss_type / kl_penalty),
    where verl's k3 clamps (to [-10, 10]) do not bite."""
    logp, _, ref, _, _ = pair(35)
    kl = verl_functions("kl_penalty", "kl_penalty_forward")["kl_penalty"]
    agree(lambda: L.KL_ESTIMATORS[ours](logp, ref).sum(), lambda: kl(logp, ref, theirs).sum(),
          logp)


def test_k3_with_the_is_correction_is_verls_k3_plus_on_the_first_pass() -> None:
    """verl's ``k3+`` (k3's value, k2's gradient: the unbiased KL gradient) is what TRL's
    use_bias_correction_kl gives grpolab's k3 where the policy ratio is 1."""
    logp, _, ref, adv, mask = pair(36)
    kl = verl_functions("kl_penalty", "kl_penalty_forward")["kl_penalty"]
    agree(lambda: grpo_loss(logp, logp.detach(), ref, adv * 0, mask, beta=1.0,
                            agg="token_mean", kl_is_correction=True).loss,
          lambda: (kl(logp, ref, "k3+") * mask).sum() / mask.sum(), logp)


@pytest.mark.parametrize("shape", ["answer", "token"])
@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize(("ratio", "coef"), [(0.0002, 0.1), (0.2, 1.0)])
def test_kl_cov_matches_verl(agg: str, ratio: float, coef: float, shape: str) -> None:
    """KL-Cov: the |log r| penalty on the tokens of largest covariance (one token at verl's
    default share of this small batch, six at 0.2); one advantage per answer or per token."""
    logp, old, _, adv, mask = pair(37, spread=0.5)
    adv = adv if shape == "answer" else token_level(adv, logp.shape[1])
    hit = L.kl_cov_loss(logp, old, adv, mask, kl_cov_ratio=ratio).clipped
    assert hit.sum() == max(1, int(mask.sum() * ratio)) and not (hit & ~mask.bool()).any()
    agree(lambda: grpo_loss(logp, old, None, adv, mask, beta=0.0, agg=agg, policy_loss="kl_cov",
                            kl_cov_ratio=ratio, kl_cov_coef=coef).loss,
          lambda: verl_loss("kl_cov", logp, old, adv, mask, agg, kl_cov_ratio=ratio,
                            ppo_kl_coef=coef),
          logp)


@pytest.mark.parametrize("agg", list(AGG))
def test_clip_cov_matches_verl_on_the_same_random_draw(agg: str) -> None:
    """Clip-Cov: PPO's clip, and a random draw of tokens within the covariance bounds left
    without gradient, drawn from torch's global generator as verl draws them."""
    logp, old, _, adv, mask = pair(38, spread=0.8)
    knobs = {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0}
    torch.manual_seed(3)
    t = L.clip_cov_loss(logp, old, adv, mask, **knobs)
    ratio = torch.exp(logp.detach() - old)
    by_clip = ((-adv[:, None] * torch.clamp(ratio, 0.8, 1.2)) > (-adv[:, None] * ratio))
    dropped = t.clipped & ~by_clip
    assert dropped.sum() == int(0.2 * mask.sum()) and (t.loss[dropped] == 0).all()

    def ours() -> torch.Tensor:
        torch.manual_seed(3)
        return grpo_loss(logp, old, None, adv, mask, beta=0.0, agg=agg,
                         policy_loss="clip_cov", **knobs).loss

    def theirs() -> torch.Tensor:
        torch.manual_seed(3)
        return verl_loss("clip_cov", logp, old, adv, mask, agg, **knobs)

    agree(ours, theirs, logp)


@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_dppo_matches_verl(agg: str, mode: str) -> None:
    """DPPO: the trust region on the sampled token's probability (its difference, or its
    binary KL), the importance weight capped (verl's clip_ratio_c)."""
    logp, old, _, adv, mask = pair(39, spread=1.2)
    logp = (logp.detach() / 3).requires_grad_(True)  # probabilities far from 0: regions bite
    old = (old / 3).clamp(max=-0.01)  # (probabilities, below 1)
    eps, cap = (0.05, 0.08), 1.5
    terms = L.POLICY_LOSSES[mode](logp, old, adv, mask, eps_low=eps[0], eps_high=eps[1],
                                  dppo_cap=cap)
    out = terms.clipped & mask.bool()
    assert out[adv > 0].any() and out[adv < 0].any()  # left out on both sides, not all
    assert out.sum() < mask.sum()
    assert (torch.exp(logp.detach() - old)[~out & mask.bool()] > cap).any()  # the cap bites
    agree(lambda: grpo_loss(logp, old, None, adv, mask, beta=0.0, agg=agg, policy_loss=mode,
                            eps_low=eps[0], eps_high=eps[1], dppo_cap=cap).loss,
          lambda: verl_loss(mode, logp, old, adv, mask, agg, clip_ratio_low=eps[0],
                            clip_ratio_high=eps[1], clip_ratio_c=cap),
          logp)


@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize("shape", ["answer", "token"])
def test_dro_matches_verl(agg: str, shape: str) -> None:
    logp, old, _, adv, mask = pair(40, spread=0.5)
    adv = adv if shape == "answer" else token_level(adv, logp.shape[1])
    agree(lambda: grpo_loss(logp, old, None, adv, mask, beta=0.0, agg=agg, policy_loss="dro",
                            dro_beta=0.3).loss,
          lambda: verl_loss("dro", logp, old, adv, mask, agg, dro_beta=0.3), logp)


@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize("shape", ["answer", "token"])
def test_gpg_loss_matches_verl(agg: str, shape: str) -> None:
    logp, old, _, adv, mask = pair(41, spread=0.5)
    adv = adv if shape == "answer" else token_level(adv, logp.shape[1])
    agree(lambda: grpo_loss(logp, old, None, adv, mask, beta=0.0, agg=agg,
                            policy_loss="gpg").loss,
          lambda: verl_loss("gpg", logp, old, adv, mask, agg), logp)


def test_gpg_advantage_matches_verl() -> None:
    """verl's compute_gpg_outcome_advantage: (r - group mean) x batch / nonzero rewards, no
    std; grpolab's scale gpg (dead groups 0 either way), on groups and on ragged groups."""
    import numpy as np

    from grpolab.core import advantages as A

    fn = verl_functions("compute_gpg_outcome_advantage")["compute_gpg_outcome_advantage"]
    g = torch.Generator().manual_seed(5)
    rewards = (torch.rand(24, generator=g) < 0.4).float() * torch.rand(24, generator=g).round()
    rewards[8:12] = 1.0  # a dead group, all right
    mask = torch.ones(24, 3)
    token_rewards = torch.zeros(24, 3)
    token_rewards[:, -1] = rewards
    want, _ = fn(token_rewards, mask, np.repeat(np.arange(6), 4))
    got = A.group_advantages(rewards, 4, scale="gpg")
    torch.testing.assert_close(got, want[:, 0], rtol=1e-6, atol=1e-7)
    assert float(torch.count_nonzero(rewards)) < 24 and bool((got[8:12] == 0).all())
    ragged = A.group_advantages_ragged(rewards, A.group_ids_from_sizes([4] * 6), scale="gpg")
    torch.testing.assert_close(ragged, want[:, 0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized"])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("std", [{"std": "sample", "std_eps": 1e-6}, {"defaults": "verl"}])
def test_verls_group_advantages_from_its_config(name: str, norm: bool, std: dict) -> None:
    """verl's GRPO and RLOO advantages (the loop and the vectorized forms) against grpolab's
    reading of its config (with verl's sample std + 1e-6, given or as ``defaults: verl``):
    random rewards, a dead group all right, one all wrong, one of equal fractions; Dr. GRPO's
    norm_adv_by_std_in_grpo=False (read by verl's grpo only, as here)."""
    import numpy as np

    from grpolab.config import make_config
    from grpolab.run.update import advantages

    g = torch.Generator().manual_seed(6)
    rewards = torch.rand(32, generator=g)
    rewards[:16] = (rewards[:16] > 0.5).float()
    rewards[16:20], rewards[20:24], rewards[24:28] = 1.0, 0.0, 0.25
    cfg = make_config(None, {"algorithm.adv_estimator": name, **std,
                             "algorithm.norm_adv_by_std_in_grpo": norm,
                             "actor_rollout_ref.rollout.n": 4}, "train")
    fn_name = f"compute_{name.split('_')[0]}{'_vectorized' * name.endswith('vectorized')}"
    ns = verl_functions(f"{fn_name}_outcome_advantage")
    token_rewards = torch.zeros(32, 3)
    token_rewards[:, -1] = rewards
    told = {"norm_adv_by_std_in_grpo": norm} if name == "grpo" else {}  # (verl's compute_advantage)
    want, _ = ns[f"{fn_name}_outcome_advantage"](token_rewards, torch.ones(32, 3),
                                                 np.repeat(np.arange(8), 4), epsilon=1e-6, **told)
    got = advantages(cfg, rewards)
    torch.testing.assert_close(got, want[:, 0].float(), rtol=1e-5, atol=1e-6)
    assert bool((got[16:28] == 0).all())  # dead groups: exactly 0 in grpolab


def test_token_sum_norm_divides_by_verls_loss_scale_factor() -> None:
    """seq-mean-token-sum-norm (Dr. GRPO): verl divides by loss_scale_factor, by default the
    responses' padded length; grpolab by loss_norm_len, by default max_new_tokens (the same
    where answers are padded to it, as verl pads them)."""
    agg = verl_functions("agg_loss")["agg_loss"]
    gen = torch.Generator().manual_seed(5)
    loss_mat = torch.randn(4, 7, generator=gen)
    mask = (torch.rand(4, 7, generator=gen) > 0.3).float()
    for factor in (None, 512):
        theirs = agg(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=factor)
        ours = L.LOSS_AGGREGATIONS["seq_mean_token_sum_norm"](loss_mat, mask, factor or 7)
        assert torch.allclose(ours, theirs)


def test_the_trainer_divides_by_loss_norm_len(tmp_path) -> None:
    """loss_norm_len 2 with answers of at most 4 tokens: the same batch's loss, twice max_new
    tokens' (0: the default divisor)."""
    from helpers import world_trainer

    losses = []
    for n in (0, 2):
        tr = world_trainer(tmp_path / str(n), loss_agg="seq_mean_token_sum_norm",
                           loss_norm_len=n, beta=0.0)
        losses.append(tr.update(tr.collect())["policy_loss"])
    assert losses[0] != 0 and losses[1] == pytest.approx(2 * losses[0], rel=1e-6)
