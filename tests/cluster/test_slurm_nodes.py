"""One run over two nodes of the real cluster (``slurm_cluster``: slurmd n1, n2 and n3 on this host):
through ``hydra/launcher=slurm_ddp`` with ``nodes=2``, and through a hand-written ``sbatch --nodes=2``
script whose ``srun`` starts ``python -m expkit.train`` once per node."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from conftest import REPO, assert_same_weights, run_cli, slow_env, slow_train, torchrun_command, train_losses
from slurm_fixture import slurm_cluster  # noqa: F401 (the session's cluster)

pytestmark = pytest.mark.slow

ONE_EPOCH = ["trainer.max_epochs=1", "default_hooks.logger.plot=false"]


def _check_one_run_over_two_nodes(work, cluster, launched_from: str, checkpoint: str = "epoch_1.pth") -> None:
    """One work dir, written by rank 0 (rank 1 only its log), whose records say 2 processes on n1 and n2."""
    story = "".join((work / name).read_text()[-3000:] for name in ("train.log", "rank1.log") if (work / name).exists())
    result = json.loads((work / "result.json").read_text())
    shape = {"world_size": 2, "nodes": ["n1", "n2"], "processes_per_node": {"n1": 1, "n2": 1}}
    assert result["status"] == "completed" and result["iter"] == 20, story + cluster.log()  # 1258 / 2 ranks / 32
    assert {k: result[k] for k in shape} == shape, result
    assert result["rendezvous"].endswith(f" from {launched_from}"), result
    provenance = json.loads((work / "provenance.json").read_text())
    assert {k: provenance[k] for k in shape} == shape, provenance
    head = (work / "train.log").read_text().splitlines()[:4]
    assert any("World: 2 processes on 2 nodes (n1: 1, n2: 1); rendezvous 127.0.0.1:" in line for line in head), head
    assert not (work / "rank0.log").exists() and (work / "rank1.log").is_file()
    assert (work / "checkpoints" / checkpoint).exists(), sorted(p.name for p in (work / "checkpoints").iterdir())


def test_one_run_spans_two_nodes_through_slurm_ddp_with_ddp_fsdp_and_through_a_hand_written_sbatch(
    slurm_cluster,  # noqa: F811
    tmp_path,
):
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1"}
    # the hand-written script, submitted first: both jobs fit the cluster at once (a CPU of each node each)
    script = tmp_path / "job.sh"
    train = [sys.executable, "-m", "expkit.train", f"hydra.run.dir={tmp_path / 'sbatch'}", *ONE_EPOCH]
    script.write_text("#!/bin/sh\nexec srun " + " ".join(train) + "\n")
    sbatch = subprocess.Popen(
        ["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=2G", "--time=5"]
        + [f"--output={tmp_path / 'sbatch.out'}", f"--chdir={REPO}", str(script)],
        env=slurm_cluster.environ(OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    one_process = subprocess.Popen(  # a run in one process, outside Slurm: its epochs have twice the iterations
        [sys.executable, "-m", "expkit.train", f"hydra.run.dir={tmp_path / 'one'}", *ONE_EPOCH],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for strategy, checkpoint in (("ddp", "epoch_1.pth"), ("fsdp", "epoch_1.dcp")):  # (FSDP2: a sharded checkpoint)
        sweep = tmp_path / strategy
        proc = run_cli(
            "-m",
            "hydra/launcher=slurm_ddp",
            "hydra.launcher.nodes=2",
            "hydra.launcher.tasks_per_node=1",
            "hydra.launcher.cpus_per_task=1",
            "hydra.launcher.mem_gb=2",
            f"trainer.strategy={strategy}",
            *ONE_EPOCH,
            f"hydra.sweep.dir={sweep}",
            env=env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.output + slurm_cluster.log()
        assert [p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")] == ["0"]  # one work dir
        (submission,) = (sweep / ".submitit").rglob("*_submission.sh")
        assert "#SBATCH --nodes=2" in submission.read_text()
        _check_one_run_over_two_nodes(sweep / "0", slurm_cluster, "SLURM_LAUNCH_NODE_IPADDR", checkpoint)

    output, _ = sbatch.communicate(timeout=300)
    assert sbatch.returncode == 0, output + (tmp_path / "sbatch.out").read_text()[-3000:] + slurm_cluster.log()
    _check_one_run_over_two_nodes(tmp_path / "sbatch", slurm_cluster, "SLURM_LAUNCH_NODE_IPADDR")
    assert one_process.wait(timeout=120) == 0
    assert json.loads((tmp_path / "one" / "result.json").read_text())["iter"] == 40  # twice the 20 of each rank


def _past_epoch(work, epoch: int) -> bool:
    return any(int(p.stem.split("_")[1]) >= epoch for p in (work / "checkpoints").glob("epoch_*.pth"))


@pytest.mark.long(seconds=140)
def test_a_usr2_to_every_rank_and_a_preemption_each_requeue_a_two_node_job_which_resumes_exactly(
    slurm_cluster,  # noqa: F811
    tmp_path,
):
    """A two-node job runs on n2 and n3 (partition ``low``; n3 runs no other test's jobs). Its steps
    get USR2 (as at a time limit: ``scancel --signal=USR2``, to every rank on both nodes): the ranks agree on the
    iteration to stop after, save once, and submitit requeues the job. Then a job of the higher
    partition (``urgent``) needs n3's CPUs: Slurm preempts the job (SIGTERM, GraceTime=30); it saves
    and requeues itself (Slurm would not: a job that ends within its grace time is COMPLETED). Each
    time the job resumes from its last complete checkpoint, and it ends with the weights and every
    logged loss of an uninterrupted run of two processes (torchrun, outside Slurm)."""
    epochs = ["trainer.max_epochs=18", "default_hooks.logger.plot=false"]
    first, _, last = slurm_cluster.nodes
    env = slow_env(tmp_path, **slurm_cluster.env)
    reference = subprocess.Popen(
        torchrun_command(f"hydra.run.dir={tmp_path / 'reference'}", *epochs),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    sweep, work = tmp_path / "sweep", tmp_path / "sweep" / "0"
    launch = [
        "-m",
        "hydra/launcher=slurm_ddp",
        "hydra.launcher.nodes=2",
        "hydra.launcher.tasks_per_node=1",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=2",
        "hydra.launcher.partition=low",
        f"hydra.launcher.exclude={first}",  # (n3, and n2, which other tests' jobs share)
        "hydra.launcher.timeout_min=10",
        "hydra.launcher.max_num_timeout=1",  # (submitit counts a USR2 long before the limit as a preemption)
        *epochs,
        f"hydra.sweep.dir={sweep}",
    ]
    running = subprocess.Popen(
        slow_train(tmp_path, *launch), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def wait_until(done, what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if running.poll() is not None or time.monotonic() > deadline:
                running.kill()
                pytest.fail(f"{what}: " + running.communicate()[0][-3000:] + slurm_cluster.log())
            time.sleep(0.3)

    def restarts(job: str) -> int:
        found = re.search(r"Restarts=(\d+)", slurm_cluster.run("scontrol", "show", "job", job).stdout)
        return int(found.group(1)) if found else -1

    wait_until(lambda: _past_epoch(work, 4), "epoch 4")
    (job,) = [p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+", p.name)]  # (not an array)
    signalled = slurm_cluster.run("scancel", "--signal=USR2", job)  # (every task of the job's step)
    assert signalled.returncode == 0, signalled.stderr
    wait_until(lambda: restarts(job) >= 1 and _past_epoch(work, 10), "epoch 10 after the USR2")
    urgent = slurm_cluster.run(  # all of n3's CPUs, on the partition of the higher PriorityTier
        "sbatch",
        "--parsable",
        "--partition=urgent",
        f"--nodelist={last}",
        f"--cpus-per-task={slurm_cluster.cpus}",
        "--mem=500M",
        "--time=1",
        "--output=/dev/null",
        "--wrap=sleep 3",
    )
    assert urgent.returncode == 0, urgent.stderr
    output, _ = running.communicate(timeout=300)

    train_log, rank1_log = (work / "train.log").read_text(), (work / "rank1.log").read_text()
    story = output[-3000:] + train_log[-4000:] + slurm_cluster.log()
    assert running.returncode == 0, story
    result = json.loads((work / "result.json").read_text())
    assert result["status"] == "completed" and result["requeues"] == 2 and result["world_size"] == 2, story
    assert "Slurm is requeuing this job" in train_log and "stopped" not in output, story
    for log in (train_log, rank1_log):  # each rank stopped at Slurm's signals, not at the other's
        assert "Stop requested: signal SIGTERM" in log and "Stop requested: signal SIGUSR2" in log, story
        assert "(on another rank)" not in log, story
    assert train_log.count("Resumed from ") == 2, story
    assert reference.wait(timeout=300) == 0
    assert_same_weights(work, tmp_path / "reference", "epoch_18.pth")
    assert train_losses(work) == train_losses(tmp_path / "reference")  # each step once
