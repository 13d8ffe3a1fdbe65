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
``<out_dir>/api_data/`` and the run reads them from there (``grpolab.data.memory``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpolab.config import Config, ConfigError, make_config, to_dict
from grpolab.data import memory

# Python callables given as rewards: load_reward finds them here by a spec string
# ("grpolab.app.api:rewards.<name>"), so the trainer sees them as it sees any user reward.
rewards = types.SimpleNamespace()


class Records(list):
    """The run's metrics records, plus where it wrote them (``out_dir``) and its summary."""

    out_dir: Path
    summary: dict[str, Any]


def _spec(fn: Any, taken: dict[str, Any]) -> str:
    """A callable's reward spec, by its name: the same in every process, so that a run resumes
    with the function given again (a notebook's cell run again: a new object, the same name).
    Two of one name in one run (``taken``: its callables so far) are numbered, in order."""
    name = re.sub(r"\W", "_", getattr(fn, "__name__", "") or type(fn).__name__)
    key, n = name, 2
    while taken.get(key, fn) is not fn:
        key, n = f"{name}_{n}", n + 1
    setattr(rewards, key, fn)
    taken[key] = fn
    return f"grpolab.app.api:rewards.{key}"


def _config(config: Config | dict | str | Path | None, overrides: dict[str, Any],
            command: str) -> Config:
    """Defaults, then the config (YAML path, dict or Config), then keyword overrides."""
    if not isinstance(config, (Config, dict, str, os.PathLike, type(None))):
        what = (_TRAINER_ARGS["args"] if hasattr(config, "output_dir") else  # (TrainingArguments)
                "rows go in train_dataset=" if hasattr(config, "__len__") else
                "give a YAML file's path, a dict of settings or a grpolab Config")
        raise ConfigError(f"config: a {type(config).__name__} is not read; {what}")
    if isinstance(config, Config) and overrides.get("defaults") not in (None, "grpolab"):
        raise ConfigError(f"defaults={overrides['defaults']!r}: a Config holds every setting, "
                          "so none is left to take another's default; give a dict or a YAML "
                          "file of the settings you set")
    taken: dict[str, Any] = {}  # (the run's callables, by the names they are given)
    base: dict[str, Any] | str | None = (
        to_dict(config) if isinstance(config, Config) else
        _callables(dict(config), taken) if isinstance(config, dict) else
        None if config is None else str(config))
    if isinstance(config, Config) and config.passes > 0:
        del base["steps"]  # (passes set the steps: a Config holds both)
    if "answer_column" in overrides and overrides["answer_column"] is None:
        overrides = {**overrides, "answer_column": ""}  # (None: no answer column, as YAML's null)
    return make_config(base, _callables(dict(overrides), taken), command, strict=True)


def _callables(given: dict[str, Any], taken: dict[str, Any] | None = None) -> dict[str, Any]:
    """Reward functions given as Python callables (``rewards``, TRL's ``reward_funcs``), as
    reward specs (``_spec``; ``taken``: the run's callables named so far)."""
    taken = {} if taken is None else taken
    for key in ("rewards", "reward_funcs"):
        specs = given.get(key)
        if specs is not None:
            specs = [specs] if callable(specs) or isinstance(specs, str) else list(specs)
            given[key] = [_spec(r, taken) if callable(r) else r for r in specs]
    watch = given.get("watch_reward")
    if callable(watch):
        given["watch_reward"] = _spec(watch, taken)
    return given


@contextlib.contextmanager
def _cli_errors() -> Iterator[None]:
    """The CLI's errors (``commands.user_error``): ConfigError (exit 2) or RunError (exit 1)."""
    try:
        yield
    except Exception as e:
        from grpolab.app.commands import user_error

        err = user_error(e)
        if isinstance(err, ConfigError) and (said := _keywords(str(err))) != str(err):
            raise ConfigError(said) from e
        if err is None or err is e:
            raise
        raise err from e


_shown_lock = threading.Lock()
_shown: list[Any] = [None, 0]  # (the handler this API added, the calls that share it)


@contextlib.contextmanager
def _warnings_shown() -> Iterator[None]:
    """grpolab's warnings on stderr as the CLI shows them (``grpolab: ...``) for the call's
    length, unless the program has configured logging itself (then they go where it says).
    Calls in several threads share one handler, removed when the last of them ends."""
    log = logging.getLogger("grpolab")
    with _shown_lock:
        ours = _shown[0] is not None or not (log.handlers or logging.getLogger().handlers)
        if ours:
            if _shown[0] is None:
                _shown[0] = logging.StreamHandler()
                _shown[0].setFormatter(logging.Formatter("grpolab: %(message)s"))
                log.addHandler(_shown[0])
            _shown[1] += 1
    try:
        yield
    finally:
        if ours:
            with _shown_lock:
                _shown[1] -= 1
                if not _shown[1]:
                    log.removeHandler(_shown[0])
                    _shown[0] = None


def _keywords(message: str) -> str:
    """An error's command-line flags as this API's keywords (``--out-dir``: ``out_dir=``,
    ``--resume``: ``resume=True``); other flags as they are."""
    fields = Config.__dataclass_fields__

    def keyword(m: re.Match[str]) -> str:
        name, on = m[1].replace("-", "_"), "True"
        if name.startswith("no_") and name[3:] in fields:  # (--no-lora: lora=False)
            name, on = name[3:], "False"
        if name == "resume" or fields.get(name) and fields[name].type in (bool, "bool"):
            return f"{name}={on}"
        return f"{name}=" if name in fields else m[0]

    return re.sub(r"(?<![\w/.-])--([a-z][a-z0-9-]*)", keyword, message)


_IN_MEMORY = "(in memory)"  # the dataset's name until the run's folder is chosen
# GRPOTrainer's arguments that are no config key: what to give instead (``model``: a name)
_TRAINER_ARGS = {
    "args": "a GRPOConfig is not read whole (its __post_init__ fills settings nobody gave): "
            "pass the settings you set as keywords or a dict, in TRL's names",
    "processing_class": "the tokenizer comes with the model (chat_template replaces its "
                        "template)",
    "peft_config": "LoRA is use_peft (lora), lora_r, lora_alpha, lora_target_modules",
}


def _trainer_args(overrides: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``GRPOTrainer(model=...)`` as ``model_path``; its other arguments refused with
    what to give instead."""
    for key, instead in _TRAINER_ARGS.items():
        if key in overrides:
            raise ConfigError(f"{key}= (GRPOTrainer's): {instead}")
    if "model" in overrides:
        model = overrides.pop("model")
        if not isinstance(model, (str, os.PathLike)):
            raise ConfigError("model= takes a model's Hub id or folder (grpolab loads it); save "
                              "a model held in memory with save_pretrained(folder) and give "
                              "the folder")
        overrides["model_path"] = str(model)
    return overrides


def _held_rows(config: Any, overrides: dict[str, Any]) -> tuple[Any, dict[str, Any],
                                                                 dict[str, Any]]:
    """The config and keywords with in-memory datasets taken out (TRL's ``train_dataset`` read
    as ``dataset``): {key: (rows, the name the user gave)}, each key a placeholder until
    ``_with_rows``."""
    held: dict[str, Any] = {}
    config = dict(config) if isinstance(config, dict) else config
    for given in (config, overrides):
        if not isinstance(given, dict):
            continue
        said = {"dataset": "dataset", "eval_dataset": "eval_dataset"}  # (the user's name)
        if "train_dataset" in given:
            if given.get("dataset") is not None:
                raise ConfigError("dataset and train_dataset are one setting: give one")
            given["dataset"], said["dataset"] = given.pop("train_dataset"), "train_dataset"
        for key in memory.STEMS:
            if memory.in_memory(given.get(key)):
                try:
                    held[key] = (memory.rows_of(given[key], said[key]), said[key])
                except ValueError as e:
                    raise ConfigError(str(e)) from None
                given[key] = _IN_MEMORY
            elif given is overrides and given.get(key) is not None:
                held.pop(key, None)  # (a keyword's path replaces the config's rows)
    return config, overrides, held


def _with_rows(cfg: Config, held: dict[str, Any], resume: bool) -> Config:
    """``cfg`` reading its in-memory datasets from ``<out_dir>/api_data/`` (written there, named
    by their content); on resume, the rows must be those the run's config.json names. Rows
    whose key a later setting replaced (TRL's ``dataset_name``) are not used."""
    paths = {}
    saved = Path(cfg.out_dir) / "config.json"
    for key, (rows, said) in held.items():
        if getattr(cfg, key) != _IN_MEMORY:
            continue
        try:
            if not resume:
                paths[key] = str(memory.write_rows(rows, Path(cfg.out_dir) / memory.FOLDER,
                                                   memory.STEMS[key], said))
                continue
            ran = json.loads(saved.read_text()).get(key, "") if saved.is_file() else ""
            mine = Path(cfg.out_dir) / memory.FOLDER / Path(ran).name
            if Path(ran).parent.name != memory.FOLDER or not mine.is_file():
                raise ValueError(f"{said}: the run being resumed did not read its rows from "
                                 f"memory ({key} {ran!r}); resume it with its own {key} setting")
            memory.check_same(rows, mine, said)
            # (as the run wrote it, when it is this file: the resume sees no changed setting)
            paths[key] = ran if Path(ran).resolve() == mine.resolve() else str(mine)
        except (ValueError, OSError) as e:
            raise ConfigError(str(e)) from None
    return dataclasses.replace(cfg, **paths)


# A run never downloads, so it turns the Hugging Face libraries offline; these switches (the
# variables, and what the modules read from them when imported) are put back after an API call,
# so that a notebook's later load_dataset or from_pretrained may use the network again.
_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_OFFLINE_READ = (("huggingface_hub.constants", "HF_HUB_OFFLINE", "HF_HUB_OFFLINE"),
                 ("datasets.config", "HF_HUB_OFFLINE", "HF_HUB_OFFLINE"),
                 ("datasets.config", "HF_DATASETS_OFFLINE", "HF_DATASETS_OFFLINE"))


@contextlib.contextmanager
def _online_kept() -> Iterator[None]:
    env = {n: os.environ.get(n) for n in _OFFLINE}
    read = {(m, a): getattr(sys.modules[m], a) for m, a, _ in _OFFLINE_READ
            if m in sys.modules and hasattr(sys.modules[m], a)}
    try:
        yield
    finally:
        for n, v in env.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
        for m, a, n in _OFFLINE_READ:  # (a module first imported by the run: as the variable says)
            if m in sys.modules and hasattr(sys.modules[m], a):
                on = (env[n] or env[_OFFLINE[0]] or "").upper()  # (the caller's own value)
                setattr(sys.modules[m], a, read.get((m, a), on in ("1", "ON", "YES", "TRUE")))


def _out_dir(cfg: Config, command: str, resume: bool) -> Config:
    from grpolab.app.commands import choose_out_dir

    return choose_out_dir(cfg, command, resume)


def resume_asked_by(config: Any, overrides: dict[str, Any], cfg: Config) -> bool:
    """verl's ``trainer.resume_mode`` or TRL's ``resume_from_checkpoint`` among the config's
    (a YAML path, a dict; a Config has none) and the overrides' keys, as ``resume=True``
    (the CLI's ``--resume`` too)."""
    from grpolab.config.load import load_yaml, resume_asked
    from grpolab.run.checkpoint import holds_checkpoint

    keys = load_yaml(config) if isinstance(config, (str, Path)) else (
        dict(config) if isinstance(config, dict) else {})
    return resume_asked({**keys, **overrides}, cfg.out_dir, holds_checkpoint(cfg.out_dir),
                        cfg.overwrite)


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

    with _cli_errors(), _warnings_shown(), _online_kept():
        config, overrides, held = _held_rows(config, _trainer_args(overrides))
        cfg = _config(config, overrides, "train")
        asked = resume_asked_by(config, overrides, cfg)
        if resume and not asked and "resume_from_checkpoint" in overrides:  # (said false)
            raise ConfigError("resume=True and resume_from_checkpoint=False: keep one")
        resume = resume or asked
        cfg = _out_dir(cfg, "train", resume)
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
    from grpolab.world.workshop import run_sweep, run_workshop, sweep_folders

    if "train_dataset" in overrides:  # (refused as dataset is: not the workshop's)
        overrides["dataset"] = overrides.pop("train_dataset")
    with _cli_errors(), _warnings_shown():
        cfg = _out_dir(_config(config, overrides, "workshop"), "workshop", resume)
        if not (sweep or variants or seeds):
            summary = run_workshop(cfg, resume=resume)
            file = Path(cfg.out_dir) / "summary.json"  # (as train's: an undefined number None)
            return _records(file.parent, json.loads(file.read_text()) if file.is_file() else summary)
        sizes, names = _items(sweep, "sweep", int) or [cfg.group_size], _items(
            variants, "variants", str) or ["grpo"]
        seeds = _items(seeds, "seeds", int)
        run_sweep(cfg, sizes, names, seeds, resume)
        root = Path(cfg.out_dir)  # (this sweep's runs: not another's folders beside them)
        return {n: _records(root / n, json.loads((root / n / "summary.json").read_text()))
                for n in sweep_folders(sizes, names, seeds or [cfg.seed])}


def _items(value: Any, what: str, kind: type) -> list[Any] | None:
    """A sweep's ``sweep=``, ``seeds=`` (integers) or ``variants=`` (names): a list, one value,
    or the CLI's comma-separated text; anything else is a ConfigError naming it."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
        if kind is int:
            from grpolab.app.commands import _int_list

            return _int_list(",".join(value), f"{what}=")
    if isinstance(value, kind) and not isinstance(value, bool):
        return [value]
    items = list(value) if isinstance(value, (list, tuple, range)) else None
    if items is None or not all(isinstance(v, kind) and not isinstance(v, bool) for v in items):
        raise ConfigError(f"{what}= takes a list of {'integers' if kind is int else 'names'} "
                          f"(or one, or comma-separated text); got {value!r}")
    return items or None


__all__ = ["Records", "train", "workshop"]
