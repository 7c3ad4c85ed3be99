"""Real sweeps in subprocesses: basic, joblib, submitit_local, Optuna; failures; the rebuild command."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from conftest import REPO, assert_svg_reads_right, run_cli, sweep_train

pytestmark = pytest.mark.slow
GRID = ["optim.lr=0.1,0.01", "model=mlp,cnn", "trainer.max_epochs=2"]


def _true_best(sweep: Path, jobs: int) -> tuple[str, float]:
    """The job whose metrics.jsonl really holds the highest val/acc."""
    best = {}
    for job in range(jobs):
        lines = (sweep / str(job) / "metrics.jsonl").read_text().splitlines()
        best[str(job)] = max(json.loads(line)["val/acc"] for line in lines if "val/acc" in line)
    job = max(best, key=best.get)
    return job, best[job]


def _check_sweep(sweep: Path, jobs: int) -> dict:
    for job in range(jobs):
        work = sweep / str(job)
        assert json.loads((work / "result.json").read_text())["status"] == "completed"
        assert (work / "checkpoints" / "last_checkpoint").is_file()
        assert list((work / "checkpoints").glob("best_val_acc_*.pth"))
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert len(rows) == jobs
    values = [float(r["best"]) for r in rows]
    assert values == sorted(values, reverse=True)  # best first
    best = json.loads((sweep / "best.json").read_text())
    job, value = _true_best(sweep, jobs)
    assert (best["job"], best["value"]) == (job, pytest.approx(value))
    assert Path(best["best_checkpoint"]).is_file() and best["work_dir"] == str((sweep / job).resolve())
    assert (sweep / "summary.md").read_text().startswith("# Sweep")
    _check_plot(sweep, rows)
    return best


def _check_plot(sweep: Path, rows: list[dict]) -> None:
    """sweep.svg: one line per job (its tooltip names the job), and in every panel of a swept
    hyperparameter one point per job, placed by its best value (higher value, smaller y)."""
    ns = "{http://www.w3.org/2000/svg}"
    colors = assert_svg_reads_right(sweep / "sweep.svg")  # every job one color, as in the legend
    root = ET.parse(sweep / "sweep.svg").getroot()

    def title(element) -> str:
        return element.find(f"{ns}title").text

    lines = [
        line for line in root.findall(f"{ns}polyline") if title(line) != "best so far"
    ]  # an Optuna search's progress
    assert sorted(title(line).split(":")[0] for line in lines) == sorted(r["job"] for r in rows)
    points = [c for c in root.findall(f"{ns}circle") if c.get("class") == "point" and not title(c).startswith("trial ")]
    best = {r["job"]: float(r["best"]) for r in rows}
    swept = len(points) // len(rows)
    assert swept >= 1 and len(points) == swept * len(rows)
    for panel in range(swept):
        mine = points[panel * len(rows) : (panel + 1) * len(rows)]
        jobs = [c.find(f"{ns}title").text.split(":")[0].removeprefix("job ") for c in mine]
        assert sorted(jobs) == sorted(best)
        by_height = [best[j] for j, _ in sorted(zip(jobs, mine), key=lambda jc: float(jc[1].get("cy")))]
        assert by_height == sorted(by_height, reverse=True)
        assert all(c.get("fill") == colors[f"job {j}"] for j, c in zip(jobs, mine))


def test_grid_with_the_basic_launcher(tmp_path):
    proc = run_cli("-m", *GRID, f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.output
    best = _check_sweep(tmp_path, 4)
    assert f"Sweep best: job {best['job']}" in proc.output
    assert sorted(best["overrides"]) == sorted(
        yaml.safe_load((tmp_path / best["job"] / ".hydra" / "overrides.yaml").read_text())
    )


def test_grid_with_joblib_and_two_workers(tmp_path):
    proc = run_cli("-m", *GRID, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.output
    _check_sweep(tmp_path, 4)


def test_submitit_local(tmp_path):
    proc = run_cli(
        "-m",
        "optim.lr=0.1,0.01",
        "trainer.max_epochs=1",
        "hydra/launcher=submitit_local",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.output
    _check_sweep(tmp_path, 2)


def test_optuna_best_trial_agrees_with_best_json(tmp_path):
    proc = run_cli(
        "hparams_search=optuna", "hydra.sweeper.n_trials=4", "trainer.max_epochs=2", f"hydra.sweep.dir={tmp_path}"
    )
    assert proc.returncode == 0, proc.output
    best = _check_sweep(tmp_path, 4)
    study = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert study["best_value"] == pytest.approx(best["value"])
    for key, value in study["best_params"].items():
        assert f"{key}={value}".replace(" ", "") in [o.replace(" ", "") for o in best["overrides"]]


def test_a_failing_job_is_recorded_and_the_others_run(tmp_path):
    # (a value only building refuses: a word for a number is refused before any job starts)
    proc = run_cli("-m", "optim.lr=0.1,-1,0.01", "trainer.max_epochs=1", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.output
    rows = {r["job"]: r for r in csv.DictReader((tmp_path / "summary.csv").open())}
    assert rows["1"]["status"] == "failed" and "Invalid learning rate: -1" in rows["1"]["error"]
    assert rows["0"]["status"] == rows["2"]["status"] == "completed"
    assert list(rows)[-1] == "1"  # a failed job sorts last
    best = json.loads((tmp_path / "best.json").read_text())
    assert best["statuses"] == {"completed": 2, "failed": 1} and best["job"] in ("0", "2")


def test_fail_fast_skips_the_rest(tmp_path):
    proc = run_cli("-m", "optim.lr=-1,0.1", "trainer.max_epochs=1", "fail_fast=true", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode != 0
    statuses = [json.loads((tmp_path / str(j) / "result.json").read_text())["status"] for j in (0, 1)]
    assert statuses == ["failed", "skipped"]


def test_rebuild_command_while_running_and_after(tmp_path):
    proc = run_cli("-m", "optim.lr=0.1,0.01", "trainer.max_epochs=2", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.output
    expected = json.loads((tmp_path / "best.json").read_text())
    for name in ("summary.csv", "summary.md", "best.json", "sweep.svg"):
        (tmp_path / name).unlink()
    (tmp_path / "1" / "result.json").unlink()  # as if job 1 were still running
    rebuild = subprocess.run([sys.executable, "-m", "expkit.sweep", str(tmp_path)], capture_output=True, text=True)
    assert rebuild.returncode == 0, rebuild.stderr
    rows = {r["job"]: r for r in csv.DictReader((tmp_path / "summary.csv").open())}
    assert rows["1"]["status"] == "running" and float(rows["1"]["best"]) > 0  # read from metrics.jsonl
    assert (tmp_path / "sweep.svg").is_file()
    rebuilt = json.loads((tmp_path / "best.json").read_text())
    assert (rebuilt["job"], rebuilt["value"]) == (expected["job"], pytest.approx(expected["value"]))
    bad = subprocess.run([sys.executable, "-m", "expkit.sweep", str(tmp_path / "nope")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a directory" in bad.stderr


def test_two_sweeps_started_together_get_their_own_dirs(tmp_path):
    command = sweep_train("trainer.max_epochs=1", "optim.lr=0.1", "show_hooks=true")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        for _ in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    dirs = list((tmp_path / "outputs" / "sweeps").iterdir())
    assert len(dirs) == 2, dirs  # the dir names carry microseconds


@pytest.fixture(scope="module")
def three_jobs(tmp_path_factory) -> Path:
    sweep = tmp_path_factory.mktemp("three") / "sweep"
    proc = run_cli("-m", "optim.lr=0.1,0.03,0.001", "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.output
    return sweep


def test_a_job_end_appends_its_row_and_updates_best_json_in_constant_time(three_jobs, tmp_path):
    from expkit.sweeps.summary import record_job_end, summarize

    sweep = tmp_path / "sweep"
    import shutil

    shutil.copytree(three_jobs, sweep, ignore=shutil.ignore_patterns(".rows", "summary.*", "best.json", "sweep.svg"))
    final = {r["job"]: float(r["best"]) for r in csv.DictReader((three_jobs / "summary.csv").open())}
    for job in ("2", "0", "1"):  # the order in which they end
        record_job_end(sweep, sweep / job)
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [r["job"] for r in rows] == ["2", "0", "1"]  # appended as they ended
    best = json.loads((sweep / "best.json").read_text())
    top = max(final, key=final.get)
    assert (best["job"], best["value"], best["jobs"], best["statuses"]) == (
        top,
        pytest.approx(final[top]),
        3,
        {"completed": 3},
    )
    before = {name: (sweep / name).read_bytes() for name in ("summary.csv", "summary.md", "best.json")}
    record_job_end(sweep, sweep / "0")  # a job a resumed sweep found finished: nothing changes
    assert before == {name: (sweep / name).read_bytes() for name in before}
    assert summarize(sweep)["job"] == top
    assert [r["job"] for r in csv.DictReader((sweep / "summary.csv").open())] == sorted(final, key=lambda j: -final[j])


def test_resume_finds_jobs_through_the_index_and_scans_an_old_sweep_dir_once(three_jobs, tmp_path):
    import shutil

    from expkit.sweeps.sweep_jobs import INDEX_DIR, find_job, job_identity, read_job

    sweep = tmp_path / "sweep"
    shutil.copytree(three_jobs, sweep)
    identity = read_job(sweep / "1")["overrides"]
    assert find_job(sweep, identity) == sweep / "1"  # its index entry
    shutil.rmtree(sweep / INDEX_DIR)  # a sweep dir from before the index
    assert find_job(sweep, identity) == sweep / "1"  # found by one scan, which indexes every job
    assert len(list((sweep / INDEX_DIR).iterdir())) == 3 + 1  # three jobs and the "complete" mark
    stray = sweep / "9"
    shutil.copytree(sweep / "2", stray)  # a job dir the index never heard of
    (stray / "job.json").write_text(json.dumps({"overrides": job_identity(["optim.lr=9"])}))
    assert find_job(sweep, job_identity(["optim.lr=9"])) is None  # a complete index is not rescanned


def test_the_bookkeeping_benchmark_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/sweep_bookkeeping.py", "--jobs", "40", "--rounds", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "per-job bookkeeping in 40 job dirs vs 3" in proc.stdout and "full rebuild of 40 job dirs" in proc.stdout


KILL_ONCE = '''
import os, signal
from expkit import Hook

class KillOnce(Hook):
    """The job's process is SIGKILLed once, at iteration 25 (its last checkpoint: iteration 20),
    as a preempted Slurm job is."""

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        marker = runner.work_dir / "killed"
        if runner.iter == 25 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
'''


def test_a_requeued_slurm_job_resumes_its_own_dir_and_ends_as_an_uninterrupted_one(tmp_path):
    """Slurm reruns a requeued job's command with SLURM_RESTART_COUNT set (submitit's launcher
    requeues on preemption or timeout); the job must continue from its checkpoint, not start over."""
    (tmp_path / "killonce.py").write_text(KILL_ONCE)
    common = (
        "trainer.max_epochs=2",
        "default_hooks.checkpoint.by_epoch=false",
        "default_hooks.checkpoint.interval=10",
        "+hooks.kill._target_=killonce.KillOnce",
        "optim.lr=0.05",
    )
    env = {"PYTHONPATH": str(tmp_path)}
    reference = tmp_path / "reference"
    (reference / "0").mkdir(parents=True)
    (reference / "0" / "killed").touch()  # the reference is never killed
    proc = run_cli("-m", f"hydra.sweep.dir={reference}", *common, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.output[-3000:]
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", f"hydra.sweep.dir={sweep}", *common, cwd=tmp_path, env=env)
    assert proc.returncode != 0 and (sweep / "0" / "killed").is_file()
    proc = run_cli(
        "-m",
        f"hydra.sweep.dir={sweep}",
        *common,
        "sweep_output=full",
        cwd=tmp_path,
        env={**env, "SLURM_RESTART_COUNT": "1"},
    )
    assert proc.returncode == 0, proc.output[-3000:]
    result = json.loads((sweep / "0" / "result.json").read_text())
    assert result["status"] == "completed" and result["requeues"] == 1
    assert "Resumed from" in (sweep / "0" / "train.log").read_text() and "iter_20.pth" in proc.output
    import torch

    final, expected = (
        torch.load(d / "0" / "checkpoints" / "iter_80.pth", weights_only=True)["state_dict"] for d in (sweep, reference)
    )
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_a_requeued_sbatch_run_resumes_its_dir_without_resume_true(tmp_path):
    """The same for a single run of an sbatch script (``srun python -m expkit.train
    hydra.run.dir=...``) that Slurm requeued: its next start resumes by itself, without
    ``resume=true`` on its command line."""
    (tmp_path / "killonce.py").write_text(KILL_ONCE)
    common = [f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_epochs=1", "+hooks.kill._target_=killonce.KillOnce"]
    common += ["default_hooks.checkpoint.by_epoch=false", "default_hooks.checkpoint.interval=10"]
    env = {"PYTHONPATH": str(tmp_path)}
    assert run_cli(*common, cwd=tmp_path, env=env).returncode == -9  # (killed at iteration 25)
    proc = run_cli(*common, cwd=tmp_path, env={**env, "SLURM_RESTART_COUNT": "1"})
    assert proc.returncode == 0, proc.output[-3000:]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "Requeue 1: resuming this run from its last complete checkpoint" in log
    assert "iter_20.pth at epoch 0, iteration 20" in log
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert (result["status"], result["requeues"], result["iter"]) == ("completed", 1, 40), result


def test_the_summary_command_is_a_hydra_app_that_creates_nothing_for_a_wrong_dir(tmp_path):
    def sweep_cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "expkit.sweep", *args], capture_output=True, text=True)

    composed = sweep_cli("--cfg", "job", f"sweep_dir={tmp_path}", "plot=false")
    assert composed.returncode == 0 and f"sweep_dir: {tmp_path}" in composed.stdout and "plot: false" in composed.stdout
    for args in [(), (str(tmp_path / "nope"),), (f"sweep_dir={tmp_path / 'nope'}",)]:
        refused = sweep_cli(*args)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert "sweep_dir" in refused.stderr
    assert not (tmp_path / "nope").exists()
    empty = sweep_cli(str(tmp_path))  # a dir, but no jobs in it
    assert empty.returncode == 2 and "no job dirs" in empty.stderr and not (tmp_path / ".hydra").exists()


def test_summary_md_never_cuts_the_overrides_that_tell_jobs_apart():
    from expkit.sweeps.summary import _md_line

    common = " ".join(f"model.hidden{i}=[256,256]" for i in range(8))  # 160 characters alike
    rows = [{"job": n, "overrides": f"{common} optim.lr={lr}", "error": "x" * 300} for n, lr in ((0, 0.1), (1, 0.01))]
    lines = [_md_line(row, ["job", "overrides", "error"]) for row in rows]
    assert "optim.lr=0.1 |" in lines[0] and "optim.lr=0.01 |" in lines[1]
    assert lines[0].count("x") == 120  # an error is cut; the csv and the job's result.json hold it whole


def test_the_first_job_warns_once_when_the_sweeps_checkpoints_would_not_fit(tmp_path):
    """Two jobs keeping 2 regular + 1 best checkpoint of about 0.7 MB each (4.1 MB) on a 3 MB
    disk: the first job says so, with what to change; a sweep that fits says nothing."""
    from conftest import small_disk

    with small_disk(tmp_path / "disk", "3m") as disk:
        command = sweep_train(f"hydra.sweep.dir={disk / 'sweep'}", "trainer.max_epochs=1", "optim.lr=0.1,0.05")
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        output = proc.stdout + proc.stderr
        assert output.count("The sweep's 2 jobs would keep about") == 1, output[-3000:]
        assert "max_keep_ckpts=1" in output
    fits = subprocess.run(
        [*command[:4], f"hydra.sweep.dir={tmp_path / 'sweep'}", *command[5:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert fits.returncode == 0 and "would keep about" not in fits.stdout + fits.stderr


def test_a_job_recorded_again_is_listed_once_and_an_interrupted_one_is_not_done(three_jobs, tmp_path, monkeypatch):
    # a job interrupted (scancel, a signal) and then resumed ends twice: summary.csv listed it twice
    # until the sweep's end sorted it, and a resumed sweep's progress counted it as done (issue 53, item 4)
    import shutil

    from expkit.sweeps.summary import progress_line, record_job_end

    sweep = tmp_path / "sweep"
    shutil.copytree(three_jobs, sweep, ignore=shutil.ignore_patterns(".rows", "summary.*", "best.json", "sweep.svg"))
    result_file = sweep / "1" / "result.json"
    completed = json.loads(result_file.read_text())
    result_file.write_text(json.dumps({**completed, "status": "stopped", "stop_reason": "signal SIGTERM"}))
    for job in ("0", "1"):
        record_job_end(sweep, sweep / job)
    # (a sweep run in this worker before, in-process, left its launch's variables behind)
    monkeypatch.delenv("EXPKIT_SWEEP_LAUNCHED", raising=False)
    monkeypatch.setenv("EXPKIT_SWEEP_JOBS", "3")
    assert progress_line(sweep, "1").startswith("Sweep: 1/3 jobs done; job 1 (interrupted)")
    result_file.write_text(json.dumps(completed))  # resumed, and completed
    record_job_end(sweep, sweep / "1")
    record_job_end(sweep, sweep / "2")
    assert progress_line(sweep, "2").startswith("Sweep: 3/3 jobs done")
    # a launch of two jobs into a dir that holds three of an earlier one: its own jobs only
    monkeypatch.setenv("EXPKIT_SWEEP_JOBS", "2")
    monkeypatch.setenv("EXPKIT_SWEEP_LAUNCHED", repr(time.time()))
    assert progress_line(sweep, "2").startswith("Sweep: 1/2 jobs done; job 2")
    assert progress_line(sweep, "0").startswith("Sweep: 2/2 jobs done; job 0")
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert sorted(r["job"] for r in rows) == ["0", "1", "2"]  # each job once
    assert [r["status"] for r in rows] == ["completed"] * 3
    best = json.loads((sweep / "best.json").read_text())
    assert (best["jobs"], best["statuses"]) == (3, {"completed": 3})
    assert [line for line in (sweep / "summary.md").read_text().splitlines() if line.startswith("| 1 |")] != []
    assert sum(line.startswith("| 1 |") for line in (sweep / "summary.md").read_text().splitlines()) == 1


def test_the_summary_command_on_a_run_dir_exits_2_and_leaves_nothing_there(three_jobs):
    run_dir = three_jobs / "0"  # a run's dir, not a sweep's
    before = sorted(p.name for p in run_dir.iterdir())
    refused = subprocess.run(
        [sys.executable, "-m", "expkit.sweep", f"sweep_dir={run_dir}"], capture_output=True, text=True, cwd=REPO
    )
    assert refused.returncode == 2 and "no job dirs" in refused.stderr, refused.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == before  # no .summary.lock, no .rows
