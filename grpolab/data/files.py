"""Load local prompt datasets into plain dicts, with errors a user can act on.

Gold answers are text: a CSV answer column is read as written (one empty cell must not make the
column floats, gold ``4`` read back as ``4.0``), a number from JSON or parquet becomes its text
(a whole float as an integer: Arrow turns 4 into 4.0 in a column that also holds 2.5), and a
missing gold answer (an empty cell, null, NaN) is refused at load naming its row: it would
otherwise be compared as the text "None". Lists and mappings (several accepted answers,
structured gold) are passed to rewards as they are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpolab.data import hub

# Hugging Face `datasets` builder name for each supported file extension.
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Split names. A file is of a split when its stem is the name or the name and a dash
# (train.jsonl, test-00000-of-00002.parquet); training_notes.jsonl is of none.
SPLITS = ("train", "test", "validation", "valid", "val", "dev", "eval")
# No model takes a prompt this long whole (a 128k-token context is about 500k characters): such a
# row is a data error, and rendering or tokenizing it is where memory would go.
MAX_PROMPT_CHARS = 1_000_000

log = logging.getLogger("grpolab")


def _split_of(name: str) -> str | None:
    """The split a file's stem names exactly (``train``, ``train-00000-of-00001``), or None."""
    stem = Path(name).stem.lower()
    return next((s for s in SPLITS if stem == s or stem.startswith(s + "-")), None)


def _data_files(path: Path, split: str) -> tuple[str, list[str]]:
    """Pick the builder and files for a file or a directory of same-format files.

    In a directory, the files named for ``split`` (``train.jsonl``, ``train-00000.parquet``)
    are used, others left out with a warning when they are named for no split. A folder whose
    files are named for other splits only is an error, not a silent mix of them; a folder with
    no split names is one split of several files.
    """
    if not path.exists():
        raise FileNotFoundError(f"dataset {str(path)!r} does not exist")
    if path.is_file():
        builder = FORMATS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"dataset {str(path)!r}: unsupported extension {path.suffix!r} "
                f"(expected one of {', '.join(FORMATS)})"
            )
        return builder, [str(path)]

    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FORMATS)
    if not files:
        raise FileNotFoundError(f"dataset directory {str(path)!r} has no {'/'.join(FORMATS)} files")
    named = {p: _split_of(p.name) for p in files}
    for_split = [p for p in files if named[p] == split]
    if not for_split and any(named.values()):
        have = sorted({s for s in named.values() if s})
        raise ValueError(f"dataset directory {str(path)!r} has no {split!r} files (it has "
                         f"{', '.join(have)}); name the file itself")
    unnamed = [p.name for p in files if named[p] is None]
    if for_split and unnamed:
        log.warning("dataset directory %s: %s split from %s; left out %s (named for no split)",
                    path, split, ", ".join(p.name for p in for_split), ", ".join(unnamed))
    if not for_split and split != "train":  # (held out: the same files train, most likely)
        log.warning("dataset directory %s names no split (train.jsonl, test.jsonl, "
                    "test-00000.parquet, ...): its %s prompts come from all of %s", path, split,
                    ", ".join(p.name for p in files))
    files = for_split or files
    builders = {FORMATS[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        raise ValueError(
            f"dataset directory {str(path)!r} mixes formats ({', '.join(sorted(builders))}); "
            "keep one format per directory"
        )
    return builders.pop(), [str(p) for p in files]


def _load(builder: str, files: list[str], split: str, where: str,
          text_column: str | None = None) -> list[dict[str, Any]]:
    try:
        # A throwaway cache dir keeps converted Arrow copies out of the user's HF cache.
        with hub.quiet_datasets() as datasets, tempfile.TemporaryDirectory(
                prefix="grpolab-data-") as cache_dir:
            # a CSV answer column as written: pandas would turn "4" into 4.0 beside an empty cell
            extra = {"converters": {text_column: str}} if builder == "csv" and text_column else {}
            ds = datasets.load_dataset(
                builder,
                data_files={split: files},
                split=split,
                cache_dir=cache_dir,
                keep_in_memory=True,
                **extra,
            )
            return ds.to_list()
    except StopIteration:  # what `datasets` raises for an empty JSON file
        return []
    except Exception as e:
        cause = e.__cause__ or e
        detail = _bad_jsonl_line(files) or " ".join(str(cause).split())[:300]
        raise ValueError(f"dataset {where!r}: could not read {builder} data: {detail}") from e


def _jsonl_lines(files: list[str]) -> Iterator[tuple[str, int, str]]:
    """(file, 1-based line number, text) of each JSONL line a reader keeps (blank ones are
    skipped, as `datasets` skips them); nothing when a file is not .jsonl."""
    if not all(f.lower().endswith(".jsonl") for f in files):
        return
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    yield f, n, line


def _line_name(files: list[str], file: str, n: int) -> str:
    return f"line {n}" + (f" of {Path(file).name}" if len(files) > 1 else "")


def _bad_jsonl_line(files: list[str]) -> str | None:
    """The first JSONL line that is not a JSON object, by its line number (the reader's own
    error gives a byte position or a 0-based row)."""
    for f, n, line in _jsonl_lines(files):
        try:
            value = json.loads(line)
        except ValueError as e:
            why = getattr(e, "msg", str(e)).removesuffix(" at")  # ("Invalid ... at")
            return (f"{_line_name(files, f, n)} is not valid JSON ({why}, column "
                    f"{getattr(e, 'colno', '?')})")
        if not isinstance(value, dict):
            return f"{_line_name(files, f, n)} is not a JSON object"
    return None


class _RowName:
    """Row ``index`` (0-based, over the files in order) as a user finds it in the file: a JSONL
    line number, else the row counting from 1. Worked out when an error is formatted (it reads
    the file again), never for a good row."""

    def __init__(self, files: list[str], index: int) -> None:
        self.files, self.index = files, index

    def __str__(self) -> str:
        for i, (f, n, _) in enumerate(_jsonl_lines(self.files)):
            if i == self.index:
                return _line_name(self.files, f, n)
        csv = all(f.lower().endswith(".csv") for f in self.files)
        return f"row {self.index + 1} (counting from 1{', after the header' if csv else ''})"


def _header_only(file: str) -> bool:
    """A CSV file with at most one non-blank line."""
    with open(file, encoding="utf-8", errors="replace") as f:
        lines = 0
        for line in f:
            lines += bool(line.strip())
            if lines > 1:
                return False
    return True


def _check_prompt(prompt: Any, row: str, column: str, where: str) -> None:
    """Prompts are strings or chat messages; anything else would fail much later in the trainer."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        return
    raise ValueError(
        f"dataset {where!r}: {row} column {column!r} is {type(prompt).__name__} "
        f"{str(prompt)[:60]!r}; expected a string or a list of {{'role', 'content'}} messages"
    )


_MISSING = object()


def field(row: dict[str, Any], name: str, default: Any = None) -> Any:
    """``row[name]``, or with dots a field of a nested column (verl's data keeps the gold
    answer as ``reward_model.ground_truth``); ``default`` when there is none."""
    if name in row:
        return row[name]
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


def load_rows(
    path: str,
    prompt_column: str = "prompt",
    answer_column: str | None = "answer",
    split: str = "train",
) -> list[dict[str, Any]]:
    """Load a local .jsonl/.json/.parquet/.csv file (or a directory of them, or a Hub dataset in
    the local cache: ``grpolab.data.hub``) as a list of dicts.

    Each row keeps all original columns and gains ``prompt`` (from ``prompt_column``) and, if
    ``answer_column`` is set, ``answer``. Chat-style prompts (lists of messages) are kept as-is.
    """
    where = str(path)
    if hub.is_hub_dataset(where):  # (ORG/NAME[:CONFIG[:SPLIT]] in the Hugging Face cache)
        builder, files = hub.hub_files(where, split)
    else:
        builder, files = _data_files(Path(path).expanduser(), split)
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"dataset {where!r} is empty")
    if builder == "csv" and all(_header_only(f) for f in files):
        raise ValueError(f"dataset {where!r} has a header line but no rows")
    rows = _load(builder, files, split, where, answer_column)
    if not rows:
        raise ValueError(f"dataset {where!r} is empty")

    columns = list(rows[0])
    for wanted, role in ((prompt_column, "prompt"), (answer_column, "answer")):
        if wanted is not None and field(rows[0], wanted, _MISSING) is _MISSING:
            hint = ("; answer_column: null (--answer-column '') reads none (the code reward's "
                    "tests need none)") \
                if role == "answer" else ""
            raise ValueError(
                f"dataset {where!r} has no {role} column {wanted!r}; "
                f"columns are: {', '.join(columns)}{hint}"
            )

    out = []
    for i, row in enumerate(rows):
        prompt = field(row, prompt_column)
        _check_prompt(prompt, _RowName(files, i), prompt_column, where)
        size = len(prompt) if isinstance(prompt, str) else sum(len(str(m["content"]))
                                                               for m in prompt)
        if size > MAX_PROMPT_CHARS:
            raise ValueError(f"dataset {where!r}: {_RowName(files, i)} has a prompt of "
                             f"{size:,} characters (over {MAX_PROMPT_CHARS:,}); remove or "
                             "shorten it")
        if isinstance(prompt, list):
            # Arrow unifies message structs, padding absent keys (e.g. `name`) with None;
            # drop those so chat templates do not render "None".
            prompt = [{k: v for k, v in m.items() if v is not None} for m in prompt]
        new = dict(row)
        new["prompt"] = prompt
        if answer_column is not None:
            new["answer"] = gold_text(field(row, answer_column), _RowName(files, i), answer_column,
                                      where)
        out.append(new)
    return out


def gold_text(value: Any, row: Any, column: str, where: str) -> Any:
    """A gold answer as text (lists and mappings as they are); a missing one is a ValueError
    naming ``row`` (where it is in the file)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"dataset {where!r}: {row} has no gold answer (column {column!r} "
                         "is empty or null); fill it in or drop the row")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def run_rows(cfg: Any, warn: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training and held-out rows a run's config names, with ``prompt_template`` and
    ``system_prompt`` applied.

    ``dataset``/``eval_dataset`` are local files or folders, or ``reasoning_gym:<task>``; a task
    library's held-out split comes from another seed and never repeats a training question.
    ``warn``: log the data's warnings (files left out, a small task, held-out prompts that are
    training prompts); under torchrun every rank loads the same rows, so rank 0 alone says so.
    """
    def quiet(record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING  # (errors still pass)

    if not warn:
        log.addFilter(quiet)
    try:
        return _run_rows(cfg)
    finally:
        log.removeFilter(quiet)


def _run_rows(cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from grpolab.data.tasks import HELDOUT_SEED_OFFSET, is_task, task_rows

    def load(spec: str, size: int, seed: int, exclude: list[str],
             split: str) -> list[dict[str, Any]]:
        if is_task(spec):
            return task_rows(spec, size, seed, cfg.task_config, exclude)
        return load_rows(spec, cfg.prompt_column, cfg.answer_column or None, split=split)

    train = load(cfg.dataset, cfg.dataset_size, cfg.seed, [], "train") if cfg.dataset else []
    held = []
    if cfg.eval_dataset:
        asked = [r["prompt"] for r in train if isinstance(r["prompt"], str)]
        # a folder's held-out files are the ones named for the test split (test.jsonl, ...)
        held = load(cfg.eval_dataset, cfg.eval_size, cfg.seed + HELDOUT_SEED_OFFSET, asked,
                    "test")
        _warn_overlap(train, held[: cfg.eval_size])  # the prompts evaluated; none: no warning
        if 0 < cfg.eval_size < len(held):  # (TRL evaluates every row: say which are measured)
            log.warning("eval_dataset has %d prompts; held-out measures are of the first %d "
                        "(eval_size)", len(held), cfg.eval_size)
    for row in (*train, *held):
        if cfg.prompt_template:
            row["prompt"] = _templated(cfg.prompt_template, row["prompt"])
        if cfg.system_prompt:
            row["prompt"] = with_system(cfg.system_prompt, row["prompt"])
    return train, held


def with_system(system: str, prompt: Any) -> Any:
    """A prompt as chat messages opening with the ``system`` message (open-r1's
    ``make_conversation``); a chat prompt that has a system message keeps its own."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if any(m.get("role") == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _templated(template: str, prompt: Any) -> Any:
    """A text prompt inside ``template``; of a chat prompt, its last user message's text."""
    if isinstance(prompt, str):
        return template.replace("{prompt}", prompt)
    last = max((i for i, m in enumerate(prompt) if m.get("role") == "user"), default=None)
    if last is None or not isinstance(prompt[last].get("content"), str):
        return prompt  # (no user text to wrap: a system-only or multimodal prompt)
    out = list(prompt)
    out[last] = {**prompt[last], "content": template.replace("{prompt}", prompt[last]["content"])}
    return out


def _warn_overlap(train: list[dict[str, Any]], held: list[dict[str, Any]]) -> None:
    """Held-out accuracy on prompts the run trains on measures memory, not generalisation."""
    def key(prompt: Any) -> str:
        return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True,
                                                                 default=str)

    seen = {key(r["prompt"]) for r in train}
    both = sum(key(r["prompt"]) in seen for r in held)
    if both:
        log.warning("%d of the %d eval_dataset prompts evaluated (eval_size) are also training "
                    "prompts: held-out accuracy on them measures recall, not generalisation",
                    both, len(held))


def fingerprint(values: list[Any]) -> str:
    """The sha256 of a list of rows or prompts, in order, as JSON: a run's training rows (its
    checkpoints keep it: a resume on rows that changed, their count or not, is refused) and
    the prompts ``grpolab eval`` measured (eval.json's ``prompts_sha256``)."""
    text = json.dumps(values, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()
