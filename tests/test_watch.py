"""The reward-hacking watch: hand values, and a run where it fires."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from grpolab.run.watch import hacking_suspected, reward_rise


def test_reward_rise_compares_the_last_window_with_the_first() -> None:
    assert reward_rise([0.1, 0.2, 0.3], window=2) is None  # fewer than two windows
    assert reward_rise([0.0, 0.2, 0.5, 0.9], window=2) == pytest.approx(0.6)
    assert reward_rise([0.5, 0.5, 0.5, 0.5, 0.5], window=2) == 0.0


def test_hacking_suspected_needs_the_gap_to_reach_the_margin() -> None:
    assert hacking_suspected(0.5, 0.0, 0.2)
    assert hacking_suspected(0.1, -0.15, 0.2)  # reward up while the check falls
    assert not hacking_suspected(0.5, 0.4, 0.2)  # both rose: learning, not hacking
    assert not hacking_suspected(0.19, 0.0, 0.2)
    assert not hacking_suspected(None, 0.0, 0.2) and not hacking_suspected(0.5, None, 0.2)


@pytest.mark.slow  # subprocesses / a full run: not in the quick subset
def test_the_watch_fires_when_training_reward_climbs_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A reward that pays more every step (whatever the model writes) against a strict check
    that never passes: the run must flag it, in the metrics and with one warning line."""
    from grpolab.app import cli
    from grpolab.rollout.tinyhf import make_tiny_model

    model = make_tiny_model(tmp_path / "m", arch="llama", hidden=32, heads=4)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": "never"}) + "\n"
                            for i in range(8)))
    rewards = tmp_path / "climbing.py"
    rewards.write_text(
        "calls = [0]\n"
        "def climbing(prompts, completions, **kw):\n"
        "    calls[0] += 1\n"
        "    return [min(1.0, 0.1 * calls[0]) if i % 2 else 0.0 for i in range(len(completions))]\n"
        "climbing.in_process = True  # its call counter must live in the trainer's process\n"
    )
    out = tmp_path / "run"
    argv = ["train", "--model-path", model, "--dataset", str(data), "--eval-dataset", str(data),
            "--rewards", f"{rewards}:climbing", "--watch-reward", "math", "--watch-window", "2",
            "--steps", "6", "--eval-every", "2", "--budget", "8", "--group-size", "4", "--max-new-tokens", "4",
            "--eval-size", "4", "--out-dir", str(out), "--no-progress", "--checkpoint-every", "0"]
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        assert cli.main(argv) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["step"] >= 1]
    assert [r["heldout_check_acc"] for r in steps] == [None, 0.0, None, 0.0, None, 0.0]
    assert [r["hacking_suspected"] for r in steps][:3] == [False, False, False]  # < 2 windows
    assert steps[-1]["hacking_suspected"] and steps[-1]["watch_train_rise"] >= 0.2
    # judged at evaluations (steps 2, 4, 6); a step between them carries the last verdict
    first = next(r["step"] for r in steps if r["hacking_suspected"])
    assert first in (4, 6)
    assert all(r["hacking_suspected"] for r in steps if r["step"] >= first)
    fired = [m for m in caplog.messages if "reward hacking suspected" in m]
    assert len(fired) == 1
    # without held-out prompts the watch would check nothing: refused before the run
    at = argv.index("--eval-dataset")
    bare = [*argv[:at], *argv[at + 2 : argv.index("--out-dir")]]
    assert cli.main([*bare, "--out-dir", str(tmp_path / "bare"), "--no-progress"]) == 2
    assert not (tmp_path / "bare" / "metrics.jsonl").exists()
