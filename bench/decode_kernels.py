"""Operations per decode step of the fixed-shape loop, on both layouts, counted on the CPU.

    python bench/decode_kernels.py MODEL_DIR [--dtype bfloat16] [--rows 32] [--lora]

A replayed CUDA graph costs about one launch per kernel, and on a GPU each operation that does
work (every aten call but views; a cast counts) is about one kernel; so the count of a decode
step, which needs no GPU, says how many launches the GPU's step pays. Compares
``FastLM.cuda_layout`` off (the CPU's decode weights) and on (the GPU's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Kernels(TorchDispatchMode):
    """Counts the aten calls that do work: every call but views (under inference mode a cast
    arrives as ``to``, marked a view: it counts when it made a new tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.n += 1
        elif isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            self.n += out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()
        return out


def bench_backend(model: str, device: str, dtype: str, lora: bool) -> Any:
    """The GPU benches' policy: ``HFBackend`` on ``model`` without a reference, with LoRA r=8
    on q/k/v/o as bench/vs_trl_real.py trains it when ``lora``."""
    from grpolab.rollout.hf import HFBackend
    from grpolab.rollout.models import load_model

    kw = {"lora": True, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    return HFBackend(*load_model(model, device=device, dtype=dtype), reference=False,
                     **(kw if lora else {}))


def per_step(be: Any, ids: torch.Tensor, mask: torch.Tensor, steps: int = 4) -> float:
    """Operations per ``GraphDecoder.step`` (greedy tokens fed back), averaged over ``steps``."""
    from grpolab.rollout.batch import shared_prompts
    from grpolab.rollout.graphdecode import GraphDecoder

    with torch.inference_mode():
        dec = GraphDecoder(be._fast, ids, mask, steps + 1, shared_prompts(ids, mask))
        logits, count = dec.logits, Kernels()
        for t in range(steps):
            with count:
                logits = dec.step(logits.argmax(-1), torch.tensor([t], device=ids.device))
    return count.n / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--lora", action="store_true", help="LoRA r=8 on q/k/v/o, as the bench")
    a = p.parse_args(argv)
    be = bench_backend(a.model, "cpu", a.dtype, a.lora)
    ids, mask = be.encode_prompts([f"What is {i} + {2 * i + 7}?" for i in range(a.rows)])
    got = {}
    for layout in (False, True):
        be._fast.cuda_layout = layout
        got[layout] = per_step(be, ids, mask)
    layers = len(be._fast.layers)
    print(f"{a.model}: {layers} layers, {a.dtype}, {'LoRA r=8 q/k/v/o' if a.lora else 'no LoRA'}"
          f"; operations per decode step: CPU layout {got[False]:.0f}, CUDA layout "
          f"{got[True]:.0f} ({got[True] / got[False]:.2f}x; {got[True] / layers:.1f} a layer)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
