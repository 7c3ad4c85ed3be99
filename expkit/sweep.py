"""Sweep summaries, built from the job dirs on disk: ``python -m expkit.sweep <sweep dir>``.

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
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

from expkit.core import confine, hydra_compat
from expkit.core.atomic import write_json_atomic, write_text_atomic
from expkit.metrics import monitor_of
from expkit.sweeps import search
from expkit.sweeps.search import objective_values, objectives_of
from expkit.sweeps.sweep_jobs import finished, job_order, job_target, key_kind
from expkit.workdir.records import BEST_FILE, RESULT, read_best, read_job, read_records, read_result

__all__ = [
    "COLUMNS",
    "DEFAULT_SEED_KEYS",
    "GROUP_COLUMNS",
    "LOCK_FILE",
    "ROWS_DIR",
    "UNSORTED",
    "SweepSummaryCallback",
    "group_rows",
    "job_row",
    "main",
    "plot_sweep",
    "progress_line",
    "rebuild",
    "record_job_end",
    "seed_keys_of",
    "summarize",
]


log = logging.getLogger("expkit")

COLUMNS = [
    "job",
    "status",
    "resumed",
    "monitor",
    "best",
    "best_epoch",
    "final",
    "wall_time_s",
    "overrides",
    "best_checkpoint",
    "work_dir",
    "error",
]


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: ~10x faster than pure Python


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.load(path.read_text(), Loader=_YAML_LOADER)  # a safe loader (C or Python)
    except (OSError, yaml.YAMLError):
        return None


def job_row(work_dir: Path) -> dict[str, Any] | None:
    """One job's row, from its result.json, or from metrics.jsonl while it runs.

    Args:
        work_dir: the job's work dir.

    Returns:
        The row: the ``COLUMNS`` values, the monitored metric's rule, curve and override values;
            None when `work_dir` has no ``.hydra/`` or stands for another job's dir (a resumed sweep's
            alias).
    """
    hydra_dir = work_dir / ".hydra"
    if not hydra_dir.is_dir() or "alias_of" in (read_job(work_dir) or {}):
        return None
    result_path = work_dir / RESULT
    result = read_result(work_dir)  # (None while it runs, and for a torn or foreign file)
    if result is not None and result.get("monitor") and result.get("monitor_rule") in ("greater", "less"):
        monitor, rule = result["monitor"], result["monitor_rule"]  # what the run used (no YAML to parse)
    else:
        monitor, rule = monitor_of(_read_yaml(hydra_dir / "config.yaml"))
    overrides = _read_yaml(hydra_dir / "overrides.yaml") or []
    row: dict[str, Any] = {
        "job": work_dir.name,
        "result_mtime": _mtime(result_path),  # a cached row is stale once result.json changed
        "monitor": monitor,
        "rule": rule,
        "overrides": " ".join(o for o in overrides if not o.startswith("resume=")),
        "override_values": dict(o.split("=", 1) for o in overrides if "=" in o),
        "work_dir": str(work_dir.resolve()),
    }
    records = read_records(work_dir)
    curve = [[r["epoch"], r[monitor]] for r in records if monitor in r and "epoch" in r]
    row["curve"] = curve
    if result is not None:
        best = (result.get("best_metrics") or {}).get(monitor) or {}
        if not best and result.get("evaluation"):  # an evaluation (expkit.eval -m): its value is its result
            best = {"value": (result.get("final_metrics") or {}).get(monitor)}
        status = result.get("status")
        row.update(
            status="interrupted" if status == "stopped" and not finished(result) else status,  # (by a signal)
            best=best.get("value"),
            best_epoch=best.get("epoch"),
            final=(result.get("final_metrics") or {}).get(monitor),
            wall_time_s=result.get("wall_time_s"),
            best_checkpoint=(result.get("best_checkpoints") or {}).get(monitor) or result.get("best_checkpoint"),
            error=result.get("error"),
            resumed=bool(result.get("resumed_in_sweep", False)),
            trial=result.get("optuna_trial"),
        )
        objectives = objectives_of(work_dir.parent)  # (a search of several objectives: each one's value)
        if objectives is not None:
            row["objectives"] = dict(zip(objectives[0], objective_values(result, objectives[0]), strict=True))
    else:  # still running (or killed): what metrics.jsonl shows so far
        values = [v for _, v in curve if isinstance(v, (int, float)) and math.isfinite(v)]
        pick = max if rule == "greater" else min
        best = pick(values) if values else None
        row.update(
            status="running",
            best=best,
            best_epoch=next((e for e, v in curve if v == best), None),
            final=values[-1] if values else None,
        )
    return row


def _sort_key(row: dict[str, Any]) -> tuple:
    value = row.get("best")
    usable = isinstance(value, (int, float)) and math.isfinite(value)
    sign = -1 if row.get("rule") == "greater" else 1
    # a pruned job ranks after every job that ran to its end (as in the Optuna study's best trial)
    return (not usable, row.get("status") == "pruned", sign * value if usable else 0.0, row["job"])


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


def _usable(row: dict[str, Any] | None) -> bool:
    return row is not None and isinstance(row.get("best"), (int, float)) and math.isfinite(row["best"])


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


# -- seed groups -------------------------------------------------------------------------------------
DEFAULT_SEED_KEYS = ["trainer.seed"]
GROUP_COLUMNS = [
    "group",
    "monitor",
    "mean",
    "std",
    "n",
    "min",
    "max",
    "final_mean",
    "final_std",
    "best_job",
    "jobs",
    "statuses",
    "overrides",
]


def seed_keys_of(sweep_dir: Path) -> list[str]:
    """The sweep's ``seed_keys`` (its multirun.yaml, as the sweep was composed), else the default.

    Args:
        sweep_dir: the sweep dir.

    Returns:
        The override keys that only change the seed (``DEFAULT_SEED_KEYS`` when multirun.yaml
            gives no list).
    """
    config = _read_yaml(sweep_dir / "multirun.yaml")
    keys = config.get("seed_keys") if isinstance(config, dict) else None
    return [str(k) for k in keys] if isinstance(keys, list) else list(DEFAULT_SEED_KEYS)


def _stats(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def group_rows(rows: list[dict[str, Any]], seed_keys: list[str]) -> list[dict[str, Any]] | None:
    """The sweep's seed groups, best mean first; None when no two jobs differ only in a seed key
    (the summary then stays one row per job). A failed or diverged member counts in the group's
    statuses, not in its statistics.

    Args:
        rows: the jobs' rows (``job_row``), with their ``override_values``.
        seed_keys: the override keys that only change the seed.

    Returns:
        One row per group, numbered by ``group`` in order, with the ``GROUP_COLUMNS`` values,
            its rule and its member rows; None when no seed key is overridden or no group has two jobs.
    """
    if not any(k in r["override_values"] for r in rows for k in seed_keys):
        return None
    groups: dict[tuple[tuple[str, str], ...], list[dict[str, Any]]] = {}
    for r in rows:
        key = tuple(
            sorted(
                (k, str(v)) for k, v in r["override_values"].items() if k not in seed_keys and key_kind(k) != "control"
            )
        )
        groups.setdefault(key, []).append(r)
    if all(len(members) < 2 for members in groups.values()):
        return None
    out = []
    for key, members in groups.items():
        members.sort(key=lambda r: job_order(Path(r["job"])))
        values = [float(m["best"]) for m in members if _usable(m)]
        finals = [
            float(m["final"]) for m in members if isinstance(m.get("final"), (int, float)) and math.isfinite(m["final"])
        ]
        mean, std = _stats(values)
        final_mean, final_std = _stats(finals)
        top = min(members, key=_sort_key)
        statuses: dict[str, int] = {}
        for m in members:
            statuses[str(m.get("status"))] = statuses.get(str(m.get("status")), 0) + 1
        out.append(
            {
                "monitor": members[0]["monitor"],
                "rule": members[0]["rule"],
                "mean": mean,
                "std": std,
                "n": len(values),
                "min": min(values, default=None),
                "max": max(values, default=None),
                "final_mean": final_mean,
                "final_std": final_std,
                "best_job": top["job"] if _usable(top) else None,
                "jobs": " ".join(m["job"] for m in members),
                "members": members,
                "statuses": " ".join(f"{n} {s}" for s, n in sorted(statuses.items())),
                "overrides": " ".join(f"{k}={v}" for k, v in key),
                "override_values": dict(key),
            }
        )
    sign = -1 if out[0]["rule"] == "greater" else 1
    out.sort(key=lambda g: (g["mean"] is None, sign * (g["mean"] or 0.0), g["jobs"]))
    for i, g in enumerate(out):
        g["group"] = i
    return out


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


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


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
    lines = _md_header(f"{len(rows)} jobs, best first by {rows[0]['monitor']} ({rows[0]['rule']})", sweep_dir, shown)
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
        f"{len(rows)} jobs, the Pareto front of {', '.join(f'{n} ({d})' for n, d in zip(names, directions, strict=True))} "
        f"first ({len(front)} jobs)"
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
    lines += ["", f"## {len(rows)} jobs, best first", "", "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
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


def plot_sweep(rows: list[dict[str, Any]], path: Path, seed_keys: list[str] | None = None) -> None:
    """Left: the monitored metric over epochs, one line per job. Then one panel per swept
    hyperparameter: each job's best value against its value (a log axis when positive
    values span 20x or more; names in order for values that are not numbers). With seed
    groups, each group's mean best value with its standard deviation, instead of each job's.

    An Optuna search gets one more panel: each trial's best value, and the best so far.

    Args:
        rows: the jobs' rows (``job_row``).
        path: the SVG file to write.
        seed_keys: the override keys that only change the seed; None: ``DEFAULT_SEED_KEYS``.
    """
    from expkit.loggers.svgplot import Panel, Series, charts

    groups = group_rows(rows, seed_keys or DEFAULT_SEED_KEYS) if rows else None
    keys = {k for r in rows for k in r["override_values"] if key_kind(k) != "control"}
    if groups is not None:
        keys -= set(seed_keys or DEFAULT_SEED_KEYS)
    swept = sorted(k for k in keys if len({r["override_values"].get(k) for r in rows}) > 1)  # values that vary
    monitor = rows[0]["monitor"] if rows else "value"
    jobs = sorted(rows, key=lambda r: (len(r["job"]), r["job"]))
    curves = [Series(r["curve"], label=f"{r['job']}: {r['overrides']}") for r in jobs if r["curve"]]
    panels = [Panel(f"{monitor} per job", curves, xlabel="epoch", ylabel=monitor, legend=True)]
    for key in swept or [""]:
        if groups is not None:
            panels.append(_group_panel(groups, key, monitor))
            continue
        points = [(r["override_values"].get(key), r.get("best"), r["job"]) for r in jobs]
        points = [p for p in points if p[0] is not None and isinstance(p[1], (int, float)) and math.isfinite(p[1])]
        panel = Panel(f"best {monitor}", [], xlabel=key or "(nothing swept)", ylabel=f"best {monitor}")
        xs = _axis(panel, [x for x, _, _ in points])
        panel.series = [
            Series([(x, y)], label=f"job {job}: {key}={raw}", line=False) for x, (raw, y, job) in zip(xs, points)
        ]
        panels.append(panel)
    objectives = search.objectives_of(path.parent)
    if objectives is not None and len(objectives[0]) >= 2:  # the first two objectives, the front drawn
        panels.append(_front_panel(rows, objectives))
    trials = sorted((r for r in rows if r.get("trial") is not None), key=lambda r: r["trial"])
    if trials and objectives is None:  # an Optuna search: each trial's best value, and the best so far over the trials
        pick = max if trials[0]["rule"] == "greater" else min
        done, so_far, best = [], [], None
        for r in trials:
            value = r.get("best")
            if isinstance(value, (int, float)) and math.isfinite(value):
                done.append(
                    Series(
                        [(float(r["trial"]), value)],
                        label=f"trial {r['trial']} (job {r['job']}): {r.get('status')}",
                        line=False,
                    )
                )
                if r.get("status") != "pruned":
                    best = value if best is None else pick(best, value)
            if best is not None:
                so_far.append((float(r["trial"]), best))
        series = [Series(so_far, label="best so far")] if so_far else []
        panels.append(Panel(f"search progress: best {monitor}", series + done, xlabel="trial", ylabel=monitor))
    charts(path, panels)


def _front_panel(rows: list[dict[str, Any]], objectives: tuple[list[str], list[str]]) -> Any:
    """Every finished job at its values of the first two objectives; the Pareto front as a line."""
    from expkit.loggers.svgplot import Panel, Series

    (x_name, y_name), (x_dir, y_dir) = objectives[0][:2], objectives[1][:2]
    points = [
        (r, (r.get("objectives") or {}).get(x_name), (r.get("objectives") or {}).get(y_name))
        for r in rows
        if r.get("status") == "completed"
    ]
    points = [(r, x, y) for r, x, y in points if x is not None and y is not None]
    front = sorted((x, y) for r, x, y in points if r.get("pareto"))
    series = [Series(front, label="Pareto front")] if front else []
    series += [Series([(x, y)], label=f"job {r['job']}", line=False) for r, x, y in points]
    return Panel(f"{x_name} ({x_dir}) against {y_name} ({y_dir})", series, xlabel=x_name, ylabel=y_name)


def _group_panel(groups: list[dict[str, Any]], key: str, monitor: str) -> Any:
    """Each seed group's mean best value against its value of `key`, with its standard deviation."""
    from expkit.loggers.svgplot import Panel, Series

    points = [(g["override_values"].get(key), g) for g in groups if g["mean"] is not None]
    points = [(x, g) for x, g in points if x is not None]
    panel = Panel(f"mean best {monitor} (± std)", [], xlabel=key or "(nothing swept)", ylabel=f"best {monitor}")
    xs = _axis(panel, [x for x, _ in points])
    panel.series = [
        Series(
            [(x, g["mean"])],
            label=f"group {g['group']} (n={g['n']}): {key}={raw}",
            line=False,
            errors=[g["std"] or 0.0],
        )
        for x, (raw, g) in zip(xs, points)
    ]
    return panel


def _axis(panel: Any, raw: list[Any]) -> list[float]:
    """x positions of `raw` values: numbers (a log axis when positive values span 20x or more),
    else categories (choice lists, strings, model names) in order, never read as numbers."""
    try:
        xs = [float(x) for x in raw]
        panel.log_x = bool(xs) and min(xs) > 0 and max(xs) / min(xs) >= 20
        return xs
    except ValueError:
        panel.categories = sorted({str(x) for x in raw})
        return [float(panel.categories.index(str(x))) for x in raw]


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


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
    launched = float(os.environ.get(SWEEP_LAUNCHED_ENV, "0") or 0) or None
    total = int(os.environ.get(SWEEP_JOBS_ENV, "0") or 0) or None
    row = next((r for r in rows if r["job"] == job), None)
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


class SweepSummaryCallback(Callback):
    """A Hydra callback (``hydra.callbacks``): records every job as it ends, in constant time
    (``record_job_end``: a crash leaves an up-to-date summary), and writes the whole summary,
    best first, with sweep.svg at the end of the sweep.

    Args:
        plot_each_job: whether each job's end writes the whole summary and sweep.svg again
            (reads every job: time in proportion to the jobs so far) instead of recording the job.
    """

    def __init__(self, plot_each_job: bool = False) -> None:
        self.plot_each_job = plot_each_job

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return
        if self.plot_each_job:  # the whole summary and sweep.svg: reads every job (O(jobs) per job)
            self._summarize(Path(hc.sweep.dir), plot=True)
            return
        try:
            record_job_end(Path(hc.sweep.dir), Path(hc.runtime.output_dir))
            line = progress_line(Path(hc.sweep.dir), job_target(Path(hc.runtime.output_dir)).name)
            log.info("%s", line)  # (the job's train.log; the terminal too with sweep_output=full)
            if config.get("sweep_output", "progress") != "full":
                print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)
        except Exception as exc:  # a summary must never fail the sweep
            log.warning("Could not record the job in %s: %s", hc.sweep.dir, exc)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        current = all((sweep_dir / name).is_file() for name in ("summary.csv", BEST_FILE, "sweep.svg"))
        sorted_already = current and not self.plot_each_job and not (sweep_dir / ROWS_DIR / UNSORTED).exists()
        best = read_best(sweep_dir) if sorted_already else None
        if best is None:  # (a best.json torn by a kill is written again too)
            best = self._summarize(sweep_dir, plot=True)
        if best and best.get("pareto_front") is not None:
            members = ", ".join(f"job {m['job']} ({m['values']})" for m in best["pareto_front"]) or "none"
            log.info("Sweep Pareto front of %s: %s", ", ".join(best["objectives"]), members)
        elif best and best.get("group") is not None and best["value"] is not None:
            spread = f" ± {best['std']:.4f}" if best.get("std") is not None else ""
            log.info(
                "Sweep best: %s, mean %s = %.4f%s over %d seeds; its best job %s (%s)",
                best["group"] or "(one group)",
                best["metric"],
                best["value"],
                spread,
                best["n"],
                best["job"],
                best["work_dir"],
            )
        elif best and best["job"] is not None:
            log.info("Sweep best: job %s, %s = %.4f, %s", best["job"], best["metric"], best["value"], best["work_dir"])
        interrupted = (best or {}).get("statuses", {}).get("interrupted", 0)
        if interrupted:  # (scancel of a cluster job: the sweep itself ended normally)
            log.warning(
                "%d job%s stopped by a signal before the end, saved: run the sweep command again with resume=true "
                "to finish %s (the completed jobs are not run again)",
                interrupted,
                "s" if interrupted > 1 else "",
                "them" if interrupted > 1 else "it",
            )

    def _summarize(self, sweep_dir: Path, plot: bool) -> dict[str, Any] | None:
        try:
            return summarize(sweep_dir, plot=plot)
        except Exception as exc:  # a summary must never fail the sweep
            log.warning("Could not summarize the sweep in %s: %s", sweep_dir, exc)
            return None


def rebuild(sweep_dir: Path, plot: bool = True, quiet: bool = False, seed_keys: list[str] | None = None) -> int:
    """Rebuild `sweep_dir`'s summary from disk and print it; the exit status (2: nothing to summarise).

    Args:
        sweep_dir: the sweep dir.
        plot: whether to draw sweep.svg too.
        quiet: whether to leave out summary.md and print only best.json.
        seed_keys: the override keys that only change the seed; None: the sweep's own setting.

    Returns:
        0 when the summary was written, 2 when the sweep dir holds no job dir.
    """
    # (checked first: summarizing takes the sweep's lock file, which a run dir must not be left holding)
    has_jobs = any(p.is_dir() and (p / ".hydra").is_dir() for p in sweep_dir.iterdir() if not p.name.startswith("."))
    best = summarize(sweep_dir, plot=plot, fresh=True, seed_keys=seed_keys) if has_jobs else None
    if best is None:
        print(f"Error: no job dirs (with .hydra/) in {sweep_dir}", file=sys.stderr)
        return 2
    if not quiet:
        print((sweep_dir / "summary.md").read_text())
    print(json.dumps(best, indent=2))
    return 0


def _hydra_argv(argv: list[str]) -> list[str]:
    """The older command line (``DIR [--no-plot] [--quiet]``) as Hydra's ``sweep_dir=DIR plot=false quiet=true``."""
    from expkit.config.cli import hydra_quoted, tokens

    aliases, out = {"--no-plot": "plot=false", "--quiet": "quiet=true"}, []
    for token in tokens(argv):
        arg = token[0]
        if len(token) == 1 and not arg.startswith("-") and ("=" not in arg or Path(arg).is_dir()):  # the sweep dir
            out.append(f"sweep_dir={hydra_quoted(arg)}")
        else:
            out += [aliases.get(arg, arg), *token[1:]]
    return out


def main() -> None:
    """``python -m expkit.sweep``: a Hydra app over conf/sweep.yaml (``--help``, ``--cfg job``).

    Raises:
        SystemExit: with status 2 when no ``sweep_dir`` is given, it is not a directory, or it
            holds no job dir.
    """

    from expkit.core import versions

    versions.require()
    sys.argv[1:] = argv = _hydra_argv(sys.argv[1:])
    asks_hydra = any(a in ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c") for a in argv)
    if not asks_hydra and not any(a.startswith("sweep_dir=") for a in argv):
        print("Error: which sweep? python -m expkit.sweep sweep_dir=outputs/sweeps/<sweep>", file=sys.stderr)
        sys.exit(2)

    @hydra_compat.main(config_path="conf", config_name="sweep")
    def run(cfg: Any) -> None:
        sweep_dir = Path(cfg.sweep_dir)
        if not sweep_dir.is_dir():  # (Hydra parsed it: quotes, interpolations, the last of several)
            print(
                f"Error: sweep_dir={sweep_dir} is not a directory; give a sweep dir (outputs/sweeps/<sweep>)",
                file=sys.stderr,
            )
            sys.exit(2)
        keys = cfg.get("seed_keys")
        code = rebuild(
            sweep_dir,
            plot=bool(cfg.plot),
            quiet=bool(cfg.quiet),
            seed_keys=None if keys is None else [str(k) for k in keys],
        )
        if code:
            sys.exit(code)

    run()


if __name__ == "__main__":
    main()
