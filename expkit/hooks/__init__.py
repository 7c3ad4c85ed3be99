"""Hooks: the base class, the six default hooks and the custom catalog (one per file)."""

from expkit.hooks.base import Hook
from expkit.hooks.checkpoint import CheckpointHook
from expkit.hooks.ema import EMAHook
from expkit.hooks.iter_timer import IterTimerHook
from expkit.hooks.logger import LoggerHook
from expkit.hooks.param_scheduler import ParamSchedulerHook
from expkit.hooks.runtime_info import RuntimeInfoHook
from expkit.hooks.sampler_seed import DistSamplerSeedHook

__all__ = [
    "CheckpointHook",
    "DistSamplerSeedHook",
    "EMAHook",
    "Hook",
    "IterTimerHook",
    "LoggerHook",
    "ParamSchedulerHook",
    "RuntimeInfoHook",
]
