"""TRL's sampling settings (top_k, top_p, min_p, repetition_penalty: ``sampling.Filters``):
the filtered logits equal transformers' own logits processors, every sampler draws from what
they leave, greedy decoding with a penalty equals HF ``generate``'s on every decode path, and
the world's exact held-out accuracy is that of the filtered sampler."""

from __future__ import annotations

import pytest
import torch
from helpers import same_answers
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpolab.rollout import graphdecode
from grpolab.rollout.batch import shared_prompts
from grpolab.rollout.hf import HFBackend
from grpolab.rollout.models import load_model
from grpolab.rollout.sampling import (
    Filters,
    decode,
    multinomial_next,
    next_probs,
    penalise,
    prompt_tokens,
    sample_next,
    sampled_logprobs,
    warp,
)
from grpolab.rollout.tinyhf import make_tiny_model

PROMPTS = ["What is 2 + 3?", "Compute 12 * 7. So the answer is", "1", "<think> 40 - 8 ="]
FILTERS = [Filters(top_k=7), Filters(top_p=0.8), Filters(min_p=0.1),
           Filters(top_k=40, top_p=0.9, min_p=0.05), Filters(top_k=1)]


def hf_warpers(f: Filters, temperature: float) -> LogitsProcessorList:
    """transformers' sampling warpers for ``f``, in the order ``generate`` builds them."""
    procs = [TemperatureLogitsWarper(temperature)] if temperature != 1 else []
    procs += [TopKLogitsWarper(f.top_k)] if f.top_k else []
    procs += [TopPLogitsWarper(f.top_p)] if f.top_p < 1 else []
    procs += [MinPLogitsWarper(f.min_p)] if f.min_p else []
    return LogitsProcessorList(procs)


@pytest.mark.parametrize("f", FILTERS, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_warp_is_transformers_warpers(f: Filters, temperature: float) -> None:
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(3)) * 3
    got = warp(logits, temperature, f)
    assert torch.equal(got, hf_warpers(f, temperature)(None, logits.clone()))
    kept = torch.isfinite(got).sum(dim=1)
    assert bool((kept >= 1).all()) and bool((kept < 500).all())  # each filter removes some


def test_penalty_is_transformers_processor_on_left_padded_prompts() -> None:
    """The penalty counts each row's real tokens only (transformers >= 5 ignores left pads)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 2
    ids = torch.randint(0, 50, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[2, :7] = 0, 0
    ids[0, :4] = ids[2, :7] = 0  # pad id 0: not penalised unless a real token is 0
    pads = (mask != 0).int().argmax(dim=1)
    want = RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=pads)(ids, logits.clone())
    got = penalise(logits, prompt_tokens(ids, mask, 50), 1.3)
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)


SAMPLERS = {
    "sample_next": lambda x, f, g: sample_next(x, 0.8, g, f),
    "multinomial": lambda x, f, g: multinomial_next(x, 0.8, g, f),
    "graph_draw": lambda x, f, g: graphdecode.draw(
        x, 0.8, torch.rand((len(x), 1), generator=g, dtype=torch.float64), f),
}


# (vocabulary, draws, tolerance: about 5 standard errors): one level, then sample_next's
# block search (over 4 x 256 tokens)
@pytest.mark.parametrize(("vocab", "n", "atol"), [(40, 200_000, 5e-3), (1100, 40_000, 1.2e-2)])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_draws_follow_the_filtered_softmax(name: str, vocab: int, n: int, atol: float) -> None:
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 2
    f = Filters(top_k=30, top_p=0.9)
    want = next_probs(row[None], 0.8, f)[0].double()
    assert 1 < int((want > 0).sum()) < 30
    draws = SAMPLERS[name](row.repeat(n, 1), f, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=vocab).double() / len(draws)
    assert float(freq[want == 0].sum()) == 0  # a filtered token is never drawn
    torch.testing.assert_close(freq, want, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("llama"), hidden=32, heads=4,
                               arch="llama"))


def backend(path: str, f: Filters) -> HFBackend:
    return HFBackend(*load_model(path, device="cpu"), reference=False, filters=f)


def graph_path(be: HFBackend, ids: torch.Tensor, mask: torch.Tensor, temperature: float,
               seed: int) -> torch.Tensor:
    """The fixed-shape loop (uncaptured on the CPU) as the CUDA path runs it."""
    with torch.inference_mode():
        return graphdecode.GraphSampler(bucket=4).sample(
            be._fast, ids, mask, 12, temperature, be.eos_ids, be.pad_id,
            torch.Generator().manual_seed(seed), be.filters)


@pytest.mark.parametrize("grouped", [False, True])
def test_greedy_with_a_penalty_equals_hf_generate(llama: str, grouped: bool) -> None:
    """HF ``generate`` with repetition_penalty (left-padded prompts): the lean loop and the
    fixed-shape one decode what it decodes; without the penalty the answers differ."""
    be = backend(llama, Filters(repetition_penalty=5.0))
    prompts = [p for p in PROMPTS for _ in range(3 if grouped else 1)]
    ids, mask = be.encode_prompts(prompts)
    want = be._hf_generate(ids, mask, 0.0, 12, seed=0)
    assert same_answers(be._sample(ids, mask, 0.0, 12, seed=0), want, be.pad_id)
    assert same_answers(graph_path(be, ids, mask, 0.0, 0), want, be.pad_id)
    plain = backend(llama, Filters())._hf_generate(ids, mask, 0.0, 12, seed=0)
    assert not same_answers(plain, want, be.pad_id)


def test_top_k_one_samples_the_greedy_answer(llama: str) -> None:
    """At T = 1 with top_k 1 every path draws the penalised argmax: greedy's answers."""
    be = backend(llama, Filters(top_k=1, repetition_penalty=1.5))
    ids, mask = be.encode_prompts(PROMPTS)
    greedy = be._sample(ids, mask, 0.0, 12, seed=0)
    for seed in (1, 2):
        assert same_answers(be._sample(ids, mask, 1.0, 12, seed=seed), greedy, be.pad_id)
        assert same_answers(graph_path(be, ids, mask, 1.0, seed), greedy, be.pad_id)
        assert same_answers(be._hf_generate(ids, mask, 1.0, 12, seed=seed), greedy, be.pad_id)


def test_graph_loop_keeps_the_penalty_between_steps(llama: str) -> None:
    """The fixed-shape loop's tokens are the plain loop's logits, penalised for what each row
    has seen, drawn with the same uniforms (the seen set is kept outside the captured step)."""
    f = Filters(top_p=0.9, repetition_penalty=2.0)
    be = backend(llama, f)
    prompts = [p for p in PROMPTS for _ in range(2)]
    ids, mask = be.encode_prompts(prompts)
    got = graph_path(be, ids, mask, 1.0, 7)
    ids, mask = graphdecode.padded_prompts(ids, mask, be.pad_id)
    u = torch.rand((12, len(prompts), 1), generator=torch.Generator().manual_seed(7),
                   dtype=torch.float64)
    with torch.inference_mode():
        be._fast.pack = False
        try:
            dec = be._fast.decoder(ids, mask, 12, shared_prompts(ids, mask))
            logits, seen, want = dec.logits, prompt_tokens(ids, mask, dec.logits.shape[-1]), []
            for t in range(got.shape[1]):
                nxt = graphdecode.draw(logits, 1.0, u[t], f, seen)
                want.append(nxt)
                seen.scatter_(1, nxt[:, None], True)
                if t < got.shape[1] - 1:
                    logits = dec.step(nxt)
        finally:
            be._fast.pack = True
    assert same_answers(got, torch.stack(want, 1), be.pad_id)


def test_sampled_logprobs_score_the_filtered_draws(llama: str) -> None:
    """Each drawn token has a finite log-probability under the filtered sampler, another one
    than the plain softmax's; unfiltered, it is the plain log-softmax the loss scores."""
    f = Filters(top_k=5, top_p=0.8, repetition_penalty=1.3)
    be = backend(llama, f)
    ro = be.generate(PROMPTS * 2, 0.9, 10, torch.Generator().manual_seed(4))
    from grpolab.rollout.logprobs import completion_logits

    with torch.no_grad():
        logits = completion_logits(be._fast, ro, be.device, False)
    lp = sampled_logprobs(logits, ro.completion_ids, 0.9, f, (ro.prompt_ids, ro.prompt_mask))
    real = ro.completion_mask.bool()
    assert bool(torch.isfinite(lp[real]).all())
    plain = sampled_logprobs(logits, ro.completion_ids, 0.9, Filters(),
                             (ro.prompt_ids, ro.prompt_mask))
    torch.testing.assert_close(plain[real], be.logprobs(ro, 0.9)[real], atol=1e-5, rtol=0)
    assert not torch.allclose(lp[real], plain[real])


def test_a_penalty_needs_the_prompts() -> None:
    class Flat:
        logits = torch.zeros(2, 5)

        def step(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.logits

    with pytest.raises(ValueError, match="needs the prompts"):
        decode(Flat(), 3, 1.0, [4], 0, filters=Filters(repetition_penalty=1.2))


def test_world_pass_probability_is_the_filtered_samplers(tmp_path) -> None:
    """top_k 1 makes the sampler greedy: the exact held-out accuracy is then 0 or 1 per prompt,
    and 1 exactly where the greedy answer is right."""
    from helpers import world_trainer

    tr = world_trainer(tmp_path, top_k=1)
    rows = tr.heldout_rows[:16]
    p = tr.backend.pass_probability(rows, 1.0)
    assert set(p.tolist()) <= {0.0, 1.0}
    ro = tr.backend.generate([r["prompt"] for r in rows], 0.0, 8)
    right = [c == r["answer"] for c, r in zip(ro.completions, rows)]
    assert p.bool().tolist() == right
    plain = world_trainer(tmp_path / "plain").backend.pass_probability(rows, 1.0)
    assert bool(((plain > 0) & (plain < 1)).all())


def test_the_configs_filters_reach_the_backend_or_are_refused(tmp_path) -> None:
    """The config's settings are what the backend samples with: a backend built with others,
    or one whose sampling applies none, is refused in one line, not run unfiltered."""
    from helpers import world_trainer

    from grpolab.config import ConfigError, make_config
    from grpolab.run.trainer import GRPOTrainer
    from grpolab.world.model import TinyConfig, TinyGPT
    from grpolab.world.task import make_splits

    assert world_trainer(tmp_path / "a", top_p=0.5).backend.filters == Filters(top_p=0.5)
    splits = make_splits(0, 64, 16)
    model = TinyGPT(TinyConfig(d_model=16, n_layers=1, n_heads=2, max_len=24))

    def trainer(backend, **over) -> GRPOTrainer:
        cfg = make_config(None, {"progress": False, "budget": 8, "group_size": 4, **over})
        return GRPOTrainer(cfg, backend, splits.train, [lambda p, c, **_: [0.0] * len(c)],
                           out_dir=tmp_path / "b")

    from grpolab.world.backend import TinyBackend

    with pytest.raises(ConfigError, match="built to sample with Filters.top_k=0, top_p=0.5"):
        trainer(TinyBackend(model, filters=Filters(top_p=0.5)), top_p=0.9)
    unfiltered = TinyBackend(model)
    unfiltered.filters = None  # as a subclass whose sampling applies none
    with pytest.raises(ConfigError, match="TinyBackend applies no sampling filters"):
        trainer(unfiltered, top_k=3)
    assert trainer(unfiltered).backend.filters is None  # (at the defaults it runs)


def test_top_p_search_finds_hfs_boundary_in_a_few_tokens() -> None:
    """top_p_drop looks among the most likely tokens first (no full sort where they hold
    top_p): on peaked rows, flat rows (sorted in full) and a batch of both, HF's warper's
    choice; and it never sorts the peaked rows."""
    g = torch.Generator().manual_seed(6)
    v = 6000
    peaked = torch.randn(4, v, generator=g) * 6  # top-p 0.9 within the first 256 tokens
    middle = torch.randn(2, v, generator=g) * 2.2  # ... within the first 4096
    flat = torch.randn(3, v, generator=g) * 0.5  # ... within none of the searched sizes
    tied = torch.full((1, v), float("-inf"))
    tied[0, :10] = 1.0  # ten tokens of 0.1: the boundary falls on a tie
    from grpolab.rollout.sampling import top_p_drop

    hf = TopPLogitsWarper(0.9)
    for x in (peaked, middle, flat, torch.cat([flat[:1], peaked, middle, flat[1:]])):
        assert torch.equal(top_p_drop(x, 0.9), torch.isinf(hf(None, x.clone())))
    kept = [(~top_p_drop(x, 0.9)).sum(-1) for x in (peaked, middle)]
    assert bool((kept[0] < 256).all()) and bool((kept[0] > 1).all())
    assert bool((kept[1] > 256).all()) and bool((kept[1] < 4096).all())
    assert torch.equal(top_p_drop(tied, 0.5), torch.isinf(TopPLogitsWarper(0.5)(None, tied)))
    sort = torch.sort
    try:
        torch.sort = None  # a full sort would fail here
        top_p_drop(peaked, 0.9)
    finally:
        torch.sort = sort
