"""Fixtures shared by several test files. Plain helpers (rewards, trainer factories, the
2-rank plumbing) are in helpers.py, TRL's side of the equivalence tests in trl_harness.py.

Markers (registered in pyproject.toml): ``slow`` (the world model's SFT and workshop runs,
paired ``grpolab train`` runs on the tiny HF model, GGUF conversion and the real SmolLM2
model, subprocess benches), ``dist`` (2-process groups), ``trl`` (imports or runs TRL).
``pytest -m "not slow"`` is the quick subset; plain ``pytest`` runs everything.

The model folders and the SFT cache are built once per session: tests only read them."""

from __future__ import annotations

import pytest
import torch

from grpolab.world.sft import sft_model
from grpolab.world.task import make_splits


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama (with its tokenizer) saved as a Hugging Face model folder."""
    from grpolab.rollout.tinyhf import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", hidden=32, heads=4)


@pytest.fixture(scope="session")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random GPT-2 (1024 positions) saved as a Hugging Face model folder."""
    from grpolab.rollout.tinyhf import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gpt2"), arch="gpt2", hidden=32, heads=4)


@pytest.fixture(scope="session")
def world_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """CLI flags for a tiny, fast workshop run (the 2-step SFT start is built once)."""
    cache = tmp_path_factory.mktemp("cache")
    sft_model(0, make_splits(0, 64, 16), 2, cache)
    return ["--sft-steps", "2", "--cache-dir", str(cache), "--world-train-size", "64",
            "--world-heldout-size", "16", "--eval-size", "16", "--budget", "16",
            "--group-size", "4", "--no-progress"]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def device(request: pytest.FixtureRequest) -> str:
    """The devices a test that takes it runs on: the CPU always, CUDA too where there is one
    (each run compares on its own device)."""
    return request.param
