"""The cost of the sampling filters per decode step on the CPU, against transformers' own
warpers in the same process: one next-token draw for 32 rows of a 49,152-token vocabulary
(SmolLM2's), plain and with top-p 0.95 (grpolab's search, and HF's full sort), on a flat and on
peaked synthetic distributions (Zipf-shaped logits, as a language model's are).

    python bench/sampling_filters.py [--rows 32] [--threads 2] [--model smollm2-135m-instruct]

With ``--model`` it also samples 32 answers of 40 tokens from that model (top-p 0.95, T 1 and
0.7) and counts where each draw's top-p boundary fell: within the first 256 tokens, the first
4096, or past them (a full sort).
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
    ap.add_argument("--model", default="", help="also count a real model's top-p boundaries")
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
    if args.model:
        boundaries(args.model)


def boundaries(model_path: str) -> None:
    """Where top-p 0.95's boundary falls in a real model's draws (``TOP_P_SEARCH``'s sizes)."""
    import collections

    from grpolab.rollout import sampling
    from grpolab.rollout.hf import HFBackend
    from grpolab.rollout.models import load_model

    seen: collections.Counter = collections.Counter()
    plain = sampling.top_p_drop

    def counting(x: torch.Tensor, p: float, search: tuple = sampling.TOP_P_SEARCH):
        mass = x.softmax(-1).topk(min(4096, x.shape[-1]), dim=-1).values.cumsum(-1)
        at256, at4096 = mass[:, min(255, mass.shape[1] - 1)] >= p, mass[:, -1] >= p
        seen.update({"draws": len(x), "within 256": int(at256.sum()),
                     "within 4096": int((at4096 & ~at256).sum()),
                     "past 4096": int((~at4096).sum())})
        return plain(x, p, search)

    sampling.top_p_drop = counting
    try:
        model, tok = load_model(model_path)
        be = HFBackend(model, tok, reference=False, filters=Filters(top_p=0.95))
        prompts = [f"What is {a} + {b}? End your reply with 'The answer is N.'"
                   for a in range(4) for b in range(8)]
        for t in (1.0, 0.7):
            seen.clear()
            be.generate(prompts, t, 40, torch.Generator().manual_seed(0))
            print(f"{model_path}, T {t}: {dict(seen)}")
    finally:
        sampling.top_p_drop = plain


if __name__ == "__main__":
    main()
