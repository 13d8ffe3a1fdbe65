"""Advantage options beyond the group std: scale: batch (also over ranks, through the reduce
hook) and several rewards standardised one by one (GDPO's normalize_then_sum).
(Against TRL's advantage code: test_objectives_trl.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import first_digit_odd, world_trainer

from grpolab.core import advantages as A
from grpolab.run import update

# ----------------------------------------------------------------- batch scale --


def test_batch_std_hand_values() -> None:
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    sd = math.sqrt(0.375 * 0.625)  # population std of the eight rewards
    a = A.group_advantages(r, 4, scale="batch")
    want = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    assert a.tolist() == pytest.approx([w / sd for w in want], abs=1e-6)
    # a dead group is still exactly 0; the sample std divides by n - 1
    a = A.group_advantages(torch.tensor([1.0, 0, 1, 1, 1, 1]), 3, scale="batch", std="sample")
    sd = math.sqrt((5 * (1 / 6) ** 2 + (5 / 6) ** 2) / 5)  # five 1s and a 0, mean 5/6
    assert a[3:].tolist() == [0.0, 0.0, 0.0]
    assert a[:3].tolist() == pytest.approx([(1 / 3) / sd, (-2 / 3) / sd, (1 / 3) / sd], abs=1e-6)


def test_batch_std_over_ranks_equals_one_process() -> None:
    """With a reduce hook (what torchrun passes: sums over ranks) the batch std comes from
    count, sum and sum of squares; one process's hook is the identity."""
    r = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 0.0, 1.0])
    for std in A.STD_KINDS:
        a = A.group_advantages(r, 4, scale="batch", std=std)
        b = A.group_advantages(r, 4, scale="batch", std=std, reduce=lambda v: list(v))
        assert torch.allclose(a, b, atol=1e-6)


# ------------------------------------------------------------ several rewards --


CORRECT = [1.0, 1, 1, 0, 0, 0, 0, 1]


FORMAT = [1.0, 1, 0, 0, 0, 0, 0, 0]


def test_gdpo_hand_values() -> None:
    """Group 1: correctness (1,1,1,0) -> z = (1,1,1,-3)/sqrt(3), format (1,1,0,0) -> (1,1,-1,-1);
    group 2: correctness (0,0,0,1) -> (-1,-1,-1,3)/sqrt(3), format dead -> 0. Weights (1, 0.5):
    x = z_c + z_f / 2, then (x - mean) / std over the eight answers."""
    per_fn = torch.tensor([CORRECT, FORMAT]).T
    s3 = math.sqrt(3)
    x = [1 / s3 + 0.5, 1 / s3 + 0.5, 1 / s3 - 0.5, -3 / s3 - 0.5,
         -1 / s3, -1 / s3, -1 / s3, 3 / s3]
    mean = sum(x) / 8
    sd = math.sqrt(sum((v - mean) ** 2 for v in x) / 8)
    a = A.normalize_then_sum(per_fn, torch.tensor([1.0, 0.5]), 4)
    assert a.tolist() == pytest.approx([(v - mean) / sd for v in x], abs=1e-6)
    # sum-then-normalize (GRPO) is different: totals (1.5, 1.5, 1, 0) and (0, 0, 0, 1)
    b = A.sum_then_normalize(per_fn, torch.tensor([1.0, 0.5]), 4)
    sd1 = math.sqrt(0.375)
    assert b[:4].tolist() == pytest.approx([0.5 / sd1, 0.5 / sd1, 0.0, -1 / sd1], abs=1e-6)
    # a group where every reward is constant stays exactly 0
    dead = torch.tensor([[1.0, 0.0]] * 4 + [[1.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    assert A.normalize_then_sum(dead, torch.tensor([1.0, 1.0]), 4)[:4].tolist() == [0.0] * 4


def test_trainer_keeps_each_reward_for_gdpo(tmp_path) -> None:
    def short(prompts, completions, **_):
        return [1.0 if len(c) <= 2 else 0.0 for c in completions]

    for dynamic in (False, True):
        tr = world_trainer(tmp_path / str(dynamic), reward_aggregation="normalize_then_sum",
                     dynamic_sampling=dynamic, reward_weights=[1.0, 0.5],
                     rewards=["first_digit_odd", "short"])
        tr.scorer.reward_fns = [first_digit_odd, short]
        batch = tr.collect()
        assert batch.rewards_per_fn.shape == (len(batch.rows), 2)
        assert torch.allclose(batch.rewards_per_fn @ torch.tensor([1.0, 0.5]), batch.rewards)
        want = A.normalize_then_sum(batch.rewards_per_fn, torch.tensor([1.0, 0.5]), 4)
        assert torch.equal(update.advantages(tr.cfg, batch.rewards, batch.rewards_per_fn), want)
        assert math.isfinite(tr.update(batch)["loss"])


# ------------------------------------------------------ answers no reward scored --

NAN = math.nan


def test_unscored_answers_left_out_hand_values() -> None:
    """TRL 1.16: an answer every reward said None for (NaN) is left out of its group's mean
    and std and gets 0; a group with one scored answer, or none, is dead."""
    r = torch.tensor([1.0, 0.0, NAN, 1.0] + [1.0, 1.0, NAN, 1.0] + [NAN, 2.0, NAN, NAN]
                     + [NAN] * 4)
    s = math.sqrt(2 / 9)  # population std of (1, 0, 1), mean 2/3
    want = [1 / 3 / s, -2 / 3 / s, 0.0, 1 / 3 / s] + [0.0] * 12
    ids = A.group_ids_from_sizes([4] * 4)
    assert A.group_advantages(r, 4).tolist() == pytest.approx(want, abs=1e-6)
    assert A.group_advantages_ragged(r, ids).tolist() == pytest.approx(want, abs=1e-6)
    assert A.dead_mask(r, 4).tolist() == A.dead_mask_ragged(r, ids).tolist() == [
        False, True, True, True]
    # the batch std: over the seven scored rewards only (1, 0, 1, 1, 1, 1, 2)
    sd = torch.tensor([1.0, 0, 1, 1, 1, 1, 2]).std(unbiased=False).item()
    assert A.group_advantages(r, 4, scale="batch")[:4].tolist() == pytest.approx(
        [1 / 3 / sd, -2 / 3 / sd, 0.0, 1 / 3 / sd], abs=1e-6)
    # several rewards: a None counts 0 in the total, all None leaves the answer out
    per_fn = torch.tensor([[1.0, NAN], [NAN, NAN], [0.0, 0.5], [NAN, 1.0]])
    assert A.total_reward(per_fn, torch.tensor([1.0, 2.0])).tolist() == [1.0, 0.0, 1.0, 2.0]
    assert A.unscored(per_fn).tolist() == [False, True, False, False]
    assert A.unscored(torch.zeros(3, 0)).tolist() == [False] * 3


def test_dead_groups_split_by_their_first_scored_answer() -> None:
    r = torch.tensor([NAN, 1.0, 1.0, 1.0, 1.0, 1.0, NAN, 1.0, NAN, NAN, NAN, NAN])
    want = A.DeadStats(groups=3, dead=3, all_right=2, all_wrong=1)  # (none scored: wrong)
    assert A.dead_stats(r, 4) == want
    assert A.dead_stats_ragged(r, A.group_ids_from_sizes([4, 4, 4])) == want


def test_gdpo_leaves_each_rewards_none_out() -> None:
    """normalize_then_sum: each reward's group statistics over the answers it scored; the
    answers no reward scored are left out of the batch's mean and std and get 0."""
    per_fn = torch.tensor([[1.0, 1.0], [0.0, NAN], [1.0, 0.0], [NAN, NAN]])
    # correctness over (1, 0, 1): (1/3, -2/3, 1/3) / sqrt(2/9); format over (1, 0): (1, -1)
    s = math.sqrt(2 / 9)
    x = [1 / 3 / s + 1.0, -2 / 3 / s, 1 / 3 / s - 1.0]
    mean = sum(x) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in x) / 3)
    a = A.normalize_then_sum(per_fn, torch.tensor([1.0, 1.0]), 4)
    assert a.tolist() == pytest.approx([(v - mean) / sd for v in x] + [0.0], abs=1e-6)
    b = A.normalize_then_sum_ragged(per_fn, torch.tensor([1.0, 1.0]), torch.zeros(4))
    assert b.tolist() == pytest.approx(a.tolist(), abs=1e-6)


def test_trainer_leaves_unscored_answers_out(tmp_path) -> None:
    """A TRL reward that says None for every answer to some prompts (and a second reward that
    scores only some answers): those answers get advantage 0, their groups count dead, the
    logged per-reward means skip the None, samples.jsonl shows null."""
    from grpolab.rewards.trl_compat import TRLReward
    from grpolab.run.report import sample_record
    from grpolab.run.trackers import sample_rows

    def odd_or_none(prompts, completions, **_):  # None: prompts whose text has a 7
        return [None if "7" in p else float(c[:1] in "13579" and bool(c))
                for p, c in zip(prompts, completions)]

    def long_or_none(prompts, completions, **_):
        return [None if "7" in p or len(c) < 3 else 1.0 for p, c in zip(prompts, completions)]

    tr = world_trainer(tmp_path, rewards=["odd_or_none", "long_or_none"])
    tr.scorer.reward_fns = [TRLReward(odd_or_none), TRLReward(long_or_none)]
    batch = tr.collect()
    pf = batch.rewards_per_fn
    assert pf[:, 0].isnan().any() and A.unscored(pf).any()
    adv = update.advantages(tr.cfg, batch.rewards, pf)
    assert (adv[A.unscored(pf)] == 0).all()
    assert torch.equal(batch.rewards, A.total_reward(pf, torch.ones(2)))
    rec = tr.step()
    assert rec["reward_problems"] == 0
    for name in ("odd_or_none", "long_or_none"):
        assert 0.0 <= rec[f"rewards/{name}"] <= 1.0
    assert rec["rewards/long_or_none"] == 1.0  # (the mean of the answers it scored)
    groups = sample_record(batch, 4, 8, adv)  # (what samples.jsonl gets, and trackers)
    assert any(row[5] is None for row in sample_rows(1, groups))
    shown = [(x, a) for g in groups for x, a in zip(g["rewards"], g["advantages"])]
    assert any(x is None for x, _ in shown) and all(a == 0 for x, a in shown if x is None)
    # said once a run: a checkpoint keeps that it was said, so a resume does not say it again
    assert tr.rollouts.told_unscored and tr.state_dict()["told_unscored"] is True
    again = world_trainer(tmp_path / "again", rewards=["odd_or_none", "long_or_none"])
    again.rollouts.load_state_dict(tr.state_dict())
    assert again.rollouts.told_unscored
    assert all(g["dead"] for g in groups if all(x is None for x in g["rewards"]))
    # each function's own score beside the total (TRL's completions table), None as null
    lo = 0
    for g in groups:
        want = pf[lo:lo + 4]
        assert list(g["per_reward"]) == ["odd_or_none", "long_or_none"]
        for j, name in enumerate(g["per_reward"]):
            assert [math.nan if v is None else v for v in g["per_reward"][name]] == \
                pytest.approx(want[:, j].tolist(), nan_ok=True)
        lo += 4
    from grpolab.run.trackers import sample_columns

    assert sample_columns(groups)[-2:] == ["rewards/odd_or_none", "rewards/long_or_none"]
    rows = sample_rows(1, groups)
    assert [r[-2:] for r in rows[:4]] == [list(x) for x in zip(*groups[0]["per_reward"].values())]


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline", "ppo"])
def test_token_level_estimators_leave_unscored_answers_out(tmp_path, estimator: str) -> None:
    """REINFORCE++ (and its group baseline) and PPO: an answer no reward scored gets no
    advantage and is out of the baseline and the whitening: the others' advantages are those
    of the batch without it."""
    from grpolab.rewards.trl_compat import TRLReward

    def odd_or_none(prompts, completions, **_):
        return [None if "7" in p else float(c[:1] in "13579" and bool(c))
                for p, c in zip(prompts, completions)]

    tr = world_trainer(tmp_path, rewards=["odd_or_none"], estimator=estimator)
    tr.scorer.reward_fns = [TRLReward(odd_or_none)]
    batch = tr.collect()
    out = A.unscored(batch.rewards_per_fn)
    assert out.any() and not out.all()
    scored = tr.score(batch)
    adv = update.token_advantages(tr.cfg, batch, scored, None)
    assert (adv[out] == 0).all() and (adv[~out] != 0).any()
    if estimator == "reinforce_pp":  # the whitening over the scored answers' tokens only
        m = scored.rollout.completion_mask[~out].bool()
        assert abs(float(adv[~out][m].mean())) < 1e-5
