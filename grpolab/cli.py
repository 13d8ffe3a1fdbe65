"""Command line: ``grpolab workshop`` (the built-in experiment), ``grpolab train`` and
``grpolab eval`` (real models).

Every config field is a flag (``--group-size 8``, ``--dynamic-sampling``); ``--config run.yaml``
loads a file first. User mistakes end with one line on stderr and exit code 2.
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


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(Config)
    choices = literal_fields()
    helps = field_help()
    defaults = Config()
    for name in Config.__dataclass_fields__:
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


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers (got {text!r})") from None
    if not vals:
        raise ConfigError(f"{what} is empty")
    return vals


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
    _add_config_flags(w)
    t = sub.add_parser("train", help="GRPO on a Hugging Face model and a local dataset")
    t.add_argument("--config", help="YAML file of config keys")
    t.add_argument("--resume", action="store_true", help="continue from out_dir's checkpoint")
    _add_config_flags(t)
    e = sub.add_parser("eval", help="greedy accuracy and pass@k of a Hugging Face model")
    e.add_argument("--config", help="YAML file of config keys")
    e.add_argument("--compare", metavar="EVAL_JSON",
                   help="an earlier eval.json of the same prompts: print the gain per measure "
                        "with its paired standard error")
    _add_config_flags(e)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="grpolab: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        cfg = make_config(args.config, _overrides(args))
        dist.init()  # joins torchrun's process group; nothing in a single process
        cfg = _choose_out_dir(cfg, args)
        if args.command == "workshop":
            return _workshop(cfg, args)
        if args.command == "eval":
            return _eval(cfg, args.compare)
        return _train(cfg, args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        return _fail(e, 2)
    except KeyboardInterrupt:
        print("grpolab: interrupted; the last checkpoint and metrics are kept", file=sys.stderr)
        return 130
    except OSError as e:  # a full disk, a folder made read-only mid-run: one line, exit 1
        where = f" ({e.filename})" if e.filename else ""
        return _fail(f"{e.strerror or e}{where}; files written before it are intact", 1)
    except Exception as e:
        from .trainer import CheckpointError, TrainingError

        if isinstance(e, (TrainingError, CheckpointError)):
            return _fail(e, 1)
        raise
    except BaseException as e:
        from .trainer import RunStopped

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


def _workshop(cfg: Config, args: argparse.Namespace) -> int:
    from .workshop import run_sweep, run_workshop

    if args.sweep or args.variants or args.seeds:
        if dist.is_dist():
            raise ConfigError("--sweep/--variants run one after another; under torchrun "
                              "launch one configuration at a time")
        sizes = _int_list(args.sweep, "--sweep") if args.sweep else [cfg.group_size]
        variants = [v.strip() for v in (args.variants or "grpo").split(",") if v.strip()]
        seeds = _int_list(args.seeds, "--seeds") if args.seeds else None
        print(run_sweep(cfg, sizes, variants, seeds))
        print(f"\nwrote {cfg.out_dir}/sweep.md and {cfg.out_dir}/sweep.png")
        return 0
    if not dist.is_main():  # the other ranks train alongside rank 0, which writes everything
        from .workshop import world_trainer

        world_trainer(cfg).train(resume=args.resume)
        return 0
    s = run_workshop(cfg, resume=args.resume)
    print(f"G={s['group_size']} ({s['prompts_per_step']} prompts/step): mean dead share "
          f"{s['mean_dead_share']:.3f} (predicted {s['mean_predicted_dead_share']:.3f}), "
          f"held-out accuracy {s['start_heldout_acc']:.3f} -> {s['final_heldout_acc']:.3f} "
          f"(greedy), {s['start_heldout_pass_prob']:.3f} -> {s['final_heldout_pass_prob']:.3f} "
          f"(T={cfg.temperature}, exact)")
    print(f"wrote {cfg.out_dir}/metrics.jsonl and {cfg.out_dir}/workshop.png")
    return 0


def _train(cfg: Config, args: argparse.Namespace) -> int:
    try:
        from .hf import run_train
    except ImportError as e:
        raise ConfigError(f"grpolab train needs the Hugging Face extras ({e})") from None
    run_train(cfg, resume=args.resume)
    return 0


def _eval(cfg: Config, compare_to: str | None = None) -> int:
    if dist.is_dist():
        raise ConfigError("grpolab eval runs in one process; launch it without torchrun")
    try:
        from .evaluate import compare, run_eval
    except ImportError as e:
        raise ConfigError(f"grpolab eval needs the Hugging Face extras ({e})") from None
    before = None
    if compare_to:
        import json

        try:
            before = json.loads(Path(compare_to).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--compare {compare_to}: cannot read it ({e})") from None
    res = run_eval(cfg)
    line = f"{res['prompts']} prompts: greedy accuracy {res['greedy_accuracy']:.3f}"
    ks = [k for k in res if k.startswith("pass@")]
    if ks:
        line += f"; at T={res['temperature']}, " + ", ".join(f"{k} {res[k]:.3f}" for k in ks)
    print(line)
    if before is not None:
        for name, (gain, se) in compare(before, res).items():
            print(f"  {name}: {gain:+.3f} ± {se:.3f} (paired standard error) against {compare_to}")
    print(f"wrote {cfg.out_dir}/eval.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
