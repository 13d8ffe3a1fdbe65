"""TRL's sync_ref_model (TR-DPO's reference update): the reference TRL's own callback would
make, at TRL's optimiser-step count, kept in checkpoints, and refused where TRL refuses it."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_trainer

from grpolab.config import ConfigError, make_config

SYNC = {"lora": False, "sync_ref_model": True, "ref_model_mixup_alpha": 0.3,
        "ref_model_sync_steps": 3, "epochs": 2}


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_reference_is_trls_sync_at_its_optimiser_steps(tmp_path) -> None:
    """Two epochs a step: optimiser steps 1, 2 (step 1), 3, 4 (step 2): the sync falls after
    optimiser step 3, the first epoch of step 2, with that moment's policy, as TRL's
    SyncRefModelCallback computes it; step 1 leaves the reference as it started."""
    trl_callbacks = pytest.importorskip("trl.trainer.callbacks")
    tr = tiny_trainer(tmp_path, steps=2, **SYNC)
    start = params(tr.backend.ref)
    seen = {}
    opt_step = tr.opt.step

    def step_and_look(*a, **k):  # the policy after each optimiser step
        out = opt_step(*a, **k)
        seen[len(seen) + 1] = [p.detach().clone() for p in tr.backend.model.parameters()]
        return out

    tr.opt.step = step_and_look
    tr.train()
    assert sorted(seen) == [1, 2, 3, 4]
    want = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in start])
    policy = torch.nn.ParameterList([torch.nn.Parameter(p) for p in seen[3]])
    trl_callbacks.SyncRefModelCallback._sync_target_model(policy, want, 0.3)
    for got, w, s in zip(tr.backend.ref.parameters(), want, start, strict=True):
        torch.testing.assert_close(got, w.detach(), rtol=0, atol=0)
    assert any(not torch.equal(g, s) for g, s in zip(tr.backend.ref.parameters(), start))


def test_synced_reference_resumes_bitwise(tmp_path) -> None:
    """(The world's backend keeps its reference in its own state; the HF backend's is the
    trainer's: tests/test_hf.py's resume test.)"""
    over = {**SYNC, "checkpoint_every": 1, "ref_model_sync_steps": 2}
    whole = tiny_trainer(tmp_path / "whole", steps=3, **over)
    rows = whole.train()[1:]
    tiny_trainer(tmp_path / "cut", steps=1, **over).train()  # synced after its 2nd opt step
    second = tiny_trainer(tmp_path / "cut", steps=3, **over)
    resumed = second.train(resume=True)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows[1:]]
    for a, b in zip(params(second.backend.ref), params(whole.backend.ref), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("over", "message"), [
    ({"sync_ref_model": True}, "needs full fine-tuning"),  # the train command's LoRA
    ({"sync_ref_model": True, "lora": False, "beta": 0.0}, "beta > 0"),
    ({"sync_ref_model": True, "lora": False, "ref_model_mixup_alpha": 1.5}, r"in \[0, 1\]"),
])
def test_refused_where_it_cannot_act(over: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_config(None, over, "train")


def test_trl_names_load(tmp_path) -> None:
    y = tmp_path / "trl.yaml"
    y.write_text("sync_ref_model: true\nref_model_mixup_alpha: 0.9\nref_model_sync_steps: 64\n"
                 "use_peft: false\nbf16: false\nbeta: 0.04\nnum_generations: 8\n")
    c = make_config(y, None, "train")
    assert (c.sync_ref_model, c.ref_model_mixup_alpha, c.ref_model_sync_steps) == (True, 0.9, 64)
