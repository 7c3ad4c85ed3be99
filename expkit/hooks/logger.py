"""LoggerHook: terminal log lines and ``metrics.jsonl`` (BELOW_NORMAL).

Every record carries ``step`` (training iterations completed: one monotonic axis for
train, val and test), ``epoch`` and ``iter``, and namespaced keys (``train/loss``,
``train/lr``, ``val/acc``, ``test/acc``).
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import IO, TYPE_CHECKING, Any

import torch

from expkit.hooks.base import Hook
from expkit.stages import Priority

if TYPE_CHECKING:
    from expkit.runner import Runner

log = logging.getLogger("expkit")


class LoggerHook(Hook):
    """Logs training every ``interval`` iterations and at the last iteration of each epoch,
    and every validation and test result."""

    priority = Priority.BELOW_NORMAL

    def __init__(self, interval: int = 10, filename: str = "metrics.jsonl") -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be a positive integer (iterations), got {interval!r}")
        self.interval = interval
        self.filename = filename
        self._file: IO[str] | None = None
        self._losses: list[torch.Tensor] = []

    # -- output ----------------------------------------------------------------------------
    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def before_run(self, runner: Runner) -> None:
        # append: a resumed run continues the same file
        self._file = open(runner.work_dir / self.filename, "a", encoding="utf-8")  # noqa: SIM115

    def after_run(self, runner: Runner) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- train -----------------------------------------------------------------------------
    def before_train(self, runner: Runner) -> None:
        self._max_iters = runner.max_iters  # computing it per iteration costs microseconds

    def before_train_epoch(self, runner: Runner) -> None:
        self._epoch_len = len(runner.train_loader) if hasattr(runner.train_loader, "__len__") else None  # type: ignore[arg-type]

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        self._losses.append(outputs["loss"].detach())  # read at the interval: no device sync per iteration
        last_of_epoch = batch_idx + 1 == self._epoch_len
        if (batch_idx + 1) % self.interval and not last_of_epoch and runner.iter + 1 != self._max_iters:
            return
        loss = torch.stack([x.detach().float() for x in self._losses]).mean().item()
        self._losses.clear()
        step = runner.iter + 1
        record: dict[str, Any] = {"step": step, "epoch": runner.epoch + 1, "iter": step, "train/loss": loss}
        if runner.optimizer is not None:
            record["train/lr"] = runner.optimizer.param_groups[0]["lr"]
        scalars = runner.scalars
        for key in ("train/time", "train/data_time"):
            if key in scalars:
                record[key] = scalars[key]
        if runner.extra_scalars:  # what other hooks published since the last record
            record.update(runner.extra_scalars)
            runner.extra_scalars.clear()
        self.write(record)
        s = runner.settings
        if s.by_epoch:
            width = len(str(self._epoch_len or 0))
            where = f"Epoch(train) [{runner.epoch + 1}/{s.max_epochs}][{batch_idx + 1:>{width}}/{self._epoch_len}]"
        else:
            where = f"Iter(train) [{step:>{len(str(s.max_iters))}}/{s.max_iters}]"
        parts = [where]
        if "train/lr" in record:
            parts.append(f"lr: {record['train/lr']:.4e}")
        if "eta_s" in scalars:
            parts.append(f"eta: {datetime.timedelta(seconds=int(scalars['eta_s']))}")
        if "train/time" in record:
            parts.append(f"time: {record['train/time']:.4f}  data_time: {record['train/data_time']:.4f}")
        parts.append(f"loss: {loss:.4f}")
        log.info("  ".join(parts))

    # -- val / test ------------------------------------------------------------------------
    def _log_eval(self, runner: Runner, mode: str, metrics: dict[str, float]) -> None:
        self.write({"step": runner.iter, "epoch": runner.epoch, "iter": runner.iter, **metrics})
        width = max(len(k) for k in metrics) if metrics else 0
        table = "\n".join(f"    {k:<{width}}  {v:.4f}" for k, v in metrics.items())
        where = f"epoch {runner.epoch}" if runner.settings.by_epoch else f"iter {runner.iter}"
        log.info("%s (%s):\n%s", "Validation" if mode == "val" else "Test", where, table)

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        self._log_eval(runner, "val", metrics)

    def after_test_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        self._log_eval(runner, "test", metrics)
