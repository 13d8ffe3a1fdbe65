"""grpolab eval: greedy accuracy and unbiased pass@k of a Hugging Face model."""

from __future__ import annotations

import dataclasses
import json
from math import comb
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from grpolab.app import cli
from grpolab.config import Speed
from grpolab.core.passk import ks_up_to, pass_at_k
from grpolab.rollout.tinyhf import make_tiny_model


def test_pass_at_k_hand_values() -> None:
    """n = 5 samples: c = 2 right gives pass@1 0.4, pass@2 1 - C(3,2)/C(5,2) = 0.7; none right
    gives 0; when fewer than k are wrong, a right one is always drawn."""
    c = torch.tensor([2, 0, 4, 5])
    assert pass_at_k(5, c, 1).tolist() == pytest.approx([0.4, 0.0, 0.8, 1.0])
    assert pass_at_k(5, c, 2).tolist() == pytest.approx([0.7, 0.0, 1.0, 1.0])
    for k in (1, 2, 3, 4, 5):  # the closed form, for every c
        want = [1 - comb(5 - ci, k) / comb(5, k) for ci in range(6)]
        assert pass_at_k(5, torch.arange(6), k).tolist() == pytest.approx(want)
    with pytest.raises(ValueError, match="pass@6"):
        pass_at_k(5, c, 6)
    assert ks_up_to(8) == [1, 2, 4, 8] and ks_up_to(6) == [1, 2, 4, 6] and ks_up_to(1) == [1]


def test_eval_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_model(tmp_path / "model", arch="llama", hidden=32, heads=4)
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"q": f"What is {a} + {a}?", "a": str(2 * a)}) + "\n"
                            for a in range(7)))
    rewards = tmp_path / "my_rewards.py"  # a verifier a random model passes now and then
    rewards.write_text(
        "def first_digit_odd(prompts, completions, **_):\n"
        "    return [1.0 if any(ch in '13579' for ch in c[:3]) else 0.0 for c in completions]\n")
    out = tmp_path / "eval"
    argv = ["eval", "--model-path", model, "--eval-dataset", str(data), "--prompt-column", "q",
            "--answer-column", "a", "--rewards", f"{rewards}:first_digit_odd", "--eval-samples",
            "6", "--budget", "8", "--max-new-tokens", "6", "--out-dir", str(out),
            "--speed", "early_exit=false", "--top-p", "0.95"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "eval.json").read_text())
    assert res["prompts"] == 7 and res["samples_per_prompt"] == 6
    assert res["speed"] == {**dataclasses.asdict(Speed()), "early_exit": False}  # recorded
    assert res["sampling"] == {"top_k": 0, "top_p": 0.95, "min_p": 0.0,
                               "repetition_penalty": 1.0}
    assert 0 <= res["greedy_accuracy"] <= 1 and res["reward_problems"] == 0
    assert res["rewards/first_digit_odd"] == pytest.approx(res["greedy_accuracy"])
    passes = [res[f"pass@{k}"] for k in (1, 2, 4, 6)]
    assert passes == sorted(passes) and 0 < passes[0] < passes[-1] <= 1
    assert res["pass@1"] == pytest.approx(res["sampled_accuracy"])  # the estimator at k = 1
    assert "greedy accuracy" in printed and "pass@6" in printed
    assert cli.main(argv) == 0  # seeded: the same numbers again
    assert json.loads((out / "eval.json").read_text()) == res
    # --compare with an evaluation of other prompts: refused before any work or write
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**res, "prompts": 5, "greedy_correct": res["greedy_correct"][:5]}))
    out2 = tmp_path / "eval2"
    capsys.readouterr()
    assert cli.main([*argv[:-4], "--out-dir", str(out2), "--compare", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "5 prompts" in err[0] and "7 of" in err[0], err
    assert not (out2 / "eval.json").exists()
    # ... or of as many other prompts of the same dataset (another seed, a changed file)
    prompts = [json.loads(x)["prompt"] for x in (out / "completions.jsonl").read_text()
               .splitlines()][:7]
    from grpolab.data.files import fingerprint

    assert res["prompts_sha256"] == fingerprint(prompts)
    other.write_text(json.dumps({**res, "prompts_sha256": fingerprint(prompts[::-1])}))
    assert cli.main([*argv[:-4], "--out-dir", str(out2), "--compare", str(other)]) == 2
    assert "but not the same ones" in capsys.readouterr().err
    other.write_text("[1, 2]")  # (JSON of another shape: refused before any work)
    assert cli.main([*argv[:-4], "--out-dir", str(out2), "--compare", str(other)]) == 2
    assert "is no grpolab eval.json" in capsys.readouterr().err
    assert not (out2 / "eval.json").exists()


def test_eval_needs_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["eval", "--eval-dataset", str(tmp_path / "x.jsonl"),
                     "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "grpolab eval needs model_path" in err[0]


def test_a_run_folder_given_as_the_model_names_its_final_model(tmp_path: Path) -> None:
    """A run folder holds grpolab's config.json, not a model's: it is named as a run folder
    (and its final/ model, once written), not left to a tokenizer's traceback."""
    from grpolab.rollout.models import check_source

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"model_path": "m", "steps": 2}')
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(FileNotFoundError, match="is a grpolab run folder, not a model: it "
                                                "holds no final/ model yet"):
        check_source(str(run))
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(FileNotFoundError, match=f"its trained model is '{run / 'final'}'"):
        check_source(str(run))
    check_source(str(run / "final"))  # (a model's config.json: no refusal)


def test_eval_of_no_prompts_is_a_config_error(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # the size is refused before the model loads
    data = tmp_path / "x.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert cli.main(["eval", "--model-path", str(model), "--eval-dataset", str(data),
                     "--eval-size", "0", "--out-dir", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["grpolab: error: grpolab eval needs eval_size >= 1 (the prompts it measures)"]


def test_eval_help_and_out_dir_are_evals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """eval's help says what a shared setting means to eval, and eval writes to --out-dir, else
    runs/eval: never into the training run's out_dir that a --config file names."""
    from grpolab.app import evaluate

    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--out-dir OUT_DIR where eval.json and completions.jsonl go" in text
    assert "checkpoints" not in text and "dynamic" not in text and "LoRA" not in text
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "where metrics, samples, checkpoints and the model go" in text
    assert "comma-separated (q_proj,v_proj); all-linear = every" in text and "[all-" not in text

    seen: list[str] = []
    monkeypatch.setattr(evaluate, "evaluate", lambda cfg, compare: seen.append(cfg.out_dir) or 0)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run.yaml"
    run.write_text("model_path: m\ndataset: d.jsonl\nout_dir: runs/train-x\n")
    assert cli.main(["eval", "--config", str(run)]) == 0
    assert cli.main(["eval", "--config", str(run), "--out-dir", "runs/after"]) == 0
    assert seen == ["runs/eval", "runs/after"]


def test_compare_gives_paired_gains_and_standard_errors(caplog: pytest.LogCaptureFixture) -> None:
    """Hand values: per-prompt differences (1, 0, 1, 0) have mean 0.5 and sample sd 0.5774,
    so s.e. 0.2887; pass@k gains come from the per-prompt estimates."""
    from grpolab.core.passk import compare

    before = {"prompts": 4, "dataset": "d", "greedy_correct": [0, 1, 0, 0],
              "samples_per_prompt": 2, "sampled_correct": [0, 1, 0, 2]}
    after = {"prompts": 4, "dataset": "d", "greedy_correct": [1, 1, 1, 0],
             "samples_per_prompt": 2, "sampled_correct": [2, 1, 1, 2]}
    got = compare(before, after)
    assert got["greedy_accuracy"][0] == pytest.approx(0.5)
    assert got["greedy_accuracy"][1] == pytest.approx((1 / 3) ** 0.5 / 2)  # 0.2887
    # pass@1 per prompt = c / 2: differences (1, 0, 0.5, 0) -> mean 0.375
    assert got["pass@1"][0] == pytest.approx(0.375)
    # pass@2 per prompt = 1 if c >= 1: differences (1, 0, 1, 0) -> mean 0.5
    assert got["pass@2"][0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="cannot be paired: that evaluation is of 4 prompts"):
        compare(before, {**after, "prompts": 5})
    for bad in ([1, 2], {**before, "greedy_correct": [0, 1]}, {**before, "greedy_correct": "x"}):
        with pytest.raises(ValueError, match="that file is no grpolab eval.json"):
            compare(bad, after)  # (a file of another shape: refused, not a traceback)
    assert list(compare({**before, "sampled_correct": [9, 0, 0, 0]}, after)) == [
        "greedy_accuracy"]  # (counts above the samples: pass@k not paired)
    # the same dataset and count, other prompts (another seed): refused where both recorded
    # them; an eval.json from before prompts_sha256 compares by dataset and count
    with pytest.raises(ValueError, match="but not the same ones"):
        compare({**before, "prompts_sha256": "a"}, {**after, "prompts_sha256": "b"})
    assert compare({**before, "prompts_sha256": "a"}, after) == got
    assert list(compare(before, {**after, "samples_per_prompt": 4})) == ["greedy_accuracy"]
    assert "pass@k not compared: 2 answers a prompt before, 4 now" in caplog.text


def test_eval_writes_what_it_judged_and_splits_by_difficulty(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    """completions.jsonl: one line per answer judged (greedy, then the samples), its prompt,
    gold, text and scores agreeing with eval.json; a ``difficulty`` column splits accuracy."""
    model = make_tiny_model(tmp_path / "model", arch="llama", hidden=32, heads=4)
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"q": f"What is {a} + {a}?", "a": str(2 * a),
                                        "difficulty": "small" if a < 3 else "large"}) + "\n"
                            for a in range(7)))
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(
        "def first_digit_odd(prompts, completions, **_):\n"
        "    return [1.0 if any(ch in '13579' for ch in c[:3]) else 0.0 for c in completions]\n")
    out = tmp_path / "eval"
    assert cli.main(["eval", "--model-path", model, "--eval-dataset", str(data), "--prompt-column",
                     "q", "--answer-column", "a", "--rewards", f"{rewards}:first_digit_odd",
                     "--eval-samples", "2", "--budget", "8", "--max-new-tokens", "6",
                     "--out-dir", str(out)]) == 0
    assert "by difficulty: large" in capsys.readouterr().out
    res = json.loads((out / "eval.json").read_text())
    lines = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 7 + 7 * 2
    greedy = [x for x in lines if x["greedy"]]
    assert [x["gold"] for x in greedy] == [str(2 * a) for a in range(7)]
    assert [int(x["right"]) for x in greedy] == res["greedy_correct"]
    for x in lines:  # the score is the reward of the text written down
        odd = any(ch in "13579" for ch in x["completion"][:3])
        assert x["rewards"] == {"first_digit_odd": float(odd)} and x["right"] == odd
    ok = res["greedy_correct"]
    assert res["greedy_accuracy_by_difficulty"] == pytest.approx(
        {"small": sum(ok[:3]) / 3, "large": sum(ok[3:]) / 4})
    sampled = [x for x in lines if not x["greedy"]]
    assert [x["prompt"] for x in sampled] == [x["prompt"] for x in greedy for _ in range(2)]
    assert sum(x["right"] for x in sampled) == sum(res["sampled_correct"])


def test_eval_says_when_no_reward_scored_the_answers(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A reward that says None (TRL's "cannot score") for every answer: accuracy 0 is not
    left unexplained; eval.json counts the unscored answers and the printed line says so."""
    model = make_tiny_model(tmp_path / "model", arch="llama", hidden=32, heads=4)
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n"
                            for a in range(3)))
    (tmp_path / "r.py").write_text("def none(prompts, completions, **kw):\n"
                                   "    return [None] * len(completions)\n")
    out = tmp_path / "ev"
    assert cli.main(["eval", "--model-path", model, "--eval-dataset", str(data), "--rewards",
                     f"{tmp_path / 'r.py'}:none", "--max-new-tokens", "3", "--eval-samples",
                     "2", "--out-dir", str(out), "--no-progress"]) == 0
    res = json.loads((out / "eval.json").read_text())
    assert (res["greedy_accuracy"], res["unscored_answers"], res["rewards/none"]) == (0.0, 3, None)
    assert res["sampled_unscored_answers"] == 6
    assert "(3 answers no reward scored: none right)" in capsys.readouterr().out


def test_compare_never_replaces_the_eval_it_compares_with(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """``grpolab eval --compare runs/eval/eval.json`` into the default out_dir (runs/eval) would
    write its own eval.json over the baseline it reads: refused in one line, before any model
    loads, the baseline left as it was; an eval.json nested past the JSON reader's depth is
    "cannot read it", not a traceback."""
    monkeypatch.chdir(tmp_path)
    base = tmp_path / "runs" / "eval" / "eval.json"
    base.parent.mkdir(parents=True)
    base.write_text('{"greedy_correct": [1], "prompts": 1}\n')
    for given in ("runs/eval/eval.json", str(base), "runs/../runs/eval/eval.json"):
        assert cli.main(["eval", "--model-path", "m", "--dataset", "d.jsonl",
                         "--compare", given]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [(f"grpolab: error: --compare {given} is the eval.json this evaluation "
                        "writes (out_dir runs/eval); give another --out-dir")]
    assert base.read_text() == '{"greedy_correct": [1], "prompts": 1}\n'
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    assert cli.main(["eval", "--model-path", "m", "--dataset", "d.jsonl", "--compare",
                     str(deep), "--out-dir", "after"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"grpolab: error: --compare {deep}: cannot read it (nested too deeply)"]
    assert not (tmp_path / "after").exists()
