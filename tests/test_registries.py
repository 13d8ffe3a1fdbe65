"""The option registries are the single source of the config's choices, the CLI's flags and
help, and the workshop's variants."""

from __future__ import annotations

import dataclasses

import pytest

from grpolab.config import Config, ConfigError, literal_fields, make_config, resolve
from grpolab.core import advantages as A
from grpolab.core import losses as L


def test_config_choices_are_the_registries() -> None:
    lit = literal_fields()
    assert lit["policy_loss"] == tuple(L.POLICY_LOSSES) == (
        "clip", "gspo", "cispo", "sapo", "vespo", "gmpo", "kl_cov", "clip_cov", "dppo_tv",
        "dppo_kl", "dro", "gpg")
    assert lit["kl_estimator"] == tuple(L.KL_ESTIMATORS) == ("k1", "k2", "k3")
    assert lit["loss_agg"] == tuple(L.LOSS_AGGREGATIONS)
    assert lit["baseline"] == tuple(A.ADVANTAGE_BASELINES)
    assert lit["scale"] == tuple(A.ADVANTAGE_SCALES) == ("std", "batch", "none", "gpg")
    assert lit["reward_aggregation"] == tuple(A.REWARD_AGGREGATIONS)
    with pytest.raises(ConfigError, match="policy_loss must be one of"):
        make_config(None, {"policy_loss": "dapo"})


def test_cli_lists_every_option_with_one_line_of_help(capsys) -> None:
    from grpolab.app.cli import build_parser, command_fields
    from grpolab.world.workshop import PRESETS, VARIANTS

    helps = {f.name: f.metadata.get("help") for f in dataclasses.fields(Config)}
    missing = [k for k in Config.__dataclass_fields__ if not helps.get(k)]
    assert not missing, f"config fields without help (their --help): {missing}"
    assert all("\n" not in h for h in helps.values())
    parser = build_parser()
    # every config field is a flag of some command; each command's --help has each of its
    # flags with its one line of help, and none of the flags that do not apply to it
    offered = {c: command_fields(c) for c in ("workshop", "train", "eval")}
    assert set().union(*offered.values()) == set(Config.__dataclass_fields__)
    assert "sft_steps" not in offered["train"] and "model_path" not in offered["workshop"]
    assert "eval_samples" in offered["eval"] and "lora_r" not in offered["eval"]
    for command, names in offered.items():
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for name in names:
            assert "--" + name.replace("_", "-") in text
            meta = Config.__dataclass_fields__[name].metadata
            want = meta["helps"].get(command, helps[name]).replace("`", "")  # (plain text)
            assert " ".join(want.split()) in text, name
        for name in set(Config.__dataclass_fields__) - set(names):
            assert "--" + name.replace("_", "-") + " " not in text, (command, name)
    sub = parser._subparsers._group_actions[0].choices
    actions = {a.dest: a for a in sub["train"]._actions}
    assert tuple(actions["policy_loss"].choices) == tuple(L.POLICY_LOSSES)
    assert tuple(actions["scale"].choices) == tuple(A.ADVANTAGE_SCALES)
    wactions = {a.dest: a for a in sub["workshop"]._actions}
    for name in [*PRESETS, *(k for k in VARIANTS if "=" in k)]:
        assert name in wactions["variants"].help


def test_workshop_presets_derive_from_the_registries() -> None:
    from grpolab.world.workshop import PRESETS, REGISTRIES, VARIANTS, variant_settings

    for key, reg in REGISTRIES.items():
        for name in reg:
            if name != getattr(Config, key):
                assert VARIANTS[f"{key}={name}"] == {key: name}
    for name, settings in VARIANTS.items():  # every preset is a valid configuration
        resolve(dataclasses.replace(Config(), **settings))
    assert set(PRESETS) <= set(VARIANTS)
    assert variant_settings("policy_loss=gspo+epochs=2") == {"policy_loss": "gspo", "epochs": 2}
    with pytest.raises(ConfigError, match="unknown variant"):
        variant_settings("nope")
    with pytest.raises(ConfigError, match="unknown config key"):
        variant_settings("nope=1")


def test_a_sweep_names_presets_over_given_values_and_unread_settings(caplog) -> None:
    """``--variants gmpo --eps-low 0.1``: the preset's 0.4 runs, and one line says so;
    ``--variants sapo --sapo-tau-pos 4`` runs SAPO at 4 with no warning, the grpo variant
    beside it is told that clip does not read it."""
    from grpolab.world.workshop import check_variants

    cfg = make_config(None, {"eps_low": 0.1, "sapo_tau_pos": 4.0})
    with caplog.at_level("WARNING", logger="grpolab"):
        settings = check_variants(cfg, [8], ["gmpo", "sapo", "grpo"])
    assert settings["gmpo"]["eps_low"] == 0.4
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpolab"):  # what a switch's resolve changes too
        check_variants(make_config(None, {"loss_agg": "token_mean"}), [8], ["dr_grpo"])
    assert [r.getMessage() for r in caplog.records] == [
        "variant dr_grpo sets loss_agg seq_mean_token_sum_norm over the given token_mean"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpolab"):
        settings = check_variants(cfg, [8], ["gmpo", "sapo", "grpo"])
    assert [r.getMessage() for r in caplog.records] == [
        "variant gmpo sets eps_low 0.4 over the given 0.1",
        "variant gmpo: policy_loss gmpo does not read sapo_tau_pos (sapo_tau_pos: sapo)",
        ("variant sapo: policy_loss sapo does not read eps_low (eps_low: clip, gspo, gmpo, "
        "clip_cov, dppo_tv, dppo_kl)"),
        "variant grpo: policy_loss clip does not read sapo_tau_pos (sapo_tau_pos: sapo)"]
