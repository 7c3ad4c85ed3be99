"""resume=true in a group of two processes (gloo): every rank resumes from the checkpoint rank 0
picks, whatever its own view of the work dir says."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def _start(rank: int, port: int, dirs: list[str], chosen: dict) -> None:
    import torch.distributed as dist

    from expkit.checkpoint import run_checkpoint
    from expkit.core.errors import ResumeRefused
    from expkit.testing import toy_runner

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        runner = toy_runner(dirs[rank], resume=True)
        try:
            run_checkpoint.check_start(runner)
            path, checkpoint = runner.start_checkpoint
            chosen[rank] = (str(path), checkpoint["meta"]["iter"])
        except ResumeRefused as exc:
            chosen[rank] = ("refused", str(exc))
    finally:
        dist.destroy_process_group()


def _resume_in_two_ranks(dirs: list[Path]) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    chosen = mp.Manager().dict()
    mp.spawn(_start, args=(port, [str(d) for d in dirs], chosen), nprocs=2, join=True)
    return dict(chosen)


@pytest.fixture
def two_views(tmp_path) -> tuple[Path, Path]:
    """Rank 0's work dir after 2 epochs (last_checkpoint: epoch 2), and rank 1's view of it as a stale
    listing would give it: the pointer still at epoch 1."""
    from expkit.testing import toy_runner

    toy_runner(tmp_path / "run", max_epochs=2).run()
    stale = tmp_path / "stale"
    shutil.copytree(tmp_path / "run", stale)
    pointer = stale / "checkpoints" / "last_checkpoint"
    assert pointer.read_text().strip() == "epoch_2.pth"
    pointer.write_text("epoch_1.pth")
    return tmp_path / "run", stale


@pytest.mark.slow
def test_every_rank_resumes_from_rank_0s_choice(two_views):
    run, stale = two_views
    chosen = _resume_in_two_ranks([run, stale])
    expected = str(run / "checkpoints" / "epoch_2.pth")
    assert chosen[0][0] == chosen[1][0] == expected, chosen
    assert chosen[0][1] == chosen[1][1], chosen  # (the same content: the same iteration)
