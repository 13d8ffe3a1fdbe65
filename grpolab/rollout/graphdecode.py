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
  in float64 over the softmax: exactly softmax(logits / T), argmax at T = 0;
* the host checks whether every answer has ended only every ``SYNC_EVERY`` steps.

Shared prompts (GRPO's groups) are prefilled once, as in the plain loop. ``GraphDecoder.step``
is a pure function of tensors of fixed shape: ``torch.compile(fullgraph=True)`` traces it
whole (the tests check this on the CPU).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from grpolab.rollout.kvcache import StaticKV, additive, decode_kv_dtype, prefill
from grpolab.rollout.sampling import _inverse_cdf

SYNC_EVERY = 16  # steps between the host's checks that every answer has ended
KEY_BUCKET = 64  # new positions a step's attention widens by (a graph per width)


class GraphKV:
    """A StaticKV's buffers at a fixed shape: ``update`` writes position ``at`` (a [1] device
    tensor) and returns the first ``width`` positions' keys and values."""

    def __init__(self, static: StaticKV) -> None:
        self.k, self.v = static.k, static.v
        # positions not written yet are attended with weight 0, but must be finite: 0 * NaN
        # (left over in new memory) would poison the row
        static.buf.narrow(4, static.len, static.buf.shape[4] - static.len).zero_()
        self.at: Tensor | None = None
        self.width = static.buf.shape[4]

    def update(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k[i].index_copy_(2, self.at, k.to(self.k[i].dtype))
        self.v[i].index_copy_(2, self.at, v.to(self.v[i].dtype))
        return self.k[i].narrow(2, 0, self.width), self.v[i].narrow(2, 0, self.width)


class GraphDecoder:
    """Prefill, then ``step(tokens, t)`` at one fixed shape for up to ``max_new`` tokens."""

    def __init__(self, lm: Any, ids: Tensor, mask: Tensor, max_new: int,
                 shared: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
        self.lm = lm
        b, tp = ids.shape
        self.logits, pre, (_, _, rows), tables, x = prefill(lm, ids, mask, max_new, shared,
                                                             lm.weights())
        kv_dtype = decode_kv_dtype(lm.dtype, ids.device) if lm.pack else lm.dtype
        self.cache = GraphKV(StaticKV(pre.kv, rows, tp + max_new, kv_dtype))
        self.tp = tp
        # step t's position for each row, and which keys it may see: the real prompt keys,
        # then the new tokens up to its own (the rest are hidden by ``at`` in ``step``)
        self.pos = mask.sum(dim=1, keepdim=True) + torch.arange(max_new, device=ids.device)
        self.seen = torch.cat([mask.bool(), mask.new_ones((b, max_new), dtype=torch.bool)], 1)
        self.keys = torch.arange(tp + max_new, device=ids.device)
        self.kv_dtype = kv_dtype
        self.cos_sin = None if tables is None else lm.rotary(self.pos, x, tables)
        self.w = lm.decode_weights(b)

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


def draw(logits: Tensor, temperature: float, u: Tensor) -> Tensor:
    """One token per row from exactly softmax(logits / T) given uniforms ``u`` [B, 1] (float64);
    argmax at T = 0. Device-side, no host sync: the full-vocabulary float64 search."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    probs = torch.softmax(logits / temperature if temperature != 1 else logits, dim=-1)
    return _inverse_cdf(probs, u)


def graph_decode(dec: GraphDecoder, max_new: int, temperature: float, eos_ids: list[int],
                 pad_id: int, generator: torch.Generator | None = None,
                 step: Any = None, bucket: int = KEY_BUCKET) -> Tensor:
    """The decode loop at a fixed shape: completion ids [B, steps taken], PAD after each EOS.

    ``step``: the function that advances one token, ``(tokens, t, u, done, width) -> next
    tokens`` (``make_step(dec, ...)``, or it captured: ``cuda_graph``); ``width``: the keys
    attended, the prompt and the new positions up to the next multiple of ``bucket``. The host
    looks at ``done`` every ``SYNC_EVERY`` steps only.
    """
    logits = dec.logits
    b, dev = logits.shape[0], logits.device
    u = torch.rand((max_new, b, 1), generator=generator, device=dev, dtype=torch.float64)
    step = step or make_step(dec, temperature, eos_ids, pad_id)
    out = torch.full((b, max_new), pad_id, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    eos = torch.as_tensor(eos_ids, device=dev)
    ts = torch.arange(max_new, device=dev)  # step t's index as a device tensor: a view, no copy
    nxt = draw(logits, temperature, u[0])
    steps = max_new
    for t in range(max_new):
        out[:, t] = nxt
        done = done | torch.isin(nxt, eos)
        if t == max_new - 1 or ((t + 1) % SYNC_EVERY == 0 and bool(done.all())):
            steps = t + 1
            break
        width = dec.tp + min(max_new, -(-(t + 1) // bucket) * bucket)
        nxt = step(nxt, ts[t:t + 1], u[t + 1], done, width)
    return out[:, :steps]


def make_step(dec: GraphDecoder, temperature: float, eos_ids: list[int],
              pad_id: int) -> Any:
    """The captured unit: feed the last tokens, draw the next ones, PAD for finished rows."""

    def step(tokens: Tensor, t: Tensor, u: Tensor, done: Tensor, width: int) -> Tensor:
        logits = dec.step(tokens, t, width)
        return draw(logits, temperature, u).masked_fill(done, pad_id)

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

    return run
