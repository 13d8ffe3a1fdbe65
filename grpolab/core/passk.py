"""The measures of ``grpolab eval`` (run by ``app.evaluate.run_eval``): pass@k and paired gains.

RL with verifiable rewards is known to sharpen pass@1 while it can narrow pass@k for large k
(the answers a model can reach at all); measuring both, before and after training, on the same
prompts and verifier, tells which happened. pass@k uses the unbiased estimator of Chen et al.
(2021) from n >= k samples per prompt, not the biased share of prompts solved in k tries.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("grpolab")


def pass_at_k(n: int, correct: Tensor, k: int) -> Tensor:
    """Per prompt, the chance that at least one of k answers drawn without replacement from n
    sampled ones is right: 1 - C(n - c, k) / C(n, k), as the stable product
    1 - prod_{i = n - c + 1}^{n} (1 - k / i)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n}")
    out = torch.ones(correct.shape, dtype=torch.float64)
    for j, c in enumerate(correct.tolist()):
        if n - c >= k:
            i = torch.arange(n - c + 1, n + 1, dtype=torch.float64)
            out[j] = 1.0 - torch.prod(1.0 - k / i)
    return out


def ks_up_to(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [1]
    while ks[-1] * 2 <= n:
        ks.append(ks[-1] * 2)
    return ks if ks[-1] == n else [*ks, n]


def standard_error(per_prompt: Tensor) -> float:
    """Standard error of a mean over prompts (sample std / sqrt(prompts))."""
    n = per_prompt.numel()
    return float(per_prompt.std() / n**0.5) if n > 1 else float("nan")


def prompts_differ(a: Any, b: dict[str, Any]) -> str:
    """Why evaluation ``a`` (an earlier eval.json, read as JSON) cannot be paired with ``b``,
    or "" when it can: it must be one (a per-prompt ``greedy_correct`` of 0/1 for each of its
    ``prompts``), of the same dataset and count and (where both recorded it) the same prompts,
    in order."""
    right = a.get("greedy_correct") if isinstance(a, dict) else None
    if not (isinstance(right, list) and len(right) == a.get("prompts")
            and all(x in (0, 1) for x in right)):
        return "that file is no grpolab eval.json (it has no greedy_correct for each prompt)"
    if (a.get("dataset"), a.get("prompts")) != (b.get("dataset"), b.get("prompts")):
        return (f"that evaluation is of {a.get('prompts')} prompts of {a.get('dataset')!r}, "
                f"this one of {b.get('prompts')} of {b.get('dataset')!r}")
    if a.get("prompts_sha256", "") and b.get("prompts_sha256", "") and (
            a["prompts_sha256"] != b["prompts_sha256"]):
        return (f"both are of {a.get('prompts')} prompts of {a.get('dataset')!r}, but not the "
                "same ones (another seed, or the file changed)")
    return ""


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Gain and its paired standard error, after minus before, per measure (greedy accuracy,
    pass@1, pass@k): both evaluations must hold the same prompts in the same order.

    Paired: each prompt is its own control, so the error is that of the per-prompt
    differences, smaller than the two accuracies' errors combined when they are correlated.
    """
    if why := prompts_differ(before, after):
        raise ValueError(f"the two evaluations cannot be paired: {why}")
    n, m = before.get("samples_per_prompt"), after.get("samples_per_prompt")
    for e, k in ((before, n), (after, m)):  # (the sampled counts, checked as the greedy ones)
        c = e.get("sampled_correct") if k else None
        if k and not (isinstance(k, int) and isinstance(c, list) and len(c) == e["prompts"]
                      and all(isinstance(x, int) and 0 <= x <= k for x in c)):
            n = m = None  # (pass@k not paired: the greedy gain alone)
    out = {}
    diff = (torch.tensor(after["greedy_correct"], dtype=torch.float64)
            - torch.tensor(before["greedy_correct"], dtype=torch.float64))
    out["greedy_accuracy"] = (float(diff.mean()), standard_error(diff))
    if n and m and n != m:  # (pass@k of n and of m answers are not paired)
        log.warning("pass@k not compared: %d answers a prompt before, %d now (give the same "
                    "eval_samples)", n, m)
    if n and n == m:
        c0, c1 = (torch.tensor(e["sampled_correct"]) for e in (before, after))
        for k in ks_up_to(n):
            d = pass_at_k(n, c1, k) - pass_at_k(n, c0, k)
            out[f"pass@{k}"] = (float(d.mean()), standard_error(d))
    return out
