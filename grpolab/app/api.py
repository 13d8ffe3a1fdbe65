"""The Python API, as small as the CLI: ``grpolab.train(config)`` and ``grpolab.workshop()``.

```python
import grpolab

records = grpolab.train("run.yaml", steps=20, report_to=["tensorboard"])
records = grpolab.train({"model_path": "smollm2-135m-instruct", "dataset": "train.jsonl",
                         "rewards": [my_reward, "format"]})
records = grpolab.train("run.yaml", train_dataset=load_dataset("json", data_files=f)["train"])
records[-1]["heldout_acc"], records.out_dir, records.summary
```

The config is a YAML path, a dict of config keys (TRL's names too) or a ``Config``; keyword
arguments override it, as flags do on the command line. A reward may be a Python callable
(TRL's signature ``prompts, completions, **kwargs`` works unchanged). Both return the run's
metrics records (one dict per step, step 0 first; what metrics.jsonl holds) as a list that
also carries ``out_dir`` and ``summary``. The out_dir rules and files are the CLI's, and so are
the errors: ``grpolab.ConfigError`` where the CLI exits 2, ``grpolab.RunError`` where it exits 1,
each with the CLI's one-line message (the original exception is its ``__cause__``).
``dataset`` (or TRL's ``train_dataset``) and ``eval_dataset`` may be rows in memory (a list of
dicts, a dict of columns, a ``datasets.Dataset``, a pandas DataFrame): they are written to
``<out_dir>/data/`` and the run reads them from there (``grpolab.data.memory``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpolab.config import Config, ConfigError, make_config, to_dict
from grpolab.config.load import out_of_scope
from grpolab.data import memory

# Python callables given as rewards: load_reward finds them here by a spec string
# ("grpolab.app.api:rewards.<name>"), so the trainer sees them as it sees any user reward.
rewards = types.SimpleNamespace()


class Records(list):
    """The run's metrics records, plus where it wrote them (``out_dir``) and its summary."""

    out_dir: Path
    summary: dict[str, Any]


def _spec(fn: Any) -> str:
    name = re.sub(r"\W", "_", getattr(fn, "__name__", "") or type(fn).__name__)
    key, n = name, 2
    while getattr(rewards, key, fn) is not fn:
        key, n = f"{name}_{n}", n + 1
    setattr(rewards, key, fn)
    return f"grpolab.app.api:rewards.{key}"


def _config(config: Config | dict | str | Path | None, overrides: dict[str, Any],
            command: str) -> Config:
    """Defaults, then the config (YAML path, dict or Config), then keyword overrides."""
    base: dict[str, Any] | str | None = (
        to_dict(config) if isinstance(config, Config) else
        _callables(dict(config)) if isinstance(config, dict) else
        None if config is None else str(config))
    if isinstance(config, Config) and config.passes > 0:
        del base["steps"]  # (passes set the steps: a Config holds both)
    idle = out_of_scope(overrides, command)
    if idle:
        raise ConfigError(idle)
    return make_config(base, _callables(dict(overrides)), command)


def _callables(given: dict[str, Any]) -> dict[str, Any]:
    """Reward functions given as Python callables, as reward specs."""
    specs = given.get("rewards")
    if specs is not None:
        specs = [specs] if callable(specs) or isinstance(specs, str) else list(specs)
        given["rewards"] = [_spec(r) if callable(r) else r for r in specs]
    watch = given.get("watch_reward")
    if callable(watch):
        given["watch_reward"] = _spec(watch)
    return given


@contextlib.contextmanager
def _cli_errors() -> Iterator[None]:
    """The CLI's errors (``commands.user_error``): ConfigError (exit 2) or RunError (exit 1)."""
    try:
        yield
    except Exception as e:
        from grpolab.app.commands import user_error

        err = user_error(e)
        if err is None or err is e:
            raise
        raise err from e


_IN_MEMORY = "(in memory)"  # the dataset's name until the run's folder is chosen


def _held_rows(config: Any, overrides: dict[str, Any]) -> tuple[Any, dict[str, Any],
                                                                 dict[str, Any]]:
    """The config and keywords with in-memory datasets taken out (TRL's ``train_dataset`` read
    as ``dataset``): {key: rows}, each key's value a placeholder until ``_with_rows``."""
    held: dict[str, Any] = {}
    config = dict(config) if isinstance(config, dict) else config
    for given in (config, overrides):
        if not isinstance(given, dict):
            continue
        if "train_dataset" in given:
            if given.get("dataset") is not None:
                raise ConfigError("dataset and train_dataset are one setting: give one")
            given["dataset"] = given.pop("train_dataset")
        for key in memory.FILES:
            if memory.in_memory(given.get(key)):
                try:
                    held[key] = memory.rows_of(given[key], key)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
                given[key] = _IN_MEMORY
            elif given is overrides and key in given:
                held.pop(key, None)  # (a keyword's path replaces the config's rows)
    return config, overrides, held


def _with_rows(cfg: Config, held: dict[str, Any], resume: bool) -> Config:
    """``cfg`` reading its in-memory datasets from ``<out_dir>/data/`` (written there); on
    resume, rows other than those the run trained on are refused."""
    paths = {}
    for key, name in memory.FILES.items():  # (a replaced run's rows must not look current)
        stale = Path(cfg.out_dir) / "data" / name
        if key not in held and not resume and stale.resolve() != Path(
                getattr(cfg, key) or stale.parent).expanduser().resolve():
            stale.unlink(missing_ok=True)
    for key, rows in held.items():
        path = Path(cfg.out_dir) / "data" / memory.FILES[key]
        try:
            memory.write_rows(rows, path, key, resume=resume)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        paths[key] = str(path)
    return dataclasses.replace(cfg, **paths)


def _out_dir(cfg: Config, command: str, resume: bool) -> Config:
    from grpolab.app.commands import choose_out_dir

    return choose_out_dir(cfg, command, resume)


def _records(out_dir: Path, summary: dict[str, Any]) -> Records:
    from grpolab.run.report import read_metrics

    out = Records(read_metrics(Path(out_dir) / "metrics.jsonl"))
    out.out_dir, out.summary = Path(out_dir), summary
    return out


def train(config: Config | dict | str | Path | None = None, *, resume: bool = False,
          **overrides: Any) -> Records:
    """``grpolab train`` in Python: GRPO on a Hugging Face model; returns the records."""
    from grpolab.app.commands import run_train
    from grpolab.run.checkpoint import out_dir_lock

    with _cli_errors():
        config, overrides, held = _held_rows(config, overrides)
        cfg = _out_dir(_config(config, overrides, "train"), "train", resume)
        # (rows in memory are written into a folder this run holds; nothing made otherwise)
        with out_dir_lock(cfg.out_dir) if held else contextlib.nullcontext():
            trainer = run_train(_with_rows(cfg, held, resume), resume=resume)
    summary_file = Path(trainer.out_dir) / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    return _records(trainer.out_dir, summary)


def workshop(config: Config | dict | str | Path | None = None, *, resume: bool = False,
             sweep: list[int] | None = None, variants: list[str] | None = None,
             seeds: list[int] | None = None, **overrides: Any) -> Records | dict[str, Records]:
    """``grpolab workshop`` in Python: the built-in experiment; returns its records.

    With ``sweep`` (group sizes), ``variants`` or ``seeds`` it runs the sweep and returns
    ``{run folder name: records}`` (sweep.md and sweep.png are written as by the CLI).
    """
    from grpolab.world.workshop import run_sweep, run_workshop

    with _cli_errors():
        cfg = _out_dir(_config(config, overrides, "workshop"), "workshop", resume)
        if not (sweep or variants or seeds):
            summary = run_workshop(cfg, resume=resume)
            return _records(Path(cfg.out_dir), summary)
        if resume:
            raise ConfigError("resume continues one run, not a sweep")
        run_sweep(cfg, list(sweep or [cfg.group_size]), list(variants or ["grpo"]),
                  list(seeds) if seeds else None)
    root = Path(cfg.out_dir)
    return {d.name: _records(d, json.loads((d / "summary.json").read_text()))
            for d in sorted(root.iterdir()) if (d / "summary.json").is_file()}


__all__ = ["Records", "train", "workshop"]
