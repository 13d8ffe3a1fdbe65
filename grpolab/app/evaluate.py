"""``grpolab eval``: a model's greedy accuracy, each reward's mean and pass@k on held-out
prompts, with the training's verifiers and backend settings (``commands``: loading, checks);
``--compare`` pairs it with an earlier evaluation of the same prompts (``core.passk``)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from grpolab.app.commands import check_code_tests, check_paths, load, make_backend, need_hf
from grpolab.config import Config, ConfigError
from grpolab.rewards.scorer import make_scorer
from grpolab.rewards.trl_compat import check_columns
from grpolab.rollout.sampling import Filters
from grpolab.rollout.templates import check_render
from grpolab.run import dist
from grpolab.run.checkpoint import write_json
from grpolab.run.heldout import plain, score_answers


def run_eval(cfg: Config, same_as: dict[str, Any] | None = None) -> dict[str, Any]:
    """Greedy accuracy and per-reward means on the first ``eval_size`` rows of eval_dataset (or
    dataset); with ``eval_samples`` n > 0 also pass@k for k = 1, 2, 4, ... n at ``temperature``.
    Writes ``<out_dir>/eval.json`` (by difficulty too, when the rows have a ``difficulty``
    column) and every answer judged to ``<out_dir>/completions.jsonl``; returns eval.json's.
    ``same_as``: an earlier eval.json to compare with, checked to be of the same prompts first."""
    from grpolab.core.passk import ks_up_to, pass_at_k, prompts_differ, standard_error
    from grpolab.data.files import fingerprint, run_rows
    from grpolab.data.hub import is_hub_dataset, with_split
    from grpolab.run.report import by_difficulty

    need_hf("eval")
    cfg = check_paths(cfg, "eval")
    if cfg.eval_size < 1:
        raise ConfigError("grpolab eval needs eval_size >= 1 (the prompts it measures)")
    if not cfg.progress:  # as in train: no weight-loading bars around a one-line error
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if not cfg.eval_dataset and is_hub_dataset(cfg.dataset):  # its held-out split, as TRL
        cfg = dataclasses.replace(cfg, eval_dataset=with_split(cfg.dataset, "test"))
    train_rows, held = run_rows(cfg)
    rows = (held or train_rows)[: cfg.eval_size]
    dataset = cfg.eval_dataset or cfg.dataset
    check_code_tests(cfg, (rows, dataset))
    which = {"dataset": dataset, "prompts": len(rows),
             "prompts_sha256": fingerprint([r["prompt"] for r in rows])}
    if same_as is not None and (why := prompts_differ(same_as, which)):
        raise ConfigError(f"--compare: {why}; compare evaluations of the same prompts")
    scorer = make_scorer(cfg)
    check_columns(scorer.reward_fns, rows)
    model, tok = load(cfg)
    # The training backend's settings (chat template, prompt limit, seed), minus what only
    # training needs: adapters, the reference copy, checkpointing.
    backend = make_backend(dataclasses.replace(cfg, lora=False, beta=0.0, rollout_backend="hf",
                                               gradient_checkpointing=False), model, tok)
    check_render(backend.render, rows[0]["prompt"])
    gen = torch.Generator().manual_seed(cfg.seed)
    n = cfg.eval_samples
    try:  # in chunks of ``budget`` answers (bounded memory)
        greedy = score_answers(backend, rows, scorer, cfg.max_new_tokens, cfg.success_threshold,
                               0.0, gen, chunk=cfg.budget)
        if n:
            sampled = score_answers(backend, [r for r in rows for _ in range(n)], scorer,
                                    cfg.max_new_tokens, cfg.success_threshold, cfg.temperature,
                                    gen, chunk=cfg.budget)
    finally:
        scorer.close()
    ok = greedy.ok
    out: dict[str, Any] = {
        "model_path": cfg.model_path, **which, "greedy_accuracy": float(ok.float().mean()),
        "greedy_accuracy_se": standard_error(ok.double()),
        **greedy.reward_means(),
        "reward_problems": greedy.problems,
        "greedy_correct": ok.int().tolist(),  # per prompt, for paired comparisons
        "speed": dataclasses.asdict(cfg.speed),  # the sampling paths taken
        "sampling": dataclasses.asdict(Filters.of(cfg)),  # (the penalty also shapes greedy)
        "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed, "dtype": cfg.dtype,
    }
    if (by := by_difficulty(rows, ok.float())) is not None:
        out["greedy_accuracy_by_difficulty"] = by
    if n:
        correct = sampled.ok.view(len(rows), n).sum(1)
        out.update({"samples_per_prompt": n, "temperature": cfg.temperature,
                    "sampled_accuracy": float(sampled.ok.float().mean()),  # == pass@1
                    "sampled_accuracy_se": standard_error(correct.double() / n),
                    "sampled_reward_problems": sampled.problems,
                    "sampled_correct": correct.tolist(),  # (and verl's reward mean@n:)
                    **{f"sampled_{k}": v for k, v in sampled.reward_means().items()}})
        out.update({f"pass@{k}": float(pass_at_k(n, correct, k).mean()) for k in ks_up_to(n)})
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    judged = [(greedy, rows, True)] + ([(sampled, [r for r in rows for _ in range(n)], False)]
                                       if n else [])
    lines = [json.dumps({"prompt": r["prompt"], "gold": r.get("answer"), "greedy": g,
                         "completion": c, "right": bool(o),
                         "rewards": dict(zip(a.names, plain(f)))}, default=str)
             for a, rs, g in judged for r, c, o, f in zip(rs, a.completions, a.ok, a.per_fn)]
    tmp = out_dir / ".completions.jsonl.partial"  # (each file whole or the old one)
    tmp.write_text("".join(x + "\n" for x in lines))
    os.replace(tmp, out_dir / "completions.jsonl")
    write_json(out_dir / "eval.json", out)
    return out


def evaluate(cfg: Config, compare_to: str | None = None) -> int:
    """``grpolab eval``: print the measures (and, with --compare, the paired gains)."""
    if dist.is_dist():
        raise ConfigError("grpolab eval runs in one process; launch it without torchrun")
    from grpolab.core.passk import compare

    before = None
    if compare_to:
        mine = Path(cfg.out_dir).expanduser() / "eval.json"
        if Path(compare_to).expanduser().resolve() == mine.resolve():  # (it would be replaced)
            raise ConfigError(f"--compare {compare_to} is the eval.json this evaluation writes "
                              f"(out_dir {cfg.out_dir}); give another --out-dir")
        try:
            before = json.loads(Path(compare_to).read_text())
        except (OSError, ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else e
            raise ConfigError(f"--compare {compare_to}: cannot read it ({why})") from None
    res = run_eval(cfg, before)
    line = f"{res['prompts']} prompts: greedy accuracy {res['greedy_accuracy']:.3f}" + (
        f" ({u} answers no reward scored: none right)" if (u := res["unscored_answers"]) else "")
    if ks := [k for k in res if k.startswith("pass@")]:
        line += f"; at T={res['temperature']}, " + ", ".join(f"{k} {res[k]:.3f}" for k in ks)
    print(line)
    if by := res.get("greedy_accuracy_by_difficulty"):
        print("  by difficulty: " + ", ".join(f"{k} {v:.3f}" for k, v in by.items()))
    if before is not None:
        for name, (gain, se) in compare(before, res).items():
            print(f"  {name}: {gain:+.3f} ± {se:.3f} (paired standard error) against {compare_to}")
    print(f"wrote {cfg.out_dir}/eval.json and {cfg.out_dir}/completions.jsonl")
    return 0
