"""The speed paths a run records with its config (``Config.speed``): switches that change how
fast, never what (the same maths up to float rounding)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Speed:
    """The speed paths: each computes the same maths as the plain path (up to float rounding)
    and is on by default; switching one off measures what it buys. Recorded with the run."""

    lean_forward: bool = True  # Llama-family and GPT-2 models on grpolab's forward (fastlm)
    # CPU: sample on LoRA-merged, oneDNN-prepacked weights; CUDA: the GPU's decode and
    # training layouts (merged q/k/v, stacked adapters; fastlm.FastLM.cuda_layout)
    cpu_pack: bool = True
    score_pack: bool = True  # CPU: scoring's frozen linears on oneDNN copies (with cpu_pack)
    early_exit: bool = True  # finished answers leave the decode batch
    length_buckets: bool = True  # answers of unequal length scored in length buckets
    head_grad_in_forward: bool = True  # a frozen LM head's input gradient made in forward
    # CUDA: decoding at a fixed shape, each step a replayed CUDA graph; the decoder and its
    # graphs kept for later sampling calls of as many rows (its cache stays allocated)
    graph_decode: bool = True
