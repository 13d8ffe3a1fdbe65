"""Checkpoint and resume: a run killed with SIGKILL, or stopped with SIGTERM, and resumed
equals the uninterrupted run.

Runs go through the real CLI in a subprocess. The launcher swaps the workshop's exact-answer
reward for partial credit per digit: a barely fine-tuned policy (2 SFT steps keep the test
fast) almost never answers exactly, and with only dead groups the weights and the optimiser
state would never change, so bitwise equality would prove little.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import computed, files_under

from grpolab.config import Config
from grpolab.run.trainer import CheckpointError, GRPOTrainer
from grpolab.world.backend import TinyBackend
from grpolab.world.model import CharTokenizer, TinyConfig, TinyGPT
from grpolab.world.sft import sft_model
from grpolab.world.task import make_splits

LAUNCHER = '''
import os
import sys
import time

from grpolab.run import trainer
from grpolab.app.cli import main


slow = float(os.environ.get("SLOW_REWARD", "0"))


def digit_reward(prompts, completions, answer, **_):
    time.sleep(slow)  # (in a reward worker) so that a signal lands mid-step
    return [sum(x == y for x, y in zip(c, a)) / len(a) for c, a in zip(completions, answer)]


init = trainer.GRPOTrainer.__init__


def patched(self, cfg, backend, train_rows, reward_fns, *args, **kwargs):
    init(self, cfg, backend, train_rows, [digit_reward], *args, **kwargs)


trainer.GRPOTrainer.__init__ = patched
step = trainer.GRPOTrainer.step
pause_at = int(os.environ.get("PAUSE_AT_STEP", "0"))


def paused(self):
    rec = step(self)
    if rec["step"] == pause_at:  # metrics of this step are on disk; wait to be killed
        time.sleep(120)
    return rec


trainer.GRPOTrainer.step = paused
sys.exit(main(sys.argv[1:]))
'''
STEPS = 6
WORLD = ["--world-train-size", "64", "--world-heldout-size", "32", "--eval-size", "32"]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A launcher script and an SFT cache built once, so runs only load the start policy."""
    root = tmp_path_factory.mktemp("resume")
    sft_model(0, make_splits(0, 64, 32), 2, root / "cache")
    launcher = root / "launch.py"
    launcher.write_text(LAUNCHER)
    return {"root": root, "launcher": launcher, "cache": root / "cache"}


def _cmd(env: dict, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(env["launcher"]), "workshop", "--steps", str(STEPS),
            "--checkpoint-every", "2", "--sft-steps", "2", "--cache-dir", str(env["cache"]),
            "--out-dir", str(out), "--budget", "32", "--group-size", "4", "--curriculum",
            "--no-progress",
            *WORLD, *extra]


def _env(**extra: str) -> dict[str, str]:
    # One thread per run: runs share the CPU, and the thread count is fixed.
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _run(env: dict, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(env, out, *extra), check=False, capture_output=True, text=True,
                          timeout=120, env=_env())


def _metrics(out: Path) -> list[dict]:
    """The metrics lines without timings and run id (two runs compared have two ids)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len({r["run_id"] for r in rows}) == 1, "one run's lines carry one run id"
    return computed(rows)


def _last_step(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return -1
    steps = [-1]
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            pass  # a line being written right now
    return max(steps)


@pytest.fixture(scope="module")
def reference(env: dict) -> Path:
    """The uninterrupted run (checkpoints at steps 2, 4, 6)."""
    out = env["root"] / "reference"
    p = _run(env, out)
    assert p.returncode == 0, p.stderr
    return out


def _assert_same_run(got: Path, want: Path) -> None:
    assert _metrics(got) == _metrics(want)
    a = torch.load(got / "checkpoints" / "last.pt", weights_only=False)
    b = torch.load(want / "checkpoints" / "last.pt", weights_only=False)
    assert a["step"] == b["step"] == STEPS
    for k, v in b["backend"]["model"].items():
        assert torch.equal(a["backend"]["model"][k], v), k
    for i, s in b["optimizer"]["state"].items():
        assert all(torch.equal(a["optimizer"]["state"][i][k], s[k]) for k in s), i


@pytest.mark.slow
def test_killed_run_resumes_bitwise(env: dict, reference: Path) -> None:
    out = env["root"] / "killed"
    # Paused after step 3 (past the step-2 checkpoint, its metrics line written), so the kill
    # lands mid-run however slow the machine is; atomic writes are tested separately below.
    proc = subprocess.Popen(_cmd(env, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=_env(PAUSE_AT_STEP="3"))
    deadline = time.monotonic() + 90
    while _last_step(out) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"the run was not killed mid-way: {err[-2000:]}"
    ckpt = out / "checkpoints"
    assert torch.load(ckpt / "last.pt", weights_only=False)["step"] == 2
    assert _last_step(out) == 3  # a step past the checkpoint: resuming must drop its line

    p = _run(env, out, "--resume")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    _assert_same_run(out, reference)
    assert _metrics(out)[-1]["dead_share"] < 1.0, "some groups must carry gradient"
    assert [x.name for x in ckpt.iterdir() if ".tmp" in x.name] == []


@pytest.mark.slow  # (SIGUSR1 takes the same handler: tests/test_stop_signals.py runs it in
@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])  # process, for the time)
def test_sigterm_checkpoints_and_resumes_bitwise(env: dict, reference: Path,
                                                 sig: signal.Signals) -> None:
    """What a scheduler sends before preemption: the step in flight finishes, a checkpoint is
    written for it (none was due: --checkpoint-every 5), the process exits 128 + signal with
    one line, and --resume continues bitwise."""
    out = env["root"] / f"stopped-{sig.name}"
    proc = subprocess.Popen(_cmd(env, out, "--checkpoint-every", "5"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env(SLOW_REWARD="0.01"))
    deadline = time.monotonic() + 90
    while _last_step(out) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err[-2000:]
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"grpolab: stopped by {sig.name} after step")
    stopped = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert 2 <= stopped < STEPS
    assert f"after step {stopped} of {STEPS}" in lines[0] and "--resume" in lines[0]
    ckpt = out / "checkpoints"
    assert torch.load(ckpt / "last.pt", weights_only=True)["step"] == stopped  # nothing lost

    p = _run(env, out, "--resume")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    _assert_same_run(out, reference)


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x80\x02not a checkpoint" * 50)


@pytest.mark.slow
def test_corrupt_last_falls_back_to_prev(env: dict, reference: Path) -> None:
    out = env["root"] / "corrupt-last"
    shutil.copytree(reference, out)
    ckpt = out / "checkpoints"
    _garbage(ckpt / "last.pt")
    p = _run(env, out, "--resume")
    assert p.returncode == 0, p.stderr
    warning = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(warning) == 1 and "last.pt" in warning[0] and "prev.pt" in warning[0], p.stderr
    assert "step 4" in warning[0]
    _assert_same_run(out, reference)  # steps 5 and 6 redone from prev.pt, bitwise the same
    # The unreadable file was parked, not rotated over the good previous checkpoint.
    assert torch.load(ckpt / "prev.pt", weights_only=False)["step"] == 4
    assert (ckpt / "last.pt.corrupt").read_bytes().startswith(b"\x80\x02not a checkpoint")


@pytest.mark.slow
def test_both_corrupt_is_one_line_error_and_touches_nothing(env: dict, reference: Path) -> None:
    out = env["root"] / "corrupt-both"
    shutil.copytree(reference, out)
    ckpt = out / "checkpoints"
    _garbage(ckpt / "last.pt")
    (ckpt / "prev.pt").write_bytes(b"")
    before = files_under(out)  # (the out_dir lock aside: the refused run held it)
    p = _run(env, out, "--resume")
    assert p.returncode in (1, 2)
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("grpolab: error: no readable checkpoint")
    assert "last.pt" in lines[0] and "prev.pt" in lines[0]
    assert files_under(out) == before


# ------------------------------------------------------------------- in-process ----


def _tiny_trainer(out: Path) -> GRPOTrainer:
    torch.manual_seed(0)
    model = TinyGPT(TinyConfig(vocab_size=CharTokenizer().vocab_size, d_model=32, n_layers=1))
    splits = make_splits(0, 16, 4)
    cfg = Config(budget=8, group_size=4, progress=False, out_dir=str(out))
    return GRPOTrainer(cfg, TinyBackend(model), splits.train, [lambda p, c, **_: [0.0] * len(c)],
                       out_dir=out)


def test_crash_while_writing_keeps_both_checkpoints(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash before the rename leaves last.pt and prev.pt as they were, and complete."""
    tr = _tiny_trainer(tmp_path)
    ckpt = tmp_path / "checkpoints"
    tr.step_num = 1
    tr.save_checkpoint()
    tr.step_num = 2
    tr.save_checkpoint()
    before = {n: (ckpt / n).read_bytes() for n in ("last.pt", "prev.pt")}
    (ckpt / ".last.pt.tmp99999999").write_bytes(b"torn")  # left by a killed writer

    def crash(fd: int) -> None:
        raise OSError("simulated crash during the write")

    monkeypatch.setattr("grpolab.run.checkpoint.os.fsync", crash)
    tr.step_num = 3
    with pytest.raises(OSError, match="simulated"):
        tr.save_checkpoint()
    assert {n: (ckpt / n).read_bytes() for n in ("last.pt", "prev.pt")} == before
    monkeypatch.undo()

    assert tr.load_checkpoint() == 2
    tr.step_num = 3
    tr.save_checkpoint()
    assert sorted(p.name for p in ckpt.iterdir()) == ["last.pt", "prev.pt"]  # stale tmp gone
    assert torch.load(ckpt / "prev.pt", weights_only=False)["step"] == 2


def test_resume_without_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        _tiny_trainer(tmp_path).train(resume=True)
    assert not (tmp_path / "metrics.jsonl").exists()
