"""Where a decode step's time goes: the sampling loop's tokens/s, one replayed step's time, and
the kernels of one eager step by device time.

    python bench/decode_profile.py MODEL_DIR [--device cuda] [--dtype bfloat16] [--rows 256]
                                   [--new 256] [--lora]

Answers run to ``--new`` tokens (no EOS), rows in groups of 8 sharing a prompt, as the bench.
On CUDA a replayed step's time beside the summed device time of its kernels says what the
graph's launches cost over the kernels' own work; the table names the kernels that dominate.
On the CPU (a dry run) the step is not captured and the profile lists operators.

``--compile`` also times the step compiled by torch.compile (inductor: elementwise chains
fused into generated kernels; on CUDA then captured as the shipped step is), with its compile
time and kernel count: whether fusing kernels pays where a replayed step costs about a launch
per kernel. An experiment, not a speed option: nothing in grpolab compiles. On the CPU the
step section then runs on the GPU's layout (oneDNN's packed weights do not compile).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_kernels import bench_backend


def timed(fn: Any, cuda: bool) -> tuple[Any, float]:
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def profile_steps(step: Any, args: tuple, cuda: bool, n: int = 3) -> tuple[Any, int, float]:
    """Kernels (CUDA) or operators (CPU) of ``n`` calls of ``step``: the profiler's averages,
    how many a call launches, and their device (CPU: self CPU) milliseconds a call."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(n):
            step(*args)
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if cuda:  # kernels, copies and memsets: what a graph replays
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    else:
        kernels = [e for e in events if not e.cpu_children]  # leaf operators
        busy = sum(e.self_cpu_time_total for e in events) / 1e3
    return prof.key_averages(), len(kernels) // n, busy / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--lora", action="store_true", help="LoRA r=8 on q/k/v/o, as the bench")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--compile", action="store_true",
                   help="also time the step compiled by torch.compile (inductor)")
    a = p.parse_args(argv)
    from grpolab.rollout.batch import shared_prompts
    from grpolab.rollout.graphdecode import GraphDecoder, cuda_graph, make_step, padded_prompts

    cuda = a.device == "cuda"
    be = bench_backend(a.model, a.device, a.dtype, a.lora)
    be.eos_ids = [-1]  # every answer runs to --new tokens
    prompts = [f"Question {i}: what is {i} + {2 * i + 7}? Think step by step, then answer."
               for i in range(-(-a.rows // 8)) for _ in range(8)][: a.rows]
    ids, mask = be.encode_prompts(prompts)
    if cuda:  # padded as graph decoding pads them (the sampling calls pad them the same)
        ids, mask = padded_prompts(ids, mask, be.pad_id)
    ids, mask = ids.to(a.device), mask.to(a.device)
    say(f"{a.model}: {a.rows} rows x {a.new} tokens, prompts of {ids.shape[1]}, {a.dtype}, "
        f"{'LoRA r=8 q/k/v/o' if a.lora else 'no LoRA'}, {a.device}"
        + (f" ({torch.cuda.get_device_name()})" if cuda else ""))
    # the sampling call as training makes it: the first builds the decoder (and on CUDA
    # captures its graphs), the second (same shape) prefills into it and replays
    first = timed(lambda: be._sample(ids, mask, 1.0, a.new, seed=0), cuda)[1]
    out, again = timed(lambda: be._sample(ids, mask, 1.0, a.new, seed=1), cuda)
    say(f"sampling: {again:.4g} s, {out.numel() / again:,.0f} tokens/s (first call "
        f"{first:.3f} s; graph decoders built in the two: {be._graphs.builds})"
        f"{'' if cuda and be.speed.graph_decode else ', uncaptured'}"
        + (f"; CUDA GRAPH CAPTURE FAILED ({be._graphs.capture_failed}), uncaptured"
           if be._graphs.capture_failed else ""))
    # one step at the widest attention, replayed (CUDA) and eager, and its kernels
    if a.compile and not cuda:  # oneDNN's packed weights do not compile: the GPU's layout
        be._fast.cuda_layout = True
    with torch.inference_mode():
        dec = GraphDecoder(be._fast, ids, mask, a.new, shared_prompts(ids, mask))
        step = make_step(dec, 1.0, be.eos_ids, be.pad_id)
        b = len(ids)
        args = (dec.logits.argmax(-1), torch.zeros(1, dtype=torch.long, device=a.device),
                torch.rand((b, 1), dtype=torch.float64, device=a.device),
                torch.zeros(b, dtype=torch.bool, device=a.device), dec.tp + a.new)
        reps = 20
        per = {}
        for name, fn in (("eager", step), ("replayed", cuda_graph(step) if cuda else None)):
            if fn is None:
                continue
            fn(*args)  # warm-up (and the capture)
            per[name] = timed(lambda fn=fn: [fn(*args) for _ in range(reps)], cuda)[1] / reps
        table, count, busy = profile_steps(step, args, cuda)
        unit = "kernels" if cuda else "operators"
        say("one step at full width: " + ", ".join(
            f"{k} {v * 1e3:.2f} ms" for k, v in per.items())
            + f"; {count} {unit} a step, {busy:.2f} ms of {'device' if cuda else 'CPU'} time"
            + (f"; a replay spends {per['replayed'] * 1e3 - busy:.2f} ms beyond its kernels' "
               "time" if "replayed" in per else ""))
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        say(table.table(sort_by=key, row_limit=a.top, max_name_column_width=60))
        if a.compile:
            say(compiled_step(step, args, cuda, reps))
    return 0


def say(line: str) -> None:  # at once: a stage cut by its time limit keeps what was said
    print(line, flush=True)


def compiled_step(step: Any, args: tuple, cuda: bool, reps: int) -> str:
    """The step compiled by inductor: its compile time, its kernels (or operators) a step, and
    a call's time after it (on CUDA replayed, captured as the shipped step is)."""
    from grpolab.rollout.graphdecode import cuda_graph

    try:
        fn = torch.compile(step, fullgraph=True, dynamic=False)
        _, first = timed(lambda: fn(*args), cuda)
        _, count, busy = profile_steps(fn, args, cuda)
        run = cuda_graph(fn) if cuda else fn
        run(*args)  # the capture
        _, t = timed(lambda: [run(*args) for _ in range(reps)], cuda)
    except Exception as e:  # noqa: BLE001 - an experiment: its failure is a finding
        said = (str(e).strip().splitlines() or [""])[0][:200]
        return f"compiled step: FAILED ({type(e).__name__}: {said})"
    how = ("" if not cuda else ", replayed" if not run.failed
           else f", CAPTURE FAILED ({run.failed[0]}), uncaptured")
    return (f"compiled step: {1e3 * t / reps:.2f} ms a call{how}; {count} "
            f"{'kernels' if cuda else 'operators'} a step, {busy:.2f} ms of "
            f"{'device' if cuda else 'CPU'} time; compiling took {first:.1f} s")


if __name__ == "__main__":
    raise SystemExit(main())
