"""Model folders: ``final/`` and ``checkpoint-<step>/``, each written whole or not at all.

A model folder is what ``AutoModelForCausalLM.from_pretrained`` and ``grpolab eval
--model-path`` load: the weights (LoRA merged), the tokenizer and, with LoRA, the adapters
alone in ``adapter/`` (``backend.save_pretrained``). ``final/`` is the last step's, written
after the run; ``checkpoint-<step>/`` every ``save_model_every`` steps, as TRL names its
``save_steps`` folders, each carrying ``grpolab.json`` (its run and step) so that pruning,
``--overwrite`` and a resume touch only the folders a grpolab run wrote. Resuming uses
``checkpoints/`` (``grpolab.run.checkpoint``), not these. This module writes folders; it knows
nothing of the trainer.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from grpolab.config import ConfigError

PREFIX = "checkpoint-"
MARK = "grpolab.json"  # in each checkpoint-<step>/: {"run_id": ..., "step": ...}


def work_dirs(path: Path) -> tuple[Path, Path]:
    """``new_dir``'s folders beside ``path``: the one being written, the one being replaced."""
    return path.with_name(f".{path.name}.partial"), path.with_name(f".{path.name}.old")


@contextlib.contextmanager
def new_dir(path: Path) -> Iterator[Path]:
    """A folder written in full or not at all: the block fills a temporary sibling, which then
    takes ``path``'s place (a reader, or a run killed mid-write, never sees half of it)."""
    tmp, old = work_dirs(path)
    shutil.rmtree(tmp, ignore_errors=True)  # (a killed earlier attempt's)
    tmp.mkdir(parents=True)
    yield tmp
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save_model(backend: Any, path: Path, state_dict: dict | None = None,
               extra: Callable[[Path], None] | None = None) -> Path:
    """``backend``'s model (LoRA merged) and tokenizer as the folder ``path``, whole or absent;
    ``state_dict``: a sharded model's weights, gathered by the caller (collective); ``extra``
    writes more files into the folder before it is put in place (final/'s model card)."""
    with new_dir(path) as tmp:
        backend.save_pretrained(str(tmp), state_dict=state_dict)
        if extra is not None:
            extra(tmp)
    return path


def save_step(backend: Any, out_dir: Path, step: int, run_id: str | None,
              state_dict: dict | None = None, keep: int = 0) -> Path:
    """``checkpoint-<step>/`` in ``out_dir`` (replacing one of that step: a resume that repeats
    a step rewrites its folder), then only the newest ``keep`` of this run's kept (0: all)."""
    def mark(d: Path) -> None:
        (d / MARK).write_text(json.dumps({"run_id": run_id, "step": step}) + "\n")

    path = save_model(backend, out_dir / f"{PREFIX}{step}", state_dict, mark)
    if keep:
        for old in step_dirs(out_dir, run_id)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def _mark(d: Path) -> dict[str, Any] | None:
    """A checkpoint-<step>/ folder's grpolab.json (None: not a grpolab model folder)."""
    try:
        got = json.loads((d / MARK).read_text())
    except (OSError, ValueError, RecursionError):  # (a damaged file: not grpolab's mark)
        return None
    return got if isinstance(got, dict) else None


def _folders(out_dir: Path) -> list[tuple[int, Path, dict[str, Any] | None]]:
    """Every ``checkpoint-<step>/`` folder in ``out_dir``, whoever wrote it, oldest step first
    (by number: checkpoint-10 after checkpoint-9), with its mark (None: not grpolab's)."""
    found = [(int(d.name.removeprefix(PREFIX)), d) for d in Path(out_dir).glob(f"{PREFIX}*")
             if d.name.removeprefix(PREFIX).isdigit() and d.is_dir()]
    return [(step, d, _mark(d)) for step, d in sorted(found)]


def step_dirs(out_dir: Path, run_id: str | None = None) -> list[Path]:
    """The checkpoint-<step>/ folders grpolab wrote in ``out_dir`` (only run ``run_id``'s when
    given), oldest step first."""
    return [d for _, d, mark in _folders(out_dir)
            if mark is not None and (run_id is None or mark.get("run_id") == run_id)]


def _leftovers(out_dir: Path, *names: str) -> list[Path]:
    """What a stopped ``new_dir`` left beside the folders whose names start with one of
    ``names`` (``.<name>.partial``, ``.<name>.old``)."""
    return [w for name in names for w in Path(out_dir).glob(f".{name}*")
            if w.name.endswith((".partial", ".old"))]


def foreign_outputs(out_dir: Path) -> list[str]:
    """The files of a run's names in a folder that holds no run: a config.json that is no
    grpolab run's (a model's), a final/ or summary.json without the run that wrote them."""
    d, out = Path(out_dir), []
    try:
        mine = "group_size" in json.loads((d / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        mine = not (d / "config.json").exists()
    out += [] if mine else ["config.json"]
    return out + [n for n in ("final/", "summary.json") if (d / n.rstrip("/")).exists()]


def check_free(out_dir: Path, run_id: str | None) -> None:
    """Before a run writes model folders: a ``checkpoint-<step>/`` it did not write (another
    tool's, another run's) would be replaced at that step; refused in one line instead."""
    theirs = [d.name for _, d, mark in _folders(out_dir)
              if (mark or {}).get("run_id", object()) != run_id]
    if theirs:
        raise ConfigError(f"out_dir {out_dir} holds {', '.join(theirs[:3])} not written by this "
                          "run; its model folders would replace them: move them or choose "
                          "another out_dir")


def drop_after(out_dir: Path, step: int, run_id: str | None) -> None:
    """A resume at ``step``: run ``run_id``'s folders of later steps go (it trains those steps
    again and writes them anew; left, they would be of the steps it abandoned), with any
    folder a stopped save left half-written."""
    for d in step_dirs(out_dir, run_id):
        if int(d.name.removeprefix(PREFIX)) > step:
            shutil.rmtree(d, ignore_errors=True)
    for d in _leftovers(out_dir, PREFIX):
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


def clear(out_dir: Path) -> None:
    """``--overwrite``: the model folders a run wrote (final/, every grpolab checkpoint-<step>/,
    half-written ones) go; another tool's folders of those names stay."""
    d = Path(out_dir)
    for p in (d / "final", *step_dirs(d), *_leftovers(d, "final.", PREFIX)):
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
