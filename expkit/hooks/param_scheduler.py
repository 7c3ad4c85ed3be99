"""ParamSchedulerHook: steps the learning-rate scheduler (LOW: after the logger read the lr)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch.optim.lr_scheduler import ReduceLROnPlateau

from expkit.core.errors import ConfigError
from expkit.core.stages import Priority, Stage
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["ParamSchedulerHook"]


log = logging.getLogger("expkit")


def _plateaus(runner: Runner) -> list[ReduceLROnPlateau]:
    return [s for s in runner.schedulers.values() if isinstance(s, ReduceLROnPlateau)]


def _step_all(runner: Runner) -> None:
    """Step every scheduler but ReduceLROnPlateau (stepped on a metric after validation)."""
    for scheduler in runner.schedulers.values():
        if not isinstance(scheduler, ReduceLROnPlateau):
            scheduler.step()


class ParamSchedulerHook(Hook):
    """Steps the run's schedulers (``runner.schedulers``: one per optimizer) after each
    iteration (``scheduler_by_epoch=False``) or each complete epoch; ReduceLROnPlateau steps
    after validation on ``monitor``.

    Args:
        monitor: the validation metric a ReduceLROnPlateau scheduler steps on; its mode (max or min)
            follows the run's direction of this metric. Unused without ReduceLROnPlateau; with one, a
            validation that does not report it raises a ConfigError.
    """

    priority = Priority.LOW

    def __init__(self, monitor: str = "val/loss") -> None:
        self.monitor = monitor

    def before_run(self, runner: Runner) -> None:
        """ReduceLROnPlateau decays when `monitor` stops improving: its mode follows the run's
        direction of that metric (max for an accuracy, min for a loss), whatever its config said."""
        if runner.scheduler_by_epoch and type(self).after_train_iter is ParamSchedulerHook.after_train_iter:
            runner.hook_table.mute(self, Stage.AFTER_TRAIN_ITER)  # nothing to step per iteration
        plateaus = _plateaus(runner)
        if not plateaus:
            return
        rule = runner.metric_rule(self.monitor, "default_hooks.param_scheduler.monitor")
        mode = "max" if rule == "greater" else "min"
        log.info("ReduceLROnPlateau mode %s for %s (%s is better)", mode, self.monitor, rule)
        for scheduler in plateaus:
            if scheduler.mode != mode:
                scheduler.mode = mode
                scheduler._init_is_better(
                    mode=mode, threshold=scheduler.threshold, threshold_mode=scheduler.threshold_mode
                )
                scheduler._reset()

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        if not runner.scheduler_by_epoch:
            _step_all(runner)

    def after_train_epoch(self, runner: Runner) -> None:
        if runner.scheduler_by_epoch and runner.epoch_complete:
            _step_all(runner)

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        plateaus = _plateaus(runner)
        if not plateaus:
            return
        if self.monitor not in metrics:
            raise ConfigError(
                f"ReduceLROnPlateau monitors {self.monitor!r}, which validation does not produce; "
                f"set default_hooks.param_scheduler.monitor to one of {sorted(metrics)}"
            )
        for scheduler in plateaus:
            scheduler.step(metrics[self.monitor])
