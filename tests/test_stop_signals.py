"""Issue 18 replayed: runs that never hang, never lose or mix data, and never execute what they
load. Stop signals: SIGTERM finishes the step, checkpoints and resumes bitwise; a second signal
abandons the step and keeps what was written; from the CLI, one line and exit 128 + the signal.
(SIGTERM + --resume through a real subprocess is in test_resume.py.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import computed, metric_steps, run_cli, tiny_trainer, weights

from grpolab.run import checkpoint
from grpolab.run.report import read_metrics
from grpolab.run.trainer import RunStopped


def _signalling(at_calls: tuple[int, ...]) -> Any:
    """A reward (run in-process) that sends this process SIGTERM at the given calls."""
    calls = {"n": 0}

    def reward(prompts, completions, **_):
        calls["n"] += 1
        if calls["n"] in at_calls:
            os.kill(os.getpid(), signal.SIGTERM)
        return [float(c[:1] in "13579") for c in completions]

    reward.in_process = True
    return reward


def test_sigterm_finishes_the_step_checkpoints_and_resumes_bitwise(tmp_path: Path) -> None:
    plain = tiny_trainer(tmp_path / "plain", [_signalling(())], steps=5, checkpoint_every=5)
    plain.train()
    # calls: 1 = step-0 eval, then 2 a step (sampling, eval): the 6th is inside step 3
    stopped = tiny_trainer(tmp_path / "stop", [_signalling((6,))], steps=5, checkpoint_every=5)
    with pytest.raises(RunStopped) as info:
        stopped.train()
    assert info.value.exit_code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM after step 3 of 5" in str(info.value)
    assert checkpoint.read(tmp_path / "stop" / "checkpoints" / "last.pt")["step"] == 3
    assert metric_steps(tmp_path / "stop") == [0, 1, 2, 3]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    again = tiny_trainer(tmp_path / "stop", [_signalling(())], steps=5, checkpoint_every=5)
    again.train(resume=True)
    for k, v in weights(plain).items():
        assert torch.equal(weights(again)[k], v), k
    want = computed(read_metrics(tmp_path / "plain" / "metrics.jsonl"))
    assert computed(read_metrics(tmp_path / "stop" / "metrics.jsonl")) == want


def test_a_second_signal_abandons_the_step_and_keeps_what_was_written(tmp_path: Path) -> None:
    tr = tiny_trainer(tmp_path, [_signalling((6, 7))], steps=5, checkpoint_every=2)
    with pytest.raises(RunStopped, match="second SIGTERM: the step in flight was abandoned"):
        tr.train()
    assert checkpoint.read(tmp_path / "checkpoints" / "last.pt")["step"] == 2
    assert metric_steps(tmp_path) == [0, 1, 2]


@pytest.mark.slow
def test_sigterm_from_the_cli_exits_143_with_one_line(
        tmp_path: Path, world_args: list[str], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from grpolab.run import trainer

    real = trainer.GRPOTrainer.step

    def step_then_signal(self):
        rec = real(self)
        if rec["step"] == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return rec

    monkeypatch.setattr(trainer.GRPOTrainer, "step", step_then_signal)
    out = tmp_path / "run"
    code, err = run_cli(["workshop", "--out-dir", str(out), "--steps", "6", "--checkpoint-every",
                      "5", *world_args], capsys)
    assert code == 128 + signal.SIGUSR1 and len(err) == 1, err
    assert "stopped by SIGUSR1 after step 2 of 6" in err[0] and "--resume" in err[0]
    assert checkpoint.read(out / "checkpoints" / "last.pt")["step"] == 2  # 0 steps lost


@pytest.mark.slow
@pytest.mark.parametrize("signals", [1, 2])
def test_a_signal_while_the_final_files_are_written(
        tmp_path: Path, world_args: list[str], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, signals: int) -> None:
    """A preemption after the last step waits for the plot and summary (a model's save can
    take minutes), then exits 143 in one line; a second signal abandons them, and --resume
    writes them."""
    from grpolab.world import workshop

    real = workshop.finish_run

    def signalled_finish(*args, **kwargs):
        for _ in range(signals):
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(workshop, "finish_run", signalled_finish)
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), "--steps", "2", *world_args]
    code, err = run_cli(args, capsys)
    assert code == 128 + signal.SIGTERM and len(err) == 1, err
    if signals == 1:
        assert "after the last step" in err[0] and "the run is complete" in err[0]
        assert (out / "summary.json").exists()
    else:
        assert "writing the final model and summary was abandoned" in err[0]
        assert not (out / "summary.json").exists()
        monkeypatch.undo()
        assert run_cli([*args, "--resume"], capsys)[0] == 0
        assert (out / "summary.json").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize(("command", "said"), [
    ("eval", "stopped by SIGTERM: the evaluation writes its files at its end: none were written"),
    ("train", "stopped by SIGTERM: outside a training step (loading, or between runs)")])
def test_a_signal_outside_a_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch, command: str,
                                            said: str) -> None:
    """SIGTERM while grpolab eval works, or while train loads its model (before the run's own
    handlers): one line and 143, not a silent end."""
    from grpolab.app import commands, evaluate

    def signalled(*args: Any) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        return 0

    if command == "eval":
        monkeypatch.setattr(evaluate, "evaluate", signalled)
    else:
        monkeypatch.setattr(commands, "train", signalled)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    code, err = run_cli([command, "--model-path", "m", "--dataset", "d.jsonl",
                         *(["--eval-dataset", "d.jsonl"] if command == "eval" else []),
                         "--out-dir", str(tmp_path / "o")], capsys)
    assert code == 143 and len(err) == 1 and err[0].startswith(f"grpolab: {said}"), err
    assert {s: signal.getsignal(s) for s in before} == before  # (put back: none left behind)
