"""result.json, a run's last word: its one writer.

The Runner writes it at the end of every run (``write_run_result``); a command that fails
before a Runner exists, or a sweep job that is skipped, writes a short one
(``write_failure``). Readers: the sweep summary (``expkit.sweep``), ``expkit.eval``, users.
"""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expkit.core.atomic import SpaceReserve, disk_full, write_json_atomic

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["RESULT", "failure_message", "run_result", "write_failure", "write_run_result"]


log = logging.getLogger("expkit")
RESULT = "result.json"


def run_result(runner: Runner, status: str, error: str | None, tb: str | None, wall_time: float) -> dict[str, Any]:
    """result.json's content at the end of a run.

    Args:
        runner: the runner whose state is recorded.
        status: ``completed``, ``stopped``, ``pruned`` or ``failed``.
        error: the one-line error (``failure_message``); None when the run did not fail.
        tb: the traceback of the error; None without one.
        wall_time: this process's run's duration, in seconds.

    Returns:
        The record: status, error, counters, final and best metrics, the monitor and its rule, the
        checkpoints, the wall time (``wall_time_s``: of a resumed run, its earlier segments' up to
        the checkpoint it resumed from included, and ``segment_wall_time_s`` this one's), every
        entry of ``runner.run_info``, and the traceback.
    """
    r = runner
    result = {
        "status": status,  # completed, stopped, pruned or failed
        "error": error,
        "stop_reason": r.stop_reason,
        "work_dir": str(r.work_dir.resolve()),
        "epoch": r.epoch,
        "iter": r.iter,
        "final_metrics": {**r.val_metrics, **r.test_metrics},
        "best_metrics": r.best_metrics,
        "monitor": r.monitor,
        "monitor_rule": r.directions.rule(r.monitor) if r.monitor else None,
        "best_checkpoint": next(iter(r.best_checkpoints.values()), None),
        "best_checkpoints": r.best_checkpoints,
        "last_checkpoint": str(r.last_checkpoint) if r.last_checkpoint else None,
        "test_checkpoint": r.test_checkpoint,
        "provenance": "provenance.json",  # commit, versions, packages, host, command, times
        "wall_time_s": round(r.state.earlier_wall_s + wall_time, 3),
    }
    if r.state.earlier_wall_s:  # resumed: this segment's own
        result["segment_wall_time_s"] = round(wall_time, 3)
    # data=webdataset with data.on_error=skip: the samples left out, by split
    skipped = getattr(getattr(r.train_loader, "dataset", None), "skipped_samples", None)
    if callable(skipped) and (counts := skipped()) is not None:
        result["skipped_samples"] = counts
    # what the command and hooks add (overrides, command, perf_stats, ...): never over the run's own keys
    result.update((k, v) for k, v in r.run_info.items() if k not in result and k != "traceback")
    result["traceback"] = tb
    return result


def failure_message(exc: BaseException, resume_command: str | None = None) -> str:
    """Why a run failed, in one line (result.json's ``error``): the message of an error the
    user can fix, the type and message of anything else; which rank died, and how to resume.

    Args:
        exc: the exception that ended the run.
        resume_command: the command that resumes the run, added when another rank died; None: not added.

    Returns:
        The line.
    """
    from expkit.core import distributed
    from expkit.core.errors import ExpkitError

    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (KeyboardInterrupt)"
    peer = distributed.peer_failure(exc)
    if peer is not None:
        return peer + (f"; resume with: {resume_command}" if resume_command else "")
    return str(exc) if isinstance(exc, ExpkitError) else f"{type(exc).__name__}: {exc}"


def write_run_result(runner: Runner, result: dict[str, Any], wall_time: float, reserve: SpaceReserve | None) -> None:
    """Rank 0 writes result.json and provenance.json (from `reserve`'s room when the disk is
    full). When rank 0 died, the lowest surviving rank on its host writes result.json.

    Args:
        runner: the runner; its work dir, rank and provenance record are read.
        result: the record (``run_result``).
        wall_time: the run's duration, in seconds: a result.json written since the run started is
            rank 0's, which a surviving rank leaves alone.
        reserve: the space held for these files, used when the disk is full and released afterwards;
            None: plain writes.
    """
    from expkit.core import distributed  # (here, as provenance: they import torch, which reading a result needs not)
    from expkit.workdir import provenance

    r = runner
    path = r.work_dir / RESULT
    if not r.is_main and not (
        result["status"] == "failed"
        and distributed.writes_for_the_group()
        and not _written_since(path, time.time() - wall_time)  # rank 0's own word wins
    ):
        return
    write = reserve.write_json if reserve is not None else write_json_atomic
    files = [(path, result)]
    if r.is_main:
        files.append((r.work_dir / "provenance.json", provenance.finish(r.provenance, result["status"])))
    for target, content in files:
        try:
            write(target, content)
        except OSError as exc:  # say so instead of hiding the run's own error under a traceback
            cause = "no space left on the device" if disk_full(exc) else exc
            log.error("Could not write %s: %s (the run's status: %s)", target, cause, result["status"])
    if reserve is not None:
        reserve.release()


def write_failure(
    work_dir: Path, error: str, *, status: str = "failed", keep: bool = True, with_traceback: bool = False, **extra: Any
) -> None:
    """A short result.json for a run that ends before (or without) a Runner: a failure while
    building, a bad checkpoint in an eval sweep, a sweep job skipped after fail_fast. `keep`:
    leave a result.json already there (the Runner's own) alone.

    Args:
        work_dir: the run directory.
        error: the one-line error.
        status: the record's status.
        keep: do nothing when a result.json is already there.
        with_traceback: add the traceback of the exception being handled now.
        **extra: more entries of the record.
    """
    path = work_dir / RESULT
    if keep and path.exists():
        return
    content = {"status": status, "error": error, "work_dir": str(work_dir.resolve()), **extra}
    if with_traceback:
        content["traceback"] = traceback.format_exc()
    try:
        write_json_atomic(path, content)
    except OSError as exc:  # a full or read-only disk: the error itself is what matters
        log.error("Could not write %s: %s", path, exc)


def _written_since(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False
