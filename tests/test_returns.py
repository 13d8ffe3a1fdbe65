"""REINFORCE++ and REINFORCE++-baseline (``grpolab.core.returns``): hand-computed values, and
verl's own ``core_algos`` functions on identical inputs (verl_harness.py)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from verl_harness import verl_functions

from grpolab.core.returns import (
    masked_whiten,
    reinforce_pp,
    reinforce_pp_baseline,
    token_rewards,
)


def batch(seed: int = 0, b: int = 8, t: int = 6) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor, torch.Tensor]:
    """Rewards [B] (0/1), a ragged mask, a per-token penalty and group ids (groups of 4, one
    group of 1 when b is odd)."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (b,), generator=g).float()
    lens = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lens[:, None]).long()
    pen = 0.05 * torch.randn(b, t, generator=g) * mask
    ids = torch.arange(b) // 4
    return rewards, mask, pen, ids


def test_token_rewards_put_the_outcome_on_the_last_real_token() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    got = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert got.tolist() == [[0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0]]
    pen = torch.full((3, 4), 0.1)
    got = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, pen)
    assert got[0].tolist() == pytest.approx([-0.1, -0.1, 0.9, 0.0])
    assert got[1].tolist() == pytest.approx([1.9, 0, 0, 0]) and not got[2].any()


def test_returns_and_whitening_by_hand() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    r = token_rewards(torch.tensor([1.0, 0.0]), mask)
    # gamma 1: every real token of row 0 returns 1, of row 1 returns 0; mean 0.4 over 5
    # tokens, unbiased variance (2 x 0.36 + 3 x 0.16) / 4 = 0.3
    got = reinforce_pp(r, mask, gamma=1.0)
    s = math.sqrt(0.3 + 1e-8)
    assert got.flatten().tolist() == pytest.approx([0.6 / s, 0.6 / s, 0] + [-0.4 / s] * 3)
    # gamma 0.5: row 0 returns 0.5, 1; row 1 zeros
    got = reinforce_pp(r, mask, gamma=0.5)
    x = torch.tensor([0.5, 1, 0, 0, 0])
    want = (x - x.mean()) / torch.sqrt(x.var() + 1e-8)
    assert got[mask.bool()].tolist() == pytest.approx(want.tolist())
    # gamma 0: only the last token has a return
    assert reinforce_pp(r, mask, gamma=0.0)[0, 0] == reinforce_pp(r, mask, gamma=0.0)[1, 0]


def test_baseline_centres_each_group_and_leaves_a_group_of_one() -> None:
    mask = torch.ones(5, 2, dtype=torch.long)
    r = token_rewards(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0]), mask)
    ids = torch.tensor([0, 0, 0, 0, 1])  # a group of 4 and a group of 1
    got = reinforce_pp_baseline(r, mask, ids)
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 1.0]).repeat_interleave(2)
    want = (centred - centred.mean()) / torch.sqrt(centred.var() + 1e-8)
    assert got.flatten().tolist() == pytest.approx(want.tolist(), abs=1e-6)
    dead = reinforce_pp_baseline(token_rewards(torch.ones(4), torch.ones(4, 2)), torch.ones(4, 2),
                                 torch.zeros(4, dtype=torch.long))
    assert not dead.any()  # a group whose rewards are equal: all zero


def test_whitening_over_ranks_is_the_whole_batchs() -> None:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    m = torch.ones(6, 4)
    whole = masked_whiten(x, m)
    # two "ranks" of 3 rows each, their sums added by reduce
    halves = [(x[:3], m[:3]), (x[3:], m[3:])]
    sums: list[list[float]] = []

    def reduce(values: list[float]) -> list[float]:
        sums.append(values)
        if len(sums) == 1:  # n and sum
            return [float(m.sum()), float(x.sum())]
        return [float(((x - x.mean()) ** 2).sum())]

    got = masked_whiten(halves[0][0], halves[0][1], reduce)
    torch.testing.assert_close(got, whole[:3])


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_equals_verl(gamma: float, seed: int) -> None:
    verl = verl_functions("compute_reinforce_plus_plus_outcome_advantage")
    rewards, mask, pen, _ = batch(seed)
    tr = token_rewards(rewards, mask, pen)
    want, _ = verl["compute_reinforce_plus_plus_outcome_advantage"](
        tr, mask.float(), config=SimpleNamespace(gamma=gamma))
    torch.testing.assert_close(reinforce_pp(tr, mask, gamma=gamma), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("b", [8, 9])  # 9: a group of one at the end
@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_baseline_equals_verl(b: int, seed: int) -> None:
    verl = verl_functions("compute_reinforce_plus_plus_baseline_outcome_advantage")
    rewards, mask, pen, ids = batch(seed, b=b)
    tr = token_rewards(rewards, mask, pen)
    want, _ = verl["compute_reinforce_plus_plus_baseline_outcome_advantage"](
        tr.clone(), mask.float(), ids.tolist())
    torch.testing.assert_close(reinforce_pp_baseline(tr, mask, ids), want, atol=1e-5, rtol=1e-5)


def first_digit_odd(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
    return [float(bool(c) and c[0] in "13579") for c in completions]


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_trainer_takes_the_token_level_step(tmp_path: Path, estimator: str) -> None:
    """A step with the per-token KL in the reward: the trainer's advantages are the estimator's
    on the policy's and reference's own log-probs, the loss is finite, samples.jsonl gets one
    advantage per answer and the KL penalty is reported."""
    from grpolab.config import Config, resolve
    from grpolab.core.losses import KL_ESTIMATORS
    from grpolab.core.returns import ESTIMATORS
    from grpolab.run.trainer import GRPOTrainer
    from grpolab.world.backend import TinyBackend
    from grpolab.world.model import TinyConfig, TinyGPT
    from grpolab.world.task import make_splits

    torch.manual_seed(0)
    cfg = resolve(Config(budget=32, group_size=4, progress=False, out_dir=str(tmp_path),
                         estimator=estimator, kl_in="reward", kl_estimator="k1", beta=0.5,
                         checkpoint_every=0, steps=1, log_samples=8))
    backend = TinyBackend(TinyGPT(TinyConfig(d_model=32, n_layers=2)))  # a frozen reference copy
    tr = GRPOTrainer(cfg, backend, make_splits(0, 64, 8).train, [first_digit_odd],
                     out_dir=tmp_path)
    with torch.no_grad():  # move the policy away from its frozen copy
        for p in backend.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = tr.collect()
    scored = tr.score(batch)
    adv = tr.advantages(batch, scored)
    ro, m = batch.rollout, batch.rollout.completion_mask
    with torch.no_grad():
        kl = KL_ESTIMATORS["k1"](backend.logprobs(ro, 1.0), backend.logprobs(ro, 1.0, True))
    want = ESTIMATORS[estimator](token_rewards(batch.rewards, m, 0.5 * kl * m), m,
                                 torch.arange(32) // 4)
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)
    assert adv.shape == m.shape and not adv[m == 0].any()
    out = tr.optimize(scored, adv)
    assert math.isfinite(out["loss"]) and out["kl"] == 0.0
    assert out["kl_reward"] == pytest.approx(float((0.5 * kl * m).sum(-1).mean()), rel=1e-5)
    tr.samples = tr.metrics = None
    from grpolab.run.report import MetricsWriter

    tr.samples = MetricsWriter(tmp_path / "samples.jsonl", None, "test")
    tr.step()
    group = tr.last_samples[0]
    assert len(group["advantages"]) == 4 and all(isinstance(a, float)
                                                 for a in group["advantages"])


# ------------------------------------------------------------------------------- PPO


def unwhitened_gae(r: list[float], v: list[float], m: list[int], gamma: float,
                   lam: float) -> list[float]:
    """GAE's advantages before whitening, as returns - values (one row)."""
    from grpolab.core.returns import gae

    rr, vv = torch.tensor([r]), torch.tensor([v])
    _, ret = gae(rr, vv, torch.tensor([m]), gamma, lam)
    return ((ret - vv) * torch.tensor([m])).flatten().tolist()


def test_gae_by_hand() -> None:
    r, v, m = [0.0, 0.0, 1.0], [0.5, 0.5, 0.5], [1, 1, 1]
    assert unwhitened_gae(r, v, m, 1.0, 1.0) == pytest.approx([0.5, 0.5, 0.5])  # R - V
    assert unwhitened_gae(r, v, m, 1.0, 0.0) == pytest.approx([0.0, 0.0, 0.5])  # one-step TD
    assert unwhitened_gae(r, v, m, 0.0, 1.0) == pytest.approx([-0.5, -0.5, 0.5])  # r_t - V_t
    assert unwhitened_gae(r, v, m, 0.5, 0.5) == pytest.approx(
        [0.25 * -0.25 + 0.0625 * 0.5 - 0.25, 0.25 * 0.5 - 0.25, 0.5])
    # padding after the end changes nothing; a one-token answer is r - V
    assert unwhitened_gae([0.0, 1.0, 0.0], [0.5, 0.5, 9.0], [1, 1, 0], 1.0, 1.0) == \
        pytest.approx([0.5, 0.5, 0.0])
    assert unwhitened_gae([1.0, 0.0, 0.0], [0.3, 9.0, 9.0], [1, 0, 0], 1.0, 0.95) == \
        pytest.approx([0.7, 0.0, 0.0])


def test_value_loss_clips_around_the_old_value() -> None:
    from grpolab.core.returns import value_loss

    old, ret, m = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2)
    v = torch.tensor([[2.0, 0.4]], requires_grad=True)
    loss, hit = value_loss(v, old, ret, m, 0.5, (1, 2))
    # token 0: (2-1)^2 = 1 vs clipped (0.5-1)^2 = 0.25 -> 1; token 1: 0.36 vs (0.4-1)^2 -> 0.36
    assert float(loss.detach()) == pytest.approx(0.5 * (1 + 0.36) / 2) and hit == 0.0
    v2 = torch.tensor([[-1.0, 0.0]], requires_grad=True)  # moving away past the clip
    loss2, hit2 = value_loss(v2, old, ret, m, 0.5, (1, 2))
    # token 0: (-1-1)^2 = 4 vs clipped (-0.5-1)^2 = 2.25 -> 4 (the unclipped term decides)
    assert float(loss2.detach()) == pytest.approx(0.5 * (4 + 1) / 2) and hit2 == 0.0
    v3 = torch.tensor([[3.0, 1.0]], requires_grad=True)
    loss3, hit3 = value_loss(v3, torch.tensor([[2.0, 1.0]]), ret, m, 0.5, (1, 2))
    assert hit3 == 0.0
    # token 0: (3-1)^2 = 4 vs clipped (2.5-1)^2 = 2.25 -> 4; nothing clipped decides
    loss3.backward()
    assert v3.grad.flatten().tolist() == pytest.approx([0.5 * 2 * 2 / 2, 0.0])
    v4 = torch.tensor([[1.2, 1.0]], requires_grad=True)  # old 0 +- 0.5: both clipped to 0.5
    loss4, hit4 = value_loss(v4, old, ret, m, 0.5, (1, 2))
    # (0.5 - 1)^2 = 0.25 beats 0.04 and 0: the clipped term decides at both tokens
    assert float(loss4.detach()) == pytest.approx(0.5 * (0.25 + 0.25) / 2) and hit4 == 1.0
    loss4.backward()
    assert not v4.grad.any()  # the clipped term has no gradient into v
    # a mini-batch whose answers are all masked (mask_truncated): 0, not 0/0
    loss5, _ = value_loss(v4, old, ret, torch.zeros(1, 2), 0.5, (1, 0))
    assert float(loss5.detach()) == 0.0


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.0), (0.0, 1.0)])
def test_gae_and_value_loss_equal_verl(gamma: float, lam: float) -> None:
    from grpolab.core.returns import gae, value_loss

    verl = verl_functions("compute_gae_advantage_return", "compute_value_loss", "agg_loss")
    verl["verl_F"].clip_by_value = lambda x, lo, hi: torch.max(torch.min(x, hi), lo)
    rewards, mask, pen, _ = batch(3, b=9)
    tr = token_rewards(rewards, mask, pen)
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4)) * mask
    adv, ret = gae(tr, values, mask, gamma, lam)
    want_adv, want_ret = verl["compute_gae_advantage_return"](tr, values, mask.float(), gamma, lam)
    torch.testing.assert_close(adv * mask, want_adv * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret * mask, want_ret * mask, atol=1e-5, rtol=1e-5)
    v = values + 0.8 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(5))
    counts = (mask.shape[0], int(mask.sum()))
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):  # (verl's critic:
        ours, frac = value_loss(v, values, ret, mask, 0.5, counts, agg)  # the actor's agg)
        theirs, their_frac = verl["compute_value_loss"](v, ret, values, mask.float(), 0.5,
                                                        loss_agg_mode=agg.replace("_", "-"))
        assert float(ours) == pytest.approx(float(theirs), rel=1e-5), agg
        assert frac == pytest.approx(float(their_frac), rel=1e-5)
        halves = [value_loss(v[i], values[i], ret[i], mask[i], 0.5, counts, agg)[0]
                  for i in (slice(0, 4), slice(4, None))]  # micro-batches: shares of the whole
        assert float(sum(halves)) == pytest.approx(float(theirs), rel=1e-5), agg


def ppo_trainer(out: Path, **over: Any) -> Any:
    from grpolab.config import Config, resolve
    from grpolab.run.trainer import GRPOTrainer
    from grpolab.world.backend import TinyBackend
    from grpolab.world.model import TinyConfig, TinyGPT
    from grpolab.world.task import make_splits

    torch.manual_seed(0)
    kw = {"budget": 16, "group_size": 1, "progress": False, "out_dir": str(out),
          "estimator": "ppo", "kl_in": "reward", "kl_estimator": "k1", "beta": 0.1, "lr": 1e-2,
          "critic_lr": 1e-2, "checkpoint_every": 2, "steps": 4, "log_samples": 0, **over}
    cfg = resolve(Config(**kw))
    backend = TinyBackend(TinyGPT(TinyConfig(d_model=32, n_layers=2)), lora=True)
    return GRPOTrainer(cfg, backend, make_splits(0, 64, 8).train, [first_digit_odd],
                       out_dir=out)


def test_ppo_trains_the_critic_and_resumes_bitwise(tmp_path: Path) -> None:
    """One answer per prompt: the value model learns (its loss and explained variance are
    reported), its warm-up leaves the policy alone, and a resumed run continues bitwise,
    value model and its optimizer included."""
    one = ppo_trainer(tmp_path / "one", critic_warmup=1)
    before = [p.detach().clone() for p in one.params]
    critic0 = [p.detach().clone() for p in one.critic.params]
    rec = one.step()  # warm-up: only the critic moves
    assert all(torch.equal(a, b) for a, b in zip(before, one.params))
    assert not all(torch.equal(a, b) for a, b in zip(critic0, one.critic.params))
    assert rec["value_loss"] > 0 and math.isfinite(rec["explained_variance"])
    assert rec["no_signal"] is None  # groups of one: no dead-group alarm
    # every answer of a group of one is "dead" to GRPO; PPO learns from each one it gives a
    # nonzero advantage, and the answers-per-useful count says so
    assert rec["dead_share"] == 1.0 and rec["zero_advantage_answers"] == 0
    assert rec["useful_answers"] == rec["answers_generated"] == 16
    from grpolab.run.trackers import Reporter

    reporter = Reporter()
    reporter.cfg = one.cfg
    line = reporter.status_line(rec)
    assert "reward" in line and "dead" not in line
    whole = ppo_trainer(tmp_path / "whole", critic_warmup=1)
    rows = whole.train()[1:]
    assert rows[0]["loss"] == 0.0 and rows[1]["loss"] != 0.0  # the policy trains after it
    first = ppo_trainer(tmp_path / "cut", critic_warmup=1, steps=2)
    first.train()
    second = ppo_trainer(tmp_path / "cut", critic_warmup=1)
    resumed = second.train(resume=True)  # (no step-0 line on a resume)
    assert len(resumed) == 2
    for key in ("loss", "value_loss", "explained_variance", "reward_mean"):
        assert [r[key] for r in resumed] == [r[key] for r in rows[2:]], key
    for a, b in zip(second.critic.params, whole.critic.params):
        assert torch.equal(a, b)
    for a, b in zip(second.params, whole.params):
        assert torch.equal(a, b)
