"""Sharded full fine-tuning with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

``shard: fsdp`` under ``torchrun``: each decoder layer and the root of the policy (and of the
frozen reference copy) are wrapped with ``fully_shard`` on a 1-D mesh over all ranks, so each
rank keeps 1/N of the weights, of their gradients and of Adam's two moments. A forward gathers
one layer's weights at a time; sampling gathers the whole policy first (decode runs hundreds of
tiny forwards, and some model stacks read weights directly), so a rank briefly holds one full
copy of the weights during generation and evaluation, then frees it.

Gradients are *summed* over ranks (each rank's loss already carries its exact share of the
global loss, see ``core.losses.grpo_loss``): FSDP's default average is turned off, with plain SUM
collectives because gloo has no PREMUL_SUM. Checkpoints are written with
``torch.distributed.checkpoint`` (one file per rank plus a metadata file), so a run saved on N
ranks resumes on M, including one process without FSDP. The metadata is read with a restricted
unpickler: a file carrying code is refused, never run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import importlib
import io
import pickle
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpolab.run import dist

MODES = ("none", "fsdp")


def layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers to wrap one by one: the classes a Hugging Face model lists in
    ``_no_split_modules``, else the children of the model's (first) ModuleList."""
    names = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(lists[0]) if lists else []


def _fsdp_modules(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module | None) -> bool:
    # Nothing is sharded before FSDP is imported (importing it to check costs ~2 s).
    return (model is not None and "torch.distributed.fsdp" in sys.modules
            and bool(_fsdp_modules(model)))


def shard_module(model: nn.Module) -> None:
    """``fully_shard`` every decoder layer, then the root, over all ranks; gradients summed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if dist._device().type == "cuda" else "cpu"
    mesh = init_device_mesh(device, (dist.world_size(),))
    for layer in layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in _fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)  # sum, not mean: losses carry global shares
        m.set_force_sum_reduction_for_comms(True)  # (gloo has no PREMUL_SUM)


def shard_backend(backend: Any) -> None:
    """Shard a backend's policy and frozen reference in place (a no-op in one process).

    Sampling is wrapped to run on gathered weights; the lean HF forward (``fastlm``), which
    reads weight tensors directly, is switched off so every forward goes through FSDP's hooks.
    """
    if not dist.is_dist() or is_sharded(backend.model):
        return
    if getattr(backend, "lora", False):
        raise ValueError("shard: fsdp shards a full fine-tune; with LoRA the trained adapters "
                         "are small: run data-parallel (shard: none) instead")
    shard_module(backend.model)
    if getattr(backend, "ref", None) is not None:
        shard_module(backend.ref)
    for attr in ("_fast", "_fast_ref"):
        if hasattr(backend, attr):
            setattr(backend, attr, None)
    sample = backend.sample

    def gathered_sample(*args: Any, **kwargs: Any) -> torch.Tensor:
        with gathered(backend.model):
            return sample(*args, **kwargs)

    backend.sample = gathered_sample


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Hold the whole model unsharded (every rank a full copy) for the duration."""
    mods = _fsdp_modules(model)
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def set_sync(model: nn.Module, sync: bool) -> None:
    """Reduce gradients in this backward (the last micro-batch) or only accumulate them."""
    for m in _fsdp_modules(model):
        m.set_requires_gradient_sync(sync, recurse=False)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0's CPU (empty elsewhere); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


# ------------------------------------------------------------------------- checkpoints

_SAFE_PREFIXES = ("torch.distributed.checkpoint.", "torch.distributed.tensor.")
_SAFE = {("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"),
         ("builtins", "frozenset"), ("torch._utils", "_rebuild_tensor_v2"),
         ("torch", "device"), ("torch.serialization", "_get_layout"),
         ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
         ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Only the plain data classes DCP's metadata is made of; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE:
            return super().find_class(module, name)
        if module.startswith(_SAFE_PREFIXES):  # DCP's metadata dataclasses and enums only
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj)
                                          or issubclass(obj, enum.Enum)):
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}: refused")


def _reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(meta_path, "rb") as f:
                meta = _MetadataUnpickler(io.BytesIO(f.read())).load()
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return SafeReader(str(path))


def files_hash(path: Path) -> dict[str, str]:
    """sha256 of every file of a DCP folder (kept in last.pt, checked before loading)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).iterdir()) if p.is_file()}


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    """DCP warns when it runs without a process group; a one-process run (or resume) of an
    fsdp checkpoint is meant, so that warning alone is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable "
                                "or uninitialized", category=UserWarning)
        yield


def save_dcp(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Weights and optimizer state of every rank into ``path`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    with _one_process_is_meant():
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def load_dcp(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Load a DCP checkpoint written on any number of ranks into this (sharded or not) model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    try:  # Adam keeps no state before its first step: make the slots the checkpoint fills
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(opt)
    except ImportError:  # pragma: no cover - older torch
        pass
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    with _one_process_is_meant():
        dcp.load(state, storage_reader=_reader(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
