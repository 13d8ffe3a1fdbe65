"""Datasets held in memory (the Python API's ``dataset=``, as TRL's ``train_dataset=``): a
list of dicts, a dict of equal-length columns, a ``datasets.Dataset`` or a pandas DataFrame,
written as a JSONL file in the run's folder (named by its content), so that the run is
recorded with the rows it trained on and a resume reads them back as it reads any file.

Values JSON has no word for are made plain on the way: numpy scalars and arrays become numbers
and lists, a NaN or missing value null (a null gold answer is then refused at load naming its
row, as in a file); anything else (a date, an object) is refused naming its row and column.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

FOLDER = "api_data"  # in out_dir: grpolab's own (a user's data/ is never written or removed)
STEMS = {"dataset": "train", "eval_dataset": "eval"}


def in_memory(value: Any) -> bool:
    """Whether a ``dataset`` value is rows rather than a path or a task name."""
    return value is not None and not isinstance(value, (str, os.PathLike))


def rows_of(value: Any, name: str) -> list[dict[str, Any]]:
    """The rows of an in-memory dataset, as plain dicts; a ValueError naming ``name`` for a
    value that is not one (a dataset of several splits, an endless stream, no rows)."""
    kind = type(value).__name__
    if kind == "DatasetDict" or kind == "IterableDatasetDict":
        want = ("train",) if name in ("dataset", "train_dataset") else ("test", "validation")
        pick = next((s for s in want if s in value), next(iter(value), want[0]))
        raise ValueError(f"{name} is a {kind} of splits ({', '.join(value)}); give one split, "
                         f"e.g. {name}=ds[{pick!r}]")
    if kind == "IterableDataset":
        raise ValueError(f"{name} is an IterableDataset, which may not end; give a Dataset "
                         "(e.g. datasets.Dataset.from_list(list(stream.take(1000))))")
    if hasattr(value, "to_list") and hasattr(value, "column_names"):  # datasets.Dataset
        rows = value.to_list()
    elif hasattr(value, "to_dict") and hasattr(value, "columns"):  # pandas.DataFrame
        rows = value.to_dict("records")
    elif isinstance(value, Mapping):  # columns, as datasets.Dataset.from_dict takes them
        columns = {k: list(v) for k, v in value.items() if hasattr(v, "__len__")
                   and not isinstance(v, (str, bytes, Mapping))}  # (lists, arrays, Series)
        lengths = {k: len(v) for k, v in columns.items()}
        if not columns or len(columns) < len(value) or len(set(lengths.values())) > 1:
            shapes = ", ".join(f"{k}: {lengths[k] if k in lengths else type(v).__name__}"
                               for k, v in value.items())
            raise ValueError(f"{name} is a dict, read as columns, but its values are not "
                             f"sequences of one length ({shapes}); give {{column: [values...]}} "
                             "or a list of rows")
        rows = [dict(zip(columns, row)) for row in zip(*columns.values())]
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        rows = list(value)
    else:
        raise ValueError(f"{name} is of type {kind}; give a file's path, a list of dicts, a dict of "
                         "columns, a datasets.Dataset or a pandas DataFrame")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"{name}: row {i} is of type {type(row).__name__}, not a dict "  # noqa: TRY004
                             "of columns")
    if not rows:
        raise ValueError(f"{name} has no rows")
    return [dict(r) for r in rows]


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON holds it (see the module's docstring)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float) and not math.isinf(value):
        return None if math.isnan(value) else value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if hasattr(value, "tolist") and type(value).__module__.split(".")[0] in ("numpy", "torch"):
        return _plain(value.tolist(), where)  # (numpy scalars and arrays, tensors)
    if type(value).__module__.split(".")[0] == "pandas" and type(value).__name__ in (
            "NAType", "NaTType"):
        return None
    raise ValueError(f"{where} holds {str(value)[:40]!r} of type {type(value).__name__}, which a "
                     "JSON line cannot hold; convert it to text or a number first")


def _lines(rows: list[dict[str, Any]], name: str) -> tuple[list[dict[str, Any]], str]:
    """The rows made plain, and their JSONL text; a ValueError naming a row and column that no
    file can hold."""
    plain, lines = [], []
    for i, row in enumerate(rows):
        plain.append({str(k): _plain(v, f"{name}: row {i} column {k!r}") for k, v in row.items()})
        line = json.dumps(plain[-1], ensure_ascii=False, allow_nan=False) + "\n"
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:  # (a lone surrogate: no file can hold it)
            bad = next(k for k, v in plain[-1].items() if not _encodes(v))
            raise ValueError(f"{name}: row {i} column {bad!r} holds text that is not valid "
                             "Unicode (a lone surrogate); fix or drop it") from None
        lines.append(line)
    return plain, "".join(lines)


def write_rows(rows: list[dict[str, Any]], folder: Path, stem: str, name: str) -> Path:
    """``rows`` as ``<folder>/<stem>-<hash of the content>.jsonl``, written atomically unless
    it is there already: a file written once is never replaced, so a run that fails to start
    cannot change the rows an earlier run in the folder trained on."""
    _, text = _lines(rows, name)
    path = folder / f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.jsonl"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp"
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def check_same(rows: list[dict[str, Any]], path: Path, name: str) -> None:
    """A resume's rows must be those of ``path`` (the run's own), row by row, keys in any
    order; else a ValueError naming the first that differs."""
    plain, _ = _lines(rows, name)
    text = path.read_text(encoding="utf-8")
    theirs = [json.loads(x) for x in text.split("\n") if x]  # (not splitlines: U+2028 is text)
    if theirs != plain:
        first = next((i for i, (a, b) in enumerate(zip(theirs, plain)) if a != b),
                     min(len(theirs), len(plain)))
        raise ValueError(f"{name}: these rows are not the ones the run being resumed trained "
                         f"on ({path}: {len(theirs)} rows, these {len(plain)}; row {first} "
                         "differs first); resume with the same rows, or start a new run")


def _encodes(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
