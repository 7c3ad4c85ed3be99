"""expkit: a Hydra-native experiment framework for PyTorch.

from expkit import Runner, Hook, Priority, Stage, TrainerSettings
"""

from expkit.core import data_info as data_info  # registers ${data_info:KEY} before any config is composed
from expkit.core.errors import ConfigError, ExpkitError, HookError
from expkit.core.rng import seed_everything
from expkit.core.settings import TrainerSettings
from expkit.core.stages import Priority, Stage, get_priority
from expkit.engine.runner import Runner
from expkit.hooks import Hook, default_hooks

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ExpkitError",
    "Hook",
    "HookError",
    "Priority",
    "Runner",
    "Stage",
    "TrainerSettings",
    "default_hooks",
    "get_priority",
    "seed_everything",
]
