"""grpolab: GRPO and its fixes (DAPO, Dr. GRPO, RLOO) for RL with verifiable rewards."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpolab.app.api import train, workshop
    from grpolab.app.commands import RunError
    from grpolab.config import Config, ConfigError, make_config
    from grpolab.core.advantages import dead_stats, group_advantages, predicted_dead_share
    from grpolab.core.losses import grpo_loss

# Each name is loaded from its module on first use, so that ``import grpolab`` (and the
# command's entry point, grpolab.app.main) does not load torch: Ctrl-C while it loads is then
# the command's one line. ``train``/``workshop``: the Python API; ``RunError``: a run that could
# not go on (the CLI's exit 1).
_FROM = {"Config": "grpolab.config", "ConfigError": "grpolab.config",
         "make_config": "grpolab.config", "dead_stats": "grpolab.core.advantages",
         "group_advantages": "grpolab.core.advantages",
         "predicted_dead_share": "grpolab.core.advantages", "grpo_loss": "grpolab.core.losses",
         "train": "grpolab.app.api", "workshop": "grpolab.app.api",
         "RunError": "grpolab.app.commands"}
__all__ = ["Config", "ConfigError", "RunError", "dead_stats", "group_advantages", "grpo_loss",
           "make_config", "predicted_dead_share", "train", "workshop"]
__version__ = "0.1.0"


_PACKAGES = ("app", "config", "core", "data", "predict", "rewards", "rollout", "run", "world")


def __getattr__(name: str) -> Any:
    if name in _FROM:
        return getattr(importlib.import_module(_FROM[name]), name)
    if name in _PACKAGES:  # (grpolab.core.losses after a bare import grpolab, as before: the
        for module in sorted(set(_FROM.values())):  # modules it loaded then, and theirs)
            importlib.import_module(module)
        return importlib.import_module(f"grpolab.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM})
