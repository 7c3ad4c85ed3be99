"""Never lose a checkpoint: copied run dirs, retention, crashes inside a save, bad pointers."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli, toy_runner

from expkit import Hook
from expkit.config.cli import continue_command, flags_first
from expkit.core.errors import ConfigError
from expkit.hooks import CheckpointHook, LoggerHook, default_hooks

EXIT_HOOK = """
import os
from expkit import Hook

class ExitAtSave(Hook):
    '''Ends the process (as SIGKILL would: no cleanup) at `stage` of the save of checkpoint `count`.'''

    def __init__(self, stage: str, count: int) -> None:
        self.stage, self.count, self.saves = stage, count, 0

    def before_save_checkpoint(self, runner, *, checkpoint):
        self.saves += 1
        if self.stage == "before" and self.saves == self.count:
            os._exit(9)

    def after_save_checkpoint(self, runner, *, path, is_best, metric):
        if self.stage == "after" and self.saves == self.count:
            os._exit(9)
"""


def _digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _names(work: Path) -> list[str]:
    return sorted(p.name for p in (work / "checkpoints").glob("*.pth"))


@pytest.mark.slow
def test_resuming_a_copied_run_leaves_the_original_untouched(tmp_path):
    original, copy = tmp_path / "x", tmp_path / "y"
    keep = ["default_hooks.checkpoint.max_keep_ckpts=2"]
    assert run_cli(f"hydra.run.dir={original}", "trainer.max_epochs=3", *keep).returncode == 0
    shutil.copytree(original, copy)
    # records as earlier versions wrote them: absolute paths into the original
    (copy / "checkpoints" / "last_checkpoint").write_text(str(original / "checkpoints" / "epoch_3.pth"))
    for name in ("epoch_2.pth", "epoch_3.pth"):
        checkpoint = torch.load(copy / "checkpoints" / name, weights_only=True)
        state = checkpoint["hooks"]["checkpoint"]
        state["kept"] = [str(original / "checkpoints" / n) for n in state["kept"]]
        state["best_paths"] = {k: str(original / "checkpoints" / v) for k, v in state["best_paths"].items()}
        checkpoint["meta"]["best_checkpoints"] = dict(state["best_paths"])
        torch.save(checkpoint, copy / "checkpoints" / name)
    before = _digests(original)

    proc = run_cli(f"hydra.run.dir={copy}", "resume=true", "trainer.max_epochs=5", *keep)
    assert proc.returncode == 0, proc.output
    assert f"Resumed from {copy / 'checkpoints' / 'epoch_3.pth'}" in proc.output
    assert _digests(original) == before  # not one byte of the original changed
    assert [n for n in _names(copy) if not n.startswith("best_")] == ["epoch_4.pth", "epoch_5.pth"]
    assert (copy / "checkpoints" / "last_checkpoint").read_text() == "epoch_5.pth"
    result = json.loads((copy / "result.json").read_text())
    assert result["epoch"] == 5 and Path(result["best_checkpoint"]).parent == copy / "checkpoints"


def _keep_one(work: Path) -> list[str]:
    """A 3-epoch run keeping one regular checkpoint, without best ones: the n-th save is epoch_n."""
    return [
        f"hydra.run.dir={work}",
        "trainer.max_epochs=3",
        "default_hooks.checkpoint.max_keep_ckpts=1",
        "default_hooks.checkpoint.save_best=null",
    ]


def _write_exit_hook(tmp_path: Path, stage: str, count: int) -> tuple[list[str], dict[str, str]]:
    (tmp_path / "exithook.py").write_text(EXIT_HOOK)
    args = ["+hooks.exit._target_=exithook.ExitAtSave", f"+hooks.exit.stage={stage}", f"+hooks.exit.count={count}"]
    return args, {"PYTHONPATH": str(tmp_path)}


@pytest.mark.slow
def test_a_kill_inside_the_second_save_keeps_the_first_checkpoint(tmp_path):
    work = tmp_path / "run"
    common = _keep_one(work)
    exit_args, env = _write_exit_hook(tmp_path, "before", 2)
    killed = run_cli(*common, *exit_args, env=env)
    assert killed.returncode == 9, killed.output
    assert _names(work) == ["epoch_1.pth"]  # max_keep_ckpts=1 did not delete it before the new one existed
    assert (work / "checkpoints" / "last_checkpoint").read_text() == "epoch_1.pth"
    (work / "checkpoints" / ".epoch_2.pth.tmp4242").write_bytes(b"half a checkpoint")  # a killed writer's leftovers
    (work / ".result.json.tmp4242").write_text("{")

    resumed = run_cli(*common, "resume=true", "~hooks.exit")  # (the run's own overrides hold the exit hook)
    assert resumed.returncode == 0, resumed.output
    assert f"Resumed from {work / 'checkpoints' / 'epoch_1.pth'}" in resumed.output
    assert _names(work) == ["epoch_3.pth"]
    assert not list(work.rglob("*.tmp4242"))  # stale temporaries removed on resume


@pytest.mark.slow
def test_a_kill_between_a_save_and_its_retention_is_finished_on_resume(tmp_path):
    work = tmp_path / "run"
    common = _keep_one(work)
    exit_args, env = _write_exit_hook(tmp_path, "after", 2)
    assert run_cli(*common, *exit_args, env=env).returncode == 9
    assert _names(work) == ["epoch_1.pth", "epoch_2.pth"]  # written and pointed at, epoch_1 not yet deleted
    resumed = run_cli(*common, "resume=true", "~hooks.exit")  # (the run's own overrides hold the exit hook)
    assert resumed.returncode == 0, resumed.output
    assert f"Resumed from {work / 'checkpoints' / 'epoch_2.pth'}" in resumed.output
    assert _names(work) == ["epoch_3.pth"]


def test_retention_never_leaves_the_run_without_a_complete_checkpoint(tmp_path):
    """At each save, the files on disk hold the previous checkpoint until the new one is complete."""
    seen: list[tuple[str, list[str]]] = []

    class Watch(Hook):
        def before_save_checkpoint(self, runner, *, checkpoint):
            seen.append(("before", _names(tmp_path)))

        def after_save_checkpoint(self, runner, *, path, is_best, metric):
            seen.append(("after", _names(tmp_path)))

    hooks = default_hooks(logger=LoggerHook(plot=False), checkpoint=CheckpointHook(max_keep_ckpts=1))
    toy_runner(tmp_path, default_hooks=hooks, hooks=[Watch()], max_epochs=3).run()
    assert seen == [
        ("before", []),
        ("after", ["epoch_1.pth"]),
        ("before", ["epoch_1.pth"]),
        ("after", ["epoch_1.pth", "epoch_2.pth"]),
        ("before", ["epoch_2.pth"]),
        ("after", ["epoch_2.pth", "epoch_3.pth"]),
    ]
    assert _names(tmp_path) == ["epoch_3.pth"]


def test_a_pointer_that_is_not_utf8_falls_back_to_the_newest_checkpoint(tmp_path):
    toy_runner(tmp_path, max_epochs=2).run()
    (tmp_path / "checkpoints" / "last_checkpoint").write_bytes(b"\xff\xfe\x00garbage")
    resumed = toy_runner(tmp_path, max_epochs=3, resume=True)
    resumed.run()
    assert resumed.iter == 6 and json.loads((tmp_path / "result.json").read_text())["epoch"] == 3


def test_when_no_checkpoint_loads_resume_refuses_and_changes_nothing(tmp_path):
    toy_runner(tmp_path, max_epochs=2).run()
    for path in (tmp_path / "checkpoints").glob("*.pth"):
        path.write_bytes(b"not a checkpoint")
    before = _digests(tmp_path / "checkpoints")
    with pytest.raises(ConfigError, match=r"holds checkpoints but none loads \(.*epoch_2.pth.*run without resume=true"):
        toy_runner(tmp_path, max_epochs=3, resume=True).run()
    assert _digests(tmp_path / "checkpoints") == before


def test_an_empty_run_dir_is_refused_and_nothing_is_written(tmp_path):
    for value in ("", "''"):
        proc = run_cli(f"hydra.run.dir={value}", cwd=tmp_path)
        assert proc.returncode == 2 and "hydra.run.dir is empty" in proc.stderr, proc.output
        assert "Traceback" not in proc.stderr
    proc = run_cli("-m", "hydra.sweep.dir=", "optim.lr=0.1,0.2", cwd=tmp_path)
    assert proc.returncode == 2 and "hydra.sweep.dir is empty" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_continue_command_pastes_into_a_shell_with_flags_first():
    argv = flags_first(["model=cnn", "--config-dir", "my conf", "hydra.run.dir=old", "resume=true", "-m"])
    assert argv == ["--config-dir", "my conf", "-m", "model=cnn", "hydra.run.dir=old", "resume=true"]
    command = continue_command(argv, Path("/runs/with space/run 1"))
    assert shlex.split(command)[3:] == [
        "--config-dir",
        "my conf",
        "-m",
        "model=cnn",
        "hydra.run.dir=/runs/with space/run 1",
        "resume=true",
    ]


@pytest.mark.slow
def test_overrides_may_come_before_and_after_config_dir(tmp_path):
    project = REPO / "examples" / "my_project"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "expkit.train",
            "model=residual_mlp",
            "--config-dir",
            "conf",
            "show_hooks=true",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "CheckpointHook [checkpoint]" in proc.stdout
