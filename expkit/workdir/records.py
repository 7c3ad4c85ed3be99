"""The readers of a work dir's records: one function per file, one behaviour for a broken one.

- ``read_result``: ``result.json``, a run's last word (``expkit.workdir.results`` writes it);
- ``read_records``: ``metrics.jsonl``, one record per line (the LoggerHook appends it);
- ``read_job``: ``job.json``, a sweep job's identity (``expkit.sweeps.sweep_jobs`` writes it);
- ``read_best``: ``best.json``, a sweep dir's best job (``expkit.sweeps.summary`` writes it);
- ``read_provenance``: ``provenance.json``, what produced a run (``expkit.workdir.provenance`` writes it).

Every record is data from a stranger that a kill may have cut short. So a file that is missing,
unreadable, torn (not JSON, or bytes cut inside a character) or foreign (JSON but not an object,
say a list) reads as no record: None for the one-object files, and, in ``metrics.jsonl``, each
line that is not a JSON object is skipped (a killed run leaves a torn last line). No reader
raises for what a file holds; the caller decides what a missing record means.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from expkit.workdir.results import RESULT

__all__ = [
    "BEST_FILE",
    "JOB_FILE",
    "METRICS_FILE",
    "PROVENANCE_FILE",
    "RESULT",
    "read_best",
    "read_job",
    "read_provenance",
    "read_records",
    "read_result",
]

METRICS_FILE = "metrics.jsonl"  # the LoggerHook's default filename; the summaries and expkit.check read this one
JOB_FILE = "job.json"  # a job's identity in a sweep; Hydra never writes it
BEST_FILE = "best.json"  # in a sweep dir: its best job (or group, or Pareto front)
PROVENANCE_FILE = "provenance.json"  # a run's commit, environment and command (expkit.reproduce reads it)


def _read_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when it is missing, unreadable, torn or not an object."""
    try:
        # bytes, not text: a character cut by a kill is a ValueError (UnicodeDecodeError) like any tear
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_result(work_dir: Path) -> dict[str, Any] | None:
    """A run's ``result.json``.

    Args:
        work_dir: the run's work dir.

    Returns:
        Its content; None when the file is missing, unreadable, torn (a write cut short) or not
            a JSON object. A run that is still going has none yet.
    """
    return _read_object(Path(work_dir) / RESULT)


def read_records(work_dir: Path, filename: str = METRICS_FILE) -> list[dict[str, Any]]:
    """A run's ``metrics.jsonl``, in order.

    Args:
        work_dir: the run's work dir.
        filename: the file's name in it (the LoggerHook's ``filename``; ``metrics.jsonl``).

    Returns:
        Its records; a line that is not a JSON object (the torn last line of a killed run, a line
            being written right now, a foreign value) is skipped; none when the file is missing or
            unreadable.
    """
    try:
        lines = (Path(work_dir) / filename).read_bytes().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_job(work_dir: Path) -> dict[str, Any] | None:
    """A sweep job dir's ``job.json``, as ``record_job`` (or ``place_job``, for an alias) wrote it.

    Args:
        work_dir: the job dir.

    Returns:
        Its content; None when the file is missing, unreadable, torn or not a JSON object (the
            dir then holds no job of its own).
    """
    return _read_object(Path(work_dir) / JOB_FILE)


def read_best(sweep_dir: Path) -> dict[str, Any] | None:
    """A sweep dir's ``best.json``.

    Args:
        sweep_dir: the sweep dir.

    Returns:
        Its content; None when the file is missing, unreadable, torn or not a JSON object (the
            summary then is to be written again).
    """
    return _read_object(Path(sweep_dir) / BEST_FILE)


def read_provenance(work_dir: Path) -> dict[str, Any] | None:
    """A run's ``provenance.json``.

    Args:
        work_dir: the run's work dir.

    Returns:
        Its content; None when the file is missing, unreadable, torn or not a JSON object.
    """
    return _read_object(Path(work_dir) / PROVENANCE_FILE)
