"""grpolab: GRPO and its fixes (DAPO, Dr. GRPO, RLOO) for RL with verifiable rewards."""

from .advantages import dead_stats, group_advantages, predicted_dead_share
from .config import Config, make_config
from .losses import grpo_loss

__all__ = [
    "Config",
    "dead_stats",
    "group_advantages",
    "grpo_loss",
    "make_config",
    "predicted_dead_share",
    "train",
    "workshop",
]
__version__ = "0.1.0"


def __getattr__(name: str):  # the Python API (grpolab.api), loaded on first use
    """``grpolab.train`` is ``grpolab.api.train``; ``grpolab.workshop`` is the workshop module,
    which called is ``grpolab.api.workshop`` (the import system sets the package's
    ``workshop`` attribute to that module whenever it is imported, so the module itself must
    be the callable: see the end of ``grpolab/workshop.py``)."""
    if name == "train":
        from .api import train

        return train
    if name == "workshop":
        import importlib

        return importlib.import_module(".workshop", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
