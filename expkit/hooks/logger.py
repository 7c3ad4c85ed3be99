"""LoggerHook: terminal, ``metrics.jsonl``, the logging backends and a learning-curve plot (BELOW_NORMAL).

Every record carries ``step`` (training iterations completed: one monotonic axis for
train, val and test, on every backend), ``epoch`` and ``iter``, and namespaced keys
(``train/loss``, ``train/lr``, ``val/acc``, ``test/acc``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from expkit.core.atomic import write_text_atomic
from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner
    from expkit.engine.state import TrainWindow
    from expkit.loggers.backends import Backend

__all__ = ["LoggerHook", "plot_curves"]


log = logging.getLogger("expkit")


class _HideTrainLines(logging.Filter):
    """On a terminal the progress line replaces the periodic training lines (train.log keeps them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "train_line", False)


def _terminal_handlers() -> list[logging.StreamHandler]:
    handlers = []
    for logger in (logging.getLogger(), log):
        for h in logger.handlers:
            if (
                type(h) is logging.StreamHandler
                and h.level <= logging.INFO
                and getattr(h.stream, "isatty", lambda: False)()
            ):
                handlers.append(h)
    return handlers


class LoggerHook(Hook):
    """Logs training every ``interval`` iterations and at the last iteration of each epoch,
    and every validation and test result, to metrics.jsonl, the terminal and the backends
    of ``runner.loggers``. ``progress``: a live progress line when the output is a terminal
    (``auto``), plain lines otherwise. ``plot``: ``curves.svg`` in the work dir at the end (no matplotlib needed).
    ``flush_secs``: training records are written out to metrics.jsonl with the first record
    that comes this many seconds after the last write, at the end of every epoch and before
    every validation; val/test records at once; everything before every checkpoint and at the
    end (a write per record costs a system call; a kill loses only records after the last
    checkpoint, which a resume drops anyway).

    Args:
        interval: the iterations between training records, counted within the epoch; the last
            iteration of each epoch and of the run is always logged. A record's ``train/loss`` is the
            mean over the iterations since the previous record.
        filename: the records file, relative to the work dir; appended to, so a resumed run continues
            it. ``expkit.check``, sweeps and the summaries read ``metrics.jsonl``.
        progress: ``auto``: a live progress line on the log's handlers that write to a terminal (none
            when the output is not a terminal); True: the same, falling back to the root logger's plain
            stream handlers when none writes to a terminal; False: plain lines only. With a progress
            line, those handlers hide the periodic training lines (``train.log`` keeps them).
        plot: write ``curves.svg`` (loss and metrics against the step) into the work dir at the end.
        flush_secs: the most seconds a training record may wait in the buffer before it is written
            out (checked when the next record comes); 0: every record is written at once.

    Raises:
        ValueError: `interval` is not a positive integer, `flush_secs` is not a number >= 0, or
            `progress` is not ``auto``, True or False.
    """

    priority = Priority.BELOW_NORMAL
    log_steps_only = True  # called at logging steps only: runner.train_window has the losses in between

    def __init__(
        self,
        interval: int = 10,
        filename: str = "metrics.jsonl",
        progress: str | bool = "auto",
        plot: bool = True,
        flush_secs: float = 1.0,
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be a positive integer (iterations), got {interval!r}")
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) or flush_secs < 0:
            raise ValueError(f"flush_secs must be a number of seconds >= 0, got {flush_secs!r}")
        if progress not in ("auto", True, False):
            raise ValueError(f"progress must be auto, true or false, got {progress!r}")
        self.interval = interval
        self.filename = filename
        self.progress = progress
        self.plot = plot
        self.flush_secs = flush_secs
        self._flushed = 0.0  # time.monotonic() of the last write to disk
        self._file: IO[str] | None = None
        self._losses: list[torch.Tensor] = []
        self._window: TrainWindow | None = None  # runner.train_window, from before_train on
        self._seen: int | None = None  # runner.train_window.iters when last taken (None: not yet)
        self._logged: dict[str, list[Any]] = {}  # a model's own train scalars (outputs["log"]) since the last record
        self._backends: list[Backend] = []
        self._tty: list[logging.StreamHandler] = []
        self._filter = _HideTrainLines()

    @property
    def log_step_interval(self) -> int:  # type: ignore[override]
        """``interval``: the logging steps include this logger's."""
        return self.interval

    # -- output ----------------------------------------------------------------------------
    def _safely(self, backend: Backend, what: str, *args: Any) -> None:
        try:
            getattr(backend, what)(*args)
        except Exception as exc:  # one warning, then the run goes on without it
            log.warning(
                "Logging backend %s failed in %s (%s: %s); it is off for the rest of this run. "
                "metrics.jsonl and checkpoints are not affected.",
                backend.name,
                what,
                type(exc).__name__,
                exc,
            )
            if backend in self._backends:
                self._backends.remove(backend)
            try:
                backend.close()
            except Exception:  # noqa: S110 - it already failed once; one warning is enough
                pass

    def write(self, record: dict[str, Any], flush: bool = False) -> None:
        """Append `record` to metrics.jsonl (written out now with `flush`, else within
        ``flush_secs``) and send its scalars to every backend."""
        if self._file is not None:
            try:
                self._file.write(json.dumps(record) + "\n")
            except OSError as exc:
                raise self._named(exc) from None
            if flush or time.monotonic() - self._flushed >= self.flush_secs:
                self.flush()
        for backend in list(self._backends):
            self._safely(backend, "log", record, record["step"])

    def flush(self) -> None:
        """Write metrics.jsonl's pending records out."""
        if self._file is not None:
            try:
                self._file.flush()
            except OSError as exc:
                raise self._named(exc) from None
            self._flushed = time.monotonic()

    def _named(self, exc: OSError) -> OSError:
        """The error naming the file and the cause (a full disk, most often)."""
        return OSError(exc.errno, f"could not append to {self._file.name}: {exc.strerror}")  # type: ignore[union-attr]

    # -- state: the losses of a log interval not yet written, so a resumed record averages the same ones --
    def state_dict(self) -> dict[str, Any]:
        self._take_window()  # (a checkpoint between logging steps: the losses since the last one)
        if not self._losses and not self._logged:
            return {}
        return {
            "pending_losses": [float(x) for x in self._losses],
            "pending_logged": {k: [float(v) for v in vs] for k, vs in self._logged.items()},
        }

    def _take_window(self) -> None:
        """Add the iterations of ``runner.train_window`` this logger has not seen to the pending ones."""
        window = self._window
        if window is None or window.iters == self._seen:
            return
        self._losses.extend(window.new_losses(self._seen))
        for index, logged in window.logged:
            if self._seen is None or index >= self._seen:
                for key, value in logged.items():  # (detached by the loop)
                    self._logged.setdefault(key, []).append(value)
        self._seen = window.iters

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._losses = [torch.tensor(x, dtype=torch.float32) for x in state.get("pending_losses", [])]
        self._logged = {k: list(vs) for k, vs in state.get("pending_logged", {}).items()}

    def before_save_checkpoint(self, runner: Runner, *, checkpoint: dict[str, Any]) -> None:
        """What is logged up to a checkpoint is on disk before the checkpoint exists: a run
        killed later resumes from it with every record up to its step (metrics.jsonl and
        TensorBoard buffer records for up to their flush_secs)."""
        self.flush()
        for backend in list(self._backends):
            self._safely(backend, "flush")

    def after_load_checkpoint(self, runner: Runner, *, checkpoint: dict[str, Any]) -> None:
        """Resuming: what an earlier attempt recorded after this checkpoint is void, so the logs
        read as one uninterrupted run."""
        if runner.load_purpose == "resume":
            self._void_after(runner, int(checkpoint["meta"]["iter"]))

    def _void_after(self, runner: Runner, step: int) -> None:
        """metrics.jsonl keeps the records up to `step` (test records come only at a run's end:
        all are dropped); each backend voids `step` and later, then gets the kept records of
        `step` again (an earlier attempt may have logged test records at that step too)."""
        if self._file is None:
            return
        kept: list[tuple[str, dict[str, Any]]] = []
        if self._file.tell():  # (an empty file, as a new run's, has nothing to void)
            path = runner.work_dir / self.filename
            self._file.close()
            dropped = 0
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut by the kill
                    dropped += 1
                    continue
                if record.get("step", 0) <= step and not any(k.startswith("test/") for k in record):
                    kept.append((line, record))
                else:
                    dropped += 1
            write_text_atomic(path, "".join(line + "\n" for line, _ in kept))
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in after_run
            if dropped:
                log.info(
                    "Resuming at step %d: dropped %d record%s of %s written after it",
                    step,
                    dropped,
                    "" if dropped == 1 else "s",
                    self.filename,
                )
        for backend in list(self._backends):
            self._safely(backend, "resume", step)
            for _, record in kept:
                if record.get("step") == step:
                    self._safely(backend, "log", record, step)

    def before_run(self, runner: Runner) -> None:
        if not runner.is_main:  # under DDP, rank 0 writes the files and the backends
            self.plot = False
            return
        # append: a resumed run continues the same file
        self._file = open(runner.work_dir / self.filename, "a", encoding="utf-8")  # noqa: SIM115
        self._backends = list(runner.loggers.values())
        for backend in list(self._backends):
            self._safely(backend, "open", runner)
        if self.progress is not False:
            self._tty = _terminal_handlers()
            if self.progress is True and not self._tty:
                self._tty = [h for h in logging.getLogger().handlers if type(h) is logging.StreamHandler]
            for h in self._tty:
                h.addFilter(self._filter)

    def after_run(self, runner: Runner) -> None:
        self._clear_progress()
        for h in self._tty:
            h.removeFilter(self._filter)
        self._tty = []
        try:
            if self._file is not None:  # curves.svg first: a backend may store it (MLflow's artifacts)
                try:
                    self.flush()  # (the last records: a full disk shows here, the file named)
                finally:
                    file, self._file = self._file, None
                    with contextlib.suppress(OSError):  # (what flush could not write, close cannot either)
                        file.close()
                if self.plot:
                    plot_curves(runner.work_dir / self.filename, runner.work_dir / "curves.svg")
        finally:  # the backends finish however the file ended
            result = {"status": runner.status, "final_metrics": {**runner.val_metrics, **runner.test_metrics}}
            for backend in list(self._backends):
                self._safely(backend, "finish", runner, result)
                self._safely(backend, "close")
            self._backends = []

    def before_val(self, runner: Runner) -> None:
        """A validation can take a while: the training records so far are written out first."""
        self.flush()

    # -- train -----------------------------------------------------------------------------
    def before_train(self, runner: Runner) -> None:
        if not runner.resuming:  # training starts at step 0 (a new run, or resume=true before any checkpoint)
            self._void_after(runner, 0)
        self._max_iters = runner.max_iters  # computing it per iteration costs microseconds
        self._window = runner.train_window
        self._seen = None  # (a second training in this process starts a new window)
        self._batch_size = getattr(runner.train_loader, "batch_size", None) or 0

    def before_train_epoch(self, runner: Runner) -> None:
        self._epoch_len = runner.steps_per_epoch  # iterations (optimizer steps), not batches

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        """At logging steps (the loop calls it there only): the losses and a model's own scalars
        (``outputs["log"]``: train/<key>) since the last one come from ``runner.train_window``,
        still on their device: read here, at the interval, so no iteration waits for the device."""
        self._take_window()
        last_of_epoch = batch_idx + 1 == self._epoch_len
        if (batch_idx + 1) % self.interval and not last_of_epoch and runner.iter + 1 != self._max_iters:
            return
        loss = torch.stack(self._losses).float().mean().item()
        self._losses.clear()
        step = runner.iter + 1
        record: dict[str, Any] = {"step": step, "epoch": runner.epoch + 1, "iter": step, "train/loss": loss}
        for key, values in self._logged.items():
            record[f"train/{key}"] = float(
                torch.stack([torch.as_tensor(v, dtype=torch.float32) for v in values]).mean()
            )
        self._logged.clear()
        if runner.optimizer is not None:
            record["train/lr"] = runner.optimizer.param_groups[0]["lr"]
            several = len(runner.optimizers) > 1
            for name, optimizer in runner.optimizers.items():  # each optimizer's, each group's (by name)
                groups = optimizer.param_groups
                prefix = f"train/lr/{name}" if several else "train/lr"
                if several:
                    record[prefix] = groups[0]["lr"]
                if len(groups) > 1:
                    record.update({f"{prefix}/{g.get('name', i)}": g["lr"] for i, g in enumerate(groups)})
        scalars = runner.scalars
        for key in ("train/time", "train/data_time"):
            if key in scalars:
                record[key] = scalars[key]
        if runner.extra_scalars:  # what other hooks published since the last record
            record.update(runner.extra_scalars)
            runner.extra_scalars.clear()
        self.write(record, flush=last_of_epoch)
        if log.isEnabledFor(logging.INFO):  # (not formatted for nobody: a run from Python with logging off)
            log.info(self._line(runner, record, batch_idx), extra={"train_line": True})
        if self._tty:
            self._draw_progress(runner, record, batch_idx)

    def _line(self, runner: Runner, record: dict[str, Any], batch_idx: int) -> str:
        s = runner.settings
        if s.by_epoch:
            width = len(str(self._epoch_len or 0))
            where = f"Epoch(train) [{runner.epoch + 1}/{s.max_epochs}][{batch_idx + 1:>{width}}/{self._epoch_len}]"
        else:
            where = f"Iter(train) [{record['step']:>{len(str(s.max_iters))}}/{s.max_iters}]"
        parts = [where]
        if "train/lr" in record:
            parts.append(f"lr: {record['train/lr']:.4e}")
        if "eta_s" in runner.scalars:
            parts.append(f"eta: {datetime.timedelta(seconds=int(runner.scalars['eta_s']))}")
        if "train/time" in record:
            parts.append(f"time: {record['train/time']:.4f}  data_time: {record['train/data_time']:.4f}")
        parts.append(f"loss: {record['train/loss']:.4f}")
        return "  ".join(parts)

    # -- the live progress line (terminals only) --------------------------------------------
    def _draw_progress(self, runner: Runner, record: dict[str, Any], batch_idx: int) -> None:
        done, total = record["step"], self._max_iters
        width = 24
        filled = int(width * done / max(total, 1))
        bar = "#" * filled + "-" * (width - filled)
        where = f"epoch {runner.epoch + 1}/{runner.settings.max_epochs}" if runner.settings.by_epoch else "iter"
        speed = self._batch_size / record["train/time"] if record.get("train/time") else 0.0
        eta = datetime.timedelta(seconds=int(runner.scalars.get("eta_s", 0)))
        text = (
            f"\r\x1b[K{where} [{bar}] {done}/{total}  loss {record['train/loss']:.4f}  "
            f"lr {record.get('train/lr', 0):.2e}  {speed:,.0f} samples/s  eta {eta}"
        )
        for h in self._tty:
            h.stream.write(text)
            h.stream.flush()

    def _clear_progress(self) -> None:
        for h in self._tty:
            h.stream.write("\r\x1b[K")
            h.stream.flush()

    # -- val / test ------------------------------------------------------------------------
    def _log_eval(self, runner: Runner, mode: str, metrics: dict[str, float]) -> None:
        self.write({"step": runner.iter, "epoch": runner.epoch, "iter": runner.iter, **metrics}, flush=True)
        self._clear_progress()
        if not log.isEnabledFor(logging.INFO):
            return
        width = max(len(k) for k in metrics) if metrics else 0
        table = "\n".join(f"    {k:<{width}}  {v:.4f}" for k, v in metrics.items())
        where = f"epoch {runner.epoch}" if runner.settings.by_epoch else f"iter {runner.iter}"
        # the test's weights: the best checkpoint's, or the evaluated one's (not this epoch's); so are a
        # validation's without training (expkit.eval split=val)
        evaluated = mode == "test" or runner.train_loader is None
        weights = runner.test_checkpoint or runner.load_source if evaluated else None
        if weights:
            where = f"weights {Path(str(weights)).name}"
        log.info("%s (%s):\n%s", "Validation" if mode == "val" else "Test", where, table)

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        self._log_eval(runner, "val", metrics)

    def after_test_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        self._log_eval(runner, "test", metrics)


def plot_curves(metrics_file: Any, path: Any) -> None:
    """curves.svg: one panel per metric (the loss first), its own y range, named on its axis;
    in it the train and val values as lines and the test value as a point, with a legend;
    every panel on the run's step axis, from 0 to its last step.

    Args:
        metrics_file: the run's ``metrics.jsonl``, one JSON record per line.
        path: the SVG file to write; nothing is written when no record has a ``train/loss*``,
            ``val/*`` or ``test/*`` key.
    """
    from expkit.loggers.svgplot import Panel, Series, charts
    from expkit.workdir.records import read_records

    metrics_file = Path(metrics_file)
    records = read_records(metrics_file.parent, metrics_file.name)  # (a torn line: skipped, not a failed plot)
    keys = sorted({k for r in records for k in r if k.startswith(("train/loss", "val/", "test/"))})
    if not keys:
        return
    by_metric: dict[str, list[str]] = {}
    for key in sorted(keys, key=lambda k: ("train/val/test/".index(k.split("/", 1)[0] + "/"), k)):
        by_metric.setdefault(key.split("/", 1)[1], []).append(key)
    last = max(float(r.get("step", 0)) for r in records)
    panels = [
        Panel(
            metric,
            [
                Series([(r["step"], r[key]) for r in records if key in r], key, not key.startswith("test/"))
                for key in members
            ],
            ylabel=metric,
            legend=True,
            x_range=(0.0, last),
        )
        for metric, members in sorted(by_metric.items(), key=lambda item: (item[0] != "loss", item[0]))
    ]
    charts(path, panels)
