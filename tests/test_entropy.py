"""Token entropies: scored in the log-prob pass, the entropy bonus, and the entropy logged
every step. (Against TRL, and the high-entropy token selection: test_objectives_trl.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import world_trainer

from grpolab.core.losses import grpo_loss
from grpolab.rollout import head as H


def test_entropy_hand_values() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.5, 1e-30], [0.5, 0.25, 0.25]]]))
    logits[0, 0, 2] = float("-inf")  # a masked vocabulary entry adds 0, not NaN
    targets = torch.tensor([[0, 2]])
    lp, ent = H.token_logprobs_and_entropy(logits, targets)
    assert ent.flatten().tolist() == pytest.approx([math.log(2), 1.5 * math.log(2)])
    assert torch.equal(lp, H.token_logprobs(logits, targets))  # bit for bit
    assert lp.flatten().tolist() == pytest.approx([math.log(0.5), math.log(0.25)])


def test_entropy_bonus_hand_value() -> None:
    """Per-reply mean (the default aggregation), like the loss: replies of entropies (1, 3)
    and (2): bonus 0.1 x mean(2, 2) = 0.2 off the loss; gradient -0.1 x 1/2 x 1/2 per token of
    the long reply."""
    ent = torch.tensor([[1.0, 3.0], [2.0, 0.0]], requires_grad=True)
    logp = torch.zeros(2, 2, requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    out = grpo_loss(logp, logp.detach(), None, torch.zeros(2), mask, beta=0.0, entropy=ent,
                    entropy_coef=0.1)
    assert out.loss.item() == pytest.approx(-0.2)
    assert out.entropy == pytest.approx(2.0)
    (g,) = torch.autograd.grad(out.loss, ent)
    assert g.flatten().tolist() == pytest.approx([-0.025, -0.025, -0.05, 0.0])


def test_entropy_logged_every_step_and_bonus_trains(tmp_path) -> None:
    tr = world_trainer(tmp_path)
    tr.metrics = None
    recs = [tr.step() for _ in range(2)]
    vocab = tr.backend.model.config.vocab_size
    for rec in recs:
        assert 0 < rec["entropy"] < math.log(vocab)
    # the logged entropy is the completion-token mean of the policy's next-token entropies
    tr2 = world_trainer(tmp_path / "b", entropy_coef=0.5, top_entropy_quantile=0.5)
    batch = tr2.collect()
    ro = batch.rollout
    _, ent = tr2.backend.logprobs_and_entropy(ro, 1.0)
    m = ro.completion_mask
    want = float((ent * m).sum() / m.sum())
    out = tr2.update(batch)
    assert out["entropy"] == pytest.approx(want, rel=1e-5)
    assert 0.4 <= out["entropy_token_share"] <= 0.7
