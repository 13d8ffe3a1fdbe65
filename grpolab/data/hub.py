"""Hugging Face Hub datasets already in the local cache, named as TRL's script names them
(``dataset: openai/gsm8k:main``; TRL's ``dataset_name``, ``dataset_config`` and split names).

The spec is ``ORG/NAME[:CONFIG[:SPLIT]]``: the dataset's ``main`` snapshot in the Hugging Face
cache (where ``hf download --repo-type dataset`` or an earlier ``load_dataset`` put it), its
split's files chosen as ``datasets`` chooses them (the card's ``configs``, else the file names),
then read as a local file is. Nothing is downloaded: a dataset or a split not in the cache is
one line naming the fetch. The split defaults to the caller's (train, or test when held out).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

_SPEC = re.compile(r"(?P<id>[\w.-]+/[\w.-]+)(?::(?P<config>[\w.-]*))?(?::(?P<split>[\w.-]+))?")
BUILDERS = ("json", "parquet", "csv")  # what files.load_rows reads
# datasets' words for a card's split whose files are not there
_PARTIAL = ("Couldn't infer the same data file format", "Unable to find",
            "doesn't match any data file")


def is_hub_dataset(spec: str) -> bool:
    """``spec`` has a Hub dataset's shape and is not a local path (a local one wins; a name
    ending as a data file does, is a missing file)."""
    return (bool(_SPEC.fullmatch(spec)) and not spec.startswith((".", "-"))
            and not spec.lower().endswith((".jsonl", ".json", ".parquet", ".csv"))
            and not Path(spec).expanduser().exists())


def snapshot(spec: str) -> str:
    """The local snapshot folder of ``spec``'s dataset; FileNotFoundError in one line when the
    cache does not hold it."""
    from huggingface_hub import constants, snapshot_download

    name = spec.split(":")[0]
    try:
        return str(snapshot_download(name, repo_type="dataset", local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or not a valid id: the same one line
        raise FileNotFoundError(
            f"dataset {spec!r} is not a local file or folder, nor a Hugging Face Hub dataset in "
            f"the local cache ({constants.HF_HUB_CACHE}); {_fetch(name)}") from None


def hub_files(spec: str, split: str) -> tuple[str, list[str]]:
    """The builder (json/parquet/csv) and local files of ``spec``'s split; FileNotFoundError or
    ValueError in one line (not cached, no such config or split, another format)."""
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise ValueError(f"dataset {spec!r}: write a Hub dataset as ORG/NAME[:CONFIG[:SPLIT]]")
    name, config, split = m["id"], m["config"] or None, m["split"] or split
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # (before `datasets` is imported)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    folder = snapshot(spec)
    verbosity = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    try:
        with tempfile.TemporaryDirectory(prefix="grpolab-data-") as cache_dir:
            builder = datasets.load_dataset_builder(folder, config, cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - datasets' reason, on one line
        text = " ".join(str(e).split("Example of usage")[0].split())
        if any(w in text for w in _PARTIAL):  # (a split's files absent: partly fetched)
            raise FileNotFoundError(f"dataset {spec!r}: the cache holds only part of it "
                                    f"({text[:160]}); {_fetch(name)}") from None
        raise ValueError(f"dataset {spec!r}: {text[:300]} (write {name}:CONFIG)") from None
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
    files = dict(builder.config.data_files or {})
    if builder.name not in BUILDERS:
        raise ValueError(f"dataset {spec!r}: its files are {builder.name}, not one of "
                         f"{', '.join(BUILDERS)}")
    if split not in files:
        raise ValueError(f"dataset {spec!r} has no {split!r} split in the cache (it has "
                         f"{', '.join(files) or 'none'}); write {name}:{config or ''}:SPLIT")
    if not files[split]:
        raise FileNotFoundError(f"dataset {spec!r}: the cache holds none of its {split!r} "
                                f"files; {_fetch(name)}")
    return builder.name, [str(f) for f in files[split]]


def _fetch(name: str) -> str:
    return (f"grpolab downloads nothing at run time: fetch it first (hf download --repo-type "
            f"dataset {name})")
