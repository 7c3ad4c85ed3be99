"""TimeLimitHook: save and stop before the job's time limit, to be requeued (VERY_LOW)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["TimeLimitHook"]


log = logging.getLogger("expkit")


class TimeLimitHook(Hook):
    """Stops the run, to be continued, once the job's end is nearer than the longest iteration
    seen so far, the longest save and ``margin_s`` together: the checkpoint hook then saves
    while there is time for it, before the scheduler's warning signal or its kill, and the
    command requeues the job (``runner.requeue``). The Runner registers it under Slurm when
    ``trainer.save_before_limit`` is on and the job has a time limit; it costs one clock read
    an iteration and asks the scheduler nothing after it was made.

    The longest iteration is measured from the end of one iteration to the end of the next, so
    a validation or a periodic save between them counts: the stop must leave room for whatever
    may come before the next chance to stop.

    Args:
        end_time: when the job ends, as ``time.time()`` seconds (Slurm's ``EndTime``).
        margin_s: seconds kept free on top of the longest iteration and save (the last records,
            the requeue, the clocks of two machines).
        what: the limit's name in the stop reason and the log.
    """

    priority = Priority.VERY_LOW  # (after the hooks that may stop first for a reason of their own)

    def __init__(self, end_time: float, margin_s: float = 60, what: str = "the job's time limit") -> None:
        # the wall clock read once, then the monotonic one: a clock step (NTP) moves no deadline
        self.deadline = time.monotonic() + (end_time - time.time())
        self.margin_s = margin_s
        self.what = what
        self.longest_iter_s = 0.0
        self.longest_save_s = 0.0
        self._last_iter_end: float | None = None
        self._save_began: float | None = None

    def seconds_left(self) -> float:
        """Seconds until the job's end.

        Returns:
            The time left, negative once the end has passed.
        """
        return self.deadline - time.monotonic()

    def before_train(self, runner: Runner) -> None:
        self._last_iter_end = time.monotonic()
        left = self.seconds_left()
        if left < 2 * self.margin_s:
            log.warning(
                "%s is %.0f s away, less than twice trainer.limit_margin_s=%s: save_before_limit may stop this "
                "run after every few iterations; give the job more time or a smaller margin",
                self.what[0].upper() + self.what[1:],
                left,
                self.margin_s,
            )

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        now = time.monotonic()
        if self._last_iter_end is not None and now - self._last_iter_end > self.longest_iter_s:
            self.longest_iter_s = now - self._last_iter_end
        self._last_iter_end = now
        left = self.deadline - now
        if left <= self.longest_iter_s + self.longest_save_s + self.margin_s:
            runner.requeue = runner.requeue or runner.stop_reason is None
            runner.request_stop(
                f"interrupted: {max(left, 0.0):.0f} s before {self.what}, saved ahead of it (trainer.save_before_limit; "
                f"longest iteration {self.longest_iter_s:.1f} s, save {self.longest_save_s:.1f} s)",
                resumable=True,
            )

    def before_save_checkpoint(self, runner: Runner, *, checkpoint: dict[str, Any]) -> None:
        self._save_began = time.monotonic()

    def after_save_checkpoint(self, runner: Runner, *, path: Any, is_best: bool, metric: str | None) -> None:
        if self._save_began is not None:
            self.longest_save_s = max(self.longest_save_s, time.monotonic() - self._save_began)
            self._save_began = None
