"""TRL's GRPOConfig names for grpolab's settings: a TRL YAML file loads as it is.

``TRL_ALIASES`` renames keys one to one; ``TRL_VALUES`` maps TRL values that choose several
grpolab settings at once; ``from_trl`` translates a dict and refuses contradictions.
"""

from __future__ import annotations

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
}


def from_trl(d: dict[str, Any]) -> dict[str, Any]:
    """Translate TRL GRPOConfig keys in ``d`` to grpolab's (other keys pass unchanged).

    ``epsilon`` without ``epsilon_high`` sets both clips, as in TRL; ``delta: null`` is 0 (off).
    A TRL key and the grpolab key it maps to (or two TRL keys) that disagree are an error.
    """
    if not any(k in TRL_ALIASES or k in TRL_VALUES for k in d):
        return dict(d)
    out = {k: v for k, v in d.items() if k not in TRL_ALIASES and k not in TRL_VALUES}
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
        if trl_key in TRL_VALUES:
            table = TRL_VALUES[trl_key]
            word = str(value).strip().lower()
            if word not in table:
                raise ConfigError(f"{trl_key}: {value!r} (TRL) has no grpolab equivalent; "
                                  f"grpolab reads {', '.join(table)}")
            for key, v in table[word].items():
                put(key, v, trl_key)
        elif trl_key in TRL_ALIASES:
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
    return out


def _same(key: str, a: Any, b: Any) -> bool | None:
    """Whether two values of a config key agree once read as its type (None if unreadable)."""
    try:
        return coerce(key, a) == coerce(key, b)
    except ConfigError:
        return None
