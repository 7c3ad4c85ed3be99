"""torchrun with 2 CPU processes (gloo): one work dir, rank 0 writes, ranks agree, crashes stop."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DIE_ONCE, run_cli, torchrun

from expkit.core.hydra_compat import INIT_KWARGS

pytestmark = pytest.mark.slow

PROBE = '''
import atexit, gc, json, os, torch, torch.distributed as dist
from expkit import Hook


@atexit.register
def left_at_exit():
    """What still exists when the interpreter starts tearing down (atexit runs before): a DDP
    model alive then is destroyed in the teardown, where gloo's threads can abort the process."""
    gc.unfreeze()  # (frozen objects are not in gc.get_objects())
    models = sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
    with open(f"exit_rank{os.environ['RANK']}.json", "w") as f:
        json.dump({"ddp_models": models, "process_group": dist.is_initialized()}, f)

class Probe(Hook):
    """Test instrumentation: what each rank saw and ended with."""
    priority = "LOW"

    def __init__(self, crash_rank: int = -1):
        self.crash_rank, self.seen = crash_rank, {}

    def before_train(self, runner):
        """Count the gradient all-reduces DDP starts (one per bucket per synchronised backward)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.allreduces = 0

        def counting(state, bucket):
            self.allreduces += 1
            return allreduce_hook(None, bucket)

        runner.ddp_model.register_comm_hook(None, counting)

    def before_train_epoch(self, runner):
        self.seen[runner.epoch] = list(runner.train_loader.sampler)

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        if dist.get_rank() == self.crash_rank and runner.iter == 5:
            raise RuntimeError("rank died")

    def after_train(self, runner):
        rank = dist.get_rank()
        torch.save(runner.model.state_dict(), runner.work_dir / f"weights_rank{rank}.pt")
        (runner.work_dir / f"seen_rank{rank}.json").write_text(json.dumps(self.seen))
        (runner.work_dir / f"allreduces_rank{rank}.json").write_text(json.dumps([self.allreduces, runner.iter]))
'''


F1 = "+metrics.f1={_target_:torchmetrics.classification.MulticlassF1Score,num_classes:10,average:macro}"


def _torchrun(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    conf = tmp_path / "conf" / "hooks"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "probe.yaml").write_text("probe:\n  _target_: ddp_probe.Probe\n  crash_rank: -1\n")
    (tmp_path / "ddp_probe.py").write_text(PROBE)
    return torchrun(
        "--config-dir",
        str(tmp_path / "conf"),
        "hooks=[probe]",
        *args,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
        timeout=timeout,
    )


def test_two_processes_one_run(tmp_path):
    proc = _torchrun(tmp_path, "trainer.max_epochs=3", "trainer.test_with=last", F1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):  # the group and what holds it are gone before the interpreter's teardown
        left = json.loads((tmp_path / f"exit_rank{rank}.json").read_text())
        assert left == {"ddp_models": 0, "process_group": False}, left
    runs = list((tmp_path / "outputs" / "runs").iterdir())
    assert len(runs) == 1, runs  # no second work dir for rank 1
    (work,) = runs
    assert sorted(p.name for p in (work / "checkpoints").glob("epoch_*.pth")) == [
        "epoch_2.pth",
        "epoch_3.pth",
    ]  # (max_keep_ckpts=2)
    assert (work / "rank1.log").is_file() and not (work / ".hydra" / "rank1").exists()
    # rank 0 tells the run once; rank 1's INFO lines go to its own file only
    assert proc.stdout.count("Hooks: ") == 1 and proc.stdout.count("Done (completed)") == 1, proc.stdout[-3000:]
    assert "Hooks: " in (work / "rank1.log").read_text() and "[rank 1]" not in (work / "rank1.log").read_text()
    result = json.loads((work / "result.json").read_text())
    assert result["status"] == "completed" and result["iter"] == 60  # 1258 samples / 2 ranks / 32 = 20 per epoch

    # every rank ends with the same weights, and they are the checkpointed ones
    w0, w1 = (torch.load(work / f"weights_rank{r}.pt", weights_only=True) for r in (0, 1))
    last = torch.load(work / "checkpoints" / "epoch_3.pth", weights_only=True)["state_dict"]
    for key in w0:
        assert torch.equal(w0[key], w1[key]) and torch.equal(w0[key], last[key]), key

    # each rank saw a different half of the training data, every epoch
    seen = [json.loads((work / f"seen_rank{r}.json").read_text()) for r in (0, 1)]
    for epoch in ("0", "1", "2"):
        a, b = set(seen[0][epoch]), set(seen[1][epoch])
        assert not a & b and len(a | b) == 1258
    assert seen[0]["0"] != seen[0]["1"]  # a new order each epoch

    # val/acc over both ranks equals one process evaluating the final weights on the whole set
    evaluation = subprocess.run(
        [
            sys.executable,
            "-m",
            "expkit.eval",
            "--config-dir",
            str(tmp_path / "conf"),
            f"checkpoint={work}",
            "which=last",
            "split=val",
            f"work_dir={tmp_path / 'eval'}",
        ],
        capture_output=True,
        text=True,
    )  # the probe hook's config dir: its target is trusted
    assert evaluation.returncode == 0, evaluation.stderr
    single = json.loads((tmp_path / "eval" / "result.json").read_text())["final_metrics"]
    assert single["val/acc"] == pytest.approx(result["final_metrics"]["val/acc"], abs=1e-9)
    assert single["val/loss"] == pytest.approx(result["final_metrics"]["val/loss"], rel=1e-5)
    # a torchmetrics metric synchronises itself (in compute): macro F1 needs every rank's counts, once
    assert single["val/f1"] == pytest.approx(result["final_metrics"]["val/f1"], abs=1e-6)

    # the same checkpoint resumes in one process
    resumed = run_cli(
        f"hydra.run.dir={tmp_path / 'single'}", f"resume={work / 'checkpoints' / 'epoch_2.pth'}", "trainer.max_epochs=3"
    )
    assert resumed.returncode == 0, resumed.output
    assert json.loads((tmp_path / "single" / "result.json").read_text())["epoch"] == 3


def test_accumulation_under_ddp_syncs_once_per_step_and_equals_one_big_batch(tmp_path):
    """2 ranks x batch 32 x 2 micro-batches = one global batch of 128 per step (the ranks take
    alternate samples of one permutation), the shorter last window of an epoch included."""
    proc = _torchrun(
        tmp_path,
        "trainer.max_epochs=2",
        "data.batch_size=32",
        "trainer.accumulate_grad_batches=2",
        "trainer.test_with=last",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (work,) = list((tmp_path / "outputs" / "runs").iterdir())
    for rank in (0, 1):  # 629 samples a rank: 20 micro-batches, 10 steps an epoch; the MLP's gradients fill 1 bucket
        allreduces, steps = json.loads((work / f"allreduces_rank{rank}.json").read_text())
        assert (allreduces, steps) == (20, 20)  # one all-reduce per step: the first micro-batch ran under no_sync
    from hydra import compose, initialize_config_dir

    from expkit.config.build import build_runner
    from expkit.config.cli import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), **INIT_KWARGS):
        cfg = compose(config_name="train", overrides=["trainer.max_epochs=2", "data.batch_size=128"])
    single = build_runner(cfg, tmp_path / "single")
    single.run()
    weights = torch.load(work / "weights_rank0.pt", weights_only=True)
    for key, value in single.model.state_dict().items():
        assert torch.allclose(weights[key], value, atol=1e-5), key


def test_a_crashing_rank_stops_the_whole_run(tmp_path):
    proc = _torchrun(tmp_path, "trainer.max_epochs=50", "hooks.probe.crash_rank=1", timeout=240)
    assert proc.returncode != 0
    assert "rank died" in proc.stdout + proc.stderr
    left = json.loads((tmp_path / "exit_rank1.json").read_text())  # the failed rank let go of the group too
    assert left == {"ddp_models": 0, "process_group": False}, left


def test_submitit_local_with_two_tasks_is_one_ddp_run(tmp_path):
    env = {"OMP_NUM_THREADS": "1"}
    proc = run_cli(
        "-m",
        "trainer.max_epochs=2",
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        f"hydra.sweep.dir={tmp_path}",
        env=env,
    )
    assert proc.returncode == 0, proc.output
    result = json.loads((tmp_path / "0" / "result.json").read_text())
    assert result["status"] == "completed" and result["iter"] == 40  # two ranks share each epoch
    assert (tmp_path / "0" / "rank1.log").is_file()
    assert json.loads((tmp_path / "best.json").read_text())["job"] == "0"


def test_slurm_ddp_launcher_config_starts_one_task_per_gpu():
    proc = run_cli(
        "hydra/launcher=slurm_ddp",
        "hydra.launcher.gpus_per_node=8",
        "hydra.launcher.cpus_per_task=4",
        "--cfg",
        "hydra",
        "--resolve",
    )
    assert proc.returncode == 0, proc.output
    assert "gpus_per_node: 8" in proc.stdout and "tasks_per_node: 8" in proc.stdout
    assert "SlurmLauncher" in proc.stdout


def test_slurm_ddp_takes_its_defaults_from_one_sinfo_call(tmp_path):
    """A stand-in sinfo on PATH (a node of 2 GPUs named in gres' long form, 8 CPUs): one task per
    GPU, the CPUs shared by them, and sinfo asked once for the three defaults."""
    sinfo = tmp_path / "sinfo"
    sinfo.write_text(f'#!/bin/sh\necho called >> {tmp_path}/calls\necho "debug*|gpu:a100:2(S:0-1)|8"\n')
    sinfo.chmod(0o755)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    proc = run_cli("hydra/launcher=slurm_ddp", "--cfg", "hydra", "--resolve", env=env)
    assert proc.returncode == 0, proc.output
    for line in ("gpus_per_node: 2", "tasks_per_node: 2", "cpus_per_task: 4"):
        assert line in proc.stdout, proc.stdout
    assert (tmp_path / "calls").read_text().count("called") == 1


KILL_HOOK = '''
import os, signal
import torch.distributed as dist
from expkit import Hook

class KillRank(Hook):
    """SIGKILLs one rank once, after the checkpoint at iteration 10."""

    def __init__(self, rank: int):
        self.rank = rank

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        marker = runner.work_dir / "killed"
        if dist.get_rank() == self.rank and runner.iter == 15 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_rank_leaves_a_one_line_record_and_the_run_resumes(tmp_path, killed):
    (tmp_path / "killhook.py").write_text(KILL_HOOK)
    work = tmp_path / "run"
    args = (
        f"hydra.run.dir={work}",
        "trainer.max_epochs=2",
        "default_hooks.checkpoint.by_epoch=false",
        "default_hooks.checkpoint.interval=10",
        "+hooks.kill._target_=killhook.KillRank",
        f"+hooks.kill.rank={killed}",
    )
    proc = _torchrun(tmp_path, *args, timeout=240)
    assert proc.returncode != 0
    result = json.loads((work / "result.json").read_text())  # written by whichever rank survived
    assert result["status"] == "failed" and "\n" not in result["error"]
    assert result["error"].startswith(f"rank {killed} (pid ") and " died: " in result["error"], result["error"]
    # the torchrun beside the interpreter that ran, as a path: the command pastes without a venv activated
    command = re.search(r"resume with: (\S*torchrun) --nproc_per_node=2 -m expkit\.train", result["error"])
    assert command and Path(command.group(1)).is_file(), result["error"]
    assert f"Error: rank {killed} (pid " in proc.stderr
    resumed = _torchrun(tmp_path, *args, "resume=true", timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    if killed == 0:  # the dead owner of the work dir is named when the next start takes it over
        assert "taking it over from pid" in resumed.stdout + resumed.stderr
    assert json.loads((work / "result.json").read_text())["status"] == "completed"


TERM_ONE = '''
import os, signal
import torch.distributed as dist
from expkit import Hook

class TermRankOne(Hook):
    """SIGTERM to rank 1 alone, once, at iteration 15 (a kill of one PID, not of the job)."""

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        marker = runner.work_dir / "termed"
        if dist.get_rank() == 1 and runner.iter == 15 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGTERM)
'''


def test_a_signal_to_one_rank_stops_every_rank_as_that_signal_and_resume_finishes(tmp_path):
    """Rank 0, which writes result.json, never had the signal: the stop it records is still a
    signal's (an unfinished run, which a sweep's resume runs again), not a plain stop."""
    (tmp_path / "termhook.py").write_text(TERM_ONE)
    work = tmp_path / "run"
    args = (f"hydra.run.dir={work}", "trainer.max_epochs=2", "+hooks.term._target_=termhook.TermRankOne")
    proc = _torchrun(tmp_path, *args, timeout=240)
    assert proc.returncode != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((work / "result.json").read_text())
    assert (result["status"], result["stop_reason"]) == ("stopped", "signal SIGTERM (on another rank)"), result
    assert "test/acc" not in result["final_metrics"]  # (an interruption: no test pass)

    from expkit.sweeps.sweep_jobs import finished

    assert not finished(result)
    resumed = _torchrun(tmp_path, *args, "resume=true", timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads((work / "result.json").read_text())["status"] == "completed"


def _torchrun_elastic(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return torchrun(*args, cwd=tmp_path, launcher=("--max-restarts=2",), env={"PYTHONPATH": str(tmp_path)})


def test_torchrun_restarts_resume_the_same_run_and_end_bit_identical(tmp_path):
    (tmp_path / "diehook.py").write_text(DIE_ONCE)
    common = ["trainer.max_epochs=3", "default_hooks.checkpoint.by_epoch=false", "default_hooks.checkpoint.interval=10"]
    reference = _torchrun_elastic(tmp_path, *common, f"hydra.run.dir={tmp_path / 'reference'}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    proc = _torchrun_elastic(tmp_path, *common, "+hooks.die._target_=diehook.DieOnce")  # the default work dir
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "connectFullMesh" not in proc.stderr and "torchrun restart 1: resuming" in proc.stderr
    (work,) = (tmp_path / "outputs" / "runs").iterdir()  # the restart found the first attempt's dir
    # ... in torchrun's store: nothing of torchrun's is written relative to the current directory
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["runs"]
    assert (work / "died").is_file()
    result = json.loads((work / "result.json").read_text())
    story = proc.stderr[-4000:] + "".join(
        f"\n--- {f.name}\n" + f.read_text()[-3000:] for f in sorted(work.glob("*.log"))
    )
    # (a second restart: a rank that aborted after the run had completed, fixed in distributed.shutdown)
    assert result["status"] == "completed" and result["restarts"] == 1 and result["iter"] == 60, story
    assert "Resumed from" in (work / "train.log").read_text()  # not re-initialised from scratch
    final, expected = (
        torch.load(w / "checkpoints" / "iter_60.pth", weights_only=True)["state_dict"]
        for w in (work, tmp_path / "reference")
    )
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_a_rank_above_0_prints_only_its_warnings_marked_with_its_rank(tmp_path):
    import io
    import logging

    from expkit.loggers.logs import LOG_FORMAT, log_to_rank_file

    root, saved = logging.getLogger(), logging.getLogger().handlers[:]
    terminal, file = logging.StreamHandler(io.StringIO()), logging.FileHandler(tmp_path / "train.log")
    for handler in (terminal, file):
        handler.setFormatter(logging.Formatter(*LOG_FORMAT))
    root.handlers[:] = [terminal, file]
    level = root.level
    root.setLevel(logging.INFO)
    try:
        log_to_rank_file(tmp_path, 1)
        logging.getLogger("expkit").info("progress")
        logging.getLogger("expkit").warning("careful")
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = saved
        root.setLevel(level)
    printed = terminal.stream.getvalue()
    assert "progress" not in printed and "] [rank 1] careful" in printed
    assert "progress" in (tmp_path / "rank1.log").read_text() and not (tmp_path / "train.log").read_text()
