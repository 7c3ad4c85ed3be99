"""Resuming with another number of processes: a DDP or FSDP2 checkpoint saved inside an epoch by
2 processes resumes on 1 and on 3, one saved by 1 process on 2. The processes of the resumed
run share the rest of the epoch's order: every sample of the epoch is trained on once (a
padding sample or two aside), none twice."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from conftest import SEEN_PROBE, run_cli, seen_samples, torchrun

pytestmark = pytest.mark.slow

ARGS = ["+hooks.seen._target_=seenprobe.Seen", "trainer.max_epochs=1", "default_hooks.logger.plot=false"]


def _launch(tmp_path: Path, processes: int, *args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    if processes > 1:
        return torchrun(*ARGS, *args, cwd=tmp_path, nproc=processes, env=env, timeout=400)
    return run_cli(*ARGS, *args, cwd=tmp_path, env=env, timeout=400)


@pytest.fixture(scope="module")
def whole_epoch(tmp_path_factory) -> Counter:
    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "seenprobe.py").write_text(SEEN_PROBE)
    proc = _launch(tmp, 1, f"hydra.run.dir={tmp / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return seen_samples(tmp / "run")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (2, 3), (1, 2)])
def test_a_checkpoint_inside_an_epoch_resumes_on_another_number_of_processes(
    tmp_path, whole_epoch, strategy, saved, resumed
):
    (tmp_path / "seenprobe.py").write_text(SEEN_PROBE)
    work = tmp_path / "run"
    common = [f"hydra.run.dir={work}", f"trainer.strategy={strategy}"]
    stopped = _launch(
        tmp_path, saved, *common, "+hooks.stop._target_=expkit.hooks.StopAfterHook", "+hooks.stop.iters=7"
    )
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    last = "iter_7.dcp" if strategy == "fsdp" else "iter_7.pth"
    assert (work / "checkpoints" / last).exists(), sorted(p.name for p in (work / "checkpoints").iterdir())
    done = seen_samples(work)
    assert sum(done.values()) == 7 * 32 * saved

    proc = _launch(tmp_path, resumed, *common, "resume=true", "~hooks.stop")  # (the run's own overrides hold it)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    log = (work / "train.log").read_text()
    assert f"{last} at epoch 0, iteration 7" in log
    if saved != resumed:
        assert f"after {7 * 32 * saved} samples of its order (saved with {saved} processes, now {resumed})" in log
    assert json.loads((work / "result.json").read_text())["status"] == "completed"
    seen = seen_samples(work)
    # every sample of the epoch once; beyond the whole epoch only the padding that equal shares need
    assert set(seen) == set(whole_epoch)
    assert not whole_epoch - seen
    assert sum((seen - whole_epoch).values()) <= resumed - 1, seen - whole_epoch


def test_the_iteration_that_ends_a_resumed_epoch_saves_after_its_validation(tmp_path):
    """After a resume on another number of processes the resumed epoch is shorter than the
    loader's length while its iteration count goes on from the saved one: the checkpoint of its
    last iteration must still wait for the epoch's validation (a resume from it would otherwise
    validate that epoch again)."""
    import torch

    (tmp_path / "seenprobe.py").write_text(SEEN_PROBE)
    work = tmp_path / "run"
    saves = [
        "default_hooks.checkpoint.by_epoch=false",
        "default_hooks.checkpoint.interval=1",
        "default_hooks.checkpoint.max_keep_ckpts=-1",
        "default_hooks.checkpoint.save_best=null",
    ]
    stopped = _launch(
        tmp_path,
        2,
        f"hydra.run.dir={work}",
        *saves,
        "+hooks.stop._target_=expkit.hooks.StopAfterHook",
        "+hooks.stop.iters=7",
    )
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    proc = _launch(tmp_path, 1, f"hydra.run.dir={work}", *saves, "trainer.max_epochs=2", "resume=true", "~hooks.stop")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    metas = [torch.load(p, weights_only=True)["meta"] for p in (work / "checkpoints").glob("iter_*.pth")]
    ends = [m for m in metas if m["epoch"] == 1 and m["inner_iter"] == 0]
    assert len(ends) == 1 and ends[0]["val_metrics"], sorted((m["iter"], m["epoch"], m["inner_iter"]) for m in metas)
    assert not [m for m in metas if m["epoch"] == 0 and m["iter"] == ends[0]["iter"]]
