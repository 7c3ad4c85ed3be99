"""``python -m expkit.compare <run or sweep dirs, globs>``: compare runs that were made apart.

Any set of work dirs: single runs, sweep jobs, torchrun runs, last week's baseline beside
today's three seeds; a sweep dir stands for its job dirs. Each run's row comes from its own
files, read as a sweep's summary reads them (``expkit.sweeps.rows.job_row``): its
``.hydra/config.yaml`` and the choices of its config groups (``.hydra/hydra.yaml``), its
``result.json`` and its ``metrics.jsonl``. It writes, in ``out``:

  compare.md    the config keys that differ between the runs, each run's status and its final and
                best metrics, and the runs that differ only in a seed key as groups (mean ± std, n)
  compare.svg   one panel per metric: each run's curve, or each group's mean curve with its spread

A failed run is shown as failed, not dropped. A dir named on its own that holds no run is refused
(exit 2); one that a glob matches, or that lies in a sweep or parent dir, is skipped and named.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from expkit.config import cli
from expkit.core import hydra_compat
from expkit.core.atomic import write_text_atomic
from expkit.core.errors import ConfigError, config_errors_exit_2, counted
from expkit.sweeps.rows import DEFAULT_SEED_KEYS, _read_yaml, group_rows, job_row
from expkit.sweeps.summary import _cell
from expkit.sweeps.sweep_jobs import job_order, job_target
from expkit.workdir.records import read_records, read_result

__all__ = ["Comparison", "compare", "find_runs", "main", "plot", "render", "run", "write"]


log = logging.getLogger("expkit")

ABSENT = "—"  # a key a run's config does not have
GLOB_CHARACTERS = "*?["


def _is_run(path: Path) -> bool:
    """A work dir of a run: Hydra's record and a run's own (an lr_find dir, a fresh dir have none)."""
    return (path / ".hydra").is_dir() and any((path / name).is_file() for name in ("result.json", "metrics.jsonl"))


def _left_no_run(path: Path) -> bool:
    """A dir a command left when it failed before its run started (``load_from=`` or ``resume=`` of a
    missing file): Hydra's record, no result.json or metrics.jsonl."""
    return (path / ".hydra").is_dir() and not _is_run(path)


def find_runs(
    patterns: Sequence[str], skipped: list[Path] | None = None, command: str = "expkit.compare"
) -> list[Path]:
    """The run dirs that `patterns` name: each one a dir or a glob; a dir that is no run stands for
    the runs directly inside it (a sweep dir: its job dirs, in Hydra's order). A dir that a glob
    matches, or that lies inside a given dir, and that holds no run is passed over (and added to
    `skipped`): a glob over ``outputs/runs`` meets the dirs of commands that failed at start-up.

    Args:
        patterns: run dirs, sweep dirs or glob patterns (``outputs/runs/2026-11-*``), in order.
        skipped: a list the dirs passed over are appended to; None: not told.
        command: the command whose runs these are, as the message for no pattern names it.

    Returns:
        The run dirs, each once (a sweep job that stands for another job dir, its alias, as that dir), in
            the order given.

    Raises:
        ConfigError: when no pattern is given, a pattern matches nothing, a dir named without a glob
            holds no run, or a pattern's dirs hold no run at all.
    """
    if not patterns:
        raise ConfigError(
            f"which runs? give run dirs, sweep dirs or globs: python -m {command} outputs/runs/A outputs/sweeps/B"
        )
    passed_over = skipped if skipped is not None else []
    found: list[Path] = []
    for pattern in patterns:
        is_glob = any(c in pattern for c in GLOB_CHARACTERS)
        matches = sorted(glob.glob(pattern)) if is_glob else [pattern]
        dirs = [Path(m) for m in matches if Path(m).is_dir()]
        if not dirs:
            what = "matches no dir" if matches != [pattern] else "is not a directory"
            raise ConfigError(f"{pattern} {what}; give run dirs, sweep dirs or globs of them")
        runs_of_pattern = 0
        for directory in dirs:
            if _is_run(directory):
                found.append(directory)
                runs_of_pattern += 1
                continue
            inside = [p for p in directory.iterdir() if p.is_dir()]
            jobs = sorted((p for p in inside if _is_run(p)), key=job_order)
            passed_over += sorted(p for p in inside if _left_no_run(p))
            if not jobs and is_glob:
                passed_over.append(directory)
                continue
            if not jobs:
                raise ConfigError(
                    f"{directory} holds no run: neither it nor a dir directly inside it has .hydra/ with a "
                    "result.json or metrics.jsonl; give a run's work dir or a sweep dir"
                )
            found += jobs
            runs_of_pattern += len(jobs)
        if not runs_of_pattern:
            raise ConfigError(
                f"{pattern}: none of the {len(dirs)} dirs it matches holds a run (a result.json or "
                "metrics.jsonl beside .hydra/); give run dirs, sweep dirs or globs of them"
            )
    unique: dict[Path, Path] = {}
    for path in found:
        target = job_target(path)  # (a resumed sweep's alias: the dir it stands for; confined to the sweep)
        unique.setdefault(target.resolve(), target)
    return list(unique.values())


def _labels(paths: list[Path]) -> list[str]:
    """Short names that tell the runs apart: the fewest trailing parts of each path that no other
    run's path ends with (``a``, ``sweep_x/0``: a sweep job by its sweep too); spaces become ``_`` (a
    group's row lists its runs' names with spaces)."""
    parts = [p.resolve().parts for p in paths]
    labels = []
    for mine in parts:
        for n in range(2 if mine[-1].isdigit() else 1, len(mine) + 1):
            tail = mine[-n:]
            if all(other[-n:] != tail for other in parts if other is not mine):
                break
        labels.append("/".join(tail).replace(" ", "_"))
    return labels


def _flat(node: Any, prefix: str = "") -> dict[str, str]:
    """A config as dotted keys and their values as text (a list or an empty node as one value)."""
    if isinstance(node, dict) and node:
        out: dict[str, str] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    text = json.dumps(node) if isinstance(node, (dict, list)) else "null" if node is None else str(node)
    return {prefix[:-1]: text}


def _settings(work_dir: Path) -> dict[str, str]:
    """What a run was composed from: its config's keys and its groups' choices (``model: cnn``);
    its overrides when the config cannot be read."""
    config = _read_yaml(work_dir / ".hydra" / "config.yaml")
    if not isinstance(config, dict):
        overrides = _read_yaml(work_dir / ".hydra" / "overrides.yaml") or []
        return dict(o.split("=", 1) for o in overrides if isinstance(o, str) and "=" in o)
    values = _flat(config)
    hydra = _read_yaml(work_dir / ".hydra" / "hydra.yaml")
    choices = ((hydra or {}).get("hydra") or {}).get("runtime", {}).get("choices") if isinstance(hydra, dict) else None
    for group, option in (choices or {}).items() if isinstance(choices, dict) else ():
        if not str(group).startswith("hydra"):  # Hydra's own groups, expkit's choices in them
            values.setdefault(str(group), "null" if option is None else str(option))
    return values


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rule_of(result: dict[str, Any] | None, config: Any, metric: str) -> str:
    from expkit.metrics import monitor_of

    recorded = ((result or {}).get("best_metrics") or {}).get(metric) or {}
    if recorded.get("rule") in ("greater", "less"):
        return recorded["rule"]
    return monitor_of({**(config if isinstance(config, dict) else {}), "monitor": metric})[1]


def _for_metric(row: dict[str, Any], metric: str, records: list[dict[str, Any]]) -> None:
    """`row` (``job_row``'s, for the run's own monitor) made to speak of `metric` instead."""
    work_dir = Path(row["work_dir"])
    result = read_result(work_dir)
    rule = _rule_of(result, _read_yaml(work_dir / ".hydra" / "config.yaml"), metric)
    curve = [[r["epoch"], r[metric]] for r in records if metric in r and "epoch" in r]
    row.update(monitor=metric, rule=rule, curve=curve)
    if result is not None:  # (its best and final metrics hold the val and test keys, not train/loss: the curve's)
        best = ((result.get("best_metrics") or {}).get(metric)) or {}
        final = (result.get("final_metrics") or {}).get(metric)
        if best or final is not None:
            row.update(best=best.get("value"), best_epoch=best.get("epoch"), final=final)
            return
    values = [v for _, v in curve if _finite(v)]
    best_value = (max if rule == "greater" else min)(values) if values else None
    row.update(
        best=best_value,
        best_epoch=next((e for e, v in curve if v == best_value), None),
        final=values[-1] if values else None,
    )


@dataclass
class Comparison:
    """What ``compare`` found: the runs' rows (``expkit.sweeps.rows.job_row``'s, one per run, in the
    order given), the keys that differ, the seed groups and each run's records.

    Args:
        rows: one row per run; ``job`` is the run's short name, ``override_values`` its values of
            ``differing``, ``settings`` all its config keys, ``result`` its result.json (or None).
        metric: the compared metric (the runs' monitor unless given).
        rule: its direction, ``greater`` or ``less``.
        differing: the config keys (and group choices) whose values are not the same in every run.
        seed_keys: the keys that only change the seed.
        groups: ``expkit.sweeps.rows.group_rows``' groups (best mean first); None when no two runs differ
            only in a seed key.
        records: each run's ``metrics.jsonl`` records, by its short name.
        monitors: the runs' own monitors, when they are not all the compared metric.
    """

    rows: list[dict[str, Any]]
    metric: str
    rule: str
    differing: list[str]
    seed_keys: list[str]
    groups: list[dict[str, Any]] | None
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    monitors: dict[str, str] = field(default_factory=dict)


def compare(run_dirs: Sequence[Path], metric: str | None = None, seed_keys: Sequence[str] | None = None) -> Comparison:
    """Read the runs and compare them.

    Args:
        run_dirs: the runs' work dirs (``find_runs``).
        metric: the metric compared (a key of ``metrics.jsonl``/result.json, ``val/loss``); None: the
            monitor of the first run.
        seed_keys: the keys that only change the seed; None: the runs' own ``seed_keys`` (all of them).

    Returns:
        The comparison.

    Raises:
        ConfigError: when `run_dirs` is empty.
    """
    if not run_dirs:
        raise ConfigError("no runs to compare")
    rows, records = [], {}
    for path, label in zip(run_dirs, _labels(list(run_dirs))):
        row = job_row(path)
        if row is None:  # (a dir find_runs accepted: only if it changed since)
            raise ConfigError(f"{path} holds no run (no .hydra/)")
        row["job"] = label
        row["settings"] = _settings(path)
        row["result"] = read_result(path)
        records[label] = read_records(path)
        rows.append(row)
    monitors = {r["job"]: r["monitor"] for r in rows}
    if metric is not None:
        reported = _reported(rows, records)
        if reported and metric not in reported:
            raise ConfigError(f"metric={metric}: no run reports it; they report {', '.join(sorted(reported))}")
    metric = metric or rows[0]["monitor"]
    for row in rows:
        if row["monitor"] != metric:
            _for_metric(row, metric, records[row["job"]])
    if seed_keys is None:
        own = [row["settings"].get("seed_keys") for row in rows]
        keys = {str(k) for text in own if text for k in _json_list(text)}
        seed_keys = sorted(keys) or list(DEFAULT_SEED_KEYS)
    every = sorted({k for row in rows for k in row["settings"]})
    differing = [k for k in every if len({row["settings"].get(k, ABSENT) for row in rows}) > 1]
    for row in rows:
        row["override_values"] = {k: row["settings"].get(k, ABSENT) for k in differing}
    groups = group_rows(rows, list(seed_keys)) if len(rows) > 1 else None
    shown_monitors = monitors if any(m != metric for m in monitors.values()) else {}
    return Comparison(rows, metric, rows[0]["rule"], differing, list(seed_keys), groups, records, shown_monitors)


def _reported(rows: list[dict[str, Any]], records: dict[str, list[dict[str, Any]]]) -> set[str]:
    """The metric keys any run reports: in its result.json or its records (not the step counters)."""
    keys = {
        k for r in rows for part in ("final_metrics", "best_metrics") for k in ((r["result"] or {}).get(part) or {})
    }
    return keys | {k for runs in records.values() for record in runs for k in record if "/" in k}


def _json_list(text: str) -> list[Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return value if isinstance(value, list) else []


# -- compare.md --------------------------------------------------------------------------------------
def _number(value: Any) -> str:
    return f"{value:.4f}" if _finite(value) else ""


def _spread(mean: Any, std: Any) -> str:
    if not _finite(mean):
        return ""
    return f"{mean:.4f} ± {std:.4f}" if _finite(std) else f"{mean:.4f}"


def _some(names: list[str], shown: int = 4) -> str:
    """Up to `shown` names, then how many more (``a, b, c, d and 12 more``)."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(_cell(c) for c in line) + " |" for line in lines]


def _monitors_line(c: Comparison) -> list[str]:
    """What the runs monitor, when that is not the compared metric: the line and a blank one."""
    own = sorted(set(c.monitors.values()))
    if len(own) == 1:
        return [f"The runs monitor {own[0]}; compared here by {c.metric}.", ""]
    if not own:
        return []
    by_metric = {m: [job for job, mine in c.monitors.items() if mine == m] for m in own}
    listed = "; ".join(f"{m} by {_some(jobs)}" for m, jobs in by_metric.items())
    return [f"The runs monitor different metrics ({listed}); all are compared by {c.metric}.", ""]


def render(comparison: Comparison) -> str:
    """compare.md: the runs, the keys that differ, the seed groups, every run's final and best metrics.

    Args:
        comparison: what ``compare`` found.

    Returns:
        The Markdown text.
    """
    c = comparison
    rows = c.rows
    lines = [f"# Compare {counted(len(rows), 'run')} by {c.metric} ({c.rule})", ""]
    lines += _monitors_line(c)
    lines += ["## Runs", ""]
    lines += _table(
        ["run", "status", f"best {c.metric}", "best epoch", f"final {c.metric}", "wall time (s)", "work dir", "error"],
        [
            [
                r["job"],
                str(r.get("status")),
                _number(r.get("best")),
                "" if r.get("best_epoch") is None else str(r["best_epoch"]),
                _number(r.get("final")),
                f"{r['wall_time_s']:.1f}" if _finite(r.get("wall_time_s")) else "",
                r["work_dir"],
                (str(r.get("error") or ""))[:120],
            ]
            for r in rows
        ],
    )
    lines += ["", "## Config keys that differ", ""]
    if c.differing:
        lines += _table(
            ["key", *(r["job"] for r in rows)], [[k, *(r["override_values"][k] for r in rows)] for k in c.differing]
        )
    else:
        lines.append("None: the runs were composed from the same config.")
    if c.groups is not None:
        lines += [
            "",
            f"## Groups: runs that differ only in {', '.join(c.seed_keys)}, best mean first",
            "",
        ]
        lines += _table(
            [
                "group",
                "runs",
                "n",
                f"best {c.metric} (mean ± std)",
                f"final {c.metric} (mean ± std)",
                "statuses",
                "keys",
            ],
            [
                [
                    str(g["group"]),
                    g["jobs"],
                    str(g["n"]),
                    _spread(g["mean"], g["std"]),
                    _spread(g["final_mean"], g["final_std"]),
                    g["statuses"],
                    " ".join(f"{k}={v}" for k, v in g["override_values"].items()) or "(the same)",
                ]
                for g in c.groups
            ],
        )
    lines += ["", "## Final and best metrics", ""]
    finals = sorted({k for r in rows for k in ((r["result"] or {}).get("final_metrics") or {})})
    bests = sorted({k for r in rows for k in ((r["result"] or {}).get("best_metrics") or {})})
    header = ["run", *(f"best {k}" for k in bests), *(f"final {k}" for k in finals)]
    body = []
    for r in rows:
        result = r["result"] or {}
        best = result.get("best_metrics") or {}
        final = result.get("final_metrics") or {}
        body.append(
            [
                r["job"],
                *(_number((best.get(k) or {}).get("value")) for k in bests),
                *(_number(final.get(k)) for k in finals),
            ]
        )
    lines += _table(header, body)
    return "\n".join(lines) + "\n"


# -- compare.svg -------------------------------------------------------------------------------------
def _curve(records: list[dict[str, Any]], key: str, x_key: str) -> list[tuple[float, float]]:
    return [(float(r[x_key]), float(r[key])) for r in records if _finite(r.get(key)) and _finite(r.get(x_key))]


def _mean_curve(curves: list[list[tuple[float, float]]]) -> tuple[list[tuple[float, float]], list[float]]:
    """The mean at each x that any member has, and the standard deviation there (0 with one value)."""
    at: dict[float, list[float]] = {}
    for curve in curves:
        for x, y in curve:
            at.setdefault(x, []).append(y)
    xs = sorted(at)
    points = [(x, statistics.fmean(at[x])) for x in xs]
    errors = [statistics.stdev(at[x]) if len(at[x]) > 1 else 0.0 for x in xs]
    return points, errors


def plot(comparison: Comparison, path: Path) -> None:
    """compare.svg: one panel per metric (the compared one first, then the other ``val/`` metrics
    and ``train/loss``), a line per run, or per seed group its mean with the standard deviation.

    Args:
        comparison: what ``compare`` found.
        path: the SVG file to write.
    """
    from expkit.loggers.svgplot import Panel, Series, charts

    c = comparison
    keys = {k for records in c.records.values() for r in records for k in r}
    others = sorted(k for k in keys if k.startswith("val/") and k != c.metric)
    metrics = [c.metric, *others] + (["train/loss"] if "train/loss" in keys and c.metric != "train/loss" else [])
    by_job = {r["job"]: r for r in c.rows}
    units = [(g["jobs"].split(), g) for g in c.groups] if c.groups is not None else [([r["job"]], None) for r in c.rows]
    panels = []
    for key in metrics:
        x_key = "step" if key.startswith("train/") else "epoch"
        series = []
        for jobs, group in units:
            curves = [_curve(c.records[j], key, x_key) for j in jobs]
            keys_text = " ".join(f"{k}={v}" for k, v in (group or by_job[jobs[0]])["override_values"].items())
            if len(jobs) == 1:
                status = by_job[jobs[0]].get("status")
                series.append(Series(curves[0], label=f"{jobs[0]} ({status}): {keys_text}".rstrip(": ")))
            else:
                points, errors = _mean_curve(curves)
                label = f"group {group['group']} (n={len(jobs)}: {' '.join(jobs)}): {keys_text}"  # type: ignore[index]
                series.append(Series(points, label=label.rstrip(": "), errors=errors))
        title = f"{key} (mean ± std per group)" if c.groups is not None else key
        panels.append(Panel(title, series, xlabel=x_key, ylabel=key, legend=True))
    charts(path, panels)


def write(comparison: Comparison, out: Path) -> tuple[Path, Path]:
    """Write compare.md and compare.svg into `out` (made when missing).

    Args:
        comparison: what ``compare`` found.
        out: the dir to write into.

    Returns:
        The paths of compare.md and compare.svg.
    """
    out.mkdir(parents=True, exist_ok=True)
    md, svg = out / "compare.md", out / "compare.svg"
    write_text_atomic(md, render(comparison))
    plot(comparison, svg)
    return md, svg


# -- the command -------------------------------------------------------------------------------------
@hydra_compat.main(config_path="conf", config_name="compare")
def run(cfg: DictConfig) -> None:
    """Hydra's task function: bad input exits 2 with one line.

    Args:
        cfg: the composed ``compare.yaml`` config; Hydra composes it from the command line and passes
            it, so the function is called with no arguments (as ``main`` does).

    Raises:
        SystemExit: with status 2 for bad input: no runs given, a pattern that matches nothing, a dir
            that holds no run.
    """
    with config_errors_exit_2():
        keys = cfg.get("seed_keys")
        skipped: list[Path] = []
        runs = find_runs([str(p) for p in cfg.runs or []], skipped)
        if skipped:
            shown = ", ".join(str(p) for p in skipped[:5]) + (
                f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
            )
            print(
                f"Skipped {len(skipped)} dir(s) that hold no run (a command that failed before its run started, "
                f"or no run dir at all): {shown}",
                file=sys.stderr,
            )
        comparison = compare(
            runs,
            metric=cfg.get("metric"),
            seed_keys=None if keys is None else [str(k) for k in keys],
        )
        md, svg = write(comparison, Path(str(cfg.out)))
    print(md.read_text())
    print(f"Written: {md} and {svg}")


def _hydra_argv(argv: list[str]) -> list[str]:
    """Bare words (run dirs, sweep dirs, globs) as Hydra's ``runs=[...]``, added to an explicit one."""
    out, given = [], []
    for token in cli.tokens(argv):
        arg = token[0]
        if len(token) == 1 and not arg.startswith("-") and ("=" not in arg or Path(arg).is_dir()):
            given.append(arg)
        else:
            out += token
    if not given:
        return out
    quoted = ",".join(cli.hydra_quoted(a) for a in given)
    explicit = next((i for i, a in enumerate(out) if a.startswith("runs=")), None)
    if explicit is None:
        return [*out, f"runs=[{quoted}]"]
    inner = out[explicit].split("=", 1)[1].strip()
    inner = inner[1:-1] if inner.startswith("[") and inner.endswith("]") else inner
    out[explicit] = f"runs=[{inner + ',' if inner else ''}{quoted}]"
    return out


def main() -> None:
    """``python -m expkit.compare``: a Hydra app over conf/compare.yaml (``--help``, ``--cfg job``).

    Raises:
        SystemExit: with status 2 for bad input (also Hydra's own errors), 0 when compare.md and
            compare.svg were written.
    """
    cli.dirs_command_main(run, _hydra_argv)


if __name__ == "__main__":
    main()
