"""Plain helpers several test files share: rewards, the tiny-world trainer factories, the
2-rank plumbing (needed by worker processes, so not fixtures), the reliability tests' CLI
runner and the loss-equivalence checks. Fixtures live in conftest.py; TRL's side of the
equivalence tests in trl_harness.py (it imports trl)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from grpolab.config import Config, make_config
from grpolab.run.report import read_metrics
from grpolab.run.trainer import GRPOTrainer
from grpolab.world.backend import TinyBackend
from grpolab.world.model import CharTokenizer, TinyConfig, TinyGPT
from grpolab.world.task import make_splits

# ------------------------------------------------------------ the Hub's cache --


def hub_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``cache`` as the Hugging Face Hub cache for this test, its Hub unreachable (so nothing
    can be downloaded: a test that needed the network fails)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # (nothing listens)
    return cache


def cached_repo(cache: Path, repo: str, kind: str = "models") -> Path:
    """The snapshot folder of ``repo`` laid out as `hf download` leaves it (refs/main naming
    snapshots/<commit>); the caller fills it."""
    root = cache / f"{kind}--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("c0ffee")
    return root / "snapshots" / "c0ffee"


def cached_dataset(cache: Path, repo: str, configs: dict[str, dict[str, list[dict]]]) -> Path:
    """A Hub dataset in ``cache``: each config's splits as parquet files under <config>/, and
    the dataset card's ``configs`` naming them, as the Hub's parquet layout has it."""
    import pandas as pd
    import yaml

    snap = cached_repo(cache, repo, "datasets")
    card = []
    for config, splits in configs.items():
        (snap / config).mkdir(parents=True)
        for split, rows in splits.items():
            pd.DataFrame(rows).to_parquet(snap / config / f"{split}-00000-of-00001.parquet")
        card.append({"config_name": config, "data_files": [
            {"split": split, "path": f"{config}/{split}-*"} for split in splits]})
    (snap / "README.md").write_text(f"---\n{yaml.safe_dump({'configs': card})}---\n")
    return snap


# ----------------------------------------------------------------------- rewards --


def first_digit_odd(prompts, completions, **_):
    """A reward a random model gets right about half the time, so groups are often mixed."""
    return [1.0 if c[:1] in "13579" and c else 0.0 for c in completions]


def never(prompts, completions, **_):
    return [0.0] * len(completions)


def digit_reward(prompts: list, completions: list[str], **_: object) -> list[float]:
    """Share of digit characters: a near-random policy still gets mixed groups."""
    return [sum(ch.isdigit() for ch in c) / 8 for c in completions]


# ------------------------------------------------------------- tiny-world trainers --


def world_trainer(tmp_path, reward=first_digit_odd, lora=False, max_len=24,
                  **over) -> GRPOTrainer:
    """A trainer on the task world's tiny model (untrained: groups are often mixed)."""
    cfg = make_config(None, {"progress": False, "checkpoint_every": 0, "budget": 32,
                             "group_size": 4, "steps": 2, "max_new_tokens": 4,
                             "eval_size": 16, **over})
    torch.manual_seed(0)
    model = TinyGPT(TinyConfig(d_model=32, n_layers=2, n_heads=2, max_len=max_len))
    splits = make_splits(0, 64, 16)
    backend = TinyBackend(model, lora=lora, seed=0)
    rewards = reward if isinstance(reward, list) else [reward]
    return GRPOTrainer(cfg, backend, splits.train, rewards, splits.heldout, out_dir=tmp_path)


def tiny_trainer(out: Path, rewards: list | None = None, rows: int = 32,
                 **over: Any) -> GRPOTrainer:
    """A one-layer world trainer writing to ``out`` (3 steps, no checkpoints unless asked)."""
    torch.manual_seed(0)
    model = TinyGPT(TinyConfig(vocab_size=CharTokenizer().vocab_size, d_model=32, n_layers=1))
    splits = make_splits(0, rows, 8)
    cfg = Config(**{"budget": 8, "group_size": 4, "steps": 3, "eval_size": 8, "progress": False,
                    "checkpoint_every": 0, "out_dir": str(out), **over})
    return GRPOTrainer(cfg, TinyBackend(model), splits.train,
                       rewards or [lambda p, c, **_: [float(x[:1] in "13579") for x in c]],
                       splits.heldout, out_dir=out)


def weights(tr: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tr.backend.model.state_dict().items()}


# ------------------------------------------------------------------- two ranks --

G = 4
GROUPS = 8


def rank_env(rank: int, world: int, port: int) -> None:
    """What torchrun sets for a rank (on this host), and one torch thread per rank."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------ the CLI, in-process --


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """Exit code and stderr lines of an in-process CLI call; warnings are added as the CLI
    prints them ("grpolab: ..."), since pytest takes over the logging handlers."""
    from grpolab.app.cli import main

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("grpolab")
    logger.addHandler(handler)
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        logger.removeHandler(handler)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    # (the no-signal alarm fires on these 2-step SFT starts, which get every answer wrong; its
    # warning is tested in test_predict.py, not counted here)
    return code, [f"grpolab: {r.getMessage()}" for r in records
                  if not r.getMessage().startswith(("NO LEARNING SIGNAL",
                                                    "LITTLE LEARNING SIGNAL"))] + err


def files_under(d: Path) -> dict[str, bytes]:
    """Every file under d: what 'nothing already written is lost' compares (the out_dir lock
    aside: any run that gets the folder writes its pid there, even one then refused)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".grpolab.lock"}


def metric_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl")]


def computed(rows: list[dict]) -> list[dict]:
    """Metrics lines without what is measured rather than computed (timings, the process's
    memory high-water marks) and the run id: what two runs of the same work must share."""
    return [{k: v for k, v in r.items()
             if not k.startswith(("time_", "peak_")) and k != "run_id"} for r in rows]


# ------------------------------------------------------------------- decoding --


def same_answers(a: torch.Tensor, b: torch.Tensor, pad: int) -> bool:
    """Completion ids [B, T] of two decoders, PAD after each answer's end, equal up to trailing
    PAD: decoders stop at different points once every answer has ended (HF at once, the
    fixed-shape loop at its next check), on any device."""
    w = max(a.shape[1], b.shape[1])
    a, b = (torch.nn.functional.pad(x.cpu(), (0, w - x.shape[1]), value=pad) for x in (a, b))
    return torch.equal(a, b)


# -------------------------------------------------------- loss equivalence checks --


def pair(seed: int = 0, b: int = 6, t: int = 5, spread: float = 0.5):
    """Random log-probs (with grad), old and reference log-probs, advantages of both signs and
    a ragged mask."""
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=gen) * 3).requires_grad_(True)
    old = logp.detach() + spread * torch.randn(b, t, generator=gen)
    ref = logp.detach() + 0.3 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, generator=gen)
    lens = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lens[:, None]).long()
    return logp, old, ref, adv, mask


def agree(ours_fn, theirs_fn, *tensors) -> None:
    """Same loss and same gradients w.r.t. every given leaf tensor."""
    a = ours_fn()
    ga = torch.autograd.grad(a, tensors, allow_unused=True)
    b = theirs_fn()
    gb = torch.autograd.grad(b, tensors, allow_unused=True)
    assert a.item() == pytest.approx(b.item(), rel=1e-5, abs=1e-6)
    for x, y in zip(ga, gb):
        x = torch.zeros_like(tensors[0]) if x is None else x
        y = torch.zeros_like(tensors[0]) if y is None else y
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), (x, y)
