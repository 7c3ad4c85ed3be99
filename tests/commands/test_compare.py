"""python -m expkit.compare over runs made apart: real expkit.train processes (two single runs that
differ only in their seed, a sweep, a run that failed), compared by dir and by glob; a dir that
holds no run is refused with one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import assert_svg_reads_right, run_cli, run_module

SVG = "{http://www.w3.org/2000/svg}"


def compare(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_module("expkit.compare", *args, cwd=cwd, timeout=120)


def table(md: str, heading: str) -> list[dict[str, str]]:
    """The rows of the Markdown table under the ``## heading...`` line, as dicts by column."""
    lines = md.split(f"## {heading}", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    header, body = rows[0], rows[2:]
    return [dict(zip(header, row)) for row in body]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """runs/a and runs/b: the default experiment with seeds 0 and 1; runs/sweep: a one-job sweep with
    optim.lr=0.05; runs/bad: a run that failed (a negative lr). Each made by its own command."""
    root = tmp_path_factory.mktemp("compare") / "runs"
    epoch = ["trainer.max_epochs=2"]
    for args in (
        [*epoch, f"hydra.run.dir={root / 'a'}"],
        [*epoch, "trainer.seed=1", f"hydra.run.dir={root / 'b'}"],
        ["-m", *epoch, "optim.lr=0.05", f"hydra.sweep.dir={root / 'sweep'}"],
    ):
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.output
    proc = run_cli(*epoch, "optim.lr=-1", f"hydra.run.dir={root / 'bad'}")
    assert proc.returncode == 2 and (root / "bad" / "result.json").is_file(), proc.output
    return root


def _check_comparison(out: Path, runs: Path) -> None:
    md = (out / "compare.md").read_text()
    assert md.startswith("# Compare 4 runs by val/acc (greater)"), md
    listed = {r["run"]: r for r in table(md, "Runs")}
    assert set(listed) == {"a", "b", "sweep/0", "bad"}
    assert listed["bad"]["status"] == "failed" and "Invalid learning rate" in listed["bad"]["error"]
    assert all(
        listed[r]["status"] == "completed" and float(listed[r]["best val/acc"]) > 0.5 for r in ("a", "b", "sweep/0")
    )
    assert listed["sweep/0"]["work dir"] == str((runs / "sweep" / "0").resolve())
    differing = {r["key"]: r for r in table(md, "Config keys that differ")}
    assert set(differing) == {"optim.lr", "trainer.seed"}, differing
    assert [differing["optim.lr"][r] for r in ("a", "b", "sweep/0", "bad")] == ["0.1", "0.1", "0.05", "-1"]
    assert [differing["trainer.seed"][r] for r in ("a", "b", "sweep/0", "bad")] == ["0", "1", "0", "0"]
    groups = {g["runs"]: g for g in table(md, "Groups: runs that differ only in trainer.seed")}
    assert set(groups) == {"a b", "sweep/0", "bad"}, groups
    pair = groups["a b"]
    values = [float(listed[r]["best val/acc"]) for r in ("a", "b")]
    mean, std = (float(v) for v in pair["best val/acc (mean ± std)"].split(" ± "))
    assert pair["n"] == "2" and abs(mean - sum(values) / 2) < 1e-4
    assert abs(std - abs(values[0] - values[1]) / 2**0.5) < 1e-4
    assert pair["keys"] == "optim.lr=0.1" and groups["bad"]["statuses"] == "1 failed" and groups["bad"]["n"] == "0"
    metrics = {r["run"]: r for r in table(md, "Final and best metrics")}
    assert float(metrics["a"]["final test/acc"]) > 0.5 and metrics["bad"]["final test/acc"] == ""
    assert_svg_reads_right(out / "compare.svg")  # no legend entry runs into the next panel's
    root = ET.parse(out / "compare.svg").getroot()
    titles = [t.text for t in root.findall(f"{SVG}text")]
    panels = [t for t in titles if t and t.endswith("(mean ± std per group)")]
    assert panels == [
        "val/acc (mean ± std per group)",
        "val/loss (mean ± std per group)",
        "train/loss (mean ± std per group)",
    ]
    lines = [line.find(f"{SVG}title").text for line in root.findall(f"{SVG}polyline")]
    assert lines.count("group 0 (n=2: a b): optim.lr=0.1") == 3, lines  # one per panel: the pair's mean
    assert lines.count("sweep/0 (completed): optim.lr=0.05") == 3, lines
    bars = [p for p in root.findall(f"{SVG}path") if p.get("class") == "errorbar"]
    assert len(bars) >= 2 * 2  # the pair's spread at each of its two epochs, in the val panels at least


@pytest.mark.slow
def test_runs_made_apart_are_compared_and_two_seeds_grouped(runs, tmp_path):
    out = tmp_path / "out"
    proc = compare(str(runs / "a"), str(runs / "b"), str(runs / "sweep"), str(runs / "bad"), f"out={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.output
    assert f"Written: {out / 'compare.md'} and {out / 'compare.svg'}" in proc.stdout
    _check_comparison(out, runs)


@pytest.mark.slow
def test_a_glob_finds_the_runs_and_the_sweeps_jobs_and_skips_start_up_failures(runs, tmp_path):
    """The glob of compare's own --help meets the dirs that commands failing at start-up left: they
    are skipped and named (issue 64, item 6), and each such command leaves a failed result.json."""
    left = tmp_path / "left"
    proc = run_cli("resume=/no/such.pth", f"hydra.run.dir={left / 'resumed'}")
    assert proc.returncode == 2, proc.output
    result = json.loads((left / "resumed" / "result.json").read_text())
    assert result["status"] == "failed" and "resume=/no/such.pth: no such checkpoint file" in result["error"]
    (left / "resumed").rename(runs / "resumed_missing")
    (runs / "older" / ".hydra").mkdir(parents=True)  # what such a command left before: .hydra/, an empty log
    (runs / "older" / "train.log").write_text("")
    proc = compare(f"{runs}/*", cwd=tmp_path)  # (quoted: the command expands it) and its default out
    assert proc.returncode == 0, proc.output
    skipped = [line for line in proc.stderr.splitlines() if line.startswith("Skipped 2 dir(s)")]
    assert len(skipped) == 1 and str(runs / "older") in skipped[0] and str(runs / "resumed_missing") in skipped[0]
    made = list((tmp_path / "outputs" / "compare").iterdir())
    assert len(made) == 1
    _check_comparison(made[0], runs)
    shutil.rmtree(runs / "older"), shutil.rmtree(runs / "resumed_missing")


def test_a_dir_that_holds_no_run_exits_2_naming_it(tmp_path):
    empty = tmp_path / "not_a_run"
    (empty / "sub").mkdir(parents=True)
    (empty / "notes.txt").write_text("no run here\n")
    for args, named in (
        ([str(empty)], f"{empty} holds no run"),
        ([str(tmp_path / "missing")], f"{tmp_path / 'missing'} is not a directory"),
        ([f"{tmp_path}/zz*"], f"{tmp_path}/zz* matches no dir"),
        ([], "which runs?"),
    ):
        proc = compare(*args, f"out={tmp_path / 'out'}", cwd=tmp_path)
        assert proc.returncode == 2, proc.output
        assert proc.stderr.startswith(f"Error: {named}") and proc.stderr.count("\n") == 1, proc.stderr
        assert "Traceback" not in proc.output
    assert not (tmp_path / "out").exists()


def test_bare_dirs_and_globs_become_the_runs_setting():
    from expkit.compare import _hydra_argv

    assert _hydra_argv(["outputs/runs/a", "out=o", "outputs/sweeps/*"]) == [
        "out=o",
        "runs=['outputs/runs/a','outputs/sweeps/*']",
    ]
    assert _hydra_argv(["runs=[x]", "y", "--cfg", "job"]) == ["runs=[x,'y']", "--cfg", "job"]


@pytest.mark.slow
def test_a_metric_that_result_json_does_not_hold_is_read_from_the_curve(runs, tmp_path):
    """metric=train/loss: result.json's best and final metrics hold only val/ and test/ keys, so a
    completed run's best and final come from its metrics.jsonl (they were left empty)."""
    out = tmp_path / "out"
    proc = compare(str(runs / "a"), str(runs / "b"), "metric=train/loss", f"out={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.output
    listed = {r["run"]: r for r in table((out / "compare.md").read_text(), "Runs")}
    for name in ("a", "b"):
        losses = [
            r["train/loss"]
            for r in map(json.loads, (runs / name / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in r
        ]
        assert abs(float(listed[name]["best train/loss"]) - min(losses)) < 1e-4, listed[name]
    proc = compare(str(runs / "a"), f"out={tmp_path / 'one'}", cwd=tmp_path)  # one run, one job: singular
    assert proc.returncode == 0, proc.output
    assert (tmp_path / "one" / "compare.md").read_text().startswith("# Compare 1 run by val/acc"), proc.output
    assert "1 job, best first" in (runs / "sweep" / "summary.md").read_text()


def test_runs_that_monitor_different_metrics_are_listed_by_metric_not_one_by_one():
    """The line listed every run with its monitor ("a: val/acc, b: val/acc, ..."), a paragraph for a
    sweep of 40 jobs: the runs are grouped under each metric, the first four named."""
    from expkit.compare import Comparison, render

    monitors = {f"r{i}": "val/acc" for i in range(6)} | {"s": "val/loss"}
    rows = [
        {"job": job, "status": "completed", "work_dir": f"/w/{job}", "override_values": {}, "result": None}
        for job in monitors
    ]
    md = render(Comparison(rows, "val/acc", "greater", [], [], None, monitors=monitors))
    assert "(val/acc by r0, r1, r2, r3 and 2 more; val/loss by s); all are compared by val/acc." in md, md
