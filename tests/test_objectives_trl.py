"""The objectives of TRL and verl in grpolab against TRL 1.16's own code on identical inputs
(values and gradients), option by option. TRL's loss is ``GRPOTrainer._compute_loss`` run on
a bare trainer object whose scoring pass returns the test's log-probs; its advantages are the
lines of ``GRPOTrainer._generate_and_score_completions`` that turn rewards into advantages,
executed as they are (trl_harness.py). Hand values for each option are in test_policy_losses.py,
test_kl.py, test_entropy.py and test_advantage_options.py."""

from __future__ import annotations

import dataclasses
import enum

import pytest
import torch
import yaml
from helpers import agree, pair

from grpolab.config import Config, ConfigError, make_config
from grpolab.config import trl as trl_names
from grpolab.config.trl import TRL_ALIASES, TRL_FIXED, TRL_KEYS, TRL_VALUES
from grpolab.config.trl_values import TRL_REWARDS
from grpolab.core import advantages as A
from grpolab.core import losses as L
from grpolab.core.losses import grpo_loss
from grpolab.rollout import head as H

trl = pytest.importorskip("trl")
from trl import GRPOConfig, GRPOTrainer, ModelConfig
from trl import rewards as trl_rewards
from trl.trainer.utils import entropy_from_logits
from trl_harness import bare_trainer, trl_advantages, trl_loss, trl_step_loss

pytestmark = pytest.mark.trl


# ------------------------------------------------------------------- losses --


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_matches_trl_sequence_level(beta: float) -> None:
    logp, old, ref, adv, mask = pair(2, spread=0.05)
    eps = (0.01, 0.02)
    agree(lambda: grpo_loss(logp, old, ref, adv, mask, beta=beta, eps_low=eps[0],
                            eps_high=eps[1], policy_loss="gspo").loss,
          lambda: trl_loss(logp, old, ref, adv, mask, beta=beta, epsilon_low=eps[0],
                           epsilon_high=eps[1], importance_sampling_level="sequence"),
          logp)


def test_dual_clip_matches_trl_delta() -> None:
    logp, old, ref, adv, mask = pair(3, spread=1.5)  # ratios far outside the clip range
    assert (torch.exp(logp.detach() - old)[adv < 0] > 3).any()
    for policy_loss, level in (("clip", "token"), ("gspo", "sequence")):
        agree(lambda p=policy_loss: grpo_loss(logp, old, ref, adv, mask, beta=0.04,
                                              dual_clip=3.0, policy_loss=p).loss,
              lambda lv=level: trl_loss(logp, old, ref, adv, mask, beta=0.04, delta=3.0,
                                        importance_sampling_level=lv),
              logp)


def test_cispo_matches_trl() -> None:
    logp, old, ref, adv, mask = pair(10, spread=1.0)
    agree(lambda: grpo_loss(logp, old, ref, adv, mask, beta=0.04, policy_loss="cispo",
                            cispo_max=2.0, agg="token_mean").loss,
          lambda: trl_loss(logp, old, ref, adv, mask, beta=0.04, loss_type="cispo",
                           epsilon_high=2.0),
          logp)


def _ours(c: Config, logp, old, ref, adv, mask, beta: float, **over) -> torch.Tensor:
    """grpolab's loss for config ``c``, its policy loss's settings passed as the update does."""
    return grpo_loss(logp, old, ref, adv, mask, beta=beta, agg=c.loss_agg,
                     norm_len=c.max_new_tokens, policy_loss=c.policy_loss,
                     kl_is_correction=c.kl_is_correction,
                     **{k: getattr(c, k) for k in L.policy_knobs(c.policy_loss)}, **over).loss


@pytest.mark.parametrize(("trl_keys", "beta"), [
    ({"loss_type": "sapo"}, 0.0),
    ({"loss_type": "sapo", "sapo_temperature_pos": 0.7, "sapo_temperature_neg": 2.0}, 0.04),
    ({"loss_type": "sapo", "use_bias_correction_kl": True}, 0.04),
    ({"loss_type": "vespo"}, 0.0),
    ({"loss_type": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5, "vespo_k_neg": 4.0,
      "vespo_lambda_neg": 1.0}, 0.04),
    ({"loss_type": "vespo", "use_bias_correction_kl": True}, 0.04),
    ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, 0.0),
    ({"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon": 0.05}, 0.04),
    ({"loss_type": "luspo"}, 0.04),  # token level: TRL warns, and computes PPO's clip
    # TRL's sequence level for the losses that have their own: one ratio per answer
    ({"loss_type": "cispo", "importance_sampling_level": "sequence", "epsilon_high": 1.3}, 0.04),
    ({"loss_type": "sapo", "importance_sampling_level": "sequence",
      "use_bias_correction_kl": True}, 0.04),
    ({"loss_type": "vespo", "importance_sampling_level": "sequence",
      "use_bias_correction_kl": True}, 0.04),
])
@pytest.mark.parametrize("shape", ["answer", "token"])
def test_sapo_vespo_luspo_match_trl(trl_keys: dict, beta: float, shape: str) -> None:
    """TRL's loss types sapo, vespo and luspo, with their settings, translate to the policy
    loss and aggregation that give TRL's loss and gradient: with one advantage per answer or
    per token (TRL takes [B, T] from subclasses, grpolab from REINFORCE++), and an answer
    with no tokens."""
    logp, old, ref, adv, mask = pair(15, spread=0.8)
    adv[1] = 0.0  # a dead group's answer: no loss, no gradient, whichever side's settings
    mask[3] = 0
    if shape == "token":
        adv = adv[:, None] * torch.linspace(1.5, -0.5, logp.shape[1])
    c = make_config(None, {**trl_keys, "max_completion_length": logp.shape[1], "beta": beta})
    trl_over = {k: v for k, v in trl_keys.items() if k != "epsilon"}
    if "epsilon" in trl_keys:
        trl_over.update(epsilon_low=trl_keys["epsilon"], epsilon_high=trl_keys["epsilon"])
    if shape == "token" and c.policy_loss == "gspo":  # TRL's trainer gives one advantage an
        # answer; with a token's own (REINFORCE++, PPO: verl's estimators) GSPO is verl's
        # GSPO-token: TRL's loss, each token's gradient by its own advantage
        # (test_objectives_verl.py::test_gspo_matches_verl)
        theirs = trl_loss(logp, old, ref, adv, mask, beta=beta, **trl_over)
        assert float(_ours(c, logp, old, ref, adv, mask, beta)) == pytest.approx(float(theirs))
        return
    agree(lambda: _ours(c, logp, old, ref, adv, mask, beta),
          lambda: trl_loss(logp, old, ref, adv, mask, beta=beta, **trl_over), logp)


@pytest.mark.parametrize(("loss_type", "level"), [("grpo", "token"), ("dapo", "sequence"),
                                                  ("sapo", "token")])
def test_off_policy_mask_matches_trl(loss_type: str, level: str) -> None:
    logp, old, ref, adv, mask = pair(16, spread=0.5)
    keys = {"loss_type": loss_type, "importance_sampling_level": level,
            "off_policy_mask_threshold": 0.1}
    c = make_config(None, {**keys, "max_completion_length": logp.shape[1], "beta": 0.04})
    dropped = 1 - L.off_policy_keep(logp, old, adv, mask, 0.1)
    assert 0 < dropped.sum() < (adv < 0).sum()  # some mistakes dropped, not all
    agree(lambda: _ours(c, logp, old, ref, adv, mask, 0.04, off_policy_mask=c.off_policy_mask),
          lambda: trl_loss(logp, old, ref, adv, mask, beta=0.04, **keys), logp)


@pytest.mark.parametrize("correction", [False, True])
def test_k3_matches_trl(correction: bool) -> None:
    logp, old, ref, adv, mask = pair(5, spread=0.1)
    agree(lambda: grpo_loss(logp, old, ref, adv, mask, beta=0.1,
                            kl_is_correction=correction).loss,
          lambda: trl_loss(logp, old, ref, adv, mask, beta=0.1,
                           use_bias_correction_kl=correction),
          logp)


@pytest.mark.parametrize(("loss_type", "beta"), [("grpo", 0.0), ("bnpo", 0.04),
                                                 ("dr_grpo", 0.04), ("dapo", 0.04)])
def test_trl_loss_types_match_trl(loss_type: str, beta: float) -> None:
    """TRL's loss_type names translate to the aggregation that gives TRL's loss."""
    logp, old, ref, adv, mask = pair(12, spread=0.3)
    c = make_config(None, {"loss_type": loss_type, "max_new_tokens": logp.shape[1]})
    agree(lambda: grpo_loss(logp, old, ref, adv, mask, beta=beta, agg=c.loss_agg,
                            norm_len=c.max_new_tokens).loss,
          lambda: trl_loss(logp, old, ref, adv, mask, beta=beta, loss_type=loss_type),
          logp)


NAN = float("nan")


# -------------------------------------------------------------- advantages --


@pytest.mark.parametrize(("scale_rewards", "scale"), [("group", "std"), ("batch", "batch"),
                                                      ("none", "none")])
def test_scale_matches_trl(scale_rewards: str, scale: str) -> None:
    gen = torch.Generator().manual_seed(4)
    r = (torch.rand(16, generator=gen) * 3).round()
    r[4:8] = 2.0  # one dead group
    ours = A.group_advantages(r, 4, scale=scale, std="sample", std_eps=1e-4)
    theirs = trl_advantages(r[:, None], [1.0], 4, scale_rewards=scale_rewards)
    assert torch.allclose(ours, theirs.float(), atol=1e-5)


@pytest.mark.parametrize("aggregation", list(A.REWARD_AGGREGATIONS))
def test_reward_aggregation_matches_trl(aggregation: str) -> None:
    gen = torch.Generator().manual_seed(11)
    per_fn = torch.stack([(torch.rand(16, generator=gen) > 0.5).float(),
                          (torch.rand(16, generator=gen) > 0.7).float(),
                          torch.rand(16, generator=gen)], dim=1)
    w = [1.0, 0.5, 2.0]
    ours = A.REWARD_AGGREGATIONS[aggregation](per_fn, torch.tensor(w), 4, std="sample",
                                              std_eps=1e-4)
    theirs = trl_advantages(per_fn, w, 4, aggregation=aggregation)
    assert torch.allclose(ours, theirs.float(), atol=1e-5)


@pytest.mark.parametrize(("aggregation", "scale_rewards", "scale"), [
    ("sum_then_normalize", "group", "std"), ("sum_then_normalize", "batch", "batch"),
    ("sum_then_normalize", "none", "none"), ("normalize_then_sum", "group", "std")])
def test_none_rewards_match_trl(aggregation: str, scale_rewards: str, scale: str) -> None:
    """A reward's None (NaN, as TRL holds it): counted 0 in the total; an answer no reward
    scored is left out of its group (and of the batch's statistics) and gets 0; with
    normalize_then_sum each reward's None is left out of its own group statistics. On fixed
    and ragged groups alike."""
    gen = torch.Generator().manual_seed(3)
    per_fn = torch.stack([(torch.rand(16, generator=gen) > 0.5).float(),
                          (torch.rand(16, generator=gen) > 0.7).float(),
                          torch.rand(16, generator=gen)], dim=1)
    per_fn[1], per_fn[5, 0], per_fn[8:12, 1], per_fn[13:] = NAN, NAN, NAN, NAN
    w = [1.0, 0.5, 2.0]
    opts = {"std": "sample", "std_eps": 1e-4, "scale": scale}
    theirs = trl_advantages(per_fn, w, 4, scale_rewards=scale_rewards, aggregation=aggregation)
    ours = A.REWARD_AGGREGATIONS[aggregation](per_fn, torch.tensor(w), 4, **opts)
    assert torch.allclose(ours, theirs.float(), atol=1e-5)
    ragged = A.RAGGED_REWARD_AGGREGATIONS[aggregation](
        per_fn, torch.tensor(w), A.group_ids_from_sizes([4] * 4), **opts)
    assert torch.allclose(ragged, theirs.float(), atol=1e-5)
    assert ours[[1, 12, 13, 14, 15]].tolist() == [0.0] * 5


# ----------------------------------------------------------------- entropy --


def test_entropy_matches_trl() -> None:
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(6)) * 3
    _, ent = H.token_logprobs_and_entropy(logits, torch.zeros(3, 4, dtype=torch.long))
    assert torch.allclose(ent, entropy_from_logits(logits), atol=1e-5)
    _, ent_g = H.token_logprobs_and_entropy(logits, torch.zeros(3, 4, dtype=torch.long), True)
    assert torch.allclose(ent, ent_g)


@pytest.mark.parametrize("fast", ["1", "0"])
def test_hf_backend_scores_entropy_in_the_same_pass(tmp_path, monkeypatch, fast: str) -> None:
    """Hugging Face models (lean forward and plain HF forward): the same log-probs as
    ``logprobs``, bit for bit, and the entropy of the model's own next-token distribution."""
    from grpolab.app.commands import make_backend
    from grpolab.rollout.models import load_model
    from grpolab.rollout.tinyhf import make_tiny_model

    path = make_tiny_model(tmp_path / "m", hidden=32, heads=4)
    model, tok = load_model(path, device="cpu")
    backend = make_backend(make_config(None, {"model_path": path, "lora": False,
                                                "speed": f"lean_forward={fast}"}), model, tok)
    ro = backend.generate(["What is 2 + 2?", "What is 2 + 2?", "Compute 3 * 4."], 1.0, 6,
                          torch.Generator().manual_seed(0))
    lp, ent = backend.logprobs_and_entropy(ro, 0.7)
    assert torch.equal(lp, backend.logprobs(ro, 0.7))
    ids = torch.cat([ro.prompt_ids, ro.completion_ids], 1)
    attn = torch.cat([ro.prompt_mask, torch.ones_like(ro.completion_ids)], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1], attention_mask=attn[:, :-1],
                       position_ids=pos[:, :-1]).logits[:, -ro.completion_ids.shape[1]:]
    want = entropy_from_logits(logits.float() / 0.7)
    m = ro.completion_mask.bool()
    assert torch.allclose(ent[m], want[m], atol=1e-4)


def test_high_entropy_mask_hand_values() -> None:
    """Real-token entropies 0.1 0.5 0.9 0.3 0.7: the 0.6-quantile is 0.58 (linear
    interpolation), so top_entropy_quantile 0.4 keeps 0.7 and 0.9; padding never."""
    ent = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    keep = L.high_entropy_mask(ent, mask, 0.6)
    assert keep.tolist() == [[False, False, True], [False, True, False]]
    tr = bare_trainer()
    assert torch.equal(keep, GRPOTrainer.get_high_entropy_mask(tr, ent, mask, 0.6))
    # in the loss: only the kept tokens carry the policy gradient, KL stays on every token
    logp = torch.zeros(2, 3, requires_grad=True)
    out = grpo_loss(logp, logp.detach(), None, torch.tensor([1.0, 1.0]), mask, beta=0.0,
                    entropy=ent, top_entropy_quantile=0.4)
    (g,) = torch.autograd.grad(out.loss, logp)
    assert (g != 0).tolist() == keep.tolist()
    assert out.entropy_share == pytest.approx(2 / 5)


@pytest.mark.parametrize(("loss_type", "agg"), [("bnpo", "token_mean"), ("dapo", "token_mean")])
def test_entropy_bonus_and_selection_match_trl(loss_type: str, agg: str) -> None:
    logp, old, ref, adv, mask = pair(7, spread=0.1)
    ent = (torch.rand(logp.shape, generator=torch.Generator().manual_seed(8)) * 2
           ).requires_grad_(True)
    for coef, q in ((0.01, 1.0), (0.0, 0.3), (0.05, 0.3)):
        agree(lambda c=coef, q=q: grpo_loss(logp, old, ref, adv, mask, beta=0.04, agg=agg,
                                            entropy=ent, entropy_coef=c,
                                            top_entropy_quantile=q).loss,
              lambda c=coef, q=q: trl_loss(logp, old, ref, adv, mask, entropies=ent, beta=0.04,
                                           loss_type=loss_type, entropy_coef=c,
                                           top_entropy_quantile=q),
              logp, ent)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_entropy_bonus_is_trls_token_mean_for_every_loss_type(loss_type: str) -> None:
    """TRL's bonus is the token mean of the entropy whatever loss_type says: entropy_agg
    token_mean (what a TRL config with entropy_coef gets)."""
    agg = {"grpo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm",
           "dapo": "token_mean"}[loss_type]
    logp, old, ref, adv, mask = pair(9, spread=0.1)
    ent = (torch.rand(logp.shape, generator=torch.Generator().manual_seed(2)) * 2
           ).requires_grad_(True)
    for q in (1.0, 0.4):
        agree(lambda q=q: grpo_loss(logp, old, ref, adv, mask, beta=0.04, agg=agg,
                                    norm_len=logp.shape[1], entropy=ent, entropy_coef=0.05,
                                    entropy_agg="token_mean", top_entropy_quantile=q).loss,
              lambda q=q: trl_loss(logp, old, ref, adv, mask, entropies=ent, beta=0.04,
                                   loss_type=loss_type, entropy_coef=0.05,
                                   top_entropy_quantile=q),
              logp, ent)
    split = [grpo_loss(logp[r], old[r], ref[r], adv[r], mask[r], beta=0.04, agg=agg,
                       norm_len=logp.shape[1], entropy=ent[r], entropy_coef=0.05,
                       entropy_agg="token_mean", global_rows=len(logp),
                       global_tokens=int(mask.sum())).loss for r in (slice(0, 2), slice(2, None))]
    whole = grpo_loss(logp, old, ref, adv, mask, beta=0.04, agg=agg, norm_len=logp.shape[1],
                      entropy=ent, entropy_coef=0.05, entropy_agg="token_mean").loss
    assert float(sum(split).detach()) == pytest.approx(float(whole.detach()), rel=1e-6)


LEVELS = (0.6, 0.8, 1.3, 0.7, 1.6, 1.4, 0.5)  # each step's mean entropy, about, for target 1


@pytest.mark.parametrize(("loss_type", "q", "start", "delta", "levels"), [
    ("grpo", 1.0, 0.05, 0.02, LEVELS), ("dapo", 0.5, 0.05, 0.02, LEVELS),
    # starting under the floor, rising by less than it; over the cap, falling
    ("grpo", 1.0, 0.0, 0.004, LEVELS), ("grpo", 1.0, 0.2, 0.02, (1.4, 1.6, *LEVELS))])
def test_adaptive_entropy_matches_trls_controller(loss_type: str, q: float, start: float,
                                                   delta: float, levels: tuple) -> None:
    """Skywork-OR1's controller (TRL's use_adaptive_entropy), step by step: the loss (no bonus
    until a step's entropy is seen, then only while it is at most the target), its gradient
    and the coefficient after each step, with entropies on both sides of the target; a
    coefficient outside its bounds is bounded only on the side it moves to, as in TRL."""
    from trl_harness import adaptive_trainer, trl_step_loss

    from grpolab.run.optim import EntropyControl

    knobs = {"entropy_target": 1.0, "entropy_coef_delta": delta, "entropy_coef_min": 0.01,
             "entropy_coef_max": 0.06}
    tr = adaptive_trainer(knobs, loss_type=loss_type, entropy_coef=start, beta=0.04,
                          top_entropy_quantile=q)
    control = EntropyControl(Config(use_adaptive_entropy=True, entropy_coef=start, **knobs))
    agg = "seq_mean_token_mean" if loss_type == "grpo" else "token_mean"
    def step(k: int, level: float, coef: float) -> float:
        """One step on both sides; the entropy grpolab's controller is told."""
        logp, old, ref, adv, mask = pair(20 + k, spread=0.1)
        ent = (torch.rand(logp.shape, generator=torch.Generator().manual_seed(k)) * 2 * level
               ).requires_grad_(True)
        seen = []

        def ours() -> torch.Tensor:
            out = grpo_loss(logp, old, ref, adv, mask, beta=0.04, agg=agg, entropy=ent,
                            entropy_coef=coef, entropy_agg="token_mean", top_entropy_quantile=q)
            seen.append(out.trained_entropy / out.trained_tokens)
            return out.loss

        agree(ours, lambda: trl_step_loss(tr, logp, old, ref, adv, mask, ent), logp, ent)
        return seen[0]

    coefs = []
    for k, level in enumerate(levels):
        control.observe(step(k, level, control.applied()))
        assert control.coef == pytest.approx(tr.entropy_coef, abs=1e-12)
        assert control.last == pytest.approx(tr._last_world_entropy, rel=1e-6)
        coefs.append(control.coef)
    assert len(set(coefs)) > 2  # it moved both ways
    if start == 0.05:
        assert max(coefs) == 0.06  # and hit the cap


# --------------------------------------------------------------- TRL names --


def trl_classes() -> tuple[type, ...]:
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.scripts.utils import DatasetMixtureConfig

    return GRPOConfig, ModelConfig, GRPOScriptArguments, DatasetMixtureConfig


def test_trl_aliases_are_trl_fields() -> None:
    """grpolab's TRL names are the fields of TRL 1.16's GRPOConfig (its TrainingArguments'
    included), ModelConfig and `trl grpo`'s script arguments, and every one of those fields is
    either one of them or grpolab's own key: none is unknown to grpolab. (open-r1's keys, read
    beside TRL's, are tested in tests/test_open_r1.py.)"""
    from grpolab.config import open_r1

    trl_fields = {f.name for cls in trl_classes() for f in dataclasses.fields(cls)}
    ours = set(Config.__dataclass_fields__)
    assert TRL_KEYS - open_r1.KEYS <= trl_fields and not open_r1.KEYS & trl_fields
    assert trl_fields - TRL_KEYS - ours == set()
    assert not TRL_KEYS & ours  # (a key is translated, or grpolab's own: never both)
    assert all(getattr(trl_rewards, name) for name in TRL_REWARDS)
    assert all(v in Config.__dataclass_fields__ for v in TRL_ALIASES.values())


def trl_defaults() -> dict:
    """TRL 1.16's defaults: GRPOConfig's fields (its TrainingArguments'), ModelConfig's and the
    script's, as a YAML holds them (enums by their value)."""
    out = {}
    for cls in trl_classes():
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
    return {k: v.value if isinstance(v, enum.Enum) else v for k, v in out.items()}


def load_as_yaml(tmp_path, keys: dict) -> Config:  # (None stays None, as TRL's "unset")
    y = tmp_path / "trl.yaml"
    y.write_text(yaml.safe_dump(keys))
    return make_config(y, None, "train")


# TRL's defaults that grpolab cannot run as they are, each refused in one line
DEFAULTS_REFUSED = {
    "disable_dropout": (True, "disable_dropout: False"),  # grpolab's model has no dropout
    "bf16": (False, "bf16 .TRL. with full fine-tuning"),  # float32 weights under autocast
}


def test_trl_defaults_load(tmp_path, monkeypatch, caplog) -> None:
    """A YAML of every field of GRPOConfig, ModelConfig and the script at TRL's default loads
    but for the two refused in one line, and runs TRL's defaults: only max_prompt_tokens
    (TRL has no prompt limit) is named at grpolab's own default."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    every = trl_defaults()
    assert len(every) > 200
    given = {**every, **{k: v for k, (v, _) in DEFAULTS_REFUSED.items()}}
    for key, (_, message) in DEFAULTS_REFUSED.items():
        with pytest.raises(ConfigError, match=message):
            load_as_yaml(tmp_path, {**given, key: every[key]})
    with caplog.at_level("WARNING", logger="grpolab"):
        c = load_as_yaml(tmp_path, given)
    # TRL's defaults: 8 answers a step (8 per device, no accumulation), each forward all 8,
    # no held-out evaluation (eval_strategy "no"), full fine-tuning in float32 (bf16 false),
    # the advantage over the sample std + 1e-4, dapo's token mean, HF sampling, 3 epochs
    assert (c.budget, c.micro_batch, c.group_size, c.eval_size, c.passes) == (8, 8, 8, 0, 3.0)
    assert (c.scale, c.std, c.std_eps, c.dtype, c.lora) == ("std", "sample", 1e-4, "float32",
                                                            False)
    assert (c.beta, c.loss_agg, c.kl_is_correction, c.eps_low, c.eps_high) == (
        0.0, "token_mean", True, 0.2, 0.2)
    assert (c.lr, c.lr_schedule, c.warmup_steps, c.grad_clip, c.seed) == (
        1e-6, "linear", 0, 1.0, 42)
    assert (c.max_new_tokens, c.checkpoint_every, c.gradient_checkpointing) == (512, 500, True)
    assert (c.save_model_every, c.save_total_limit) == (500, 0)  # checkpoint-500/, all kept
    assert (c.lora_r, c.lora_alpha, c.lora_dropout) == (16, 32, 0.0)  # disable_dropout's 0
    assert (c.reward_weights, c.lora_target_modules, c.rollout_backend) == ([], [], "hf")
    left = [r.getMessage() for r in caplog.records if "grpolab's defaults" in r.getMessage()]
    assert left == [("this TRL config leaves these at grpolab's defaults, not TRL's: "
                    "max_prompt_tokens 1024 (TRL: whole prompts), use_chat_template true "
                    "(TRL's: text prompts as written, chat prompts in the template "
                    "(use_chat_template false))")]


# grpolab train's defaults that are not TRL's (docs/real-models.md#trl-configs lists them)
TRAIN_DEFAULTS_DIFFER = {
    "beta", "loss_type", "use_bias_correction_kl", "per_device_train_batch_size",
    "gradient_accumulation_steps", "use_peft", "lora_r", "lora_alpha", "lora_dropout",
    "learning_rate", "lr_scheduler_type", "max_completion_length", "gradient_checkpointing",
    "max_steps", "save_steps", "eval_strategy", "seed", "disable_dropout", "bf16",
    "scale_rewards", "shuffle_dataset"}


def test_train_defaults_against_trl(tmp_path, monkeypatch) -> None:
    """Each TRL setting grpolab reads, at TRL's default, against ``grpolab train``'s default:
    the ones that differ are the documented ones (fails when TRL moves a default)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    trl_default = trl_defaults()
    named = ({*TRL_ALIASES, *TRL_VALUES, *TRL_FIXED, *trl_names._BATCH} | {
        k for k in Config.__dataclass_fields__ if trl_default.get(k) is not None}
             ) & set(trl_default)  # (None for one of grpolab's own keys is not TRL's "unset")
    named.discard("model_name_or_path")  # (TRL's None: none given; a run needs one)
    ours = dataclasses.asdict(make_config(None, {}, "train"))
    differ = set()
    for name in named:
        try:
            theirs = dataclasses.asdict(load_as_yaml(tmp_path, {name: trl_default[name]}))
        except ConfigError:  # max_steps -1: TRL counts epochs, grpolab steps
            differ.add(name)
            continue
        theirs["report_to"] = [n for n in theirs["report_to"] if n != "none"]
        if theirs != ours:
            differ.add(name)
    assert differ == TRAIN_DEFAULTS_DIFFER
    # each is named, when a TRL config leaves it out, in the one warning (load.make_config)
    named = {k for _, _, keys, _ in trl_names.TRL_DEFAULTS_DIFFER for k in keys}
    assert TRAIN_DEFAULTS_DIFFER <= named


@pytest.mark.parametrize("over", [
    {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_generation": 8},
    {"per_device_train_batch_size": 8, "generation_batch_size": 64},
    {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4},
    {"per_device_train_batch_size": 16, "steps_per_generation": 2, "num_iterations": 2},
])
def test_generation_batch_and_its_optimiser_steps_are_trls(tmp_path, over: dict) -> None:
    """TRL's GRPOConfig resolves the generation batch (answers sampled at once) and its steps
    per generation; grpolab samples that budget and takes steps_per_generation /
    gradient_accumulation_steps optimiser steps on it, each of TRL's per-step batch."""
    t = GRPOConfig(output_dir=str(tmp_path), num_generations=8, bf16=False, report_to=[], **over)
    c = make_config(None, {"num_generations": 8, **over}, "train")
    assert c.budget == t.generation_batch_size
    assert c.minibatches == t.steps_per_generation // t.gradient_accumulation_steps
    assert c.budget // c.minibatches == (t.per_device_train_batch_size
                                         * t.gradient_accumulation_steps)
    assert c.micro_batch == t.per_device_train_batch_size
    assert c.epochs == t.num_iterations



@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo", "grpo"])
def test_several_steps_a_generation_divide_as_trl(loss_type: str) -> None:
    """steps_per_generation 2 over one accumulation: TRL's dapo, cispo and vespo divide each
    step's token sum by the generation batch's tokens / 2 (num_items_in_batch spans it), not
    by the step's own; grpolab's token_mean_by batch. Steps of 9 and 18 tokens; grpo (a mean
    per answer) is as before."""
    cfg = make_config(None, {"loss_type": loss_type, "steps_per_generation": 2, "beta": 0.04,
                             "per_device_train_batch_size": 3, "num_generations": 3}, "train")
    assert cfg.minibatches == 2 and cfg.micro_batch == 3
    logp, old, ref, adv, mask = pair(41, b=6, t=6, spread=0.3)
    mask[:3] = 0
    mask[:3, :3] = 1  # step 1: 9 tokens; step 2: 18
    mask[3:] = 1
    items = mask.sum()
    from grpolab.core.policy_losses import policy_knobs

    tr = bare_trainer(loss_type=loss_type, beta=0.04,
                      epsilon_high=cfg.cispo_max if loss_type == "cispo" else 0.2)
    tr.args.steps_per_generation = 2
    for rows in (slice(0, 3), slice(3, 6)):
        m = mask[rows]
        batch_share = float(items) / cfg.minibatches if cfg.token_mean_by == "batch" else None
        agree(lambda rows=rows, m=m, share=batch_share: grpo_loss(
                  logp[rows], old[rows], ref[rows], adv[rows], m, beta=cfg.beta,
                  agg=cfg.loss_agg, policy_loss=cfg.policy_loss,
                  **{k: getattr(cfg, k) for k in policy_knobs(cfg.policy_loss)},
                  global_rows=3, global_tokens=int(m.sum()), loss_tokens=share).loss,
              lambda rows=rows, m=m: trl_step_loss(tr, logp[rows], old[rows], ref[rows],
                                                   adv[rows], m, torch.zeros(3, 6), items),
              logp)
    # loss_tokens alone (no global counts) is the divisor too: the token sum over it
    m = mask[3:]
    whole = grpo_loss(logp[3:], old[3:], ref[3:], adv[3:], m, beta=0.0, agg="token_mean").loss
    alone = grpo_loss(logp[3:], old[3:], ref[3:], adv[3:], m, beta=0.0, agg="token_mean",
                      loss_tokens=4 * float(m.sum())).loss
    assert float(alone.detach()) == pytest.approx(float(whole.detach()) / 4)


def test_defaults_trl_takes_trls_defaults_for_what_a_config_leaves_unset(tmp_path,
                                                                        caplog) -> None:
    """``defaults: trl``: each setting a TRL config leaves unset takes TRL 1.16's default (read
    from its own GRPOConfig here), where grpolab has it; the two it has not (autocast, dropout
    on) stay in the one warning. A setting given, in either naming, stays as given."""
    trl_default = trl_defaults()
    for _, _, _, theirs in trl_names.TRL_DEFAULTS_DIFFER:
        for k, v in theirs.items():
            if k in trl_default:
                assert trl_default[k] == v, k
    with caplog.at_level("WARNING", logger="grpolab"):
        c = make_config(None, {"defaults": "trl", "num_generations": 8}, "train")
    said = [r.getMessage() for r in caplog.records if "defaults, not TRL's" in r.getMessage()]
    assert said == [("this TRL config leaves these at grpolab's defaults, not TRL's: dtype "
                     "float32 (TRL's bf16 autocast), the model's dropout off (TRL's "
                     "disable_dropout false)")]
    assert (c.beta, c.loss_agg, c.kl_is_correction, c.std, c.std_eps, c.budget, c.micro_batch,
            c.lora, c.lr, c.lr_schedule, c.max_new_tokens, c.seed, c.passes, c.eval_size) == (
        0.0, "token_mean", True, "sample", 1e-4, 8, 8, False, 1e-6, "linear", 512, 42, 3.0, 0)
    c = make_config(None, {"defaults": "trl", "beta": 0.04, "lr": 1e-5}, "train")
    assert (c.beta, c.lr, c.loss_agg) == (0.04, 1e-5, "token_mean")
    (tmp_path / "f.yaml").write_text("loss_type: grpo\ndefaults: trl\n")
    c = make_config(tmp_path / "f.yaml", {"learning_rate": 3e-6}, "train")
    assert (c.loss_agg, c.beta, c.lr) == ("seq_mean_token_mean", 0.0, 3e-6)
    assert make_config(None, {"num_generations": 8}, "train").beta == 0.04  # (grpolab's)
    with pytest.raises(ConfigError, match="defaults"):
        make_config(None, {"defaults": "trl"}, "workshop", strict=True)
    # TRL's defaults lie under the file and the overrides: a key of any naming there wins,
    # wherever it is written, and one that sets part of a default keeps the rest TRL's
    a = "actor_rollout_ref.actor."
    for where in ("file", "flags"):
        def made(keys: dict, where: str = where) -> Config:
            both = {"defaults": "trl", **keys}
            return make_config(*((both, None) if where == "file" else (None, both)), "train")
        c = made({"scale": "none", "budget": 16, a + "optim.lr": 1e-5})
        assert (c.scale, c.std, c.budget, c.micro_batch, c.lr) == ("none", "sample", 16, 8, 1e-5)
        c = made({"std_eps": 1e-6, "save_model_every": 5})
        assert (c.std, c.std_eps, c.checkpoint_every, c.save_model_every) == (
            "sample", 1e-6, 500, 5)
        c = made({"max_steps": 10, "eval_strategy": "steps", "eval_steps": 5,
                  "eval_dataset": "e.jsonl"})  # (a length or evaluation given: whole)
        assert (c.steps, c.passes, c.eval_size, c.eval_every) == (10, 0.0, 256, 5)
    # grpolab eval reads a training file's defaults too (its answers' length, template, seed)
    c = make_config({"defaults": "trl", "model_path": "m"}, {}, "eval")
    assert (c.max_new_tokens, c.use_chat_template, c.seed) == (512, False, 42)
    import grpolab  # a Config holds every setting: no default is left to take

    with pytest.raises(ConfigError, match="a Config holds every setting"):
        grpolab.train(Config(model_path="m"), defaults="trl")
    with pytest.raises(ConfigError, match=r"^defaults must be grpolab, trl or verl "
                                          r"\(got 'Trl'\)"):  # (before any of TRL's is read)
        make_config({"defaults": "Trl", "budget": 64}, None, "train")
    bad = tmp_path / "bad.yaml"  # (a file's is named with the file, null too)
    bad.write_text("defaults: null\nbudget: 64\n")
    with pytest.raises(ConfigError, match=f"^{bad}: defaults must be grpolab, trl or verl "
                                          r"\(got None\)"):
        make_config(bad, None, "train")
