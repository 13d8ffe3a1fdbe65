"""Config: defaults are the workshop; YAML then CLI override; one-switch fixes resolve."""

import pytest

from grpolab.config import Config, ConfigError, make_config


def test_defaults_are_the_workshop() -> None:
    c = make_config()
    assert (c.budget, c.group_size, c.prompts_per_step) == (64, 8, 8)
    assert (c.temperature, c.epochs, c.lr, c.steps) == (1.0, 1, 1e-3, 40)
    assert (c.std, c.scale, c.baseline, c.loss_agg) == (
        "population", "std", "mean", "seq_mean_token_mean"
    )


def test_yaml_then_cli(tmp_path) -> None:
    y = tmp_path / "run.yaml"
    y.write_text("group_size: 4\nsteps: 7\nrewards: [math, format]\nlora: true\n")
    c = make_config(y, {"steps": "9", "dynamic_sampling": True})
    assert (c.group_size, c.steps, c.prompts_per_step) == (4, 9, 16)
    assert c.rewards == ["math", "format"] and c.lora and c.dynamic_sampling
    assert make_config(None, {"rewards": "a.b:f,math"}).rewards == ["a.b:f", "math"]


def test_switches_resolve() -> None:
    c = make_config(None, {"dr_grpo": True})
    assert (c.scale, c.loss_agg) == ("none", "seq_mean_token_sum_norm")
    c = make_config(None, {"clip_higher": True, "token_level_loss": True})
    assert (c.eps_low, c.eps_high, c.loss_agg) == (0.2, 0.28, "token_mean")
    c = make_config(None, {"rloo": True})
    assert (c.baseline, c.scale) == ("rloo", "none")
    with pytest.raises(ConfigError, match="dr_grpo"):
        make_config(None, {"dr_grpo": True, "token_level_loss": True})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"group_size": 5}, "does not divide the budget 64"),
        ({"group_size": 1}, "group_size must be >= 2"),
        ({"stepz": 3}, "unknown config key 'stepz'"),
        ({"steps": "abc"}, "cannot read 'abc' as int"),
        ({"lora": "maybe"}, "cannot read 'maybe' as bool"),
        ({"loss_agg": "sum"}, "loss_agg must be one of"),
        ({"temperature": 0}, "temperature must be > 0"),
        ({"micro_batch": -1}, "micro_batch must be >= 0"),
    ],
)
def test_errors_name_the_problem(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_config(None, overrides)


def test_yaml_errors(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1,\n  group_size: 2\n")
    with pytest.raises(ConfigError, match="broken YAML in .*bad.yaml at line"):
        make_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        make_config(tmp_path / "missing.yaml")
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        make_config(lst)


def test_every_field_has_a_default() -> None:
    Config()  # constructible with no arguments: the workshop needs no config file
