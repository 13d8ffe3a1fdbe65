"""Issue 18 replayed: runs that never hang, never lose or mix data, and never execute what they
load. Run folders: a new run never wipes or mixes with an old one, metrics of another run are
refused on resume, and the README's command works twice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import files_under, metric_steps, run_cli

from grpolab.app.cli import main
from grpolab.run.report import read_metrics

pytestmark = pytest.mark.slow  # CLI workshop runs from the SFT start (world_args)


def test_a_new_run_never_wipes_or_mixes_with_an_old_one(tmp_path: Path, world_args: list[str],
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), *world_args]
    assert run_cli([*args, "--steps", "2", "--checkpoint-every", "1"], capsys)[0] == 0
    before = files_under(out)
    code, err = run_cli([*args, "--steps", "2"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "already holds a run" in err[0] and "--resume" in err[0] and "--overwrite" in err[0]
    assert files_under(out) == before
    old_id = read_metrics(out / "metrics.jsonl")[0]["run_id"]

    # --overwrite replaces it; killed before its first checkpoint, --resume does not pick up
    # the old run's weights
    from grpolab.run import trainer

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer.GRPOTrainer, "step", interrupted)
    code, err = run_cli([*args, "--steps", "2", "--overwrite"], capsys)
    assert code == 130
    monkeypatch.undo()
    assert not (out / "checkpoints" / "last.pt").exists()
    lines = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in lines] == [0] and lines[0]["run_id"] != old_id
    # nothing of the replaced run is left looking current beside the new one's files
    assert not (out / "summary.json").exists() and (out / "config.json").exists()
    code, err = run_cli([*args, "--steps", "2", "--resume"], capsys)
    assert code == 1 and len(err) == 1 and "no checkpoint to resume from" in err[0], err


def test_metrics_of_another_run_are_refused_on_resume(tmp_path: Path, world_args: list[str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert run_cli(["workshop", "--out-dir", str(out), "--steps", "1", "--checkpoint-every",
                     "1", *world_args], capsys)[0] == 0
    shutil.copy(a / "metrics.jsonl", b / "metrics.jsonl")
    before = files_under(b)
    code, err = run_cli(["workshop", "--out-dir", str(b), "--steps", "2", "--resume", *world_args],
                     capsys)
    assert code == 2 and len(err) == 1 and "they are not one run" in err[0], err
    assert files_under(b) == before


def test_the_readme_command_works_twice(tmp_path: Path, world_args: list[str],
                                        capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert run_cli(["workshop", "--steps", "1", *world_args], capsys)[0] == 0
    first = files_under(tmp_path / "runs" / "workshop")
    code = main(["workshop", "--steps", "1", *world_args])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert out.splitlines()[0] == ("grpolab: runs/workshop holds an earlier run; this one writes "
                                   "to runs/workshop-2 (--out-dir chooses the folder, "
                                   "--overwrite replaces the run)")
    assert "wrote runs/workshop-2/metrics.jsonl" in out
    assert files_under(tmp_path / "runs" / "workshop") == first
    assert metric_steps(tmp_path / "runs" / "workshop-2") == [0, 1]


def test_a_resume_with_changed_settings_keeps_the_old_config(
        tmp_path: Path, world_args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """config.json is the config that trains the steps to come; the one that trained the steps
    before a changed resume is kept beside it, and a resume that trains nothing changes none."""
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), "--checkpoint-every", "1", *world_args]
    assert run_cli([*args, "--steps", "2", "--lr", "0.001"], capsys)[0] == 0
    code, err = run_cli([*args, "--steps", "3", "--lr", "0.01", "--resume"], capsys)
    assert code == 0 and len(err) == 1 and "at step 2" in err[0] and "lr 0.001 -> 0.01" in err[0]
    lr = {p.name: json.loads(p.read_text())["lr"] for p in out.glob("config*.json")}
    assert lr == {"config.json": 0.01, "config.until-step-2.json": 0.001}
    assert metric_steps(out) == [0, 1, 2, 3]
    before = files_under(out)
    assert run_cli([*args, "--steps", "3", "--lr", "0.5", "--resume"], capsys)[0] == 0
    assert json.loads((out / "config.json").read_text())["lr"] == 0.01
    assert files_under(out)["config.json"] == before["config.json"]


def test_odd_metrics_lines_are_skipped_not_a_traceback(tmp_path: Path, world_args: list[str],
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """A metrics.jsonl with lines that are JSON but no metrics record (a list, a number, a
    step that is no integer, a text where a share belongs, a list nested past the JSON
    reader's depth): --resume reads around them, finishes the run and its summary, and keeps
    every real line of metrics.jsonl and samples.jsonl."""
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), *world_args, "--checkpoint-every", "1"]
    assert run_cli([*args, "--steps", "2"], capsys)[0] == 0
    odd = ["[]", "7", '{"step": "a"}', '{"step": null}', "[" * 100_000,
           '{"step": 1, "dead_share": "x"}', '{"step": 2, "group_dead": [1, "x"]}']
    with (out / "metrics.jsonl").open("a") as f:
        f.write("".join(x + "\n" for x in odd))
    code, err = run_cli([*args, "--steps", "3", "--resume"], capsys)
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]
    assert [r["step"] for r in read_metrics(out / "samples.jsonl")] == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
