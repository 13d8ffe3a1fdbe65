"""TRL's optimiser settings (weight_decay, adam_beta1, adam_beta2, adam_epsilon): the parameters
decayed are those transformers' Trainer decays, a step is AdamW's by hand, the defaults keep
torch's Adam (the step of earlier runs), and a resume applies the run's values or refuses a
decay switched on or off."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_trainer
from transformers import Trainer

from grpolab.config import Config, ConfigError
from grpolab.rollout.models import load_model
from grpolab.rollout.tinyhf import make_tiny_model
from grpolab.run.optim import optimizer


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # RMSNorm by name; GPT-2's ln_1 by type
def test_decayed_parameters_are_transformers(tmp_path, arch: str) -> None:
    model, _ = load_model(str(make_tiny_model(tmp_path, hidden=32, heads=4, arch=arch)))
    _, opt = optimizer(model, Config(weight_decay=0.1))
    theirs = set(Trainer.get_decay_parameter_names(None, model))  # (tied weights: both names)
    want = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in theirs}
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert {id(p) for p in opt.param_groups[0]["params"]} == want
    assert 0 < len(want) < len(list(model.parameters()))  # norms (GPT-2's biases) not decayed


def test_a_step_is_adamw_by_hand(tmp_path) -> None:
    """With zero gradients Adam's update is 0, so a decayed weight shrinks by lr x decay
    exactly and a norm's weight stays; at weight_decay 0 the optimiser is plain Adam."""
    model, _ = load_model(str(make_tiny_model(tmp_path, hidden=32, heads=4, arch="llama")))
    cfg = Config(weight_decay=0.1, lr=0.01, adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-6)
    params, opt = optimizer(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        want = before[n] if "norm" in n else before[n] * (1 - 0.01 * 0.1)
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=0)
    assert (opt.param_groups[0]["betas"], opt.param_groups[0]["eps"]) == ((0.8, 0.9), 1e-6)
    _, plain = optimizer(model, Config())
    assert type(plain) is torch.optim.Adam and len(plain.param_groups) == 1


def test_resume_takes_the_runs_values_and_refuses_a_decay_switched(tmp_path) -> None:
    tiny_trainer(tmp_path, weight_decay=0.1, steps=2, checkpoint_every=1).train()
    tr = tiny_trainer(tmp_path, weight_decay=0.05, adam_beta2=0.95, steps=3,
                      checkpoint_every=1)
    tr.train(resume=True)
    assert [g["weight_decay"] for g in tr.opt.param_groups] == [0.05, 0.0]
    assert tr.opt.param_groups[0]["betas"] == (0.9, 0.95)
    with pytest.raises(ConfigError, match=r"weight_decay=0.05 \(this run: 0.0\)"):
        tiny_trainer(tmp_path, steps=4, checkpoint_every=1).train(resume=True)


def test_min_lr_is_over_the_runs_final_lr(tmp_path) -> None:
    """transformers' min_lr is an lr, divided by the optimiser's: a TRL file's min_lr under an
    lr given later still floors the schedule at min_lr itself."""
    from grpolab.config import make_config
    from grpolab.run.optim import lr_factor

    trl = {"lr_scheduler_type": "cosine_with_min_lr", "learning_rate": 1e-3,
           "lr_scheduler_kwargs": {"min_lr": 1e-4}, "num_generations": 4}
    c = make_config(trl, {"lr": 2e-3}, "train")
    assert (c.lr, c.min_lr, c.min_lr_rate, c.lr_schedule) == (2e-3, 1e-4, 0.0, "cosine")
    rows = tiny_trainer(tmp_path, steps=4, lr=2e-3, lr_schedule="cosine", min_lr=1e-4).train()
    assert [r["lr"] for r in rows[1:]] == pytest.approx(
        [2e-3 * lr_factor(s, 4, "cosine", 0, 0.05) for s in range(4)])
    with pytest.raises(ConfigError, match="give one"):
        make_config(None, {"min_lr": 1e-4, "min_lr_rate": 0.1})


def test_the_lr_moves_each_optimiser_step(tmp_path) -> None:
    """With epochs (TRL's num_iterations) each pass is an optimiser step and the schedule moves
    at each, as TRL's scheduler does: steps x epochs of them, the warm-up likewise."""
    from grpolab.run.optim import lr_factor

    tr = tiny_trainer(tmp_path, steps=3, epochs=2, lr=1e-3, lr_schedule="linear",
                      warmup_steps=1)
    seen, step = [], tr.opt.step

    def record(*a, **k):
        seen.append(tr.opt.param_groups[0]["lr"])
        return step(*a, **k)

    tr.opt.step = record
    tr.train()
    assert seen == pytest.approx([1e-3 * lr_factor(i, 6, "linear", 2) for i in range(6)])
    assert seen[2] > seen[3] > seen[4] > seen[5]  # (each step's two passes differ)
