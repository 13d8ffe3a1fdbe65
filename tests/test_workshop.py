"""End to end: a short workshop writes its metrics, plot and summary; a sweep writes its table."""

import json
import struct
from pathlib import Path

import pytest
from helpers import computed

from grpolab.app.cli import main
from grpolab.run.report import read_metrics

TINY = ["--sft-steps", "20", "--steps", "3", "--world-train-size", "64",
        "--world-heldout-size", "32", "--eval-size", "32", "--no-progress"]


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.mark.slow
def test_short_workshop_writes_metrics_and_png(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    rc = main(["workshop", *TINY, "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(out)])
    assert rc == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert r["groups"] == 8 and r["answers_generated"] == 64
        assert abs(r["dead_all_right_share"] + r["dead_all_wrong_share"] - r["dead_share"]) < 1e-9
        assert 0 <= r["predicted_dead_share"] <= 1
        assert r["heldout_acc"] is not None
    # the process's resident high-water mark: a model and an optimizer's worth, never falling
    peaks = [r["peak_rss_mib"] for r in rows[1:]]
    assert peaks == sorted(peaks) and peaks[0] > 50
    w, h = png_size(out / "workshop.png")
    assert w > 800 and h > 300
    summary = json.loads((out / "summary.json").read_text())
    assert summary["group_size"] == 8 and summary["prompts_per_step"] == 8
    assert summary["answers_generated"] == 3 * 64
    assert summary["peak_rss_mib"] == peaks[-1]
    assert (out / "checkpoints" / "last.pt").is_file()
    assert "held-out p(T=1) " in capsys.readouterr().out


def test_final_line_names_the_two_accuracies_as_the_step_lines_do(monkeypatch, capsys) -> None:
    """The exact pass probability at T is "held-out p(T=1)", greedy accuracy "held-out acc",
    in the workshop's last line as in the status lines and the sweep table."""
    from grpolab.app import commands
    from grpolab.config import Config
    from grpolab.run.trackers import Reporter

    summary = {"group_size": 8, "prompts_per_step": 8, "mean_dead_share": 0.5,
               "mean_predicted_dead_share": 0.5, "start_heldout_pass_prob": 0.641,
               "final_heldout_pass_prob": 0.656, "start_heldout_acc": 0.4,
               "final_heldout_acc": 0.45, "all_right_share_of_dead": 0.5}
    monkeypatch.setattr(commands, "run_workshop", lambda cfg, resume: summary)
    assert commands.workshop(Config(out_dir="x"), None, None, None, False) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert ("held-out p(T=1) 0.641 -> 0.656 (exact), held-out acc 0.400 -> 0.450 (greedy)"
            in line), line
    reporter = Reporter()
    reporter.cfg = Config()
    status = reporter.status_line({"step": 1, "heldout_acc": 0.45, "heldout_pass_prob": 0.656})
    assert "held-out acc 0.450  held-out p(T=1) 0.656" in status


@pytest.mark.slow
def test_sweep_table_and_plot(tmp_path, capsys) -> None:
    out = tmp_path / "sweep"
    rc = main(["workshop", *TINY, "--steps", "2", "--cache-dir", str(tmp_path / "cache"),
               "--out-dir", str(out), "--sweep", "4,16", "--variants", "grpo,dynamic",
               "--max-sampling-rounds", "1"])
    assert rc == 0
    table = (out / "sweep.md").read_text().splitlines()
    assert table[0].startswith("| variant | G | prompts/step")
    body = [line.split("|")[1:-1] for line in table[2:]]
    assert [(c[0].strip(), c[1].strip(), c[2].strip()) for c in body] == [
        ("grpo", "4", "16"), ("grpo", "16", "4"), ("dynamic", "4", "16"), ("dynamic", "16", "4")
    ]
    # plain GRPO generates exactly the budget; dynamic sampling at least that
    answers = [int(c[-1]) for c in body]
    assert answers[0] == answers[1] == 2 * 64 and min(answers[2:]) >= 2 * 64
    png_size(out / "sweep.png")
    for d in ("grpo-G4", "grpo-G16", "dynamic-G4", "dynamic-G16"):
        assert (out / d / "metrics.jsonl").is_file() and (out / d / "workshop.png").is_file()
    assert "| grpo | 4 |" in capsys.readouterr().out


def test_sweep_rejects_bad_sizes(tmp_path, capsys) -> None:
    assert main(["workshop", "--sweep", "2,5", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sweep: group_size 5 does not divide the budget 64" in err[0]


@pytest.mark.slow
def test_seed_sweep_reports_mean_and_spread(tmp_path) -> None:
    out = tmp_path / "seeds"
    rc = main(["workshop", *TINY, "--steps", "1", "--cache-dir", str(tmp_path / "cache"),
               "--out-dir", str(out), "--sweep", "8", "--seeds", "0,1"])
    assert rc == 0
    row = (out / "sweep.md").read_text().splitlines()[2].split("|")[1:-1]
    assert row[0].strip() == "grpo" and "±" in row[3] and row[-1].strip() == "64"
    assert (out / "grpo-G8-seed0" / "metrics.jsonl").is_file()
    assert (out / "grpo-G8-seed1" / "metrics.jsonl").is_file()


def test_mean_summary_hand_values() -> None:
    from grpolab.world.workshop import SUMMARY_KEYS, mean_summary

    a = dict.fromkeys(SUMMARY_KEYS, 0.2)
    b = dict.fromkeys(SUMMARY_KEYS, 0.4)
    m = mean_summary([a, b])
    assert m["mean_dead_share"] == pytest.approx(0.3)
    assert m["mean_dead_share_sd"] == pytest.approx(0.1414, abs=1e-4)
    assert "mean_dead_share_sd" not in mean_summary([a])


def test_a_sweep_value_undefined_in_every_seed_is_a_dash(tmp_path) -> None:
    """No held-out rows (eval_size 0) leave the held-out numbers undefined in every seed: the
    table says '-' and the plot leaves them out (the sweep crashed after its last run)."""
    from grpolab.config import Config
    from grpolab.run.plots import plot_sweep
    from grpolab.world.workshop import SUMMARY_KEYS, mean_summary, sweep_row

    held = [k for k in SUMMARY_KEYS if "heldout" in k]
    runs = [{**dict.fromkeys(SUMMARY_KEYS, x), **dict.fromkeys(held, None)} for x in (0.2, 0.4)]
    m = mean_summary(runs)
    row = sweep_row("grpo", Config(), m)
    assert row[3] == "0.300 ± 0.141" and row[6:9] == ["-"] * 3 and row[9:12] == ["-"] * 3
    plot_sweep([("grpo", 8, m), ("grpo", 4, m)], tmp_path / "sweep.png")
    png_size(tmp_path / "sweep.png")


@pytest.mark.slow
def test_short_run_is_deterministic_per_seed(tmp_path) -> None:
    """Same seed, same thread count: the same metrics line for line (timings aside); another
    seed is another world, start and run."""

    def run(seed: int, name: str) -> list[dict]:
        out = tmp_path / name
        assert main(["workshop", *TINY, "--seed", str(seed), "--cache-dir",
                     str(tmp_path / f"cache-{name}"), "--out-dir", str(out)]) == 0
        return computed(read_metrics(out / "metrics.jsonl"))

    a, b, c = run(0, "a"), run(0, "b"), run(1, "c")
    assert a == b
    assert a != c


def test_waste_vs_success_summary() -> None:
    """First/last-ten dead shares and the correlation of the all-right dead share with
    held-out accuracy, from hand-made steps where both rise together."""
    from grpolab.run.report import summarize

    rows = [{"step": 0, "heldout_acc": 0.5, "heldout_pass_prob": 0.5}]
    for s in range(1, 21):
        right = 0.2 + 0.02 * s
        rows.append({"step": s, "reward_mean": 0.5 + 0.01 * s, "dead_share": right + 0.1,
                     "dead_all_right_share": right, "dead_all_wrong_share": 0.1,
                     "heldout_acc": 0.5, "heldout_pass_prob": 0.5 + 0.01 * s,
                     "answers_generated": 64, "useful_answers": 32})
    s = summarize(rows)
    assert s["dead_share_first10"] == pytest.approx(0.1 + 0.2 + 0.02 * 5.5)
    assert s["dead_share_last10"] == pytest.approx(0.1 + 0.2 + 0.02 * 15.5)
    assert s["dead_all_right_last10"] > s["dead_all_right_first10"]
    assert s["reward_last10"] == pytest.approx(0.5 + 0.155)
    assert s["corr_all_right_dead_vs_acc"] == pytest.approx(1.0)
    assert s["answers_per_useful"] == pytest.approx(2.0)


@pytest.mark.slow
def test_workshop_with_top_p_and_the_plain_heldout_bench(tmp_path) -> None:
    """A workshop run with top_p reports its own (filtered) sampler's exact held-out accuracy;
    bench/plain_heldout.py reads its final policy under the plain softmax, which is the run's
    own number for a run without filters."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "plain_heldout", Path(__file__).resolve().parents[1] / "bench" / "plain_heldout.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cache = ["--cache-dir", str(tmp_path / "cache")]
    ends = {}
    for name, extra in (("plain", []), ("top_p", ["--top-p", "0.5"])):
        out = tmp_path / name
        assert main(["workshop", *TINY, *cache, *extra, "--out-dir", str(out)]) == 0
        last = read_metrics(out / "metrics.jsonl")[-1]
        step, plain = bench.plain_heldout(out, tmp_path / "scratch" / name)
        assert step == 3
        ends[name] = (last["heldout_pass_prob"], plain)
    assert ends["plain"][0] == pytest.approx(ends["plain"][1], abs=1e-6)
    # (the 20-step start is poor: about 0.01 either way) the filtered sampler is another one
    assert abs(ends["top_p"][0] - ends["top_p"][1]) > 1e-3


def test_a_sweep_resumes_each_run_and_refuses_shared_folders(tmp_path, world_args,
                                                            monkeypatch, capsys) -> None:
    """--resume on a sweep continues each run that has a checkpoint (here: one stopped at its
    first step) and starts the others, instead of refusing the first run as already there;
    a variant or seed given twice, or names alike but for punctuation, would write one folder
    twice: refused before any run starts."""
    from grpolab.run import trainer

    out = tmp_path / "sweep"
    args = ["workshop", *world_args, "--out-dir", str(out), "--sweep", "4", "--variants",
            "grpo,policy_loss=gspo+epochs=2", "--checkpoint-every", "1"]
    real_step, calls = trainer.GRPOTrainer.step, []

    def stop_in_the_second_run(self):  # (SIGKILL-like: the second run's step 2 never ends)
        calls.append(self.out_dir.name)
        if calls.count(self.out_dir.name) == 2 and self.out_dir.name != "grpo-G4":
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(trainer.GRPOTrainer, "step", stop_in_the_second_run)
    assert main([*args, "--steps", "2"]) == 130
    monkeypatch.undo()
    capsys.readouterr()
    assert main([*args, "--steps", "2", "--resume"]) == 0, capsys.readouterr().err
    second = read_metrics(out / "policy_loss_gspo_epochs_2-G4" / "metrics.jsonl")
    assert [r["step"] for r in second] == [0, 1, 2] and len({r["run_id"] for r in second}) == 1
    assert (out / "sweep.md").read_text().count("| 4 | 4 |") == 2
    for variants, seeds in (("grpo,grpo", "0"), ("grpo", "0,0"),
                            ("policy_loss=gspo+epochs=2,policy_loss=gspo+ epochs=2", "0")):
        fresh = tmp_path / f"dup{len(variants)}{len(seeds)}"
        code = main(["workshop", *world_args, "--out-dir", str(fresh), "--variants", variants,
                     "--seeds", seeds, "--steps", "1"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "would both write" in err[0], err
        assert not fresh.exists()


def test_api_sweep_arguments_are_checked_and_only_its_runs_returned(tmp_path,
                                                                   world_args) -> None:
    """grpolab.workshop(sweep=4) or seeds="0,1" (the CLI's text) run as the CLI would; a
    value of another kind is a ConfigError, not a TypeError or a sweep of characters; the
    records returned are this sweep's runs, not those another sweep left in the folder."""
    import grpolab

    kw = {"sft_steps": 2, "cache_dir": world_args[3], "world_train_size": 64,
          "world_heldout_size": 16, "eval_size": 16, "budget": 16, "progress": False,
          "steps": 1}
    out = tmp_path / "sweep"
    assert list(grpolab.workshop(sweep=4, variants="grpo", out_dir=str(out), **kw)) == [
        "grpo-G4"]
    got = grpolab.workshop(sweep="4", variants=["rloo"], seeds="0,1", out_dir=str(out),
                           overwrite=True, **kw)
    assert sorted(got) == ["rloo-G4-seed0", "rloo-G4-seed1"] and (out / "grpo-G4").is_dir()
    for bad in ({"sweep": 4.5}, {"seeds": ["0"]}, {"variants": [1]}, {"sweep": {4: 1}},
                {"seeds": True}):
        with pytest.raises(grpolab.ConfigError, match="takes a list of"):
            grpolab.workshop(out_dir=str(tmp_path / "bad"), **bad, **kw)
    with pytest.raises(grpolab.ConfigError, match="must be comma-separated integers"):
        grpolab.workshop(out_dir=str(tmp_path / "bad"), seeds="0,x", **kw)
    assert not (tmp_path / "bad").exists()
