"""The policy losses besides PPO's clip, on hand-computed values: GSPO (sequence-level
ratios), the dual clip and CISPO; and the default objective, bit for bit the old formula.
(Each against TRL's own code: test_objectives_trl.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import pair

from grpolab.config import ConfigError, make_config
from grpolab.core import losses as L
from grpolab.core.losses import grpo_loss

# ------------------------------------------------------------------------ GSPO --


def test_gspo_hand_values() -> None:
    """Answer 0: token log-ratios 0.1, 0.3 -> s = e^0.2 = 1.2214, A = +1: clipped to 1.2, no
    gradient. Answer 1: one token, log-ratio -0.1 -> s = e^-0.1 = 0.9048, A = -1: unclipped."""
    old = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    logp = (old + torch.tensor([[0.1, 0.3], [-0.1, 0.0]])).requires_grad_(True)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1.0])
    terms = L.gspo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert terms.ratio.flatten().tolist() == pytest.approx([math.exp(0.2), math.exp(-0.1)])
    assert terms.loss[0].tolist() == pytest.approx([-1.2, -1.2])
    assert terms.loss[1, 0].item() == pytest.approx(math.exp(-0.1))
    assert terms.clipped.tolist() == [[True, True], [False, False]]
    out = grpo_loss(logp, old, None, adv, mask, beta=0.0, policy_loss="gspo")
    assert out.loss.item() == pytest.approx((-1.2 + math.exp(-0.1)) / 2)
    assert out.clip_frac == pytest.approx(2 / 3)
    out.loss.backward()
    # d/dlogp of s = exp(mean log-ratio) is s / |y|; per-reply mean, then 1/2 over replies
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, 0.5 * math.exp(-0.1), 0.0])


def test_gspo_first_pass_gradient_is_grpo_gradient() -> None:
    logp, _, _, adv, mask = pair(1)
    g = []
    for name in ("clip", "gspo"):
        out = grpo_loss(logp, logp.detach(), None, adv, mask, beta=0.0, policy_loss=name)
        g.append(torch.autograd.grad(out.loss, logp)[0])
    assert torch.allclose(g[0], g[1], atol=1e-7)


# ------------------------------------------------------------------- dual clip --


def test_dual_clip_hand_values() -> None:
    """A = -1: ratio 4 costs 4 unclipped, capped at c = 3 (no gradient); ratio 2 stays 2 with
    gradient 2 (= ratio x |A|). A = +1, ratio 4: the usual upper clip, -1.2, untouched."""
    old = torch.zeros(3, 1)
    logp = torch.log(torch.tensor([[4.0], [2.0], [4.0]])).requires_grad_(True)
    adv = torch.tensor([-1.0, -1.0, 1.0])
    t = L.ppo_clip_loss(logp, old, adv, torch.ones(3, 1), dual_clip=3.0)
    assert t.loss.flatten().tolist() == pytest.approx([3.0, 2.0, -1.2])
    assert t.clipped.flatten().tolist() == [True, False, True]
    (g,) = torch.autograd.grad(t.loss.sum(), logp)
    assert g.flatten().tolist() == pytest.approx([0.0, 2.0, 0.0])
    plain = L.ppo_clip_loss(logp, old, adv, torch.ones(3, 1))
    assert plain.loss.flatten().tolist() == pytest.approx([4.0, 2.0, -1.2])


def test_dual_clip_config() -> None:
    assert make_config(None, {"dual_clip": 3}).dual_clip == 3.0
    with pytest.raises(ConfigError, match="dual_clip must be 0"):
        make_config(None, {"dual_clip": 1.1})


# ----------------------------------------------------------------------- CISPO --


def test_cispo_hand_values() -> None:
    """Answer 0: ratio 2, A = +1, weight min(2, 1.5) = 1.5: loss -1.5 x 1 x (-1) = 1.5,
    gradient -1.5. Answer 1: ratio 0.5, A = -1: loss -0.5 x -1 x -2 = -1, gradient 0.5.
    Token mean: 0.25; gradients halved."""
    logp = torch.tensor([[-1.0], [-2.0]], requires_grad=True)
    old = logp.detach() - torch.log(torch.tensor([[2.0], [0.5]]))
    adv = torch.tensor([1.0, -1.0])
    out = grpo_loss(logp, old, None, adv, torch.ones(2, 1), beta=0.0, policy_loss="cispo",
                    cispo_max=1.5, agg="token_mean")
    assert out.loss.item() == pytest.approx(0.25)
    assert out.clip_frac == pytest.approx(0.5)
    (g,) = torch.autograd.grad(out.loss, logp)
    assert g.flatten().tolist() == pytest.approx([-0.75, 0.25])


def test_cispo_first_pass_gradient_is_grpo_gradient() -> None:
    logp, _, _, adv, mask = pair(9)
    g = []
    for name in ("clip", "cispo"):
        out = grpo_loss(logp, logp.detach(), None, adv, mask, beta=0.0, policy_loss=name,
                        agg="token_mean")
        g.append(torch.autograd.grad(out.loss, logp)[0])
    assert torch.allclose(g[0], g[1], atol=1e-7)


# --------------------------------------------------------------------- default --


def test_default_loss_is_unchanged() -> None:
    """The default objective is computed by exactly the operations it was before the
    registries: the old formula, bit for bit."""
    logp, old, ref, adv, mask = pair(13, spread=0.4)
    out = grpo_loss(logp, old, ref, adv, mask, beta=0.04)
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    surrogate = -torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
    d = ref - logp
    per_token = surrogate + 0.04 * (torch.exp(d) - d - 1)
    m = mask.to(per_token.dtype)
    want = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    assert torch.equal(out.loss, want)
