"""``slurm_cluster``: a real Slurm 22.05 cluster of three nodes on this machine (``scripts/setup_slurm.sh``
with EXPKIT_SLURM_NODES=3: munged, MariaDB, slurmdbd, slurmctld, ``slurmd -N n1`` ... ``-N n3`` at
127.0.0.1, each node with all of this machine's CPUs), started once per session and stopped at its end.
The default partition, ``debug``, has n1 and n2: a job of one node runs as on a one-node cluster,
``--nodes=2`` spans both. n3 is only in ``low`` (every node) and ``urgent`` (n3, whose jobs preempt
``low``'s): a test that sets n3 DOWN or preempts on it stops only its own job there.

A test module that needs it registers the fixture with ``from slurm_fixture import slurm_cluster  # noqa: F401``
and passes ``slurm_cluster.environ()`` (SLURM_CONF) to the commands it runs: ``sbatch``, ``sacct``,
or ``python -m expkit.train -m hydra/launcher=submitit_slurm ...``. The jobs run as the user who
submits them, so any dir that user can reach (``tmp_path``) serves as a job's or a sweep's dir.

Without Slurm (not installed, and this user may not install it: ``scripts/setup_slurm.sh install``
as root does) the tests skip and say why; where EXPKIT_REQUIRE_SLURM=1 (CI) they fail instead.

One cluster (its dir: EXPKIT_SLURM_DIR, /tmp/expkit-slurm by default; its ports: EXPKIT_SLURM_PORT,
6817-6819) serves every pytest-xdist worker. Each worker's session registers itself under a lock,
and the last one to finish stops the cluster, and only if a session started it (a cluster started
by hand is left running).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "setup_slurm.sh"
NOT_HERE = 3  # setup_slurm.sh start's status where Slurm is not installed or this user may not start it
NODES = "3"  # n1, n2 for the jobs of every test, n3 for the tests that fail or preempt a node


@dataclass(frozen=True)
class SlurmCluster:
    """A running cluster.

    Args:
        dir: the cluster's own dir (configs, spool, logs, the database), ``setup_slurm.sh``'s DIR.
        conf: its slurm.conf; every client finds the cluster through SLURM_CONF.
        partition: the default partition (``sbatch`` without ``-p`` uses it), over every node.
        cpus: a node's CPUs (this machine's).
        nodes: the nodes' names (n1, n2, n3), which resolve to 127.0.0.1; the last one is only in the
            partitions ``low`` and ``urgent``.
        env: what a client's environment needs (SLURM_CONF).
    """

    dir: Path
    conf: Path
    partition: str
    cpus: int
    nodes: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def environ(self, **extra: str) -> dict[str, str]:
        """This process's environment with the cluster's (and ``extra``), for a subprocess."""
        return {**os.environ, **self.env, **extra}

    def run(self, *command: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (``sbatch``, ``sacct``, ``scontrol``...) against this cluster."""
        return subprocess.run(
            command, env=self.environ(), capture_output=True, text=True, timeout=timeout, check=False, **kwargs
        )

    def log(self, daemon: str = "slurmctld", lines: int = 40) -> str:
        """The last lines of a daemon's log (slurmctld, slurmdbd, slurmd-n1, slurmd-n2), for a failing test's message."""
        try:
            return "\n".join((self.dir / "log" / f"{daemon}.log").read_text().splitlines()[-lines:])
        except OSError as e:
            return f"({daemon}'s log: {e})"


def _script(command: str, cluster_dir: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), command, str(cluster_dir)],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
        env={**os.environ, "EXPKIT_SLURM_NODES": NODES},
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _live_users(users: Path) -> list[Path]:
    """The sessions registered as using the cluster; a dead one's entry (a killed pytest) is dropped."""
    live = []
    for entry in users.glob("*.pid"):
        if entry.stem.isdigit() and _alive(int(entry.stem)):
            live.append(entry)
        else:
            entry.unlink(missing_ok=True)
    return live


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A started ``SlurmCluster`` for the whole session; skips without Slurm (fails where
    EXPKIT_REQUIRE_SLURM=1)."""
    cluster_dir = Path(os.environ.get("EXPKIT_SLURM_DIR", "/tmp/expkit-slurm"))
    users = cluster_dir / "test-sessions"  # the pytest sessions (xdist's workers) using the cluster
    users.mkdir(parents=True, exist_ok=True)
    lock, owned, me = users / "lock", users / "started-by-a-test-session", users / f"{os.getpid()}.pid"
    with _locked(lock):
        if not _live_users(users) and _script("status", cluster_dir, timeout=60).returncode != 0:
            owned.touch()  # this session starts it, so the last session stops it (else: started by hand)
        started = _script("start", cluster_dir)
        if started.returncode == NOT_HERE:
            reason = f"no Slurm cluster here: {started.stderr.strip()}"
            if os.environ.get("EXPKIT_REQUIRE_SLURM"):
                pytest.fail(f"{reason} (EXPKIT_REQUIRE_SLURM is set)")
            pytest.skip(reason)
        if started.returncode != 0:
            _script("stop", cluster_dir, timeout=120)
            pytest.fail(f"scripts/setup_slurm.sh start {cluster_dir} failed:\n{started.stdout}{started.stderr}")
        me.touch()
    conf = cluster_dir / "etc" / "slurm.conf"
    lines = [line.split() for line in conf.read_text().splitlines() if line.startswith("NodeName=")]
    nodes = tuple(words[0].removeprefix("NodeName=") for words in lines)
    cpus = int(next(word for word in lines[0] if word.startswith("CPUs=")).removeprefix("CPUs="))
    yield SlurmCluster(cluster_dir, conf, "debug", cpus, nodes, env={"SLURM_CONF": str(conf)})
    with _locked(lock):
        me.unlink(missing_ok=True)
        if not _live_users(users) and owned.exists():
            stopped = _script("stop", cluster_dir, timeout=120)
            owned.unlink(missing_ok=True)
            assert stopped.returncode == 0, stopped.stdout + stopped.stderr


@pytest.fixture
def last_node(slurm_cluster) -> Iterator[str]:
    """The cluster's last node (n3), this test's alone while it runs: the tests that set it DOWN or
    preempt its jobs take it in turn (an exclusive lock across pytest-xdist's workers), and no
    other test's jobs run there (it is outside the ``debug`` partition)."""
    node = slurm_cluster.nodes[-1]
    with _locked(slurm_cluster.dir / "test-sessions" / "last-node.lock"):
        slurm_cluster.run(
            "scontrol", "update", f"nodename={node}", "state=resume"
        )  # (after a killed test left it DOWN)
        try:
            yield node
        finally:
            slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=resume")
