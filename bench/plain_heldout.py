"""The held-out accuracy of workshop runs' final policies under one sampler for all: the plain
softmax at T (no top-k/top-p/min-p/penalty), exact, over each run's own held-out prompts. A run
with sampling filters reports its own sampler's accuracy, which the filter lifts by itself;
this reads what the policy learned.

    python bench/plain_heldout.py runs/sweep-top-p/grpo-G8-seed0 runs/sweep/grpo-G8-seed0 ...

Each folder's config.json and checkpoints/last.pt are read; prints the step and the accuracy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grpolab.config import Config
from grpolab.config.values import coerce
from grpolab.rollout.sampling import NO_FILTERS
from grpolab.run import checkpoint
from grpolab.world.workshop import world_trainer


def plain_heldout(run: Path, scratch: Path, temperature: float = 1.0) -> tuple[int, float]:
    raw = json.loads((run / "config.json").read_text())
    cfg = Config(**{k: coerce(k, v) for k, v in raw.items() if k in Config.__dataclass_fields__})
    cfg.progress = False
    trainer = world_trainer(cfg, scratch)  # the run's split and fine-tuned start (cached)
    state = checkpoint.read(run / "checkpoints" / "last.pt")
    trainer.backend.load_state_dict(state["backend"])
    trainer.backend.filters = NO_FILTERS
    rows = trainer.heldout_rows[: cfg.eval_size]
    return int(state["step"]), float(trainer.backend.pass_probability(rows, temperature).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="workshop run folders")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--scratch", type=Path, default=Path("runs/plain-heldout"),
                    help="where the loaded trainers write (nothing is kept there)")
    args = ap.parse_args()
    for run in args.runs:
        step, acc = plain_heldout(run, args.scratch / run.name, args.temperature)
        print(f"{run}: step {step}, held-out p(T={args.temperature:g}) {acc:.3f}")


if __name__ == "__main__":
    main()
