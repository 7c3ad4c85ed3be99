"""A sweep job's row: what its dir holds (result.json, or metrics.jsonl while it runs), in the
columns of the summary; and the seed groups of jobs that differ only in their seed.

``job_row`` reads a job dir the way the summaries (``expkit.sweeps.summary``), the plots and
``expkit.compare`` all see it.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import yaml

from expkit.metrics import monitor_of
from expkit.sweeps.search import objective_values, objectives_of
from expkit.sweeps.sweep_jobs import finished, job_order, key_kind
from expkit.workdir.records import RESULT, read_job, read_records, read_result

__all__ = ["COLUMNS", "DEFAULT_SEED_KEYS", "GROUP_COLUMNS", "group_rows", "job_row", "seed_keys_of"]

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


def _usable(row: dict[str, Any] | None) -> bool:
    return row is not None and isinstance(row.get("best"), (int, float)) and math.isfinite(row["best"])


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


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
