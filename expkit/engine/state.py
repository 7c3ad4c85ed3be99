"""A run's state: where it is, what it has found, how it ends. One object, saved and loaded whole.

The Runner keeps it in ``runner.state`` and reads every field through an attribute of its own of
the same name (``runner.epoch`` is ``runner.state.epoch``), which is what hooks use. The loops
write the counters; a checkpoint stores ``state.state_dict()`` and a resume puts it back with
``state.load_state_dict``. What is not here belongs to the objects the Runner was given (the
model, optimizers, schedulers, hooks: each saves its own state) or to the process (RNG streams,
saved with the state and put back with it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from expkit.core import confine
from expkit.core.rng import rng_states, set_rng_states

__all__ = ["EpochStart", "Position", "RunState", "TrainWindow"]


class Position(NamedTuple):
    """Where a run stands, in units completed: what a checkpoint saved now records."""

    epoch: int = 0
    """Epochs completed."""
    iter: int = 0
    """Training iterations (optimizer steps) completed."""
    inner_iter: int = 0
    """Batches of the current epoch trained on."""


class EpochStart(NamedTuple):
    """Where this process took up an epoch that a mid-epoch resume continues with another number
    of processes or batch size: the samples skipped are counted in the epoch's order, not in batches."""

    samples: int = 0
    """Samples of the epoch's order trained on before, by all the saving run's processes together."""
    inner_iter: int = 0
    """``inner_iter`` at that point (the batches the saving run had trained on)."""


@dataclass(slots=True)
class TrainWindow:
    """What the training iterations since the last logging step left, kept by the loop for the
    hooks that run at logging steps only (``Hook.log_steps_only``: the timer and the logger), so
    that the iterations in between call no hook. ``runner.train_window``; not saved (the logger
    saves the losses it has not written yet).

    The window runs from just before the last logging step's hooks (or the epoch's start) to
    now: ``iters - start_iters`` iterations, ``data_s - start_data_s`` seconds of data time. A hook
    called more often reads what is new to it by counting: ``iters`` only grows, and the newest
    ``iters - seen`` entries of ``losses`` are the iterations since it last looked.
    """

    iters: int = 0
    """Training iterations of the run up to the last one the loop finished (it only grows; set to
    ``runner.iter`` when training starts, so a resumed run counts on from its checkpoint)."""
    data_s: float = 0.0
    """The data time of this process's iterations in all, in seconds: from the end of each
    iteration's predecessor (or the epoch's start) until its batch was ready."""
    end_s: float = 0.0
    """``time.perf_counter()`` when the last iteration ended (or the epoch started)."""
    start_s: float = 0.0
    """``time.perf_counter()`` when the window started: when the last logging step's hooks were
    called (what they take counts in this window), or the epoch's start (the time between epochs
    is no iteration's)."""
    step_s: float = 0.0
    """``time.perf_counter()`` just before the logging step's hooks are called: the window's end."""
    start_iters: int = 0
    """``iters`` when the window started."""
    start_data_s: float = 0.0
    """``data_s`` when the window started."""
    losses: list[Any] = field(default_factory=list)
    """Each iteration's loss (detached, still on its device) since the last logging step; emptied
    after each. Kept only while some hook has a ``log_step_interval`` or ``log_steps_only``."""
    logged: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """``(index, outputs["log"])`` of the iterations since the last logging step whose step returned
    a ``log`` dict (a model's own scalars); ``index`` is ``iters`` before that iteration (its
    ``runner.iter``)."""

    def restart(self, now: float, start: float | None = None) -> None:
        """A new window from `start` (default `now`), the last iteration having ended at `now` (its
        losses are emptied apart, after each logging step)."""
        self.end_s = now
        self.start_s = self.step_s = now if start is None else start
        self.start_iters, self.start_data_s = self.iters, self.data_s

    def new_losses(self, seen: int | None) -> list[Any]:
        """The losses kept of the iterations after the first `seen` of ``iters`` (None: all kept)."""
        if seen is None:
            return list(self.losses)
        new = self.iters - seen
        return self.losses[-new:] if new > 0 else []


@dataclass(slots=True)
class RunState:
    """The mutable state of one run. Counters follow MMEngine (see ``expkit.core.stages``)."""

    epoch: int = 0
    """Epochs completed; inside an epoch, its 0-based index."""
    iter: int = 0
    """Training iterations (optimizer steps) completed."""
    inner_iter: int = 0
    """Batches of the current epoch trained on (a mid-epoch resume skips them)."""
    position: Position = field(default_factory=Position)
    """Epochs, iterations and batches of the epoch completed: what a checkpoint saved now records.
    Ahead of the counters above inside ``after_optimizer_step``, ``after_train_iter`` and
    ``after_train_epoch``, which run before the loop counts the iteration (or epoch) done."""
    epoch_start: EpochStart = field(default_factory=EpochStart)
    """Set by a mid-epoch resume with another number of processes or batch size; (0, 0) otherwise."""
    epoch_batches: int | None = None
    """The resumed epoch's length in batches (those skipped included, as ``inner_iter`` counts
    them) when its sampler skipped the samples; None otherwise (the loader's length is)."""
    run_started_s: float = 0.0
    """``time.time()`` when this process's ``Runner.run`` began (a segment of a resumed run)."""
    earlier_wall_s: float = 0.0
    """Wall time of the earlier segments of a resumed run, up to the checkpoint resumed from
    (its ``meta.wall_time_s``); 0 for a run that did not resume."""
    batch_ready_s: float = 0.0
    """``time.perf_counter()``, in seconds, when the current iteration's batch was ready (the
    iteration's data time ends there)."""
    val_metrics: dict[str, float] = field(default_factory=dict)
    """The last validation's metrics (``val/acc``, ...)."""
    test_metrics: dict[str, float] = field(default_factory=dict)
    """The test's metrics, once tested."""
    best_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per metric key, its best value so far and when (``value``, ``epoch``, ``iter``)."""
    best_checkpoints: dict[str, str] = field(default_factory=dict)
    """Per monitored key, the path of its best checkpoint."""
    last_checkpoint: Path | None = None
    """The newest complete regular checkpoint (or the one resumed from)."""
    scalars: dict[str, float] = field(default_factory=dict)
    """The latest values hooks publish (``train/time``, ...)."""
    extra_scalars: dict[str, float] = field(default_factory=dict)
    """Hooks' values for the next log record (cleared there)."""
    resuming: bool = False
    """True once this run continues from a resume checkpoint."""
    load_purpose: str = ""
    """Why the last checkpoint was loaded: ``resume``, ``load_from`` or ``test``."""
    load_source: Path | None = None
    """The file (or sharded dir) the last checkpoint was loaded from."""
    test_checkpoint: str | None = None
    """The weights the test used."""
    status: str = "running"
    """``running``, then ``completed``, ``stopped``, ``pruned`` or ``failed`` (set before after_run)."""
    stop_reason: str | None = None
    """Why the run was asked to stop (the first request wins); None while nobody asked."""
    stop_status: str = "stopped"
    """What result.json says after the stop: ``stopped`` (early stopping, a signal) or ``pruned``."""
    stop_signal: int | None = None
    """The signal number, when a signal asked to stop."""
    stopped_by_signal: bool = False
    """Whether a signal was the first stop request (not one after a stop)."""
    stop_resumable: bool = False
    """Whether the first stop request was an interruption the run goes on from when resumed (an
    unreachable search storage; a signal's stop is one too): the test pass waits for that."""
    requeue: bool = False
    """Whether the stop asks for the job to run again: a requeue signal (``trainer.requeue_signal``,
    submitit's), or the job's time limit near (``trainer.save_before_limit``). The command requeues
    the job once the run is recorded."""
    error: str | None = None
    """Why the run failed, in one line (result.json's ``error``)."""

    def wall_time_s(self) -> float:
        """The run's wall time so far, in seconds: this segment's, plus the earlier segments' up
        to the checkpoint it resumed from (what a segment spent after its last checkpoint is
        not counted: the work was done again).

        Returns:
            The seconds; 0 before ``Runner.run`` began.
        """
        if not self.run_started_s:
            return self.earlier_wall_s
        return self.earlier_wall_s + time.time() - self.run_started_s

    def state_dict(self) -> dict[str, Any]:
        """What continuing this run exactly needs of its state, as a checkpoint stores it.

        Returns:
            ``{"meta": {...}, "rng": ...}``: the counters (as completed: ``position``), the best
                and last validation metrics, the best checkpoints' file names (they lie beside
                the checkpoint) and every RNG stream of this process.
        """
        epoch, iters, inner = self.position
        return {
            "meta": {
                "epoch": epoch,
                "iter": iters,
                "inner_iter": inner,
                "best_metrics": self.best_metrics,
                "val_metrics": self.val_metrics,  # the last validation's: result.json reports them after a resume
                "best_checkpoints": {k: Path(v).name for k, v in self.best_checkpoints.items()},
                "wall_time_s": self.wall_time_s(),  # (a resumed run's result.json counts on from it)
            },
            "rng": rng_states(),
        }

    def load_state_dict(self, checkpoint: dict[str, Any], source: Path) -> None:
        """Put a checkpoint's run state back (to resume): counters, metrics, RNG streams.

        Args:
            checkpoint: a checkpoint, as ``state_dict`` (with the rest of the checkpoint) wrote it.
            source: the file (or sharded dir) it was read from: the best checkpoints it names are
                read beside it, and nowhere else (a name that leaves that dir is dropped).
        """
        meta = checkpoint["meta"]
        self.epoch, self.iter, self.inner_iter = meta["epoch"], meta["iter"], meta.get("inner_iter", 0)
        self.position = Position(self.epoch, self.iter, self.inner_iter)
        self.epoch_start, self.epoch_batches = EpochStart(0, 0), None
        self.best_metrics = dict(meta.get("best_metrics", {}))
        earlier = meta.get("wall_time_s")
        valid = isinstance(earlier, (int, float)) and not isinstance(earlier, bool) and math.isfinite(earlier)
        self.earlier_wall_s = float(earlier) if valid and earlier > 0 else 0.0
        self.val_metrics = dict(meta.get("val_metrics", {}))
        recorded = meta.get("best_checkpoints", {})
        confined = {
            key: confine.confined(source.parent, path, source, "checkpoint")
            for key, path in (recorded.items() if isinstance(recorded, dict) else ())
        }
        self.best_checkpoints = {key: str(path) for key, path in confined.items() if path is not None}
        self.last_checkpoint = source
        if "rng" in checkpoint:
            set_rng_states(checkpoint["rng"])
