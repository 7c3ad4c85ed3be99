"""The rendezvous expkit forms outside torchrun (a plain ``srun``, a submitit job, variables set by
hand) is bounded: a rank that cannot reach it, or a group that never fills, fails within
``EXPKIT_RENDEZVOUS_TIMEOUT_S`` with one line naming the address and where it came from. Each case
is a real ``python -m expkit.train`` given the variables Slurm (or the user) gives a rank; no
cluster is needed. It was 30 minutes of torch's retry warnings (an unresolvable first node)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO

ADVICE = "set MASTER_ADDR to the address of rank 0's node, or EXPKIT_RENDEZVOUS_TIMEOUT_S to wait longer"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(tmp_path: Path, name: str, module: str = "expkit.train", **variables: str) -> subprocess.Popen:
    """One rank of a group that never forms (of ``python -m MODULE``): nothing else of the group is started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_"))}
    return subprocess.Popen(
        [sys.executable, "-m", module, f"hydra.run.dir={tmp_path / name}", "trainer.max_epochs=1"],
        cwd=REPO,
        env={**env, "OMP_NUM_THREADS": "1", "EXPKIT_RENDEZVOUS_TIMEOUT_S": "2", **variables},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_rendezvous_that_cannot_be_reached_fails_in_its_timeout_with_one_line_naming_the_address(tmp_path):
    port = str(_free_port())  # (nothing listens there)
    slurm = {  # a task of `srun` in an sbatch script on nodes n1, n2 (these names resolve nowhere here)
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "zz-expkit-node[1-2]",
        "SLURM_STEP_NODELIST": "zz-expkit-node[1-2]",
        "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    cases = {  # name: (its rank's variables, the line's end after the address)
        "unresolvable": (
            {
                "RANK": "1",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "zz-expkit.invalid",
                "MASTER_PORT": port,
            },
            f"zz-expkit.invalid:{port} (from MASTER_ADDR) within 2 s: the name 'zz-expkit.invalid' does not resolve",
        ),
        "nothing_listens": (  # srun in the batch script: the launch node's address, no name to look up
            {**slurm, "ENVIRONMENT": "BATCH"},
            f"127.0.0.1:{port} (from SLURM_LAUNCH_NODE_IPADDR) within 2 s: nothing answered there",
        ),
        "first_node": (  # srun from elsewhere (a login node): the first node of the allocation, by name
            slurm,
            f"zz-expkit-node1:{port} (from the first node of SLURM_JOB_NODELIST) within 2 s: "
            + "the name 'zz-expkit-node1' does not resolve",
        ),
    }
    started = time.monotonic()
    ranks = {name: _rank(tmp_path, name, **variables) for name, (variables, _) in cases.items()}
    alone = _rank(
        tmp_path,
        "alone",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    for name, (_, said) in cases.items():
        out, err = ranks[name].communicate(timeout=60)
        assert ranks[name].returncode == 1, (name, out, err)
        assert err.splitlines() == [f"Error: rank 1 of 2: no rendezvous at {said}; {ADVICE}"], (name, err)
        assert not list((tmp_path / name).glob("*"))  # (nothing written for a run that never formed)
    out, err = alone.communicate(timeout=60)  # rank 0, whose peer never comes
    assert alone.returncode == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("Error: rank 0 of 2: no rendezvous at 127.0.0.1:") and "not every rank joined" in err, err
    assert time.monotonic() - started < 120  # (each waits 2 s after its start-up: not the 30 minutes of before)


def test_a_rendezvous_timeout_that_is_not_a_number_of_seconds_is_refused_in_one_line(tmp_path):
    proc = _rank(
        tmp_path,
        "bad",
        RANK="1",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
        EXPKIT_RENDEZVOUS_TIMEOUT_S="soon",
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert err.splitlines() == [
        "Error: EXPKIT_RENDEZVOUS_TIMEOUT_S must be a positive number of seconds, got 'soon'; e.g. 300"
    ]


def test_the_range_test_says_an_unreachable_rendezvous_in_the_same_one_line(tmp_path):
    port = str(_free_port())
    variables = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "zz-expkit.invalid"}
    rank = _rank(tmp_path, "lr_find", module="expkit.lr_find", MASTER_PORT=port, **variables)
    out, err = rank.communicate(timeout=60)
    said = f"zz-expkit.invalid:{port} (from MASTER_ADDR) within 2 s: the name 'zz-expkit.invalid' does not resolve"
    assert rank.returncode == 1, (out, err)
    assert err.splitlines() == [f"Error: rank 1 of 2: no rendezvous at {said}; {ADVICE}"], err
