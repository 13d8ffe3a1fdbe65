"""shard: fsdp on 2 CPU ranks (gloo): the FSDP2 update equals the 1-process update, each rank
holds about half the weights and Adam state, and a sharded checkpoint resumes on 2 ranks
bitwise and loads on 1 process with the same weights and optimizer state."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import GROUPS, G, digit_reward, free_port, rank_env

from grpolab.config import Config, ConfigError, validate
from grpolab.run import dist, shard
from grpolab.run.trainer import Batch, GRPOTrainer
from grpolab.world.backend import TinyBackend
from grpolab.world.model import CharTokenizer, TinyConfig, TinyGPT
from grpolab.world.task import make_splits

# (loss_agg, epochs, micro_batch, minibatches)
CASES = [("seq_mean_token_mean", 1, 0, 1), ("token_mean", 2, 5, 1), ("token_mean", 1, 3, 2)]


def local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> int:
    """Bytes of trainable parameters and optimizer state held by this rank (its shards)."""

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = sum(nbytes(p) for p in model.parameters() if p.requires_grad)
    if opt is not None:
        total += sum(nbytes(v) for st in opt.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def _trainer(out: Path, loss_agg: str = "token_mean", epochs: int = 1, micro_batch: int = 0,
             steps: int = 4, minibatches: int = 1, save_model_every: int = 0) -> GRPOTrainer:
    torch.manual_seed(0)
    model = TinyGPT(TinyConfig(vocab_size=CharTokenizer().vocab_size, d_model=32, n_layers=2))
    cfg = Config(budget=G * GROUPS, group_size=G, loss_agg=loss_agg, epochs=epochs, beta=0.04,
                 progress=False, out_dir=str(out), micro_batch=micro_batch, lora=False,
                 shard="fsdp", steps=steps, checkpoint_every=1, overwrite=True,
                 minibatches=minibatches, save_model_every=save_model_every)
    return GRPOTrainer(cfg, TinyBackend(model), make_splits(0, 64, 8).train, [digit_reward],
                       out_dir=out)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().reshape(-1).clone()


def _flat(tr: GRPOTrainer, grad: bool = False) -> torch.Tensor:
    return torch.cat([_full(p.grad if grad else p) for p in tr.backend.model.parameters()])


def _opt_state(tr: GRPOTrainer) -> torch.Tensor:
    return torch.cat([_full(v).double() for p in tr.backend.model.parameters()
                      for v in tr.opt.state[p].values()])


def _update(out: Path, loss_agg: str, epochs: int, micro_batch: int, minibatches: int) -> dict:
    """One update on one fixed batch; each rank trains on its half of the groups. With
    mini-batches each rank splits its half, so one process takes its groups in that order."""
    tr = _trainer(out, loss_agg, epochs, micro_batch, minibatches=minibatches)
    rows = [tr.train_rows[i] for i in range(GROUPS) for _ in range(G)]
    ro = tr.backend.generate([r["prompt"] for r in rows], 1.0, 8,
                             torch.Generator().manual_seed(123))
    rewards = torch.tensor(digit_reward(ro.prompts, ro.completions))
    lo, hi = dist.shard(GROUPS)
    idx = list(range(lo * G, hi * G))
    if minibatches == 2 and not dist.is_dist():  # rank 0's first half, rank 1's, ...
        h = GROUPS // 4
        idx = [g * G + j for g in (*range(h), *range(2 * h, 3 * h), *range(h, 2 * h),
                                   *range(3 * h, GROUPS)) for j in range(G)]
    before = _flat(tr)
    metrics = tr.update(Batch(ro.select(idx), [rows[i] for i in idx], rewards[idx]))
    return {"before": before, "params": _flat(tr), "grads": _flat(tr, grad=True),
            "metrics": metrics, "bytes": local_bytes(tr.backend.model, tr.opt),
            "sharded": tr.sharded}


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    rank_env(rank, world, port)
    dist.init()
    try:
        res: dict = {"cases": [_update(Path(tmp) / f"u{rank}", *c) for c in CASES]}
        # 4 steps in one go (a model folder every 2: gathered on both ranks, rank 0 writes),
        # and 2 + 2 with a resume from the sharded checkpoint
        whole = _trainer(Path(tmp) / "whole", save_model_every=2)
        whole.train()
        res["whole"] = _flat(whole)
        half = _trainer(Path(tmp) / "half", steps=2)
        half.train()
        resumed = _trainer(Path(tmp) / "half")
        resumed.train(resume=True)  # ... and saves its step 4 as the last checkpoint
        res["resumed"], res["resumed_opt"] = _flat(resumed), _opt_state(resumed)
        if rank == 0:
            torch.save(res, Path(tmp) / "fsdp.pt")
    finally:
        dist.cleanup()


@pytest.mark.slow
@pytest.mark.dist
def test_fsdp_two_ranks_equal_one_and_resume(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    two = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ones = [_update(tmp_path / "single", *c) for c in CASES]
        # the 2-rank sharded checkpoint, loaded by one process without FSDP
        one = _trainer(tmp_path / "half")
        one.load_checkpoint()
    finally:
        torch.set_num_threads(threads)
    for case, got, want in zip(CASES, two["cases"], ones):
        assert got["sharded"] and not want["sharded"]
        assert (want["params"] - want["before"]).abs().max() > 1e-4, "the weights must move"
        scale = float(want["grads"].abs().max())
        torch.testing.assert_close(got["grads"], want["grads"], rtol=1e-4, atol=1e-6 * scale,
                                   msg=lambda m, c=case: f"{c} gradients: {m}")
        torch.testing.assert_close(got["params"], want["params"], rtol=0,
                                   atol=5e-5 if case[3] == 1 else 2e-4,
                                   msg=lambda m, c=case: f"{c} weights: {m}")
        for key in ("loss", "policy_loss", "kl", "clip_frac", "grad_norm"):
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5,
                                                        abs=1e-7), (case, key)
        # weights + Adam moments per rank: about half of one process's (dims split unevenly)
        ratio = got["bytes"] / want["bytes"]
        print(f"weights + Adam bytes: 1 process {want['bytes']}, per rank of 2 {got['bytes']}")
        assert 0.45 < ratio < 0.6, ratio
    # resumed on 2 ranks: bitwise the uninterrupted run
    assert torch.equal(two["resumed"], two["whole"])
    # loaded on 1 process: the same weights and Adam state the 2 ranks saved, bit for bit
    assert not one.sharded and one.step_num == 4
    assert torch.equal(_flat(one), two["resumed"])
    assert torch.equal(_opt_state(one), two["resumed_opt"])
    # the model folders hold the whole model, gathered from the shards
    plain = _trainer(tmp_path / "plain").backend.model
    assert sorted(p.name for p in (tmp_path / "whole").glob("checkpoint-*")) == [
        "checkpoint-2", "checkpoint-4"]
    plain.load_state_dict(torch.load(tmp_path / "whole" / "checkpoint-4" / "tiny_gpt.pt",
                                     weights_only=True))
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in plain.parameters()]),
                       two["whole"])


def test_fsdp_is_for_full_fine_tuning() -> None:
    with pytest.raises(ConfigError, match="no-lora"):
        validate(Config(shard="fsdp", lora=True))


def test_sharded_checkpoint_refuses_code_and_tampering(tmp_path: Path) -> None:
    """shard: fsdp writes DCP checkpoints even in one process; loading them runs no code
    from disk and catches a changed shard file."""
    import pickle

    with warnings.catch_warnings(record=True) as said:  # one process is meant: DCP says nothing
        warnings.simplefilter("always")
        tr = _trainer(tmp_path / "run", steps=1)
        tr.train()
        folder = next((tmp_path / "run" / "checkpoints").glob("dcp-*"))
        fresh = _trainer(tmp_path / "run")
        assert fresh.load_checkpoint() == 1 and torch.equal(_flat(fresh), _flat(tr))
    assert not [w for w in said if "torch.distributed is disabled" in str(w.message)]

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with pytest.raises(pickle.UnpicklingError, match="refused"):
        shard._MetadataUnpickler(__import__("io").BytesIO(pickle.dumps(Evil()))).load()
    assert not (tmp_path / "pwned").exists()
    data = next(folder.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(Exception, match="does not match the hashes"):
        _trainer(tmp_path / "run").load_checkpoint()
