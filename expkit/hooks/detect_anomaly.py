"""DetectAnomalyHook: autograd anomaly detection during training (HIGHEST)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["DetectAnomalyHook"]


class DetectAnomalyHook(Hook):
    """Turns on ``torch.autograd.set_detect_anomaly`` for training: a backward pass that
    produces NaN fails with the forward operation that caused it. Slows training several
    times over: for debugging only.

    Args:
        check_nan: passed to ``set_detect_anomaly``: True fails on the first backward pass that produces
            NaN; False keeps anomaly mode (the forward traceback in backward errors) without that check.
    """

    priority = Priority.HIGHEST

    def __init__(self, check_nan: bool = True) -> None:
        self.check_nan = check_nan
        self._previous: bool | None = None

    def before_train(self, runner: Runner) -> None:
        self._previous = torch.is_anomaly_enabled()
        torch.autograd.set_detect_anomaly(True, check_nan=self.check_nan)

    def _restore(self) -> None:
        if self._previous is not None:
            torch.autograd.set_detect_anomaly(self._previous)
            self._previous = None

    def after_train(self, runner: Runner) -> None:
        self._restore()

    def after_run(self, runner: Runner) -> None:
        self._restore()
