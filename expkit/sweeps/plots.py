"""sweep.svg: a sweep's learning curves, and each job's (or seed group's) best value against
every swept hyperparameter; the Pareto front of a search of several objectives, the progress of
an Optuna search."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from expkit.sweeps import search
from expkit.sweeps.rows import DEFAULT_SEED_KEYS, group_rows
from expkit.sweeps.sweep_jobs import key_kind

__all__ = ["plot_sweep"]


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
    # a job is one key, so one color, in every panel: its line, its points and its legend entry
    curves = [
        Series(r["curve"], label=f"{r['job']}: {r['overrides']}", key=f"job {r['job']}") for r in jobs if r["curve"]
    ]
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
            Series([(x, y)], label=f"job {job}: {key}={raw}", line=False, key=f"job {job}")
            for x, (raw, y, job) in zip(xs, points)
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
                        key=f"job {r['job']}",
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
    series += [Series([(x, y)], label=f"job {r['job']}", line=False, key=f"job {r['job']}") for r, x, y in points]
    short = {"maximize": "max", "minimize": "min"}
    return Panel(f"{x_name} ({short[x_dir]}) vs {y_name} ({short[y_dir]})", series, xlabel=x_name, ylabel=y_name)


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
            key=f"group {g['group']}",
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
