"""Real processes killed mid-run (SIGKILL, SIGTERM), resumed, compared bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli

pytestmark = pytest.mark.slow

# iteration checkpoints every 7 iterations: most land in the middle of an epoch (40 batches)
COMMON = ["trainer.max_epochs=3", "default_hooks.checkpoint.by_epoch=false", "default_hooks.checkpoint.interval=7"]
SLOW_HOOK = """
import time
from expkit import Hook

class Slow(Hook):
    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        time.sleep(0.02)  # a slower run, so a signal lands mid-epoch
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    work = tmp_path_factory.mktemp("reference")
    proc = run_cli(f"hydra.run.dir={work}", *COMMON)
    assert proc.returncode == 0, proc.output
    return torch.load(work / "checkpoints" / "iter_120.pth", weights_only=True)["state_dict"]


def _start_slow_run(tmp_path: Path, work: Path) -> subprocess.Popen:
    conf = tmp_path / "conf" / "hooks"
    conf.mkdir(parents=True)
    (conf / "slow.yaml").write_text("slow:\n  _target_: slowhook.Slow\n")
    (tmp_path / "slowhook.py").write_text(SLOW_HOOK)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "expkit.train",
            "--config-dir",
            str(tmp_path / "conf"),
            "hooks=[slow]",
            f"hydra.run.dir={work}",
            *COMMON,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for_mid_epoch_checkpoint(work: Path, proc: subprocess.Popen, timeout: float = 120) -> int:
    pointer = work / "checkpoints" / "last_checkpoint"
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        if pointer.exists():
            n = int(Path(pointer.read_text()).stem.split("_")[1])
            if n > 40 and n % 40:  # in epoch 2, mid-epoch
                return n
        time.sleep(0.05)
    raise AssertionError("no mid-epoch checkpoint appeared")


def _resume_and_compare(work: Path, reference: dict[str, torch.Tensor]) -> None:
    # (the run's own overrides hold hooks=[slow], from a --config-dir this resume leaves out: hooks=[] drops it)
    proc = run_cli(f"hydra.run.dir={work}", "resume=true", "hooks=[]", *COMMON)
    assert proc.returncode == 0, proc.output
    assert "Resumed from" in proc.output
    result = json.loads((work / "result.json").read_text())
    assert (result["status"], result["iter"]) == ("completed", 120)
    final = torch.load(work / "checkpoints" / "iter_120.pth", weights_only=True)["state_dict"]
    assert final.keys() == reference.keys()
    for key, expected in reference.items():
        assert torch.equal(final[key], expected), key


def test_sigkill_mid_epoch_then_resume_is_bit_identical(tmp_path, reference):
    work = tmp_path / "run"
    proc = _start_slow_run(tmp_path, work)
    try:
        killed_at = _wait_for_mid_epoch_checkpoint(work, proc)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    for path in (work / "checkpoints").glob("iter_*.pth"):
        torch.load(path, weights_only=True)  # every file under a final name is complete
    assert killed_at % 40
    _resume_and_compare(work, reference)


def test_sigterm_exits_143_with_a_checkpoint_then_resumes_exactly(tmp_path, reference):
    work = tmp_path / "run"
    proc = _start_slow_run(tmp_path, work)
    try:
        _wait_for_mid_epoch_checkpoint(work, proc)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "Stopped by a signal; continue with:" in output
    result = json.loads((work / "result.json").read_text())
    assert (result["status"], result["stop_reason"]) == ("stopped", "signal SIGTERM")
    pointed = work / "checkpoints" / (work / "checkpoints" / "last_checkpoint").read_text()
    assert pointed.name == f"iter_{result['iter']}.pth"  # saved where it stopped
    _resume_and_compare(work, reference)


LATE_SIGTERM = """
import os, signal, sys
from expkit import train
from expkit.engine import runner

real_run = runner.Runner.run

def run_then_sigterm(self):  # torchrun's SIGTERM to a dead rank's survivors, landing just after the run ended
    try:
        return real_run(self)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)

runner.Runner.run = run_then_sigterm
sys.argv[0] = "expkit.train"
train.main()
"""
BOOM_HOOK = """
from expkit import Hook

class Boom(Hook):
    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        if runner.iter == 3:
            raise RuntimeError("boom at iteration 3")
"""


@pytest.mark.parametrize("ending", ["failed", "completed", "stopped early"])
def test_a_sigterm_just_after_the_run_cuts_neither_the_error_line_nor_the_exit_code(tmp_path, ending):
    (tmp_path / "late.py").write_text(LATE_SIGTERM)
    (tmp_path / "boomhook.py").write_text(BOOM_HOOK)
    work = tmp_path / "run"
    args = [f"hydra.run.dir={work}", "trainer.max_epochs=1"]
    args += {
        "failed": ["+hooks.boom._target_=boomhook.Boom"],
        "completed": [],
        "stopped early": ["hooks=[stop_after]", "hooks.stop_after.iters=5"],
    }[ending]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "late.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((work / "result.json").read_text())
    if ending == "failed":
        assert proc.returncode == 1, output
        assert "Error: in Boom.after_train_iter: RuntimeError: boom at iteration 3" in proc.stderr
        assert result["status"] == "failed"
    else:  # the signal came after the run's end: it stopped nothing, and is not what stopped it
        assert proc.returncode == 0, output
        assert "Stopped by a signal" not in output
        assert result["status"] == ("completed" if ending == "completed" else "stopped")
