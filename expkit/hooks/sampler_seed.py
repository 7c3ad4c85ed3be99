"""DistSamplerSeedHook: gives the sampler the epoch, so each epoch has its own order (NORMAL)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["DistSamplerSeedHook"]


class DistSamplerSeedHook(Hook):
    """Calls ``set_epoch(runner.epoch)`` on the train sampler (or the batch sampler's).

    The order then depends on (seed, epoch) only, so a resumed run sees the same batches
    as an uninterrupted one, and DistributedSampler shuffles differently each epoch.
    """

    priority = Priority.NORMAL

    def before_train_epoch(self, runner: Runner) -> None:
        loader = runner.train_loader
        sampler = getattr(loader, "sampler", None)
        if not hasattr(sampler, "set_epoch"):
            sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(runner.epoch)  # type: ignore[union-attr]
