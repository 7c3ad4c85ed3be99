"""The probe's traces read back: ``<work dir>/check_probe.jsonl`` (and each rank's), as the probe
(``expkit.check.check_probe``, a hook in each run the check starts) wrote it, by kind of record.
Apart from the probe, which imports torch: the check's own process reads traces and never
needs torch (``python -m expkit.check --help`` imports none)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["KILL_AT_ENV", "RECORDS", "Trace", "read_trace", "records_name"]


KILL_AT_ENV = "EXPKIT_CHECK_KILL_AT"  # the iteration whose checkpoint this process dies right after
RECORDS = "check_probe.jsonl"


def records_name(rank: int) -> str:
    """The records file of a rank: rank 0's is ``check_probe.jsonl``, rank N's ``check_probe.rankN.jsonl``.

    Args:
        rank: the process's rank.

    Returns:
        The file's name, in the run's work dir.
    """
    return RECORDS if rank == 0 else RECORDS.replace(".jsonl", f".rank{rank}.jsonl")


@dataclass
class Trace:
    """One run's probe records, by kind; an iteration seen twice keeps its last record.

    Args:
        start: the records of each start (a resumed run has two).
        iters: the record of each iteration, by iteration.
        evals: the validation and test records, in order.
        end: the record of the end of training; None when the run did not get there.
        killed: whether the run killed itself after the checkpoint it waited for.
    """

    start: list[dict[str, Any]]
    iters: dict[int, dict[str, Any]]
    evals: list[dict[str, Any]]
    end: dict[str, Any] | None
    killed: bool


def read_trace(work_dir: Path, rank: int = 0) -> Trace:
    """The probe records a run left; lines that cannot be parsed (cut by the kill) are skipped.

    Args:
        work_dir: the run's work dir.
        rank: the rank whose records are read.

    Returns:
        The records by kind (all empty when the file is missing).
    """
    start, iters, evals, end, killed = [], {}, [], None, False
    path = work_dir / records_name(rank)
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # (a line cut by the kill)
            continue
        kind = rec.get("event")
        if kind == "start":
            start.append(rec)
        elif kind == "iter":
            iters[rec["iter"]] = rec
        elif kind in ("val", "test"):
            evals.append(rec)
        elif kind == "end":
            end = rec
        elif kind == "killed":
            killed = True
    return Trace(start, iters, evals, end, killed)
