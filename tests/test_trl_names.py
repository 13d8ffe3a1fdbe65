"""TRL's GRPOConfig names and values translate line for line into grpolab's config; the
conflicts are one line. (That the names are TRL's fields, and that the loss types give TRL's
loss: test_objectives_trl.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from grpolab.config import ConfigError, make_config
from grpolab.config import trl as trl_names


@pytest.fixture(autouse=True)
def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's batch counts torchrun's processes (WORLD_SIZE): one, unless a test says."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_trl_config_translates_line_for_line(tmp_path) -> None:
    y = tmp_path / "trl.yaml"
    y.write_text("num_generations: 4\nnum_iterations: 2\nepsilon: 0.1\nepsilon_high: 0.3\n"
                 "beta: 0.02\nloss_type: dr_grpo\nscale_rewards: batch\n"
                 "importance_sampling_level: sequence\nuse_bias_correction_kl: true\n"
                 "delta: 3.0\nmask_truncated_completions: true\ntop_entropy_quantile: 0.2\n"
                 "entropy_coef: 0.01\nmulti_objective_aggregation: normalize_then_sum\n"
                 "max_completion_length: 16\nlearning_rate: 1.0e-5\nmax_grad_norm: 0.5\n")
    c = make_config(y)
    assert (c.group_size, c.epochs, c.eps_low, c.eps_high, c.beta) == (4, 2, 0.1, 0.3, 0.02)
    # normalize_then_sum: TRL scales each reward over its group, whatever scale_rewards says
    assert (c.loss_agg, c.scale, c.policy_loss) == ("seq_mean_token_sum_norm", "std", "gspo")
    assert (c.std, c.std_eps) == ("sample", 1e-4)
    assert c.kl_is_correction and c.dual_clip == 3.0 and c.mask_truncated
    assert (c.top_entropy_quantile, c.entropy_coef) == (0.2, 0.01)
    assert c.reward_aggregation == "normalize_then_sum"
    assert (c.max_new_tokens, c.lr, c.grad_clip) == (16, 1e-5, 0.5)


@pytest.mark.parametrize(("trl_keys", "want"), [
    ({"loss_type": "grpo"}, {"loss_agg": "seq_mean_token_mean"}),
    ({"loss_type": "bnpo"}, {"loss_agg": "token_mean"}),
    ({"loss_type": "dapo"}, {"loss_agg": "token_mean"}),
    ({"loss_type": "cispo", "epsilon_high": 4.0},
     {"policy_loss": "cispo", "loss_agg": "token_mean", "cispo_max": 4.0, "eps_high": 0.2}),
    # TRL's cap is epsilon_high, unset = epsilon (0.2 by default)
    ({"loss_type": "cispo"}, {"policy_loss": "cispo", "cispo_max": 0.2}),
    ({"loss_type": "cispo", "epsilon": 0.3}, {"cispo_max": 0.3}),
    ({"epsilon": 0.1}, {"eps_low": 0.1, "eps_high": 0.1}),  # TRL: epsilon_high = epsilon
    ({"epsilon": 0.1, "epsilon_high": None}, {"eps_low": 0.1, "eps_high": 0.1}),
    ({"scale_rewards": True}, {"scale": "std", "std": "sample", "std_eps": 1e-4}),
    ({"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "none"},
     {"reward_aggregation": "normalize_then_sum", "scale": "std", "std": "sample"}),
    ({"scale_rewards": False}, {"scale": "none"}),
    ({"delta": None}, {"dual_clip": 0.0}),
    ({"num_generations": 8, "group_size": 8}, {"group_size": 8}),  # agreeing is fine
])
def test_trl_values(trl_keys: dict, want: dict) -> None:
    c = make_config(None, trl_keys)
    assert {k: getattr(c, k) for k in want} == want


@pytest.mark.parametrize(("trl_keys", "message"), [
    ({"num_generations": 4, "group_size": 8}, "num_generations: 4 .TRL. sets group_size"),
    ({"loss_type": "dapo", "loss_agg": "seq_mean_token_mean"}, "loss_type: 'dapo'"),
    ({"loss_type": "luspo_v2"}, "'luspo_v2' .TRL. has no grpolab equivalent"),
    ({"loss_type": "sapo", "importance_sampling_level": "sequence", "ratio_level": "token"},
     "importance_sampling_level: 'sequence' .TRL. sets ratio_level"),
    ({"loss_type": "grpo", "importance_sampling_level": "sequence", "policy_loss": "clip"},
     "importance_sampling_level: 'sequence' .TRL. sets policy_loss"),
])
def test_trl_conflicts_are_one_line(trl_keys: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        make_config(None, trl_keys)
    assert "\n" not in str(e.value)


def test_trl_training_arguments_translate(tmp_path, monkeypatch, caplog) -> None:
    """A TRL GRPO YAML as people write them (TrainingArguments and ModelConfig names beside
    GRPOConfig's) loads: batch, precision, saving, evaluation, model and LoRA translated, the
    logging and Hub settings left aside with one notice naming them."""
    y = tmp_path / "trl.yaml"
    y.write_text("model_name_or_path: runs/tiny\nuse_peft: true\nlora_r: 16\nbf16: true\n"
                 "per_device_train_batch_size: 8\ngradient_accumulation_steps: 4\n"
                 "num_generations: 8\nmax_steps: 100\nnum_train_epochs: 1\n"
                 "save_strategy: steps\nsave_steps: 25\neval_strategy: steps\n"
                 "eval_steps: 20\nlogging_steps: 1\nlog_completions: true\n"
                 "push_to_hub: false\nreport_to: none\noptim: adamw_torch\n"
                 "weight_decay: 0.0\ntop_p: 1.0\nuse_vllm: false\nseed: 42\n")
    with caplog.at_level("WARNING", logger="grpolab"):
        c = make_config(y, None, "train")
    assert (c.model_path, c.lora, c.lora_r, c.dtype) == ("runs/tiny", True, 16, "bfloat16")
    # TRL: 8 per device x 4 accumulated = 32 answers an optimiser step, 8 rows a backward
    assert (c.budget, c.micro_batch, c.group_size, c.steps) == (32, 8, 8, 100)
    assert (c.checkpoint_every, c.eval_every, c.seed) == (25, 20, 42)
    notes = [r.getMessage() for r in caplog.records if "left aside" in r.getMessage()]
    assert len(notes) == 1
    assert notes[0].endswith("log_completions, logging_steps, push_to_hub")
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun's processes each take 8 x 4
    assert make_config(y, None, "train").budget == 128


@pytest.mark.parametrize(("trl_keys", "want"), [
    ({"fp16": True}, {"dtype": "float16"}),
    ({"bf16": False, "fp16": False}, {"dtype": "float32"}),
    ({"use_peft": False}, {"lora": False}),
    ({"use_vllm": True, "vllm_importance_sampling_correction": False},
     {"rollout_backend": "vllm"}),
    ({"save_strategy": "no"}, {"checkpoint_every": 0, "save_model_every": 0}),
    ({"eval_strategy": "no"}, {"eval_size": 0}),
    ({"disable_tqdm": True}, {"progress": False}),
    ({"disable_dropout": True, "use_peft": True}, {"lora_dropout": 0.0, "lora": True}),
    ({"gradient_accumulation_steps": 2}, {"budget": 16, "micro_batch": 8}),  # TRL's 8 each
    ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4,
      "steps_per_generation": 4}, {"budget": 16}),
    ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4,
      "generation_batch_size": 16}, {"budget": 16}),
    # a generation batch for several optimiser steps: each takes a random share (TRL's buffer)
    ({"steps_per_generation": 4}, {"budget": 32, "minibatches": 4, "micro_batch": 8,
                                   "minibatch_order": "shuffled"}),
    ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
      "generation_batch_size": 32, "num_iterations": 2, "max_steps": 40, "warmup_steps": 8},
     {"budget": 32, "minibatches": 4, "epochs": 2, "steps": 5, "warmup_steps": 1}),
    ({"max_steps": 7, "num_train_epochs": 3}, {"steps": 7, "passes": 0.0}),  # max_steps wins
    # epochs: passes over the data, counted when it is read (TRL's default 3)
    ({"num_train_epochs": 2}, {"passes": 2.0}), ({"max_steps": -1}, {"passes": 3.0}),
    ({"num_train_epochs": 0.5, "max_steps": -1}, {"passes": 0.5}),
    ({"save_strategy": "no", "save_steps": 500},  # TRL ignores it: no checkpoint-N folders
     {"checkpoint_every": 0, "save_model_every": 0}),
    # TRL's save_steps writes checkpoint-N model folders: grpolab's model folders and its
    # checkpoints both; save_total_limit is grpolab's key too (TRL's null: all kept)
    ({"save_steps": 2, "save_total_limit": 1},
     {"checkpoint_every": 2, "save_model_every": 2, "save_total_limit": 1}),
    ({"save_steps": 5, "save_total_limit": None}, {"save_model_every": 5, "save_total_limit": 0}),
    ({"eval_strategy": "no", "eval_steps": 5}, {"eval_size": 0}),
    # transformers: eval_steps unset = logging_steps
    ({"eval_strategy": "steps", "logging_steps": 5}, {"eval_every": 5}),
    ({"eval_strategy": "steps", "logging_steps": 5, "eval_steps": 4}, {"eval_every": 4}),
    # TRL counts optimiser steps, num_iterations of them per sampled batch; grpolab batches
    ({"num_iterations": 2, "max_steps": 10, "save_steps": 4, "eval_steps": 2},
     {"epochs": 2, "steps": 5, "checkpoint_every": 2, "save_model_every": 2, "eval_every": 1}),
    ({"scale_rewards": "group"}, {"scale": "std", "std": "sample", "std_eps": 1e-4}),
    ({"scale_rewards": "batch"}, {"scale": "batch", "std": "sample", "std_eps": 1e-4}),
    ({"loss_type": "bnpo"}, {"loss_agg": "token_mean"}),  # one micro-batch: exact
    ({"bf16": True, "use_peft": True}, {"dtype": "bfloat16", "lora": True}),
    ({"bf16": None, "fp16": True, "use_peft": True}, {"dtype": "float16"}),
    ({"use_vllm": False, "vllm_mode": "server"}, {"rollout_backend": "hf"}),
    ({"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 3},
     {"lr_schedule": "constant", "warmup_steps": 3}),
    ({"num_iterations": 2, "max_steps": 10, "warmup_steps": 4}, {"steps": 5, "warmup_steps": 2}),
    # below 1, a share of the run (test_trl_warmup_is_transformers), from lr 0 as TRL's
    ({"max_steps": 50, "warmup_steps": 0.05, "num_generations": 8},
     {"warmup_steps": 0.05, "warmup_from_zero": True}),
    ({"num_generations": 8, "warmup_steps": 0.1}, {"warmup_steps": 0.1}),
    # eval_steps unset: logging_steps, 10 optimiser steps by default = 5 sampled batches
    ({"eval_strategy": "steps", "num_iterations": 2, "max_steps": 10}, {"eval_every": 5}),
    ({"max_steps": "1e1"}, {"steps": 10}),  # (PyYAML's reading of 1e1)
    ({"output_dir": "1e1", "model_name_or_path": "007"}, {"out_dir": "1e1", "model_path": "007"}),
    ({"push_to_hub": "false"}, {"steps": 40}),
    ({"use_vllm": True, "vllm_importance_sampling_correction": "false"},
     {"rollout_backend": "vllm"}),
    # `trl grpo`'s reward functions: its registry names and dotted paths; a reward model first
    ({"reward_funcs": ["accuracy_reward", "think_format_reward"]},
     {"rewards": ["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward"]}),
    ({"reward_funcs": ["my_lib.rewards.custom"], "reward_model_name_or_path": "runs/rm"},
     {"rewards": ["rm:runs/rm", "my_lib.rewards:custom"]}),
    # ModelConfig's dtype bfloat16 loads bfloat16 weights: grpolab's full fine-tuning too
    ({"bf16": True, "use_peft": False, "dtype": "bfloat16"}, {"dtype": "bfloat16", "lora": False}),
    # grpolab's own vLLM switch beside a TRL name: TRL's correction default does not apply
    ({"rollout_backend": "vllm", "num_generations": 8}, {"rollout_backend": "vllm"}),
    # TRL's sampling settings are grpolab's own; min_p's null is off; generation_kwargs win
    ({"top_p": 0.9, "top_k": 50, "min_p": 0.1, "repetition_penalty": 1.1, "num_generations": 8},
     {"top_p": 0.9, "top_k": 50, "min_p": 0.1, "repetition_penalty": 1.1}),
    ({"top_p": 0.9, "temperature": 0.7,
      "generation_kwargs": {"top_p": 0.95, "min_p": 0.05, "temperature": 0.7}},
     {"top_p": 0.95, "min_p": 0.05, "temperature": 0.7, "top_k": 0}),
    ({"generation_kwargs": '{"top_k": 20}'}, {"top_k": 20}),  # TRL's JSON text
    # TRL's entropy bonus is a token mean whatever loss_type says; Skywork-OR1's controller
    ({"loss_type": "grpo", "entropy_coef": 0.01}, {"entropy_agg": "token_mean"}),
    ({"use_adaptive_entropy": True, "entropy_target": 2.0, "num_generations": 8},
     {"use_adaptive_entropy": True, "entropy_target": 2.0, "entropy_agg": "token_mean"}),
    ({"entropy_coef": 0.01}, {"entropy_agg": "loss"}),  # grpolab's own keys only: verl's
    # open-r1's schedule: transformers' cosine_with_min_lr, its floor a share of the lr
    ({"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
     {"lr_schedule": "cosine", "min_lr_rate": 0.1}),
    ({"lr_scheduler_type": "cosine_with_min_lr", "learning_rate": 2e-5,
      "lr_scheduler_kwargs": '{"min_lr": 5e-6}'}, {"min_lr": 5e-6, "min_lr_rate": 0.0}),
    ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": 0.5}},
     {"lr_schedule": "cosine", "min_lr_rate": 0.0}),
    # earlier TRL / transformers names
    ({"torch_dtype": "bfloat16", "max_prompt_length": 256, "num_generations": 8},
     {"dtype": "bfloat16", "max_prompt_tokens": 256}),
    ({"warmup_ratio": 0.1, "max_steps": 50, "num_generations": 8}, {"warmup_steps": 0.1}),
    # intervals below 1: a share of max_steps (test_trl_interval_shares_are_transformers)
    ({"save_steps": 0.1, "max_steps": 100, "num_iterations": 2, "num_generations": 8},
     {"checkpoint_every": 5, "save_model_every": 5}),
    # the script's registry entry: DAPO's soft overlong punishment at 1280 tokens, 256 soft
    ({"reward_funcs": ["get_soft_overlong_punishment"]}, {"rewards": ["overlong:1280:256"]}),
    # (an override of None is unset: the default, as for any key)
    ({"max_prompt_length": None, "overwrite_output_dir": True, "num_generations": 8},
     {"max_prompt_tokens": 1024}),
    ({"weight_decay": 0.1, "adam_beta2": 0.99, "adam_epsilon": 1e-6, "optim": "adamw_torch"},
     {"weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.99, "adam_epsilon": 1e-6}),
    # a share of the run: grpolab's 40 steps where TRL's length is not given (warned of)
    ({"save_steps": 0.5}, {"checkpoint_every": 0.5, "save_model_every": 0.5}),
    # each epoch's end (counted once the data is read); save_steps left aside, as TRL does
    ({"save_strategy": "epoch", "save_steps": 5}, {"save_each_pass": True,
                                                   "checkpoint_every": 10}),
    ({"eval_strategy": "epoch", "eval_steps": 5}, {"eval_each_pass": True, "eval_every": 10}),
    # TRL's script: load_dataset(dataset_name, dataset_config)[split], the test split held
    # out when it evaluates (a Hub id: read from the local cache, grpolab.data.hub)
    ({"dataset_name": "trl-lib/DeepMath-103K"}, {"dataset": "trl-lib/DeepMath-103K",
                                                 "eval_dataset": ""}),
    ({"dataset_name": "openai/gsm8k", "dataset_config": "main", "eval_strategy": "steps"},
     {"dataset": "openai/gsm8k:main", "eval_dataset": "openai/gsm8k:main"}),
    ({"dataset_name": "o/d", "dataset_train_split": "tr", "dataset_test_split": "dev",
      "eval_strategy": "epoch"}, {"dataset": "o/d::tr", "eval_dataset": "o/d::dev"}),
    ({"dataset_name": "o/d", "dataset": "m.jsonl"}, {"dataset": "m.jsonl"}),  # (aside)
    # TRL's dataset mixture of one dataset: its script's dataset_name keys; nothing held out
    ({"datasets": [{"path": "o/d", "name": "main", "split": "dev", "columns": ["q"]}],
      "eval_strategy": "steps", "streaming": False},
     {"dataset": "o/d:main:dev", "eval_dataset": ""}),
    ({"datasets": [{"path": "json", "data_files": "m.jsonl", "fraction": 1.0}],
      "test_split_size": None}, {"dataset": "m.jsonl"}),
    ({"datasets": [{"path": "o/d"}], "dataset_name": "o/e"}, {"dataset": "o/d"}),  # (TRL's)
    # a string that names no registry entry but has an owner is a reward model (GRPOTrainer's)
    ({"reward_funcs": ["org/rm-0.6B", "accuracy_reward"]},
     {"rewards": ["rm:org/rm-0.6B", "trl.rewards:accuracy_reward"]}),
])
def test_trl_training_values(trl_keys: dict, want: dict) -> None:
    c = make_config(None, trl_keys, "train")
    assert {k: getattr(c, k) for k in want} == want


@pytest.mark.parametrize(("trl_keys", "message"), [
    ({"generation_kwargs": {"num_beams": 4, "top_p": 0.9}}, "generation_kwargs: num_beams .TRL"),
    ({"generation_kwargs": "[1, 2]"}, "generation_kwargs .TRL. must be a mapping"),
    ({"generation_kwargs": {"top_p": 1.5}}, "top_p in .0, 1.,"),
    ({"generation_kwargs": {"temperature": 0.7}}, "samples at another temperature than the"),
    ({"lr_scheduler_type": "cosine_with_min_lr"}, "needs one of lr_scheduler_kwargs' min_lr_rat"),
    ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": 1.0}},
     "lr_scheduler_kwargs: num_cycles for lr_scheduler_type cosine"),
    ({"lr_scheduler_type": "linear", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
     "lr_scheduler_kwargs: min_lr_rate for lr_scheduler_type linear"),
    ({"torch_dtype": "bfloat16", "dtype": "float32"}, "torch_dtype .an earlier TRL name of dtype"),
    ({"generation_kwargs": {"top_k": None}}, "generation_kwargs: top_k null"),
    ({"optim": "adafactor"}, "optim: 'adafactor' .TRL. has no grpolab equivalent"),
    ({"save_steps": 0.1, "num_train_epochs": 2, "num_iterations": 2, "num_generations": 8},
     "with epochs and 2 optimiser steps a sampled batch: give a count"),
    ({"steps_per_generation": 3, "gradient_accumulation_steps": 2},
     "steps_per_generation 3 .TRL. is not a multiple of gradient_accumulation_steps 2"),
    ({"per_device_train_batch_size": 4, "generation_batch_size": 6},
     "generation_batch_size 6 .TRL. must be a multiple of per_device_train_batch_size 4"),
    ({"steps_per_generation": 2, "max_steps": 5}, "max_steps: 5 .TRL. counts optimiser steps, 2"),
    ({"per_device_train_batch_size": 6, "steps_per_generation": 2},
     "x 2 optimiser steps a generation = 12 answers"),
    ({"steps_per_generation": 1, "generation_batch_size": 8}, "set one or neither"),
    ({"per_device_train_batch_size": 4, "budget": 64}, "sets budget to 4, but budget"),
    ({"bf16": True, "dtype": "float32"}, "bf16: True .TRL. sets dtype"),
    ({"push_to_hub": True}, "does not upload"),
    ({"num_iterations": 2, "max_steps": 9}, "max_steps: 9 .TRL. counts optimiser steps, 2 per"),
    ({"loss_type": "bnpo", "gradient_accumulation_steps": 2}, "use loss_type: dapo"),
    ({"bf16": True, "use_peft": False}, "bf16 .TRL. with full fine-tuning"),
    ({"fp16": True, "lora": False}, "fp16 .TRL. with full fine-tuning"),
    ({"model_revision": "v2"}, "model_revision: 'v2' .TRL. picks a Hub model's revision"),
    ({"gradient_accumulation_steps": 1.5}, "must be a whole number"),
    ({"lr_scheduler_type": "constant", "warmup_steps": 3}, "use constant_with_warmup"),
    ({"reward_funcs": ["accuracy_reward"], "rewards": ["math"]}, "sets rewards to"),
    ({"dataset_name": ".", "dataset_config": "main"}, "'.' is a local folder: its splits"),
    ({"datasets": [{"path": "o/d"}, {"path": "o/e"}]}, "lists 2 datasets: grpolab trains on one"),
    ({"datasets": [{"path": "o/d"}], "test_split_size": 0.1}, "give them as eval_dataset"),
    ({"datasets": [{"path": "o/d", "revision": "x"}]}, "an entry takes path .required."),
    ({"datasets": [{"path": "o/d", "data_files": "a.jsonl"}]}, "path json, csv or parquet"),
    ({"datasets": "o/d"}, "a list of entries"),
    ({"datasets": [{"path": "o/d", "data_dir": "math"}]}, "data_dir of 'o/d', no local folder"),
    ({"model_name_or_path": "./local", "model_revision": "v2"}, "'./local' is no Hub id"),
    ({"model_path": "o/m@v2", "model_revision": "v3"}, "name two revisions; keep one"),
    ({"save_steps": 2, "save_model_every": 3}, "save_steps: 2 .TRL. sets save_model_every to 2"),
    ({"num_iterations": 2, "save_steps": 3}, "save_steps: 3 .TRL. counts optimiser steps"),
    ({"save_steps": 2.5}, "save_steps: 2.5 .TRL. must be a count of optimiser steps, or below"),
    ({"eval_steps": -0.5, "eval_strategy": "steps"}, "eval_steps: -0.5 .TRL. must be a count"),
    ({"use_vllm": True, "vllm_importance_sampling_correction": False, "vllm_mode": "server"},
     "vllm_mode: 'server'"),
    ({"use_vllm": True}, "vllm_importance_sampling_correction: True .TRL. has no grpolab"),
    ({"rollout_backend": "vllm", "vllm_mode": "server"}, "vllm_mode: 'server'"),
    ({"disable_dropout": False}, "disable_dropout: False .TRL. has no grpolab equivalent"),
])
def test_trl_training_refusals_are_one_line(trl_keys: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        make_config(None, trl_keys, "train")
    assert "\n" not in str(e.value)


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def _vllm_as_if_installed(monkeypatch) -> None:
    """The translation of TRL's vLLM keys, as on a machine with vLLM (none is here)."""
    monkeypatch.setattr(trl_names, "vllm_installed", lambda: True)


def test_use_vllm_without_vllm_says_so_first(monkeypatch) -> None:
    """On a machine without vLLM, use_vllm: true is refused for that, before its settings."""
    monkeypatch.setattr(trl_names, "vllm_installed", lambda: False)
    with pytest.raises(ConfigError, match="use_vllm: true .TRL. needs the vllm package"):
        make_config(None, {"use_vllm": True, "num_generations": 8}, "train")


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_example_configs_load(name: str) -> None:
    make_config(EXAMPLES / name, None, "train")


def test_trl_named_example_is_hf_tiny() -> None:
    """examples/trl_tiny.yaml, in TRL's names, is examples/hf_tiny.yaml's run: the same
    settings but the folder and the backward's rows (the same step, to float rounding)."""
    from grpolab.rewards.builtin import THINK_ANSWER_PATTERN

    ours = dataclasses.asdict(make_config(EXAMPLES / "hf_tiny.yaml", None, "train"))
    trl = dataclasses.asdict(make_config(EXAMPLES / "trl_tiny.yaml", None, "train"))
    trl["format_pattern"] = trl["format_pattern"] or THINK_ANSWER_PATTERN  # "" = the default
    trl["report_to"] = [n for n in trl["report_to"] if n != "none"]
    differ = {k: (ours[k], trl[k]) for k in ours if ours[k] != trl[k]}
    assert differ == {"out_dir": ("runs/hf-tiny", "runs/trl-tiny"), "micro_batch": (0, 8)}


def test_trl_yaml_numbers_and_later_keys(tmp_path, caplog) -> None:
    """PyYAML reads 1e-8 (no dot) as a string: TRL's default still loads. A step count given
    on the command line replaces a YAML's epochs. The logging_steps that set the
    evaluation's interval is not in the notice of settings left aside."""
    y = tmp_path / "trl.yaml"
    y.write_text("adam_epsilon: 1e-8\nnum_train_epochs: 2\neval_strategy: steps\n"
                 "logging_steps: 3\nattn_implementation: sdpa\n")
    assert make_config(y, None, "train").passes == 2.0
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpolab"):
        c = make_config(y, {"steps": 6}, "train")  # (a later step count replaces the epochs)
    assert (c.steps, c.passes, c.eval_every) == (6, 0.0, 3)
    assert [r.getMessage().rsplit(": ", 1)[1] for r in caplog.records
            if "left aside" in r.getMessage()] == ["attn_implementation"]
    y.write_text("top_k: null\n")  # unset: generate's own default, 50
    with pytest.raises(ConfigError, match="top_k: null .TRL. leaves it to the model's"):
        make_config(y, None, "train")
    y.write_text("min_p: null\nnum_generations: 8\n")  # unset: no min-p filter
    assert make_config(y, None, "train").min_p == 0.0


@pytest.mark.parametrize(("text", "message"), [
    ("max_completion_length: null\n", "max_completion_length: null .TRL's unset."),  # no cap
    ("use_peft: null\n", "use_peft: null"),
    ("scale_rewards: null\n", "scale_rewards: None .TRL. has no grpolab equivalent"),
])
def test_trl_unset_values_are_refused(tmp_path, text: str, message: str) -> None:
    y = tmp_path / "trl.yaml"
    y.write_text(text)
    with pytest.raises(ConfigError, match=message):
        make_config(y, None, "train")


def test_trl_refusals_see_the_command_line(tmp_path, monkeypatch, caplog) -> None:
    """bf16 in the file and full fine-tuning on the command line is TRL's float32 training,
    refused; bnpo over several processes too; unused vLLM settings are named aside."""
    y = tmp_path / "trl.yaml"
    y.write_text("bf16: true\n")
    with pytest.raises(ConfigError, match="bf16 .TRL. with full fine-tuning"):
        make_config(y, {"lora": False}, "train")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="use loss_type: dapo"):
        make_config(None, {"loss_type": "bnpo"}, "train")
    monkeypatch.delenv("WORLD_SIZE")
    with caplog.at_level("WARNING", logger="grpolab"):
        make_config(None, {"use_vllm": False, "vllm_mode": "server"}, "train")
    assert [r.getMessage() for r in caplog.records if "left aside" in r.getMessage()
            ][-1].endswith(": vllm_mode")


@pytest.mark.parametrize(("text", "later", "want"), [
    # TRL's batch is the product of per-device rows and accumulation, wherever each is given
    ("per_device_train_batch_size: 4\n", {"gradient_accumulation_steps": 2},
     {"budget": 8, "micro_batch": 4}),
    ("gradient_accumulation_steps: 2\n", {"per_device_train_batch_size": 4},
     {"budget": 8, "micro_batch": 4}),
    # optimiser steps over num_iterations, from the file or the call
    ("max_steps: 100\nsave_steps: 20\n", {"num_iterations": 2},
     {"steps": 50, "checkpoint_every": 10, "save_model_every": 10, "epochs": 2}),
    ("save_steps: 20\n", {"save_model_every": 0}, {"checkpoint_every": 20, "save_model_every": 0}),
    ("num_iterations: 2\n", {"max_steps": 100}, {"steps": 50, "epochs": 2}),
    ("warmup_steps: 0.1\nmax_steps: 100\n", {"max_steps": 200}, {"warmup_steps": 0.1, "steps": 200}),
    ("loss_type: cispo\n", {"epsilon_high": 5.0}, {"policy_loss": "cispo", "cispo_max": 5.0}),
    ("epsilon_high: 5.0\n", {"loss_type": "cispo"}, {"policy_loss": "cispo", "cispo_max": 5.0}),
    ("reward_funcs: [accuracy_reward]\n", {"reward_model_name_or_path": "runs/rm"},
     {"rewards": ["rm:runs/rm", "trl.rewards:accuracy_reward"]}),
    # the call overrides the file, in either naming, without a conflict
    ("num_generations: 4\ngroup_size: 4\n", {"num_generations": 8}, {"group_size": 8}),
    ("group_size: 4\n", {"num_generations": 8}, {"group_size": 8}),
    ("num_generations: 4\n", {"group_size": 8}, {"group_size": 8}),
    ("bf16: true\nuse_peft: false\ndtype: float32\n", {"bf16": False}, {"dtype": "float32"}),
    # TRL's script's dataset given later replaces a file's dataset; given earlier, it does not
    ("dataset: m.jsonl\neval_strategy: steps\n", {"dataset_name": "o/d", "dataset_config": "c"},
     {"dataset": "o/d:c", "eval_dataset": "o/d:c"}),
    ("dataset_name: o/d\n", {"dataset": "m.jsonl"}, {"dataset": "m.jsonl"}),
    ("dataset_name: o/d\n", {"dataset_config": "c"}, {"dataset": "o/d:c"}),
])
def test_trl_keys_combine_across_file_and_call(tmp_path, text: str, later: dict,
                                               want: dict) -> None:
    """The Python API's keywords and a TRL YAML (or a dict in its place, as grpolab.train
    takes) are read together, as TRL reads one config."""
    y = tmp_path / "trl.yaml"
    y.write_text(text)
    for base in (y, yaml.safe_load(text)):
        c = make_config(base, later, "train")
        assert {k: getattr(c, k) for k in want} == want


def test_trl_refusals_read_file_and_call_together(tmp_path) -> None:
    """A file's use_peft: true overridden by the call's lora: false is full fine-tuning: with
    the file's bf16 it is refused, as TRL would train float32 weights under autocast."""
    y = tmp_path / "trl.yaml"
    y.write_text("bf16: true\nuse_peft: true\n")
    with pytest.raises(ConfigError, match="bf16 .TRL. with full fine-tuning"):
        make_config(y, {"lora": False}, "train")
    assert make_config(y, {"use_peft": False, "dtype": "bfloat16"}, "train").dtype == "bfloat16"


def grpolab_defaults_note(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "grpolab's defaults" in r.getMessage()]


def test_trl_config_names_grpolab_defaults_it_runs_on(tmp_path, caplog) -> None:
    """A TRL config runs on grpolab train's defaults for the keys it leaves out: one warning
    names each that is not TRL's, with both values; the keys the file or the call set, in
    either naming, are not named, and LoRA's r, alpha and dropout only with LoRA on."""
    y = tmp_path / "trl.yaml"
    y.write_text("num_generations: 8\nmax_steps: 10\n")
    with caplog.at_level("WARNING", logger="grpolab"):
        make_config(y, None, "train")
    assert grpolab_defaults_note(caplog) == [
        ("this TRL config leaves these at grpolab's defaults, not TRL's: beta 0.04 (TRL 0.0), "
        "loss_agg seq_mean_token_mean (TRL's loss_type dapo), kl_is_correction false (TRL's "
        "use_bias_correction_kl true), std population + std_eps 0.0 (TRL's scale_rewards: the "
        "sample std + 1e-4), budget 64 (TRL's per_device_train_batch_size 8 x "
        "gradient_accumulation_steps 1), micro_batch 0 (TRL's per_device_train_batch_size 8), "
        "lora true (TRL's use_peft false), lora_r 8 (TRL 16), lora_alpha 16 (TRL 32), "
        "lora_dropout 0.0 (TRL 0.05), lr 1e-05 (TRL's learning_rate 1e-06), lr_schedule "
        "constant (TRL's lr_scheduler_type linear), max_new_tokens 256 (TRL's "
        "max_completion_length 512), gradient_checkpointing false (TRL true), checkpoint_every "
        "10, save_model_every 0 (TRL's save_steps 500, for both), seed 0 (TRL 42), "
        "prompt_order random (TRL's shuffled passes, shuffle_dataset true), "
        "dtype float32 (TRL's bf16 autocast), the model's dropout off (TRL's disable_dropout "
        "false), max_prompt_tokens 1024 (TRL: whole prompts), use_chat_template true (TRL's: "
        "text prompts as written, chat prompts in the template (use_chat_template false))")]
    caplog.clear()  # (with data held out, grpolab evaluates it where TRL would not)
    make_config(y, {"eval_dataset": "held.jsonl"}, "train")
    assert "eval_every 10 (TRL's eval_strategy no)" in grpolab_defaults_note(caplog)[0]
    caplog.clear()
    y.write_text("num_generations: 8\nmax_steps: 10\nuse_peft: false\nbf16: false\n"
                 "per_device_train_batch_size: 8\nloss_type: grpo\nscale_rewards: group\n"
                 "learning_rate: 1.0e-6\ngradient_checkpointing: true\nsave_steps: 500\n"
                 "eval_strategy: 'no'\nmax_completion_length: 512\n")
    with caplog.at_level("WARNING", logger="grpolab"):
        make_config(y, {"beta": 0.0, "kl_is_correction": True, "lr_schedule": "linear",
                        "seed": 42, "disable_dropout": True}, "train")
    assert grpolab_defaults_note(caplog) == [
        ("this TRL config leaves these at grpolab's defaults, not TRL's: prompt_order random "
        "(TRL's shuffled passes, shuffle_dataset true), max_prompt_tokens 1024 (TRL: whole "
        "prompts), use_chat_template true (TRL's: text prompts as written, chat prompts in the "
        "template (use_chat_template false))")]
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpolab"):  # grpolab's names; the workshop
        make_config(None, {"group_size": 8}, "train")
        make_config(None, {"num_generations": 8}, "workshop")
    assert grpolab_defaults_note(caplog) == []


@pytest.mark.parametrize(("command", "keys", "hint"), [
    ("train", {"bogus_setting": 1}, "(grpolab train --help lists them)"),
    ("eval", {"bogus_setting": 1}, "(grpolab eval --help lists them)"),
    ("workshop", {"bogus_setting": 1}, "(grpolab workshop --help lists them)"),
    ("train", {"num_generation": 8}, "(did you mean 'num_generations'?)"),  # TRL's names too
    ("train", {"per_device_train_batchsize": 8}, "(did you mean 'per_device_train_batch_size'?)"),
    ("train", {"group_sise": 8}, "(did you mean 'group_size'?)"),
])
def test_unknown_key_hint(tmp_path, command: str, keys: dict, hint: str) -> None:
    """An unknown key names the help of the command in use, or the closest key, grpolab's or
    TRL's, in the file or in the call."""
    (key, value), = keys.items()
    y = tmp_path / "run.yaml"
    y.write_text(f"{key}: {value}\n")
    for base, later in ((y, None), (None, keys)):
        with pytest.raises(ConfigError) as e:
            make_config(base, later, command)
        assert str(e.value).endswith(f"unknown config key {key!r} {hint}")


def test_overridden_rewards_drop_the_files_weights(tmp_path, caplog) -> None:
    """Rewards given by the call without weights replace the file's rewards and weights: the
    file's weights paired with its own rewards (one line says they are dropped)."""
    y = tmp_path / "run.yaml"
    y.write_text("rewards: [math, format]\nreward_weights: [1.0, 0.2]\n")
    with caplog.at_level("WARNING", logger="grpolab"):
        c = make_config(y, {"rewards": "exact"}, "train")
    assert (c.rewards, c.reward_weights) == (["exact"], [])
    assert [r.getMessage() for r in caplog.records] == [
        ("the overrides' rewards replace the config's, so its reward_weights [1.0, 0.2] are "
        "dropped (each reward weighs 1)")]
    # weights given with them, or the file's own rewards again: the weights stand
    c = make_config(y, {"rewards": "exact,format", "reward_weights": "2,1"}, "train")
    assert (c.rewards, c.reward_weights) == (["exact", "format"], [2.0, 1.0])
    c = make_config(y, {"rewards": ["math", "format"]}, "train")
    assert c.reward_weights == [1.0, 0.2]
    # TRL's reward_funcs in the call replace them too
    c = make_config(y, {"reward_funcs": ["accuracy_reward"]}, "train")
    assert (c.rewards, c.reward_weights) == (["trl.rewards:accuracy_reward"], [])


@pytest.mark.parametrize(("text", "later", "world", "message"), [
    ("per_device_train_batch_size: 3\nnum_generations: 4\n", None, "1",
     ("per_device_train_batch_size 3 x gradient_accumulation_steps 1 x 1 process = 3 answers a "
     "step .TRL's batch. is not divisible by num_generations 4; TRL refuses it too")),
    ("per_device_train_batch_size: 3\n", {"gradient_accumulation_steps": 2,
                                          "num_generations": 4}, "1",
     "x gradient_accumulation_steps 2 x 1 process = 6 answers a step"),
    ("per_device_train_batch_size: 3\ngroup_size: 4\n", None, "3",
     "x 3 processes = 9 answers a step .TRL's batch. is not divisible by num_generations 4"),
    ("per_device_train_batch_size: 4\n", None, "1", "= 4 answers a step .* num_generations 8"),
])
def test_trl_batch_refused_in_trls_terms(tmp_path, monkeypatch, text: str, later: dict | None,
                                         world: str, message: str) -> None:
    """A TRL batch that does not hold whole groups is refused in TRL's terms (grpolab's own
    budget in its own)."""
    monkeypatch.setenv("WORLD_SIZE", world)
    y = tmp_path / "trl.yaml"
    y.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        make_config(y, later, "train")
    assert "\n" not in str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="group_size 4 does not divide the budget 6"):
        make_config(None, {"budget": 6, "num_generations": 4}, "train")


def test_earlier_trl_names_are_read_and_named_once(tmp_path, caplog) -> None:
    """An open-r1-style recipe (transformers 4's torch_dtype and warmup_ratio, TRL 0.x's
    max_prompt_length, cosine_with_min_lr) loads, the earlier names in one notice."""
    y = tmp_path / "recipe.yaml"
    y.write_text("torch_dtype: bfloat16\nwarmup_ratio: 0.1\nmax_prompt_length: 512\n"
                 "overwrite_output_dir: true\nlr_scheduler_type: cosine_with_min_lr\n"
                 "lr_scheduler_kwargs:\n  min_lr_rate: 0.1\nmax_steps: 100\nnum_generations: 16\n"
                 "per_device_train_batch_size: 16\ngradient_accumulation_steps: 4\n"
                 "use_peft: true\nlearning_rate: 2.0e-05\ntemperature: 0.7\n")
    with caplog.at_level("WARNING", logger="grpolab"):
        c = make_config(y, None, "train")
    assert (c.dtype, c.warmup_steps, c.max_prompt_tokens, c.lr_schedule, c.min_lr_rate) == (
        "bfloat16", 0.1, 512, "cosine", 0.1)
    notes = [r.getMessage() for r in caplog.records if "earlier TRL names" in r.getMessage()]
    assert notes == [("earlier TRL names read as TRL 1.16's: torch_dtype as dtype, warmup_ratio "
                      "as warmup_steps, max_prompt_length as max_prompt_tokens, "
                      "overwrite_output_dir left aside")]
    y2 = tmp_path / "unset.yaml"  # TRL's null: whole prompts; torch_dtype's: the default
    y2.write_text("max_prompt_length: null\ntorch_dtype: null\nwarmup_ratio: 0.25\n"
                  "steps: 8\nnum_generations: 8\n")
    c2 = make_config(y2, None, "train")
    assert (c2.max_prompt_tokens, c2.dtype, c2.warmup_steps) == (0, "float32", 0.25)
    y2.write_text("torch_dtype: bfloat16\ntop_k: null\nnum_generations: 8\n")  # (others' nulls)
    with pytest.raises(ConfigError, match="top_k: null .TRL. leaves it to the model's"):
        make_config(y2, None, "train")
    y2.write_text("warmup_ratio: 1.0\nmax_steps: 8\nnum_generations: 8\n")
    with pytest.raises(ConfigError, match="warms up the whole run"):
        make_config(y2, None, "train")


def test_trl_names_as_flags(capsys) -> None:
    """TRL's CLI spelling (``--learning_rate 3e-4``, ``--use_peft``, ``--max-steps=2``) on
    grpolab's command line; anything else is argparse's one-line error, exit 2."""
    from grpolab.app.cli import _overrides, build_parser, trl_flags

    p = build_parser()
    args, extra = p.parse_known_args(["train", "--max_steps", "2", "--learning_rate=3e-4",
                                      "--use_peft", "--num-generations", "4", "--top_p", "0.9"])
    c = make_config(None, {**_overrides(args), **trl_flags(extra, p)}, "train")
    assert (c.steps, c.lr, c.lora, c.group_size, c.top_p) == (2, 3e-4, True, 4, 0.9)
    with pytest.raises(SystemExit) as e:
        trl_flags(["--max_stepz", "2"], p)
    assert e.value.code == 2 and "unrecognized arguments: --max_stepz 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        trl_flags(["oops"], p)
    assert e.value.code == 2 and "unrecognized arguments: oops" in capsys.readouterr().err
    assert trl_flags(["--reward_funcs", "a.b", "c.d", "--use_peft"], p) == {
        "reward_funcs": ["a.b", "c.d"], "use_peft": "true"}
    from grpolab.app import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--group-size", "4", "--group_size", "8"])
    assert e.value.code == 2 and "group_size given twice" in capsys.readouterr().err
    trl = {"max_steps": 40, "num_iterations": 2, "num_generations": 8}  # a TRL file
    from grpolab.run.optim import schedule_length

    c = make_config(trl, {"warmup_ratio": 0.1}, "train")  # 40 optimiser steps, 4 of warm-up
    assert (c.warmup_steps, schedule_length(c)) == (0.1, (2, 40, 4))


@pytest.mark.parametrize(("text", "message"), [
    ("eval_strategy: no\nnum_generations: 8\n", "write 'no'"),  # YAML's unquoted no: false
    ("reward_funcs: [reasoning_gym]\n", "grpolab's own rewards, math, reasoning_gym"),
    ("eval_steps: 0\neval_strategy: steps\nnum_generations: 8\n",
     "eval_size 0 turns evaluation off"),
])
def test_trl_mistakes_say_what_to_write(tmp_path, text: str, message: str) -> None:
    y = tmp_path / "trl.yaml"
    y.write_text(text)
    with pytest.raises(ConfigError, match=message):
        make_config(y, None, "train")


@pytest.mark.parametrize(("save", "evals", "logging"), [(0.1, 0.25, 10), (0.07, None, 0.3),
                                                       (30, None, 0.5)])
def test_trl_interval_shares_are_transformers(save, evals, logging) -> None:
    """save_steps / eval_steps / logging_steps below 1 are shares of max_steps, as transformers'
    TrainerState.compute_steps reads them (rounded up)."""
    from transformers import TrainerState
    from trl import GRPOConfig

    keys = {"max_steps": 90, "save_steps": save, "eval_strategy": "steps",
            "logging_steps": logging, "num_generations": 8, "per_device_train_batch_size": 8}
    if evals is not None:
        keys["eval_steps"] = evals
    args = GRPOConfig(output_dir="unused", report_to=[], bf16=False, **{
        k: v for k, v in keys.items() if k != "eval_strategy"}, eval_strategy="steps")
    state = TrainerState()
    state.compute_steps(args, 90)
    c = make_config(None, keys, "train")
    assert (c.checkpoint_every, c.save_model_every, c.eval_every) == (
        state.save_steps, state.save_steps, state.eval_steps)


def test_trl_interval_shares_follow_a_later_length() -> None:
    """A share is of the run's length: a later grpolab ``steps`` (sampled batches, each
    num_iterations optimiser steps) replaces the file's max_steps for it, as it does for a
    warm-up share; later passes are epochs, refused as with num_train_epochs."""
    file = {"max_steps": 100, "save_steps": 0.1, "num_iterations": 2, "num_generations": 8}
    c = make_config(file, {"steps": 400}, "train")
    assert (c.steps, c.checkpoint_every) == (400, 40)  # 0.1 x 800 optimiser steps, / 2
    assert make_config(file, {"max_steps": 400}, "train").checkpoint_every == 20
    with pytest.raises(ConfigError, match="with epochs and 2 optimiser steps a sampled batch"):
        make_config(file, {"passes": 2}, "train")  # (at one a batch: a share, test_run_length)


def test_a_mixtures_data_dir_is_a_folder_in_its_local_path(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "math").mkdir(parents=True)
    c = make_config(None, {"datasets": [{"path": "data", "data_dir": "math"}]}, "train")
    assert c.dataset == "data/math"


def test_a_mixture_beside_dataset_name_is_said_once(tmp_path, caplog) -> None:
    """The file's layer is read again as the overrides' context: its warning is the file's."""
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    file = {"datasets": [{"path": str(tmp_path / "d.jsonl")}], "dataset_name": "o/e"}
    with caplog.at_level("WARNING", logger="grpolab"):
        c = make_config(file, {"learning_rate": 1e-5}, "train")
    assert c.dataset == str(tmp_path / "d.jsonl")
    said = [r.getMessage() for r in caplog.records if "dataset_name left aside" in r.getMessage()]
    assert len(said) == 1, said
