"""Issue 18 replayed: runs that never hang, never lose or mix data, and never execute what they
load. Lengths: a 100k-character row is cut to the prompt limit, a row no model can take is a
one-line dataset error, and answers beyond the model's positions fail up front."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from grpolab.config import Config, ConfigError
from grpolab.data.files import load_rows


def test_a_100k_character_row_is_cut_to_the_prompt_limit(
        gpt2: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from grpolab.rollout.hf import HFBackend
    from grpolab.rollout.models import load_model
    from grpolab.rollout.tinyhf import make_tiny_model

    row = "word " * 20_000 + "What is 2 + 3?"
    limit = Config().max_prompt_tokens  # the default: 1024
    long_ctx = make_tiny_model(tmp_path / "llama", arch="llama", hidden=32, heads=4,
                               max_positions=4096)
    be = HFBackend(*load_model(long_ctx), reference=False, max_prompt_tokens=limit,
                   max_new_tokens=8)
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        ids, _ = be.encode_prompts([row, "2 + 3?"])
    assert ids.shape[1] == limit == 1024
    assert "prompts over 1024 tokens (max_prompt_tokens=1024) are cut from the left" in caplog.text
    # GPT-2: its 1024 positions, less the answer's room, bound the prompt (no IndexError)
    be = HFBackend(*load_model(gpt2), reference=False, max_prompt_tokens=limit,
                   max_new_tokens=8)
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        ro = be.generate([row] * 2, 1.0, 8, torch.Generator().manual_seed(0))
    assert ro.prompt_ids.shape[1] == 1024 - 8 and ro.completion_ids.shape[0] == 2
    assert "(the model's 1024 positions less max_new_tokens 8)" in caplog.text


def test_a_row_no_model_can_take_is_a_one_line_dataset_error(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 1_500_000, "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1 has a prompt of 1,500,000 characters"):
        load_rows(str(path))


def test_max_new_tokens_beyond_gpt2_positions_fails_up_front(
        gpt2: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from grpolab.rollout.hf import HFBackend
    from grpolab.rollout.models import load_model

    with pytest.raises(ConfigError, match="max_new_tokens 1100 does not fit the model's 1024"):
        HFBackend(*load_model(gpt2), reference=False, max_new_tokens=1100)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    out = tmp_path / "run"
    capsys.readouterr()  # (the weight-loading bars of the load above; the CLI's --no-progress
    # quiets its own, and an earlier test in the same process may have quieted them already)
    code, err = run_cli(["train", "--model-path", gpt2, "--dataset", str(data), "--rewards",
                      "exact", "--budget", "8", "--group-size", "4", "--max-new-tokens", "1100",
                      "--out-dir", str(out), "--no-progress"], capsys)
    assert code == 2 and len(err) == 1 and "1024 positions" in err[0], err
    assert not (out / "metrics.jsonl").exists()
