"""TRL's GRPOConfig names and values translate line for line into grpolab's config; the
conflicts are one line. (That the names are TRL's fields, and that the loss types give TRL's
loss: test_objectives_trl.py.)"""

from __future__ import annotations

import pytest

from grpolab.config import ConfigError, make_config


def test_trl_config_translates_line_for_line(tmp_path) -> None:
    y = tmp_path / "trl.yaml"
    y.write_text("num_generations: 4\nnum_iterations: 2\nepsilon: 0.1\nepsilon_high: 0.3\n"
                 "beta: 0.02\nloss_type: dr_grpo\nscale_rewards: batch\n"
                 "importance_sampling_level: sequence\nuse_bias_correction_kl: true\n"
                 "delta: 3.0\nmask_truncated_completions: true\ntop_entropy_quantile: 0.2\n"
                 "entropy_coef: 0.01\nmulti_objective_aggregation: normalize_then_sum\n"
                 "max_completion_length: 16\nlearning_rate: 1.0e-5\nmax_grad_norm: 0.5\n")
    c = make_config(y)
    assert (c.group_size, c.epochs, c.eps_low, c.eps_high, c.beta) == (4, 2, 0.1, 0.3, 0.02)
    assert (c.loss_agg, c.scale, c.policy_loss) == ("seq_mean_token_sum_norm", "batch", "gspo")
    assert c.kl_is_correction and c.dual_clip == 3.0 and c.mask_truncated
    assert (c.top_entropy_quantile, c.entropy_coef) == (0.2, 0.01)
    assert c.reward_aggregation == "normalize_then_sum"
    assert (c.max_new_tokens, c.lr, c.grad_clip) == (16, 1e-5, 0.5)


@pytest.mark.parametrize(("trl_keys", "want"), [
    ({"loss_type": "grpo"}, {"loss_agg": "seq_mean_token_mean"}),
    ({"loss_type": "bnpo"}, {"loss_agg": "token_mean"}),
    ({"loss_type": "dapo"}, {"loss_agg": "token_mean"}),
    ({"loss_type": "cispo", "epsilon_high": 5.0},
     {"policy_loss": "cispo", "loss_agg": "token_mean", "cispo_max": 5.0, "eps_high": 0.2}),
    ({"epsilon": 0.1}, {"eps_low": 0.1, "eps_high": 0.1}),  # TRL: epsilon_high = epsilon
    ({"epsilon": 0.1, "epsilon_high": None}, {"eps_low": 0.1, "eps_high": 0.1}),
    ({"scale_rewards": True}, {"scale": "std"}),
    ({"scale_rewards": False}, {"scale": "none"}),
    ({"delta": None}, {"dual_clip": 0.0}),
    ({"num_generations": 8, "group_size": 8}, {"group_size": 8}),  # agreeing is fine
])
def test_trl_values(trl_keys: dict, want: dict) -> None:
    c = make_config(None, trl_keys)
    assert {k: getattr(c, k) for k in want} == want


@pytest.mark.parametrize(("trl_keys", "message"), [
    ({"num_generations": 4, "group_size": 8}, "num_generations: 4 .TRL. sets group_size"),
    ({"loss_type": "dapo", "loss_agg": "seq_mean_token_mean"}, "loss_type: 'dapo'"),
    ({"loss_type": "sapo"}, "'sapo' .TRL. has no grpolab equivalent"),
    ({"loss_type": "cispo", "importance_sampling_level": "sequence"}, "sets policy_loss"),
])
def test_trl_conflicts_are_one_line(trl_keys: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        make_config(None, trl_keys)
    assert "\n" not in str(e.value)
