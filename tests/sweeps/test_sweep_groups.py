"""Seeds in a sweep: jobs that differ only in their seed form a group, summarised by mean,
std and n; the best group is chosen by its mean, not by its luckiest seed."""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli

pytestmark = pytest.mark.slow


def _best(job: Path) -> float:
    return json.loads((job / "result.json").read_text())["best_metrics"]["val/acc"]["value"]


def test_seed_groups_summary_best_plot_progress_and_rebuild(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(
        "-m", "trainer.seed=0,1,2", "model.hidden=[32],[64]", "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}"
    )
    assert proc.returncode == 0, proc.output
    values = {j: _best(sweep / j) for j in "012345"}  # jobs 0,2,4: [32]; 1,3,5: [64] (Hydra's order)
    groups = list(csv.DictReader((sweep / "summary.csv").open()))
    assert len(groups) == 2 and [g["n"] for g in groups] == ["3", "3"]
    by_hidden = {g["overrides"].split()[0]: g for g in groups}
    for hidden, members in (("model.hidden=[32]", "024"), ("model.hidden=[64]", "135")):
        group = by_hidden[hidden]
        expected = [values[j] for j in members]
        assert group["jobs"].split() == list(members)
        assert float(group["mean"]) == pytest.approx(statistics.fmean(expected))
        assert float(group["std"]) == pytest.approx(statistics.stdev(expected))
        assert float(group["min"]) == pytest.approx(min(expected)) and float(group["max"]) == pytest.approx(
            max(expected)
        )
    assert float(groups[0]["mean"]) >= float(groups[1]["mean"])  # best mean first

    best = json.loads((sweep / "best.json").read_text())
    top = groups[0]
    assert best["group"] == top["overrides"] and best["n"] == 3 and best["value"] == pytest.approx(float(top["mean"]))
    assert best["std"] == pytest.approx(float(top["std"]))
    assert best["job"] == max(top["jobs"].split(), key=values.get)  # its best member, named
    assert len(list(csv.DictReader((sweep / "jobs.csv").open()))) == 6  # one row per job stays
    assert "## 6 jobs, best first" in (sweep / "summary.md").read_text()

    svg = (sweep / "sweep.svg").read_text()
    assert svg.count('class="errorbar"') == 2  # one per group
    assert ">[32]</text>" in svg and ">[64]</text>" in svg  # a categorical axis, not numbers
    assert ">trainer.seed</text>" not in svg  # the seed is never drawn as an axis

    lines = [line for line in proc.stdout.splitlines() if "Sweep: " in line and "jobs done" in line]
    assert len(lines) == 6 and "6/6 jobs done" in lines[-1] and "group mean, n=3" in lines[-1]

    # rebuilt from disk: the same groups; seed_keys=[] gives one row per job
    summary = (sweep / "summary.csv").read_text()
    rebuilt = subprocess.run(
        [sys.executable, "-m", "expkit.sweep", str(sweep)], cwd=REPO, capture_output=True, text=True
    )
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert (sweep / "summary.csv").read_text() == summary
    per_job = subprocess.run(
        [sys.executable, "-m", "expkit.sweep", f"sweep_dir={sweep}", "seed_keys=[]"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert per_job.returncode == 0, per_job.stderr
    assert len(list(csv.DictReader((sweep / "summary.csv").open()))) == 6


def test_an_unknown_seed_key_is_refused_before_any_job(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "seed_keys=[trainer.sed]", "optim.lr=0.1,0.05", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 2, proc.output
    assert "seed_keys: trainer.sed is not a key of the config" in proc.output and "Traceback" not in proc.output
    assert not (sweep / "0").exists()
