"""The headline experiment: GRPO from the fine-tuned world model at a fixed answer budget.

64 answers a step split as 64/G prompts x G answers: a larger G means fewer prompts but fewer
dead groups. ``run_sweep`` measures that trade-off (and the fixes) side by side; the variants
it can run are named here. One run is ``run_workshop``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import statistics
from pathlib import Path
from typing import Any

import torch

from grpolab.config import Config, ConfigError, coerce, resolve
from grpolab.config.load import warn_idle
from grpolab.core import advantages, losses, returns
from grpolab.rewards.builtin import exact_answer
from grpolab.rollout.sampling import Filters
from grpolab.run.checkpoint import holds_run, out_dir_lock
from grpolab.run.plots import format_table, plot_sweep
from grpolab.run.report import finish_run
from grpolab.run.trackers import Reporter
from grpolab.run.trainer import GRPOTrainer
from grpolab.world.backend import TinyBackend
from grpolab.world.sft import sft_model
from grpolab.world.task import make_splits

log = logging.getLogger("grpolab")

# Named variants for sweeps: each is one switch on top of plain GRPO.
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dynamic": {"dynamic_sampling": True},
    "curriculum": {"curriculum": True},
    "allocate": {"allocate": True},  # prompts and group sizes from pass-rate posteriors
    "allocate_dynamic": {"allocate": True, "dynamic_sampling": True},  # ... refilled with live
    "allocate_grid": {"allocate": True, "predict_prior": "grid"},  # ... posteriors on a grid prior
    "allocate_grid_answers": {"allocate": True, "predict_prior": "grid",
                              "allocate_objective": "live_answers"},
    "dr_grpo": {"dr_grpo": True},
    "clip_higher": {"clip_higher": True},
    "token_loss": {"token_level_loss": True},
    "rloo": {"rloo": True},
    # the objectives of TRL and verl, with the settings their papers use
    "gspo": {"policy_loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4},  # GSPO's clip range
    "cispo": {"policy_loss": "cispo", "loss_agg": "token_mean"},  # as TRL's loss_type cispo
    "sapo": {"policy_loss": "sapo"},  # TRL's loss_type sapo, verl's: its temperatures 1, 1.05
    "vespo": {"policy_loss": "vespo", "loss_agg": "token_mean"},  # as TRL's loss_type vespo
    "gmpo": {"policy_loss": "gmpo", "eps_low": 0.4, "eps_high": 0.4},  # GMPO's (e^-0.4, e^0.4)
    # LUSPO: GSPO with each answer's loss summed over its tokens, at GSPO's clip range
    "luspo": {"policy_loss": "gspo", "loss_agg": "seq_mean_token_sum", "eps_low": 3e-4,
              "eps_high": 4e-4},
    # GPG: REINFORCE on (r - group mean) x answers / answers rewarded (verl: gpg loss and
    # advantage, its default token mean; the run's beta kept: one switch)
    "gpg": {"policy_loss": "gpg", "scale": "gpg", "loss_agg": "token_mean"},
    "dual_clip": {"dual_clip": 3.0},  # verl's clip_ratio_c default
    "batch_std": {"scale": "batch"},  # TRL scale_rewards: batch
    "gdpo": {"reward_aggregation": "normalize_then_sum"},
    "kl_k1": {"kl_estimator": "k1"},
    "kl_k2": {"kl_estimator": "k2"},
    "kl_is": {"kl_is_correction": True},  # TRL 1.16's default use_bias_correction_kl
    "kl_reward": {"kl_in": "reward", "kl_estimator": "k1"},  # verl use_kl_in_reward, kl_penalty kl
    "no_kl": {"beta": 0.0},  # TRL's default beta
    "entropy_bonus": {"entropy_coef": 0.01},
    "high_entropy": {"top_entropy_quantile": 0.2},  # the 80/20 paper's rho
    # REINFORCE++ (verl's reinforce_plus_plus[_baseline]): per-token k1 KL in the reward
    "reinforce_pp": {"estimator": "reinforce_pp", "kl_in": "reward", "kl_estimator": "k1"},
    "reinforce_pp_baseline": {"estimator": "reinforce_pp_baseline", "kl_in": "reward",
                              "kl_estimator": "k1"},
    # PPO with a value model and GAE (verl's gae estimator), the KL in the reward
    "ppo": {"estimator": "ppo", "kl_in": "reward", "kl_estimator": "k1"},
}

# Every entry of the maths registries is a preset too, named "<config key>=<entry>", so a new
# function in core/advantages.py or core/losses.py can be swept without touching this file.
REGISTRIES: dict[str, dict[str, Any]] = {
    "policy_loss": losses.POLICY_LOSSES,
    "kl_estimator": losses.KL_ESTIMATORS,
    "loss_agg": losses.LOSS_AGGREGATIONS,
    "baseline": advantages.ADVANTAGE_BASELINES,
    "scale": advantages.ADVANTAGE_SCALES,
    "reward_aggregation": advantages.REWARD_AGGREGATIONS,
    "estimator": returns.ESTIMATORS,
}
VARIANTS: dict[str, dict[str, Any]] = {
    **PRESETS,
    **{f"{key}={name}": {key: name} for key, reg in REGISTRIES.items() for name in reg
       if name != getattr(Config, key)},
}


def variant_settings(name: str) -> dict[str, Any]:
    """A variant's config settings: a preset (VARIANTS), or ad hoc ``key=value`` pairs joined
    by ``+`` (``policy_loss=gspo+epochs=2``), each key a config key."""
    if name in VARIANTS:
        return dict(VARIANTS[name])
    if "=" not in name:
        raise ConfigError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)} (or "
                          "key=value+key=value)")
    out: dict[str, Any] = {}
    for pair in name.split("+"):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"variant {name!r}: {pair!r} is not key=value")
        key = key.strip().replace("-", "_")
        out[key] = coerce(key, value.strip())
    return out


def variants_help() -> str:
    """One line for --variants: every preset, by name."""
    return ("comma-separated sweep variants (default: grpo): " + ", ".join(PRESETS) + "; every "
            "registry entry as key=name (" + ", ".join(k for k in VARIANTS if "=" in k) + "); or "
            "any key=value+key=value")


SWEEP_HEADER = ["variant", "G", "prompts/step", "mean dead share", "predicted dead share",
                "all-right share of dead groups",
                "held-out p(T) start", "held-out p(T) end", "held-out p(T) gain",
                "greedy start", "greedy end", "greedy gain", "answers generated"]
# p(T): held-out accuracy at the run's temperature, exact (the world has one right string per
# prompt); greedy accuracy (the status lines' "held-out acc") beside it
SUMMARY_KEYS = ["mean_dead_share", "mean_predicted_dead_share", "all_right_share_of_dead",
                "start_heldout_pass_prob", "final_heldout_pass_prob", "heldout_pass_prob_gain",
                "start_heldout_acc", "final_heldout_acc", "heldout_acc_gain", "answers_generated"]
# also averaged over seeds (summary.json and the sweep plot), not table columns
EXTRA_KEYS = ["start_train_pass_prob", "final_train_pass_prob", "answers_per_useful",
              "dead_share_first10", "dead_share_last10", "dead_all_right_first10",
              "dead_all_right_last10", "reward_first10", "reward_last10",
              "corr_all_right_dead_vs_acc", "corr_dead_vs_acc"]


def mean_summary(summaries: list[dict]) -> dict:
    """Mean over seeds of every table number, plus its spread (sample std) where n > 1.

    An undefined value (None or NaN: a correlation over a constant series, a short run) is left
    out of its mean.
    """
    out: dict = {}
    for k in SUMMARY_KEYS + [k for k in EXTRA_KEYS if all(k in s for s in summaries)]:
        vals = [s[k] for s in summaries if s[k] is not None and s[k] == s[k]]  # not NaN
        if not vals:
            continue
        out[k] = sum(vals) / len(vals)
        if len(vals) > 1:
            out[k + "_sd"] = statistics.stdev(vals)
    return out


def sweep_row(variant: str, cfg: Config, s: dict) -> list:
    """One table row from a run's config and (seed-averaged) summary: 'mean ± sd' over seeds;
    '-' where the value is undefined in every seed (no held-out rows, no dead group)."""
    cells = [f"{s[k]:.3f} ± {s[k + '_sd']:.3f}" if k + "_sd" in s else s.get(k, "-")
             for k in SUMMARY_KEYS[:-1]]
    if cfg.allocate:  # (the allocator chooses the groups' sizes and count each step)
        return [variant, f"{cfg.allocate_min_group}-{cfg.allocate_max_group}", "-", *cells,
                round(s["answers_generated"])]
    return [variant, cfg.group_size, cfg.prompts_per_step, *cells,
            round(s["answers_generated"])]


def run_sweep(
    cfg: Config, sizes: list[int], variants: list[str], seeds: list[int] | None = None,
    resume: bool = False,
) -> str:
    """Every (variant, G) pair, over one or more seeds (each seed is its own world, SFT start and
    run); writes sweep.md and sweep.png under cfg.out_dir and returns the table. ``resume``:
    each run whose folder holds one continues it, the others start."""
    settings = check_variants(cfg, sizes, variants)
    sweep_folders(sizes, variants, seeds or [cfg.seed])  # (two runs of one folder: refused)
    with out_dir_lock(cfg.out_dir):
        return _run_sweep(cfg, sizes, variants, settings, seeds or [cfg.seed], resume)


def _folder(variant: str, g: int, seed: int, seeds: list[int]) -> str:
    return (re.sub(r"[^A-Za-z0-9_.-]+", "_", variant) + f"-G{g}"
            + (f"-seed{seed}" if len(seeds) > 1 else ""))


def sweep_folders(sizes: list[int], variants: list[str], seeds: list[int]) -> list[str]:
    """The run folders of a sweep, in the order it runs them; two runs that would share one
    (a variant, size or seed given twice; names alike but for punctuation) are refused before
    the first starts, not found at the second."""
    seen: dict[str, tuple] = {}
    for variant in variants:
        for g in sizes:
            for seed in seeds:
                name = _folder(variant, g, seed, seeds)
                if name in seen:
                    raise ConfigError(f"sweep: {seen[name]} and {(variant, g, seed)} (variant, "
                                      f"G, seed) would both write {name}/; give each once")
                seen[name] = (variant, g, seed)
    return list(seen)


def check_variants(cfg: Config, sizes: list[int], variants: list[str]) -> dict[str, dict]:
    """Each variant's settings, every configuration checked before the first run starts; a
    preset that replaces a value the command was given, or a setting a variant's run does not
    read, is warned of."""
    settings = {}
    default, base = resolve(Config()), resolve(cfg)
    for variant in variants:
        try:
            settings[variant] = variant_settings(variant)
            for g in sizes:
                resolve(dataclasses.replace(cfg, group_size=g, **settings[variant]))
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"sweep: {e} (variant {variant})") from None
        ran = resolve(dataclasses.replace(cfg, **settings[variant]))
        for f in dataclasses.fields(Config):  # a preset over the command's own value
            given, now = getattr(base, f.name), getattr(ran, f.name)
            if given != getattr(default, f.name) and now != given:
                log.warning("variant %s sets %s %s over the given %s", variant, f.name, now,
                            given)
        warn_idle(ran, f"variant {variant}: ")
    return settings


def _run_sweep(cfg: Config, sizes: list[int], variants: list[str], settings: dict,
               seeds: list[int], resume: bool) -> str:
    root = Path(cfg.out_dir)
    results: list[tuple[str, int, dict]] = []
    table = []
    for variant in variants:
        for g in sizes:
            runs = []
            for seed in seeds:
                c = resolve(dataclasses.replace(cfg, group_size=g, seed=seed,
                                        **settings[variant]))
                run = root / _folder(variant, g, seed, seeds)
                runs.append(run_workshop(c, run, resume=resume and holds_run(run)))
            s = mean_summary(runs)
            results.append((variant, g, s))
            table.append(sweep_row(variant, c, s))
    text = format_table(SWEEP_HEADER, table)
    root.mkdir(parents=True, exist_ok=True)
    (root / "sweep.md").write_text(text + "\n")
    over = f", mean of seeds {seeds}" if len(seeds) > 1 else f", seed {seeds[0]}"
    plot_sweep(results, root / "sweep.png",
               f"GRPO workshop sweep ({cfg.steps} steps, {cfg.budget} answers per step{over})")
    return text


def world_trainer(cfg: Config, out_dir: str | Path | None = None) -> GRPOTrainer:
    """A trainer on the built-in world, starting from the cached fine-tuned model."""
    # One thread: the world's model is so small that a second thread buys little, and on a
    # shared or busy machine its spin-waits cost several times the CPU (measured: the first run
    # took over 200 s of CPU with 2 threads on a loaded 2-core host, 44 s with one). The README's
    # tables are measured this way and are bit-for-bit repeatable with it.
    torch.set_num_threads(1)
    splits = make_splits(cfg.seed, cfg.world_train_size, cfg.world_heldout_size,
                         cfg.world_top_share, cfg.world_carry_share)
    model = sft_model(cfg.seed, splits, cfg.sft_steps, cfg.cache_dir or None,
                      progress=cfg.progress, slip=cfg.sft_slip, slip_top=cfg.sft_slip_top)
    backend = TinyBackend(model, lora=cfg.lora, lora_r=cfg.lora_r,
                          lora_alpha=cfg.world_lora_alpha, seed=cfg.seed, filters=Filters.of(cfg))
    return GRPOTrainer(cfg, backend, splits.train, [exact_answer], splits.heldout,
                       out_dir=out_dir)


def run_workshop(cfg: Config, out_dir: str | Path | None = None, resume: bool = False) -> dict:
    """One workshop run: metrics.jsonl, workshop.png and summary.json in the run folder."""
    with out_dir_lock(out_dir or cfg.out_dir):  # (before the SFT: a busy folder fails fast)
        return _run_workshop(cfg, out_dir, resume)


def _run_workshop(cfg: Config, out_dir: str | Path | None, resume: bool) -> dict:
    trainer = world_trainer(cfg, out_dir)
    title = (f"GRPO workshop: G={cfg.group_size}, {cfg.prompts_per_step} prompts x "
             f"{cfg.group_size} answers per step")
    if cfg.allocate:  # group sizes chosen per prompt
        title = (f"GRPO workshop: allocate, {cfg.budget} answers per step in groups of "
                 f"{cfg.allocate_min_group}-{cfg.allocate_max_group}")
    # report_to, and the plot redrawn with a status line at each evaluation
    trainer.reporter = Reporter(trainer.out_dir / "workshop.png", title)
    trainer.train(resume=resume)
    with trainer.stop.finishing(trainer.out_dir):
        return finish_run(trainer.out_dir, "workshop.png", title, group_size=cfg.group_size,
                          prompts_per_step=cfg.prompts_per_step)
