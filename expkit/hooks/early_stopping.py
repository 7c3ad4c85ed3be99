"""EarlyStoppingHook: stop when a validation metric stops improving (LOWEST: after the
checkpoint hook saved the best model of that validation)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from expkit.core.stages import Priority
from expkit.hooks.base import Hook
from expkit.metrics import RULES, better

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["EarlyStoppingHook"]


log = logging.getLogger("expkit")


class EarlyStoppingHook(Hook):
    """After each validation, in this order (MMEngine's):
    a non-finite ``monitor`` stops (``check_finite``); reaching ``stopping_threshold`` stops;
    an improvement smaller than ``min_delta`` counts toward ``patience`` validations, after
    which training stops; a larger one resets the count.

    ``rule``: greater/less, declared for the whole run; None asks the run's one direction
    rule (``metrics.<name>.higher_is_better``, the metric's own attribute, its name).
    ``monitor`` must be a metric validation reports (checked at start-up). ``strict``: a
    monitor missing from a validation's results is an error instead of a warning. ``min_delta`` defaults to 0 (MMEngine's
    code uses 0.1 and its docs 0.01; 0.1 is most of an accuracy's range).

    Args:
        monitor: the metric key to watch, e.g. ``val/acc``; it must be one validation reports.
        rule: ``greater`` or ``less`` (which direction is better), declared for the whole run; None: the
            run's direction rule decides.
        min_delta: the margin by which a value must beat the best so far to count as an improvement.
        patience: the validations in a row without an improvement after which training stops; at least 1.
        strict: True: a validation whose results lack `monitor` raises a KeyError; False: it is skipped
            with a warning.
        check_finite: stop as soon as `monitor` is NaN or infinite.
        stopping_threshold: stop as soon as `monitor` reaches this value (equals it or is better under
            the rule); None: no threshold.

    Raises:
        ValueError: `rule` is not ``greater``, ``less`` or None, `patience` is below 1 or `min_delta`
            is negative.
    """

    priority = Priority.LOWEST

    def __init__(
        self,
        monitor: str = "val/loss",
        rule: str | None = None,
        min_delta: float = 0.0,
        patience: int = 5,
        strict: bool = False,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
    ) -> None:
        if rule is not None and rule not in RULES:
            raise ValueError(f"rule must be 'greater', 'less' or null, got {rule!r}")
        if patience < 1 or min_delta < 0:
            raise ValueError("patience must be >= 1 and min_delta >= 0")
        self.monitor, self.rule, self.min_delta, self.patience = monitor, rule, min_delta, patience
        self.strict, self.check_finite, self.stopping_threshold = strict, check_finite, stopping_threshold
        self.best_score: float | None = None  # none yet: the first finite value improves
        self.wait_count = 0
        # (kind, reason) once it stopped training: "patience", or "final" (a non-finite value, the threshold)
        self.stopped: tuple[str, str] | None = None

    def before_run(self, runner: Runner) -> None:
        self.rule = runner.metric_rule(self.monitor, "hooks.early_stopping.monitor", self.rule)

    def before_train(self, runner: Runner) -> None:
        """A run resumed from the checkpoint of the validation that stopped it stops again before
        training: ``resume=true`` on an early-stopped run (a job script that always passes it) trained
        one more epoch each time. A larger ``patience`` than the count reached lets it train on."""
        if self.stopped is None:
            return
        kind, reason = self.stopped
        if kind == "final" or self.wait_count >= self.patience:
            runner.request_stop(f"{reason}; resumed after it")
        else:
            self.stopped = None

    def _stop(self, runner: Runner, kind: str, reason: str) -> None:
        self.stopped = (kind, reason)
        runner.request_stop(reason)

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:
            message = f"early stopping monitors {self.monitor!r}, not among {sorted(metrics)}"
            if self.strict:
                raise KeyError(message)
            log.warning("%s; skipped", message)
            return
        score = metrics[self.monitor]
        where = f"epoch {runner.epoch}" if runner.settings.by_epoch else f"iteration {runner.iter}"
        if self.check_finite and not math.isfinite(score):
            self._stop(runner, "final", f"early stopping: {self.monitor} is {score} at {where}")
        elif self.stopping_threshold is not None and not better(self.stopping_threshold, score, self.rule):
            self.best_score = score
            self._stop(runner, "final", f"early stopping: {self.monitor}={score:.4f} reached {self.stopping_threshold}")
        elif self.best_score is not None and not better(score, self.best_score, self.rule, self.min_delta):
            self.wait_count += 1
            if self.wait_count >= self.patience:
                self._stop(
                    runner,
                    "patience",
                    f"early stopping: {self.monitor} did not improve on {self.best_score:.4g} by more than "
                    f"{self.min_delta} for {self.patience} validations (at {where})",
                )
        else:
            self.best_score, self.wait_count = score, 0

    def state_dict(self) -> dict[str, Any]:
        return {"best_score": self.best_score, "wait_count": self.wait_count, "stopped": self.stopped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        best = state["best_score"]
        self.best_score = None if best is None or not math.isfinite(best) else float(best)
        self.wait_count = int(state["wait_count"])
        stopped = state.get("stopped")  # (a checkpoint of an earlier version has none)
        valid = isinstance(stopped, (list, tuple)) and len(stopped) == 2 and all(isinstance(x, str) for x in stopped)
        self.stopped = (stopped[0], stopped[1]) if valid else None  # type: ignore[index]
