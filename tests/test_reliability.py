"""Issue 18 replayed: runs that never hang, never lose or mix data, and never execute what they
load. Each test is one case of the report; it asserts the one-line error or the correct
behaviour, and that nothing already written is lost.

(SIGKILL + --resume bitwise, kills during a checkpoint write and SIGTERM + --resume bitwise
through the real CLI are in test_resume.py; sandbox containment is in test_sandbox.py.)
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from grpolab.app.cli import main
from grpolab.config import Config, ConfigError, make_config
from grpolab.data.files import load_rows
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
from grpolab.run.trainer import GRPOTrainer, RunStopped
from grpolab.world.backend import TinyBackend
from grpolab.world.model import CharTokenizer, TinyConfig, TinyGPT
from grpolab.world.sft import sft_model
from grpolab.world.task import make_splits

# ------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """CLI flags for a tiny, fast workshop run (the SFT start is built once)."""
    cache = tmp_path_factory.mktemp("cache")
    sft_model(0, make_splits(0, 64, 16), 2, cache)
    return ["--sft-steps", "2", "--cache-dir", str(cache), "--world-train-size", "64",
            "--world-heldout-size", "16", "--eval-size", "16", "--budget", "16",
            "--group-size", "4", "--no-progress"]


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """Exit code and stderr lines of an in-process CLI call; warnings are added as the CLI
    prints them ("grpolab: ..."), since pytest takes over the logging handlers."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("grpolab")
    logger.addHandler(handler)
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        logger.removeHandler(handler)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    # (the no-signal alarm fires on these 2-step SFT starts, which get every answer wrong; its
    # warning is tested in test_predict.py, not counted here)
    return code, [f"grpolab: {r.getMessage()}" for r in records
                  if not r.getMessage().startswith("NO LEARNING SIGNAL")] + err


def _files(d: Path) -> dict[str, bytes]:
    """Every file under d: what 'nothing already written is lost' compares."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl")]


def _tiny(out: Path, rewards: list | None = None, rows: int = 32, **over: Any) -> GRPOTrainer:
    torch.manual_seed(0)
    model = TinyGPT(TinyConfig(vocab_size=CharTokenizer().vocab_size, d_model=32, n_layers=1))
    splits = make_splits(0, rows, 8)
    cfg = Config(**{"budget": 8, "group_size": 4, "steps": 3, "eval_size": 8, "progress": False,
                    "checkpoint_every": 0, "out_dir": str(out), **over})
    return GRPOTrainer(cfg, TinyBackend(model), splits.train,
                       rewards or [lambda p, c, **_: [float(x[:1] in "13579") for x in c]],
                       splits.heldout, out_dir=out)


def _weights(tr: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tr.backend.model.state_dict().items()}


# ====================================================================== 1. checkpoints ==


class _Payload:
    """Pickles to a call of os.system: what a booby-trapped last.pt carries."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_pickle_payload_in_a_checkpoint_is_never_run(tmp_path: Path, world: list[str],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out, marker = tmp_path / "run", tmp_path / "PWNED"
    args = ["workshop", "--out-dir", str(out), "--checkpoint-every", "1", *world]
    assert _cli([*args, "--steps", "2"], capsys)[0] == 0
    ckpt = out / "checkpoints"
    torch.save({"step": 2, "backend": _Payload(marker)}, ckpt / "last.pt")

    code, err = _cli([*args, "--steps", "3", "--resume"], capsys)
    assert code == 0 and not marker.exists()
    assert len(err) == 1 and "last.pt" in err[0] and "moved aside" in err[0], err
    assert "prev.pt (step 1)" in err[0]
    assert _steps(out) == [0, 1, 2, 3]
    # the file was set aside, not deleted: and it really carried a live payload
    assert (ckpt / "last.pt.corrupt").exists() and not marker.exists()
    torch.load(ckpt / "last.pt.corrupt", weights_only=False)
    assert marker.exists()
    marker.unlink()

    # both files trapped: one line, exit 1, nothing run, nothing moved
    torch.save({"step": 3, "x": _Payload(marker)}, ckpt / "last.pt")
    torch.save({"step": 2, "x": _Payload(marker)}, ckpt / "prev.pt")
    before = _files(out)
    code, err = _cli([*args, "--steps", "4", "--resume"], capsys)
    assert code == 1 and len(err) == 1 and "no readable checkpoint" in err[0], err
    assert "Weights only load failed" in err[0] or "weights_only" in err[0]
    assert not marker.exists() and _files(out) == before


def _tensor_offset(path: Path) -> int:
    """Where the largest tensor's bytes start inside a torch zip file."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = path.read_bytes()
    name_len, extra_len = (int.from_bytes(raw[info.header_offset + k : info.header_offset + k + 2],
                                          "little") for k in (26, 28))
    return info.header_offset + 30 + name_len + extra_len


def test_altered_tensor_bytes_are_caught_and_set_aside(tmp_path: Path, world: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), "--checkpoint-every", "1", *world]
    assert _cli([*args, "--steps", "2"], capsys)[0] == 0
    last = out / "checkpoints" / "last.pt"
    good = torch.load(last, weights_only=True)
    raw = bytearray(last.read_bytes())
    at = _tensor_offset(last)
    raw[at : at + 64] = bytes((b + 1) % 256 for b in raw[at : at + 64])
    last.write_bytes(raw)
    altered = torch.load(last, weights_only=True)  # the premise: it still loads, silently
    assert any(not torch.equal(a, b) for a, b in zip(altered["backend"]["model"].values(),
                                                      good["backend"]["model"].values()))
    with pytest.raises(checkpoint.CheckpointError, match="content hash mismatch"):
        checkpoint.read(last)

    code, err = _cli([*args, "--steps", "3", "--resume"], capsys)
    assert code == 0 and len(err) == 1 and "content hash mismatch" in err[0], err
    assert "last.pt.corrupt" in err[0] and "prev.pt (step 1)" in err[0]
    assert _steps(out) == [0, 1, 2, 3]
    # random garbage: the same, and the next resume no longer trips over it
    (out / "checkpoints" / "last.pt").write_bytes(os.urandom(5000))
    code, err = _cli([*args, "--steps", "4", "--resume"], capsys)
    assert code == 0 and len(err) == 1 and "last.pt.corrupt.1" in err[0], err
    code, err = _cli([*args, "--steps", "4", "--resume"], capsys)
    assert code == 0 and err == []
    assert _steps(out) == [0, 1, 2, 3, 4]


def test_run_id_ties_checkpoints_and_metrics(tmp_path: Path, world: list[str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), "--checkpoint-every", "1", *world]
    assert _cli([*args, "--steps", "2"], capsys)[0] == 0
    ids = {r["run_id"] for r in read_metrics(out / "metrics.jsonl")}
    st = checkpoint.read(out / "checkpoints" / "last.pt")
    assert ids == {st["run_id"]} and len(st["sha256"]) == 64
    assert {r["run_id"] for r in read_metrics(out / "samples.jsonl")} == ids
    assert _cli([*args, "--steps", "3", "--resume"], capsys)[0] == 0
    assert {r["run_id"] for r in read_metrics(out / "metrics.jsonl")} == ids  # same run
    assert _cli([*args, "--steps", "1", "--overwrite"], capsys)[0] == 0
    new = {r["run_id"] for r in read_metrics(out / "metrics.jsonl")}
    assert len(new) == 1 and new != ids and _steps(out) == [0, 1]


def test_changed_lora_r_is_named_not_called_unreadable(tmp_path: Path, world: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), "--checkpoint-every", "1", *world]
    assert _cli([*args, "--steps", "1"], capsys)[0] == 0
    before = _files(out)
    code, err = _cli([*args, "--steps", "2", "--resume", "--lora-r", "4"], capsys)
    assert code == 1 and len(err) == 1, err
    assert "does not fit this model" in err[0] and "lora_r=8 (this run: 4)" in err[0]
    assert "unreadable" not in err[0] and _files(out) == before


# ========================================================================= 2. rewards ==


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

    tr = _tiny(tmp_path, [hangs], reward_timeout=0.3, reward_workers=4)
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"reward 'hangs' failed on all 8 answers") as info:
        tr.train()
    assert "timed out after 0.3 s" in str(info.value) and "\n" not in str(info.value)
    assert time.monotonic() - t0 < 20
    assert tr.scorer.pool is None  # workers stopped on the way out
    assert _steps(tmp_path) == []  # it failed at once: on the step-0 evaluation


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
        tr = _tiny(out, [fn])
        with pytest.raises(RewardError) as info:
            tr.train()
        msg = str(info.value)
        assert f"reward {fn.__name__!r} failed on all 8 answers" in msg and why in msg, msg
        assert "fail_on_reward_errors" in msg and "\n" not in msg
    # configurable: the run goes on, each answer scored reward_on_error and counted
    tr = _tiny(tmp_path / "lenient", [needs_math_verify], fail_on_reward_errors=False, steps=1)
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
    code, err = _cli(args, capsys)
    assert code == 2 and len(err) == 1, err
    assert "reward 'bad' failed on all 8 answers" in err[0] and "TypeError" in err[0]
    code, err = _cli([*args, "--overwrite", "--no-fail-on-reward-errors"], capsys)
    assert code == 0
    assert read_metrics(out / "metrics.jsonl")[-1]["reward_problems"] == 8


def test_eval_with_a_broken_reward_is_an_error(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from grpolab.rollout.tinyhf import make_tiny_model

    model = make_tiny_model(tmp_path / "model", arch="llama", hidden=32, heads=4)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    (tmp_path / "my_rewards.py").write_text("def bad(completions, **kw):\n    return 1 + 'x'\n")
    code, err = _cli(["eval", "--model-path", model, "--eval-dataset", str(data), "--rewards",
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
    tr = _tiny(tmp_path, [huge], steps=1)
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


# ==================================================================== 3. stop signals ==


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
    plain = _tiny(tmp_path / "plain", [_signalling(())], steps=5, checkpoint_every=5)
    plain.train()
    # calls: 1 = step-0 eval, then 2 a step (sampling, eval): the 6th is inside step 3
    stopped = _tiny(tmp_path / "stop", [_signalling((6,))], steps=5, checkpoint_every=5)
    with pytest.raises(RunStopped) as info:
        stopped.train()
    assert info.value.exit_code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM after step 3 of 5" in str(info.value)
    assert checkpoint.read(tmp_path / "stop" / "checkpoints" / "last.pt")["step"] == 3
    assert _steps(tmp_path / "stop") == [0, 1, 2, 3]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    again = _tiny(tmp_path / "stop", [_signalling(())], steps=5, checkpoint_every=5)
    again.train(resume=True)
    for k, v in _weights(plain).items():
        assert torch.equal(_weights(again)[k], v), k
    strip = [{k: v for k, v in r.items() if not k.startswith("time_") and k != "run_id"}
             for r in read_metrics(tmp_path / "plain" / "metrics.jsonl")]
    got = [{k: v for k, v in r.items() if not k.startswith("time_") and k != "run_id"}
           for r in read_metrics(tmp_path / "stop" / "metrics.jsonl")]
    assert got == strip


def test_a_second_signal_abandons_the_step_and_keeps_what_was_written(tmp_path: Path) -> None:
    tr = _tiny(tmp_path, [_signalling((6, 7))], steps=5, checkpoint_every=2)
    with pytest.raises(RunStopped, match="second SIGTERM: the step in flight was abandoned"):
        tr.train()
    assert checkpoint.read(tmp_path / "checkpoints" / "last.pt")["step"] == 2
    assert _steps(tmp_path) == [0, 1, 2]


def test_sigterm_from_the_cli_exits_143_with_one_line(
        tmp_path: Path, world: list[str], capsys: pytest.CaptureFixture[str],
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
    code, err = _cli(["workshop", "--out-dir", str(out), "--steps", "6", "--checkpoint-every",
                      "5", *world], capsys)
    assert code == 128 + signal.SIGUSR1 and len(err) == 1, err
    assert "stopped by SIGUSR1 after step 2 of 6" in err[0] and "--resume" in err[0]
    assert checkpoint.read(out / "checkpoints" / "last.pt")["step"] == 2  # 0 steps lost


# ======================================================================= 4. run folders ==


def test_a_new_run_never_wipes_or_mixes_with_an_old_one(tmp_path: Path, world: list[str],
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), *world]
    assert _cli([*args, "--steps", "2", "--checkpoint-every", "1"], capsys)[0] == 0
    before = _files(out)
    code, err = _cli([*args, "--steps", "2"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "already holds a run" in err[0] and "--resume" in err[0] and "--overwrite" in err[0]
    assert _files(out) == before
    old_id = read_metrics(out / "metrics.jsonl")[0]["run_id"]

    # --overwrite replaces it; killed before its first checkpoint, --resume does not pick up
    # the old run's weights
    from grpolab.run import trainer

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer.GRPOTrainer, "step", interrupted)
    code, err = _cli([*args, "--steps", "2", "--overwrite"], capsys)
    assert code == 130
    monkeypatch.undo()
    assert not (out / "checkpoints" / "last.pt").exists()
    lines = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in lines] == [0] and lines[0]["run_id"] != old_id
    code, err = _cli([*args, "--steps", "2", "--resume"], capsys)
    assert code == 1 and len(err) == 1 and "no checkpoint to resume from" in err[0], err


def test_metrics_of_another_run_are_refused_on_resume(tmp_path: Path, world: list[str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert _cli(["workshop", "--out-dir", str(out), "--steps", "1", "--checkpoint-every",
                     "1", *world], capsys)[0] == 0
    shutil.copy(a / "metrics.jsonl", b / "metrics.jsonl")
    before = _files(b)
    code, err = _cli(["workshop", "--out-dir", str(b), "--steps", "2", "--resume", *world],
                     capsys)
    assert code == 2 and len(err) == 1 and "they are not one run" in err[0], err
    assert _files(b) == before


def test_the_readme_command_works_twice(tmp_path: Path, world: list[str],
                                        capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert _cli(["workshop", "--steps", "1", *world], capsys)[0] == 0
    first = _files(tmp_path / "runs" / "workshop")
    code = main(["workshop", "--steps", "1", *world])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert out.splitlines()[0] == ("grpolab: runs/workshop holds an earlier run; this one writes "
                                   "to runs/workshop-2 (--out-dir chooses the folder, "
                                   "--overwrite replaces the run)")
    assert "wrote runs/workshop-2/metrics.jsonl" in out
    assert _files(tmp_path / "runs" / "workshop") == first
    assert _steps(tmp_path / "runs" / "workshop-2") == [0, 1]


# =========================================================================== 5. lengths ==


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> str:
    from grpolab.rollout.tinyhf import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gpt2"), arch="gpt2", hidden=32, heads=4)


def test_a_100k_character_row_is_cut_to_the_prompt_limit(
        gpt2: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from grpolab.rollout.hf import HFBackend
    from grpolab.rollout.models import load_model
    from grpolab.rollout.tinyhf import make_tiny_model

    row = "word " * 20_000 + "What is 2 + 3?"
    limit = Config().max_prompt_tokens  # the default: 1024
    long_ctx = make_tiny_model(tmp_path / "llama", arch="llama", hidden=32, heads=4,
                               max_positions=4096)
    be = HFBackend(*load_model(long_ctx), reference=False, max_prompt_tokens=limit,
                   max_new_tokens=8)
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        ids, _ = be.encode_prompts([row, "2 + 3?"])
    assert ids.shape[1] == limit == 1024
    assert "prompts over 1024 tokens (max_prompt_tokens=1024) are cut from the left" in caplog.text
    # GPT-2: its 1024 positions, less the answer's room, bound the prompt (no IndexError)
    be = HFBackend(*load_model(gpt2), reference=False, max_prompt_tokens=limit,
                   max_new_tokens=8)
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        ro = be.generate([row] * 2, 1.0, 8, torch.Generator().manual_seed(0))
    assert ro.prompt_ids.shape[1] == 1024 - 8 and ro.completion_ids.shape[0] == 2
    assert "(the model's 1024 positions less max_new_tokens 8)" in caplog.text


def test_a_row_no_model_can_take_is_a_one_line_dataset_error(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 1_500_000, "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 has a prompt of 1,500,000 characters"):
        load_rows(str(path))


def test_max_new_tokens_beyond_gpt2_positions_fails_up_front(
        gpt2: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from grpolab.rollout.hf import HFBackend
    from grpolab.rollout.models import load_model

    with pytest.raises(ConfigError, match="max_new_tokens 1100 does not fit the model's 1024"):
        HFBackend(*load_model(gpt2), reference=False, max_new_tokens=1100)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    out = tmp_path / "run"
    code, err = _cli(["train", "--model-path", gpt2, "--dataset", str(data), "--rewards",
                      "exact", "--budget", "8", "--group-size", "4", "--max-new-tokens", "1100",
                      "--out-dir", str(out), "--no-progress"], capsys)
    assert code == 2 and len(err) == 1 and "1024 positions" in err[0], err
    assert not (out / "metrics.jsonl").exists()


# ============================================================ 6. settings and the disk ==

BAD_SETTINGS = [
    (["--grad-clip", "-1"], "grad_clip must be > 0"),
    (["--grad-clip", "0"], "grad_clip must be > 0"),
    (["--beta", "nan"], "beta must be a finite number"),
    (["--success-threshold", "nan"], "success_threshold must be a finite number"),
    (["--reward-weights", "nan"], "reward_weights must be a finite number"),
    (["--reward-on-error", "nan"], "reward_on_error must be a finite number"),
    (["--eps-low", "nan"], "eps_low must be a finite number"),
    (["--temperature", "inf"], "temperature must be a finite number"),
    (["--eval-size", "-1"], "eval_size must be >= 0"),
    (["--lora-r", "0"], "lora_r must be >= 1"),
    (["--lora-r", "-3"], "lora_r must be >= 1"),
    (["--reward-timeout", "-1"], "reward_timeout must be >= 0"),
]


@pytest.mark.parametrize(("flags", "words"), BAD_SETTINGS, ids=[" ".join(f) for f, _ in
                                                                BAD_SETTINGS])
def test_settings_that_wreck_a_run_are_one_line_exit_2(
        flags: list[str], words: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code, err = _cli(["workshop", *flags, "--out-dir", str(out), "--no-progress"], capsys)
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_out_dir_that_is_a_file_or_read_only(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "afile").write_text("keep me")
    code, err = _cli(["workshop", "--out-dir", str(tmp_path / "afile")], capsys)
    assert code == 2 and err == [(f"grpolab: error: out_dir {tmp_path / 'afile'} is a file, "
                                  "not a folder")]
    assert (tmp_path / "afile").read_text() == "keep me"
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != ro)  # (root ignores chmod)
    code, err = _cli(["workshop", "--out-dir", str(ro / "run")], capsys)
    assert code == 2 and len(err) == 1 and "is not writable" in err[0], err


@pytest.mark.parametrize("where", ["checkpoint", "metrics"])
def test_a_full_disk_is_one_line_and_keeps_what_was_written(
        where: str, tmp_path: Path, world: list[str], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), "--checkpoint-every", "1", *world]
    assert _cli([*args, "--steps", "1"], capsys)[0] == 0
    before = _files(out)
    real = os.fsync

    def full(fd: int) -> None:  # the disk fills up when this kind of file is written
        name = os.readlink(f"/proc/self/fd/{fd}")
        if (".pt.tmp" in name) if where == "checkpoint" else name.endswith("metrics.jsonl"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", full)
    code, err = _cli([*args, "--steps", "3", "--resume"], capsys)
    monkeypatch.undo()
    assert code == 1 and len(err) == 1 and "No space left on device" in err[0], err
    assert checkpoint.read(out / "checkpoints" / "last.pt")["step"] == 1
    kept = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in kept][:2] == [0, 1]
    assert kept[:2] == [json.loads(line) for line in
                        before["metrics.jsonl"].decode().splitlines()[:2]]


def test_a_dataset_smaller_than_a_step_is_an_error(tmp_path: Path) -> None:
    tr = _tiny(tmp_path, rows=1, budget=32, group_size=4)
    with pytest.raises(ConfigError, match="the training set has 1 prompts but a step needs 8"):
        tr.train()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_header_only_csv_and_dataset_folder_splits(tmp_path: Path) -> None:
    (tmp_path / "h.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="has a header line but no rows"):
        load_rows(str(tmp_path / "h.csv"))
    folder = tmp_path / "d"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text(json.dumps({"prompt": split, "answer": "1"}))
    assert [r["prompt"] for r in load_rows(str(folder), split="test")] == ["test"]
    with pytest.raises(ValueError, match=r"has no 'validation' files \(it has test, train\)"):
        load_rows(str(folder), split="validation")


def test_eval_dataset_folder_uses_its_test_split(tmp_path: Path) -> None:
    from grpolab.data.files import run_rows

    folder = tmp_path / "d"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text(json.dumps({"prompt": split, "answer": "1"}))
    cfg = make_config(None, {"dataset": str(folder), "eval_dataset": str(folder)})
    train, held = run_rows(cfg)
    assert [r["prompt"] for r in train] == ["train"] and [r["prompt"] for r in held] == ["test"]
