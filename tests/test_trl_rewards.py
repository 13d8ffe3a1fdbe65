"""TRL reward functions used unchanged: trl.rewards' own accuracy_reward and
think_format_reward in ``grpolab train`` (and in ``grpolab.train``), None as "cannot score",
TRL's conversational completions; the final model's card."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import grpolab
from grpolab.app import cli
from grpolab.rewards.builtin import load_reward
from grpolab.rewards.scorer import score
from grpolab.rewards.trl_compat import TRLReward

trl_rewards = pytest.importorskip("trl.rewards")

pytestmark = pytest.mark.trl

# gold answers as TRL's GSM8K/MATH recipes give them; the empty one cannot be parsed, so
# accuracy_reward returns None for it ("skip this example")
ROWS = [{"prompt": f"What is {a} + {b}?", "solution": s} for a, b, s in
        [(3, 4, "$7$"), (12, 7, "$19$"), (25, 17, "$42$"), (8, 9, "")]]


def conversational(texts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": t}] for t in texts]


def test_trl_builtins_score_like_trl() -> None:
    acc, fmt = load_reward("trl.rewards:accuracy_reward"), load_reward(
        "trl.rewards:think_format_reward")
    texts = [r"so \boxed{7}", "<think>\nadd\n</think>\n19", "no idea", r"\boxed{5}"]
    gold = ["$7$", "$19$", "$42$", ""]
    res = score([acc, fmt], ["q"] * 4, texts, {"solution": gold})
    want_acc = trl_rewards.accuracy_reward(conversational(texts), gold)
    assert want_acc == [1.0, 0.0, 0.0, None]  # TRL's own verdicts, None included
    assert res.per_fn[:3, 0].tolist() == [1.0, 0.0, 0.0] and res.per_fn[3, 0].isnan()
    assert res.per_fn[:, 1].tolist() == trl_rewards.think_format_reward(conversational(texts))
    assert res.total.tolist() == [1.0, 1.0, 0.0, 0.0]  # None counts 0, as TRL's nansum
    assert res.problems == []  # None is "cannot score", not a failure
    # no reward scored an answer: NaN in the total group statistics read, 0 in the total
    res = score([acc], ["q"] * 4, texts, {"solution": gold})
    assert res.total[3] == 0 and res.scored_total[3].isnan() and not res.success(1.0)[3]


def test_none_from_grpolabs_own_rewards_is_a_failure() -> None:
    """Only TRL's convention (TRLReward) reads None as "cannot score"; a plain reward
    function's None is a bad value: reward_on_error and a problem line."""
    def plain(prompts, completions, **_):
        return [None, 1.0]

    res = score([plain], ["q", "q"], ["a", "b"], on_error=-1.0)
    assert res.per_fn[:, 0].tolist() == [-1.0, 1.0] and len(res.problems) == 1
    res = score([TRLReward(plain)], ["q", "q"], ["a", "b"], on_error=-1.0)
    assert res.per_fn[0, 0].isnan() and res.total.tolist() == [0.0, 1.0] and not res.problems

    def nan(prompts, completions, **_):  # TRL holds a None as NaN: a NaN reads as one
        return [float("nan"), 1.0]

    res = score([TRLReward(nan)], ["q", "q"], ["a", "b"], on_error=-1.0)
    assert res.per_fn[0, 0].isnan() and not res.problems
    res = score([nan], ["q", "q"], ["a", "b"], on_error=-1.0)  # (grpolab's own: a bad value)
    assert res.per_fn[:, 0].tolist() == [-1.0, 1.0] and len(res.problems) == 1


def test_resume_and_resume_from_checkpoint_false_are_one_or_the_other(tmp_path: Path) -> None:
    with pytest.raises(grpolab.ConfigError, match="resume=True and resume_from_checkpoint=False"):
        grpolab.train({"model_path": "m", "dataset": "d.jsonl", "out_dir": str(tmp_path)},
                      resume=True, resume_from_checkpoint=False)


def test_a_resume_needs_the_python_rewards_it_was_given() -> None:
    """A run trained on Python callables (grpolab.train(rewards=[fn])) resumed without them is
    refused, not continued on a default reward; the command line says to resume from Python."""
    from grpolab.config import ConfigError, make_config
    from grpolab.run.resume import changed_settings

    cfg = make_config(None, {"rewards": ["exact"]}, "train")
    saved = {"config": {**vars(cfg), "rewards": ["grpolab.app.api:rewards.length_reward"]}}
    with pytest.raises(ConfigError, match="Python reward.s. length_reward given to grpolab"):
        changed_settings(saved, cfg, [], None)
    with pytest.raises(ValueError, match="'length_reward' was a Python callable given to"):
        load_reward("grpolab.app.api:rewards.length_reward")


def test_eval_means_skip_none() -> None:
    """``grpolab eval``'s rewards/NAME: the mean over the answers the function scored (TRL's
    nanmean), None when it scored none; completions.jsonl shows null, never NaN."""
    from grpolab.run.heldout import Answers, plain

    nan = float("nan")
    got = Answers(per_fn=torch.tensor([[1.0, nan], [0.0, nan], [1.0, nan]]),
                  ok=torch.tensor([True, False, True]), names=["acc", "fmt"], problems=0)
    assert got.reward_means() == {"rewards/acc": pytest.approx(2 / 3), "rewards/fmt": None,
                                  "unscored_answers": 0}
    both = Answers(per_fn=torch.tensor([[1.0, nan], [nan, nan]]), ok=torch.tensor([True, False]),
                   names=["acc", "fmt"], problems=0)
    assert both.reward_means()["unscored_answers"] == 1  # (no function scored the second)
    assert plain(torch.tensor([0.5, nan])) == [0.5, None]


def test_calling_conventions() -> None:
    def trl_style(prompts, completions, **kwargs):  # chat completions, found by trying text first
        return [float(c[0]["content"] == "ok") for c in completions]

    def keyword_order(completions, answer, **kwargs):  # not (prompts, completions) positions
        return [float(c == a) for c, a in zip(completions, answer)]

    def positional(p, c, answer, **_):  # grpolab's older convention, unchanged
        return [float(x == a) for x, a in zip(c, answer)]

    fns = [TRLReward(f) for f in (trl_style, keyword_order, positional)]
    res = score(fns, ["q", "q"], ["ok", "no"], {"answer": ["ok", "ok"]})
    assert res.per_fn.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]] and res.problems == []
    assert fns[0].format == "conversational" and fns[1].format == "text"
    assert res.names == ["trl_style", "keyword_order", "positional"]


def config(tmp_path: Path, model: str, **over: Any) -> dict[str, Any]:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = {"model_path": model, "dataset": str(data), "eval_dataset": str(data),
           "answer_column": "solution", "steps": 2, "budget": 8, "group_size": 4,
           "max_new_tokens": 8, "eval_size": 4, "out_dir": str(tmp_path / "run"),
           "progress": False, "seed": 0}
    cfg.update(over)
    return cfg


def test_grpolab_train_with_trl_rewards_unchanged(llama: str, tmp_path: Path) -> None:
    cfg = config(tmp_path, llama, rewards=["trl.rewards:accuracy_reward",
                                           "trl.rewards:think_format_reward"])
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", "--config", str(tmp_path / "run.yaml")]) == 0
    out = tmp_path / "run"
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [0, 1, 2]
    for r in metrics[1:]:
        assert r["reward_problems"] == 0
        assert {"rewards/accuracy_reward", "rewards/think_format_reward"} <= set(r)
    # every logged reward is what TRL's own functions give for those completions
    for line in (out / "samples.jsonl").read_text().splitlines():
        for g in json.loads(line)["groups"]:
            comps = conversational(g["completions"])
            gold = [next(r["solution"] for r in ROWS if r["prompt"] == g["prompt"])] * len(comps)
            acc = [a or 0.0 for a in trl_rewards.accuracy_reward(comps, gold)]
            fmt = trl_rewards.think_format_reward(comps)
            assert g["rewards"] == pytest.approx([a + f for a, f in zip(acc, fmt)])
    card = (out / "final" / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "transformers" and "grpo" in meta["tags"]
    assert llama in card and cfg["dataset"] in card
    assert "`trl.rewards:accuracy_reward`" in card
    summary = json.loads((out / "summary.json").read_text())
    assert f"| held-out accuracy (greedy) | {summary['start_heldout_acc']:.3f} | " in card
    # the config that differs from grpolab train's defaults: what this test set, no more
    changed = yaml.safe_load(card.split("```yaml")[1].split("```")[0])
    assert changed == {k: v for k, v in cfg.items() if k not in ("out_dir", "progress", "seed")}
    assert f"`{cfg['eval_dataset']}` (4 prompts)" in card


def test_python_api_train_with_a_callable_reward(llama: str, tmp_path: Path) -> None:
    def length_reward(prompts, completions, **kwargs):  # TRL's signature; None = cannot score
        return [None if not c or "12 +" in p else len(c) / 100  # (a whole group unscored)
                for p, c in zip(prompts, completions)]

    records = grpolab.train(config(tmp_path, llama, rewards=[length_reward]), steps=1,
                            budget=8, group_size=2, eval_size=2, log_samples=4,
                            report_to=["none"])
    assert [r["step"] for r in records] == [0, 1]
    assert records.out_dir == tmp_path / "run"
    assert records.summary["steps"] == 1
    assert all(r["reward_problems"] == 0 and r["rewards/length_reward"] > 0
               for r in records[1:])
    # the unscored group: null rewards in samples.jsonl (and the trackers' tables), never NaN
    groups = json.loads((records.out_dir / "samples.jsonl").read_text())["groups"]
    assert [g["rewards"] for g in groups if "12 +" in g["prompt"]] == [[None, None]]
    assert "NaN" not in (records.out_dir / "metrics.jsonl").read_text()
    # TRL's resume_from_checkpoint: true continues the run (as the API's resume=True)
    more = grpolab.train(config(tmp_path, llama, rewards=[length_reward]), steps=2, budget=8,
                         group_size=2, eval_size=2, log_samples=4, report_to=["none"],
                         resume_from_checkpoint=True)
    assert [r["step"] for r in more] == [0, 1, 2]
    assert (records.out_dir / "final" / "README.md").is_file()


def test_token_id_rewards_get_completion_ids(llama: str, tmp_path: Path) -> None:
    """TRL's rewards that read ``completion_ids`` run unchanged (in the reward workers): its
    soft overlong punishment gives what grpolab's ``overlong:8:4`` gives, its repetition
    penalty is <= 0; a reward that neither names completion_ids nor takes **kwargs is not
    given them."""
    def strict(prompts, completions, answer, solution):  # (no **kwargs)
        return [0.0] * len(completions)

    soft = trl_rewards.get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)
    rep = trl_rewards.get_repetition_penalty_reward(ngram_size=2)
    records = grpolab.train(config(tmp_path, llama, rewards=[soft, "overlong:8:4", rep, strict]),
                            steps=2, report_to=["none"])
    for r in records[1:]:
        assert r["reward_problems"] == 0
        assert r["rewards/soft_overlong_punishment_reward"] == r["rewards/overlong"] < 0
        assert -1 <= r["rewards/repetition_penalty_reward"] <= 0


def test_overlong_is_dapos_soft_punishment() -> None:
    """grpolab's overlong reward is TRL's get_soft_overlong_punishment at every length (0 up to
    MAX - BUFFER tokens, a linear fall to -1 at MAX, -1 beyond); ``overlong:BUFFER`` takes the
    run's max_new_tokens; a bad spec is one line."""
    ids = [[5] * n for n in range(26)]
    theirs = trl_rewards.get_soft_overlong_punishment(20, 6)(ids)
    assert load_reward("overlong:20:6")([], [], completion_ids=ids) == theirs
    assert load_reward("overlong:6", max_new_tokens=20)([], [], completion_ids=ids) == theirs
    assert theirs[14] == 0.0 and theirs[17] == pytest.approx(-0.5) and theirs[25] == -1.0
    for bad in ("overlong", "overlong:0", "overlong:30:31", "overlong:x"):
        with pytest.raises(ValueError, match="write overlong:BUFFER"):
            load_reward(bad, max_new_tokens=20)


def test_answer_ids_are_trls_completion_ids() -> None:
    """The ids a reward gets are TRL's: up to and including the first EOS (any of them), the
    whole answer when cut at the length limit, no padding; the watch's strict check gets them
    too (``score_answers``)."""
    from types import SimpleNamespace

    from grpolab.rewards.scorer import Scorer
    from grpolab.rollout.batch import Rollout, first_eos_mask
    from grpolab.run.heldout import score_answers

    eos, pad = [2, 9], 0
    raw = torch.tensor([[5, 6, 2, 0, 0], [5, 9, 0, 0, 0], [5, 6, 7, 8, 4], [2, 0, 0, 0, 0],
                        [5, 2, 9, 2, 0]])
    # TRL's GRPOTrainer (transformers generate): mask up to the first EOS, ids kept under it
    is_eos = torch.isin(raw, torch.tensor(eos))
    idx = torch.full((raw.size(0),), raw.size(1))
    idx[is_eos.any(1)] = is_eos.int().argmax(1)[is_eos.any(1)]
    keep = torch.arange(raw.size(1)).expand(raw.size(0), -1) <= idx[:, None]
    theirs = [c[m].tolist() for c, m in zip(raw, keep)]
    ids, mask, cut = first_eos_mask(raw, eos, pad)
    ro = Rollout(["q"] * 5, torch.ones(5, 1, dtype=torch.long), torch.ones(5, 1, dtype=torch.long),
                 ids, mask, ["a"] * 5, cut)
    assert ro.answer_ids() == theirs == [[5, 6, 2], [5, 9], [5, 6, 7, 8, 4], [2], [5, 2]]

    def lengths(completion_ids, **kwargs):
        return [float(len(i)) for i in completion_ids]

    backend = SimpleNamespace(generate=lambda prompts, *a: ro)
    cfg = SimpleNamespace(reward_weights=[], reward_on_error=0.0, fail_on_reward_errors=True,
                          reward_timeout=0, reward_workers=0)
    got = score_answers(backend, [{"prompt": "q", "answer": "a"}] * 5,
                        Scorer(cfg, [TRLReward(lengths)]), 5, 4.0, check_fn=TRLReward(lengths))
    assert got.per_fn[:, 0].tolist() == [3.0, 2.0, 5.0, 1.0, 2.0]
    assert got.checked.tolist() == [False, False, True, False, False]


def test_rewards_written_before_completion_ids_still_work() -> None:
    """grpolab's positional convention with a parameter named completion_ids stays positional;
    a **kwargs reward that hands its columns to a strict function (as it could before
    completion_ids were given) is called again without them, and from then on."""
    def short(p, c, completion_ids, **_):
        return [float(len(i) < 3) for i in completion_ids]

    def judge(completions, answer):
        return [float(x == a) for x, a in zip(completions, answer)]

    def forwards(prompts, completions, **kwargs):
        return judge(completions, **kwargs)

    fns = [TRLReward(short), TRLReward(forwards)]
    res = score(fns, ["q", "q"], ["7", "8"], {"answer": ["7", "7"],
                                              "completion_ids": [[5, 2], [6, 6, 2]]},
                fail_on_all_errors=True)
    assert res.per_fn.tolist() == [[1.0, 1.0], [0.0, 0.0]] and res.problems == []
    assert fns[1].drop_ids and not fns[0].drop_ids


def test_a_reward_needing_a_column_the_rows_lack_stops_before_loading(
        llama: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """TRL's accuracy_reward reads ``solution``: on rows with only an answer it would fail on
    every answer after the model loads; it is refused at once (exit 2), naming the column."""
    from grpolab.rewards.trl_compat import missing_columns

    def keywords(completions, solution, **kwargs):  # TRL's style
        return [0.0] * len(completions)

    def positional(p, c, answer, **kw):  # grpolab's style
        return [0.0] * len(c)

    assert missing_columns(keywords, {"answer"}) == ["solution"]
    assert missing_columns(keywords, {"answer", "solution"}) == []
    assert missing_columns(positional, {"answer"}) == []
    assert missing_columns(positional, {"solution"}) == ["answer"]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": "7"}) + "\n"
                            for r in ROWS))
    cfg = config(tmp_path, llama, dataset=str(data), eval_dataset=str(data),
                 answer_column="answer", rewards=["trl.rewards:accuracy_reward"])
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", "--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert "reward 'accuracy_reward' needs the column(s) solution" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
