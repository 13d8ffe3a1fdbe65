"""The commands ``grpolab workshop`` and ``grpolab train``, and what ``grpolab eval`` shares.

Each builds a backend and a scorer (``rewards.scorer.make_scorer``, the one factory), runs,
and ends with the same finishing step (``finish_run``: the plot and ``summary.json``); held-out
accuracy is ``run.heldout.score_answers`` for all of them. ``cli.py`` parses the flags and
calls ``workshop`` or ``train`` (``grpolab eval``: ``grpolab.app.evaluate``); the API:
``run_workshop``/``run_train``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch

from grpolab.config import Config, ConfigError
from grpolab.config.load import warn_idle
from grpolab.config.schema import command_defaults
from grpolab.config.validate import length_line, with_length
from grpolab.rewards.builtin import CODE_REWARDS
from grpolab.rewards.scorer import load_rewards
from grpolab.rewards.trl_compat import check_columns
from grpolab.rollout.sampling import Filters
from grpolab.rollout.templates import check_render
from grpolab.run import dist, export, shard
from grpolab.run.checkpoint import CheckpointError, busy_error, holds_run, lock_holder, out_dir_lock
from grpolab.run.export import save_model
from grpolab.run.report import finish_run, read_metrics
from grpolab.run.trackers import Reporter
from grpolab.run.trainer import GRPOTrainer, TrainingError
from grpolab.world.workshop import run_sweep, run_workshop, world_trainer

log = logging.getLogger("grpolab")


class RunError(RuntimeError):
    """The run could not go on (the CLI's exit 1); files written before it are intact."""


def user_error(e: BaseException) -> ConfigError | RunError | None:
    """What the CLI reports for ``e``, and the Python API raises: ConfigError for a mistake in
    the settings, data, a model folder or a reward (exit 2), RunError for a run that could not
    go on (exit 1); each with a one-line message. None: not the user's (a bug), raised as is."""
    one_line = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, (ConfigError, RunError)) and str(e) == one_line:
        return e
    if isinstance(e, (ConfigError, FileNotFoundError, ValueError)):
        return ConfigError(one_line)
    if isinstance(e, OSError):  # a full disk, a folder made read-only mid-run
        where = f" ({e.filename})" if e.filename else ""
        return RunError(f"{e.strerror or one_line}{where}; files written before it are intact")
    if isinstance(e, (RunError, TrainingError, CheckpointError)):
        return RunError(one_line)
    return None


# ----------------------------------------------------------------------------- workshop


def workshop(cfg: Config, sweep: str | None, variants: str | None, seeds: str | None,
             resume: bool) -> int:
    """``grpolab workshop``: one run, or with --sweep/--variants/--seeds a table of runs."""

    if sweep or variants or seeds:
        if dist.is_dist():
            raise ConfigError("--sweep/--variants run one after another; under torchrun "
                              "launch one configuration at a time")
        sizes = _int_list(sweep, "--sweep") if sweep else [cfg.group_size]
        names = [v.strip() for v in (variants or "grpo").split(",") if v.strip()]
        print(run_sweep(cfg, sizes, names, _int_list(seeds, "--seeds") if seeds else None,
                        resume))
        print(f"\nwrote {cfg.out_dir}/sweep.md and {cfg.out_dir}/sweep.png")
        return 0
    if not dist.is_main():  # the other ranks train alongside rank 0, which writes everything
        with out_dir_lock(cfg.out_dir):  # (collective: where rank 0's run_workshop takes it)
            world_trainer(cfg).train(resume=resume)
        return 0
    warn_idle(cfg)
    s = run_workshop(cfg, resume=resume)
    print(f"G={s['group_size']} ({s['prompts_per_step']} prompts/step): mean dead share "
          f"{s['mean_dead_share']:.3f} (predicted {s['mean_predicted_dead_share']:.3f}), "
          # the status lines' and the sweep table's names: p(T) exact, acc greedy
          f"held-out p(T={cfg.temperature:g}) {s['start_heldout_pass_prob']:.3f} -> "
          f"{s['final_heldout_pass_prob']:.3f} (exact), held-out acc "
          f"{s['start_heldout_acc']:.3f} -> {s['final_heldout_acc']:.3f} (greedy); "
          f"{s['all_right_share_of_dead']:.0%} of dead groups all right")
    print(f"wrote {cfg.out_dir}/metrics.jsonl and {cfg.out_dir}/workshop.png")
    return 0


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers (got {text!r})") from None
    if not vals:
        raise ConfigError(f"{what} is empty")
    return vals


# ----------------------------------------------------------------------------- real models


def need_hf(command: str) -> None:
    """A one-line ConfigError with the install command when the [hf] extra is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"grpolab {command} needs the Hugging Face extras ({e}): "
                          "pip install 'grpolab[hf]'") from None


def check_paths(cfg: Config, command: str = "train") -> Config:
    """One-line errors for a missing model, dataset or reward, before anything loads; the
    config with ``dtype: auto`` read from the model's files (so the run records what ran)."""
    from grpolab.data.hub import is_hub_dataset, snapshot
    from grpolab.data.tasks import is_task
    from grpolab.rollout.models import check_source, checkpoint_dtype

    if not cfg.model_path:
        raise ConfigError(f"grpolab {command} needs model_path (a local model folder, a Hub id "
                          "in the local cache, a .gguf file or smollm2-135m-instruct)")
    check_source(cfg.model_path)
    if not (cfg.dataset or (command == "eval" and cfg.eval_dataset)):
        raise ConfigError(f"grpolab {command} needs dataset (a local .jsonl/.parquet/.csv file, "
                          "a Hub dataset in the local cache or reasoning_gym:<task>)")
    for name in ("dataset", "eval_dataset"):
        value = getattr(cfg, name)
        if value and is_hub_dataset(value):
            snapshot(value)  # (in the Hugging Face cache, or one line)
        elif value and not is_task(value) and not Path(value).expanduser().exists():
            raise FileNotFoundError(f"{name} {value!r} does not exist")
    if not cfg.rewards:
        raise ConfigError("rewards is empty; name at least one reward (e.g. math, format)")
    auto = cfg.dtype == "auto"
    return dataclasses.replace(cfg, dtype=checkpoint_dtype(cfg.model_path)) if auto else cfg


def make_backend(cfg: Config, model: Any, tokenizer: Any) -> Any:
    """The HF backend (or the vLLM one) the config describes, around a loaded model."""
    from grpolab.rollout.hf import HFBackend

    kwargs: dict[str, Any] = {
        "lora": cfg.lora, "lora_r": cfg.lora_r, "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "lora_target_modules": list(cfg.lora_target_modules) or None,
        "lora_options": {"use_rslora": cfg.use_rslora, "use_dora": cfg.use_dora},
        "use_chat_template": cfg.use_chat_template, "reference": cfg.beta > 0, "seed": cfg.seed,
        "chat_template_kwargs": cfg.chat_template_kwargs,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "max_prompt_tokens": cfg.max_prompt_tokens, "max_new_tokens": cfg.max_new_tokens,
        "logit_chunk": cfg.logit_chunk, "speed": cfg.speed, "filters": Filters.of(cfg),
    }
    if cfg.rollout_backend == "vllm":
        from grpolab.rollout.models import resolve_model  # (vLLM reads the folder itself)
        from grpolab.rollout.vllm import VLLMBackend

        return VLLMBackend(model, tokenizer, resolve_model(cfg.model_path, cfg.cache_dir),
                           **kwargs)
    return HFBackend(model, tokenizer, **kwargs)


def load(cfg: Config) -> tuple[Any, Any]:
    from grpolab.rollout.models import load_model

    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {cfg.device}: this machine has no CUDA device torch can use")
    device = None if cfg.device == "auto" else cfg.device
    model, tokenizer = load_model(str(Path(cfg.model_path).expanduser()), dtype=cfg.dtype,
                                  cache_dir=cfg.cache_dir, device=device)
    tokenizer.chat_template = cfg.chat_template or tokenizer.chat_template  # (saved with it)
    return model, tokenizer


def run_train(cfg: Config, resume: bool = False) -> GRPOTrainer:
    """``grpolab train``: GRPO on a local HF model and dataset; returns the ``GRPOTrainer``.

    Writes ``metrics.jsonl``, ``checkpoints/last.pt``, ``train.png``, ``summary.json`` and the
    final model (LoRA merged) plus tokenizer in ``<out_dir>/final`` (with ``save_model_every``,
    also ``checkpoint-<step>/`` on the way: ``grpolab.run.export``).
    """
    need_hf("train")
    cfg = check_paths(cfg)
    if cfg.rollout_backend == "vllm":
        from grpolab.rollout.vllm import check_vllm

        check_vllm()
    with out_dir_lock(cfg.out_dir):  # held to the last file written (final/, summary)
        return _run_train(cfg, resume)


def check_code_tests(cfg: Config, *datasets: tuple[list[dict], str]) -> None:
    """The code rewards on data whose tests cannot be judged: refused (they would train on 0),
    or, where some cannot, warned of, per file (by rank 0)."""
    if set(CODE_REWARDS) & {*cfg.rewards, cfg.watch_reward}:
        from grpolab.rewards.sandbox import check_tests

        for rows, where in datasets:
            check_tests(rows, repr(where), warn=dist.is_main())


def _run_train(cfg: Config, resume: bool) -> GRPOTrainer:
    from grpolab.data.files import run_rows

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not cfg.progress:  # --no-progress also quiets the weight loading/saving bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    rows, heldout = run_rows(cfg, warn=dist.is_main())  # (said once, not per rank)
    cfg = with_length(cfg, len(rows))  # passes: steps, now that the prompts are counted
    if cfg.passes > 0 and dist.is_main():
        print(f"grpolab: {length_line(cfg, len(rows))}", flush=True)
    if cfg.watch_reward and not heldout[: cfg.eval_size]:  # it would watch nothing
        raise ConfigError(f"watch_reward {cfg.watch_reward} checks held-out prompts: set "
                          "eval_dataset (and eval_size > 0)")
    check_code_tests(cfg, (rows, cfg.dataset), (heldout, cfg.eval_dataset))
    reward_fns, watch = load_rewards(cfg)
    check_columns(reward_fns, rows)
    model, tok = load(cfg)
    if cfg.dtype != "float32" and not cfg.lora and dist.is_main():
        log.warning("full fine-tuning in %s: weights and Adam states stay in it, and updates "
                    "below its resolution are lost; LoRA adapters train in float32", cfg.dtype)
    backend = make_backend(cfg, model, tok)
    # chat prompts without a chat template, or a template that fails or loops, stop here
    check_render(backend.render, rows[0]["prompt"])
    trainer = GRPOTrainer(cfg, backend, rows, reward_fns, heldout, out_dir=cfg.out_dir,
                          watch_fn=watch)
    title = (f"GRPO on {Path(cfg.model_path).name}: G={cfg.group_size}, {cfg.prompts_per_step} "
             f"prompts per step{' (LoRA)' if cfg.lora else ''}")
    # report_to, and the plot redrawn with a status line at each evaluation
    trainer.reporter = Reporter(trainer.out_dir / "train.png", title, lengths=True)
    trainer.train(resume=resume)
    with trainer.stop.finishing(trainer.out_dir):  # a preemption waits for the final model
        _finish_train(cfg, trainer, title, heldout)
    return trainer


def _finish_train(cfg: Config, trainer: GRPOTrainer, title: str, heldout: list) -> None:
    """The final model (LoRA merged), plot, summary and model card; the closing lines."""
    backend = trainer.backend
    # sharded weights are gathered to rank 0 (collective) for the final model
    full = shard.full_state_dict(backend.model) if trainer.sharded else None
    if not dist.is_main():  # under torchrun rank 0 alone writes the model, plot and summary
        return
    out = trainer.out_dir
    summary = finish_run(out, "train.png", title, lengths=True, model_path=cfg.model_path,
                         lora=cfg.lora, calibration_title="Dead-group prediction: "
                         f"{Path(cfg.model_path).name}")
    from grpolab.run.model_card import write_model_card

    save_model(backend, out / "final", full, lambda final: write_model_card(  # (whole or absent)
        final, cfg, summary, read_metrics(out / "metrics.jsonl"), len(heldout[: cfg.eval_size])))
    acc = (f", held-out acc {summary['start_heldout_acc']:.3f} -> "
           f"{summary['final_heldout_acc']:.3f} (greedy)" if heldout and cfg.eval_size
           else " (no eval_dataset)" if not heldout else " (no evaluation: eval_size 0)")
    if "start_heldout_check_acc" in summary:
        acc += (f"; strict check ({cfg.watch_reward}) {summary['start_heldout_check_acc']:.3f} -> "
                f"{summary['final_heldout_check_acc']:.3f}")
        if summary["hacking_suspected_steps"]:
            acc += f"; REWARD HACKING SUSPECTED at steps {summary['hacking_suspected_steps']}"
    if "posterior_dead_brier" in summary and cfg.group_size > 1:
        print(f"dead groups: predicted {summary['mean_posterior_dead_share']:.3f}, measured "
              f"{summary['posterior_measured_dead_share']:.3f} (over the same "
              f"{summary['posterior_dead_groups']} groups); Brier "
              f"{summary['posterior_dead_brier']:.3f} "
              f"(base rate {summary['posterior_dead_brier_base_rate']:.3f}), "
              f"see {out}/calibration.png")
    n = summary["steps"]
    print(f"trained {n} step{'s' * (n != 1)}: mean reward {summary['mean_reward']:.3f}{acc}\n"
          f"wrote {out}/metrics.jsonl, {out}/train.png and the model in {out}/final")


def train(cfg: Config, resume: bool) -> int:
    """``grpolab train``."""
    run_train(cfg, resume=resume)
    return 0


# ----------------------------------------------------------------------------- out_dir


def _in_use(d: Path) -> bool:
    """Whether a folder holds a run (or a live run's lock), or a sweep's runs one level down."""
    if not d.is_dir():
        return False
    if holds_run(d) or (d / "sweep.md").exists() or lock_holder(d) is not None:
        return True
    return any(holds_run(c) for c in d.iterdir() if c.is_dir())


def choose_out_dir(cfg: Config, command: str, resume: bool = False) -> Config:
    """out_dir checked before anything runs: a file or an unwritable place is a one-line
    error, and two runs never share a folder. A folder holding a run is refused unless
    --resume or --overwrite, except the default out_dir: there the new run gets the next free
    ``runs/workshop-N`` (so the README's first command works when run twice)."""
    out = Path(cfg.out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir {cfg.out_dir} is a file, not a folder")
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"out_dir {cfg.out_dir} cannot be made: {probe} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"out_dir {cfg.out_dir} is not writable ({probe} is read-only)")
    if command == "eval":
        return cfg
    # Rank 0 looks and every rank takes its answer: a rank that looked later could see rank 0's
    # own lock (taken as soon as it runs on) and refuse the run.
    default = cfg.out_dir == command_defaults(command).get("out_dir", Config.out_dir)
    busy, in_use = (lock_holder(out), _in_use(out) or default and bool(export.foreign_outputs(
        out))) if dist.is_main() else (None, False)  # (the default moves past a model's files)
    if dist.is_dist():
        busy, in_use = dist.all_gather_object((busy, in_use))[0]
    if busy is not None and (resume or cfg.overwrite or not default):
        raise busy_error(cfg.out_dir, busy)  # (the run's own lock decides; this is early)
    if resume and not out.is_dir():  # (nothing made: the folder named may be a typo)
        raise ConfigError(f"--resume: out_dir {cfg.out_dir} does not exist, so there is no "
                          "run to continue; check --out-dir, or start without --resume")
    if resume or cfg.overwrite:
        return cfg
    if in_use:
        if not default:
            raise ConfigError(f"out_dir {cfg.out_dir} already holds a run; continue it with "
                              "--resume, replace it with --overwrite, or choose another --out-dir")
        n = 2
        while Path(f"{out}-{n}").exists():
            n += 1
        new = f"{cfg.out_dir}-{n}"
        new = dist.all_gather_object(new)[0] if dist.is_dist() else new  # rank 0 decides
        if dist.is_main():
            print(f"grpolab: {cfg.out_dir} holds an earlier run; this one writes to {new} "
                  "(--out-dir chooses the folder, --overwrite replaces the run)", flush=True)
        cfg = dataclasses.replace(cfg, out_dir=new)
    return cfg
