"""verl 0.9.1's names, as tables: those grpolab reads one to one, those it leaves aside
(nothing trained changes), and verl's own defaults where grpolab's differ. What takes more
than a table (the batch, the KL, the advantage, the rewards) is ``grpolab.config.verl``."""

from __future__ import annotations

A, R, M = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.model."
# the first part of every verl key (a key of grpolab's never has one of these)
VERL_ROOTS = frozenset({"actor_rollout_ref", "algorithm", "data", "trainer", "critic",
                        "reward_model", "reward", "custom_reward_function", "ray_kwargs",
                        "global_profiler", "transfer_queue"})

# verl key -> grpolab key, the value as it is
VERL_ALIASES: dict[str, str] = {
    R + "n": "group_size", R + "temperature": "temperature", R + "top_p": "top_p",
    A + "ppo_epochs": "epochs", A + "optim.lr": "lr", A + "optim.weight_decay": "weight_decay",
    A + "optim.clip_grad": "grad_clip", A + "grad_clip": "grad_clip",
    A + "optim.min_lr_ratio": "min_lr_rate",
    A + "clip_ratio_low": "eps_low", A + "clip_ratio_high": "eps_high",
    A + "entropy_coeff": "entropy_coef", A + "loss_scale_factor": "loss_norm_len",
    A + "tau_pos": "sapo_tau_pos", A + "tau_neg": "sapo_tau_neg",
    A + "policy_loss.clip_cov_ratio": "clip_cov_ratio", A + "policy_loss.clip_cov_lb": "clip_cov_lb",
    A + "policy_loss.clip_cov_ub": "clip_cov_ub", A + "policy_loss.kl_cov_ratio": "kl_cov_ratio",
    A + "policy_loss.ppo_kl_coef": "kl_cov_coef", A + "policy_loss.dro_beta": "dro_beta",
    A + "ppo_micro_batch_size_per_gpu": "micro_batch",
    M + "path": "model_path", M + "lora_alpha": "lora_alpha",
    M + "enable_gradient_checkpointing": "gradient_checkpointing",
    "data.prompt_key": "prompt_column", "data.max_response_length": "max_new_tokens",
    "data.max_prompt_length": "max_prompt_tokens",
    "algorithm.gamma": "gamma", "algorithm.lam": "lam",
    "algorithm.filter_groups.enable": "dynamic_sampling",
    "trainer.total_training_steps": "steps", "trainer.critic_warmup": "critic_warmup",
    "trainer.default_local_dir": "out_dir",
    "critic.optim.lr": "critic_lr", "critic.cliprange_value": "value_clip",
}
# DAPO's soft overlong punishment: the recipe's keys, and verl 0.9's reward manager's
# (verl 0.9.1 moves reward_model.reward_kwargs, the recipe scripts' spelling, to reward.)
OVERLONG = tuple(f"{root}{k}" for root in ("reward_model.overlong_buffer.",
                                           "reward.reward_kwargs.overlong_buffer_cfg.",
                                           "reward_model.reward_kwargs.overlong_buffer_cfg.")
                 for k in ("enable", "len", "penalty_factor", "log")) + (
    "reward.reward_kwargs.max_resp_len", "reward_model.reward_kwargs.max_resp_len")
# verl's validation sampling: grpolab eval's (training leaves them aside: VERL_ASIDE)
VAL_KWARGS = tuple(R + "val_kwargs." + k for k in ("n", "do_sample", "temperature", "top_p",
                                                    "top_k"))
# verl keys read with others (grpolab.config.verl): each listed so that it is known
VERL_COMBINED = frozenset({*OVERLONG, *VAL_KWARGS, "data.gen_batch_size",
    "data.train_batch_size", A + "ppo_mini_batch_size", A + "use_kl_loss", A + "kl_loss_coef",
    A + "kl_loss_type", "algorithm.use_kl_in_reward", "algorithm.kl_ctrl.kl_coef",
    "algorithm.kl_penalty", "algorithm.kl_ctrl.type", "algorithm.adv_estimator",
    "algorithm.norm_adv_by_std_in_grpo", A + "policy_loss.loss_mode", A + "loss_agg_mode",
    A + "clip_ratio", M + "lora_rank", M + "target_modules", R + "top_k", R + "name",
    R + "do_sample", "data.shuffle", "data.train_files", "data.val_files",
    "trainer.total_epochs", "trainer.save_freq", "trainer.test_freq", "trainer.logger",
    "custom_reward_function.path", "custom_reward_function.name",
    "reward.custom_reward_function.path", "reward.custom_reward_function.name",
    "reward_model.enable", "reward_model.model.path", "algorithm.filter_groups.metric",
    "algorithm.filter_groups.max_num_gen_batches", A + "optim.lr_scheduler_type",
    A + "optim.warmup_style", A + "optim.lr_warmup_steps", A + "optim.lr_warmup_steps_ratio",
    A + "optim.betas", A + "optim.optimizer", A + "optim.num_cycles", "critic.model.path",
    A + "optim.zero_indexed_step",
    "critic.ppo_mini_batch_size", "critic.ppo_epochs", "critic.loss_agg_mode",
    A + "clip_ratio_c", A + "shuffle",
    "reward.reward_model.enable", "reward.reward_model.model_path",
    "data.filter_overlong_prompts", "data.truncation", "data.reward_fn_key",
    "reward_model.reward_manager", "reward.reward_manager.name", "trainer.resume_mode",
    "trainer.resume_from_path"})
# keys (or the start of keys) that change nothing trained here: engines, memory, placement,
# logging names; named in one notice
VERL_ASIDE = (
    A + "fsdp_config.", A + "use_dynamic_bsz", A + "ppo_max_token_len_per_gpu",
    A + "ppo_micro_batch_size", A + "ulysses_sequence_parallel_size", A + "use_torch_compile",
    A + "checkpoint.", A + "entropy_from_logits", A + "entropy_checkpointing",
    A + "strategy", A + "data_loader_seed", A + "use_remove_padding", A + "use_fused_kernels",
    A + "calculate_entropy", A + "profiler.", A + "optim.optimizer_impl",
    A + "optim.total_training_steps",
    "actor_rollout_ref.ref.", "actor_rollout_ref.hybrid_engine",
    R + "gpu_memory_utilization", R + "tensor_model_parallel_size", R + "data_parallel_size",
    R + "log_prob_", R + "enforce_eager", R + "free_cache_engine", R + "load_format",
    R + "layered_summon", R + "max_num_batched_tokens", R + "max_num_seqs", R + "max_model_len",
    R + "enable_chunked_prefill", R + "enable_prefix_caching", R + "mode", R + "dtype",
    R + "disable_log_stats", R + "calculate_log_probs", R + "val_kwargs.", R + "prompt_length",
    R + "response_length", R + "cudagraph_capture_sizes", R + "multi_stage_wake_up",
    R + "skip_tokenizer_init", R + "agent.", R + "multi_turn.enable", R + "nnodes",
    R + "n_gpus_per_node",
    M + "use_remove_padding", M + "use_shm", M + "use_fused_kernels", M + "use_liger",
    M + "enable_activation_offload", M + "fused_kernel_options.",
    "data.filter_overlong_prompts_workers", "data.dataloader_num_workers",
    "data.return_raw_chat", "data.return_full_prompt", "data.use_shm",
    "data.val_batch_size", "data.validation_shuffle", "data.tokenizer",
    "trainer.n_gpus_per_node", "trainer.nnodes", "trainer.project_name",
    "trainer.experiment_name", "trainer.val_before_train",
    "trainer.log_val_generations", "trainer.balance_batch", "trainer.default_hdfs_dir",
    "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep", "trainer.device",
    "trainer.esi_redundant_time", "trainer.ray_wait_register_center_timeout",
    "trainer.del_local_ckpt_after_load", "trainer.rollout_data_dir",
    "trainer.validation_data_dir", "ray_kwargs.", "global_profiler.", "transfer_queue.",
    "critic.model.fsdp_config.", "critic.model.use_remove_padding",
    "critic.model.enable_gradient_checkpointing", "critic.ppo_micro_batch_size",
    "critic.ppo_max_token_len_per_gpu", "critic.use_dynamic_bsz", "critic.strategy",
    "critic.optim.optimizer_impl", "critic.optim.total_training_steps",
    "algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.target_kl", "reward.reward_manager.source",
    "reward.reward_manager.module.", "reward.num_workers", "reward_model.num_workers",
    "reward.reward_model.rollout.", "reward.reward_model.enable_resource_pool",
    "reward.reward_model.n_gpus_per_node", "reward.reward_model.nnodes",
    "algorithm.filter_groups.max_inflight_gen_batches")

# verl 0.9.1's defaults (trainer/config/_generated_ppo_trainer.yaml; a test reads that file)
VERL_DEFAULTS: dict[str, object] = {
    "algorithm.adv_estimator": "gae", A + "use_kl_loss": False, "algorithm.use_kl_in_reward":
    False, R + "n": 1, A + "loss_agg_mode": "token-mean", A + "clip_ratio_c": 3.0,
    A + "optim.lr": 1e-6, A + "optim.weight_decay": 0.01, M + "lora_rank": 0,
    "data.max_response_length": 512, "data.max_prompt_length": 512,
    M + "enable_gradient_checkpointing": True, "trainer.total_epochs": 30,
    "trainer.save_freq": -1, "trainer.test_freq": -1, "data.shuffle": True,
    "data.train_batch_size": 1024, A + "ppo_mini_batch_size": 256}
# grpolab train's defaults that are not verl's: grpolab's value as the warning shows it, verl's
# (from VERL_DEFAULTS), the keys in either naming that set it, and verl's value in its names
# (what ``defaults: verl`` sets; {}: none grpolab has)
VERL_DEFAULTS_DIFFER: tuple[tuple[str, str, tuple[str, ...], dict[str, object]], ...] = (
    ("estimator {estimator}", "verl's algorithm.adv_estimator gae (PPO, a value model)",
     ("algorithm.adv_estimator", "estimator"), {"algorithm.adv_estimator": "gae"}),
    ("beta {beta}", "verl: no KL term (use_kl_loss, use_kl_in_reward false)",
     (A + "use_kl_loss", "algorithm.use_kl_in_reward", "beta"), {A + "use_kl_loss": False}),
    ("group_size {group_size}", "verl's rollout.n 1", (R + "n", "group_size"), {R + "n": 1}),
    ("budget {budget}", "verl's data.train_batch_size 1024 prompts x rollout.n",
     ("data.train_batch_size", "budget"), {"data.train_batch_size": 1024}),
    ("loss_agg {loss_agg}", "verl's loss_agg_mode token-mean", (A + "loss_agg_mode", "loss_agg"),
     {A + "loss_agg_mode": "token-mean"}),
    ("dual_clip {dual_clip}", "verl's clip_ratio_c 3.0", (A + "clip_ratio_c", "dual_clip"),
     {A + "clip_ratio_c": 3.0}),
    ("std {std} + std_eps {std_eps}", "verl: the sample std + 1e-6", ("std", "std_eps"),
     {"std": "sample", "std_eps": 1e-6}),
    ("lr {lr}", "verl's optim.lr 1e-06", (A + "optim.lr", "lr"), {A + "optim.lr": 1e-6}),
    ("weight_decay {weight_decay}", "verl's optim.weight_decay 0.01",
     (A + "optim.weight_decay", "weight_decay"), {A + "optim.weight_decay": 0.01}),
    ("lora {lora}", "verl's lora_rank 0: full fine-tuning", (M + "lora_rank", "lora"),
     {M + "lora_rank": 0}),
    ("max_new_tokens {max_new_tokens}", "verl's max_response_length 512",
     ("data.max_response_length", "max_new_tokens"), {"data.max_response_length": 512}),
    ("max_prompt_tokens {max_prompt_tokens}", "verl's max_prompt_length 512",
     ("data.max_prompt_length", "max_prompt_tokens"), {"data.max_prompt_length": 512}),
    ("gradient_checkpointing {gradient_checkpointing}", "verl true",
     (M + "enable_gradient_checkpointing", "gradient_checkpointing"),
     {M + "enable_gradient_checkpointing": True}),
    ("steps {steps}", "verl's total_epochs 30",
     ("trainer.total_training_steps", "trainer.total_epochs", "steps", "passes"),
     {"trainer.total_epochs": 30}),
    ("checkpoint_every {checkpoint_every}", "verl's save_freq -1: none",
     ("trainer.save_freq", "checkpoint_every"), {"trainer.save_freq": -1}),
    ("eval_every {eval_every}", "verl's test_freq -1: before training only",
     ("trainer.test_freq", "eval_every", "eval_size"), {"trainer.test_freq": -1}),
    ("prompt_order {prompt_order}", "verl's data.shuffle true: shuffled passes",
     ("data.shuffle", "prompt_order"), {"data.shuffle": True}),
    ("rewards {rewards}", "verl's default_compute_score by data_source",
     ("custom_reward_function.path", "reward.custom_reward_function.path",
      "reward_model.enable", "reward.reward_model.enable", "rewards"), {}),
    ("dtype {dtype}", "verl: bfloat16 compute", ("dtype",), {}),
)
