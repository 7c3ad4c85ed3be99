"""One writer per work dir: the lock file, a second writer refused, stale locks taken over,
two launches of one sweep running each job once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, run_cli, sweep_train

from expkit.workdir.ownership import LOCK_FILE, WorkDirBusy, WorkDirLock, live_owner, why_stale

SLOW_HOOK = """
import time
from pathlib import Path
from expkit import Hook

class Slow(Hook):
    '''Sleeps each iteration (so runs overlap) and counts the times a work dir starts training.'''

    def __init__(self, seconds: float = 0.02) -> None:
        self.seconds = seconds

    def before_train(self, runner):
        with open(runner.work_dir / "starts.txt", "a") as f:
            f.write(f"{runner.iter}\\n")

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        time.sleep(self.seconds)
"""


def _write_owner(work: Path, **fields) -> None:
    work.mkdir(parents=True, exist_ok=True)
    owner = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": "earlier",
        "command": "python x",
        "heartbeat": time.time(),
    } | fields
    (work / LOCK_FILE).write_text(json.dumps(owner))


def test_a_lock_file_without_a_live_owner_is_taken_over_and_a_live_one_refuses(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cases = {
        "dead pid here": ({"pid": dead.pid}, "is no longer running"),
        "pid reused": ({"start": "1"}, "is no longer running"),  # this PID, but another process's start time
        "old heartbeat there": ({"host": "elsewhere", "heartbeat": time.time() - 600}, "heartbeat is 600 s old"),
        "released": ({"released": True}, None),
    }
    for name, (fields, reason) in cases.items():
        work = tmp_path / name.replace(" ", "_")
        _write_owner(work, **fields)
        with WorkDirLock(work, heartbeat=0) as lock:
            assert (lock.took_over is None) if reason is None else (reason in lock.took_over), name
            assert json.loads((work / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert json.loads((work / LOCK_FILE).read_text())["released"] is True
    work = tmp_path / "fresh_heartbeat_there"
    _write_owner(work, host="elsewhere", pid=1)  # a live owner on another host (no flock shared)
    with pytest.raises(WorkDirBusy, match="pid 1 on elsewhere"):
        WorkDirLock(work, heartbeat=0).acquire()


def test_a_requeued_slurm_job_takes_its_earlier_attempts_lock_on_another_node_within_a_minute(tmp_path, monkeypatch):
    """A requeue on another node (a failed node, a preemption) finds the earlier attempt's lock:
    gone once its heartbeat is REQUEUED_STALE_S old, waited for while it is younger; a live owner
    that is not this job's earlier attempt still has STALE_AFTER_S."""
    from expkit.workdir import ownership

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    earlier = {"host": "node9", "pid": 1, "slurm_job": "77", "slurm_restart": 0}
    old = time.time() - ownership.REQUEUED_STALE_S - 10  # (well under STALE_AFTER_S)
    cases = {  # (the owner, the reason it is gone, or None when it may still run)
        "earlier attempt, silent": (earlier | {"heartbeat": old}, "attempt 0 of Slurm job 77, which is at attempt 1"),
        "earlier attempt, beating": (earlier | {"heartbeat": time.time()}, None),
        "this attempt": (earlier | {"slurm_restart": 1, "heartbeat": old}, None),
        "another job": (earlier | {"slurm_job": "76", "heartbeat": old}, None),
        "no Slurm record": ({"host": "node9", "pid": 1, "heartbeat": old}, None),
    }
    for name, (owner, reason) in cases.items():
        said = why_stale(owner)
        assert (said is None) if reason is None else (reason in said), (name, said)
    work = tmp_path / "requeued"
    _write_owner(work, **earlier, heartbeat=old)
    with WorkDirLock(work, heartbeat=0) as lock:
        assert "attempt 0 of Slurm job 77" in lock.took_over
        record = json.loads((work / LOCK_FILE).read_text())
        assert (record["slurm_job"], record["slurm_restart"]) == ("77", 1)  # what the next attempt will read
    # an earlier attempt's heartbeat 2 s short of stale: waited for, then taken (not refused)
    work = tmp_path / "waited"
    _write_owner(work, **earlier, heartbeat=time.time() - ownership.REQUEUED_STALE_S + 2)
    started = time.monotonic()
    with WorkDirLock(work, heartbeat=0) as lock:
        assert "attempt 0 of Slurm job 77" in lock.took_over
    assert 1.5 < time.monotonic() - started < 10
    # a fresh heartbeat (or a clock ahead of ours) that no longer changes, watched on this machine's clock
    work = tmp_path / "watched"
    _write_owner(work, **earlier, heartbeat=time.time() + 5)
    with WorkDirLock(work, heartbeat=0, requeued_stale_after=1.5) as lock:
        assert (
            "attempt 0 of Slurm job 77, which is at attempt 1 now, and its heartbeat has not changed" in lock.took_over
        )
    # a heartbeat that still changes: alive (a node Slurm lost contact with), refused after the wait
    work = tmp_path / "alive"
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.2):
            _write_owner(work, **earlier, heartbeat=time.time())

    _write_owner(work, **earlier, heartbeat=time.time())
    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(WorkDirBusy, match="earlier attempt of this job .* its heartbeat still changes"):
            WorkDirLock(work, heartbeat=0, requeued_stale_after=1.0, requeue_wait=2.5).acquire()
    finally:
        stop.set()
        beating.join()
    # the command's check before Hydra writes into the dir leaves an earlier attempt to the lock's wait
    from expkit.config import cli

    _write_owner(work, **earlier, heartbeat=time.time())
    assert cli.check_owner([f"hydra.run.dir={work}"]) is None
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")  # the same attempt, started twice: refused at once
    assert "pid 1 on node9" in cli.check_owner([f"hydra.run.dir={work}"])
    with pytest.raises(WorkDirBusy, match="pid 1 on node9"):
        WorkDirLock(work, heartbeat=0).acquire()


def test_an_owner_starting_while_a_probe_looks_at_its_lock_is_not_told_it_is_busy(tmp_path):
    """live_owner probes a lock with a shared flock for microseconds (a sweep's status, a
    worker counting the others); an owner whose acquire lands then waits for the probe, while a
    real holder still refuses it."""
    import fcntl
    import threading

    work = tmp_path / "run"
    work.mkdir()
    probe = os.open(work / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(probe, fcntl.LOCK_SH)  # (a probe caught in the middle)
    threading.Timer(0.1, os.close, (probe,)).start()  # (it lets go 100 ms later: descheduled, say)
    with WorkDirLock(work, heartbeat=0) as lock:
        assert lock.took_over is None
        with pytest.raises(WorkDirBusy, match=f"pid {os.getpid()}"):
            WorkDirLock(work, heartbeat=0).acquire()


def test_the_lock_is_held_while_the_owner_lives_and_dropped_when_it_is_killed(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; from expkit.workdir.ownership import WorkDirLock\n"
                f"lock = WorkDirLock(Path({str(tmp_path)!r}), 'holder', heartbeat=0.1).acquire(); print('held', flush=True)\n"
                "time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        first = json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"]
        time.sleep(0.3)
        assert json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"] > first  # the heartbeat runs
        assert live_owner(tmp_path)["command"] == "holder"
        with pytest.raises(WorkDirBusy, match=f"pid {holder.pid} on "):
            WorkDirLock(tmp_path, heartbeat=0).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert live_owner(tmp_path) is None
        with WorkDirLock(tmp_path, heartbeat=0) as lock:
            assert f"pid {holder.pid} is no longer running" in lock.took_over
    finally:
        holder.kill()


def _start_slow_run(tmp_path: Path, work: Path, *extra: str) -> subprocess.Popen:
    (tmp_path / "slowhook.py").write_text(SLOW_HOOK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "expkit.train",
            f"hydra.run.dir={work}",
            "trainer.max_epochs=3",
            "+hooks.slow._target_=slowhook.Slow",
            "+hooks.slow.seconds=0.1",
            *extra,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.slow
def test_a_second_writer_exits_2_naming_the_owner_and_a_killed_owner_is_taken_over(tmp_path):
    work = tmp_path / "run"
    owner = _start_slow_run(tmp_path, work)
    try:
        deadline = time.monotonic() + 60
        while not (work / "metrics.jsonl").is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        hydra_record = (work / ".hydra" / "overrides.yaml").read_text()
        log_size = (work / "train.log").stat().st_size
        for extra in ([], ["resume=true"], ["optim.lr=0.5"]):
            second = run_cli(f"hydra.run.dir={work}", *extra)
            assert second.returncode == 2, second.output
            assert f"is in use by pid {owner.pid} on {socket.gethostname()}" in second.stderr
            assert "Traceback" not in second.stderr
        assert (work / ".hydra" / "overrides.yaml").read_text() == hydra_record  # the owner's record untouched
        assert (work / "train.log").stat().st_size >= log_size and "is in use" not in (work / "train.log").read_text()
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        resumed = run_cli(  # (the run's own overrides hold the slow hook: the resume drops it)
            f"hydra.run.dir={work}",
            "trainer.max_epochs=3",
            "resume=true",
            "~hooks.slow",
            env={"PYTHONPATH": str(tmp_path)},
        )
        assert resumed.returncode == 0, resumed.output
        assert f"taking it over from pid {owner.pid}" in resumed.output and "is no longer running" in resumed.output
        assert json.loads((work / "result.json").read_text())["status"] == "completed"
    finally:
        owner.kill()


@pytest.mark.slow
def test_two_launches_of_one_sweep_run_each_job_once(tmp_path):
    (tmp_path / "slowhook.py").write_text(SLOW_HOOK)
    sweep = tmp_path / "sweep"
    command = sweep_train(
        "optim.lr=0.1,0.05,0.02,0.01",
        "trainer.max_epochs=2",
        "+hooks.slow._target_=slowhook.Slow",
        f"hydra.sweep.dir={sweep}",
        "sweep_output=full",
        "resume=true",
    )  # (two launches of one sweep: each may find the other's jobs)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    launches = [
        subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in launches]
    assert [p.returncode for p in launches] == [0, 0], outputs
    skipped = sum(
        o.count("this launch skips it")
        + o.count("this launch does not run it again")
        + o.count("is already completed; not trained again")
        for o in outputs
    )
    assert skipped >= 4, outputs  # every job ran in one launch and was skipped by the other
    for job in range(4):
        work = sweep / str(job)
        assert (work / "starts.txt").read_text() == "0\n", job  # trained exactly once
        steps = [json.loads(line)["step"] for line in (work / "metrics.jsonl").read_text().splitlines()]
        assert steps == sorted(steps) and len(steps) == len(set(zip(steps, range(len(steps))))), job
        assert json.loads((work / "result.json").read_text())["status"] == "completed"
    best = json.loads((sweep / "best.json").read_text())
    assert best["jobs"] == 4 and best["statuses"] == {"completed": 4}


def test_a_killed_owner_not_yet_reaped_owns_nothing(tmp_path):
    # a zombie answers os.kill(pid, 0) and keeps its start time in /proc: the other workers of a
    # search waited on such a worker's trial until it was reaped (issue 53, item 2)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import time; from pathlib import Path; from expkit.workdir.ownership import WorkDirLock\n"
                f"lock = WorkDirLock(Path({str(tmp_path)!r}), 'holder', heartbeat=0).acquire(); print('held', flush=True)\n"
                "time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGKILL)  # not reaped: no wait() until the end
        for _ in range(100):
            if Path(f"/proc/{holder.pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                break
            time.sleep(0.05)
        owner = json.loads((tmp_path / LOCK_FILE).read_text())
        # (the leader shows Z while the process's other threads still exit: the flock goes with the last)
        deadline = time.time() + 10
        while live_owner(tmp_path) is not None and time.time() < deadline:
            time.sleep(0.05)
        os.kill(holder.pid, 0)  # the zombie still answers, with its start time: what fooled the old check
        assert live_owner(tmp_path) is None
        # where locks are not honoured, the record alone decides: a zombie is not alive either
        assert why_stale(owner) == f"pid {holder.pid} is no longer running"
        with WorkDirLock(tmp_path, heartbeat=0) as lock:
            assert f"pid {holder.pid} is no longer running" in lock.took_over
    finally:
        holder.kill()
        holder.wait()


def test_an_owner_here_whose_lock_is_free_is_gone_even_if_its_pid_runs(tmp_path):
    # a record naming this very process (alive, same start time) but with no flock held on the file:
    # its PID was reused by a process that holds nothing there
    from expkit.workdir.ownership import _process_start

    _write_owner(tmp_path, start=_process_start(os.getpid()))
    assert live_owner(tmp_path) is None
    assert why_stale(json.loads((tmp_path / LOCK_FILE).read_text())) is None  # (the record alone: alive)
    with WorkDirLock(tmp_path, heartbeat=0) as lock:
        assert f"pid {os.getpid()} no longer holds its lock" in lock.took_over
