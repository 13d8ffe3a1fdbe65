"""TRL settings whose values take more than a table to translate (``grpolab.config.trl``
reads the rest): the batch, the warm-up, `trl grpo`'s rewards, generate's options, and the
helpers that read TRL's values (YAML numbers, words, whole counts, torchrun's processes)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from typing import Any

from grpolab.config import open_r1
from grpolab.config.schema import ConfigError

TRL_REWARDS = {name: f"trl.rewards:{name}" for name in
               ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")}
# TRL's sampling settings (grpolab's own keys), which ``generation_kwargs`` may override
_GENERATION = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def generation_settings(kwargs: Any, temperature: Any) -> dict[str, Any]:
    """TRL's ``generation_kwargs`` (a mapping, or its JSON text): the sampling settings grpolab
    has, which win over the keys of those names (as in TRL); any other generate option, and a
    temperature other than the run's (TRL would sample at one and score at the other), is
    refused in one line."""
    kwargs = as_mapping(kwargs)
    if kwargs is None:
        raise ConfigError("generation_kwargs (TRL) must be a mapping of generate's options")
    other = sorted(str(k) for k in kwargs if k not in _GENERATION)
    if other:
        raise ConfigError(f"generation_kwargs: {', '.join(other)} (TRL) has no grpolab "
                          f"equivalent; grpolab samples with {', '.join(_GENERATION)}")
    if "temperature" in kwargs and as_number(kwargs["temperature"]) != as_number(temperature):
        raise ConfigError(f"generation_kwargs: temperature {kwargs['temperature']!r} (TRL) "
                          f"samples at another temperature than the loss scores at "
                          f"({temperature!r}); set temperature instead")
    if "top_k" in kwargs and kwargs["top_k"] is None:
        raise ConfigError("generation_kwargs: top_k null (TRL) leaves it to the model's "
                          "generation config; give a number (0: all tokens)")
    return {k: 0.0 if k == "min_p" and v is None else v for k, v in kwargs.items()}

def script_rewards(d: dict[str, Any]) -> list[str]:
    """`trl grpo`'s ``reward_model_name_or_path`` and ``reward_funcs`` as grpolab's ``rewards``
    (TRL's registry names, open-r1's with the recipe's parameters, dotted import paths)."""
    out = [f"rm:{d['reward_model_name_or_path']}"] if d.get("reward_model_name_or_path") else []
    for name in open_r1.reward_names(d):
        if name in TRL_REWARDS:
            out.append(TRL_REWARDS[name])
        elif name == "get_soft_overlong_punishment":  # (the script's: 1280 tokens, 256 soft)
            out.append("overlong:1280:256")
        elif spec := open_r1.reward_spec(str(name), d):
            out.append(spec)
        elif ":" in str(name):  # a grpolab spec (file.py:fn, a Python API callable)
            out.append(str(name))
        elif "/" in str(name):  # a reward model's id or folder (GRPOTrainer loads it so)
            out.append(f"rm:{name}")
        elif "." in str(name):
            module, _, fn = str(name).rpartition(".")
            out.append(f"{module}:{fn}")
        else:
            raise ConfigError(f"reward_funcs: {name!r} (TRL's script) has no grpolab equivalent; "
                              f"grpolab reads {', '.join(TRL_REWARDS)}, open-r1's "
                              f"{', '.join(open_r1.REWARDS)} or a dotted import path (grpolab's "
                              "own rewards, math, reasoning_gym, ..., go in rewards)")
    return out


def dataset_spec(d: dict[str, Any], split_key: str, default: str) -> str:
    """TRL's script's ``load_dataset(dataset_name, dataset_config)[split]`` as grpolab's
    dataset: a Hub id as ``ORG/NAME[:CONFIG[:SPLIT]]`` (read from the local cache,
    ``grpolab.data.hub``); a local folder as is (its splits are its files' names)."""
    name, config = str(d["dataset_name"]), str(d.get("dataset_config") or "")
    split = str(d.get(split_key) or default)
    for key, value in (("dataset_config", config), (split_key, split)):
        if not re.fullmatch(r"[\w.-]*", value):  # (no slicing: train[:10%])
            raise ConfigError(f"{key}: {value!r} (TRL): grpolab reads a whole split or config "
                              "by its name (letters, digits, . _ -)")
    if os.path.exists(os.path.expanduser(name)):
        if config or split != default:
            raise ConfigError(f"dataset_name {name!r} is a local folder: its splits are its "
                              f"files' names (train.jsonl, test.jsonl); drop dataset_config "
                              f"and {split_key}")
        return name
    return name + (f":{config}" if config or split != default else "") + (
        f":{split}" if split != default else "")


def generation_steps(d: dict[str, Any]) -> int:
    """Optimiser steps per TRL generation batch: ``steps_per_generation`` (or
    ``generation_batch_size`` over the rows a micro-step takes on every process) over the
    accumulation; 1 by default (each optimiser step samples its own answers)."""
    per = whole_count(d, "per_device_train_batch_size", 8)
    acc = whole_count(d, "gradient_accumulation_steps", 1)
    spg, gbs = d.get("steps_per_generation"), d.get("generation_batch_size")
    if spg is not None and gbs is not None:
        raise ConfigError("steps_per_generation and generation_batch_size (TRL): set one or "
                          "neither (TRL refuses both)")
    if gbs is not None:
        gbs = whole_count(d, "generation_batch_size", 1)
        if gbs % (per * processes()):
            raise ConfigError(f"generation_batch_size {gbs} (TRL) must be a multiple of "
                              f"per_device_train_batch_size {per} x {processes()} process(es)")
        spg = gbs // (per * processes())
    elif spg is not None:
        spg = whole_count(d, "steps_per_generation", 1)
    spg = acc if spg is None else spg
    if spg % acc:
        raise ConfigError(f"steps_per_generation {spg} (TRL) is not a multiple of "
                          f"gradient_accumulation_steps {acc}: an optimiser step would take "
                          "answers of two generation batches (grpolab steps on one batch)")
    return spg // acc


def batch_settings(d: dict[str, Any], group: Any, check: bool = True) -> dict[str, Any]:
    """TRL's batch settings as grpolab's ``budget`` (answers sampled at once, over all
    processes: one generation batch), ``minibatches`` (optimiser steps on it, each on a random
    share of it, as TRL deals its shuffled buffer out; with ``steps_per_generation`` > the
    accumulation; then for dapo, cispo and vespo each step's token sum over the generation
    batch's tokens / its steps, ``token_mean_by``) and ``micro_batch`` (rows per
    forward/backward). ``group``: the run's group size (None: 8, TRL's and grpolab's
    default); with ``check``, it must divide the generation batch, said in TRL's terms (the
    budget comes from them)."""
    per = whole_count(d, "per_device_train_batch_size", 8)
    acc = whole_count(d, "gradient_accumulation_steps", 1)
    k = generation_steps(d)
    answers = per * acc * processes() * k
    g = as_number(8 if group is None else group)
    if check and isinstance(g, int) and g > 0 and answers % g:
        n = processes()
        what = (f" x {k} optimiser steps a generation = {answers} answers (TRL's generation "
                "batch)" if k > 1 else f" = {answers} answers a step (TRL's batch)")
        raise ConfigError(
            f"per_device_train_batch_size {per} x gradient_accumulation_steps {acc} x {n} "
            f"process{'es' if n > 1 else ''}{what} is not divisible by num_generations {g}; "
            f"TRL refuses it too (a {'generation' if k > 1 else 'step'} holds whole groups)")
    out: dict[str, Any] = {"budget": answers, "micro_batch": per}
    if k > 1:
        out.update(minibatches=k, minibatch_order="shuffled")
        if as_word(d.get("loss_type")) in ("dapo", "cispo", "vespo"):  # (TRL divides
            out["token_mean_by"] = "batch"  # by the generation batch's tokens / its steps)
    return out

def warmup_batches(d: dict[str, Any], per_sample: int) -> Any:
    """TRL's ``warmup_steps`` as grpolab's: a count of optimiser steps in sampled batches; below
    1 a share of the run, as it is (grpolab's share is of the optimiser steps, as TRL's)."""
    w = as_number(d["warmup_steps"])
    if isinstance(w, float) and 0 < w < 1:
        return w
    return per_batches("warmup_steps", w, per_sample) if per_sample > 1 else w


def run_share(key: str, value: Any, d: dict[str, Any], per_sample: int) -> Any:
    """TRL's interval below 1 (``save_steps``, ``eval_steps``, ``logging_steps``): a share of
    the run's optimiser steps, rounded up as transformers does; a count as it is. With epochs,
    a share as it is (grpolab's share of its steps, counted from the data: TRL's at one
    optimiser step a sampled batch)."""
    n = as_number(value)
    if isinstance(n, bool) or not isinstance(n, (int, float)) or n < 0 or (
            n > 1 and n % 1):
        raise ConfigError(f"{key}: {value!r} (TRL) must be a count of optimiser steps, or "
                          "below 1 a share of the run's")
    if not 0 < n < 1:
        return value
    total = as_number(d.get("max_steps", -1))
    if (not isinstance(total, int) or total < 1) and isinstance(as_number(d.get("steps")), int):
        total = as_number(d["steps"]) * per_sample  # (grpolab's steps: sampled batches)
    if isinstance(total, int) and total >= 1:
        return math.ceil(total * n)
    if per_sample > 1:
        raise ConfigError(f"{key}: {value!r} (TRL: a share of the run's optimiser steps) with "
                          f"epochs and {per_sample} optimiser steps a sampled batch: give a "
                          "count, or max_steps")
    return n


def per_batches(key: str, value: Any, per_sample: int) -> int:
    """TRL's count of optimiser steps as grpolab's count of sampled batches (each taken
    through ``num_iterations`` x ``generation_steps`` optimiser steps)."""
    n = as_number(value)
    if not isinstance(n, int) or n % per_sample:
        raise ConfigError(f"{key}: {value!r} (TRL) counts optimiser steps, {per_sample} per "
                          "sampled batch (num_iterations x steps_per_generation / gradient_"
                          "accumulation_steps); grpolab counts sampled batches: use a "
                          f"multiple of {per_sample}")
    return n // per_sample

def whole_count(d: dict[str, Any], key: str, default: int) -> int:
    n = as_number(d.get(key, default))
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"{key}: {d.get(key)!r} (TRL) must be a whole number >= 1")
    return n

def processes() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's processes

def as_number(value: Any) -> Any:
    """A YAML number as one: PyYAML reads 1e-8 (no dot) as a string. Integral values as int;
    anything else as it was."""
    try:
        x = float(value) if isinstance(value, str) else value
    except ValueError:
        return value
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x

def as_mapping(value: Any) -> dict | None:
    """A mapping, or its JSON text (TRL takes either for its ``*_kwargs``), as a dict; None
    where it is neither."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def as_word(value: Any) -> str:
    return str(value).strip().lower()


def schedule_options(d: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``lr_scheduler_kwargs`` for ``lr_scheduler_type`` (TRL's): cosine's
    ``num_cycles`` at its 0.5 (half a cosine), cosine_with_min_lr's ``min_lr_rate`` or
    ``min_lr`` (grpolab's keys of those names; min_lr is divided by the run's final lr);
    anything else refused."""
    kind = as_word(d.get("lr_scheduler_type", "linear"))
    kwargs = d.get("lr_scheduler_kwargs") or {}  # (unset: None)
    kwargs = as_mapping({} if isinstance(kwargs, str) and not kwargs.strip() else kwargs)
    if kwargs is None:
        raise ConfigError("lr_scheduler_kwargs (TRL) must be a mapping of the scheduler's "
                          "options")
    kwargs = dict(kwargs)
    cycles = kwargs.pop("num_cycles", None)
    if cycles is not None and (as_number(cycles) != 0.5
                               or kind not in ("cosine", "cosine_with_min_lr")):
        kwargs["num_cycles"] = cycles  # (refused below)
    rate, floor = kwargs.pop("min_lr_rate", None), kwargs.pop("min_lr", None)
    if kind == "cosine_with_min_lr":
        if (rate is None) == (floor is None):
            raise ConfigError("lr_scheduler_type: cosine_with_min_lr (TRL) needs one of "
                              "lr_scheduler_kwargs' min_lr_rate and min_lr (transformers too)")
    elif rate is not None or floor is not None:
        kwargs["min_lr_rate" if floor is None else "min_lr"] = rate if floor is None else floor
    if kwargs:
        raise ConfigError(f"lr_scheduler_kwargs: {', '.join(sorted(kwargs))} for "
                          f"lr_scheduler_type {kind} (TRL) has no grpolab equivalent (cosine's "
                          "num_cycles 0.5; cosine_with_min_lr's min_lr_rate or min_lr)")
    if floor is not None:
        return {"min_lr": float(as_number(floor))}
    return {} if rate is None else {"min_lr_rate": float(as_number(rate))}


_MIXTURE_ENTRY = {"path", "name", "data_dir", "data_files", "split", "columns", "fraction"}


def mixture(layer: dict[str, Any], say: bool = True) -> dict[str, Any]:
    """TRL's dataset mixture (``datasets: [{path, name, split, ...}]``, its script's
    DatasetMixtureConfig) of one dataset, as its script's ``dataset_name`` keys (read as TRL's
    script reads them, ``dataset_spec``): ``path`` a Hub id in the local cache or a local
    file or folder (``data_dir`` a folder in it; ``data_files`` one file, with the builder
    ``json``/``csv``/``parquet`` or none as its path), ``name`` its config, ``split``;
    ``columns`` and one entry's ``fraction`` change nothing here. Several datasets, or a
    ``test_split_size``, are refused in one line. ``datasets`` stays in the layer (a mixture
    holds no test split: nothing is held out from it). ``say``: warn of a dataset_name left
    aside (the layer being translated; not again where it is read as another's context)."""
    sets = layer.get("datasets")
    if not sets:
        return layer
    if not isinstance(sets, list) or not all(isinstance(x, dict) for x in sets):
        raise ConfigError("datasets (TRL's mixture): a list of entries such as {path: "
                          "org/name, split: train}")
    if len(sets) > 1:
        raise ConfigError(f"datasets (TRL's mixture) lists {len(sets)} datasets: grpolab "
                          "trains on one source; put their rows in one folder (its files read "
                          "as one dataset) and give it as dataset")
    if layer.get("test_split_size") is not None:
        raise ConfigError("test_split_size (TRL): grpolab does not split held-out rows off the "
                          "training data; give them as eval_dataset")
    (entry,) = sets
    if set(entry) - _MIXTURE_ENTRY or not entry.get("path"):
        raise ConfigError(f"datasets (TRL's mixture): an entry takes path (required), "
                          f"{', '.join(sorted(_MIXTURE_ENTRY - {'path'}))}; got {sorted(entry)}")
    path, files = str(entry["path"]), entry.get("data_files")
    if files is not None:
        files = [files] if isinstance(files, str) else files
        if not isinstance(files, list) or len(files) != 1 or path not in (
                "json", "csv", "parquet"):
            raise ConfigError("datasets (TRL's mixture): data_files reads here as one local "
                              "file with path json, csv or parquet; or give path a file or "
                              "folder")
        path = str(files[0])
    elif entry.get("data_dir"):
        if not os.path.isdir(os.path.expanduser(path)):
            raise ConfigError(f"datasets (TRL's mixture): data_dir of {path!r}, no local "
                              "folder: give the folder itself as path (a Hub dataset's subfolder "
                              "is not read)")
        path = os.path.join(path, str(entry["data_dir"]))
    if say and layer.get("dataset_name"):  # (as TRL's script)
        logging.getLogger("grpolab").warning("datasets and dataset_name both given (TRL): "
                                             "datasets is read, dataset_name left aside")
    out = {**layer, "dataset_name": path}
    for key, ours in (("name", "dataset_config"), ("split", "dataset_train_split")):
        out.pop(ours, None)
        if entry.get(key):
            out[ours] = entry[key]
    return out


def with_revision(given: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's ``model_revision`` (a branch, tag or commit other than main; ``d``: every
    layer's keys) on the Hub id a layer names, or the one an earlier layer named: grpolab's
    ``model_path`` ``ID@REVISION``, read from the local cache. A local model has no revision
    to pick: refused in one line."""
    revision = str(d.get("model_revision") or "main")
    if revision == "main" or not {"model_revision", "model_name_or_path"} & given.keys():
        return given
    key = "model_path" if "model_path" in given and "model_name_or_path" not in given else (
        "model_name_or_path")
    model = str(given.get(key) or d.get("model_name_or_path") or d.get("model_path") or "")
    if "@" in model and model.rpartition("@")[2] != revision:
        raise ConfigError(f"model_revision: {revision!r} (TRL) and model {model!r} name two "
                          "revisions; keep one")
    if "@" in model:
        return given
    if (not re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", model)
            or os.path.exists(os.path.expanduser(model))):
        raise ConfigError(f"model_revision: {revision!r} (TRL) picks a Hub model's revision, "
                          f"and model {model!r} is no Hub id (a local folder is as it is)")
    return {**given, key: f"{model}@{revision}"}
