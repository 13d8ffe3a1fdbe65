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
]
__version__ = "0.1.0"
