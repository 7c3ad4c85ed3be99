"""trainer.strategy=fsdp: FSDP2 on 2 CPU processes (gloo), sharded checkpoints on disk, resumed on
another number of processes, evaluated, exported; refusals at start-up; a checkpoint index that
would run code is refused."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DIE_ONCE, run_cli, torchrun  # (DIE_ONCE: rank 1 SIGKILLed once, at iteration 25)

from expkit.checkpoint import checkpoint_io
from expkit.core import atomic
from expkit.core.errors import ConfigError

# a small batch makes uneven evaluation shares (269 val samples: 135 and 134 per rank, 2 and 1
# batches): FSDP's forwards must still pair up across ranks
COMMON = (
    "data.batch_size=67",
    "trainer.clip_grad_norm=0.5",
    "trainer.accumulate_grad_batches=2",
    "default_hooks.logger.plot=false",
)


def _torchrun(cwd: Path, *args: str, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    return torchrun(*COMMON, *args, cwd=cwd, nproc=nproc, timeout=timeout)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return checkpoint_io.load_checkpoint(path, "test")["state_dict"]


@pytest.mark.slow
def test_fsdp_trains_as_ddp_does_and_its_sharded_checkpoint_resumes_in_one_process_evaluates_and_exports(tmp_path):
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    for work, strategy in ((ddp, "ddp"), (fsdp, "fsdp")):
        proc = _torchrun(tmp_path, f"hydra.run.dir={work}", f"trainer.strategy={strategy}", "trainer.max_epochs=2")
        assert proc.returncode == 0, proc.stderr[-3000:]
        # expkit's teardown scanned the heap for meshes: 4 FutureWarnings of torch's deprecated objects
        assert "FutureWarning" not in proc.output, proc.output[-3000:]

    # on disk: one directory per checkpoint, one shard per rank, the index, the rest of the state
    ckpt = fsdp / "checkpoints" / "epoch_2.dcp"
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pth"]
    assert (fsdp / "checkpoints" / "last_checkpoint").read_text() == "epoch_2.dcp"
    assert not [p for p in (fsdp / "checkpoints").iterdir() if p.name.startswith(".")]  # no temporary left
    result = json.loads((fsdp / "result.json").read_text())
    assert result["status"] == "completed" and result["best_checkpoint"].endswith(".dcp")

    # the same training: sharded gradients, clipping and accumulation give DDP's weights
    reference, sharded = _weights(ddp / "checkpoints" / "epoch_2.pth"), _weights(ckpt)
    assert sorted(reference) == sorted(sharded)
    for key in reference:
        assert torch.allclose(reference[key], sharded[key], atol=1e-5, rtol=0), key
    assert result["final_metrics"]["val/acc"] == pytest.approx(
        json.loads((ddp / "result.json").read_text())["final_metrics"]["val/acc"], abs=1e-6
    )

    # 2 -> 1 process: resumes from the sharded checkpoint (weights and optimizer state) and finishes
    proc = run_cli(
        *COMMON, f"hydra.run.dir={fsdp}", "trainer.strategy=fsdp", "trainer.max_epochs=3", "resume=true", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.output[-3000:]
    assert "Resumed from" in proc.output and "epoch_2.dcp at epoch 2" in proc.output
    resumed = json.loads((fsdp / "result.json").read_text())
    assert resumed["status"] == "completed" and resumed["epoch"] == 3
    assert (fsdp / "checkpoints" / "epoch_3.dcp" / "__0_0.distcp").is_file()
    assert not (fsdp / "checkpoints" / "epoch_3.dcp" / "__1_0.distcp").exists()  # one process, one shard

    # expkit.eval scores the best (sharded) checkpoint as the run's own test did
    evaluated = subprocess.run(
        [sys.executable, "-m", "expkit.eval", f"checkpoint={fsdp}", f"work_dir={tmp_path / 'eval'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    scored = json.loads((tmp_path / "eval" / "result.json").read_text())
    assert scored["checkpoint"].endswith(".dcp")
    assert scored["final_metrics"]["test/acc"] == pytest.approx(resumed["final_metrics"]["test/acc"], abs=1e-9)

    # ... and it exports to one ordinary .pth (consolidated state_dict), loadable with weights_only=True
    out = tmp_path / "one.pth"
    exported = subprocess.run(
        [
            sys.executable,
            "-m",
            "expkit.export",
            f"checkpoint={fsdp}",
            "which=last",
            "format=pth",
            f"out={out}",
            f"hydra.run.dir={tmp_path / 'export'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    plain = torch.load(out, weights_only=True)
    last = _weights(fsdp / "checkpoints" / "epoch_3.dcp")
    assert "sharded" not in plain and all(torch.equal(plain["state_dict"][k], last[k]) for k in last)
    assert json.loads(out.with_name("one.pth.json").read_text())["format"] == "pth"


@pytest.mark.slow
def test_a_sharded_run_resumed_on_two_processes_ends_bit_identical_and_one_to_two_processes_resumes(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    proc = _torchrun(tmp_path, f"hydra.run.dir={straight}", "trainer.strategy=fsdp", "trainer.max_epochs=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _torchrun(tmp_path, f"hydra.run.dir={split}", "trainer.strategy=fsdp", "trainer.max_epochs=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _torchrun(tmp_path, f"hydra.run.dir={split}", "trainer.strategy=fsdp", "trainer.max_epochs=2", "resume=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected, final = (_weights(w / "checkpoints" / "epoch_2.dcp") for w in (straight, split))
    assert all(torch.equal(expected[k], final[k]) for k in expected)  # the optimizer state came back whole

    # 1 -> 2 processes: a one-process sharded checkpoint (one shard) resharded over two
    one = tmp_path / "one"
    proc = run_cli(*COMMON, f"hydra.run.dir={one}", "trainer.strategy=fsdp", "trainer.max_epochs=1", cwd=tmp_path)
    assert proc.returncode == 0, proc.output[-3000:]
    proc = _torchrun(tmp_path, f"hydra.run.dir={one}", "trainer.strategy=fsdp", "trainer.max_epochs=2", "resume=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch_1.dcp at epoch 1" in proc.stdout + proc.stderr
    assert json.loads((one / "result.json").read_text())["status"] == "completed"
    assert (one / "checkpoints" / "epoch_2.dcp" / "__1_0.distcp").is_file()


def test_one_process_sharded_checkpoints_keep_retention_and_resume(tmp_path):
    args = (
        f"hydra.run.dir={tmp_path}",
        "trainer.strategy=fsdp",
        "default_hooks.checkpoint.max_keep_ckpts=1",
        "default_hooks.logger.plot=false",
        "data.batch_size=128",
    )
    proc = run_cli(*args, "trainer.max_epochs=2")
    assert proc.returncode == 0, proc.output[-3000:]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["best_val_acc_epoch_2.dcp", "epoch_2.dcp", "last_checkpoint"]  # epoch_1.dcp retired
    proc = run_cli(*args, "trainer.max_epochs=3", "resume=true")
    assert proc.returncode == 0, proc.output[-3000:]
    assert "epoch_2.dcp at epoch 2" in proc.output
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-2:] == ["epoch_3.dcp", "last_checkpoint"]

    # its weights start an unsharded run (load_from) and come back in Python (load_model)
    from expkit.eval import load_model

    other = tmp_path / "other"
    proc = run_cli(
        f"hydra.run.dir={other}",
        f"load_from={tmp_path / 'checkpoints' / 'epoch_3.dcp'}",
        "trainer.max_epochs=1",
        "default_hooks.logger.plot=false",
        "data.batch_size=128",
    )
    assert proc.returncode == 0, proc.output[-3000:]
    assert "Loaded weights from" in proc.output and (other / "checkpoints" / "epoch_1.pth").is_file()
    model = load_model(tmp_path, which="last")
    weights = _weights(tmp_path / "checkpoints" / "epoch_3.dcp")
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("hooks=[ema]",), "the hook(s) ema (EMAHook) do not work with sharded parameters"),
        (("trainer.precision=16",), "trainer.precision=16 with trainer.strategy=fsdp"),
        (("trainer.fsdp_blocks=7",), "trainer.fsdp_blocks must be a list of module class names"),
    ],
)
def test_fsdp_refuses_what_it_cannot_do_at_start_up(tmp_path, overrides, message):
    proc = run_cli(f"hydra.run.dir={tmp_path}", "trainer.strategy=fsdp", *overrides)
    assert proc.returncode == 2, proc.output[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_fsdp_blocks_default_per_model_and_unknown_names_are_refused():
    from expkit import models
    from expkit.engine import fsdp

    mlp = models.MLP(1, 8, 10)
    assert fsdp.block_names(mlp, None) == ["Linear"]
    resnet = models.torchvision_resnet(3, 32, 10)
    assert fsdp.block_names(resnet, None) == ["BasicBlock", "Bottleneck"]
    with pytest.raises(ConfigError, match=r"trainer.fsdp_blocks names \['Block'\]"):
        fsdp.block_names(mlp, ["Block"])


def test_a_sharded_checkpoint_whose_index_would_run_code_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from expkit.checkpoint.dcp import STATE_FILE

    ckpt = tmp_path / "epoch_1.dcp"
    dcp.save({"model": {"w": torch.ones(2)}}, storage_writer=dcp.FileSystemWriter(ckpt))
    atomic.save_atomic({"meta": {}, "config": None}, ckpt / STATE_FILE)
    assert torch.equal(checkpoint_io.load_checkpoint(ckpt)["state_dict"]["w"], torch.ones(2))  # a plain one loads

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    def text(value: str) -> bytes:  # pickle's SHORT_BINUNICODE
        return b"\x8c" + bytes([len(value)]) + value.encode()

    # a plain global, and a dotted name looked up through an allowed module (pickle protocol 4)
    dotted = (
        b"\x80\x04"
        + text("torch.distributed.checkpoint.metadata")
        + text("os.system")
        + b"\x93"
        + text(f"touch {marker}")
        + b"\x85R."
    )
    for payload in (pickle.dumps(Payload()), dotted):
        (ckpt / ".metadata").write_bytes(payload)
        with pytest.raises(ConfigError, match="refused, its index"):
            checkpoint_io.load_checkpoint(ckpt)
        assert not marker.exists()


def test_an_index_naming_paths_as_any_python_writes_them_reads_on_this_one():
    """DCP's index may hold a path: Python 3.13 pickles it as pathlib._local.PosixPath, older
    ones as pathlib.PosixPath. Both read on every Python; nothing else of pathlib does."""
    from expkit.checkpoint import dcp

    def text(value: str) -> bytes:  # pickle's SHORT_BINUNICODE
        return b"\x8c" + bytes([len(value)]) + value.encode()

    for module in ("pathlib", "pathlib._local"):
        data = b"\x80\x04" + text(module) + text("PosixPath") + b"\x93" + text("ckpt") + b"\x85R."
        assert dcp._MetadataUnpickler(io.BytesIO(data)).load() == Path("ckpt")
    sneaky = b"\x80\x04" + text("pathlib._local") + text("os") + b"\x93."
    with pytest.raises(pickle.UnpicklingError, match="not part of a checkpoint index"):
        dcp._MetadataUnpickler(io.BytesIO(sneaky)).load()


@pytest.mark.slow
def test_a_sharded_run_survives_a_dead_worker_with_torchrun_restarts_bit_identical(tmp_path):
    (tmp_path / "diehook.py").write_text(DIE_ONCE)
    common = [
        "trainer.strategy=fsdp",
        "trainer.max_epochs=2",
        "default_hooks.checkpoint.by_epoch=false",
        "default_hooks.checkpoint.interval=10",
    ]

    def restarting(*args: str) -> subprocess.CompletedProcess:
        return torchrun(*common, *args, cwd=tmp_path, launcher=("--max-restarts=2",), env={"PYTHONPATH": str(tmp_path)})

    reference, work = tmp_path / "reference", tmp_path / "work"
    assert restarting(f"hydra.run.dir={reference}").returncode == 0
    proc = restarting(f"hydra.run.dir={work}", "+hooks.die._target_=diehook.DieOnce")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (work / "died").is_file() and "torchrun restart 1: resuming" in proc.stderr
    result = json.loads((work / "result.json").read_text())
    assert result["status"] == "completed" and result["restarts"] == 1
    assert "Resumed from" in (work / "train.log").read_text() and "iter_20.dcp" in (work / "train.log").read_text()
    last = result["last_checkpoint"]
    assert last.endswith(".dcp")
    final, expected = (_weights(w / "checkpoints" / Path(last).name) for w in (work, reference))
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_a_sharded_checkpoint_restores_an_optimizer_whose_unused_parameters_have_no_state(tmp_path):
    from torch import nn

    from expkit.checkpoint import dcp

    def make():
        torch.manual_seed(0)
        model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
        groups = [
            {"params": model["used"].parameters(), "lr": 0.1},
            {"params": model["unused"].parameters(), "lr": 0.01},
        ]
        return model, torch.optim.Adam(groups)

    model, optimizer = make()
    model["used"](torch.randn(2, 4)).sum().backward()  # "unused" gets no gradient, so no Adam state
    optimizer.step()
    dcp.save(tmp_path / "a.dcp", {"meta": {}}, model, {"optimizer": optimizer})
    fresh_model, fresh = make()
    dcp.load_into(
        tmp_path / "a.dcp",
        checkpoint_io.read_sharded_state(tmp_path / "a.dcp", "resume"),
        fresh_model,
        {"optimizer": fresh},
    )
    saved, loaded = optimizer.state_dict(), fresh.state_dict()
    assert [g["lr"] for g in loaded["param_groups"]] == [0.1, 0.01]
    assert sorted(loaded["state"]) == sorted(saved["state"]) == [0, 1]  # only the used parameters' state
    for index, state in saved["state"].items():
        assert all(torch.equal(state[k], loaded["state"][index][k]) for k in state)


STOP_ON_ONE_RANK = '''
import os, signal
import torch.distributed as dist
from expkit import Hook

class StopOnOneRank(Hook):
    """Rank 1 alone gets SIGTERM at iteration 7, as when a signal reaches the ranks at different moments."""

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        if dist.get_rank() == 1 and runner.iter == 7 and not (runner.work_dir / "signalled").exists():
            (runner.work_dir / "signalled").touch()
            os.kill(os.getpid(), signal.SIGTERM)
'''


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_iteration_and_the_run_resumes(tmp_path):
    (tmp_path / "stophook.py").write_text(STOP_ON_ONE_RANK)
    work = tmp_path / "work"
    env = {"PYTHONPATH": str(tmp_path)}
    args = [
        f"hydra.run.dir={work}",
        "trainer.strategy=fsdp",
        "trainer.max_epochs=2",
        "+hooks.stop._target_=stophook.StopOnOneRank",
    ]
    proc = torchrun(*args, cwd=tmp_path, env=env)
    result = json.loads((work / "result.json").read_text())
    assert result["status"] == "stopped" and result["iter"] == 8, proc.stderr[-3000:]  # rank 0 stopped with rank 1
    assert result["last_checkpoint"].endswith("iter_8.dcp") and "test/acc" not in result["final_metrics"]
    proc = torchrun(*args, "resume=true", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((work / "result.json").read_text())["status"] == "completed"


def test_a_sharded_save_interrupted_between_its_renames_keeps_the_checkpoint(tmp_path):
    from torch import nn

    from expkit.checkpoint import dcp

    model = nn.Linear(2, 2)
    dcp.save(tmp_path / "epoch_2.dcp", {"meta": {}}, model, {})
    # killed while saving epoch_2.dcp again: the old one moved aside, the new one not yet renamed
    os.replace(tmp_path / "epoch_2.dcp", tmp_path / ".epoch_2.dcp.tmp41old")
    dcp.save(tmp_path / "new.dcp", {"meta": {}}, model, {})
    os.replace(tmp_path / "new.dcp", tmp_path / ".epoch_2.dcp.tmp41")
    (tmp_path / ".epoch_1.dcp.tmp7").mkdir()  # a save killed before its index: incomplete
    (tmp_path / ".epoch_0.dcp.del9").mkdir()  # a deletion killed half-way
    removed = checkpoint_io.remove_stale_temporaries(tmp_path)
    assert sorted(removed) == [".epoch_0.dcp.del9", ".epoch_1.dcp.tmp7", ".epoch_2.dcp.tmp41old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_2.dcp"]
    assert torch.equal(checkpoint_io.load_checkpoint(tmp_path / "epoch_2.dcp")["state_dict"]["weight"], model.weight)
    checkpoint_io.remove_checkpoint(tmp_path / "epoch_2.dcp")
    assert list(tmp_path.iterdir()) == []
