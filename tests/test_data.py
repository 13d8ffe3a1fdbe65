"""Local dataset loading: formats, column mapping and actionable errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpolab.data.files import load_rows

ROWS = [
    {"question": "What is 2 + 2?", "solution": "4", "level": 1},
    {"question": "What is 3 * 3?", "solution": "9", "level": 2},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_maps_columns_and_keeps_originals(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    rows = load_rows(str(path), prompt_column="question", answer_column="solution")
    assert rows == [
        {**ROWS[0], "prompt": "What is 2 + 2?", "answer": "4"},
        {**ROWS[1], "prompt": "What is 3 * 3?", "answer": "9"},
    ]


def test_parquet_and_csv(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2", "answer": "4"}]
    )
    pq.write_table(table, tmp_path / "d.parquet")
    rows = load_rows(str(tmp_path / "d.parquet"))
    assert [(r["prompt"], r["answer"]) for r in rows] == [("1+1", "2"), ("2+2", "4")]

    (tmp_path / "d.csv").write_text("prompt,answer\n5+5,10\n")
    rows = load_rows(str(tmp_path / "d.csv"))
    assert rows[0]["prompt"] == "5+5"
    assert str(rows[0]["answer"]) == "10"


def test_json_array_and_no_answer_column(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "hi"}, {"prompt": "yo"}]))
    rows = load_rows(str(path), answer_column=None)
    assert rows == [{"prompt": "hi"}, {"prompt": "yo"}]


def test_chat_prompts_are_kept_as_messages(tmp_path: Path) -> None:
    chat = [
        {
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "2+2?"},
            ],
            "answer": "4",
        },
        {"prompt": [{"role": "user", "content": "3+3?", "name": "bob"}], "answer": "6"},
    ]
    rows = load_rows(str(_write_jsonl(tmp_path / "chat.jsonl", chat)))
    assert rows[0]["prompt"] == chat[0]["prompt"]
    assert rows[1]["prompt"] == chat[1]["prompt"]


def test_prompt_template_wraps_text_and_the_last_user_message(tmp_path: Path) -> None:
    from grpolab.config import make_config
    from grpolab.data.files import run_rows

    chat = [{"prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "4"},
                        {"role": "user", "content": "3+3?"}], "answer": "6"},
            {"prompt": "1+1?", "answer": "2"}]
    data = _write_jsonl(tmp_path / "mixed.jsonl", chat)
    cfg = make_config(None, {"model_path": "m", "dataset": str(data),
                             "prompt_template": "{prompt} Reply briefly."}, "train")
    train, _ = run_rows(cfg)
    assert train[0]["prompt"] == [*chat[0]["prompt"][:3],
                                  {"role": "user", "content": "3+3? Reply briefly."}]
    assert train[1]["prompt"] == "1+1? Reply briefly."


def test_parquet_chat_prompts_drop_arrow_padding(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Arrow gives every message struct every key; the first message gets name=None.
    chat = [
        {"prompt": [{"role": "user", "content": "a"}], "answer": "1"},
        {"prompt": [{"role": "user", "content": "b", "name": "x"}], "answer": "2"},
    ]
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "chat.parquet")
    rows = load_rows(str(tmp_path / "chat.parquet"))
    assert [r["prompt"] for r in rows] == [c["prompt"] for c in chat]


def test_directory_prefers_split_files(tmp_path: Path, caplog) -> None:
    _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": "1"}])
    _write_jsonl(tmp_path / "test.jsonl", [{"prompt": "b", "answer": "2"}])
    assert [r["prompt"] for r in load_rows(str(tmp_path))] == ["a"]
    assert [r["prompt"] for r in load_rows(str(tmp_path), split="test")] == ["b"]
    # no file named for a split: one split of every file, said when it is the held-out one
    other = tmp_path / "other"
    other.mkdir()
    _write_jsonl(other / "training_data.jsonl", [{"prompt": "a", "answer": "1"}])
    _write_jsonl(other / "test_v2.jsonl", [{"prompt": "b", "answer": "2"}])
    with caplog.at_level("WARNING", logger="grpolab"):
        assert len(load_rows(str(other))) == 2 and not caplog.records
        assert len(load_rows(str(other), split="test")) == 2
    assert caplog.records[-1].getMessage().endswith(
        "names no split (train.jsonl, test.jsonl, test-00000.parquet, ...): its test prompts "
        "come from all of test_v2.jsonl, training_data.jsonl")


def test_missing_column_lists_existing_columns(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match="no prompt column 'prompt'") as info:
        load_rows(str(path))
    for column in ("question", "solution", "level"):
        assert column in str(info.value)
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match="no answer column 'answer'.*question, solution, level"):
        load_rows(str(path), prompt_column="question")


def test_missing_file_and_bad_extension(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "d.txt"
    bad.write_text("hello")
    with pytest.raises(ValueError, match=r"unsupported extension '\.txt'"):
        load_rows(str(bad))


def test_empty_and_malformed(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_rows(str(empty))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="broken.jsonl"):
        load_rows(str(broken))


def test_a_bad_jsonl_line_is_named_by_its_line_number(tmp_path: Path) -> None:
    rows = [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(30)]
    rows[24] = '{"prompt": "q24" "answer": "24"}'  # a missing comma on line 26 (one blank line)
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(rows[:3] + [""] + rows[3:]) + "\n")
    with pytest.raises(ValueError) as info:
        load_rows(str(path))
    assert "line 26 is not valid JSON (Expecting ',' delimiter, column 18)" in str(info.value)
    assert "\n" not in str(info.value)
    path.write_text(rows[0] + "\n[1, 2]\n")
    with pytest.raises(ValueError, match="line 2 is not a JSON object"):
        load_rows(str(path))


def test_non_text_prompt_is_rejected(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "ok", "answer": 1}, {"prompt": 5, "answer": 2}]
    )
    with pytest.raises(ValueError, match="line 2 column 'prompt' is int"):
        load_rows(str(path))


def test_a_hub_dataset_is_read_from_the_local_cache(tmp_path: Path, monkeypatch) -> None:
    """ORG/NAME[:CONFIG[:SPLIT]]: the dataset's files in the Hugging Face cache, chosen by its
    card's configs as `datasets` chooses them (the config's split, not another config's); no
    config among several, a split the cache lacks, a dataset it lacks or holds in part, is one
    line saying what to write or fetch. A local path of that shape is a path."""
    pytest.importorskip("pandas")
    from helpers import cached_dataset, hub_cache

    cache = hub_cache(tmp_path / "hub", monkeypatch)
    cached_dataset(cache, "org/math", {"main": {"train": ROWS, "test": ROWS[:1]},
                                       "other": {"train": [{"question": "x", "solution": "y"}]}})
    part = cached_dataset(cache, "org/part", {"main": {"train": ROWS, "test": ROWS}})
    (part / "main" / "test-00000-of-00001.parquet").unlink()  # (fetched in part)
    from helpers import cached_repo

    plain = cached_repo(cache, "org/plain", "datasets") / "data"  # no card: the files' names
    plain.mkdir(parents=True)
    for i in (0, 2):  # (shard 1 of 3 not fetched)
        _write_jsonl(plain / f"train-0000{i}-of-00003.jsonl", ROWS[:1])
    read = lambda spec, split="train": load_rows(spec, "question", "solution", split)
    assert [r["answer"] for r in read("org/math:main")] == ["4", "9"]
    assert [r["answer"] for r in read("org/math:main", "test")] == ["4"]
    assert [r["answer"] for r in read("org/math:main:test")] == ["4"]
    assert [r["answer"] for r in read("org/math:other")] == ["y"]
    with pytest.raises(ValueError, match=r"no 'test' split in the cache \(it has train\)"):
        read("org/plain", "test")
    for spec, error, message in (
            ("org/math", ValueError, (r"available configs: \['main', 'other'\] \(write "
                                     r"org/math:CONFIG\)")),
            ("org/math:main:validation", ValueError, ("has no 'validation' split in the cache "
                                                     r"\(it has train, test\); write "
                                                     "org/math:main:SPLIT")),
            ("org/nope", FileNotFoundError, ("not a local file or folder, nor a Hugging Face Hub "
                                            f"dataset in the local cache .{cache}.; grpolab "
                                            "downloads nothing at run time: fetch it first "
                                            r"\(hf download --repo-type dataset org/nope\)")),
            ("org/part:main", FileNotFoundError, ("'org/part:main': the cache holds only part "
                                                  r"of it \(.*\); grpolab downloads nothing")),
            ("org/plain", FileNotFoundError, ("the cache holds 2 of 3 shards of its 'train' "
                                             "files; grpolab downloads nothing")),
            ("data/missing.jsonl", FileNotFoundError, ("dataset 'data/missing.jsonl' does not "
                                                      "exist"))):
        with pytest.raises(error, match=message):
            read(spec)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    _write_jsonl(tmp_path / "org" / "math", ROWS[:1])  # (a file named like the id)
    with pytest.raises(ValueError, match="unsupported extension"):
        read("org/math")  # the local path wins


def test_held_out_rows_past_eval_size_are_named(tmp_path: Path, caplog) -> None:
    """TRL evaluates every held-out row; grpolab the first eval_size: one line says so."""
    from grpolab.config import make_config
    from grpolab.data.files import run_rows

    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    for size, said in ((1, [("eval_dataset has 2 prompts; held-out measures are of the first 1 "
                            "(eval_size)")]), (2, [])):
        caplog.clear()
        cfg = make_config(None, {"dataset": str(path), "eval_dataset": str(path),
                                 "prompt_column": "question", "answer_column": "solution",
                                 "eval_size": size}, "train")
        with caplog.at_level("WARNING", logger="grpolab"):
            run_rows(cfg)
        assert [r.getMessage() for r in caplog.records if "has 2 prompts" in r.getMessage()] == said
