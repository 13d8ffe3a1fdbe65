"""Load local prompt datasets into plain dicts, with errors a user can act on."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

# Hugging Face `datasets` builder name for each supported file extension.
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _data_files(path: Path, split: str) -> tuple[str, list[str]]:
    """Pick the builder and files for a file or a directory of same-format files.

    In a directory, files whose name starts with ``split`` (``train.jsonl``,
    ``train-00000.parquet``) win, so a folder holding train and test files loads the right one.
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
    for_split = [p for p in files if p.name.startswith(split)]
    files = for_split or files
    builders = {FORMATS[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        raise ValueError(
            f"dataset directory {str(path)!r} mixes formats ({', '.join(sorted(builders))}); "
            "keep one format per directory"
        )
    return builders.pop(), [str(p) for p in files]


def _load(builder: str, files: list[str], split: str, where: str) -> list[dict[str, Any]]:
    # Local files never need the network; set before `datasets` is imported so it sticks.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        # A throwaway cache dir keeps converted Arrow copies out of the user's HF cache.
        with tempfile.TemporaryDirectory(prefix="grpolab-data-") as cache_dir:
            ds = datasets.load_dataset(
                builder,
                data_files={split: files},
                split=split,
                cache_dir=cache_dir,
                keep_in_memory=True,
            )
            return ds.to_list()
    except StopIteration:  # what `datasets` raises for an empty JSON file
        return []
    except Exception as e:
        cause = e.__cause__ or e
        detail = " ".join(str(cause).split())[:300]
        raise ValueError(f"dataset {where!r}: could not read {builder} data: {detail}") from e
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


def _check_prompt(prompt: Any, index: int, column: str, where: str) -> None:
    """Prompts are strings or chat messages; anything else would fail much later in the trainer."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        return
    raise ValueError(
        f"dataset {where!r}: row {index} column {column!r} is {type(prompt).__name__} "
        f"{str(prompt)[:60]!r}; expected a string or a list of {{'role', 'content'}} messages"
    )


def load_rows(
    path: str,
    prompt_column: str = "prompt",
    answer_column: str | None = "answer",
    split: str = "train",
) -> list[dict[str, Any]]:
    """Load a local .jsonl/.json/.parquet/.csv file (or a directory of them) as a list of dicts.

    Each row keeps all original columns and gains ``prompt`` (from ``prompt_column``) and, if
    ``answer_column`` is set, ``answer``. Chat-style prompts (lists of messages) are kept as-is.
    """
    where = str(path)
    builder, files = _data_files(Path(path).expanduser(), split)
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"dataset {where!r} is empty")
    rows = _load(builder, files, split, where)
    if not rows:
        raise ValueError(f"dataset {where!r} is empty")

    columns = list(rows[0])
    for wanted, role in ((prompt_column, "prompt"), (answer_column, "answer")):
        if wanted is not None and wanted not in columns:
            raise ValueError(
                f"dataset {where!r} has no {role} column {wanted!r}; "
                f"columns are: {', '.join(columns)}"
            )

    out = []
    for i, row in enumerate(rows):
        prompt = row[prompt_column]
        _check_prompt(prompt, i, prompt_column, where)
        if isinstance(prompt, list):
            # Arrow unifies message structs, padding absent keys (e.g. `name`) with None;
            # drop those so chat templates do not render "None".
            prompt = [{k: v for k, v in m.items() if v is not None} for m in prompt]
        new = dict(row)
        new["prompt"] = prompt
        if answer_column is not None:
            new["answer"] = row[answer_column]
        out.append(new)
    return out
