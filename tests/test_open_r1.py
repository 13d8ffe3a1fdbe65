"""open-r1's recipes: its reward registry scores as open-r1's own functions do, its keys load
beside TRL's, and a recipe trains end to end (system prompt, chat template, a save per pass)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import pytest

from grpolab.config import ConfigError
from grpolab.config.load import make_config
from grpolab.config.validate import with_length
from grpolab.data.files import with_system
from grpolab.rewards import open_r1
from grpolab.rewards.builtin import load_reward

GOLDEN = json.loads((Path(__file__).parent / "data" / "open_r1_golden.json").read_text())

# open-r1's patterns (src/open_r1/rewards.py), matched as it matches them: the specification
FORMAT = r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$"
CODE_FORMAT = r"^<think>\n.*?\n</think>\n<answer>\n.*?```{}.*?```.*?\n</answer>$"
PIECES = ["<think>\n", "\n</think>\n<answer>\n", "\n</answer>", "\n", "x", "<think>", "</answer>",
          "```python", "```", "\n<answer>\n", "Step 1:", "1.", "\n-", "\n*", "First,", "Finally,",
          "\n</think>\n", " ", "```cpp", "Step 22:"]


def _fuzz(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12))) for _ in range(n)]
    return texts + ["<think>\n" + t for t in texts]


@pytest.mark.parametrize("name", ["accuracy", "cosine", "length"])
def test_math_rewards_equal_open_r1s_own(name: str) -> None:
    """On 192 answer/gold pairs (boxed, bare, percent, sets, intervals, unparseable golds),
    grpolab's values equal those open-r1's functions gave (tests/data/make_open_r1_golden.py),
    None (a gold that does not parse) included; length over batches of 8, as called."""
    texts = [c for c, _ in GOLDEN["pairs"]]
    golds = [s for _, s in GOLDEN["pairs"]]
    if name == "accuracy":
        assert open_r1.accuracy_reward(texts, golds) == GOLDEN["accuracy"]
        assert {None, 0.0, 1.0} == set(GOLDEN["accuracy"])
    elif name == "cosine":
        for params, want in GOLDEN["cosine"].items():
            assert open_r1.cosine_reward(*json.loads(params))(texts, golds) == want
    else:
        got = [v for i in range(0, len(texts), 8)
               for v in open_r1.len_reward(texts[i:i + 8], golds[i:i + 8])]
        assert got == GOLDEN["length"]


def test_text_rewards_equal_open_r1s_patterns() -> None:
    """format and code_format decide open-r1's regexes (re.match, DOTALL | MULTILINE) in linear
    time: equal on 8,000 texts built from the tags; tag_count and reasoning_steps as defined."""
    texts = _fuzz(4000)
    flags = re.DOTALL | re.MULTILINE
    want = [1.0 if re.match(FORMAT, t, flags) else 0.0 for t in texts]
    assert open_r1.format_reward(texts) == want and 100 < sum(want) < len(texts)
    for lang in ("python", "cpp"):
        want = [1.0 if re.match(CODE_FORMAT.format(lang), t, flags) else 0.0 for t in texts]
        assert open_r1.code_format_reward(lang)(texts) == want and sum(want) > 0
    langs = random.Random(1).choices(["python", "cpp"], k=len(texts))  # (a language column)
    want = [1.0 if re.match(CODE_FORMAT.format(g), t, flags) else 0.0 for t, g in zip(texts, langs)]
    assert open_r1.code_format_reward("python")(texts, language=langs) == want
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    assert open_r1.tag_count_reward(texts) == [sum(0.25 for g in tags if t.count(g) == 1)
                                              for t in texts]
    steps = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")
    assert open_r1.reasoning_steps_reward(texts) == [min(1.0, len(steps.findall(t)) / 3)
                                                    for t in texts]
    good = "<think>\nplan\n</think>\n<answer>\nx = 1\n</answer>"
    assert open_r1.format_reward([good, good + "\ntrailing", good + " x", " " + good]) == [
        1.0, 1.0, 0.0, 0.0]  # ($ under MULTILINE: a line's end; ^: the text's start)
    assert open_r1.tag_count_reward([good, "<think>\n<think>\n"]) == [1.0, 0.0]


def test_repetition_and_length_by_hand() -> None:
    rep = open_r1.repetition_reward(3, -1.0)
    # "a a a a": 2 trigrams, 1 distinct: (1 - 1/2) x -1; fewer words than n: 0; none repeated: 0
    assert rep(["a a a a", "A a", "", "a b c d"]) == [-0.5, 0.0, 0.0, 0.0]
    assert open_r1.repetition_reward(1, -0.5)(["The the cat"]) == [pytest.approx(-0.5 / 3)]
    with pytest.raises(ValueError, match="must be <= 0"):
        open_r1.repetition_reward(2, 0.5)
    # 9, 11 and 13 characters: 0.5 - (len - 9) / 4, a wrong answer's at most 0
    got = open_r1.len_reward(["\\boxed{1}", "\\boxed{111}", "\\boxed{11111}"],
                                ["$1$", "$111$", "$2$"])
    assert got == [0.5, 0.0, -0.5]
    # a bare "1" is no answer (it needs a box or an anchor): wrong, so min(0, 0.5)
    assert open_r1.len_reward(["1", "\\boxed{1}"], ["$1$", "$1$"]) == [0.0, -0.5]
    assert open_r1.len_reward(["1", "2"], ["$1$", "$3$"]) == [0.0, 0.0]  # one length: 0


def test_code_blocks_are_open_r1s_and_linear() -> None:
    cases = ["```python\nA```x```python\nB```", "```python\nA", "```python\nA```python\nB", "",
             "```python\n```", "```python\nA``` ```python\nB", "``````python\nQ```", "```py\nA```"]
    for text in cases:
        want = (re.findall(r"```python\n(.*?)```", text, re.DOTALL) or [""])[-1]
        assert open_r1.python_blocks(text) == want
    assert open_r1.python_blocks("```python\n" * 100_000) == ""  # (the regex: quadratic)


def test_specs_load_and_refuse_in_one_line() -> None:
    fn = load_reward("open-r1:format")
    answer = "<think>\na\n</think>\n<answer>\nb\n</answer>"
    assert fn.__name__ == "format_reward" and fn(["p"], [answer]) == [1.0]
    assert load_reward("open-r1:accuracy")([""], ["\\boxed{2}"], solution=["no math"]) == [None]
    assert load_reward("open-r1:repetition_penalty:1:-2")([""], ["a a"]) == [-1.0]
    assert load_reward("open-r1:cosine:0:-0.5:0.5:1:1e3")([""], [""], solution=["x"]) == [1.0]
    # open-r1's soft_punish_cache 0: 0 up to the maximum, -1 past it
    assert load_reward("overlong:10:0")([""] * 2, ["a", "b"], completion_ids=[[1] * 10,
                                                                           [1] * 11]) == [0, -1]
    for spec, message in [("open-r1:ioi_code", "Piston or Morph judge"),
                          ("open-r1:nope", "unknown open-r1 reward"),
                          ("open-r1:cosine:1:2", "give all 5 parameters"),
                          ("open-r1:cosine:a:b:c:d:e", "'a' is not one of its finite"),
                          ("open-r1:cosine:0:0:0:0:10.5", "'10.5' is not one of its whole"),
                          ("open-r1:cosine:0:0:nan:0:10", "'nan' is not one of its finite"),
                          ("open-r1:format:x", "takes no parameters"),
                          ("open-r1:code_format:a b", "code_format:LANGUAGE")]:
        with pytest.raises(ValueError, match=message):
            load_reward(spec)


RECIPE = """\
model_name_or_path: deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
torch_dtype: bfloat16
attn_implementation: flash_attention_2
chat_template: "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"
dataset_name: open-r1/OpenR1-Math-220k
dataset_prompt_column: problem
system_prompt: "Think, then answer."
bf16: true
use_vllm: true
vllm_device: auto
learning_rate: 1.0e-06
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs:
  min_lr_rate: 0.1
max_steps: -1
num_generations: 16
num_train_epochs: 1
per_device_train_batch_size: 16
gradient_accumulation_steps: 4
push_to_hub: true
wandb_project: open-r1
reward_funcs: [accuracy, format, tag_count, cosine, soft_overlong_punishment]
cosine_max_len: 500
repetition_n_grams: 4
soft_punish_cache: 1024
reward_weights: [1.0, 1.0, 1.0, 0.5, 1.0]
save_strategy: "epoch"
save_total_limit: 1
warmup_ratio: 0.1
"""


def test_an_open_r1_recipe_loads(tmp_path, caplog) -> None:
    """open-r1's DeepSeek-R1-Distill demo (its keys) loads with the two overrides a CPU run
    needs: the registry's rewards with the recipe's parameters, the prompt column, the system
    prompt and chat template, a save each epoch; unused parameters and the Hub's and W&B's
    settings left aside in the notice."""
    y = tmp_path / "config_demo.yaml"
    y.write_text(RECIPE)
    with pytest.raises(ConfigError) as e:  # (all a recipe's refusals in one line, one run)
        make_config(y, None, "train")
    said = str(e.value)
    assert "\n" not in said and [said.count(k) for k in (
        "use_vllm: true (TRL) needs the vllm package", "push_to_hub: true (TRL)",
        "dataset_name", "vllm_importance")] == [1, 1, 0, 0]
    # the Hub dataset is read from the local cache (grpolab.data.hub): its train split
    assert make_config(y, {"use_vllm": False, "push_to_hub": False}, "train").dataset == \
        "open-r1/OpenR1-Math-220k"
    with caplog.at_level("WARNING", logger="grpolab"):
        c = make_config(y, {"use_vllm": False, "push_to_hub": False, "dataset": "m.jsonl"},
                        "train")
    assert c.rewards == ["open-r1:accuracy", "open-r1:format", "open-r1:tag_count",
                         "open-r1:cosine:0.0:-0.5:0.5:1.0:500", "overlong:16384:1024"]
    assert (c.prompt_column, c.answer_column, c.system_prompt, c.save_each_pass,
            c.save_total_limit, c.passes, c.prompt_order) == (
        "problem", "", "Think, then answer.", True, 1, 1.0, "epochs")
    assert c.chat_template.startswith("{% for m in messages %}")
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "vllm_device left aside" in said
    aside = next(r.getMessage() for r in caplog.records if "left aside (" in r.getMessage())
    assert ("dataset_name 'open-r1/OpenR1-Math-220k' (TRL's script) is replaced by dataset "
            "'m.jsonl'") in said
    for key in ("attn_implementation", "repetition_n_grams", "wandb_project"):
        assert key in aside
    assert "soft_punish_cache" not in aside and "cosine_max_len" not in aside
    with pytest.raises(ConfigError, match="reward_funcs: 'ioi' .* open-r1's accuracy"):
        make_config(None, {"reward_funcs": ["ioi"]}, "train")


# every field open-r1 adds to TRL's (GRPOScriptArguments, GRPOConfig; configs.py at 1416fa0)
# at its default; dataset_name and dataset_mixture at None
OPEN_R1_FIELDS = {
    "dataset_name": None, "dataset_mixture": None,
    "reward_funcs": ["accuracy", "format", "tag_count"], "cosine_min_value_wrong": 0.0,
    "cosine_max_value_wrong": -0.5, "cosine_min_value_correct": 0.5,
    "cosine_max_value_correct": 1.0, "cosine_max_len": 1000, "repetition_n_grams": 3,
    "repetition_max_penalty": -1.0, "code_language": "python", "code_eval_test_batch_size": 1,
    "code_eval_scoring_mode": "weighted_sum", "parallel_code_exec_per_proc": 2,
    "dataset_prompt_column": "prompt", "e2b_router_url": None, "morph_router_url": None,
    "code_provider": "e2b", "ioi_provider": "piston", "max_completion_len": 16384,
    "soft_punish_cache": 4096, "benchmarks": [], "callbacks": [], "chat_template": None,
    "hub_model_revision": "main", "num_completions_to_print": 0,
    "overwrite_hub_revision": False, "push_to_hub_revision": False, "system_prompt": None,
    "wandb_log_unique_prompts": True, "wandb_entity": None, "wandb_project": None,
    "wandb_run_group": None}


def test_every_open_r1_field_at_its_default_loads(tmp_path) -> None:
    import yaml

    y = tmp_path / "all.yaml"
    y.write_text(yaml.safe_dump(OPEN_R1_FIELDS))
    c = make_config(y, None, "train")
    assert c.rewards == ["open-r1:accuracy", "open-r1:format", "open-r1:tag_count"]
    assert (c.system_prompt, c.chat_template, c.prompt_column) == ("", "", "prompt")


@pytest.mark.parametrize(("keys", "message"), [
    ({"cosine_max_len": 1000.5}, "cosine_max_len: 1000.5 .open-r1. must be a whole number"),
    ({"cosine_min_value_wrong": ".nan"}, "cosine_min_value_wrong: '.nan' .open-r1. must be"),
    ({"repetition_n_grams": 2.5}, "repetition_n_grams: 2.5 .open-r1. must be a whole"),
    ({"code_language": "py thon"}, "code_language: 'py thon' .open-r1. must be a language"),
    ({"reward_funcs": ["cf_code"]}, "cf_code .open-r1. runs Codeforces' tests on a Piston"),
])
def test_recipe_parameters_are_checked_by_their_names(keys: dict, message: str) -> None:
    funcs = {"reward_funcs": ["cosine", "repetition_penalty", "code_format"]}
    with pytest.raises(ConfigError, match=message):
        make_config(None, {**funcs, **keys}, "train")


def test_recipe_values_as_open_r1_reads_them(caplog) -> None:
    with caplog.at_level("WARNING", logger="grpolab"):
        c = make_config(None, {"reward_funcs": "accuracy, cosine", "cosine_max_len": 1000.0,
                               "soft_punish_cache": 0}, "train")  # (a flag's comma list)
    assert c.rewards == ["open-r1:accuracy", "open-r1:cosine:0.0:-0.5:0.5:1.0:1000"]
    assert "cosine_max_len" not in caplog.text and "soft_punish_cache" in caplog.text
    c = make_config(None, {"reward_funcs": ["soft_overlong_punishment"],
                           "max_completion_len": 64, "soft_punish_cache": 0}, "train")
    assert c.rewards == ["overlong:64:0"]
    with caplog.at_level("WARNING", logger="grpolab"):
        make_config(None, {"dataset": "m.jsonl", "dataset_mixture": {"datasets": []},
                           "reward_funcs": ["format"]}, "train")
    assert "left aside (they change nothing that is trained here): dataset_mixture" in caplog.text
    with pytest.raises(ConfigError, match="dataset_mixture .open-r1. mixes Hub datasets"):
        make_config(None, {"dataset_mixture": {"datasets": []}, "reward_funcs": ["format"]},
                    "train")


def test_code_data_in_another_language_is_warned_of(caplog) -> None:
    """open-r1's code data may mix languages: a C++ row has no test the Python sandbox can
    run (its code_format still reads the row's language), and a file that mixes them is
    warned of, not refused."""
    from grpolab.rewards.code_data import row_case
    from grpolab.rewards.sandbox import check_tests

    case = {"test_cases": [{"type": "stdin_stdout", "input": "1", "output": "1"}]}
    rows = [{"verification_info": {**case, "language": "python"}},
            {"verification_info": {**case, "language": "cpp"}}]
    assert row_case(rows[0]).io and not row_case(rows[1]).count
    with caplog.at_level("WARNING"):
        check_tests(rows, "'mixed.jsonl'")
    assert "1 of the 2 rows of 'mixed.jsonl' with no tests" in caplog.text


def test_a_template_that_renders_nothing_stops_before_the_run() -> None:
    from grpolab.rollout.templates import check_render

    with pytest.raises(ValueError, match="renders the first prompt as nothing"):
        check_render(lambda p: ("  ", True), [{"role": "user", "content": "q"}])
    check_render(lambda p: ("", False), "")  # (a plain prompt: the tokenizer's to refuse)


def test_an_override_lifts_a_files_refusal(tmp_path) -> None:
    """TRL's command line overrides its YAML: a file's use_vllm: true, refused here, is
    lifted by --use_vllm false (refused even then before), push_to_hub: true alike."""
    y = tmp_path / "c.yaml"
    y.write_text("use_vllm: true\npush_to_hub: true\nnum_generations: 4\n")
    with pytest.raises(ConfigError, match="push_to_hub: true"):
        make_config(y, {"use_vllm": "false"}, "train")
    c = make_config(y, {"use_vllm": "false", "push_to_hub": "false"}, "train")
    assert (c.rollout_backend, c.group_size) == ("hf", 4)
    y.write_text("top_k: null\nnum_generations: 4\n")
    assert make_config(y, {"top_k": "5"}, "train").top_k == 5


def test_a_changed_save_each_pass_is_a_free_resume_change() -> None:
    from grpolab.config import to_dict
    from grpolab.run.resume import changed_settings

    c = make_config(None, {}, "train")
    later = dataclasses.replace(c, save_each_pass=True, checkpoint_every=5, save_model_every=5)
    assert changed_settings({"config": to_dict(c)}, later, [], None) == {}


def test_each_pass_saves_and_the_system_prompt() -> None:
    c = make_config(None, {"save_each_pass": True, "passes": 2, "budget": 8, "group_size": 4},
                    "train")
    d = with_length(c, 7)  # 3 steps of 2 prompts a pass
    assert (d.steps, d.checkpoint_every, d.save_model_every, d.eval_every) == (6, 3, 3, 10)
    d = with_length(make_config(None, {"eval_strategy": "epoch", "passes": 2, "budget": 8,
                                       "group_size": 4}, "train"), 7)  # (TRL's epoch evals)
    assert (d.eval_each_pass, d.eval_every, d.checkpoint_every) == (True, 3, 10)
    by_steps = make_config(None, {"save_each_pass": True, "steps": 5, "budget": 8,
                                  "group_size": 4}, "train")
    assert (with_length(by_steps, 9).steps, with_length(by_steps, 9).checkpoint_every) == (5, 4)
    with pytest.raises(ConfigError, match="save_each_pass: the dataset's 1 prompts fill no"):
        with_length(by_steps, 1)
    # (use_chat_template false, TRL's way, still templates the chat prompts a system prompt makes)
    assert make_config(None, {"system_prompt": "s", "use_chat_template": False},
                       "train").system_prompt == "s"
    sys = {"role": "system", "content": "S"}
    assert with_system("S", "q") == [sys, {"role": "user", "content": "q"}]
    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}]
    assert with_system("S", own) == own
    assert with_system("S", own[1:]) == [sys, own[1]]


def test_an_open_r1_recipe_trains_end_to_end(llama: str, tmp_path) -> None:
    """A cut-down open-r1 recipe on a tiny Llama: problem/solution rows, its chat template and
    system prompt in every prompt, its rewards logged by name, a model saved at each of two
    epochs (save_total_limit 1 keeps the last) and the template saved with the final model."""
    import yaml

    from grpolab.app import cli

    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {a} + {a}?", "solution":
                                        f"${2 * a}$"}) + "\n" for a in range(5)))
    recipe = yaml.safe_load(RECIPE)
    out = tmp_path / "run"
    recipe.update({"model_name_or_path": llama, "use_vllm": False, "push_to_hub": False,
                   "dataset": str(data), "num_train_epochs": 2, "num_generations": 2,
                   "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                   "max_completion_length": 6, "bf16": False, "torch_dtype": None,
                   "output_dir": str(out), "eval_size": 0, "use_peft": True})
    y = tmp_path / "recipe.yaml"
    y.write_text(yaml.safe_dump(recipe))
    assert cli.main(["train", "--config", str(y), "--no-progress"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # 5 prompts, 2 a step: 2 a pass
    assert {"rewards/accuracy_reward", "rewards/format_reward", "rewards/tag_count_reward",
            "rewards/cosine_scaled_reward", "rewards/overlong"} <= steps[0].keys()
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert sample["groups"][0]["prompt"][0] == {"role": "system", "content": "Think, then answer."}
    assert [p.name for p in out.glob("checkpoint-*") if p.is_dir()] == ["checkpoint-4"]
    saved = json.loads((out / "final" / "tokenizer_config.json").read_text())
    template = saved.get("chat_template") or (out / "final" / "chat_template.jinja").read_text()
    assert template.startswith("{% for m in messages %}")
    # max_steps ending inside a pass: a model folder at the last step too, as transformers'
    # epoch saves; every one kept at save_total_limit 0
    assert cli.main(["train", "--config", str(y), "--no-progress", "--max_steps", "3",
                     "--save_total_limit", "0", "--output_dir", str(tmp_path / "cut")]) == 0
    assert sorted(p.name for p in (tmp_path / "cut").glob("checkpoint-*")) == [
        "checkpoint-2", "checkpoint-3"]
