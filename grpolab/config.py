"""One typed config for every run: defaults are the workshop, YAML and the command line override.

A single flat dataclass keeps the mapping YAML key == CLI flag == attribute obvious, and lets
`validate` reject unknown keys and inconsistent combinations with one-line messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

LossAgg = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]


class ConfigError(ValueError):
    """A user-facing configuration problem; the CLI prints it on one line and exits with 2."""


@dataclass
class Config:
    """Everything a run needs. Defaults reproduce the workshop (G=8, 64 answers a step)."""

    # --- run ---
    out_dir: str = "runs/workshop"
    seed: int = 0
    steps: int = 40
    budget: int = 64  # answers generated per step (before dynamic-sampling top-ups)
    group_size: int = 8  # G: answers per prompt
    temperature: float = 1.0
    max_new_tokens: int = 8
    lr: float = 1e-3  # the workshop's "step size 0.001" (Adam)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # decay to 0 at `steps`
    warmup_steps: int = 0  # linear ramp from lr / warmup_steps up to lr
    grad_clip: float = 1.0
    epochs: int = 1  # mu: optimisation passes over one batch (old-policy ratio when > 1)
    micro_batch: int = 0  # rows per forward/backward in the update (0 = all); same step
    eval_every: int = 1
    eval_size: int = 256
    eval_samples: int = 0  # grpolab eval: answers per prompt at `temperature` for pass@k
    checkpoint_every: int = 10
    log_samples: int = 1  # groups a step written to samples.jsonl (answers, rewards); 0 = none
    progress: bool = True
    # --- GRPO maths ---
    beta: float = 0.04  # KL(k3) weight to the frozen reference
    eps_low: float = 0.2
    eps_high: float = 0.2  # DAPO clip-higher sets this above eps_low (0.28)
    loss_agg: LossAgg = "seq_mean_token_mean"
    baseline: Literal["mean", "rloo"] = "mean"
    scale: Literal["std", "none"] = "std"  # "none" = Dr. GRPO (no std division)
    std: Literal["population", "sample"] = "population"
    std_eps: float = 0.0  # added to the std before dividing (verl uses 1e-6)
    min_std: float = 0.0  # tiny-difference guard: divide by max(std, min_std)
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
    # --- built-in world (used when model_path is empty) ---
    world_train_size: int = 1024
    world_heldout_size: int = 256
    sft_steps: int = 1500
    sft_slip: float = 0.4  # the SFT teacher forgets each carry with this probability
    cache_dir: str = ""  # where the fine-tuned start is cached; "" = ~/.cache/grpolab
    # --- real models ---
    model_path: str = ""  # local Hugging Face model directory; empty = the built-in world
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # of the model's weights
    gradient_checkpointing: bool = False  # recompute activations in backward (HF forward)
    max_prompt_tokens: int = 0  # longer prompts lose their first tokens (0 = no limit)
    dataset: str = ""  # local jsonl/parquet/csv file with prompts
    eval_dataset: str = ""
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    rewards: list[str] = field(default_factory=lambda: ["exact"])
    reward_weights: list[float] = field(default_factory=list)
    format_pattern: str = ""
    reward_on_error: float = 0.0
    lora: bool = True  # train rank-lora_r adapters; reference = adapters off (no copy)
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=list)
    use_chat_template: bool = True
    rollout_backend: Literal["hf", "vllm"] = "hf"

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
        return c

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
        if self.micro_batch < 0:
            raise ConfigError(f"micro_batch must be >= 0 (got {self.micro_batch})")
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise ConfigError(
                f"reward_weights has {len(self.reward_weights)} entries for "
                f"{len(self.rewards)} rewards"
            )
        for name, allowed in literal_fields().items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {list(allowed)} (got {getattr(self, name)!r})")


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
    """Defaults, then the YAML file, then command-line overrides; resolved and validated."""
    kwargs: dict[str, Any] = {}
    if yaml_path:
        for k, v in load_yaml(yaml_path).items():
            try:  # name the file: the user has to find the bad line
                kwargs[str(k).replace("-", "_")] = coerce(str(k).replace("-", "_"), v)
            except ConfigError as e:
                raise ConfigError(f"{yaml_path}: {e}") from None
    for k, v in (overrides or {}).items():
        if v is not None:
            kwargs[k.replace("-", "_")] = coerce(k.replace("-", "_"), v)
    return Config(**kwargs).resolved()


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
