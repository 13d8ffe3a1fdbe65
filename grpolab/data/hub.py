"""Hugging Face Hub datasets already in the local cache, named as TRL's script names them
(``dataset: openai/gsm8k:main``; TRL's ``dataset_name``, ``dataset_config`` and split names).

The spec is ``ORG/NAME[:CONFIG[:SPLIT]]``: the dataset's ``main`` snapshot in the Hugging Face
cache (where ``hf download --repo-type dataset`` or an earlier ``load_dataset`` put it), its
split's files chosen as ``datasets`` chooses them (the card's ``configs``, else the file names),
then read as a local file is. Nothing is downloaded: a dataset or a split not in the cache is
one line naming the fetch. The split defaults to the caller's (train, or test when held out).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_ID = r"[\w.-]+/[\w.-]+"
_SPEC = re.compile(rf"(?P<id>{_ID})(?::(?P<config>[\w.-]*))?(?::(?P<split>[\w.-]+))?")
BUILDERS = ("json", "parquet", "csv")  # what files.load_rows reads
# datasets' words for a card's split whose files are not there
_PARTIAL = ("Couldn't infer the same data file format", "Unable to find",
            "doesn't match any data file")
_SHARD = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.\w+$")


def hub_shaped(value: str, pattern: str = r"(?:[\w.-]+/)?[\w.-]+") -> bool:
    """``value`` reads as a Hub id (``pattern``) and is not a local path: a local one wins."""
    return (bool(re.fullmatch(pattern, value)) and not value.startswith((".", "-"))
            and not Path(value).expanduser().exists())


def is_hub_dataset(spec: str) -> bool:
    """``spec`` has a Hub dataset's shape and is not a local path (a name ending as a data file
    does is a missing file)."""
    return hub_shaped(spec, _SPEC.pattern) and not spec.lower().endswith(
        (".jsonl", ".json", ".parquet", ".csv"))


def with_split(spec: str, split: str) -> str:
    """``spec`` reading ``split`` unless it names its own (``org/d:main`` -> ``org/d:main:test``)."""
    m = _SPEC.fullmatch(spec)
    return spec if m is None or m["split"] else f"{m['id']}:{m['config'] or ''}:{split}"


def cached(name: str, repo_type: str, what: str, revision: str | None = None) -> str:
    """The local snapshot folder of Hub repository ``name`` at its ``main`` revision (or
    ``revision``), as the Hugging Face cache holds it (HF_HUB_CACHE, HF_HOME);
    FileNotFoundError in one line naming ``what`` and the fetch when it is not there. Nothing
    is downloaded."""
    from huggingface_hub import constants, snapshot_download

    try:
        return str(snapshot_download(name, repo_type=repo_type, revision=revision,
                                     local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or not a valid id: the same one line
        kind = "dataset" if repo_type == "dataset" else "model"
        flag = " --repo-type dataset" if repo_type == "dataset" else ""
        raise FileNotFoundError(
            f"{what} is not a local {'file or ' if kind == 'dataset' else ''}folder, nor a "
            f"Hugging Face Hub {kind} in the local cache ({constants.HF_HUB_CACHE}); grpolab "
            f"downloads nothing at run time: fetch it first (hf download{flag} {name}"
            f"{f' --revision {revision}' if revision else ''})"
            f"{'' if kind == 'dataset' else ' or give its folder'}") from None


def snapshot(spec: str) -> str:
    """The local snapshot folder of ``spec``'s dataset (``cached``)."""
    return cached(spec.split(":")[0], "dataset", f"dataset {spec!r}")


@contextlib.contextmanager
def quiet_datasets() -> Iterator[Any]:
    """``datasets``, offline (local files never need the network; set before it is imported,
    so that it sticks), its progress bars and log lines off for the block: its own line for a
    file it cannot read would come before grpolab's one-line error."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    verbosity = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    try:
        yield datasets
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()


def hub_files(spec: str, split: str) -> tuple[str, list[str]]:
    """The builder (json/parquet/csv) and local files of ``spec``'s split; FileNotFoundError or
    ValueError in one line (not cached or cached in part, no such config or split, another
    format)."""
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise ValueError(f"dataset {spec!r}: write a Hub dataset as ORG/NAME[:CONFIG[:SPLIT]]")
    name, config, split = m["id"], m["config"] or None, m["split"] or split
    folder = snapshot(spec)
    fetch = f"grpolab downloads nothing at run time: fetch it (hf download --repo-type dataset {name})"
    with quiet_datasets() as datasets:
        try:
            with tempfile.TemporaryDirectory(prefix="grpolab-data-") as cache_dir:
                builder = datasets.load_dataset_builder(folder, config, cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001 - datasets' reason, on one line
            text = " ".join(str(e).split("Example of usage")[0].split())
            if any(w in text for w in _PARTIAL):  # (a split's files absent: fetched in part)
                raise FileNotFoundError(f"dataset {spec!r}: the cache holds only part of it "
                                        f"({text[:160]}); {fetch}") from None
            raise ValueError(f"dataset {spec!r}: {text[:300]} (write {name}:CONFIG)") from None
    files = {str(k): [str(f) for f in v] for k, v in (builder.config.data_files or {}).items()}
    if builder.name not in BUILDERS:
        raise ValueError(f"dataset {spec!r}: its files are {builder.name}, not one of "
                         f"{', '.join(BUILDERS)}")
    if split not in files:
        raise ValueError(f"dataset {spec!r} has no {split!r} split in the cache (it has "
                         f"{', '.join(files) or 'none'}); write {name}:{config or ''}:SPLIT")
    missing = _missing_shards(files[split])
    if not files[split] or missing:
        raise FileNotFoundError(f"dataset {spec!r}: the cache holds "
                                f"{missing or 'none'} of its {split!r} files; {fetch}")
    return builder.name, files[split]


def _missing_shards(files: list[str]) -> str:
    """'2 of 3' when sharded files (``train-00000-of-00003.parquet``) are not all there."""
    seen: dict[tuple[str, int], set[int]] = {}
    for f in files:
        if m := _SHARD.match(Path(f).name):
            seen.setdefault((m["stem"], int(m["n"])), set()).add(int(m["i"]))
    short = [(len(got), n) for (_, n), got in seen.items() if len(got) < n]
    return ", ".join(f"{got} of {n} shards" for got, n in short)
