"""Resume a whole sweep: kill it mid-job with SIGKILL, run the same command with resume=true."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli, slow_train

pytestmark = pytest.mark.slow
VALUES = ["optim.lr=0.1,0.05,0.02,0.01", "trainer.max_epochs=3"]


def _sweep(tmp_path: Path, *extra: str) -> list[str]:
    """The sweep of slow jobs (0.01 s an iteration), as one command line."""
    return slow_train(tmp_path, "-m", *VALUES, f"hydra.sweep.dir={tmp_path / 'sweep'}", *extra, sleep_s=0.01)


def test_kill_during_the_third_job_then_resume(tmp_path):
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.Popen(
        _sweep(tmp_path),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 240
        while not (sweep / "2" / "checkpoints" / "epoch_1.pth").exists():
            assert proc.poll() is None and time.time() < deadline, "the third job never got going"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert not (sweep / "2" / "result.json").exists() and not (sweep / "3").exists()
    stamps = {p: p.stat().st_mtime_ns for j in ("0", "1") for p in (sweep / j / "checkpoints").glob("*.pth")}

    resumed = subprocess.run(_sweep(tmp_path, "resume=true"), cwd=REPO, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # jobs 0 and 1 were not retrained
    results = {j: json.loads((sweep / j / "result.json").read_text()) for j in ("0", "1", "2", "3")}
    assert all(r["status"] == "completed" for r in results.values())
    assert results["2"].get("resumed_in_sweep") is True and not results["3"].get("resumed_in_sweep")

    # job 2 ends with the weights of an uninterrupted run of the same job
    reference = run_cli(f"hydra.run.dir={tmp_path / 'ref'}", "optim.lr=0.02", "trainer.max_epochs=3")
    assert reference.returncode == 0, reference.output
    ref = torch.load(tmp_path / "ref" / "checkpoints" / "epoch_3.pth", weights_only=True)["state_dict"]
    got = torch.load(sweep / "2" / "checkpoints" / "epoch_3.pth", weights_only=True)["state_dict"]
    assert all(torch.equal(ref[k], got[k]) for k in ref)

    best = json.loads((sweep / "best.json").read_text())
    assert best["statuses"] == {"completed": 4} and best["resumed_jobs"] == ["2"]
    expected = max(results, key=lambda j: results[j]["best_metrics"]["val/acc"]["value"])
    assert best["job"] == expected


def test_reordered_and_added_values_mix_nothing_up(tmp_path):
    sweep = tmp_path / "sweep"
    assert run_cli("-m", "optim.lr=0.1,0.05", "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}").returncode == 0
    before = {j: json.loads((sweep / j / "result.json").read_text())["wall_time_s"] for j in ("0", "1")}
    proc = run_cli("-m", "optim.lr=0.01,0.05,0.1", "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}", "resume=true")
    assert proc.returncode == 0, proc.output
    # the old jobs keep their dirs, records and results; the new value got a dir of its own
    for job, lr in (("0", "0.1"), ("1", "0.05")):
        assert f"optim.lr={lr}" in (sweep / job / ".hydra" / "overrides.yaml").read_text()
        assert json.loads((sweep / job / "result.json").read_text())["wall_time_s"] == before[job]
    rows = [line for line in (sweep / "summary.csv").read_text().splitlines()[1:]]
    assert len(rows) == 3 and sum("optim.lr=0.01" in r for r in rows) == 1


def test_a_value_added_where_another_job_lives_is_recorded_in_the_summary_and_best(tmp_path):
    """Values added in front: Hydra's dir 1 holds lr=0.01's job, so lr=0.03 runs in a dir of its own
    (1_<digest>). The end of each job used to be recorded as the job of Hydra's dir: lr=0.03's never
    reached best.json (2 jobs, perhaps the wrong best) and the progress lines named other jobs."""
    sweep = tmp_path / "sweep"
    assert run_cli("-m", "optim.lr=0.1,0.01", "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}").returncode == 0
    proc = run_cli("-m", "optim.lr=0.01,0.03,0.1", "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}", "resume=true")
    assert proc.returncode == 0, proc.output
    (added,) = sweep.glob("1_*")
    assert "optim.lr=0.03" in (added / ".hydra" / "overrides.yaml").read_text()
    acc = {
        d.name: json.loads((d / "result.json").read_text())["best_metrics"]["val/acc"]["value"]
        for d in (sweep / "0", sweep / "1", added)
    }
    best = json.loads((sweep / "best.json").read_text())
    assert best["jobs"] == 3 and acc[best["job"]] == max(acc.values()), (best, acc)  # (a tie: either job)
    lines = [line for line in proc.output.splitlines() if "jobs done" in line]
    assert len(lines) == 3 and "3/3 jobs done" in lines[-1], lines
    assert any(f"job {added.name} (completed) val/acc {acc[added.name]:.4f}" in line for line in lines), lines
