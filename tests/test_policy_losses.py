"""The policy losses besides PPO's clip, on hand-computed values: GSPO (sequence-level
ratios), the dual clip, CISPO, SAPO, VESPO and GMPO; and the default objective, bit for bit the
old formula. (Against TRL's own code: test_objectives_trl.py; verl's: test_objectives_verl.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import pair

from grpolab.config import ConfigError, make_config
from grpolab.core import losses as L
from grpolab.core.losses import grpo_loss

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


def test_dual_clip_config() -> None:
    assert make_config(None, {"dual_clip": 3}).dual_clip == 3.0
    with pytest.raises(ConfigError, match="dual_clip must be 0"):
        make_config(None, {"dual_clip": 1.1})


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


def test_cispo_lower_bound_hand_values() -> None:
    """verl's CISPO clips the weight from below too: ratio 0.5 with cispo_min 0.8 weighs 0.8."""
    logp = torch.tensor([[-1.0], [-2.0]], requires_grad=True)
    old = logp.detach() - torch.log(torch.tensor([[2.0], [0.5]]))
    t = L.cispo_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1), cispo_max=1.5,
                     cispo_min=0.8)
    assert t.loss.flatten().tolist() == pytest.approx([1.5, -1.6])
    assert t.clipped.flatten().tolist() == [True, True]


def test_cispo_at_the_sequence_level_hand_values() -> None:
    """TRL's importance_sampling_level sequence: one weight per answer, exp(mean log-ratio).
    Log-ratios 0.2 and 0.6: r = e^0.4 = 1.49, capped at 1.3; each token -1.3 x A x logp."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = logp.detach() - torch.tensor([[0.2, 0.6]])
    t = L.cispo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), cispo_max=1.3,
                     ratio_level="sequence")
    assert t.ratio.flatten().tolist() == pytest.approx([math.exp(0.4)])
    assert t.loss.flatten().tolist() == pytest.approx([1.3, 2.6])
    assert t.clipped.tolist() == [[True, True]]


# ------------------------------------------------------------------------ SAPO --


def test_sapo_hand_values() -> None:
    """Token 0: ratio 1, A = +1, tau 1: gate sigmoid(0) x 4 = 2, loss -2, slope 4 s (1 - s) r
    = 1. Token 1: ratio e^0.5, A = -1, tau_neg 2: s = sigmoid(2 (e^0.5 - 1)), gate s x 2, loss
    +2s, gradient -(-1) x 4 s (1 - s) e^0.5."""
    logp = torch.tensor([[-1.0], [-1.0]], requires_grad=True)
    old = logp.detach() - torch.tensor([[0.0], [0.5]])
    adv = torch.tensor([1.0, -1.0])
    t = L.sapo_loss(logp, old, adv, torch.ones(2, 1), sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    r = math.exp(0.5)
    sig = 1 / (1 + math.exp(-2 * (r - 1)))
    assert t.loss.flatten().tolist() == pytest.approx([-2.0, 2 * sig])
    assert not t.clipped.any()
    (g,) = torch.autograd.grad(t.loss.sum(), logp)
    assert g.flatten().tolist() == pytest.approx([-1.0, 4 * sig * (1 - sig) * r])


def test_sapo_signs_fade_at_their_own_temperature() -> None:
    """Away from ratio 1 a larger temperature fades the gradient faster: with tau_neg 3 a
    negative advantage's tokens get less gradient than a positive one's at tau_pos 1; an
    advantage of 0 has neither loss nor gradient."""
    logp, old, _, _, mask = pair(3, spread=0.5)
    b = logp.shape[0]

    def slope(adv: torch.Tensor) -> torch.Tensor:
        t = L.sapo_loss(logp, old, adv, mask, sapo_tau_pos=1.0, sapo_tau_neg=3.0)
        return torch.autograd.grad((t.loss * mask).sum(), logp)[0].abs()

    pos, neg = slope(torch.ones(b)), slope(-torch.ones(b))
    real = mask.bool() & ((logp - old).abs() > 0.1)
    assert (neg[real] < pos[real]).all()
    zero = L.sapo_loss(logp, old, torch.zeros(b), mask)
    assert torch.equal(zero.loss, torch.zeros_like(zero.loss))
    assert torch.equal(slope(torch.zeros(b)), torch.zeros_like(logp))


def test_sapo_far_off_policy_and_in_bfloat16() -> None:
    """A token whose log-ratio is past float32's exp (~88) gets a finite gradient (verl's clamp
    to [-20, 20]; TRL's is NaN there); bfloat16 log-probs keep the temperatures exact."""
    logp = torch.tensor([[100.0, 0.0]], requires_grad=True)
    t = L.sapo_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2))
    (g,) = torch.autograd.grad(t.loss.sum(), logp)
    assert torch.isfinite(g).all() and torch.isfinite(t.loss).all()
    lp = torch.full((1, 1), -1.0, dtype=torch.bfloat16)  # ratio 1: the loss is -(4/tau)/2 x A
    half = L.sapo_loss(lp, lp, torch.tensor([-1.0]), torch.ones(1, 1)).loss
    assert half.item() == pytest.approx(2 / 1.05, rel=1e-6)  # not bfloat16's 1.046875


# ----------------------------------------------------------------------- VESPO --


def test_vespo_hand_values() -> None:
    """Answer 0: log-ratios 0.1, 0.2, A = +1 (k 2, lam 3): log w = 0.3, phi = e^(3 + 0.6 -
    3 e^0.3); each token's loss -phi x logp, gradient -phi. Answer 1: one token, log-ratio
    -0.5, A = -2 (k 3, lam 2): phi = e^(2 - 1.5 - 2 e^-0.5), loss 2 phi logp, gradient 2 phi."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    old = logp.detach() - torch.tensor([[0.1, 0.2], [-0.5, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -2.0])
    t = L.vespo_loss(logp, old, adv, mask)
    phi0 = math.exp(3 + 2 * 0.3 - 3 * math.exp(0.3))
    phi1 = math.exp(2 + 3 * -0.5 - 2 * math.exp(-0.5))
    assert t.loss[0].tolist() == pytest.approx([phi0, 2 * phi0])
    assert t.loss[1, 0].item() == pytest.approx(2 * phi1 * -0.5)
    (g,) = torch.autograd.grad((t.loss * mask).sum(), logp)
    assert g.flatten().tolist() == pytest.approx([-phi0, -phi0, 2 * phi1, 0.0])


def test_vespo_weight_fades_on_both_sides() -> None:
    """phi(1) = 1; phi falls for w far below and far above 1, and is never NaN."""
    logp = torch.zeros(5, 1)
    old = -torch.log(torch.tensor([[1.0], [0.05], [5.0], [1e-12], [1e12]]))
    t = L.vespo_loss(logp - 1.0, old - 1.0, torch.ones(5), torch.ones(5, 1))
    phi = t.loss.flatten()  # -phi x A x log pi = -phi x 1 x (-1)
    assert phi[0].item() == pytest.approx(1.0)
    assert (phi[1:] < 0.2).all() and torch.isfinite(phi).all()


# ------------------------------------------------------------------------ GMPO --


def test_gmpo_hand_values() -> None:
    """eps 0.4. Answer 0, A = +1, log-ratios 0.5, -0.1: the first clipped to 0.4, clipped ratio
    e^((0.4 - 0.1) / 2); loss -e^0.15 on both tokens, gradient only through the second token.
    Answer 1, A = -1, log-ratios -0.6, 0.2: the first clipped to -0.4, clipped ratio e^-0.1,
    loss +e^-0.1. ``ratio`` is the unclipped one (e^0.2, e^-0.2)."""
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    old = logp.detach() - torch.tensor([[0.5, -0.1], [-0.6, 0.2]])
    adv = torch.tensor([1.0, -1.0])
    t = L.gmpo_loss(logp, old, adv, torch.ones(2, 2), eps_low=0.4, eps_high=0.4)
    assert t.ratio.flatten().tolist() == pytest.approx([math.exp(0.2), math.exp(-0.2)])
    assert t.loss.flatten().tolist() == pytest.approx([-math.exp(0.15)] * 2 + [math.exp(-0.1)] * 2)
    assert t.clipped.tolist() == [[True, False], [True, False]]
    out = grpo_loss(logp, old, None, adv, torch.ones(2, 2), beta=0.0, policy_loss="gmpo",
                    eps_low=0.4, eps_high=0.4)
    (g,) = torch.autograd.grad(out.loss, logp)
    assert g.flatten().tolist() == pytest.approx([0.0, -math.exp(0.15) / 4, 0.0,
                                                  math.exp(-0.1) / 4])


def test_gmpo_corrects_the_kl_with_the_unclipped_ratio() -> None:
    """kl_is_correction weighs the KL by the answer's geometric-mean ratio before any clip,
    also on an answer whose advantage is 0 (whose clipped ratio is 1)."""
    logp, old, ref, adv, mask = pair(6, spread=0.8)
    adv[0] = 0.0
    t = L.gmpo_loss(logp, old, adv, mask, eps_low=0.1, eps_high=0.1)
    m = mask.float()
    want = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))
    assert torch.allclose(t.ratio.flatten(), want)
    grads = [torch.autograd.grad(grpo_loss(logp, old, ref, adv, mask, beta=0.1,
                                           policy_loss="gmpo", kl_is_correction=c).loss,
                                 logp)[0][0] for c in (False, True)]
    assert not torch.allclose(*grads)  # the dead answer's KL is corrected too


def test_gmpo_in_float16_with_an_empty_answer() -> None:
    logp, old, _, adv, mask = pair(7)
    mask[2] = 0
    t = L.gmpo_loss(logp.detach().half(), old.half(), adv, mask)
    assert torch.isfinite(t.loss).all() and (t.loss[2] == 0).all()


def test_gmpo_takes_one_advantage_per_answer() -> None:
    with pytest.raises(ConfigError, match="policy_loss gmpo .* takes estimator grpo"):
        make_config(None, {"policy_loss": "gmpo", "estimator": "reinforce_pp"})


def test_a_setting_the_run_does_not_read_is_named(caplog) -> None:
    """A changed setting the chosen policy loss does not read is named in one warning (at its
    default, as in a TRL config that lists every field, it is not), and so is an off-policy
    mask with one epoch, where it cannot act."""
    def warnings(over: dict) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="grpolab"):
            make_config(None, over, command="train")
        return [r.getMessage() for r in caplog.records if "leaves these" not in r.getMessage()]

    assert warnings({"loss_type": "grpo", "sapo_temperature_neg": 2.0, "vespo_k_pos": 2}) == [
        "policy_loss clip does not read sapo_tau_neg (sapo_tau_neg: sapo)"]
    assert warnings({"policy_loss": "cispo", "cispo_min": 0.5, "cispo_max": 2.0}) == []
    assert warnings({"off_policy_mask": 0.5}) == [
        ("off_policy_mask acts only with epochs > 1 (TRL num_iterations) or minibatches > 1: "
         "with one optimiser step the policy is the one that sampled, and nothing is masked")]
    assert warnings({"off_policy_mask": 0.5, "epochs": 2}) == []
    assert warnings({"off_policy_mask": 0.5, "minibatches": 2}) == []
    assert warnings({"entropy_target": 3.0, "entropy_coef_max": 0.5}) == [
        "entropy_target, entropy_coef_max act only with use_adaptive_entropy"]
    assert warnings({"entropy_target": 3.0, "use_adaptive_entropy": True}) == []
    said = ("token_mean_by batch acts only with minibatches > 1 and a token_mean loss_agg: one "
            "optimiser step a batch divides by its own tokens")
    assert warnings({"token_mean_by": "batch", "loss_agg": "token_mean"}) == [said]
    assert warnings({"token_mean_by": "batch", "minibatches": 2}) == [said]  # (per answer)
    assert warnings({"token_mean_by": "batch", "minibatches": 2, "loss_agg": "token_mean"}) == []
    # the value model's settings (verl's critic.*, algorithm.lam) act with ppo alone
    assert warnings({"critic_lr": 1e-4, "lam": 0.95}) == [
        "critic_lr, lam act only with estimator ppo (the value model's)"]
    assert warnings({"critic.optim.lr": 1e-4, "algorithm.adv_estimator": "grpo"}) == [
        "critic_lr acts only with estimator ppo (the value model's)"]
    assert warnings({"critic_lr": 1e-4, "lam": 0.95, "estimator": "ppo"}) == []
    assert warnings({"critic_lr": 1e-3, "critic_warmup": 0}) == []  # (the workshop's default)
    # verl's actor loss_agg_mode is its critic's only where verl has one (gae)
    assert warnings({"actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum",
                     "algorithm.adv_estimator": "grpo"}) == []
    assert warnings({"actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum",
                     "estimator": "grpo"}) == []  # (grpolab's name for it)


def test_trl_entropy_bonus_with_micro_batches_is_warned(caplog) -> None:
    """TRL's entropy bonus is each micro-batch's token mean, averaged; grpolab's the whole
    batch's: a TRL config that splits the batch is told."""
    def warned(over: dict) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="grpolab"):
            make_config(None, over, command="train")
        return [r.getMessage() for r in caplog.records if "micro-batch's token mean" in
                r.getMessage()]

    assert len(warned({"entropy_coef": 0.01, "gradient_accumulation_steps": 2,
                       "per_device_train_batch_size": 8, "num_generations": 8})) == 1
    assert warned({"entropy_coef": 0.01, "num_generations": 8}) == []


def test_trl_warnings_on_loss_type_and_ratio_level(caplog) -> None:
    """TRL's own warnings, where grpolab runs what TRL runs: LUSPO at the token level, a
    token sum at the sequence level; and CISPO's cap left at epsilon."""
    def warned(over: dict) -> str:
        caplog.clear()
        with caplog.at_level("WARNING", logger="grpolab"):
            make_config(None, over)
        return " | ".join(r.getMessage() for r in caplog.records)

    assert "luspo without importance_sampling_level: sequence" in warned({"loss_type": "luspo"})
    assert warned({"loss_type": "luspo", "importance_sampling_level": "sequence"}) == ""
    assert "weighting each answer by its length" in warned(
        {"loss_type": "dapo", "importance_sampling_level": "sequence"})
    assert warned({"importance_sampling_level": "sequence"}) == ""
    assert "changes only the KL's correction" in warned(
        {"loss_type": "vespo", "importance_sampling_level": "sequence"})
    assert "caps the importance weight at epsilon, 0.2" in warned({"loss_type": "cispo"})
    assert warned({"loss_type": "cispo", "epsilon_high": 5.0}) == ""


def test_gmpo_clips_only_on_the_advantage_side() -> None:
    """As PPO: A > 0 with a small ratio, and A < 0 with a large one, are not clipped."""
    logp = torch.zeros(2, 1, requires_grad=True)
    old = torch.tensor([[0.6], [-0.6]])  # log-ratios -0.6 and +0.6
    t = L.gmpo_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1), eps_low=0.4,
                    eps_high=0.4)
    assert t.ratio.flatten().tolist() == pytest.approx([math.exp(-0.6), math.exp(0.6)])
    assert not t.clipped.any()


@pytest.mark.parametrize(("name", "agg"), [("sapo", "seq_mean_token_mean"),
                                           ("vespo", "token_mean"),
                                           ("gmpo", "seq_mean_token_mean")])
def test_first_pass_gradient_is_grpo_gradient(name: str, agg: str) -> None:
    """At ratio 1 each of them is the policy gradient: SAPO's gate has slope 1, VESPO's weight
    is 1, GMPO's geometric mean moves as the tokens' mean log-prob."""
    logp, _, _, adv, mask = pair(21)
    g = []
    for loss in ("clip", name):
        out = grpo_loss(logp, logp.detach(), None, adv, mask, beta=0.0, policy_loss=loss,
                        agg=agg)
        g.append(torch.autograd.grad(out.loss, logp)[0])
    assert torch.allclose(g[0], g[1], atol=1e-7)


def test_knobs_reach_their_loss_and_typos_are_refused() -> None:
    logp, old, ref, adv, mask = pair(4, spread=1.0)
    a = grpo_loss(logp, old, ref, adv, mask, beta=0.0, policy_loss="sapo", sapo_tau_neg=1.05)
    b = grpo_loss(logp, old, ref, adv, mask, beta=0.0, policy_loss="sapo", sapo_tau_neg=4.0)
    assert a.loss.item() != pytest.approx(b.loss.item())
    assert L.policy_knobs("vespo") == ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                                       "vespo_lambda_neg", "ratio_level")
    with pytest.raises(TypeError, match="sapo_tau"):
        grpo_loss(logp, old, ref, adv, mask, beta=0.0, policy_loss="sapo", sapo_tau=2.0)


def test_kl_cov_hand_values() -> None:
    """Token advantages 1, 1, -1, -1 (mean 0), log-probs -1, -0.5, -3, -4 (mean -2.125):
    covariances 1.125, 1.625, 0.875, 1.875. A share of 0.25 is one token, the last, which alone
    gets coef x |log r| = 0.1 x 0.1 on top of -r A."""
    logp = torch.tensor([[-1.0, -0.5], [-3.0, -4.0]], requires_grad=True)
    old = logp.detach() - torch.tensor([[0.1, 0.3], [0.2, -0.1]])
    adv = torch.tensor([1.0, -1.0])
    t = L.kl_cov_loss(logp, old, adv, torch.ones(2, 2), kl_cov_ratio=0.25, kl_cov_coef=0.1)
    assert t.clipped.tolist() == [[False, False], [False, True]]
    r = torch.exp(torch.tensor([[0.1, 0.3], [0.2, -0.1]]))
    want = -torch.tensor([[1.0], [-1.0]]) * r + torch.tensor([[0.0, 0.0], [0.0, 0.01]])
    assert torch.allclose(t.loss, want)


@pytest.mark.parametrize(("over", "message"), [
    ({"kl_cov_ratio": 0}, "kl_cov_ratio must be in .0, 1."),
    ({"dppo_cap": 0}, "dppo_cap must be > 0"),
    ({"dro_beta": -0.1}, "dro_beta must be > 0"),
    ({"eps_low": 1.5}, "eps_low must be < 1"),
    ({"clip_cov_lb": 5.0}, "clip_cov_lb must be below clip_cov_ub"),
    ({"sapo_tau_neg": 0}, "sapo_tau_neg must be > 0"),
    ({"vespo_lambda_pos": -1}, "vespo_lambda_pos must be > 0"),
    ({"vespo_k_neg": -0.5}, "vespo_k_neg must be >= 0"),
    ({"cispo_min": 6.0}, "cispo_max must be > cispo_min"),
])
def test_policy_knobs_are_checked(over: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_config(None, over)
    if "eps_low" in over:  # a divergence bound, not a ratio's clip: may pass 1
        assert make_config(None, {**over, "policy_loss": "dppo_kl"}).eps_low == 1.5


# ------------------------------------------------------ off-policy sequence mask --


def test_off_policy_mask_hand_values() -> None:
    """Threshold 0.1. Answer 0: A = -1, log(pi_old/pi) 0.3 and 0.1 (mean 0.2 > 0.1): dropped.
    Answer 1: A = -1, mean 0.05: kept. Answer 2: A = +1, mean 0.2: kept (only mistakes are
    dropped). The KL term stays on every answer."""
    logp = torch.full((3, 2), -1.0, requires_grad=True)
    old = logp.detach() + torch.tensor([[0.3, 0.1], [0.05, 0.05], [0.2, 0.2]])
    adv = torch.tensor([-1.0, -1.0, 1.0])
    mask = torch.ones(3, 2)
    keep = L.off_policy_keep(logp, old, adv, mask, 0.1)
    assert keep.flatten().tolist() == [0.0, 1.0, 1.0]
    ref = logp.detach() - 0.5
    out = grpo_loss(logp, old, ref, adv, mask, beta=0.1, off_policy_mask=0.1)
    assert out.masked_share == pytest.approx(2 / 6)  # answer 0's two tokens of six
    (g,) = torch.autograd.grad(out.loss, logp)
    plain = grpo_loss(logp, old, ref, adv, mask, beta=0.1)
    (gp,) = torch.autograd.grad(plain.loss, logp)
    kl_only = grpo_loss(logp, old, ref, adv, mask, beta=0.1, eps_low=0.0, eps_high=0.0)
    assert torch.allclose(g[1:], gp[1:]) and not torch.allclose(g[0], gp[0])
    (gk,) = torch.autograd.grad(kl_only.loss, logp)  # eps 0: every policy gradient clipped
    assert torch.allclose(g[0], gk[0])  # answer 0 keeps only its KL gradient
    first_pass = grpo_loss(logp, logp.detach(), ref, adv, mask, beta=0.1, off_policy_mask=0.1)
    assert first_pass.loss.item() == pytest.approx(
        grpo_loss(logp, logp.detach(), ref, adv, mask, beta=0.1).loss.item())


def test_off_policy_mask_config() -> None:
    assert make_config(None, {"off_policy_mask_threshold": 0.5}).off_policy_mask == 0.5
    assert make_config(None, {"off_policy_mask_threshold": None}).off_policy_mask == 0.0
    with pytest.raises(ConfigError, match="off_policy_mask_threshold: 0 .TRL. must be > 0"):
        make_config(None, {"off_policy_mask_threshold": 0.0})
    with pytest.raises(ConfigError, match="off_policy_mask must be >= 0"):
        make_config(None, {"off_policy_mask": -1})


# --------------------------------------------------------------------- default --


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
