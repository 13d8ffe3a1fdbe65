"""verl 0.9.1's whole actor loss and its KL in the reward, run as verl's own code on the same
inputs as grpolab reads a verl config: ``workers/utils/losses.py::ppo_loss`` (the policy loss,
minus ``entropy_coeff`` x the entropy, plus ``kl_loss_coef`` x the KL, each aggregated as
``loss_agg_mode``; micro-batches as shares of the global batch), and
``ray_trainer.apply_kl_penalty`` (``use_kl_in_reward``: ``kl_ctrl.kl_coef`` x the per-token
``kl_penalty`` off the token-level rewards) followed by verl's advantage estimators, against
grpolab's scoring pass (``run.update.score``) and ``batch_advantages``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers import pair
from verl_harness import VerlConfig, padded_batch, verl_apply_kl_penalty, verl_ppo_loss

from grpolab.config import make_config
from grpolab.core.losses import grpo_loss
from grpolab.core.policy_losses import policy_knobs
from grpolab.rollout.batch import Rollout
from grpolab.run import update
from grpolab.run.collect import Batch

A = "actor_rollout_ref.actor."
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def actor_config(mode: str, agg: str, coef: float) -> VerlConfig:
    """verl's ActorConfig as the config below sets it (its defaults elsewhere)."""
    policy = VerlConfig(loss_mode=mode, clip_cov_ratio=0.0002, clip_cov_lb=1.0,
                        clip_cov_ub=5.0, kl_cov_ratio=0.0002, ppo_kl_coef=0.1, dro_beta=0.1)
    return VerlConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                      clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05, global_batch_info={},
                      policy_loss=policy, loss_scale_factor=None, loss_agg_mode=agg,
                      entropy_coeff=coef, use_kl_loss=True, kl_loss_type="mse",
                      kl_loss_coef=0.05)


def grpolab_config(mode: str, agg: str, coef: float, width: int) -> Any:
    return make_config(None, {A + "policy_loss.loss_mode": mode, A + "loss_agg_mode": agg,
                              A + "use_kl_loss": True, A + "kl_loss_coef": 0.05,
                              A + "kl_loss_type": "mse", A + "entropy_coeff": coef,
                              A + "clip_ratio_high": 0.28, A + "clip_ratio_c": 3.0,
                              "data.max_response_length": width}, "train")


def ours(cfg: Any, logp, old, ref, adv, mask, ent, **split: int) -> torch.Tensor:
    """grpo_loss as the update calls it with ``cfg``'s settings."""
    knobs = {"eps_low": cfg.eps_low, "eps_high": cfg.eps_high, "dual_clip": cfg.dual_clip,
             **{k: getattr(cfg, k) for k in policy_knobs(cfg.policy_loss)}}
    return grpo_loss(logp, old, ref, adv, mask, beta=cfg.beta, agg=cfg.loss_agg,
                     policy_loss=cfg.policy_loss, kl_estimator=cfg.kl_estimator, entropy=ent,
                     entropy_coef=cfg.entropy_coef, entropy_agg=cfg.entropy_agg,
                     policy_agg=cfg.policy_agg, norm_len=cfg.loss_norm_len or cfg.max_new_tokens,
                     **knobs, **split).loss


def same(a: torch.Tensor, b: torch.Tensor, *leaves: torch.Tensor) -> None:
    """Equal loss, equal gradients with respect to each leaf."""
    ga = torch.autograd.grad(a, leaves, allow_unused=True)
    gb = torch.autograd.grad(b, leaves, allow_unused=True)
    assert a.item() == pytest.approx(b.item(), rel=1e-5, abs=1e-6)
    for x, y in zip(ga, gb):
        x = torch.zeros(()) if x is None else x
        y = torch.zeros(()) if y is None else y
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), (x, y)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(("mode", "shape"), [
    ("vanilla", "answer"), ("vanilla", "token"), ("sapo", "answer"), ("sapo", "token"),
    ("geo_mean", "answer"), ("gspo", "answer"), ("gspo", "token"), ("cispo", "token"),
    ("gpg", "token"), ("dro", "token")])
def test_verls_actor_loss_with_entropy_and_kl(mode: str, shape: str, agg: str) -> None:
    """verl's ppo_loss (entropy_coeff 0.03, a k2 KL at 0.05) against grpolab's reading of the
    same verl config; the entropy bonus and the KL aggregated as loss_agg_mode (SAPO's and
    geo_mean's policy term per answer whatever it says). Advantages one per answer or per
    token (REINFORCE++, PPO); the loss and its gradients in log-probs and entropies."""
    logp, old, ref, adv, mask = pair(41, b=8, spread=0.6)
    adv = adv if shape == "answer" else adv[:, None] * torch.linspace(1.5, -0.5, logp.shape[1])
    ent = torch.rand(logp.shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
    cfg = grpolab_config(mode, agg, 0.03, logp.shape[1])
    ppo_loss = verl_ppo_loss()
    theirs = ppo_loss(actor_config(mode, agg, 0.03), {"log_probs": logp, "entropy": ent},
                      padded_batch(mask, old, adv, ref))[0]
    same(ours(cfg, logp, old, ref, adv, mask, ent), theirs, logp, ent)
    if mode == "geo_mean":  # (verl sums its micro-batches' means unscaled: docs/objectives.md)
        return
    rows, tokens, parts = logp.shape[0], int(mask.sum()), (slice(0, 3), slice(3, None))
    split = sum(ours(cfg, logp[i], old[i], ref[i], adv[i], mask[i], ent[i], global_rows=rows,
                     global_tokens=tokens) for i in parts)
    verl_split = sum(ppo_loss(actor_config(mode, agg, 0.03),
                              {"log_probs": logp[i], "entropy": ent[i]},
                              padded_batch(mask[i], old[i], adv[i], ref[i], tokens, rows))[0]
                     for i in parts)
    same(split, verl_split, logp, ent)


# ------------------------------------------------------------ KL in the reward --

B, T, G = 8, 5, 4


class _Policy:
    """A backend whose log-probs (policy and reference) are fixed per row (prompt = row)."""

    def __init__(self, lp: torch.Tensor, ref: torch.Tensor) -> None:
        self.lp, self.ref = lp, ref

    def logprobs(self, ro: Rollout, temperature: float, reference: bool = False) -> torch.Tensor:
        rows = torch.tensor(ro.prompts)
        return (self.ref if reference else self.lp)[rows, : ro.completion_ids.shape[1]].clone()


def _verl_advantages(ns: dict, est: str, kind: str, norm: bool, scores, mask, lp, ref):
    class _Batch(dict):
        batch_size = (B,)

    batch = _Batch(response_mask=mask.float(), old_log_probs=lp, ref_log_prob=ref,
                   token_level_scores=scores)
    ns["apply_kl_penalty"](type("Data", (), {"batch": batch})(),
                           kl_ctrl=type("Fixed", (), {"value": 0.2, "update": lambda *a, **k: None})(),
                           kl_penalty=kind)
    rewards, m, idx = batch["token_level_rewards"], mask.float(), np.repeat(np.arange(B // G), G)
    if est == "reinforce_plus_plus":
        return ns["compute_reinforce_plus_plus_outcome_advantage"](
            rewards, m, config=VerlConfig(gamma=0.9))[0]
    told = {"norm_adv_by_std_in_grpo": norm} if est == "grpo" else {}
    return ns[f"compute_{est}_outcome_advantage"](rewards, m, idx, **told)[0]


@pytest.mark.parametrize("kind", ["kl", "mse", "low_var_kl"])
@pytest.mark.parametrize(("est", "norm"), [
    ("grpo", True), ("grpo", False), ("rloo", True), ("gpg", True),
    ("reinforce_plus_plus", True), ("reinforce_plus_plus_baseline", True)])
def test_kl_in_reward_matches_verl(kind: str, est: str, norm: bool) -> None:
    """use_kl_in_reward: verl's apply_kl_penalty (kl_ctrl.kl_coef x kl_penalty of the rollout
    policy to the reference, on every response token) and then its estimator, against
    grpolab's scoring pass and advantages for the same verl config (two micro-batches; a group
    whose outcome rewards are all equal, which its KL keeps alive in both)."""
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(B, T, generator=gen) * 2
    ref = lp + 0.4 * torch.randn(B, T, generator=gen)
    lens = torch.tensor([5, 3, 1, 4, 2, 5, 5, 3])
    mask = (torch.arange(T)[None] < lens[:, None]).long()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    scores = torch.zeros(B, T)
    scores[torch.arange(B), lens - 1] = rewards
    cfg = make_config(None, {"algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": kind,
                             "algorithm.kl_ctrl.kl_coef": 0.2, "algorithm.adv_estimator": est,
                             "algorithm.norm_adv_by_std_in_grpo": norm, "algorithm.gamma": 0.9,
                             "defaults": "verl", "actor_rollout_ref.rollout.n": G,
                             "data.train_batch_size": B // G, A + "ppo_mini_batch_size": B // G,
                             A + "ppo_micro_batch_size_per_gpu": 3}, "train")
    ro = Rollout(list(range(B)), torch.zeros(B, 1, dtype=torch.long),
                 torch.ones(B, 1, dtype=torch.long), torch.ones(B, T, dtype=torch.long),
                 mask.clone(), [""] * B)
    batch = Batch(rollout=ro, rows=[{}] * B, rewards=rewards.clone())
    scored = update.score(cfg, _Policy(lp, ref), batch)
    got = update.batch_advantages(cfg, batch, scored, 0)
    got = got if got.dim() == 2 else got[:, None] * mask
    want = _verl_advantages(verl_apply_kl_penalty(), est, kind, norm, scores, mask, lp, ref)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=2e-6)
    assert bool((got[4:8].abs() > 1e-3).any())  # the all-right group, alive through its KL
