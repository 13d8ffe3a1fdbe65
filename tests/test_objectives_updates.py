"""The objective options under split updates: micro-batches take the whole batch's step, and
the batch statistics (scale: batch, GDPO, KL in the reward) are over every rank."""

from __future__ import annotations

import pytest
import torch
from helpers import first_digit_odd, free_port, rank_env, tiny_trainer, world_trainer

from grpolab.config import Config, resolve


@pytest.mark.parametrize("over", [
    {"entropy_coef": 0.1},
    {"entropy_coef": 0.1, "loss_agg": "token_mean"},
    {"entropy_coef": 0.1, "entropy_agg": "token_mean"},  # (the loss a mean of replies)
    {"use_adaptive_entropy": True, "entropy_coef": 0.1, "entropy_target": 100.0, "epochs": 2},
    {"loss_agg": "seq_mean_token_sum", "policy_loss": "gspo", "epochs": 2},
    {"policy_loss": "cispo", "loss_agg": "token_mean", "epochs": 2, "dual_clip": 3.0},
    {"scale": "batch", "kl_estimator": "k2", "kl_is_correction": True},
    {"policy_loss": "sapo", "epochs": 2, "sapo_tau_neg": 2.0},
    {"policy_loss": "vespo", "loss_agg": "token_mean", "epochs": 2},
    {"policy_loss": "gmpo", "eps_low": 0.4, "eps_high": 0.4, "epochs": 2},
    {"off_policy_mask": 1e-4, "epochs": 2},
    {"minibatches": 2, "epochs": 2, "entropy_coef": 0.1},
    {"minibatches": 4, "minibatch_order": "shuffled", "loss_agg": "token_mean"},
])
def test_micro_batches_take_the_whole_batch_step(tmp_path, over: dict) -> None:
    """micro_batch 8 (parts of two groups) takes the whole batch's step with the new options
    (plain SGD, so equal gradients give equal weights, also after a second pass)."""
    params, outs = [], []
    for mb in (0, 8):
        tr = world_trainer(tmp_path / str(mb), micro_batch=mb, **over)
        tr.opt = torch.optim.SGD(tr.params, lr=0.1)
        outs.append(tr.update(tr.collect()))
        params.append(torch.cat([p.detach().flatten() for p in tr.params]))
    assert torch.allclose(params[0], params[1], atol=1e-6)
    for key in ("loss", "policy_loss", "kl", "grad_norm", "entropy"):
        assert outs[1][key] == pytest.approx(outs[0][key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize(("policy_loss", "knob", "values"), [
    ("sapo", "sapo_tau_neg", (1.05, 6.0)), ("vespo", "vespo_lambda_pos", (3.0, 0.2)),
    ("cispo", "cispo_min", (0.0, 0.99)), ("gmpo", "eps_high", (0.4, 1e-3)),
    ("clip", "off_policy_mask", (0.0, 1e-6)), ("kl_cov", "kl_cov_coef", (0.1, 50.0)),
    ("clip_cov", "clip_cov_lb", (1.0, -1.0)), ("dppo_tv", "eps_high", (0.2, 1e-4)),
    ("dro", "dro_beta", (0.1, 50.0))])
def test_a_policy_loss_setting_reaches_the_update(tmp_path, policy_loss: str, knob: str,
                                                  values: tuple) -> None:
    """The update passes the chosen loss its settings: a second pass over the same batch
    moves the weights differently when only the setting differs."""
    params = []
    for v in values:
        tr = world_trainer(tmp_path / str(v), policy_loss=policy_loss, epochs=2, lr=0.05,
                           **{knob: v})
        tr.update(tr.collect())
        params.append(torch.cat([p.detach().flatten() for p in tr.params]))
    assert not torch.allclose(params[0], params[1], atol=1e-6)


# ------------------------------------------------- batch statistics over ranks --


DIST_CASES = [{"scale": "batch"}, {"reward_aggregation": "normalize_then_sum"},
              {"kl_in": "reward", "kl_estimator": "k1", "scale": "batch"}]


def _dist_update(over: dict, out_dir) -> dict:
    """One update on a fixed batch of 8 groups of 4 with two rewards; under two ranks each
    holds 3 and 5 groups. Returns the gradients."""
    from grpolab.run import dist
    from grpolab.run.trainer import Batch, GRPOTrainer
    from grpolab.world.backend import TinyBackend
    from grpolab.world.model import TinyConfig, TinyGPT
    from grpolab.world.task import make_splits

    torch.manual_seed(0)
    model = TinyGPT(TinyConfig(d_model=32, n_layers=2))
    splits = make_splits(0, 64, 8)
    cfg = resolve(Config(budget=32, group_size=4, progress=False, out_dir=str(out_dir),
                         rewards=["a", "b"], reward_weights=[1.0, 0.5], **over))
    backend = TinyBackend(model)  # full weights: the reference is a frozen copy
    tr = GRPOTrainer(cfg, backend, splits.train, [first_digit_odd], out_dir=out_dir)
    with torch.no_grad():  # policy != reference, so the KL penalty is not 0
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    rows = [tr.train_rows[i] for i in range(8) for _ in range(4)]
    ro = backend.generate([r["prompt"] for r in rows], 1.0, 4, torch.Generator().manual_seed(5))
    per_fn = torch.tensor([first_digit_odd(None, ro.completions),
                           [float(len(c) % 2) for c in ro.completions]]).T
    total = per_fn @ torch.tensor([1.0, 0.5])
    cut = [0, 3, 8] if dist.world_size() == 2 else [0, 8]
    lo, hi = cut[dist.rank()] * 4, cut[dist.rank() + 1] * 4
    batch = Batch(ro.select(list(range(lo, hi))), rows[lo:hi], total[lo:hi],
                  rewards_per_fn=per_fn[lo:hi])
    tr.opt.zero_grad()
    tr.opt = torch.optim.SGD(tr.params, lr=0.0)  # keep the gradients, move nothing
    out = tr.update(batch)
    grads = torch.cat([p.grad.flatten() for p in tr.params])
    return {"grads": grads, "metrics": out}


def _dist_worker(rank: int, world: int, port: int, tmp: str) -> None:
    import os

    from grpolab.run import dist

    rank_env(rank, world, port)
    dist.init()
    try:
        res = [_dist_update(over, os.path.join(tmp, f"r{rank}")) for over in DIST_CASES]
        if rank == 0:
            torch.save(res, os.path.join(tmp, "two.pt"))
    finally:
        dist.cleanup()


@pytest.mark.slow
@pytest.mark.dist
def test_batch_statistics_are_over_every_rank(tmp_path) -> None:
    """scale: batch, GDPO's batch standardisation and the KL-in-reward penalty: two ranks
    holding 3 and 5 groups take the single-process step (the statistics are all-reduced)."""
    import torch.multiprocessing as mp

    mp.spawn(_dist_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ones = [_dist_update(over, tmp_path / "single") for over in DIST_CASES]
    finally:
        torch.set_num_threads(threads)
    for over, got, want in zip(DIST_CASES, two, ones):
        scale = float(want["grads"].abs().max())
        assert scale > 0, over
        torch.testing.assert_close(got["grads"], want["grads"], rtol=1e-4, atol=1e-6 * scale,
                                   msg=lambda m, o=over: f"{o}: {m}")
        for key in ("loss", "policy_loss", "entropy"):
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5,
                                                        abs=1e-7), (over, key)


def test_clip_cov_random_draw_resumes_bitwise(tmp_path) -> None:
    """Clip-Cov draws its tokens from torch's global generator (as verl); the checkpoint keeps
    that generator, so a run resumed halfway continues as the whole run did."""
    over = {"policy_loss": "clip_cov", "clip_cov_ratio": 0.3, "clip_cov_lb": -10.0,
            "epochs": 2, "checkpoint_every": 2}
    whole = tiny_trainer(tmp_path / "whole", steps=4, **over)
    rows = whole.train()[1:]
    tiny_trainer(tmp_path / "cut", steps=2, **over).train()
    second = tiny_trainer(tmp_path / "cut", steps=4, **over)
    resumed = second.train(resume=True)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows[2:]]
    assert any(r["clip_frac"] > 0 for r in rows)  # tokens were drawn
    for a, b in zip(second.params, whole.params):
        assert torch.equal(a, b)


def test_adaptive_entropy_resumes_bitwise(tmp_path) -> None:
    """The adaptive coefficient and the last step's entropy are checkpointed: a run resumed
    halfway applies what the whole run applied (no bonus only before the first step's
    entropy is seen; a coefficient restarted at entropy_coef would differ)."""
    over = {"use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 100.0,
            "entropy_coef_delta": 0.02, "checkpoint_every": 2}
    whole = tiny_trainer(tmp_path / "whole", steps=4, **over)
    rows = whole.train()[1:]
    assert [round(r["entropy_coef"], 6) for r in rows] == [0.07, 0.09, 0.11, 0.13]
    tiny_trainer(tmp_path / "cut", steps=2, **over).train()
    second = tiny_trainer(tmp_path / "cut", steps=4, **over)
    resumed = second.train(resume=True)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows[2:]]
    for a, b in zip(second.params, whole.params):
        assert torch.equal(a, b)


def test_adaptive_entropy_reads_each_steps_entropy(tmp_path) -> None:
    """The controller is told each optimiser step's entropy: the logged coefficients are what
    its rule gives on the logged entropies (a target among them, so it moves both ways), and
    micro-batches tell it the same."""
    base = [r["entropy"] for r in tiny_trainer(tmp_path / "base", steps=8).train()[1:]]
    low, high = sorted(base)[3:5]
    target = (low + high) / 2
    over = {"use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": target,
            "entropy_coef_delta": 0.02, "steps": 8}
    rows = tiny_trainer(tmp_path / "whole", **over).train()[1:]
    coef, want = 0.05, []
    for r in rows:
        coef = min(coef + 0.02, 1.0) if r["entropy"] <= target else max(coef - 0.02, 0.0)
        want.append(coef)
    got = [r["entropy_coef"] for r in rows]
    assert got == pytest.approx(want, abs=1e-12)
    assert max(got) > 0.05 and min(got) < 0.05  # up and down
    split = tiny_trainer(tmp_path / "split", micro_batch=4, **over).train()[1:]
    assert [r["entropy_coef"] for r in split] == pytest.approx(got, abs=1e-12)
