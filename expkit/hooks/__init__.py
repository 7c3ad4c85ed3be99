"""Hooks: the base class, the six default hooks and the custom catalog (one per file).

Each hook's module is imported when its name is first used (PEP 562): most of them import torch,
and ``expkit.hooks.base`` (``Hook``, which the sweeps' and the commands' modules subclass) must not
pull them in, so that a command's ``--help`` imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.hooks.activation_stats import ActivationStatsHook
    from expkit.hooks.checkpoint import CheckpointHook
    from expkit.hooks.csv_writer import CSVHook
    from expkit.hooks.detect_anomaly import DetectAnomalyHook
    from expkit.hooks.early_stopping import EarlyStoppingHook
    from expkit.hooks.ema import EMAHook
    from expkit.hooks.empty_cache import EmptyCacheHook
    from expkit.hooks.grad_norm import GradNormHook
    from expkit.hooks.invalid_loss import InvalidLossError, InvalidLossHook
    from expkit.hooks.iter_timer import IterTimerHook
    from expkit.hooks.log_predictions import LogPredictionsHook
    from expkit.hooks.logger import LoggerHook
    from expkit.hooks.memory_summary import MemorySummaryHook
    from expkit.hooks.model_complexity import ModelComplexityHook
    from expkit.hooks.momentum_encoder import MomentumEncoderHook
    from expkit.hooks.param_scheduler import ParamSchedulerHook
    from expkit.hooks.perf_stats import PerfStatsHook
    from expkit.hooks.profiler import ProfilerHook
    from expkit.hooks.runtime_info import RuntimeInfoHook
    from expkit.hooks.sampler_seed import DistSamplerSeedHook
    from expkit.hooks.stop_after import StopAfterHook
    from expkit.hooks.sync_buffers import SyncBuffersHook

# each hook of the catalog (and the error one raises) by name, and the module of expkit.hooks it lives in
_LAZY = {
    "ActivationStatsHook": "activation_stats",
    "CSVHook": "csv_writer",
    "CheckpointHook": "checkpoint",
    "DetectAnomalyHook": "detect_anomaly",
    "DistSamplerSeedHook": "sampler_seed",
    "EMAHook": "ema",
    "EarlyStoppingHook": "early_stopping",
    "EmptyCacheHook": "empty_cache",
    "GradNormHook": "grad_norm",
    "InvalidLossError": "invalid_loss",
    "InvalidLossHook": "invalid_loss",
    "IterTimerHook": "iter_timer",
    "LogPredictionsHook": "log_predictions",
    "LoggerHook": "logger",
    "MemorySummaryHook": "memory_summary",
    "ModelComplexityHook": "model_complexity",
    "MomentumEncoderHook": "momentum_encoder",
    "ParamSchedulerHook": "param_scheduler",
    "PerfStatsHook": "perf_stats",
    "ProfilerHook": "profiler",
    "RuntimeInfoHook": "runtime_info",
    "StopAfterHook": "stop_after",
    "SyncBuffersHook": "sync_buffers",
}


def default_hooks(**overrides: Hook | None) -> dict[str, Hook]:
    """MMEngine's six default hooks by name; pass NAME=hook to replace, NAME=None to drop.

    Args:
        **overrides: hooks by default-hook name (``runtime_info``, ``timer``, ``sampler_seed``,
            ``logger``, ``param_scheduler``, ``checkpoint``); a hook replaces the default of that name
            (or is added under a new name), None drops it.

    Returns:
        The hooks by name, the defaults in the order above.
    """
    from expkit.hooks.checkpoint import CheckpointHook
    from expkit.hooks.iter_timer import IterTimerHook
    from expkit.hooks.logger import LoggerHook
    from expkit.hooks.param_scheduler import ParamSchedulerHook
    from expkit.hooks.runtime_info import RuntimeInfoHook
    from expkit.hooks.sampler_seed import DistSamplerSeedHook

    hooks: dict[str, Hook | None] = {
        "runtime_info": RuntimeInfoHook(),
        "timer": IterTimerHook(),
        "sampler_seed": DistSamplerSeedHook(),
        "logger": LoggerHook(),
        "param_scheduler": ParamSchedulerHook(),
        "checkpoint": CheckpointHook(interval=1),
    }
    hooks.update(overrides)
    return {name: hook for name, hook in hooks.items() if hook is not None}


__all__ = [
    "ActivationStatsHook",
    "CSVHook",
    "CheckpointHook",
    "DetectAnomalyHook",
    "DistSamplerSeedHook",
    "EMAHook",
    "EarlyStoppingHook",
    "EmptyCacheHook",
    "GradNormHook",
    "Hook",
    "InvalidLossError",
    "InvalidLossHook",
    "IterTimerHook",
    "LogPredictionsHook",
    "LoggerHook",
    "MemorySummaryHook",
    "ModelComplexityHook",
    "MomentumEncoderHook",
    "ParamSchedulerHook",
    "PerfStatsHook",
    "ProfilerHook",
    "RuntimeInfoHook",
    "StopAfterHook",
    "SyncBuffersHook",
    "default_hooks",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'expkit.hooks' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"expkit.hooks.{_LAZY[name]}"), name)
    globals()[name] = value  # (the next look-up is a plain module attribute)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
