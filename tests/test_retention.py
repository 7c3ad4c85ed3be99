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
from expkit.cli import continue_command, flags_first
from expkit.errors import CheckpointWriteError, ConfigError
from expkit.hook_table import default_hooks
from expkit.hooks import CheckpointHook, LoggerHook

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
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}  # fmt: skip


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
    return [f"hydra.run.dir={work}", "trainer.max_epochs=3", "default_hooks.checkpoint.max_keep_ckpts=1",
            "default_hooks.checkpoint.save_best=null"]  # fmt: skip


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

    resumed = run_cli(*common, "resume=true")
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
    resumed = run_cli(*common, "resume=true")
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
    assert seen == [("before", []), ("after", ["epoch_1.pth"]),
                    ("before", ["epoch_1.pth"]), ("after", ["epoch_1.pth", "epoch_2.pth"]),
                    ("before", ["epoch_2.pth"]), ("after", ["epoch_2.pth", "epoch_3.pth"])]  # fmt: skip
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
    assert shlex.split(command)[3:] == ["--config-dir", "my conf", "-m", "model=cnn",
                                        "hydra.run.dir=/runs/with space/run 1", "resume=true"]  # fmt: skip


@pytest.mark.slow
def test_overrides_may_come_before_and_after_config_dir(tmp_path):
    project = REPO / "examples" / "my_project"
    proc = subprocess.run(
        [sys.executable, "-m", "expkit.train", "model=residual_mlp", "--config-dir", "conf", "show_hooks=true",
         f"hydra.run.dir={tmp_path}"],
        cwd=project, env={**os.environ, "PYTHONPATH": str(project)}, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "CheckpointHook [checkpoint]" in proc.stdout


# -- background writes (the checkpoint hook's default) ---------------------------------------------
def _pointed(work: Path) -> str | None:
    pointer = work / "checkpoints" / "last_checkpoint"
    return pointer.read_text() if pointer.exists() else None


def test_a_background_checkpoint_holds_the_state_of_its_save_not_of_the_training_after_it(tmp_path):
    runner = toy_runner(tmp_path)
    saved = {k: v.clone() for k, v in runner.model.state_dict().items()}
    path = runner.save_checkpoint(tmp_path / "checkpoints" / "epoch_0.pth", background=True)
    with torch.no_grad():  # training goes on at once, in place, while the file may not be written yet
        for p in runner.model.parameters():
            p.add_(1.0)
    runner.wait_for_checkpoints()
    written = torch.load(path, weights_only=True)["state_dict"]
    assert all(torch.equal(written[k], saved[k]) for k in saved)
    assert runner.last_checkpoint == path and _pointed(tmp_path) == "epoch_0.pth"


def test_background_writes_leave_what_writing_in_place_leaves(tmp_path):
    """Retention, best files, the pointer and the files' contents are the same either way."""
    works = {}
    for background in (True, False):
        work = tmp_path / str(background)
        hooks = default_hooks(logger=LoggerHook(plot=False),
                              checkpoint=CheckpointHook(max_keep_ckpts=2, save_best="val/acc", background=background))  # fmt: skip
        runner = toy_runner(work, default_hooks=hooks, max_epochs=5)
        runner.run()
        assert runner.last_checkpoint == work / "checkpoints" / "epoch_5.pth"
        works[background] = work
    bg, in_place = works[True], works[False]
    assert (work / "checkpoints").is_dir() and _names(bg) == _names(in_place)
    assert _pointed(bg) == _pointed(in_place) == "epoch_5.pth"
    assert not list((bg / "checkpoints").glob(".*"))  # no temporary file left behind
    for name in _names(bg):
        a, b = (torch.load(w / "checkpoints" / name, weights_only=True) for w in (bg, in_place))
        a["hooks"].pop("timer"), b["hooks"].pop("timer")  # (measured times)
        assert a.keys() == b.keys() and a["hooks"] == b["hooks"] and a["meta"]["epoch"] == b["meta"]["epoch"]
        assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])


def test_with_background_writes_the_pointer_always_names_a_complete_checkpoint(tmp_path):
    """At every save (a hook at before_save_checkpoint does not make the write synchronous),
    the pointer names a complete file that retention has not deleted."""
    seen: list[tuple[str | None, bool]] = []

    class Watch(Hook):
        def before_save_checkpoint(self, runner, *, checkpoint):
            pointed = _pointed(tmp_path)
            seen.append((pointed, pointed is not None and (tmp_path / "checkpoints" / pointed).is_file()))
            if pointed is not None:
                torch.load(tmp_path / "checkpoints" / pointed, weights_only=True)

    hooks = default_hooks(logger=LoggerHook(plot=False), checkpoint=CheckpointHook(max_keep_ckpts=1))
    toy_runner(tmp_path, default_hooks=hooks, hooks=[Watch()], max_epochs=4).run()
    assert seen[0] == (None, False) and all(complete for _, complete in seen[1:]), seen
    assert _names(tmp_path) == ["epoch_4.pth"] and _pointed(tmp_path) == "epoch_4.pth"


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_checkpoint_write_fails_the_run_naming_the_file_and_keeps_the_last_complete_one(tmp_path, background):
    blocked = tmp_path / "checkpoints" / "epoch_2.pth"
    (blocked / "in-the-way").mkdir(parents=True)  # a directory under the name: the rename fails
    hooks = default_hooks(logger=LoggerHook(plot=False), checkpoint=CheckpointHook(background=background))
    runner = toy_runner(tmp_path, default_hooks=hooks, max_epochs=3)
    with pytest.raises(CheckpointWriteError, match=r"could not write .*epoch_2\.pth: IsADirectoryError.*previous "
                       r"complete checkpoint .*epoch_1\.pth \(and last_checkpoint\) is intact"):  # fmt: skip
        runner.run()
    assert runner.epoch == (3 if background else 2)  # in the background, it surfaces at the next save
    assert _pointed(tmp_path) == "epoch_1.pth" and runner.last_checkpoint == tmp_path / "checkpoints" / "epoch_1.pth"
    assert not (tmp_path / "checkpoints" / "epoch_3.pth").exists()  # nothing saved past the failed one
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "failed" and "epoch_2.pth" in result["error"]
