"""A path read from a checkpoint or a work dir's records never reaches outside the run's own dir.

Each case crafts the newest checkpoint of a finished run as an attacker (or a corrupted
file) would, with names that climb out of its checkpoints dir, then resumes it by
``resume=true`` (the run dir) and by ``resume=<file>`` (into a new run dir beside it): the
files and dirs outside must still exist, and the run must still resume.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from expkit.checkpoint import checkpoint_io
from expkit.core import confine
from expkit.sweeps.summary import ROWS_DIR, _cached_row
from expkit.sweeps.sweep_jobs import JOB_FILE, job_target, restore_hydra_record

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A completed two-epoch run: epoch_1.pth, epoch_2.pth, best_val_acc_epoch_*.pth."""
    run = tmp_path_factory.mktemp("base") / "run"
    proc = run_cli(f"hydra.run.dir={run}", "trainer.max_epochs=2")
    assert proc.returncode == 0, proc.output
    return run


def _area(tmp_path: Path, finished_run: Path) -> tuple[Path, dict[str, Path]]:
    """A copy of the finished run in tmp_path/run, beside files and a dir that must survive."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    victims = {"file": tmp_path / "victim.txt", "pth": tmp_path / "victim2.pth", "dir": tmp_path / "victim_dir"}
    victims["file"].write_text("keep me")
    victims["pth"].write_bytes(b"keep me too")
    victims["dir"].mkdir()
    (victims["dir"] / "inside.txt").write_text("and me")
    return run, victims


def _craft(run: Path, **state) -> Path:
    """Put `state` into the checkpoint hook's state of the run's newest checkpoint."""
    path = run / "checkpoints" / "epoch_2.pth"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["hooks"]["checkpoint"].update(state)
    torch.save(checkpoint, path)
    return path


def _resume(how: str, run: Path, *extra: str):
    if how == "true":
        return run_cli(f"hydra.run.dir={run}", "resume=true", "trainer.max_epochs=3", *extra)
    return run_cli(
        f"hydra.run.dir={run.parent / 'new'}",
        f"resume={run / 'checkpoints' / 'epoch_2.pth'}",
        "trainer.max_epochs=3",
        *extra,
    )


def _assert_all_there(victims: dict[str, Path]) -> None:
    assert victims["file"].read_text() == "keep me"
    assert victims["pth"].read_bytes() == b"keep me too"
    assert (victims["dir"] / "inside.txt").read_text() == "and me"


CASES = {
    "dropping a .. file": ({"dropping": ["../../victim.txt"]}, []),
    "dropping a .. dir": ({"dropping": ["../../victim_dir"]}, []),
    "kept a .. file, max_keep 1": ({"kept": ["../../victim2.pth"]}, ["default_hooks.checkpoint.max_keep_ckpts=1"]),
    "best path a .. file": ({"best_paths": {"val/acc": "../../victim.txt"}, "best_scores": {"val/acc": -1.0}}, []),
    "dropping an absolute path": ({"dropping": ["{victim_dir}", "{victim_file}"]}, []),
    "kept an absolute path": ({"kept": ["{victim_pth}"]}, ["default_hooks.checkpoint.max_keep_ckpts=1"]),
}


@pytest.mark.parametrize("how", ["true", "file"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_checkpoint_deletes_nothing_outside_the_run(tmp_path, finished_run, case, how):
    run, victims = _area(tmp_path, finished_run)
    state, extra = CASES[case]
    absolute = {
        "{victim_dir}": str(victims["dir"]),
        "{victim_file}": str(victims["file"]),
        "{victim_pth}": str(victims["pth"]),
    }
    state = copy.deepcopy(state)
    for key, value in state.items():
        if isinstance(value, list):
            state[key] = [absolute.get(v, v) for v in value]
    _craft(run, **state)

    proc = _resume(how, run, *extra)
    assert proc.returncode == 0, proc.output
    _assert_all_there(victims)
    resumed = run if how == "true" else run.parent / "new"
    assert json.loads((resumed / "result.json").read_text())["status"] == "completed"
    if how == "true" and ".." in json.dumps(state):  # a name that climbs out is said, with the file it came from
        assert "Ignoring '../../victim" in proc.output and "epoch_2.pth" in proc.output, proc.output


@pytest.mark.parametrize("how", ["true", "file"])
def test_a_symlink_in_the_checkpoints_dir_leading_out_is_not_followed(tmp_path, finished_run, how):
    run, victims = _area(tmp_path, finished_run)
    outside = tmp_path / "outside.pth"  # a checkpoint outside the run, reached through a symlink inside it
    shutil.copy(run / "checkpoints" / "epoch_1.pth", outside)
    (run / "checkpoints" / "epoch_7.pth").symlink_to(outside)
    (run / "checkpoints" / "epoch_8.pth").symlink_to(victims["dir"])
    (run / "checkpoints" / "epoch_9.pth").symlink_to(victims["pth"])
    (run / "checkpoints" / "last_checkpoint").write_text("epoch_7.pth")
    _craft(run, kept=["epoch_8.pth", "epoch_9.pth", "epoch_2.pth"], dropping=["epoch_8.pth"])

    proc = _resume(how, run, "default_hooks.checkpoint.max_keep_ckpts=1")
    assert proc.returncode == 0, proc.output
    _assert_all_there(victims)
    assert outside.is_file()
    if how == "true":  # the pointer's symlink is not read: the newest checkpoint inside the run is
        assert "Resumed from " + str(run / "checkpoints" / "epoch_2.pth") in proc.output, proc.output
        assert "'epoch_7.pth'" in proc.output and "leads out of" in proc.output


def test_resuming_from_a_file_does_not_inherit_its_retention(tmp_path, finished_run):
    """resume=<file> into a dir that holds checkpoints of its own: the file's kept list names
    epoch_1.pth, which here is the new run's own file, and must not be retired by it."""
    run, _ = _area(tmp_path, finished_run)
    _craft(run, kept=["epoch_1.pth", "epoch_2.pth"], best_paths={"val/acc": "epoch_1.pth"})
    new = tmp_path / "new"
    (new / "checkpoints").mkdir(parents=True)
    mine = new / "checkpoints" / "epoch_1.pth"
    shutil.copy(run / "checkpoints" / "epoch_1.pth", mine)

    proc = _resume("file", run, "default_hooks.checkpoint.max_keep_ckpts=2")
    assert proc.returncode == 0, proc.output
    assert mine.is_file()
    assert "this run keeps, retires and ranks only its own checkpoints" in proc.output
    names = sorted(p.name for p in (new / "checkpoints").glob("*.pth"))
    assert "epoch_3.pth" in names and any(n.startswith("best_") for n in names)  # its own best, in its own dir
    result = json.loads((new / "result.json").read_text())
    assert Path(result["best_checkpoint"]).parent == new / "checkpoints"


def test_confined_accepts_one_name_inside_and_rejects_the_rest(tmp_path, caplog):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    (directory / "epoch_1.pth").write_bytes(b"x")
    (directory / "out.pth").symlink_to(tmp_path)
    source = directory / "last_checkpoint"
    assert confine.confined(directory, "epoch_1.pth", source) == directory / "epoch_1.pth"
    assert confine.confined(directory, str(tmp_path / "elsewhere" / "epoch_1.pth"), source) == directory / "epoch_1.pth"
    for bad in ("../x.pth", "a/b.pth", "..", ".", "", None, 3, ["epoch_1.pth"], "out.pth", "/"):
        assert confine.confined(directory, bad, source) is None, bad
    assert str(source) in caplog.text and "'../x.pth'" in caplog.text


def test_name_patterns_match_only_the_hooks_own_names():
    pattern = confine.name_pattern("epoch_{}.pth")
    assert all(pattern.fullmatch(n) for n in ("epoch_1.pth", "epoch_12.dcp"))
    assert not any(pattern.fullmatch(n) for n in ("epoch_.pth", "epoch_1.txt", "victim2.pth", "xepoch_1.pth"))
    best = confine.name_pattern("best_val_acc_epoch_{}.pth")
    assert best.fullmatch("best_val_acc_epoch_3.pth") and not best.fullmatch("best_val_loss_epoch_3.pth")


def test_removing_a_checkpoint_never_deletes_another_tree(tmp_path):
    tree = tmp_path / "epoch_1.dcp"  # named like a sharded checkpoint, but without its index
    tree.mkdir()
    (tree / "data.txt").write_text("x")
    checkpoint_io.remove_checkpoint(tree)
    assert (tree / "data.txt").is_file()
    link = tmp_path / "epoch_2.pth"
    link.symlink_to(tree)
    checkpoint_io.remove_checkpoint(link)  # the link goes, never what it leads to
    assert not link.is_symlink() and (tree / "data.txt").is_file()


def test_a_sweep_job_record_cannot_point_a_job_outside_its_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    job = sweep / "0"
    job.mkdir(parents=True)
    (tmp_path / "victim").mkdir()
    for alias in ("../victim", str(tmp_path / "victim")):
        (job / JOB_FILE).write_text(json.dumps({"alias_of": alias, "overrides": []}))
        assert job_target(job) == job
    (sweep / "1").mkdir()
    (job / JOB_FILE).write_text(json.dumps({"alias_of": str(sweep / "1"), "overrides": []}))
    assert job_target(job) == sweep / "1"


def test_a_sweep_job_record_cannot_write_outside_its_hydra_dir(tmp_path):
    """job.json keeps a copy of the job's .hydra files by name; a crafted name is not a path."""
    job = tmp_path / "sweep" / "0"
    (job / ".hydra").mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    crafted = {
        "../../../victim.txt": "pwned",
        str(victim): "pwned",
        "../config.yaml": "pwned",
        "config.yaml": "a: 1",
        "notes.txt": "pwned",
    }
    restore_hydra_record(job, {"hydra": crafted})
    assert victim.read_text() == "keep me"
    assert not (job / "config.yaml").exists() and not (job / ".hydra" / "notes.txt").exists()
    assert (job / ".hydra" / "config.yaml").read_text() == "a: 1"


def test_a_cached_row_named_in_best_json_stays_in_the_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / ROWS_DIR).mkdir(parents=True)
    (tmp_path / "secret.json").write_text(json.dumps({"job": "x", "value": 1}))
    (sweep / ROWS_DIR / "0.json").write_text(json.dumps({"job": "0"}))
    assert _cached_row(sweep, "../../secret") is None
    assert _cached_row(sweep, "0") == {"job": "0"}


def test_resume_keeps_the_best_file_of_a_key_that_extends_another(tmp_path, finished_run):
    """best_val_acc_top5_*.pth belongs to key val/acc_top5, not to val/acc: resuming must not rank it
    among val/acc's best files (and delete it as a stale one)."""
    run, _ = _area(tmp_path, finished_run)
    best = next((run / "checkpoints").glob("best_val_acc_epoch_*.pth"))
    other = run / "checkpoints" / "best_val_acc_top5_epoch_1.pth"
    shutil.copy(best, other)
    proc = _resume("true", run)
    assert proc.returncode == 0, proc.output
    assert other.is_file(), proc.output


def test_a_sharded_save_never_replaces_a_tree_that_is_not_a_checkpoint(tmp_path):
    from expkit.checkpoint.dcp import _replace_dir

    mine, new = tmp_path / "epoch_1.dcp", tmp_path / ".epoch_1.dcp.tmp1"
    mine.mkdir()
    (mine / "data.txt").write_text("mine")
    new.mkdir()
    with pytest.raises(FileExistsError, match="epoch_1.dcp"):
        _replace_dir(new, mine)
    assert (mine / "data.txt").read_text() == "mine"


# -- a refused resume changes nothing in the run it refuses (issue 43 A) ---------------------------
def _digests(run: Path) -> dict[str, bytes]:
    """Every file of the run but its lock (which records its last owner) and train.log."""
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name not in (".lock", "train.log")
    }


@pytest.mark.parametrize(
    "override",
    ["model=cnn", "model.hidden=[32]", "optim.param_groups=[{match: '*.bias', weight_decay: 0.0}]"],
)
def test_a_refused_resume_changes_nothing_in_the_run(tmp_path, finished_run, override):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = _digests(run)
    proc = run_cli(f"hydra.run.dir={run}", "resume=true", override)
    assert proc.returncode == 2, proc.output
    assert "Nothing in" in proc.stderr and "was changed" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.output
    assert _digests(run) == before
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "completed" and result["best_metrics"]


def test_an_accepted_resume_records_its_config_in_hydra(tmp_path, finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    proc = run_cli(f"hydra.run.dir={run}", "resume=true", "trainer.max_epochs=3")
    assert proc.returncode == 0, proc.output
    from omegaconf import OmegaConf

    assert OmegaConf.load(run / ".hydra" / "config.yaml").trainer.max_epochs == 3
    assert "trainer.max_epochs=3" in OmegaConf.load(run / ".hydra" / "overrides.yaml")
    hydra = OmegaConf.load(run / ".hydra" / "hydra.yaml").hydra
    assert hydra.output_subdir == ".hydra" and "hydra.output_subdir=null" not in hydra.overrides.hydra
