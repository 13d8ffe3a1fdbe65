"""Build tiny, randomly initialised Hugging Face models locally: tests and benchmarks, no hub."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
# Whole tokens (as in Qwen-style reasoning models) instead of "<", "think", ">" pieces.
FORMAT_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

# Plain "role: content" turns so the template tokenizes with the tiny BPE, ending in EOS so a
# model trained on it learns where to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def default_texts(n: int = 300, seed: int = 0) -> list[str]:
    """Arithmetic and answer-format lines, so rollouts in those formats get short token ids."""
    rng = random.Random(seed)
    texts = [
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
        "\\boxed{}",
        "\\frac{1}{2}",
        "user: assistant: system:",
        "The answer is",
    ]
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        result = a + b if op == "+" else a - b if op == "-" else a * b
        kind = rng.randrange(4)
        if kind == 0:
            texts.append(f"What is {a} {op} {b}? {result}")
        elif kind == 1:
            texts.append(f"<think> {a} {op} {b} = {result} </think> <answer>{result}</answer>")
        elif kind == 2:
            texts.append(f"Compute {a} {op} {b}. So the answer is \\boxed{{{result}}}.")
        else:
            texts.append(f"{a} {op} {b} = {result}\n")
    return texts


def train_tokenizer(
    texts: list[str] | None,
    out_dir: str | Path | None = None,
    vocab_size: int = 512,
    chat_template: bool = False,
    model_max_length: int = 1024,
    extra_tokens: Sequence[str] = FORMAT_TOKENS,
) -> Any:
    """Train a byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``.

    Byte-level means any string round-trips exactly (no unknown tokens), which the
    tests and reward code rely on. ``extra_tokens`` become single, non-special tokens.
    The total vocabulary is at most ``vocab_size``. Saved to ``out_dir`` when given.
    """
    import tokenizers as tk
    from transformers import PreTrainedTokenizerFast

    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size - len(extra_tokens),
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts if texts is not None else default_texts(), trainer)
    tok.add_tokens([tk.AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
    )
    if chat_template:
        hf_tok.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    vocab_size: int = 512,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    chat_template: bool = False,
    texts: list[str] | None = None,
    max_positions: int = 1024,
    kv_heads: int | None = None,
    tie_word_embeddings: bool = True,
) -> str:
    """Save a tokenizer and a randomly initialised ``llama`` or ``gpt2`` causal LM to ``out_dir``.

    The result loads with ``AutoModelForCausalLM/AutoTokenizer.from_pretrained(out_dir)``
    offline, so tests and benchmarks exercise the same code path as real checkpoints.
    ``kv_heads`` (grouped-query attention) and ``tie_word_embeddings`` apply to ``llama``.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if arch not in ("llama", "gpt2"):
        raise ValueError(f"make_tiny_model: unknown arch {arch!r} (expected 'llama' or 'gpt2')")
    if hidden % heads:
        raise ValueError(f"make_tiny_model: hidden={hidden} is not divisible by heads={heads}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(texts, out, vocab_size, chat_template, max_positions)
    ids = {
        "vocab_size": len(tok),  # BPE may learn fewer merges than asked on small corpora
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    if arch == "llama":
        config: Any = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads or heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=tie_word_embeddings,
            **ids,
        )
        model_cls: Any = LlamaForCausalLM
    else:
        config = GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions, **ids
        )
        model_cls = GPT2LMHeadModel

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # seed locally, leave the caller's RNG alone
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out))
    return str(out)
