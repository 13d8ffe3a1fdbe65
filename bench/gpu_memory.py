"""Where a GPU step's peak memory goes: one step recorded with torch.cuda's memory history, its
allocation trace replayed to the moment the most bytes were allocated, and what was live then
summed by the line that asked for it (the innermost frame outside torch itself).

    trace_step(fn) -> {"peak_mib", "max_allocated_mib", "before_mib", "owners": [[line, MiB]],
                       "rest_mib"}

``before_mib``: bytes allocated before the step and still live at its peak (weights, optimizer
state, the reference, caches). ``max_allocated_mib`` is torch's own peak for the same step, a
check on the replay.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

MIB = 2**20


def owner(frames: list[dict[str, Any]]) -> str:
    """``path:line function`` of the innermost Python frame outside torch's own files."""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" in name or name.startswith("<") or not name:
            continue
        for mark in ("site-packages/", "dist-packages/"):
            if mark in name:
                name = name.rsplit(mark, 1)[1]
                break
        else:
            for mark in ("/grpolab/", "/bench/", "/tests/"):
                if mark in name:
                    name = mark[1:] + name.rsplit(mark, 1)[1]
                    break
        return f"{name}:{f.get('line', 0)} {f.get('name', '?')}"
    return "torch internals" if frames else "no Python stack"


def peak_owners(trace: list[dict[str, Any]], base: int, top: int = 8) -> dict[str, Any]:
    """Replay ``trace`` (one device's entries of ``torch.cuda.memory._snapshot()``) from
    ``base`` bytes allocated: the peak, the bytes from before the trace still live then, and
    the live bytes at the peak by owner (the ``top`` largest; the rest summed)."""
    now = peak = base
    at = -1
    for i, e in enumerate(trace):  # pass 1: when the peak is
        if e["action"] == "alloc":
            now += e["size"]
            if now > peak:
                peak, at = now, i
        elif e["action"] == "free_completed":
            now -= e["size"]
    live: dict[int, tuple[int, str]] = {}
    before = base
    for e in trace[: at + 1]:  # pass 2: what is live then
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], owner(e.get("frames") or []))
        elif e["action"] == "free_completed" and live.pop(e["addr"], None) is None:
            before -= e["size"]  # a block from before the trace
    by = Counter[str]()
    for size, who in live.values():
        by[who] += size
    ranked = by.most_common()
    return {"peak_mib": peak / MIB, "before_mib": before / MIB,
            "owners": [[who, size / MIB] for who, size in ranked[:top]],
            "rest_mib": sum(size for _, size in ranked[top:]) / MIB}


def trace_step(step: Callable[[], Any], top: int = 8) -> dict[str, Any]:
    """Run ``step()`` once on the current CUDA device under memory-history recording (Python
    stacks); ``peak_owners`` of its trace plus torch's own peak for the step."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    out = peak_owners(snap["device_traces"][torch.cuda.current_device()], base, top)
    out["max_allocated_mib"] = torch.cuda.max_memory_allocated() / MIB
    return out


def describe(who: str, m: dict[str, Any]) -> str:
    """One report line: the traced step's peak and what it is made of."""
    parts = ", ".join(f"{w} {mib:.0f}" for w, mib in m["owners"])
    return (f"{who}: one traced step peaks at {m['peak_mib']:.0f} MiB (torch: "
            f"{m['max_allocated_mib']:.0f}) = {m['before_mib']:.0f} from before the step "
            f"(weights, optimizer, reference) + live at the peak, MiB: {parts}, other "
            f"{m['rest_mib']:.0f}")
