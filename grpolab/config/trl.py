"""TRL's GRPOConfig names for grpolab's settings (the TrainingArguments it inherits,
ModelConfig's and `trl grpo`'s script arguments included; every field of the three is
classified): a TRL YAML file loads as it is, each key it sets meaning what it means to TRL
1.16, or is refused in one line where grpolab has no equivalent. The keys it leaves out take
grpolab's defaults; ``TRL_DEFAULTS_DIFFER`` names those that are not TRL's (one warning).

``TRL_ALIASES`` renames keys one to one; ``TRL_VALUES`` maps TRL values that choose several
grpolab settings at once; ``TRL_FIXED`` are settings grpolab has at one value only;
``TRL_ASIDE`` change nothing that is trained (logging, the Hub, data loading, speed, vLLM's
engine) and are left aside with one notice (those three tables: ``trl_fields``); ``from_trl``
translates a dict and refuses contradictions.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from typing import Any

from grpolab.config import open_r1
from grpolab.config.schema import ConfigError
from grpolab.config.trl_fields import BATCH as _BATCH
from grpolab.config.trl_fields import TRL_ASIDE, TRL_DEFAULTS_DIFFER, TRL_FIXED, TRL_VALUES
from grpolab.config.trl_fields import VLLM_FIXED as _VLLM_FIXED
from grpolab.config.trl_values import (
    as_number,
    as_word,
    batch_settings,
    dataset_spec,
    generation_settings,
    generation_steps,
    mixture,
    per_batches,
    processes,
    run_share,
    schedule_options,
    script_rewards,
    warmup_batches,
    whole_count,
    with_revision,
)
from grpolab.config.values import coerce

# TRL GRPOConfig names -> grpolab's, where they differ (same meaning, value as is).
TRL_ALIASES: dict[str, str] = {
    "num_generations": "group_size",
    "num_iterations": "epochs",
    "epsilon": "eps_low",
    "epsilon_high": "eps_high",  # cispo_max when loss_type is cispo
    "delta": "dual_clip",
    "off_policy_mask_threshold": "off_policy_mask",  # unset: 0, off; its 0 is refused
    "sapo_temperature_pos": "sapo_tau_pos",
    "sapo_temperature_neg": "sapo_tau_neg",
    "use_bias_correction_kl": "kl_is_correction",
    "mask_truncated_completions": "mask_truncated",
    "max_completion_length": "max_new_tokens",
    "learning_rate": "lr",
    "max_grad_norm": "grad_clip",
    "max_steps": "steps",  # these three count optimiser steps: / num_iterations
    "save_steps": "checkpoint_every",  # and save_model_every: TRL's checkpoint-N folders
    "eval_steps": "eval_every",
    "output_dir": "out_dir",
    "model_name_or_path": "model_path",  # ModelConfig's
    "use_peft": "lora",  # ModelConfig's
}
# Names of earlier TRL and transformers versions that recipes still carry, read as TRL 1.16's
# (one notice): transformers 5 renamed torch_dtype to dtype and folded warmup_ratio into
# warmup_steps (below 1: a share); TRL's max_prompt_length kept a prompt's last tokens, as
# max_prompt_tokens does; overwrite_output_dir (None: left aside) deleted nothing.
TRL_RENAMED: dict[str, str | None] = {"torch_dtype": "dtype", "warmup_ratio": "warmup_steps",
                                      "max_prompt_length": "max_prompt_tokens",
                                      "overwrite_output_dir": None, "vllm_device": None}
_OPT_STEPS = ("max_steps", "save_steps", "eval_steps")  # (warmup_steps: ``warmup_batches``)
# aliases whose None (TRL's "unset") grpolab reads: delta off, epsilon_high = epsilon,
# eval_steps = logging_steps, TRL's own output folder, no model named here, no off-policy mask
_UNSET_OK = ("delta", "epsilon_high", "eval_steps", "output_dir", "model_name_or_path",
             "off_policy_mask_threshold")
# grpolab's own keys, also TRL's, whose None is grpolab's []: every reward weighs 1; peft's
# default modules for the architecture
_NONE_IS_EMPTY = ("reward_weights", "lora_target_modules")
# grpolab's own keys, also TRL's, whose None (TRL's unset) is off: no min-p filter, no options
_NONE_IS = {"min_p": 0.0, "chat_template_kwargs": {}, "save_total_limit": 0}  # (0: all kept)
# `trl grpo`'s script arguments: its reward functions (as grpolab's reward specs) and reward
# model, which it puts first
_SCRIPT = ("reward_funcs", "reward_model_name_or_path", "dataset_name")
_SPLITS = ("dataset_config", "dataset_train_split", "dataset_test_split")  # with dataset_name
_MIXTURE = ("datasets",)  # DatasetMixtureConfig's (trl_values.mixture; the rest: aside)
TRL_KEYS = frozenset({*TRL_ALIASES, *TRL_VALUES, *TRL_FIXED, *_VLLM_FIXED, *TRL_ASIDE,
                      *_BATCH, *_SCRIPT, *_MIXTURE, "num_train_epochs", "generation_kwargs",
                      "lr_scheduler_kwargs", *open_r1.KEYS,  # (open-r1's recipes: TRL's)
                      "resume_from_checkpoint",  # (as --resume: config.load.resume_asked)
                      "model_revision"})  # (a Hub id's, as model_path ID@REVISION)
_LORA_ONLY = ("lora_r", "lora_alpha", "lora_dropout")
log = logging.getLogger("grpolab")


def renamed(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with the earlier names of ``TRL_RENAMED`` under today's (one notice); an
    earlier name beside its new one is refused."""
    old = [k for k in given if k in TRL_RENAMED]
    if not old:
        return given
    out = {}
    for key, value in given.items():
        new = TRL_RENAMED.get(key, key)
        if new is not None and new != key and new in given:
            raise ConfigError(f"{key} (an earlier TRL name of {new}) and {new} are both given; "
                              f"keep {new}")
        if value is None and key in TRL_RENAMED and new != "max_prompt_tokens":
            continue  # an earlier name unset: the new key's default
        if new == "max_prompt_tokens" and value is None:
            value = 0  # TRL's unset: whole prompts (grpolab: the model's limit)
        ratio = as_number(value) if key == "warmup_ratio" else None
        if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio >= 1:
            raise ConfigError(f"warmup_ratio: {value!r} warms up the whole run; give "
                              "warmup_steps (a count, or below 1 a share)")
        if new is not None:
            out[new] = value
    log.warning("earlier TRL names read as TRL 1.16's: %s", ", ".join(
        f"{k} as {TRL_RENAMED[k]}" if TRL_RENAMED[k] else f"{k} left aside" for k in old))
    return out


def unset_defaults(given: set[str] | Any, cfg: Any) -> list[str]:
    """``TRL_DEFAULTS_DIFFER``'s entries that none of ``given`` (the keys of the file and of
    the overrides) sets, each as "grpolab's value (TRL's)"."""
    shown = {k: str(v).lower() if isinstance(v, bool) else v for k, v in vars(cfg).items()}
    same = {"prompt_order": cfg.prompt_order == "epochs",  # (TRL's order, set by its epochs)
            "eval_every": not cfg.eval_dataset}  # (nothing held out: nothing evaluated)
    return [f"{ours.format_map(shown)} ({theirs})" for ours, theirs, keys, _ in TRL_DEFAULTS_DIFFER
            if not set(given) & set(keys) and (cfg.lora or ours.split()[0] not in _LORA_ONLY)
            and not same.get(ours.split()[0])]


def from_trl(given: dict[str, Any], later: dict[str, Any] | None = None,
             earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """Translate TRL keys in ``given`` to grpolab's (other keys pass unchanged).

    ``epsilon`` without ``epsilon_high`` sets both clips, as in TRL; ``delta: null`` is 0 (off).
    A TRL key and the grpolab key it maps to (or two TRL keys) that disagree are an error.
    ``earlier`` (a YAML file) and ``later`` (overrides): the settings given before and after
    ``given``, read where TRL combines several keys (the batch, ``num_iterations``' step
    counts, the clips, warm-up, the rewards): a file's ``per_device_train_batch_size`` and an
    override's ``gradient_accumulation_steps`` multiply as in TRL. Only ``given``'s keys are
    translated, less those ``later`` sets again.
    """
    later, earlier = mixture(later or {}, say=False), mixture(earlier or {}, say=False)
    given = with_revision(mixture(given), {**earlier, **given, **later})
    if "top_k" in given and given["top_k"] is None and "top_k" in later:
        given = {k: v for k, v in given.items() if k != "top_k"}  # (the later one is read)
    if "top_k" in given and given["top_k"] is None:
        raise ConfigError("top_k: null (TRL) leaves it to the model's generation config (50 by "
                          "default); give a number (0: all tokens)")
    given = {k: _NONE_IS.get(k, v) if v is None else v for k, v in given.items()}
    over_trl = "warmup_steps" in given and any(k in TRL_KEYS for k in earlier or {})
    if not any(k in TRL_KEYS for k in given) and not over_trl:  # (a warm-up given over a
        return dict(given)  # TRL file is TRL's: its count, its first step at lr 0)
    d = {**earlier, **given, **later}  # what the run is given: read for what TRL combines
    out = {k: [] if v is None and k in _NONE_IS_EMPTY else v
           for k, v in given.items() if k not in TRL_KEYS}
    if as_word(d.get("disable_dropout")) == "true" and "disable_dropout" not in later:
        out.pop("lora_dropout", None)  # TRL zeroes LoRA's dropout too, after lora_dropout
    source: dict[str, str] = {}  # grpolab key -> the TRL key that set it

    def put(key: str, value: Any, trl_key: str) -> None:
        try:
            coerce(key, value)
        except ConfigError as e:  # named as the user wrote it
            raise ConfigError(f"{trl_key}: {d[trl_key]!r} (TRL, grpolab's {key}): {e}") from None
        if key in out and _same(key, out[key], value) is False:
            was = f"{source[key]} (TRL)" if key in source else key
            raise ConfigError(f"{trl_key}: {d[trl_key]!r} (TRL) sets {key} to {value!r}, but "
                              f"{was} sets it to {out[key]!r}; keep one of them")
        out.setdefault(key, value)
        source.setdefault(key, trl_key)

    _refuse({k: v for k, v in given.items() if k not in later}, d, (earlier, given, later))
    # optimiser steps per sampled batch: passes x TRL's steps per generation batch
    per_sample = whole_count(d, "num_iterations", 1) * generation_steps(d)
    skip = {"save_steps" if as_word(d.get("save_strategy")) in ("no", "epoch") else "",
            "eval_steps" if as_word(d.get("eval_strategy")) in ("no", "epoch") else "",
            "bf16" if d.get("bf16") is None and as_word(d.get("fp16")) == "true" else "",
            # TRL's GDPO scales each reward over its group whatever scale_rewards says
            "scale_rewards" if as_word(d.get("multi_objective_aggregation")) == "normalize_then_sum"
            else ""}
    loss_type, level = as_word(d.get("loss_type")), as_word(d.get("importance_sampling_level"))
    cispo = loss_type == "cispo"
    if {"loss_type", "importance_sampling_level"} & given.keys():
        _loss_type_notes(loss_type, level, d)
    if level == "sequence" and loss_type in ("cispo", "sapo", "vespo"):  # their own level
        skip.add("importance_sampling_level")
        put("ratio_level", "sequence", "importance_sampling_level")
    # the run's length for a share: a grpolab steps or passes given later, or beside it over
    # an earlier max_steps, replaces that max_steps
    over = later.keys() | (given.keys() if "max_steps" not in given else set())
    run = {**d, "max_steps": -1, **({} if "steps" in over else {"steps": None})} if (
        {"steps", "passes"} & over) else d
    for trl_key, value in given.items():
        if trl_key in skip or trl_key in later:
            continue
        if trl_key in TRL_VALUES:
            table, word = TRL_VALUES[trl_key], None if value is None else as_word(value)
            if word not in table:
                quote = (" (YAML reads an unquoted no as false: write 'no')"
                         if word == "false" and "no" in table else "")
                raise ConfigError(f"{trl_key}: {value!r} (TRL) has no grpolab equivalent; "
                                  f"grpolab reads {', '.join(k for k in table if k)}{quote}")
            for key, v in table[word].items():
                if not (key == "dtype" and as_word(d.get("dtype")) == "auto"):  # (it decides)
                    put(key, v, trl_key)
        elif trl_key in TRL_ALIASES:
            value = value if trl_key in ("output_dir", "model_name_or_path") else as_number(value)
            if trl_key == "max_steps" and value == -1:  # TRL: num_train_epochs decides
                continue
            if value is None:
                if trl_key not in _UNSET_OK:
                    raise ConfigError(f"{trl_key}: null (TRL's unset) has no grpolab "
                                      "equivalent; give it a value")
                if trl_key in ("delta", "off_policy_mask_threshold"):
                    put(TRL_ALIASES[trl_key], 0.0, trl_key)
                continue
            if trl_key in ("save_steps", "eval_steps"):  # (below 1: a share of the run)
                value = run_share(trl_key, value, run, per_sample)
            if trl_key in _OPT_STEPS and per_sample > 1:
                value = per_batches(trl_key, value, per_sample)
            key = "cispo_max" if trl_key == "epsilon_high" and cispo else TRL_ALIASES[trl_key]
            put(key, value, trl_key)
            if trl_key == "save_steps":  # TRL saves its checkpoint-N model folders with it
                put("save_model_every", value, trl_key)
            if trl_key == "off_policy_mask_threshold" and not coerce(key, value) > 0:
                raise ConfigError(f"off_policy_mask_threshold: {value!r} (TRL) must be > 0 here "
                                  "(grpolab's off_policy_mask 0 is off)")
    if ({"epsilon", "epsilon_high", "loss_type"} & given.keys()
            and d.get("epsilon_high") is None):  # TRL: epsilon_high = epsilon, cispo's cap too
        if cispo:
            put("cispo_max", d.get("epsilon", 0.2), "loss_type")
        elif d.get("epsilon") is not None and "eps_high" not in out:
            put("eps_high", d["epsilon"], "epsilon")
    if ({"entropy_coef", "use_adaptive_entropy"} & given.keys()
            and "entropy_agg" not in d):  # TRL's bonus is always a token mean
        put("entropy_agg", "token_mean", "entropy_coef" if "entropy_coef" in given
            else "use_adaptive_entropy")
        if whole_count(d, "gradient_accumulation_steps", 1) * processes() > 1:
            log.warning("entropy_coef (TRL) with several micro-batches: TRL averages each "
                        "micro-batch's token mean of the entropy, grpolab takes the whole "
                        "batch's (the same with one micro-batch)")
    if given.get("generation_kwargs") and "generation_kwargs" not in later:
        out.update(generation_settings(given["generation_kwargs"], d.get("temperature", 1.0)))
    if ({"lr_scheduler_kwargs", "lr_scheduler_type"} & given.keys()
            and "lr_scheduler_kwargs" not in later):
        for key, value in schedule_options(d).items():
            put(key, value, "lr_scheduler_kwargs")
    counts_epochs = "num_train_epochs" in given or as_number(given.get("max_steps")) == -1
    if counts_epochs and not {"shuffle_dataset", "prompt_order"} & d.keys():
        put("prompt_order", "epochs", "num_train_epochs" if "num_train_epochs" in d
            else "max_steps")  # (TRL's sampler: shuffled passes; kept when --steps extends)
    if counts_epochs and not (
            "steps" in d or "passes" in later or as_number(d.get("max_steps", -1)) != -1):
        # TRL: epochs over the dataset (3 unless given), counted when the data is read (an
        # earlier layer's passes are replaced, as a later steps replaces them)
        key = "num_train_epochs" if "num_train_epochs" in d else "max_steps"
        put("passes", d.get("num_train_epochs", 3.0), key)
        if not coerce("passes", d.get("num_train_epochs", 3.0)) > 0:  # (grpolab's 0: unset)
            raise ConfigError(f"num_train_epochs: {d.get('num_train_epochs')!r} (TRL) must be "
                              "a number of epochs > 0 (or give max_steps)")
    if "warmup_steps" in given:  # TRL's: optimiser steps, or below 1 a share of max_steps
        out["warmup_steps"] = warmup_batches(d, per_sample)
        if as_number(d["warmup_steps"]) and "warmup_from_zero" not in d:  # (transformers':
            # the first warm-up step at lr 0)
            put("warmup_from_zero", True, "warmup_steps")
    if ({"eval_strategy", "eval_steps", "logging_steps"} & given.keys()
            and as_word(d.get("eval_strategy")) == "steps" and d.get("eval_steps") is None):
        # transformers: eval_steps unset = logging_steps (10 by default)
        every = run_share("logging_steps", d.get("logging_steps", 10), run, per_sample)
        put("eval_every", every if isinstance(every, float) and every < 1 else per_batches(
            "logging_steps", every, per_sample), "logging_steps" if "logging_steps" in d
            else "eval_strategy")
    rewards = script_rewards(d) if set(_SCRIPT) & given.keys() else []
    if rewards:
        put("rewards", rewards, "reward_funcs" if "reward_funcs" in d
            else "reward_model_name_or_path")
        if "reward_funcs" in given and "answer_column" not in d:  # (they read their columns
            put("answer_column", "", "reward_funcs")  # by name: no answer column needed)
    # TRL's script's dataset, unless a dataset is given in the same layer or a later one
    layers = (earlier, given, later)
    hub = bool(d.get("dataset_name")) and _after(layers, "dataset_name", "dataset")
    if hub and {"dataset_name", *_SPLITS} & given.keys() and not {"dataset_name", *_SPLITS} & (
            later.keys()):  # (translated in the last layer that names it)
        put("dataset", dataset_spec(d, "dataset_train_split", "train"), "dataset_name")
        if as_word(d.get("eval_strategy", "no")) != "no" and not d.get("datasets") and _after(
                layers, "dataset_name", "eval_dataset"):
            put("eval_dataset", dataset_spec(d, "dataset_test_split", "test"), "dataset_name")
    for key, value in open_r1.translated(d).items():
        put(key, value, "dataset_prompt_column")
    open_aside = open_r1.aside(d)
    batch = [k for k in _BATCH if given.get(k) is not None]
    if batch:
        for key, value in batch_settings(d, _last((earlier, given, later), "group_size",
                                              "num_generations"),
                                     "budget" not in given.keys() | later.keys()).items():
            put(key, value, batch[0])
    aside = sorted(k for k in given if (
        k in TRL_ASIDE or (k in _VLLM_FIXED and not _vllm(d)) or k in skip or k in open_aside
        or (k == "dataset_name" and not hub and not d.get("dataset")))
                   and k not in source.values() and not (hub and k in _SPLITS) and k not in later)
    if aside:
        log.warning("TRL settings left aside (they change nothing that is trained here): %s",
                    ", ".join(aside))
    if "dataset_name" in given and not hub and d.get("dataset") and "dataset_name" not in later:
        log.warning("dataset_name %r (TRL's script) is replaced by dataset %r, given with it or "
                    "after it", d["dataset_name"], d["dataset"])
    return out


def _refuse(given: dict[str, Any], d: dict[str, Any],
            layers: tuple[dict[str, Any], ...]) -> None:
    """The TRL settings grpolab cannot honour, all named in one line (a ConfigError), so a
    recipe's are found in one run: ``given``'s own, and those of what the run is given (``d``;
    ``layers``: the file, then overrides)."""
    out = []
    no_vllm = as_word(given.get("use_vllm")) == "true" and not vllm_installed()
    if no_vllm:  # (then vLLM's own settings are not refused besides)
        out.append("use_vllm: true (TRL) needs the vllm package and a CUDA GPU, and vllm is not "
                   "installed here: set use_vllm: false (grpolab samples on its own)")
    fixed = {**TRL_FIXED, **(_VLLM_FIXED if _vllm(d) and not no_vllm else {})}
    if as_word(given.get("use_vllm")) == "true" and "vllm_importance_sampling_correction" not in d:
        given = {**given, "vllm_importance_sampling_correction": True}  # TRL's default
    out += [f"{key}: {given[key]!r} (TRL) has no grpolab equivalent: {why}"
            for key, (values, why) in fixed.items() if key in given
            and as_number(given[key]) not in values
            and as_word(given[key]) not in {as_word(v) for v in values}]
    if as_word(given.get("push_to_hub")) == "true":
        out.append("push_to_hub: true (TRL): grpolab does not upload (the final model is saved "
                   "to out_dir/final): set push_to_hub: false")
    half = ("fp16" if as_word(d.get("fp16")) == "true" else
            "bf16" if "bf16" in d and as_word(d["bf16"]) in ("true", "none") else None)
    lora = _last(layers, "lora", "use_peft")
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(half or "")
    if half and as_word(lora) == "false" and as_word(_last(layers, "dtype")) not in (dtype,
                                                                                    "auto"):
        out.append(f"{half} (TRL) with full fine-tuning: TRL keeps float32 weights under "
                   "autocast, grpolab would train the weights in that precision; set "
                   f"{half}: false (TRL's unset is on) or dtype: {dtype}, knowingly")
    if (as_word(d.get("lr_scheduler_type")) == "constant"
            and as_number(d.get("warmup_steps", 0)) not in (0, None)):
        out.append("lr_scheduler_type: constant (TRL) has no warm-up (transformers ignores "
                   "warmup_steps there): use constant_with_warmup, or drop warmup_steps")
    if as_word(d.get("loss_type")) == "bnpo" and (
            whole_count(d, "gradient_accumulation_steps", 1) * processes() > 1):
        out.append("loss_type: bnpo (TRL) with several micro-batches averages each one's token "
                   "mean; grpolab's token mean is the whole batch's (TRL's dapo): use "
                   "loss_type: dapo")
    if out:
        raise ConfigError("; and ".join(out))


def _vllm(d: dict[str, Any]) -> bool:
    return as_word(d.get("use_vllm")) == "true" or as_word(d.get("rollout_backend")) == "vllm"


def _after(layers: tuple[dict[str, Any], ...], key: str, other: str) -> bool:
    """Whether ``key`` is set (not empty) in a later layer than any that sets ``other``."""
    def last(k: str) -> int:
        return max((i for i, layer in enumerate(layers) if layer.get(k)), default=-1)

    return last(key) > last(other)


def _last(layers: tuple[dict[str, Any], ...], *keys: str) -> Any:
    """The value of the last layer (file, then overrides) that sets one of ``keys``."""
    for layer in reversed(layers):
        for key in keys:
            if key in layer:
                return layer[key]
    return None


def vllm_installed() -> bool:
    return "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None


def _loss_type_notes(loss_type: str, level: str, d: dict[str, Any]) -> None:
    """TRL's warnings on loss_type beside importance_sampling_level."""
    if level == "sequence" and loss_type == "vespo":
        log.warning("loss_type: vespo with importance_sampling_level: sequence: VESPO weighs "
                    "answers by their own ratio; the level changes only the KL's correction "
                    "(TRL warns too)")
    if loss_type == "luspo" and level != "sequence":
        log.warning("loss_type: luspo without importance_sampling_level: sequence is PPO's "
                    "token ratio summed per answer (TRL warns too: LUSPO's is sequence level)")
    if level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        log.warning("importance_sampling_level: sequence with loss_type: %s sums token losses, "
                    "weighting each answer by its length (TRL warns too: GSPO's paper uses "
                    "loss_type: grpo)", loss_type)
    if loss_type == "cispo" and d.get("epsilon_high") is None:
        log.warning("loss_type: cispo without epsilon_high caps the importance weight at "
                    "epsilon, %s, as TRL does (TRL's docs recommend epsilon_high: 5.0)",
                    d.get("epsilon", 0.2))


def _same(key: str, a: Any, b: Any) -> bool | None:
    """Whether two values of a config key agree once read as its type (None if unreadable)."""
    try:
        return coerce(key, a) == coerce(key, b)
    except ConfigError:
        return None
