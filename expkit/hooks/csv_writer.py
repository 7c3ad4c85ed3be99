"""CSVHook: one row per epoch of chosen variables in ``<work dir>/metrics.csv`` (BELOW_NORMAL)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any

import torch

from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["CSVHook"]


class CSVHook(Hook):
    """emloop's WriteCSV: columns ``epoch``, ``step`` and ``variables`` (``train/loss`` is the
    epoch's mean training loss; others are the last validation's metrics, empty when that
    epoch did not validate). Rows are appended, so a resumed run continues the file.

    Args:
        variables: the columns after ``epoch`` and ``step``, in order: ``train/loss``, or a key of the
            metrics validation reports (``val/acc``, ...); a key validation does not report stays empty.
        filename: the file's path relative to the work dir; the header is written only when the file
            is new. Only the main process writes it.
    """

    priority = Priority.BELOW_NORMAL

    def __init__(self, variables: Sequence[str] = ("train/loss", "val/loss", "val/acc"), filename: str = "metrics.csv"):
        self.variables = list(variables)
        self.filename = filename
        self._row: dict[str, Any] | None = None
        self._losses: list[torch.Tensor] = []
        self._file: IO[str] | None = None

    def before_run(self, runner: Runner) -> None:
        if not runner.is_main:  # under DDP, rank 0 writes
            return
        path = runner.work_dir / self.filename
        new = not path.exists()
        self._file = open(path, "a", newline="", encoding="utf-8")  # noqa: SIM115
        self._writer = csv.DictWriter(self._file, fieldnames=["epoch", "step", *self.variables], extrasaction="ignore")
        if new:
            self._writer.writeheader()

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        self._losses.append(outputs["loss"].detach())

    def after_train_epoch(self, runner: Runner) -> None:
        self._flush()
        loss = float(torch.stack(self._losses).float().mean()) if self._losses else None
        self._losses.clear()
        self._row = {"epoch": runner.epoch + 1, "step": runner.iter, "train/loss": loss}

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        if self._row is not None:
            self._row.update(metrics)

    def _flush(self) -> None:
        if self._row is not None and self._file is not None:
            self._writer.writerow(self._row)
            self._file.flush()
            self._row = None

    def after_train(self, runner: Runner) -> None:
        self._flush()

    def after_run(self, runner: Runner) -> None:
        self._flush()
        if self._file is not None:
            self._file.close()
            self._file = None
