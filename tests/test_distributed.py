"""Split updates: N ranks (gloo on CPU), or micro-batches in one process, must take exactly
the step one pass over the whole batch takes.

Groups are sharded whole, so advantages need no communication; what can go wrong is the loss
normalisation (a per-rank or per-micro-batch mean is not the global mean when the parts hold
different numbers of replies or tokens) and the gradient sum. One update on a fixed batch
checks both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import GROUPS, G, digit_reward, free_port, rank_env

from grpolab.config import Config, ConfigError
from grpolab.run import dist
from grpolab.run.trainer import Batch, GRPOTrainer
from grpolab.world.backend import TinyBackend
from grpolab.world.model import CharTokenizer, TinyConfig, TinyGPT
from grpolab.world.sft import sft_model
from grpolab.world.task import make_splits

# (loss_agg, epochs, groups on rank 0): uneven shards stress the global normalisation.
MICRO_CASE = ("token_mean", 2, 3)
MINI_CASE = ("token_mean", 2, GROUPS // 2)
CASES = [
    ("seq_mean_token_mean", 1, 4),
    ("token_mean", 1, 4),
    ("seq_mean_token_sum_norm", 1, 4),
    ("seq_mean_token_mean", 2, 5),
    ("token_mean", 2, 3),
]


def _trainer(loss_agg: str, epochs: int, out_dir: Path, budget: int = G * GROUPS,
             micro_batch: int = 0, minibatches: int = 1) -> GRPOTrainer:
    torch.manual_seed(0)
    model = TinyGPT(TinyConfig(vocab_size=CharTokenizer().vocab_size, d_model=32, n_layers=2,
                               max_len=24))
    splits = make_splits(0, 64, 8)
    cfg = Config(budget=budget, group_size=G, loss_agg=loss_agg, epochs=epochs, beta=0.04,
                 progress=False, out_dir=str(out_dir), micro_batch=micro_batch,
                 minibatches=minibatches)
    return GRPOTrainer(cfg, TinyBackend(model), splits.train, [digit_reward], out_dir=out_dir)


def _update(loss_agg: str, epochs: int, rank0_groups: int, out_dir: Path,
            micro_batch: int = 0, minibatches: int = 1, order: list[int] | None = None) -> dict:
    """One update on the same batch everywhere; each rank trains on its slice of the groups
    (``order``: the groups in this order)."""
    tr = _trainer(loss_agg, epochs, out_dir, micro_batch=micro_batch, minibatches=minibatches)
    rows = [tr.train_rows[i] for i in range(GROUPS) for _ in range(G)]
    ro = tr.backend.generate([r["prompt"] for r in rows], 1.0, 8,
                             torch.Generator().manual_seed(123))
    # A near-random policy rarely stops early; cut replies to varied lengths so ranks hold
    # different token counts (what token_mean must weight by).
    keep = torch.arange(ro.completion_ids.shape[1])[None, :] < torch.tensor(
        [1 + (3 * i + i // 7) % 8 for i in range(len(rows))])[:, None]
    ro.completion_ids = ro.completion_ids.masked_fill(~keep, tr.backend.pad_id)
    ro.completion_mask = ro.completion_mask * keep
    ro.completions = [tr.backend.tok.decode(r.tolist()) for r in ro.completion_ids]
    rewards = torch.tensor(digit_reward(ro.prompts, ro.completions))
    if order:
        idx = [g * G + j for g in order for j in range(G)]
        ro, rows, rewards = ro.select(idx), [rows[i] for i in idx], rewards[idx]
    cut = [0, rank0_groups, GROUPS] if dist.world_size() == 2 else [0, GROUPS]
    lo, hi = cut[dist.rank()] * G, cut[dist.rank() + 1] * G
    batch = Batch(ro.select(list(range(lo, hi))), rows[lo:hi], rewards[lo:hi])
    before = _flat(tr)
    out = tr.update(batch)
    return {"before": before, "params": _flat(tr), "grads": _flat(tr, grad=True), "metrics": out,
            "mixed": int((rewards.view(-1, G).std(1) > 0).sum())}


def _flat(tr: GRPOTrainer, grad: bool = False) -> torch.Tensor:
    ps = list(tr.backend.model.parameters())
    return torch.cat([
        (torch.zeros_like(p) if grad and p.grad is None else p.grad if grad else p.detach())
        .reshape(-1).clone() for p in ps
    ])


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    rank_env(rank, world, port)
    dist.init()
    try:
        res: dict = {"cases": [_update(*case, Path(tmp) / f"r{rank}") for case in CASES]}
        # ranks and micro-batches together: each rank's 5-row parts of uneven shards
        res["micro"] = _update(*MICRO_CASE, Path(tmp) / f"r{rank}", micro_batch=5)
        # each rank splits its own groups into mini-batches, as verl's ranks do
        res["mini"] = _update(*MINI_CASE, Path(tmp) / f"r{rank}", minibatches=2)
        try:  # 3 prompts a step cannot be shared by 2 ranks as whole groups
            _trainer("token_mean", 1, Path(tmp) / f"r{rank}", budget=3 * G)
            res["config_error"] = None
        except ConfigError as e:
            res["config_error"] = str(e)
        if rank == 0:
            torch.save(res, Path(tmp) / "two_ranks.pt")
    finally:
        dist.cleanup()


@pytest.mark.slow
@pytest.mark.dist
def test_two_ranks_take_the_single_process_step(tmp_path: Path) -> None:
    """Summed gradients match to float precision; weights after Adam to ~lr / 100. With
    mini-batches each rank splits its own groups (verl's ranks do): one process takes the same
    steps with its groups in that order.

    The gradients are the real check (Adam is scale-invariant, so a wrongly scaled gradient
    would still give the same weights). Adam's first steps move each weight by about
    lr * sign(g), so a weight whose gradient is at rounding-noise level can move differently:
    merely reordering the groups of one process changes weights by up to ~2e-6 after one pass
    and ~6e-6 after two (measured), hence 1e-5 (one pass) and 5e-5 (two).
    """
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    two = torch.load(tmp_path / "two_ranks.pt", weights_only=False)
    assert two["config_error"] and "across 2 ranks" in two["config_error"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers
    # two ranks' mini-batch k = rank 0's k-th half + rank 1's: one process's, groups reordered
    h = GROUPS // 4
    order = [*range(h), *range(2 * h, 3 * h), *range(h, 2 * h), *range(3 * h, GROUPS)]
    try:
        wants = [_update(*case, tmp_path / "single") for case in CASES]
        mini = _update(*MINI_CASE, tmp_path / "single", minibatches=2, order=order)
    finally:
        torch.set_num_threads(threads)
    wants += [wants[CASES.index(MICRO_CASE)], mini]  # (micro: the same whole-batch step)
    for case, got, want in zip([*CASES, MICRO_CASE, MINI_CASE],
                               [*two["cases"], two["micro"], two["mini"]], wants):
        assert want["mixed"] >= 3, "the fixed batch should have groups that carry gradient"
        assert (want["params"] - want["before"]).abs().max() > 1e-4, "the weights must move"
        scale = float(want["grads"].abs().max())
        torch.testing.assert_close(got["grads"], want["grads"], rtol=1e-4, atol=1e-6 * scale,
                                   msg=lambda m, c=case: f"{c} gradients: {m}")
        # (four Adam steps with mini-batches: 7.4e-5 measured on 2 of 27,328 weights)
        torch.testing.assert_close(got["params"], want["params"], rtol=0,
                                   atol=1e-5 if case[1] == 1 else 5e-5 if got is not two["mini"]
                                   else 2e-4, msg=lambda m, c=case: f"{c} weights: {m}")
        for key in ("loss", "policy_loss", "kl", "clip_frac", "grad_norm"):
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5,
                                                        abs=1e-7), (case, key)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _cleanup_worker(rank: int, world: int, port: int, tmp: str) -> None:
    rank_env(rank, world, port)
    before = _threads()
    dist.init()
    during = _threads()
    w = torch.nn.Parameter(torch.ones(3))
    # Adam's first step imports torch._dynamo, which imports torch.distributed.nn.functional
    opt = torch.optim.Adam([w], lr=0.1)
    (w * float(dist.all_gather_object(rank)[1 - rank])).sum().backward()
    dist.sum_grads([w])
    opt.step()
    dist.cleanup()
    torch.save({"before": before, "during": during, "after": _threads()},
               Path(tmp) / f"threads{rank}.pt")


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_cleanup_releases_the_process_group(tmp_path: Path) -> None:
    """After dist.cleanup() gloo's threads are gone, so none can outlive Python's finalisation.

    Seen in CI: a rank that finished cleanly aborted at exit ("terminate called without an
    active exception") because torch.distributed.nn.functional, imported by torch._dynamo on
    the first optimiser step, had bound the live group as default arguments; the group outlived
    destroy_process_group and a gloo thread freed a tensor while the interpreter shut down.
    """
    mp.spawn(_cleanup_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        n = torch.load(tmp_path / f"threads{rank}.pt")
        assert n["during"] > n["before"], "the group should have started gloo threads"
        assert n["after"] == n["before"], n


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.skipif(shutil.which("torchrun") is None and not Path(sys.executable).with_name(
    "torchrun").exists(), reason="torchrun not installed")
def test_torchrun_workshop_smoke(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m grpolab workshop``: one metrics file, global counts."""
    cache = tmp_path / "cache"
    splits = make_splits(0, 64, 16)
    sft_model(0, splits, 2, cache)  # built once here, so the ranks only load it
    out = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun if torchrun.exists() else shutil.which("torchrun")),
           "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "grpolab",
           "workshop", "--steps", "2", "--sft-steps", "2", "--cache-dir", str(cache),
           "--out-dir", str(out), "--world-train-size", "64", "--world-heldout-size", "16",
           "--eval-size", "16", "--budget", "32", "--group-size", "4", "--checkpoint-every",
           "1", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["groups"] == r["trained_groups"] == 8  # prompts_per_step, not 8 per rank
        assert r["answers_generated"] == 32
    assert (out / "workshop.png").is_file() and (out / "checkpoints" / "last.pt").is_file()
    st = torch.load(out / "checkpoints" / "last.pt", weights_only=False)
    assert st["world_size"] == 2 and len(st["rank_rng"]) == 2
    assert not torch.equal(st["rank_rng"][0]["gen"], st["rank_rng"][1]["gen"])
    assert sorted(x.name for x in out.iterdir()) == [
        ".grpolab.lock", "calibration.png", "checkpoints", "config.json", "metrics.jsonl",
        "samples.jsonl", "summary.json", "workshop.png"]


@pytest.mark.parametrize("micro_batch", [5, 12])
def test_micro_batches_take_the_whole_batch_step(tmp_path: Path, micro_batch: int) -> None:
    """Micro-batches of 5 rows (groups cut in two, parts of 1 to 8 answer tokens, the last part
    short) or 12 accumulate the gradient of one pass over all 32 rows, for every loss_agg and
    with two epochs (old-policy log-probs taken per part before the first optimizer step).

    Gradients are compared everywhere. Weights are compared where the gradient is clearly above
    rounding noise: Adam's first step is lr * g / (|g| + 1e-8), so a weight whose gradient is
    ~1e-8 moves by a noise-dependent amount (measured: up to 2.5e-5 of a 1e-3 step).
    """
    for case in CASES:
        want = _update(*case, tmp_path / "whole")
        got = _update(*case, tmp_path / f"mb{micro_batch}", micro_batch=micro_batch)
        assert (want["params"] - want["before"]).abs().max() > 1e-4, "the weights must move"
        scale = float(want["grads"].abs().max())
        torch.testing.assert_close(got["grads"], want["grads"], rtol=1e-4, atol=1e-6 * scale,
                                   msg=lambda m, c=case: f"{c} gradients: {m}")
        clear = want["grads"].abs() > 1e-4 * scale
        assert clear.float().mean() > 0.5, "most weights have a clear gradient"
        torch.testing.assert_close(got["params"][clear], want["params"][clear], rtol=0,
                                   atol=1e-6 if case[1] == 1 else 1e-5,
                                   msg=lambda m, c=case: f"{c} weights: {m}")
        for key in ("loss", "policy_loss", "kl", "clip_frac", "grad_norm"):
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5,
                                                        abs=1e-7), (case, key)
