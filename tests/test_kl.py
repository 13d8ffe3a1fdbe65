"""The KL estimators (k1, k2, k3), k3 with the importance-sampling correction, and the KL
penalty taken off the reward (kl_in: reward). (k3 against TRL: test_objectives_trl.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import world_trainer

from grpolab.config import ConfigError, make_config
from grpolab.core import losses as L
from grpolab.core.losses import grpo_loss
from grpolab.run import update


def test_kl_estimators_hand_values() -> None:
    lp, ref = torch.tensor([-0.5, -2.0]), torch.tensor([-0.6, -1.5])  # log-ratios 0.1, -0.5
    assert L.k1_kl(lp, ref).tolist() == pytest.approx([0.1, -0.5])
    assert L.k2_kl(lp, ref).tolist() == pytest.approx([0.005, 0.125])
    assert L.k3_kl(lp, ref).tolist() == pytest.approx(
        [math.exp(-0.1) + 0.1 - 1, math.exp(0.5) - 0.5 - 1], rel=1e-5)
    for name in L.KL_ESTIMATORS:  # all vanish when policy == reference
        assert L.KL_ESTIMATORS[name](lp, lp).tolist() == [0.0, 0.0]


def test_k3_with_is_correction_hand_gradient() -> None:
    """First pass (ratio 1): the corrected k3 has the same value, and its gradient is
    (1 - e^d) + k3 = -d = log pi - log ref (k1's value: the unbiased reverse-KL gradient)
    instead of k3's 1 - e^d, with d = ref - logp."""
    lp = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    ref = torch.tensor([[-0.6, -1.5]])
    mask = torch.ones(1, 2)
    kw = {"beta": 1.0, "agg": "token_mean"}
    plain = grpo_loss(lp, lp.detach(), ref, torch.zeros(1), mask, **kw)
    corr = grpo_loss(lp, lp.detach(), ref, torch.zeros(1), mask, kl_is_correction=True, **kw)
    assert corr.loss.item() == pytest.approx(plain.loss.item()) and corr.kl == plain.kl
    (g1,) = torch.autograd.grad(plain.loss, lp)
    (g2,) = torch.autograd.grad(corr.loss, lp)
    d = [-0.1, 0.5]
    assert g1.flatten().tolist() == pytest.approx([(1 - math.exp(x)) / 2 for x in d])
    assert g2.flatten().tolist() == pytest.approx([-x / 2 for x in d])


def test_kl_in_reward(tmp_path) -> None:
    """kl_in: reward takes beta x the answer's summed KL off its reward (here k1, verl's
    default) and leaves the loss without a KL term."""
    tr = world_trainer(tmp_path, kl_in="reward", kl_estimator="k1", beta=0.5)
    with torch.no_grad():  # move the policy away from its frozen copy (the reference)
        for p in tr.backend.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = tr.collect()
    ro = batch.rollout
    lp = tr.backend.logprobs(ro, 1.0).detach()
    ref = tr.backend.logprobs(ro, 1.0, reference=True).detach()
    want = 0.5 * ((lp - ref) * ro.completion_mask).sum(-1)
    rewards, pen = update.kl_rewards(tr.cfg, tr.backend, ro, batch.rewards)
    assert torch.allclose(pen, want, atol=1e-6)
    assert torch.allclose(rewards, batch.rewards - want, atol=1e-6)
    out = tr.update(batch)
    assert out["kl"] == 0.0 and out["kl_reward"] == pytest.approx(float(want.mean()), rel=1e-5)
    with pytest.raises(ConfigError, match="kl_is_correction"):
        make_config(None, {"kl_in": "reward", "kl_is_correction": True})
