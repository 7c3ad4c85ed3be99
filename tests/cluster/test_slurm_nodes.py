"""One run over two nodes of the real cluster (``slurm_cluster``: slurmd n1, n2 and n3 on this host):
through ``hydra/launcher=slurm_ddp`` with ``nodes=2``, and through a hand-written ``sbatch --nodes=2``
script whose ``srun`` starts ``python -m expkit.train`` once per node; a two-node job through a node
failure, a time limit's signal and a preemption; runs resumed on another number of nodes."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from conftest import (
    REPO,
    SEEN_PROBE,
    assert_same_weights,
    run_cli,
    seen_samples,
    slow_env,
    slow_train,
    torchrun_command,
    train_losses,
)
from slurm_fixture import last_node, slurm_cluster  # noqa: F401 (the session's cluster, its last node)

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


def _sacct_reading_node_fail(tmp_path, marked, read, asked) -> str:
    """A dir with an ``sacct`` that answers as the cluster's, except that while the file `marked`
    names a job, that job's state reads ``NODE_FAIL`` (and the file `read` is made). A job
    Slurm requeues after a node failure reads so in sacct for a few seconds (3-6 s on this
    cluster) before it reads PENDING; submitit's watcher polls every few tens of seconds and so
    reads it only sometimes (twice in the runs of 2026-11-28, and the sweep then ended). This
    makes it read it every time, so that the test fails without the sweep's handling of it.
    Its ``scontrol`` is the cluster's, and writes each call of a job's task to the file `asked`
    (``SLURM_PROCID`` and the arguments)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "scontrol").write_text(
        f'#!/bin/sh\n[ -n "$SLURM_PROCID" ] && echo "$SLURM_PROCID $*" >> {asked}\nexec {shutil.which("scontrol")} "$@"\n'
    )
    (shim / "scontrol").chmod(0o755)
    (shim / "sacct").write_text(
        "#!/bin/sh\n"
        f'out=$({shutil.which("sacct")} "$@"); rc=$?\n'
        f"if [ -f {marked} ]; then job=$(cat {marked}); touch {read}\n"
        '  out=$(printf "%s\\n" "$out" | sed "s/^$job|[A-Z_]*|/$job|NODE_FAIL|/"); fi\n'
        'printf "%s\\n" "$out"; exit $rc\n'
    )
    (shim / "sacct").chmod(0o755)
    return str(shim)


@pytest.mark.long(seconds=205)
def test_a_node_down_a_usr2_to_every_rank_and_a_preemption_each_requeue_a_two_node_job_which_resumes_exactly(
    slurm_cluster,  # noqa: F811
    last_node,  # noqa: F811
    tmp_path,
):
    """A two-node job runs on n2 and n3 (partition ``low``; n3 runs no other test's jobs). n3 is set
    DOWN while it trains: Slurm sends its ranks SIGTERM, ends the job and requeues it; it waits for
    two nodes until n3 comes back, and the sweep waits for it although submitit's watcher read the
    ended attempt's NODE_FAIL (``_sacct_reading_node_fail``). Later the job's steps get USR2 (as at a
    time limit: ``scancel --signal=USR2``, to every rank on both nodes): the ranks agree on the
    iteration to stop after, save once, and submitit requeues the job. An admin's ``scontrol
    requeue`` (SIGTERM to every rank) stops it the same way, and Slurm requeues it. Then a job of the higher
    partition (``urgent``) needs n3's CPUs: Slurm preempts the job (SIGTERM, GraceTime=30); it saves
    and requeues itself (Slurm would not: a job that ends within its grace time is COMPLETED). Each
    time the job resumes from its last complete checkpoint, and it ends with the weights and every
    logged loss of an uninterrupted run of two processes (torchrun, outside Slurm)."""
    epochs = ["trainer.max_epochs=21", "default_hooks.logger.plot=false"]
    first, last = slurm_cluster.nodes[0], last_node
    env = slow_env(tmp_path, **slurm_cluster.env)
    marked, read, asked = tmp_path / "node_fail.job", tmp_path / "node_fail.read", tmp_path / "scontrol.calls"
    shim = _sacct_reading_node_fail(tmp_path, marked, read, asked)
    sweep_env = {**env, "PATH": f"{shim}{os.pathsep}{env['PATH']}"}
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
        "hydra.launcher.max_num_timeout=1",  # (the one USR2: at a limit of 10 min submitit counts any as a timeout)
        *epochs,
        f"hydra.sweep.dir={sweep}",
    ]
    running = subprocess.Popen(
        slow_train(tmp_path, *launch),
        cwd=REPO,
        env=sweep_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
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

    try:
        wait_until(lambda: _past_epoch(work, 3), "epoch 3")
        (job,) = [p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+", p.name)]  # (not an array)
        marked.write_text(job)  # (the sweep's sacct says NODE_FAIL until submitit's watcher has read it; written
        # first, so that the watcher cannot read the real NODE_FAIL and be done with sacct before the shim is on)
        down = slurm_cluster.run("scontrol", "update", f"nodename={last}", "state=down", "reason=expkit-test")
        assert down.returncode == 0, down.stderr
        wait_until(lambda: restarts(job) >= 1, f"the requeue after {last} went down", timeout=120)
        wait_until(read.exists, "submitit's watcher reading NODE_FAIL", timeout=300)  # (it polls less often with age)
    finally:
        marked.unlink(missing_ok=True)
        slurm_cluster.run("scontrol", "update", f"nodename={last}", "state=resume")
    wait_until(lambda: _past_epoch(work, 8), "epoch 8 after the requeue")
    signalled = slurm_cluster.run("scancel", "--signal=USR2", job)  # (every task of the job's step)
    assert signalled.returncode == 0, signalled.stderr
    wait_until(lambda: restarts(job) >= 2 and _past_epoch(work, 12), "epoch 12 after the USR2")
    requeued = slurm_cluster.run("scontrol", "requeue", job)  # (an admin's: SIGTERM to every rank, then requeued)
    assert requeued.returncode == 0, requeued.stderr
    wait_until(lambda: restarts(job) >= 3 and _past_epoch(work, 15), "epoch 15 after scontrol requeue")
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
    assert result["status"] == "completed" and result["requeues"] == 4 and result["world_size"] == 2, story
    assert "Slurm is requeuing this job" in train_log and "stopped" not in output, story
    for log in (train_log, rank1_log):  # each rank stopped at Slurm's signals (SIGTERM: the node, scontrol, the
        # preemption), after the same iterations; a rank whose signal came a moment after the other's is told by
        # it at the next iteration ("(on another rank)"), the one that got it first says so itself
        assert "Stop requested: signal SIGTERM" in log and "Stop requested: signal SIGUSR2" in log, story
    for name in ("SIGTERM", "SIGUSR2"):
        said = re.findall(rf"Stop requested: signal {name}(?! \(on another rank\))", train_log + rank1_log)
        assert said, story
    resumed = [re.findall(r"Resumed from \S+ at epoch \d+, iteration \d+", log) for log in (train_log, rank1_log)]
    assert resumed[0] == resumed[1], resumed  # both ranks resumed from the same checkpoint each time
    assert train_log.count("Resumed from ") == 4, story
    # slurmctld is asked by rank 0 for the whole job: the end time at each start, "requeue or cancel?"
    # at each SIGTERM (a rank whose rank 0 is gone, on a failed node, asks itself)
    calls = asked.read_text().splitlines()
    assert sum(c.startswith("0 --oneliner show job") for c in calls) >= 5, calls  # (5 starts, 3 SIGTERMs)
    assert not [c for c in calls if not c.startswith("0 ")][1:], calls
    rows = list(csv.DictReader((sweep / "summary.csv").open()))  # the sweep records one completed job
    assert [(r["job"], r["status"]) for r in rows] == [("0", "completed")], rows
    assert reference.wait(timeout=300) == 0
    assert_same_weights(work, tmp_path / "reference", "epoch_21.pth")
    assert train_losses(work) == train_losses(tmp_path / "reference")  # each step once


@pytest.mark.long(seconds=60)
def test_a_two_node_run_resumes_on_one_node_and_a_one_node_run_on_two_every_sample_once(
    slurm_cluster,  # noqa: F811
    tmp_path,
):
    """Plain ``sbatch`` jobs whose ``srun`` starts ``python -m expkit.train``: a run of two nodes
    stopped after 7 iterations of its first epoch resumes in a job of one node, and a run of one
    node in a job of two. The resumed epoch is shared out from where the saved one stopped: every
    sample of the epoch is trained on once (a padding sample aside), none twice."""
    (tmp_path / "seenprobe.py").write_text(SEEN_PROBE)
    args = ["+hooks.seen._target_=seenprobe.Seen", "trainer.max_epochs=1", "default_hooks.logger.plot=false"]
    env = slurm_cluster.environ(OMP_NUM_THREADS="1", PYTHONPATH=str(tmp_path))

    def submit(name: str, nodes: int, *more: str) -> subprocess.Popen:
        script = tmp_path / f"{name}-{nodes}.sh"
        train = [sys.executable, "-m", "expkit.train", f"hydra.run.dir={tmp_path / name}", *args, *more]
        script.write_text("#!/bin/sh\nexec srun " + " ".join(train) + "\n")
        return subprocess.Popen(
            ["sbatch", "--wait", f"--nodes={nodes}", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=2G"]
            + ["--time=5", f"--output={tmp_path / name}-{nodes}.out", f"--chdir={REPO}", str(script)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def finish(job: subprocess.Popen, name: str, nodes: int) -> None:
        output, _ = job.communicate(timeout=300)
        story = output + (tmp_path / f"{name}-{nodes}.out").read_text()[-3000:] + slurm_cluster.log()
        assert job.returncode == 0, story

    whole = subprocess.run(  # the epoch's samples, from a run in one process outside Slurm
        [sys.executable, "-m", "expkit.train", f"hydra.run.dir={tmp_path / 'whole'}", *args],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    whole_epoch = seen_samples(tmp_path / "whole")
    stop = ["+hooks.stop._target_=expkit.hooks.StopAfterHook", "+hooks.stop.iters=7"]
    shapes = {"two": (2, 1), "one": (1, 2)}  # run: nodes it was saved on, nodes it resumes on
    started = {name: submit(name, saved, *stop) for name, (saved, _) in shapes.items()}
    for name, (saved, _) in shapes.items():
        finish(started[name], name, saved)
        assert sum(seen_samples(tmp_path / name).values()) == 7 * 32 * saved
    resumed = {name: submit(name, nodes, "resume=true", "~hooks.stop") for name, (_, nodes) in shapes.items()}
    for name, (saved, nodes) in shapes.items():
        finish(resumed[name], name, nodes)
        work = tmp_path / name
        log = (work / "train.log").read_text()
        assert "iter_7.pth at epoch 0, iteration 7" in log, log[-3000:]
        assert f"after {7 * 32 * saved} samples of its order (saved with {saved} processes, now {nodes})" in log
        result = json.loads((work / "result.json").read_text())
        assert (result["status"], result.get("world_size", 1)) == ("completed", nodes), result  # (1: no entry)
        seen = seen_samples(work)
        assert set(seen) == set(whole_epoch) and not whole_epoch - seen
        assert sum((seen - whole_epoch).values()) <= max(saved, nodes) - 1, seen - whole_epoch
