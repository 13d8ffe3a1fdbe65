"""The cost of the sampling filters per decode step on the CPU, against transformers' own
warpers in the same process: one next-token draw for 32 rows of a 49,152-token vocabulary
(SmolLM2's), plain and with top-p 0.95 (grpolab's search, and HF's full sort), on a flat and on
peaked synthetic distributions (Zipf-shaped logits, as a language model's are).

    python bench/sampling_filters.py [--rows 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from grpolab.rollout.sampling import Filters, sample_next, top_p_drop


def timed(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g, v, t = torch.Generator().manual_seed(0), 49152, 0.9
    log_rank = torch.arange(1, v + 1, dtype=torch.float32).log()
    cases = {"flat (randn x 3)": torch.randn(args.rows, v, generator=g) * 3}
    for s in (1.1, 1.5, 2.0):
        cases[f"Zipf {s}"] = torch.stack([-s * log_rank[torch.randperm(v, generator=g)]
                                          for _ in range(args.rows)])
    hf = [TemperatureLogitsWarper(t), TopPLogitsWarper(0.95)]
    print(f"{args.rows} rows x {v} tokens, T {t}, top-p 0.95, {args.threads} threads (ms a draw)")
    for name, x in cases.items():
        kept = float((~top_p_drop(x / t, 0.95)).sum(-1).float().mean())
        plain = timed(lambda x=x: sample_next(x, t, g))
        ours = timed(lambda x=x: sample_next(x, t, g, Filters(top_p=0.95)))
        theirs = timed(lambda x=x: torch.multinomial(torch.softmax(
            hf[1](None, hf[0](None, x.clone())), -1), 1, generator=g))
        print(f"{name:18} kept {kept:7.0f}  plain {plain:6.2f}  top-p {ours:6.2f}  "
              f"HF warpers + multinomial {theirs:6.2f}  (HF / grpolab {theirs / ours:.1f}x)")


if __name__ == "__main__":
    main()
