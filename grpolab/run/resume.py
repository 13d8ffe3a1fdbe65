"""What a resume may change: the settings a checkpoint can continue under, and the one-line
errors for one it cannot (another model shape or optimiser grouping, other prompts)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpolab.config import Config, ConfigError, to_dict
from grpolab.data.files import fingerprint
from grpolab.data.tasks import is_task
from grpolab.run.checkpoint import CheckpointError

# Config keys a resume may change without changing the maths (micro_batch splits a step
# otherwise, for an out-of-memory run: float rounding then differs, as with the speed paths).
RESUME_FREE_KEYS = {"steps", "passes", "pass_batch", "out_dir", "progress", "cache_dir",
                    "checkpoint_every", "eval_every", "save_model_every", "save_each_pass",
                    "eval_each_pass",
                    "save_total_limit", "micro_batch", "log_samples", "overwrite",
                    "reward_timeout", "reward_workers", "fail_on_reward_errors", "report_to",
                    "shard", "speed"}
# Config keys that change the trained weights' shapes: a checkpoint of another value cannot
# load. (A weight decay switched on or off changes the optimiser's parameter groups: refused
# before loading, ``changed_settings``.)
SHAPE_KEYS = ("lora", "lora_r", "lora_target_modules", "model_path", "use_dora")
# Config keys that choose the prompts: the sampler's and posteriors' state is per prompt, so a
# checkpoint of other data is refused (ConfigError, exit 2), not loaded into the wrong rows.
DATA_KEYS = ("dataset", "eval_dataset", "dataset_size", "prompt_column", "answer_column",
             "prompt_template", "system_prompt", "task_config", "world_train_size",
             "world_heldout_size", "world_top_share", "world_carry_share")


# Config keys that shape the pass-rate posteriors' state: a prior per kind (the prior's form
# alone loads either way: the counts are the same).
POSTERIOR_KEYS = ("predict_prior", "predict_group_by")


def changed_settings(st: dict[str, Any], cfg: Config, rows: list[dict[str, Any]],
                     path: Path | None, digest: Callable[[], str] | None = None,
                     ) -> dict[str, tuple[Any, Any]]:
    """The settings this run changes from the checkpoint ``st``'s: {key: (saved, now)}, those
    a resume may change freely left out; a checkpoint of other prompts (``rows``: this run's
    training rows; ``digest``: their fingerprint, where kept) or with weight decay switched
    refused before anything is loaded."""
    saved, now = st.get("config") or {}, to_dict(cfg)
    # (passes only set the steps; the steps move the schedule, a warm-up share's length too)
    fixed = cfg.lr_schedule != "constant" or 0 < cfg.warmup_steps < 1
    free = RESUME_FREE_KEYS - ({"steps"} if fixed else set())
    changed = {k: (saved[k], now[k]) for k in sorted(now)
               if k in saved and k not in free and saved[k] != now[k]}
    where = f"checkpoint {path or 'given'}"
    data = [k for k in DATA_KEYS if k in changed]
    if data:
        k = data[0]
        raise ConfigError(f"{where} was written for {k}={saved[k]!r} (this run: {now[k]!r}); "
                          f"resume with the run's {', '.join(data)}, or start a new run")
    by_kind = saved.get("predict_group_by") or now.get("predict_group_by")
    shaped = [k for k in POSTERIOR_KEYS if k in changed and (by_kind or k != "predict_prior")]
    if shaped:
        k = shaped[0]
        raise ConfigError(f"{where} was written with {k}={saved[k]!r} (this run: {now[k]!r}): "
                          "the pass-rate posteriors it keeps are of that form; resume with the "
                          f"run's {', '.join(shaped)}, or start a new run")
    gone = [r.rpartition(".")[2] for r in changed.get("rewards", ([], []))[0]
            if r.startswith("grpolab.app.api:") and r not in now["rewards"]]
    if gone:  # (a Python callable the API was given: not one to swap for a default)
        raise ConfigError(f"{where} was written with the Python reward(s) {', '.join(gone)} "
                          "given to grpolab.train: resume from Python with them given again")
    decay = changed.get("weight_decay")
    if decay and bool(decay[0]) != bool(decay[1]):
        raise ConfigError(f"{where} was written with weight_decay={decay[0]!r} (this run: "
                          f"{decay[1]!r}): decay on or off changes the optimiser's parameter "
                          "groups; resume with the run's weight_decay, or start a new run")
    # (a generated task's rows, the workshop's world's too, are drawn from the seed)
    generated = not cfg.dataset or is_task(cfg.dataset)  # (the workshop's world: no dataset)
    seed = (f"seed={saved['seed']!r} (this run: {now['seed']!r}), which draws a generated "
            "task's rows; resume with the run's seed" if "seed" in changed and generated else "")
    saved_rows = len(st.get("sampler", {}).get("pass_rate", ()))
    if saved_rows and saved_rows != len(rows):
        raise ConfigError(f"{where} was written for a dataset of {saved_rows} prompts, this "
                          f"run's has {len(rows)}" + (f": it was written with {seed}" if seed
                                                     else " (the dataset file changed?); resume "
                                                     "with the run's data") +
                          ", or start a new run")
    kept = st.get("rows_sha256")  # (older files: none kept)
    if kept is not None and kept != (digest() if digest else fingerprint(rows)):
        raise ConfigError(f"{where} was written for other training rows than this run's, as "
                          "many" + (f": it was written with {seed}" if seed else " (the dataset "
                          "file changed: rows edited or reordered?); resume with the run's data") +
                          ", or start a new run")
    return changed


def load_error(e: Exception, changed: dict[str, tuple[Any, Any]],
               path: Path | None) -> Exception:
    """The one-line error for weights or optimiser state that would not load: a ConfigError
    naming the setting where one of ``SHAPE_KEYS`` changed (exit 2), else a CheckpointError."""
    shape = [f"{k}={changed[k][0]!r} (this run: {changed[k][1]!r})" for k in SHAPE_KEYS
             if k in changed]
    why = f"it was written with {', '.join(shape)}" if shape else " ".join(str(e).split())[:160]
    error = ConfigError if shape else CheckpointError
    return error(f"checkpoint {path or 'given'} does not fit this model: {why}; resume with the "
                 "run's settings, or start a new run")


def check_state(st: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """The run's state besides the weights (step, random streams, sampler, posteriors, the
    watch's), each of the form a checkpoint keeps: a file of another form (one without a
    content hash, as older grpolab wrote them, that was damaged or made by hand) is a
    CheckpointError naming what, not a traceback from the first part that would not load."""
    T = torch.Tensor
    sampler, rates = st.get("sampler"), st.get("pass_rates", {})
    n = sampler.get("pass_rate") if isinstance(sampler, dict) else None
    shape = n.shape if isinstance(n, T) and n.dim() == 1 else None
    ranks = st.get("rank_rng")  # (older files: none; never a truth test: a tensor has none)
    rngs = [st, *(ranks if isinstance(ranks, list) else [] if _unset(ranks) else [None])]
    bad = [what for what, ok in (
        ("its config", isinstance(st.get("config", {}), dict)),
        ("its step", type(st.get("step")) is int and st["step"] >= 0),
        ("its random state", all(isinstance(r, dict) and all(
            isinstance(r.get(k), T) and r[k].dtype == torch.uint8 for k in ("gen", "torch_rng"))
            for r in rngs) and isinstance(st.get("sampler_gen"), T)),
        ("its prompt sampler", shape is not None and isinstance(sampler.get("visits"), T)
         and sampler["visits"].shape == shape),
        ("its pass-rate posteriors", isinstance(rates, dict) and (not rates or (
            all(isinstance(rates.get(k), T) and rates[k].shape == shape
                for k in ("successes", "failures")) and isinstance(rates.get("squares", n), T)
            and rates.get("squares", n).shape == shape
            and isinstance(rates.get("prior"), (list, tuple)) and len(rates["prior"]) == 2
            and all(type(x) in (int, float) for x in rates["prior"])))),
        ("whether it said the unscored answers", type(st.get("told_unscored", False)) is bool),
        ("its watch's state", all(isinstance(st.get(k), dict) or _unset(st.get(k))
                                  for k in ("watch", "alarm", "entropy_control"))),
    ) if not ok]
    if bad:
        raise CheckpointError(f"checkpoint {path or 'given'} is damaged ({', '.join(bad)} not "
                              "as grpolab keeps it); resume from another checkpoint, or start "
                              "a new run")
    return st


def _unset(value: Any) -> bool:
    """Whether a checkpoint's part reads as absent where the trainer loads ``value or {}``
    (None, an empty container, 0, false), without asking a tensor its truth."""
    return value is None or (isinstance(value, (list, tuple, dict, str, int, float))
                             and not value)
