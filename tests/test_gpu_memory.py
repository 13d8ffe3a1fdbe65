"""bench/gpu_memory.py: the replay of a torch.cuda allocation trace to its peak, by hand on the
CPU, and on a GPU against torch's own peak; bench/saved_tensors.py's count of what autograd
keeps for backward; bench/decode_profile.py's report, on the CPU and on a GPU."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from decode_profile import main as decode_profile
from gpu_memory import owner, peak_owners, trace_step
from saved_tensors import saved_by_owner

TORCH = {"filename": "/v/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"}
OURS = {"filename": "/w/main/grpolab/rollout/fastlm.py", "line": 372, "name": "_attention"}
HF = {"filename": "/v/lib/python3.12/site-packages/transformers/models/llama/x.py",
      "line": 50, "name": "forward"}


def ev(action: str, addr: int, size: int, *frames: dict) -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


def test_owner_is_the_innermost_frame_outside_torch() -> None:
    assert owner([TORCH, OURS, HF]) == "grpolab/rollout/fastlm.py:372 _attention"
    assert owner([TORCH, HF]) == "transformers/models/llama/x.py:50 forward"
    assert owner([TORCH]) == "torch internals" and owner([]) == "no Python stack"


def test_peak_owners_by_hand() -> None:
    mib = 2**20
    trace = [
        ev("free_completed", 99, 30 * mib),  # a block from before the trace: 1000 -> 970
        ev("alloc", 1, 100 * mib, TORCH, OURS),  # 1070
        ev("alloc", 2, 50 * mib, HF),  # 1120: the peak
        ev("free_requested", 1, 100 * mib),  # (still allocated until completed)
        ev("free_completed", 1, 100 * mib),  # 1020
        ev("alloc", 3, 90 * mib, OURS),  # 1110: not above the peak
        ev("alloc", 4, 5 * mib),  # 1115
    ]
    got = peak_owners(trace, 1000 * mib, top=1)
    assert got["peak_mib"] == 1120 and got["before_mib"] == 970
    assert got["owners"] == [["grpolab/rollout/fastlm.py:372 _attention", 100.0]]
    assert got["rest_mib"] == 50
    assert peak_owners([], 7 * mib) == {"peak_mib": 7, "before_mib": 7, "owners": [],
                                        "rest_mib": 0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trace_step_agrees_with_torchs_peak() -> None:
    keep = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # live before the step

    def step() -> None:
        a = torch.ones(2048, 2048, device="cuda")  # 16 MiB
        b = a @ a  # 16 MiB more: the peak
        del a, b

    got = trace_step(step)
    assert got["before_mib"] >= 64 and keep.numel()
    assert got["peak_mib"] == pytest.approx(got["max_allocated_mib"], abs=1)
    assert sum(mib for _, mib in got["owners"]) + got["rest_mib"] == pytest.approx(
        got["peak_mib"] - got["before_mib"])
    assert any("test_gpu_memory.py" in who for who, _ in got["owners"])


def test_saved_by_owner_counts_each_storage_once_by_line() -> None:
    w = torch.randn(8, 4, requires_grad=True)  # a weight: held anyway, not counted
    x = torch.randn(16, 8, requires_grad=True)

    def forward() -> None:
        h = x @ w  # keeps x (512 B) and w
        y = h.sin()  # keeps h (256 B)
        (y * h).sum()  # keeps y (256 B) and h again (counted once)

    by = saved_by_owner(forward, {w.untyped_storage().data_ptr()})
    assert sum(by.values()) == 512 + 256 + 256
    assert all(who.startswith("tests/test_gpu_memory.py:") for who in by)
    assert sorted(by.values()) == [256, 256, 512]  # by line: h.sin(), y * h, x @ w


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_decode_profile_reports_the_step(tmp_path, capsys: pytest.CaptureFixture,
                                         device: str) -> None:
    """The decode profile on a tiny model: tokens/s is rows x new tokens over the sampling
    time, a step's kernels (CUDA, with the replayed step) or operators (CPU) counted."""
    from grpolab.rollout.tinyhf import make_tiny_model

    path = make_tiny_model(tmp_path / "m", hidden=32, heads=4, kv_heads=2)
    assert decode_profile([path, "--device", device, "--dtype", "float32", "--rows", "12",
                           "--new", "10", "--lora", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "12 rows x 10 tokens" in out
    secs, rate = re.search(r"sampling: ([0-9.]+) s, ([0-9,]+) tokens/s", out).groups()
    assert abs(float(rate.replace(",", "")) - 120 / float(secs)) <= 0.01 * 120 / float(secs) + 1
    unit = "kernels" if device == "cuda" else "operators"
    n = int(re.search(rf"; ([0-9]+) {unit} a step", out).group(1))
    assert n > 20  # two layers' projections, norms and attention at least
    assert ("replayed" in out) == (device == "cuda")


@pytest.mark.slow
def test_decode_profile_compiles_the_step_with_fewer_operators(
        tmp_path, capsys: pytest.CaptureFixture) -> None:
    """``--compile`` (an experiment for the GPU: do fused kernels pay?) compiles the step with
    inductor on the GPU's layout and reports fewer operators a step than the eager step's."""
    from grpolab.rollout.tinyhf import make_tiny_model

    path = make_tiny_model(tmp_path / "m", hidden=32, heads=4, kv_heads=2)
    try:
        assert decode_profile([path, "--device", "cpu", "--dtype", "float32", "--rows", "8",
                               "--new", "6", "--lora", "--top", "3", "--compile"]) == 0
    finally:
        torch._dynamo.reset()  # no compiled code left for later tests
    out = capsys.readouterr().out
    eager = int(re.search(r"; ([0-9]+) operators a step", out).group(1))
    fused = re.search(r"compiled step: [0-9.]+ ms a call; ([0-9]+) operators a step", out)
    assert fused is not None, out[-400:]
    assert int(fused.group(1)) < eager
