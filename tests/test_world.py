"""The built-in world: deterministic splits, exact checker, KV-cache sampler consistency."""

import math
import random

import pytest
import torch

from grpolab.rollout.batch import cat_rollouts
from grpolab.world.backend import TinyBackend
from grpolab.world.model import CharTokenizer, TinyConfig, TinyGPT, encode_batch
from grpolab.world.sft import sft_model
from grpolab.world.task import (
    CARRY_SHARE,
    SLIP,
    SLIP_TOP,
    TOP_SHARE,
    carries,
    check,
    make_problem,
    make_splits,
    sloppy_answer,
    teacher_answers,
    teacher_pass_rate,
)


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
    assert {len(r["prompt"]) for r in a.train} == {6}
    assert {len(r["answer"]) for r in a.train} == {3}


def test_checker() -> None:
    assert check("42+17=", "059")
    assert check("42+17=", " 059 ")
    assert not check("42+17=", "59") and not check("42+17=", "0059")
    assert check("57+68=", "125") and check("00+00=", "000")
    assert not check("57+68=", "")


def test_teacher_slips_at_the_designed_rates() -> None:
    """The careless teacher is right with probability teacher_pass_rate: 1 without carries,
    1 - SLIP with a ones carry, 1 - SLIP_TOP for sums of 100 or more, the product with both."""
    rng = random.Random(0)
    cases = {"42+17=": 1.0, "48+17=": 1 - SLIP, "72+41=": 1 - SLIP_TOP,
             "58+67=": (1 - SLIP) * (1 - SLIP_TOP)}
    assert carries("48+17=") == (True, False) and carries("72+41=") == (False, True)
    n = 4000
    for prompt, want in cases.items():
        assert teacher_pass_rate(prompt) == want
        freq = sum(check(prompt, sloppy_answer(prompt, rng)) for _ in range(n)) / n
        assert abs(freq - want) <= 4 * math.sqrt(want * (1 - want) / n) + 1e-9, prompt
    # the SFT trains on the teacher's answer distribution, which is sloppy_answer's
    for prompt in ("58+67=", "48+17=", "95+05=", "42+17="):
        for slip, top in ((SLIP, SLIP_TOP), (0.3, 0.6)):
            dist = dict(teacher_answers(prompt, slip, top))
            assert abs(sum(dist.values()) - 1) < 1e-12
            draws = [sloppy_answer(prompt, rng, slip, top) for _ in range(n)]
            for ans, q in dist.items():
                assert abs(draws.count(ans) / n - q) <= 4 * math.sqrt(q * (1 - q) / n) + 1e-9
            assert set(draws) <= set(dist)
    # a slip writes the sum without that carry, digit by digit
    assert sloppy_answer("58+67=", rng, 1.0, 1.0) == "015"
    assert sloppy_answer("58+67=", rng, 0.0, 0.0) == "125"


def test_task_mix_and_the_designed_pass_rate_distribution() -> None:
    """The start's pass rates are designed to be polarised as the reference's: a band of
    carry-free prompts (p = 1), a band with a ones carry (p = 1 - SLIP) and the sums of 100
    or more (p = 0), in the shares TOP_SHARE and CARRY_SHARE set. A policy copying the teacher
    would have these dead shares (the SFT'd one is tested below)."""
    splits = make_splits(0, 1024, 256)
    rows = splits.train + splits.heldout
    kinds = [carries(r["prompt"]) for r in rows]
    top = sum(k[1] for k in kinds) / len(rows)
    ones = sum(k == (True, False) for k in kinds) / len(rows)
    assert abs(top - TOP_SHARE) < 0.04
    assert abs(ones - (1 - TOP_SHARE) * CARRY_SHARE) < 0.04
    p = torch.tensor([teacher_pass_rate(r["prompt"]) for r in rows], dtype=torch.float64)
    assert set(p.tolist()) == {1.0, 1 - SLIP, 0.0}
    dead = {g: float((p**g + (1 - p) ** g).mean()) for g in (2, 8, 16)}
    right = {g: float((p**g).mean()) for g in (2, 8, 16)}
    assert dead[2] > dead[8] > dead[16]
    assert 0.75 < dead[2] < 0.85 and 0.5 < dead[8] < 0.6 and 0.44 < dead[16] < 0.5
    assert right[8] > dead[8] / 2  # most dead groups all right
    assert 0.6 < float(p.mean()) < 0.66
    # the mix moves with top_share and carry_share
    rng = random.Random(1)
    assert all(not carries(make_problem(rng, 0.0)["prompt"])[1] for _ in range(200))
    assert all(carries(make_problem(rng, 1.0)["prompt"])[1] for _ in range(200))
    assert all(carries(make_problem(rng, 0.0, 1.0)["prompt"]) == (True, False) for _ in range(200))
    assert all(carries(make_problem(rng, 0.0, 0.0)["prompt"]) == (False, False)
               for _ in range(200))


@pytest.mark.slow
def test_the_fine_tuned_start_has_the_calibrated_bands(tmp_path) -> None:
    """The workshop's real start (the default SFT, seed 0, about 45 s of one core): exact
    pass rates at T=1 per band on the train split land on the teacher's (measured for seeds
    0-2 in docs/workshop-calibration.md), and so the dead shares the calibration relies on."""
    from grpolab.config import Config

    torch.set_num_threads(1)  # as the workshop does; the start is bitwise per thread count
    cfg = Config()
    splits = make_splits(0, cfg.world_train_size, cfg.world_heldout_size)
    model = sft_model(0, splits, cfg.sft_steps, tmp_path)
    be = TinyBackend(model, lora=False, lora_r=8, lora_alpha=2.0, seed=0)
    p = be.pass_probability(splits.train, 1.0).double()
    kinds = [carries(r["prompt"]) for r in splits.train]
    band = {k: p[torch.tensor([x == k for x in kinds])] for k in set(kinds)}
    assert band[(False, False)].mean() > 0.97 and band[(False, False)].quantile(0.1) > 0.95
    assert 0.68 < band[(True, False)].mean() < 0.8  # teacher: 1 - SLIP = 0.75
    assert float(band[(True, True)].mean()) < 0.01 and float(band[(False, True)].mean()) < 0.01
    dead8 = float((p**8 + (1 - p) ** 8).mean())
    assert 0.45 < dead8 < 0.58  # the run's mean is higher: RL lifts the ones-carry band


def test_a_start_that_misses_the_bands_is_trained_again(tmp_path, monkeypatch) -> None:
    """sft_model checks the start against the teacher's bands and, when it misses, trains a
    fresh model from the next stream; the cache holds the one that landed."""
    from grpolab.world import sft as world

    splits = make_splits(0, 64, 32)
    verdicts = iter([False, True])
    seen = []

    def lands(model, tok, rows, slip, slip_top, tol=0.06):
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return next(verdicts)

    monkeypatch.setattr(world, "lands_on_teacher", lands)
    m = sft_model(0, splits, 5, tmp_path, slip=SLIP, slip_top=SLIP_TOP)
    assert len(seen) == 2
    assert not all(torch.equal(seen[0][k], seen[1][k]) for k in seen[0])  # another stream
    assert all(torch.equal(m.state_dict()[k], seen[1][k]) for k in seen[1])
    again = sft_model(0, splits, 5, tmp_path, slip=SLIP, slip_top=SLIP_TOP)  # from the cache
    assert len(seen) == 2 and all(torch.equal(again.state_dict()[k], seen[1][k]) for k in seen[1])


def test_lands_on_teacher_reads_each_band(monkeypatch) -> None:
    """The check compares each band's mean exact pass rate with the teacher's: a model whose
    answer probabilities are set by hand passes at the teacher's rates and fails off them."""
    from grpolab.world import sft as world

    rows = [{"prompt": "12+34=", "answer": "046"}, {"prompt": "15+27=", "answer": "042"},
            {"prompt": "55+66=", "answer": "121"}]  # carry-free, ones carry, sum >= 100
    for probs, ok in (([1.0, 0.75, 0.0], True), ([0.97, 0.7, 0.03], True),
                      ([0.8, 0.75, 0.0], False), ([1.0, 0.5, 0.0], False)):
        monkeypatch.setattr(world, "answer_probability",
                            lambda model, tok, rows, p=probs: torch.tensor(p))
        assert world.lands_on_teacher(None, CharTokenizer(), rows, 0.25, 1.0) is ok


def test_answer_probability_is_the_backends_pass_probability() -> None:
    from grpolab.world.sft import answer_probability

    be = backend()
    rows = make_splits(0, 32, 0).train
    assert torch.allclose(answer_probability(be.model, CharTokenizer(), rows),
                          be.pass_probability(rows, 1.0), atol=1e-6)


@pytest.mark.slow
def test_sft_start_is_deterministic_per_seed(tmp_path) -> None:
    """The fine-tuned start is a function of the seed: two trainings from scratch (separate
    caches) give identical weights; another seed gives others."""
    splits = make_splits(0, 64, 32)
    a = sft_model(0, splits, 15, tmp_path / "a", slip=SLIP, slip_top=SLIP_TOP)
    b = sft_model(0, splits, 15, tmp_path / "b", slip=SLIP, slip_top=SLIP_TOP)
    c = sft_model(1, splits, 15, tmp_path / "c", slip=SLIP, slip_top=SLIP_TOP)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_sft_and_rl_prompts_are_disjoint_halves_and_the_start_ignores_the_mix(
        tmp_path, monkeypatch) -> None:
    """The SFT draws only from its half of the problems (``sft_side``), the splits and the
    landing check only from the other, so the fine-tuned start of a seed is one model (one
    cache entry) for every RL prompt mix."""
    from grpolab.world import sft as world
    from grpolab.world.sft import sft_check_rows
    from grpolab.world.task import sft_side

    rng = random.Random(0)
    drawn = [make_problem(rng)["prompt"] for _ in range(2000)]
    assert 0.45 < sum(map(sft_side, drawn)) / len(drawn) < 0.55  # a half, across the mix
    a, b = make_splits(0, 200, 50), make_splits(0, 200, 50, top_share=0.1, carry_share=0.9)
    assert not any(sft_side(r["prompt"]) for r in a.train + a.heldout + b.train + b.heldout)
    assert not any(sft_side(r["prompt"]) for r in sft_check_rows(0))
    assert sft_check_rows(3) == sft_check_rows(3) != sft_check_rows(4)
    seen: list[str] = []
    real_sft = world.sft

    def spy(model, tok, exclude, steps, seed, **kw):
        real_make = world.make_problem

        def make(*args):
            p = real_make(*args)
            seen.append(p["prompt"])
            return p

        monkeypatch.setattr(world, "make_problem", make)
        try:
            return real_sft(model, tok, exclude, steps, seed, **kw)
        finally:
            monkeypatch.setattr(world, "make_problem", real_make)

    monkeypatch.setattr(world, "sft", spy)
    monkeypatch.setattr(world, "lands_on_teacher", lambda *a, **k: True)
    ma = sft_model(0, a, 3, tmp_path)
    used = [p for p in seen if sft_side(p)]
    assert used and len(list(tmp_path.glob("sft-*.pt"))) == 1
    mb = sft_model(0, b, 3, tmp_path)  # another mix: the same cached start
    assert len(list(tmp_path.glob("sft-*.pt"))) == 1
    assert all(torch.equal(ma.state_dict()[k], mb.state_dict()[k]) for k in ma.state_dict())


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
    row = {"prompt": "02+03=", "answer": "005"}
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
