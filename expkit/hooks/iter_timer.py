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
    """Publishes ``train/data_time`` and ``train/time`` (seconds an iteration, smoothed over about
    ``1/smoothing`` iterations) and ``eta_s`` in ``runner.scalars`` at each logging step (the
    logger's interval, each epoch's last iteration, the run's last): from the iterations since
    the previous one, which ``runner.train_window`` counts, so the iterations in between call no
    hook (MMEngine's timer runs every iteration for values read at the interval only).

    Args:
        smoothing: the weight of the newest iteration in the exponential averages of the times, in
            (0, 1]; 1: no smoothing (the mean of the iterations since the last logging step). The
            ETA uses the plain mean since the start (or resume) instead.

    Raises:
        ValueError: `smoothing` is not in (0, 1].
    """

    priority = Priority.NORMAL
    log_steps_only = True

    def __init__(self, smoothing: float = 0.1) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
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

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        """The iterations of the window (since the last logging step, or the epoch's start): their
        mean wall time, and their mean data time, from the end of each one's predecessor until its
        batch was ready (the loop stamps it: a clock read there costs less than a hook call)."""
        window = runner.train_window
        # at a logging step the loop stamped the window's end just before the hooks: back to back
        # with the next window (a timer called between logging steps reads the clock)
        now = window.step_s if window.step_s > window.start_s else time.perf_counter()
        n = window.iters - window.start_iters
        if n <= 0:
            return
        iter_time, data_time = (now - window.start_s) / n, (window.data_s - window.start_data_s) / n
        a, d = self._avg_time, self._avg_data
        weight = 1 - (1 - self.smoothing) ** n  # n iterations' worth of smoothing at once
        self._avg_time = iter_time if a is None else a + weight * (iter_time - a)
        self._avg_data = data_time if d is None else d + weight * (data_time - d)
        scalars = runner.scalars
        scalars["train/time"] = self._avg_time
        scalars["train/data_time"] = self._avg_data  # type: ignore[assignment]
        done = runner.iter + 1 - self._start_iter
        scalars["eta_s"] = (now - self._start_time) / done * (self._max_iters - runner.iter - 1)
