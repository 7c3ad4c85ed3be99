"""expkit: a Hydra-native experiment framework for PyTorch.

from expkit import Runner, Hook, Priority, Stage, TrainerSettings

The names that need torch (``Runner``, ``Hook``, ``seed_everything``...) are imported when first
used (PEP 562), so that a command's ``--help``, ``--cfg job`` and ``--info`` never import torch
(about 1.5 s of the 1.7 s that ``import expkit`` cost when they were imported here).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from expkit.core import data_info as data_info  # registers ${data_info:KEY} before any config is composed
from expkit.core.errors import ConfigError, ExpkitError, HookError
from expkit.core.stages import Priority, Stage, get_priority

if TYPE_CHECKING:
    from expkit.core.rng import seed_everything
    from expkit.core.settings import TrainerSettings
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

# the names that import torch, and the module each comes from
_LAZY = {
    "Hook": "expkit.hooks",
    "Runner": "expkit.engine.runner",
    "TrainerSettings": "expkit.core.settings",
    "default_hooks": "expkit.hooks",
    "seed_everything": "expkit.core.rng",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'expkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # (the next look-up is a plain module attribute)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
