"""grpolab.rollout.hf: GRPO on tiny local Hugging Face models, end to end through the CLI."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import same_answers
from transformers import AutoModelForCausalLM

from grpolab.app import cli, commands
from grpolab.config import ConfigError, make_config
from grpolab.rollout import sampling
from grpolab.rollout import vllm as vllm_backend
from grpolab.rollout.batch import first_eos_mask, shared_prompts
from grpolab.rollout.fastlm import base_model, checkpointing
from grpolab.rollout.hf import HFBackend
from grpolab.rollout.models import load_model
from grpolab.rollout.tinyhf import CHAT_TEMPLATE

# A random tiny model hits this on roughly a third of its 16-token answers, so most groups are
# mixed and GRPO has a gradient from step 1 (an all-zero reward would train nothing).
PATTERN = r".*7.*"

QUESTIONS = [(3, 4), (12, 7), (25, 17), (8, 9), (40, 2), (6, 6)]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def math_rows() -> list[dict]:
    return [{"question": f"What is {a} + {b}?", "solution": str(a + b)} for a, b in QUESTIONS]


def write_config(tmp_path: Path, model: str, **over: Any) -> tuple[str, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "run"
    data = write_jsonl(tmp_path / "train.jsonl", math_rows())
    cfg = {
        "model_path": model, "dataset": data, "eval_dataset": data,
        "prompt_column": "question", "answer_column": "solution",
        "rewards": ["math", "format"], "format_pattern": PATTERN,
        "steps": 3, "budget": 8, "group_size": 4, "max_new_tokens": 16, "lr": 0.01,
        "eval_size": 4, "out_dir": str(out), "progress": False, "seed": 0,
    }
    cfg.update(over)
    cfg = {k: v for k, v in cfg.items() if v is not None}  # (None: the key left out)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), out


def run_cli(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> Any:
    """cli.main, capturing the trainer that run_train returns (the CLI discards it)."""
    seen: dict[str, Any] = {}
    real = commands.run_train

    def spy(cfg: Any, resume: bool = False) -> Any:
        seen["trainer"] = real(cfg, resume=resume)
        return seen["trainer"]

    monkeypatch.setattr(commands, "run_train", spy)
    assert cli.main(argv) == 0
    return seen["trainer"]


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def base_name(peft_name: str) -> str:
    """peft parameter name -> the plain model's name for the same weight."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer", "")


# ------------------------------------------------------------------------------ end to end


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_train_end_to_end(
    llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lora: bool, device: str
) -> None:
    yaml_path, out = write_config(tmp_path, llama, lora=lora, device=device)
    trainer = run_cli(monkeypatch, ["train", "--config", yaml_path])

    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    steps = rows[1:]
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert all(r["reward_problems"] == 0 for r in steps)
    for r in steps:  # each reward function's own mean; unweighted, the total is their sum
        math_mean, format_mean = r["rewards/math_answer"], r["rewards/format_reward"]
        assert 0 <= math_mean <= 1 and 0 <= format_mean <= 1
        assert r["reward_mean"] == pytest.approx(math_mean + format_mean)
    assert any(r["rewards/format_reward"] > 0 for r in steps)
    assert min(r["dead_share"] for r in steps) < 1  # some group had a learning signal
    assert rows[-1]["heldout_acc"] is not None
    assert (out / "train.png").is_file() and (out / "summary.json").is_file()

    ckpt = torch.load(out / "checkpoints" / "last.pt", weights_only=False)
    assert ckpt["step"] == 3
    trainable = ckpt["backend"]["trainable"]
    assert trainable and all(isinstance(t, torch.Tensor) for t in trainable.values())
    assert all(("lora_" in n) == lora for n in trainable)

    init = dict(AutoModelForCausalLM.from_pretrained(llama).named_parameters())
    final = dict(AutoModelForCausalLM.from_pretrained(out / "final").named_parameters())
    assert final.keys() == init.keys()
    changed = [n for n in init if not torch.equal(init[n], final[n])]
    assert changed, "the saved final model equals the initial one"
    assert (out / "final" / "tokenizer.json").is_file()

    model = trainer.backend.model
    assert next(model.parameters()).device.type == device
    if lora:
        assert {"q_proj", "v_proj"} <= set(model.peft_config["default"].target_modules)
        assert all(".q_proj." in n or ".v_proj." in n for n in changed)
        base = {base_name(n): p for n, p in model.named_parameters() if "lora_" not in n}
        assert base.keys() == init.keys()
        assert all(torch.equal(base[n].cpu(), init[n]) for n in init), "LoRA changed base weights"
        assert all(not p.requires_grad for p in base.values())
        lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
        assert lora_b and any(p.abs().max() > 0 for p in lora_b)  # zero-initialised by peft
        assert (out / "final" / "adapter" / "adapter_config.json").is_file()
    else:
        assert len(changed) > len(init) // 2
        assert trainer.backend.ref is not None
        ref = dict(trainer.backend.ref.named_parameters())
        assert all(torch.equal(ref[n].cpu(), init[n]) for n in init), "the reference moved"


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_lora_final_model_matches_adapter_on_base(
    llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merged final model computes what base + saved adapter computes."""
    from peft import PeftModel

    yaml_path, out = write_config(tmp_path, llama, lora=True, steps=1, eval_dataset="")
    run_cli(monkeypatch, ["train", "--config", yaml_path])
    x = torch.tensor([[5, 17, 33, 60, 2, 90]])
    merged = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama),
                                        out / "final" / "adapter").eval()
    plain = AutoModelForCausalLM.from_pretrained(llama).eval()
    with torch.no_grad():
        a, b, c = merged(x).logits, adapted(x).logits, plain(x).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert (a - c).abs().max() > 1e-6


@pytest.mark.slow  # two or more grpolab train runs, compared
@pytest.mark.parametrize("over", [
    {"lora": True},
    # full fine-tuning whose reference moves each step (TRL sync_ref_model): kept in the state
    {"lora": False, "sync_ref_model": True, "ref_model_sync_steps": 1,
     "ref_model_mixup_alpha": 0.5}], ids=["lora", "synced_reference"])
def test_resume_continues_exactly(
    llama: str, tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch, over: dict
) -> None:
    """2 steps + resume to 3 == 3 steps straight: the HF backend's state round-trips."""
    whole_yaml, whole = write_config(tmp_path / "a", llama, eval_dataset="", device=device,
                                     **over)
    run_cli(monkeypatch, ["train", "--config", whole_yaml])
    part_yaml, part = write_config(tmp_path / "b", llama, eval_dataset="", device=device, **over)
    run_cli(monkeypatch, ["train", "--config", part_yaml, "--steps", "2"])
    run_cli(monkeypatch, ["train", "--config", part_yaml, "--resume"])

    a, b = read_metrics(whole), read_metrics(part)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for key in ("reward_mean", "loss", "kl", "completion_len"):
        assert a[3][key] == pytest.approx(b[3][key], rel=1e-5, abs=1e-7), key
    ta = torch.load(whole / "checkpoints" / "last.pt", weights_only=False)["backend"]
    tb = torch.load(part / "checkpoints" / "last.pt", weights_only=False)["backend"]
    for n, t in ta["trainable"].items():
        torch.testing.assert_close(t, tb["trainable"][n], atol=1e-6, rtol=1e-5)


@pytest.mark.slow  # two or more grpolab train runs, compared
def test_micro_batches_take_the_same_step(
    llama: str, tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    """--micro-batch 3 (groups of 4 cut across parts) takes the whole-batch step, and a run may
    resume with another micro-batch size without a config-change warning."""
    # CUDA draws another random stream than the CPU's (where seed 0's step is live): 4 groups
    live = {"budget": 16} if device == "cuda" else {}
    whole_yaml, whole = write_config(tmp_path / "a", llama, lora=False, steps=1, eval_dataset="",
                                     device=device, **live)
    run_cli(monkeypatch, ["train", "--config", whole_yaml])
    mb_yaml, mb = write_config(tmp_path / "b", llama, lora=False, steps=1, eval_dataset="",
                               device=device, **live)
    trainer = run_cli(monkeypatch, ["train", "--config", mb_yaml, "--micro-batch", "3"])
    assert trainer.cfg.micro_batch == 3
    a, b = read_metrics(whole)[1], read_metrics(mb)[1]
    assert a["dead_share"] < 1, "the step should carry a gradient"
    for key in ("reward_mean", "loss", "policy_loss", "kl", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        run_cli(monkeypatch, ["train", "--config", mb_yaml, "--resume", "--steps", "2",
                              "--micro-batch", "2"])
    assert "changed settings" not in caplog.text
    assert [r["step"] for r in read_metrics(mb)] == [0, 1, 2]


@pytest.mark.slow  # two grpolab train runs (LoRA and full, in bfloat16)
def test_bfloat16_training(
    llama: str, tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    """--dtype bfloat16: the base weights load and stay bf16, the LoRA adapters train in
    float32, and the merged final model is saved in bf16; full fine-tuning in bf16 warns."""
    yaml_path, out = write_config(tmp_path / "lora", llama, lora=True, steps=2, eval_dataset="",
                                  device=device)
    trainer = run_cli(monkeypatch, ["train", "--config", yaml_path, "--dtype", "bfloat16"])
    params = dict(trainer.backend.model.named_parameters())
    assert {p.dtype for n, p in params.items() if "lora_" not in n} == {torch.bfloat16}
    assert {p.dtype for n, p in params.items() if "lora_" in n} == {torch.float32}
    rows = read_metrics(out)[1:]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert final.config.dtype == torch.bfloat16
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        yaml_path, _ = write_config(tmp_path / "full", llama, lora=False, steps=1,
                                    eval_dataset="", device=device)
        run_cli(monkeypatch, ["train", "--config", yaml_path, "--dtype", "bfloat16"])
    assert "full fine-tuning in bfloat16" in caplog.text


@pytest.mark.slow  # two or more grpolab train runs, compared
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_takes_the_same_step(
    llama: str, tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch, lora: bool
) -> None:
    """--gradient-checkpointing recomputes each layer in backward (the lean forward, prompts
    still shared) and takes the step a plain run takes."""
    live = {"budget": 16} if device == "cuda" else {}  # see test_micro_batches_take_the_same_step
    plain_yaml, plain = write_config(tmp_path / "a", llama, lora=lora, steps=1, eval_dataset="",
                                     device=device, **live)
    run_cli(monkeypatch, ["train", "--config", plain_yaml])
    ckpt_yaml, ckpt = write_config(tmp_path / "b", llama, lora=lora, steps=1, eval_dataset="",
                                   device=device, **live)
    trainer = run_cli(monkeypatch, ["train", "--config", ckpt_yaml, "--gradient-checkpointing"])
    be = trainer.backend
    # (transformers 5.17 has no is_activation_checkpointing; fastlm.checkpointing reads either)
    assert be._fast.checkpoint and checkpointing(base_model(be.model))
    a, b = read_metrics(plain)[1], read_metrics(ckpt)[1]
    assert a["dead_share"] < 1, "the step should carry a gradient"
    for key in ("reward_mean", "loss", "policy_loss", "kl", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_failing_reward_is_reported_not_fatal(
    llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def flaky(prompts, completions, **kw):\n"
        "    if any('BAD' in p for p in prompts):\n"
        "        raise ValueError('cannot grade this one')\n"
        "    return [0.5] * len(completions)\n"
        "\n"
        "def nan_on_bad(prompts, completions, **kw):\n"
        "    return [float('nan') if 'BAD' in p else 0.0 for p in prompts]\n"
    )
    data = write_jsonl(tmp_path / "two.jsonl", [
        {"question": "What is 2 + 2? BAD", "solution": "4"},
        {"question": "What is 3 + 3?", "solution": "6"},
    ])
    rf = tmp_path / "my_rewards.py"
    yaml_path, out = write_config(
        tmp_path, llama, dataset=data, eval_dataset="", steps=2,
        rewards=["math", "format", f"{rf}:flaky", f"{rf}:nan_on_bad"],
    )
    with caplog.at_level(logging.WARNING, logger="grpolab.rewards.builtin"):
        run_cli(monkeypatch, ["train", "--config", yaml_path])
    steps = read_metrics(out)[1:]
    assert len(steps) == 2
    # Both prompts are drawn every step; flaky fails on the 4 answers to the BAD prompt, and
    # nan_on_bad's NaN there is TRL's None (not scored, not a problem: its mean is the others')
    assert [r["reward_problems"] for r in steps] == [4, 4]
    assert [r["rewards/nan_on_bad"] for r in steps] == [0.0, 0.0]
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert "reward 'flaky' raised ValueError: cannot grade this one (at my_rewards.py:" in caplog.text
    assert "BAD" in caplog.text and "returned nan" not in caplog.text


# ------------------------------------------------------------------------------ errors


def refused(yaml_path: str, capsys: pytest.CaptureFixture) -> str:
    """``grpolab train`` on ``yaml_path`` exits 2 with one line on stderr; that line."""
    assert cli.main(["train", "--config", yaml_path]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    return err


def test_missing_model_path_is_one_line_exit_2(
    llama: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    yaml_path, _ = write_config(tmp_path, str(tmp_path / "no-such-model"))
    err = refused(yaml_path, capsys)
    assert "no-such-model" in err and "does not exist" in err

    yaml_path, _ = write_config(tmp_path, llama, dataset=str(tmp_path / "nope.jsonl"))
    assert "nope.jsonl" in refused(yaml_path, capsys)


def test_hub_ids_are_read_from_the_local_cache_never_downloaded(
    llama: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model_path (TRL's model_name_or_path) and TRL's dataset_name as Hub ids: their
    snapshots in the Hugging Face cache, laid out as `hf download` leaves them (refs/main ->
    snapshots/<commit>), train, the dataset's test split held out; the card names the id. An id not in the cache is one line naming the cache and the fetch, and
    nothing is downloaded (the Hub's address is made unreachable here); a local folder of the
    same shape is still a folder."""
    import shutil

    from helpers import cached_dataset, cached_repo, hub_cache

    cache = hub_cache(tmp_path / "hub", monkeypatch)
    shutil.copytree(llama, cached_repo(cache, "tiny-org/tiny-llama"))
    rows = math_rows()
    cached_dataset(cache, "tiny-org/sums", {"main": {"train": rows[:4], "test": rows[4:]},
                                           "other": {"train": rows[:1]}})
    monkeypatch.chdir(tmp_path)
    # TRL's script's names: load_dataset(dataset_name, dataset_config), its test split held out
    yaml_path, out = write_config(tmp_path / "a", "tiny-org/tiny-llama", steps=1, eval_size=2,
                                  dataset_name="tiny-org/sums", dataset_config="main",
                                  eval_strategy="steps", dataset=None, eval_dataset=None)
    assert cli.main(["train", "--config", yaml_path]) == 0
    assert len(read_metrics(out)) == 2 and read_metrics(out)[0]["heldout_acc"] is not None
    card = (out / "final" / "README.md").read_text()
    assert "base_model: tiny-org/tiny-llama" in card
    assert "`tiny-org/sums:main` (2 prompts)" in card  # (main's test split: 2 rows)
    assert "snapshot `c0ffee`" in card
    # grpolab eval on the training's dataset measures its held-out split, as TRL evaluates
    assert cli.main(["eval", "--model-path", "tiny-org/tiny-llama", "--dataset",
                     "tiny-org/sums:main", "--prompt-column", "question", "--answer-column",
                     "solution", "--rewards", "math", "--out-dir", str(tmp_path / "ev")]) == 0
    said = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert (said["dataset"], said["prompts"]) == ("tiny-org/sums:main:test", 2)

    yaml_path, _ = write_config(tmp_path / "b", "tiny-org/other-model")
    assert refused(yaml_path, capsys) == (
        f"grpolab: error: model_path 'tiny-org/other-model' is not a local folder, nor a "
        f"Hugging Face Hub model in the local cache ({cache}); grpolab downloads nothing at run "
        "time: fetch it first (hf download tiny-org/other-model) or give its folder")
    from grpolab.rewards.reward_models import load_reward_model  # (TRL's reward model id too)

    with pytest.raises(ValueError, match="^reward model 'tiny-org/rm' is not a local folder"):
        load_reward_model("tiny-org/rm")
    (tmp_path / "tiny-org").mkdir()
    shutil.copytree(llama, tmp_path / "tiny-org" / "other-model")  # a local folder wins
    assert cli.main(["train", "--config", yaml_path, "--steps", "1", "--eval-size", "0"]) == 0
    # TRL's model_revision: the cached snapshot its ref (or commit) names, as ID@REVISION
    from grpolab.rollout.models import resolve_model
    from grpolab.run.model_card import base_model_id

    root = cache / "models--tiny-org--tiny-llama"
    commit = "beef" * 10
    shutil.copytree(llama, root / "snapshots" / commit)
    (root / "refs" / "v2").write_text(commit)
    for keys in ({"model_name_or_path": "tiny-org/tiny-llama", "model_revision": "v2"},
                 {"model_path": "tiny-org/tiny-llama", "model_revision": "v2"}):
        c = make_config(None, keys, "train")
        assert c.model_path == "tiny-org/tiny-llama@v2"
        assert resolve_model(c.model_path) == str(root / "snapshots" / commit)
    c = make_config({"model_name_or_path": "tiny-org/tiny-llama"}, {"model_revision": commit},
                    "train")  # (a commit, over a file's model)
    assert resolve_model(c.model_path) == str(root / "snapshots" / commit)
    assert base_model_id(c.model_path) == "tiny-org/tiny-llama"
    assert make_config(None, {"model_name_or_path": "tiny-org/tiny-llama",
                              "model_revision": "main"}, "train").model_path == "tiny-org/tiny-llama"
    with pytest.raises(FileNotFoundError, match=r"hf download tiny-org/tiny-llama --revision v3"):
        resolve_model("tiny-org/tiny-llama@v3")
    at = tmp_path / "runs" / "exp@lr1e-5"  # (a local folder with an @ in its name is one)
    shutil.copytree(llama, at / "final")
    assert resolve_model("runs/exp@lr1e-5/final") == "runs/exp@lr1e-5/final"
    assert base_model_id("runs/exp@lr1e-5/final") is None
    with pytest.raises(ConfigError, match="'tiny-org/other-model' is no Hub id .a local folder"):
        make_config(None, {"model_name_or_path": "tiny-org/other-model",
                           "model_revision": "v2"}, "train")


def test_vllm_without_gpu_is_one_line_exit_2(
    llama: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("transformers")
    try:
        vllm_backend.check_vllm()
    except ValueError:
        pass
    else:
        pytest.skip("vllm and a GPU are available here")
    yaml_path, out = write_config(tmp_path, llama, rollout_backend="vllm")
    err = refused(yaml_path, capsys)
    assert "vllm" in err and "CUDA" in err
    assert not (out / "metrics.jsonl").exists()


def test_device_setting(llama: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``device`` (TRL's ``use_cpu: true`` reads as cpu): a bad name, or CUDA on a machine
    without it, is one line and exit 2 before anything is written."""
    from grpolab.config import ConfigError, make_config

    assert make_config(overrides={"use_cpu": True}).device == "cpu"
    assert make_config(overrides={"use_cpu": False}).device == "auto"
    with pytest.raises(ConfigError, match="choose auto, cpu, cuda or cuda:N"):
        make_config(overrides={"device": "gpu"})
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    yaml_path, out = write_config(tmp_path, llama, device="cuda:0")
    err = refused(yaml_path, capsys)
    assert "device cuda:0" in err and "no CUDA" in err
    assert not (out / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------ backend


PROMPTS = ["What is 2 + 3?", "Compute 12 * 7. So the answer is", "1", "<think> 40 - 8 ="]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_unpadded_forward(
    request: pytest.FixtureRequest, arch: str, temperature: float, device: str
) -> None:
    """Left padding + position ids: every row scores as if it were alone and unpadded."""
    path = request.getfixturevalue(arch)
    model, tok = load_model(path, device=device)
    backend = HFBackend(model, tok, reference=False)
    ro = backend.generate(PROMPTS, temperature, 12, torch.Generator().manual_seed(1))
    assert (ro.prompt_mask == 0).any()  # prompts really differ in length
    with torch.no_grad():
        lp = backend.logprobs(ro, temperature)
        for i in range(len(PROMPTS)):
            p = ro.prompt_ids[i][ro.prompt_mask[i].bool()]
            c = ro.completion_ids[i][ro.completion_mask[i].bool()]
            # (compared on the CPU, where the backend returns log-probs; the model may be on a GPU)
            ids = torch.cat([p, c])[None].to(model.device)
            logits = model(ids).logits[0, len(p) - 1 : -1].cpu() / temperature
            want = torch.log_softmax(logits, -1).gather(-1, c[:, None]).squeeze(-1)
            torch.testing.assert_close(lp[i, : len(c)], want, atol=2e-5, rtol=1e-5)


def test_greedy_batch_equals_one_by_one(llama: str, device: str) -> None:
    """generate() sees the same left-padded positions as a single unpadded prompt."""
    backend = HFBackend(*load_model(llama, device=device), reference=False)
    batch = backend.generate(PROMPTS, 0.0, 10)
    for i, p in enumerate(PROMPTS):
        one = backend.generate([p], 0.0, 10)
        n = int(one.completion_mask.sum())
        assert torch.equal(one.completion_ids[0, :n], batch.completion_ids[i, :n])
        assert one.completions[0] == batch.completions[i]


def test_generate_is_reproducible_and_leaves_global_rng(llama: str, device: str) -> None:
    backend = HFBackend(*load_model(llama, device=device), reference=False)
    prompts = ["What is 2 + 3?"] * 6
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = backend.generate(prompts, 1.0, 12, torch.Generator().manual_seed(5))
    b = backend.generate(prompts, 1.0, 12, torch.Generator().manual_seed(5))
    c = backend.generate(prompts, 1.0, 12, torch.Generator().manual_seed(6))
    assert torch.equal(torch.get_rng_state(), before)
    assert a.completions == b.completions and torch.equal(a.completion_ids, b.completion_ids)
    assert a.completions != c.completions
    assert len(set(a.completions)) > 1  # sampling, not greedy


def test_sampling_ignores_checkpoint_generation_defaults(llama: str, tmp_path: Path) -> None:
    """A checkpoint's sampling defaults must not narrow rollouts (scores assume plain T)."""
    model, tok = load_model(llama)
    model.generation_config.top_k = 1
    model.generation_config.min_p = 0.99  # alone, either would make sampling greedy
    model.generation_config.do_sample = True
    backend = HFBackend(model, tok, reference=False)
    ro = backend.generate(["What is 2 + 3?"] * 6, 1.0, 12, torch.Generator().manual_seed(0))
    assert len(set(ro.completions)) > 1
    assert backend.model.generation_config.top_k == 1  # restored after sampling
    backend.save_pretrained(str(tmp_path / "saved"))
    assert json.loads((tmp_path / "saved" / "generation_config.json").read_text())["top_k"] == 1


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_reference_is_the_base_model(llama: str, lora: bool, device: str) -> None:
    """Reference logprobs == a fresh load of the base model, after the policy has moved."""
    backend = HFBackend(*load_model(llama, device=device), lora=lora)
    if lora:
        assert backend.ref is None  # no second copy: the reference is adapters-off
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in backend.model.named_parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    ro = backend.generate(PROMPTS, 1.0, 12, torch.Generator().manual_seed(2))
    fresh = HFBackend(*load_model(llama, device=device), reference=False)
    with torch.no_grad():
        ref = backend.logprobs(ro, 1.0, reference=True)
        base = fresh.logprobs(ro, 1.0)
        policy = backend.logprobs(ro, 1.0)
    m = ro.completion_mask.bool()
    torch.testing.assert_close(ref[m], base[m], atol=1e-5, rtol=1e-5)
    assert (policy[m] - base[m]).abs().max() > 1e-3  # the adapters/weights really moved


def test_lora_trains_only_adapters_and_state_round_trips(llama: str, device: str) -> None:
    backend = HFBackend(*load_model(llama, device=device), lora=True,
                        lora_target_modules=["q_proj"])
    trainable = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "q_proj" in n for n in trainable)
    state = backend.state_dict()
    assert set(state["trainable"]) == set(trainable)
    other = HFBackend(*load_model(llama, device=device), lora=True,
                      lora_target_modules=["q_proj"], seed=9)
    other.load_state_dict(state)
    for n, p in other.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.cpu(), state["trainable"][n])
    full = HFBackend(*load_model(llama), reference=False)
    with pytest.raises(ValueError, match="lora"):
        full.load_state_dict(state)


def test_no_reference_copy_when_beta_is_zero(llama: str) -> None:
    backend = HFBackend(*load_model(llama), reference=False)
    assert backend.ref is None
    with pytest.raises(RuntimeError, match="beta"):
        backend.logprobs(backend.generate(["1"], 0.0, 2), 1.0, reference=True)


def test_chat_template_prompts(llama: str) -> None:
    model, tok = load_model(llama)
    tok.chat_template = CHAT_TEMPLATE
    backend = HFBackend(model, tok, reference=False)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    want = tok("<|bos|>user: What is 2 + 2?<|eos|>\nassistant: ",
               add_special_tokens=False)["input_ids"]
    for prompt in (msgs, "What is 2 + 2?"):  # a string becomes one user message
        ids, mask = backend.encode_prompts([prompt])
        assert ids[0].tolist() == want and bool(mask.all())
    ro = backend.generate([msgs, "What is 13 + 1?"], 1.0, 6, torch.Generator().manual_seed(0))
    assert ro.prompts[0] == msgs and len(ro.completions) == 2

    # use_chat_template false is TRL's way: text as written, chat messages still templated
    raw = HFBackend(model, tok, reference=False, use_chat_template=False)
    assert raw.encode_prompts(["Hi"])[0][0].tolist() == tok("Hi")["input_ids"]
    assert raw.encode_prompts([msgs])[0][0].tolist() == want


def test_chat_template_kwargs_reach_the_template(llama: str, tmp_path: Path) -> None:
    """TRL's chat_template_kwargs (Qwen3's enable_thinking, say) from a config file go to
    apply_chat_template beside the messages."""
    from grpolab.config import make_config

    model, tok = load_model(llama)
    tok.chat_template = ("{{ messages[0]['content'] }}{% if enable_thinking is defined and not "
                         "enable_thinking %} /no_think{% endif %} =")
    y = tmp_path / "c.yaml"
    y.write_text("chat_template_kwargs: {enable_thinking: false}\nnum_generations: 8\n"
                 "use_peft: false\nbf16: false\nbeta: 0\n")
    cfg = make_config(y, None, "train")
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    off = commands.make_backend(cfg, model, tok)
    assert off.render("2 + 2")[0] == "2 + 2 /no_think ="
    y.write_text("chat_template_kwargs: null\nnum_generations: 8\nuse_peft: false\n"
                 "bf16: false\nbeta: 0\n")  # TRL's unset
    assert commands.make_backend(make_config(y, None, "train"), model, tok).render(
        "2 + 2")[0] == "2 + 2 ="


def test_long_prompts_are_cut_from_the_left(llama: str, caplog: pytest.LogCaptureFixture) -> None:
    """max_prompt_tokens keeps a prompt's last tokens (the question and the turn to answer);
    shorter prompts are untouched; the cut is announced once."""
    long, short = "one two three four five six seven eight nine ten What is 2 + 3?", "2 + 3?"
    plain = HFBackend(*load_model(llama), reference=False)
    full_ids, _ = plain.encode_prompts([long])
    short_ids, _ = plain.encode_prompts([short])
    limit = short_ids.shape[1] + 2
    assert full_ids.shape[1] > limit
    be = HFBackend(*load_model(llama), reference=False, max_prompt_tokens=limit)
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        ids, mask = be.encode_prompts([long, short, long])
        be.encode_prompts([long])
    assert ids.shape[1] == limit and torch.equal(ids[0], full_ids[0, -limit:])
    assert mask[1].sum() == short_ids.shape[1]
    assert torch.equal(ids[1][mask[1].bool()], short_ids[0])
    assert caplog.text.count("max_prompt_tokens") == 1
    ro = be.generate([long, short], 1.0, 4, torch.Generator().manual_seed(0))
    assert ro.prompt_ids.shape[1] == limit and be.logprobs(ro, 1.0).shape == (2, 4)


def test_completion_mask_stops_at_first_eos() -> None:
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [3, 3, 4, 9]])
    out, mask, cut = first_eos_mask(ids, [2, 4], pad_id=0)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert out.tolist() == [[5, 2, 0, 0], [5, 6, 7, 8], [3, 3, 4, 0]]
    assert cut.tolist() == [False, True, False]  # row 1 never ended: cut off by the length


def test_pattern_gives_mixed_groups_for_the_tiny_model(llama: str) -> None:
    """Guards the end-to-end tests' premise: rewards vary within groups."""
    backend = HFBackend(*load_model(llama), reference=False)
    ro = backend.generate(["What is 3 + 4?"] * 12, 1.0, 16, torch.Generator().manual_seed(0))
    hits = [bool(re.fullmatch(PATTERN, c.strip(), re.DOTALL)) for c in ro.completions]
    assert 0 < sum(hits) < len(hits)


# ------------------------------------------------------------------------------ lean sampler


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("grouped", [False, True], ids=["distinct", "grouped"])
def test_lean_sampler_matches_hf_generate_greedy(
    request: pytest.FixtureRequest, arch: str, grouped: bool
) -> None:
    """The KV-cache loop (shared prefill for repeated prompts) decodes what HF generate does."""
    backend = HFBackend(*load_model(request.getfixturevalue(arch)), reference=False)
    assert backend._lean
    prompts = [p for p in PROMPTS for _ in range(3 if grouped else 1)]
    ids, mask = backend.encode_prompts(prompts)
    lean = backend._sample(ids, mask, 0.0, 12, seed=0)
    ref = backend._hf_generate(ids, mask, 0.0, 12, seed=0)
    assert same_answers(lean, ref, backend.pad_id)  # (on CUDA the fixed-shape loop)


def test_sample_next_draws_from_softmax() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0, float("-inf"), 1.0]]).repeat(200_000, 1)
    gen = torch.Generator().manual_seed(0)
    for t in (1.0, 0.7):
        draws = sampling.sample_next(logits, t, gen)
        freq = torch.bincount(draws, minlength=5).double() / len(draws)
        want = torch.softmax(logits[0].double() / t, -1)
        assert freq[3] == 0  # probability 0 is never drawn
        torch.testing.assert_close(freq, want, atol=5e-3, rtol=0)
    assert sampling.sample_next(logits[:2], 0.0).tolist() == [0, 0]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_shared_prompt_scoring_equals_one_pass(request: pytest.FixtureRequest, arch: str) -> None:
    """Groups of identical prompts run the prompt once: same logprobs and gradients."""
    backend = HFBackend(*load_model(request.getfixturevalue(arch)), reference=False)
    prompts = [p for p in PROMPTS for _ in range(3)]
    ro = backend.generate(prompts, 1.0, 10, torch.Generator().manual_seed(3))
    assert shared_prompts(ro.prompt_ids, ro.prompt_mask) is not None
    backend.model.train()
    results = []
    for lean in (True, False):
        backend._lean = lean
        backend.model.zero_grad(set_to_none=True)
        lp = backend.logprobs(ro, 0.8)
        (lp * ro.completion_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in backend.model.named_parameters()}
        results.append((lp.detach(), grads))
    (lp_a, g_a), (lp_b, g_b) = results
    m = ro.completion_mask.bool()
    torch.testing.assert_close(lp_a[m], lp_b[m], atol=2e-5, rtol=1e-5)
    for n in g_b:
        torch.testing.assert_close(g_a[n], g_b[n], atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # a grpolab train run
def test_a_trl_recipe_with_its_sampling_schedule_and_controls_trains(
    llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TRL YAML as recipes write them (earlier names, top-p/top-k/penalty, cosine to a floor
    with a warm-up ratio, AdamW's decay, rsLoRA, adaptive entropy) trains end to end: every
    step's lr is transformers' schedule's (its warm-up from lr 0), the controller logs its
    coefficient, and the run records the settings it sampled with."""
    from transformers.optimization import _get_cosine_schedule_with_warmup_lr_lambda as hf_lr

    out = tmp_path / "run"
    y = tmp_path / "trl.yaml"
    y.write_text(yaml.safe_dump({
        "model_name_or_path": llama, "torch_dtype": "float32", "bf16": False,
        "use_peft": True, "lora_r": 8, "lora_alpha": 16, "use_rslora": True,
        "dataset": write_jsonl(tmp_path / "train.jsonl", math_rows()),
        "prompt_column": "question", "answer_column": "solution", "rewards": ["math", "format"],
        "format_pattern": PATTERN, "num_generations": 4, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2, "max_completion_length": 12, "temperature": 0.9,
        "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1, "learning_rate": 0.01,
        "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
        "warmup_ratio": 0.25, "max_steps": 4, "weight_decay": 0.01, "entropy_coef": 0.01,
        "use_adaptive_entropy": True, "entropy_target": 100.0, "loss_type": "grpo",
        "beta": 0.04, "save_strategy": "no", "eval_strategy": "no", "report_to": "none",
        "output_dir": str(out), "disable_tqdm": True}))
    trainer = run_cli(monkeypatch, ["train", "--config", str(y)])
    rows = read_metrics(out)[1:]
    assert [r["lr"] for r in rows] == pytest.approx([0.01 * hf_lr(
        s, num_warmup_steps=1, num_training_steps=4, num_cycles=0.5, min_lr_rate=0.1)
        for s in range(4)])
    assert rows[0]["lr"] == 0.0
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.015, 0.02, 0.025, 0.03])
    assert all(math.isfinite(r["loss"]) for r in rows)
    recorded = json.loads((out / "config.json").read_text())
    assert (recorded["top_p"], recorded["top_k"], recorded["repetition_penalty"],
            recorded["min_lr_rate"], recorded["entropy_agg"]) == (0.95, 50, 1.1, 0.1,
                                                                  "token_mean")
    assert trainer.backend.filters.top_p == 0.95 and len(trainer.opt.param_groups) == 2
