"""Multi-process training helpers: ``torchrun --nproc-per-node N -m grpolab ...``.

GRPO's advantages are computed inside a group, so sharding whole groups across ranks needs no
reward exchange for the maths; only gradients (summed) and metrics (gathered) cross ranks. Every
helper is a no-op in a single process, so the trainer has one code path and a 1-process run is
bitwise the same as before.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as td


def env_world_size() -> int:
    """World size torchrun announced (1 when launched without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init() -> bool:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    gloo on CPU, nccl when CUDA is available (each rank then uses cuda:LOCAL_RANK). Returns
    whether this call created the group; a single process (no WORLD_SIZE > 1) does nothing.
    """
    if env_world_size() <= 1 or (td.is_available() and td.is_initialized()):
        return False
    if not td.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    # torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it is
    # first imported (torch._dynamo imports it on the first optimiser step). Imported after the
    # group exists, those defaults keep it alive past destroy_process_group, so gloo's worker
    # threads outlive Python's finalisation and can abort the process at exit ("terminate called
    # without an active exception", SIGABRT after a successful run). Imported first, they bind None.
    import torch.distributed.nn.functional

    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    td.init_process_group(backend=backend)
    return True


def cleanup() -> None:
    """Leave the process group (safe to call when none exists)."""
    if is_dist():
        td.destroy_process_group()


def is_dist() -> bool:
    return td.is_available() and td.is_initialized() and td.get_world_size() > 1


def world_size() -> int:
    return td.get_world_size() if is_dist() else 1


def rank() -> int:
    return td.get_rank() if is_dist() else 0


def is_main() -> bool:
    """Only rank 0 writes metrics, plots and checkpoints and prints."""
    return rank() == 0


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` in a single process)."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * world_size()
    td.all_gather_object(out, obj)
    return out


def gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's 1-D CPU tensor in rank order (sizes may differ)."""
    if not is_dist():
        return t
    return torch.cat([x.reshape(-1) for x in all_gather_object(t.detach().cpu())])


def _device() -> torch.device:
    if is_dist() and td.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum of a few float64 numbers over ranks (identity in a single process)."""
    if not is_dist():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    td.all_reduce(t, op=td.ReduceOp.SUM)
    return t.cpu().tolist()


def shard(n: int) -> tuple[int, int]:
    """This rank's contiguous slice [lo, hi) of n items (sizes differ by at most one)."""
    w, r = world_size(), rank()
    return n * r // w, n * (r + 1) // w


def sum_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum gradients over ranks in one flat all-reduce (what DDP does, minus the wrapper).

    Backends keep generating through the bare model, so no DDP wrapper is involved. A parameter
    without a gradient on every rank keeps ``grad=None`` (the optimiser skips it, as it would in
    one process); one that has a gradient anywhere gets zeros where it had none.
    """
    if not is_dist() or not params:
        return
    dev = params[0].device
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=_device())
    td.all_reduce(has, op=td.ReduceOp.SUM)
    live = [p for p, h in zip(params, has.tolist()) if h > 0]
    if not live:
        return
    flat = torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dev)
        for p in live
    ])
    comm = flat.to(_device())
    td.all_reduce(comm, op=td.ReduceOp.SUM)
    flat = comm.to(dev)
    off = 0
    for p in live:
        n = p.numel()
        g = flat[off : off + n].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
        off += n


def broadcast_module(module: torch.nn.Module) -> None:
    """Copy rank 0's parameters and buffers to every rank so all start identical."""
    if not is_dist():
        return
    dev = _device()
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            buf = t.data.to(dev)
            td.broadcast(buf, src=0)
            if buf.data_ptr() != t.data.data_ptr():
                t.data.copy_(buf.to(t.device))
