"""``grpolab eval``: how good a model is on held-out prompts, greedy and as pass@k.

RL with verifiable rewards is known to sharpen pass@1 while it can narrow pass@k for large k
(the answers a model can reach at all); measuring both, before and after training, on the same
prompts and verifier, tells which happened. pass@k uses the unbiased estimator of Chen et al.
(2021) from n >= k samples per prompt, not the biased share of prompts solved in k tries.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .config import Config


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


def run_eval(cfg: Config) -> dict[str, Any]:
    """Greedy accuracy and per-reward means on the first ``eval_size`` rows of eval_dataset (or
    dataset); with ``eval_samples`` n > 0 also pass@k for k = 1, 2, 4, ... n at ``temperature``.
    Writes ``<out_dir>/eval.json`` and returns it."""
    from .data import run_rows
    from .hf import check_paths, load_model, load_rewards, make_backend
    from .reward_pool import pool_for
    from .rewards import row_columns, score

    check_paths(cfg, "eval")
    path = cfg.eval_dataset or cfg.dataset
    train, held = run_rows(cfg)
    rows = (held or train)[: cfg.eval_size]
    reward_fns, _ = load_rewards(cfg)
    model, tok = load_model(str(Path(cfg.model_path).expanduser()), dtype=cfg.dtype,
                            cache_dir=cfg.cache_dir)
    # The training backend's settings (chat template, prompt limit, seed), minus what only
    # training needs: adapters, the reference copy, checkpointing.
    backend = make_backend(dataclasses.replace(cfg, lora=False, beta=0.0, rollout_backend="hf",
                                               gradient_checkpointing=False), model, tok)
    gen = torch.Generator().manual_seed(cfg.seed)
    pool = pool_for(reward_fns, cfg.reward_timeout, cfg.reward_workers)  # as in training

    def scored(rows_in: list[dict], temperature: float) -> Any:
        """Answers and scores for rows_in, in chunks of ``budget`` answers (bounded memory)."""
        parts = []
        for lo in range(0, len(rows_in), cfg.budget):
            chunk = rows_in[lo : lo + cfg.budget]
            ro = backend.generate([r["prompt"] for r in chunk], temperature, cfg.max_new_tokens,
                                  gen)
            parts.append(score(reward_fns, ro.prompts, ro.completions, row_columns(chunk),
                               weights=cfg.reward_weights or None, on_error=cfg.reward_on_error,
                               pool=pool, fail_on_all_errors=cfg.fail_on_reward_errors))
        per_fn = torch.cat([p.per_fn for p in parts])
        ok = torch.cat([p.success(cfg.success_threshold) for p in parts])
        return per_fn, ok, parts[0].names, sum(len(p.problems) for p in parts)

    try:
        per_fn, ok, names, problems = scored(rows, 0.0)
        if cfg.eval_samples:
            _, s_ok, _, s_problems = scored([r for r in rows for _ in range(cfg.eval_samples)],
                                            cfg.temperature)
    finally:
        if pool is not None:
            pool.close()
    out: dict[str, Any] = {
        "model_path": cfg.model_path, "dataset": path, "prompts": len(rows),
        "greedy_accuracy": float(ok.float().mean()),
        "greedy_accuracy_se": _se(ok.double()),
        **{f"rewards/{n}": float(per_fn[:, j].mean()) for j, n in enumerate(names)},
        "reward_problems": problems,
        "greedy_correct": ok.int().tolist(),  # per prompt, for paired comparisons
    }
    n = cfg.eval_samples
    if n:
        ok, problems = s_ok, s_problems
        correct = ok.view(len(rows), n).sum(1)
        out.update({"samples_per_prompt": n, "temperature": cfg.temperature,
                    "sampled_accuracy": float(ok.float().mean()),  # == pass@1
                    "sampled_accuracy_se": _se(correct.double() / n),
                    "sampled_reward_problems": problems,
                    "sampled_correct": correct.tolist()})
        out.update({f"pass@{k}": float(pass_at_k(n, correct, k).mean()) for k in ks_up_to(n)})
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def _se(per_prompt: Tensor) -> float:
    """Standard error of a mean over prompts (sample std / sqrt(prompts))."""
    n = per_prompt.numel()
    return float(per_prompt.std() / n**0.5) if n > 1 else float("nan")


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Gain and its paired standard error, after minus before, per measure (greedy accuracy,
    pass@1, pass@k): both evaluations must hold the same prompts in the same order.

    Paired: each prompt is its own control, so the error is that of the per-prompt
    differences, smaller than the two accuracies' errors combined when they are correlated.
    """
    if before.get("prompts") != after.get("prompts") or before.get("dataset") != after.get(
            "dataset"):
        raise ValueError("the two evaluations are not of the same prompts (dataset or count "
                         "differ)")
    out = {}
    diff = (torch.tensor(after["greedy_correct"], dtype=torch.float64)
            - torch.tensor(before["greedy_correct"], dtype=torch.float64))
    out["greedy_accuracy"] = (float(diff.mean()), _se(diff))
    n = before.get("samples_per_prompt")
    if n and n == after.get("samples_per_prompt"):
        c0, c1 = (torch.tensor(e["sampled_correct"]) for e in (before, after))
        for k in ks_up_to(n):
            d = pass_at_k(n, c1, k) - pass_at_k(n, c0, k)
            out[f"pass@{k}"] = (float(d.mean()), _se(d))
    return out
