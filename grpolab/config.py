"""One typed config for every run: defaults are the workshop, YAML and the command line override.

A single flat dataclass keeps the mapping YAML key == CLI flag == attribute obvious, and lets
`validate` reject unknown keys and inconsistent combinations with one-line messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .advantages import ADVANTAGE_BASELINES, ADVANTAGE_SCALES, REWARD_AGGREGATIONS, STD_KINDS
from .allocate import ALLOCATION_OBJECTIVES, validate_allocation
from .losses import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from .predict import PASS_RATE_PRIORS

# The allowed values of the objective's settings are the keys of the maths modules' registries:
# a new variant there is a new choice here, on the command line and in the workshop's presets.
LossAgg = Literal[tuple(LOSS_AGGREGATIONS)]  # type: ignore[valid-type]
PolicyLoss = Literal[tuple(POLICY_LOSSES)]  # type: ignore[valid-type]
KLEstimator = Literal[tuple(KL_ESTIMATORS)]  # type: ignore[valid-type]
Baseline = Literal[tuple(ADVANTAGE_BASELINES)]  # type: ignore[valid-type]
Scale = Literal[tuple(ADVANTAGE_SCALES)]  # type: ignore[valid-type]
StdKind = Literal[tuple(STD_KINDS)]  # type: ignore[valid-type]
RewardAggregation = Literal[tuple(REWARD_AGGREGATIONS)]  # type: ignore[valid-type]
AllocationObjective = Literal[tuple(ALLOCATION_OBJECTIVES)]  # type: ignore[valid-type]
PassRatePrior = Literal[tuple(PASS_RATE_PRIORS)]  # type: ignore[valid-type]


class ConfigError(ValueError):
    """A user-facing configuration problem; the CLI prints it on one line and exits with 2."""


@dataclass
class Config:
    """Everything a run needs. Defaults reproduce the workshop (G=8, 64 answers a step)."""

    # --- run ---
    out_dir: str = "runs/workshop"  # where metrics, samples, checkpoints and the model go
    seed: int = 0  # seeds sampling, prompt order, LoRA init and the world
    steps: int = 40  # GRPO steps (optimiser updates of one sampled batch each)
    budget: int = 64  # answers generated per step (before dynamic-sampling top-ups)
    group_size: int = 8  # G: answers per prompt
    temperature: float = 1.0  # sampling temperature; log-probs are scored at the same one
    max_new_tokens: int = 8  # longest answer; the Dr. GRPO length constant
    lr: float = 1e-3  # the workshop's "step size 0.001" (Adam)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # decay to 0 at `steps`
    warmup_steps: int = 0  # linear ramp from lr / warmup_steps up to lr
    grad_clip: float = 1.0  # largest gradient norm kept (TRL max_grad_norm)
    epochs: int = 1  # mu: optimisation passes over one batch (old-policy ratio when > 1)
    micro_batch: int = 0  # rows per forward/backward in the update (0 = all); same step
    shard: Literal["none", "fsdp"] = "none"  # torchrun: fsdp shards weights, grads, Adam (full FT)
    eval_every: int = 1  # steps between held-out evaluations
    eval_size: int = 256  # held-out prompts evaluated (first rows of the split)
    eval_samples: int = 0  # grpolab eval: answers per prompt at `temperature` for pass@k
    checkpoint_every: int = 10  # steps between checkpoints (0 = none)
    log_samples: int = 1  # groups a step written to samples.jsonl (answers, rewards); 0 = none
    progress: bool = True  # show a progress bar
    report_to: list[str] = field(default_factory=list)  # trackers fed every step: tensorboard,
    #                                     wandb, trackio, mlflow, all or none ([] = none)
    # --- GRPO maths ---
    beta: float = 0.04  # KL weight to the frozen reference (TRL beta, verl kl_loss_coef)
    kl_estimator: KLEstimator = "k3"  # per-token KL: k1 log-ratio, k2 squared/2, k3 Schulman's
    kl_is_correction: bool = False  # KL times the policy ratio (TRL use_bias_correction_kl):
    #                                 the same value, another gradient
    kl_in: Literal["loss", "reward"] = "loss"  # reward: beta x the answer's summed KL comes off
    #                                            its reward instead (verl use_kl_in_reward)
    policy_loss: PolicyLoss = "clip"  # clip: PPO per-token ratio; gspo: one ratio per answer;
    #                                   cispo: clipped importance weight, REINFORCE
    eps_low: float = 0.2  # the ratio's lower clip is 1 - eps_low (TRL epsilon)
    eps_high: float = 0.2  # upper clip 1 + eps_high; DAPO clip-higher: 0.28 (TRL epsilon_high)
    dual_clip: float = 0.0  # cap the ratio of negative-advantage tokens at this (verl
    #                         clip_ratio_c, TRL delta); 0 = off
    cispo_max: float = 5.0  # cispo clips the importance weight at this (TRL epsilon_high)
    loss_agg: LossAgg = "seq_mean_token_mean"  # how token losses become one number (TRL loss_type)
    baseline: Baseline = "mean"  # mean: r - group mean (GRPO); rloo: r - mean of the others
    scale: Scale = "std"  # divide by the group's std, the batch's std, or none (Dr. GRPO)
    std: StdKind = "population"  # population (/G) or sample (/(G-1)) standard deviation
    std_eps: float = 0.0  # added to the std before dividing (verl uses 1e-6, TRL 1e-4)
    min_std: float = 0.0  # tiny-difference guard: divide by max(std, min_std)
    reward_aggregation: RewardAggregation = "sum_then_normalize"  # several rewards:
    #                                       normalize_then_sum = GDPO (each reward, then the sum)
    entropy_coef: float = 0.0  # entropy bonus: the loss minus this x the tokens' entropy
    top_entropy_quantile: float = 1.0  # the policy loss keeps this top share of tokens by
    #                                    entropy (0.2 in the 80/20 paper; 1 = every token)
    success_threshold: float = 1.0  # an answer is right when the first reward reaches this
    # --- one-switch fixes ---
    dr_grpo: bool = False  # scale="none" and loss_agg="seq_mean_token_sum_norm"
    clip_higher: bool = False  # eps_high = 0.28 (DAPO)
    token_level_loss: bool = False  # loss_agg="token_mean" (DAPO)
    rloo: bool = False  # baseline="rloo", scale="none"
    dynamic_sampling: bool = False  # DAPO: refill the batch with mixed-reward groups
    mask_truncated: bool = False  # DAPO overlong filtering: answers cut off by max_new_tokens
    #                                 (no EOS) add nothing to the loss
    max_sampling_rounds: int = 8  # extra sampling rounds allowed per step
    curriculum: bool = False  # weight prompts by recent pass rate strictly in (0, 1)
    curriculum_floor: float = 0.05  # weight of prompts with pass rate 0 or 1 (keeps exploring)
    curriculum_decay: float = 0.5  # EMA weight of the newest observation
    # --- dead-group prediction and answer allocation (grpolab.predict, grpolab.allocate) ---
    allocate: bool = False  # choose each step's prompts and group sizes from the pass-rate
    #                         posteriors to spend `budget` answers on predicted-live groups
    allocate_objective: AllocationObjective = "live_groups"  # what allocate maximises: expected
    #                                       live groups, or expected answers in live groups
    allocate_min_group: int = 4  # smallest group allocate makes
    allocate_max_group: int = 16  # largest group allocate makes
    allocate_explore: float = 0.1  # share of the budget allocate gives random prompts (revisits
    #                                prompts predicted dead)
    predict_decay: float = 0.97  # each step, past answers keep this weight in a prompt's posterior
    predict_prior_strength: float = 0.0  # a0 + b0 of the pass-rate prior; 0 = fitted (moments)
    predict_prior: PassRatePrior = "beta"  # the pass-rate prior: one Beta (moments) or a grid
    #                                       of rates with EM-fitted weights (several bands)
    alarm_truncated_share: float = 0.9  # warn NO LEARNING SIGNAL when this share of a step's
    #                                     answers hit max_new_tokens (above 1 = off)
    # --- built-in world (used when model_path is empty) ---
    world_train_size: int = 1024  # training prompts the built-in world generates
    world_heldout_size: int = 256  # held-out prompts the built-in world generates
    world_top_share: float = 0.24  # share of world prompts whose sum reaches 100
    world_carry_share: float = 0.68  # share of the world's sums below 100 with a ones carry
    sft_steps: int = 700  # SFT steps that make the built-in start (cached)
    sft_slip: float = 0.25  # the SFT teacher forgets the ones carry with this probability
    sft_slip_top: float = 1.0  # ... and the carry into the hundreds with this one
    world_lora_alpha: float = 2.0  # LoRA scale numerator of the world's policy (scale alpha/r;
    #                                lora_alpha is the real models'): sets how fast RL moves it
    cache_dir: str = ""  # where the fine-tuned start is cached; "" = ~/.cache/grpolab
    # --- real models ---
    model_path: str = ""  # HF model folder, a .gguf file or smollm2-135m-instruct; "" = world
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # of the model's weights
    gradient_checkpointing: bool = False  # recompute each layer in backward: memory for time
    logit_chunk: int = 256  # answer tokens scored through the LM head at a time (0 = all at once)
    cpu_pack: bool = True  # CPU: sample on LoRA-merged, oneDNN-prepacked weights, score frozen
    #                        linears and the head on oneDNN copies (same maths, other rounding)
    max_prompt_tokens: int = 1024  # longer prompts lose their first tokens (0 = model's limit)
    dataset: str = ""  # local jsonl/parquet/csv file or folder, or reasoning_gym:<task>
    eval_dataset: str = ""  # held-out prompts (same forms); reasoning_gym: uses another seed
    dataset_size: int = 1000  # questions a reasoning_gym: dataset generates for training
    task_config: dict[str, Any] = field(default_factory=dict)  # reasoning_gym task options
    prompt_column: str = "prompt"  # dataset column holding the prompts
    answer_column: str = "answer"  # dataset column passed to rewards as answer=
    prompt_template: str = ""  # text prompts become this with {prompt} filled in; "" = as is
    rewards: list[str] = field(default_factory=lambda: ["exact"])  # built-in, rm:DIR, file.py:fn
    answer_sources: list[str] = field(  # where math/reasoning_gym look for the final answer
        default_factory=lambda: ["boxed", "answer_tag", "answer_line", "bare"])
    watch_reward: str = ""  # strict held-out check for the reward-hacking watch ("" = off)
    watch_margin: float = 0.2  # flag when training reward rose this much more than the check
    watch_window: int = 5  # steps averaged for the training reward's start and recent level
    reward_weights: list[float] = field(default_factory=list)  # one per reward; [] = all 1
    format_pattern: str = ""  # regex of the format reward ("" = think/answer tags)
    reward_on_error: float = 0.0  # score of an answer whose reward raised or gave NaN
    lora: bool = True  # train rank-lora_r adapters; reference = adapters off (no copy)
    lora_r: int = 8  # LoRA rank
    lora_alpha: int = 16  # LoRA scale numerator (scale = alpha / r)
    lora_dropout: float = 0.0  # LoRA dropout
    lora_target_modules: list[str] = field(default_factory=list)  # [] = every linear layer
    use_chat_template: bool = True  # wrap prompts in the tokenizer's chat template
    rollout_backend: Literal["hf", "vllm"] = "hf"  # vllm: in-process engine on a GPU
    # --- reliability ---
    overwrite: bool = False  # start afresh in an out_dir holding a run (deletes its metrics, ckpts)
    reward_timeout: float = 10.0  # seconds per call of a user reward (in a worker); 0 = no limit
    reward_workers: int = 0  # worker processes for user rewards; 0 = one per core (2 to 8)
    fail_on_reward_errors: bool = True  # stop when a reward fails on every answer of a batch

    @property
    def prompts_per_step(self) -> int:
        return self.budget // self.group_size

    def resolved(self) -> Config:
        """Apply the one-switch shortcuts to the low-level fields and validate."""
        c = dataclasses.replace(self)
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
        c.validate()
        c._validate_objective()
        return c

    def _validate_objective(self) -> None:
        """Combinations of the objective's settings that mean nothing, named in one line."""
        if self.dual_clip and not self.dual_clip > 1 + self.eps_high:
            raise ConfigError(f"dual_clip must be 0 (off) or > 1 + eps_high = {1 + self.eps_high:g}"
                              f" (got {self.dual_clip}): it caps ratios above the upper clip")
        if not self.cispo_max > 0:
            raise ConfigError(f"cispo_max must be > 0 (got {self.cispo_max})")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ConfigError("top_entropy_quantile must be in [0, 1] (got "
                              f"{self.top_entropy_quantile}): the share of tokens kept")
        if self.kl_in == "reward" and self.kl_is_correction:
            raise ConfigError("kl_is_correction weights the KL term of the loss; with kl_in: "
                              "reward there is none (set kl_in: loss, or drop the correction)")
        if self.kl_in == "reward" and self.reward_aggregation != "sum_then_normalize":
            raise ConfigError(f"kl_in: reward needs reward_aggregation: sum_then_normalize (got "
                              f"{self.reward_aggregation}): the penalty comes off the total")

    def validate(self) -> None:
        if self.group_size < 2:
            raise ConfigError(f"group_size must be >= 2 (got {self.group_size})")
        if self.budget % self.group_size:
            raise ConfigError(
                f"group_size {self.group_size} does not divide the budget {self.budget}"
            )
        for name in ("steps", "budget", "epochs", "max_new_tokens", "eval_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("temperature", "lr"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.beta < 0 or self.eps_low < 0 or self.eps_high < 0:
            raise ConfigError("beta, eps_low and eps_high must be >= 0")
        validate_allocation(self)  # the prediction and allocation keys (grpolab.allocate)
        if self.max_sampling_rounds < 0:
            raise ConfigError("max_sampling_rounds must be >= 0")
        if self.max_prompt_tokens < 0:
            raise ConfigError(f"max_prompt_tokens must be >= 0 (got {self.max_prompt_tokens})")
        if self.eval_samples < 0:
            raise ConfigError(f"eval_samples must be >= 0 (got {self.eval_samples})")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0 (got {self.warmup_steps})")
        if self.log_samples < 0:
            raise ConfigError(f"log_samples must be >= 0 (got {self.log_samples})")
        if self.shard == "fsdp" and self.lora:
            raise ConfigError("shard fsdp shards a full fine-tune: add --no-lora (LoRA's "
                              "adapters are small; run it data-parallel with shard none)")
        if self.micro_batch < 0:
            raise ConfigError(f"micro_batch must be >= 0 (got {self.micro_batch})")
        if self.prompt_template and "{prompt}" not in self.prompt_template:
            raise ConfigError("prompt_template must contain {prompt} (where the question goes)")
        bad = [s for s in self.answer_sources
               if s not in ("boxed", "answer_tag", "answer_line", "bare")]
        if bad or not self.answer_sources:
            raise ConfigError(f"answer_sources {self.answer_sources}: choose from boxed, "
                              "answer_tag, answer_line, bare")
        if self.dataset_size < 1 or self.watch_window < 1:
            raise ConfigError("dataset_size and watch_window must be >= 1")
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise ConfigError(
                f"reward_weights has {len(self.reward_weights)} entries for "
                f"{len(self.rewards)} rewards"
            )
        for name, allowed in literal_fields().items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {list(allowed)} (got {getattr(self, name)!r})")
        self._validate_ranges()
        from .trackers import check_report_to  # trackers hook: names and packages checked

        check_report_to(self.report_to)

    def _validate_ranges(self) -> None:
        """Every float finite (NaN passes every `<` test) and every setting in the range where
        it means something: each of these was once accepted and wrecked a run."""
        hints = _field_types()
        for f in dataclasses.fields(self):
            if hints[f.name] in (float, list[float]):
                value = getattr(self, f.name)
                for v in value if isinstance(value, list) else [value]:
                    if not math.isfinite(v):
                        raise ConfigError(f"{f.name} must be a finite number (got {v})")
        if not self.grad_clip > 0:
            raise ConfigError(f"grad_clip must be > 0 (got {self.grad_clip}): it is the largest "
                              "gradient norm kept; <= 0 freezes or reverses the update")
        if not self.eps_low < 1:
            raise ConfigError(f"eps_low must be < 1 (got {self.eps_low}): the ratio's lower clip "
                              "is 1 - eps_low")
        for name in ("std_eps", "min_std", "reward_timeout"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (got {getattr(self, name)})")
        for name in ("eval_size", "checkpoint_every", "sft_steps", "reward_workers",
                     "world_heldout_size", "logit_chunk"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (got {getattr(self, name)})")
        for name in ("lora_r", "lora_alpha", "world_train_size", "watch_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name, lo, hi in (("lora_dropout", 0.0, 0.999), ("sft_slip", 0.0, 1.0),
                             ("sft_slip_top", 0.0, 1.0), ("world_top_share", 0.0, 1.0),
                             ("world_carry_share", 0.0, 1.0),
                             ("curriculum_floor", 1e-9, 1.0), ("curriculum_decay", 1e-9, 1.0)):
            if not lo <= getattr(self, name) <= hi:
                raise ConfigError(f"{name} must be in [{lo:g}, {hi:g}] (got {getattr(self, name)})")
        for name in ("reward_on_error", "success_threshold"):
            if abs(getattr(self, name)) > 1e9:
                raise ConfigError(f"{name} must be within +-1e9 (got {getattr(self, name)})")


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(Config)


def literal_fields() -> dict[str, tuple]:
    """Allowed values of every Literal-typed field (shared by validation and the CLI)."""
    out = {}
    for name, tp in _field_types().items():
        if typing.get_origin(tp) is Literal:
            out[name] = typing.get_args(tp)
    return out


def coerce(name: str, value: Any) -> Any:
    """Convert a YAML or command-line value to the field's declared type, or raise ConfigError."""
    types_ = _field_types()
    if name not in types_:
        close = difflib.get_close_matches(name, list(types_), n=1)
        hint = f"did you mean {close[0]!r}?" if close else "grpolab workshop --help lists them"
        raise ConfigError(f"unknown config key {name!r} ({hint})")
    tp = types_[name]
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if tp in (int, float, str):
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            if tp is not str and isinstance(value, bool):
                raise ValueError(value)
            return tp(value)
        if origin is list:
            (inner,) = typing.get_args(tp)
            if isinstance(value, str):
                value = [v for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)):
                raise ValueError(value)
            return [inner(v.strip() if isinstance(v, str) else v) for v in value]
        if origin is dict:
            if isinstance(value, str):
                value = yaml.safe_load(value) if value.strip() else {}
            if not isinstance(value, dict):
                raise ValueError(value)
            return {str(k): v for k, v in value.items()}
        if origin is Literal:
            return str(value)
        if origin in (types.UnionType, typing.Union):
            return value
    except (TypeError, ValueError):
        raise ConfigError(f"config key {name!r}: cannot read {value!r} as {_type_name(tp)}") from None
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"broken YAML in {p}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of keys to values")
    return data


def make_config(
    yaml_path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> Config:
    """Defaults, then the YAML file, then command-line overrides; resolved and validated.

    TRL's names for the same settings (``TRL_ALIASES``, ``num_generations: 8``,
    ``loss_type: dapo``...) are accepted in either and translated first (``from_trl``).
    """
    from . import trl_names  # (it reads coerce and ConfigError from here)

    kwargs: dict[str, Any] = {}
    if yaml_path:
        try:  # name the file: the user has to find the bad line
            raw = trl_names.from_trl({str(k).replace("-", "_"): v
                                      for k, v in load_yaml(yaml_path).items()})
            for k, v in raw.items():
                kwargs[k] = coerce(k, v)
        except ConfigError as e:
            raise ConfigError(f"{yaml_path}: {e}") from None
    given = {k.replace("-", "_"): v for k, v in (overrides or {}).items() if v is not None}
    for k, v in trl_names.from_trl(given).items():
        kwargs[k] = coerce(k, v)
    return Config(**kwargs).resolved()


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
