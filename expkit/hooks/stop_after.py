"""StopAfterHook: end training after a number of epochs, iterations or seconds (NORMAL)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["StopAfterHook"]

log = logging.getLogger("expkit")


class StopAfterHook(Hook):
    """Requests a stop once ``epochs`` epochs, ``iters`` iterations or ``minutes`` of training
    time are reached (whichever comes first; None: no limit). The stop saves a checkpoint,
    so a run given a time budget can be continued with ``resume=true``. Time already spent
    before a resume counts.

    Args:
        epochs: stop after this many complete epochs of the run (resumed ones included); None: no limit.
        iters: stop after this many iterations of the run (resumed ones included); None: no limit.
        minutes: stop after this much time since training started (validations included, time before a
            resume counted), checked after each iteration; None: no limit. A run that stopped on this budget
            and is resumed gets a new one (a time-boxed session, continued).

    Raises:
        ValueError: all three are None.
    """

    priority = Priority.NORMAL

    def __init__(self, epochs: int | None = None, iters: int | None = None, minutes: float | None = None) -> None:
        if epochs is None and iters is None and minutes is None:
            raise ValueError("set at least one of epochs, iters, minutes")
        self.epochs, self.iters, self.minutes = epochs, iters, minutes
        self.spent_s = 0.0
        self.timed_out = False  # this run stopped on its time budget (a resume then starts a new one)

    def before_train(self, runner: Runner) -> None:
        self._since = time.perf_counter()

    def _elapsed(self) -> float:
        return self.spent_s + time.perf_counter() - self._since

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        if self.iters is not None and runner.iter + 1 >= self.iters:
            runner.request_stop(f"stop_after: {self.iters} iterations")
        elif self.minutes is not None and self._elapsed() >= 60 * self.minutes:
            self.timed_out = True
            runner.request_stop(f"stop_after: {self.minutes} minutes of training")

    def after_train_epoch(self, runner: Runner) -> None:
        if self.epochs is not None and runner.epoch_complete and runner.epoch + 1 >= self.epochs:
            runner.request_stop(f"stop_after: {self.epochs} epochs")

    def state_dict(self) -> dict[str, Any]:
        return {"spent_s": self._elapsed() if hasattr(self, "_since") else self.spent_s, "timed_out": self.timed_out}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.spent_s = float(state.get("spent_s", 0.0))
        if state.get("timed_out") and self.minutes is not None:
            # the run stopped on its own time budget and is resumed (resume=true takes the run's
            # overrides, this hook's among them): a time-boxed session, continued, gets a new box;
            # a run cut short before its budget (preempted) keeps the time it spent
            log.info("stop_after: the run used its %s minutes; resumed, it gets another %s", self.minutes, self.minutes)
            self.spent_s = 0.0
