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

pytestmark = [pytest.mark.slow, pytest.mark.trl]  # the benches, in subprocesses

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


REAL = BENCH.parent / "vs_trl_real.py"


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from grpolab.rollout.tinyhf import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-chat"), hidden=32, heads=4,
                           chat_template=True)


def run_real(model: str, tmp_path: Path, *extra: str) -> str:
    cmd = [sys.executable, str(REAL), "--model", model, "--rounds", "1", "--steps", "1",
           "--warmup", "0", "--batch", "8", "--group-size", "4", "--max-new-tokens", "6",
           "--threads", "1", "--no-flops", *extra]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def row(out: str, name: str) -> list[str]:
    m = re.search(rf"^\| {re.escape(name)} \|(.*)\|$", out, re.MULTILINE)
    assert m, f"no {name!r} row in:\n{out}"
    return [c.strip() for c in m.group(1).split("|")]


# float32, the default, runs in the levers and lengths tests; here the dtype reaching both
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_real_model_bench_side_by_side_at_fixed_length(tiny_chat_model: str,
                                                       tmp_path: Path, dtype: str) -> None:
    """Both trainers in their own processes on one HF folder; with --fixed-length every
    completion runs to --max-new-tokens in both, so the work is equal: 8 x 6 tokens; --dtype
    bfloat16 runs both in bfloat16 (TRL bf16=True, grpolab dtype bfloat16)."""
    out = run_real(tiny_chat_model, tmp_path, "--fixed-length", "--dtype", dtype)
    assert f"q_proj,k_proj,v_proj,o_proj, {dtype}, 1 threads" in out
    for name in ("TRL GRPOTrainer", "grpolab"):
        cells = row(out, name)
        assert float(cells[0]) > 0  # steps/s
        assert float(cells[6]) == 48  # tokens/step
        assert float(cells[8]) > 0  # peak RSS
    assert re.search(r"ratio grpolab / TRL: [0-9.]+x steps/s", out)


def test_real_model_bench_levers_and_lengths(tiny_chat_model: str, tmp_path: Path) -> None:
    """--levers runs grpolab variants against the build as shipped; --lengths measures both
    trainers (and the variants) at each completion length."""
    # (bf16 is the side-by-side test's dtype: not run again here, for the suite's time)
    out = run_real(tiny_chat_model, tmp_path, "--levers", "full,no-chunk", "--fixed-length")
    assert row(out, "full")[-2:] == ["1.00x", "1.00x"]
    for lever in ("no-chunk",):
        assert float(row(out, lever)[5]) == 48  # the same work in every variant
    out = run_real(tiny_chat_model, tmp_path, "--lengths", "5", "--levers", "micro4")
    for n in (5,):
        for name in ("TRL GRPOTrainer", "grpolab full", "grpolab micro4"):
            m = re.search(rf"^\| {n} \| {name} \|(.*)\|$", out, re.MULTILINE)
            assert m, out
            cells = [c.strip() for c in m.group(1).split("|")]
            assert float(cells[4]) == 8 * n  # tokens/step: no EOS before the length


def test_real_model_bench_ab_alternates_levers_in_one_process(tiny_chat_model: str,
                                                             tmp_path: Path) -> None:
    """--ab: after a warm-up, each round runs one step as shipped and one per lever switched
    off, all in one process; the table averages them against the shipped steps."""
    levers = ("no-pack", "no-chunk", "no-early-exit", "no-buckets")
    out = run_real(tiny_chat_model, tmp_path, "--ab", ",".join(levers), "--rounds", "2",
                   "--fixed-length")
    full = row(out, "full: as shipped")
    assert full[0] == "2" and full[-1] == "1.00x"
    assert full[5] == "48" and float(full[6]) > 0  # tokens/step, generation ms per token
    for lever in levers:
        assert len(re.findall(rf"round \d {lever}", out)) == 2
        m = re.search(rf"^\| {lever}: [^|]+\| 2 \| ([0-9.]+) \|", out, re.MULTILINE)
        assert m and float(m.group(1)) > 0, out


def test_real_model_bench_refuses_a_model_without_chat_template(tmp_path: Path) -> None:
    """Both trainers get chat-templated prompts: a tokenizer without a template is refused
    in one line before any child starts (TRL's child died in a long traceback); --help gives
    every flag's help and default."""
    from grpolab.rollout.tinyhf import make_tiny_model

    plain = make_tiny_model(tmp_path / "plain", hidden=32, heads=4)  # no chat template
    cmd = [sys.executable, str(REAL), "--model", plain, "--rounds", "1", "--steps", "1",
           "--warmup", "0", "--batch", "8", "--group-size", "4", "--max-new-tokens", "6"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    said = (f"vs_trl_real.py: error: the tokenizer of {plain} has no chat template; this "
            "benchmark gives both trainers chat-templated prompts, so it needs one (an instruct "
            "model, or make_tiny_model(..., chat_template=True))")
    assert proc.stderr.strip().splitlines() == [said]
    assert "model " not in proc.stdout  # refused before the run's header, and any child
    help_text = subprocess.run([sys.executable, str(REAL), "--help"], check=True,
                               capture_output=True, text=True, timeout=60).stdout
    entries = {" ".join(e.split()).split(" ", 1)[0]: " ".join(e.split())
               for e in re.split(r"\n  (?=-)", help_text)}  # each option with its help
    for flag, default in (("--group-size", "8"), ("--lr", "1e-05"), ("--beta", "0.04"),
                          ("--seed", "0")):
        m = re.fullmatch(rf"{flag} [A-Z_]+ (.+) \(default: ([^)]*)\)", entries[flag])
        assert m and m.group(2) == default, entries[flag]
    assert "(default: )" not in help_text


def test_real_model_report_on_cuda_by_hand() -> None:
    """The report of a CUDA run from made-up children: GPU memory in the table and as a ratio,
    the allocator's reserved peak beside it, tokens/s of the step and of generation, seconds to
    the millisecond, no CPU-time ratio (the host spins in synchronize), the versions, how often
    graphs were captured and, loudly, a capture that failed; numbers by hand."""
    import argparse

    sys.path.insert(0, str(BENCH.parent))
    from vs_trl_real import print_report

    def child(who: str, time_s: float, peak: float, reserved: float) -> dict:
        return {"trainer": who, "round": 0, "steps": 2, "time": time_s, "cpu": time_s,
                "tokens": 2 * 65536, "width": 256, "peak_rss_mib": peak,
                "rss_after_build_mib": 300.0, "trainable": 921600, "load": (0.5, 0.5),
                "reserved_mib": reserved, "split": {"gen": 0.5 * time_s, "ref": 0.1 * time_s,
                                                    "pol": 0.2 * time_s}}

    res = {"trl": [child("trl", 24.0, 50000.0, 52000.0)],
           "lab": [child("lab", 4.0, 20000.0, 26000.0) | {"graph_builds": 1}]}
    args = argparse.Namespace(device="cuda", threads=16, dtype="bfloat16", fixed_length=True)
    info = {"cpu": "a GPU host", "nproc": 16, "versions": "torch 2.11.0, trl 1.16.0"}
    out = print_report(args, res, None, info)
    lab = [c.strip() for c in next(ln for ln in out.splitlines()
                                   if ln.startswith("| grpolab ")).split("|")[1:-1]]
    assert "| peak GPU MiB |" in out
    assert lab[1:3] == ["0.5000", "2.000"] and lab[4] == "0.200"  # ref: 0.1 x 4 s / 2 steps
    # 131072 tokens / 4 s; generation: 65536 a step in 1 s; then the peak
    assert lab[8:11] == ["32768.0", "65536.0", "20000"]
    assert "6.00x steps/s" in out and "peak GPU 0.40x TRL's" in out
    assert "6.00x generation's tokens/s" in out and "CPU-second" not in out  # TRL: 65536 / 6 s
    assert "torch threads 16; torch 2.11.0, trl 1.16.0;" in out
    assert "TRL 52000 MiB, grpolab 26000 MiB (0.50x TRL's)" in out
    assert "capturing its graphs) in grpolab's timed steps: 1 in 2 steps" in out
    assert "CAPTURE FAILED" not in out
    res["lab"][0]["graph_failed"] = "operation not permitted when stream is capturing"
    out = print_report(args, res, None, info)
    assert ("CUDA GRAPH CAPTURE FAILED (operation not permitted when stream is capturing): "
            "grpolab decoded uncaptured") in out
