"""expkit: a Hydra-native experiment framework for PyTorch.

from expkit import Runner, Hook, Priority, Stage, TrainerSettings
"""

from expkit import data_info as data_info  # registers ${data_info:KEY} before any config is composed
from expkit.errors import ConfigError, ExpkitError, HookError
from expkit.hooks import Hook, default_hooks
from expkit.rng import seed_everything
from expkit.runner import Runner
from expkit.settings import TrainerSettings
from expkit.stages import Priority, Stage, get_priority

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
