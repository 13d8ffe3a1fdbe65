"""open-r1's recipe keys (its ``GRPOScriptArguments`` and the fields its ``GRPOConfig`` adds to
TRL's; src/open_r1/configs.py at commit 1416fa0), read beside TRL's by ``grpolab.config.trl``:
its registry's ``reward_funcs`` names become ``open-r1:NAME`` rewards (grpolab.rewards.open_r1)
with the recipe's parameters, ``dataset_prompt_column`` is ``prompt_column``; ``system_prompt``
and ``chat_template`` are grpolab's own keys; the rest changes nothing trained here."""

from __future__ import annotations

import math
import re
from typing import Any

from grpolab.config.schema import ConfigError

# a reward's parameters: (open-r1's key, its default), in the order of the spec's fields
REWARD_PARAMS: dict[str, tuple[tuple[str, Any], ...]] = {
    "cosine": (("cosine_min_value_wrong", 0.0), ("cosine_max_value_wrong", -0.5),
               ("cosine_min_value_correct", 0.5), ("cosine_max_value_correct", 1.0),
               ("cosine_max_len", 1000)),
    "repetition_penalty": (("repetition_n_grams", 3), ("repetition_max_penalty", -1.0)),
    "code_format": (("code_language", "python"),),
    "soft_overlong_punishment": (("max_completion_len", 16384), ("soft_punish_cache", 4096)),
}
REWARDS = ("accuracy", "format", "tag_count", "reasoning_steps", "length", "code",
           "binary_code", *REWARD_PARAMS)
REFUSED = {"ioi_code": "IOI's", "cf_code": "Codeforces'"}  # (their judges: Piston, Morph)
PARAMS = tuple(key for params in REWARD_PARAMS.values() for key, _ in params)
LANGUAGE = re.compile(r"[A-Za-z0-9+#_-]+")  # (code_format's, a word in its regex)
# the remote code judges' settings (grpolab runs the tests in its own sandbox), the Hub's,
# Weights & Biases', and open-r1's callbacks and benchmarks
ASIDE = frozenset({
    "code_eval_test_batch_size", "code_eval_scoring_mode", "parallel_code_exec_per_proc",
    "e2b_router_url", "morph_router_url", "code_provider", "ioi_provider",
    "hub_model_revision", "overwrite_hub_revision", "push_to_hub_revision",
    "wandb_entity", "wandb_project", "wandb_run_group", "wandb_log_unique_prompts",
    "benchmarks", "callbacks",
    "dataset_configs"})  # (earlier recipes' dataset_name configs)
KEYS = frozenset({"dataset_prompt_column", "dataset_mixture", *PARAMS, *ASIDE})


def _param(key: str, value: Any, default: Any) -> Any:
    """A reward parameter of the recipe read as open-r1's field's type, or refused naming it."""
    if isinstance(default, str):
        if isinstance(value, str) and LANGUAGE.fullmatch(value):
            return value
        raise ConfigError(f"{key}: {value!r} (open-r1) must be a language's name, as python")
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if math.isfinite(number) and (not isinstance(default, int) or number.is_integer()):
        return type(default)(number)
    kind = "a whole number" if isinstance(default, int) else "a finite number"
    raise ConfigError(f"{key}: {value!r} (open-r1) must be {kind}")


def reward_spec(name: str, d: dict[str, Any]) -> str | None:
    """The grpolab reward spec of open-r1's registry name ``name`` with the recipe ``d``'s
    parameters (None: not one of open-r1's names)."""
    if name in REFUSED:
        raise ConfigError(f"reward_funcs: {name} (open-r1) runs {REFUSED[name]} tests on a "
                          "Piston or Morph judge, which grpolab does not run; its sandbox runs "
                          "Python answers (code, with the rows' tests)")
    if name not in REWARDS:
        return None
    values = [_param(key, d.get(key, default), default) for key, default in REWARD_PARAMS.get(name, ())]
    if name == "soft_overlong_punishment":  # (DAPO's formula, as overlong:MAX:BUFFER)
        return "overlong:" + ":".join(str(v) for v in values)
    return ":".join(["open-r1", name, *map(str, values)])


def reward_names(d: dict[str, Any]) -> list[Any]:
    """``reward_funcs`` as a list (a flag's ``a,b`` split, as grpolab's own list flags)."""
    funcs = d.get("reward_funcs") or []
    return [f.strip() for f in funcs.split(",") if f.strip()] if isinstance(funcs, str) else funcs


def aside(d: dict[str, Any]) -> set[str]:
    """The recipe's open-r1 keys that change nothing here: those of ``ASIDE``, the parameters
    of rewards it does not name, and a dataset mixture beside a local ``dataset``."""
    used = {key for name in reward_names(d) for key, _ in REWARD_PARAMS.get(str(name), ())}
    return ({k for k in d if k in ASIDE or (k in PARAMS and k not in used)}
            | ({"dataset_mixture"} if d.get("dataset_mixture") and d.get("dataset") else set()))


def translated(d: dict[str, Any]) -> dict[str, Any]:
    """open-r1's keys of ``d`` that set grpolab's: ``dataset_prompt_column``; a dataset
    mixture (Hub datasets) refused."""
    if d.get("dataset_mixture") and not d.get("dataset"):
        raise ConfigError("dataset_mixture (open-r1) mixes Hub datasets: grpolab reads one "
                          "dataset (a local file, a cached Hub dataset, a reasoning_gym task); "
                          "set dataset (and eval_dataset)")
    return {"prompt_column": d["dataset_prompt_column"]} if "dataset_prompt_column" in d else {}
