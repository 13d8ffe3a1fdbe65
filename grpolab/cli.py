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
from typing import Any, NoReturn

from . import dist
from .config import Config, ConfigError, literal_fields, make_config


class _Parser(argparse.ArgumentParser):
    """argparse errors on one line too: the usage of ~60 flags would bury the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(Config)
    choices = literal_fields()
    for name in Config.__dataclass_fields__:
        flag = "--" + name.replace("_", "-")
        tp = hints[name]
        if tp is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        elif name in choices:
            p.add_argument(flag, dest=name, choices=choices[name], default=None)
        else:
            p.add_argument(flag, dest=name, default=None, metavar=name.upper())


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
    w.add_argument("--variants", default=None,
                   help="comma-separated sweep variants: grpo,dynamic,curriculum,dr_grpo,"
                        "clip_higher,token_loss,rloo (default: grpo)")
    w.add_argument("--resume", action="store_true", help="continue from out_dir's checkpoint")
    _add_config_flags(w)
    t = sub.add_parser("train", help="GRPO on a Hugging Face model and a local dataset")
    t.add_argument("--config", help="YAML file of config keys")
    t.add_argument("--resume", action="store_true", help="continue from out_dir's checkpoint")
    _add_config_flags(t)
    e = sub.add_parser("eval", help="greedy accuracy and pass@k of a Hugging Face model")
    e.add_argument("--config", help="YAML file of config keys")
    _add_config_flags(e)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="grpolab: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        cfg = make_config(args.config, _overrides(args))
        dist.init()  # joins torchrun's process group; nothing in a single process
        if args.command == "workshop":
            return _workshop(cfg, args)
        if args.command == "eval":
            return _eval(cfg)
        return _train(cfg, args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        return _fail(e, 2)
    except KeyboardInterrupt:
        print("grpolab: interrupted; the last checkpoint and metrics are kept", file=sys.stderr)
        return 130
    except Exception as e:
        from .trainer import CheckpointError, TrainingError

        if isinstance(e, (TrainingError, CheckpointError)):
            return _fail(e, 1)
        raise
    finally:
        dist.cleanup()


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


def _eval(cfg: Config) -> int:
    if dist.is_dist():
        raise ConfigError("grpolab eval runs in one process; launch it without torchrun")
    try:
        from .evaluate import run_eval
    except ImportError as e:
        raise ConfigError(f"grpolab eval needs the Hugging Face extras ({e})") from None
    res = run_eval(cfg)
    line = f"{res['prompts']} prompts: greedy accuracy {res['greedy_accuracy']:.3f}"
    ks = [k for k in res if k.startswith("pass@")]
    if ks:
        line += f"; at T={res['temperature']}, " + ", ".join(f"{k} {res[k]:.3f}" for k in ks)
    print(line)
    print(f"wrote {cfg.out_dir}/eval.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
