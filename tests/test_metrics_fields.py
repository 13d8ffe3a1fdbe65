"""Every field a run writes to metrics.jsonl is in docs/trackers-api.md's table (name, meaning,
unit), so the table cannot fall behind the code."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from helpers import tiny_trainer

from grpolab.config import Config
from grpolab.run.report import read_metrics
from grpolab.run.trainer import GRPOTrainer
from grpolab.world.backend import TinyBackend
from grpolab.world.model import CharTokenizer, TinyConfig, TinyGPT
from grpolab.world.task import make_splits

DOC = Path(__file__).resolve().parents[1] / "docs" / "trackers-api.md"


def documented() -> dict[str, tuple[str, str]]:
    """The table under "What metrics.jsonl holds": field -> (meaning, unit)."""
    text = DOC.read_text()
    assert "## What metrics.jsonl holds" in text
    section = text.split("## What metrics.jsonl holds", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.fullmatch(r"\| `([^`]+)` \| (.+) \| ([^|]+) \|", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} twice in the table"
            rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    return rows


def is_documented(key: str, names: dict[str, tuple[str, str]]) -> bool:
    """``key`` by name, or by a pattern such as ``rewards/<name>``."""
    patterns = [".+".join(map(re.escape, re.split(r"<[^>]+>", n))) for n in names if "<" in n]
    return key in names or any(re.fullmatch(p, key) for p in patterns)


def odd(prompts: list, completions: list[str], **_: object) -> list[float]:
    return [float(c[:1] in "13579") for c in completions]


def test_every_metrics_field_is_documented(tmp_path: Path) -> None:
    # the plain path with the watch and a difficulty column (2 steps: the watch's rises) ...
    torch.manual_seed(0)
    model = TinyGPT(TinyConfig(vocab_size=CharTokenizer().vocab_size, d_model=32, n_layers=1))
    splits = make_splits(0, 32, 8)
    held = [dict(r, difficulty=i % 2) for i, r in enumerate(splits.heldout)]
    cfg = Config(budget=8, group_size=4, steps=2, eval_size=8, progress=False,
                 checkpoint_every=0, out_dir=str(tmp_path / "a"), watch_window=1)
    GRPOTrainer(cfg, TinyBackend(model), splits.train, [odd], held, out_dir=tmp_path / "a",
                watch_fn=odd).train()
    # ... and the options that add fields: a critic, token-level advantages, KL in the reward,
    # entropy-selected tokens, allocated group sizes
    tiny_trainer(tmp_path / "b", rewards=[odd], steps=1, estimator="ppo", kl_in="reward",
                 beta=0.04, top_entropy_quantile=0.5, allocate=True, off_policy_mask=0.1,
                 epochs=2).train()
    keys = {k for run in "ab" for r in read_metrics(tmp_path / run / "metrics.jsonl") for k in r}
    assert {"rewards/odd", "watch_train_rise", "heldout_acc_by_difficulty", "value_loss",
            "group_sizes", "kl_reward", "entropy_token_share", "off_policy_masked"} <= keys
    names = documented()
    assert len(names) > 40 and all(all(cell) for cell in names.values())
    missing = sorted(k for k in keys if not is_documented(k, names))
    assert not missing, f"metrics.jsonl fields missing from {DOC.name}'s table: {missing}"
