"""Mini-batches: one sampled batch, several optimiser steps (verl's ppo_mini_batch_size, TRL's
steps_per_generation), each on its share of the batch against the policy that sampled it."""

from __future__ import annotations

import pytest
import torch
from helpers import world_trainer

from grpolab.config import ConfigError, make_config
from grpolab.config.validate import validate_ranks
from grpolab.core.losses import grpo_loss
from grpolab.core.returns import value_loss
from grpolab.rollout.batch import minibatch_rows
from grpolab.run import update


def test_minibatch_rows_cut_whole_groups_nearest_equal_shares() -> None:
    rows = minibatch_rows([8] * 8, 4)
    assert [(int(r[0]), int(r[-1]) + 1) for r in rows] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    # 32 answers in groups of 4, 16, 4, 8: the boundaries are 0 4 20 24 32, and 20 is the
    # one nearest 16 (verl cuts by count; ragged groups from the allocator need boundaries)
    assert [len(r) for r in minibatch_rows([4, 16, 4, 8], 2)] == [20, 12]
    assert [len(r) for r in minibatch_rows([4, 4], 4)] == [0, 4, 0, 4]  # fewer groups than m
    assert [len(r) for r in minibatch_rows([], 2)] == [0, 0]


def test_shuffled_minibatch_rows_deal_every_answer_once() -> None:
    a = minibatch_rows([4] * 6, 4, torch.Generator().manual_seed(3))
    b = minibatch_rows([4] * 6, 4, torch.Generator().manual_seed(3))
    assert [len(r) for r in a] == [6, 6, 6, 6]
    assert sorted(torch.cat(a).tolist()) == list(range(24))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # seeded: resumable
    assert all(torch.equal(r, r.sort().values) for r in a)  # (ascending: groups stay near)
    assert not torch.equal(torch.cat(a), torch.arange(24))  # not the groups' order


def _flat(tr) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in tr.params])


@pytest.mark.parametrize("over", [{}, {"loss_agg": "token_mean", "beta": 0.0},
                                  {"loss_agg": "seq_mean_token_sum_norm", "epochs": 2}])
def test_minibatches_are_optimiser_steps_on_shares_against_the_sampling_policy(
        tmp_path, over: dict) -> None:
    """minibatches 2 = two SGD steps, the first on the first 4 groups, the second on the last 4,
    each loss a mean over its own half (its answers and tokens), the old log-probs those of
    the policy that sampled; with epochs 2 both again. Computed here by hand with grpo_loss."""
    cfg_over = {"budget": 32, "group_size": 4, "lr": 0.1, "beta": 0.04, **over}
    tr = world_trainer(tmp_path / "mb", minibatches=2, **cfg_over)
    tr.opt = torch.optim.SGD(tr.params, lr=0.1)
    batch = tr.collect()
    ref = world_trainer(tmp_path / "ref", **cfg_over)
    ref.opt = torch.optim.SGD(ref.params, lr=0.1)
    assert torch.equal(_flat(tr), _flat(ref))
    out = tr.update(batch)

    cfg, be, ro = ref.cfg, ref.backend, batch.rollout
    adv = update.advantages(cfg, batch.rewards)
    with torch.no_grad():
        old = be.logprobs(ro, cfg.temperature)
        ref_lp = be.logprobs(ro, cfg.temperature, reference=True)
    losses = []
    for _ in range(cfg.epochs):
        for half in (slice(0, 16), slice(16, 32)):
            part = ro.select(list(range(half.start, half.stop)))
            width = int(part.completion_mask.sum(1).max())
            mask = part.completion_mask[:, :width]
            part.completion_ids, part.completion_mask = part.completion_ids[:, :width], mask
            ref.opt.zero_grad()
            res = grpo_loss(be.logprobs(part, cfg.temperature), old[half, :width],
                            ref_lp[half, :width] if cfg.beta else None, adv[half], mask,
                            beta=cfg.beta, agg=cfg.loss_agg, norm_len=cfg.max_new_tokens,
                            global_rows=16, global_tokens=int(mask.sum()))
            res.loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.params, cfg.grad_clip)
            ref.opt.step()
            losses.append(float(res.loss.detach()))
    assert (_flat(ref) - _flat(tr)).abs().max() < 1e-6
    assert (_flat(tr) - _flat(world_trainer(tmp_path / "x", **cfg_over))).abs().max() > 1e-3
    assert out["loss"] == pytest.approx(sum(losses[-2:]) / 2, rel=1e-5)  # the last pass's mean


def test_lr_schedule_moves_per_optimiser_step(tmp_path) -> None:
    """Linear decay over 2 steps x 2 mini-batches = 4 optimiser steps: the record's lr is its
    last optimiser step's (3/4 then 1/4 of lr), and warm-up spans its steps' mini-batches."""
    tr = world_trainer(tmp_path / "a", minibatches=2, lr=0.01, lr_schedule="linear")
    recs = tr.train()
    assert [r["lr"] for r in recs[1:]] == pytest.approx([0.0075, 0.0025])
    tr = world_trainer(tmp_path / "b", minibatches=4, lr=0.01, warmup_steps=1, steps=3)
    assert [r["lr"] for r in tr.train()[1:]] == pytest.approx([0.01, 0.01, 0.01])
    tr = world_trainer(tmp_path / "c", minibatches=4, lr=0.01, warmup_steps=2, steps=3)
    assert [r["lr"] for r in tr.train()[1:]] == pytest.approx([0.005, 0.01, 0.01])


def test_shuffled_minibatches_differ_by_step_and_take_every_answer(tmp_path) -> None:
    tr = world_trainer(tmp_path, minibatches=4, minibatch_order="shuffled")
    seen = []
    for step in (0, 1):
        batch = tr.collect()
        scored = update.score(tr.cfg, tr.backend, batch, step=step)
        assert scored.mini_rows == [8, 8, 8, 8]
        assert sum(scored.mini_tokens) == scored.tokens
        rows = [p.rows for p in scored.parts]
        assert sorted(torch.cat(rows).tolist()) == list(range(32))
        assert all(p.old_logprobs is not None for p in scored.parts)
        seen.append(torch.cat(rows))
    assert not torch.equal(seen[0], seen[1])


def test_ppo_critic_steps_per_minibatch(tmp_path) -> None:
    """PPO's value model takes an SGD step per mini-batch too (verl: its mini-batches are the
    actor's), each a token mean over its own half; computed here by hand with value_loss."""
    over = {"estimator": "ppo", "group_size": 1, "kl_in": "reward", "budget": 8}
    tr = world_trainer(tmp_path / "mb", minibatches=2, **over)
    ref = world_trainer(tmp_path / "ref", **over)
    for t in (tr, ref):
        t.critic.opt = torch.optim.SGD(t.critic.params, lr=0.5)
    batch = tr.collect()
    scored = update.score(tr.cfg, tr.backend, batch, tr.critic)
    update.batch_advantages(tr.cfg, batch, scored, 0)  # (the returns the critic learns)
    out = update.critic_pass(tr.cfg, tr.backend, tr.critic, scored)
    ro, losses = batch.rollout, []
    for half in (slice(0, 4), slice(4, 8)):
        part = ro.select(list(range(half.start, half.stop)))
        w = int(part.completion_mask.sum(1).max())
        part.completion_ids, part.completion_mask = part.completion_ids[:, :w], part.completion_mask[:, :w]
        ref.critic.opt.zero_grad()
        loss, _ = value_loss(ref.critic.values(ref.backend, part), scored.old_values[half, :w],
                             scored.returns[half, :w], part.completion_mask, ref.cfg.value_clip,
                             (4, int(part.completion_mask.sum())), ref.cfg.value_agg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.critic.params, ref.cfg.grad_clip)
        ref.critic.opt.step()
        losses.append(float(loss.detach()))
    got, want = (torch.cat([p.detach().flatten() for p in t.critic.params]) for t in (tr, ref))
    start = torch.cat([p.detach().flatten() for p in world_trainer(tmp_path / "x", **over)
                       .critic.params])
    assert (got - start).abs().max() > 1e-4  # it moved ...
    assert (got - want).abs().max() < 1e-6  # ... as two steps on the halves move it
    assert out["value_loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)


@pytest.mark.parametrize(("over", "world", "says"), [
    ({"budget": 64, "minibatches": 8}, 2, "each of the 2 ranks holds 4 prompts"),
    ({"budget": 96, "minibatches": 4}, 2, "each of the 2 ranks holds 6 prompts"),
    ({"budget": 64, "minibatches": 32, "minibatch_order": "shuffled"}, 4,
     "each of the 4 ranks deals out its 16 answers"),
    ({"budget": 64, "minibatches": 2, "shard": "fsdp", "lora": False,
      "dynamic_sampling": True}, 2, "a rank may hold no group of a mini-batch"),
])
def test_each_rank_must_split_its_share_evenly(over: dict, world: int, says: str) -> None:
    cfg = make_config(None, over, "workshop")
    with pytest.raises(ConfigError, match=says):
        validate_ranks(cfg, world)
    validate_ranks(cfg, 1)  # one process: the batch's own check suffices


@pytest.mark.parametrize(("over", "says"), [
    ({"minibatches": 3}, "does not divide the 8 prompts a step"),
    ({"minibatches": 0}, "minibatches must be >= 1"),
    ({"minibatches": 5, "minibatch_order": "shuffled", "budget": 32, "group_size": 4},
     "does not divide the budget 32"),
    ({"minibatches": 3, "allocate": True, "budget": 32, "group_size": 4,
      "allocate_min_group": 4, "allocate_max_group": 16}, "as few as 2 groups"),
])
def test_minibatches_that_cannot_be_equal_are_refused(over: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        make_config(None, over, "workshop")


def test_token_mean_by_batch_divides_each_step_by_the_batchs_share(tmp_path,
                                                                  monkeypatch) -> None:
    """token_mean_by batch (TRL's dapo with steps_per_generation): every micro-batch's loss is
    over the sampled batch's tokens / minibatches; the statistics keep the step's own count."""
    seen: list[dict] = []
    real = update.grpo_loss

    def spy(*args, **kw):
        seen.append({k: kw[k] for k in ("global_tokens", "loss_tokens")})
        return real(*args, **kw)

    monkeypatch.setattr(update, "grpo_loss", spy)
    tr = world_trainer(tmp_path, minibatches=2, minibatch_order="shuffled", loss_agg="token_mean",
                       token_mean_by="batch", micro_batch=4)
    batch = tr.collect()
    tr.update(batch)
    total = int(batch.rollout.completion_mask.sum())
    assert len(seen) == 8 and {s["loss_tokens"] for s in seen} == {total / 2}  # 2 x 4 micro
    steps = [{s["global_tokens"] for s in seen[i:i + 4]} for i in (0, 4)]
    assert all(len(x) == 1 for x in steps) and sum(x.pop() for x in steps) == total
    seen.clear()
    tr.cfg = make_config(None, {**tr.cfg.__dict__, "token_mean_by": "minibatch"})
    tr.update(batch)
    assert {s["loss_tokens"] for s in seen} == {None}
