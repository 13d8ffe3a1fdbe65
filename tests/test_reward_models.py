"""Reward models (rm:<folder>): they score like TRL's reward-model path, whatever the padding,
and their errors are one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _reward_model(tmp_path, chat: bool = False) -> str:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpolab.rollout.tinyhf import train_tokenizer

    out = tmp_path / "rm"
    tok = train_tokenizer(None, out, 256, chat_template=chat)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, vocab_size=len(tok), num_labels=1,
                      pad_token_id=tok.pad_token_id, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForSequenceClassification(cfg).save_pretrained(str(out))
    return str(out)


@pytest.mark.trl
def test_reward_model_matches_trl(tmp_path) -> None:
    pytest.importorskip("trl")
    from trl_harness import trl_model_rewards

    from grpolab.rewards.builtin import load_reward
    from grpolab.rewards.scorer import runs_in_process, score

    path = _reward_model(tmp_path, chat=True)
    fn = load_reward(f"rm:{path}")
    assert fn.__name__ == "rm_rm" and runs_in_process(fn)
    prompts = ["What is 2 + 2?", "Compute 7 * 6.", "What is 2 + 2?"]
    completions = [" 4", " The answer is 42, I think", " five"]
    got = fn(prompts, completions)
    assert got == pytest.approx(trl_model_rewards(fn, prompts, completions), abs=1e-5)
    # padding does not change a score: each alone is the same
    assert [fn([p], [c])[0] for p, c in zip(prompts, completions)] == pytest.approx(got, abs=1e-5)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    chat_completions = [[{"role": "assistant", "content": c}] for c in completions]
    got = fn(chats, completions)
    assert got == pytest.approx(trl_model_rewards(fn, chats, chat_completions), abs=1e-5)
    res = score([fn], prompts, completions)
    assert res.names == ["rm_rm"] and res.total.tolist() == pytest.approx(fn(prompts, completions))


def test_reward_model_errors_are_one_line(tmp_path) -> None:
    from grpolab.rewards.builtin import load_reward

    with pytest.raises(ValueError, match="no config.json"):
        load_reward(f"rm:{tmp_path}")
    with pytest.raises(ValueError, match="needs a model folder"):
        load_reward("rm:")
    # a causal LM's folder, or a classifier without its head: refused, not scored at random
    from grpolab.rollout.tinyhf import make_tiny_model

    lm = make_tiny_model(tmp_path / "lm", arch="llama", hidden=32, heads=4)
    with pytest.raises(ValueError, match="LlamaForCausalLM, not a sequence-classification"):
        load_reward(f"rm:{lm}")
    rm = Path(_reward_model(tmp_path))
    from safetensors.torch import load_file, save_file

    weights = load_file(rm / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("score")},
              rm / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="its weights lack score.weight"):
        load_reward(f"rm:{rm}")
