"""TRL's GRPOConfig names for grpolab's settings (the TrainingArguments it inherits and
ModelConfig's model and LoRA names included): a TRL YAML file loads as it is.

``TRL_ALIASES`` renames keys one to one; ``TRL_VALUES`` maps TRL values that choose several
grpolab settings at once; ``TRL_FIXED`` are settings grpolab has at TRL's default value only;
``TRL_IGNORED`` change nothing that is trained (logging, the Hub, data loading) and are left
aside with one notice; ``from_trl`` translates a dict and refuses contradictions.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from grpolab.config.schema import ConfigError, coerce

# TRL GRPOConfig names -> grpolab's, where they differ (same meaning, value as is).
TRL_ALIASES: dict[str, str] = {
    "num_generations": "group_size",
    "num_iterations": "epochs",
    "epsilon": "eps_low",
    "epsilon_high": "eps_high",  # cispo_max when loss_type is cispo
    "delta": "dual_clip",
    "use_bias_correction_kl": "kl_is_correction",
    "multi_objective_aggregation": "reward_aggregation",
    "mask_truncated_completions": "mask_truncated",
    "max_completion_length": "max_new_tokens",
    "learning_rate": "lr",
    "lr_scheduler_type": "lr_schedule",
    "max_grad_norm": "grad_clip",
    "max_steps": "steps",
    "output_dir": "out_dir",
    "save_steps": "checkpoint_every",
    "eval_steps": "eval_every",
    "model_name_or_path": "model_path",  # ModelConfig's
    "use_peft": "lora",  # ModelConfig's
}
# TRL settings whose values become other grpolab settings.
TRL_VALUES: dict[str, dict[str, dict[str, Any]]] = {
    "loss_type": {
        "grpo": {"loss_agg": "seq_mean_token_mean"},
        "bnpo": {"loss_agg": "token_mean"},
        "dapo": {"loss_agg": "token_mean"},
        "dr_grpo": {"loss_agg": "seq_mean_token_sum_norm"},
        "cispo": {"policy_loss": "cispo", "loss_agg": "token_mean"},
    },
    "scale_rewards": {"group": {"scale": "std"}, "true": {"scale": "std"},
                      "batch": {"scale": "batch"}, "none": {"scale": "none"},
                      "false": {"scale": "none"}},
    "importance_sampling_level": {"token": {}, "sequence": {"policy_loss": "gspo"}},
    "use_cpu": {"true": {"device": "cpu"}, "false": {}},
    # TRL's bf16/fp16 autocast over the loaded weights; here the weights themselves (LoRA
    # adapters stay float32)
    "bf16": {"true": {"dtype": "bfloat16"}, "false": {}, "none": {}},
    "fp16": {"true": {"dtype": "float16"}, "false": {}},
    "use_vllm": {"true": {"rollout_backend": "vllm"}, "false": {}},
    "vllm_mode": {"colocate": {}},  # grpolab's vLLM engine runs in the training process
    "save_strategy": {"steps": {}, "no": {"checkpoint_every": 0}},
    "eval_strategy": {"steps": {}, "no": {"eval_size": 0}},
    "disable_tqdm": {"true": {"progress": False}, "false": {}},
    "optim": {"adamw_torch": {}, "adamw_torch_fused": {}},  # AdamW at weight_decay 0 is Adam
    # TRL's true turns every dropout off, LoRA's too; grpolab turns the model's own off, always
    "disable_dropout": {"true": {"lora_dropout": 0.0}},
}
_SAMPLING = "grpolab samples the whole softmax at `temperature`"
_ADAM = "grpolab's optimiser is torch's Adam at its defaults (TRL's AdamW at weight_decay 0)"
# TRL settings grpolab has at one value, TRL's default: (the values that mean it, why).
TRL_FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "top_p": ((1.0,), _SAMPLING), "top_k": ((0, None), _SAMPLING),
    "min_p": ((None, 0.0), _SAMPLING), "repetition_penalty": ((1.0,), _SAMPLING),
    "weight_decay": ((0.0,), _ADAM), "adam_beta1": ((0.9,), _ADAM),
    "adam_beta2": ((0.999,), _ADAM), "adam_epsilon": ((1e-8,), _ADAM),
}
# TRL settings that change nothing that is trained: read, left aside, named in one notice.
TRL_IGNORED = frozenset({
    "logging_steps", "logging_strategy", "logging_first_step", "log_level",
    "log_completions", "num_completions_to_print", "run_name",
    "save_total_limit", "save_only_model", "push_to_hub", "hub_model_id", "hub_strategy",
    "hub_private_repo", "do_train", "do_eval", "dataloader_num_workers",
    "dataloader_pin_memory", "remove_unused_columns", "gradient_checkpointing_kwargs",
    "ddp_find_unused_parameters", "model_revision",
})
# TRL's batch: answers per optimiser step = per device x accumulation x processes (TRL's
# defaults: 8, 1); each process's forward/backward takes per_device rows at a time.
_BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps",
          "generation_batch_size", "steps_per_generation")
log = logging.getLogger("grpolab")


def from_trl(d: dict[str, Any]) -> dict[str, Any]:
    """Translate TRL GRPOConfig keys in ``d`` to grpolab's (other keys pass unchanged).

    ``epsilon`` without ``epsilon_high`` sets both clips, as in TRL; ``delta: null`` is 0 (off).
    A TRL key and the grpolab key it maps to (or two TRL keys) that disagree are an error.
    """
    trl_keys = {*TRL_ALIASES, *TRL_VALUES, *TRL_FIXED, *TRL_IGNORED, *_BATCH, "num_train_epochs"}
    if not any(k in trl_keys for k in d):
        return dict(d)
    out = {k: v for k, v in d.items() if k not in trl_keys}
    source: dict[str, str] = {}  # grpolab key -> the TRL key that set it

    def put(key: str, value: Any, trl_key: str) -> None:
        if key in out and _same(key, out[key], value) is False:
            was = f"{source[key]} (TRL)" if key in source else key
            raise ConfigError(f"{trl_key}: {d[trl_key]!r} (TRL) sets {key} to {value!r}, but "
                              f"{was} sets it to {out[key]!r}; keep one of them")
        out.setdefault(key, value)
        source.setdefault(key, trl_key)

    cispo = str(d.get("loss_type", "")).strip().lower() == "cispo"
    for trl_key, value in d.items():
        if trl_key in TRL_FIXED and value not in TRL_FIXED[trl_key][0]:
            raise ConfigError(f"{trl_key}: {value!r} (TRL) has no grpolab equivalent: "
                              f"{TRL_FIXED[trl_key][1]}")
        if trl_key == "push_to_hub" and value:
            raise ConfigError("push_to_hub: true (TRL): grpolab does not upload; the final "
                              "model is saved to out_dir/final")
        if trl_key in TRL_VALUES:
            table = TRL_VALUES[trl_key]
            word = str(value).strip().lower()
            if word not in table:
                raise ConfigError(f"{trl_key}: {value!r} (TRL) has no grpolab equivalent; "
                                  f"grpolab reads {', '.join(table)}")
            for key, v in table[word].items():
                put(key, v, trl_key)
        elif trl_key in TRL_ALIASES:
            if trl_key == "max_steps" and value == -1:  # TRL: num_train_epochs decides
                continue
            if value is None:  # TRL's "unset": delta off, epsilon_high = epsilon
                if trl_key == "delta":
                    put("dual_clip", 0.0, trl_key)
                continue
            key = "cispo_max" if trl_key == "epsilon_high" and cispo else TRL_ALIASES[trl_key]
            put(key, value, trl_key)
    if (d.get("epsilon") is not None and d.get("epsilon_high") is None and not cispo
            and "eps_high" not in out):
        put("eps_high", d["epsilon"], "epsilon")
    if cispo and str(d.get("importance_sampling_level", "token")).lower() == "sequence":
        raise ConfigError("loss_type: cispo with importance_sampling_level: sequence (TRL) has no "
                          "grpolab equivalent: grpolab's cispo weights each token")
    if ("num_train_epochs" in d or d.get("max_steps") == -1) and "steps" not in out:
        raise ConfigError("num_train_epochs / max_steps: -1 (TRL: epochs over the dataset): "
                          "grpolab runs a number of optimiser steps; set max_steps (or steps)")
    batch = [k for k in _BATCH if k in d]
    if batch:
        for key, value in _trl_batch(d).items():
            put(key, value, batch[0])
    ignored = sorted(k for k in d if k in TRL_IGNORED)
    if ignored:
        log.warning("TRL settings left aside (they change nothing that is trained here): %s",
                    ", ".join(ignored))
    return out


def _trl_batch(d: dict[str, Any]) -> dict[str, int]:
    """TRL's batch settings as grpolab's ``budget`` (answers per optimiser step, over all
    processes) and ``micro_batch`` (rows per forward/backward): exact where TRL samples each
    optimiser step's answers afresh (``steps_per_generation`` = the accumulation, its default)."""
    try:
        per = int(d.get("per_device_train_batch_size", 8))
        acc = int(d.get("gradient_accumulation_steps", 1))
    except (TypeError, ValueError):
        raise ConfigError("per_device_train_batch_size and gradient_accumulation_steps (TRL) "
                          "must be whole numbers") from None
    answers = per * acc * int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's processes
    if d.get("steps_per_generation") is not None and d.get("generation_batch_size") is not None:
        raise ConfigError("steps_per_generation and generation_batch_size (TRL): set one or "
                          "neither (TRL refuses both)")
    if (d.get("steps_per_generation") not in (None, acc)
            or d.get("generation_batch_size") not in (None, answers)):
        raise ConfigError("steps_per_generation / generation_batch_size (TRL): answers sampled "
                          "once for several optimiser steps have no grpolab equivalent (its "
                          "epochs reuse a step's answers within the step)")
    return {"budget": answers, "micro_batch": per}


def _same(key: str, a: Any, b: Any) -> bool | None:
    """Whether two values of a config key agree once read as its type (None if unreadable)."""
    try:
        return coerce(key, a) == coerce(key, b)
    except ConfigError:
        return None
