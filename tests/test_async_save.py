"""default_hooks.checkpoint.async_save=true: the loop waits only for a copy of the state; the
file is written in the background, and nothing a synchronous save promises is lost."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from expkit.async_writer import BackgroundWriter
from expkit.errors import CheckpointWriteError

SAVES = ["trainer.max_epochs=3", "default_hooks.checkpoint.by_epoch=false", "default_hooks.checkpoint.interval=15",
         "default_hooks.checkpoint.max_keep_ckpts=2"]  # fmt: skip


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
        a["meta"].pop("time"), b["meta"].pop("time"), a["meta"].pop("work_dir"), b["meta"].pop("work_dir")
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
    resumed = run_cli(*args, "resume=true")
    assert resumed.returncode == 0, resumed.output
    assert "Resumed from" in resumed.output and "iter_15.pth" in resumed.output
    final, expected = (torch.load(w / "checkpoints" / "iter_120.pth", weights_only=True) for w in (work, reference))
    assert _same(final["state_dict"], expected["state_dict"]) and _same(final["optimizer"], expected["optimizer"])
    assert not list(work.rglob("*.tmp*"))  # the killed writer's temporary file is gone


@pytest.mark.slow
def test_async_save_with_sharded_checkpoints_is_refused_before_training(tmp_path):
    proc = run_cli(f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_epochs=1", "trainer.strategy=fsdp",
                   "default_hooks.checkpoint.async_save=true")  # fmt: skip
    assert proc.returncode == 2, proc.output
    assert "default_hooks.checkpoint.async_save=true" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
