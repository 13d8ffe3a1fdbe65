"""The GRPO loss against hand-computed values, and its aggregation variants."""

import math

import pytest
import torch

from grpolab.core.advantages import group_advantages
from grpolab.core.losses import aggregate, grpo_loss, k3_kl, ppo_clip_loss


def toy() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two answers to one prompt: a right one of 2 tokens, a wrong one of 1 token."""
    logp = torch.tensor([[-0.5, -1.0], [-2.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-0.6, -0.9], [-1.5, -7.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    return logp, ref, mask


def test_k3_values() -> None:
    lp, ref = torch.tensor([-0.5, -1.0, -2.0]), torch.tensor([-0.6, -0.9, -1.5])
    want = [math.exp(d) - d - 1 for d in (-0.1, 0.1, 0.5)]
    assert k3_kl(lp, ref).tolist() == pytest.approx(want, rel=1e-5)
    assert k3_kl(lp, lp).tolist() == [0.0, 0.0, 0.0]
    assert (k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


def test_loss_hand_computed_two_answers() -> None:
    logp, ref, mask = toy()
    adv = group_advantages(torch.tensor([1.0, 0.0]), 2)
    assert adv.tolist() == pytest.approx([1.0, -1.0])
    out = grpo_loss(logp, logp.detach(), ref, adv, mask, beta=0.1)
    kl = [0.0048374180, 0.0051709181, 0.1487212707]
    seq0 = ((-1 + 0.1 * kl[0]) + (-1 + 0.1 * kl[1])) / 2  # per-reply token mean
    seq1 = 1 + 0.1 * kl[2]  # padding token ignored
    assert out.loss.item() == pytest.approx((seq0 + seq1) / 2, abs=1e-7)
    assert out.loss.item() == pytest.approx(0.00768627, abs=1e-7)
    assert out.kl == pytest.approx(sum(kl) / 3, rel=1e-5)
    out.loss.backward()
    # d/dlogp of -A*ratio per token, with 1/len(reply) and 1/B weights, plus the KL term.
    g = logp.grad
    dk = lambda d: 1 - math.exp(d)
    assert g[0, 0].item() == pytest.approx(0.25 * (-1 + 0.1 * dk(-0.1)), abs=1e-6)
    assert g[1, 0].item() == pytest.approx(0.5 * (1 + 0.1 * dk(0.5)), abs=1e-6)
    assert g[1, 1].item() == 0.0


def test_dead_group_has_zero_gradient_without_kl() -> None:
    logp, ref, mask = toy()
    adv = group_advantages(torch.tensor([1.0, 1.0]), 2)
    out = grpo_loss(logp, logp.detach(), ref, adv, mask, beta=0.0)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert torch.count_nonzero(logp.grad) == 0
    # ... while the KL term alone still pulls toward the reference.
    logp2, ref2, mask2 = toy()
    grpo_loss(logp2, logp2.detach(), ref2, adv, mask2, beta=0.1).loss.backward()
    assert torch.count_nonzero(logp2.grad) > 0


def test_aggregations() -> None:
    per_tok = torch.tensor([[1.0, 3.0, 5.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(per_tok, mask, "seq_mean_token_mean").item() == pytest.approx((3 + 2) / 2)
    assert aggregate(per_tok, mask, "token_mean").item() == pytest.approx(11 / 4)
    assert aggregate(per_tok, mask, "seq_mean_token_sum_norm", 8).item() == pytest.approx(
        (9 / 8 + 2 / 8) / 2
    )
    with pytest.raises(ValueError):
        aggregate(per_tok, mask, "seq_mean_token_sum_norm")


def test_length_bias_of_per_reply_mean() -> None:
    """Per-reply averaging gives each token of a short reply more weight than a long one's."""
    logp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([-1.0, -1.0])
    grpo_loss(logp, logp.detach(), None, adv, mask, beta=0.0).loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(4 * logp.grad[1, 0].item())
    logp.grad = None
    grpo_loss(logp, logp.detach(), None, adv, mask, beta=0.0, agg="token_mean").loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(logp.grad[1, 0].item())
    logp.grad = None
    grpo_loss(logp, logp.detach(), None, adv, mask, beta=0.0, agg="seq_mean_token_sum_norm",
              norm_len=4).loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(logp.grad[1, 0].item())


def clipped_surrogate(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, eps_low: float,
                      eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    terms = ppo_clip_loss(logp, old, adv, torch.ones_like(logp), eps_low=eps_low,
                          eps_high=eps_high)
    return terms.loss, terms.clipped


def test_clipping_and_clip_higher() -> None:
    old = torch.zeros(1, 1)
    up = torch.log(torch.tensor([[1.25]]))
    pos = torch.tensor([1.0])
    loss, clipped = clipped_surrogate(up, old, pos, 0.2, 0.2)
    assert loss.item() == pytest.approx(-1.2) and clipped.item()
    loss, clipped = clipped_surrogate(up, old, pos, 0.2, 0.28)  # DAPO clip-higher
    assert loss.item() == pytest.approx(-1.25) and not clipped.item()
    down = torch.log(torch.tensor([[0.5]]))
    loss, clipped = clipped_surrogate(down, old, torch.tensor([-1.0]), 0.2, 0.28)
    assert loss.item() == pytest.approx(0.8) and clipped.item()
    # A clipped token carries no gradient.
    lp = up.clone().requires_grad_(True)
    grpo_loss(lp, old, None, pos, torch.ones(1, 1), beta=0.0).loss.backward()
    assert lp.grad.item() == 0.0


def test_first_epoch_ratio_is_one() -> None:
    logp, _, mask = toy()
    out = grpo_loss(logp, logp.detach(), None, torch.tensor([1.0, -1.0]), mask, beta=0.0,
                    eps_low=0.0, eps_high=0.0)
    assert out.clip_frac == 0.0
    out.loss.backward()
    assert torch.count_nonzero(logp.grad) == 3


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm",
                                 "seq_mean_token_sum"])
def test_parts_with_global_denominators_sum_to_the_whole_batch(agg: str) -> None:
    """Micro-batches and ranks are a property of grpo_loss: each part, given the global reply
    and token counts, returns its exact share, so the parts' losses, statistics and gradients
    add up to the one-pass numbers (verl's agg_loss with global batch size and token count)."""
    g = torch.Generator().manual_seed(0)
    b, t = 6, 5
    logp0 = -torch.rand(b, t, generator=g) - 0.1
    ref = logp0 - 0.1 * torch.rand(b, t, generator=g)
    ent = torch.rand(b, t, generator=g)
    mask = torch.ones(b, t)
    for i, n in enumerate((5, 2, 4, 1, 3, 5)):  # answers of different lengths
        mask[i, n:] = 0
    adv = torch.randn(b, generator=g)
    kw = {"beta": 0.1, "agg": agg, "norm_len": t, "entropy_coef": 0.01}

    def run(rows: list[int], whole: bool) -> tuple[torch.Tensor, object]:
        lp = logp0.clone().requires_grad_(True)
        r = torch.tensor(rows)
        out = grpo_loss(lp[r], lp[r].detach(), ref[r], adv[r], mask[r], entropy=ent[r], **kw,
                        **({} if whole else {"global_rows": b,
                                             "global_tokens": int(mask.sum())}))
        out.loss.backward()
        return lp.grad, out

    grad_all, whole = run(list(range(b)), True)
    parts = [[0, 1], [2, 3, 4], [5]]  # two micro-batches and a third "rank", unequal in size
    outs = [run(p, False) for p in parts]
    grad = sum(o[0] for o in outs)
    torch.testing.assert_close(grad, grad_all, rtol=1e-5, atol=1e-7)
    assert sum(float(o.loss.detach()) for _, o in outs) == pytest.approx(float(whole.loss.detach()),
                                                                         rel=1e-5)
    for name in ("policy_loss", "kl", "clip_frac", "entropy", "entropy_share"):
        assert sum(getattr(o, name) for _, o in outs) == pytest.approx(getattr(whole, name),
                                                                       rel=1e-5), name


def test_head_logprobs_equal_full_logits_and_pass_gradcheck() -> None:
    """``head_logprobs`` (chunked through the head, backward recomputing each chunk) is
    log_softmax(scale * (h W^T + b)) gathered at the targets, with exact gradients."""
    from grpolab.rollout.head import head_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(12, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(12, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 12, (2, 3), generator=g)
    for scale, chunk in ((1.0, 4), (1 / 0.7, 7), (2.0, 100)):
        lp, ent = head_logprobs(h, w, b, y, scale, chunk)
        logp = torch.log_softmax(scale * (h @ w.T + b), dim=-1)  # float64 throughout
        torch.testing.assert_close(lp, logp.gather(-1, y[..., None])[..., 0])
        torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1))
        assert not ent.requires_grad
        lp_only, none = head_logprobs(h, w, b, y, scale, chunk, entropy=False)
        assert torch.equal(lp_only, lp) and torch.equal(none, torch.zeros_like(ent))
        assert torch.autograd.gradcheck(
            lambda h, w, b, s=scale, c=chunk: head_logprobs(h, w, b, y, s, c)[0], (h, w, b))
    assert torch.autograd.gradcheck(lambda h, w: head_logprobs(h, w, None, y, 1.0, 4)[0], (h, w))


def test_head_logprobs_with_a_frozen_head_finish_the_gradient_in_forward() -> None:
    """With only the hidden states trainable (LoRA), forward computes d lp / d hidden and
    backward only scales it: the same values, entropies and gradients as the full logits."""
    from grpolab.rollout.head import head_logprobs

    g = torch.Generator().manual_seed(1)
    w = torch.randn(12, 6, dtype=torch.float64, generator=g)
    b = torch.randn(12, dtype=torch.float64, generator=g)
    y = torch.randint(0, 12, (2, 3), generator=g)
    b[5] = float("-inf")  # an impossible token: 0 log 0 = 0 in the entropy, finite gradients
    for scale, chunk in ((1.0, 4), (1 / 0.7, 7), (2.0, 1)):
        h = torch.randn(2, 3, 6, dtype=torch.float64, generator=g, requires_grad=True)
        saved: list[tuple[int, ...]] = []  # what backward keeps: the [N, D] gradient only
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t, saved=saved: saved.append(tuple(t.shape)) or t, lambda t: t):
            lp, ent = head_logprobs(h, w, b, y, scale, chunk)
        assert saved == [(6, 6)]
        (lp * torch.arange(1.0, 7.0, dtype=torch.float64).view(2, 3)).sum().backward()
        h2 = h.detach().clone().requires_grad_(True)
        logp = torch.log_softmax(scale * (h2 @ w.T + b), dim=-1)
        want = logp.gather(-1, y[..., None])[..., 0]
        (want * torch.arange(1.0, 7.0, dtype=torch.float64).view(2, 3)).sum().backward()
        torch.testing.assert_close(lp, want)
        finite = logp.clamp(min=torch.finfo(logp.dtype).min)
        torch.testing.assert_close(ent, -(logp.exp() * finite).sum(-1).detach())
        torch.testing.assert_close(h.grad, h2.grad)
        assert torch.autograd.gradcheck(
            lambda h, s=scale, c=chunk: head_logprobs(h, w, b, y, s, c)[0], (h,))
    with torch.no_grad():  # no autograd, nothing kept
        assert head_logprobs(h, w, b, y)[0].grad_fn is None
    # bfloat16 hidden states and head: the float32 gradient rounded once, as the full logits'
    hb, wb = h.detach().bfloat16().requires_grad_(True), w.bfloat16()
    head_logprobs(hb, wb, None, y, 1.5, 4)[0].sum().backward()
    h32 = hb.detach().float().requires_grad_(True)
    torch.log_softmax(1.5 * (h32 @ wb.float().T), -1).gather(-1, y[..., None]).sum().backward()
    assert hb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hb.grad.float(), h32.grad, atol=2e-2, rtol=2e-2)
