"""Checkpoint files: atomic writes, safe reads, a content hash, and which run a folder holds.

A checkpoint is a plain ``torch.save`` dict of tensors and built-in types, so it is read with
``torch.load(..., weights_only=True)``: a file that carries a pickled program is refused, not
run. Each file also carries ``sha256``, a hash of its content (every key, value and tensor byte)
computed before writing and checked after reading, so bytes changed on disk (a bad sector, a
torn copy, an edit) are caught even where the file still unpickles. ``run_id`` ties the file
to the metrics of the run that wrote it.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any

import torch

LAST, PREV = "last.pt", "prev.pt"
RUN_FILES = ("metrics.jsonl", "samples.jsonl")  # what a run writes beside checkpoints/


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: unreadable, altered, or written for another model."""


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


# ------------------------------------------------------------------------------ hashing


def content_hash(state: Any) -> str:
    """sha256 over a checkpoint's structure and values (the ``sha256`` key itself excluded).

    A canonical walk, not the file's bytes: the file is a zip whose layout torch may change,
    while the content is what a resumed run depends on.
    """
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != "sha256"} if isinstance(state, dict)
          else state)
    return h.hexdigest()


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)};".encode())
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)};".encode())
        for v in obj:
            _feed(h, v)
    elif isinstance(obj, float):
        h.update(b"F" + struct.pack("<d", obj))
    elif obj is None or isinstance(obj, (bool, int, str)):
        text = repr(obj).encode()
        h.update(f"{type(obj).__name__[0]}{len(text)};".encode() + text)
    elif isinstance(obj, (torch.dtype, torch.Size)):
        h.update(f"X{obj!r};".encode())
    else:
        raise TypeError(f"checkpoint content of type {type(obj).__name__} cannot be hashed")


# ------------------------------------------------------------------------------ writing


def fsync_dir(path: Path) -> None:
    """Make renames inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(state: dict[str, Any], ckpt_dir: Path) -> Path:
    """Write ``state`` (plus its ``sha256``) as last.pt atomically; the old last.pt becomes
    prev.pt.

    The new file is written to a temp name, fsynced and renamed over last.pt; prev.pt is
    swapped in through a hard link first, so at every instant last.pt (once it exists) and
    prev.pt are complete files: a kill at any point loses at most the newest checkpoint. A
    full disk or a read-only folder raises its OSError with the files as they were.
    """
    last, prev = ckpt_dir / LAST, ckpt_dir / PREV
    state = {**state, "sha256": content_hash(state)}
    pid = os.getpid()
    tmp, link = ckpt_dir / f".last.pt.tmp{pid}", ckpt_dir / f".prev.pt.tmp{pid}"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    try:
        for stale in ckpt_dir.glob(".*.pt.tmp*"):  # left by a killed run
            if not stale.name.endswith(f".tmp{pid}"):
                stale.unlink(missing_ok=True)
        buf = io.BytesIO()
        torch.save(state, buf)
        with open(tmp, "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        if last.exists():
            link.unlink(missing_ok=True)
            try:
                os.link(last, link)
            except OSError:  # no hard links on this filesystem
                shutil.copyfile(last, link)
            os.replace(link, prev)
        os.replace(tmp, last)
    finally:
        for p in (tmp, link):
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass
    fsync_dir(ckpt_dir)
    return last


# ------------------------------------------------------------------------------ reading


def read(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's content, checked: tensors and built-in types only (``weights_only``),
    and, when it carries one, a matching content hash. Raises CheckpointError otherwise."""
    try:
        st = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file is reported the same way
        first = (str(e).splitlines() or [""])[0][:120]
        raise CheckpointError(f"{type(e).__name__}: {first}") from e
    if not isinstance(st, dict) or "step" not in st:
        raise CheckpointError("not a grpolab checkpoint")
    want = st.get("sha256")
    if want is not None:
        try:
            got = content_hash(st)
        except TypeError as e:
            raise CheckpointError(str(e)) from e
        if got != want:
            raise CheckpointError("content hash mismatch (the file was altered or damaged)")
    return st


def move_aside(path: Path) -> Path:
    """Rename a bad checkpoint to ``<name>.corrupt`` (``.corrupt.1``, ... if taken): kept for
    inspection, never read again."""
    dest = path.with_name(path.name + ".corrupt")
    n = 0
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.corrupt.{n}")
    os.replace(path, dest)
    return dest


# ------------------------------------------------------------------------- run folders


def holds_run(out_dir: str | os.PathLike) -> bool:
    """Whether a folder already holds (part of) a run: metrics lines or a checkpoint."""
    d = Path(out_dir)
    if any((d / "checkpoints" / n).exists() for n in (LAST, PREV)):
        return True
    return any((d / n).is_file() and (d / n).stat().st_size > 0 for n in RUN_FILES)


def clear_run(out_dir: str | os.PathLike) -> None:
    """Remove what a run wrote in ``out_dir`` (metrics, samples, checkpoints) and nothing
    else: ``--overwrite`` replaces a run; it does not empty the folder."""
    d = Path(out_dir)
    for n in RUN_FILES:
        (d / n).unlink(missing_ok=True)
    ckpt = d / "checkpoints"
    if ckpt.is_dir():
        for p in ckpt.iterdir():
            if p.is_file() and (p.name.startswith((LAST, PREV)) or ".pt.tmp" in p.name):
                p.unlink()
