"""A completed torchrun run is never reported failed: no process group object is left to the
interpreter's teardown, where gloo's threads abort the process ("terminate called without an
active exception", SIGABRT after a completed run). benchmarks/torchrun_exits.py runs the loop of
whole runs that shows it (every one exits 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import torchrun

pytestmark = pytest.mark.slow

PROBE = '''
import atexit, json, os, weakref, torch.distributed as dist
from torch.distributed import distributed_c10d
from expkit import Hook

GROUPS = []  # weak references to every process group the run made (the test's own view, never expkit's)


@atexit.register
def left_at_exit():
    """Which groups still exist when the interpreter starts tearing down (atexit runs before it):
    one alive then is destroyed in the teardown, where its gloo threads can abort the process."""
    alive = [name for name, ref in GROUPS if ref() is not None]
    with open(f"exit_rank{os.environ['RANK']}.json", "w") as f:
        json.dump({"groups": len(GROUPS), "alive": alive, "initialized": dist.is_initialized()}, f)


class Probe(Hook):
    priority = "LOWEST"

    def after_train(self, runner):
        # every group exists by now: the world, FSDP's mesh, the checkpoint hook's side groups
        GROUPS.extend((str(name), weakref.ref(pg)) for pg, name in distributed_c10d._world.pg_names.items())
'''


def _run(tmp_path: Path, *args: str):
    (tmp_path / "exit_probe.py").write_text(PROBE)
    return torchrun(
        "trainer.max_epochs=1",
        "default_hooks.logger.plot=false",
        "+hooks.probe._target_=exit_probe.Probe",
        f"hydra.run.dir={tmp_path / 'run'}",
        *args,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
    )


@pytest.mark.parametrize(
    "strategy", [["trainer.strategy=ddp"], ["trainer.strategy=fsdp", "default_hooks.checkpoint.async_save=true"]]
)
def test_no_process_group_is_left_to_the_interpreters_teardown(tmp_path, strategy):
    proc = _run(tmp_path, *strategy)
    assert proc.returncode == 0, proc.output[-3000:]
    assert "terminate called" not in proc.output
    for rank in (0, 1):
        left = json.loads((tmp_path / f"exit_rank{rank}.json").read_text())
        assert left["groups"] >= 1 and left["alive"] == [] and not left["initialized"], left
