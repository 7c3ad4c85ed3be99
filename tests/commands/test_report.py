"""python -m expkit.report over a real sweep (two learning rates x two seeds): one self-contained
page with plotly.js inside it, a figure per section, every job linked, the table's values those of
each job's result.json; bad input refused with one line."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from conftest import run_cli, run_module


def report(*args: str, cwd: Path) -> object:
    return run_module("expkit.report", *args, cwd=cwd, timeout=180)


def _table(page: str) -> list[dict[str, str]]:
    """The jobs' table: each row's cells by column, the job's cell as its link's href and text."""
    table = page.split("<table class='jobs'>", 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.DOTALL)
    header = [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", rows[0])]
    out = []
    for row in rows[1:]:
        cells = re.findall(r"<td>(.*?)</td>", row, re.DOTALL)
        href, name = re.fullmatch(r"<a href='(.*?)'>(.*?)</a>", cells[0]).groups()
        out.append(dict(zip(header, [name, *map(html.unescape, cells[1:])]), href=href))
    return out


@pytest.mark.slow
def test_a_sweeps_report_holds_every_job_its_figures_and_its_records_values(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "optim.lr=0.1,0.05", "trainer.seed=0,1", "trainer.max_epochs=2", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.output[-3000:]
    proc = report(str(sweep), cwd=tmp_path)
    assert proc.returncode == 0, proc.output
    assert f"Written: {sweep / 'report.html'}" in proc.stdout
    page = (sweep / "report.html").read_text()
    # one job's page goes into its own dir: the sweep's page stays
    one = report(str(sweep / "1"), cwd=tmp_path)
    assert one.returncode == 0 and f"Written: {sweep / '1' / 'report.html'}" in one.stdout, one.output
    assert (sweep / "report.html").read_text() == page and len(_table((sweep / "1" / "report.html").read_text())) == 1
    assert "plotly.js v" in page and page.count("Plotly.newPlot") == 3  # the bundle once; curves, parameters, groups
    assert "https://cdn" not in page.split("/*", 1)[0]  # no script fetched from the network
    for heading in ("Learning curves", "Parameters against the best value", "Seed groups: mean ± std"):
        assert f"<h2>{heading}</h2>" in page
    rows = _table(page)
    assert sorted(r["job"] for r in rows) == ["0", "1", "2", "3"]
    for row in rows:
        work = sweep / row["job"]
        assert (sweep / row["href"]).resolve() == work.resolve()  # the link leads to the job dir
        result = json.loads((work / "result.json").read_text())
        assert row["status"] == result["status"] == "completed"
        assert float(row["best val/acc"]) == pytest.approx(result["best_metrics"]["val/acc"]["value"], rel=1e-5)
        for key, value in result["final_metrics"].items():
            assert float(row[f"final {key}"]) == pytest.approx(value, rel=1e-5), key


def test_no_run_or_nothing_given_exits_2_with_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for args, named in (
        ([str(tmp_path / "empty")], "holds no run"),
        ([str(tmp_path / "nowhere")], "is not a directory"),
        ([], "which runs?"),
    ):
        proc = report(*args, cwd=tmp_path)
        assert proc.returncode == 2, proc.output
        lines = [line for line in proc.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: ") and named in lines[0], proc.output
    assert not list(tmp_path.rglob("report.html"))
