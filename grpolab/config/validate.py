"""Checks of a config: each setting in the range where it means something, and combinations
that mean nothing refused, each with a one-line ConfigError. ``resolve`` applies the one-switch
fixes (``dr_grpo``, ``rloo``, ...) to the low-level fields first."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re

from grpolab.config.schema import Config, ConfigError, field_types, literal_fields

INTERVALS = ("eval_every", "checkpoint_every", "save_model_every")  # steps, or shares of the run
# report_to's trackers and the package each needs (grpolab.run.trackers drives them).
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio",
            "mlflow": "mlflow"}


def resolve(cfg: Config) -> Config:
    """A copy with the one-switch shortcuts applied to the low-level fields, validated."""
    c = dataclasses.replace(cfg)
    if c.dr_grpo and (c.token_level_loss or c.rloo):
        raise ConfigError("dr_grpo cannot be combined with token_level_loss or rloo")
    if c.dr_grpo:
        c.scale, c.loss_agg = "none", "seq_mean_token_sum_norm"
    if c.token_level_loss:
        c.loss_agg = "token_mean"
    if c.clip_higher:
        c.eps_high = max(c.eps_high, 0.28)
    if c.rloo:
        c.baseline, c.scale = "rloo", "none"
    for name in ("warmup_steps", *INTERVALS):  # a count reads as one (a share stays)
        if float(getattr(c, name)).is_integer():
            setattr(c, name, int(getattr(c, name)))
    validate(c)
    _validate_objective(c)
    return c

def _validate_objective(cfg: Config) -> None:
    """Combinations of the objective's settings that mean nothing, named in one line."""
    if not 0.0 <= cfg.gamma <= 1.0:
        raise ConfigError(f"gamma must be in [0, 1] (got {cfg.gamma})")
    if cfg.estimator == "ppo" and (cfg.shard == "fsdp" or cfg.critic_warmup < 0
                                   or not cfg.critic_lr > 0 or not cfg.value_clip > 0
                                   or not 0.0 <= cfg.lam <= 1.0):
        raise ConfigError("estimator ppo needs critic_lr > 0, value_clip > 0, critic_warmup >= "
                          "0 and lam in [0, 1], and runs without shard fsdp")
    if cfg.estimator != "grpo" and cfg.reward_aggregation != "sum_then_normalize":
        raise ConfigError(f"estimator {cfg.estimator} whitens the summed reward over the batch: "
                          "it takes reward_aggregation sum_then_normalize")
    if cfg.dual_clip and not cfg.dual_clip > 1 + cfg.eps_high:
        raise ConfigError(f"dual_clip must be 0 (off) or > 1 + eps_high = {1 + cfg.eps_high:g}"
                          f" (got {cfg.dual_clip}): it caps ratios above the upper clip")
    if not 0 <= cfg.cispo_min < cfg.cispo_max:
        raise ConfigError(f"cispo_max must be > cispo_min >= 0 (got {cfg.cispo_max}, "
                          f"{cfg.cispo_min})")
    if cfg.policy_loss == "gmpo" and cfg.estimator != "grpo":
        raise ConfigError(f"policy_loss gmpo averages an answer's advantages into one: it takes "
                          f"estimator grpo (one advantage per answer), not {cfg.estimator}")
    for key in ("sapo_tau_pos", "sapo_tau_neg", "vespo_lambda_pos", "vespo_lambda_neg",
                "dppo_cap", "dro_beta"):
        if not getattr(cfg, key) > 0:
            raise ConfigError(f"{key} must be > 0 (got {getattr(cfg, key)})")
    for key in ("kl_cov_ratio", "clip_cov_ratio"):
        if not 0 < getattr(cfg, key) <= 1:
            raise ConfigError(f"{key} must be in (0, 1] (got {getattr(cfg, key)}): a share of "
                              "tokens")
    if not cfg.clip_cov_lb < cfg.clip_cov_ub:
        raise ConfigError(f"clip_cov_lb must be below clip_cov_ub (got {cfg.clip_cov_lb}, "
                          f"{cfg.clip_cov_ub})")
    for key in ("vespo_k_pos", "vespo_k_neg", "off_policy_mask", "kl_cov_coef", "loss_norm_len"):
        if not getattr(cfg, key) >= 0:
            raise ConfigError(f"{key} must be >= 0 (got {getattr(cfg, key)})")
    if cfg.prompt_order != "random" and (cfg.curriculum or cfg.allocate):
        raise ConfigError(f"prompt_order {cfg.prompt_order}: the curriculum and the allocator "
                          "choose the prompts themselves; use prompt_order random with them")
    if cfg.scale == "gpg" and cfg.reward_aggregation == "normalize_then_sum":
        raise ConfigError("scale gpg multiplies by answers / answers rewarded: with "
                          "normalize_then_sum each reward would get its own factor (another "
                          "weighting); use sum_then_normalize")
    if not (0 <= cfg.min_lr_rate <= 1 and 0 <= cfg.min_lr <= cfg.lr) or (
            cfg.min_lr_rate and cfg.min_lr):
        raise ConfigError(f"min_lr_rate {cfg.min_lr_rate}, min_lr {cfg.min_lr}: give one, "
                          f"min_lr_rate in [0, 1] or min_lr in [0, lr {cfg.lr}]")
    if cfg.sync_ref_model and (cfg.lora or cfg.beta == 0 or cfg.shard == "fsdp"):
        raise ConfigError("sync_ref_model moves a frozen copy of the policy: it needs full "
                          "fine-tuning (--no-lora), beta > 0 and shard none (TRL refuses "
                          "LoRA and beta 0 too)")
    if cfg.sync_ref_model and not (0 <= cfg.ref_model_mixup_alpha <= 1
                                   and cfg.ref_model_sync_steps >= 1):
        raise ConfigError("ref_model_mixup_alpha must be in [0, 1], ref_model_sync_steps >= 1")
    if cfg.use_adaptive_entropy and not (0 <= cfg.entropy_coef_min <= cfg.entropy_coef_max
                                         and cfg.entropy_coef_delta >= 0):
        raise ConfigError("use_adaptive_entropy needs 0 <= entropy_coef_min <= entropy_coef_max "
                          "and entropy_coef_delta >= 0")
    if not 0.0 <= cfg.top_entropy_quantile <= 1.0:
        raise ConfigError("top_entropy_quantile must be in [0, 1] (got "
                          f"{cfg.top_entropy_quantile}): the share of tokens kept")
    if cfg.kl_in == "reward" and cfg.kl_is_correction:
        raise ConfigError("kl_is_correction weights the KL term of the loss; with kl_in: "
                          "reward there is none (set kl_in: loss, or drop the correction)")
    if cfg.kl_in == "reward" and cfg.reward_aggregation != "sum_then_normalize":
        raise ConfigError(f"kl_in: reward needs reward_aggregation: sum_then_normalize (got "
                          f"{cfg.reward_aggregation}): the penalty comes off the total")

def _validate_minibatches(cfg: Config) -> None:
    """Mini-batches of equal size: whole groups (or answers, shuffled) that divide evenly."""
    m = cfg.minibatches
    if m == 1:
        return
    if cfg.minibatch_order == "shuffled":
        if cfg.budget % m:
            raise ConfigError(f"minibatches {m} does not divide the budget {cfg.budget} (answers "
                              "dealt out at random, as many to each optimiser step)")
    elif cfg.allocate:
        if m > cfg.budget // cfg.allocate_max_group:
            raise ConfigError(f"minibatches {m}: the allocator may choose as few as "
                              f"{cfg.budget // cfg.allocate_max_group} groups a step")
    elif cfg.prompts_per_step % m:
        raise ConfigError(f"minibatches {m} does not divide the {cfg.prompts_per_step} prompts a "
                          "step (whole groups to each optimiser step, as verl's "
                          "ppo_mini_batch_size must divide train_batch_size)")


def validate(cfg: Config) -> None:
    """Every setting in the range where it means something, with a one-line ConfigError."""
    if cfg.group_size < (1 if cfg.estimator == "ppo" else 2):
        raise ConfigError(f"group_size must be >= 2 (got {cfg.group_size})")
    if cfg.budget % cfg.group_size:
        raise ConfigError(
            f"group_size {cfg.group_size} does not divide the budget {cfg.budget}"
        )
    for name in ("steps", "budget", "epochs", "minibatches", "max_new_tokens"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be >= 1 (got {getattr(cfg, name)})")
    for name in INTERVALS:  # a count, or below 1 a share of the run
        v = getattr(cfg, name)
        if not 0 <= v < math.inf or (v > 1 and v % 1) or (name == "eval_every" and not v > 0):
            off = "; eval_size 0 turns evaluation off" if name == "eval_every" else ""
            raise ConfigError(f"{name} must be a count of steps, or below 1 a share of the run "
                              f"(got {v:g}){off}")
    for name in ("temperature", "lr"):
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"{name} must be > 0 (got {getattr(cfg, name)})")
    if cfg.top_k < 0 or not 0 < cfg.top_p <= 1 or not 0 <= cfg.min_p <= 1:
        raise ConfigError(f"top_k {cfg.top_k}, top_p {cfg.top_p}, min_p {cfg.min_p}: top_k must "
                          "be >= 0, top_p in (0, 1], min_p in [0, 1]")
    if not (cfg.weight_decay >= 0 and 0 <= cfg.adam_beta1 < 1 and 0 <= cfg.adam_beta2 < 1
            and cfg.adam_epsilon > 0):
        raise ConfigError("weight_decay must be >= 0, adam_beta1 and adam_beta2 in [0, 1), "
                          "adam_epsilon > 0")
    if not cfg.repetition_penalty > 0:
        raise ConfigError(f"repetition_penalty must be > 0 (got {cfg.repetition_penalty})")
    if cfg.beta < 0 or cfg.eps_low < 0 or cfg.eps_high < 0:
        raise ConfigError("beta, eps_low and eps_high must be >= 0")
    _validate_allocation(cfg)
    _validate_minibatches(cfg)
    if cfg.max_sampling_rounds < 0:
        raise ConfigError("max_sampling_rounds must be >= 0")
    if cfg.max_prompt_tokens < 0:
        raise ConfigError(f"max_prompt_tokens must be >= 0 (got {cfg.max_prompt_tokens})")
    if cfg.eval_samples < 0:
        raise ConfigError(f"eval_samples must be >= 0 (got {cfg.eval_samples})")
    if not 0 <= cfg.warmup_steps < math.inf or (cfg.warmup_steps > 1 and cfg.warmup_steps % 1):
        raise ConfigError(f"warmup_steps must be a count, or below 1 a share of the run (got "
                          f"{cfg.warmup_steps})")
    if not 0 <= cfg.passes < math.inf:
        raise ConfigError(f"passes must be a finite number >= 0 (got {cfg.passes}); 0: the run "
                          "is steps long")
    if cfg.pass_batch < 0:
        raise ConfigError(f"pass_batch must be >= 0 (got {cfg.pass_batch}); 0: a step's prompts")
    if cfg.log_samples < 0:
        raise ConfigError(f"log_samples must be >= 0 (got {cfg.log_samples})")
    if not str(cfg.out_dir).strip():
        raise ConfigError("out_dir is empty: name the folder the run writes to")
    if cfg.shard == "fsdp" and cfg.lora:
        raise ConfigError("shard fsdp shards a full fine-tune: add --no-lora (LoRA's "
                          "adapters are small; run it data-parallel with shard none)")
    if cfg.micro_batch < 0:
        raise ConfigError(f"micro_batch must be >= 0 (got {cfg.micro_batch})")
    if cfg.prompt_template and "{prompt}" not in cfg.prompt_template:
        raise ConfigError("prompt_template must contain {prompt} (where the question goes)")
    bad = [s for s in cfg.answer_sources
           if s not in ("boxed", "answer_tag", "answer_line", "bare", "last_statement")]
    if bad or not cfg.answer_sources:
        raise ConfigError(f"answer_sources {cfg.answer_sources}: choose from boxed, "
                          "answer_tag, answer_line, bare, last_statement")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        raise ConfigError(f"device {cfg.device!r}: choose auto, cpu, cuda or cuda:N")
    if cfg.dataset_size < 1 or cfg.watch_window < 1:
        raise ConfigError("dataset_size and watch_window must be >= 1")
    if cfg.reward_weights and len(cfg.reward_weights) != len(cfg.rewards):
        raise ConfigError(
            f"reward_weights has {len(cfg.reward_weights)} entries for "
            f"{len(cfg.rewards)} rewards"
        )
    for name, allowed in literal_fields().items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{name} must be one of {list(allowed)} (got {getattr(cfg, name)!r})")
    _validate_ranges(cfg)
    check_report_to(cfg.report_to)


def _validate_ranges(cfg: Config) -> None:
    """Every float finite (NaN passes every `<` test) and every setting in the range where
    it means something: each of these was once accepted and wrecked a run."""
    hints = field_types()
    for f in dataclasses.fields(cfg):
        if hints[f.name] in (float, list[float]):
            value = getattr(cfg, f.name)
            for v in value if isinstance(value, list) else [value]:
                if not math.isfinite(v):
                    raise ConfigError(f"{f.name} must be a finite number (got {v})")
    if not cfg.grad_clip > 0:
        raise ConfigError(f"grad_clip must be > 0 (got {cfg.grad_clip}): it is the largest "
                          "gradient norm kept; <= 0 freezes or reverses the update")
    if not cfg.eps_low < 1 and cfg.policy_loss not in ("dppo_tv", "dppo_kl", "gmpo"):
        raise ConfigError(f"eps_low must be < 1 (got {cfg.eps_low}): the ratio's lower clip "
                          "is 1 - eps_low")
    for name in ("std_eps", "min_std", "reward_timeout"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0 (got {getattr(cfg, name)})")
    for name in ("eval_size", "save_total_limit",
                 "sft_steps", "reward_workers", "world_heldout_size", "logit_chunk"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0 (got {getattr(cfg, name)})")
    for name in ("lora_r", "lora_alpha", "world_train_size", "watch_window"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be >= 1 (got {getattr(cfg, name)})")
    for name, lo, hi in (("lora_dropout", 0.0, 0.999), ("sft_slip", 0.0, 1.0),
                         ("sft_slip_top", 0.0, 1.0), ("world_top_share", 0.0, 1.0),
                         ("world_carry_share", 0.0, 1.0),
                         ("curriculum_floor", 1e-9, 1.0), ("curriculum_decay", 1e-9, 1.0)):
        if not lo <= getattr(cfg, name) <= hi:
            raise ConfigError(f"{name} must be in [{lo:g}, {hi:g}] (got {getattr(cfg, name)})")
    for name in ("reward_on_error", "success_threshold"):
        if abs(getattr(cfg, name)) > 1e9:
            raise ConfigError(f"{name} must be within +-1e9 (got {getattr(cfg, name)})")


def _validate_allocation(cfg: Config) -> None:
    """The prediction and allocation keys (grpolab.predict)."""
    if not 0.0 < cfg.predict_decay <= 1.0:
        raise ConfigError(f"predict_decay must be in (0, 1] (got {cfg.predict_decay})")
    if cfg.predict_prior_strength < 0 or cfg.alarm_truncated_share < 0:
        raise ConfigError("predict_prior_strength and alarm_truncated_share must be >= 0")
    if not 0.0 <= cfg.allocate_explore < 1.0:
        raise ConfigError(f"allocate_explore must be in [0, 1) (got {cfg.allocate_explore})")
    if not 2 <= cfg.allocate_min_group <= cfg.allocate_max_group:
        raise ConfigError("need 2 <= allocate_min_group <= allocate_max_group (got "
                          f"{cfg.allocate_min_group}, {cfg.allocate_max_group})")
    if not cfg.allocate:
        return
    if cfg.allocate_min_group > cfg.budget:
        raise ConfigError(f"allocate_min_group {cfg.allocate_min_group} exceeds the budget "
                          f"{cfg.budget}")
    if cfg.curriculum:
        raise ConfigError("allocate chooses the prompts itself; it cannot be combined with "
                          "curriculum")
    if cfg.allocate_by_kind and not cfg.predict_group_by:
        raise ConfigError("allocate_by_kind needs predict_group_by (the column naming each "
                          "prompt's kind)")


def check_report_to(names: list[str]) -> None:
    """One-line ConfigError for an unknown tracker or one whose package is not installed."""
    for name in names:
        if name in ("none", "all"):
            continue
        if name not in TRACKER_PACKAGES:
            raise ConfigError(f"report_to: unknown tracker {name!r}; choose from "
                              f"{', '.join(TRACKER_PACKAGES)} (or none, all)")
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            raise ConfigError(f"report_to {name} needs the {TRACKER_PACKAGES[name]} package: "
                              "pip install 'grpolab[trackers]'")


def validate_ranks(cfg: Config, world: int) -> None:
    """What ``world`` processes need: whole groups on every rank and, with mini-batches (each
    rank splits its own share), equal ones on every rank; with FSDP, where every rank takes
    part in every backward, no mini-batch a rank could hold nothing of."""
    if cfg.prompts_per_step % world:
        raise ConfigError(
            f"prompts_per_step {cfg.prompts_per_step} (budget {cfg.budget} / group_size "
            f"{cfg.group_size}) cannot be split into whole groups across {world} ranks")
    m, share = cfg.minibatches, cfg.prompts_per_step // world
    if m == 1 or world == 1:
        return
    if cfg.minibatch_order == "groups" and share % m and not cfg.allocate:
        raise ConfigError(f"minibatches {m}: each of the {world} ranks holds {share} prompts a "
                          "step and splits them into its own mini-batches (as verl's ranks "
                          "do), so minibatches must divide them")
    if cfg.minibatch_order == "shuffled" and (cfg.budget // world) % m:
        raise ConfigError(f"minibatches {m}: each of the {world} ranks deals out its "
                          f"{cfg.budget // world} answers, so minibatches must divide them")
    if cfg.shard == "fsdp" and (cfg.dynamic_sampling or cfg.allocate):
        raise ConfigError("minibatches > 1 with shard: fsdp and dynamic_sampling or allocate: a "
                          "rank may hold no group of a mini-batch, and fsdp needs every rank "
                          "in every backward")


def with_length(cfg: Config, prompts: int) -> Config:
    """``cfg`` with ``passes`` turned into ``steps`` for a dataset of ``prompts`` training
    prompts: passes x the whole batches in one pass (of ``pass_batch`` prompts, else a step's;
    its part batch left out, as the data loaders of TRL and verl drop it), rounded up as
    transformers does; with ``save_each_pass`` / ``eval_each_pass``, checkpoints and model
    saves / evaluations every pass's steps. Unchanged at passes 0 without them."""
    each = [k for k in ("save_each_pass", "eval_each_pass") if getattr(cfg, k)]
    if not (cfg.passes > 0 or each):
        return cfg
    batch = _pass_batch(cfg)
    per_pass = prompts // batch
    if per_pass < 1:
        why = f"passes {cfg.passes:g}" if cfg.passes > 0 else each[0]
        raise ConfigError(f"{why}: the dataset's {prompts} prompts fill no batch of {batch}; "
                          "give steps, or more prompts")
    if cfg.save_each_pass:
        cfg = dataclasses.replace(cfg, checkpoint_every=per_pass, save_model_every=per_pass)
    if cfg.eval_each_pass:
        cfg = dataclasses.replace(cfg, eval_every=per_pass)
    if not cfg.passes > 0:
        return cfg
    steps = cfg.passes * per_pass
    if steps >= 2**53:  # (past exact floats; inf: no number of steps)
        raise ConfigError(f"passes {cfg.passes:g} x {per_pass} steps a pass is too many steps "
                          "(the limit: 2**53)")
    return dataclasses.replace(cfg, steps=math.ceil(steps))


def _pass_batch(cfg: Config) -> int:
    """The prompts a pass's batch holds: ``pass_batch`` (verl's loader's gen_batch_size), else
    a step's."""
    return cfg.pass_batch or cfg.prompts_per_step


def length_line(cfg: Config, prompts: int) -> str:
    """What ``with_length`` counted, said before the run."""
    batch = _pass_batch(cfg)
    unit = f"batches of {batch} (verl's gen_batch_size)" if cfg.pass_batch else f"steps of {batch}"
    return (f"{cfg.passes:g} pass{'' if cfg.passes == 1 else 'es'} over {prompts} prompts, "
            f"{prompts // batch} {unit} a pass: {cfg.steps} steps")


def every(cfg: Config, name: str) -> int:
    """An interval (``INTERVALS``) in steps: a count as it is, a share (below 1) of the run's
    steps rounded up, as transformers counts its save_steps / eval_steps shares; read where
    it is used, so a share follows the run's length (passes, a later --steps, a sweep's)."""
    v = getattr(cfg, name)
    return math.ceil(cfg.steps * v) if 0 < v < 1 else int(v)
