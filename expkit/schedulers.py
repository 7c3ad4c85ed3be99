"""Learning-rate schedules that need the run's length (config/build.py passes it in)."""

from __future__ import annotations

import math

import torch

__all__ = ["warmup_cosine"]


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    warmup_fraction: float = 0.0,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from 0, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``.

    Steps are whatever the scheduler is stepped on (iterations with ``sched.by_epoch=false``).
    ``warmup_fraction`` of ``total_steps`` is used when ``warmup_steps`` is 0.

    Args:
        optimizer: the optimizer whose learning rates are scheduled.
        total_steps: the length of the run, in scheduler steps.
        warmup_steps: the steps of linear warm-up; 0 takes `warmup_fraction` of `total_steps`.
        warmup_fraction: the share of `total_steps` to warm up for when `warmup_steps` is 0.
        min_lr_ratio: the learning rate at the end of the decay, as a fraction of the initial one.

    Returns:
        A ``LambdaLR`` that multiplies each parameter group's initial learning rate by the schedule.

    Raises:
        ValueError: when the warm-up is negative or not shorter than `total_steps`.
    """
    warmup = warmup_steps or int(warmup_fraction * total_steps)
    if not 0 <= warmup < total_steps:
        raise ValueError(f"warm-up ({warmup} steps) must be shorter than the run ({total_steps} steps)")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
