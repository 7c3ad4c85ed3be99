"""Several nodes: two torchrun agents on this machine act as two nodes (c10d rendezvous on
127.0.0.1, one process each), for DDP and FSDP2. One work dir, one set of records, the same
weights as one node with two processes, and elastic restarts across both nodes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import DIE_ONCE, torchrun, torchrun_command  # (DIE_ONCE: rank 1, the second node's worker)

pytestmark = pytest.mark.slow

COMMON = ["trainer.max_epochs=2", "default_hooks.checkpoint.by_epoch=false", "default_hooks.checkpoint.interval=10"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}


def _two_nodes(tmp_path: Path, *args: str, restarts: int = 0) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents, one per "node", joined by a c10d rendezvous on 127.0.0.1."""
    port = _free_port()
    rendezvous = ("--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=test{port}")
    command = torchrun_command(*args, nproc=1, launcher=(*rendezvous, f"--max-restarts={restarts}"), standalone=False)
    nodes = [
        subprocess.Popen(
            command, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    done = []
    for node in nodes:
        out, err = node.communicate(timeout=400)
        done.append(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    return done


def _one_node(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return torchrun(*args, cwd=tmp_path, env=_env(tmp_path), timeout=400)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from expkit.checkpoint.checkpoint_io import load_checkpoint

    return load_checkpoint(path, "test")["state_dict"]


def _story(procs) -> str:
    return "\n".join(f"--- node {i}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}" for i, p in enumerate(procs))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_nodes_write_one_run_equal_to_one_node_with_two_processes(tmp_path, strategy):
    reference = tmp_path / "one_node"
    assert _one_node(tmp_path, *COMMON, f"trainer.strategy={strategy}", f"hydra.run.dir={reference}").returncode == 0
    work = tmp_path / "two_nodes"
    procs = _two_nodes(tmp_path, *COMMON, f"trainer.strategy={strategy}", f"hydra.run.dir={work}")
    assert all(p.returncode == 0 for p in procs), _story(procs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one_node", "two_nodes"]  # nothing else, anywhere
    assert (work / "rank1.log").is_file() and (work / "metrics.jsonl").is_file()
    assert not (work / ".hydra" / "rank1").exists()
    result = json.loads((work / "result.json").read_text())
    assert result["status"] == "completed" and result["iter"] == 40, result  # 1258 samples / 2 ranks / 32: 20 an epoch
    records = [(w / "metrics.jsonl").read_text().splitlines() for w in (work, reference)]
    assert len(records[0]) == len(records[1])  # one set of records, written once
    if strategy == "fsdp":  # every rank wrote its shard
        shards = sorted(p.name for p in (work / "checkpoints" / "iter_40.dcp").glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"]
    final = "iter_40.dcp" if strategy == "fsdp" else "iter_40.pth"
    a, b = (_weights(w / "checkpoints" / final) for w in (work, reference))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_dead_worker_on_one_node_restarts_both_and_they_resume_bit_identical(tmp_path, strategy):
    (tmp_path / "diehook.py").write_text(DIE_ONCE)
    reference = tmp_path / "reference"
    assert _one_node(tmp_path, *COMMON, f"trainer.strategy={strategy}", f"hydra.run.dir={reference}").returncode == 0
    procs = _two_nodes(
        tmp_path, *COMMON, f"trainer.strategy={strategy}", "+hooks.die._target_=diehook.DieOnce", restarts=1
    )  # (no hydra.run.dir: the restart finds rank 0's dir in the store)
    assert all(p.returncode == 0 for p in procs), _story(procs)
    (work,) = (tmp_path / "outputs" / "runs").iterdir()
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["runs"]
    assert (work / "died").is_file()
    result = json.loads((work / "result.json").read_text())
    assert result["status"] == "completed" and result["restarts"] == 1 and result["iter"] == 40, _story(procs)
    assert "Resumed from" in (work / "train.log").read_text()
    final = "iter_40.dcp" if strategy == "fsdp" else "iter_40.pth"
    a, b = (_weights(w / "checkpoints" / final) for w in (work, reference))
    assert all(torch.equal(a[k], b[k]) for k in b)
