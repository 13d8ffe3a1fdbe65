"""Bad input ends with one line on stderr that names the problem, and a meaningful exit code.

Config mistakes exit 2 before anything is written; a failing reward is not fatal (it is
counted in ``reward_problems``); a non-finite loss stops the run with exit 1 and leaves the
metrics and checkpoints written so far intact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpolab.app.cli import main
from grpolab.config import Config
from grpolab.core.losses import LossOut
from grpolab.run.trainer import GRPOTrainer
from grpolab.world.backend import TinyBackend
from grpolab.world.model import CharTokenizer, TinyConfig, TinyGPT
from grpolab.world.task import make_splits


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = int(e.code or 0)
    return code, capsys.readouterr().err.splitlines()


def _files(tmp_path: Path) -> dict[str, Path]:
    files = {"broken": "steps: [1, 2\ngroup_size: 4\n", "unknown": "steps: 3\ngroup_sise: 4\n",
             "badvalue": "steps: abc\n"}
    out = {}
    for name, text in files.items():
        out[name] = tmp_path / f"{name}.yaml"
        out[name].write_text(text)
    return out


CASES = [
    # (argv, words the one line must contain); {d} is the test's tmp dir
    (["workshop", "--config", "{d}/broken.yaml"], ["broken YAML", "broken.yaml", "at line 2"]),
    (["workshop", "--config", "{d}/unknown.yaml"],
     ["unknown.yaml", "unknown config key 'group_sise'", "did you mean 'group_size'"]),
    (["workshop", "--group-sise", "4"], ["unrecognized arguments: --group-sise"]),
    (["workshop", "--group-size", "7"], ["group_size 7 does not divide the budget 64"]),
    (["workshop", "--sweep", "4,6"], ["sweep: group_size 6 does not divide the budget 64"]),
    (["workshop", "--sweep", "1,4"], ["sweep: group_size must be >= 2 (got 1)"]),
    (["train", "--model-path", "/nonexistent/model"], ["model_path", "/nonexistent/model"]),
    (["workshop", "--config", "{d}/missing.yaml"], ["config file not found", "missing.yaml"]),
    (["workshop", "--steps", "abc"], ["'steps'", "'abc'", "int"]),
    (["workshop", "--config", "{d}/badvalue.yaml"], ["badvalue.yaml", "'steps'", "'abc'"]),
    (["workshop", "--loss-agg", "tokens"], ["--loss-agg", "'tokens'"]),
    (["workshop", "--steps", "0"], ["steps must be >= 1"]),
    # another command's setting is refused, not left unread (argparse offers each command its
    # own flags; these come in through TRL's spelling)
    (["workshop", "--dataset", "d.jsonl", "--model_path", "m"],
     [("dataset, model_path are settings of grpolab train and eval, which grpolab workshop "
      "does not read (it trains on its own task world")]),
    (["train", "--world_train_size", "9"],
     ["world_train_size is a setting of grpolab workshop, which grpolab train does not read"]),
    (["eval", "--lr", "0.1"], [("lr is a setting of grpolab workshop and train, which grpolab "
                               "eval does not read")]),
    # ... in TRL's and verl's names too (read as grpolab's)
    (["workshop", "actor_rollout_ref.model.path=m", "--dataset_name", "o/d"],
     ["model_path", "dataset", "are settings of grpolab train and eval, which grpolab workshop"]),
    (["eval", "--num_generations", "4"],
     ["group_size is a setting of grpolab workshop and train, which grpolab eval does not"]),
]


@pytest.mark.parametrize(("argv", "words"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_config_errors_are_one_line_exit_2(argv: list[str], words: list[str], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _files(tmp_path)
    out = tmp_path / "run"
    argv = [a.format(d=tmp_path) for a in argv] + ["--out-dir", str(out), "--no-progress"]
    code, err = _cli(argv, capsys)
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith("grpolab"), err
    for w in words:
        assert w in err[0], (w, err[0])
    assert not out.exists(), "nothing is written before the config is valid"


def test_train_without_the_hf_extra_names_the_install(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    code, err = _cli(["train", "--model-path", str(tmp_path), "--out-dir", str(tmp_path / "r")],
                     capsys)
    assert code == 2 and len(err) == 1, err
    assert "needs the Hugging Face extras" in err[0]
    assert err[0].endswith(": pip install 'grpolab[hf]'"), err


def test_version_and_a_help_without_markup(capsys: pytest.CaptureFixture[str]) -> None:
    import grpolab

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"grpolab {grpolab.__version__}\n"
    for argv in ([], ["workshop"], ["train"], ["eval"]):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        assert "`" not in capsys.readouterr().out, argv


@pytest.mark.slow  # subprocesses / a full run: not in the quick subset
def test_real_process_prints_exactly_one_line(tmp_path: Path) -> None:
    """No library warning or traceback sneaks onto stderr (imports included)."""
    for argv in (["workshop", "--steps", "abc"], ["train", "--model-path", "/nonexistent"]):
        p = subprocess.run([sys.executable, "-m", "grpolab", *argv, "--out-dir",
                            str(tmp_path / "run")], check=False, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2
        assert p.stderr.count("\n") == 1 and p.stderr.startswith("grpolab: error: "), p.stderr


def test_ctrl_c_while_torch_loads_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C in the second or two torch takes to load (before grpolab's own handling) ends
    in one line and 130, as later; ``import grpolab`` itself loads no torch."""
    script = ("import builtins, sys\n"
              "real = builtins.__import__\n"
              "def imp(name, *a, **k):\n"
              "    if name == 'torch':\n"
              "        raise KeyboardInterrupt\n"
              "    return real(name, *a, **k)\n"
              "import grpolab\n"
              "assert 'torch' not in sys.modules and grpolab.__version__\n"
              "builtins.__import__ = imp\n"
              "from grpolab.app import main\n"
              "sys.exit(main(['workshop', '--out-dir', sys.argv[1]]))\n")
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], check=False,
                       capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr) == (130, "grpolab: interrupted; nothing was written\n")
    assert not (tmp_path / "run").exists()
    import grpolab  # (every name the package offers is there on first use)

    assert all(callable(getattr(grpolab, name)) for name in grpolab.__all__)


# ---------------------------------------------------------------- during training ----


def _flaky_reward(prompts: list, completions: list[str], answer: list, **_: object) -> list:
    """Raises on any batch holding a '7' (user code with a bug); fine on the rest."""
    if any("7" in c for c in completions):
        raise KeyError("bug in user reward")
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def test_raising_reward_is_counted_not_fatal(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyGPT(TinyConfig(vocab_size=CharTokenizer().vocab_size, d_model=32, n_layers=1))
    splits = make_splits(0, 32, 8)
    cfg = Config(steps=2, budget=16, group_size=4, eval_size=8, progress=False,
                 checkpoint_every=0, reward_on_error=-1.0)
    tr = GRPOTrainer(cfg, TinyBackend(model), splits.train, [_flaky_reward], splits.heldout,
                     out_dir=tmp_path)
    recs = tr.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # Only the answers containing a '7' are penalised, each counted once.
    assert all(r["reward_problems"] > 0 for r in recs[1:])
    assert all(r["reward_problems"] < 16 for r in recs[1:])
    assert min(r["reward_mean"] for r in recs[1:]) > -1.0


@pytest.mark.slow
def test_nan_loss_stops_with_one_line_and_keeps_files(
    tmp_path: Path, world_args: list[str], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from grpolab.run import update

    real = update.grpo_loss
    calls = {"n": 0}

    def nan_at_step_3(*args: object, **kwargs: object) -> LossOut:
        calls["n"] += 1
        out = real(*args, **kwargs)
        if calls["n"] == 3:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(update, "grpo_loss", nan_at_step_3)
    out = tmp_path / "run"
    code, err = _cli(["workshop", "--steps", "5", "--checkpoint-every", "2", "--out-dir",
                      str(out), *world_args], capsys)
    assert code == 1
    assert len(err) == 1, err
    assert "non-finite loss (nan) at step 3" in err[0] and str(out) in err[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=False)["step"] == 2

    # ... and the run resumes from there once the cause is gone.
    monkeypatch.setattr(update, "grpo_loss", real)
    code, err = _cli(["workshop", "--steps", "3", "--resume", "--out-dir", str(out),
                      *world_args], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]


@pytest.mark.slow
def test_resume_without_checkpoint_exits_1(tmp_path: Path, world_args: list[str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _cli(["workshop", "--steps", "2", "--resume", "--out-dir", str(tmp_path),
                      *world_args], capsys)
    assert code == 1
    assert len(err) == 1 and "no checkpoint to resume from" in err[0], err


def test_resume_into_a_missing_folder_makes_nothing(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "typo"
    code, err = _cli(["workshop", "--steps", "2", "--resume", "--out-dir", str(out)], capsys)
    assert code == 2 and len(err) == 1 and "does not exist" in err[0], err
    assert not out.exists()


# ---------------------------------------------------------------- the Python API ----


def test_python_api_raises_the_clis_config_error(tmp_path: Path) -> None:
    """What the CLI reports with exit 2 (here a missing dataset file) is grpolab.ConfigError,
    one line, found before anything is written."""
    import grpolab

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # enough for the path check, which comes first
    out = tmp_path / "run"
    with pytest.raises(grpolab.ConfigError) as info:
        grpolab.train({"model_path": str(model), "dataset": str(tmp_path / "nope.jsonl")},
                      steps=1, out_dir=str(out))
    msg = str(info.value)
    assert "\n" not in msg and "nope.jsonl" in msg and "does not exist" in msg
    assert isinstance(info.value.__cause__, FileNotFoundError)
    assert not out.exists()


def test_other_commands_settings_in_the_api_and_in_a_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A keyword of another command is the CLI's ConfigError; a file that sets one (a file
    may serve several commands) is named in one warning, and eval, which reads its training's
    file, is not warned."""
    import grpolab
    from grpolab.config import make_config

    with pytest.raises(grpolab.ConfigError, match="^rewards is a setting of grpolab train and "
                       "eval, which grpolab workshop does not read"):
        grpolab.workshop(rewards=["math"], out_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    (tmp_path / "run.yaml").write_text("rewards: [math]\nlr: 0.001\n")
    make_config(str(tmp_path / "run.yaml"), {}, "workshop")
    make_config(str(tmp_path / "run.yaml"), {}, "eval")
    from grpolab.config import Config, to_dict

    for command in ("workshop", "train"):  # a run's config.json holds every key: not warned
        make_config(to_dict(Config()), {}, command)
    assert [r.getMessage() for r in caplog.records] == [
        (f"{tmp_path / 'run.yaml'}: rewards is a setting of grpolab train and eval, which "
        "grpolab workshop does not read (it trains on its own task world; models and data are "
        "grpolab train's)")]


def test_python_api_raises_run_error_where_the_cli_exits_1(llama: str, tmp_path: Path) -> None:
    import grpolab

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(8)))
    (tmp_path / "run").mkdir()  # (a folder that does not exist is a ConfigError)
    with pytest.raises(grpolab.RunError, match="no checkpoint to resume from") as info:
        grpolab.train({"model_path": llama, "dataset": str(data)}, resume=True, steps=1,
                      budget=4, group_size=2, out_dir=str(tmp_path / "run"), progress=False)
    assert "\n" not in str(info.value)
    assert type(info.value.__cause__).__name__ == "CheckpointError"


def test_switches_take_hugging_faces_true_and_false(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``--lora false`` (as Hugging Face's CLIs write booleans) is ``--no-lora``; the word is
    no longer read as the previous flag's value (``--max_completion_length 4 --overwrite true``
    was "cannot read ['4', 'true'] as int")."""
    from grpolab.app.cli import _bool_words

    assert _bool_words(["train", "--max_completion_length", "4", "--overwrite", "true",
                        "--lora", "False", "--dynamic-sampling", "0", "--steps", "2"]) == [
        "train", "--max_completion_length", "4", "--overwrite", "--no-lora",
        "--no-dynamic-sampling", "--steps", "2"]
    code, err = _cli(["workshop", "--group_size", "3", "--dynamic-sampling", "true",
                      "--out-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and err == ["grpolab: error: group_size 3 does not divide the budget 64"]


def test_a_bare_import_reaches_the_subpackages() -> None:
    """``import grpolab`` then ``grpolab.core.losses`` (as before the lazy names), in a fresh
    process where nothing else has loaded them."""
    for code in ("import grpolab; print(grpolab.config.Config, grpolab.core.losses.grpo_loss)",
                 # (first: nothing else of grpolab loaded it, grpolab.config's import included)
                 "import grpolab; print(grpolab.core.losses.grpo_loss, grpolab.run.trainer)"):
        p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0 and "grpo_loss" in p.stdout, p.stderr
