"""grpolab.rollout.packed and the fast paths built on it: LoRA merged for sampling, oneDNN-prepacked
weights, the chunked head through a packed weight, and the two-level sampler.

Each is checked against the plain computation it replaces (same maths, other rounding).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpolab.rollout import packed, sampling
from grpolab.rollout.batch import shared_prompts
from grpolab.rollout.head import entropy_from_logp, head_logprobs
from grpolab.rollout.hf import HFBackend
from grpolab.rollout.kvcache import Decoder
from grpolab.rollout.models import load_model
from grpolab.rollout.tinyhf import make_tiny_model

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                          "_reorder_linear_weight")


@pytest.fixture(scope="module")
def lora_backend(tmp_path_factory: pytest.TempPathFactory) -> HFBackend:
    path = make_tiny_model(tmp_path_factory.mktemp("llama"), hidden=32, heads=4, arch="llama")
    be = HFBackend(*load_model(path, device="cpu"), reference=False, lora=True,
                   lora_target_modules=["q_proj", "v_proj", "up_proj"])
    with torch.no_grad():  # adapters start as a no-op (lora_B = 0): make them count
        for n, p in be.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    return be


def _lora_layers(be: HFBackend) -> list[nn.Module]:
    return [m for m in be.model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def test_merged_weight_is_the_lora_layers_map(lora_backend: HFBackend) -> None:
    layers = _lora_layers(lora_backend)
    assert layers
    x = torch.randn(5, layers[0].base_layer.in_features)
    with torch.no_grad():
        for m in layers:
            w, b = packed.merged_weight(m)
            torch.testing.assert_close(F.linear(x, w, b), m(x), atol=1e-6, rtol=1e-5)
            assert not torch.allclose(w, m.base_layer.weight)  # the adapters count
        with lora_backend.model.disable_adapter():  # the reference: the base weight itself
            assert all(packed.merged_weight(m)[0] is m.base_layer.weight for m in layers)
    plain = nn.Linear(3, 4)
    assert packed.merged_weight(plain) == (plain.weight, plain.bias)
    assert packed.merged_weight(nn.Conv1d(3, 4, 1)) is None


def test_merged_weight_refuses_what_it_would_change(lora_backend: HFBackend) -> None:
    m = _lora_layers(lora_backend)[0]
    name = m.active_adapters[0]
    m.base_layer.to(torch.bfloat16)  # float32 adapters on a bfloat16 base
    try:
        assert packed.merged_weight(m) is None
    finally:
        m.base_layer.to(torch.float32)
    m.lora_dropout[name] = nn.Dropout(0.5)
    m.train()
    try:
        assert packed.merged_weight(m) is None  # dropout on: the module runs
        m.eval()
        assert packed.merged_weight(m) is not None
    finally:
        m.lora_dropout[name] = nn.Identity()


def test_float32_adapters_on_a_bfloat16_base_run_as_peft_runs_them(
        lora_backend: HFBackend) -> None:
    """The decode loop's map of a LoRA layer whose float32 adapters cannot be merged into its
    bfloat16 base: peft's operations in peft's dtypes (bit-identical on the same base matmul),
    the adapters' small updates kept (a merged bfloat16 weight would round them away)."""
    m = _lora_layers(lora_backend)[0]
    m.base_layer.to(torch.bfloat16)
    try:
        x = torch.randn(6, m.base_layer.in_features).bfloat16()
        base = m.base_layer
        with torch.no_grad():
            want = m(x)
            f = packed.lowrank_linear(m, lambda x: F.linear(x, base.weight, base.bias))
            got = f(x)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want)
            assert not torch.equal(want, base(x))  # the adapters count
            dec = packed.decode_proj(m, 6, lambda _: pytest.fail("fell back to the module"))
            torch.testing.assert_close(dec(x), want, atol=2e-2, rtol=2e-2)  # packed: bf16 rounding
            with lora_backend.model.disable_adapter():  # the reference: the base alone
                assert torch.equal(packed.lowrank_linear(m, base)(x), base(x))
        assert packed.lowrank_linear(nn.Conv1d(3, 4, 1), base) is None
    finally:
        m.base_layer.to(torch.float32)


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN")
def test_packed_weight_is_kept_while_frozen_and_redone_when_changed() -> None:
    w = torch.randn(16, 8)
    x = torch.randn(3, 8)
    old = packed.PACK_MIN, packed.PACK_MIN_BF16
    packed.PACK_MIN = packed.PACK_MIN_BF16 = 0
    try:
        first = packed.packed_weight(w, 3)
        assert first is not None and packed.packed_weight(w, 3) is first  # kept
        f = packed.packed_linear(w, None, 3)
        torch.testing.assert_close(f(x), F.linear(x, w), atol=1e-6, rtol=1e-5)
        w.add_(1.0)  # an optimizer step in place: the copy is stale
        again = packed.packed_weight(w, 3)
        assert again is not first
        torch.testing.assert_close(packed.packed_linear(w, None, 3)(x), F.linear(x, w),
                                   atol=1e-6, rtol=1e-5)
        w.data.add_(1.0)  # bypasses the version counter: clear_packed() forgets the copy
        packed.clear_packed()
        torch.testing.assert_close(packed.packed_linear(w, None, 3)(x), F.linear(x, w),
                                   atol=1e-6, rtol=1e-5)
        trained = torch.randn(16, 8, requires_grad=True)  # trained weights keep no copy
        assert packed.packed_weight(trained, 3) is not packed.packed_weight(trained, 3)
        assert packed.packed_weight(w.double(), 3) is None  # float32 and bfloat16 only
        wb = w.bfloat16()
        if packed._bf16_cpu():  # bfloat16 weights pack where the CPU has bf16 instructions
            torch.testing.assert_close(packed.packed_linear(wb, None, 3)(x.bfloat16()),
                                       F.linear(x.bfloat16(), wb), atol=0.1, rtol=1e-2)
            assert packed.packed_weight(wb, 3) is not None
        else:
            assert packed.packed_weight(wb, 3) is None
    finally:
        packed.PACK_MIN, packed.PACK_MIN_BF16 = old


@pytest.mark.parametrize("pack_all", [False, True])
def test_decoder_on_decode_weights_matches_the_training_forward(
        lora_backend: HFBackend, monkeypatch: pytest.MonkeyPatch, pack_all: bool) -> None:
    """Merged LoRA (and, with pack_all, every weight through oneDNN) gives the decode loop the
    logits of the plain weights, step by step, for grouped rows (shared prompts)."""
    if pack_all and not ONEDNN:
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(packed, "PACK_MIN", 0 if pack_all else packed.PACK_MIN)
    be = lora_backend
    ids, mask = be.encode_prompts([p for p in ("2 + 3 =", "Compute 12 * 7.") for _ in range(3)])
    shared = shared_prompts(ids, mask)
    fast = be._fast
    steps = 12
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 60, (ids.shape[0], steps), generator=g)
    with torch.inference_mode():
        outs = []
        for pack in (False, True):
            fast.pack = pack
            dec = Decoder(fast, ids, mask, steps + 1, shared)
            assert isinstance(dec.ws.layers[0].q, nn.Module) != pack  # peft's layer, or merged
            outs.append([dec.logits] + [dec.step(tokens[:, t]) for t in range(steps)])
    fast.pack = True
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)


def test_bfloat16_decoder_keeps_the_adapters(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 model with float32 adapters: the decode loop runs the adapters beside the
    (packed, where the CPU has bfloat16 instructions) base, so its logits follow peft's
    forward step by step, and differ from the base's (the adapters are not rounded away)."""
    monkeypatch.setattr(packed, "PACK_MIN_BF16", 0)
    path = make_tiny_model(tmp_path, hidden=32, heads=4, arch="llama")
    be = HFBackend(*load_model(path, device="cpu", dtype="bfloat16"), reference=False, lora=True,
                   lora_target_modules=["q_proj", "v_proj", "up_proj"])
    with torch.no_grad():
        for n, p in be.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    ids, mask = be.encode_prompts([p for p in ("2 + 3 =", "Compute 12 * 7.") for _ in range(3)])
    shared = shared_prompts(ids, mask)
    fast, steps = be._fast, 12
    tokens = torch.randint(3, 60, (ids.shape[0], steps), generator=torch.Generator().manual_seed(0))

    def run(pack: bool) -> list[Tensor]:
        fast.pack = pack
        dec = Decoder(fast, ids, mask, steps + 1, shared)
        assert isinstance(dec.ws.layers[0].q, nn.Module) != pack  # peft's layer, or ours
        return [dec.logits] + [dec.step(tokens[:, t]) for t in range(steps)]

    with torch.inference_mode():
        peft_run, ours = run(False), run(True)
        with be.model.disable_adapter():
            base = run(True)
    fast.pack = True
    for a, b, c in zip(peft_run, ours, base, strict=True):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), a.float(), atol=0.1, rtol=0.05)
    assert max((a.float() - c.float()).abs().max() for a, c in zip(peft_run, base)) > 0.2


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN")
def test_chunked_head_through_a_packed_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed, "PACK_MIN", 0)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 16, generator=g)
    b = torch.randn(300, generator=g)
    h0 = torch.randn(37, 16, generator=g)
    t = torch.randint(0, 300, (37,), generator=g)
    got, want = [], []
    for linear, out in ((packed.packed_linear(w, b, 8), got), (None, want)):
        h = h0.clone().requires_grad_(True)
        lp, ent = head_logprobs(h, w, b, t, 0.7, chunk=8, linear=linear)
        (lp * torch.linspace(-1, 1, 37)).sum().backward()
        out += [lp, ent, h.grad]
    for a, c in zip(got, want, strict=True):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_head_backward_with_a_masked_target_row() -> None:
    """A target of probability 0 (-inf logit) has no finite log-sum-exp shortcut: backward
    falls back to softmax and still gives the gradient of the full log-softmax."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(50, 8, dtype=torch.float64, generator=g)
    b = torch.zeros(50, dtype=torch.float64)
    b[7] = float("-inf")
    h = torch.randn(6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.tensor([1, 2, 3, 4, 7, 6])  # row 4's target is impossible: lp = -inf
    lp, _ = head_logprobs(h, w, b, t, 1.0, chunk=4)
    lp.sum().backward()
    h2 = h.detach().clone().requires_grad_(True)
    want = torch.log_softmax(F.linear(h2, w, b), -1).gather(-1, t[:, None]).squeeze(-1)
    want.sum().backward()
    assert lp[4] == -float("inf") == want[4]
    torch.testing.assert_close(lp, want)
    torch.testing.assert_close(h.grad, h2.grad)  # (onehot - softmax is finite there too)


def test_entropy_with_impossible_tokens_is_finite_and_differentiable() -> None:
    logits = torch.tensor([[0.0, 0.0, float("-inf"), 0.0], [1.0, 2.0, 3.0, 4.0]],
                          requires_grad=True)
    p = torch.softmax(logits[1].detach(), -1)
    want = torch.stack([torch.log(torch.tensor(3.0)), -(p * p.log()).sum()])
    with torch.no_grad():  # the fused product, NaN row summed again
        torch.testing.assert_close(entropy_from_logp(torch.log_softmax(logits, -1)), want)
    ent = entropy_from_logp(torch.log_softmax(logits, -1))  # with autograd (entropy bonus)
    torch.testing.assert_close(ent.detach(), want)
    ent.sum().backward()
    assert torch.isfinite(logits.grad[:, [0, 1, 3]]).all() and torch.isfinite(logits.grad[1]).all()


@pytest.mark.parametrize("vocab", [49152, 3001])
def test_two_level_sampler_draws_the_full_search_token(vocab: int) -> None:
    """Same uniforms, same tokens as the one-level float64 inverse CDF; tokens of probability 0
    (every 7th, and the last 300, part of the padded final block) are never drawn."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(256, vocab, generator=g) * 3
    logits[:, ::7] = float("-inf")
    logits[:, -300:] = float("-inf")
    got = sampling.sample_next(logits, 0.8, torch.Generator().manual_seed(5))
    probs = torch.softmax(logits / 0.8, -1)
    u = torch.rand((256, 1), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert torch.equal(got, sampling._inverse_cdf(probs, u))
    assert bool((probs.gather(1, got[:, None]) > 0).all())


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN")
def test_frozen_linear_gives_f_linears_values_and_input_gradient(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring's frozen linear on oneDNN copies: F.linear's output and input gradient (other
    rounding), no gradient for the frozen weight, and the W.T copy made at the first backward
    only (inference needs none) and kept after it."""
    monkeypatch.setattr(packed, "PACK_MIN", 0)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(12, 7, generator=g), torch.randn(12, generator=g)
    x = torch.randn(2, 5, 7, generator=g, requires_grad=True)
    f = packed.frozen_linear(w, b, 10)
    with torch.no_grad():
        torch.testing.assert_close(f(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert (id(w), True) not in packed._PACKED and (id(w), False) in packed._PACKED
    up = torch.randn(2, 5, 12, generator=g)
    (f(x) * up).sum().backward()
    got, x.grad = x.grad, None
    (F.linear(x, w, b) * up).sum().backward()
    torch.testing.assert_close(got, x.grad, atol=1e-5, rtol=1e-5)
    assert (id(w), True) in packed._PACKED
    assert packed.frozen_linear(w.clone().requires_grad_(True), b, 10) is None  # trains


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN")
def test_kept_copies_stop_at_the_memory_budget(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Kept copies take at most ``keep_budget()`` bytes: a frozen weight beyond it runs on
    F.linear (no frozen_linear), its input gradient on g @ W where the W.T copy does not fit,
    with one warning a process; a copy redone after an update replaces its own bytes, and a
    copy goes (with its bytes) when its weight does."""
    machine = packed.keep_budget()  # a share of this machine's memory
    assert 0 < machine <= packed.KEEP_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")
    monkeypatch.setattr(packed, "PACK_MIN", 0)
    monkeypatch.setattr(packed, "_PACKED", {})
    monkeypatch.setattr(packed, "keep_budget", lambda: 2 * 16 * 8 * 4 + 100)  # two copies
    packed._say_budget_reached.cache_clear()
    g = torch.Generator().manual_seed(0)
    w1, w2, w3 = (torch.randn(16, 8, generator=g) for _ in range(3))
    assert packed.packed_weight(w1, 4) is not None and packed.packed_weight(w2, 4) is not None
    with caplog.at_level(logging.WARNING, logger=packed.__name__):
        assert packed.packed_weight(w3, 4) is None
        assert packed.frozen_linear(w3, None, 4) is None
    assert [r.getMessage()[:36] for r in caplog.records] == [
        "oneDNN copies of frozen weights stop"]
    w1.add_(1.0)  # stale: its new copy takes the old one's place
    assert packed.packed_weight(w1, 4) is not None
    x = torch.randn(3, 8, generator=g, requires_grad=True)
    packed.frozen_linear(w2, None, 4)(x).sum().backward()  # no room for W2.T's copy
    assert (id(w2), True) not in packed._PACKED
    torch.testing.assert_close(x.grad, w2.sum(0).expand(3, 8), atol=1e-6, rtol=1e-6)
    del w1
    assert packed.packed_weight(w3, 4) is not None


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN")
def test_scoring_on_onednn_copies_matches_the_plain_forward(
        lora_backend: HFBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """FastLM's scoring with every frozen linear on oneDNN copies (speed.score_pack): the
    plain forward's log-probs and the LoRA adapters' gradients, up to rounding."""

    monkeypatch.setattr(packed, "PACK_MIN", 0)
    be = lora_backend
    ro = be.generate(["2 + 3 =", "Compute 12 * 7."], 1.0, 6, torch.Generator().manual_seed(0))
    out = []
    for on in (False, True):
        monkeypatch.setattr(be._fast, "score_pack", on)
        be.model.zero_grad()
        lp = be.logprobs(ro, 1.0)
        (lp * ro.completion_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in be.model.named_parameters() if p.grad is not None}
        w = be._fast.weights()
        assert isinstance(w.layers[0].q, nn.Module) != on  # peft's module, or ours
        out.append((lp.detach(), grads))
    (lp0, g0), (lp1, g1) = out
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    assert g0.keys() == g1.keys() and any("lora_A" in n for n in g0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-4)
