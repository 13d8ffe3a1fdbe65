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
    from .data import load_rows
    from .hf import check_paths, load_model, make_backend
    from .rewards import load_reward, row_columns, score

    check_paths(cfg, "eval")
    path = cfg.eval_dataset or cfg.dataset
    rows = load_rows(path, cfg.prompt_column, cfg.answer_column or None)[: cfg.eval_size]
    reward_fns = [load_reward(s, cfg.format_pattern or None) for s in cfg.rewards]
    model, tok = load_model(str(Path(cfg.model_path).expanduser()), dtype=cfg.dtype)
    # The training backend's settings (chat template, prompt limit, seed), minus what only
    # training needs: adapters, the reference copy, checkpointing.
    backend = make_backend(dataclasses.replace(cfg, lora=False, beta=0.0, rollout_backend="hf",
                                               gradient_checkpointing=False), model, tok)
    gen = torch.Generator().manual_seed(cfg.seed)

    def scored(rows_in: list[dict], temperature: float) -> Any:
        """Answers and scores for rows_in, in chunks of ``budget`` answers (bounded memory)."""
        parts = []
        for lo in range(0, len(rows_in), cfg.budget):
            chunk = rows_in[lo : lo + cfg.budget]
            ro = backend.generate([r["prompt"] for r in chunk], temperature, cfg.max_new_tokens,
                                  gen)
            parts.append(score(reward_fns, ro.prompts, ro.completions, row_columns(chunk),
                               weights=cfg.reward_weights or None, on_error=cfg.reward_on_error))
        per_fn = torch.cat([p.per_fn for p in parts])
        ok = torch.cat([p.success(cfg.success_threshold) for p in parts])
        return per_fn, ok, parts[0].names, sum(len(p.problems) for p in parts)

    per_fn, ok, names, problems = scored(rows, 0.0)
    out: dict[str, Any] = {
        "model_path": cfg.model_path, "dataset": path, "prompts": len(rows),
        "greedy_accuracy": float(ok.float().mean()),
        **{f"rewards/{n}": float(per_fn[:, j].mean()) for j, n in enumerate(names)},
        "reward_problems": problems,
    }
    n = cfg.eval_samples
    if n:
        _, ok, _, problems = scored([r for r in rows for _ in range(n)], cfg.temperature)
        correct = ok.view(len(rows), n).sum(1)
        out.update({"samples_per_prompt": n, "temperature": cfg.temperature,
                    "sampled_accuracy": float(ok.float().mean()),  # == pass@1
                    "sampled_reward_problems": problems})
        out.update({f"pass@{k}": float(pass_at_k(n, correct, k).mean()) for k in ks_up_to(n)})
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(out, indent=2) + "\n")
    return out
