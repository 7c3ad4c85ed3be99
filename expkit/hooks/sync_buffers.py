"""SyncBuffersHook: average the model's buffers over all processes (NORMAL)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["SyncBuffersHook", "sync_buffers"]


def sync_buffers(module: torch.nn.Module) -> int:
    """All-reduce (mean) every floating-point buffer, e.g. BatchNorm running statistics.
    Returns how many were averaged; 0 outside a distributed run.

    Args:
        module: the module whose buffers are averaged in place; every rank must call this.

    Returns:
        The number of floating-point buffers averaged; 0 when no process group of more than one
        process is joined.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    world = dist.get_world_size()
    for buffer in buffers:
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        buffer.div_(world)
    return len(buffers)


class SyncBuffersHook(Hook):
    """After each train epoch (and before validation in iteration-based runs), every process
    holds the same buffers, so validation and checkpoints see one set of statistics."""

    priority = Priority.NORMAL

    def __init__(self) -> None:
        self._synced_at: int | None = None

    def after_train_epoch(self, runner: Runner) -> None:
        sync_buffers(runner.model)
        self._synced_at = runner.iter

    def before_val_epoch(self, runner: Runner) -> None:
        if self._synced_at != runner.iter:
            sync_buffers(runner.model)
            self._synced_at = runner.iter
