"""The run's length and its learning-rate schedule as TRL and verl count them: epochs over the
data (``passes``), a warm-up given as a share, the warm-up's first step at lr 0, and verl's
schedule that moves once a training step. Each checked against TRL's / transformers' and
verl's own code, and end to end."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader
from verl_harness import verl_functions

from grpolab.config import ConfigError, make_config
from grpolab.config.validate import every, resolve, with_length
from grpolab.run.optim import lr_at, schedule_length


def trl_schedule(keys: dict, prompts: int) -> list[float]:
    """The lr of each optimiser step TRL 1.16 takes for ``keys`` on ``prompts`` prompts: its
    GRPO sampler and batch, transformers' Trainer's count of steps from epochs, its warm-up
    and its scheduler."""
    pytest.importorskip("trl")
    from transformers import Trainer, get_scheduler
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir="unused", report_to=[], bf16=False, **keys)
    t = GRPOTrainer.__new__(GRPOTrainer)  # (what its sampler and the step count read)
    t.args, t.num_generations, t.num_iterations = args, args.num_generations, args.num_iterations
    t.shuffle_dataset, t._train_batch_size = True, args.per_device_train_batch_size
    t.accelerator, t.is_deepspeed_enabled = SimpleNamespace(parallelism_config=None), False
    t.model = torch.nn.Linear(1, 1)
    data = list(range(prompts))
    loader = DataLoader(data, batch_size=args.per_device_train_batch_size
                        * args.steps_per_generation, sampler=t._get_train_sampler(data))
    max_steps = Trainer.set_initial_training_values(t, args, loader)[-1]
    opt = torch.optim.SGD(t.model.parameters(), lr=args.learning_rate)
    sched = get_scheduler(args.lr_scheduler_type, opt, args.get_warmup_steps(max_steps),
                          max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    out = []
    for _ in range(max_steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def ours(keys: dict, prompts: int) -> tuple[list[float], int]:
    """grpolab's lr of each optimiser step for the same keys, and its optimiser steps a batch."""
    c = with_length(make_config(None, keys, "train"), prompts)
    per = c.epochs * c.minibatches
    return [lr_at(c, s, i) for s in range(c.steps) for i in range(per)], per


TRL_RUNS = [  # (TRL's keys, prompts in the dataset; the batch given: grpolab's default differs)
    ({"num_generations": 4, "per_device_train_batch_size": 8, "num_train_epochs": 2, "learning_rate": 1e-3,
      "lr_scheduler_type": "linear", "warmup_steps": 0.1}, 21),
    ({"num_generations": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
      "steps_per_generation": 4, "num_iterations": 2, "num_train_epochs": 1.5,
      "learning_rate": 1e-3, "lr_scheduler_type": "cosine", "warmup_steps": 0.1}, 37),
    ({"num_generations": 8, "per_device_train_batch_size": 16, "num_train_epochs": 3,
      "learning_rate": 2e-5,  # open-r1's schedule
      "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
      "warmup_steps": 0.1}, 50),
    ({"num_generations": 4, "per_device_train_batch_size": 8, "max_steps": 12, "num_iterations": 3, "learning_rate": 1e-3,
      "lr_scheduler_type": "constant_with_warmup", "warmup_steps": 0.3}, 10),
    ({"num_generations": 4, "per_device_train_batch_size": 8, "max_steps": -1,
      "learning_rate": 1e-3, "lr_scheduler_type": "linear", "warmup_steps": 2}, 9),
]


@pytest.mark.parametrize(("keys", "prompts"), TRL_RUNS)
def test_trl_epochs_and_warmup_are_trls(keys: dict, prompts: int) -> None:
    """TRL's epochs, warm-up share (rounded up over the run's optimiser steps) and schedule:
    every optimiser step at TRL's lr, the first at 0, the run as long as TRL's."""
    theirs = trl_schedule(keys, prompts)
    mine, _ = ours(keys, prompts)
    assert mine == pytest.approx(theirs, rel=1e-12, abs=1e-15)
    assert mine[0] == 0.0


def test_interval_shares_with_epochs_are_transformers() -> None:
    """TRL's save_steps / eval_steps / logging_steps shares with epochs (open-r1's Codeforces
    recipe: save_steps 0.05, one epoch): shares of the steps counted from the data, equal to
    transformers' TrainerState over the step count its Trainer derives; in grpolab's own keys
    too (the workshop's steps are known at once)."""
    from transformers import TrainerState
    from trl import GRPOConfig

    for shares, prompts in (({"save_steps": 0.1, "eval_steps": 0.25}, 21),
                            ({"save_steps": 0.05, "logging_steps": 0.3}, 50)):
        keys = {**TRL_RUNS[0][0], **shares, "eval_strategy": "steps"}
        state = TrainerState()
        state.compute_steps(GRPOConfig(output_dir="unused", report_to=[], bf16=False, **keys),
                            len(trl_schedule(keys, prompts)))
        c = with_length(make_config(None, keys, "train"), prompts)
        assert c.checkpoint_every == keys["save_steps"]  # (a share, counted where it is read)
        assert [every(c, k) for k in ("checkpoint_every", "save_model_every", "eval_every")] == [
            state.save_steps, state.save_steps, state.eval_steps]
    c = make_config(None, {"checkpoint_every": 0.25, "eval_every": 0.1, "steps": 30},
                    "workshop")
    assert (every(c, "checkpoint_every"), every(c, "eval_every")) == (8, 3)  # ceil 7.5, 3.0
    # a share follows the run's length: a sweep's or the API's later steps, passes given
    # beside the share over a file's max_steps, the workshop (which has no passes)
    assert every(resolve(dataclasses.replace(c, steps=10)), "checkpoint_every") == 3
    file = {"model_name_or_path": "m", "max_steps": 100}
    c = with_length(make_config(file, {"passes": 2, "save_steps": 0.1}, "train"), 1000)
    assert (c.steps, every(c, "checkpoint_every")) == (250, 25)  # (not 0.1 x 100)
    c = make_config(None, {"passes": 2, "eval_every": 0.5}, "workshop")
    assert (c.steps, every(c, "eval_every")) == (40, 20)


def test_a_part_epoch_ends_on_a_whole_batch() -> None:
    """1.3 epochs of 4 batches, 4 optimiser steps a batch: TRL stops after 21 optimiser steps,
    inside the sixth batch; grpolab samples whole batches and takes all 24 (steps ceil(1.3 x 4)
    = 6), its schedule over those 24. Documented, not hidden."""
    keys = {**TRL_RUNS[1][0], "num_train_epochs": 1.3}
    theirs, (mine, per) = trl_schedule(keys, 37), ours(keys, 37)
    assert (len(theirs), len(mine), per) == (21, 24, 4)
    assert len(mine) == per * math.ceil(len(theirs) / per)


VERL = "actor_rollout_ref.actor."


@pytest.mark.parametrize("style", ["constant", "cosine", "ratio"])
def test_verl_epochs_and_schedule_are_verls(style: str) -> None:
    """verl: total_epochs x the whole batches of its drop_last loader (ray_trainer's
    total_training_steps), its warm-up from lr 0 and its schedule stepped once a training
    step: every mini-batch of a step at verl's lr for that step. ``ratio``: its
    lr_warmup_steps_ratio (0.285, its GRPO examples'), int(ratio x total) steps, counted once
    the data is: 3 of 12 (grpolab's share rounded up would take 4)."""
    f = verl_functions("get_cosine_schedule_with_warmup", "get_constant_schedule_with_warmup")
    prompts, batch, epochs = 70, 16, 3
    keys = {"data.train_batch_size": batch, "actor_rollout_ref.rollout.n": 4,
            VERL + "ppo_mini_batch_size": 4, "trainer.total_epochs": epochs,
            VERL + "optim.lr": 1e-3, VERL + "optim.lr_warmup_steps": 2,
            VERL + "optim.lr_scheduler_type": "constant" if style == "constant" else "cosine",
            VERL + "optim.min_lr_ratio": 0.1}
    if style == "constant":
        del keys[VERL + "optim.min_lr_ratio"]
    total = len(DataLoader(range(prompts), batch_size=batch, drop_last=True)) * epochs
    warmup = 2
    if style == "ratio":
        del keys[VERL + "optim.lr_warmup_steps"]
        keys[VERL + "optim.lr_warmup_steps_ratio"] = 0.285
        warmup = int(0.285 * total)
        assert (total, warmup, math.ceil(0.285 * total)) == (12, 3, 4)
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1e-3)
    sched = (f["get_constant_schedule_with_warmup"](opt, 2) if style == "constant"
             else f["get_cosine_schedule_with_warmup"](opt, warmup, total, min_lr_ratio=0.1))
    theirs = []
    for _ in range(total):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    c = with_length(make_config(None, keys, "train"), prompts)
    assert (c.steps, c.minibatches, c.schedule_per) == (total, 4, "step")
    mine = [[lr_at(c, s, i) for i in range(c.minibatches)] for s in range(c.steps)]
    assert [lrs[0] for lrs in mine] == pytest.approx(theirs, rel=1e-12, abs=1e-15)
    assert all(len(set(lrs)) == 1 for lrs in mine)  # (one lr a training step)


def test_verl_epochs_count_its_loaders_gen_batches() -> None:
    """verl's DAPO loader serves gen_batch_size prompts (3 x train_batch_size in its recipe):
    total_training_steps = the loader's whole batches x total_epochs, and the schedule over
    them; grpolab's passes count the same batches (not train_batch_size's: 3x the steps)."""
    import importlib.util  # (verl's trainer imports ray, absent here: its text is read)

    trainer = Path(importlib.util.find_spec("verl").origin).parent / "trainer/ppo/ray_trainer.py"
    source = trainer.read_text()
    assert 'get("gen_batch_size", None) or self.config.data.train_batch_size' in source
    assert "len(self.train_dataloader) * self.config.trainer.total_epochs" in source
    prompts, train, gen, epochs = 100, 16, 48, 3
    keys = {"data.train_batch_size": train, "data.gen_batch_size": gen,
            "algorithm.filter_groups.enable": True, "actor_rollout_ref.rollout.n": 4,
            VERL + "ppo_mini_batch_size": 16, "trainer.total_epochs": epochs,
            VERL + "optim.lr_warmup_steps_ratio": 0.285}
    total = len(DataLoader(range(prompts), batch_size=gen, drop_last=True)) * epochs
    c = with_length(make_config(None, keys, "train"), prompts)
    assert (c.steps, total, schedule_length(c)) == (6, 6, (1, 6, int(0.285 * 6)))
    with pytest.raises(ConfigError, match="100 prompts fill no batch of 128"):
        with_length(make_config(None, {**keys, "data.gen_batch_size": 128}, "train"), prompts)


def test_schedule_units_and_warmup_start() -> None:
    """By hand: 4 steps x 2 epochs, a 0.25 warm-up share. Per optimiser step: 8 units, 2 of
    warm-up; per step: 4 units, 1 of warm-up. From zero the ramp starts at 0."""
    c = make_config(None, {"steps": 4, "epochs": 2, "warmup_steps": 0.25, "lr": 1.0,
                           "lr_schedule": "linear"}, "train")
    assert schedule_length(c) == (2, 8, 2)
    assert [lr_at(c, s, i) for s in range(4) for i in range(2)] == pytest.approx(
        [0.5, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6])
    z = make_config(None, {"steps": 4, "epochs": 2, "warmup_steps": 0.25, "lr": 1.0,
                           "lr_schedule": "linear", "warmup_from_zero": True}, "train")
    assert [lr_at(z, 0, i) for i in range(2)] == [0.0, 0.5]
    s = make_config(None, {"steps": 4, "epochs": 2, "warmup_steps": 0.25, "lr": 1.0,
                           "lr_schedule": "linear", "schedule_per": "step"}, "train")
    assert schedule_length(s) == (1, 4, 1)
    assert [lr_at(s, k, i) for k in range(4) for i in range(2)] == pytest.approx(
        [1.0, 1.0, 1.0, 1.0, 2 / 3, 2 / 3, 1 / 3, 1 / 3])


def test_passes_count_whole_batches_and_say_so() -> None:
    c = make_config(None, {"passes": 2.5, "budget": 16, "group_size": 4}, "train")
    assert with_length(c, 23).steps == math.ceil(2.5 * 5)  # 23 prompts: 5 whole steps of 4
    with pytest.raises(ConfigError, match="the dataset's 3 prompts fill no batch of 4"):
        with_length(c, 3)
    assert with_length(make_config(None, {"steps": 7}, "train"), 3).steps == 7  # passes 0
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="passes must be a finite number >= 0"):
            make_config(None, {"passes": bad}, "train")
    with pytest.raises(ConfigError, match="steps 5 and passes 2 both given"):
        make_config(None, {"steps": 5, "passes": 2}, "train")
    # a later steps (an override) replaces a file's passes; a later passes a file's steps
    assert make_config({"passes": 2}, {"steps": 5}, "train").passes == 0
    assert make_config({"steps": 5}, {"passes": 2}, "train").passes == 2
    for bad in (2.5, -1, float("nan")):
        with pytest.raises(ConfigError, match="warmup_steps must be a count, or below 1"):
            make_config(None, {"warmup_steps": bad}, "train")
    assert make_config(None, {"warmup_steps": 3.0}, "train").warmup_steps == 3  # (an int)


def test_train_runs_trls_epochs_end_to_end(llama: str, tmp_path, capsys, caplog) -> None:
    """``grpolab train`` on a TRL config that counts epochs: 7 prompts, 2 a step (8 answers,
    G 4), so 3 whole steps a pass, 2 epochs: 6 steps, said before the run; a later
    ``--steps`` replaces the epochs (and goes on from the checkpoint with --resume)."""
    import json

    import yaml

    from grpolab.app import cli

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a} + {a} =", "answer": str(2 * a)}) + "\n"
                            for a in range(7)))
    out = tmp_path / "run"
    y = tmp_path / "trl.yaml"
    y.write_text(yaml.safe_dump({
        "model_name_or_path": llama, "dataset": str(data), "rewards": ["math"],
        "num_generations": 4, "per_device_train_batch_size": 8, "num_train_epochs": 2,
        "max_completion_length": 4, "warmup_steps": 0.5, "lr_scheduler_type": "linear",
        "learning_rate": 0.01, "output_dir": str(out), "save_steps": 3, "eval_size": 0,
        "use_peft": True, "bf16": False}))
    assert cli.main(["train", "--config", str(y), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "grpolab: 2 passes over 7 prompts, 3 steps of 2 a pass: 6 steps" in said
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    # transformers' linear schedule over 6 steps, 3 of warm-up from lr 0, then (6 - s) / 3
    assert [r["lr"] for r in steps] == pytest.approx([0.01 * k / 3 for k in (0, 1, 2, 3, 2, 1)])
    # the run's own config.json (passes, and the steps they made) reads back: eval, resume
    assert make_config(str(out / "config.json"), command="train").passes == 2
    earlier = json.loads((out / "config.json").read_text())  # (an earlier version's: a key
    earlier.pop("loss_norm_len")  # fewer)
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    assert make_config(str(tmp_path / "earlier.json"), command="train").passes == 2
    assert cli.main(["eval", "--config", str(out / "config.json"), "--no-progress",
                     "--model-path", str(out / "final"), "--out-dir", str(tmp_path / "ev"),
                     "--eval-size", "2"]) == 0
    assert "its trained model is" not in caplog.text
    assert "no eval_dataset: grpolab eval measures dataset's prompts" in caplog.text
    assert cli.main(["eval", "--config", str(out / "config.json"), "--no-progress",
                     "--out-dir", str(tmp_path / "ev0"), "--eval-size", "2"]) == 0
    assert f"the run started from; its trained model is {out / 'final'}" in caplog.text
    assert cli.main(["train", "--config", str(y), "--no-progress", "--resume",
                     "--steps", "8"]) == 0
    assert "at step 6 of 8" in capsys.readouterr().out


def test_verl_constant_warmup_reads_no_zero_indexed_step() -> None:
    """verl's constant schedule takes no zero_indexed_step: from lr 0 whatever it says."""
    f = verl_functions("get_constant_schedule_with_warmup")["get_constant_schedule_with_warmup"]
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    sched, theirs = f(opt, 3), []
    for _ in range(5):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    c = make_config(None, {VERL + "optim.lr": 1.0, VERL + "optim.lr_warmup_steps": 3,
                           VERL + "optim.zero_indexed_step": False,
                           "trainer.total_training_steps": 5}, "train")
    assert [lr_at(c, s) for s in range(5)] == pytest.approx(theirs)


def test_later_lengths_replace_earlier_ones() -> None:
    """A later --steps is the length verl's warm-up ratio reads, and test_freq -1 stays
    "before and after training" at any length; a later epoch count replaces a file's passes;
    TRL's num_train_epochs 0 (no step) is refused, not read as grpolab's unset 0."""
    f = {"trainer.total_training_steps": 25, VERL + "optim.lr_warmup_steps_ratio": 0.1,
         "trainer.test_freq": -1}
    c = make_config(f, {"steps": 50}, "train")
    assert (c.steps, c.warmup_steps, c.eval_every) == (50, 5, 10**9)
    c = make_config(f, {"passes": 2}, "train")  # (ratio x the steps the data gives, down)
    assert (c.warmup_steps, c.warmup_round) == (0.1, "down")
    assert make_config({"passes": 2}, {"num_train_epochs": 3}, "train").passes == 3
    assert make_config({"passes": 2}, {"trainer.total_epochs": 3}, "train").passes == 3
    assert make_config({"steps": 7}, {"num_train_epochs": 3}, "train").passes == 0  # (TRL:
    # max_steps wins over epochs)
    with pytest.raises(ConfigError, match="num_train_epochs: 0 .TRL. must be a number of ep"):
        make_config(None, {"num_train_epochs": 0}, "train")
    with pytest.raises(ConfigError, match="too many steps"):
        with_length(make_config(None, {"passes": 1e308}, "train"), 100)


def test_resume_sees_a_warmup_share_move() -> None:
    """A resume may change steps under a constant lr, unless a warm-up share makes the
    warm-up's length follow them; passes alone (steps unchanged) change nothing."""
    from grpolab.config import to_dict
    from grpolab.run.resume import changed_settings

    trl = {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 0.1,
           "num_generations": 8}
    a = make_config(None, {**trl, "max_steps": 100}, "train")
    b = make_config(None, {**trl, "max_steps": 200}, "train")
    assert changed_settings({"config": to_dict(a)}, b, [], None) == {"steps": (100, 200)}
    p = with_length(make_config(None, {"passes": 2, "budget": 16, "group_size": 4}, "train"), 8)
    q = make_config({"passes": 2, "budget": 16, "group_size": 4}, {"steps": 4}, "train")
    assert changed_settings({"config": to_dict(p)}, q, [], None) == {}


def test_api_takes_a_config_with_passes() -> None:
    """grpolab.train(config) with a Config that counts passes (it holds steps too)."""
    from grpolab.app.api import _config

    c = make_config(None, {"num_train_epochs": 2, "num_generations": 8}, "train")
    for given in (c, with_length(c, 100)):
        assert _config(given, {}, "train").passes == 2
    assert _config(c, {"steps": 5}, "train").passes == 0


def test_passes_show_each_prompt_once_a_pass_and_a_warmup_over_a_trl_file_is_trls() -> None:
    """With passes, prompts come in shuffled passes (TRL's and verl's order) unless an order is
    given; a warm-up given over a TRL file (a flag, an API keyword) is read as TRL's: a count
    of its optimiser steps, the first at lr 0."""
    assert make_config({"num_train_epochs": 2}, None, "train").prompt_order == "epochs"
    assert make_config(None, {"trainer.total_epochs": 2}, "train").prompt_order == "epochs"
    assert make_config({"passes": 2, "prompt_order": "random"}, None,
                       "train").prompt_order == "random"
    assert make_config({"num_train_epochs": 2}, {"shuffle_dataset": False},
                       "train").prompt_order == "sequential"
    assert make_config({"steps": 4}, None, "train").prompt_order == "random"  # (grpolab's)
    trl = {"max_steps": 40, "num_iterations": 2, "num_generations": 8}
    for later, warm in (({"warmup_ratio": 0.1}, 4), ({"warmup_steps": 8}, 8)):
        c = make_config(trl, later, "train")
        assert (schedule_length(c), c.warmup_from_zero) == ((2, 40, warm), True)
    c = make_config({"steps": 10}, {"warmup_steps": 8}, "train")  # (grpolab's own: batches)
    assert (schedule_length(c), c.warmup_from_zero) == ((1, 10, 8), False)


def test_extending_a_trl_or_verl_epoch_run_keeps_its_order(tmp_path) -> None:
    """TRL's and verl's epochs come in shuffled passes; a later --steps (extending the run on
    resume) keeps that order, and the defaults warning does not name it as grpolab's own.
    TRL's negative epochs are refused in TRL's words."""
    from grpolab.config.trl import unset_defaults

    trl = {"num_train_epochs": 2, "num_generations": 8}
    for later in (None, {"steps": 8}):
        c = make_config(trl, later, "train")
        assert c.prompt_order == "epochs"
        assert not [x for x in unset_defaults(set(trl), c) if x.startswith("prompt_order")]
    assert make_config({"trainer.total_epochs": 2}, {"steps": 8}, "train").prompt_order == \
        "epochs"
    assert make_config({"trainer.total_epochs": 2, "data.shuffle": False}, None,
                       "train").prompt_order == "sequential"
    with pytest.raises(ConfigError, match="num_train_epochs: -2 .TRL. must be a number"):
        make_config(None, {"num_train_epochs": -2}, "train")
