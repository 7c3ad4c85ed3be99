"""A sweep stopped the way people stop it: Ctrl-C in the terminal (SIGINT to the whole process
group) or SIGTERM (Slurm preemption), sent to real sweeps started in their own process group."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest
import torch
from conftest import REPO, run_cli, slow_env, slow_train
from optuna.trial import TrialState

pytestmark = pytest.mark.slow


def _command(tmp_path: Path, *args: str) -> list[str]:
    return slow_train(tmp_path, *args, sleep_s=0.01)


def _interrupt(tmp_path: Path, command: list[str], ready: Path, *signals: signal.Signals) -> tuple[int, str, float]:
    """Start `command` in its own process group, send `signals` to the group once `ready`
    exists; its exit status, its output, and the seconds from the first signal to its end."""
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            command, cwd=REPO, env=slow_env(tmp_path), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.time() + 240
            while not ready.exists():
                assert proc.poll() is None and time.time() < deadline, out.read_text()[-3000:]
                time.sleep(0.02)
            sent = time.time()
            for i, sig in enumerate(signals):
                if i:
                    time.sleep(0.05)
                os.killpg(proc.pid, sig)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return rc, out.read_text(), time.time() - sent


def _when_saved(jobs: list[Path], ready: Path) -> None:
    """Make `ready` (from a watcher thread) once every one of `jobs` has saved a checkpoint (any
    epoch's: retention removes epoch_1.pth two epochs later, and jobs started a few seconds apart on
    a loaded machine need not hold it at the same moment)."""

    def watch() -> None:
        deadline = time.time() + 240
        while time.time() < deadline and not all(any((job / "checkpoints").glob("epoch_*.pth")) for job in jobs):
            time.sleep(0.02)
        ready.touch()

    threading.Thread(target=watch, daemon=True).start()


def _status(job: Path) -> str:
    return json.loads((job / "result.json").read_text())["status"]


def test_ctrl_c_stops_the_sweep_and_the_printed_command_finishes_it(tmp_path):
    sweep = tmp_path / "sweep"
    command = _command(tmp_path, "-m", "optim.lr=0.1,0.05,0.02", "trainer.max_epochs=3", f"hydra.sweep.dir={sweep}")
    rc, output, took = _interrupt(tmp_path, command, sweep / "1" / "checkpoints" / "epoch_1.pth", signal.SIGINT)
    assert rc == 130, output[-3000:]
    assert took < 30 and "Traceback" not in output
    assert "Sweep interrupted (SIGINT): 1 completed, 1 interrupted, 1 not started of 3" in output
    assert not (sweep / "2").exists()  # no job started after the signal
    result = json.loads((sweep / "1" / "result.json").read_text())
    assert result["status"] == "stopped" and result["stop_reason"] == "signal SIGINT"  # interrupted, never failed
    assert "| interrupted |" in (sweep / "summary.md").read_text()

    resume = shlex.split(re.search(r"Resume it with: (.*)", output).group(1))
    assert resume[1:3] == ["-m", "expkit.train"] and resume[-1] == "resume=true"
    done = subprocess.run(  # pasted as printed: the interpreter that ran, not the `python` on PATH
        resume, cwd=REPO, env=slow_env(tmp_path), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [_status(sweep / j) for j in "012"] == ["completed"] * 3
    assert json.loads((sweep / "1" / "result.json").read_text())["resumed_in_sweep"] is True

    # the interrupted job ends with the weights of an uninterrupted run of the same job, on as many
    # torch threads (slow_env's one: on two physical cores the default of two sums in another order)
    reference = run_cli(
        f"hydra.run.dir={tmp_path / 'ref'}", "optim.lr=0.05", "trainer.max_epochs=3", env={"OMP_NUM_THREADS": "1"}
    )
    assert reference.returncode == 0, reference.output
    ref = torch.load(tmp_path / "ref" / "checkpoints" / "epoch_3.pth", weights_only=True)["state_dict"]
    got = torch.load(sweep / "1" / "checkpoints" / "epoch_3.pth", weights_only=True)["state_dict"]
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_sigterm_exits_143_and_a_second_ctrl_c_exits_at_once_without_a_traceback(tmp_path):
    sweep = tmp_path / "term"
    command = _command(tmp_path, "-m", "optim.lr=0.1,0.05", "trainer.max_epochs=3", f"hydra.sweep.dir={sweep}")
    rc, output, _ = _interrupt(tmp_path, command, sweep / "0" / "checkpoints" / "epoch_1.pth", signal.SIGTERM)
    assert rc == 143, output[-3000:]
    assert "Sweep interrupted (SIGTERM): 1 interrupted, 1 not started of 2" in output and "Traceback" not in output
    assert _status(sweep / "0") == "stopped" and not (sweep / "1").exists()

    sweep = tmp_path / "twice"
    command = _command(tmp_path, "-m", "optim.lr=0.1,0.05", "trainer.max_epochs=3", f"hydra.sweep.dir={sweep}")
    rc, output, took = _interrupt(
        tmp_path, command, sweep / "0" / "checkpoints" / "epoch_1.pth", signal.SIGINT, signal.SIGINT
    )
    assert rc == 130 and took < 30, output[-3000:]
    assert "Traceback" not in output and "Sweep interrupted (SIGINT)" in output
    assert _status(sweep / "0") == "stopped" and not (sweep / "1").exists()  # stopped, never failed


def test_ctrl_c_leaves_the_optuna_trial_running_for_resume_to_finish(tmp_path):
    sweep = tmp_path / "search"
    args = [
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=3",
        "trainer.max_epochs=3",
        "hydra.sweeper.study_name=s",
        f"hydra.sweep.dir={sweep}",
    ]
    rc, output, _ = _interrupt(
        tmp_path, _command(tmp_path, *args), sweep / "1" / "checkpoints" / "epoch_1.pth", signal.SIGINT
    )
    assert rc == 130 and "Traceback" not in output, output[-3000:]
    assert "1 completed, 1 interrupted, 1 not started of 3" in output
    from expkit.sweeps.search import open_storage

    def states() -> list[TrialState]:
        storage = open_storage(str(sweep / "optuna.journal"))
        return [t.state for t in optuna.load_study(study_name="s", storage=storage).trials]

    assert states() == [TrialState.COMPLETE, TrialState.RUNNING]  # not told as failed, nor complete
    done = subprocess.run(
        [*_command(tmp_path, *args), "resume=true"], cwd=REPO, env=slow_env(tmp_path), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert states() == [TrialState.COMPLETE] * 3
    assert json.loads((sweep / "1" / "result.json").read_text())["resumed_in_sweep"] is True


def test_ctrl_c_stops_joblib_workers_after_they_save_and_starts_no_other_job(tmp_path):
    sweep = tmp_path / "joblib"
    command = _command(
        tmp_path,
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "optim.lr=0.1,0.05,0.02,0.01",
        "trainer.max_epochs=6",
        f"hydra.sweep.dir={sweep}",
    )
    both = tmp_path / "both_running"
    _when_saved([sweep / j for j in "01"], both)  # the signal goes when both workers have a checkpoint
    rc, output, took = _interrupt(tmp_path, command, both, signal.SIGINT)
    assert rc == 130 and took < 30, output[-3000:]
    assert "Traceback" not in output
    assert "Sweep interrupted (SIGINT): 2 interrupted, 2 not started of 4" in output
    for job in "01":  # each worker's job saved its interruption checkpoint and recorded itself
        result = json.loads((sweep / job / "result.json").read_text())
        assert result["status"] == "stopped" and result["stop_reason"] == "signal SIGINT"
    assert not any((sweep / j / "result.json").exists() or (sweep / j / "checkpoints").exists() for j in "23")

    resume = shlex.split(re.search(r"Resume it with: (.*)", output).group(1))
    done = subprocess.run(
        [sys.executable, *resume[1:]], cwd=REPO, env=slow_env(tmp_path), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [_status(sweep / j) for j in "0123"] == ["completed"] * 4


def test_ctrl_c_stops_submitit_local_jobs_after_they_save_and_starts_no_other_job(tmp_path):
    sweep = tmp_path / "submitit"
    command = _command(
        tmp_path,
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=10",
        "optim.lr=0.1,0.05,0.02",
        "trainer.max_epochs=6",
        f"hydra.sweep.dir={sweep}",
    )
    started = tmp_path / "started"
    _when_saved([sweep / j for j in "012"], started)  # submitit_local runs the batch's jobs side by side
    rc, output, took = _interrupt(tmp_path, command, started, signal.SIGINT)
    assert rc == 130 and took < 60, output[-3000:]
    assert "Traceback" not in output
    assert "SIGINT: the running jobs save and stop" in output
    assert "Sweep interrupted (SIGINT): 3 interrupted of 3" in output, output[-3000:]
    for job in "012":
        result = json.loads((sweep / job / "result.json").read_text())
        assert result["status"] == "stopped" and result["stop_reason"] == "signal SIGINT"

    resume = shlex.split(re.search(r"Resume it with: (.*)", output).group(1))
    done = subprocess.run(
        [sys.executable, *resume[1:]], cwd=REPO, env=slow_env(tmp_path), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [_status(sweep / j) for j in "012"] == ["completed"] * 3


def test_ctrl_c_stops_an_optuna_search_in_slots_and_resume_finishes_its_trials(tmp_path):
    """Two trials in flight in joblib workers (no batch: each slot asks for its next trial):
    Ctrl-C lets both save and stop, asks the study for nothing more, leaves both running for
    resume=true, which finishes them and the trials still missing."""
    sweep = tmp_path / "slots"
    args = [
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=2",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "trainer.max_epochs=6",
        "hydra.sweeper.study_name=s",
        f"hydra.sweep.dir={sweep}",
    ]
    both = tmp_path / "both_running"
    _when_saved([sweep / j for j in "01"], both)
    rc, output, took = _interrupt(tmp_path, _command(tmp_path, *args), both, signal.SIGINT)
    assert rc == 130 and took < 30, output[-3000:]
    assert "Traceback" not in output
    assert "2 interrupted" in output and "of 4" in output, output[-3000:]
    for job in "01":
        assert _status(sweep / job) == "stopped"
    assert not (sweep / "2").exists()
    from expkit.sweeps.search import open_storage

    def states() -> list[TrialState]:
        storage = open_storage(str(sweep / "optuna.journal"))
        return [t.state for t in optuna.load_study(study_name="s", storage=storage).trials]

    assert states() == [TrialState.RUNNING] * 2  # no trial asked after the signal, none told failed
    done = subprocess.run(
        [*_command(tmp_path, *args), "resume=true"], cwd=REPO, env=slow_env(tmp_path), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert states() == [TrialState.COMPLETE] * 4
    assert [_status(sweep / j) for j in "0123"] == ["completed"] * 4


def test_ctrl_c_stops_a_sweep_that_started_with_sigint_ignored_at_any_moment(tmp_path):
    # a sweep started as a script's background job (`cmd &`) inherits SIGINT ignored; expkit takes
    # Ctrl-C back (docs/sweeps-in-practice.md): a kill -INT stops it as it stops a sweep started
    # normally, whenever it comes after a job's launch line (issue 53, item 3)
    for started in ("ignoring SIGINT", "normally"):
        for delay in (0.0, 0.05, 0.5):
            sweep = tmp_path / f"{started.split()[0]}-{delay}"
            command = _command(
                tmp_path, "-m", "optim.lr=0.1,0.05,0.02", "trainer.max_epochs=3", f"hydra.sweep.dir={sweep}"
            )
            out = tmp_path / f"{sweep.name}.txt"
            with out.open("w") as sink:
                proc = subprocess.Popen(
                    command,
                    cwd=REPO,
                    env=slow_env(tmp_path),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                try:
                    deadline = time.time() + 240
                    while "#1 : " not in out.read_text():
                        assert proc.poll() is None and time.time() < deadline, out.read_text()[-3000:]
                        time.sleep(0.01)
                    time.sleep(delay)
                    os.killpg(proc.pid, signal.SIGINT)
                    rc = proc.wait(timeout=120)
                finally:
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
            output = out.read_text()
            case = f"started {started}, SIGINT {delay} s after job 1's launch line"
            assert rc == 130, f"{case}: exit {rc}\n{output[-3000:]}"
            assert not (sweep / "2").exists(), case  # no job started after the signal
            assert "Traceback" not in output, case
