"""The optimiser and what sets each optimiser step's hyperparameters: torch's Adam with TRL's
AdamW decay groups (``optimizer``), the learning-rate schedule (``lr_at``) and the entropy
bonus's coefficient (``EntropyControl``, Skywork-OR1's adaptive controller). Each is read by
``grpolab.run.update.optimize``; the trainer owns their state."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from grpolab.config import Config


def lr_factor(step: int, steps: int, schedule: str, warmup: int, floor: float = 0.0,
              from_zero: bool = False) -> float:
    """Multiplier of the base lr for GRPO step ``step`` (0-based) of ``steps``: a linear
    warm-up over ``warmup`` steps (from lr / warmup, or with ``from_zero`` from 0 as
    transformers' and verl's), then constant, linear to 0 or half a cosine to ``floor`` at
    ``steps`` (as transformers' schedulers do; the floor: its cosine_with_min_lr's
    min_lr_rate). A function of the step alone, so a resumed run continues the schedule
    exactly."""
    if step < warmup:
        return (step + (0 if from_zero else 1)) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    if schedule == "linear":
        return 1.0 - progress
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cosine * (1 - floor) + floor if floor else cosine


def schedule_length(cfg: Config) -> tuple[int, int, int]:
    """What the lr schedule counts: (units per GRPO step, units in the run, warm-up units).
    Optimiser steps (``steps x epochs x minibatches``, TRL's) or with ``schedule_per: step``
    sampled batches (a batch's optimiser steps at one lr, verl's); a ``warmup_steps`` share
    is of the run's units, rounded up (transformers') or with ``warmup_round: down`` down
    (verl's ``int(ratio * total_training_steps)``)."""
    per = cfg.epochs * cfg.minibatches if cfg.schedule_per == "optimiser_step" else 1
    w, units = cfg.warmup_steps, cfg.steps * per
    if not 0 < w < 1:
        return per, units, int(w) * per
    return per, units, int(w * units) if cfg.warmup_round == "down" else math.ceil(w * units)


def lr_at(cfg: Config, step: int, i: int = 0) -> float:
    """The lr of optimiser step ``i`` of GRPO step ``step`` (``schedule_length``'s count)."""
    per, total, warmup = schedule_length(cfg)
    floor = cfg.min_lr_rate or cfg.min_lr / cfg.lr  # (transformers' min_lr: over the lr)
    return cfg.lr * lr_factor(step * per + (i if per > 1 else 0), total, cfg.lr_schedule,
                              warmup, floor, cfg.warmup_from_zero)


# transformers' Trainer decays no bias and no norm's weight (``get_decay_parameter_names``)
NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def optimizer(model: nn.Module, cfg: Config) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    """The trainable parameters and torch's Adam over them, as TRL's AdamW: decoupled weight
    decay ``weight_decay`` on every one but biases and normalisation weights (by name, or
    inside an ``nn.LayerNorm``), in a second parameter group; one group without decay."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    kw = {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_epsilon}
    if not cfg.weight_decay:
        return params, torch.optim.Adam(params, **kw)
    norms = {f"{m}.{n}".lstrip(".") for m, mod in model.named_modules()
             if isinstance(mod, nn.LayerNorm) for n, _ in mod.named_parameters()}
    plain = {n for n, _ in named if n in norms or NO_DECAY.search(n.lower())}
    return params, torch.optim.AdamW(
        [{"params": [p for n, p in named if n not in plain], "weight_decay": cfg.weight_decay},
         {"params": [p for n, p in named if n in plain], "weight_decay": 0.0}], **kw)


class EntropyControl:
    """The entropy bonus's coefficient, and its state: ``entropy_coef`` fixed, or with
    ``use_adaptive_entropy`` Skywork-OR1's controller as TRL 1.16 runs it: a step applies the
    coefficient only if the previous optimiser step's entropy (over the tokens the policy
    loss trained on, all micro-batches and ranks; none yet: no bonus) was at most
    ``entropy_target``; after each step the coefficient rises by ``entropy_coef_delta`` if that
    step's entropy was, else falls by it, within [``entropy_coef_min``, ``entropy_coef_max``]."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.coef, self.last = cfg, float(cfg.entropy_coef), math.inf

    def applied(self) -> float:
        """The coefficient this optimiser step applies."""
        adaptive = self.cfg.use_adaptive_entropy
        return self.coef if not adaptive or self.last <= self.cfg.entropy_target else 0.0

    def observe(self, entropy: float) -> None:
        """After an optimiser step: that step's entropy moves the coefficient (adaptive only)."""
        c = self.cfg
        if c.use_adaptive_entropy:  # (bounded on the side it moves to, as TRL does)
            if entropy <= c.entropy_target:
                self.coef = min(self.coef + c.entropy_coef_delta, c.entropy_coef_max)
            else:
                self.coef = max(self.coef - c.entropy_coef_delta, c.entropy_coef_min)
            self.last = entropy

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "last": self.last}

    def load_state_dict(self, state: dict[str, float]) -> None:
        # a fixed coefficient is the config's (a resume may change it); an older checkpoint
        # has no state: the run's entropy_coef, no step seen
        if state and self.cfg.use_adaptive_entropy:
            self.coef, self.last = float(state["coef"]), float(state["last"])
