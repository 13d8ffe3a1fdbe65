"""Issue 30, defects 3-11: what a config, a reward, a data or model file, a second run or a
Ctrl-C can do to a run. One test per defect; each failed before its fix.

New API is imported inside the tests, so on older code each test fails on its own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpolab.app import cli
from grpolab.config import ConfigError, make_config
from grpolab.run.trainer import GRPOTrainer
from grpolab.world.backend import TinyBackend
from grpolab.world.model import TinyConfig, TinyGPT
from grpolab.world.task import make_splits

ROOT = Path(__file__).resolve().parents[1]


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    return code, capsys.readouterr().err.splitlines()


def _one_line(code: int, err: list[str], *words: str) -> None:
    assert code == 2 and len(err) == 1 and err[0].startswith("grpolab: error"), (code, err)
    for w in words:
        assert w in err[0], (w, err[0])


def _reward(prompts, completions, **_):
    return [float(c[:1] in "13579" and bool(c)) for c in completions]


def _trainer(out: Path, rows: int = 64, **over) -> GRPOTrainer:
    cfg = make_config(None, {"progress": False, "checkpoint_every": 0, "budget": 16,
                             "group_size": 4, "steps": 1, "max_new_tokens": 4, "eval_size": 8,
                             **over})
    torch.manual_seed(0)
    splits = make_splits(0, rows, 8)
    backend = TinyBackend(TinyGPT(TinyConfig(d_model=32, n_layers=1, n_heads=2, max_len=24)))
    return GRPOTrainer(cfg, backend, splits.train, [_reward], splits.heldout, out_dir=out)


# ------------------------------------------------------------------ 3. YAML aliases --


def _bomb(levels: int = 6) -> str:
    """10**levels values from a few lines: each level lists ten aliases of the one before."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "{" + ", ".join(lines) + "}"


def test_yaml_alias_bomb_is_refused_before_it_expands(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(f"task_config: {_bomb()}\n")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="alias") as info:
        make_config(path, None, "train")
    assert str(path) in str(info.value) and time.monotonic() - t0 < 5
    plain = tmp_path / "plain.yaml"  # one ordinary alias is still fine
    plain.write_text("task_config: {a: &x [1, 2], b: *x}\n")
    assert make_config(plain, None, "train").task_config == {"a": [1, 2], "b": [1, 2]}
    code, err = _cli(["train", "--task-config", _bomb(), "--out-dir", str(tmp_path / "r")],
                     capsys)
    _one_line(code, err, "task_config", "alias")


# ------------------------------------------------------------- 4. one run per folder --

HOLDER = """
import fcntl, os, sys, time
f = open(os.path.join(sys.argv[1], ".grpolab.lock"), "a+")
fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
f.truncate(0); f.write(f"{os.getpid()}\\n"); f.flush()
print("ready", flush=True)
time.sleep(60)
"""


def test_a_live_run_locks_its_out_dir(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from grpolab.run.checkpoint import holds_run

    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert not holds_run(out)  # the lock file alone is not a run
        with pytest.raises(ConfigError) as info:  # the run's own lock (atomic)
            _trainer(out).train()
        assert str(out) in str(info.value) and f"pid {holder.pid}" in str(info.value)
        assert not (out / "metrics.jsonl").exists()
        for extra in ([], ["--overwrite"], ["--resume"]):  # the CLI says so before any work
            code, err = _cli(["workshop", "--out-dir", str(out), "--no-progress", *extra],
                             capsys)
            _one_line(code, err, str(out), f"pid {holder.pid}")
        assert (out / ".grpolab.lock").exists()
    finally:
        holder.kill()
        holder.wait()
    _trainer(out).train()  # the holder gone, the folder is free
    assert (out / "metrics.jsonl").exists()


# -------------------------------------------------------- 5. unusable reward output --


def test_reward_unusable_for_every_answer_is_an_error() -> None:
    from grpolab.rewards.pool import RewardPool
    from grpolab.rewards.scorer import RewardError, score

    def scalar(prompts, completions, **_):
        return 1.0

    def short(prompts, completions, **_):
        return [1.0] * (len(completions) - 1)

    def nans(prompts, completions, **_):
        return [math.nan] * len(completions)

    def strings(prompts, completions, **_):
        return ["good"] * len(completions)

    def half(prompts, completions, **_):
        return [math.nan if i % 2 else 1.0 for i in range(len(completions))]

    prompts, completions = ["p"] * 8, ["c"] * 8
    fns = [scalar, short, nans, strings]
    for fn in fns:
        with pytest.raises(RewardError, match=f"reward '{fn.__name__}' failed on all 8"):
            score([fn], prompts, completions, fail_on_all_errors=True)
    pool = RewardPool([*fns, half], timeout=10, workers=2)
    try:
        for fn in fns:  # in worker processes, parts of whole groups
            with pytest.raises(RewardError, match=f"reward '{fn.__name__}' failed on all 8"):
                score([fn], prompts, completions, pool=pool, fail_on_all_errors=True,
                      group_size=4)
        res = score([half], prompts, completions, pool=pool, fail_on_all_errors=True)
        assert res.per_fn[:, 0].tolist() == [1.0, 0.0] * 4 and len(res.problems) == 4
    finally:
        pool.close()


# ------------------------------------------------------------------ 6. gold answers --


def test_gold_answers_are_text_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    from grpolab.data.files import load_rows

    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\nq1,4\nq2,2.5\nq3,007\n")
    assert [r["answer"] for r in load_rows(str(csv))] == ["4", "2.5", "007"]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": a}) + "\n"
                             for i, a in enumerate([4, 2.5, ["1", "one"]])))
    assert [r["answer"] for r in load_rows(str(jsonl))] == ["4", "2.5", ["1", "one"]]
    csv.write_text("prompt,answer\nq1,4\nq2,\nq3,5\n")
    # named where a user finds them: a CSV's row counting from 1, a JSONL file's line number
    with pytest.raises(ValueError, match=r"row 2 \(counting from 1, after the header\) has no "
                                         "gold answer"):
        load_rows(str(csv))
    jsonl.write_text('{"prompt": "q0", "answer": null}\n{"prompt": "q1", "answer": "2"}\n')
    with pytest.raises(ValueError, match="line 1 has no gold answer"):
        load_rows(str(jsonl))
    jsonl.write_text('{"prompt": "q0", "answer": "1"}\n\n{"prompt": "q1", "answer": null}\n')
    with pytest.raises(ValueError, match="line 3 has no gold answer"):  # (blank lines count)
        load_rows(str(jsonl))


# ------------------------------------------------------- 7. what a reward starts --

_PIDS = Path(os.environ.get("TMPDIR", "/tmp")) / f"grpolab-test-{os.getpid()}.pids"


def _spawns(prompts, completions, **_):
    p = subprocess.Popen(["sleep", "60"])
    with open(_PIDS, "a") as f:
        f.write(f"{p.pid}\n")
    return [0.0] * len(completions)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] in "ZX"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_a_reward_starts_dies_with_the_pool() -> None:
    from grpolab.rewards.pool import RewardPool

    _PIDS.unlink(missing_ok=True)
    pool = RewardPool([_spawns], timeout=10, workers=1)
    try:
        assert pool.map(_spawns, [((["p"], ["c"]), {})])[0][0] == "ok"
        pid = int(_PIDS.read_text().split()[0])
        status = Path(f"/proc/{pid}/status").read_text()
        ignored = int(next(x for x in status.splitlines() if x.startswith("SigIgn:")).split()[1],
                      16)
        for sig in (signal.SIGTERM, signal.SIGINT):  # not inherited from the worker
            assert not ignored & (1 << (sig - 1)), status
        pool.close()
        deadline = time.monotonic() + 5
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid), "the reward's subprocess outlived the pool"
    finally:
        pool.close()
        for line in _PIDS.read_text().split() if _PIDS.exists() else []:
            try:
                os.kill(int(line), signal.SIGKILL)
            except OSError:
                pass
        _PIDS.unlink(missing_ok=True)


# ------------------------------------------------------- 8. resume with other data --


def test_resume_with_another_dataset_is_refused_naming_it(tmp_path: Path) -> None:
    _trainer(tmp_path, dataset="a.jsonl", checkpoint_every=1).train()
    other = _trainer(tmp_path, rows=48, dataset="b.jsonl", checkpoint_every=1)
    with pytest.raises(ConfigError, match="dataset='a.jsonl'") as info:
        other.train(resume=True)
    assert "\n" not in str(info.value)
    changed_file = _trainer(tmp_path, rows=48, dataset="a.jsonl", checkpoint_every=1)
    with pytest.raises(ConfigError, match="dataset of 48 prompts|dataset"):  # same name
        changed_file.train(resume=True)


# ------------------------------------------------------------- 9. model files --


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("transformers")
    from grpolab.rollout.tinyhf import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model"), hidden=32, heads=4)


def _copy_model(src: str, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


class _Touch:
    """A pickle that, when loaded, creates a file: what a hostile pytorch_model.bin does."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


LOOP = ("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}"
        "{% endfor %}")
INTERNALS = "{{ messages.__class__.__mro__[1].__subclasses__() }}"


def test_model_files_are_refused_in_one_line(tiny_model: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n"
                            for i in range(4)))

    def run(model: Path) -> tuple[int, list[str]]:
        return _cli(["eval", "--model-path", str(model), "--eval-dataset", str(data),
                     "--rewards", "exact", "--max-new-tokens", "2", "--budget", "8",
                     "--out-dir", str(tmp_path / "out"), "--no-progress"], capsys)

    pickled = _copy_model(tiny_model, tmp_path / "pickled")
    marker = tmp_path / "ran"
    state = load_file(str(pickled / "model.safetensors"))
    torch.save({**state, "x": _Touch(marker)}, pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    _one_line(*run(pickled), "pytorch_model.bin", "safetensors")
    assert not marker.exists(), "nothing in the pickle ran"

    internals = _copy_model(tiny_model, tmp_path / "internals")
    cfg_path = internals / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**tok_cfg, "chat_template": INTERNALS}))
    _one_line(*run(internals), "chat template")
    # a truncated weight file (safetensors' own error), a config.json that is no JSON
    cut = _copy_model(tiny_model, tmp_path / "cut")
    with open(cut / "model.safetensors", "r+b") as f:
        f.truncate(4000)
    _one_line(*run(cut), "cannot load the model", "deserializing header")
    broken = _copy_model(tiny_model, tmp_path / "broken")
    (broken / "config.json").write_text("{bad")
    _one_line(*run(broken), "cannot load the model", "not a valid JSON file")

    from transformers import AutoTokenizer

    from grpolab.rollout.templates import check_render

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = LOOP
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="did not render a sample prompt within 1 s"):
        check_render(lambda p: tok.apply_chat_template([{"role": "user", "content": p}],
                                                        tokenize=False), "q", seconds=1)
    assert time.monotonic() - t0 < 10


# ----------------------------------------------------------------- 10. Ctrl-C --


def test_ctrl_c_before_a_checkpoint_does_not_offer_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from grpolab.app import commands

    def interrupted(cfg, *args):
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out_dir) / "metrics.jsonl").write_text('{"step": 0}\n')
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "workshop", interrupted)
    out = tmp_path / "run"
    code, err = _cli(["workshop", "--out-dir", str(out), "--no-progress"], capsys)
    assert code == 130 and len(err) == 1
    assert "nothing can be resumed" in err[0] and "continue with --resume" not in err[0], err
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "last.pt").write_bytes(b"x")
    code, err = _cli(["workshop", "--out-dir", str(out), "--no-progress", "--resume"], capsys)
    assert code == 130 and "continue with --resume" in err[0], err


# ------------------------------------------------------------ 11. dataset folders --


def test_a_folder_split_is_the_exact_stem_and_overlap_is_warned(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from grpolab.data.files import load_rows, run_rows

    folder = tmp_path / "data"
    folder.mkdir()
    for name, prompts in (("train.jsonl", ["a", "b"]), ("training_notes_OLD.jsonl", ["old"]),
                          ("test-00000-of-00001.jsonl", ["a", "c"])):
        (folder / name).write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                                           for p in prompts))
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        assert [r["prompt"] for r in load_rows(str(folder))] == ["a", "b"]
        assert [r["prompt"] for r in load_rows(str(folder), split="test")] == ["a", "c"]
        assert "training_notes_OLD.jsonl" in caplog.text  # left out, and said so
        caplog.clear()
        cfg = make_config(None, {"dataset": str(folder), "eval_dataset": str(folder)}, "train")
        train, held = run_rows(cfg)
    assert len(train) == 2 and len(held) == 2
    assert "1 of the 2 eval_dataset prompts evaluated (eval_size) are also training" in caplog.text
    caplog.clear()  # --eval-size 0: nothing is evaluated, so there is nothing to warn about
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        run_rows(dataclasses.replace(cfg, eval_size=0))
        assert "also training prompts" not in caplog.text
        run_rows(dataclasses.replace(cfg, eval_size=1))  # "a", the one evaluated, is trained on
    assert "1 of the 1 eval_dataset prompts evaluated" in caplog.text


def test_data_warnings_are_said_by_rank_0_only(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun every rank loads the same rows: the overlap warning is rank 0's alone."""
    from grpolab.app import commands
    from grpolab.run import dist

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in "ab"))
    cfg = make_config(None, {"dataset": str(data), "eval_dataset": str(data),
                             "model_path": str(tmp_path)}, "train")

    def stop(cfg: object) -> None:  # the rows are loaded: nothing more is needed
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "load_rewards", stop)
    # (_run_train sets it for the process; restored after the test)
    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "1"))
    for main, said in ((True, 1), (False, 0)):
        monkeypatch.setattr(dist, "is_main", lambda main=main: main)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="grpolab"), pytest.raises(KeyboardInterrupt):
            commands._run_train(cfg, resume=False)
        assert caplog.text.count("are also training prompts") == said
