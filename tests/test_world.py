"""The built-in world: deterministic splits, exact checker, KV-cache sampler consistency."""

import math

import torch

from grpolab.rollout import cat_rollouts
from grpolab.world import CharTokenizer, TinyConfig, TinyGPT, check, encode_batch, make_splits
from grpolab.world_backend import TinyBackend


def backend(seed: int = 0) -> TinyBackend:
    torch.manual_seed(seed)
    return TinyBackend(TinyGPT(TinyConfig(d_model=32, n_layers=2, n_heads=2)))


def test_splits_deterministic_and_disjoint() -> None:
    a, b = make_splits(3, 200, 50), make_splits(3, 200, 50)
    assert a == b
    assert make_splits(4, 200, 50) != a
    train = {r["prompt"] for r in a.train}
    held = {r["prompt"] for r in a.heldout}
    assert len(train) == 200 and len(held) == 50 and not train & held
    assert all(check(r["prompt"], r["answer"]) for r in a.train + a.heldout)
    assert {r["prompt"][3] for r in a.train} == {"+", "-", "*"}


def test_checker() -> None:
    assert check("042+317=", "359")
    assert check("042+317=", " 359 ")
    assert not check("042+317=", "0359")
    assert check("317-042=", "275") and check("012*007=", "84")
    assert not check("012*007=", "")


def test_tokenizer_roundtrip() -> None:
    tok = CharTokenizer()
    ids = tok.encode("123+456=")
    assert ids[0] == tok.BOS and tok.decode(ids[1:] + [tok.EOS, 5]) == "123+456="


def test_greedy_kv_cache_matches_full_forward() -> None:
    be = backend()
    prompts = [r["prompt"] for r in make_splits(0, 16, 0).train]
    ro = be.generate(prompts, 0.0, 6)
    full = torch.cat([ro.prompt_ids, ro.completion_ids], 1)
    logits, _ = be.model(full[:, :-1])
    tp = ro.prompt_ids.shape[1]
    argmax = logits[:, tp - 1 :, :].argmax(-1)
    m = ro.completion_mask.bool()
    assert torch.equal(argmax[m], ro.completion_ids[m])
    assert m.any() and (ro.completion_ids[~m] == CharTokenizer.PAD).all()


def test_sampling_is_reproducible_and_seeded() -> None:
    be = backend()
    prompts = ["123+456="] * 32
    a = be.generate(prompts, 1.0, 5, torch.Generator().manual_seed(1))
    b = be.generate(prompts, 1.0, 5, torch.Generator().manual_seed(1))
    c = be.generate(prompts, 1.0, 5, torch.Generator().manual_seed(2))
    assert a.completions == b.completions and a.completions != c.completions


def test_pass_probability_is_exact() -> None:
    """p from teacher forcing matches the frequency of right answers among samples."""
    torch.manual_seed(0)
    be = backend()
    # Make one answer likely enough to be sampled often: a few supervised steps on it.
    row = {"prompt": "002+003=", "answer": "5"}
    ids, mask = encode_batch(be.tok, [row], 12)
    opt = torch.optim.Adam(be.model.parameters(), lr=1e-2)
    for _ in range(8):
        logits, _ = be.model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    p = float(be.pass_probability([row], 1.0))
    assert 0.2 < p < 0.95
    n = 4000
    ro = be.generate([row["prompt"]] * n, 1.0, 4, torch.Generator().manual_seed(0))
    freq = sum(check(row["prompt"], c) for c in ro.completions) / n
    assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_logprobs_score_sampled_tokens() -> None:
    be = backend()
    ro = be.generate(["111+222="] * 8, 1.0, 5, torch.Generator().manual_seed(0))
    lp = be.logprobs(ro, 1.0)
    ref = be.logprobs(ro, 1.0, reference=True)
    assert torch.allclose(lp, ref)  # the reference starts as a copy of the policy
    assert (lp[ro.completion_mask.bool()] < 0).all()


def test_cat_rollouts_pads() -> None:
    be = backend()
    a = be.generate(["111+222="] * 2, 0.0, 2)
    b = be.generate(["111+222="] * 3, 0.0, 4)
    c = cat_rollouts([a, b], be.pad_id)
    assert c.completion_ids.shape == (5, max(a.completion_ids.shape[1], 4))
    assert c.completions == a.completions + b.completions
    assert c.select([0, 4]).completions == [a.completions[0], b.completions[2]]
