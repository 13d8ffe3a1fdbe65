"""Where a run is watched while it trains: experiment trackers, a live PNG and a console line.

``report_to: [tensorboard, wandb, trackio, mlflow]`` (any subset, none by default) sends every
number of ``metrics.jsonl`` each step, the config as hyperparameters, the per-step samples as a
table (prompt, answer, reward, advantage, dead or not) and the run's plot to each tool, through
its own package (``pip install 'grpolab[trackers]'``), in that tool's own local store unless the
user points it elsewhere:

* tensorboard: event files in ``<out_dir>/tensorboard/<run_id>`` (``tensorboard --logdir``).
* wandb: ``wandb.init(dir=<out_dir>)``; ``WANDB_MODE=offline`` keeps it on disk
  (``wandb sync`` uploads later); ``WANDB_PROJECT`` names the project (default grpolab).
* trackio: trackio's local database (``TRACKIO_DIR``, default ~/.cache/huggingface/trackio),
  project ``TRACKIO_PROJECT`` (default grpolab); ``trackio show`` opens it.
* mlflow: mlflow's tracking URI (``MLFLOW_TRACKING_URI``; mlflow's default is
  ``sqlite:///mlflow.db`` in the working folder), experiment ``MLFLOW_EXPERIMENT_NAME``
  (default grpolab).

``Reporter`` is what the trainer calls: ``start`` when the run starts, ``log`` with each
record it writes (step 0 included) and that step's sample groups, ``finish`` when it ends. At
each evaluation it redraws the run's PNG and prints one status line (at most ~10% of the
run's time goes to drawing: a fast run's PNG is redrawn less often; the last step always).

A tracker that fails mid-run (a full disk, a server gone) is dropped with one warning: the run,
its metrics.jsonl and checkpoints go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpolab.config.validate import TRACKER_PACKAGES as PACKAGES
from grpolab.config.validate import every

log = logging.getLogger("grpolab")

# name -> the package that provides it (checked when the config is validated)
SAMPLE_COLUMNS = ["step", "group", "prompt", "answer", "completion", "reward", "advantage",
                  "dead"]


def resolve(names: list[str]) -> list[str]:
    """The trackers to start: ``none`` is nothing, ``all`` every installed one (as in TRL)."""
    if "all" in names:
        return [n for n, pkg in PACKAGES.items() if importlib.util.find_spec(pkg) is not None]
    return [n for n in dict.fromkeys(names) if n != "none"]


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record (bools as 0/1); ids, None and NaN are left out."""
    out = {}
    for k, v in metrics.items():
        if k in ("step", "run_id") or v is None or isinstance(v, (str, list, dict)):
            continue
        try:
            x = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(x):
            out[k] = x
    return out


def _text(value: Any) -> str:
    """A prompt or answer as one string (chat messages: role: content lines)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in value)
    return json.dumps(value, default=str)


def sample_columns(groups: list[dict]) -> list[str]:
    """The table's columns: SAMPLE_COLUMNS, then each reward function's score when there are
    several (TRL's completions table)."""
    return SAMPLE_COLUMNS + [f"rewards/{n}" for n in (groups[0].get("per_reward", {})
                                                      if groups else [])]


def sample_rows(step: int, groups: list[dict]) -> list[list[Any]]:
    """samples.jsonl's groups of one step as table rows, one per answer (``sample_columns``)."""
    rows = []
    for gi, g in enumerate(groups):
        per = list(g.get("per_reward", {}).values())
        for i, (c, r, a) in enumerate(zip(g["completions"], g["rewards"], g["advantages"])):
            rows.append([step, gi, _text(g["prompt"]), _text(g.get("answer", "")), _text(c),
                         None if r is None else float(r), float(a), bool(g["dead"]),
                         *(col[i] for col in per)])
    return rows


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """Config values as trackers take hyperparameters: lists and dicts as JSON text."""
    return {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
            for k, v in config.items()}


# ------------------------------------------------------------------------------ trackers


class Tracker:
    """One tool. ``start`` opens the run; the rest write to it; ``finish`` closes it."""

    name = ""

    def start(self, config: dict[str, Any], out_dir: Path, run_name: str, run_id: str) -> None:
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def log_samples(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        raise NotImplementedError

    def log_image(self, name: str, path: Path, step: int) -> None:
        raise NotImplementedError

    def finish(self, ok: bool = True) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """torch's SummaryWriter: scalars, the config and samples as text, the plot as an image."""

    name = "tensorboard"

    def start(self, config: dict[str, Any], out_dir: Path, run_name: str, run_id: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = out_dir / "tensorboard" / run_id
        self.writer = SummaryWriter(log_dir=str(self.logdir))
        table = "| key | value |\n|---|---|\n" + "\n".join(
            f"| {k} | {v} |" for k, v in flat_config(config).items())
        self.writer.add_text("config", table, 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_samples(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        def cell(v: Any) -> str:
            s = f"{v:.3f}" if isinstance(v, float) else str(v)
            return s.replace("|", "\\|").replace("\n", " ")

        head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)
        self.writer.add_text("samples", head + "\n" + "\n".join(
            "| " + " | ".join(cell(v) for v in r) + " |" for r in rows), step)

    def log_image(self, name: str, path: Path, step: int) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as im:
            self.writer.add_image(name, np.asarray(im.convert("RGB")), step, dataformats="HWC")
        self.writer.flush()

    def finish(self, ok: bool = True) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """wandb.init in ``out_dir``; the mode (online, offline) is wandb's own (WANDB_MODE)."""

    name = "wandb"

    def start(self, config: dict[str, Any], out_dir: Path, run_name: str, run_id: str) -> None:
        import os

        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpolab"), name=run_name,
                              dir=str(out_dir), config=config, reinit="create_new")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({"samples": self.wandb.Table(columns=columns, data=rows)}, step=step)

    def log_image(self, name: str, path: Path, step: int) -> None:
        self.run.log({name: self.wandb.Image(str(path))}, step=step)

    def finish(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class TrackioTracker(Tracker):
    """trackio.init in its local database (TRACKIO_DIR); no system-metrics sampling."""

    name = "trackio"

    def start(self, config: dict[str, Any], out_dir: Path, run_name: str, run_id: str) -> None:
        import os

        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "grpolab"),
                                name=run_name, config=config, auto_log_cpu=False,
                                auto_log_gpu=False, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({"samples": self.trackio.Table(columns=columns, data=rows)},
                     step=step)

    def log_image(self, name: str, path: Path, step: int) -> None:
        self.run.log({name: self.trackio.Image(str(path))}, step=step)

    def finish(self, ok: bool = True) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """An MlflowClient run at mlflow's tracking URI: params, metrics, tables, the plot."""

    name = "mlflow"

    def start(self, config: dict[str, Any], out_dir: Path, run_name: str, run_id: str) -> None:
        import os

        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "grpolab")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_name,
                                             tags={"grpolab.run_id": run_id}).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flat_config(config).items()]
        for i in range(0, len(params), 100):  # mlflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_samples(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        data = {c: [r[i] for r in rows] for i, c in enumerate(columns)}
        path = f"samples/step_{step:06d}.json"
        try:
            self.client.log_table(self.run_id, data=data, artifact_file=path)
        except ImportError:  # log_table wants pandas; the same rows as plain JSON without it
            self.client.log_dict(self.run_id, data, path)

    def log_image(self, name: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), "plots")

    def finish(self, ok: bool = True) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


TRACKERS: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "trackio": TrackioTracker,
    "mlflow": MlflowTracker,
}


# ------------------------------------------------------------------------------ the reporter


class Reporter:
    """The trainer's one handle on everything watched live: trackers, PNG, status line.

    ``png``/``title``/``lengths`` are those of the run's plot (``plots.plot_run``); without
    ``png`` no plot is drawn. Only the process that writes metrics (rank 0) reports.
    """

    draw_share = 0.1  # most of the run's time that redrawing the PNG may take
    first_draw_s = 20.0  # no live redraw in a run's first seconds (a short run draws at its end)

    def __init__(self, png: str | Path | None = None, title: str = "", lengths: bool = False,
                 status: bool = True) -> None:
        self.png = Path(png) if png else None
        self.title = title
        self.lengths = lengths
        self.status = status
        self.trackers: list[Tracker] = []
        self.cfg: Any = None
        self.out_dir: Path | None = None
        self.last_step = -1
        self._last_draw = 0.0  # when the PNG was last drawn
        self._draw_cost = 0.0  # seconds the last drawing took
        self._t0: float | None = None  # when the first record came (for s/step)
        self._steps_at_t0 = 0

    # ---------------------------------------------------------------- hooks --
    def start(self, trainer: Any) -> None:
        """Run start: open each configured tracker (config logged as hyperparameters)."""
        from grpolab.run import dist

        if not dist.is_main():
            return
        self.cfg, self.out_dir = trainer.cfg, Path(trainer.out_dir)
        config = dataclasses.asdict(self.cfg)
        run_id = str(trainer.run_id)
        run_name = f"{self.out_dir.name}-{run_id}"
        for name in resolve(list(getattr(self.cfg, "report_to", []) or [])):
            tracker = TRACKERS[name]()
            try:
                tracker.start(config, self.out_dir, run_name, run_id)
            except Exception as e:  # noqa: BLE001 - a tracker never stops a run
                log.warning("report_to %s: could not start (%s); training goes on without it",
                            name, " ".join(str(e).split())[:200])
                continue
            self.trackers.append(tracker)

    def log(self, record: dict[str, Any], samples: list[dict] | None = None) -> None:
        """Each record the trainer writes: its numbers and samples to every tracker; at an
        evaluation also the PNG and the status line."""
        if self.cfg is None:
            return
        step = int(record.get("step", 0))
        if self._t0 is None:
            self._t0, self._steps_at_t0 = time.perf_counter(), step
        numbers = _numbers(record)
        rows = sample_rows(step, samples) if samples else []
        self._each("log", step, numbers)
        if rows:
            self._each("log_samples", step, sample_columns(samples), rows)
        self.last_step = step
        cfg = self.cfg
        if step == 0 or step % every(cfg, "eval_every") == 0 or step == cfg.steps:
            self.evaluated(record)

    def evaluated(self, record: dict[str, Any]) -> None:
        """An evaluation: redraw the PNG (unless drawing would cost more than ~10% of the run's
        time since the last one; the last step always) and print one status line."""
        step = int(record.get("step", 0))
        now = time.perf_counter()
        if step != self.cfg.steps and (
                now - self._last_draw < self._draw_cost / self.draw_share
                or now - self._t0 < self.first_draw_s):
            if step == 0 and self.status:  # the start's numbers, not drawn yet
                self._print(self.status_line(record))
            return
        if self.png is not None:
            import warnings

            from grpolab.run.plots import plot_run
            from grpolab.run.report import read_metrics

            t = time.perf_counter()
            with warnings.catch_warnings():  # (an empty legend before the first step)
                warnings.simplefilter("ignore", UserWarning)
                plot_run(read_metrics(self.out_dir / "metrics.jsonl"), self.png, self.title,
                         lengths=self.lengths)
            self._draw_cost = time.perf_counter() - t
        self._last_draw = time.perf_counter()
        if self.status:
            self._print(self.status_line(record))

    def finish(self, ok: bool = True) -> None:
        """Run end: the final plot to every tracker, then close them."""
        if self.cfg is None:
            return
        if self.png is not None and self.png.is_file() and ok:
            self._each("log_image", self.png.stem, self.png, max(self.last_step, 0))
        for t in self.trackers:
            try:
                t.finish(ok)
            except Exception as e:  # noqa: BLE001
                log.warning("report_to %s: finishing failed (%s)", t.name, e)
        self.trackers = []
        self.cfg = None

    # -------------------------------------------------------------- helpers --
    def status_line(self, r: dict[str, Any]) -> str:
        """``step 10/40  reward 0.53  held-out acc 0.45  dead 0.38  1.2 s/step  -> train.png``"""
        step = int(r.get("step", 0))
        parts = [f"step {step}/{self.cfg.steps}"]
        for key, label in (("reward_mean", "reward"), ("heldout_acc", "held-out acc"),
                           ("heldout_pass_prob", f"held-out p(T={self.cfg.temperature:g})"),
                           ("dead_share", "dead"), ("completion_len", "len")):
            v = r.get(key)
            if key == "dead_share" and self.cfg.group_size == 1:
                continue  # a group of one has no spread to lose
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                parts.append(f"{label} {v:.3g}" if key == "completion_len" else f"{label} {v:.3f}")
        done = step - self._steps_at_t0
        if done > 0 and self._t0 is not None:
            parts.append(f"{(time.perf_counter() - self._t0) / done:.2f} s/step")
        if r.get("hacking_suspected"):
            parts.append("REWARD HACKING SUSPECTED")
        if self.png is not None:
            parts.append(f"-> {self.png}")
        return "grpolab: " + "  ".join(parts)

    @staticmethod
    def _print(line: str) -> None:
        from tqdm import tqdm

        tqdm.write(line)  # above a progress bar, if one is showing

    def _each(self, method: str, *args: Any) -> None:
        for t in list(self.trackers):
            try:
                getattr(t, method)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker never stops a run
                log.warning("report_to %s: %s failed (%s); dropping it for the rest of the run",
                            t.name, method, " ".join(str(e).split())[:200])
                self.trackers.remove(t)
                with contextlib.suppress(Exception):
                    t.finish(False)


@contextlib.contextmanager
def finishing(reporter: Reporter | None) -> Iterator[None]:
    """Around a run: the reporter's ``finish`` on the way out, told whether the run failed."""
    if reporter is None:
        yield
        return
    try:
        yield
    except BaseException:
        reporter.finish(ok=False)
        raise
    reporter.finish(ok=True)
