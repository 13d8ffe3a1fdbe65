"""Model folders on the way (``save_model_every``, ``save_total_limit``: grpolab.run.export):
checkpoint-<step>/ written whole, pruned by step number among this run's own, rewritten by a
resume that repeats the step, removed by --overwrite; saved models load with
``from_pretrained`` and ``grpolab eval`` like final/."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml
from helpers import run_cli, tiny_trainer, weights

from grpolab.config import ConfigError
from grpolab.run import checkpoint, export
from grpolab.run.trainer import RunStopped, TrainingError


class FolderBackend:
    """Writes one file per save (its ``tag``), or half of it and fails (``fail``)."""

    def __init__(self, tag: str = "v1", fail: bool = False) -> None:
        self.tag, self.fail = tag, fail

    def save_pretrained(self, out_dir: str, state_dict: dict | None = None) -> None:
        (Path(out_dir) / "model.txt").write_text(self.tag)
        if self.fail:
            raise OSError(28, "No space left on device")


def steps_of(out: Path, run_id: str | None = None) -> list[int]:
    return [int(d.name.removeprefix("checkpoint-")) for d in export.step_dirs(out, run_id)]


def test_pruning_keeps_the_newest_steps_of_this_run_only(tmp_path: Path) -> None:
    """save_total_limit counts this run's folders by step number (checkpoint-10 is newer than
    checkpoint-9); final/, checkpoints/, an earlier run's folder and another tool's
    checkpoint-N/ (no grpolab.json) are never pruned; --overwrite removes grpolab's only."""
    out = tmp_path
    foreign = out / "checkpoint-12"  # e.g. TRL's, in the same folder
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    export.save_step(FolderBackend(), out, 1, "earlier")
    (out / "final").mkdir()
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "last.pt").write_bytes(b"x")
    for step in (9, 10, 11):
        export.save_step(FolderBackend(), out, step, "run", keep=0)
    assert steps_of(out, "run") == [9, 10, 11]
    export.save_step(FolderBackend(), out, 20, "run", keep=2)
    assert steps_of(out, "run") == [11, 20]  # (by name, 9 would have been kept over 11)
    assert steps_of(out) == [1, 11, 20]
    assert json.loads((out / "checkpoint-20" / "grpolab.json").read_text()) == {
        "run_id": "run", "step": 20}
    assert (foreign / "config.json").exists() and (out / "final").is_dir()
    (out / "notes.txt").write_text("mine")
    checkpoint.clear_run(out)  # --overwrite
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-12", "checkpoints", "notes.txt"]


def test_a_failed_save_leaves_the_folder_whole_and_a_resume_clears_after_its_step(
        tmp_path: Path) -> None:
    """A save that fails half-way (a full disk, a second signal) leaves the step's earlier
    folder as it was and no half folder under its name; a resume at an earlier step drops
    the later folders it will write again, and the leftovers."""
    export.save_step(FolderBackend("v1"), tmp_path, 4, "run")
    with pytest.raises(OSError, match="No space"):
        export.save_step(FolderBackend("v2", fail=True), tmp_path, 4, "run")
    assert (tmp_path / "checkpoint-4" / "model.txt").read_text() == "v1"
    with pytest.raises(OSError, match="No space"):
        export.save_step(FolderBackend("v2", fail=True), tmp_path, 6, "run")
    assert not (tmp_path / "checkpoint-6").exists()
    assert (tmp_path / ".checkpoint-6.partial").is_dir()
    export.drop_after(tmp_path, 4, "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
    export.drop_after(tmp_path, 2, "run")
    assert list(tmp_path.iterdir()) == []


def test_the_trainer_saves_prunes_and_a_resume_rewrites_later_steps(tmp_path: Path) -> None:
    """Every save_model_every steps a folder of the model as it is then (the world's backend
    writes tiny_gpt.pt), the newest save_total_limit kept; the saves change nothing trained.
    A resume drops the run's folders past its step and writes each step's again."""
    plain = tiny_trainer(tmp_path / "plain", steps=4)
    plain.train()
    out = tmp_path / "run"
    tr = tiny_trainer(out, steps=4, save_model_every=1, save_total_limit=2, checkpoint_every=2)
    tr.train()
    assert steps_of(out) == [3, 4]
    last = torch.load(out / "checkpoint-4" / "tiny_gpt.pt", weights_only=True)
    for k, v in weights(plain).items():  # the model of step 4, and the same run as without
        assert torch.equal(weights(tr)[k], v) and torch.equal(last[k], v), k
    third = torch.load(out / "checkpoint-3" / "tiny_gpt.pt", weights_only=True)
    assert any(not torch.equal(third[k], v) for k, v in last.items())
    # a kill after step 5's folder (no checkpoint of it): the resume at 4 redoes step 5
    (out / "checkpoint-5").mkdir()
    (out / "checkpoint-5" / "grpolab.json").write_text(json.dumps({"run_id": tr.run_id}))
    (out / "checkpoint-7").mkdir()  # a run that got further before it was stopped
    (out / "checkpoint-7" / "grpolab.json").write_text(json.dumps({"run_id": tr.run_id}))
    again = tiny_trainer(out, steps=6, save_model_every=1, save_total_limit=0)
    again.train(resume=True)
    assert again.run_id == tr.run_id
    assert steps_of(out) == [3, 4, 5, 6]  # 7 is gone; 5 is the resumed run's
    assert (out / "checkpoint-5" / "tiny_gpt.pt").is_file()


def test_a_folder_this_run_did_not_write_is_never_replaced(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Another tool's checkpoint-2/ (TRL's, say) in out_dir: refused before the first step, in
    one line, the folder untouched. A save that fails (a full disk) stops the run, named."""
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "optimizer.pt").write_text("TRL's")
    tr = tiny_trainer(out, steps=2, save_model_every=1)
    with pytest.raises(ConfigError, match="holds checkpoint-2 not written by this run"):
        tr.train()
    assert os.listdir(out / "checkpoint-2") == ["optimizer.pt"]
    # ... another grpolab run's folder too, and the user's files beside it (the refusal is a
    # mistake before step 1: it takes back only what this run wrote)
    (out / "checkpoint-2" / "grpolab.json").write_text(json.dumps({"run_id": "other"}))
    (out / "train.png").write_text("mine")
    tr = tiny_trainer(out, steps=2, save_model_every=1)
    with pytest.raises(ConfigError, match="holds checkpoint-2 not written by this run"):
        tr.train()
    assert sorted(os.listdir(out / "checkpoint-2")) == ["grpolab.json", "optimizer.pt"]
    assert (out / "train.png").read_text() == "mine"

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "save_step", full)
    tr = tiny_trainer(tmp_path / "full", steps=2, save_model_every=1)
    with pytest.raises(TrainingError, match="model folder of step 1 could not be written: "
                                            "OSError: .Errno 28. No space left"):
        tr.train()


@pytest.mark.parametrize("signals", [1, 2])
def test_a_signal_during_a_model_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      signals: int) -> None:
    """A stop signal while checkpoint-<step>/ is written waits for it, as for a step, then
    checkpoints and stops; a second one abandons it, leaving no folder of that name, and the
    resume writes it."""
    tr = tiny_trainer(tmp_path, steps=4, save_model_every=2, checkpoint_every=1)
    real = type(tr.backend).save_pretrained

    def signalled(self, out_dir: str, state_dict: dict | None = None) -> None:
        for _ in range(signals):
            os.kill(os.getpid(), signal.SIGTERM)
        real(self, out_dir, state_dict)

    monkeypatch.setattr(type(tr.backend), "save_pretrained", signalled)
    with pytest.raises(RunStopped) as info:
        tr.train()
    if signals == 1:
        assert "after step 2 of 4" in str(info.value)
        assert (tmp_path / "checkpoint-2" / "tiny_gpt.pt").is_file()
        assert checkpoint.read(tmp_path / "checkpoints" / "last.pt")["step"] == 2
    else:
        assert "second SIGTERM" in str(info.value)
        assert not (tmp_path / "checkpoint-2").exists()
        assert checkpoint.read(tmp_path / "checkpoints" / "last.pt")["step"] == 1
    monkeypatch.undo()
    tiny_trainer(tmp_path, steps=4, save_model_every=2, checkpoint_every=1).train(resume=True)
    assert steps_of(tmp_path) == [2, 4]
    assert sorted(p.name for p in tmp_path.glob(".checkpoint-*")) == []


@pytest.mark.parametrize("key", ["save_model_every", "save_total_limit"])
def test_a_negative_count_is_one_line_exit_2(key: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code, err = run_cli(["train", f"--{key.replace('_', '-')}", "-1", "--out-dir", str(out)],
                        capsys)
    what = ("a count of steps, or below 1 a share of the run" if key == "save_model_every"
            else ">= 0")
    assert code == 2 and err == [f"grpolab: error: {key} must be {what} (got -1)"]
    assert not out.exists()


# ------------------------------------------------------------- a real model, end to end


def _params(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())


@pytest.mark.slow
def test_train_writes_model_folders_that_load_and_evaluate(
        llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """grpolab train, 4 steps, LoRA: save_model_every 2 with save_total_limit 1 leaves
    checkpoint-4/ beside final/, the same merged weights; with no limit checkpoint-2/ stays
    too, another model, which grpolab eval loads; --overwrite removes the folders."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {a}?", "solution": str(2 * a)})
                            + "\n" for a in range(6)))
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model_path": llama, "dataset": str(data), "eval_dataset": str(data),
        "prompt_column": "question", "answer_column": "solution", "rewards": ["format"],
        "format_pattern": ".*7.*", "steps": 4, "budget": 8, "group_size": 4,
        "max_new_tokens": 8, "lr": 0.01, "eval_size": 4, "eval_every": 4, "out_dir": str(out),
        "progress": False, "checkpoint_every": 0, "save_model_every": 2,
        "save_total_limit": 1}))
    train = ["train", "--config", str(config)]
    assert run_cli(train, capsys)[0] == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    final, fourth = _params(out / "final"), _params(out / "checkpoint-4")
    assert final.keys() == fourth.keys() and all(torch.equal(final[k], fourth[k]) for k in final)
    assert (out / "checkpoint-4" / "tokenizer.json").is_file()
    assert (out / "checkpoint-4" / "adapter" / "adapter_config.json").is_file()

    assert run_cli([*train, "--overwrite", "--save-total-limit", "0"], capsys)[0] == 0
    assert steps_of(out) == [2, 4]
    second, final = _params(out / "checkpoint-2"), _params(out / "final")
    assert any(not torch.equal(second[k], v) for k, v in final.items())
    evaluated = tmp_path / "eval"
    assert run_cli(["eval", "--config", str(config), "--model-path", str(out / "checkpoint-2"),
                    "--out-dir", str(evaluated)], capsys)[0] == 0
    assert json.loads((evaluated / "eval.json").read_text())["prompts"] == 4

    assert run_cli([*train, "--overwrite", "--steps", "1"], capsys)[0] == 0
    assert list(out.glob("checkpoint-*")) == []  # (1 step: none of this run's own)
