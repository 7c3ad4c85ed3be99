"""Searches that never wait: with ``hydra.sweeper.n_jobs=K`` and a launcher whose jobs run in
other processes (joblib, submitit), K trials are in flight while trials remain; a trial that
ends frees its slot at once, and the study is asked for the next trial then. Real joblib and
submitit_local workers, real Optuna studies; when each job ran is read from its own records."""

from __future__ import annotations

import csv
import json
import os
import signal
import time
from pathlib import Path

import optuna
import pytest
from conftest import finish_workers, kill_workers, run_cli, search_worker
from optuna.trial import TrialState

from expkit.sweeps.search import open_storage

EPOCHS = "trainer.max_epochs=choice(1,2)"  # (a sweep override on the command line: part of the search space)
GATE_HOOK = """
import time
from expkit import Hook

class Gate(Hook):
    # A trial of more than one epoch holds its first epoch open until trial 2's job has started
    # (its dir exists), or 120 s. With slots, trial 2 starts in the slot trial 1 left, so the
    # long trial goes on at once; in batches of two, trial 2 starts only after it: it waits 120 s.
    def after_train_epoch(self, runner):
        if runner.settings.max_epochs > 1 and runner.epoch == 0:
            deadline = time.monotonic() + 120
            while not (runner.work_dir.parent / "2").is_dir() and time.monotonic() < deadline:
                time.sleep(0.05)
"""


def _enqueued(storage: str, name: str, epochs: list[int]) -> None:
    """A study whose first trials are fixed: one of `epochs[i]` epochs each, in this order."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=open_storage(storage), direction="maximize")
    for e in epochs:
        study.enqueue_trial({"trainer.max_epochs": e})


def _span(job: Path) -> tuple[float, float]:
    """When the job began (Hydra records its config first) and ended (result.json, last)."""
    return (job / ".hydra" / "config.yaml").stat().st_mtime, (job / "result.json").stat().st_mtime


def _jobs_by_trial(sweep: Path) -> dict[int, Path]:
    jobs = [p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()]
    return {json.loads((j / "result.json").read_text())["optuna_trial"]: j for j in jobs}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_a_short_trial_starts_as_soon_as_a_slot_frees_not_after_the_slowest(tmp_path, launcher):
    """Trials of 2, 1 and 1 epochs, two at a time: trial 2 takes the slot trial 1 left while
    trial 0 still trains (a batch of two would wait for trial 0). A hook holds trial 0 open until
    trial 2's job exists, so the order does not hang on how busy the machine is."""
    conf = tmp_path / "conf" / "hooks"
    conf.mkdir(parents=True)
    (conf / "gate.yaml").write_text("gate:\n  _target_: gatehook.Gate\n")
    (tmp_path / "gatehook.py").write_text(GATE_HOOK)
    storage = f"{tmp_path}/study.journal"
    _enqueued(storage, "slots", [2, 1, 1])
    workers = (
        ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
        if launcher == "joblib"
        else ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5"]
    )
    proc = run_cli(
        "--config-dir",
        str(tmp_path / "conf"),
        "hparams_search=optuna",
        "hooks=[gate]",
        EPOCHS,
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.n_jobs=2",
        *workers,
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=slots",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.output
    study = optuna.load_study(study_name="slots", storage=open_storage(storage))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
    assert [t.params["trainer.max_epochs"] for t in study.trials] == [2, 1, 1]
    jobs = _jobs_by_trial(tmp_path / "sweep")
    assert sorted(jobs) == [0, 1, 2]  # each trial ran once, in a job dir of its own
    (_, end0), (_, end1), (start2, _) = (_span(jobs[n]) for n in (0, 1, 2))
    assert end1 < end0  # (the short trial ended first)
    assert start2 < end0, "trial 2 waited for the slowest trial of a batch"
    assert start2 >= end1 - 0.05  # it took the slot trial 1 left, not a third one
    assert end0 - start2 < 100, "trial 0 was held until its gate gave up: trial 2 started late"


# -- many workers, one study ---------------------------------------------------------------------
FAST = ["hparams_search=optuna", "trainer.max_epochs=1", "data.batch_size=64"]


def _one_study(sweep: Path, study: optuna.Study, n: int) -> dict:
    """Every trial ran once, in the job dir named by its number, and the summary has them all."""
    assert [t.number for t in study.trials] == list(range(n))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * n  # none failed, lost or left running
    jobs = _jobs_by_trial(sweep)
    assert {n_: j.name for n_, j in jobs.items()} == {i: str(i) for i in range(n)}
    with (sweep / "summary.csv").open() as f:
        assert len(list(csv.DictReader(f))) == n
    ledger = json.loads((sweep / "optuna_trials.json").read_text())["trials"]
    assert sorted(map(int, ledger)) == list(range(n))
    return ledger


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["journal", "sqlite"])
def test_the_same_search_started_twice_shares_one_study_and_one_sweep_dir(tmp_path, storage):
    sweep = tmp_path / "sweep"
    url = str(sweep / "optuna.journal") if storage == "journal" else f"sqlite:///{tmp_path}/study.db"
    args = [*FAST, "hydra.sweeper.n_trials=6", "hydra.sweeper.study_name=w", f"hydra.sweep.dir={sweep}"]
    if storage == "sqlite":
        args.append(f"hydra.sweeper.storage={url}")  # (the journal: the sweep dir's own, by default)
    workers = [search_worker(tmp_path, f"w{i}", *args) for i in range(2)]
    finish_workers(workers)
    study = optuna.load_study(study_name="w", storage=open_storage(url))
    ledger = _one_study(sweep, study, 6)  # n_trials: the sweep dir's total, not each worker's
    assert len({e["worker"] for e in ledger.values()}) == 2  # both workers ran trials
    params = [tuple(sorted(t.params.items())) for t in study.trials]
    assert len(set(params)) == 6  # the workers drew different trials (no shared seed)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_workers_trial_is_finished_by_another_when_it_is_killed_or_stopped(tmp_path, sig):
    """One of two workers is killed (SIGKILL: the worker and the job it runs in its process),
    or stopped with Ctrl-C (its job saves and stops, the trial stays running in the study): the
    other worker runs that trial's job again in its own dir, from its checkpoint, and tells
    the study once."""
    sweep = tmp_path / "sweep"
    args = [
        "hparams_search=optuna",
        "hooks=[slow]",
        "trainer.max_epochs=3",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.study_name=k",
        f"hydra.sweep.dir={sweep}",
    ]
    workers = [search_worker(tmp_path, f"w{i}", *args) for i in range(2)]
    try:
        deadline = time.time() + 300
        while not list(sweep.glob("[0-9]*/checkpoints/epoch_1.pth")):
            assert time.time() < deadline and all(p.poll() is None for p, _ in workers)
            time.sleep(0.05)
        job = min(sweep.glob("[0-9]*/checkpoints/epoch_1.pth")).parent.parent
        ledger = json.loads((sweep / "optuna_trials.json").read_text())["trials"]
        victim = int(next(e["worker"] for e in ledger.values() if e["job"] == job.name).split("-")[-2])
        os.killpg(victim, sig)
        proc, out = next(w for w in workers if w[0].pid == victim)
        assert proc.wait(timeout=120) == (-9 if sig == signal.SIGKILL else 130)
        if sig == signal.SIGINT:  # that worker only; it says so
            text = out.read_text()
            assert "Traceback" not in text and "1 other worker of the search goes on" in text, text[-3000:]
        finish_workers([w for w in workers if w[0].pid != victim])
    finally:
        kill_workers(workers)
    study = optuna.load_study(study_name="k", storage=open_storage(str(sweep / "optuna.journal")))
    ledger = _one_study(sweep, study, 3)
    result = json.loads((job / "result.json").read_text())
    assert result["status"] == "completed" and result["resumed_in_sweep"] is True  # from its checkpoint
    survivor = next(p.pid for p, _ in workers if p.pid != victim)
    assert int(ledger[str(result["optuna_trial"])]["worker"].split("-")[-2]) == survivor  # taken over


@pytest.mark.slow
def test_workers_on_two_sweep_dirs_share_a_postgresql_study(tmp_path, postgres):
    """Two workers of one sweep dir and a third in a sweep dir of its own (another host without
    the shared disk), all on one study in a real PostgreSQL server: every trial runs once."""
    args = [*FAST, "hydra.sweeper.n_trials=3", "hydra.sweeper.study_name=pg", f"hydra.sweeper.storage={postgres}"]
    workers = [search_worker(tmp_path, f"w{i}", *args, f"hydra.sweep.dir={tmp_path / 'shared'}") for i in range(2)]
    workers.append(search_worker(tmp_path, "w2", *args, f"hydra.sweep.dir={tmp_path / 'own'}"))
    finish_workers(workers)
    study = optuna.load_study(study_name="pg", storage=open_storage(postgres))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 6  # 3 for each sweep dir
    shared = json.loads((tmp_path / "shared" / "optuna_trials.json").read_text())["trials"]
    own = json.loads((tmp_path / "own" / "optuna_trials.json").read_text())["trials"]
    assert len(shared) == len(own) == 3 and not set(shared) & set(own)  # no trial run twice
    assert sorted(map(int, [*shared, *own])) == list(range(6))
    for sweep, ledger in ((tmp_path / "shared", shared), (tmp_path / "own", own)):
        assert {str(n): j.name for n, j in _jobs_by_trial(sweep).items()} == {n: n for n in ledger}


@pytest.mark.slow
def test_bad_storages_and_a_second_search_on_one_study_stop_before_training(tmp_path, postgres):
    unreachable = run_cli(
        *FAST, "hydra.sweeper.storage=postgresql://expkit@127.0.0.1:9/nowhere", f"hydra.sweep.dir={tmp_path / 'u'}"
    )
    assert unreachable.returncode == 2, unreachable.output
    assert "postgresql://expkit@127.0.0.1:9/nowhere" in unreachable.output and "pg_isready" in unreachable.output
    assert "Traceback" not in unreachable.output and not (tmp_path / "u" / "0").exists()

    first = run_cli(
        *FAST,
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.study_name=one",
        f"hydra.sweeper.storage={postgres}",
        f"hydra.sweep.dir={tmp_path / 'a'}",
    )
    assert first.returncode == 0, first.output
    other = run_cli(
        *FAST,
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.study_name=one",
        "optim.lr=choice(0.1,0.01)",
        f"hydra.sweeper.storage={postgres}",
        f"hydra.sweep.dir={tmp_path / 'b'}",
    )
    assert other.returncode == 2, other.output
    assert "study 'one'" in other.output and "optim.lr: CategoricalDistribution" in other.output
    assert "optim.lr: FloatDistribution" in other.output  # both spaces named
    assert not (tmp_path / "b" / "0").exists()


def test_workers_that_join_a_search_together_take_different_places(tmp_path):
    """A worker's place (what seeds its sampler apart from the others') is the lowest
    .workers/.place-<k> that no running worker holds a flock of. A worker that has taken its
    place but not yet its lock (the moment two workers started together used to both count
    none, seed their samplers alike and draw the same trials) still keeps the next from place 0;
    workers that run together hold different places, and a worker alone takes 0 again."""
    import fcntl
    import threading

    from expkit.sweeps.search import PLACE, WORKERS, join_search, live_workers

    (tmp_path / WORKERS).mkdir()
    first = os.open(tmp_path / WORKERS / PLACE.format(0), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(first, fcntl.LOCK_EX)  # (a worker in place 0, its lock not taken yet)
        assert live_workers(tmp_path) == 0
        held, place = join_search(tmp_path, "w1", "test")
        held.close()
        assert place == 1
    finally:
        os.close(first)
    joined: dict[str, object] = {}

    def join(name: str) -> None:
        try:
            joined[name] = join_search(tmp_path, name, "test")
        except BaseException as exc:  # (told to the test, not lost in the thread)
            joined[name] = exc

    threads = [threading.Thread(target=join, args=(f"w{i}",), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    held = [v for v in joined.values() if isinstance(v, tuple)]
    try:
        assert len(held) == 3, joined
        assert sorted(place for _, place in held) == [0, 1, 2]
        assert live_workers(tmp_path) == 3  # (the place files are not counted as workers)
    finally:
        for stack, _ in held:
            stack.close()
    assert live_workers(tmp_path) == 0
    held, place = join_search(tmp_path, "w4", "test")
    held.close()
    assert place == 0  # (alone: a resumed search seeds its sampler as the first worker did)
