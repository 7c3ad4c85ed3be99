"""Time limits, requeues and scancel without a Slurm cluster: submitit's local executor sends its
timeout signal (USR2) and requeues as on Slurm; a run takes the requeue signal (USR1); SIGTERM
to one job of a sweep (Slurm's scancel); the time-limit guard on a toy run. The same paths on a
real slurmctld are in tests/cluster/test_slurm.py."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_same_weights, slow_env, slow_train, toy_runner, train_losses

from expkit.core.errors import ConfigError
from expkit.core.settings import TrainerSettings
from expkit.hooks.time_limit import TimeLimitHook


def _result(work: Path) -> dict:
    return json.loads((work / "result.json").read_text())


# -- the settings -------------------------------------------------------------------------------------
def test_requeue_settings_are_checked_and_the_signal_name_is_kept_bare():
    assert TrainerSettings(requeue_signal="SIGUSR2").requeue_signal == "USR2"
    assert TrainerSettings(requeue_signal=None).requeue_signal is None
    for bad, key in (
        ({"requeue_signal": "TERM"}, "trainer.requeue_signal"),
        ({"requeue_signal": "FOO"}, "trainer.requeue_signal"),
        ({"save_before_limit": "yes"}, "trainer.save_before_limit"),
        ({"limit_margin_s": -1}, "trainer.limit_margin_s"),
    ):
        with pytest.raises(ConfigError, match=key):
            TrainerSettings(**bad)


# -- save_before_limit: the guard itself, on a real toy run ------------------------------------------
def test_the_time_limit_guard_stops_resumable_while_a_save_still_fits_and_the_resume_ends_exactly(tmp_path):
    reference = toy_runner(tmp_path / "reference", max_epochs=2)
    reference.run()

    class SlowIterations(TimeLimitHook):
        """The guard with the job's end 0.5 s after training starts and a margin of 0.4 s; each
        iteration takes 20 ms or more (4 batches an epoch): it stops after iteration 4 or sooner."""

        def before_train(self, runner) -> None:
            self.deadline = time.monotonic() + 0.5
            super().before_train(runner)

        def after_train_iter(self, runner, **payload) -> None:
            time.sleep(0.02)
            super().after_train_iter(runner, **payload)

    guard = SlowIterations(time.time() + 3600, margin_s=0.4)
    cut = toy_runner(tmp_path / "cut", max_epochs=2, hooks={"time_limit": guard})
    result = cut.run()
    # stopped after a few iterations, saved where it stopped, resumable (not finished for a sweep)
    assert result["status"] == "stopped" and result["stop_reason"].startswith("interrupted: ")
    assert "trainer.save_before_limit" in result["stop_reason"] and cut.requeue and cut.stop_resumable
    assert 0 < result["iter"] < 8 and guard.longest_iter_s >= 0.02
    assert cut.last_checkpoint is not None and cut.last_checkpoint.name == f"iter_{result['iter']}.pth"
    from expkit.sweeps.sweep_jobs import finished

    assert not finished(result)

    resumed = toy_runner(tmp_path / "cut", max_epochs=2, resume=True)
    assert resumed.run()["status"] == "completed"
    for key, value in reference.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key


def test_a_run_outside_slurm_asks_slurm_nothing_and_gets_no_guard(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    runner = toy_runner(tmp_path, max_epochs=1)
    assert "time_limit" not in runner.hook_names()


def test_a_requeue_signal_after_sigterm_leaves_the_stop_to_sigterm_and_stops_the_job_alone(tmp_path, monkeypatch):
    """A job's time-limit signal (USR2) that lands while SIGTERM stops it (an admin's requeue, a
    preemption, a cancel) leaves the stop SIGTERM's: Slurm then says whether the job comes back,
    and the job stops alone. Before, USR2 took SIGTERM's place with no requeue asked, and the
    job stopped its whole sweep. USR2 first, then SIGTERM (Slurm's at submitit's own requeue): SIGTERM's,
    requeue kept, as before."""
    from expkit.core.signals import stop_for_signal
    from expkit.train import _stops_only_this_job

    for first, then, requeue in ((signal.SIGTERM, signal.SIGUSR2, False), (signal.SIGUSR2, signal.SIGTERM, True)):
        runner = toy_runner(tmp_path / first.name, max_epochs=1)
        runner.requeue_signals = (signal.SIGUSR2,)  # (a submitit job's)
        stop_for_signal(runner, first)
        stop_for_signal(runner, then)
        assert (runner.stop_signal, runner.requeue) == (signal.SIGTERM, requeue), first
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")  # (the run built: its job a submitit job from here)
        assert runner.stop_reason == f"signal {first.name}" and _stops_only_this_job(runner)
        monkeypatch.delenv("SUBMITIT_EXECUTOR")


def test_a_sigterm_during_start_up_under_slurm_is_the_runs_first_stop(tmp_path, monkeypatch):
    """A preemption (SIGTERM) while a run starts (imports, the group, the model, the data) used to kill
    the process: with a GraceTime, Slurm 22.05 then never requeues the job. Held
    (signals.hold_sigterm), it stops the run before its first iteration, recorded as stopped by the
    signal, and the command asks Slurm and requeues as at any SIGTERM; a repeat (slurmstepd and a
    launcher both forwarding it) is the same request. After the run SIGTERM's default action is
    back. Outside Slurm, and under torchrun (whose agent ends workers with SIGTERM), nothing is held."""
    import sys

    from expkit.core import signals

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    signals.hold_sigterm()
    try:
        assert signal.getsignal(signal.SIGTERM) is signals._hold  # (else the raise below would end pytest)
        signal.raise_signal(signal.SIGTERM)  # (during the start-up: no run holds the signals yet)
        signal.raise_signal(signal.SIGTERM)
        monkeypatch.delenv("SLURM_JOB_ID")  # (the runner asks no Slurm for its time limit)
        runner = toy_runner(tmp_path, max_epochs=1)
        result = runner.run()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # (the start-up is over)
    finally:
        signals.release_sigterm()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert (runner.stop_signal, runner.stop_reason) == (signal.SIGTERM, "signal SIGTERM (during start-up)")
    assert runner.stopped_by_signal and (result["status"], result["iter"]) == ("stopped", 0), result
    start_up = "import signal; from expkit.core import signals; signals.hold_sigterm(); " + (
        "signal.raise_signal(signal.SIGTERM); print('held', flush=True)"
    )
    cases = {"slurm": ({"SLURM_JOB_ID": "4242"}, 0), "no slurm": ({}, -signal.SIGTERM)}
    cases["torchrun"] = ({"SLURM_JOB_ID": "4242", "TORCHELASTIC_RESTART_COUNT": "0"}, -signal.SIGTERM)
    for name, (extra, code) in cases.items():
        env = {k: v for k, v in slow_env(tmp_path).items() if k not in ("SLURM_JOB_ID", "TORCHELASTIC_RESTART_COUNT")}
        proc = subprocess.run(
            [sys.executable, "-c", start_up], env=env | extra, capture_output=True, text=True, timeout=60
        )
        assert (proc.returncode, proc.stdout) == (code, "held\n" if code == 0 else ""), (name, proc)


# -- the requeue signal in a single run ---------------------------------------------------------------
@pytest.mark.slow
def test_the_requeue_signal_saves_and_stops_a_run_resumable_and_resume_ends_exactly(tmp_path):
    reference = tmp_path / "reference"
    common = ["trainer.max_epochs=3", "default_hooks.checkpoint.max_keep_ckpts=-1"]
    done = subprocess.Popen(
        [*slow_train(tmp_path, f"hydra.run.dir={reference}", *common)], cwd=REPO, env=slow_env(tmp_path)
    )
    work = tmp_path / "run"
    out = tmp_path / "run.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            slow_train(tmp_path, f"hydra.run.dir={work}", *common),
            cwd=REPO,
            env=slow_env(tmp_path),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120
        while not (work / "checkpoints" / "epoch_1.pth").exists():
            assert proc.poll() is None and time.time() < deadline, out.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=60) == 128 + signal.SIGUSR1, out.read_text()[-3000:]
    output = out.read_text()
    result = _result(work)
    assert (result["status"], result["stop_reason"]) == ("stopped", "signal SIGUSR1"), output[-3000:]
    assert "Not requeued (not a Slurm job); resume=true continues" in output
    assert "Traceback" not in output and 40 < result["iter"] < 120  # mid-run, saved where it stopped
    assert (work / "checkpoints" / "last_checkpoint").read_text() == f"iter_{result['iter']}.pth"

    resumed = subprocess.run(
        slow_train(tmp_path, f"hydra.run.dir={work}", "resume=true", *common),
        cwd=REPO,
        env=slow_env(tmp_path),
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert done.wait(timeout=240) == 0
    assert _result(work)["status"] == "completed"
    assert_same_weights(work, reference, "epoch_3.pth")
    assert train_losses(work) == train_losses(reference)  # each step once, as the uninterrupted run logged it


# -- submitit's time limit: USR2, checkpoint, requeue, resume ------------------------------------------
@pytest.mark.slow
@pytest.mark.long(seconds=55)
def test_submitit_time_limit_saves_requeues_and_the_next_attempt_resumes_exactly(tmp_path):
    """hydra/launcher=submitit_local with timeout_min=1: submitit sends USR2 30 s into each attempt
    (its local signal_delay_s), calls the launcher's checkpoint(), requeues and exits, as it does on
    Slurm. The job saves at the signal, is recorded stopped, and the next attempt resumes it."""
    reference = tmp_path / "reference"
    common = ["trainer.max_epochs=20"]
    done = subprocess.Popen(
        [*slow_train(tmp_path, f"hydra.run.dir={reference}", *common)], cwd=REPO, env=slow_env(tmp_path)
    )
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        slow_train(
            tmp_path,
            "-m",
            *common,
            "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=1",
            "+hydra.launcher.max_num_timeout=3",  # (Hydra's default, 0, requeues nothing)
            f"hydra.sweep.dir={sweep}",
        ),
        cwd=REPO,
        env=slow_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=400,
    )
    logs = "".join(p.read_text()[-3000:] for p in sorted((sweep / ".submitit").rglob("*_log.*")))
    story = proc.stdout[-3000:] + proc.stderr[-3000:] + logs + (sweep / "0" / "train.log").read_text()[-3000:]
    assert proc.returncode == 0, story
    result = _result(sweep / "0")
    assert result["status"] == "completed" and result["requeues"] >= 1, story
    assert result["resumed_in_sweep"] is True
    assert "Caught signal SIGUSR2" in logs and "Requeued job" in logs
    train_log = (sweep / "0" / "train.log").read_text()
    assert "Stop requested: signal SIGUSR2" in train_log and "Requeue 1: resuming this job" in train_log
    assert "SystemExit" not in story and "failed" not in result.get("error", "") if result.get("error") else True
    summary = (sweep / "summary.csv").read_text()
    assert ",completed," in summary and "failed" not in summary and "interrupted" not in summary

    assert done.wait(timeout=240) == 0
    assert_same_weights(sweep / "0", reference, "epoch_20.pth")
    assert train_losses(sweep / "0") == train_losses(reference)


@pytest.mark.slow
@pytest.mark.long(seconds=57)
def test_at_hydras_default_max_num_timeout_the_job_is_saved_stopped_and_resume_finishes_it(tmp_path):
    """Hydra's launcher defaults to max_num_timeout=0: submitit gives up at the first timeout. The
    job is still saved at USR2 and recorded stopped, not failed; resume=true finishes it."""
    sweep = tmp_path / "sweep"
    args = ["-m", "trainer.max_epochs=20", "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(
        slow_train(tmp_path, *args, "hydra.launcher.timeout_min=1", "+hydra.launcher.max_num_timeout=0"),
        cwd=REPO,
        env=slow_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = _result(sweep / "0")
    train_log = (sweep / "0" / "train.log").read_text()
    assert (result["status"], result["stop_reason"]) == ("stopped", "signal SIGUSR2"), train_log[-3000:]
    assert "Not requeued (Job not requeued because: timed-out too many times.)" in train_log
    assert ",interrupted," in (sweep / "summary.csv").read_text()

    resumed = subprocess.run(
        slow_train(tmp_path, *args, "hydra.launcher.timeout_min=10", "resume=true"),
        cwd=REPO,
        env=slow_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert _result(sweep / "0")["status"] == "completed"
    steps = [s for s, _ in train_losses(sweep / "0")]
    assert steps == sorted(set(steps)) and steps[-1] == 800  # each step logged once, to the end
