"""report_to: each tracker's files read back with that tool's own reader; the live PNG and
status line; the Python API's workshop records. One short workshop run feeds every test."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import json
import math
import struct
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

import grpolab
from grpolab.config import ConfigError, make_config
from grpolab.run import plots
from grpolab.run.report import read_metrics
from grpolab.run.trackers import TRACKERS, Reporter, Tracker

INSTALLED = [n for n in TRACKERS if importlib.util.find_spec(n) is not None]
STEPS = 3


def numbers(rec: dict) -> dict[str, float]:
    return {k: float(v) for k, v in rec.items()
            if isinstance(v, (int, float)) and k != "step" and not math.isnan(v)}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("trackers")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
           "TRACKIO_DIR": str(tmp / "trackio"), "TRACKIO_PROJECT": "grpolab-test",
           # mlflow's file store: its sqlite store (mlflow's default) spends ~8 s creating
           # tables; both are read through the same MlflowClient
           "MLFLOW_TRACKING_URI": f"file:{tmp / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true",
           "MLFLOW_EXPERIMENT_NAME": "grpolab-test", "MLFLOW_DISABLE_TELEMETRY": "true",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    drawn: list[list[int]] = []
    real_plot = plots.plot_run

    def spy(rows: list[dict], *a: Any, **k: Any) -> None:
        drawn.append([r["step"] for r in rows])
        real_plot(rows, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        if "trackio" in INSTALLED and "trackio.utils" in sys.modules:  # read TRACKIO_DIR already
            for name, mod in list(sys.modules.items()):
                if name.startswith("trackio") and hasattr(mod, "TRACKIO_DIR"):
                    mp.setattr(mod, "TRACKIO_DIR", tmp / "trackio")
        mp.setattr(plots, "plot_run", spy)
        mp.setattr(Reporter, "draw_share", 1e9)  # redraw at every evaluation, however fast
        mp.setattr(Reporter, "first_draw_s", 0.0)  # ... from the first
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            records = grpolab.workshop(
                sft_steps=2, steps=STEPS, world_train_size=64, world_heldout_size=32,
                eval_size=32, progress=False, cache_dir=str(tmp / "cache"),
                out_dir=str(tmp / "run"), report_to=INSTALLED)
    run_dir = tmp / "run"
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    return {"tmp": tmp, "dir": run_dir, "records": records, "drawn": drawn,
            "stdout": out.getvalue(), "metrics": read_metrics(run_dir / "metrics.jsonl"),
            "samples": samples, "env": env}


def need(name: str) -> None:
    if name not in INSTALLED:
        pytest.skip(f"{name} is not installed (pip install 'grpolab[trackers]')")


# ---------------------------------------------------------------------- API, PNG, console


@pytest.mark.slow
def test_python_api_workshop_returns_the_records(run: dict) -> None:
    records = run["records"]
    assert list(records) == run["metrics"]
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    assert records.out_dir == run["dir"]
    assert records.summary["steps"] == STEPS
    assert records.summary["final_heldout_acc"] == records[-1]["heldout_acc"]


@pytest.mark.slow
def test_png_redrawn_at_every_evaluation_with_a_status_line(run: dict) -> None:
    # during the run the PNG held the steps so far (then once more at the end, as before)
    assert run["drawn"][: STEPS + 1] == [list(range(s + 1)) for s in range(STEPS + 1)]
    lines = [x for x in run["stdout"].splitlines() if x.startswith("grpolab: step ")]
    assert [x.split()[2] for x in lines] == [f"{s}/{STEPS}" for s in range(STEPS + 1)]
    last = run["metrics"][-1]
    assert f"reward {last['reward_mean']:.3f}" in lines[-1]
    assert f"held-out acc {last['heldout_acc']:.3f}" in lines[-1]
    assert str(run["dir"] / "workshop.png") in lines[-1]


def test_report_to_names_are_checked() -> None:
    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'"):
        make_config(None, {"report_to": "tensorbord"})
    assert make_config(None, {"report_to": "none"}).report_to == ["none"]
    assert make_config(None, {}).report_to == []


def test_a_failing_tracker_is_dropped_and_the_run_goes_on(tmp_path: Path, caplog) -> None:
    class Broken(Tracker):
        name = "broken"
        logged: ClassVar[list] = []

        def start(self, *a: Any) -> None: ...

        def log(self, step: int, metrics: dict) -> None:
            raise OSError("disk full")

        def finish(self, ok: bool = True) -> None:
            Broken.logged.append(ok)

    class Fake:
        cfg = make_config(None, {"steps": 2})
        out_dir, run_id, step_num = tmp_path, "abc", 0

    rep = Reporter(status=False)
    rep.start(Fake())
    rep.trackers = [Broken()]
    rep.log({"step": 1, "reward_mean": 0.5})
    assert rep.trackers == [] and Broken.logged == [False]
    assert "report_to broken: log failed (disk full)" in caplog.text
    rep.log({"step": 2, "reward_mean": 0.5})  # nothing left to fail
    rep.finish()


# ---------------------------------------------------------------------- each tool's reader


@pytest.mark.slow
def test_tensorboard_event_file(run: dict) -> None:
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logdir,) = (run["dir"] / "tensorboard").iterdir()
    assert logdir.name == run["metrics"][0]["run_id"]
    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0, "images": 0})
    acc.Reload()
    for rec in run["metrics"]:
        for key, value in numbers(rec).items():
            (ev,) = [e for e in acc.Scalars(key) if e.step == rec["step"]]
            assert ev.value == pytest.approx(value, rel=1e-6, abs=1e-7), key
    texts = {t: acc.Tensors(t) for t in acc.Tags()["tensors"]}
    config = texts["config/text_summary"][0].tensor_proto.string_val[0].decode()
    assert "| group_size | 8 |" in config and "| report_to |" in config
    samples = texts["samples/text_summary"]
    assert [e.step for e in samples] == list(range(1, STEPS + 1))
    first = run["samples"][0]["groups"][0]
    text = samples[0].tensor_proto.string_val[0].decode()
    assert f"| 1 | 0 | {first['prompt']} | {first['answer']} | {first['completions'][0]} |" in text
    (img,) = acc.Images("workshop")
    assert img.step == STEPS and img.width > 800


def read_wandb_records(path: Path) -> list[Any]:
    """The records of a .wandb transaction log, parsed with wandb's own protobuf schema.

    The framing is LevelDB's log format after a 7-byte ':W&B' header (what wandb's former
    ``sdk/internal/datastore.py`` read; wandb 0.2x+ ships no Python reader): 32 KiB blocks of
    chunks, each a 7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    block, pos, out, parts = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            out.append(rec)
    return out


@pytest.mark.slow
def test_wandb_offline_run_files(run: dict) -> None:
    need("wandb")
    (path,) = glob.glob(str(run["dir"] / "wandb" / "offline-run-*" / "run-*.wandb"))
    recs = read_wandb_records(Path(path))
    kinds = [r.WhichOneof("record_type") for r in recs]
    (run_rec,) = [r.run for r, k in zip(recs, kinds) if k == "run"]
    config = {i.key: json.loads(i.value_json) for i in run_rec.config.update}
    assert config["group_size"] == 8 and config["steps"] == STEPS
    history = {}
    for r, k in zip(recs, kinds):
        if k == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in r.history.item}
            history[row["_step"]] = row
    assert sorted(history) == list(range(STEPS + 1))
    for rec in run["metrics"]:
        for key, value in numbers(rec).items():
            assert history[rec["step"]][key] == pytest.approx(value, rel=1e-6), key
    files = Path(path).parent / "files"
    table = json.loads((files / history[1]["samples/path"]).read_text())
    assert table["columns"][:5] == ["step", "group", "prompt", "answer", "completion"]
    group = run["samples"][0]["groups"][0]
    assert [row[5] for row in table["data"]] == pytest.approx(group["rewards"])
    assert [row[6] for row in table["data"]] == pytest.approx(group["advantages"])
    assert (files / history[STEPS]["workshop/path"]).is_file()


@pytest.mark.slow
def test_mlflow_local_store(run: dict) -> None:
    need("mlflow")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(run["env"]["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("grpolab-test")
    (mrun,) = client.search_runs([exp.experiment_id])
    assert mrun.info.status == "FINISHED"
    assert mrun.data.tags["grpolab.run_id"] == run["metrics"][0]["run_id"]
    assert mrun.data.params["group_size"] == "8" and mrun.data.params["steps"] == str(STEPS)
    for key in ("reward_mean", "dead_share", "heldout_acc", "loss"):
        hist = {m.step: m.value for m in client.get_metric_history(mrun.info.run_id, key)}
        want = {r["step"]: float(r[key]) for r in run["metrics"] if r.get(key) is not None}
        assert hist == pytest.approx(want), key
    local = Path(client.download_artifacts(mrun.info.run_id, "samples/step_000001.json",
                                           str(run["tmp"] / "mlflow-dl")))
    table = json.loads(local.read_text())
    group = run["samples"][0]["groups"][0]
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [r["completion"] for r in rows] == group["completions"]
    assert [r["reward"] for r in rows] == pytest.approx(group["rewards"])
    assert [a.path for a in client.list_artifacts(mrun.info.run_id, "plots")] == [
        "plots/workshop.png"]


@pytest.mark.slow
def test_trackio_local_database(run: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    need("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    # where the run wrote (a trackio imported before the fixture, by another test's imports,
    # had TRACKIO_DIR patched only while the run lasted)
    for name, mod in list(sys.modules.items()):
        if name.startswith("trackio") and hasattr(mod, "TRACKIO_DIR"):
            monkeypatch.setattr(mod, "TRACKIO_DIR", run["tmp"] / "trackio")
    assert (run["tmp"] / "trackio").is_dir()
    (name,) = SQLiteStorage.get_runs("grpolab-test")
    assert name == f"run-{run['metrics'][0]['run_id']}"
    assert SQLiteStorage.get_run_config("grpolab-test", name)["group_size"] == 8
    logs = SQLiteStorage.get_logs("grpolab-test", name)
    for rec in run["metrics"]:
        got = {}
        for row in logs:
            if row["step"] == rec["step"]:
                got.update(row)
        for key, value in numbers(rec).items():
            assert got[key] == pytest.approx(value, rel=1e-6), key
    tables = [row["samples"] for row in logs if "samples" in row]
    assert len(tables) == STEPS
    first = tables[0]["_value"]
    group = run["samples"][0]["groups"][0]
    assert [r["completion"] for r in first] == group["completions"]
    assert [r["advantage"] for r in first] == pytest.approx(group["advantages"])
    assert any("workshop" in row for row in logs)


@pytest.mark.slow  # subprocesses / a full run: not in the quick subset
@pytest.mark.parametrize("first", ["module", "function"])
def test_grpolab_workshop_and_train_are_the_api(first: str) -> None:
    # grpolab.workshop and grpolab.train are the Python API's functions, whichever of the
    # package's modules were imported first.
    import subprocess

    head = ("from grpolab.world.workshop import PRESETS\n" if first == "module"
            else "f = grpolab.workshop\nassert callable(f)\n")
    code = ("import grpolab\n" + head
            + "import grpolab.world.workshop as w\nimport grpolab.app.commands, grpolab.app.api\n"
              "assert grpolab.workshop is grpolab.app.api.workshop\n"
              "assert 'grpo' in w.PRESETS\n"
              "assert grpolab.train is grpolab.app.api.train\n")
    subprocess.run([sys.executable, "-c", code], check=True)
