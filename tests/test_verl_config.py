"""verl's names: a verl run script's overrides (or its nested YAML) read as verl 0.9.1 means
them; verl's defaults as its own config file states them; verl's reward functions."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpolab.config import ConfigError, make_config
from grpolab.config import verl as V
from grpolab.config import verl_rules as VR
from grpolab.config.verl_fields import (
    OVERLONG,
    VERL_ALIASES,
    VERL_ASIDE,
    VERL_COMBINED,
    VERL_DEFAULTS,
    VERL_DEFAULTS_DIFFER,
    A,
    M,
    R,
)
from grpolab.rewards.builtin import load_reward
from grpolab.rewards.scorer import score

# verl's examples/grpo_trainer LoRA GSM8K script, as its overrides
SCRIPT = {
    "algorithm.adv_estimator": "grpo", "trainer.val_before_train": False,
    "data.train_files": "train.parquet", "data.val_files": "test.parquet",
    "data.train_batch_size": 16, "data.max_prompt_length": 512,
    "data.max_response_length": 1024, "data.filter_overlong_prompts": True,
    "data.truncation": "error", "data.shuffle": False, M + "path": "runs/tiny-llama",
    M + "use_shm": True, M + "lora_rank": 64, M + "lora_alpha": 32, A + "optim.lr": 3e-5,
    M + "use_remove_padding": True, A + "ppo_mini_batch_size": 4,
    A + "ppo_micro_batch_size_per_gpu": 40, A + "use_kl_loss": True, A + "kl_loss_coef": 0.001,
    A + "kl_loss_type": "low_var_kl", A + "entropy_coeff": 0,
    M + "enable_gradient_checkpointing": True, A + "fsdp_config.param_offload": False,
    A + "fsdp_config.optimizer_offload": False, R + "log_prob_micro_batch_size_per_gpu": 40,
    R + "tensor_model_parallel_size": 2, R + "name": "vllm", R + "gpu_memory_utilization": 0.6,
    R + "n": 5, R + "load_format": "safetensors", R + "layered_summon": True,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 40,
    "actor_rollout_ref.ref.fsdp_config.param_offload": True,
    "algorithm.use_kl_in_reward": False, "trainer.critic_warmup": 0,
    "trainer.logger": ["console", "wandb"], "trainer.project_name": "verl_grpo_example_gsm8k",
    "trainer.experiment_name": "qwen2.5_3b_grpo_lora", "trainer.n_gpus_per_node": 2,
    "trainer.nnodes": 1, "trainer.save_freq": 20, "trainer.test_freq": 5,
    "trainer.total_epochs": 15, "trainer.total_training_steps": 60,
    "custom_reward_function.path": "r.py",  # (verl's default scorer is not at hand here)
}


def _cfg(over: dict, **kw) -> object:
    return make_config(None, {**over, **kw}, "train")


def test_a_verl_grpo_script_reads_as_verl_means_it(monkeypatch) -> None:
    monkeypatch.setattr("grpolab.config.trl.vllm_installed", lambda: True)
    c = _cfg(SCRIPT)
    want = {
        "estimator": "grpo", "baseline": "mean", "scale": "std", "group_size": 5,
        "budget": 80, "minibatches": 4, "minibatch_order": "groups", "micro_batch": 40,
        "lr": 3e-5, "lora": True, "lora_r": 64, "lora_alpha": 32, "kl_in": "loss",
        "beta": 0.001, "kl_estimator": "k3", "entropy_coef": 0.0,
        "gradient_checkpointing": True, "rollout_backend": "vllm", "max_new_tokens": 1024,
        "max_prompt_tokens": 512, "prompt_order": "sequential", "dataset": "train.parquet",
        "eval_dataset": "test.parquet", "answer_column": "reward_model.ground_truth",
        "prompt_column": "prompt", "report_to": ["wandb"], "checkpoint_every": 20,
        "eval_every": 5, "steps": 60, "critic_warmup": 0, "model_path": "runs/tiny-llama",
        "lora_target_modules": ["all-linear"], "eval_size": 1_000_000,
        "rewards": ["verl:r.py:compute_score"]}
    assert {k: getattr(c, k) for k in want} == want


# DAPO's recipe as verl's scripts give it: epochs, a warm-up, clip-higher, the dual clip,
# group filtering with its generation batch, the soft overlong punishment
DAPO = (
    "data.train_files=train.parquet data.prompt_key=prompt data.truncation=left "
    "data.max_prompt_length=2048 data.max_response_length=20480 data.gen_batch_size=1536 "
    "data.train_batch_size=512 actor_rollout_ref.rollout.n=16 algorithm.adv_estimator=grpo "
    "algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0 "
    f"{A}use_kl_loss=False {A}kl_loss_coef=0.0 {A}clip_ratio_low=0.2 {A}clip_ratio_high=0.28 "
    f"{A}clip_ratio_c=10.0 algorithm.filter_groups.enable=True "
    "algorithm.filter_groups.metric=acc algorithm.filter_groups.max_num_gen_batches=10 "
    f"{A}use_dynamic_bsz=True {A}ppo_max_token_len_per_gpu=22528 {M}path=runs/m "
    f"{A}optim.lr=1e-6 {A}optim.lr_warmup_steps=10 {A}optim.weight_decay=0.1 "
    f"{A}ppo_mini_batch_size=32 {A}fsdp_config.param_offload=True {A}entropy_coeff=0 "
    f"{A}grad_clip=1.0 {A}loss_agg_mode=token-mean {R}temperature=1.0 {R}top_p=1.0 "
    f"{R}top_k=-1 {R}val_kwargs.top_p=0.7 reward_model.reward_manager=dapo "
    "reward_model.overlong_buffer.enable=True reward_model.overlong_buffer.len=4096 "
    "reward_model.overlong_buffer.penalty_factor=1.0 trainer.logger=[console,wandb] "
    "trainer.test_freq=5 trainer.save_freq=5 trainer.total_epochs=1 trainer.resume_mode=auto "
    "custom_reward_function.path=r.py")


def test_dapos_verl_script_reads_as_verl_means_it() -> None:
    from grpolab.app.cli import build_parser, trl_flags

    c = make_config(None, trl_flags(DAPO.split(), build_parser()), "train")
    want = {"budget": 8192, "group_size": 16, "minibatches": 16, "passes": 1.0,
            "prompt_order": "epochs", "eps_low": 0.2, "eps_high": 0.28, "dual_clip": 10.0,
            "beta": 0.0, "loss_agg": "token_mean", "dynamic_sampling": True,
            "max_sampling_rounds": 29, "warmup_steps": 10, "warmup_from_zero": True,
            "schedule_per": "step", "weight_decay": 0.1, "max_new_tokens": 20480,
            "rewards": ["verl:r.py:compute_score", "overlong:20480:4096"],
            "reward_weights": [], "report_to": ["wandb"], "eval_every": 5, "pass_batch": 1536}
    assert {k: getattr(c, k) for k in want} == want
    # verl's recipe scripts spell the overlong buffer +reward_model.reward_kwargs.* (verl 0.9.1
    # moves it to reward.reward_kwargs): the same run
    now = DAPO.replace("reward_model.overlong_buffer.", "+reward_model.reward_kwargs."
                       "overlong_buffer_cfg.") + " +reward_model.reward_kwargs.max_resp_len=20480"
    c = make_config(None, trl_flags(now.split(), build_parser()), "train")
    assert {k: getattr(c, k) for k in want} == want


def test_verls_validation_sampling_is_what_grpolab_eval_samples() -> None:
    """rollout.val_kwargs: grpolab eval samples val_kwargs.n answers a prompt at its
    temperature, top_p and top_k when do_sample is on (pass@1 = verl's acc mean@n); greedy
    otherwise, or at temperature 0, as verl; training (greedy held-out) leaves them aside."""
    from grpolab.app.cli import build_parser, trl_flags

    val = (f"{R}val_kwargs.do_sample=True {R}val_kwargs.n=4 {R}val_kwargs.temperature=0.6 "
           f"{R}val_kwargs.top_p=0.7 {R}val_kwargs.top_k=-1")
    for script, want in (
            (f"{DAPO} {val}", {"eval_samples": 4, "temperature": 0.6, "top_p": 0.7, "top_k": 0}),
            (DAPO, {"eval_samples": 0, "temperature": 1.0, "top_p": 1.0, "top_k": 0}),
            (val.replace("temperature=0.6", "temperature=0"), {"eval_samples": 0}),
            (val.replace("do_sample=True", "do_sample=False"), {"eval_samples": 0}),
            (f"{val} {R}val_kwargs.top_k=20", {"eval_samples": 4, "top_k": 20})):
        c = make_config(None, trl_flags(script.split(), build_parser()), "eval")
        assert {k: getattr(c, k) for k in want} == want, script
    train = make_config(None, trl_flags(f"{DAPO} {val}".split(), build_parser()), "train")
    assert (train.eval_samples, train.temperature, train.top_p) == (0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="keep one of them"):  # (a grpolab flag beside it)
        make_config(None, {**trl_flags(val.split(), build_parser()), "temperature": 0.9}, "eval")


def test_dapos_overlong_penalty_is_verls() -> None:
    """verl's DAPO reward manager's penalty, min(-(length - (max_resp_len - len)) / len x
    factor, 0) with the answer's length EOS included, is what the translated rewards give at
    every length the run allows."""
    from grpolab.rewards.builtin import load_reward

    c = _cfg({"custom_reward_function.path": "r.py", "data.max_response_length": 40,
              "+reward_model.reward_kwargs.overlong_buffer_cfg.enable": True,
              "+reward_model.reward_kwargs.overlong_buffer_cfg.len": 16,
              "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": 0.5,
              "+reward_model.reward_kwargs.max_resp_len": 40})
    assert c.rewards[1] == "overlong:40:16"
    ids = [[7] * n for n in range(1, 41)]
    ours = [c.reward_weights[1] * v for v in load_reward(c.rewards[1])([], [], completion_ids=ids)]
    assert ours == pytest.approx([min(-(n - (40 - 16)) / 16 * 0.5, 0) for n in range(1, 41)])


def test_nested_yaml_is_the_dotted_overrides(tmp_path) -> None:
    nested: dict = {}
    for key, value in SCRIPT.items():
        node = nested
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    nested["actor_rollout_ref"]["rollout"]["name"] = "hf"
    (tmp_path / "verl.yaml").write_text(yaml.safe_dump(nested))
    assert make_config(tmp_path / "verl.yaml", None, "train") == _cfg(SCRIPT, **{R + "name": "hf"})


@pytest.mark.parametrize(("over", "want"), [
    ({"algorithm.adv_estimator": "rloo"}, {"baseline": "rloo", "scale": "none"}),
    ({"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": False},
     {"scale": "none"}),
    ({"algorithm.adv_estimator": "gae"}, {"estimator": "ppo"}),
    ({"algorithm.adv_estimator": "reinforce_plus_plus"}, {"estimator": "reinforce_pp"}),
    ({"algorithm.adv_estimator": "gpg", A + "policy_loss.loss_mode": "gpg"},
     {"scale": "gpg", "policy_loss": "gpg"}),
    ({A + "policy_loss.loss_mode": "cispo", A + "clip_ratio_low": 0.3, A + "clip_ratio_high": 4},
     {"policy_loss": "cispo", "cispo_min": 0.7, "cispo_max": 5.0}),
    ({A + "policy_loss.loss_mode": "geo_mean"}, {"policy_loss": "gmpo"}),
    ({A + "loss_agg_mode": "seq-mean-token-sum-norm", "algorithm.adv_estimator": "gae"},
     {"loss_agg": "seq_mean_token_sum_norm", "value_agg": "seq_mean_token_sum_norm"}),
    # no estimator named: the run is grpolab's grpo (said in the defaults warning), no critic
    ({A + "loss_agg_mode": "seq-mean-token-sum-norm"}, {"estimator": "grpo",
                                                         "value_agg": "token_mean"}),
    ({A + "loss_agg_mode": "seq-mean-token-sum", "defaults": "verl"},  # (verl's gae: a critic)
     {"estimator": "ppo", "value_agg": "seq_mean_token_sum"}),
    # verl's critic aggregates as its actor by default, or as critic.loss_agg_mode says
    ({A + "loss_agg_mode": "seq-mean-token-mean", "critic.loss_agg_mode": "token-mean"},
     {"loss_agg": "seq_mean_token_mean", "value_agg": "token_mean"}),
    ({"critic.loss_agg_mode": "seq-mean-token-sum"}, {"value_agg": "seq_mean_token_sum"}),
    ({A + "loss_agg_mode": "seq-mean-token-sum", "algorithm.adv_estimator": "grpo"},
     {"loss_agg": "seq_mean_token_sum", "value_agg": "token_mean"}),  # (no critic: no value_agg)
    ({A + "loss_agg_mode": "seq-mean-token-sum", "estimator": "grpo"},  # (grpolab's name)
     {"loss_agg": "seq_mean_token_sum", "value_agg": "token_mean"}),
    ({A + "loss_agg_mode": "seq-mean-token-sum", "estimator": "ppo"},
     {"loss_agg": "seq_mean_token_sum", "value_agg": "seq_mean_token_sum"}),
    ({A + "policy_loss.loss_mode": "sapo"}, {"policy_loss": "sapo",
                                             "policy_agg": "seq_mean_token_mean"}),
    ({A + "policy_loss.loss_mode": "gspo", A + "clip_ratio_c": 10.0}, {"policy_loss": "gspo",
                                                                        "dual_clip": 0.0}),
    ({"algorithm.use_kl_in_reward": True}, {"kl_in": "reward", "beta": 0.001, "kl_estimator": "k1"}),
    ({"algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": "mse",
      "algorithm.kl_ctrl.kl_coef": 0.02}, {"kl_in": "reward", "beta": 0.02, "kl_estimator": "k2"}),
    ({A + "kl_loss_coef": 0.5}, {"beta": 0.0}),  # verl reads it only with use_kl_loss
    ({R + "top_k": -1, R + "top_p": 0.9}, {"top_k": 0, "top_p": 0.9}),
    ({M + "lora_rank": 0}, {"lora": False}),
    ({M + "lora_rank": 16, M + "target_modules": "all-linear"},
     {"lora": True, "lora_r": 16, "lora_target_modules": ["all-linear"]}),
    ({"data.shuffle": True}, {"prompt_order": "epochs"}),
    ({"trainer.save_freq": -1}, {"checkpoint_every": 0}),
    ({A + "optim.lr_scheduler_type": "cosine", A + "optim.min_lr_ratio": 0.1,
      A + "optim.lr_warmup_steps_ratio": 0.1, "trainer.total_training_steps": 25,
      A + "optim.betas": [0.9, 0.95]},
     {"lr_schedule": "cosine", "min_lr_rate": 0.1, "warmup_steps": 2, "steps": 25,
      "adam_beta2": 0.95, "warmup_from_zero": True, "schedule_per": "step"}),
    # DAPO's soft overlong punishment, added to the named reward's score x penalty_factor
    ({"custom_reward_function.path": "r.py", "reward_model.overlong_buffer.enable": True,
      "reward_model.overlong_buffer.len": 64, "reward_model.overlong_buffer.penalty_factor": 0.5,
      "reward_model.overlong_buffer.log": True, "data.max_response_length": 256},
     {"rewards": ["verl:r.py:compute_score", "overlong:256:64"], "reward_weights": [1.0, 0.5]}),
    ({"reward.custom_reward_function.path": "r.py",
      "+reward.reward_kwargs.overlong_buffer_cfg.enable": True,
      "+reward.reward_kwargs.overlong_buffer_cfg.len": 16, "+reward.reward_kwargs.max_resp_len": 128},
     {"rewards": ["verl:r.py:compute_score", "overlong:128:16"], "reward_weights": []}),
    # passes over the data (counted when it is read); verl evaluates before training only
    ({"trainer.total_epochs": 15, "trainer.test_freq": -1}, {"passes": 15, "eval_every": 10**9}),
    ({"trainer.total_epochs": 15, "trainer.total_training_steps": 4}, {"passes": 0, "steps": 4}),
    # verl's constant schedule reads no zero_indexed_step: its warm-up starts at 0 regardless
    ({A + "optim.lr_warmup_steps": 3, A + "optim.zero_indexed_step": False},
     {"warmup_steps": 3, "warmup_from_zero": True, "schedule_per": "step"}),
    ({"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
      "algorithm.filter_groups.max_num_gen_batches": 10},
     {"dynamic_sampling": True, "max_sampling_rounds": 9, "dynamic_sampling_on": "acc"}),
    ({"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "score"},
     {"dynamic_sampling": True, "dynamic_sampling_on": "first"}),
    ({"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "seq_reward"},
     {"dynamic_sampling": True, "dynamic_sampling_on": "total"}),
    ({"algorithm.filter_groups.enable": True, "data.gen_batch_size": 48,  # (DAPO's, warned)
      "data.train_batch_size": 16, R + "n": 4, A + "ppo_mini_batch_size": 16},
     {"dynamic_sampling": True, "budget": 64, "pass_batch": 48}),
    # verl's cap counts rounds of gen_batch_size prompts: as many prompts in grpolab's rounds
    ({"algorithm.filter_groups.enable": True, "data.gen_batch_size": 48,
      "algorithm.filter_groups.max_num_gen_batches": 2, "data.train_batch_size": 16, R + "n": 4,
      A + "ppo_mini_batch_size": 16}, {"max_sampling_rounds": 5}),
    ({"custom_reward_function.path": "r.py"}, {"rewards": ["verl:r.py:compute_score"]}),
    ({"reward.custom_reward_function.path": "r.py", "reward.custom_reward_function.name": "f"},
     {"rewards": ["verl:r.py:f"]}),
    ({"data.train_batch_size": 512, R + "n": 2}, {"budget": 1024, "minibatches": 2}),  # 256's
    ({A + "use_kl_loss": 1, "algorithm.norm_adv_by_std_in_grpo": "0",  # OmegaConf's booleans
      "algorithm.adv_estimator": "grpo"},
     {"kl_in": "loss", "beta": 0.001, "scale": "none"}),
    ({"algorithm.adv_estimator": "grpo_vectorized"}, {"estimator": "grpo", "baseline": "mean"}),
    ({M + "lora_rank": 8}, {"lora_target_modules": ["all-linear"]}),  # verl's default
    ({"data.val_files": "v.parquet", "trainer.test_freq": -1, "trainer.total_training_steps": 7},
     {"answer_column": "reward_model.ground_truth", "eval_size": 1_000_000,
      "eval_every": 10**9}),  # (before training and after the last step, whatever its length)
    ({A + "policy_loss.loss_mode": "dppo_tv", A + "clip_ratio_c": 10.0},
     {"policy_loss": "dppo_tv", "dppo_cap": 10.0, "dual_clip": 0.0}),
    ({A + "clip_ratio_c": 3.0}, {"dual_clip": 3.0}),
    # beside grpolab's own policy_loss, verl's loss keys leave it (no conflict), as verl would
    ({"policy_loss": "gspo", A + "loss_agg_mode": "token-mean"},
     {"policy_loss": "gspo", "loss_agg": "token_mean"}),
    ({"policy_loss": "dppo_tv", A + "clip_ratio_c": 5.0}, {"dppo_cap": 5.0, "dual_clip": 0.0}),
    ({A + "shuffle": True}, {"minibatch_order": "shuffled"}),
    ({"algorithm.adv_estimator": "rloo", "algorithm.norm_adv_by_std_in_grpo": False},
     {"baseline": "rloo", "scale": "none"}),  # (verl reads it with grpo only)
    ({"algorithm.filter_groups.enable": True}, {"dynamic_sampling": True,
                                                "max_sampling_rounds": 8}),
    ({"reward.reward_model.enable": True, "reward.reward_model.model_path": "rm"},
     {"rewards": ["rm:rm"]}),
    ({"data.truncation": "left", "data.max_prompt_length": 64}, {"max_prompt_tokens": 64}),
    ({A + "loss_scale_factor": 512}, {"loss_norm_len": 512}),
    # verl's reward managers: per answer (naive, dapo, prime) or per batch, plural keywords
    ({"custom_reward_function.path": "r.py", "reward_model.reward_manager": "batch"},
     {"rewards": ["verl-batch:r.py:compute_score"]}),
    ({"custom_reward_function.path": "r.py", "reward.reward_manager.name": "prime"},
     {"rewards": ["verl:r.py:compute_score"]}),
    ({"custom_reward_function.path": "r.py", "reward.reward_manager.name": "rate_limited"},
     {"rewards": ["verl:r.py:compute_score"]}),
])
def test_verl_settings_read_with_the_keys_verl_reads_them_with(over: dict, want: dict) -> None:
    c = _cfg(over)
    for key, value in want.items():
        assert getattr(c, key) == (pytest.approx(value) if isinstance(value, float) else value), key


def test_resume_mode_is_resume_as_verl_means_it(tmp_path) -> None:
    """auto: continue out_dir's run when it holds a checkpoint; resume_path: the run the path
    lies in, which must be out_dir; disable, or unset (grpolab's --resume decides): no."""
    from grpolab.config.verl import resume_from

    out = tmp_path / "run"
    auto = {"trainer.resume_mode": "auto"}
    assert resume_from(auto, out, True) and not resume_from(auto, out, False)
    assert not resume_from({"trainer": {"resume_mode": "disable"}}, out, True)
    assert not resume_from({}, out, True)
    inside = {"trainer.resume_mode": "resume_path",
              "trainer.resume_from_path": str(out / "checkpoints")}
    assert resume_from(inside, out, False)
    for other in (tmp_path / "other", out / "global_step_1"):  # (grpolab: its last checkpoint)
        with pytest.raises(ConfigError, match="grpolab continues the run in out_dir"):
            resume_from({**inside, "trainer.resume_from_path": str(other)}, out, True)
    with pytest.raises(ConfigError, match="resume_mode=resume_path .verl.: auto, disable"):
        _cfg({"trainer.resume_mode": "resume_path"})


@pytest.mark.parametrize(("over", "says"), [
    ({A + "optim.foo": 1}, "optim.foo=1 .verl.: no such key grpolab reads; did you mean"),
    ({"trainer.foo": 1}, "trainer.foo=1 .verl. has no grpolab equivalent; remove it .or ask"),
    ({"data.gen_batch_size": 48}, "without algorithm.filter_groups"),
    ({"reward_model.overlong_buffer.enable": True, "reward_model.overlong_buffer.len": 8},
     "adds to the score of the reward verl names"),
    # both spellings on: verl 0.9.1 reads one (and a factor of one must not weigh the other)
    ({"custom_reward_function.path": "r.py", "reward_model.overlong_buffer.enable": True,
      "reward_model.overlong_buffer.len": 8, "reward_model.overlong_buffer.penalty_factor": 0.5,
      "reward.reward_kwargs.overlong_buffer_cfg.enable": True,
      "reward.reward_kwargs.overlong_buffer_cfg.len": 4}, "both add DAPO's overlong"),
    # past max_resp_len verl's penalty falls on below -factor, grpolab's stops at -1
    ({"custom_reward_function.path": "r.py", "data.max_response_length": 256,
      "reward.reward_kwargs.overlong_buffer_cfg.enable": True,
      "reward.reward_kwargs.overlong_buffer_cfg.len": 16, "reward.reward_kwargs.max_resp_len": 128},
     "max_resp_len=128 .verl. is below the answers' length limit 256"),
    ({"custom_reward_function.path": "r.py", "data.max_response_length": 256,
      "reward_model.overlong_buffer.enable": True, "reward_model.overlong_buffer.len": 300},
     "len=300 .verl. must not exceed the length limit 256"),
    ({"trainer.total_epochs": 2, A + "optim.lr_warmup_steps_ratio": 1.5},
     "lr_warmup_steps_ratio .verl. must be below 1 .got 1.5.: a share"),
    ({A + "optim.zero_indexed_step": False, A + "optim.lr_scheduler_type": "cosine"},
     "zero_indexed_step=false"),
    ({"data.train_batch_size": 10, A + "ppo_mini_batch_size": 4}, "not a multiple of"),
    ({"data.train_batch_size": 16}, "ppo_mini_batch_size 256 .verl's default."),
    ({A + "ppo_mini_batch_size": 4}, "give that too"),
    ({"algorithm.adv_estimator": "remax"}, "adv_estimator=remax .verl. has no grpolab"),
    ({A + "use_kl_loss": True, "algorithm.use_kl_in_reward": True}, "both true"),
    ({A + "use_kl_loss": True, A + "kl_loss_type": "low_var_kl+"}, "has no grpolab estimator"),
    ({A + "policy_loss.loss_mode": "fancy"}, "loss_mode=fancy"),
    ({"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "len"},
     "metric=len"),
    ({"data.truncation": "right"}, "data.truncation=right"),
    ({"reward_model.reward_manager": "bogus"}, "reward manager bogus .verl."),
    ({"custom_reward_function.path": "r.py", "reward_model.reward_manager": "naive",
      "reward_model.overlong_buffer.enable": True, "reward_model.overlong_buffer.len": 8},
     "naive reward manager does not apply the overlong buffer"),
    ({"data.reward_fn_key": "src"}, "reward_fn_key=src .verl.: grpolab .and verl 0.9.1"),
    ({"reward.reward_manager.name": "gdpo"}, "reward manager gdpo"),
    ({A + "use_kl_loss": "ture"}, "use_kl_loss='ture' .verl.: not true or false"),
    ({A + "kl_loss_coeff": 0.1}, "did you mean actor_rollout_ref.actor.kl_loss_coef"),
    ({"data.train_files": "t.parquet"}, "without a reward"),
    ({"data.train_files": "t.parquet", "reward_model.enable": False}, "without a reward"),
    ({"trainer.logger": ["console", "swanlab"]}, "swanlab is not one of"),
    ({"critic.model.path": "other", M + "path": "runs/x"}, "a copy of the policy"),
    ({"data.train_files": ["a.parquet", "b.parquet"]}, "grpolab reads one file or folder"),
    ({R + "name": "sglang"}, "grpolab samples with hf or vllm"),
    ({R + "do_sample": False}, "greedy groups"),
    ({A + "optim.lr": 1e-6, "lr": 1e-5}, "sets lr to 1e-06, but lr sets it to 1e-05"),
    # values no rule can read: each named (they were tracebacks, or unnamed, or taken as off)
    ({M + "target_modules": 5}, "target_modules=5 .verl.: cannot be read"),
    ({A + "optim.betas": "abc"}, "optim.betas='abc' .verl.: cannot be read"),
    ({A + "optim.betas": [0.9]}, "optim.betas=.0.9. .verl.: cannot be read"),
    ({"trainer.save_freq": "abc"}, "save_freq='abc' .verl. must be a whole number"),
    ({"trainer.save_freq": 1.5}, "save_freq=1.5 .verl. must be a whole number"),
    ({"trainer.test_freq": "abc"}, "test_freq='abc' .verl. must be a whole number"),
    ({"trainer.test_freq": [1]}, "test_freq=.1. .verl. must be a whole number"),
    ({"trainer.total_epochs": "abc", "trainer.total_training_steps": 3},
     "total_epochs='abc' .verl. must be a whole number >= 1"),
    ({"algorithm.filter_groups.enable": True,
      "algorithm.filter_groups.max_num_gen_batches": "abc"}, "max_num_gen_batches='abc'"),
])
def test_what_verl_names_and_grpolab_cannot_honour_is_refused(over: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        _cfg(over)


def test_overrides_over_a_yaml_as_hydra_takes_them(tmp_path) -> None:
    """key=null unsets the file's key; a group size given later resizes the file's batch."""
    y = tmp_path / "v.yaml"
    y.write_text(yaml.safe_dump({"trainer": {"total_training_steps": 2},
                                 "data": {"train_batch_size": 4},
                                 "actor_rollout_ref": {"rollout": {"n": 4},
                                                       "actor": {"ppo_mini_batch_size": 2}}}))
    assert make_config(y, {"trainer.total_training_steps": 6}, "train").steps == 6
    c = make_config(y, {"trainer.total_training_steps": None, "trainer.total_epochs": 15},
                    "train")
    assert c.passes == 15  # (verl: 15 passes over the data, counted when it is read)
    c = make_config(y, {"group_size": 2}, "train")
    assert (c.group_size, c.budget, c.minibatches) == (2, 8, 2)  # 4 prompts x 2, as verl's n
    with pytest.raises(ConfigError) as e:  # the override's mistake is not the file's
        make_config(y, {"data.train_batch_size": 3}, "train")
    assert str(e.value).startswith("data.train_batch_size 3 is not a multiple of")


def test_aside_settings_are_named_once(caplog) -> None:
    with caplog.at_level("WARNING", logger="grpolab"):
        _cfg({R + "gpu_memory_utilization": 0.6, "trainer.n_gpus_per_node": 8, R + "n": 4})
    notes = [r.getMessage() for r in caplog.records if "left aside" in r.getMessage()]
    assert notes == [("verl settings left aside (they change nothing that is trained here): "
                      f"{R}gpu_memory_utilization, trainer.n_gpus_per_node")]


def _verl_root() -> Path:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("verl is not installed: pip install --no-deps verl==0.9.1 (.ci/run does)")
    return Path(spec.submodule_search_locations[0])


def _verl_defaults() -> dict:
    tree = yaml.safe_load((_verl_root() / "trainer/config/_generated_ppo_trainer.yaml").read_text())
    return dict(V.flatten(tree))


def test_verl_defaults_named_are_verl_0_9_1s_own() -> None:
    """The defaults the warning quotes, and every key grpolab reads, are verl's config's."""
    theirs = _verl_defaults()
    for key, value in VERL_DEFAULTS.items():
        assert theirs[key] == value, key
    read = {*VERL_ALIASES, *VERL_COMBINED} - {A + "grad_clip", "custom_reward_function.path",
                                              "custom_reward_function.name",
                                              "reward_model.enable", "reward_model.model.path",
                                              *OVERLONG}
    assert sorted(k for k in read if k not in theirs) == []  # (older names: grad_clip, ...)
    # the overlong keys: given with +, read by verl 0.9.1's DAPO reward manager (and the
    # DAPO recipe's reward_model.overlong_buffer before it)
    dapo = (Path(importlib.util.find_spec("verl").submodule_search_locations[0])
            / "experimental/reward_loop/reward_manager/dapo.py").read_text()
    for name in ('get("overlong_buffer_cfg"', 'get("max_resp_len"', ".len", ".penalty_factor",
                 ".enable", ".log"):
        assert name in dapo, name
    assert all(any(k.startswith(p) for k in theirs) for p in VERL_ASIDE if p.count(".") > 1
               and not p.startswith(("actor_rollout_ref.hybrid", R + "free_cache",
                                     R + "multi_turn", "critic.model.", "critic.use_dyn",
                                     "critic.strategy", "reward_model.")))
    # a rule reads every combined key, and none is also one-to-one
    assert {k for keys, _ in VR.RULES for k in keys} >= VERL_COMBINED
    assert not VERL_COMBINED & VERL_ALIASES.keys()


def test_a_config_that_leaves_verls_defaults_is_told_which(caplog) -> None:
    with caplog.at_level("WARNING", logger="grpolab"):
        _cfg({R + "n": 4, "algorithm.adv_estimator": "grpo"})
    (note,) = [r.getMessage() for r in caplog.records if "verl 0.9.1's" in r.getMessage()]
    assert "beta 0.04 (verl: no KL term" in note and "dual_clip 0.0 (verl's clip_ratio_c 3.0)" in note
    assert "estimator" not in note and "group_size" not in note  # (given)
    assert len(VERL_DEFAULTS_DIFFER) == note.count(" (verl") + 2  # less estimator, group_size


# ------------------------------------------------------------------------- rewards


def test_verl_reward_functions_get_verls_arguments(tmp_path) -> None:
    f = tmp_path / "r.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return {'score': float(ground_truth in solution_str) + extra_info['k'],"
                 " 'acc': 1} if data_source == 'd' else 0.5\n")
    fn = load_reward(f"verl:{f}:compute_score")
    cols = {"data_source": ["d", "d", "other"], "extra_info": [{"k": 0}, {"k": 0.25}, {"k": 0}],
            "reward_model": [{"ground_truth": "7"}] * 3, "answer": ["7"] * 3}
    assert fn(["p"] * 3, ["it is 7", "it is 8", "7"], **cols) == [
        {"score": 1.0, "acc": 1}, {"score": 0.25, "acc": 1}, 0.5]
    # scored: the dict's score, its other numbers beside it (NaN where an answer had none)
    res = score([fn], ["p"] * 3, ["it is 7", "it is 8", "7"], cols)
    assert res.per_fn[:, 0].tolist() == [1.0, 0.25, 0.5] and not res.problems
    assert res.extras["compute_score/acc"][:2].tolist() == [1.0, 1.0]
    assert res.extras["compute_score/acc"][2].isnan()
    chat = [[{"role": "assistant", "content": "7"}]]
    assert fn(["p"], chat, data_source=["d"], extra_info=[{"k": 0}], answer=["7"]) == [
        {"score": 1.0, "acc": 1}]
    h = tmp_path / "h.py"  # verl always passes a dict as extra_info, and takes a bool score
    h.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                 "    return extra_info.get('w', True)\n")
    assert load_reward(f"verl:{h}:compute_score")(["p"], ["x"], answer=["1"]) == [1.0]
    g = tmp_path / "bad.py"
    g.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                 "    return 'yes'\n")
    bad = load_reward(f"verl:{g}:compute_score")
    with pytest.raises(TypeError, match="returned a str"):
        bad(["p"], ["x"], answer=["1"])
    nd = tmp_path / "no_score.py"
    nd.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                  "    return {'acc': 1}\n")
    with pytest.raises(TypeError, match=r"returned a dict without 'score' \(keys: acc\)"):
        load_reward(f"verl:{nd}:compute_score")(["p"], ["x"], answer=["1"])
    b = tmp_path / "b.py"  # verl's batch reward manager: one call, the same arguments as lists
    b.write_text("def batch_score(data_sources, solution_strs, ground_truths, extra_infos):\n"
                 "    return [{'score': float(g in s) + x['k']} if d == 'd' else 0.5\n"
                 "            for d, s, g, x in zip(data_sources, solution_strs, ground_truths,"
                 " extra_infos)]\n")
    assert load_reward(f"verl-batch:{b}:batch_score")(
        ["p"] * 3, ["it is 7", "it is 8", "7"], **cols) == [{"score": 1.0}, {"score": 0.25}, 0.5]
    arr = tmp_path / "arr.py"  # (arrays and 0-d tensors, as verl takes them)
    arr.write_text("import numpy as np, torch\n"
                   "def batch_score(**kw):\n    return np.arange(len(kw['solution_strs']))\n"
                   "def score(**kw):\n    return torch.tensor(0.5)\n")
    assert load_reward(f"verl-batch:{arr}:batch_score")(["p"] * 2, ["a", "b"]) == [0.0, 1.0]
    assert load_reward(f"verl:{arr}:score")(["p"], ["a"]) == [0.5]
    # a scalar, or a list of one score for any batch: the whole batch off, on_error (retried
    # answer by answer, one score passed for each), and a batch where every answer is off stops
    from grpolab.rewards.scorer import RewardError
    from grpolab.rewards.scorer import score as score_batch

    one = tmp_path / "one.py"
    one.write_text("def batch_score(**kw):\n    return 1.0\n"
                   "def short(**kw):\n    return [1.0]\n")
    for name in ("batch_score", "short"):
        fn = load_reward(f"verl-batch:{one}:{name}")
        res = score_batch([fn], ["p"] * 3, ["x", "y", "z"], {"answer": ["1"] * 3},
                          on_error=-1.0, fail_on_all_errors=False)
        assert res.per_fn[:, 0].tolist() == [-1.0] * 3
        assert "for 3 samples (expected a list of 3 numbers)" in res.problems[0]
        with pytest.raises(RewardError, match="failed on all 3 answers"):
            score_batch([fn], ["p"] * 3, ["x", "y", "z"], {"answer": ["1"] * 3},
                        fail_on_all_errors=True)


def test_verls_own_gsm8k_scorer_runs_unchanged() -> None:
    """verl's GSM8K check (strict '#### answer'), given only the arguments it takes."""
    spec = f"verl:{_verl_root() / 'utils/reward_score/gsm8k.py'}:compute_score"
    fn = load_reward(spec)
    got = fn(["q"] * 3, ["so #### 72", "72", "#### 7"], reward_model=[{"ground_truth": "72"}] * 3)
    assert got == [1.0, 0.0, 0.0]


@pytest.mark.slow
def test_a_verl_script_trains_from_the_command_line(tmp_path, monkeypatch, capsys,
                                                    caplog) -> None:
    """verl's overrides as grpolab train's arguments, on verl-layout parquet data (chat prompts,
    reward_model.ground_truth, data_source, extra_info) with a verl reward function."""
    pd = pytest.importorskip("pandas")
    from grpolab.rollout.tinyhf import make_tiny_model

    make_tiny_model(tmp_path / "tiny", chat_template=True)
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
             "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"index": i}} for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 2),
                                                                    (5, 1), (6, 2), (4, 4)])]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    (tmp_path / "r.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    assert data_source == 'arith' and isinstance(extra_info, dict)\n"
        "    x = float(any(ch.isdigit() for ch in solution_str))\n"
        "    return {'score': x, 'acc': x > 0, 'pred': solution_str}\n")
    args = ["algorithm.adv_estimator=grpo", "data.train_files=train.parquet",
            "data.train_batch_size=4", "data.max_response_length=6",
            "actor_rollout_ref.model.path=tiny", "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.rollout.name=hf",
            "trainer.logger=['console']", "trainer.total_training_steps=2",
            "+trainer.default_local_dir=out", "custom_reward_function.path=r.py"]
    p = subprocess.run([sys.executable, "-m", "grpolab", "train", "--no-progress", *args],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    cfg = json.loads((tmp_path / "out/config.json").read_text())
    assert (cfg["budget"], cfg["minibatches"], cfg["group_size"], cfg["lora_r"]) == (8, 2, 2, 4)
    metrics = [json.loads(x) for x in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert all(r["rewards/compute_score/acc"] == r["rewards/compute_score"] for r in metrics[1:])
    samples = [json.loads(x) for x in (tmp_path / "out/samples.jsonl").read_text().splitlines()]
    for group in samples[0]["groups"]:
        assert group["rewards"] == [float(any(ch.isdigit() for ch in c))
                                    for c in group["completions"]]
        assert group["answer"] in {"3", "7", "4", "6", "8"}  # the nested ground truth
    # the same script again with verl's resume_mode=auto and a longer run: it continues (in
    # this process, for the suite's time)
    from grpolab.app import cli

    monkeypatch.chdir(tmp_path)
    more = [a.replace("total_training_steps=2", "total_training_steps=3") for a in args]
    assert cli.main(["train", "--no-progress", *more, "trainer.resume_mode=auto"]) == 0
    assert "at step 2 of 3" in capsys.readouterr().out
    # and the script evaluates the trained model (its training settings left aside, in one
    # notice), writing where default_local_dir says, sampling as its val_kwargs say
    ev = [a for a in args if "model.path" not in a and "default_local" not in a]
    assert cli.main(["eval", "--no-progress", *ev, "data.val_files=train.parquet",
                     f"{M}path=out/final", "trainer.default_local_dir=ev",
                     f"{R}val_kwargs.do_sample=True", f"{R}val_kwargs.n=2",
                     f"{R}val_kwargs.temperature=1.0"]) == 0
    assert "a verl script's settings, left aside" in caplog.text
    res = json.loads((tmp_path / "ev/eval.json").read_text())
    assert res["model_path"] == "out/final" and res["samples_per_prompt"] == 2
    sampled = [json.loads(x) for x in (tmp_path / "ev/completions.jsonl").read_text()
               .splitlines() if not json.loads(x)["greedy"]]
    assert res["pass@1"] == pytest.approx(sum(x["right"] for x in sampled) / 12)
    assert res["sampled_rewards/compute_score"] == pytest.approx(  # (verl's reward mean@2)
        sum(x["rewards"]["compute_score"] for x in sampled) / 12)
    # DAPO's keys on the same data: 3 epochs of verl's loader batches (6 prompts, 4 a batch:
    # 1 a pass, as verl counts them; 2 trained a step), group filtering
    # on the named reward, the overlong buffer beside it, a warm-up from lr 0
    dapo = [*(a for a in args if "total_training_steps" not in a and "default_local" not in a
              and "train_batch_size" not in a and "mini_batch" not in a),
            "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.total_epochs=3", "algorithm.filter_groups.enable=True",
            "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=2",
            "data.gen_batch_size=4", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=3",
            "+reward_model.reward_kwargs.max_resp_len=6",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=1", "+trainer.default_local_dir=dapo"]
    p = subprocess.run([sys.executable, "-m", "grpolab", "train", "--no-progress", *dapo],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    said = "3 passes over 6 prompts, 1 batches of 4 (verl's gen_batch_size) a pass: 3 steps"
    assert said in p.stdout
    cfg = json.loads((tmp_path / "dapo/config.json").read_text())
    assert (cfg["rewards"], cfg["dynamic_sampling_on"], cfg["max_sampling_rounds"]) == (
        ["verl:r.py:compute_score", "overlong:6:3"], "acc", 3)
    metrics = [json.loads(x) for x in (tmp_path / "dapo/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [0, 1, 2, 3] and metrics[1]["lr"] == 0.0
    assert all(-1 <= r["rewards/overlong"] <= 0 for r in metrics[1:])


def test_resume_and_overwrite_are_one_or_the_other(tmp_path, capsys) -> None:
    """--resume with --overwrite is refused; verl's resume_mode=auto resumes where out_dir
    holds a checkpoint, disable never."""
    from grpolab.app import cli

    assert cli.main(["train", "--resume", "--overwrite", "--out-dir", str(tmp_path)]) == 2
    assert "--resume continues out_dir's run, --overwrite replaces it" in capsys.readouterr().err
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "last.pt").write_bytes(b"")
    from grpolab.config import make_config

    cfg = make_config(None, {"out_dir": str(tmp_path / "run")}, "train")
    from grpolab.app.api import resume_asked_by

    assert resume_asked_by(None, {"trainer.resume_mode": "auto"}, cfg)
    assert not resume_asked_by(None, {"trainer.resume_mode": "disable"}, cfg)


def test_filter_groups_on_acc_judges_the_dicts_acc() -> None:
    """verl's filter_groups.metric=acc: a kept group's answers differ in the reward dict's
    acc (its score where an answer's dict has none); score: in the score."""
    import torch

    from grpolab.rewards.scorer import ScoreResult
    from grpolab.run.collect import first_judged

    res = ScoreResult(total=torch.zeros(3), per_fn=torch.tensor([[0.5], [0.9], [0.1]]),
                      names=["cs"], problems=[],
                      extras={"cs/acc": torch.tensor([1.0, float("nan"), 0.0])})
    assert first_judged(res, "acc").tolist() == [1.0, pytest.approx(0.9), 0.0]
    assert first_judged(res, "first").tolist() == pytest.approx([0.5, 0.9, 0.1])
    assert first_judged(ScoreResult(torch.zeros(1), torch.ones(1, 1), ["cs"], []),
                        "acc").tolist() == [1.0]


def test_trls_resume_from_checkpoint_is_resume(tmp_path) -> None:
    """TRL's resume_from_checkpoint (its script passes it to trainer.train): true continues
    output_dir's run from its last checkpoint, which must exist; a path must be that run's;
    false or unset: no."""
    from grpolab.config.load import resume_asked

    out = str(tmp_path / "run")
    assert resume_asked({"resume_from_checkpoint": True}, out, True)
    assert resume_asked({"resume_from_checkpoint": f"{out}/checkpoints/last.pt"}, out, True)
    assert not resume_asked({"resume_from_checkpoint": False}, out, True)
    assert not resume_asked({}, out, True)
    with pytest.raises(ConfigError, match="holds no checkpoint to continue from"):
        resume_asked({"resume_from_checkpoint": "true"}, out, False)
    with pytest.raises(ConfigError, match="grpolab continues the run in output_dir"):
        resume_asked({"resume_from_checkpoint": f"{out}/checkpoint-500"}, out, True)
    assert make_config(None, {"resume_from_checkpoint": True}, "train")  # (read, not refused)
    # with overwrite: an explicit ask is refused, verl's auto yields
    with pytest.raises(ConfigError, match="overwrite replaces it: keep one"):
        resume_asked({"resume_from_checkpoint": True}, out, True, overwrite=True)
    assert not resume_asked({"trainer.resume_mode": "auto"}, out, True, overwrite=True)


def test_defaults_verl_takes_verls_defaults_for_what_a_config_leaves_unset(caplog) -> None:
    """``defaults: verl``: each setting a verl config leaves unset takes verl 0.9.1's default
    (VERL_DEFAULTS, read from verl's own config file by another test), where grpolab has it;
    the warning then names only the two it has not (verl's default reward, its bf16 compute)."""
    for _, _, _, theirs in VERL_DEFAULTS_DIFFER:
        for k, v in theirs.items():
            if k in VERL_DEFAULTS:
                assert VERL_DEFAULTS[k] == v, k
    over = {"defaults": "verl", "algorithm.adv_estimator": "grpo", R + "n": 8,
            "data.train_batch_size": 32, A + "ppo_mini_batch_size": 16}
    with caplog.at_level("WARNING", logger="grpolab"):
        c = make_config(None, over, "train")
    said = [r.getMessage() for r in caplog.records if "not verl 0.9.1's" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(": rewards ['exact'] (verl's default_compute_score "
                                               "by data_source), dtype float32 (verl: bfloat16 "
                                               "compute)"), said
    assert (c.beta, c.budget, c.minibatches, c.loss_agg, c.dual_clip, c.std, c.std_eps, c.lr,
            c.weight_decay, c.lora, c.max_new_tokens, c.max_prompt_tokens, c.passes,
            c.checkpoint_every, c.prompt_order) == (0.0, 256, 2, "token_mean", 3.0, "sample",
                                                    1e-6, 1e-6, 0.01, False, 512, 512, 30.0, 0,
                                                    "epochs")
    c = make_config(None, {"defaults": "verl"}, "train")  # verl's own: PPO, one answer each
    assert (c.estimator, c.group_size, c.budget) == ("ppo", 1, 1024)
    # an estimator named: not verl's rollout.n 1 (no group baseline), grpolab's 8, warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpolab"):
        c = make_config(None, {"defaults": "verl", "estimator": "grpo"}, "train")
    assert c.group_size == 8 and "group_size 8 (verl's rollout.n 1)" in caplog.text
    # TRL's defaults chosen beside a verl key: no warning of verl's (over TRL's values)
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpolab"):
        make_config(None, {"defaults": "trl", R + "n": 4}, "train")
    assert "not verl 0.9.1's" not in caplog.text and "not TRL's: dtype" in caplog.text
    # sapo's own mean is verl's sapo's: not a clip loss's given over it
    over = {A + "policy_loss.loss_mode": "sapo", A + "loss_agg_mode": "token-mean"}
    assert make_config(over, None, "train").policy_agg == "seq_mean_token_mean"
    assert make_config(over, {"policy_loss": "clip"}, "train").policy_agg == "loss"
    # verl's null unsets: its default, here verl's; a TRL name over it wins
    assert make_config({"defaults": "verl", A + "optim.lr": None}, None, "train").lr == 1e-6
    assert make_config({"defaults": "verl", "learning_rate": 1e-5}, None, "train").lr == 1e-5


def _written(table: tuple, given: dict) -> dict:
    """A peer's defaults written out in the config, less the entries ``given`` sets a key of."""
    out: dict = {}
    for _, _, keys, theirs in table:
        if not set(keys) & set(given):
            out.update(theirs)
    return {**out, **given}


@pytest.mark.parametrize("peer,given,expect", [
    ("verl", {R + "n": 4}, {"budget": 4096, "group_size": 4, "minibatches": 4}),
    ("verl", {"algorithm.adv_estimator": "grpo", R + "n": 4}, {"budget": 4096, "group_size": 4}),
    ("verl", {"group_size": 4}, {"budget": 4096}),
    ("verl", {A + "policy_loss.loss_mode": "gspo"}, {"policy_loss": "gspo", "dual_clip": 0.0}),
    ("verl", {"policy_loss": "gspo"}, {"dual_clip": 0.0}),
    ("verl", {A + "policy_loss.loss_mode": "dppo_tv"}, {"dual_clip": 0.0, "dppo_cap": 3.0}),
    ("trl", {"steps_per_generation": 4}, {"minibatches": 4, "token_mean_by": "batch"}),
    ("trl", {"num_iterations": 2}, {"epochs": 2, "checkpoint_every": 250}),
])
def test_peer_defaults_combine_with_the_keys_given_as_written_out(peer, given, expect) -> None:
    """``defaults: verl`` / ``trl`` under a file or flags is the config with the peer's
    defaults written out: where the peer reads keys together (verl's train_batch_size x
    rollout.n, its clip_ratio_c as the policy loss reads it; TRL's loss_type dapo over several
    steps a generation, its save_steps in optimiser steps), a given key meets the peer's
    default as it would meet it written (it met grpolab's: 1024 answers, not prompts; a dual
    clip on verl's gspo; TRL's dapo divided by each step's own tokens)."""
    import dataclasses

    from grpolab.config.trl_fields import TRL_DEFAULTS_DIFFER

    table = TRL_DEFAULTS_DIFFER if peer == "trl" else VERL_DEFAULTS_DIFFER
    written = dataclasses.asdict(make_config(None, _written(table, given), "train"))
    for where in ("file", "flags"):
        keys = {"defaults": peer, **given}
        c = make_config(*((keys, None) if where == "file" else (None, keys)), "train")
        assert {k: getattr(c, k) for k in expect} == expect, where
        assert {**dataclasses.asdict(c), "defaults": "grpolab"} == written, where


def test_peer_defaults_that_cannot_meet_a_given_key_are_one_line() -> None:
    """TRL's save_steps 500 counts optimiser steps: at num_iterations 3 no count of sampled
    batches is it; refused in one line that says it is the peer's default."""
    with pytest.raises(ConfigError, match=r"^defaults: trl: save_steps: 500 \(TRL\) counts "
                                          r"optimiser steps.*or set it in the config$"):
        make_config(None, {"defaults": "trl", "num_iterations": 3}, "train")
    c = make_config(None, {"defaults": "trl", "num_iterations": 3, "save_steps": 30}, "train")
    assert c.checkpoint_every == 10


@pytest.mark.parametrize("file,flags,expect", [
    ({"policy_loss": "sapo"}, {A + "policy_loss.loss_mode": "vanilla", A + "loss_agg_mode":
                               "token-mean"}, ("clip", "loss", 0.0)),
    ({"policy_loss": "gspo"}, {A + "policy_loss.loss_mode": "vanilla", A + "clip_ratio_c": 3.0},
     ("clip", "loss", 3.0)),
    ({"policy_loss": "clip"}, {A + "policy_loss.loss_mode": "gspo", A + "clip_ratio_c": 3.0},
     ("gspo", "loss", 0.0)),
    ({A + "policy_loss.loss_mode": "vanilla", A + "loss_agg_mode": "token-mean"},
     {"policy_loss": "sapo"}, ("sapo", "loss", 0.0)),
    ({A + "policy_loss.loss_mode": "sapo", A + "loss_agg_mode": "token-mean"}, {},
     ("sapo", "seq_mean_token_mean", 0.0)),
])
def test_the_later_layers_policy_loss_is_the_one_read_for_its_mean_and_dual_clip(
        file, flags, expect) -> None:
    """A file's policy_loss and a flag's loss_mode (or the reverse): the later one runs, and
    verl's dual clip (clip_ratio_c) and sapo's per-answer mean (policy_agg) are read for it: a
    file's sapo under a flag's vanilla left sapo's mean on PPO's clip, a file's gspo took the
    flag's dual clip away, a file's clip gave the flag's gspo one; grpolab's sapo given over
    verl's vanilla has grpolab's mean."""
    c = make_config({"model_path": "m", **file}, flags, "train")
    assert (c.policy_loss, c.policy_agg, c.dual_clip) == expect


@pytest.mark.parametrize("file,flags", [
    ({"policy_loss": "gspo"}, {A + "policy_loss.loss_mode": "vanilla"}),
    ({"policy_loss": "clip"}, {A + "policy_loss.loss_mode": "gspo"}),
    ({"policy_loss": "clip"}, {A + "policy_loss.loss_mode": "dppo_tv"}),
])
def test_defaults_verl_reads_its_dual_clip_for_the_later_layers_policy_loss(file, flags) -> None:
    """``defaults: verl`` with a file's policy_loss and a flag's loss_mode is the config with
    verl's clip_ratio_c 3 written out: the flag's loss runs and the dual clip is read for it (a
    file's gspo took the flag's vanilla's dual clip away; a file's clip gave the flag's gspo
    one, which verl's gspo has not)."""
    written = make_config({"model_path": "m", **file, A + "clip_ratio_c": 3.0}, flags, "train")
    c = make_config({"model_path": "m", "defaults": "verl", **file}, flags, "train")
    assert (c.policy_loss, c.dual_clip, c.dppo_cap) == (
        written.policy_loss, written.dual_clip, written.dppo_cap)


def test_defaults_verl_says_a_keys_warning_once(caplog) -> None:
    """verl's defaults are read with the keys given, through the same rules: what a rule warns
    of a given key (clip_ratio, data.truncation) is said once, by the key's own reading."""
    caplog.set_level("WARNING", logger="grpolab")
    for keys in ({A + "clip_ratio": 0.3}, {"data.truncation": "error"}):
        for where in ("file", "flags"):
            caplog.clear()
            given = {"defaults": "verl", **keys}
            make_config(*((given, None) if where == "file" else (None, given)), "train")
            said = [r.getMessage() for r in caplog.records if r.module == "verl_rules"]
            assert len(said) == 1, (keys, where, said)
