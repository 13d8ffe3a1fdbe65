"""grpolab.rollout.fastlm: the lean forward computes what the HF forward computes, and is used by HFBackend.

Logits (left padding, position ids, shared prompts), greedy and sampled decoding, gradients of a
scoring loss and LoRA all match the HF model; unsupported models fall back to the HF forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import same_answers
from torch import nn

from grpolab.config import Speed
from grpolab.rollout import backend as rollout
from grpolab.rollout import fastlm, kvcache, logprobs
from grpolab.rollout.batch import Rollout, shared_prompts
from grpolab.rollout.fastlm import FastLM, pos_ids, unsupported
from grpolab.rollout.graphdecode import GraphDecoder
from grpolab.rollout.hf import HFBackend, HFDecoder
from grpolab.rollout.models import load_model
from grpolab.rollout.tinyhf import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from decode_kernels import Kernels  # the bench's count of a step's kernels

PROMPTS = ["What is 2 + 3?", "Compute 12 * 7. So the answer is", "1", "<think> 40 - 8 ="]

# name -> make_tiny_model kwargs: MHA with tied embeddings, GPT-2, and GQA (2 kv heads for 4
# query heads) with untied embeddings.
TINY = {
    "llama": {"arch": "llama"},
    "gpt2": {"arch": "gpt2"},
    "gqa": {"arch": "llama", "kv_heads": 2, "tie_word_embeddings": False},
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {name: make_tiny_model(tmp_path_factory.mktemp(name), hidden=32, heads=4, **kw)
            for name, kw in TINY.items()}


def backend(paths: dict[str, str], name: str, device: str = "cpu", **kw: Any) -> HFBackend:
    kw.setdefault("reference", False)
    return HFBackend(*load_model(paths[name], device=device), **kw)


def padded_batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[4, 9] ids with 0, 3, 1 and 5 left-padding positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 3, 1, 5)):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def in_memory(kind: str, **over: Any) -> nn.Module:
    """Random qwen2 (q/k/v biases) or mistral (sliding window) models, no tokenizer needed."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "pad_token_id": 0, **over}
    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    return MistralForCausalLM(MistralConfig(sliding_window=16, **common)).eval()


def assert_logits_match(model: nn.Module, vocab: int, cuda_layout: bool | None = None) -> None:
    """FastLM == HF forward at every real position of a left-padded batch, one pass and with
    the prompt shared (prompt = first 6 columns, completion = the last 3)."""
    lm = FastLM(model)
    lm.cuda_layout = cuda_layout
    ids, mask = padded_batch(vocab)
    pos = pos_ids(mask)
    real = mask.bool()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = lm.logits(ids, mask, pos, keep=0)
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
        # groups: rows 0 and 1 share row 0's prompt, rows 2 and 3 row 2's
        ids[1, :6], mask[1, :6] = ids[0, :6], mask[0, :6]
        ids[3, :6], mask[3, :6] = ids[2, :6], mask[2, :6]
        pos = pos_ids(mask)
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -4:-1]
        shared = shared_prompts(ids[:, :6], mask[:, :6])
        assert shared is not None and shared[0].shape[0] == 2
        got = lm.shared_prefix_logits(ids, mask, pos, 3, shared)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("name", list(TINY))
def test_logits_match_hf_with_left_padding(paths: dict[str, str], name: str) -> None:
    model, tok = load_model(paths[name], device="cpu")
    assert unsupported(model) is None
    assert_logits_match(model.eval(), len(tok))


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_llama_family_variants_match_hf(kind: str) -> None:
    model = in_memory(kind)
    assert unsupported(model) is None
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert_logits_match(model, 128)  # 9 tokens: within mistral's window of 16
    lm = FastLM(model)
    assert lm.fits(16) and not lm.fits(17) if kind == "mistral" else lm.fits(10**6)


# ------------------------------------------------------------------------------ sampling


@pytest.fixture(params=["plain-cache", "shared-cache"])
def cache_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Decode grouped rows with a plain cache (prompt copied per row) or the shared one."""
    shared = request.param == "shared-cache"
    monkeypatch.setattr(kvcache, "SHARED_MIN_BYTES", 0 if shared else 1 << 62)
    return request.param


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("grouped", [False, True], ids=["distinct", "grouped"])
def test_greedy_decoding_equals_hf_generate(paths: dict[str, str], name: str, grouped: bool,
                                             cache_kind: str) -> None:
    be = backend(paths, name)
    assert be._fast is not None
    prompts = [p for p in PROMPTS for _ in range(3 if grouped else 1)]
    ids, mask = be.encode_prompts(prompts)
    fast = be._sample(ids, mask, 0.0, 12, seed=0)
    ref = be._hf_generate(ids, mask, 0.0, 12, seed=0)
    assert torch.equal(fast, ref)
    same_len = be.encode_prompts(["What is 2 + 3?", "What is 4 + 5?"])  # no padding at all
    assert not (same_len[1] == 0).any()
    assert torch.equal(be._sample(*same_len, 0.0, 12, seed=0),
                       be._hf_generate(*same_len, 0.0, 12, seed=0))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sampling_equals_hf_forward_loop(paths: dict[str, str], name: str,
                                         cache_kind: str) -> None:
    """Same seed, same logits: the lean and the HF-forward sampling loops draw the same tokens."""
    be = backend(paths, name)
    prompts = [p for p in PROMPTS for _ in range(4)]
    ids, mask = be.encode_prompts(prompts)
    fast = be._sample(ids, mask, 1.0, 16, seed=7)
    be._fast = None
    slow = be._sample(ids, mask, 1.0, 16, seed=7)
    assert torch.equal(fast, slow)
    assert len({tuple(r) for r in fast.tolist()}) > 4  # really sampled


@pytest.mark.parametrize("name", list(TINY))
def test_shared_prompt_cache_equals_plain_cache(paths: dict[str, str], name: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows decoded against one copy of their group's prompt get the plain cache's logits.

    Groups interleaved (the decoder reorders rows and must undo it), prompts of different
    lengths (left padding), GQA and GPT-2 included; unequal groups keep the plain cache.
    """
    default = kvcache.SHARED_MIN_BYTES
    be = backend(paths, name)
    prompts = [PROMPTS[i % 3] for i in range(9)]  # 3 groups of 3: rows 0, 3, 6 share a prompt
    ids, mask = be.encode_prompts(prompts)
    assert not mask.all()
    feed = torch.randint(3, be.model.config.vocab_size, (6, 9),
                         generator=torch.Generator().manual_seed(0))

    def decode(min_bytes: int, ids: torch.Tensor, mask: torch.Tensor) -> tuple[Any, torch.Tensor]:
        monkeypatch.setattr(kvcache, "SHARED_MIN_BYTES", min_bytes)
        with torch.inference_mode():
            dec = be._fast.decoder(ids, mask, 7, shared_prompts(ids, mask))
            out = [dec.logits] + [dec.step(tokens[: ids.shape[0]]) for tokens in feed]
        return dec, torch.stack(out)

    plain_dec, plain = decode(1 << 62, ids, mask)
    shared_dec, shared = decode(0, ids, mask)
    assert isinstance(plain_dec.cache, kvcache.StaticKV)
    assert isinstance(shared_dec.cache, kvcache.SharedKV) and shared_dec.cache.group == 3
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    assert isinstance(decode(default, ids, mask)[0].cache, kvcache.StaticKV)  # tiny: below 1 MiB
    ids, mask = be.encode_prompts(prompts[:8])  # groups of 3, 3 and 2
    assert isinstance(decode(0, ids, mask)[0].cache, kvcache.StaticKV)


@pytest.mark.parametrize("name", list(TINY))
def test_early_exit_draws_the_same_answers(paths: dict[str, str], name: str, cache_kind: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Finished rows leave the decoder's batch (lean and HF-forward loops, plain and shared
    caches, padded prompts, interleaved groups): every answer is the one drawn without early
    exit, from the same random stream, and the decoder really computes fewer rows."""
    be = backend(paths, name)
    be.eos_ids = list(range(3, be.model.config.vocab_size, 5))  # a fifth of the vocabulary
    prompts = [PROMPTS[i % 4] for i in range(16)]  # 4 groups of 4, interleaved
    ids, mask = be.encode_prompts(prompts)
    rows: list[list[int]] = []
    for cls, fn in ((kvcache.Decoder, "shrink"), (HFDecoder, "shrink")):
        orig = getattr(cls, fn)

        def spy(self: Any, done: torch.Tensor, orig: Any = orig) -> Any:
            keep = orig(self, done)
            rows[-1].append(done.shape[0] if keep is None else int(keep.sum()))
            return keep

        monkeypatch.setattr(cls, fn, spy)
    fast = be._fast
    got = {}
    for lean in (True, False):
        be._fast = fast if lean else None
        for early in (True, False):
            be.speed = dataclasses.replace(be.speed, early_exit=early)
            rows.append([])
            got[lean, early] = be._sample(ids, mask, 1.0, 20, seed=5)
            assert bool(rows[-1]) == early
            if early:  # the batch shrank step by step, never below the unfinished rows
                assert rows[-1][-1] < 16 and rows[-1] == sorted(rows[-1], reverse=True)
    want = got[True, False]
    lengths = (want != be.pad_id).sum(1)
    assert len(set(lengths.tolist())) > 3 and int(lengths.max()) > 4  # ragged, really sampled
    for key, out in got.items():
        assert torch.equal(out, want), key


# ------------------------------------------------------------------------------ scoring


def scores_and_grads(be: HFBackend, ro: Any, fast: FastLM | None,
                     temperature: float = 0.8) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    be._fast = fast
    be.model.train()
    be.model.zero_grad(set_to_none=True)
    lp = be.logprobs(ro, temperature)
    w = torch.linspace(-1, 1, lp.numel()).view_as(lp)  # a loss that weighs every position
    (lp * w * ro.completion_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in be.model.named_parameters() if p.grad is not None}
    return lp.detach(), grads


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("grouped", [False, True], ids=["one-pass", "shared-prompt"])
def test_scoring_logprobs_and_grads_equal_hf(paths: dict[str, str], name: str,
                                             grouped: bool) -> None:
    be = backend(paths, name)
    fast = be._fast
    assert fast is not None
    prompts = [p for p in PROMPTS for _ in range(3 if grouped else 1)]
    ro = be.generate(prompts, 1.0, 10, torch.Generator().manual_seed(3))
    assert (shared_prompts(ro.prompt_ids, ro.prompt_mask) is not None) == grouped
    lp_fast, g_fast = scores_and_grads(be, ro, fast)
    lp_hf, g_hf = scores_and_grads(be, ro, None)
    m = ro.completion_mask.bool()
    torch.testing.assert_close(lp_fast[m], lp_hf[m], atol=2e-5, rtol=1e-5)
    assert g_fast.keys() == g_hf.keys() and len(g_hf) == len(list(be.model.parameters()))
    for n in g_hf:
        torch.testing.assert_close(g_fast[n], g_hf[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_shrunk_decoder_keeps_each_rows_logits(kind: str, cache_kind: str) -> None:
    """Three drops (the first turns a shared cache into a plain one), padded prompts of three
    lengths, groups interleaved: every kept row's logits are those of a decoder that never
    drops. Large weights and fast rotations (theta 100) make attention sharp, so a row given
    another row's keys, positions or rotations would show."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                           n_positions=64, initializer_range=0.3)).eval()
    else:
        model = in_memory("qwen2", vocab_size=64, initializer_range=0.3, rope_theta=100.0)
    lm = FastLM(model)
    g = torch.Generator().manual_seed(1)
    u, um = torch.randint(1, 64, (3, 7), generator=g), torch.ones(3, 7, dtype=torch.long)
    for i, pad in enumerate((0, 3, 5)):
        um[i, :pad], u[i, :pad] = 0, 0
    rows = torch.tensor([i % 3 for i in range(12)])
    ids, mask = u[rows], um[rows]
    feed = torch.randint(1, 64, (8, 12), generator=torch.Generator().manual_seed(2))
    drops = {0: [1, 4, 5, 6, 7, 8, 10], 2: [0, 2, 4, 5, 6, 7, 8, 10, 11], 4: [9]}
    with torch.inference_mode():
        whole = lm.decoder(ids, mask, 8, shared_prompts(ids, mask))
        part = lm.decoder(ids, mask, 8, shared_prompts(ids, mask))
        assert isinstance(part.cache, kvcache.SharedKV) == (cache_kind == "shared-cache")
        live = torch.arange(12)
        for t in range(7):
            want = whole.step(feed[t])
            if t in drops:
                done = torch.zeros(12, dtype=torch.bool)
                done[drops[t]] = True
                keep = part.shrink(done[live])
                assert keep is not None and torch.equal(keep, ~done[live])
                live = live[keep]
            got = part.step(feed[t][live])
            assert float(want.abs().max()) > 3  # sharp enough to tell rows apart
            torch.testing.assert_close(got, want[live], atol=2e-5, rtol=1e-5)
    assert isinstance(part.cache, kvcache.StaticKV) and live.tolist() == [3]
    assert part.shrink(torch.zeros(1, dtype=torch.bool)) is None  # nothing finished: no drop


def test_length_buckets_by_hand() -> None:
    """Sorted longest first, cut where a cut saves more positions than a forward costs; rows
    without answer tokens are left out."""
    assert rollout.length_buckets([64, 63, 10, 9, 8, 0], cost=16) == [[0, 1], [2, 3, 4]]
    assert rollout.length_buckets([9, 10, 64, 8, 63], cost=16) == [[2, 4], [1, 0, 3]]
    assert rollout.length_buckets([5, 4, 5], cost=16) == [[0, 2, 1]]  # a cut saves 1 < 16
    assert rollout.length_buckets([30, 3, 3], cost=0) == [[0], [1, 2]]
    assert rollout.length_buckets([0, 0], cost=16) == []
    assert rollout.answer_lengths(torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])) \
        == [2, 3, 0]


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("grouped", [False, True], ids=["one-pass", "shared-prompt"])
def test_length_buckets_score_what_one_pass_scores(paths: dict[str, str], name: str,
                                                   grouped: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Ragged answers scored bucket by bucket (only their real positions) give the padded
    one-pass log-probs and gradients; positions after an answer's end score 0."""
    be = backend(paths, name)
    be.eos_ids = list(range(3, be.model.config.vocab_size, 6))
    prompts = [p for p in PROMPTS for _ in range(4 if grouped else 1)]
    ro = be.generate(prompts, 1.0, 12, torch.Generator().manual_seed(1))
    lengths = rollout.answer_lengths(ro.completion_mask)
    assert len(set(lengths)) > 2 and max(lengths) == ro.completion_ids.shape[1]
    buckets: list[int] = []
    spy = rollout.bucketed_hidden

    def counted(*a: Any) -> Any:
        buckets.append(len(a[4]))
        return spy(*a)

    monkeypatch.setattr(rollout, "bucketed_hidden", counted)
    for where in (rollout, logprobs):  # tiny answers: cut wherever it saves
        monkeypatch.setattr(where, "BUCKET_COST", 0)
    got = {}
    for on in (True, False):
        be.speed = dataclasses.replace(be.speed, length_buckets=on)
        got[on] = scores_and_grads(be, ro, be._fast)
    assert buckets and buckets[0] > 1  # bucketed once (on), not at all (off)
    m = ro.completion_mask.bool()
    torch.testing.assert_close(got[True][0][m], got[False][0][m], atol=1e-5, rtol=1e-5)
    assert not got[True][0][~m].any()
    for n, g in got[False][1].items():
        torch.testing.assert_close(got[True][1][n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize(("name", "grouped", "tc", "lora", "ckpt"), [
    ("llama", True, 9, True, False), ("gpt2", False, 9, False, True),
    ("llama", True, 9, True, True), ("gqa", True, 1, False, False)])
def test_length_buckets_with_hand_masks(paths: dict[str, str], name: str, grouped: bool,
                                        tc: int, lora: bool, ckpt: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Masks no sampler makes (an interior zero, a row with none, one-token answers), LoRA
    (the reference with adapters off), gradient checkpointing, one-token completions: the
    policy's log-probs and gradients, the entropies and the reference's log-probs are the one
    pass's at every real position, and every path scores 0 elsewhere (so the log-probs of
    different paths never meet at padding)."""
    kw: dict[str, Any] = {"gradient_checkpointing": ckpt}
    if lora:
        kw.update(lora=True, lora_target_modules=["q_proj", "v_proj"])
    be = HFBackend(*load_model(paths[name], device="cpu"), reference=not lora, **kw)
    if lora:
        torch.manual_seed(0)
        with torch.no_grad():
            for n, p in be.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
    prompts = [p for p in PROMPTS for _ in range(3 if grouped else 1)]
    ids, mask = be.encode_prompts(prompts)
    g = torch.Generator().manual_seed(0)
    b = len(prompts)
    lens = torch.randint(0, tc + 1, (b,), generator=g)
    lens[0], lens[1] = tc, max(tc - 3, 1)
    cm = (torch.arange(tc)[None] < lens[:, None]).long()
    cm[2], cm[3] = 0, 0
    cm[3, 0] = 1  # one token
    if tc > 2:
        cm[1, :3] = torch.tensor([1, 0, 1])  # an interior zero
    cids = torch.randint(3, 100, (b, tc), generator=g).masked_fill(cm == 0, be.pad_id)
    ro = Rollout(prompts, ids, mask, cids, cm, [""] * b)
    for where in (rollout, logprobs):
        monkeypatch.setattr(where, "BUCKET_COST", 0)
    if tc > 1:
        assert len(rollout.length_buckets(rollout.answer_lengths(cm))) > 2
    got = {}
    for on in (True, False):
        be.speed = dataclasses.replace(be.speed, length_buckets=on)
        lp, grads = scores_and_grads(be, ro, be._fast)
        _, ent = be.logprobs_and_entropy(ro, 0.8)
        full_lp, _ = be.logprobs_and_entropy(ro, 0.8, entropy_grad=True)  # full logits
        with torch.no_grad():
            ref = be.logprobs(ro, 0.8, reference=True)
        got[on] = lp, grads, ent.detach(), ref, full_lp.detach()
    m = cm.bool()
    for a, b_ in zip(got[True][2:], got[False][2:]):
        torch.testing.assert_close(a[m], b_[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[True][0][m], got[False][0][m], atol=1e-5, rtol=1e-5)
    for n, g_ in got[False][1].items():
        torch.testing.assert_close(got[True][1][n], g_, rtol=1e-4, atol=1e-6, msg=n)
    for x in (*got[True][2:], *got[False][2:], got[True][0], got[False][0]):
        assert not x[~m].any()


def test_reference_model_uses_its_own_lean_forward(paths: dict[str, str]) -> None:
    be = backend(paths, "llama", reference=True)
    assert be._fast_ref is not None and be._fast_ref.model is be.ref
    with torch.no_grad():
        for p in be.model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ro = be.generate(PROMPTS * 2, 1.0, 8, torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast = be.logprobs(ro, 1.0, reference=True)
        be._fast_ref = None
        slow = be.logprobs(ro, 1.0, reference=True)
        policy = be.logprobs(ro, 1.0)
    m = ro.completion_mask.bool()
    torch.testing.assert_close(fast[m], slow[m], atol=2e-5, rtol=1e-5)
    assert (policy[m] - slow[m]).abs().max() > 1e-3


# ------------------------------------------------------------------------------ LoRA


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
@pytest.mark.parametrize(("targets", "options"), [
    (["q_proj", "v_proj", "up_proj"], {}), (["all-linear"], {}),
    # TRL's use_rslora (scale alpha / sqrt(r)) and use_dora (peft runs those layers itself)
    (["q_proj", "v_proj", "up_proj"], {"use_rslora": True}),
    (["q_proj", "v_proj", "up_proj"], {"use_dora": True})], ids=["plain", "all", "rs", "dora"])
def test_lora_model_matches_hf(paths: dict[str, str], targets: list[str], options: dict) -> None:
    be = backend(paths, "llama", lora=True, lora_target_modules=targets, lora_options=options)
    scales = {s for m in be.model.modules() if hasattr(m, "lora_A") for s in m.scaling.values()}
    assert scales == {16 / 8 ** 0.5 if options.get("use_rslora") else 16 / 8}
    assert any("magnitude" in n for n, _ in be.model.named_parameters()) == bool(
        options.get("use_dora"))
    adapted = {n.split(".")[-1] for n, m in be.model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"} if targets == ["all-linear"] else set(targets))
    fast = be._fast
    assert fast is not None
    with torch.no_grad():  # adapters start as a no-op (lora_B = 0): make them count
        for n, p in be.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    ids, mask = be.encode_prompts([p for p in PROMPTS for _ in range(2)])
    assert torch.equal(be._sample(ids, mask, 0.0, 10, seed=0),
                       be._hf_generate(ids, mask, 0.0, 10, seed=0))
    ro = be.generate([p for p in PROMPTS for _ in range(2)], 1.0, 10,
                     torch.Generator().manual_seed(1))
    lp_fast, g_fast = scores_and_grads(be, ro, fast)
    lp_hf, g_hf = scores_and_grads(be, ro, None)
    m = ro.completion_mask.bool()
    torch.testing.assert_close(lp_fast[m], lp_hf[m], atol=2e-5, rtol=1e-5)
    assert g_hf and all("lora_" in n for n in g_hf)
    for n in g_hf:
        torch.testing.assert_close(g_fast[n], g_hf[n], rtol=1e-4, atol=1e-6, msg=n)
    with torch.no_grad():  # the reference is the same modules with adapters off
        be._fast = fast
        ref_fast = be.logprobs(ro, 1.0, reference=True)
        be._fast = None
        ref_hf = be.logprobs(ro, 1.0, reference=True)
    torch.testing.assert_close(ref_fast[m], ref_hf[m], atol=2e-5, rtol=1e-5)
    assert (ref_hf[m] - lp_hf[m]).abs().max() > 1e-3


# ------------------------------------------------------------------------------ fallback


def test_unsupported_models_fall_back_to_hf(paths: dict[str, str]) -> None:
    from transformers import AutoModelForCausalLM

    model, tok = load_model(paths["llama"], device="cpu")
    config = model.config.to_dict()
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    scaled = AutoModelForCausalLM.from_config(type(model.config).from_dict(config))
    assert "rope" in (unsupported(scaled) or "")
    with pytest.raises(ValueError, match="rope"):
        FastLM(scaled)
    be = HFBackend(scaled, tok, reference=False)
    assert be._fast is None and be._lean  # the HF-forward loop still drives sampling
    ro = be.generate(PROMPTS, 1.0, 6, torch.Generator().manual_seed(0))
    assert be.logprobs(ro, 1.0).shape == ro.completion_ids.shape

    model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert "hook" in (unsupported(model) or "")
    bert_like = nn.Linear(2, 2)
    assert unsupported(bert_like) is not None


def test_sliding_window_beyond_the_sequence_uses_hf(paths: dict[str, str]) -> None:
    model, tok = load_model(paths["llama"], device="cpu")
    be = HFBackend(model, tok, reference=False)
    assert be._fast is not None
    be._fast.window = 8  # as a mistral checkpoint with an 8-token window would be
    ids, mask = be.encode_prompts(PROMPTS)
    calls = []
    real = FastLM.decoder
    FastLM.decoder = lambda *a, **k: calls.append(1) or real(*a, **k)  # type: ignore[method-assign]
    try:
        be._sample(ids, mask, 0.0, 6, seed=0)  # prompt + 6 new tokens > 8: HF forward
        assert not calls
    finally:
        FastLM.decoder = real  # type: ignore[method-assign]


def test_lean_forward_switch(paths: dict[str, str]) -> None:
    """speed.lean_forward off: the HF forward for sampling and scoring, policy and reference."""
    be = backend(paths, "llama", reference=True, speed=Speed(lean_forward=False))
    assert be._fast is None and be._fast_ref is None
    assert backend(paths, "llama")._fast is not None


def test_fast_forward_keeps_no_weight_copies(paths: dict[str, str]) -> None:
    """The lean forward reads the live parameters: an in-place update changes its output."""
    model, tok = load_model(paths["gqa"], device="cpu")
    lm = FastLM(model)
    ids, mask = padded_batch(len(tok))
    with torch.no_grad():
        before = lm.logits(ids, mask, pos_ids(mask), keep=1)
        model.model.layers[1].mlp.down_proj.weight.mul_(2)
        after = lm.logits(ids, mask, pos_ids(mask), keep=1)
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos_ids(mask)).logits
    assert (before - after).abs().max() > 1e-4
    torch.testing.assert_close(after[:, -1], want[:, -1], atol=1e-5, rtol=1e-5)
    assert fastlm.base_model(model) is model


# ------------------------------------------------------------------------------ bfloat16


@pytest.mark.parametrize("name", list(TINY))
def test_bfloat16_model_matches_hf(paths: dict[str, str], name: str, cache_kind: str) -> None:
    """A bfloat16 model: the lean forward does HF's operations in HF's dtypes (norms in float32,
    rotations cast to bf16), so scores with shared prompts match the HF forward and greedy
    decoding (either cache) matches HF generate; adapters stay float32."""
    be = HFBackend(*load_model(paths[name], device="cpu", dtype="bfloat16"), lora=True,
                   reference=False)
    assert be._fast is not None and be._fast.dtype == torch.bfloat16
    assert {p.dtype for n, p in be.model.named_parameters() if "lora_" in n} == {torch.float32}
    with torch.no_grad():  # adapters that change the outputs
        for n, p in be.model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.02)
    prompts = [p for p in PROMPTS for _ in range(3)]
    ids, mask = be.encode_prompts(prompts)
    be._fast.pack = False  # HF's operations in HF's dtypes: greedy decoding is HF's
    greedy = be._sample(ids, mask, 0.0, 10, seed=0)
    assert torch.equal(greedy, be._hf_generate(ids, mask, 0.0, 10, seed=0))
    shared = shared_prompts(ids, mask)
    with torch.inference_mode():  # as shipped: float32 keys/values, fed HF's greedy tokens
        runs = []
        for pack in (False, True):
            be._fast.pack = pack
            dec = kvcache.Decoder(be._fast, ids, mask, 11, shared)
            assert dec.kv_dtype == (torch.float32 if pack else torch.bfloat16)
            runs.append([dec.logits] + [dec.step(greedy[:, t]) for t in range(9)])
    for a, b in zip(*runs, strict=True):  # bf16 rounding apart (its resolution is 2^-8)
        torch.testing.assert_close(b.float(), a.float(), atol=3e-2, rtol=2e-2)
    ro = be.generate(prompts, 1.0, 10, torch.Generator().manual_seed(1))
    m = ro.completion_mask.bool()
    fast = be.logprobs(ro, 0.7)
    be._fast = None
    slow = be.logprobs(ro, 0.7)
    assert fast.dtype == torch.float32 and torch.isfinite(fast[m]).all()
    torch.testing.assert_close(fast[m], slow[m], atol=2e-2, rtol=1e-2)


# -------------------------------------------------------------------- the CUDA layout


def test_masked_grouped_attention_laid_out_for_fused_kernels(
        paths: dict[str, str], device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``FastLM.cuda_layout`` (on where the model is on CUDA): every masked SDPA call over
    grouped keys has as many query heads as key heads (one-token queries fold their group's
    heads into query positions, longer ones repeat the keys), so the fused kernels may take
    it; logits, greedy answers and gradients stay HF's. On CUDA the efficient kernel accepts
    every such call."""
    calls: list[tuple[int, int, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
            **kw: Any) -> torch.Tensor:
        if attn_mask is not None:
            calls.append((q.shape[1], k.shape[1], bool(kw.get("enable_gqa"))))
            if q.is_cuda:
                from torch.backends.cuda import SDPAParams, can_use_efficient_attention
                assert can_use_efficient_attention(
                    SDPAParams(q, k, v, attn_mask, 0.0, False, bool(kw.get("enable_gqa"))),
                    True)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    class Functional:  # fastlm's ``F``, its attention calls recorded (HF's are not)
        scaled_dot_product_attention = staticmethod(spy)

        def __getattr__(self, name: str) -> Any:
            return getattr(torch.nn.functional, name)

    monkeypatch.setattr(fastlm, "F", Functional())
    for layout in (False, True):
        if device == "cuda" and not layout:
            continue  # (the grouped call is what CUDA's kernels refuse)
        calls.clear()
        be = HFBackend(*load_model(paths["gqa"], device=device), reference=False)
        be._fast.cuda_layout = layout
        prompts = [p for p in PROMPTS for _ in range(3)]
        ids, mask = be.encode_prompts(prompts)
        assert same_answers(be._sample(ids, mask, 0.0, 12, seed=0),
                            be._hf_generate(ids, mask, 0.0, 12, seed=0), be.pad_id)
        ro = be.generate(prompts, 1.0, 10, torch.Generator().manual_seed(3))
        lp_fast, g_fast = scores_and_grads(be, ro, be._fast)
        assert {t for q, k, _ in calls for t in [q == k]} == {layout}  # decode and scoring
        assert not any(gqa for *_, gqa in calls) if layout else all(gqa for *_, gqa in calls)
        lp_hf, g_hf = scores_and_grads(be, ro, None)
        m = ro.completion_mask.bool()
        torch.testing.assert_close(lp_fast[m], lp_hf[m], atol=2e-5, rtol=1e-5)
        for n in g_hf:
            torch.testing.assert_close(g_fast[n], g_hf[n], rtol=1e-4, atol=1e-6, msg=n)
    if device == "cpu":
        model, tok = load_model(paths["gqa"], device="cpu")
        assert_logits_match(model.eval(), len(tok), cuda_layout=True)
        assert_logits_match(in_memory("qwen2"), 128, cuda_layout=True)


@pytest.mark.parametrize(("lora", "dtype"), [(True, "float32"), (False, "float32"),
                                           (True, "bfloat16")], ids=["lora", "full", "bf16"])
def test_cuda_layout_scores_as_peft_does(paths: dict[str, str], device: str, lora: bool,
                                         dtype: str) -> None:
    """The training forward on the CUDA layout (q, k and v one function, their adapters' input
    cast once; in bfloat16 also the norms keeping their bfloat16 input): the log-probs and every
    trainable weight's gradient of the other layout and of the HF forward, with LoRA (adapters
    that act) and full fine-tuning; in bfloat16 up to its rounding (the other layout is as far
    from HF: 1.0% against 1.4% of each gradient's largest entry, 2026-12-05)."""
    be = HFBackend(*load_model(paths["gqa"], device=device, dtype=dtype), lora=lora,
                   reference=False)
    with torch.no_grad():
        for n, p in be.model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.02)
    fast = be._fast
    ro = be.generate([p for p in PROMPTS for _ in range(3)], 1.0, 10,
                     torch.Generator().manual_seed(4))
    m = ro.completion_mask.bool()
    got = {}
    for layout in ([True] if device == "cuda" else [False, True]):
        fast.cuda_layout = layout
        got[layout] = scores_and_grads(be, ro, fast)
    got["hf"] = scores_and_grads(be, ro, None)
    lp_on, g_on = got[True]
    assert g_on and all(("lora_" in n) == lora for n in g_on)
    low = dtype == "bfloat16"
    for other in [k for k in got if k is not True]:
        lp, g = got[other]
        # bfloat16: one rounding of a logit near 0.5 is 2e-3; CUDA's kernels round elsewhere
        atol = (4e-3 if device == "cuda" else 2e-3) if low else 2e-5
        torch.testing.assert_close(lp_on[m], lp[m], atol=atol, rtol=1e-5)
        assert g.keys() == g_on.keys()
        for n in g:
            if low:
                assert (g_on[n] - g[n]).abs().max() <= 0.03 * g[n].abs().max(), n
            else:
                torch.testing.assert_close(g_on[n], g[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_cuda_layout_recomputes_the_mlp_in_backward(paths: dict[str, str], dropout: float,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Training on the CUDA layout keeps no MLP activation ([B, T, intermediate]) for backward:
    norm, gate, up and their product run again there (the other layout keeps g, u and silu(g)
    per layer). Log-probs and gradients: those of the same layout without the recomputation,
    bit for bit (its comparison with HF and peft is the test above), also with LoRA dropout in
    the MLP (the recomputation draws the forward's masks again)."""
    targets = ["q_proj", "v_proj"] + (["up_proj"] if dropout else [])
    be = backend(paths, "gqa", lora=True, lora_target_modules=targets, lora_dropout=dropout)
    inter, layers = be.model.config.intermediate_size, be.model.config.num_hidden_layers
    ro = be.generate([p for p in PROMPTS for _ in range(3)], 1.0, 10,
                     torch.Generator().manual_seed(4))
    weights = {p.data_ptr() for p in be.model.parameters()}
    kept: list[torch.Size] = []  # the shapes of what is kept but weights

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in weights:
            kept.append(t.shape)
        return t

    def run(layout: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        torch.manual_seed(0)  # the same dropout masks
        be._fast.cuda_layout = layout
        be.model.train()
        be.model.zero_grad(set_to_none=True)
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            lp = be.logprobs(ro, 0.8)
        (lp * ro.completion_mask).sum().backward()
        grads = {n: p.grad for n, p in be.model.named_parameters() if p.grad is not None}
        return lp.detach(), grads, sum(len(s) == 3 and s[-1] == inter for s in kept)

    (lp, g, mlp), (_, _, mlp_cpu) = run(True), run(False)
    assert mlp == 0 and mlp_cpu == 3 * layers * 2  # two passes: shared prompts, completions
    monkeypatch.setattr("grpolab.rollout.fastlm.recomputed", lambda f, random: f)
    lp_kept, g_kept, mlp_kept = run(True)
    assert mlp_kept == 2 * layers * 2  # g and u (blocks.silu_mul)
    assert torch.equal(lp, lp_kept) and g.keys() == g_kept.keys() and g
    assert all(torch.equal(g[n], g_kept[n]) for n in g)


def backward_keeping(f: Any, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor
                     ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """``f`` on copies of ``inputs`` that require grad, backward from ``grad``: the output, each
    input's gradient, and the tensors autograd kept for backward."""
    xs = [t.clone().requires_grad_() for t in inputs]
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = f(*xs)
    y.backward(grad)
    return y.detach(), [x.grad for x in xs], kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_keeps_two_tensors_and_autograds_gradients(dtype: torch.dtype) -> None:
    """silu(g) * u with only g and u kept for backward: the output and both gradients are
    autograd's, bit for bit."""
    from grpolab.rollout.blocks import silu_mul

    g0, u0, grad = (torch.randn(7, 48, generator=torch.Generator().manual_seed(i)).to(dtype)
                    for i in range(3))
    (y1, (dg1, du1), k1), (y2, (dg2, du2), k2) = (
        backward_keeping(f, (g0, u0), grad) for f in (silu_mul, lambda g, u: F.silu(g) * u))
    assert torch.equal(y1, y2) and torch.equal(dg1, dg2) and torch.equal(du1, du2)
    assert len(k1) == 2 and len(k2) == 3  # g and u; autograd also keeps silu(g)


def test_adapters_keep_their_bfloat16_input() -> None:
    """The adapters' A on a bfloat16 input (``packed._adapters_in``): autograd's output and
    gradients bit for bit, with the bfloat16 input kept for backward, not a float32 copy."""
    from grpolab.rollout.packed import _adapters_in

    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 5, 48, generator=gen).bfloat16()
    a0 = torch.randn(24, 48, generator=gen)
    grad = torch.randn(3, 5, 24, generator=gen)
    (y1, (gx1, ga1), k1), (y2, (gx2, ga2), k2) = (
        backward_keeping(f, (x0, a0), grad)
        for f in (_adapters_in, lambda x, a: F.linear(x.to(a.dtype), a)))
    assert torch.equal(y1, y2) and torch.equal(gx1, gx2) and torch.equal(ga1, ga2)
    as_big = [{t.dtype for t in k if t.numel() == x0.numel()} for k in (k1, k2)]
    assert as_big == [{torch.bfloat16}, {torch.float32}]


def test_rms_norm_keeping_its_bfloat16_input() -> None:
    """``rms_norm(keep_low=True)`` on bfloat16: HF's output bit for bit, HF's gradients up to
    float rounding, and for backward the bfloat16 input kept, no float32 copy of it."""
    from grpolab.rollout.blocks import rms_norm

    norm_mod = in_memory("qwen2").model.norm.to(torch.bfloat16)
    with torch.no_grad():
        norm_mod.weight.copy_(torch.linspace(0.5, 1.5, 32))
    x0 = (3 * torch.randn(6, 5, 32, generator=torch.Generator().manual_seed(0))).bfloat16()
    grad = torch.randn(6, 5, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    outs = []
    for keep in (True, False):
        norm_mod.weight.grad = None
        y, (gx,), kept = backward_keeping(rms_norm(norm_mod, keep_low=keep), (x0,), grad)
        outs.append((y, gx, norm_mod.weight.grad.clone(), kept))
    (y1, gx1, gw1, kept1), (y2, gx2, gw2, kept2) = outs
    assert torch.equal(y1, y2) and torch.equal(y2, norm_mod(x0))
    torch.testing.assert_close(gx1, gx2)  # bfloat16's tolerance
    torch.testing.assert_close(gw1, gw2)
    copies = [[t for t in k if t.dtype == torch.float32 and t.numel() >= x0.numel()]
              for k in (kept1, kept2)]
    assert not copies[0] and copies[1]  # HF's sequence keeps a float32 copy of x


def test_fused_rms_norm_is_hfs(device: str) -> None:
    """The decode layout's RMSNorm (``fused``: one ``F.rms_norm`` on the bfloat16 input, then
    the weight) gives HF's output: bit for bit on the CPU, to bfloat16 rounding on CUDA (whose
    reductions run in another order than HF's mean)."""
    from grpolab.rollout.blocks import rms_norm

    norm_mod = in_memory("qwen2").model.norm.to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        norm_mod.weight.copy_(torch.linspace(0.5, 1.5, 32))
    x = (3 * torch.randn(64, 7, 32, generator=torch.Generator().manual_seed(0))).bfloat16()
    x = x.to(device)
    with torch.no_grad():
        got, want = rms_norm(norm_mod, fused=True)(x), norm_mod(x)
    assert got.dtype == torch.bfloat16
    if device == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_stacked_linear_is_the_projections_side_by_side() -> None:
    """q, k and v (qwen2: with biases) as one matmul give the three outputs side by side; with
    float32 LoRA adapters on a bfloat16 base (``upcast``) the adapters are folded into float32
    copies and the output comes back in the input's dtype; without ``upcast`` there is none."""
    from peft import LoraConfig, get_peft_model

    from grpolab.rollout.packed import stacked_linear

    at = in_memory("qwen2").model.layers[0].self_attn
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = torch.cat([m(x) for m in (at.q_proj, at.k_proj, at.v_proj)], -1)
        torch.testing.assert_close(stacked_linear([at.q_proj, at.k_proj, at.v_proj])(x), want)
    model = get_peft_model(in_memory("qwen2").to(torch.bfloat16), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).eval()
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float().fill_(0.05)
    at = model.base_model.model.model.layers[0].self_attn
    mods = [at.q_proj, at.k_proj, at.v_proj]
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        want = torch.cat([m(xb).float() for m in mods], -1)
        got = stacked_linear(mods, upcast=True)(xb)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
        plain = torch.cat([F.linear(xb, m.base_layer.weight, m.base_layer.bias).float()
                           for m in (at.q_proj, at.v_proj)], -1)
        assert (want[:, list(range(32)) + list(range(48, 64))] - plain).abs().max() > 0.1
    assert stacked_linear(mods) is None  # float32 adapters do not round into bfloat16


def test_cuda_layout_decodes_in_fewer_kernels(paths: dict[str, str], device: str) -> None:
    """A bfloat16 model with float32 LoRA adapters, decoded on the CUDA layout (q, k and v one
    matmul on float32 copies with the adapters folded in, q and k rotated together, fused
    RMSNorm): the logits of the other layout up to bfloat16 rounding, the adapters' effect
    kept, and under two thirds of its operations per step."""
    be = HFBackend(*load_model(paths["gqa"], device=device, dtype="bfloat16"), lora=True,
                   reference=False)
    with torch.no_grad():  # adapters that change the outputs
        for n, p in be.model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.02)
    ids, mask = be.encode_prompts([p for p in PROMPTS for _ in range(3)])
    ids, mask = ids.to(device), mask.to(device)
    shared = shared_prompts(ids, mask)
    runs, kernels = {}, {}
    for name, layout, adapters in [("other", False, True), ("cuda", True, True),
                                   ("cuda-off", True, False)]:
        if device == "cuda" and not layout:
            continue
        be._fast.cuda_layout = layout
        with torch.inference_mode(), (contextlib.nullcontext() if adapters
                                      else be.adapters_off()):
            dec = GraphDecoder(be._fast, ids, mask, 6, shared)
            logits, count = [dec.logits], Kernels()
            for t in range(5):
                with count:
                    logits.append(dec.step(logits[-1].argmax(-1), torch.tensor([t],
                                                                            device=device)))
        runs[name], kernels[name] = torch.stack(logits).float(), count.n / 5
    assert (runs["cuda"] - runs["cuda-off"]).abs().max() > 0.05  # the adapters act
    if device == "cpu":
        torch.testing.assert_close(runs["cuda"], runs["other"], atol=3e-2, rtol=2e-2)
        assert kernels["cuda"] < 2 / 3 * kernels["other"], kernels


# ------------------------------------------------------------------- chunked LM head


@pytest.mark.parametrize("name", ["llama", "gqa"])
def test_chunked_head_scores_like_full_logits(paths: dict[str, str], name: str) -> None:
    """Scoring through ``logit_chunk`` tokens of the head at a time gives the full-logit path's
    log-probs, entropies and gradients (tied and untied heads, T != 1, shared prompts)."""
    be = backend(paths, name)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained-looking head: the tied one is also the embedding
        for p in be.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ro = be.generate([p for p in PROMPTS for _ in range(2)], 0.7, 10,
                     torch.Generator().manual_seed(2))
    m = ro.completion_mask.bool()
    out = {}
    for chunk in (0, 3, 1000):
        be.logit_chunk = chunk
        be.model.zero_grad(set_to_none=True)
        lp, ent = be.logprobs_and_entropy(ro, 0.7)
        w = torch.linspace(-1, 1, lp.numel()).view_as(lp)
        (lp * w * ro.completion_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in be.model.named_parameters()}
        out[chunk] = (lp.detach(), ent, grads)
    lp0, ent0, g0 = out[0]
    for chunk in (3, 1000):
        lp, ent, g = out[chunk]
        torch.testing.assert_close(lp[m], lp0[m], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent[m], ent0[m], atol=1e-5, rtol=1e-5)
        for n in g0:  # float rounding: ~3e-6 on entries up to ~10 (summed over positions)
            torch.testing.assert_close(g[n], g0[n], rtol=1e-4, atol=2e-5, msg=n)
    assert be._fast is not None and be._fast.linear_head() is not None


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpointed_scoring_keeps_layer_inputs_only(paths: dict[str, str], name: str,
                                                      lora: bool) -> None:
    """With the model's gradient checkpointing on, the lean forward (prompts shared) gives the
    same log-probs and gradients and saves a fraction of the activations for backward."""
    kw: dict[str, Any] = {"lora": True, "lora_target_modules": ["q_proj", "v_proj", "up_proj"]
                          if name != "gpt2" else ["c_attn", "c_fc"]} if lora else {}
    plain = backend(paths, name, **kw)
    ckpt = backend(paths, name, gradient_checkpointing=True, **kw)
    ckpt.model.load_state_dict(plain.model.state_dict())
    assert ckpt._fast is not None and ckpt._fast.checkpoint and not plain._fast.checkpoint
    ro = plain.generate([p for p in PROMPTS for _ in range(3)], 1.0, 10,
                        torch.Generator().manual_seed(3))
    out = []
    for be in (plain, ckpt):
        saved = []  # bytes of every tensor autograd keeps for backward
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t, saved=saved: saved.append(t.numel() * t.element_size()) or t,
                lambda t: t):
            lp, grads = scores_and_grads(be, ro, be._fast)
        out.append((lp, grads, sum(saved)))
    (lp_a, g_a, bytes_a), (lp_b, g_b, bytes_b) = out
    assert torch.equal(lp_a, lp_b)
    assert g_a.keys() == g_b.keys() and g_a
    for n in g_a:
        torch.testing.assert_close(g_b[n], g_a[n], rtol=1e-5, atol=1e-7, msg=n)
    assert bytes_b < 0.5 * bytes_a, (bytes_a, bytes_b)


def test_concat_kv_keeps_first_keys_and_takes_prompt_rows() -> None:
    """A checkpointed layer calls ``update`` again in backward: the first keys stay and no
    duplicates pile up; a shared prompt's keys are taken per row inside ``update``."""
    from grpolab.rollout.kvcache import ConcatKV

    k0, k1 = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)
    kv = ConcatKV()
    kv.update(0, k0, k0)
    kv.update(1, k1, k1)
    kv.update(0, k1, k1)  # (the recomputation)
    assert len(kv.kv) == 2 and kv.kv[0][0] is k0
    rows = torch.tensor([1, 1, 0])
    own = torch.randn(3, 1, 2, 4)
    ext = ConcatKV(kv.kv, rows, keep=False)
    k, _ = ext.update(1, own, own)
    assert torch.equal(k, torch.cat([k1[rows], own], dim=2)) and ext.kv == []
