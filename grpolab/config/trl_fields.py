"""TRL 1.16's settings whose values choose grpolab settings (``TRL_VALUES``), that grpolab has
at one value (``TRL_FIXED``, ``VLLM_FIXED``) or that change nothing it trains (``TRL_ASIDE``):
with ``grpolab.config.trl``'s renames and translations, every field of GRPOConfig (its
TrainingArguments' included), ModelConfig and `trl grpo`'s script arguments that is not one of
grpolab's own keys."""

from __future__ import annotations

from typing import Any

# TRL's trainer divides by the sample std plus this constant
_TRL_STD = {"std": "sample", "std_eps": 1e-4}
# TRL settings whose values become other grpolab settings.
TRL_VALUES: dict[str, dict[str | None, dict[str, Any]]] = {
    "loss_type": {
        "grpo": {"loss_agg": "seq_mean_token_mean"},
        "bnpo": {"loss_agg": "token_mean"},
        "dapo": {"loss_agg": "token_mean"},
        "dr_grpo": {"loss_agg": "seq_mean_token_sum_norm"},
        "cispo": {"policy_loss": "cispo", "loss_agg": "token_mean"},
        "sapo": {"policy_loss": "sapo", "loss_agg": "seq_mean_token_mean"},
        "vespo": {"policy_loss": "vespo", "loss_agg": "token_mean"},
        # GSPO's ratio with importance_sampling_level: sequence (its paper's), PPO's without
        "luspo": {"loss_agg": "seq_mean_token_sum"},
    },
    "scale_rewards": {"group": {"scale": "std", **_TRL_STD}, "true": {"scale": "std", **_TRL_STD},
                      "batch": {"scale": "batch", **_TRL_STD}, "none": {"scale": "none"},
                      "false": {"scale": "none"}},
    "importance_sampling_level": {"token": {}, "sequence": {"policy_loss": "gspo"}},
    # GDPO in TRL: each reward over its group's sample std + 1e-4, the sum over the batch's
    "multi_objective_aggregation": {
        "sum_then_normalize": {"reward_aggregation": "sum_then_normalize"},
        "normalize_then_sum": {"reward_aggregation": "normalize_then_sum", "scale": "std",
                               **_TRL_STD}},
    # transformers' constant schedule has no warm-up (``_refuse``); constant_with_warmup has
    "lr_scheduler_type": {"linear": {"lr_schedule": "linear"}, "cosine": {"lr_schedule": "cosine"},
                          "constant": {"lr_schedule": "constant"},
                          "constant_with_warmup": {"lr_schedule": "constant"},
                          # its floor: lr_scheduler_kwargs' min_lr_rate (``schedule_options``)
                          "cosine_with_min_lr": {"lr_schedule": "cosine"}},
    "use_cpu": {"true": {"device": "cpu"}, "false": {}},
    # TRL's sampler: a shuffled pass over the data per epoch, or the data's order
    "shuffle_dataset": {"true": {"prompt_order": "epochs"},
                        "false": {"prompt_order": "sequential"}},
    # TRL autocasts over float32 weights; here the weights themselves (LoRA adapters stay
    # float32), so full fine-tuning is refused (``_refuse``). Unset (None) is on in TRL.
    "bf16": {"true": {"dtype": "bfloat16"}, None: {"dtype": "bfloat16"}, "false": {}},
    "fp16": {"true": {"dtype": "float16"}, "false": {}},
    "use_vllm": {"true": {"rollout_backend": "vllm"}, "false": {}},
    "save_strategy": {"steps": {}, "no": {"checkpoint_every": 0, "save_model_every": 0},
                      "epoch": {"save_each_pass": True}},  # (each pass's steps: with_length)
    "eval_strategy": {"steps": {}, "no": {"eval_size": 0}, "epoch": {"eval_each_pass": True}},
    "disable_tqdm": {"true": {"progress": False}, "false": {}, None: {}},
    "optim": {"adamw_torch": {}, "adamw_torch_fused": {}},  # grpolab's AdamW (Adam at weight_decay 0)
    # TRL's true zeroes every nn.Dropout after wrapping, LoRA's included, whatever lora_dropout
    # says (``from_trl``); grpolab always zeroes the model's own
    "disable_dropout": {"true": {"lora_dropout": 0.0}},
}
_SAMPLING = "grpolab samples at `temperature` with top_k, top_p, min_p, repetition_penalty"
_MODEL = "grpolab loads model_path as it is"
_LORA = "grpolab's LoRA is peft's plain LoRA of a causal LM (scale lora_alpha / lora_r)"
# TRL settings grpolab has at one value: (the values that mean it, why). Each changes what is
# trained at another value, so that value is refused.
TRL_FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    # the optimiser, its schedule and batch
    "neftune_noise_alpha": ((None,), "grpolab adds no noise to the embeddings"),
    "auto_find_batch_size": ((False,), "grpolab keeps its batch (no halving on out-of-memory)"),
    # the prompts' order
    "data_seed": ((None,), "grpolab's seed orders the prompts; set seed"),
    "accelerator_config": ((None, {}), "grpolab batches without Accelerate's options"),
    # the loss and the reference
    # None: the model's own coefficient, nothing for a dense model; grpolab adds no router loss
    "router_aux_loss_coef": ((None, 0.0), "grpolab adds no MoE router loss"),
    "cast_lm_head_to_fp32": ((False,), "grpolab runs the LM head in dtype (softmax in float32)"),
    # the model and its LoRA
    "model_init_kwargs": ((None, {}), _MODEL),
    "trust_remote_code": ((False,), "grpolab runs no model code shipped with the weights"),
    "load_in_4bit": ((False,), "grpolab loads the weights unquantised, in dtype"),
    "load_in_8bit": ((False,), "grpolab loads the weights unquantised, in dtype"),
    "lora_task_type": (("CAUSAL_LM",), _LORA), "lora_target_parameters": ((None, []), _LORA),
    "lora_modules_to_save": ((None, []), "grpolab trains the LoRA adapters only"),
    # the run: grpolab resumes out_dir's checkpoint (--resume) and keeps the last step's model
    "load_best_model_at_end": ((False,), "grpolab's final model is the last step's"),
}
# TRL's vLLM settings: with use_vllm, grpolab's engine runs in the training process, samples
# the plain softmax and has no importance-sampling correction, so these must say so.
VLLM_FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "vllm_mode": (("colocate",), "grpolab's engine runs in the training process"),
    "vllm_importance_sampling_correction": (
        (False,), "grpolab does not correct for the engine's rounding; set it to false"),
    "vllm_structured_outputs_regex": ((None,), _SAMPLING),
}
# TRL settings that change nothing that is trained: read, left aside, named in one notice.
TRL_ASIDE = frozenset({
    # logging and reporting
    "logging_strategy", "logging_first_step", "log_level", "log_level_replica",
    "log_on_each_node", "logging_nan_inf_filter", "include_num_input_tokens_seen",
    "log_completions", "num_completions_to_print", "log_multimodal", "log_unique_prompts",
    "log_completions_hub_repo", "run_name", "project", "trackio_space_id", "trackio_bucket_id",
    "trackio_static_space_id", "skip_memory_metrics", "debug",
    "logging_steps",  # (but as the evaluation's interval, see from_trl)
    # saving, the Hub, resuming
    "save_only_model", "save_on_each_node", "enable_jit_checkpoint",
    "push_to_hub", "hub_model_id", "hub_strategy", "hub_private_repo", "hub_token",
    "hub_always_push", "hub_revision", "ignore_data_skip", "restore_callback_states_from_checkpoint",
    # the held-out evaluation's own settings (it scores, trains nothing)
    "do_train", "do_eval", "do_predict", "per_device_eval_batch_size", "eval_delay",
    "eval_on_start", "prediction_loss_only", "eval_do_concat_batches", "eval_use_gather_object",
    "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics", "bf16_full_eval",
    "fp16_full_eval", "num_generations_eval", "metric_for_best_model", "greater_is_better",
    "label_names",
    # speed and memory: the same maths (to float rounding), other kernels or layouts
    "torch_compile", "torch_compile_backend", "torch_compile_mode", "use_liger_kernel",
    "liger_kernel_config", "tf32", "use_cache", "activation_checkpointing",
    "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs", "torch_empty_cache_steps",
    "pad_to_multiple_of", "cache_implementation", "attn_implementation", "full_determinism",
    "use_transformers_continuous_batching", "transformers_continuous_batching_config",
    "use_transformers_paged", "ds3_gather_for_generation",
    # data loading and processes (TRL's GRPO samples prompts with its own sampler)
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_drop_last",
    "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "dataloader_multiprocessing_context", "dataloader_in_order", "remove_unused_columns",
    "train_sampling_strategy", "length_column_name", "ddp_find_unused_parameters",
    "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend",
    "ddp_timeout", "local_rank", "ignore_bias_buffers", "fsdp", "fsdp_config", "deepspeed",
    "parallelism_config",
    "average_tokens_across_devices",  # (Trainer's compute_loss, which GRPO's replaces)
    # read by TRL only beside a setting grpolab refuses at another value
    "optim_args", "optim_target_modules",  # optimisers other than AdamW
    "label_smoothing_factor",  # Trainer's own loss
    "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage",  # load_in_4bit
    "max_tool_calling_iterations",  # tools (GRPOTrainer's argument, not the config's)
    "dataset_config", "dataset_train_split", "dataset_test_split",
    "dataset_streaming",  # dataset_name
    "streaming", "test_split_size",  # datasets (a mixture: a test split refused there)
    # vLLM's engine
    "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_server_base_url", "vllm_server_host",
    "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
    "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap",
})


# TRL's batch: answers per optimiser step = per device x accumulation x processes (TRL's
# defaults: 8, 1); each process's forward/backward takes per_device rows at a time.
BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps",
         "generation_batch_size", "steps_per_generation")
# grpolab train's defaults that are not TRL 1.16's (docs/real-models.md#trl-configs): grpolab's
# value as the warning shows it (filled in from the config), TRL's in words, the keys in either
# naming that set it, and TRL's default in its names (what ``defaults: trl`` sets; {}: none
# grpolab has). A TRL config that sets none of an entry's keys runs on grpolab's value, or with
# ``defaults: trl`` on TRL's.
TRL_DEFAULTS_DIFFER: tuple[tuple[str, str, tuple[str, ...], dict[str, Any]], ...] = (
    ("beta {beta}", "TRL 0.0", ("beta",), {"beta": 0.0}),
    ("loss_agg {loss_agg}", "TRL's loss_type dapo",
     ("loss_type", "loss_agg", "token_level_loss", "dr_grpo"), {"loss_type": "dapo"}),
    ("kl_is_correction {kl_is_correction}", "TRL's use_bias_correction_kl true",
     ("use_bias_correction_kl", "kl_is_correction"), {"use_bias_correction_kl": True}),
    ("std {std} + std_eps {std_eps}", "TRL's scale_rewards: the sample std + 1e-4",
     ("scale_rewards", "std", "std_eps", "multi_objective_aggregation"),
     {"scale_rewards": "group"}),
    ("budget {budget}", "TRL's per_device_train_batch_size 8 x gradient_accumulation_steps 1",
     (*BATCH, "budget"), {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}),
    ("micro_batch {micro_batch}", "TRL's per_device_train_batch_size 8", (*BATCH, "micro_batch"),
     {"per_device_train_batch_size": 8}),
    ("lora {lora}", "TRL's use_peft false", ("use_peft", "lora"), {"use_peft": False}),
    ("lora_r {lora_r}", "TRL 16", ("lora_r",), {"lora_r": 16}),  # (with LoRA on only)
    ("lora_alpha {lora_alpha}", "TRL 32", ("lora_alpha",), {"lora_alpha": 32}),
    ("lora_dropout {lora_dropout}", "TRL 0.05", ("lora_dropout", "disable_dropout"),
     {"lora_dropout": 0.05}),
    ("lr {lr}", "TRL's learning_rate 1e-06", ("learning_rate", "lr"), {"learning_rate": 1e-6}),
    ("lr_schedule {lr_schedule}", "TRL's lr_scheduler_type linear",
     ("lr_scheduler_type", "lr_schedule"), {"lr_scheduler_type": "linear"}),
    ("max_new_tokens {max_new_tokens}", "TRL's max_completion_length 512",
     ("max_completion_length", "max_new_tokens"), {"max_completion_length": 512}),
    ("gradient_checkpointing {gradient_checkpointing}", "TRL true", ("gradient_checkpointing",),
     {"gradient_checkpointing": True}),
    ("steps {steps}", "TRL's num_train_epochs 3",
     ("max_steps", "steps", "num_train_epochs", "passes"), {"num_train_epochs": 3}),
    ("checkpoint_every {checkpoint_every}, save_model_every {save_model_every}",
     "TRL's save_steps 500, for both", ("save_steps", "save_strategy", "checkpoint_every",
                                        "save_model_every"), {"save_steps": 500}),
    ("eval_every {eval_every}", "TRL's eval_strategy no",
     ("eval_strategy", "eval_steps", "eval_every", "eval_size"), {"eval_strategy": "no"}),
    ("seed {seed}", "TRL 42", ("seed",), {"seed": 42}),
    ("prompt_order {prompt_order}", "TRL's shuffled passes, shuffle_dataset true",
     ("shuffle_dataset", "prompt_order"), {"shuffle_dataset": True}),
    # (TRL's autocast keeps float32 weights: grpolab has no autocast, so float32 stays, said)
    ("dtype {dtype}", "TRL's bf16 autocast", ("bf16", "fp16", "dtype"), {}),
    ("the model's dropout off", "TRL's disable_dropout false", ("disable_dropout",), {}),
    ("max_prompt_tokens {max_prompt_tokens}", "TRL: whole prompts", ("max_prompt_tokens",),
     {"max_prompt_tokens": 0}),
    ("use_chat_template {use_chat_template}", ("TRL's: text prompts as written, chat prompts in "
     "the template (use_chat_template false)"), ("use_chat_template",),
     {"use_chat_template": False}),
)
