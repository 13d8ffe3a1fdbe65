"""Which prompts a step trains on: fresh random draws (grpolab's default), shuffled passes over
the data (TRL's sampler) or passes in the data's order (TRL's shuffle_dataset false); each
prompt once a pass, the pass's place kept in checkpoints."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import tiny_trainer

from grpolab.config import ConfigError, make_config
from grpolab.predict.curriculum import PromptSampler


@pytest.mark.parametrize("k", [5, 3, 7])  # passes of 10 prompts: whole draws, or cut by one
def test_each_prompt_once_a_pass(k: int) -> None:
    s = PromptSampler(10, torch.Generator().manual_seed(0), order="epochs")
    draws = [s.draw(k) for _ in range(10)]  # 10 k picks: k whole passes
    assert all(len(set(d)) == len(d) == k for d in draws)  # distinct within a step
    flat = [i for d in draws for i in d]
    assert Counter(flat) == dict.fromkeys(range(10), k)
    assert flat[:10] != list(range(10))  # shuffled
    seq = PromptSampler(10, torch.Generator().manual_seed(0), order="sequential")
    assert [seq.draw(4) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    rnd = PromptSampler(10, torch.Generator().manual_seed(0))
    counts = Counter(i for _ in range(10) for i in rnd.draw(k))
    assert set(counts.values()) != {k}  # fresh draws: some prompts more often than others


def test_the_pass_resumes_where_it_was(tmp_path) -> None:
    over = {"prompt_order": "epochs", "checkpoint_every": 1}
    whole = tiny_trainer(tmp_path / "whole", steps=5, rows=12, **over)
    rows = whole.train()[1:]
    tiny_trainer(tmp_path / "cut", steps=2, rows=12, **over).train()
    second = tiny_trainer(tmp_path / "cut", steps=5, rows=12, **over)
    resumed = second.train(resume=True)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows[2:]]
    assert torch.equal(second.sampler.queue, whole.sampler.queue)


def test_settings_and_trl_names() -> None:
    assert make_config(None, {"shuffle_dataset": False, "num_generations": 8},
                       "train").prompt_order == "sequential"
    assert make_config(None, {"shuffle_dataset": True, "num_generations": 8},
                       "train").prompt_order == "epochs"
    assert make_config(None, {}, "train").prompt_order == "random"
    with pytest.raises(ConfigError, match="the curriculum and the allocator choose"):
        make_config(None, {"prompt_order": "epochs", "curriculum": True})
