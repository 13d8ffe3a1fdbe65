"""The fixed-shape decode path (``grpolab.rollout.graphdecode``), on the CPU: greedy output equal
to HF ``generate``, the sampling stream equal to the plain loop's logits drawn with the same
uniforms, draws from exactly softmax(logits / T), and a step that ``torch.compile`` traces
whole (no host sync, no shape change: what a CUDA graph needs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import same_answers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from grpolab.rollout.batch import shared_prompts
from grpolab.rollout.graphdecode import GraphDecoder, draw, graph_decode, make_step
from grpolab.rollout.hf import HFBackend
from grpolab.rollout.models import load_model
from grpolab.rollout.sampling import NO_FILTERS, Filters
from grpolab.rollout.tinyhf import make_tiny_model

PROMPTS = ["What is 2 + 3?", "Compute 12 * 7. So the answer is", "1", "<think> 40 - 8 ="]
TINY = {"llama": {"arch": "llama"}, "gpt2": {"arch": "gpt2"},
        "gqa": {"arch": "llama", "kv_heads": 2, "tie_word_embeddings": False}}


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> dict[str, HFBackend]:
    out = {}
    for name, kw in TINY.items():
        path = make_tiny_model(tmp_path_factory.mktemp(name), hidden=32, heads=4, **kw)
        out[name] = HFBackend(*load_model(path, device="cpu"), reference=False)
    return out


def graph_sample(be: HFBackend, prompts: list[str], temperature: float, max_new: int,
                 seed: int, step: Any = None, eos: list[int] | None = None,
                 bucket: int = 4, filters: Filters = NO_FILTERS) -> torch.Tensor:
    """Sampled by the fixed-shape loop; keys attended in buckets of 4 new positions, so a
    12-token answer crosses three attention widths."""
    ids, mask = be.encode_prompts(prompts)
    with torch.inference_mode():
        dec = GraphDecoder(be._fast, ids, mask, max_new, shared_prompts(ids, mask))
        gen = torch.Generator().manual_seed(seed)
        return graph_decode(dec, max_new, temperature, eos or be.eos_ids, be.pad_id, gen,
                            step(dec) if step else None, bucket=bucket, filters=filters,
                            prompts=(ids, mask))


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("group", [1, 3])
def test_greedy_equals_hf_generate(backends: dict[str, HFBackend], name: str,
                                   group: int) -> None:
    be = backends[name]
    prompts = [p for p in PROMPTS for _ in range(group)]  # left-padded; shared when grouped
    ids, mask = be.encode_prompts(prompts)
    assert bool((mask == 0).any())
    got = graph_sample(be, prompts, 0.0, 12, seed=0)
    want = be._hf_generate(ids, mask, 0.0, 12, seed=0)
    assert same_answers(got, want, be.pad_id)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sampling_stream_is_the_plain_loops_logits_with_the_same_uniforms(
        backends: dict[str, HFBackend], name: str) -> None:
    """One uniform per row per step, drawn up front: the fixed-shape step's tokens are what the
    growing-cache decoder's logits give with those uniforms."""
    be, max_new, temp = backends[name], 10, 1.0
    prompts = [p for p in PROMPTS for _ in range(2)]
    ids, mask = be.encode_prompts(prompts)
    # a random tiny model seldom says EOS: 40 of its 512 tokens end an answer here
    stops = be.eos_ids + list(range(100, 140))
    got = graph_sample(be, prompts, temp, max_new, seed=7, eos=stops)
    u = torch.rand((max_new, len(prompts), 1), generator=torch.Generator().manual_seed(7),
                   dtype=torch.float64)
    eos = torch.as_tensor(stops)
    with torch.inference_mode():
        be._fast.pack = False  # the plain loop on the same unpacked weights
        try:
            dec = be._fast.decoder(ids, mask, max_new, shared_prompts(ids, mask))
            logits, done, want = dec.logits, torch.zeros(len(prompts), dtype=torch.bool), []
            for t in range(got.shape[1]):
                nxt = draw(logits, temp, u[t]).masked_fill(done, be.pad_id)
                want.append(nxt)
                done |= torch.isin(nxt, eos)
                if t < got.shape[1] - 1:
                    logits = dec.step(nxt)
        finally:
            be._fast.pack = True
    want = torch.stack(want, 1)
    lengths = (want != be.pad_id).sum(1)
    assert len(set(lengths.tolist())) > 1  # answers of several lengths: some ended early
    assert torch.equal(got, want)
    again = graph_sample(be, prompts, temp, max_new, seed=7, eos=stops)
    assert torch.equal(again, got)  # reproducible
    whole = graph_sample(be, prompts, temp, max_new, seed=7, eos=stops, bucket=max_new)
    assert torch.equal(whole, got)  # every key attended at every step: the same draws
    assert not torch.equal(graph_sample(be, prompts, temp, max_new, seed=8, eos=stops), got)


def test_draw_follows_the_softmax() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0, float("-inf"), 1.0]]).repeat(100_000, 1)
    for t in (1.0, 0.7):
        u = torch.rand((len(logits), 1), generator=torch.Generator().manual_seed(0),
                       dtype=torch.float64)
        freq = torch.bincount(draw(logits, t, u), minlength=5).double() / len(logits)
        assert freq[3] == 0  # probability 0 is never drawn
        torch.testing.assert_close(freq, torch.softmax(logits[0].double() / t, -1),
                                   atol=5e-3, rtol=0)
    assert draw(logits[:2], 0.0, u[:2]).tolist() == [0, 0]


def test_attention_widens_by_buckets(backends: dict[str, HFBackend]) -> None:
    """Step t attends over the prompt and the new positions up to the next multiple of the
    bucket (never past the cache): the widths a 10-token decode asks for, by hand."""
    be = backends["llama"]
    ids, mask = be.encode_prompts(PROMPTS)
    widths: list[int] = []
    with torch.inference_mode():
        dec = GraphDecoder(be._fast, ids, mask, 10, shared_prompts(ids, mask))
        inner = make_step(dec, 0.0, [-1], be.pad_id)

        def step(*args: Any) -> torch.Tensor:
            widths.append(args[4])  # (tokens, t, u, done, width, seen)
            return inner(*args)

        graph_decode(dec, 10, 0.0, [-1], be.pad_id, None, step, bucket=4)
    tp = ids.shape[1]
    assert widths == [tp + w for w in (4, 4, 4, 4, 8, 8, 8, 8, 10)]  # t = 0..8 feeds tp + t


@pytest.mark.parametrize("filters", [NO_FILTERS, Filters(top_k=50, top_p=0.9, min_p=0.02,
                                                          repetition_penalty=1.3)], ids=str)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_step_traces_whole(backends: dict[str, HFBackend], name: str,
                               filters: Filters) -> None:
    """torch.compile(fullgraph=True) fails on any host sync or data-dependent shape in the
    step; compiled, it gives the eager step's tokens (with TRL's sampling filters too)."""
    import torch._dynamo

    be = backends[name]
    prompts = [p for p in PROMPTS for _ in range(2)]
    eager = graph_sample(be, prompts, 1.0, 8, seed=3, filters=filters)
    torch._dynamo.reset()

    def compiled(dec: GraphDecoder) -> Any:
        return torch.compile(make_step(dec, 1.0, be.eos_ids, be.pad_id, filters),
                             fullgraph=True, backend="eager", dynamic=False)

    try:
        got = graph_sample(be, prompts, 1.0, 8, seed=3, step=compiled, filters=filters)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["llama", "gqa"])
def test_cuda_graph_decoding_equals_hf_generate(tmp_path, name: str) -> None:
    """On a GPU, ``HFBackend`` decodes with the captured step (speed.graph_decode): greedy
    answers as HF generate's, and the same answers with graph_decode off."""
    from grpolab.config import Speed

    path = make_tiny_model(tmp_path / name, hidden=32, heads=4, **TINY[name])
    be = HFBackend(*load_model(path, device="cuda"), reference=False)
    ids, mask = be.encode_prompts([p for p in PROMPTS for _ in range(3)])
    got = be._sample(ids, mask, 0.0, 12, seed=0)
    want = be._hf_generate(ids, mask, 0.0, 12, seed=0)
    assert same_answers(got, want, be.pad_id)
    be.speed = Speed(graph_decode=False)
    assert same_answers(be._sample(ids, mask, 0.0, 12, seed=0), got, be.pad_id)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("error:graph_decode:RuntimeWarning")  # a failed capture fails it
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kept_cuda_graphs_follow_new_prompts_and_weights(tmp_path, dtype: str) -> None:
    """On a GPU the backend keeps its graphs between sampling calls: after an in-place update
    of the adapters, other prompts of the same padded shape replay the kept graphs, decode
    greedily what the plain loop decodes (float32: bfloat16's near-ties may differ between the
    two loops' kernels) and sample what graphs captured afresh sample (three widths)."""
    import dataclasses

    from grpolab.rollout.graphdecode import GraphSampler

    path = make_tiny_model(tmp_path / "gqa", hidden=32, heads=4, **TINY["gqa"])
    be = HFBackend(*load_model(path, device="cuda", dtype=dtype), lora=True, reference=False)
    batches = [be.encode_prompts([p for p in PROMPTS for _ in range(3)]),
               be.encode_prompts([p for p in reversed(PROMPTS) for _ in range(3)])]

    def update(scale: float) -> None:  # as an optimiser step: in place
        with torch.no_grad():
            for n, p in be.model.named_parameters():
                if "lora_B" in n:
                    p.add_(torch.randn_like(p), alpha=scale)

    def drawn(sampler: GraphSampler, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return sampler.sample(be._fast, ids.cuda(), mask.cuda(), 12, 1.0, be.eos_ids,
                              be.pad_id, torch.Generator(device="cuda").manual_seed(3))

    for i, (ids, mask) in enumerate(batches):
        update(0.1 * (i + 1))
        runs = []
        for graphs in (True, False):
            be.speed = dataclasses.replace(be.speed, graph_decode=graphs)
            runs.append(be._sample(ids, mask, 0.0, 12, seed=0))
        assert dtype == "bfloat16" or same_answers(runs[0], runs[1], be.pad_id)
        if i == 0:
            dec = be._graphs.kept[1]
    assert be._graphs.builds == 1 and be._graphs.kept[1] is dec, "the second call replays"
    kept = GraphSampler(bucket=4)  # 12 new tokens: graphs of widths 4, 8 and 12, one pool
    drawn(kept, *batches[0])
    update(0.1)
    got = drawn(kept, *batches[1])
    assert kept.builds == 1
    assert torch.equal(got, drawn(GraphSampler(bucket=4), *batches[1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("shape", "dtype"), [
    ({"hidden": 32, "heads": 4}, "float32"),
    # SmolLM2's head size and grouping in bfloat16: the kernels its decode runs on a GPU
    ({"hidden": 192, "heads": 3, "kv_heads": 1}, "bfloat16")], ids=["float32", "bf16-gqa"])
def test_cuda_graph_decoding_syncs_only_at_its_checks(tmp_path, shape: dict[str, int],
                                                      dtype: str) -> None:
    """64 captured steps with no answer ending: the host waits for the device at the checks
    every SYNC_EVERY steps (and a few one-off copies), not once per token; the replayed graphs
    draw the eager step's tokens."""
    import warnings

    from grpolab.rollout.graphdecode import SYNC_EVERY, cuda_graph

    path = make_tiny_model(tmp_path / "llama", arch="llama", **shape)
    be = HFBackend(*load_model(path, device="cuda", dtype=dtype), reference=False)
    ids, mask = be.encode_prompts([p for p in PROMPTS for _ in range(3)])
    ids, mask, max_new = ids.cuda(), mask.cuda(), 64
    runs = []
    with torch.inference_mode():
        for captured in (True, False):  # four widths (buckets of 16): four graphs
            dec = GraphDecoder(be._fast, ids, mask, max_new, shared_prompts(ids, mask))
            step = make_step(dec, 1.0, [-1], be.pad_id)
            gen = torch.Generator(device="cuda").manual_seed(0)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    runs.append(graph_decode(dec, max_new, 1.0, [-1], be.pad_id, gen,
                                             cuda_graph(step) if captured else step,
                                             bucket=16))
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            if captured:
                syncs = [str(w.message) for w in seen if "synchroniz" in str(w.message)]
    assert runs[0].shape == (len(ids), max_new)
    assert len(syncs) <= max_new // SYNC_EVERY + 4, syncs
    assert torch.equal(runs[0], runs[1])  # the replayed graphs draw what the eager step draws


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_that_cannot_be_captured_runs_uncaptured() -> None:
    """A capture that fails (here a host read inside the step) leaves one warning naming the
    error, and the step runs uncaptured from then on, giving the same results. In its own
    process: a failed capture must not be able to harm the other tests' CUDA state."""
    import subprocess
    import sys

    code = """
import warnings, torch
from grpolab.rollout.graphdecode import cuda_graph
def step(x, width):
    if x.sum().item() < 0:  # a host sync: no capture can take it
        raise AssertionError
    return x * width
run = cuda_graph(step)
x = torch.ones(4, device="cuda")
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    got = [run(x, 2), run(x, 3), run(x + 1, 2)]
assert [float(y.sum()) for y in got] == [8.0, 12.0, 16.0], got
msgs = [str(w.message) for w in seen if "graph_decode" in str(w.message)]
assert len(msgs) == 1 and "without CUDA graphs" in msgs[0], msgs
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=False)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]


def test_capture_shares_one_pool_and_falls_back_uncaptured(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """``cuda_graph``'s bookkeeping on the CPU, torch.cuda's graph API stood in for: the
    second width's graph is captured into the first's pool; a capture that raises leaves one
    warning and the eager step for every later call (the CUDA test above does it for real)."""
    import contextlib

    from grpolab.rollout import graphdecode

    pools: list[Any] = []
    capturing: list[bool] = [False]

    class Graph:
        def pool(self) -> tuple[str, int]:
            return ("pool", id(self))

        def replay(self) -> None:  # the captured output stands for the replay's
            pass

    @contextlib.contextmanager
    def graph(g: Graph, pool: Any = None) -> Any:
        pools.append(pool)
        capturing[0] = True
        try:
            yield
        finally:
            capturing[0] = False

    class Stream:
        def wait_stream(self, other: Stream) -> None:
            pass

    for name, value in {"Stream": Stream, "current_stream": Stream, "CUDAGraph": Graph,
                        "graph": graph, "stream": lambda s: contextlib.nullcontext()}.items():
        monkeypatch.setattr(torch.cuda, name, value)

    def step(x: torch.Tensor, width: int) -> torch.Tensor:
        if capturing[0] and width == 5:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        return x * width

    run = graphdecode.cuda_graph(step)
    x = torch.ones(3)
    assert torch.equal(run(x, 2), x * 2) and torch.equal(run(x, 4), x * 4)
    assert len(pools) == 2 and pools[0] is None and pools[1][0] == "pool"
    with pytest.warns(RuntimeWarning, match=r"\(operation not permitted when stream is "
                                            r"capturing\); decoding without CUDA graphs"):
        assert torch.equal(run(x, 5), x * 5)
    assert torch.equal(run(x + 1, 2), (x + 1) * 2)  # eager now: the new input counts
    assert len(pools) == 3
    assert run.failed == ["operation not permitted when stream is capturing"]  # for reports


class Reads(TorchDispatchMode):
    """The storages a function's operations read that it did not make itself: what a CUDA
    graph captured from it reads again, at the same addresses, on every replay."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()
        self.read: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        for t in tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.Tensor) and t.numel():
                p = t.untyped_storage().data_ptr()
                if p not in self.made:
                    self.read.add(p)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel():
                p = t.untyped_storage().data_ptr()
                if p not in self.read:
                    self.made.add(p)
        return out


def replay_checked(log: list[str]) -> Any:
    """A stand-in for ``cuda_graph`` on the CPU: inputs copied into the first call's tensors
    (as a graph's static inputs), the step run on them, and each later run's reads checked to
    be the first run's storages: a replay reads nothing else."""

    def capture(step: Any) -> Any:
        first: dict[tuple, tuple[list, set[int] | None]] = {}

        def run(*args: Any) -> torch.Tensor:
            key = tuple(a for a in args if not isinstance(a, torch.Tensor))
            if key not in first:
                first[key] = ([a.clone() if isinstance(a, torch.Tensor) else a
                               for a in args], None)
            static, reads = first[key]
            for dst, src in zip(static, args, strict=True):
                if isinstance(src, torch.Tensor):
                    dst.copy_(src)
            with Reads() as r:
                out = step(*static)
            if reads is None:
                first[key] = (static, r.read)
                log.append("captured")
            else:
                log.append("replayed" if r.read == reads else
                           f"read {len(r.read - reads)} other storages")
            return out

        return run

    return capture


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("name", ["gqa", "gpt2"])
def test_kept_graphs_read_new_prompts_and_weights_where_they_were(tmp_path, name: str,
                                                                  lora: bool) -> None:
    """GraphSampler keeps its decoder and graphs between calls. On the GPU's layout (LoRA
    merged into float32 copies, q/k/v stacked into one copy), a second call with other prompts
    of the same padded shape, after an optimiser-like in-place update, reuses the decoder; its
    replayed steps read only the storages captured in the first call, and it draws what a
    decoder built afresh draws. A parameter moved elsewhere builds anew and the old decoder is
    freed at once (no cycle left for the collector); another length builds a decoder of its
    own, kept only once that kind repeats."""
    import gc
    import weakref

    from grpolab.rollout.graphdecode import PROMPT_BUCKET, GraphSampler, held_tensors

    path = make_tiny_model(tmp_path / name, hidden=32, heads=4, **TINY[name])
    be = HFBackend(*load_model(path, device="cpu", dtype="bfloat16"), lora=lora,
                   reference=False)
    lm = be._fast
    lm.cuda_layout = True  # the decode weights a GPU builds
    log: list[str] = []
    kept = GraphSampler(replay_checked(log), bucket=4)

    def update(seed: int) -> None:  # as an optimiser step: the trained weights, in place
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            for p in be.model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=gen).to(p.dtype), alpha=0.05)

    def sample(sampler: GraphSampler, prompts: list[str], max_new: int = 13) -> torch.Tensor:
        ids, mask = be.encode_prompts(prompts)
        return sampler.sample(lm, ids, mask, max_new, 1.0, [-1], be.pad_id,
                              torch.Generator().manual_seed(5))

    def afresh(prompts: list[str], max_new: int = 13) -> torch.Tensor:
        return sample(GraphSampler(bucket=4), prompts, max_new)

    first = [p for p in PROMPTS for _ in range(3)]
    other = [p for p in reversed(PROMPTS) for _ in range(2)] + ["What is 9 - 4?"] * 4
    assert be.encode_prompts(first)[0].shape[1] < PROMPT_BUCKET  # both pad to one shape
    update(0)
    got = sample(kept, first)
    dec = kept.kept[1]
    assert torch.equal(got, afresh(first)) and log.count("captured") == 3  # widths 4, 8, 12
    log.clear()
    update(1)
    where = [t.data_ptr() for t in held_tensors(dec.w)]
    got = sample(kept, other)
    assert kept.kept[1] is dec, "the same shape reuses the decoder"
    assert log and set(log) == {"replayed"}, log
    assert [t.data_ptr() for t in held_tensors(dec.w)] == where
    want = afresh(other)
    assert torch.equal(got, want)
    update(2)  # another draw with these weights: the update is read
    assert not torch.equal(afresh(other), want)
    assert torch.equal(sample(kept, other), afresh(other)) and kept.kept[1] is dec
    p = next(p for p in be.model.parameters() if p.requires_grad)
    p.data = p.data.clone()  # moved: a replay would read the old place
    log.clear()

    def made(dec: Any) -> list[weakref.ref]:  # what a decoder allocated: cache, merges, ...
        held = held_tensors([dec.w, dec.pos, dec.seen, dec.cos_sin, dec.cache.static.buf])
        return [weakref.ref(t) for t in held if not isinstance(t, torch.nn.Parameter)]

    old = made(dec)
    del dec
    gc.disable()
    try:
        assert torch.equal(sample(kept, first), afresh(first)) and "captured" in log
        assert not any(r() is not None for r in old), "the old decoder's tensors are freed"
        old = made(kept.kept[1])
        sample(kept, first, max_new=5)  # another kind, once: a decoder of its own, dropped
        assert all(r() is not None for r in old), "the kept decoder stays"
        sample(kept, first, max_new=5)  # the kind repeats: it replaces the kept one
        assert not any(r() is not None for r in old) and kept.kept[0][5] == 5
    finally:
        gc.enable()


def test_kept_decoder_takes_narrower_prompts(backends: dict[str, HFBackend]) -> None:
    """Prompts narrower than the kept decoder's are padded to its width and replay its graphs
    (drawing what a decoder built afresh on the same padding draws); wider ones build anew. A
    capture that failed is reported (``capture_failed``: the bench prints it)."""
    from grpolab.rollout.graphdecode import PROMPT_BUCKET, GraphSampler, padded_prompts

    be = backends["llama"]
    lm = be._fast
    wide = be.encode_prompts([f"Please think about this {p}" * 4 for p in PROMPTS[:2]] * 2)
    narrow = be.encode_prompts(PROMPTS)
    assert wide[0].shape[1] > PROMPT_BUCKET >= narrow[0].shape[1]
    log: list[str] = []
    kept = GraphSampler(replay_checked(log), bucket=4)

    def sample(sampler: GraphSampler, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return sampler.sample(lm, ids, mask, 8, 1.0, [-1], be.pad_id,
                              torch.Generator().manual_seed(1))

    lm.cuda_layout = True  # the GPU's decode weights (the CPU's prepacked ones are rebuilt)
    try:
        sample(kept, *narrow)
        sample(kept, *wide)
        width = kept.kept[1].tp
        assert kept.builds == 2 and width == -(-wide[0].shape[1] // PROMPT_BUCKET) * PROMPT_BUCKET
        log.clear()
        got = sample(kept, *narrow)
        assert kept.builds == 2 and log and set(log) == {"replayed"}, log
        afresh = GraphSampler(bucket=4)
        assert torch.equal(got, sample(afresh, *padded_prompts(*narrow, be.pad_id, width)))
        assert kept.capture_failed is None

        def failing(step: Any) -> Any:  # as cuda_graph after a capture failed: uncaptured
            def run(*args: Any) -> torch.Tensor:
                return step(*args)

            run.failed = ["operation not permitted when stream is capturing"]
            return run

        uncaptured = GraphSampler(failing, bucket=4)
        assert torch.equal(sample(uncaptured, *narrow), sample(GraphSampler(bucket=4), *narrow))
        assert uncaptured.capture_failed == "operation not permitted when stream is capturing"
    finally:
        lm.cuda_layout = None


def test_kept_graphs_through_grpo_training(tmp_path) -> None:
    """GRPO steps as a GPU runs them, on the CPU: LoRA, a KL term (the reference pass with the
    adapters off between samplings), AdamW's updates, held-out evaluation (greedy: a decoder of
    its own, dropped after it). Every training call after the first replays the steps captured
    in the first, reading only their storages; every call draws what a decoder built afresh on
    the same padded prompts and generator state draws."""
    import itertools

    from helpers import digit_reward

    from grpolab.app.commands import make_backend
    from grpolab.config import make_config
    from grpolab.rollout.graphdecode import GraphSampler, padded_prompts
    from grpolab.run.trainer import GRPOTrainer

    class Checked(GraphSampler):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.calls: list[tuple[float, int]] = []  # (temperature, decoders built so far)

        def sample(self, lm: Any, ids: torch.Tensor, mask: torch.Tensor, max_new: int,
                   temperature: float, eos_ids: list[int], pad_id: int,
                   generator: torch.Generator | None, filters: Any = None) -> torch.Tensor:
            state = generator.get_state()
            got = super().sample(lm, ids, mask, max_new, temperature, eos_ids, pad_id,
                                 generator, filters)
            again = torch.Generator().set_state(state)
            ids, mask = padded_prompts(ids, mask, pad_id, self.kept[1].tp)
            want = GraphSampler(bucket=self.bucket).sample(lm, ids, mask, max_new, temperature,
                                                           eos_ids, pad_id, again, filters)
            assert torch.equal(got, want)
            self.calls.append((temperature, self.builds))
            return got

    path = make_tiny_model(tmp_path / "gqa", hidden=32, heads=4, **TINY["gqa"])
    cfg = make_config(None, {"model_path": str(path), "lora": True, "beta": 0.04, "steps": 3,
                             "budget": 8, "group_size": 4, "max_new_tokens": 9, "lr": 0.05,
                             "eval_every": 2, "eval_size": 4, "progress": False,
                             "checkpoint_every": 0, "out_dir": str(tmp_path / "run")},
                      command="train")
    be = make_backend(cfg, *load_model(str(path), device="cpu"))
    be._fast.cuda_layout = True  # the GPU's layout: graph decoding, here uncaptured
    log: list[str] = []
    be._graphs = Checked(replay_checked(log), bucket=4)
    rows = [{"prompt": p, "answer": "5"} for p in PROMPTS] * 4
    trainer = GRPOTrainer(cfg, be, rows, [digit_reward], rows[:4], out_dir=tmp_path / "run")
    before = [p.detach().clone() for p in be.model.parameters() if p.requires_grad]
    for _ in range(3):
        trainer.step()
    after = [p for p in be.model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    temps, builds = zip(*be._graphs.calls, strict=True)
    assert temps.count(1.0) == 3 and 0.0 in temps  # three steps, evaluation between
    # a decoder is built only where the call's kind changes (training <-> evaluation)
    # one build for training, one per evaluation (dropped after it): training keeps its own
    assert list(builds) == [1 + e for e in itertools.accumulate(t == 0.0 for t in temps)]
    assert builds[1] == 1  # the second training call replayed the first's steps
    assert set(log) == {"captured", "replayed"} and log.count("captured") == 2 * builds[-1]


def test_refill_pairs_held_tensors_and_never_writes_a_parameter() -> None:
    """``refill`` copies tensors closures hold (as ``Weights``' functions do) pair by pair, and
    refuses, writing nothing, where shapes differ or the tensor written over is a parameter."""
    from grpolab.rollout.blocks import Weights
    from grpolab.rollout.graphdecode import held_tensors, refill

    lin = torch.nn.Linear(3, 2)

    def build(scale: float) -> Weights:
        merged = lin.weight.detach() * scale
        return Weights(lambda x: x @ merged.T, [], lambda x, w=lin.weight: x * w.sum(), None)

    old, new = build(1.0), build(2.0)
    assert [t.shape for t in held_tensors(old)] == [(2, 3), (2, 3)]
    assert held_tensors(old)[1] is lin.weight  # a parameter, read where it is
    keep = {lin.weight.untyped_storage().data_ptr()}
    merged = held_tensors(old)[0]
    assert refill(old, new, keep) and torch.equal(merged, lin.weight.detach() * 2)
    assert held_tensors(old)[0] is merged  # written over in place
    w0 = lin.weight.detach().clone()
    assert not refill(old, Weights(lambda x: x, [], lambda x, w=lin.weight * 3: x, None), keep)
    assert torch.equal(lin.weight, w0)
    odd = torch.ones(3, 2)  # another shape in the merged copy's place
    assert not refill(old, Weights(lambda x: x @ odd, [], new.norm, None), keep)
    assert torch.equal(merged, lin.weight.detach() * 2)
