"""Issue 18 replayed: runs that never hang, never lose or mix data, and never execute what they
load. Settings and the disk: settings that would wreck a run, an unusable out_dir and a full
disk are one line (and keep what was written); datasets too small or oddly laid out are clear
errors."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from helpers import files_under, run_cli, tiny_trainer

from grpolab.config import ConfigError, make_config
from grpolab.data.files import load_rows
from grpolab.run import checkpoint
from grpolab.run.report import read_metrics

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
    (["--out-dir", ""], "out_dir is empty"),  # (it wrote into the working folder)
]


@pytest.mark.parametrize(("flags", "words"), BAD_SETTINGS, ids=[" ".join(f) for f, _ in
                                                                BAD_SETTINGS])
def test_settings_that_wreck_a_run_are_one_line_exit_2(
        flags: list[str], words: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code, err = run_cli(["workshop", "--out-dir", str(out), *flags, "--no-progress"], capsys)
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_out_dir_that_is_a_file_or_read_only(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "afile").write_text("keep me")
    code, err = run_cli(["workshop", "--out-dir", str(tmp_path / "afile")], capsys)
    assert code == 2 and err == [(f"grpolab: error: out_dir {tmp_path / 'afile'} is a file, "
                                  "not a folder")]
    assert (tmp_path / "afile").read_text() == "keep me"
    code, err = run_cli(["workshop", "--out-dir", str(tmp_path / "afile" / "sub")], capsys)
    assert code == 2 and err == [(f"grpolab: error: out_dir {tmp_path / 'afile' / 'sub'} cannot "
                                  f"be made: {tmp_path / 'afile'} is a file")]
    assert (tmp_path / "afile").read_text() == "keep me"
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != ro)  # (root ignores chmod)
    code, err = run_cli(["workshop", "--out-dir", str(ro / "run")], capsys)
    assert code == 2 and len(err) == 1 and "is not writable" in err[0], err


@pytest.mark.slow
@pytest.mark.parametrize("where", ["checkpoint", "metrics"])
def test_a_full_disk_is_one_line_and_keeps_what_was_written(
        where: str, tmp_path: Path, world_args: list[str], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), "--checkpoint-every", "1", *world_args]
    assert run_cli([*args, "--steps", "1"], capsys)[0] == 0
    before = files_under(out)
    real = os.fsync

    def full(fd: int) -> None:  # the disk fills up when this kind of file is written
        name = os.readlink(f"/proc/self/fd/{fd}")
        if (".pt.tmp" in name) if where == "checkpoint" else name.endswith("metrics.jsonl"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", full)
    code, err = run_cli([*args, "--steps", "3", "--resume"], capsys)
    monkeypatch.undo()
    assert code == 1 and len(err) == 1 and "No space left on device" in err[0], err
    assert checkpoint.read(out / "checkpoints" / "last.pt")["step"] == 1
    kept = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in kept][:2] == [0, 1]
    assert kept[:2] == [json.loads(line) for line in
                        before["metrics.jsonl"].decode().splitlines()[:2]]


def test_a_dataset_smaller_than_a_step_is_an_error(tmp_path: Path) -> None:
    tr = tiny_trainer(tmp_path, rows=1, budget=32, group_size=4)
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


@pytest.mark.parametrize("theirs", ["model", "final", "summary"])
def test_a_folder_of_other_files_is_never_written_over(tmp_path: Path, theirs: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A new run in a folder that holds no grpolab run but files of a run's names (a model's
    config.json, a final/ or summary.json another tool left) is refused, --overwrite or not,
    and nothing there changes; a grpolab run's own config.json alone does not block."""
    out = tmp_path / "m"
    out.mkdir()
    if theirs == "model":
        (out / "config.json").write_text('{"model_type": "llama"}')
    elif theirs == "final":
        (out / "final").mkdir()
        (out / "final" / "notes.txt").write_text("x")
    else:
        (out / "summary.json").write_text("{}")
    before = files_under(out)
    for more in ([], ["--overwrite"]):
        code, err = run_cli(["workshop", "--out-dir", str(out), "--steps", "1", *more], capsys)
        assert code == 2 and len(err) == 1 and "of no grpolab run" in err[0], err
        assert files_under(out) == before
    mine = tmp_path / "mine"  # (a grpolab run stopped before its first metrics line)
    mine.mkdir()
    (mine / "config.json").write_text('{"group_size": 8}')
    assert checkpoint.export.foreign_outputs(mine) == []
    deep = mine / "checkpoint-3"  # (a mark nested past the parser's depth: not grpolab's)
    deep.mkdir()
    (deep / checkpoint.export.MARK).write_text("[" * 100_000)
    assert checkpoint.export._mark(deep) is None


def test_a_damaged_log_is_named_on_resume(tmp_path: Path, caplog) -> None:
    """A resume keeps the log's lines up to the checkpoint: lines it cannot read (a damaged
    or removed file) are named in one warning, not silently left out."""
    from grpolab.run.report import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path, None, "r1")
    for step in range(4):
        w.write({"step": step})
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1], "{torn", lines[3]]) + "\n")
    with caplog.at_level("WARNING", logger="grpolab"):
        MetricsWriter(path, 3, "r1")
    assert f"{path} has no readable line of step 2 (damaged or removed?)" in caplog.text
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 3]
    caplog.clear()
    path.unlink()  # (a run's metrics removed)
    with caplog.at_level("WARNING", logger="grpolab"):
        MetricsWriter(path, 2, "r1")
    assert "has no readable line of steps 0, 1, 2" in caplog.text
    caplog.clear()
    samples = tmp_path / "samples.jsonl"  # (from step 1; none at all: log_samples just on)
    samples.write_text(json.dumps({"step": 1, "run_id": "r1"}) + "\n")
    with caplog.at_level("WARNING", logger="grpolab"):
        MetricsWriter(samples, 2, "r1", first=1)
    assert "samples.jsonl has no readable line of step 2" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpolab"):
        MetricsWriter(tmp_path / "new.jsonl", 3, "r1", first=1)
    assert not caplog.text


def test_the_default_folder_moves_past_other_files(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The default out_dir holding a model's files (no run): the run takes runs/workshop-2, as
    it does past an earlier run, and leaves them as they are."""
    from grpolab.app.commands import choose_out_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "workshop").mkdir(parents=True)
    (tmp_path / "runs" / "workshop" / "config.json").write_text('{"model_type": "llama"}')
    cfg = make_config(None, {}, "workshop")
    assert choose_out_dir(cfg, "workshop").out_dir == f"{cfg.out_dir}-2"


def test_a_resume_on_changed_rows_of_the_same_count_is_refused(tmp_path: Path) -> None:
    """A checkpoint keeps its training rows' fingerprint: the same count of other rows (the
    file edited, or reordered) is refused before anything loads, not trained on unsaid."""
    tr = tiny_trainer(tmp_path, steps=1, checkpoint_every=1)
    tr.train()
    again = tiny_trainer(tmp_path, steps=2)
    again.train_rows = again.rollouts.rows = list(reversed(again.train_rows))
    with pytest.raises(ConfigError, match="other training rows than this run's, as many"):
        again.train(resume=True)
    assert tiny_trainer(tmp_path, steps=2).train(resume=True)[-1]["step"] == 2  # (its own rows)


def test_a_resume_with_another_seed_of_a_generated_task_names_the_seed() -> None:
    """The workshop's world and a generated task draw their rows from the seed: a resume
    with another seed is refused naming it, not as a changed dataset file."""
    from grpolab.config import to_dict
    from grpolab.run.resume import changed_settings

    cfg, rows = make_config(None, {"seed": 5}, "workshop"), [{"prompt": "1+1", "answer": "2"}]
    st = {"config": to_dict(make_config(None, {}, "workshop")), "rows_sha256": "other"}
    with pytest.raises(ConfigError, match=r"as many: it was written with seed=0 \(this run: 5\)"
                                          r", which draws a generated task's rows; resume with "
                                          r"the run's seed, or start a new run$"):
        changed_settings(st, cfg, rows, None)
    st["sampler"] = {"pass_rate": [0.5, 0.5]}
    with pytest.raises(ConfigError, match=r"this run's has 1: it was written with seed=0"):
        changed_settings(st, cfg, rows, None)
    st["config"]["seed"] = 5  # (the same seed: the data changed)
    with pytest.raises(ConfigError, match=r"has 1 \(the dataset file changed\?\); resume "):
        changed_settings(st, cfg, rows, None)
    on_file = {"dataset": "d.jsonl", "model_path": "m"}  # (a file's rows: the seed draws none)
    st["config"] = to_dict(make_config(None, on_file, "train"))
    with pytest.raises(ConfigError, match=r"has 1 \(the dataset file changed\?\); resume "):
        changed_settings(st, make_config(None, {**on_file, "seed": 5}, "train"), rows, None)


def test_a_resume_with_other_posteriors_is_refused_before_loading(tmp_path: Path) -> None:
    """predict_group_by shapes the pass-rate posteriors a checkpoint keeps (a prior per
    kind): another, or another prior's form beside it, is one line before any weight loads (it
    was a shape traceback after the weights). The prior's form alone resumes (the counts are
    the same), said as a changed setting."""
    tr = tiny_trainer(tmp_path, steps=1, checkpoint_every=1)
    tr.train()
    assert tiny_trainer(tmp_path, steps=2, predict_prior="grid").train(
        resume=True)[-1]["step"] == 2
    from grpolab.config import Config, to_dict
    from grpolab.run.resume import changed_settings

    saved = {"config": to_dict(Config(predict_group_by="level"))}
    with pytest.raises(ConfigError, match="written with predict_group_by='level'"):
        changed_settings(saved, Config(), [], None)
    with pytest.raises(ConfigError, match="written with predict_prior='beta' .this run: "
                                          "'grid'.: the pass-rate posteriors"):
        changed_settings(saved, Config(predict_group_by="level", predict_prior="grid"), [], None)
