"""bench/vs_trl.py runs end to end on tiny settings (no timing assertions: targets live there)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "vs_trl.py"
NUM = r"([0-9]+(?:\.[0-9]+)?)"


def test_vs_trl_prints_both_rates_and_ratio(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH), "--steps", "1", "--rounds", "1", "--batch", "8",
           "--group-size", "4", "--max-new-tokens", "8", "--hidden", "32", "--layers", "1",
           "--sample-batch", "16", "--sample-repeats", "1"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    rates = {}
    for name in ("TRL", "grpolab"):
        # steps/s, s/step, steps/cpu-s, tok/step, width, gen tok/s
        m = re.search(rf"^{name}" + rf"\s+{NUM}" * 6, out, re.MULTILINE)
        assert m, f"no {name} row in:\n{out}"
        rates[name] = float(m.group(1))
        assert rates[name] > 0 and float(m.group(3)) > 0
        assert float(m.group(4)) > 0  # generated tokens per step
        assert float(m.group(5)) <= 8  # padded width never exceeds --max-new-tokens
    m = re.search(rf"ratio grpolab / TRL \(steps/s\): {NUM}x", out)
    assert m, out
    assert float(m.group(1)) == pytest.approx(rates["grpolab"] / rates["TRL"], rel=0.02)
    assert re.search(rf"on CPU time .*: {NUM}x", out)
    # Counted work: TRL runs each group's prompt G times, grpolab once, so TRL does more.
    work = {}
    for name in ("TRL", "grpolab"):
        m = re.search(rf"^  {name}\s+{NUM} GFLOP  floor\s+{NUM} ms/step  measured\s+{NUM} "
                      rf"ms/step = {NUM}x its floor", out, re.MULTILINE)
        assert m, f"no {name} work line in:\n{out}"
        work[name] = float(m.group(1))
        assert float(m.group(4)) == pytest.approx(float(m.group(3)) / float(m.group(2)),
                                                  rel=0.01)  # (printed to 4 digits)
    assert work["TRL"] > work["grpolab"] > 0
    m = re.search(rf"TRL does {NUM}x grpolab's work.*could reach .*: {NUM}x", out)
    assert m and float(m.group(1)) == pytest.approx(work["TRL"] / work["grpolab"], rel=0.01)
    for label in ("KV cache (TinyBackend.generate)", "KV cache (HFBackend.generate)",
                  "no cache (naive)", "forward-only bound"):
        assert label in out
    assert out.count("KV cache / forward bound") == 2
    assert not any(tmp_path.iterdir())  # everything went to a temporary directory
    assert elapsed < 60, f"the tiny benchmark took {elapsed:.0f}s"
