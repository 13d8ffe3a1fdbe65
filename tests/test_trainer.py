"""Trainer-level behaviour of the switches: dynamic sampling, curriculum, epochs, predictions."""

import json
import logging
import math

import pytest
import torch
from helpers import first_digit_odd, never, tiny_trainer, world_trainer

from grpolab.config import make_config
from grpolab.core.advantages import dead_mask
from grpolab.predict.curriculum import PromptSampler, curriculum_weights
from grpolab.run.report import sample_record
from grpolab.run.trainer import GRPOTrainer, lr_factor
from grpolab.world.backend import TinyBackend
from grpolab.world.model import TinyConfig, TinyGPT
from grpolab.world.task import make_splits


def test_dynamic_sampling_trains_only_mixed_groups(tmp_path) -> None:
    tr = world_trainer(tmp_path, dynamic_sampling=True)
    batch = tr.collect()
    assert len(batch.rows) == 32 and batch.trained_groups == 8
    assert not dead_mask(batch.rewards, 4).any()
    sampled = torch.cat(batch.sampled_rewards)
    assert batch.answers_generated == sampled.numel() == 32 * batch.rounds
    assert batch.rounds >= 2  # a random policy gives dead groups, so a refill was needed
    assert not batch.cap_hit


def test_dynamic_sampling_can_judge_groups_on_the_first_reward(tmp_path) -> None:
    """A second reward that differs between every two answers (a length penalty, say) keeps
    every group alive by the total; judged on the first reward alone (verl's filter on acc),
    the dead ones by it are refilled, and every kept group's first rewards differ."""
    def spread(prompts, completions, **_):
        return [0.001 * i for i in range(len(completions))]

    total = world_trainer(tmp_path / "t", reward=[first_digit_odd, spread],
                          dynamic_sampling=True).collect()
    first = world_trainer(tmp_path / "f", reward=[first_digit_odd, spread],
                          dynamic_sampling=True, dynamic_sampling_on="first").collect()
    assert total.rounds == 1 and dead_mask(total.rewards_per_fn[:, 0], 4).any()
    assert first.rounds >= 2 and not dead_mask(first.rewards_per_fn[:, 0], 4).any()
    assert first.trained_groups == 8


def test_dynamic_sampling_cap_is_reported(tmp_path, caplog) -> None:
    tr = world_trainer(tmp_path, reward=never, dynamic_sampling=True, max_sampling_rounds=2)
    tr.metrics = None
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        rec = tr.step()
    assert rec["sampling_cap_hit"] is True
    assert rec["sampling_rounds"] == 3 and rec["answers_generated"] == 96
    assert rec["trained_groups"] == 0 and rec["useful_answers"] == 0
    assert rec["answers_per_useful"] is None
    assert "cap of 2 extra rounds hit" in caplog.text


def test_plain_grpo_counts_useful_answers(tmp_path) -> None:
    tr = world_trainer(tmp_path)
    rec = tr.step()
    assert rec["answers_generated"] == 32 and rec["sampling_rounds"] == 1
    live = round((1 - rec["dead_share"]) * rec["groups"])
    assert rec["useful_answers"] == live * 4
    # the world backend predicts the dead share from exact pass rates
    assert rec["predicted_dead_share"] is not None and 0 <= rec["predicted_dead_share"] <= 1
    assert 0 <= rec["heldout_pass_prob"] <= 1


def test_curriculum_weights_hand_values() -> None:
    p = torch.tensor([0.0, 0.5, 1.0, 0.25, 0.9], dtype=torch.float64)
    seen = torch.tensor([True, True, True, True, False])
    w = curriculum_weights(p, seen, floor=0.05, unseen=0.5)
    assert w.tolist() == pytest.approx([0.05, 1.0, 0.05, 0.75, 0.5])


def test_curriculum_running_pass_rate_and_draws() -> None:
    s = PromptSampler(4, torch.Generator().manual_seed(0), curriculum=True, decay=0.5)
    s.update([0, 1, 2], [1.0, 0.5, 0.0])
    s.update([1], [0.0])  # EMA: 0.5 * 0.5 + 0.5 * 0.0
    assert s.pass_rate.tolist() == pytest.approx([1.0, 0.25, 0.0, 0.0])
    assert s.visits.tolist() == [1, 2, 1, 0]
    counts = torch.zeros(4)
    for _ in range(400):
        counts[s.draw(1)[0]] += 1
    # weights 0.05, 0.75, 0.05, 0.5 (unseen): the sometimes-failed prompt dominates
    assert counts[1] > counts[3] > 5 * counts[0]
    assert counts[0] > 0  # never dropped outright
    uniform = PromptSampler(4, torch.Generator().manual_seed(0))
    assert sorted(uniform.draw(4)) == [0, 1, 2, 3]


def test_epochs_reuse_the_old_policy_and_clip(tmp_path) -> None:
    one = world_trainer(tmp_path / "a", epochs=1, lr=0.05, eps_low=0.01, eps_high=0.01)
    two = world_trainer(tmp_path / "b", epochs=2, lr=0.05, eps_low=0.01, eps_high=0.01)
    b1, b2 = one.collect(), two.collect()
    assert b1.rows == b2.rows and torch.equal(b1.rewards, b2.rewards)
    out1, out2 = one.update(b1), two.update(b2)
    assert out1["clip_frac"] == 0.0  # first pass: ratio is exactly 1
    assert out2["clip_frac"] > 0.0  # second pass: the ratio to the old policy moved and clipped
    w1 = torch.cat([p.flatten() for p in one.backend.model.parameters()])
    w2 = torch.cat([p.flatten() for p in two.backend.model.parameters()])
    assert not torch.equal(w1, w2)


def test_lora_reference_is_the_base(tmp_path) -> None:
    tr = world_trainer(tmp_path, lora=True, lr=0.05)
    assert tr.backend.ref is None
    trainable = [n for n, p in tr.backend.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ro = tr.backend.generate(["123+456="] * 4, 1.0, 4, torch.Generator().manual_seed(0))
    before = tr.backend.logprobs(ro, 1.0).detach()
    for _ in range(3):
        tr.update(tr.collect())
    after = tr.backend.logprobs(ro, 1.0).detach()
    ref = tr.backend.logprobs(ro, 1.0, reference=True).detach()
    assert not torch.allclose(after, before)  # the adapters learned something
    assert torch.allclose(ref, before, atol=1e-6)  # adapters off = the starting model


def test_samples_log_shows_answers_rewards_and_advantages(tmp_path) -> None:
    """samples.jsonl: per step, the first log_samples groups with their answers, rewards and the
    advantages those rewards gave (population std: +-1 for a 2-2 split), dead groups flagged."""
    tr = world_trainer(tmp_path, log_samples=3, steps=3)
    tr.train()
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    prompts = {r["prompt"]: r["answer"] for r in tr.train_rows}
    seen_dead = seen_split = False
    for rec in records:
        assert len(rec["groups"]) == 3
        for grp in rec["groups"]:
            assert prompts[grp["prompt"]] == grp["answer"]
            assert len(grp["completions"]) == len(grp["rewards"]) == len(grp["advantages"]) == 4
            assert grp["rewards"] == first_digit_odd(None, grp["completions"])
            adv = torch.tensor(grp["advantages"])
            if grp["dead"]:
                seen_dead = True
                assert len(set(grp["rewards"])) == 1 and not adv.any()
            else:
                assert abs(float(adv.sum())) < 1e-5 and len(set(grp["rewards"])) == 2
            if sorted(grp["rewards"]) == [0.0, 0.0, 1.0, 1.0]:
                seen_split = True
                assert sorted(grp["advantages"]) == pytest.approx([-1, -1, 1, 1])
    assert seen_dead and seen_split, "the run should show both kinds of group"
    off = world_trainer(tmp_path / "off", log_samples=0)
    off.train()
    assert not (tmp_path / "off" / "samples.jsonl").exists()


def test_lr_schedule_hand_values() -> None:
    """Warm-up 2 of 10 steps, then linear or cosine decay to 0 at step 10."""
    assert [lr_factor(s, 10, "constant", 2) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_factor(s, 10, "linear", 2) for s in (0, 1, 2, 6, 9)] == [0.5, 1.0, 1.0, 0.5,
                                                                        0.125]
    assert lr_factor(4, 10, "cosine", 2) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(6, 10, "cosine", 2) == pytest.approx(0.5)
    assert lr_factor(0, 10, "linear", 0) == 1.0 and lr_factor(10, 10, "linear", 0) == 0.0
    # cosine to a floor (transformers' cosine_with_min_lr), its own function past the warm-up
    # (transformers defines this name twice; the module keeps the one taking min_lr_rate)
    from transformers.optimization import _get_cosine_schedule_with_warmup_lr_lambda as with_min_lr

    for step in range(2, 11):
        assert lr_factor(step, 10, "cosine", 2, 0.1) == pytest.approx(with_min_lr(
            step, num_warmup_steps=2, num_training_steps=10, num_cycles=0.5, min_lr_rate=0.1))
    assert lr_factor(10, 10, "cosine", 2, 0.1) == pytest.approx(0.1)
    assert lr_factor(6, 10, "linear", 2, 0.1) == 0.5  # (the floor is cosine's only)


def test_lr_schedule_is_applied_and_logged(tmp_path, caplog) -> None:
    tr = world_trainer(tmp_path, steps=4, lr=0.01, lr_schedule="linear", warmup_steps=1,
                 checkpoint_every=2)
    recs = tr.train()[1:]
    assert [r["lr"] for r in recs] == pytest.approx([0.01, 0.01, 0.01 * 2 / 3, 0.01 / 3])
    assert tr.opt.param_groups[0]["lr"] == pytest.approx(0.01 / 3)
    # the schedule ends at `steps`: resuming with another length changes it, and says so
    again = world_trainer(tmp_path, steps=6, lr=0.01, lr_schedule="linear", warmup_steps=1)
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        again.load_checkpoint()
    assert "changed settings (steps 4 -> 6)" in caplog.text


def always_formatted(prompts, completions, **_):
    return [1.0] * len(completions)


def test_accuracy_is_the_first_rewards_verdict(tmp_path) -> None:
    """With [verifier, format] rewards every answer's total reaches 1 (the format reward alone
    gives 1): accuracy, the curriculum's pass rates and all-right groups follow the verifier."""
    cfg = make_config(None, {"progress": False, "checkpoint_every": 0, "budget": 32,
                             "group_size": 4, "steps": 1, "max_new_tokens": 4, "eval_size": 16})
    torch.manual_seed(0)
    model = TinyGPT(TinyConfig(d_model=32, n_layers=2, n_heads=2, max_len=24))
    splits = make_splits(0, 64, 16)
    tr = GRPOTrainer(cfg, TinyBackend(model, seed=0), splits.train,
                     [first_digit_odd, always_formatted], splits.heldout, out_dir=tmp_path)
    batch = tr.collect()
    rec_rewards = torch.cat(batch.sampled_rewards)
    assert (rec_rewards >= 1).all()  # the total would call every answer right
    verdict = torch.tensor(first_digit_odd(None, batch.rollout.completions)) >= 1
    assert torch.equal(torch.cat(batch.sampled_success), verdict)
    assert 0 < verdict.float().mean() < 1
    rec = tr.step()
    assert rec["accuracy_train"] < 1 and rec["heldout_acc"] < 1
    assert rec["rewards/always_formatted"] == 1.0
    assert rec["reward_mean"] == pytest.approx(1 + rec["rewards/first_digit_odd"])


def test_mask_truncated_drops_cut_off_answers_from_the_loss(tmp_path) -> None:
    """DAPO overlong filtering: with mask_truncated the update equals one on the same batch with
    the cut-off answers' tokens masked by hand; with every answer cut off nothing moves."""
    import copy

    def update(mask_truncated: bool, batch, hand_mask: bool = False):
        tr = world_trainer(tmp_path / str(len(list(tmp_path.iterdir()))), max_new_tokens=3,
                     mask_truncated=mask_truncated)
        b = copy.deepcopy(batch)
        if hand_mask:
            b.rollout.completion_mask = b.rollout.completion_mask * (~b.rollout.truncated)[:, None]
        out = tr.update(b)
        return out, torch.cat([p.detach().reshape(-1) for p in tr.params])

    batch = world_trainer(tmp_path / "sample", max_new_tokens=3).collect()
    cut = batch.rollout.truncated
    assert cut is not None and 0 < cut.float().mean() < 1, "need both kinds of answer"
    got, p_got = update(True, batch)
    want, p_want = update(False, batch, hand_mask=True)
    _, p_plain = update(False, batch)
    assert got["loss"] == pytest.approx(want["loss"]) and got["kl"] == pytest.approx(want["kl"])
    torch.testing.assert_close(p_got, p_want)
    assert not torch.equal(p_got, p_plain)  # the switch changes the step
    every = copy.deepcopy(batch)
    every.rollout.truncated = torch.ones_like(cut)
    out, _ = update(True, every)
    assert out["loss"] == 0 and out["grad_norm"] == 0


def test_truncated_share_is_logged(tmp_path) -> None:
    rec = world_trainer(tmp_path, max_new_tokens=2).step()
    assert rec["truncated_share"] is not None and 0 < rec["truncated_share"] <= 1


def test_samples_log_the_advantages_the_update_trained_with(tmp_path) -> None:
    """With a batch-level statistic (scale: batch) a group's advantages depend on the whole
    step; samples.jsonl must show the trained ones, not its own group's recomputation."""
    from grpolab.core import advantages as A

    tr = world_trainer(tmp_path, scale="batch", log_samples=8)
    batch = tr.collect()
    adv = tr.advantages(batch, tr.score(batch))
    whole = A.group_advantages(batch.rewards.float(), 4, scale="batch")
    assert torch.equal(adv, whole)
    g = 4
    live = next(i for i in range(0, len(batch.rewards), g) if batch.rewards[i : i + g].std() > 0)
    logged = sample_record(batch, g, live // g + 1, adv)[-1]["advantages"]  # to the first live
    assert logged == whole[live : live + g].tolist()
    own = A.group_advantages(batch.rewards[: live + g].float(), g, scale="batch")[live:]
    assert logged != own.tolist()  # what the old recomputation over the logged groups gave


def test_heldout_accuracy_by_difficulty(tmp_path) -> None:
    """Held-out rows with a ``difficulty`` column: each evaluation's line splits the accuracy
    by it, and the split's weighted mean is the accuracy itself."""
    tr = tiny_trainer(tmp_path, eval_every=1, eval_size=8)
    for i, row in enumerate(tr.heldout_rows[:8]):
        row["difficulty"] = "easy" if i < 3 else "hard"
    records = tr.train()
    evaluated = [r for r in records if r["heldout_acc"] is not None]
    assert len(evaluated) == 4  # step 0 and the 3 steps
    for r in evaluated:
        by = r["heldout_acc_by_difficulty"]
        assert set(by) == {"easy", "hard"}
        assert (3 * by["easy"] + 5 * by["hard"]) / 8 == pytest.approx(r["heldout_acc"])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["heldout_acc_by_difficulty"] for x in lines] == [
        r["heldout_acc_by_difficulty"] for r in evaluated]


def test_resume_says_where_it_goes_on_from(tmp_path, capsys) -> None:
    tiny_trainer(tmp_path, steps=2, checkpoint_every=2).train()
    capsys.readouterr()
    tiny_trainer(tmp_path, steps=3).train(resume=True)
    assert f"grpolab: resumed {tmp_path} at step 2 of 3\n" in capsys.readouterr().out
    tiny_trainer(tmp_path, steps=2).train(resume=True)
    assert "at step 2 of 2; nothing left to run" in capsys.readouterr().out
