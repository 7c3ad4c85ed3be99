"""Reading wandb's offline run files back (``wandb/offline-run-*/run-*.wandb``) without
wandb's servers: whether a run's log is complete, and its history, for tests and for
checking what a run sent.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

__all__ = ["offline_run_files", "read_wandb_run", "wait_for_wandb_run", "wandb_history", "wandb_run_complete"]


def offline_run_files(work_dir: Path) -> list[Path]:
    """The wandb offline run logs in a work dir (``wandb/offline-run-*/run-*.wandb``).

    Args:
        work_dir: the run directory.

    Returns:
        The paths, sorted by name.
    """
    return sorted((work_dir / "wandb").glob("offline-run-*/run-*.wandb"))


_WANDB_BLOCK = 32768


def _wandb_log_records(data: bytes) -> list[bytes]:
    """The complete records of a wandb run log, in order. The file is a LevelDB-style log: a
    7-byte ``:W&B`` header, then 32 KiB blocks of records, each with a 7-byte header (crc32c,
    length, type: 1 whole, 2 first, 3 middle, 4 last). A record cut off by the end of the
    data (a log still being written) is left out."""
    import struct

    records: list[bytes] = []
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if room < 7:  # too little room for a header: the block is padded
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
        elif kind == 0 and length == 0:  # zero padding at the end of a block
            pos += _WANDB_BLOCK - pos % _WANDB_BLOCK if pos % _WANDB_BLOCK else 0
    return records


def _wandb_record(raw: bytes) -> Any:
    from wandb.proto import wandb_internal_pb2

    record = wandb_internal_pb2.Record()
    record.ParseFromString(raw)
    return record


def wandb_run_complete(path: Path) -> bool:
    """Whether a wandb run log holds its exit record, the one ``run.finish()`` writes last.
    wandb's service writes the log through a buffer and closes it after ``finish()`` has
    returned, so for a moment the file can hold only its header.

    Args:
        path: the run log (``run-<id>.wandb``); it must exist.

    Returns:
        True when one of its last 16 complete records is the exit record; False also when the file
        does not start with wandb's header yet.
    """
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        return False
    tail = _wandb_log_records(data)[-16:]  # the exit record is the last one or close to it
    return any(_wandb_record(raw).WhichOneof("record_type") == "exit" for raw in reversed(tail))


def wait_for_wandb_run(path: Path, timeout: float = 30.0) -> bool:
    """Wait until wandb's service has written a finished run's log out (its exit record is
    on disk), so that ``wandb sync`` or ``read_wandb_run`` right after a run sees all of it.
    False if it has not after ``timeout`` seconds.

    Args:
        path: the run log (``run-<id>.wandb``); it must exist.
        timeout: the seconds to wait at most; the file is read again after 10 ms, doubling up to 250 ms.

    Returns:
        True once the exit record is on disk, False after `timeout`.
    """

    deadline = time.monotonic() + timeout
    delay = 0.01
    while not wandb_run_complete(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.25)
    return True


def _attempt_order(path: Path) -> tuple[str, int]:
    """When an offline run log began: its dir is ``offline-run-<YYYYmmdd_HHMMSS>-<id>``, with
    ``-<n>`` appended for the n-th further attempt of that id in the same second."""
    run_id = path.stem.removeprefix("run-")
    stamp, _, rest = path.parent.name.removeprefix("offline-run-").partition("-")
    tail = rest.removeprefix(run_id).lstrip("-")
    return stamp, int(tail) if tail.isdigit() else 0


def wandb_history(work_dir: Path) -> list[dict[str, Any]]:
    """The history of a work dir's latest wandb run, as an uninterrupted run logged it: each
    resumed attempt's offline log replaces the earlier attempts' rows from its first step
    on (what wandb's rewind does online).

    Args:
        work_dir: the run directory.

    Returns:
        The history rows (values by key, ``_step`` included) of the run whose id the latest offline
        log has; empty when there is no offline log.

    Raises:
        ValueError: when an offline log is not a wandb run log.
    """
    runs = [read_wandb_run(path) for path in sorted(offline_run_files(work_dir), key=_attempt_order)]
    latest = runs[-1]["run"].get("id") if runs else None
    rows: list[dict[str, Any]] = []
    for run in (r for r in runs if r["run"].get("id") == latest):
        if run["history"]:
            first = run["history"][0].get("_step", 0)
            rows = [row for row in rows if row.get("_step", 0) < first] + run["history"]
    return rows


def read_wandb_run(path: Path) -> dict[str, Any]:
    """Read an offline wandb run log (``run-<id>.wandb``) without uploading it: its run
    record (name, group, project), config, history rows and summary. Each record is a
    protobuf ``wandb.proto.wandb_internal_pb2.Record``.

    Args:
        path: the run log (``run-<id>.wandb``).

    Returns:
        ``run`` (id, name, group, project, job_type, tags), ``config`` and ``summary`` (values by key)
        and ``history`` (one dict per history record), values decoded from JSON.

    Raises:
        ValueError: when the file does not start with wandb's header.
    """
    import json as _json

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb run log")
    out: dict[str, Any] = {"run": {}, "config": {}, "history": [], "summary": {}}

    def value(item: Any) -> Any:
        return _json.loads(item.value_json)

    def key(item: Any) -> str:
        return item.key or "/".join(item.nested_key)

    for raw in _wandb_log_records(data):
        record = _wandb_record(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out["run"] = {
                "id": run.run_id,
                "name": run.display_name,
                "group": run.run_group,
                "project": run.project,
                "job_type": run.job_type,
                "tags": list(run.tags),
            }
            out["config"].update({key(i): value(i) for i in run.config.update})
        elif kind == "config":
            out["config"].update({key(i): value(i) for i in record.config.update})
        elif kind == "history":
            out["history"].append({key(i): value(i) for i in record.history.item})
        elif kind == "summary":
            out["summary"].update({key(i): value(i) for i in record.summary.update})
    return out
