"""Issue 18 replayed: runs that never hang, never lose or mix data, and never execute what they
load. Rewards: a hanging, exiting, raising or huge reward is stopped, counted or ends the run
with one line; async rewards are awaited; the built-in rewards are bounded; a reward module
never shadows an installed one. (Sandbox containment is in test_sandbox.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import metric_steps, run_cli, tiny_trainer

from grpolab.rewards.builtin import (
    THINK_ANSWER_PATTERN,
    format_reward,
    load_reward,
    math_answer,
)
from grpolab.rewards.pool import RewardPool
from grpolab.rewards.scorer import RewardError, score
from grpolab.run import checkpoint
from grpolab.run.report import read_metrics


def sleeper(prompts: list, completions: list[str], **_: Any) -> list[float]:
    time.sleep(1000 if "slow" in completions[0] else 0.3 if "nap" in completions[0] else 0)
    return [1.0] * len(completions)


def test_a_sleeping_reward_is_stopped_per_answer() -> None:
    pool = RewardPool([sleeper], timeout=0.5, workers=4)
    try:
        t0 = time.monotonic()
        res = score([sleeper], ["p"] * 4, ["fast", "slow", "fast", "slow"], pool=pool,
                    on_error=-1.0)
        assert res.total.tolist() == [1.0, -1.0, 1.0, -1.0]
        assert time.monotonic() - t0 < 5
        assert all("timed out after 0.5 s" in p for p in res.problems) and len(res.problems) == 2
        # in parallel across answers: 8 naps of 0.3 s on 4 workers take about 0.6 s, not 2.4
        t0 = time.monotonic()
        assert score([sleeper], ["p"] * 8, ["nap"] * 8, pool=pool).total.tolist() == [1.0] * 8
        assert time.monotonic() - t0 < 1.8
    finally:
        pool.close()


def test_a_reward_that_always_hangs_stops_the_run_with_one_line(tmp_path: Path) -> None:
    def hangs(prompts: list, completions: list[str], **_: Any) -> list[float]:
        time.sleep(1000)
        return [1.0]

    tr = tiny_trainer(tmp_path, [hangs], reward_timeout=0.3, reward_workers=4)
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"reward 'hangs' failed on all 8 answers") as info:
        tr.train()
    assert "timed out after 0.3 s" in str(info.value) and "\n" not in str(info.value)
    assert time.monotonic() - t0 < 20
    assert tr.scorer.pool is None  # workers stopped on the way out
    assert metric_steps(tmp_path) == []  # it failed at once: on the step-0 evaluation


def quits(prompts: list, completions: list[str], **_: Any) -> list[float]:
    if any(c.startswith("exit") for c in completions):
        sys.exit(3)
    if any(c.startswith("kill") for c in completions):
        os._exit(3)
    return [1.0] * len(completions)


def test_sys_exit_and_os_exit_in_a_reward_cannot_end_the_run() -> None:
    pool = RewardPool([quits], timeout=5, workers=2)
    try:
        res = score([quits], ["p"] * 4, ["exit", "kill", "ok", "ok"], pool=pool)
        assert res.total.tolist() == [0.0, 0.0, 1.0, 1.0]
        assert "raised SystemExit: 3" in res.problems[0]
        assert "ended its worker process (exit code 3)" in res.problems[1]
        assert score([quits], ["p"], ["ok"], pool=pool).total.tolist() == [1.0]  # replaced
    finally:
        pool.close()
    # in the trainer's own process (a reward marked in_process) sys.exit is caught as well
    quits.in_process = True
    try:
        res = score([quits], ["p", "p"], ["exit", "ok"])
        assert res.total.tolist() == [0.0, 1.0] and "SystemExit" in res.problems[0]
    finally:
        del quits.in_process


async def judge(prompts: list, completions: list[str], **_: Any) -> list[float]:
    await asyncio.sleep(0.01)
    return [float(len(c)) for c in completions]


def test_async_rewards_are_awaited() -> None:
    assert score([judge], ["p", "p"], ["ab", "abc"]).total.tolist() == [2.0, 3.0]
    pool = RewardPool([judge], timeout=5)
    try:
        assert score([judge], ["p", "p"], ["ab", "abc"], pool=pool).total.tolist() == [2.0, 3.0]
    finally:
        pool.close()


def test_a_reward_failing_on_every_answer_stops_training(tmp_path: Path) -> None:
    def bad_signature(completions, **kwargs):  # TRL-style, but prompts come first here
        return [1.0 for _ in completions[0]]

    def needs_math_verify(prompts, completions, **_):
        raise ModuleNotFoundError("No module named 'math_verify'")

    for fn, why in ((bad_signature, "TypeError"), (needs_math_verify, "ModuleNotFoundError")):
        out = tmp_path / fn.__name__
        tr = tiny_trainer(out, [fn])
        with pytest.raises(RewardError) as info:
            tr.train()
        msg = str(info.value)
        assert f"reward {fn.__name__!r} failed on all 8 answers" in msg and why in msg, msg
        assert "fail_on_reward_errors" in msg and "\n" not in msg
    # configurable: the run goes on, each answer scored reward_on_error and counted
    tr = tiny_trainer(tmp_path / "lenient", [needs_math_verify], fail_on_reward_errors=False,
                      steps=1)
    recs = tr.train()
    assert recs[-1]["reward_problems"] == 8 and recs[-1]["reward_mean"] == 0.0


def test_a_reward_failing_on_every_answer_is_one_line_from_the_cli(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from grpolab.rollout.tinyhf import make_tiny_model

    model = make_tiny_model(tmp_path / "model", arch="llama", hidden=32, heads=4)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    (tmp_path / "my_rewards.py").write_text("def bad(completions, **kw):\n    return 1 + 'x'\n")
    capsys.readouterr()  # (the model's save progress bars)
    out = tmp_path / "run"
    args = ["train", "--model-path", model, "--dataset", str(data), "--rewards",
            f"{tmp_path / 'my_rewards.py'}:bad", "--steps", "1", "--budget", "8",
            "--group-size", "4", "--max-new-tokens", "4", "--out-dir", str(out),
            "--no-progress"]
    code, err = run_cli(args, capsys)
    assert code == 2 and len(err) == 1, err
    assert "reward 'bad' failed on all 8 answers" in err[0] and "TypeError" in err[0]
    # nothing of it is left to block the rerun (exit 2: a mistake; the folder is the rerun's)
    assert not checkpoint.holds_run(out) and not (out / "config.json").exists()
    code, err = run_cli([*args, "--no-fail-on-reward-errors"], capsys)
    assert code == 0
    def no_nan(word: str) -> None:
        raise AssertionError(f"summary.json holds {word}: not JSON")

    summary = json.loads((out / "summary.json").read_text(), parse_constant=no_nan)
    assert summary["start_heldout_acc"] is None  # (nothing held out: undefined, null)
    assert read_metrics(out / "metrics.jsonl")[-1]["reward_problems"] == 8


def test_eval_with_a_broken_reward_is_an_error(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from grpolab.rollout.tinyhf import make_tiny_model

    model = make_tiny_model(tmp_path / "model", arch="llama", hidden=32, heads=4)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    (tmp_path / "my_rewards.py").write_text("def bad(completions, **kw):\n    return 1 + 'x'\n")
    code, err = run_cli(["eval", "--model-path", model, "--eval-dataset", str(data), "--rewards",
                      f"{tmp_path / 'my_rewards.py'}:bad", "--max-new-tokens", "4",
                      "--out-dir", str(tmp_path / "eval")], capsys)
    assert code == 2 and "reward 'bad' failed" in " ".join(err)


def test_format_reward_is_linear_and_equals_the_regex() -> None:
    fn = format_reward()
    evil = "<think>" + "</think><answer>" * 20_000  # 320 KB, no final </answer>
    t0 = time.monotonic()
    assert fn([], [evil, evil + "</answer>"]) == [0.0, 1.0]
    assert time.monotonic() - t0 < 1.0
    regex = re.compile(THINK_ANSWER_PATTERN, re.DOTALL)
    pieces = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "x", "<", "/"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 9)))
        assert fn([], [text]) == [1.0 if regex.fullmatch(text.strip()) else 0.0], repr(text)
    assert format_reward(r"\d+").in_process is False  # other patterns get the worker timeout


def test_math_reward_is_bounded_off_the_main_thread() -> None:
    code = textwrap.dedent("""
        import threading, time
        from grpolab.rewards.builtin import math_answer
        out = []
        t = threading.Thread(target=lambda: out.append(
            math_answer(['q'], ['\\\\boxed{9^{9^{9}}}'], answer=['3'])))
        t0 = time.monotonic(); t.start(); t.join(60)
        print(out, round(time.monotonic() - t0, 1))
    """)
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                       timeout=120)
    got, secs = p.stdout.rsplit(" ", 1)
    assert got.strip() == "[[0.0]]" and float(secs) < 10, p.stdout + p.stderr
    assert math_answer(["q"], ["\\boxed{729}"], answer=["729"]) == [1.0]


def test_huge_rewards_are_errors_not_nan_advantages(tmp_path: Path) -> None:
    def huge(prompts, completions, **_):
        return [1e39 if i % 2 else 1.0 for i in range(len(completions))]

    huge.in_process = True
    res = score([huge], ["p"] * 4, ["a"] * 4, on_error=-1.0)
    assert res.total.tolist() == [1.0, -1.0, 1.0, -1.0] and len(res.problems) == 2
    tr = tiny_trainer(tmp_path, [huge], steps=1)
    rec = tr.train()[-1]
    assert rec["reward_problems"] == 4 and all(torch.isfinite(p).all() for p in tr.params)


def test_module_reward_specs_do_not_put_the_working_dir_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "SHADOW_RAN"
    (tmp_path / "math_verify.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "grpolab_test_rewards.py").write_text(
        "def fn(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    saved = sys.modules.pop("math_verify", None)
    try:
        fn = load_reward("grpolab_test_rewards:fn")
        assert fn(["p"], ["c"]) == [1.0]
        assert sys.path[-1] == str(tmp_path)  # found, from the end of the path
        import math_verify

        assert "site-packages" in math_verify.__file__ and not marker.exists()
    finally:
        sys.modules.pop("grpolab_test_rewards", None)
        if saved is not None:
            sys.modules["math_verify"] = saved


def test_a_reward_failing_on_many_answers_logs_a_few_and_a_count(caplog) -> None:
    """20 answers each raising: the first three (distinct) lines, then one count; every
    problem still counted."""
    def picky(prompts, completions, **_):
        if len(completions) > 1:
            raise ValueError("batch")
        raise ValueError(f"cannot grade {completions[0]}")

    with caplog.at_level("WARNING", logger="grpolab.rewards.builtin"):
        res = score([picky], ["p"] * 20, [f"a{i}" for i in range(20)])
    lines = [r.getMessage() for r in caplog.records]
    assert len(res.problems) == 20
    assert len(lines) == 4 and all("cannot grade a" in x for x in lines[:3])
    assert lines[3] == "... and 17 more problems of reward 'picky' in this batch (all counted " \
                       "in reward_problems)"
