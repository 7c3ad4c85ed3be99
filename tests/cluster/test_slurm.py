"""On a real one-node Slurm cluster (``slurm_cluster``: slurmctld, slurmd, slurmdbd on 127.0.0.1):
a plain ``sbatch`` job, and a sweep through Hydra's own submitit launcher."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, assert_same_weights, run_cli, slow_env, slow_train, torchrun_command, train_losses
from slurm_fixture import slurm_cluster  # noqa: F401 (the session's cluster)

pytestmark = pytest.mark.slow


def _accounted_state(cluster, job_id: str, timeout: float = 30) -> str:
    """The job's state as sacct (slurmdbd) has it; slurmctld sends it a moment after the job ends."""
    deadline = time.monotonic() + timeout
    while True:
        proc = cluster.run("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State")
        state = proc.stdout.strip()
        if state not in ("", "PENDING", "RUNNING", "COMPLETING") or time.monotonic() > deadline:
            return f"{state} {proc.stderr.strip()}".strip()
        time.sleep(0.5)


def _launcher(cluster, *settings: str, launcher: str = "submitit_slurm") -> list[str]:
    """A launcher's settings as a user of this cluster writes them: its partition, one CPU and a
    little memory per task (two tasks side by side on its 2 CPUs)."""
    return [
        f"hydra/launcher={launcher}",
        f"hydra.launcher.partition={cluster.partition}",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=2",
        *settings,
    ]


def _job_story(sweep, job: str) -> str:
    """What a sweep's job left, for a failing test's message: its status, the lines of each rank's
    log (submitit's among them) and of each Slurm task's stderr (srun's) that tell how each attempt
    began and ended, and when each task's result file was written."""
    folder = sweep / job
    result = json.loads((folder / "result.json").read_text()) if (folder / "result.json").is_file() else {}
    parts = [f"--- job {job}: " + json.dumps({k: result.get(k) for k in ("status", "stop_reason", "requeues")})]
    tasks = sorted(p for p in (sweep / ".submitit").glob(f"*_{job}") if p.is_dir())
    told = r"Stop requested|[Rr]equeu|Could not ask|Done \(|Caught signal|slave|successful|Exiting|[Ee]rror|Traceback"
    for log in [*sorted(folder.glob("*.log"), reverse=True), *(p for t in tasks for p in sorted(t.glob("*_log.err")))]:
        kept = [line for line in log.read_text().splitlines() if re.search(told, line)]
        parts.append(f"--- {log.name}:\n" + "\n".join(kept)[-3000:])
    for pickle in (p for t in tasks for p in sorted(t.glob("*_result.pkl"))):
        parts.append(f"--- {pickle.name} written {time.strftime('%H:%M:%S', time.localtime(pickle.stat().st_mtime))}")
    return "\n".join(parts) + "\n"


def test_sbatch_wait_runs_a_python_job_and_sacct_records_it_completed(slurm_cluster, tmp_path):  # noqa: F811
    script = tmp_path / "job.sh"
    code = 'import os; print("job", os.environ["SLURM_JOB_ID"], 6 * 7)'
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -c '{code}'\n")
    out = tmp_path / "out.txt"
    proc = slurm_cluster.run(
        "sbatch", "--wait", "--parsable", "--time=2", f"--output={out}", f"--chdir={tmp_path}", str(script), timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr + slurm_cluster.log()
    job_id = proc.stdout.strip().split(";")[0]
    assert out.read_text() == f"job {job_id} 42\n"
    assert _accounted_state(slurm_cluster, job_id) == "COMPLETED", slurm_cluster.log("slurmdbd")


def test_submitit_slurm_sweep_runs_each_job_on_the_cluster(slurm_cluster, tmp_path):  # noqa: F811
    # On this one-node cluster submitit_slurm's defaults work (partition=null: the default partition;
    # mem_gb=null: DefMemPerCPU, half the memory per job on 2 CPUs; timeout_min=60). Set here as a
    # user would: the partition, one CPU and a little memory each, so that both jobs run side by
    # side on 2 CPUs, and a limit above 2 min (submitit's USR2 comes signal_delay_s=120 s before it).
    proc = run_cli(
        "-m",
        *_launcher(slurm_cluster, "hydra.launcher.timeout_min=10"),
        "optim.lr=0.1,0.05",
        "trainer.max_epochs=1",
        f"hydra.sweep.dir={tmp_path}",
        env={**slurm_cluster.env, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.output + slurm_cluster.log()
    for job in ("0", "1"):
        result = json.loads((tmp_path / job / "result.json").read_text())
        assert result["status"] == "completed", result
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert sorted(r["job"] for r in rows) == ["0", "1"] and {r["status"] for r in rows} == {"completed"}
    # each job really ran as a Slurm job (its array task), and sacct has both
    job_ids = sorted(p.name for p in (tmp_path / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert len(job_ids) == 2, job_ids
    for job_id in job_ids:
        assert _accounted_state(slurm_cluster, job_id) == "COMPLETED", slurm_cluster.log("slurmdbd")


def test_slurm_ddp_asks_the_cluster_for_its_gpus_and_runs_a_job_as_ddp_over_two_tasks(slurm_cluster, tmp_path):  # noqa: F811
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1"}
    # what the cluster refuses is one Error: line and exit 2 (it was sbatch's error at the end of 55 lines)
    for bad, said in (
        (
            ["hydra.launcher.gpus_per_node=1"],
            "Error: the cluster refused the jobs: sbatch: error: Invalid generic resource",
        ),
        (["hydra.launcher.partition=nope"], "Error: hydra.launcher.partition: the cluster has no partition 'nope'"),
    ):
        proc = run_cli("-m", "hydra/launcher=slurm_ddp", *bad, f"hydra.sweep.dir={tmp_path / 'bad'}", env=env)
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and errors[-1].startswith(said) and len(errors) <= 2, proc.output
        assert "Traceback" not in proc.output

    # gpus_per_node from sinfo (this cluster has none: 0, so no --gpus line), tasks_per_node set: DDP over 2
    sweep = tmp_path / "ddp"
    proc = run_cli(
        "-m",
        *_launcher(slurm_cluster, "hydra.launcher.tasks_per_node=2", launcher="slurm_ddp"),
        "trainer.max_epochs=1",
        f"hydra.sweep.dir={sweep}",
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.output + slurm_cluster.log()
    result = json.loads((sweep / "0" / "result.json").read_text())
    assert result["status"] == "completed" and result["iter"] == 20, result  # 1258 samples / 2 ranks / 32
    assert (sweep / "0" / "rank1.log").is_file()
    (submission,) = (sweep / ".submitit").rglob("*_submission.sh")
    script = submission.read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and "gpu" not in script, script


def test_an_optuna_search_with_seed_groups_keeps_two_trials_in_flight_on_the_cluster(slurm_cluster, tmp_path):  # noqa: F811
    import optuna

    from expkit.sweeps.search import open_storage

    sweep = tmp_path / "search"
    proc = run_cli(
        "-m",
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.seeds_per_trial=2",
        *_launcher(slurm_cluster, "hydra.launcher.timeout_min=10"),
        "trainer.max_epochs=1",
        "data.batch_size=64",
        f"hydra.sweep.dir={sweep}",
        env={**slurm_cluster.env, "OMP_NUM_THREADS": "1"},
        timeout=420,
    )
    assert proc.returncode == 0, proc.output + slurm_cluster.log()
    results = {j: json.loads((sweep / j / "result.json").read_text()) for j in "0123"}
    assert {r["status"] for r in results.values()} == {"completed"}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="expkit", storage=open_storage(str(sweep / "optuna.journal")))
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    first, second = sorted(study.trials, key=lambda t: t.datetime_start)
    assert second.datetime_start < first.datetime_complete  # both trials were out on the cluster at once
    for trial in study.trials:  # each told the mean of its two seeds, each seed a Slurm job of its own
        jobs = [r for r in results.values() if r["optuna_trial"] == trial.number]
        assert len(jobs) == 2 and len({r["submitit_job"] for r in jobs}) == 2
        assert trial.value == pytest.approx(sum(r["best_metrics"]["val/acc"]["value"] for r in jobs) / 2)
    groups = list(csv.DictReader((sweep / "summary.csv").open()))
    assert len(groups) == 2 and {g["n"] for g in groups} == {"2"}


def test_a_sweep_job_whose_result_may_be_an_earlier_attempts_is_read_again_once_slurm_is_done(
    slurm_cluster,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """submitit may hand the launch results that earlier attempts of a job left while Slurm runs it
    again. Each return is checked (a real job here, still running, then ended): one whose job
    recorded itself stopped to be continued while Slurm still holds it is waited for, and the
    job's own result is returned; one whose job ran to its end after a requeue is read again from
    rank 0's result file, once that file is newer than the record (the last attempt writes it
    last); one whose job completed unrequeued is returned as read, with no question to Slurm."""
    import submitit
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from expkit.core.slurm import job_state
    from hydra_plugins.expkit_sweeper._slurm_requeues import launch_through_requeues

    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    folder = tmp_path / "submitit" / "%j"
    executor = submitit.SlurmExecutor(folder=folder)
    # (time=10: submitit asks for USR2 90 s before the limit, and Slurm may send it a minute early)
    executor.update_parameters(partition=slurm_cluster.partition, time=10, cpus_per_task=1, mem="1G")
    job = executor.submit(eval, "__import__('time').sleep(20) or 42")

    def read(status: str, reason: str | None, **record: int) -> JobReturn:  # as Hydra's run_job returns it
        work = tmp_path / status  # (chdir=false: working_dir is the cwd)
        work.mkdir(exist_ok=True)
        (work / "result.json").write_text(json.dumps({"status": status, "stop_reason": reason, **record}))
        ret = JobReturn(working_dir=os.getcwd(), status=JobStatus.COMPLETED, _return_value="read early")
        ret.hydra_cfg = OmegaConf.create({"hydra": {"job": {"id": job.job_id}, "runtime": {"output_dir": str(work)}}})
        return ret

    class Launched:  # Hydra's submitit launcher, as far as this needs it: what its launch returned, its params
        def __init__(self, ret: JobReturn) -> None:
            self.ret, self.params = ret, {"submitit_folder": str(folder), "nodes": 1, "tasks_per_node": 1}

        def launch(self, job_overrides, initial_job_idx):
            return [self.ret]

    try:
        deadline = time.monotonic() + 60
        while job_state(job.job_id) != "RUNNING":
            assert time.monotonic() < deadline, job_state(job.job_id)
            time.sleep(0.2)
        begun = time.monotonic()
        assert launch_through_requeues(Launched(read("completed", None)), [["a=1"]], 0)[0].return_value == "read early"
        assert time.monotonic() - begun < 5 and job_state(job.job_id) == "RUNNING"  # (not waited for)
        returned = launch_through_requeues(Launched(read("stopped", "signal SIGUSR2")), [["a=1"]], 0)
        assert returned == [42] and job_state(job.job_id) in (None, "COMPLETED")  # its own, once it has left
        requeued = read("completed", None, requeues=1)  # the last attempt's record, then its result file:
        written = job.paths.result_pickle.stat().st_mtime
        record = tmp_path / "completed" / "result.json"
        os.utime(record, (written - 5, written - 5))
        assert launch_through_requeues(Launched(requeued), [["a=1"]], 0) == [42]  # read again
        os.utime(record, (written + 5, written + 5))  # the record only (the result file is about to come)
        threading.Timer(1.5, os.utime, (job.paths.result_pickle, (written + 6, written + 6))).start()
        begun = time.monotonic()
        assert launch_through_requeues(Launched(requeued), [["a=1"]], 0) == [42] and time.monotonic() - begun >= 1.5
    finally:
        job.cancel(check=False)


@pytest.mark.long(seconds=370)
def test_a_requeue_a_time_limit_and_a_scancel_lose_nothing_of_a_two_node_sweep_on_the_cluster(slurm_cluster, tmp_path):  # noqa: F811
    """Each job is one DDP run over two nodes (``slurm_ddp``, ``nodes=2``). Job 0 is requeued by an
    admin mid-epoch (``scontrol requeue``: SIGTERM to every rank, then Slurm starts it again), then
    meets its real time limit (submitit's USR2 to every rank, signal_delay_s before timeout_min): it
    comes back each time and ends bit-identical to an uninterrupted run of two processes. Job 1 is
    cancelled (``scancel``: SIGTERM too): it is recorded stopped, the sweep says how to finish it,
    and ``resume=true`` finishes it alone."""
    epochs = ["trainer.max_epochs=80", "default_hooks.logger.plot=false"]  # (2 ranks: 1 s an epoch, past the signal)
    env = slow_env(tmp_path, **slurm_cluster.env)
    references = [
        subprocess.Popen(
            torchrun_command(f"hydra.run.dir={tmp_path / f'reference{seed}'}", f"trainer.seed={seed}", *epochs),
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for seed in (0, 1)
    ]
    sweep = tmp_path / "sweep"
    two_nodes = ["hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1"]
    limit = ["hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=60"]
    launch = [
        "-m",
        "trainer.seed=0,1",
        *epochs,
        *_launcher(slurm_cluster, *two_nodes, *limit, launcher="slurm_ddp"),
        # Hydra's default, 0, requeues no job at its time limit. With a limit of 10 minutes or less
        # submitit counts every USR2 as a timeout (its guaranteed walltime, min(0.8 limit, limit - 10
        # min), is 0 or less; the admin's SIGTERM counts none), and each try trains at most what its
        # 60 s leave after start-up: with 3, a fourth timeout on a loaded machine failed CI (the job
        # recorded stopped). 12 leaves room (the sweep's 900 s bound comes first); no assert counts tries.
        "hydra.launcher.max_num_timeout=12",
        f"hydra.sweep.dir={sweep}",
    ]
    running = subprocess.Popen(
        slow_train(tmp_path, *launch), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def past_epoch_3(job: str) -> bool:
        return any(int(p.stem.split("_")[1]) >= 3 for p in (sweep / job / "checkpoints").glob("epoch_*.pth"))

    deadline = time.monotonic() + 180
    while not (past_epoch_3("0") and past_epoch_3("1")):
        if running.poll() is not None or time.monotonic() > deadline:
            running.kill()
            pytest.fail(running.communicate()[0][-3000:] + slurm_cluster.log())
        time.sleep(0.3)
    array = {p.name.split("_")[1]: p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name)}
    assert slurm_cluster.run("scontrol", "requeue", array["0"]).returncode == 0
    assert slurm_cluster.run("scancel", array["1"]).returncode == 0
    try:
        output, _ = running.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        running.kill()
        output = "the sweep ran past 900 s, killed\n" + running.communicate()[0]
    train_log = (sweep / "0" / "train.log").read_text()
    story = output[-2500:] + _job_story(sweep, "0") + slurm_cluster.log(lines=60)
    assert running.returncode == 0, story
    stopped = "1 job stopped by a signal before the end, saved: run the sweep command again with resume=true"
    assert stopped in output, story
    requeued, cancelled = (json.loads((sweep / j / "result.json").read_text()) for j in "01")
    assert requeued["status"] == "completed" and requeued["requeues"] >= 2, story
    assert "Slurm is requeuing this job" in train_log and "Stop requested: signal SIGUSR2" in train_log, story
    rank1_log = (sweep / "0" / "rank1.log").read_text()  # the rank on the other node stopped at the same signals
    assert "Stop requested: signal SIGTERM" in rank1_log and "Stop requested: signal SIGUSR2" in rank1_log, story
    assert requeued["world_size"] == 2 and requeued["nodes"] == ["n1", "n2"], requeued
    assert cancelled["status"] == "stopped", cancelled  # (rank 0 may hear of the SIGTERM from rank 1 first:
    assert cancelled["stop_reason"].startswith("signal SIGTERM"), cancelled  # "signal SIGTERM (on another rank)")
    assert "1 completed 1 interrupted" in (sweep / "summary.csv").read_text()  # (the seed group's statuses)

    finished = (sweep / "0" / "metrics.jsonl").read_bytes()
    resumed = subprocess.run(
        slow_train(tmp_path, *launch, "hydra.launcher.timeout_min=10", "resume=true"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads((sweep / "1" / "result.json").read_text())["status"] == "completed"
    assert (sweep / "0" / "metrics.jsonl").read_bytes() == finished  # the completed job is not run again
    assert "interrupted" not in (sweep / "summary.csv").read_text()
    for seed, reference in enumerate(references):
        assert reference.wait(timeout=300) == 0
        assert_same_weights(sweep / str(seed), tmp_path / f"reference{seed}", "epoch_80.pth")
        assert train_losses(sweep / str(seed)) == train_losses(tmp_path / f"reference{seed}")  # each step once
