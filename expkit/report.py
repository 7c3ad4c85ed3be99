"""``python -m expkit.report <sweep dir | run dirs | globs> [out=<file>]``: one page about a sweep.

Writes ``report.html`` (by default into the sweep dir, the runs' common parent, or one run's own dir), a page that a
browser opens offline: plotly.js is inside it once, every figure after the first reuses it. It holds

  the jobs            a table: overrides, status, final and best metrics, a link to each job dir
  learning curves     every job's curve of each metric on shared axes (a menu picks the metric)
  parameters          the swept parameters against the monitored metric's best (parallel coordinates;
                      a scatter for one parameter)
  seed groups         each group's mean curve with a band of ± one standard deviation
  the search          for an Optuna search, ``optuna.visualization``'s history, parameter importances
                      and, with several objectives, the Pareto front

A sweep still running gives a page of what its jobs wrote so far. A dir that holds no run exits 2
with one line. plotly is the ``report`` extra (``pip install 'expkit[report]'``).
"""

from __future__ import annotations

import contextlib
import html
import math
import statistics
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from expkit.compare import _hydra_argv, find_runs
from expkit.config import cli
from expkit.core import hydra_compat
from expkit.core.atomic import write_text_atomic
from expkit.core.errors import ConfigError, config_errors_exit_2
from expkit.sweeps.rows import DEFAULT_SEED_KEYS, _read_yaml, group_rows, job_row, seed_keys_of
from expkit.sweeps.sweep_jobs import key_kind
from expkit.workdir.records import read_records, read_result

__all__ = ["main", "report", "run"]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _jobs(runs: list[Path]) -> list[dict[str, Any]]:
    """Each run's row (``job_row``) with its name in the page, its result and its records."""
    one_parent = len({p.resolve().parent for p in runs}) == 1
    jobs = []
    for path in runs:
        row = job_row(path)
        if row is None:
            continue
        row["name"] = path.name if one_parent else f"{path.parent.name}/{path.name}"
        row["result"] = read_result(path) or {}
        row["records"] = read_records(path)
        jobs.append(row)
    return jobs


# -- the figures -------------------------------------------------------------------------------------
def _curves_figure(jobs: list[dict[str, Any]]) -> Any:
    """Every job's curve of each metric, one metric shown at a time (a menu picks it): ``val/`` and
    ``test/`` metrics by epoch, ``train/`` ones by step."""
    import plotly.graph_objects as go

    keys = sorted({k for j in jobs for r in j["records"] for k in r if k.startswith(("train/", "val/"))})
    monitor = jobs[0]["monitor"]
    keys.sort(key=lambda k: (k != monitor, k))
    fig = go.Figure()
    buttons = []
    for i, key in enumerate(keys):
        x_key = "step" if key.startswith("train/") else "epoch"
        for j in jobs:
            points = [(r[x_key], r[key]) for r in j["records"] if _finite(r.get(key)) and x_key in r]
            fig.add_scatter(
                x=[x for x, _ in points],
                y=[y for _, y in points],
                name=f"{j['name']}: {j['overrides']}",
                legendgroup=j["name"],
                visible=i == 0,
                mode="lines+markers" if len(points) < 50 else "lines",
            )
        shown = [k == key for k in keys for _ in jobs]
        buttons.append(
            {
                "label": key,
                "method": "update",
                "args": [{"visible": shown}, {"xaxis.title.text": x_key, "yaxis.title.text": key}],
            }
        )
    first_x = "step" if keys and keys[0].startswith("train/") else "epoch"
    fig.update_layout(
        updatemenus=[{"buttons": buttons, "x": 0, "y": 1.15, "xanchor": "left"}] if len(keys) > 1 else [],
        xaxis_title=first_x,
        yaxis_title=keys[0] if keys else "",
        height=480,
    )
    return fig


def _swept_keys(jobs: list[dict[str, Any]], seed_keys: list[str]) -> list[str]:
    keys = {k for j in jobs for k in j["override_values"] if key_kind(k) != "control" and k not in seed_keys}
    return sorted(k for k in keys if len({j["override_values"].get(k) for j in jobs}) > 1)


def _dimension(name: str, values: list[str]) -> dict[str, Any]:
    """A parallel-coordinates axis: numbers as they are, other values as names in order."""
    try:
        return {"label": name, "values": [float(v) for v in values]}
    except ValueError:
        names = sorted(set(values))
        return {
            "label": name,
            "values": [names.index(v) for v in values],
            "tickvals": list(range(len(names))),
            "ticktext": names,
        }


def _parameters_figure(jobs: list[dict[str, Any]], keys: list[str]) -> Any:
    """The swept parameters against the best value: a scatter for one parameter, parallel
    coordinates (coloured by the best value) for several."""
    import plotly.graph_objects as go

    done = [j for j in jobs if _finite(j.get("best"))]
    monitor = jobs[0]["monitor"]
    values = [[str(j["override_values"].get(k, "")) for j in done] for k in keys]
    best = [j["best"] for j in done]
    if len(keys) == 1:
        axis = _dimension(keys[0], values[0])
        fig = go.Figure(go.Scatter(x=axis["values"], y=best, mode="markers", text=[j["name"] for j in done]))
        if "ticktext" in axis:
            fig.update_xaxes(tickvals=axis["tickvals"], ticktext=axis["ticktext"])
        return fig.update_layout(xaxis_title=keys[0], yaxis_title=f"best {monitor}", height=420)
    dims = [_dimension(k, v) for k, v in zip(keys, values)] + [{"label": f"best {monitor}", "values": best}]
    line = {"color": best, "colorscale": "Viridis", "showscale": True}
    return go.Figure(go.Parcoords(dimensions=dims, line=line)).update_layout(height=480)


def _band(members: list[dict[str, Any]], key: str) -> tuple[list[float], list[float], list[float]]:
    """Epochs, and the members' mean and standard deviation of `key` at each."""
    at: dict[float, list[float]] = {}
    for m in members:
        for r in m["records"]:
            if _finite(r.get(key)) and "epoch" in r:
                at.setdefault(float(r["epoch"]), []).append(float(r[key]))
    xs = sorted(at)
    means = [statistics.fmean(at[x]) for x in xs]
    stds = [statistics.stdev(at[x]) if len(at[x]) > 1 else 0.0 for x in xs]
    return xs, means, stds


def _groups_figure(groups: list[dict[str, Any]], jobs: list[dict[str, Any]]) -> Any:
    """Each seed group's mean curve of the monitored metric with a band of ± one standard deviation."""
    import plotly.colors
    import plotly.graph_objects as go

    by_name = {j["job"]: j for j in jobs}
    monitor = jobs[0]["monitor"]
    palette = plotly.colors.qualitative.Plotly
    fig = go.Figure()
    for g in groups:
        members = [by_name[m["job"]] for m in g["members"] if m["job"] in by_name]
        xs, means, stds = _band(members, monitor)
        color = palette[g["group"] % len(palette)]
        name = f"group {g['group']} (n={len(members)}): {g['overrides']}"
        fig.add_scatter(
            x=xs + xs[::-1],
            y=[m + s for m, s in zip(means, stds)] + [m - s for m, s in zip(means, stds)][::-1],
            fill="toself",
            fillcolor=color,
            opacity=0.2,
            line={"width": 0},
            hoverinfo="skip",
            legendgroup=name,
            showlegend=False,
        )
        fig.add_scatter(x=xs, y=means, name=name, legendgroup=name, line={"color": color}, mode="lines+markers")
    return fig.update_layout(xaxis_title="epoch", yaxis_title=f"{monitor} (mean ± std)", height=420)


def _study(sweep_dir: Path | None) -> Any:
    """The Optuna study of a search, as its sweep's multirun.yaml names it (its storage, else the
    sweep's own optuna.journal); None for a sweep that is no search, or a study that cannot be read."""
    if sweep_dir is None:
        return None
    sweeper = ((_read_yaml(sweep_dir / "multirun.yaml") or {}).get("hydra") or {}).get("sweeper") or {}
    name = sweeper.get("study_name") if isinstance(sweeper, dict) else None
    storage = sweeper.get("storage") or (
        sweep_dir / "optuna.journal" if (sweep_dir / "optuna.journal").is_file() else None
    )
    if not name or storage is None:
        return None
    import optuna

    from expkit.sweeps.search import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.load_study(study_name=str(name), storage=open_storage(str(storage)))
    except Exception:  # (a study gone, a storage unreachable: the page goes without these figures)
        return None


def _search_figures(study: Any, sweep_dir: Path, monitor: str) -> list[tuple[str, Any]]:
    """optuna.visualization's history and importances (of each objective), and the Pareto front."""
    import warnings

    from optuna import visualization as vis

    from expkit.sweeps.search import objectives_of

    recorded = objectives_of(sweep_dir)
    names = study.metric_names or (recorded[0] if recorded else [monitor])
    figures = []
    for i, name in enumerate(names):
        target = None if len(names) == 1 else (lambda t, i=i: t.values[i])
        for title, plot in (
            ("optimisation history", vis.plot_optimization_history),
            ("importances", vis.plot_param_importances),
        ):
            try:
                with warnings.catch_warnings():  # (target= is experimental in Optuna: said once per figure)
                    warnings.simplefilter("ignore")
                    figures.append((f"{title}: {name}", plot(study, target=target, target_name=name)))
            except (ValueError, RuntimeError) as exc:  # (too few finished trials for importances)
                figures.append((f"{title}: {name}", str(exc)))
    if len(names) > 1:
        figures.append(("Pareto front", vis.plot_pareto_front(study, target_names=names)))
    return figures


# -- the page ----------------------------------------------------------------------------------------
def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return html.escape("" if value is None else str(value))


def _table(jobs: list[dict[str, Any]], page: Path) -> str:
    """The jobs' table: each job's overrides, status, best and final monitored value, its other
    final metrics, and a link to its dir (relative to the page)."""
    finals = sorted({k for j in jobs for k in (j["result"].get("final_metrics") or {})})
    head = ["job", "overrides", "status", f"best {jobs[0]['monitor']}", "best epoch", *(f"final {k}" for k in finals)]
    lines = ["<table class='jobs'>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for j in jobs:
        link = Path(j["work_dir"])
        try:
            href = link.relative_to(page.parent.resolve()).as_posix() + "/"
        except ValueError:
            href = link.as_uri() + "/"
        final = j["result"].get("final_metrics") or {}
        cells = [
            f"<a href='{html.escape(href)}'>{html.escape(j['name'])}</a>",
            _cell(j["overrides"]),
            _cell(j.get("status")),
            _cell(j.get("best")),
            _cell(j.get("best_epoch")),
            *(_cell(final.get(k)) for k in finals),
        ]
        lines.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "\n".join([*lines, "</table>"])


STYLE = """body{font-family:sans-serif;margin:1.5em;} table.jobs{border-collapse:collapse;font-size:13px}
table.jobs td,table.jobs th{border:1px solid #ccc;padding:3px 6px;text-align:left} h2{margin-top:1.5em}"""


def _sections(jobs: list[dict[str, Any]], sweep_dir: Path | None) -> list[tuple[str, Any]]:
    seed_keys = seed_keys_of(sweep_dir) if sweep_dir is not None else list(DEFAULT_SEED_KEYS)
    sections: list[tuple[str, Any]] = [("Learning curves", _curves_figure(jobs))]
    keys = _swept_keys(jobs, seed_keys)
    if keys and any(_finite(j.get("best")) for j in jobs):
        sections.append(("Parameters against the best value", _parameters_figure(jobs, keys)))
    groups = group_rows(jobs, seed_keys)
    if groups is not None:
        sections.append(("Seed groups: mean ± std", _groups_figure(groups, jobs)))
    study = _study(sweep_dir)
    if study is not None:
        sections += [(f"Search: {title}", fig) for title, fig in _search_figures(study, sweep_dir, jobs[0]["monitor"])]
    return sections


def report(patterns: list[str], out: str | Path | None = None) -> Path:
    """Write the report of the runs that `patterns` name.

    Args:
        patterns: a sweep dir, run dirs or globs (``compare.find_runs``).
        out: the page to write; None: ``report.html`` in the runs' common parent (a sweep's dir), or
            in the run's own dir when there is one run.

    Returns:
        The page's path.

    Raises:
        ConfigError: when the patterns name no readable run.
    """
    runs = find_runs(patterns, command="expkit.report")
    jobs = _jobs(runs)
    if not jobs:
        raise ConfigError(f"no readable run in {' '.join(patterns)}: no job dir holds .hydra/ and a record")
    parents = {p.resolve().parent for p in runs}
    sweep_dir = next(iter(parents)) if len(parents) == 1 and (next(iter(parents)) / "multirun.yaml").is_file() else None
    # one run: its own dir (its parent is a day's dir of other runs, or a sweep's with the sweep's
    # page); several: their common parent (one sweep: its dir)
    home = runs[0] if len(runs) == 1 else Path(*_common(sorted(parents)))
    page = Path(out) if out else home / "report.html"
    shown = sweep_dir or page.parent.resolve()
    with contextlib.suppress(ValueError):  # (under the cwd: as the user names it)
        shown = shown.relative_to(Path.cwd().resolve())
    title = f"Report: {shown}"
    body = [f"<h1>{html.escape(title)}</h1>", f"<h2>Jobs ({len(jobs)})</h2>", _table(jobs, page.resolve())]
    plotly_js: bool | str = True  # plotly.js inside the page once, with the first figure
    for heading, fig in _sections(jobs, sweep_dir):
        body.append(f"<h2>{html.escape(heading)}</h2>")
        if isinstance(fig, str):  # a figure that could not be made: why
            body.append(f"<p>{html.escape(fig)}</p>")
            continue
        body.append(fig.to_html(include_plotlyjs=plotly_js, full_html=False))
        plotly_js = False
    text = (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
    page.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(page, text)
    return page


def _common(paths: list[Path]) -> tuple[str, ...]:
    parts = [p.parts for p in paths]
    common = []
    for column in zip(*parts):
        if len(set(column)) > 1:
            break
        common.append(column[0])
    return tuple(common)


# -- the command -------------------------------------------------------------------------------------
@hydra_compat.main(config_path="conf", config_name="report")
def run(cfg: DictConfig) -> None:
    """Hydra's task function: bad input exits 2 with one line.

    Args:
        cfg: the composed ``report.yaml`` config; Hydra composes it from the command line and passes
            it, so the function is called with no arguments (as ``main`` does).

    Raises:
        SystemExit: with status 2 for bad input: nothing given, a pattern that matches nothing, a dir
            that holds no run, no readable run; plotly missing.
    """
    with config_errors_exit_2():
        try:
            import plotly  # noqa: F401
        except ImportError:
            raise ConfigError("the report needs plotly: pip install 'expkit[report]'") from None
        page = report([str(p) for p in cfg.runs or []], cfg.get("out"))
    print(f"Written: {page}")


def main() -> None:
    """``python -m expkit.report``: a Hydra app over conf/report.yaml (``--help``, ``--cfg job``).

    Raises:
        SystemExit: with status 2 for bad input (also Hydra's own errors), 0 when the page was written.
    """
    cli.dirs_command_main(run, _hydra_argv)


if __name__ == "__main__":
    main()
