"""Datasets held in memory in the Python API (``dataset=``, TRL's ``train_dataset=``,
``eval_dataset=``): written to the run's data/ folder, trained on exactly as the same rows
in a file, resumed only with the same rows; what cannot be written is refused in one line."""

from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

import grpolab
from grpolab.data.memory import check_same, rows_of, write_rows

ROWS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b), "level": a % 3}
        for a, b in [(3, 4), (12, 7), (25, 17), (8, 9), (1, 1), (6, 2)]]


def longer(prompts, completions, **kwargs):  # TRL's signature: signal from any random model
    return [len(c) / 10 for c in completions]


def settings(tmp_path: Path, model: str, **over: Any) -> dict[str, Any]:
    cfg = {"model_path": model, "rewards": [longer], "steps": 2, "budget": 8, "group_size": 4,
           "max_new_tokens": 6, "eval_size": 2, "out_dir": str(tmp_path / "run"),
           "progress": False, "seed": 0, "report_to": ["none"]}
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}  # (None: left out)


def test_rows_in_memory_train_as_the_same_rows_in_a_file(
        llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A list of dicts as train_dataset and a dict of columns as eval_dataset (the model and
    reward as GRPOTrainer's model= and reward_funcs=): the run's records equal a run on the same rows in JSONL files (every
    logged number), and the run's folder holds the rows it read, named by their content; its
    config names them. A resume takes the same rows only. A run replacing it, even one refused
    before it starts, changes no file an earlier run wrote; the user's own data/ folder in the
    run's folder is never touched."""
    run = tmp_path / "run"
    data = run / "data"  # (the user's files, inside the run's folder)
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    (data / "eval.jsonl").write_text("mine")
    from_files = grpolab.train(settings(tmp_path / "a", llama, dataset=str(data / "train.jsonl"),
                                        eval_dataset=str(data / "test.jsonl")))
    columns = {k: [r[k] for r in ROWS[:2]] for k in ROWS[0]}
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    in_memory = grpolab.train(settings(tmp_path, "", model_path=None, rewards=None,
                                       answer_column="answer"), model=llama,
                              train_dataset=ROWS, eval_dataset=columns, reward_funcs=longer)
    assert len(in_memory) == 3
    # the run went offline (it downloads nothing) and the process is put back as it was
    assert "HF_HUB_OFFLINE" not in os.environ and constants.HF_HUB_OFFLINE is False

    def numbers(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if isinstance(v, (int, float))
                 and not k.startswith(("sec", "tokens_per", "peak", "time"))} for r in records]

    assert numbers(in_memory) == numbers(from_files)
    assert 0 < in_memory[1]["reward_std"] and in_memory[1]["grad_norm"] > 0
    saved = json.loads((run / "config.json").read_text())
    train, held = Path(saved["dataset"]), Path(saved["eval_dataset"])
    assert train.parent == held.parent == run / "api_data"
    assert re.fullmatch(r"train-[0-9a-f]{12}\.jsonl", train.name) and held.name.startswith("eval-")
    assert train.read_text() == (data / "train.jsonl").read_text()
    assert [json.loads(x) for x in held.read_text().splitlines()] == ROWS[:2]
    assert (data / "eval.jsonl").read_text() == "mine"

    # a resume with the same rows continues; with other rows, or none in memory, it is refused
    more = grpolab.train(settings(tmp_path, llama, steps=3), resume=True, dataset=ROWS,
                         eval_dataset=columns)
    assert [r["step"] for r in more] == [0, 1, 2, 3]
    with pytest.raises(grpolab.ConfigError, match="not the ones the run being resumed .*: 6 "
                       "rows, these 5; row 0 differs first"):
        grpolab.train(settings(tmp_path, llama, steps=4), resume=True,
                      dataset=ROWS[1:], eval_dataset=columns)
    with pytest.raises(grpolab.ConfigError, match="did not read its rows from memory"):
        grpolab.train(settings(tmp_path / "a", llama, steps=3), resume=True, dataset=ROWS,
                      eval_dataset=str(data / "test.jsonl"))
    # a replacing run refused before it starts (no such model) leaves the run's rows as they
    # were; one that runs reads its own file, beside them
    before = {p.name: p.read_text() for p in (run / "api_data").iterdir()}
    with pytest.raises(grpolab.ConfigError, match="no-model"):
        grpolab.train(settings(tmp_path, str(tmp_path / "no-model"), overwrite=True),
                      train_dataset=ROWS[:4])
    assert all((run / "api_data" / n).read_text() == t for n, t in before.items())
    grpolab.train(settings(tmp_path, llama, steps=1, overwrite=True, eval_size=0),
                  train_dataset=ROWS[:4])
    now = Path(json.loads((run / "config.json").read_text())["dataset"])
    assert now.name not in before and len(now.read_text().splitlines()) == 4


def test_datasets_and_dataframes_are_rows() -> None:
    """A datasets.Dataset and a pandas DataFrame give the rows a list of dicts gives; numpy
    values become plain numbers; a DatasetDict, a stream and non-rows are refused by name."""
    datasets = pytest.importorskip("datasets")
    pandas = pytest.importorskip("pandas")
    ds = datasets.Dataset.from_list(ROWS)
    assert rows_of(ds, "dataset") == ROWS
    assert rows_of(pandas.DataFrame(ROWS), "dataset") == ROWS
    assert rows_of({"prompt": ["a", "b"], "answer": ["1", "2"]}, "dataset") == [
        {"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    np = pytest.importorskip("numpy")  # (columns as Dataset.from_dict takes them)
    assert rows_of({"prompt": np.array(["a", "b"]), "answer": pandas.Series(["1", "2"])},
                   "dataset") == [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    refused = {
        "DatasetDict of splits (train, test); give one split, e.g. dataset=ds['train']":
            datasets.DatasetDict({"train": ds, "test": ds}),
        "IterableDataset, which may not end": ds.to_iterable_dataset(),
        "e.g. eval_dataset=ds['test']": datasets.DatasetDict({"train": ds, "test": ds}),
        "values are not sequences of one length (prompt: 2, answer: 1)":
            {"prompt": ["a", "b"], "answer": ["1"]},
        "(prompt: str)": {"prompt": "a"},
        "row 1 is of type str": [{"prompt": "a"}, "b"],
        "has no rows": [],
        "is of type int; give a file's path": 3,
    }
    for why, value in refused.items():
        with pytest.raises(ValueError, match=re.escape(why)):
            rows_of(value, "eval_dataset" if "eval_dataset=" in why else "dataset")


def test_written_rows_are_plain_json_or_refused(tmp_path: Path) -> None:
    """numpy numbers and arrays become numbers and lists, NaN and pandas' missing values null,
    a line separator inside a prompt stays inside its line; the file is named by its content
    and kept when there; a date, an infinity or a lone surrogate is refused naming its row and
    column, and nothing is written then."""
    np = pytest.importorskip("numpy")
    pandas = pytest.importorskip("pandas")
    rows = [{"prompt": "a\u2028b\nc", "answer": np.int64(4), "w": np.float32(0.5),
             "ids": np.arange(3), "x": float("nan"), "y": pandas.NA}]
    path = write_rows(rows, tmp_path / "d", "train", "dataset")
    assert write_rows(rows, tmp_path / "d", "train", "dataset") == path  # (there: kept)
    lines = path.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 2 and lines[1] == ""
    assert json.loads(lines[0]) == {"prompt": "a\u2028b\nc", "answer": 4, "w": 0.5,
                                    "ids": [0, 1, 2], "x": None, "y": None}
    for bad, what in ((datetime.date(2026, 12, 6), "'2026-12-06' of type date"),
                      (float("inf"), "'inf' of type float")):
        with pytest.raises(ValueError, match=f"row 1 column 'when' holds {what}, which"):
            write_rows([{"prompt": "p"}, {"prompt": "q", "when": bad}], tmp_path / "e",
                       "train", "dataset")
    with pytest.raises(ValueError, match="row 0 column 'prompt' holds text that is not valid "
                       "Unicode"):
        write_rows([{"prompt": "a \ud83d b"}], tmp_path / "e", "train", "dataset")
    assert list(tmp_path.iterdir()) == [tmp_path / "d"]  # (nothing written, no temporary file)
    # a resume compares rows, not text: the same rows with their keys in another order, and a
    # line separator inside a text, pass
    check_same([{"w": np.float32(0.5), "ids": [0, 1, 2], "x": None, "y": None, "answer": 4,
                 "prompt": "a\u2028b\nc"}], path, "dataset")
    with pytest.raises(ValueError, match="1 rows, these 2; row 1 differs first"):
        check_same([*rows, {}], path, "dataset")


def test_api_refusals_are_one_line(llama: str, tmp_path: Path) -> None:
    """dataset and train_dataset together, and rows that cannot be written, are ConfigErrors
    before anything runs; an in-memory null gold answer is refused at load naming its line."""
    with pytest.raises(grpolab.ConfigError, match="dataset and train_dataset are one setting"):
        grpolab.train(settings(tmp_path, llama), dataset=ROWS, train_dataset=ROWS)
    with pytest.raises(grpolab.ConfigError, match="^train_dataset has no rows"):
        grpolab.train(settings(tmp_path, llama), train_dataset=[])
    with pytest.raises(grpolab.ConfigError, match="^dataset is a setting of grpolab train"):
        grpolab.workshop(train_dataset=ROWS)
    # GRPOTrainer's other arguments: model= is model_path; the rest say what to give instead
    for key, said in (("args", "a GRPOConfig is not read whole"), ("peft_config", "use_peft"),
                      ("processing_class", "the tokenizer comes with the model"),
                      ("model", "save a model held in memory with save_pretrained")):
        with pytest.raises(grpolab.ConfigError, match=f"^{key}= .*{said}"):
            grpolab.train(settings(tmp_path, llama), **{key: object()})
    # a GRPOConfig given as the config itself (it was read as a file's name)
    trl = pytest.importorskip("trl")
    with pytest.raises(grpolab.ConfigError, match="^config: a GRPOConfig is not read; a "
                                                  "GRPOConfig is not read whole"):
        grpolab.train(trl.GRPOConfig(output_dir=str(tmp_path / "x"), bf16=False, use_cpu=True),
                      model=llama)
    with pytest.raises(grpolab.ConfigError, match="^config: a int is not read"):
        grpolab.train(3)
    with pytest.raises(grpolab.ConfigError, match="^config: a list is not read; rows go in "
                                                  "train_dataset="):
        grpolab.train(ROWS)  # (TRL takes the dataset as an argument: a likely slip)
    # a keyword's None is unset (the config's rows stay); answer_column None reads no column
    from grpolab.app.api import _config, _held_rows

    config, _, held = _held_rows({"dataset": ROWS}, {"dataset": None})
    assert held == {"dataset": (ROWS, "dataset")} and config["dataset"] == "(in memory)"
    assert _config(settings(tmp_path, llama), {"answer_column": None}, "train").answer_column \
        == ""
    # rows a later setting replaces (TRL's dataset_name keyword) are not used, nor written
    from grpolab.app.api import _with_rows

    config, over, held = _held_rows(settings(tmp_path, llama, dataset=ROWS),
                                    {"dataset_name": "o/d"})
    assert _with_rows(_config(config, over, "train"), held, False).dataset == "o/d"
    assert not (tmp_path / "run").exists()
    with pytest.raises(grpolab.ConfigError, match="run.api_data.train-[0-9a-f]+.jsonl.: line 2 "
                       "has no gold answer"):
        grpolab.train(settings(tmp_path, llama), train_dataset=[ROWS[0], {**ROWS[1],
                                                                          "answer": None}])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_api_errors_name_keywords_not_flags(tmp_path: Path) -> None:
    """The CLI's errors name its flags; from Python the same errors name the keywords."""
    from grpolab.app.api import _keywords

    said = ("out_dir r already holds a run; continue it with --resume, replace it with "
            "--overwrite, or choose another --out-dir; --no-lora, --steps, --sweep-x, a--b, "
            "runs/--steps/x.jsonl, --no-fail-on-reward-errors")
    assert _keywords(said) == (
        "out_dir r already holds a run; continue it with resume=True, replace it with "
        "overwrite=True, or choose another out_dir=; lora=False, steps=, --sweep-x, a--b, "
        "runs/--steps/x.jsonl, fail_on_reward_errors=False")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "run_id": "x"}\n')
    with pytest.raises(grpolab.ConfigError, match="continue it with resume=True, replace it "
                                                  "with overwrite=True"):
        grpolab.workshop(out_dir=str(tmp_path / "run"), steps=1)


def test_api_warnings_are_shown_as_the_clis(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that configured no logging sees grpolab's warnings as the CLI prints them
    (Python's last-resort handler printed them bare); one that did gets them its own way."""
    import logging

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # (as a plain script: no pytest's)
    with pytest.raises(grpolab.ConfigError):
        grpolab.workshop(out_dir=str(tmp_path / "run"), logging_steps=3, group_size=0)
    err = capsys.readouterr().err.splitlines()
    assert err and err[0].startswith("grpolab: TRL settings left aside"), err
    assert not logging.getLogger("grpolab").handlers  # (taken back after the call)
    seen: list[str] = []
    mine = logging.Handler()
    mine.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    monkeypatch.setattr(logging.getLogger(), "handlers", [mine])
    with pytest.raises(grpolab.ConfigError):
        grpolab.workshop(out_dir=str(tmp_path / "run"), logging_steps=3, group_size=0)
    assert capsys.readouterr().err == "" and seen[0].startswith("TRL settings left aside")


def test_api_calls_in_threads_share_the_shown_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two calls at once (threads): the second's warnings are still shown after the first ends
    (the first took the handler away with it), and the last to end takes it back."""
    import logging
    import threading

    from grpolab.app.api import _warnings_shown

    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    log = logging.getLogger("grpolab")
    entered, first_done = threading.Event(), threading.Event()
    counts: list[int] = []

    def second() -> None:  # (begun during the first call, ending after it)
        with _warnings_shown():
            entered.set()
            first_done.wait(10)
            counts.append(len(log.handlers))

    t = threading.Thread(target=second)
    with _warnings_shown():
        t.start()
        entered.wait(10)
        counts.append(len(log.handlers))
    first_done.set()
    t.join()
    assert counts == [1, 1] and not log.handlers


def test_a_callable_given_again_resumes_its_run(llama: str, tmp_path: Path) -> None:
    """A notebook runs the cell that defines the reward again: a new function of the same name,
    the reward the run was written with, named so in every process; the resume takes it. A run
    resumed without it, or with another, is refused."""
    def make() -> Any:
        def score(prompts, completions, **_):
            return [float(len(c) % 2) for c in completions]
        return score

    first = grpolab.train(settings(tmp_path, llama, rewards=[make()], checkpoint_every=1,
                                   eval_size=0, steps=1), dataset=ROWS)
    saved = json.loads((first.out_dir / "config.json").read_text())["rewards"]
    more = grpolab.train(settings(tmp_path, llama, rewards=[make()], eval_size=0, steps=2),
                         resume=True, dataset=ROWS)
    assert [r["step"] for r in more] == [0, 1, 2]
    assert json.loads((first.out_dir / "config.json").read_text())["rewards"] == saved
    with pytest.raises(grpolab.ConfigError, match="resume from Python with them given again"):
        grpolab.train(settings(tmp_path, llama, rewards=["exact"], eval_size=0, steps=3),
                      resume=True, dataset=ROWS)

    def other(prompts, completions, **_):  # (another name: not the run's reward)
        return [0.0] * len(completions)

    with pytest.raises(grpolab.ConfigError, match="resume from Python with them given again"):
        grpolab.train(settings(tmp_path, llama, rewards=[other], eval_size=0, steps=3),
                      resume=True, dataset=ROWS)
    # two of one name in one run: numbered in the order given, the same in every process
    from grpolab.app.api import _callables

    a, b = make(), make()
    assert _callables({"rewards": [a, b, a]})["rewards"] == [
        "grpolab.app.api:rewards.score", "grpolab.app.api:rewards.score_2",
        "grpolab.app.api:rewards.score"]
