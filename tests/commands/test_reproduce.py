"""python -m expkit.reproduce: a real run of this repository (its tree dirty with uncommitted edits,
which provenance.diff records) re-run from its record in a temporary worktree and compared; records
altered after the fact differ (exit 1, naming key and step); inputs it cannot use exit 2 in one
line. The original run dir and the user's tree are left exactly as they were."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli, run_module, torchrun


def reproduce(*args: str) -> subprocess.CompletedProcess:
    return run_module("expkit.reproduce", *args, timeout=300)


def hashes(directory: Path) -> dict[str, str]:
    """Every file under `directory` by its relative path, with its content's hash."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def repository_state() -> list[str]:
    """The user's index, HEAD, branches and worktrees (the working tree's files are others' to edit
    meanwhile here: engineers share this checkout). The temporary worktree of a reproduction that
    another test runs at the same time (pytest's other worker) is left out; the main one's line is
    compared by its path and commit only (git pads it to the longest path listed)."""
    worktrees = [
        " ".join(line.split())
        for line in git("worktree", "list").splitlines()
        if "/expkit-reproduce-" not in line.split()[0]
    ]
    return [git("ls-files", "--stage"), git("rev-parse", "HEAD"), git("for-each-ref"), "\n".join(worktrees)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A two-epoch run of the default experiment, trained from the repository as it is now."""
    work = tmp_path_factory.mktemp("reproduce") / "runs" / "a"
    proc = run_cli("trainer.max_epochs=2", f"hydra.run.dir={work}")
    assert proc.returncode == 0, proc.output
    return work


@pytest.mark.slow
def test_a_run_reproduces_from_its_record_and_nothing_it_read_is_written(trained, tmp_path):
    before, repository = hashes(trained), repository_state()
    out = tmp_path / "again"
    proc = reproduce(str(trained), f"out={out}")
    assert proc.returncode == 0, proc.output
    report = json.loads((out / "reproduce.json").read_text())
    assert report["verdict"] == "reproduced" and report["first_difference"] is None
    assert report["checks"]["weights"].startswith("6 tensors equal bit for bit"), report["checks"]
    assert report["command"][:2] == ["-m", "expkit.train"] and "trainer.max_epochs=2" in report["command"]
    recorded = json.loads((trained / "provenance.json").read_text())
    again = json.loads((out / "provenance.json").read_text())
    assert again["git"]["commit"] == recorded["git"]["commit"]
    # the recorded code ran: expkit imported from the worktree, with the uncommitted edits applied
    assert again["command"][0].endswith("expkit/train.py") and not again["command"][0].startswith(str(REPO))
    assert again["git"]["dirty"] == recorded["git"]["dirty"]
    assert "Verdict: reproduced" in proc.stdout
    assert hashes(trained) == before
    assert repository_state() == repository


@pytest.mark.slow
def test_a_record_altered_after_the_fact_differs_naming_its_key_and_step(trained, tmp_path):
    copy = tmp_path / "altered"
    shutil.copytree(trained, copy)
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[2])
    record["train/loss"] += 1e-3
    lines[2] = json.dumps(record)
    (copy / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    proc = reproduce(str(copy), f"out={tmp_path / 'again'}")
    assert proc.returncode == 1, proc.output
    step = record["step"]
    assert f"First difference: metrics.jsonl train/loss at step {step}" in proc.stdout, proc.output
    report = json.loads((tmp_path / "again" / "reproduce.json").read_text())
    assert report["verdict"] == "differs"
    first = report["first_difference"]
    assert (first["key"], first["step"], first["original"]) == ("train/loss", step, record["train/loss"])
    assert first["reproduced"] == pytest.approx(record["train/loss"] - 1e-3)


def test_a_dir_without_a_run_exits_2_in_one_line(tmp_path):
    proc = reproduce(str(tmp_path))
    assert proc.returncode == 2, proc.output
    assert proc.stderr.strip().count("\n") == 0 and "holds no run" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def recorded_run(directory: Path, provenance: dict | None) -> Path:
    """A run's records without its training: .hydra/, result.json and `provenance` (None: no file)."""
    (directory / ".hydra").mkdir(parents=True)
    (directory / ".hydra" / "overrides.yaml").write_text("- trainer.max_epochs=1\n")
    (directory / "result.json").write_text(json.dumps({"status": "completed"}))
    if provenance is not None:
        (directory / "provenance.json").write_text(json.dumps(provenance))
    return directory


@pytest.mark.parametrize(
    ("provenance", "said"),
    [
        ({"git": {"repository": None}}, "made outside a git repository"),
        ({"git": {"repository": str(REPO), "commit": "0" * 40}}, f"commit {'0' * 40} is not in {REPO}"),
        (None, "has no readable provenance.json"),
    ],
    ids=["outside-git", "unknown-commit", "no-provenance"],
)
def test_a_record_it_cannot_rebuild_exits_2_in_one_line_writing_nothing(tmp_path, provenance, said):
    run = recorded_run(tmp_path / "run", provenance)
    before, repository = hashes(tmp_path), repository_state()
    proc = reproduce(str(run))
    assert proc.returncode == 2, proc.output
    assert proc.stderr.strip().count("\n") == 0 and said in proc.stderr, proc.stderr
    assert hashes(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert repository_state() == repository


def test_help_names_the_command():
    proc = reproduce("--help")
    assert proc.returncode == 0 and "python -m expkit.reproduce <work dir>" in proc.stdout, proc.output


def test_the_digits_are_fingerprinted_and_a_changed_file_is_named_as_the_data(tmp_path):
    from expkit.data import DigitsData
    from expkit.data.inputs import fingerprint_inputs
    from expkit.reproduce import data_difference

    data = DigitsData()
    recorded = fingerprint_inputs(data, data.loaders())
    assert recorded["files"] == 1 and recorded["entries"][0]["path"].endswith("digits.csv.gz")
    assert recorded["entries"][0]["hash"] and recorded["bytes"] == recorded["entries"][0]["size"] > 0
    changed = {**recorded, "digest": "0" * 32, "entries": [{**recorded["entries"][0], "hash": "0" * 32}]}
    assert data_difference({"inputs": recorded}, {"inputs": recorded}) is None
    finding = data_difference({"inputs": recorded}, {"inputs": changed})
    assert finding["what"] == "data" and finding["key"] == recorded["entries"][0]["path"]
    assert finding["original"]["hash"] == recorded["entries"][0]["hash"] and finding["reproduced"]["hash"] == "0" * 32


# -- a user's own project, in its own git repository -------------------------------------------------
SHRINK_HOOK = '''
import torch

from expkit import Hook

SHRINK = 0.999


class Shrink(Hook):
    """Shrinks the weights after every training iteration: this code decides the run's numbers."""

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        with torch.no_grad():
            for p in runner.model.parameters():
                p.mul_(SHRINK)
'''


def user_git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def user_repo(repo: Path) -> Path:
    """A user's project in a git repository of its own, committed: its module in ``src/userhooks.py``
    (``PYTHONPATH=<repo>/src``) and its config dir ``project/conf`` (the ``shrink`` hook), run from
    ``project/`` with ``--config-dir conf``. Returns the repository."""
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "userhooks.py").write_text(SHRINK_HOOK)
    (repo / "project" / "conf" / "hooks").mkdir(parents=True)
    (repo / "project" / "conf" / "hooks" / "shrink.yaml").write_text("shrink:\n  _target_: userhooks.Shrink\n")
    (repo / ".gitignore").write_text("__pycache__/\n")
    user_git(repo, "init", "--quiet")
    user_git(repo, "add", "--all")
    user_git(repo, "-c", "user.name=u", "-c", "user.email=u@example.com", "commit", "--quiet", "-m", "shrink")
    return repo


def user_state(repo: Path) -> list[str]:
    """The user's working tree (status and the module's text), index, HEAD, branches and worktrees."""
    return [
        user_git(repo, "status", "--porcelain", "--untracked-files=all"),
        (repo / "src" / "userhooks.py").read_text(),
        user_git(repo, "ls-files", "--stage"),
        user_git(repo, "rev-parse", "HEAD"),
        user_git(repo, "for-each-ref"),
        user_git(repo, "worktree", "list"),
    ]


def set_shrink(repo: Path, value: str) -> None:
    module = repo / "src" / "userhooks.py"
    module.write_text(module.read_text().replace(module.read_text().split("SHRINK = ")[1].split("\n")[0], value))


@pytest.mark.slow
def test_a_sweep_job_of_a_user_project_reproduces_with_its_recorded_uncommitted_code(tmp_path):
    repo = user_repo(tmp_path / "repo")
    env = {"PYTHONPATH": str(repo / "src"), "OMP_NUM_THREADS": "1"}
    set_shrink(repo, "0.998")  # the run's code: an edit not committed (provenance.diff)
    sweep = tmp_path / "sweep"
    args = ["--config-dir", "conf", "hooks=[shrink]", "trainer.max_iters=20", "-m", "optim.lr=0.01,0.02"]
    proc = run_cli(*args, f"hydra.sweep.dir={sweep}", cwd=repo / "project", env=env)
    assert proc.returncode == 0, proc.output
    assert "+SHRINK = 0.998" in (sweep / "1" / "provenance.diff").read_text()
    set_shrink(repo, "0.997")  # today's code differs from the run's: reproduce must not run it
    before, state = hashes(sweep), user_state(repo)

    proc = run_module("expkit.reproduce", str(sweep / "1"), cwd=repo / "project", env=env)
    assert proc.returncode == 0, proc.output
    # the job alone, beside the sweep dir: nothing written in the sweep dir (one more job there)
    [out] = [p for p in tmp_path.iterdir() if p.name.startswith("sweep-1-reproduced-")]
    assert hashes(sweep) == before and user_state(repo) == state
    report = json.loads((out / "reproduce.json").read_text())
    assert report["verdict"] == "reproduced" and report["checks"]["data"] == "same files", report
    assert report["checks"]["weights"].startswith("6 tensors equal bit for bit"), report["checks"]
    assert "optim.lr=0.02" in report["command"] and "-m" not in report["command"][2:]
    assert not (out / "multirun.yaml").exists()
    assert (out / ".hydra" / "overrides.yaml").read_text() == (sweep / "1" / ".hydra" / "overrides.yaml").read_text()
    # the recorded code ran, in a worktree, from the run's cwd in it
    again = json.loads((out / "provenance.json").read_text())
    assert (out / "provenance.diff").read_text() == (sweep / "1" / "provenance.diff").read_text()
    assert again["cwd"].endswith("/project") and not again["cwd"].startswith(str(repo))

    # a record whose diff no longer applies: exit 2 in one line, the user's repository untouched
    damaged = shutil.copytree(sweep / "0", tmp_path / "damaged")
    diff = damaged / "provenance.diff"
    diff.write_text(diff.read_text().replace("-SHRINK = 0.999", "-SHRINK = 0.5"))
    proc = run_module("expkit.reproduce", str(damaged), f"out={tmp_path / 'never'}", cwd=repo / "project", env=env)
    assert proc.returncode == 2, proc.output
    assert proc.stderr.strip().count("\n") == 0 and "does not apply" in proc.stderr, proc.stderr
    assert "re-run by hand at that commit" in proc.stderr
    assert not (tmp_path / "never").exists() and user_state(repo) == state


@pytest.mark.slow
def test_a_torchrun_run_reproduces_with_its_recorded_world_size(tmp_path):
    repo = user_repo(tmp_path / "repo")
    work, out = tmp_path / "ddp", tmp_path / "again"
    env = {"PYTHONPATH": str(repo / "src"), "OMP_NUM_THREADS": "1"}
    proc = torchrun(
        "--config-dir",
        "conf",
        "hooks=[shrink]",
        "trainer.max_iters=10",
        f"hydra.run.dir={work}",
        cwd=repo / "project",
        env=env,
    )
    assert proc.returncode == 0, proc.output
    proc = run_module("expkit.reproduce", str(work), f"out={out}", cwd=repo / "project", env=env)
    assert proc.returncode == 0, proc.output
    report = json.loads((out / "reproduce.json").read_text())
    assert report["verdict"] == "reproduced", report
    assert "--nproc_per_node=2" in report["command"] and "expkit.train" in report["command"]
    assert report["checks"]["weights"].startswith("6 tensors equal bit for bit"), report["checks"]
    again = json.loads((out / "provenance.json").read_text())
    assert again["world_size"] == json.loads((work / "provenance.json").read_text())["world_size"] == 2


def write_images(root: Path) -> None:
    """A small ImageFolder dataset: 8x8 greyscale PNGs of two classes, 6 a class for training, 3 for validation."""
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 6), ("val", 3)):
        for label, shade in (("dark", 60), ("light", 180)):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                pixels = (shade + torch.randint(-50, 50, (8, 8), generator=generator)).to(torch.uint8)
                Image.fromarray(pixels.numpy(), mode="L").save(root / split / label / f"{i}.png")


@pytest.mark.slow
def test_a_data_file_changed_after_the_run_is_its_own_finding(tmp_path):
    from PIL import Image

    repo, images = user_repo(tmp_path / "repo"), tmp_path / "images"
    write_images(images)
    work, out = tmp_path / "run", tmp_path / "again"
    data = ["data=image_folder", f"data.root={images}", "data.image_size=8", "data.in_channels=1", "data.num_workers=0"]
    proc = run_cli(*data, "data.batch_size=4", "trainer.max_iters=6", f"hydra.run.dir={work}", cwd=repo)
    assert proc.returncode == 0, proc.output
    changed = images / "train" / "light" / "2.png"
    Image.fromarray(torch.zeros(8, 8, dtype=torch.uint8).numpy(), mode="L").save(changed)
    proc = run_module("expkit.reproduce", str(work), f"out={out}", cwd=repo)
    assert proc.returncode == 1, proc.output
    assert f"The data changed: data {changed}" in proc.stdout, proc.output
    report = json.loads((out / "reproduce.json").read_text())
    assert report["verdict"] == "differs" and report["checks"]["data"] == "changed"
    finding = report["data_changed"]
    assert finding["key"] == str(changed) and finding["original"]["hash"] != finding["reproduced"]["hash"]


def test_a_gpu_run_of_more_processes_than_this_machine_has_gpus_exits_2_in_one_line(tmp_path):
    commit = git("rev-parse", "HEAD").strip()
    run = recorded_run(tmp_path / "run", {"git": {"repository": str(REPO), "commit": commit}, "world_size": 64})
    (run / "result.json").write_text(json.dumps({"status": "completed", "device": "cuda:0", "world_size": 64}))
    before, repository = hashes(tmp_path), repository_state()
    proc = reproduce(str(run), f"out={tmp_path / 'never'}")
    assert proc.returncode == 2, proc.output
    assert proc.stderr.strip().count("\n") == 0 and "ran on 64 GPU processes" in proc.stderr, proc.stderr
    assert "cannot be reproduced here" in proc.stderr
    assert hashes(tmp_path) == before and not (tmp_path / "never").exists()
    assert repository_state() == repository
