"""Sweep summaries, built from the job dirs on disk: ``python -m expkit.sweep <sweep dir>``.

Reading the disk (not a callback's memory) makes it work with every launcher (joblib,
submitit and ray run jobs in other processes), after failures (Hydra skips
``on_multirun_end`` when a job raised) and while a sweep is still running. It writes, in
the sweep dir:

  summary.csv, summary.md   one row per job, best first
  best.json                 the best job: metric, value, epoch, work dir, checkpoint, overrides
  sweep.svg                 the monitored metric over epochs per job, and the best value
                            against each swept hyperparameter
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

from expkit.checkpoint_io import write_json_atomic, write_text_atomic
from expkit.metrics import infer_rule, rule_of_flag

log = logging.getLogger("expkit")

COLUMNS = ["job", "status", "resumed", "monitor", "best", "best_epoch", "final", "wall_time_s", "overrides",
           "best_checkpoint", "work_dir", "error"]  # fmt: skip


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: ~10x faster than pure Python


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.load(path.read_text(), Loader=_YAML_LOADER)  # a safe loader (C or Python)
    except (OSError, yaml.YAMLError):
        return None


def _records(work_dir: Path) -> list[dict[str, Any]]:
    path = work_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            continue
    return records


def monitor_of(config: dict[str, Any] | None) -> tuple[str, str]:
    """The job's monitored metric and its rule as far as its config tells (before the run
    decided it: a run records the rule it used as result.json's ``monitor_rule``, which wins)."""
    config = config or {}
    monitor = str(config.get("monitor") or "val/acc")
    metric = (config.get("metrics") or {}).get(monitor.partition("/")[2].split("/")[0])
    rule = rule_of_flag(metric.get("higher_is_better")) if isinstance(metric, dict) else None
    if rule is None:
        rule = ((config.get("default_hooks") or {}).get("checkpoint") or {}).get("rule")
        rule = (rule[0] if rule else None) if isinstance(rule, list) else rule
    return monitor, rule or infer_rule(monitor) or "greater"


def job_row(work_dir: Path) -> dict[str, Any] | None:
    """One job's row, from its result.json, or from metrics.jsonl while it runs."""
    hydra_dir = work_dir / ".hydra"
    if not hydra_dir.is_dir() or "alias_of" in (read_job(work_dir) or {}):
        return None
    config = _read_yaml(hydra_dir / "config.yaml")
    overrides = _read_yaml(hydra_dir / "overrides.yaml") or []
    monitor, rule = monitor_of(config)
    row: dict[str, Any] = {
        "job": work_dir.name,
        "monitor": monitor,
        "rule": rule,
        "overrides": " ".join(o for o in overrides if not o.startswith("resume=")),
        "override_values": dict(o.split("=", 1) for o in overrides if "=" in o),
        "work_dir": str(work_dir.resolve()),
    }
    result_path = work_dir / "result.json"
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    if result is not None and result.get("monitor") == monitor and result.get("monitor_rule") in ("greater", "less"):
        row["rule"] = rule = result["monitor_rule"]  # the direction the run itself used
    records = _records(work_dir)
    curve = [(r["epoch"], r[monitor]) for r in records if monitor in r and "epoch" in r]
    row["curve"] = curve
    if result is not None:
        best = (result.get("best_metrics") or {}).get(monitor) or {}
        row.update(
            status=result.get("status"),
            best=best.get("value"),
            best_epoch=best.get("epoch"),
            final=(result.get("final_metrics") or {}).get(monitor),
            wall_time_s=result.get("wall_time_s"),
            best_checkpoint=(result.get("best_checkpoints") or {}).get(monitor) or result.get("best_checkpoint"),
            error=result.get("error"),
            resumed=bool(result.get("resumed_in_sweep", False)),
            trial=result.get("optuna_trial"),
        )
    else:  # still running (or killed): what metrics.jsonl shows so far
        values = [v for _, v in curve if isinstance(v, (int, float)) and math.isfinite(v)]
        pick = max if rule == "greater" else min
        best = pick(values) if values else None
        row.update(status="running", best=best, best_epoch=next((e for e, v in curve if v == best), None),
                   final=values[-1] if values else None)  # fmt: skip
    return row


def _sort_key(row: dict[str, Any]) -> tuple:
    value = row.get("best")
    usable = isinstance(value, (int, float)) and math.isfinite(value)
    sign = -1 if row.get("rule") == "greater" else 1
    # a pruned job ranks after every job that ran to its end (as in the Optuna study's best trial)
    return (not usable, row.get("status") == "pruned", sign * value if usable else 0.0, row["job"])


def summarize(sweep_dir: str | Path, plot: bool = True) -> dict[str, Any] | None:
    """Write summary.csv, summary.md, best.json (and sweep.svg) for `sweep_dir`; returns best.json's content."""
    sweep_dir = Path(sweep_dir)
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=lambda p: (len(p.name), p.name))
    rows = [row for row in (job_row(p) for p in jobs) if row is not None]
    if not rows:
        return None
    rows.sort(key=_sort_key)

    columns = COLUMNS[:1] + ["trial"] + COLUMNS[1:] if any(r.get("trial") is not None for r in rows) else COLUMNS
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(sweep_dir / "summary.csv", buffer.getvalue())

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4f}"
        return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")[:120]

    shown = [c for c in columns if c not in ("work_dir", "error")] + ["error"]
    lines = [f"# Sweep {sweep_dir.name}: {len(rows)} jobs, best first by {rows[0]['monitor']} ({rows[0]['rule']})", "",
             "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]  # fmt: skip
    lines += ["| " + " | ".join(cell(r.get(c)) for c in shown) + " |" for r in rows]
    write_text_atomic(sweep_dir / "summary.md", "\n".join(lines) + "\n")

    top = rows[0]
    usable = isinstance(top.get("best"), (int, float)) and math.isfinite(top["best"])
    best = {
        "job": top["job"] if usable else None,
        "metric": top["monitor"],
        "rule": top["rule"],
        "value": top["best"] if usable else None,
        "epoch": top.get("best_epoch") if usable else None,
        "work_dir": top["work_dir"] if usable else None,
        "best_checkpoint": top.get("best_checkpoint") if usable else None,
        "overrides": top["overrides"].split() if usable and top["overrides"] else [],
        "jobs": len(rows),
        "statuses": {s: sum(r.get("status") == s for r in rows) for s in sorted({str(r.get("status")) for r in rows})},
        "resumed_jobs": sorted((r["job"] for r in rows if r.get("resumed")), key=lambda j: (len(j), j)),
    }
    write_json_atomic(sweep_dir / "best.json", best)
    if plot:
        plot_sweep(rows, sweep_dir / "sweep.svg")
    return best


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> None:
    """Left: the monitored metric over epochs, one line per job. Then one panel per swept
    hyperparameter: each job's best value against its value (a log axis when positive
    values span 20x or more; names in order for values that are not numbers)."""
    from expkit.svgplot import Panel, Series, charts

    keys = {k for r in rows for k in r["override_values"]} - {"hydra.sweep.dir", "hydra.run.dir"}
    swept = sorted(k for k in keys if len({r["override_values"].get(k) for r in rows}) > 1)  # values that vary
    monitor = rows[0]["monitor"] if rows else "value"
    jobs = sorted(rows, key=lambda r: (len(r["job"]), r["job"]))
    curves = [Series(r["curve"], label=f"{r['job']}: {r['overrides']}") for r in jobs if r["curve"]]
    panels = [Panel(f"{monitor} per job", curves, xlabel="epoch", ylabel=monitor, legend=True)]
    for key in swept or [""]:
        points = [(r["override_values"].get(key), r.get("best"), r["job"]) for r in jobs]
        points = [p for p in points if p[0] is not None and isinstance(p[1], (int, float)) and math.isfinite(p[1])]
        panel = Panel(f"best {monitor}", [], xlabel=key or "(nothing swept)", ylabel=f"best {monitor}")
        try:
            xs = [float(x) for x, _, _ in points]
            panel.log_x = bool(xs) and min(xs) > 0 and max(xs) / min(xs) >= 20
        except ValueError:  # categorical values
            panel.categories = sorted({str(x) for x, _, _ in points})
            xs = [float(panel.categories.index(str(x))) for x, _, _ in points]
        panel.series = [Series([(x, y)], label=f"job {job}: {key}={raw}", line=False)
                        for x, (raw, y, job) in zip(xs, points)]  # fmt: skip
        panels.append(panel)
    trials = sorted((r for r in rows if r.get("trial") is not None), key=lambda r: r["trial"])
    if trials:  # an Optuna search: each trial's best value, and the best so far over the trials
        pick = max if trials[0]["rule"] == "greater" else min
        done, so_far, best = [], [], None
        for r in trials:
            value = r.get("best")
            if isinstance(value, (int, float)) and math.isfinite(value):
                done.append(Series([(float(r["trial"]), value)], label=f"trial {r['trial']} (job {r['job']}): "
                                   f"{r.get('status')}", line=False))  # fmt: skip
                if r.get("status") != "pruned":
                    best = value if best is None else pick(best, value)
            if best is not None:
                so_far.append((float(r["trial"]), best))
        series = [Series(so_far, label="best so far")] if so_far else []
        panels.append(Panel(f"search progress: best {monitor}", series + done, xlabel="trial", ylabel=monitor))
    charts(path, panels)


JOB_FILE = "job.json"  # a job's identity in a sweep; Hydra never writes it


def job_identity(overrides: list[str]) -> list[str]:
    """What makes a job the same job across launches: its overrides, sorted, without
    resume= and hydra.* (so reordering values on the command line changes nothing)."""
    return sorted(o for o in overrides if not o.lstrip("+~").startswith(("resume=", "hydra.")))


def read_job(work_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((work_dir / JOB_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def record_job(work_dir: Path, identity: list[str]) -> None:
    """job.json: the identity, and a copy of the job's .hydra files (Hydra rewrites .hydra/ of
    <sweep>/<n> at every launch, so a resumed sweep with reordered values can put them back)."""
    hydra_files = {p.name: p.read_text() for p in (work_dir / ".hydra").glob("*.yaml")}
    write_json_atomic(work_dir / JOB_FILE, {"overrides": identity, "hydra": hydra_files})


def restore_hydra_record(work_dir: Path, job: dict[str, Any]) -> None:
    for name, text in job.get("hydra", {}).items():
        write_text_atomic(work_dir / ".hydra" / name, text)


def job_result(work_dir: Path) -> dict[str, Any] | None:
    """A job's result.json, where the job really ran (a resumed job's dir may point to another: alias_of)."""
    target = Path((read_job(work_dir) or {}).get("alias_of") or work_dir)
    try:
        return json.loads((target / "result.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def find_job(sweep_dir: Path, identity: list[str]) -> Path | None:
    """The dir in `sweep_dir` that holds the job with this identity, if any."""
    for candidate in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        job = read_job(candidate)
        if job is not None and job.get("overrides") == identity and "alias_of" not in job:
            return candidate
    return None


class SweepSummaryCallback(Callback):
    """A Hydra callback (``hydra.callbacks``): rebuilds the summary after every job (so a
    crash leaves an up-to-date summary) and at the end of the sweep."""

    def __init__(self, plot_each_job: bool = False) -> None:
        self.plot_each_job = plot_each_job

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            self._summarize(Path(hc.sweep.dir), plot=self.plot_each_job)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        best = self._summarize(Path(config.hydra.sweep.dir), plot=True)
        if best and best["job"] is not None:
            log.info("Sweep best: job %s, %s = %.4f, %s", best["job"], best["metric"], best["value"], best["work_dir"])

    def _summarize(self, sweep_dir: Path, plot: bool) -> dict[str, Any] | None:
        try:
            return summarize(sweep_dir, plot=plot)
        except Exception as exc:  # a summary must never fail the sweep
            log.warning("Could not summarize the sweep in %s: %s", sweep_dir, exc)
            return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m expkit.sweep", description="Rebuild a sweep's summary from disk.")
    parser.add_argument("sweep_dir", type=Path, help="the sweep dir (holds one work dir per job: 0/, 1/, ...)")
    parser.add_argument("--no-plot", action="store_true", help="skip sweep.svg")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"Error: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    best = summarize(args.sweep_dir, plot=not args.no_plot)
    if best is None:
        print(f"Error: no job dirs (with .hydra/) in {args.sweep_dir}", file=sys.stderr)
        return 2
    print((args.sweep_dir / "summary.md").read_text())
    print(json.dumps(best, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
