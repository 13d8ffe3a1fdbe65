"""grpolab: GRPO and its fixes (DAPO, Dr. GRPO, RLOO) for RL with verifiable rewards."""

from grpolab.config import Config, ConfigError, make_config
from grpolab.core.advantages import dead_stats, group_advantages, predicted_dead_share
from grpolab.core.losses import grpo_loss

__all__ = [
    "Config",
    "ConfigError",
    "RunError",
    "dead_stats",
    "group_advantages",
    "grpo_loss",
    "make_config",
    "predicted_dead_share",
    "train",
    "workshop",
]
__version__ = "0.1.0"


def __getattr__(name: str):  # the Python API (grpolab.app.api), loaded on first use
    """``grpolab.train`` and ``grpolab.workshop`` are ``grpolab.app.api``'s functions;
    ``grpolab.RunError`` (a run that could not go on, the CLI's exit 1) is the commands'."""
    if name in ("train", "workshop"):
        from grpolab.app import api

        return getattr(api, name)
    if name == "RunError":
        from grpolab.app.commands import RunError

        return RunError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
