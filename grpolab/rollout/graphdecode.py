"""Decoding at a fixed shape, for accelerators: the one-token step of ``fastlm`` over a
preallocated KV cache, with the sampling on the device, so the whole step can be captured once
(a CUDA graph, ``torch.cuda.CUDAGraph``) and replayed.

The plain decode loop (``sampling.decode`` over ``kvcache.Decoder``) changes shapes as it goes
(the cache's keys grow by one each step, finished rows leave the batch) and asks the host about
every token, which on a GPU leaves the step's time to kernel launches and syncs. Here:

* the cache is ``[B, kv heads, prompt + max_new, head_dim]`` per layer from the start; step t
  writes position ``prompt + t`` (a device tensor) and attends over the prompt and the new
  positions up to the next multiple of ``KEY_BUCKET`` (one captured graph per such width, so
  a step reads about as many keys as a growing cache would), a mask hiding those not written
  yet;
* finished answers are masked (PAD after their EOS), not removed, so B never changes;
* each row's uniform for each step is drawn up front from the run's private generator (one per
  row per step, as ``sample_next`` draws), and the token is found on the device by inverse CDF
  in float64 over the softmax: exactly softmax(logits / T) over what ``sampling.Filters``
  leave, argmax at T = 0;
* the host checks whether every answer has ended only every ``SYNC_EVERY`` steps;
* ``GraphSampler`` keeps the decoder and its graphs for the next call of the same shape, which
  prefills into the same tensors (``GraphDecoder.load``): captures are paid once, not per call.

Shared prompts (GRPO's groups) are prefilled once, as in the plain loop. ``GraphDecoder.step``
is a pure function of tensors of fixed shape: ``torch.compile(fullgraph=True)`` traces it
whole (the tests check this on the CPU).
"""

from __future__ import annotations

import functools
import types
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from grpolab.rollout.batch import shared_prompts
from grpolab.rollout.blocks import Layer, Weights
from grpolab.rollout.kvcache import StaticKV, additive, decode_kv_dtype, prefill
from grpolab.rollout.sampling import (
    NO_FILTERS,
    Filters,
    _inverse_cdf,
    next_probs,
    penalise,
    penalty_start,
)

SYNC_EVERY = 16  # steps between the host's checks that every answer has ended
KEY_BUCKET = 64  # new positions a step's attention widens by (a graph per width)


class GraphKV:
    """A StaticKV's buffers at a fixed shape: ``update`` writes position ``at`` (a [1] device
    tensor) and returns the first ``width`` positions' keys and values."""

    def __init__(self, static: StaticKV) -> None:
        self.static = static
        self.k, self.v = static.k, static.v
        self.at: Tensor | None = None
        self.width = static.buf.shape[4]
        self._clear_new()

    def _clear_new(self) -> None:
        # positions not written yet are attended with weight 0, but must be finite: 0 * NaN
        # (left over in new memory) would poison the row
        s = self.static
        s.buf.narrow(4, s.len, s.buf.shape[4] - s.len).zero_()

    def load(self, prefix: list[tuple[Tensor, Tensor]], rows: Tensor | None) -> None:
        """New prompts' keys and values in front, in place; the new positions cleared."""
        self.static.fill(prefix, rows)
        self._clear_new()

    def update(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k[i].index_copy_(2, self.at, k.to(self.k[i].dtype))
        self.v[i].index_copy_(2, self.at, v.to(self.v[i].dtype))
        return self.k[i].narrow(2, 0, self.width), self.v[i].narrow(2, 0, self.width)


class GraphDecoder:
    """Prefill, then ``step(tokens, t)`` at one fixed shape for up to ``max_new`` tokens;
    ``load`` prefills new prompts of the same shape into the same tensors."""

    def __init__(self, lm: Any, ids: Tensor, mask: Tensor, max_new: int,
                 shared: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
        self.lm = lm
        self.tp, self.max_new = ids.shape[1], max_new
        self.keys = torch.arange(self.tp + max_new, device=ids.device)
        # the model's dtype on the GPU's layout, also where tests force it on the CPU
        # (decode_kv_dtype's float32 is for the CPU's own kernels)
        self.kv_dtype = (decode_kv_dtype(lm.dtype, ids.device)
                         if lm.pack and not lm.on_cuda_layout() else lm.dtype)
        self.cache: GraphKV | None = None
        self.load(ids, mask, shared)

    def load(self, ids: Tensor, mask: Tensor,
             shared: tuple[Tensor, Tensor, Tensor] | None = None) -> bool:
        """Prefill prompts ``ids`` [B, tp] with the model's current weights. After the first
        load every tensor ``step`` reads stays where it is, written over in place (the cache,
        positions, rotary tables, decode weights), so a step captured before reads the new
        prompts and weights when replayed. False, and nothing written, where the new state
        does not pair with the old one (another shape, or weights built differently)."""
        b, tp = ids.shape
        if self.cache is not None and tp != self.tp:
            return False
        logits, pre, (_, _, rows), tables, x = prefill(self.lm, ids, mask, self.max_new,
                                                       shared, self.lm.weights())
        # step t's position for each row, and which keys it may see: the real prompt keys,
        # then the new tokens up to its own (the rest are hidden by ``at`` in ``step``)
        pos = mask.sum(dim=1, keepdim=True) + torch.arange(self.max_new, device=ids.device)
        seen = torch.cat([mask.bool(), mask.new_ones((b, self.max_new), dtype=torch.bool)], 1)
        state = (pos, seen, None if tables is None else self.lm.rotary(pos, x, tables),
                 self.lm.decode_weights(b))
        if self.cache is None:
            self.cache = GraphKV(StaticKV(pre.kv, rows, tp + self.max_new, self.kv_dtype))
            self.pos, self.seen, self.cos_sin, self.w = state
        elif not refill((self.pos, self.seen, self.cos_sin, self.w), state,
                        {t.untyped_storage().data_ptr() for t in model_tensors(self.lm)}):
            return False
        else:
            self.cache.load(pre.kv, rows)
        self.logits = logits
        return True

    def step(self, tokens: Tensor, t: Tensor, width: int | None = None) -> Tensor:
        """Feed ``tokens`` [B] at new position ``t`` (a [1] long tensor), attending over the
        first ``width`` positions (default all; more than ``t + prompt``); logits [B, V]."""
        at = t + self.tp
        width = width or len(self.keys)
        self.cache.at, self.cache.width = at, width
        allowed = self.seen[:, :width] & (self.keys[:width] <= at)
        mask = additive(allowed[:, None, None, :], self.kv_dtype)
        rot = (None if self.cos_sin is None
               else tuple(c.index_select(1, t) for c in self.cos_sin))
        pos = self.pos.index_select(1, t)
        return self.lm.forward(tokens[:, None], pos, mask, self.cache, rot=rot, w=self.w)[:, -1]


def held_tensors(obj: Any, seen: set[int] | None = None) -> list[Tensor]:
    """The tensors ``obj`` holds, in a fixed order: through lists, tuples, dicts, partials,
    closures and their defaults (``Weights``' functions close over their merged copies) and
    attributes of plain objects (``Weights``, ``Layer``); not into modules, whose parameters
    a step reads where they are. Two builds of the same weights list theirs pair by pair."""
    if isinstance(obj, Tensor):
        return [obj]
    seen = set() if seen is None else seen
    if obj is None or id(obj) in seen or isinstance(obj, (nn.Module, type, str, int, float)):
        return []
    seen.add(id(obj))
    if isinstance(obj, dict):
        parts = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        parts = list(obj)
    elif isinstance(obj, functools.partial):
        parts = [obj.func, obj.args, obj.keywords]
    elif isinstance(obj, types.FunctionType):
        parts = [c.cell_contents for c in obj.__closure__ or ()] + list(obj.__defaults__ or ())
    elif isinstance(obj, (Weights, Layer)):
        names = getattr(obj, "__slots__", None) or list(vars(obj))
        parts = [getattr(obj, n, None) for n in names]
    else:
        return []
    return [t for p in parts for t in held_tensors(p, seen)]


def model_tensors(lm: Any) -> tuple[Tensor, ...]:
    """The model's parameters and buffers: a step reads them where they are."""
    return (*lm.model.parameters(), *lm.model.buffers())


def refill(old: Any, new: Any, keep: set[int]) -> bool:
    """Copy the tensors ``new`` holds over those ``old`` holds, pair by pair (``held_tensors``),
    where they are different tensors: False, and nothing written, unless every pair has one
    shape, dtype, device and strided layout and no written one is in storages ``keep``."""
    olds, news = held_tensors(old), held_tensors(new)
    if len(olds) != len(news) or not all(
            a.layout == b.layout == torch.strided
            and (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
            for a, b in zip(olds, news, strict=True)):
        return False
    pairs = [(a, b) for a, b in zip(olds, news, strict=True) if a is not b]
    if any(a.untyped_storage().data_ptr() in keep for a, _ in pairs):
        return False
    for a, b in pairs:
        a.copy_(b)
    return True


def draw(logits: Tensor, temperature: float, u: Tensor, filters: Filters = NO_FILTERS,
         seen: Tensor | None = None) -> Tensor:
    """One token per row from exactly softmax(logits / T) over what ``filters`` leave, given
    uniforms ``u`` [B, 1] (float64); argmax at T = 0; ``seen`` [B, V]: the tokens the
    repetition penalty applies to. Device-side, no host sync: the float64 search in full."""
    if seen is not None:
        logits = penalise(logits, seen, filters.repetition_penalty)
    if temperature == 0:
        return logits.argmax(dim=-1)
    return _inverse_cdf(next_probs(logits, temperature, filters, fixed_shape=True), u)


def graph_decode(dec: GraphDecoder, max_new: int, temperature: float, eos_ids: list[int],
                 pad_id: int, generator: torch.Generator | None = None,
                 step: Any = None, bucket: int = KEY_BUCKET, filters: Filters = NO_FILTERS,
                 prompts: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The decode loop at a fixed shape: completion ids [B, steps taken], PAD after each EOS.

    ``step``: the function that advances one token, ``(tokens, t, u, done, width, seen) ->
    next tokens`` (``make_step(dec, ...)``, or it captured: ``cuda_graph``); ``width``: the
    keys attended, the prompt and the new positions up to the next multiple of ``bucket``. The
    host looks at ``done`` every ``SYNC_EVERY`` steps only. A repetition penalty needs the
    ``prompts`` (ids, mask) the decoder holds; the tokens it has seen are kept here, outside
    the captured step, which only reads them.
    """
    logits = dec.logits
    b, dev = logits.shape[0], logits.device
    u = torch.rand((max_new, b, 1), generator=generator, device=dev, dtype=torch.float64)
    step = step or make_step(dec, temperature, eos_ids, pad_id, filters)
    out = torch.full((b, max_new), pad_id, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    eos = torch.as_tensor(eos_ids, device=dev)
    ts = torch.arange(max_new, device=dev)  # step t's index as a device tensor: a view, no copy
    seen = penalty_start(filters, prompts, logits.shape[-1], dev)
    nxt = draw(logits, temperature, u[0], filters, seen)
    steps = max_new
    for t in range(max_new):
        out[:, t] = nxt
        done = done | torch.isin(nxt, eos)
        if t == max_new - 1 or ((t + 1) % SYNC_EVERY == 0 and bool(done.all())):
            steps = t + 1
            break
        if seen is not None:
            seen.scatter_(1, nxt[:, None], True)
        width = dec.tp + min(max_new, -(-(t + 1) // bucket) * bucket)
        nxt = step(nxt, ts[t:t + 1], u[t + 1], done, width, seen)
    return out[:, :steps]


def make_step(dec: GraphDecoder, temperature: float, eos_ids: list[int],
              pad_id: int, filters: Filters = NO_FILTERS) -> Any:
    """The captured unit: feed the last tokens, draw the next ones, PAD for finished rows."""

    def step(tokens: Tensor, t: Tensor, u: Tensor, done: Tensor, width: int,
             seen: Tensor | None = None) -> Tensor:
        logits = dec.step(tokens, t, width)
        return draw(logits, temperature, u, filters, seen).masked_fill(done, pad_id)

    return step


def cuda_graph(step: Any) -> Any:
    """``step`` captured as a CUDA graph at its first call for each value of its non-tensor
    arguments (the attention width) and replayed after: tensor inputs are copied into the
    graph's own tensors, the output is the graph's (read it before the next call). A first
    call runs the step twice on the same inputs (warm-up, then the replay; capture only
    records), which is harmless: it writes the same keys at the same cache position.

    The graphs share one memory pool: they replay one at a time and what outlives a replay
    (inputs, output) stays referenced. Where a capture fails, the step runs uncaptured from
    then on, with one warning naming the error (decoding slower, the same tokens)."""
    graphs: dict[tuple, tuple[Any, list[Tensor], Tensor]] = {}
    failed: list[str] = []

    def run(*args: Any) -> Tensor:
        if failed:
            return step(*args)
        key = tuple(a for a in args if not isinstance(a, Tensor))
        if key not in graphs:
            static = [a.clone() if isinstance(a, Tensor) else a for a in args]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step(*static)  # warm-up: kernels chosen, workspaces allocated
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            pool = next(iter(graphs.values()))[0].pool() if graphs else None
            try:
                with torch.cuda.graph(g, pool=pool):
                    out = step(*static)
            except RuntimeError as e:
                failed.append(str(e).strip().splitlines()[0] if str(e).strip() else repr(e))
                warnings.warn(f"graph_decode: capturing the decode step failed ({failed[0]}); "
                              "decoding without CUDA graphs", RuntimeWarning, stacklevel=2)
                return step(*args)
            graphs[key] = (g, static, out)
        g, static, out = graphs[key]
        for dst, src in zip(static, args):
            if isinstance(src, Tensor):
                dst.copy_(src)
        g.replay()
        return out

    run.failed = failed  # type: ignore[attr-defined]  # the capture's error, for reports
    return run


def uncaptured(step: Any) -> Any:
    return step


PROMPT_BUCKET = 32  # prompts are left-padded to a multiple of this: one shape serves many


def padded_prompts(ids: Tensor, mask: Tensor, pad_id: int,
                   width: int = 0) -> tuple[Tensor, Tensor]:
    """Left-padded prompts [B, tp] padded further on the left to a multiple of
    ``PROMPT_BUCKET``, or to ``width`` if wider (the padding masked: positions and answers are
    those of ``ids``)."""
    extra = max(-ids.shape[1] % PROMPT_BUCKET, width - ids.shape[1])
    return (torch.nn.functional.pad(ids, (extra, 0), value=pad_id),
            torch.nn.functional.pad(mask, (extra, 0), value=0))


class GraphSampler:
    """``graph_decode`` with the decoder and its captured step kept from one sampling call to
    the next. Capturing costs two eager steps per attention width, and ``torch.cuda.graph``
    empties the allocator's cache each time; kept, a call costs its prefill and replays. A call
    of as many rows, with prompts no wider than the kept ones (padded on the left to their
    width; else to a multiple of ``PROMPT_BUCKET``), the same settings and the model's weights
    where they were, prefills into the kept decoder (``GraphDecoder.load``) and replays the
    graphs captured before. With prompts of varied length the kept width soon is the widest
    batch's: masked padding costs attention far less than capturing again.

    Any other call builds a decoder of its own. It replaces the kept one (freed first) when its
    kind repeats (the previous call had its settings) or the kept one can serve no more (the
    weights moved), else it is dropped after the call: a held-out evaluation between training
    steps costs one build, and the training decoder stays.

    The price: the cache, the graphs' pool and the decode weights' merged copies stay allocated
    between calls (SmolLM2-135M in bfloat16: the cache is B x (prompt + max_new) x 23 KB, about
    2 GB at 256 x 256; the float32 LoRA merges of q/k/v/o 0.1 GB). A capture that failed
    (``cuda_graph``) leaves the kept decoder uncaptured until it is rebuilt; ``capture_failed``
    says why, for the last call.

    ``capture``: what makes the step's replayable form (default ``cuda_graph`` on CUDA, none
    elsewhere; tests pass stand-ins); ``bucket``: as ``graph_decode``'s."""

    def __init__(self, capture: Any = None, bucket: int = KEY_BUCKET) -> None:
        self.capture, self.bucket = capture, bucket
        self.kept: tuple[tuple, GraphDecoder, Any] | None = None
        self.last: tuple | None = None  # the previous call's settings
        self.builds = 0  # decoders built (each then captures its graphs): for benches
        self.capture_failed: str | None = None  # the last call's failed capture, if any

    def sample(self, lm: Any, ids: Tensor, mask: Tensor, max_new: int, temperature: float,
               eos_ids: list[int], pad_id: int, generator: torch.Generator | None,
               filters: Filters = NO_FILTERS) -> Tensor:
        """Completion ids [B, steps] for prompts ``ids``/``mask`` [B, tp] (left-padded), as
        ``graph_decode`` draws them from ``generator``."""
        where = (id(lm), tuple(t.data_ptr() for t in model_tensors(lm)))  # model, weights
        key = (where, lm.pack, lm.on_cuda_layout(), lm.head_off, len(ids), max_new,
               temperature, tuple(eos_ids), pad_id, filters)
        same = self.kept is not None and self.kept[0] == key
        with torch.inference_mode():  # the kept tensors are inference tensors
            ids, mask = padded_prompts(ids, mask, pad_id, self.kept[1].tp if same else 0)
            shared = shared_prompts(ids, mask)
            if same and self.kept[1].load(ids, mask, shared):  # (False if wider)
                _, dec, step = self.kept
            else:
                # kept, unless another kind comes once; a kept decoder of another model or
                # of weights since moved can never serve again
                keep = self.kept is None or self.last == key or self.kept[0][0] != where
                if keep:
                    self.kept = None  # the old cache and graphs go before new ones are made
                dec = GraphDecoder(lm, ids, mask, max_new, shared)
                capture = self.capture or (cuda_graph if ids.is_cuda else uncaptured)
                step = capture(make_step(dec, temperature, eos_ids, pad_id, filters))
                self.builds += 1
                if keep:
                    self.kept = (key, dec, step)
            self.last = key
            out = graph_decode(dec, max_new, temperature, eos_ids, pad_id, generator, step,
                               self.bucket, filters, (ids, mask))
        failed = getattr(step, "failed", None)
        self.capture_failed = failed[0] if failed else None
        return out
