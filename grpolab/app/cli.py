"""Command line: ``grpolab workshop`` (the built-in experiment), ``grpolab train`` and
``grpolab eval`` (real models); what they do is ``grpolab.app.commands``.

Each command offers the config fields that apply to it as flags (``--group-size 8``,
``--dynamic-sampling``), each with the help its field carries (``grpolab.config.schema``);
``--config run.yaml`` loads a file of any config keys first. User mistakes end with one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import typing
from typing import Any, NoReturn

import yaml

from grpolab.app import commands, evaluate
from grpolab.app.commands import choose_out_dir
from grpolab.config import Config, ConfigError, literal_fields, make_config, yamlsafe
from grpolab.config.schema import command_defaults
from grpolab.run import dist


def command_fields(command: str) -> list[str]:
    """The config fields ``command`` offers as flags, in the config's order."""
    return [f.name for f in dataclasses.fields(Config) if command in f.metadata["commands"]]


class _Parser(argparse.ArgumentParser):
    """argparse errors on one line too: the usage of ~60 flags would bury the message."""

    help_for = ""  # the command whose --help to point to, once known

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.help_for or self.prog} --help)\n")


def _add_config_flags(p: argparse.ArgumentParser, command: str) -> None:
    hints = typing.get_type_hints(Config)
    choices = literal_fields()
    meta = {f.name: f.metadata for f in dataclasses.fields(Config)}
    defaults = dataclasses.replace(Config(), **command_defaults(command))
    for name in command_fields(command):
        flag = "--" + name.replace("_", "-")
        tp = hints[name]
        value = getattr(defaults, name)
        if isinstance(value, list):
            shown = ",".join(map(str, value))
        elif dataclasses.is_dataclass(value):
            shown = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(value).items())
        else:
            shown = value
        text = meta[name]["helps"].get(command, meta[name]["help"])
        text = text.replace("`", "")  # (markdown in the source, plain here)
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
    from grpolab import __version__

    parser = _Parser(prog="grpolab", description=(
        "GRPO and its fixes for RL with verifiable rewards: grpolab workshop (the built-in "
        "experiment), grpolab train and grpolab eval (Hugging Face models). grpolab COMMAND "
        "--help lists a command's settings."))
    parser.add_argument("--version", action="version", version=f"grpolab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("workshop", help="GRPO on the built-in world at a fixed answer budget")
    w.add_argument("--config", help="YAML file of config keys")
    w.add_argument("--sweep", help="comma-separated group sizes, e.g. 2,4,8,16,32")
    w.add_argument("--seeds", help="comma-separated seeds for a sweep (mean ± sd over them)")
    from grpolab.world.workshop import variants_help

    w.add_argument("--variants", default=None, help=variants_help())
    w.add_argument("--resume", action="store_true", help="continue from out_dir's checkpoint "
                   "(a sweep: each of its runs that has one; the others start)")
    _add_config_flags(w, "workshop")
    t = sub.add_parser("train", help="GRPO on a Hugging Face model and a local dataset",
                       epilog="TRL's names work as flags (--learning_rate 1e-6), verl's as its "
                              "scripts write them (data.train_batch_size=32 "
                              "actor_rollout_ref.rollout.n=8): docs/real-models.md")
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


def trl_flags(extra: list[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """TRL's names as flags, as its CLI writes them (``--learning_rate 1e-6``, ``--use_peft``,
    ``--max-steps=20``), and verl's overrides as its run scripts write them
    (``data.train_batch_size=32``, ``trainer.logger='["console","wandb"]'``, values read as
    Hydra reads them, YAML): what argparse left over, each a key the config reads (TRL's, an
    earlier one, grpolab's with underscores, or verl's), translated with the file's keys."""
    from grpolab.config.trl import TRL_KEYS, TRL_RENAMED
    from grpolab.config.verl import is_verl

    known = {*TRL_KEYS, *TRL_RENAMED, *Config.__dataclass_fields__}
    out: dict[str, Any] = {}
    i = 0
    while i < len(extra):
        key, eq, value = extra[i].lstrip("+").partition("=")
        if not extra[i].startswith("-") and eq and is_verl(key):
            try:
                out[key] = yamlsafe.safe_load(value) if value.strip() else None
            except yaml.YAMLError:
                parser.error(f"{key}={value}: not a value verl's overrides could hold")
            i += 1
            continue
        name, eq, value = extra[i][2:].partition("=")
        key = name.replace("-", "_")
        if not extra[i].startswith("--") or key not in known:
            parser.error(f"unrecognized arguments: {' '.join(extra[i:])}")
        i += 1
        if not eq:  # the values up to the next flag (a list where several; none: true)
            values = []
            while i < len(extra) and not extra[i].startswith("--"):
                values.append(extra[i])
                i += 1
            value = values[0] if len(values) == 1 else values or "true"
        out[key] = value
    return out


_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _bool_words(argv: list[str]) -> list[str]:
    """``--lora false`` (Hugging Face's CLIs write booleans so) as ``--no-lora``: argparse's
    switches take no value, and a word left after one would be read as the previous flag's."""
    switches = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(Config)
                if typing.get_type_hints(Config)[f.name] is bool}
    out, i = [], 0
    while i < len(argv):
        word = argv[i + 1].lower() if i + 1 < len(argv) else ""
        if argv[i] in switches and word in _WORDS:
            out.append(argv[i] if _WORDS[word] else "--no-" + argv[i][2:])
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="grpolab: %(message)s")
    parser = build_parser()
    args, extra = parser.parse_known_args(_bool_words(sys.argv[1:] if argv is None else argv))
    parser.help_for = f"{parser.prog} {args.command}"
    trl = trl_flags(extra, parser)
    ours = {k: v for k, v in _overrides(args).items() if v is not None}
    twice = sorted(set(ours) & set(trl))
    if twice:
        parser.error(f"{', '.join(twice)} given twice (as --{twice[0].replace('_', '-')} and "
                     f"--{twice[0]}); keep one")
    out_dir, before = None, {}
    try:
        from grpolab.run.stopping import stop_before_start

        before = stop_before_start(args.command)
        cfg = make_config(args.config, {**ours, **trl}, args.command, strict=True)
        given_out = args.out_dir is not None or {"out_dir", "output_dir",
                                                 "trainer.default_local_dir"} & trl.keys()
        if args.command == "eval" and not given_out:  # a config file's is its training's
            cfg = dataclasses.replace(cfg, out_dir=command_defaults("eval")["out_dir"])
        if args.command == "eval" and args.config:
            _say_trained_model(args.config, {**ours, **trl}, cfg)
        if args.command == "eval" and not cfg.eval_dataset and cfg.dataset:
            _say_which_prompts(cfg)
        dist.init()  # joins torchrun's process group; nothing in a single process
        if getattr(args, "resume", False) and cfg.overwrite:
            raise ConfigError("--resume continues out_dir's run, --overwrite replaces it: keep one")
        if args.command == "train":  # (the API's reading of TRL's and verl's resume keys)
            from grpolab.app.api import resume_asked_by

            args.resume = args.resume or resume_asked_by(args.config, trl, cfg)
        cfg = choose_out_dir(cfg, args.command, getattr(args, "resume", False))
        out_dir = cfg.out_dir
        if args.command == "workshop":
            return commands.workshop(cfg, args.sweep, args.variants, args.seeds, args.resume)
        if args.command == "eval":
            return evaluate.evaluate(cfg, args.compare)
        return commands.train(cfg, args.resume)
    except KeyboardInterrupt:
        print(f"grpolab: interrupted; {_kept(out_dir, args.command)}", file=sys.stderr)
        return 130
    except Exception as e:  # the user's mistakes exit 2, a run that could not go on 1
        err = commands.user_error(e)
        if err is None:
            raise
        return _fail(err, 2 if isinstance(err, ConfigError) else 1)
    except BaseException as e:
        from grpolab.run.stopping import RunStopped

        if not isinstance(e, RunStopped):
            raise
        # SIGTERM/SIGUSR1 (preemption): checkpoint written; 128 + signal, as a shell reports
        if dist.is_main():
            print(f"grpolab: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        dist.cleanup()
        for s, h in before.items():
            signal.signal(s, h)


def _say_trained_model(config: str, given: dict[str, Any], cfg: Config) -> None:
    """``grpolab eval --config <run>/config.json`` evaluates the model the run started from,
    as the file says; one line names the trained one beside it."""
    from pathlib import Path

    final = Path(config).expanduser().parent / "final"
    named = {"model_path", "model_name_or_path", "actor_rollout_ref.model.path"} & given.keys()
    if not named and (final / "config.json").is_file() and Path(cfg.model_path) != final:
        logging.getLogger("grpolab").warning(
            "evaluating %s, the model the run started from; its trained model is %s "
            "(--model-path)", cfg.model_path, final)


def _say_which_prompts(cfg: Config) -> None:
    """``grpolab eval`` with no eval_dataset measures the dataset's rows (a Hub dataset's test
    split aside): said in one line, as they may be the training's."""
    from grpolab.data.hub import is_hub_dataset

    if not is_hub_dataset(cfg.dataset):
        logging.getLogger("grpolab").warning(
            "no eval_dataset: grpolab eval measures dataset's prompts (%s), the training "
            "prompts if it is the training's (verl: data.val_files)", cfg.dataset)


def _kept(out_dir: str | None, command: str) -> str:
    """What an interrupted run leaves, truthfully: SIGINT stops at once, without a checkpoint,
    so --resume is offered only where an earlier one exists."""
    from grpolab.run.checkpoint import has_checkpoint, holds_run

    if out_dir is None or command == "eval" or not holds_run(out_dir):
        return "nothing was written"
    if has_checkpoint(out_dir):
        return (f"the last checkpoint and metrics in {out_dir} are kept; continue with "
                "--resume")
    return (f"no checkpoint was written yet, so nothing can be resumed (metrics so far are in "
            f"{out_dir}); start again with --overwrite or another --out-dir (SIGTERM, unlike "
            "Ctrl-C, checkpoints before stopping)")


def _fail(e: BaseException, code: int) -> int:
    """One line on stderr (tagged with the rank under torchrun), then the exit code."""
    where = f" (rank {dist.rank()})" if dist.is_dist() else ""
    msg = " ".join(str(e).split("\n")).strip() or type(e).__name__
    print(f"grpolab: error{where}: {msg}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
