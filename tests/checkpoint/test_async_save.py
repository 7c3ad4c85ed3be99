"""default_hooks.checkpoint.async_save=true: the loop waits only for a copy of the state; the
file is written in the background, and nothing a synchronous save promises is lost."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from conftest import run_cli, torchrun, toy_runner

from expkit.checkpoint.async_writer import BackgroundWriter
from expkit.core.errors import CheckpointWriteError

SAVES = [
    "trainer.max_epochs=3",
    "default_hooks.checkpoint.by_epoch=false",
    "default_hooks.checkpoint.interval=15",
    "default_hooks.checkpoint.max_keep_ckpts=2",
]


def test_the_loop_goes_on_while_a_write_runs_and_what_follows_it_waits_for_it():
    writer = BackgroundWriter()
    release, order = threading.Event(), []

    def slow_write() -> None:
        assert release.wait(30)
        order.append("written")

    writer.submit(slow_write, then=lambda: order.append("then"), position=(0, 10, 10))
    writer.after(lambda: order.append("retention"))  # follows the write, in the writer's thread
    assert order == []  # submit returned while the write is held
    release.set()
    writer.wait("regular", position=(0, 20, 20), why="saving iter_20.pth")
    assert order == ["written", "retention", "then"]
    writer.after(lambda: order.append("at once"))  # nothing in flight: now
    assert order[-1] == "at once"
    writer.close()


def test_a_failed_write_raises_at_the_next_wait_and_what_was_to_follow_it_never_runs():
    writer = BackgroundWriter()
    ran = []

    def failing() -> None:
        raise CheckpointWriteError("could not write iter_20.pth: no space left on the device")

    writer.submit(failing, then=lambda: ran.append("then"))
    writer.after(lambda: ran.append("retention"))  # (would delete the previous checkpoint)
    with pytest.raises(CheckpointWriteError, match="no space left"):
        writer.wait("regular")
    assert ran == []
    writer.close()


def test_the_staged_copy_does_not_change_with_training_and_keeps_tied_tensors_one():
    writer = BackgroundWriter()
    weight = torch.arange(6.0).reshape(2, 3)
    state = {"state_dict": {"a.weight": weight, "b.weight": weight}, "meta": {"lr": [0.1]}, "step": torch.tensor(3)}
    staged = writer.stage(state)
    weight.add_(100)  # the optimizer steps on after the save returned
    state["meta"]["lr"][0] = 0.2
    assert torch.equal(staged["state_dict"]["a.weight"], torch.arange(6.0).reshape(2, 3))
    assert staged["state_dict"]["a.weight"] is staged["state_dict"]["b.weight"] and staged["meta"]["lr"] == [0.1]
    buffer = staged["state_dict"]["a.weight"]
    assert writer.stage(state)["state_dict"]["a.weight"] is buffer  # the host buffer is reused, refreshed
    assert torch.equal(buffer, weight)


def _checkpoints(work: Path) -> dict[str, dict]:
    return {p.name: torch.load(p, weights_only=True) for p in sorted((work / "checkpoints").glob("*.pth"))}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.slow
def test_async_saves_write_what_synchronous_saves_write(tmp_path):
    runs = {}
    for mode in ("false", "true"):
        work = tmp_path / mode
        proc = run_cli(f"hydra.run.dir={work}", *SAVES, f"default_hooks.checkpoint.async_save={mode}")
        assert proc.returncode == 0, proc.output
        runs[mode] = work
    sync, background = (_checkpoints(runs[m]) for m in ("false", "true"))
    assert list(background) == list(sync) == ["best_val_acc_iter_80.pth", "iter_105.pth", "iter_120.pth"]
    for name in sync:  # every tensor, the optimizer state, the RNG streams, the hooks' state
        a, b = sync[name], background[name]
        for meta in (a["meta"], b["meta"]):  # (clock readings, and the dirs)
            meta.pop("time"), meta.pop("wall_time_s"), meta.pop("work_dir")
        a.pop("config"), b.pop("config"), a["hooks"].pop("timer"), b["hooks"].pop("timer")  # (the config, timings)
        assert _same(a, b), name
    assert (runs["true"] / "checkpoints" / "last_checkpoint").read_text() == "iter_120.pth"
    results = [json.loads((runs[m] / "result.json").read_text()) for m in ("false", "true")]
    assert results[0]["final_metrics"] == results[1]["final_metrics"]
    assert results[1]["last_checkpoint"].endswith("iter_120.pth")
    assert not list(runs["true"].rglob("*.tmp*"))


KILL_MID_WRITE = '''
import os, time
import torch
from expkit import Hook

class KillMidWrite(Hook):
    """Makes the second regular save big (a slow write), then ends the process at once, as SIGKILL
    would, at the next iteration while the background write of that file is still going on."""

    priority = "LOWEST"

    def __init__(self):
        self.saves, self.writing = 0, None

    def before_save_checkpoint(self, runner, *, checkpoint):
        self.saves += "optimizer" in checkpoint
        if self.saves == 2 and "optimizer" in checkpoint and not (runner.work_dir / "killed").exists():
            checkpoint["ballast"] = torch.ones(150_000_000)  # 600 MB: the write takes a while
            self.writing = runner.iter + 1

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        if self.writing is not None and runner.iter == self.writing:  # the iteration after that save
            tmp = runner.work_dir / "checkpoints" / f".iter_{self.writing}.pth.tmp{os.getpid()}"
            deadline = time.monotonic() + 60
            while not tmp.exists() and time.monotonic() < deadline:
                time.sleep(0.001)
            seen = tmp.exists() and not (runner.work_dir / "checkpoints" / f"iter_{self.writing}.pth").exists()
            (runner.work_dir / "killed").write_text(str(seen))
            os._exit(9)
'''


@pytest.mark.slow
def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint_bit_identical(tmp_path):
    (tmp_path / "killmidwrite.py").write_text(KILL_MID_WRITE)
    reference = tmp_path / "reference"
    assert run_cli(f"hydra.run.dir={reference}", *SAVES).returncode == 0
    work = tmp_path / "run"
    args = [f"hydra.run.dir={work}", *SAVES, "default_hooks.checkpoint.async_save=true"]
    killed = run_cli(*args, "+hooks.kill._target_=killmidwrite.KillMidWrite", env={"PYTHONPATH": str(tmp_path)})
    assert killed.returncode == 9, killed.output
    assert (work / "killed").read_text() == "True"  # killed while iter_30.pth was being written
    assert (work / "checkpoints" / "last_checkpoint").read_text() == "iter_15.pth"
    assert not (work / "checkpoints" / "iter_30.pth").exists()
    resumed = run_cli(*args, "resume=true", "~hooks.kill")  # (the run's own overrides hold the kill hook)
    assert resumed.returncode == 0, resumed.output
    assert "Resumed from" in resumed.output and "iter_15.pth" in resumed.output
    final, expected = (torch.load(w / "checkpoints" / "iter_120.pth", weights_only=True) for w in (work, reference))
    assert _same(final["state_dict"], expected["state_dict"]) and _same(final["optimizer"], expected["optimizer"])
    assert not list(work.rglob("*.tmp*"))  # the killed writer's temporary file is gone


# -- sharded checkpoints (trainer.strategy=fsdp): DCP's async_save ------------------------------------
FSDP = [
    "data.batch_size=67",
    "default_hooks.logger.plot=false",
    "trainer.strategy=fsdp",
    "trainer.max_epochs=3",
    "default_hooks.checkpoint.by_epoch=false",
    "default_hooks.checkpoint.interval=4",
    "default_hooks.checkpoint.max_keep_ckpts=2",
]


def _torchrun(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return torchrun(*FSDP, *args, cwd=cwd, env=env)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _shards(path: Path) -> dict:
    """Every tensor of a sharded checkpoint (weights, optimizer state), whole."""
    from expkit.checkpoint import dcp

    return _flat(dcp.read_tensors(path))


@pytest.mark.slow
def test_sharded_async_saves_on_two_processes_write_what_synchronous_saves_write(tmp_path):
    runs = {mode: tmp_path / mode for mode in ("false", "true")}
    for mode, work in runs.items():
        proc = _torchrun(tmp_path, f"hydra.run.dir={work}", f"default_hooks.checkpoint.async_save={mode}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    from expkit.checkpoint.checkpoint_io import read_sharded_state

    names = sorted(p.name for p in (runs["false"] / "checkpoints").glob("*.dcp"))
    assert names == sorted(p.name for p in (runs["true"] / "checkpoints").glob("*.dcp"))
    assert len([n for n in names if n.startswith("iter_")]) == 2 and any(n.startswith("best_") for n in names)
    for name in names:  # every shard of the weights and the optimizer state, and state.pth
        a, b = (_shards(runs[m] / "checkpoints" / name) for m in ("false", "true"))
        assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a), name
        a, b = (read_sharded_state(runs[m] / "checkpoints" / name, "test") for m in ("false", "true"))
        for state in (a, b):
            state["meta"].pop("time"), state["meta"].pop("wall_time_s"), state["meta"].pop("work_dir")
            state.pop("config"), state["hooks"].pop("timer")
        assert _same(a["sharded"]["optimizers"], b["sharded"]["optimizers"]) and _same(a["rng"], b["rng"])
        assert _same(a["meta"], b["meta"]) and _same(a["hooks"], b["hooks"]), name
    pointer = (runs["true"] / "checkpoints" / "last_checkpoint").read_text()
    assert pointer == (runs["false"] / "checkpoints" / "last_checkpoint").read_text()
    results = [json.loads((runs[m] / "result.json").read_text()) for m in ("false", "true")]
    assert results[0]["final_metrics"] == results[1]["final_metrics"]  # the test pass read the best checkpoint
    assert not list(runs["true"].rglob("*.tmp*"))


KILL_MID_SHARDED_WRITE = '''
import os, time
import torch
from expkit import Hook

class KillMidWrite(Hook):
    """On rank 0: makes the second save's state.pth big (written in the background once DCP's
    shards are, before the rename), then ends the process at once, as SIGKILL would, at the next
    iteration while that checkpoint is still a temporary directory."""

    priority = "LOWEST"

    def __init__(self):
        self.saves, self.writing = 0, None

    def before_save_checkpoint(self, runner, *, checkpoint):
        self.saves += 1
        if self.saves == 2 and not (runner.work_dir / "killed").exists():
            checkpoint["ballast"] = torch.ones(150_000_000)  # 600 MB
            self.writing = runner.iter + 1

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        if self.writing is not None and runner.iter == self.writing and runner.is_main:
            tmp = runner.work_dir / "checkpoints" / f".iter_{self.writing}.dcp.tmp{os.getpid()}"
            deadline = time.monotonic() + 60
            while not tmp.exists() and time.monotonic() < deadline:
                time.sleep(0.001)
            seen = tmp.exists() and not (runner.work_dir / "checkpoints" / f"iter_{self.writing}.dcp").exists()
            (runner.work_dir / "killed").write_text(str(seen))
            os._exit(9)
'''


@pytest.mark.slow
def test_a_kill_during_a_background_sharded_write_resumes_from_the_previous_one_bit_identical(tmp_path):
    (tmp_path / "killmidwrite.py").write_text(KILL_MID_SHARDED_WRITE)
    args = ["default_hooks.checkpoint.save_best=null", "default_hooks.checkpoint.async_save=true"]
    reference, work = tmp_path / "reference", tmp_path / "run"
    assert _torchrun(tmp_path, f"hydra.run.dir={reference}", *args).returncode == 0
    killed = _torchrun(
        tmp_path,
        f"hydra.run.dir={work}",
        *args,
        "+hooks.kill._target_=killmidwrite.KillMidWrite",
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert killed.returncode != 0
    assert (work / "killed").read_text() == "True"  # killed while iter_8.dcp was being written
    assert (work / "checkpoints" / "last_checkpoint").read_text() == "iter_4.dcp"
    assert not (work / "checkpoints" / "iter_8.dcp").exists()
    resumed = _torchrun(tmp_path, f"hydra.run.dir={work}", *args, "resume=true", "~hooks.kill")  # (as above)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "iter_4.dcp" in (work / "train.log").read_text()
    last = (reference / "checkpoints" / "last_checkpoint").read_text()
    assert (work / "checkpoints" / "last_checkpoint").read_text() == last
    final, expected = (_shards(w / "checkpoints" / last) for w in (work, reference))
    assert final.keys() == expected.keys() and all(_same(final[k], expected[k]) for k in expected)
    assert not list(work.rglob("*.tmp*"))  # the killed save's temporary directory is gone


def _agree(rank: int, port: int, errors: list) -> None:
    import torch.distributed as dist

    from expkit.checkpoint.dcp import AsyncShards

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mine = OSError("disk full") if rank == 1 else None
        agreed = AsyncShards.agree(mine)
        errors.append((rank, type(agreed).__name__, str(agreed)))
        errors.append((rank, "none", str(AsyncShards.agree(None))))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_a_write_that_failed_on_one_of_them():
    """A write that failed on one rank fails the save on every rank, naming the rank."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    errors = mp.Manager().list()
    mp.spawn(_agree, args=(port, errors), nprocs=2, join=True)
    found = sorted(errors)
    assert found[0][:2] == (0, "CheckpointWriteError") and "rank 1" in found[0][2] and "disk full" in found[0][2]
    assert found[2] == (1, "OSError", "disk full")  # its own error, as it was
    assert (0, "none", "None") in found and (1, "none", "None") in found


@pytest.mark.parametrize("async_save", [False, True])
def test_an_async_save_leaves_the_weights_where_they_are_for_its_staging(tmp_path, monkeypatch, async_save):
    """The staging copies every tensor to host memory (from a GPU on its own stream), so an async save
    asks the run's state for its weights where they are; a synchronous save has them copied to the
    CPU first, as before. (On a GPU, tests/engine/test_performance.py runs the whole save with no
    host synchronisation.)"""
    from expkit.checkpoint import run_checkpoint
    from expkit.hooks import CheckpointHook, LoggerHook

    asked: list[bool] = []
    state_checkpoint = run_checkpoint.state_checkpoint

    def spy(*args, weights_on_host=True, **kwargs):
        asked.append(weights_on_host)
        return state_checkpoint(*args, weights_on_host=weights_on_host, **kwargs)

    monkeypatch.setattr(run_checkpoint, "state_checkpoint", spy)
    hooks = {"logger": LoggerHook(plot=False), "checkpoint": CheckpointHook(async_save=async_save)}
    toy_runner(tmp_path, default_hooks=hooks, max_epochs=2).run()
    assert asked == [not async_save] * 2  # a save after each epoch
    saved = torch.load(tmp_path / "checkpoints" / "epoch_2.pth", weights_only=True)
    assert saved["meta"]["epoch"] == 2 and all(t.is_cpu for t in saved["state_dict"].values())
