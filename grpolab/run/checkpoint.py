"""Checkpoint files: atomic writes, safe reads, a content hash, and which run a folder holds.

A checkpoint is a plain ``torch.save`` dict of tensors and built-in types, so it is read with
``torch.load(..., weights_only=True)``: a file that carries a pickled program is refused, not
run. Each file also carries ``sha256``, a hash of its content (every key, value and tensor byte)
computed before writing and checked after reading, so bytes changed on disk (a bad sector, a
torn copy, an edit) are caught even where the file still unpickles. ``run_id`` ties the file
to the metrics of the run that wrote it.

The trainer's state (``GRPOTrainer.state_dict``: weights, optimiser, every RNG stream, the
prompt sampler, the posteriors, the watch's history) is written by ``save`` and read back by
``load_newest``: a resumed run continues bitwise. ``claim_out_dir`` keeps two runs out of one
folder, one after another; ``out_dir_lock`` (an exclusive ``flock`` on ``LOCK_FILE``, held for
the run's life) keeps out a second run started at the same time. This module reads and writes
files; it knows nothing of the trainer.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import struct
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from grpolab.config import ConfigError
from grpolab.run import dist, export

log = logging.getLogger("grpolab")

LAST, PREV = "last.pt", "prev.pt"
RUN_FILES = ("metrics.jsonl", "samples.jsonl")  # what a run writes beside checkpoints/
# what a finished run leaves besides (--overwrite deletes these too, so that a replacing run
# that fails leaves nothing of the old one looking current); trackers' folders are per run_id
RUN_OUTPUTS = ("config.json", "summary.json", "train.png", "workshop.png", "calibration.png")
LOCK_FILE = ".grpolab.lock"  # flock'ed by the live run; never deleted (unlinking races)


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


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as JSON at ``path``, atomically (a reader sees the old file or the new one)."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def write_config(out_dir: Path, config: dict[str, Any], resumed_at: int | None = None,
                 changed: bool = False) -> None:
    """``config.json``: the config as the run goes on (written once the metrics writers have
    accepted the folder). A resume at step ``resumed_at`` with no step left leaves it as it
    was; one with ``changed`` settings first keeps the config that trained the steps so far as
    ``config.until-step-<N>.json``."""
    path = out_dir / "config.json"
    if resumed_at is not None:
        if resumed_at >= config["steps"]:
            return
        kept = out_dir / f"config.until-step-{resumed_at}.json"
        if changed and path.exists() and not kept.exists():
            os.replace(path, kept)
    write_json(path, config)


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
    if Path(path).is_file() and not zipfile.is_zipfile(path):  # torch.save's format is a zip
        raise CheckpointError("not a checkpoint file (not torch's zip format: truncated, "
                              "overwritten or another kind of file)")
    try:
        st = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused an object: never run
        raise CheckpointError("refused: it holds objects other than tensors and plain values, "
                              "which could run code when loaded") from e
    except Exception as e:  # any other unreadable file is reported the same way
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


def has_checkpoint(out_dir: str | os.PathLike) -> bool:
    """Whether out_dir holds a checkpoint (last.pt or prev.pt), as this process sees it."""
    return any((Path(out_dir).expanduser() / "checkpoints" / n).exists() for n in (LAST, PREV))


def holds_run(out_dir: str | os.PathLike) -> bool:
    """Whether a folder already holds (part of) a run: metrics lines or a checkpoint."""
    d = Path(out_dir)
    if has_checkpoint(d):
        return True
    return any((d / n).is_file() and (d / n).stat().st_size > 0 for n in RUN_FILES)


def holds_checkpoint(out_dir: str | os.PathLike) -> bool:
    """``has_checkpoint`` as rank 0 sees it (every rank agrees: collective under torchrun)."""
    held = has_checkpoint(out_dir)
    return dist.all_gather_object(held)[0] if dist.is_dist() else held


def clear_run(out_dir: str | os.PathLike) -> None:
    """Remove what a run wrote in ``out_dir`` (metrics, samples, checkpoints, its config,
    summary, plots, final/ and checkpoint-<step>/ models) and nothing else: ``--overwrite``
    replaces a run; it does not empty the folder."""
    d = Path(out_dir)
    for n in (*RUN_FILES, *RUN_OUTPUTS):
        (d / n).unlink(missing_ok=True)
    for p in d.glob("config.until-step-*.json"):
        p.unlink(missing_ok=True)
    export.clear(d)
    ckpt = d / "checkpoints"
    if ckpt.is_dir():
        for p in ckpt.iterdir():
            if p.is_file() and (p.name.startswith((LAST, PREV)) or ".pt.tmp" in p.name):
                p.unlink()


def unclaim(out_dir: Path) -> None:
    """A new run's files (log, config) go after a mistake before step 1: the rerun's folder."""
    for name in (*RUN_FILES, "config.json"):
        (Path(out_dir) / name).unlink(missing_ok=True)


def claim_out_dir(out_dir: Path, overwrite: bool) -> None:
    """A new run's folder must not hold another run: refuse, or clear it on ``overwrite``."""
    from grpolab.run.report import read_metrics

    held = dist.all_reduce_sum([float(holds_run(out_dir))])[0]
    theirs = [] if held else export.foreign_outputs(out_dir)  # (a model folder, say; rank
    theirs = dist.all_gather_object(theirs)[0] if dist.is_dist() else theirs  # 0's answer)
    if theirs:
        raise ConfigError(f"out_dir {out_dir} holds {', '.join(theirs)} of no grpolab run (a "
                          "model's or another tool's files), which a run would write over: "
                          "choose another out_dir")
    if not held:  # (every rank looked before rank 0 may clear anything)
        return
    if not overwrite:
        last = (read_metrics(out_dir / "metrics.jsonl") or [{}])[-1]
        what = f" (run {last['run_id']}, step {last.get('step')})" if last.get("run_id") else ""
        raise ConfigError(f"out_dir {out_dir} already holds a run{what}; continue it "
                          "with --resume, replace it with --overwrite, or choose another "
                          "--out-dir")
    if dist.is_main():
        clear_run(out_dir)
    dist.all_reduce_sum([0.0])  # no rank starts before rank 0 has cleared the folder


_HELD: dict[str, list[Any]] = {}  # folder -> [lock file (rank 0) or None, nesting depth]


def lock_holder(out_dir: str | os.PathLike) -> int | None:
    """The pid of the live run holding ``out_dir``'s lock (0 when unknown), or None when free."""
    path = Path(out_dir) / LOCK_FILE
    if str(Path(out_dir).resolve()) in _HELD:
        return os.getpid()
    try:
        f = open(path)  # noqa: SIM115 - closed below (read-only: a look creates nothing)
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            text = f.read().strip()
            return int(text) if text.isdigit() else 0
        return None


def busy_error(out_dir: str | os.PathLike, pid: int) -> ConfigError:
    who = f"pid {pid}" if pid else "another process"
    return ConfigError(f"out_dir {out_dir} is in use by another grpolab run ({who}); wait for "
                       "it to end, or choose another --out-dir")


@contextlib.contextmanager
def out_dir_lock(out_dir: str | os.PathLike) -> Iterator[None]:
    """Hold ``out_dir``'s exclusive lock for the block (collective under torchrun: rank 0 holds
    it). Nested holds in one process are free; a folder another live process holds is a
    ConfigError naming it and that pid. The kernel drops the lock when the process dies."""
    d = Path(out_dir)
    key = str(d.resolve())
    if key in _HELD:  # (the same nesting on every rank: no collective here)
        _HELD[key][1] += 1
        try:
            yield
        finally:
            _HELD[key][1] -= 1
        return
    f, pid = None, None
    if dist.is_main():
        d.mkdir(parents=True, exist_ok=True)
        f = open(d / LOCK_FILE, "a+")  # noqa: SIM115 - held open for the block
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            text = f.read().strip()
            pid = int(text) if text.isdigit() else 0
            f.close()
            f = None
        else:
            f.truncate(0)
            f.write(f"{os.getpid()}\n")
            f.flush()
    if dist.is_dist():  # every rank refuses together
        pid = dist.all_gather_object(pid)[0]
    if pid is not None:
        raise busy_error(out_dir, pid)
    _HELD[key] = [f, 1]
    try:
        yield
    finally:
        del _HELD[key]
        if f is not None:
            f.close()  # (the lock goes with the descriptor; the file stays)


# ---------------------------------------------------------------------- trainer files


def prune_dcp(ckpt_dir: Path, state: dict[str, Any]) -> None:
    """Keep the sharded-weights folders that last.pt (``state``) and prev.pt name; drop older."""
    if not state.get("dcp"):
        return
    keep = {state["dcp"]}
    with contextlib.suppress(CheckpointError, OSError, KeyError):
        keep.add(read(ckpt_dir / PREV).get("dcp"))
    for d in ckpt_dir.glob("dcp-*"):
        if d.name not in keep:
            shutil.rmtree(d, ignore_errors=True)


def save_sharded(ckpt_dir: Path, model: Any, opt: Any, step: int, run_id: str | None
                 ) -> dict[str, Any]:
    """Write (sharded) weights and optimizer state with torch.distributed.checkpoint into a
    new folder named by step and run (collective); the entries last.pt keeps to name it and
    its files' sha256."""
    from grpolab.run import shard

    name = dist.all_gather_object(f"dcp-{step:06d}-{run_id}")[0]  # rank 0's run id
    path = ckpt_dir / name
    if dist.is_main():
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(path, ignore_errors=True)  # a save of this step killed half-way
    dist.all_reduce_sum([0.0])  # (no rank writes before the folder is clean)
    shard.save_dcp(path, model, opt)
    dist.all_reduce_sum([0.0])  # every rank's file is written before rank 0 hashes them
    return {"backend": None, "optimizer": None, "dcp": name,
            "dcp_sha256": shard.files_hash(path) if dist.is_main() else {}}


def load_sharded(state: dict[str, Any], path: Path, model: Any, opt: Any) -> None:
    """Load the DCP folder that checkpoint ``path`` (content ``state``) names, written on any
    number of ranks, after checking its files against the hashes it carries."""
    from grpolab.run import shard

    folder = path.parent / state["dcp"]
    if not folder.is_dir():
        raise CheckpointError(f"{path} names the weights folder {folder.name}, which is missing")
    if shard.files_hash(folder) != state.get("dcp_sha256"):
        raise CheckpointError(f"the weights folder {folder} does not match the hashes in {path}")
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        shard.load_dcp(folder, model, opt)
    except (CheckpointException, pickle.UnpicklingError) as e:  # one line, not a rank dump
        raise CheckpointError(f"the weights folder {folder} cannot be loaded: "
                              f"{' '.join(str(e).split())[-300:]}") from e


def load_newest(ckpt_dir: Path, apply: Any, path: str | os.PathLike | None = None) -> Path:
    """Read the newest good checkpoint (``path``, else last.pt, else prev.pt) and hand its
    content to ``apply(state, path)``; the path used.

    Files are read with ``weights_only`` (a file carrying code is refused, never run) and
    their content hash is checked. Once a good one is found, each bad one is moved aside as
    ``<name>.corrupt`` and named in a warning; when none is good, the error names every file
    and nothing on disk changes.
    """
    candidates = [Path(path)] if path else [ckpt_dir / LAST, ckpt_dir / PREV]
    errors: list[str] = []
    bad: list[Path] = []
    for p in candidates:
        if not p.exists():
            continue
        try:
            st = read(p)
        except CheckpointError as e:
            errors.append(f"{p}: {e}")
            bad.append(p)
            continue
        apply(st, p)
        if errors and dist.is_main():
            moved = [move_aside(b).name for b in bad]
            log.warning("checkpoint unusable (%s), moved aside as %s; resumed from %s "
                        "(step %d) instead", "; ".join(errors), ", ".join(moved), p,
                        int(st["step"]))
        if "sha256" not in st and dist.is_main():
            log.warning("checkpoint %s has no content hash (written by an older grpolab): "
                        "loaded without that check", p)
        return p
    if errors:
        raise CheckpointError("no readable checkpoint to resume from: " + "; ".join(errors))
    raise CheckpointError(f"no checkpoint to resume from in {ckpt_dir}")
