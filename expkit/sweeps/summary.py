"""A sweep's records, built from its job dirs on disk: summary.csv, summary.md, best.json (and
sweep.svg, ``expkit.sweeps.plots``), and the one line each job's end prints.

Reading the disk (not a callback's memory) makes it work with every launcher (joblib,
submitit and ray run jobs in other processes), after failures (Hydra skips
``on_multirun_end`` when a job raised) and while a sweep is still running. It writes, in
the sweep dir:

  summary.csv, summary.md   one row per job, best first
  best.json                 the best job: metric, value, epoch, work dir, checkpoint, overrides
  sweep.svg                 the monitored metric over epochs per job, and the best value
                            against each swept hyperparameter

Jobs that differ only in their seed (``seed_keys``, default ``[trainer.seed]``) form a group:
summary.csv and summary.md then hold one row per group (mean, std, n, min, max of the best and
of the final value, and its member jobs), best first by mean; jobs.csv and the second table of
summary.md keep one row per job; best.json names the best group and its best member; sweep.svg
draws each group's mean with its standard deviation.
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from pathlib import Path
from typing import Any

from expkit.core import confine
from expkit.core.atomic import write_json_atomic, write_text_atomic
from expkit.core.errors import counted
from expkit.sweeps import search
from expkit.sweeps.plots import plot_sweep
from expkit.sweeps.rows import (
    COLUMNS,
    GROUP_COLUMNS,
    _mtime,
    _sort_key,
    _usable,
    group_rows,
    job_row,
    seed_keys_of,
)
from expkit.sweeps.sweep_jobs import job_order, job_target
from expkit.workdir.records import BEST_FILE, RESULT, read_best

__all__ = ["LOCK_FILE", "ROWS_DIR", "UNSORTED", "progress_line", "record_job_end", "summarize"]

# -- the sweep's records: summary.csv / .md and best.json --------------------------------------------
# Each job's row is cached in <sweep>/.rows/<job>.json when the job ends, so that the end of a job
# costs the same in a sweep of 3 jobs as in one of 5,000 (it appends its row to summary.csv/.md and
# updates best.json), and the full summary (sorted, with sweep.svg) reads one small file per job
# instead of parsing each job's files. ``python -m expkit.sweep DIR`` rebuilds from the job dirs.
ROWS_DIR = ".rows"
UNSORTED = "unsorted"  # in ROWS_DIR while summary.csv holds rows appended since it was last sorted
LOCK_FILE = ".summary.lock"


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    return COLUMNS[:1] + ["trial"] + COLUMNS[1:] if any(r.get("trial") is not None for r in rows) else COLUMNS


def _cell(value: Any, column: str = "") -> str:
    """A summary.md cell: floats to 4 places; an error cut to 120 characters (its whole text is in
    summary.csv and the job's result.json); overrides never cut: they tell jobs apart."""
    if isinstance(value, float):
        return f"{value:.4f}"
    text = "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")
    return text[:120] if column == "error" else text


def _md_columns(columns: list[str]) -> list[str]:
    return [c for c in columns if c not in ("work_dir", "error")] + ["error"]


def _md_header(title: str, sweep_dir: Path, shown: list[str]) -> list[str]:
    return [f"# Sweep {sweep_dir.name}: {title}", "", "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]


def _md_line(row: dict[str, Any], shown: list[str]) -> str:
    return "| " + " | ".join(_cell(row.get(c), c) for c in shown) + " |"


def _csv_text(rows: list[dict[str, Any]], columns: list[str], header: bool = True) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore")
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _best_json(top: dict[str, Any], jobs: int, statuses: dict[str, int], resumed: list[str]) -> dict[str, Any]:
    usable = _usable(top)
    return {
        "job": top["job"] if usable else None,
        "metric": top["monitor"],
        "rule": top["rule"],
        "value": top["best"] if usable else None,
        "epoch": top.get("best_epoch") if usable else None,
        "work_dir": top["work_dir"] if usable else None,
        "best_checkpoint": top.get("best_checkpoint") if usable else None,
        "overrides": top["overrides"].split() if usable and top["overrides"] else [],
        "jobs": jobs,
        "statuses": dict(sorted(statuses.items())),
        "resumed_jobs": sorted(resumed, key=lambda j: (len(j), j)),
    }


def _best_group_json(groups: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """best.json of a grouped sweep: the best group by mean (n, std), and its best member."""
    top = groups[0]
    member = next((m for m in top["members"] if m["job"] == top["best_job"]), None)
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[str(r.get("status"))] = statuses.get(str(r.get("status")), 0) + 1
    best = _best_json(member or top["members"][0], len(rows), statuses, [r["job"] for r in rows if r.get("resumed")])
    best.update(
        value=top["mean"],
        mean=top["mean"],
        std=top["std"],
        n=top["n"],
        min=top["min"],
        max=top["max"],
        group=top["overrides"],
        members=top["jobs"].split(),
        groups=len(groups),
        member_value=member["best"] if member else None,
    )
    return best


def _cached_row(sweep_dir: Path, job: str) -> dict[str, Any] | None:
    """The cached summary row of `job` (a job dir's name, read from best.json too: confined)."""
    path = confine.confined(sweep_dir / ROWS_DIR, f"{job}.json", sweep_dir / BEST_FILE, "cached row")
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


class _Locked:
    """An exclusive lock on the sweep's records (jobs of joblib, submitit or Slurm end in other
    processes, on other hosts of a shared filesystem: flock is honoured by NFS clients)."""

    def __init__(self, sweep_dir: Path) -> None:
        self.path = sweep_dir / LOCK_FILE

    def __enter__(self) -> None:
        import fcntl

        self.file = open(self.path, "a")  # closed in __exit__
        fcntl.flock(self.file, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        self.file.close()  # releases the lock


def summarize(
    sweep_dir: str | Path, plot: bool = True, fresh: bool = False, seed_keys: list[str] | None = None
) -> dict[str, Any] | None:
    """Write summary.csv, summary.md, best.json (and sweep.svg) for `sweep_dir`, best first;
    returns best.json's content. A job's row comes from its cached row (written when it
    ended), else from its files; `fresh` reads every job's files and renews the cache.
    `seed_keys`: what makes seed groups (None: the sweep's own setting).

    Args:
        sweep_dir: the sweep dir, holding one dir per job.
        plot: whether to draw sweep.svg too.
        fresh: whether to read every job's files instead of the cached rows (and renew the cache).
        seed_keys: the override keys that only change the seed; None: the sweep's own setting.

    Returns:
        The content of best.json; None when the sweep dir holds no job dir.
    """
    sweep_dir = Path(sweep_dir)
    seed_keys = seed_keys_of(sweep_dir) if seed_keys is None else seed_keys
    with _Locked(sweep_dir):  # no job's end interleaves with this rebuild
        rows = _all_rows(sweep_dir, fresh)
        if not rows:
            return None
        best = _write_summary(sweep_dir, rows, seed_keys)
    if plot:
        plot_sweep(rows, sweep_dir / "sweep.svg", seed_keys)
    return best


def _all_rows(sweep_dir: Path, fresh: bool) -> list[dict[str, Any]]:
    """Every job's row: the cached one while its result.json is the one it was made from (and
    the job is not running), else read from the job's files (and cached)."""
    (sweep_dir / ROWS_DIR / UNSORTED).unlink(missing_ok=True)
    rows = []
    for path in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")), key=job_order):
        row = None if fresh else _cached_row(sweep_dir, path.name)
        if row is None or row.get("status") == "running" or row.get("result_mtime") != _mtime(path / RESULT):
            row = job_row(path)
            if row is not None:
                row = json.loads(json.dumps(row))  # as cached (tuples become lists)
                write_json_atomic(sweep_dir / ROWS_DIR / f"{row['job']}.json", row)
        if row is not None:
            rows.append(row)
    return rows


def _mark_front(rows: list[dict[str, Any]], objectives: tuple[list[str], list[str]]) -> list[dict[str, Any]]:
    """Mark each row ``pareto`` (True: on the front of the finished jobs with every objective's
    value) and give it a column per objective; the front's rows, by the first objective's
    direction, come first. Returns the front's rows."""
    names, directions = objectives
    usable = [
        r
        for r in rows
        if r.get("status") == "completed"
        and all(v is not None for v in (r.get("objectives") or {}).values())
        and len(r.get("objectives") or {}) == len(names)
    ]
    front_idx = set(search.pareto_front([[r["objectives"][n] for n in names] for r in usable], directions))
    front = [r for i, r in enumerate(usable) if i in front_idx]
    sign = -1 if directions[0] == "maximize" else 1
    for r in rows:
        r["pareto"] = any(r is f for f in front)
        for name in names:
            r[name] = (r.get("objectives") or {}).get(name)
    rows.sort(key=lambda r: (not r["pareto"], sign * r[names[0]] if r["pareto"] else 0.0, _sort_key(r)))
    return [r for r in rows if r["pareto"]]


def _write_summary(sweep_dir: Path, rows: list[dict[str, Any]], seed_keys: list[str]) -> dict[str, Any]:
    rows.sort(key=_sort_key)
    columns = _columns(rows)
    shown = _md_columns(columns)
    objectives = search.objectives_of(sweep_dir)
    if objectives is not None:
        return _write_front_summary(sweep_dir, rows, objectives, columns)
    groups = group_rows(rows, seed_keys)
    if groups is not None:
        return _write_group_summary(sweep_dir, rows, groups, columns, seed_keys)
    lines = _md_header(
        f"{counted(len(rows), 'job')}, best first by {rows[0]['monitor']} ({rows[0]['rule']})", sweep_dir, shown
    )
    lines += [_md_line(r, shown) for r in rows]
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[str(r.get("status"))] = statuses.get(str(r.get("status")), 0) + 1
    best = _best_json(rows[0], len(rows), statuses, [r["job"] for r in rows if r.get("resumed")])
    write_text_atomic(sweep_dir / "summary.csv", _csv_text(rows, columns))
    write_text_atomic(sweep_dir / "summary.md", "\n".join(lines) + "\n")
    write_json_atomic(sweep_dir / BEST_FILE, best)
    return best


def _write_front_summary(
    sweep_dir: Path, rows: list[dict[str, Any]], objectives: tuple[list[str], list[str]], columns: list[str]
) -> dict[str, Any]:
    """summary.csv/.md of a search of several objectives: a column per objective and ``pareto``
    (the non-dominated jobs, first); best.json lists the front's members instead of one best."""
    names, directions = objectives
    front = _mark_front(rows, objectives)
    columns = columns[:2] + ["pareto", *names] + columns[2:]
    shown = _md_columns(columns)
    title = (
        f"{counted(len(rows), 'job')}, the Pareto front of {', '.join(f'{n} ({d})' for n, d in zip(names, directions, strict=True))} "
        f"first ({counted(len(front), 'job')})"
    )
    lines = _md_header(title, sweep_dir, shown) + [_md_line(r, shown) for r in rows]
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[str(r.get("status"))] = statuses.get(str(r.get("status")), 0) + 1
    best = _best_json(front[0] if front else rows[0], len(rows), statuses, [r["job"] for r in rows if r.get("resumed")])
    best.update(
        objectives=names,
        directions=directions,
        pareto_front=[
            {
                "job": r["job"],
                "trial": r.get("trial"),
                "work_dir": r["work_dir"],
                "values": {n: r[n] for n in names},
                "best_checkpoint": r.get("best_checkpoint"),
                "overrides": r["overrides"].split() if r["overrides"] else [],
            }
            for r in front
        ],
    )
    write_text_atomic(sweep_dir / "summary.csv", _csv_text(rows, columns))
    write_text_atomic(sweep_dir / "summary.md", "\n".join(lines) + "\n")
    write_json_atomic(sweep_dir / BEST_FILE, best)
    return best


def _write_group_summary(
    sweep_dir: Path, rows: list[dict[str, Any]], groups: list[dict[str, Any]], columns: list[str], seed_keys: list[str]
) -> dict[str, Any]:
    """summary.csv/.md by seed group (best mean first), jobs.csv and a jobs table below."""
    top = groups[0]
    title = (
        f"{len(groups)} groups of jobs that differ only in {', '.join(seed_keys)}, best first by mean "
        f"{top['monitor']} ({top['rule']})"
    )
    lines = [
        f"# Sweep {sweep_dir.name}: {title}",
        "",
        "| " + " | ".join(GROUP_COLUMNS) + " |",
        "|" + "---|" * len(GROUP_COLUMNS),
    ]
    lines += [_md_line(g, GROUP_COLUMNS) for g in groups]
    shown = _md_columns(columns)
    lines += [
        "",
        f"## {counted(len(rows), 'job')}, best first",
        "",
        "| " + " | ".join(shown) + " |",
        "|" + "---|" * len(shown),
    ]
    lines += [_md_line(r, shown) for r in rows]
    best = _best_group_json(groups, rows)
    write_text_atomic(sweep_dir / "summary.csv", _csv_text(groups, GROUP_COLUMNS))
    write_text_atomic(sweep_dir / "jobs.csv", _csv_text(rows, columns))
    write_text_atomic(sweep_dir / "summary.md", "\n".join(lines) + "\n")
    write_json_atomic(sweep_dir / BEST_FILE, best)
    return best


def record_job_end(sweep_dir: Path, work_dir: Path) -> None:
    """The end of one job, in O(1): cache its row, append it to summary.csv and summary.md
    (in the order jobs end; the sweep's end sorts them) and update best.json's best job and
    counts. A job that a resumed sweep found finished (its row unchanged) changes nothing.

    With seed groups, the whole summary is written again from the cached rows instead (a
    group's row changes with each member).

    Args:
        sweep_dir: the sweep dir.
        work_dir: the ended job's work dir (Hydra's; a resumed sweep's alias is followed).
    """
    row = job_row(job_target(work_dir))
    if row is None:
        return
    if row["status"] == "running":  # a job this launch skipped (another launch runs it)
        return
    row = json.loads(json.dumps(row))  # as cached (tuples become lists)
    seed_keys = seed_keys_of(sweep_dir)
    with _Locked(sweep_dir):
        old = _cached_row(sweep_dir, row["job"])
        if json.dumps(old, sort_keys=True) == json.dumps(row, sort_keys=True):  # (NaN == NaN here)
            return
        write_json_atomic(sweep_dir / ROWS_DIR / f"{row['job']}.json", row)
        # written again from the cached rows (a small file per job) where a line would be wrong: a job
        # already listed (interrupted, then resumed: one line each, until the sweep's end sorted them),
        # seed groups (a group's row changes with each member), or a Pareto front (a job may leave it)
        if old is not None or "objectives" in row or any(k in row["override_values"] for k in seed_keys):
            _write_summary(sweep_dir, _all_rows(sweep_dir, False), seed_keys)
            return
        csv_path, md_path, best_path = (sweep_dir / n for n in ("summary.csv", "summary.md", BEST_FILE))
        new_file = not csv_path.is_file() or csv_path.stat().st_size == 0
        if new_file:
            columns = _columns([row])
        else:  # the columns the file has (a row without a trial number still lines up)
            with csv_path.open(encoding="utf-8", newline="") as f:
                columns = next(csv.reader(f), None) or _columns([row])
        with csv_path.open("a", encoding="utf-8", newline="") as f:
            f.write(_csv_text([row], columns, header=new_file))
        shown = _md_columns(columns)
        if not md_path.is_file() or md_path.stat().st_size == 0:
            header = _md_header(
                f"jobs in the order they ended (sorted best first by {row['monitor']} "
                f"({row['rule']}) when the sweep ends)",
                sweep_dir,
                shown,
            )
            md_path.write_text("\n".join(header) + "\n", encoding="utf-8")
        with md_path.open("a", encoding="utf-8") as f:
            f.write(_md_line(row, shown) + "\n")
        (sweep_dir / ROWS_DIR / UNSORTED).touch()
        best = read_best(sweep_dir) or {"job": None, "jobs": 0, "statuses": {}, "resumed_jobs": []}
        statuses = dict(best.get("statuses") or {})
        statuses[str(row.get("status"))] = statuses.get(str(row.get("status")), 0) + 1
        resumed = [j for j in best.get("resumed_jobs") or [] if j != row["job"]] + (
            [row["job"]] if row.get("resumed") else []
        )
        top = _cached_row(sweep_dir, best["job"]) if best.get("job") not in (None, row["job"]) else None
        if top is None or _sort_key(row) < _sort_key(top):
            top = row
        write_json_atomic(best_path, _best_json(top, int(best.get("jobs") or 0) + 1, statuses, resumed))


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _launch_jobs(sweep_dir: Path, stamp: str, job: str) -> set[str] | None:
    """The jobs that ended in this launch so far, `job` included: each leaves its name in the
    launch's own dir of markers (``.rows/launch-<stamp>/``; one empty file a job). None when the
    launch has no usable stamp or the markers cannot be written."""
    if not stamp.replace(".", "", 1).isdigit():
        return None
    marks = sweep_dir / ROWS_DIR / f"launch-{stamp}"
    try:
        marks.mkdir(parents=True, exist_ok=True)
        (marks / job).touch()
        return {p.name for p in marks.iterdir()}
    except OSError:
        return None


def progress_line(sweep_dir: Path, job: str) -> str:
    """One line when a job ends: jobs done of this launch's total, this job's value, the best so
    far (a group mean where seed groups exist), the time since the launch and an estimate of
    the time left (from this launch's finished jobs). Reads the cached rows and best.json.

    Args:
        sweep_dir: the sweep dir.
        job: the name of the job's dir.

    Returns:
        The line, its parts separated by semicolons.
    """
    import os

    from expkit.sweeps.sweep_jobs import SWEEP_JOBS_ENV, SWEEP_LAUNCHED_ENV

    rows = [r for r in (_cached_row(sweep_dir, p.stem) for p in (sweep_dir / ROWS_DIR).glob("*.json")) if r]
    done = [r for r in rows if r.get("status") not in ("running", "interrupted")]  # (interrupted: runs again)
    stamp = os.environ.get(SWEEP_LAUNCHED_ENV, "")
    launched = float(stamp or 0) or None
    total = int(os.environ.get(SWEEP_JOBS_ENV, "0") or 0) or None
    row = next((r for r in rows if r["job"] == job), None)
    ours = _launch_jobs(sweep_dir, stamp, job) if total else None
    if ours is not None:  # the jobs of this launch only (the dir may hold an earlier launch's, with other values)
        done = [r for r in done if r["job"] in ours]
    parts = [f"Sweep: {len(done)}/{total} jobs done" if total else f"Sweep: {len(done)} jobs done"]
    if row is not None:
        value = row.get("best")
        shown = f"{value:.4f}" if isinstance(value, (int, float)) and math.isfinite(value) else "no value"
        parts.append(f"job {job} ({row.get('status')}) {row['monitor']} {shown}")
    best = read_best(sweep_dir) or {}
    if isinstance(best.get("value"), (int, float)):
        where = f"group mean, n={best.get('n')}" if best.get("group") is not None else f"job {best.get('job')}"
        parts.append(f"best {best['value']:.4f} ({where})")
    if launched is not None:
        elapsed = time.time() - launched
        parts.append(f"{_clock(elapsed)} elapsed")
        this_launch = sum(1 for r in done if (r.get("result_mtime") or 0) >= launched)
        if total and this_launch and total > len(done):
            parts.append(f"about {_clock(elapsed / this_launch * (total - len(done)))} left")
    return "; ".join(parts)
