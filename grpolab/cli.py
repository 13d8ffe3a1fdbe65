"""Command line: ``grpolab workshop`` (the built-in experiment), ``grpolab train`` and
``grpolab eval`` (real models); what they do is ``grpolab.commands``.

Each command offers the config fields that apply to it as flags (``--group-size 8``,
``--dynamic-sampling``), each with one line of help from the field's comment in config.py;
``--config run.yaml`` loads a file of any config keys first. User mistakes end with one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from pathlib import Path
from typing import Any, NoReturn

from . import dist
from .config import Config, ConfigError, literal_fields, make_config

# Fields that only a real model uses, and only the world: each command offers the rest.
MODEL_ONLY = frozenset({
    "model_path", "dtype", "gradient_checkpointing", "max_prompt_tokens", "dataset",
    "eval_dataset", "dataset_size", "task_config", "prompt_column", "answer_column",
    "prompt_template", "rewards", "answer_sources", "watch_reward", "watch_margin",
    "watch_window", "format_pattern", "lora_dropout", "lora_target_modules",
    "use_chat_template", "rollout_backend"})
WORLD_ONLY = frozenset({"world_train_size", "world_heldout_size", "sft_steps", "sft_slip",
                        "sft_slip_top", "world_top_share", "world_carry_share",
                        "world_lora_alpha"})
# What grpolab eval reads: the model, the data, the rewards, how to sample and how many.
EVAL_FIELDS = frozenset({
    "out_dir", "seed", "budget", "temperature", "max_new_tokens", "eval_size", "eval_samples",
    "success_threshold", "progress", "cache_dir", "model_path", "dtype", "max_prompt_tokens",
    "dataset", "eval_dataset", "dataset_size", "task_config", "prompt_column",
    "answer_column", "prompt_template", "rewards", "answer_sources", "reward_weights",
    "format_pattern", "reward_on_error", "use_chat_template", "reward_timeout",
    "reward_workers", "fail_on_reward_errors"})


def command_fields(command: str) -> list[str]:
    """The config fields ``command`` offers as flags, in the config's order."""
    every = list(Config.__dataclass_fields__)
    if command == "eval":
        return [f for f in every if f in EVAL_FIELDS]
    skip = (MODEL_ONLY if command == "workshop" else WORLD_ONLY) | {"eval_samples"}
    return [f for f in every if f not in skip]


class _Parser(argparse.ArgumentParser):
    """argparse errors on one line too: the usage of ~60 flags would bury the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def field_help() -> dict[str, str]:
    """Each config field's help: its trailing comment in config.py (with the comment-only
    lines that continue it, ``#`` then aligned text), so the help lives next to the field."""
    import ast
    import inspect
    import io
    import tokenize

    from . import config as config_module

    src = inspect.getsource(config_module)
    comments = {tok.start[0]: tok.string for tok in
                tokenize.generate_tokens(io.StringIO(src).readline)
                if tok.type == tokenize.COMMENT}
    lines = src.splitlines()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "Config")
    out: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        end = node.end_lineno or node.lineno
        parts = [comments[i] for i in range(node.lineno, end + 1) if i in comments]
        i = end + 1  # continuation lines: "#" followed by the text aligned under the first
        while i in comments and lines[i - 1].lstrip().startswith("#  "):
            parts.append(comments[i])
            i += 1
        text = " ".join(" ".join(c.lstrip("#").split()) for c in parts)
        out[node.target.id] = text.split("# type:")[0].strip()
    return out


def _add_config_flags(p: argparse.ArgumentParser, command: str) -> None:
    hints = typing.get_type_hints(Config)
    choices = literal_fields()
    helps = field_help()
    defaults = Config()
    for name in command_fields(command):
        flag = "--" + name.replace("_", "-")
        tp = hints[name]
        value = getattr(defaults, name)
        shown = ",".join(map(str, value)) if isinstance(value, list) else value
        text = helps.get(name) or name.replace("_", " ")
        text = f"{text} (default: {shown!r})" if shown != "" else f'{text} (default: "")'
        text = text.replace("%", "%%")
        if tp is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                           help=text)
        elif name in choices:
            p.add_argument(flag, dest=name, choices=choices[name], default=None, help=text)
        else:
            p.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=text)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in Config.__dataclass_fields__ if hasattr(args, k)}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="grpolab", description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("workshop", help="GRPO on the built-in world at a fixed answer budget")
    w.add_argument("--config", help="YAML file of config keys")
    w.add_argument("--sweep", help="comma-separated group sizes, e.g. 2,4,8,16,32")
    w.add_argument("--seeds", help="comma-separated seeds for a sweep (mean ± sd over them)")
    from .workshop import variants_help

    w.add_argument("--variants", default=None, help=variants_help())
    w.add_argument("--resume", action="store_true", help="continue from out_dir's checkpoint")
    _add_config_flags(w, "workshop")
    t = sub.add_parser("train", help="GRPO on a Hugging Face model and a local dataset")
    t.add_argument("--config", help="YAML file of config keys")
    t.add_argument("--resume", action="store_true", help="continue from out_dir's checkpoint")
    _add_config_flags(t, "train")
    e = sub.add_parser("eval", help="greedy accuracy and pass@k of a Hugging Face model")
    e.add_argument("--config", help="YAML file of config keys")
    e.add_argument("--compare", metavar="EVAL_JSON",
                   help="an earlier eval.json of the same prompts: print the gain per measure "
                        "with its paired standard error")
    _add_config_flags(e, "eval")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="grpolab: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        cfg = make_config(args.config, _overrides(args))
        dist.init()  # joins torchrun's process group; nothing in a single process
        cfg = _choose_out_dir(cfg, args)
        from . import commands

        if args.command == "workshop":
            return commands.workshop(cfg, args.sweep, args.variants, args.seeds, args.resume)
        if args.command == "eval":
            return commands.evaluate(cfg, args.compare)
        return commands.train(cfg, args.resume)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        return _fail(e, 2)
    except KeyboardInterrupt:
        print("grpolab: interrupted; the last checkpoint and metrics are kept", file=sys.stderr)
        return 130
    except OSError as e:  # a full disk, a folder made read-only mid-run: one line, exit 1
        where = f" ({e.filename})" if e.filename else ""
        return _fail(f"{e.strerror or e}{where}; files written before it are intact", 1)
    except Exception as e:
        from .checkpoint import CheckpointError
        from .trainer import TrainingError

        if isinstance(e, (TrainingError, CheckpointError)):
            return _fail(e, 1)
        raise
    except BaseException as e:
        from .stopping import RunStopped

        if not isinstance(e, RunStopped):
            raise
        # SIGTERM/SIGUSR1 (preemption): checkpoint written; 128 + signal, as a shell reports
        if dist.is_main():
            print(f"grpolab: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        dist.cleanup()


def _in_use(d: Path) -> bool:
    """Whether a folder holds a run, or a sweep's runs one level down."""
    from .checkpoint import holds_run

    if not d.is_dir():
        return False
    if holds_run(d) or (d / "sweep.md").exists():
        return True
    return any(holds_run(c) for c in d.iterdir() if c.is_dir())


def _choose_out_dir(cfg: Config, args: argparse.Namespace) -> Config:
    """out_dir checked before anything runs: a file or an unwritable place is a one-line
    error, and two runs never share a folder. A folder holding a run is refused unless
    --resume or --overwrite, except the default out_dir: there the new run gets the next free
    ``runs/workshop-N`` (so the README's first command works when run twice)."""
    import dataclasses
    import os

    out = Path(cfg.out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir {cfg.out_dir} is a file, not a folder")
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"out_dir {cfg.out_dir} is not writable ({probe} is read-only)")
    if args.command == "eval" or getattr(args, "resume", False) or cfg.overwrite:
        return cfg
    if _in_use(out):
        if cfg.out_dir != Config.out_dir:
            raise ConfigError(f"out_dir {cfg.out_dir} already holds a run; continue it with "
                              "--resume, replace it with --overwrite, or choose another "
                              "--out-dir")
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


def _fail(e: BaseException, code: int) -> int:
    """One line on stderr (tagged with the rank under torchrun), then the exit code."""
    where = f" (rank {dist.rank()})" if dist.is_dist() else ""
    msg = " ".join(str(e).split("\n")).strip() or type(e).__name__
    print(f"grpolab: error{where}: {msg}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
