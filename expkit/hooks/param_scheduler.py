"""ParamSchedulerHook: steps the learning-rate scheduler (LOW: after the logger read the lr)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from expkit.errors import ConfigError
from expkit.hooks.base import Hook
from expkit.stages import Priority

if TYPE_CHECKING:
    from expkit.runner import Runner

log = logging.getLogger("expkit")


class ParamSchedulerHook(Hook):
    """Steps ``runner.scheduler`` after each iteration (``scheduler_by_epoch=False``) or
    each complete epoch; ReduceLROnPlateau steps after validation on ``monitor``."""

    priority = Priority.LOW

    def __init__(self, monitor: str = "val/loss") -> None:
        self.monitor = monitor

    def before_run(self, runner: Runner) -> None:
        """ReduceLROnPlateau decays when `monitor` stops improving: its mode follows the run's
        direction of that metric (max for an accuracy, min for a loss), whatever its config said."""
        if runner.scheduler is None or not self._plateau(runner):
            return
        rule = runner.metric_rule(self.monitor, "default_hooks.param_scheduler.monitor")
        mode = "max" if rule == "greater" else "min"
        log.info("ReduceLROnPlateau mode %s for %s (%s is better)", mode, self.monitor, rule)
        if runner.scheduler.mode != mode:
            scheduler = runner.scheduler
            scheduler.mode = mode
            scheduler._init_is_better(mode=mode, threshold=scheduler.threshold, threshold_mode=scheduler.threshold_mode)
            scheduler._reset()

    def _plateau(self, runner: Runner) -> bool:
        return isinstance(runner.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        if runner.scheduler is not None and not runner.scheduler_by_epoch and not self._plateau(runner):
            runner.scheduler.step()

    def after_train_epoch(self, runner: Runner) -> None:
        if runner.scheduler is not None and runner.scheduler_by_epoch and runner.epoch_complete:
            if not self._plateau(runner):
                runner.scheduler.step()

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        if runner.scheduler is None or not self._plateau(runner):
            return
        if self.monitor not in metrics:
            raise ConfigError(
                f"ReduceLROnPlateau monitors {self.monitor!r}, which validation does not produce; "
                f"set default_hooks.param_scheduler.monitor to one of {sorted(metrics)}"
            )
        runner.scheduler.step(metrics[self.monitor])
