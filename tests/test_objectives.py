"""The objectives of TRL and verl in grpolab: each option on hand-computed values and, where
TRL 1.16 has the same option, against TRL's own code on identical inputs (values and
gradients). TRL's loss is ``GRPOTrainer._compute_loss`` run on a bare trainer object whose
scoring pass returns the test's log-probs; its advantages are the lines of
``GRPOTrainer._generate_and_score_completions`` that turn rewards into advantages, executed
as they are."""

from __future__ import annotations

import dataclasses
import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpolab.config import Config, ConfigError, literal_fields, make_config, resolve
from grpolab.config.trl import TRL_ALIASES, TRL_VALUES
from grpolab.core import advantages as A
from grpolab.core import losses as L
from grpolab.core.losses import grpo_loss
from grpolab.rollout import head as H
from grpolab.run import update

trl = pytest.importorskip("trl")
from test_trainer import first_digit_odd, trainer  # the tiny-world trainer the tests share
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import entropy_from_logits, nanstd

# ------------------------------------------------------------------ TRL harness --


class _Acc:
    """One process: TRL's accelerator calls are identities."""

    num_processes = 1
    sync_gradients = True
    is_main_process = True
    device = torch.device("cpu")

    def gather(self, t):
        return t

    gather_for_metrics = gather

    def reduce(self, t, reduction="sum"):
        return t

    def pad_across_processes(self, t, dim=0, pad_index=0):
        return t


def _bare_trainer(**over) -> GRPOTrainer:
    t = GRPOTrainer.__new__(GRPOTrainer)
    args = SimpleNamespace(use_bias_correction_kl=over.pop("use_bias_correction_kl", False),
                           delta=over.pop("delta", None), entropy_target=0.0,
                           steps_per_generation=1, device=torch.device("cpu"), report_to=[])
    attrs = {"args": args, "beta": 0.0, "loss_type": "grpo",
             "importance_sampling_level": "token", "epsilon_low": 0.2, "epsilon_high": 0.2,
             "top_entropy_quantile": 1.0, "entropy_coef": 0.0, "use_adaptive_entropy": False,
             "off_policy_mask_threshold": None, "use_vllm": False, "aux_loss_enabled": False,
             "current_gradient_accumulation_steps": 1,
             "model": SimpleNamespace(training=True), "accelerator": _Acc(),
             "is_deepspeed_enabled": False, "state": SimpleNamespace(global_step=0),
             "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)}}
    attrs.update(over)
    attrs["_entropy_bonus_enabled"] = attrs["entropy_coef"] != 0.0
    t.__dict__.update(attrs)
    return t


def trl_loss(logp, old, ref, adv, mask, entropies=None, **over) -> torch.Tensor:
    """TRL 1.16's GRPO loss on these per-token log-probs (a single process, no accumulation)."""
    b, t = logp.shape
    tr = _bare_trainer(max_completion_length=t, **over)
    ent = entropies if entropies is not None else torch.zeros_like(logp)
    tr._get_per_token_logps_and_entropies = lambda *a, **k: (logp, ent, None)
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long),
              "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    return GRPOTrainer._compute_loss(tr, None, inputs)


def trl_advantages(per_fn: torch.Tensor, weights: list[float], g: int,
                   scale_rewards: str = "group",
                   aggregation: str = "sum_then_normalize") -> torch.Tensor:
    """The advantage lines of GRPOTrainer._generate_and_score_completions, run as they are."""
    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    start = next(i for i, s in enumerate(lines)
                 if 'if self.multi_objective_aggregation == "sum_then_normalize":' in s)
    end = next(i for i, s in enumerate(lines)
               if "advantages = torch.nan_to_num(advantages, nan=0.0)" in s)
    ns = {"self": SimpleNamespace(multi_objective_aggregation=aggregation,
                                  reward_weights=torch.tensor(weights),
                                  scale_rewards=scale_rewards),
          "rewards_per_func": per_fn.clone(), "unscorable_mask": torch.isnan(per_fn).all(1),
          "num_generations": g, "device": "cpu", "torch": torch, "nanstd": nanstd}
    ns["self"].reward_funcs = [None] * per_fn.shape[1]
    exec(textwrap.dedent("\n".join(lines[start : end + 1])), ns)  # noqa: S102 - TRL's code
    return ns["advantages"]


def pair(seed: int = 0, b: int = 6, t: int = 5, spread: float = 0.5):
    """Random log-probs (with grad), old and reference log-probs, advantages of both signs and
    a ragged mask."""
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=gen) * 3).requires_grad_(True)
    old = logp.detach() + spread * torch.randn(b, t, generator=gen)
    ref = logp.detach() + 0.3 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, generator=gen)
    lens = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lens[:, None]).long()
    return logp, old, ref, adv, mask


def agree(ours_fn, theirs_fn, *tensors) -> None:
    """Same loss and same gradients w.r.t. every given leaf tensor."""
    a = ours_fn()
    ga = torch.autograd.grad(a, tensors, allow_unused=True)
    b = theirs_fn()
    gb = torch.autograd.grad(b, tensors, allow_unused=True)
    assert a.item() == pytest.approx(b.item(), rel=1e-5, abs=1e-6)
    for x, y in zip(ga, gb):
        x = torch.zeros_like(tensors[0]) if x is None else x
        y = torch.zeros_like(tensors[0]) if y is None else y
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), (x, y)


# ------------------------------------------------------------------ registries --


def test_config_choices_are_the_registries() -> None:
    lit = literal_fields()
    assert lit["policy_loss"] == tuple(L.POLICY_LOSSES) == ("clip", "gspo", "cispo")
    assert lit["kl_estimator"] == tuple(L.KL_ESTIMATORS) == ("k1", "k2", "k3")
    assert lit["loss_agg"] == tuple(L.LOSS_AGGREGATIONS)
    assert lit["baseline"] == tuple(A.ADVANTAGE_BASELINES)
    assert lit["scale"] == tuple(A.ADVANTAGE_SCALES) == ("std", "batch", "none")
    assert lit["reward_aggregation"] == tuple(A.REWARD_AGGREGATIONS)
    with pytest.raises(ConfigError, match="policy_loss must be one of"):
        make_config(None, {"policy_loss": "sapo"})


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
            assert " ".join(helps[name].split()) in text, name
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


# ------------------------------------------------------------------------ GSPO --


def test_gspo_hand_values() -> None:
    """Answer 0: token log-ratios 0.1, 0.3 -> s = e^0.2 = 1.2214, A = +1: clipped to 1.2, no
    gradient. Answer 1: one token, log-ratio -0.1 -> s = e^-0.1 = 0.9048, A = -1: unclipped."""
    old = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    logp = (old + torch.tensor([[0.1, 0.3], [-0.1, 0.0]])).requires_grad_(True)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1.0])
    terms = L.gspo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert terms.ratio.flatten().tolist() == pytest.approx([math.exp(0.2), math.exp(-0.1)])
    assert terms.loss[0].tolist() == pytest.approx([-1.2, -1.2])
    assert terms.loss[1, 0].item() == pytest.approx(math.exp(-0.1))
    assert terms.clipped.tolist() == [[True, True], [False, False]]
    out = grpo_loss(logp, old, None, adv, mask, beta=0.0, policy_loss="gspo")
    assert out.loss.item() == pytest.approx((-1.2 + math.exp(-0.1)) / 2)
    assert out.clip_frac == pytest.approx(2 / 3)
    out.loss.backward()
    # d/dlogp of s = exp(mean log-ratio) is s / |y|; per-reply mean, then 1/2 over replies
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, 0.5 * math.exp(-0.1), 0.0])


def test_gspo_first_pass_gradient_is_grpo_gradient() -> None:
    logp, _, _, adv, mask = pair(1)
    g = []
    for name in ("clip", "gspo"):
        out = grpo_loss(logp, logp.detach(), None, adv, mask, beta=0.0, policy_loss=name)
        g.append(torch.autograd.grad(out.loss, logp)[0])
    assert torch.allclose(g[0], g[1], atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_matches_trl_sequence_level(beta: float) -> None:
    logp, old, ref, adv, mask = pair(2, spread=0.05)
    eps = (0.01, 0.02)
    agree(lambda: grpo_loss(logp, old, ref, adv, mask, beta=beta, eps_low=eps[0],
                            eps_high=eps[1], policy_loss="gspo").loss,
          lambda: trl_loss(logp, old, ref, adv, mask, beta=beta, epsilon_low=eps[0],
                           epsilon_high=eps[1], importance_sampling_level="sequence"),
          logp)


# ------------------------------------------------------------------- dual clip --


def test_dual_clip_hand_values() -> None:
    """A = -1: ratio 4 costs 4 unclipped, capped at c = 3 (no gradient); ratio 2 stays 2 with
    gradient 2 (= ratio x |A|). A = +1, ratio 4: the usual upper clip, -1.2, untouched."""
    old = torch.zeros(3, 1)
    logp = torch.log(torch.tensor([[4.0], [2.0], [4.0]])).requires_grad_(True)
    adv = torch.tensor([-1.0, -1.0, 1.0])
    t = L.ppo_clip_loss(logp, old, adv, torch.ones(3, 1), dual_clip=3.0)
    assert t.loss.flatten().tolist() == pytest.approx([3.0, 2.0, -1.2])
    assert t.clipped.flatten().tolist() == [True, False, True]
    (g,) = torch.autograd.grad(t.loss.sum(), logp)
    assert g.flatten().tolist() == pytest.approx([0.0, 2.0, 0.0])
    plain = L.ppo_clip_loss(logp, old, adv, torch.ones(3, 1))
    assert plain.loss.flatten().tolist() == pytest.approx([4.0, 2.0, -1.2])


def test_dual_clip_matches_trl_delta() -> None:
    logp, old, ref, adv, mask = pair(3, spread=1.5)  # ratios far outside the clip range
    assert (torch.exp(logp.detach() - old)[adv < 0] > 3).any()
    for policy_loss, level in (("clip", "token"), ("gspo", "sequence")):
        agree(lambda p=policy_loss: grpo_loss(logp, old, ref, adv, mask, beta=0.04,
                                              dual_clip=3.0, policy_loss=p).loss,
              lambda lv=level: trl_loss(logp, old, ref, adv, mask, beta=0.04, delta=3.0,
                                        importance_sampling_level=lv),
              logp)


def test_dual_clip_config() -> None:
    assert make_config(None, {"dual_clip": 3}).dual_clip == 3.0
    with pytest.raises(ConfigError, match="dual_clip must be 0"):
        make_config(None, {"dual_clip": 1.1})


# ----------------------------------------------------------------- batch scale --


def test_batch_std_hand_values() -> None:
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    sd = math.sqrt(0.375 * 0.625)  # population std of the eight rewards
    a = A.group_advantages(r, 4, scale="batch")
    want = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    assert a.tolist() == pytest.approx([w / sd for w in want], abs=1e-6)
    # a dead group is still exactly 0; the sample std divides by n - 1
    a = A.group_advantages(torch.tensor([1.0, 0, 1, 1, 1, 1]), 3, scale="batch", std="sample")
    sd = math.sqrt((5 * (1 / 6) ** 2 + (5 / 6) ** 2) / 5)  # five 1s and a 0, mean 5/6
    assert a[3:].tolist() == [0.0, 0.0, 0.0]
    assert a[:3].tolist() == pytest.approx([(1 / 3) / sd, (-2 / 3) / sd, (1 / 3) / sd], abs=1e-6)


def test_batch_std_over_ranks_equals_one_process() -> None:
    """With a reduce hook (what torchrun passes: sums over ranks) the batch std comes from
    count, sum and sum of squares; one process's hook is the identity."""
    r = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 0.0, 1.0])
    for std in A.STD_KINDS:
        a = A.group_advantages(r, 4, scale="batch", std=std)
        b = A.group_advantages(r, 4, scale="batch", std=std, reduce=lambda v: list(v))
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize(("scale_rewards", "scale"), [("group", "std"), ("batch", "batch"),
                                                      ("none", "none")])
def test_scale_matches_trl(scale_rewards: str, scale: str) -> None:
    gen = torch.Generator().manual_seed(4)
    r = (torch.rand(16, generator=gen) * 3).round()
    r[4:8] = 2.0  # one dead group
    ours = A.group_advantages(r, 4, scale=scale, std="sample", std_eps=1e-4)
    theirs = trl_advantages(r[:, None], [1.0], 4, scale_rewards=scale_rewards)
    assert torch.allclose(ours, theirs.float(), atol=1e-5)


# ---------------------------------------------------------------- KL estimators --


def test_kl_estimators_hand_values() -> None:
    lp, ref = torch.tensor([-0.5, -2.0]), torch.tensor([-0.6, -1.5])  # log-ratios 0.1, -0.5
    assert L.k1_kl(lp, ref).tolist() == pytest.approx([0.1, -0.5])
    assert L.k2_kl(lp, ref).tolist() == pytest.approx([0.005, 0.125])
    assert L.k3_kl(lp, ref).tolist() == pytest.approx(
        [math.exp(-0.1) + 0.1 - 1, math.exp(0.5) - 0.5 - 1], rel=1e-5)
    for name in L.KL_ESTIMATORS:  # all vanish when policy == reference
        assert L.KL_ESTIMATORS[name](lp, lp).tolist() == [0.0, 0.0]


def test_k3_with_is_correction_hand_gradient() -> None:
    """First pass (ratio 1): the corrected k3 has the same value, and its gradient is
    (1 - e^d) + k3 = -d = log pi - log ref (k1's value: the unbiased reverse-KL gradient)
    instead of k3's 1 - e^d, with d = ref - logp."""
    lp = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    ref = torch.tensor([[-0.6, -1.5]])
    mask = torch.ones(1, 2)
    kw = {"beta": 1.0, "agg": "token_mean"}
    plain = grpo_loss(lp, lp.detach(), ref, torch.zeros(1), mask, **kw)
    corr = grpo_loss(lp, lp.detach(), ref, torch.zeros(1), mask, kl_is_correction=True, **kw)
    assert corr.loss.item() == pytest.approx(plain.loss.item()) and corr.kl == plain.kl
    (g1,) = torch.autograd.grad(plain.loss, lp)
    (g2,) = torch.autograd.grad(corr.loss, lp)
    d = [-0.1, 0.5]
    assert g1.flatten().tolist() == pytest.approx([(1 - math.exp(x)) / 2 for x in d])
    assert g2.flatten().tolist() == pytest.approx([-x / 2 for x in d])


@pytest.mark.parametrize("correction", [False, True])
def test_k3_matches_trl(correction: bool) -> None:
    logp, old, ref, adv, mask = pair(5, spread=0.1)
    agree(lambda: grpo_loss(logp, old, ref, adv, mask, beta=0.1,
                            kl_is_correction=correction).loss,
          lambda: trl_loss(logp, old, ref, adv, mask, beta=0.1,
                           use_bias_correction_kl=correction),
          logp)


def test_kl_in_reward(tmp_path) -> None:
    """kl_in: reward takes beta x the answer's summed KL off its reward (here k1, verl's
    default) and leaves the loss without a KL term."""
    tr = trainer(tmp_path, kl_in="reward", kl_estimator="k1", beta=0.5)
    with torch.no_grad():  # move the policy away from its frozen copy (the reference)
        for p in tr.backend.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = tr.collect()
    ro = batch.rollout
    lp = tr.backend.logprobs(ro, 1.0).detach()
    ref = tr.backend.logprobs(ro, 1.0, reference=True).detach()
    want = 0.5 * ((lp - ref) * ro.completion_mask).sum(-1)
    rewards, pen = update.kl_rewards(tr.cfg, tr.backend, ro, batch.rewards)
    assert torch.allclose(pen, want, atol=1e-6)
    assert torch.allclose(rewards, batch.rewards - want, atol=1e-6)
    out = tr.update(batch)
    assert out["kl"] == 0.0 and out["kl_reward"] == pytest.approx(float(want.mean()), rel=1e-5)
    with pytest.raises(ConfigError, match="kl_is_correction"):
        make_config(None, {"kl_in": "reward", "kl_is_correction": True})


# --------------------------------------------------------------------- entropy --


def test_entropy_hand_values() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.5, 1e-30], [0.5, 0.25, 0.25]]]))
    logits[0, 0, 2] = float("-inf")  # a masked vocabulary entry adds 0, not NaN
    targets = torch.tensor([[0, 2]])
    lp, ent = H.token_logprobs_and_entropy(logits, targets)
    assert ent.flatten().tolist() == pytest.approx([math.log(2), 1.5 * math.log(2)])
    assert torch.equal(lp, H.token_logprobs(logits, targets))  # bit for bit
    assert lp.flatten().tolist() == pytest.approx([math.log(0.5), math.log(0.25)])


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
    tr = _bare_trainer()
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


def test_entropy_bonus_hand_value() -> None:
    """Per-reply mean (the default aggregation), like the loss: replies of entropies (1, 3)
    and (2): bonus 0.1 x mean(2, 2) = 0.2 off the loss; gradient -0.1 x 1/2 x 1/2 per token of
    the long reply."""
    ent = torch.tensor([[1.0, 3.0], [2.0, 0.0]], requires_grad=True)
    logp = torch.zeros(2, 2, requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    out = grpo_loss(logp, logp.detach(), None, torch.zeros(2), mask, beta=0.0, entropy=ent,
                    entropy_coef=0.1)
    assert out.loss.item() == pytest.approx(-0.2)
    assert out.entropy == pytest.approx(2.0)
    (g,) = torch.autograd.grad(out.loss, ent)
    assert g.flatten().tolist() == pytest.approx([-0.025, -0.025, -0.05, 0.0])


def test_entropy_logged_every_step_and_bonus_trains(tmp_path) -> None:
    tr = trainer(tmp_path)
    tr.metrics = None
    recs = [tr.step() for _ in range(2)]
    vocab = tr.backend.model.config.vocab_size
    for rec in recs:
        assert 0 < rec["entropy"] < math.log(vocab)
    # the logged entropy is the completion-token mean of the policy's next-token entropies
    tr2 = trainer(tmp_path / "b", entropy_coef=0.5, top_entropy_quantile=0.5)
    batch = tr2.collect()
    ro = batch.rollout
    _, ent = tr2.backend.logprobs_and_entropy(ro, 1.0)
    m = ro.completion_mask
    want = float((ent * m).sum() / m.sum())
    out = tr2.update(batch)
    assert out["entropy"] == pytest.approx(want, rel=1e-5)
    assert 0.4 <= out["entropy_token_share"] <= 0.7


# ----------------------------------------------------------------------- CISPO --


def test_cispo_hand_values() -> None:
    """Answer 0: ratio 2, A = +1, weight min(2, 1.5) = 1.5: loss -1.5 x 1 x (-1) = 1.5,
    gradient -1.5. Answer 1: ratio 0.5, A = -1: loss -0.5 x -1 x -2 = -1, gradient 0.5.
    Token mean: 0.25; gradients halved."""
    logp = torch.tensor([[-1.0], [-2.0]], requires_grad=True)
    old = logp.detach() - torch.log(torch.tensor([[2.0], [0.5]]))
    adv = torch.tensor([1.0, -1.0])
    out = grpo_loss(logp, old, None, adv, torch.ones(2, 1), beta=0.0, policy_loss="cispo",
                    cispo_max=1.5, agg="token_mean")
    assert out.loss.item() == pytest.approx(0.25)
    assert out.clip_frac == pytest.approx(0.5)
    (g,) = torch.autograd.grad(out.loss, logp)
    assert g.flatten().tolist() == pytest.approx([-0.75, 0.25])


def test_cispo_first_pass_gradient_is_grpo_gradient() -> None:
    logp, _, _, adv, mask = pair(9)
    g = []
    for name in ("clip", "cispo"):
        out = grpo_loss(logp, logp.detach(), None, adv, mask, beta=0.0, policy_loss=name,
                        agg="token_mean")
        g.append(torch.autograd.grad(out.loss, logp)[0])
    assert torch.allclose(g[0], g[1], atol=1e-7)


def test_cispo_matches_trl() -> None:
    logp, old, ref, adv, mask = pair(10, spread=1.0)
    agree(lambda: grpo_loss(logp, old, ref, adv, mask, beta=0.04, policy_loss="cispo",
                            cispo_max=2.0, agg="token_mean").loss,
          lambda: trl_loss(logp, old, ref, adv, mask, beta=0.04, loss_type="cispo",
                           epsilon_high=2.0),
          logp)


# ------------------------------------------------------------ several rewards --

CORRECT = [1.0, 1, 1, 0, 0, 0, 0, 1]
FORMAT = [1.0, 1, 0, 0, 0, 0, 0, 0]


def test_gdpo_hand_values() -> None:
    """Group 1: correctness (1,1,1,0) -> z = (1,1,1,-3)/sqrt(3), format (1,1,0,0) -> (1,1,-1,-1);
    group 2: correctness (0,0,0,1) -> (-1,-1,-1,3)/sqrt(3), format dead -> 0. Weights (1, 0.5):
    x = z_c + z_f / 2, then (x - mean) / std over the eight answers."""
    per_fn = torch.tensor([CORRECT, FORMAT]).T
    s3 = math.sqrt(3)
    x = [1 / s3 + 0.5, 1 / s3 + 0.5, 1 / s3 - 0.5, -3 / s3 - 0.5,
         -1 / s3, -1 / s3, -1 / s3, 3 / s3]
    mean = sum(x) / 8
    sd = math.sqrt(sum((v - mean) ** 2 for v in x) / 8)
    a = A.normalize_then_sum(per_fn, torch.tensor([1.0, 0.5]), 4)
    assert a.tolist() == pytest.approx([(v - mean) / sd for v in x], abs=1e-6)
    # sum-then-normalize (GRPO) is different: totals (1.5, 1.5, 1, 0) and (0, 0, 0, 1)
    b = A.sum_then_normalize(per_fn, torch.tensor([1.0, 0.5]), 4)
    sd1 = math.sqrt(0.375)
    assert b[:4].tolist() == pytest.approx([0.5 / sd1, 0.5 / sd1, 0.0, -1 / sd1], abs=1e-6)
    # a group where every reward is constant stays exactly 0
    dead = torch.tensor([[1.0, 0.0]] * 4 + [[1.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    assert A.normalize_then_sum(dead, torch.tensor([1.0, 1.0]), 4)[:4].tolist() == [0.0] * 4


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


def test_trainer_keeps_each_reward_for_gdpo(tmp_path) -> None:
    def short(prompts, completions, **_):
        return [1.0 if len(c) <= 2 else 0.0 for c in completions]

    for dynamic in (False, True):
        tr = trainer(tmp_path / str(dynamic), reward_aggregation="normalize_then_sum",
                     dynamic_sampling=dynamic, reward_weights=[1.0, 0.5],
                     rewards=["first_digit_odd", "short"])
        tr.scorer.reward_fns = [first_digit_odd, short]
        batch = tr.collect()
        assert batch.rewards_per_fn.shape == (len(batch.rows), 2)
        assert torch.allclose(batch.rewards_per_fn @ torch.tensor([1.0, 0.5]), batch.rewards)
        want = A.normalize_then_sum(batch.rewards_per_fn, torch.tensor([1.0, 0.5]), 4)
        assert torch.equal(update.advantages(tr.cfg, batch.rewards, batch.rewards_per_fn), want)
        assert math.isfinite(tr.update(batch)["loss"])


# -------------------------------------------------------------- reward models --


def _reward_model(tmp_path, chat: bool = False) -> str:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpolab.rollout.tinyhf import train_tokenizer

    out = tmp_path / "rm"
    tok = train_tokenizer(None, out, 256, chat_template=chat)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, vocab_size=len(tok), num_labels=1,
                      pad_token_id=tok.pad_token_id, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForSequenceClassification(cfg).save_pretrained(str(out))
    return str(out)


def trl_model_rewards(fn, prompts, completions) -> list[float]:
    tr = _bare_trainer(reward_funcs=[fn.model], reward_processing_classes=[fn.tokenizer],
                       reward_func_names=["rm"], environments=None, chat_template_kwargs={})
    inputs = [{"prompt": p} for p in prompts]
    tr._log_completion_extra = tr._log_metric = lambda *a, **k: None
    return GRPOTrainer._calculate_rewards(tr, inputs, prompts, completions, None)[:, 0].tolist()


def test_reward_model_matches_trl(tmp_path) -> None:
    from grpolab.rewards.builtin import load_reward
    from grpolab.rewards.scorer import runs_in_process, score

    path = _reward_model(tmp_path, chat=True)
    fn = load_reward(f"rm:{path}")
    assert fn.__name__ == "rm_rm" and runs_in_process(fn)
    prompts = ["What is 2 + 2?", "Compute 7 * 6.", "What is 2 + 2?"]
    completions = [" 4", " The answer is 42, I think", " five"]
    got = fn(prompts, completions)
    assert got == pytest.approx(trl_model_rewards(fn, prompts, completions), abs=1e-5)
    # padding does not change a score: each alone is the same
    assert [fn([p], [c])[0] for p, c in zip(prompts, completions)] == pytest.approx(got, abs=1e-5)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    chat_completions = [[{"role": "assistant", "content": c}] for c in completions]
    got = fn(chats, completions)
    assert got == pytest.approx(trl_model_rewards(fn, chats, chat_completions), abs=1e-5)
    res = score([fn], prompts, completions)
    assert res.names == ["rm_rm"] and res.total.tolist() == pytest.approx(fn(prompts, completions))


def test_reward_model_errors_are_one_line(tmp_path) -> None:
    from grpolab.rewards.builtin import load_reward

    with pytest.raises(ValueError, match="no config.json"):
        load_reward(f"rm:{tmp_path}")
    with pytest.raises(ValueError, match="needs a model folder"):
        load_reward("rm:")


# ------------------------------------------------------------------ TRL names --


def test_trl_aliases_are_trl_fields() -> None:
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert set(TRL_ALIASES) | set(TRL_VALUES) <= fields
    assert all(v in Config.__dataclass_fields__ for v in TRL_ALIASES.values())


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


# ------------------------------------------------------- defaults and updates --


def test_default_loss_is_unchanged() -> None:
    """The default objective is computed by exactly the operations it was before the
    registries: the old formula, bit for bit."""
    logp, old, ref, adv, mask = pair(13, spread=0.4)
    out = grpo_loss(logp, old, ref, adv, mask, beta=0.04)
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    surrogate = -torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
    d = ref - logp
    per_token = surrogate + 0.04 * (torch.exp(d) - d - 1)
    m = mask.to(per_token.dtype)
    want = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    assert torch.equal(out.loss, want)


@pytest.mark.parametrize("over", [
    {"entropy_coef": 0.1},
    {"entropy_coef": 0.1, "loss_agg": "token_mean"},
    {"loss_agg": "seq_mean_token_sum", "policy_loss": "gspo", "epochs": 2},
    {"policy_loss": "cispo", "loss_agg": "token_mean", "epochs": 2, "dual_clip": 3.0},
    {"scale": "batch", "kl_estimator": "k2", "kl_is_correction": True},
])
def test_micro_batches_take_the_whole_batch_step(tmp_path, over: dict) -> None:
    """micro_batch 8 (parts of two groups) takes the whole batch's step with the new options
    (plain SGD, so equal gradients give equal weights, also after a second pass)."""
    params, outs = [], []
    for mb in (0, 8):
        tr = trainer(tmp_path / str(mb), micro_batch=mb, **over)
        tr.opt = torch.optim.SGD(tr.params, lr=0.1)
        outs.append(tr.update(tr.collect()))
        params.append(torch.cat([p.detach().flatten() for p in tr.params]))
    assert torch.allclose(params[0], params[1], atol=1e-6)
    for key in ("loss", "policy_loss", "kl", "grad_norm", "entropy"):
        assert outs[1][key] == pytest.approx(outs[0][key], rel=1e-5, abs=1e-7), key


# ------------------------------------------------- batch statistics over ranks --

DIST_CASES = [{"scale": "batch"}, {"reward_aggregation": "normalize_then_sum"},
              {"kl_in": "reward", "kl_estimator": "k1", "scale": "batch"}]


def _dist_update(over: dict, out_dir) -> dict:
    """One update on a fixed batch of 8 groups of 4 with two rewards; under two ranks each
    holds 3 and 5 groups. Returns the gradients."""
    from grpolab.run import dist
    from grpolab.run.trainer import Batch, GRPOTrainer
    from grpolab.world.backend import TinyBackend
    from grpolab.world.model import TinyConfig, TinyGPT
    from grpolab.world.task import make_splits

    torch.manual_seed(0)
    model = TinyGPT(TinyConfig(d_model=32, n_layers=2))
    splits = make_splits(0, 64, 8)
    cfg = resolve(Config(budget=32, group_size=4, progress=False, out_dir=str(out_dir),
                         rewards=["a", "b"], reward_weights=[1.0, 0.5], **over))
    backend = TinyBackend(model)  # full weights: the reference is a frozen copy
    tr = GRPOTrainer(cfg, backend, splits.train, [first_digit_odd], out_dir=out_dir)
    with torch.no_grad():  # policy != reference, so the KL penalty is not 0
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    rows = [tr.train_rows[i] for i in range(8) for _ in range(4)]
    ro = backend.generate([r["prompt"] for r in rows], 1.0, 4, torch.Generator().manual_seed(5))
    per_fn = torch.tensor([first_digit_odd(None, ro.completions),
                           [float(len(c) % 2) for c in ro.completions]]).T
    total = per_fn @ torch.tensor([1.0, 0.5])
    cut = [0, 3, 8] if dist.world_size() == 2 else [0, 8]
    lo, hi = cut[dist.rank()] * 4, cut[dist.rank() + 1] * 4
    batch = Batch(ro.select(list(range(lo, hi))), rows[lo:hi], total[lo:hi],
                  rewards_per_fn=per_fn[lo:hi])
    tr.opt.zero_grad()
    tr.opt = torch.optim.SGD(tr.params, lr=0.0)  # keep the gradients, move nothing
    out = tr.update(batch)
    grads = torch.cat([p.grad.flatten() for p in tr.params])
    return {"grads": grads, "metrics": out}


def _dist_worker(rank: int, world: int, port: int, tmp: str) -> None:
    import os

    from grpolab.run import dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init()
    try:
        res = [_dist_update(over, os.path.join(tmp, f"r{rank}")) for over in DIST_CASES]
        if rank == 0:
            torch.save(res, os.path.join(tmp, "two.pt"))
    finally:
        dist.cleanup()


def test_batch_statistics_are_over_every_rank(tmp_path) -> None:
    """scale: batch, GDPO's batch standardisation and the KL-in-reward penalty: two ranks
    holding 3 and 5 groups take the single-process step (the statistics are all-reduced)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_dist_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ones = [_dist_update(over, tmp_path / "single") for over in DIST_CASES]
    finally:
        torch.set_num_threads(threads)
    for over, got, want in zip(DIST_CASES, two, ones):
        scale = float(want["grads"].abs().max())
        assert scale > 0, over
        torch.testing.assert_close(got["grads"], want["grads"], rtol=1e-4, atol=1e-6 * scale,
                                   msg=lambda m, o=over: f"{o}: {m}")
        for key in ("loss", "policy_loss", "entropy"):
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5,
                                                        abs=1e-7), (over, key)
