"""IterTimerHook: data time, iteration time and ETA of training (NORMAL)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["IterTimerHook"]


class IterTimerHook(Hook):
    """Publishes ``train/data_time`` and ``train/time`` (seconds, smoothed over about
    ``1/smoothing`` iterations) and ``eta_s`` in ``runner.scalars`` each iteration.

    Args:
        smoothing: the weight of the newest iteration in the exponential averages of the times, in
            (0, 1]; 1: no smoothing. The ETA uses the plain mean since the start (or resume) instead.

    Raises:
        ValueError: `smoothing` is not in (0, 1].
    """

    priority = Priority.NORMAL

    def __init__(self, smoothing: float = 0.1) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self._t = 0.0
        self._avg_time: float | None = None
        self._avg_data: float | None = None

    def state_dict(self) -> dict[str, Any]:
        """The smoothed times, so the ETA right after a resume is not a guess."""
        return {"avg_time": self._avg_time, "avg_data": self._avg_data}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._avg_time, self._avg_data = state.get("avg_time"), state.get("avg_data")

    def before_train(self, runner: Runner) -> None:
        self._max_iters = runner.max_iters  # len(loader) per iteration would cost microseconds
        self._start_iter = runner.iter
        self._start_time = time.perf_counter()

    def before_train_epoch(self, runner: Runner) -> None:
        self._t = time.perf_counter()

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        """Data time: from the end of the last iteration until the batch was ready (the loop
        stamps ``runner.batch_ready_s``: a clock read there costs less than a hook call)."""
        now = time.perf_counter()
        data_time, iter_time = runner.batch_ready_s - self._t, now - self._t
        self._t = now
        a, d = self._avg_time, self._avg_data
        self._avg_time = iter_time if a is None else a + self.smoothing * (iter_time - a)
        self._avg_data = data_time if d is None else d + self.smoothing * (data_time - d)
        scalars = runner.scalars
        scalars["train/time"] = self._avg_time
        scalars["train/data_time"] = self._avg_data  # type: ignore[assignment]
        done = runner.iter + 1 - self._start_iter
        scalars["eta_s"] = (now - self._start_time) / done * (self._max_iters - runner.iter - 1)
