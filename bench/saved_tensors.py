"""What the policy pass keeps for backward, counted on the CPU, by the line that saved it.

    python bench/saved_tensors.py MODEL_DIR [--rows 16 --tokens 64] [--dtype bfloat16]
                                            [--layout cpu|cuda|both]

An update's peak memory on a GPU is mostly the tensors autograd saves in the forward for the
backward; which tensors are saved depends on the operations, not the device (but for the
attention kernel), so ``torch.autograd.graph.saved_tensors_hooks`` counts them here: each
storage once, summed by the innermost frame outside torch. LoRA r=8 on q/k/v/o, answers of
exactly ``--tokens`` tokens, ``--rows`` answers in groups of 8; MiB per 1,000 answer tokens
scales to other batch sizes (the shared prompts aside).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from decode_kernels import bench_backend
from gpu_memory import owner


def saved_by_owner(fn: Any, resident: set[int] = frozenset()) -> Counter[str]:
    """Bytes of every storage saved for backward while ``fn()`` runs, by owner line; storages
    at the addresses ``resident`` (the weights: held anyway) are not counted."""
    seen: dict[int, int] = {}
    by: Counter[str] = Counter()

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.data_ptr() not in resident and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
            frames = [{"filename": f.filename, "line": f.lineno, "name": f.name}
                      for f in reversed(traceback.extract_stack()[:-1])]
            by[owner(frames)] += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return by


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--layout", default="both", choices=["cpu", "cuda", "both"])
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args(argv)
    be = bench_backend(a.model, "cpu", a.dtype, lora=True)
    be.eos_ids = [-1]  # every answer runs to --tokens
    prompts = [f"What is {i} + {3 * i + 11}?" for i in range(a.rows // 8) for _ in range(8)]
    ro = be.generate(prompts, 1.0, a.tokens, torch.Generator().manual_seed(0))
    n_tok = int(ro.completion_mask.sum())
    layouts = {"cpu": [False], "cuda": [True], "both": [False, True]}[a.layout]
    for layout in layouts:
        be._fast.cuda_layout = layout
        be.model.train()
        weights = {q.untyped_storage().data_ptr() for q in be.model.parameters()}
        by = saved_by_owner(lambda: be.score(be.model, ro, 1.0), weights)
        total = sum(by.values())
        print(f"\n{'CUDA' if layout else 'CPU'} layout: {total / 2**20:.0f} MiB saved for "
              f"backward for {n_tok} answer tokens ({a.rows} x {a.tokens}, {a.dtype}), "
              f"{total / 2**20 / n_tok * 1000:.0f} MiB per 1,000 tokens")
        for who, nbytes in by.most_common(a.top):
            print(f"  {nbytes / 2**20:8.1f} MiB  {who}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
