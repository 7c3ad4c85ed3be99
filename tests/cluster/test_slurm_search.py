"""A search across nodes of the real cluster (``slurm_cluster``): two workers of one Optuna search,
each a Slurm job of its own on another node, sharing one study in a real PostgreSQL server and
one sweep dir (the shared disk), and the node of one of them failing mid-trial."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import optuna
import pytest
from conftest import REPO
from optuna.trial import TrialState
from slurm_fixture import last_node, slurm_cluster  # noqa: F401 (the session's cluster, its last node)

from expkit.core.slurm import job_state
from expkit.sweeps.search import open_storage

pytestmark = pytest.mark.slow

NODE_HOOK = """
import os, time
from expkit import Hook

class SlowOnNode(Hook):
    # The node a job runs on (Slurm's name) in its work dir; 0.05 s an iteration (2 s an epoch).
    def before_run(self, runner):
        (runner.work_dir / "node").write_text(os.environ.get("SLURMD_NODENAME", "?"))
    def after_train_iter(self, runner, **kwargs):
        time.sleep(0.05)
"""


@pytest.mark.long(seconds=120)
def test_a_search_over_two_nodes_finishes_the_trial_of_a_worker_whose_node_failed(
    slurm_cluster,  # noqa: F811
    last_node,  # noqa: F811
    postgres,
    tmp_path,
    monkeypatch,
):
    """Worker jobs on n2 and n3 (``--no-requeue``: a job Slurm does not bring back). n3 is set DOWN
    while its worker's trial trains: that trial's job saves and is recorded stopped, not failed,
    as the worker goes; the worker on n2 takes the trial over from its checkpoint once its own
    trials are done, and the study ends with each of its 3 trials complete, once."""
    (tmp_path / "nodehook.py").write_text(NODE_HOOK)
    sweep, second, last = tmp_path / "sweep", slurm_cluster.nodes[1], last_node
    args = [
        "hparams_search=optuna",
        "+hooks.node._target_=nodehook.SlowOnNode",
        "trainer.max_epochs=3",
        "default_hooks.logger.plot=false",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.study_name=nodes",
        f"hydra.sweeper.storage={postgres}",
        f"hydra.sweep.dir={sweep}",
    ]
    script = tmp_path / "worker.sh"
    script.write_text("#!/bin/sh\nexec srun " + " ".join([sys.executable, "-m", "expkit.train", *args]) + "\n")
    env = slurm_cluster.environ(OMP_NUM_THREADS="1", PYTHONPATH=str(tmp_path), HYDRA_FULL_ERROR="0")

    def submit(node: str) -> str:
        submitted = subprocess.run(
            ["sbatch", "--parsable", "--no-requeue", "--partition=low", f"--nodelist={node}", "--ntasks=1"]
            + ["--cpus-per-task=1", "--mem=2G", "--time=5", f"--output={tmp_path / node}.out", f"--chdir={REPO}"]
            + [str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert submitted.returncode == 0, submitted.stderr
        return submitted.stdout.strip()

    def state(job: str) -> str:
        shown = slurm_cluster.run("scontrol", "show", "job", job).stdout
        return next((w.split("=", 1)[1] for w in shown.split() if w.startswith("JobState=")), "GONE")

    def story() -> str:
        return "".join((tmp_path / f"{n}.out").read_text()[-2500:] for n in (second, last)) + slurm_cluster.log()

    def wait_until(done, what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"{what}:\n{story()}"
            time.sleep(0.2)

    jobs = {node: submit(node) for node in (second, last)}
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])  # (what the sweep asks slurmctld)
    assert job_state(jobs[second]) in ("PENDING", "CONFIGURING", "RUNNING") and job_state("987654321") is None
    try:

        def victim() -> str | None:  # a job dir of n3's worker whose first epoch is saved
            for node_file in sweep.glob("[0-9]*/node"):
                if node_file.read_text() == last and (node_file.parent / "checkpoints" / "epoch_1.pth").exists():
                    return node_file.parent.name
            return None

        wait_until(lambda: victim() is not None, f"a trial of {last}'s worker past its first epoch")
        job_dir = sweep / str(victim())
        down = slurm_cluster.run("scontrol", "update", f"nodename={last}", "state=down", "reason=expkit-test")
        assert down.returncode == 0, down.stderr
        wait_until(lambda: state(jobs[last]) not in ("RUNNING", "COMPLETING"), f"{last}'s worker ended")
        assert state(jobs[last]) == "NODE_FAIL", story()
        wait_until((job_dir / "result.json").exists, "the record of the stopped trial", timeout=60)  # (Slurm ends
        # the job at once; its processes have KillWait, 30 s, to finish before SIGKILL)
        stopped = json.loads((job_dir / "result.json").read_text())
        assert (stopped["status"], stopped["stop_reason"]) == ("stopped", "signal SIGTERM"), stopped
    finally:
        slurm_cluster.run("scontrol", "update", f"nodename={last}", "state=resume")
    wait_until(lambda: state(jobs[second]) not in ("PENDING", "RUNNING", "COMPLETING"), f"{second}'s worker ended")
    assert state(jobs[second]) == "COMPLETED", story()

    study = optuna.load_study(study_name="nodes", storage=open_storage(postgres))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3, story()  # none failed, lost or left running
    ledger = json.loads((sweep / "optuna_trials.json").read_text())["trials"]
    assert sorted(map(int, ledger)) == [0, 1, 2]  # each trial once, in the job dir named by its number
    finished = json.loads((job_dir / "result.json").read_text())
    assert finished["status"] == "completed" and finished["resumed_in_sweep"] is True, finished
    assert (job_dir / "node").read_text() == second  # taken over by n2's worker, from its checkpoint
    assert "Resumed from " in (job_dir / "train.log").read_text()
