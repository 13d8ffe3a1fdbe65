"""Tiny local Hugging Face models: save, reload offline, tokenize and generate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.rollout.tinyhf import default_texts, make_tiny_model, train_tokenizer

SAMPLE = "Q: 12 + 7?\n<think> 12 + 7 = 19 </think>\n<answer>19</answer> \\boxed{19} é→日本"


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp(request.param)
    return make_tiny_model(
        out, arch=request.param, hidden=32, layers=2, heads=4, chat_template=True
    )


def test_reloads_with_auto_classes(tiny: str) -> None:
    config = json.loads((Path(tiny) / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert model.config.model_type == config["model_type"]
    assert model.config.vocab_size == len(tok)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id


def test_tokenizer_round_trips_and_compresses(tiny: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok(SAMPLE)["input_ids"]
    assert tok.decode(ids) == SAMPLE
    # BPE merges from the arithmetic corpus: far fewer ids than bytes.
    assert len(ids) < len(SAMPLE.encode()) * 0.6
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert len(tok(tag)["input_ids"]) == 1
        assert tok.decode(tok(f"x{tag}y")["input_ids"]) == f"x{tag}y"


def test_chat_template_and_generate(tiny: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|>user: What is 2 + 2?<|eos|>\nassistant: "
    enc = tok(text, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (1, enc["input_ids"].shape[1] + 5)
    assert torch.equal(out[0, : enc["input_ids"].shape[1]], enc["input_ids"][0])


def test_seed_makes_weights_reproducible(tmp_path: Path) -> None:
    def weights(seed: int, name: str) -> torch.Tensor:
        path = make_tiny_model(tmp_path / name, hidden=16, layers=1, heads=2, seed=seed)
        model = AutoModelForCausalLM.from_pretrained(path)
        return model.get_input_embeddings().weight.detach().clone()

    torch.manual_seed(123)
    before = torch.rand(1)
    a, b, c = weights(0, "a"), weights(0, "b"), weights(1, "c")
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before)  # caller's RNG state is left alone
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_train_tokenizer_custom_texts(tmp_path: Path) -> None:
    tok = train_tokenizer(["hello world"] * 10, tmp_path, vocab_size=300)
    assert len(tok) <= 300
    assert tok.decode(tok("hello world")["input_ids"]) == "hello world"
    assert tok.chat_template is None
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded("unseen ☃ text")["input_ids"] == tok("unseen ☃ text")["input_ids"]


def test_default_texts_cover_answer_formats() -> None:
    corpus = "\n".join(default_texts())
    for marker in ("<think>", "</think>", "<answer>", "</answer>", "\\boxed{"):
        assert marker in corpus


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch 'bert'"):
        make_tiny_model(tmp_path, arch="bert")
    with pytest.raises(ValueError, match="not divisible"):
        make_tiny_model(tmp_path, hidden=30, heads=4)
