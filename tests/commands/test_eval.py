"""Evaluate, load, reproduce: expkit.eval, load_model, provenance, deterministic runs."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli
from hydra import compose, initialize_config_dir

from expkit.config.build import build_runner
from expkit.config.cli import CONF_DIR
from expkit.core.hydra_compat import INIT_KWARGS
from expkit.eval import load_model


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), **INIT_KWARGS):
        return compose(config_name="train", overrides=list(overrides))


def _eval(*args: str):
    return subprocess.run([sys.executable, "-m", "expkit.eval", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("ema", [False, True])
def test_evaluating_the_best_checkpoint_gives_back_the_logged_test_metrics(tmp_path, ema):
    args = ["trainer.max_epochs=3"] + (["hooks=[ema]"] if ema else [])
    assert run_cli(f"hydra.run.dir={tmp_path / 'run'}", *args).returncode == 0
    trained = json.loads((tmp_path / "run" / "result.json").read_text())
    assert trained["test_checkpoint"] == trained["best_checkpoint"]  # test_with=best
    proc = _eval(f"checkpoint={tmp_path / 'run'}", f"work_dir={tmp_path / 'eval'}", f"ema={str(ema).lower()}")
    assert proc.returncode == 0, proc.stderr
    output = proc.stdout + proc.stderr
    assert "Data: test 270 samples\n" in output and "train ?" not in output and "evaluation only" in output
    assert "before_run:" not in output  # the hook table only when asked for
    best = Path(trained["best_checkpoint"]).name  # the test line names the weights ("Test (epoch 0)" before)
    assert f"Test (weights {best}):" in output, output
    evaluated = json.loads((tmp_path / "eval" / "result.json").read_text())
    assert evaluated["checkpoint"] == trained["best_checkpoint"] == evaluated["test_checkpoint"]
    for key in ("test/acc", "test/loss"):
        assert evaluated["final_metrics"][key] == pytest.approx(trained["final_metrics"][key], abs=1e-6)
    assert json.loads((tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()[-1])["test/acc"] > 0.5


def test_eval_errors_name_the_problem(tmp_path):
    proc = _eval(f"checkpoint={tmp_path / 'none'}")
    assert proc.returncode == 2 and "no such file or run dir" in proc.stderr
    proc = _eval("split=test")
    assert proc.returncode == 2 and "give checkpoint=" in proc.stderr


def test_load_model_equals_the_final_model_of_training(tmp_path):
    cfg = _compose("model=cnn", "trainer.max_epochs=2", "trainer.test_with=last")
    runner = build_runner(cfg, tmp_path)
    runner.run()
    loaded = load_model(tmp_path, which="last")
    assert not loaded.training
    x, _ = next(iter(runner.val_loader))
    runner.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), runner.model(x))


def test_provenance_records_the_commit_and_the_dirty_diff(tmp_path):
    repo = tmp_path / "project"
    repo.mkdir()
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "notes.txt").write_text("v1\n")
    subprocess.run([*git, "-C", str(repo), "add", "."], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "one"], check=True)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "notes.txt").write_text("v2\n")  # uncommitted
    proc = run_cli(f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_epochs=1", cwd=repo)
    assert proc.returncode == 0, proc.output
    info = json.loads((tmp_path / "run" / "provenance.json").read_text())
    assert info["git"]["commit"] == head and info["git"]["dirty"] is True
    assert "+v2" in (tmp_path / "run" / "provenance.diff").read_text()
    assert info["torch"] == torch.__version__ and any(p.startswith("torch==") for p in info["packages"])
    assert info["status"] == "completed" and info["ended"] >= info["started"]
    assert "trainer.max_epochs=1" in info["command"]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["provenance"] == "provenance.json"


def test_provenance_reads_commit_branch_and_changes_from_one_git_status(tmp_path):
    from expkit.workdir.provenance import _GitQuery

    repo, outside = tmp_path / "project", tmp_path / "elsewhere"
    (repo / "src").mkdir(parents=True)
    outside.mkdir()
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    (repo / "a.txt").write_text("a\n")
    (repo / "c.txt").write_text("c\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert _GitQuery(repo / "src").state() == {
        "repository": str(repo),
        "commit": head,
        "branch": "main",
        "dirty": False,
        "changed_files": [],
    }
    subprocess.run([*git, "mv", "a.txt", "b.txt"], check=True)
    (repo / "c.txt").write_text("changed\n")
    (repo / "src" / "new file.py").write_text("x = 1\n")
    subprocess.run([*git, "checkout", "-q", "--detach"], check=True)
    state = _GitQuery(repo / "src").state()  # paths from the repository's root, whatever the cwd
    assert (state["branch"], state["dirty"]) == ("HEAD", True)
    assert state["changed_files"] == ["a.txt -> b.txt", "c.txt", "src/"]  # (an untracked directory as git lists it)
    assert _GitQuery(outside).state() == {"repository": None}  # and no git process started
    assert _GitQuery(outside).status is None


def test_a_run_inside_a_repository_does_not_call_it_dirty_with_its_own_outputs(tmp_path):
    """A project without a .gitignore for outputs/ (examples/my_project had none): the run's
    own work dir, and the outputs/ dir holding it, are not changes to the code."""
    repo = tmp_path / "project"
    repo.mkdir()
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "train.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    for run in ("first", "second"):  # the second sees the first's outputs too
        proc = run_cli(f"hydra.run.dir=outputs/runs/{run}", "trainer.max_epochs=1", cwd=repo)
        assert proc.returncode == 0, proc.output
        info = json.loads((repo / "outputs" / "runs" / run / "provenance.json").read_text())
        assert info["git"]["dirty"] is False and info["git"]["changed_files"] == [], info["git"]
    (repo / "notes.txt").write_text("mine\n")  # an untracked file of the user's still counts
    proc = run_cli("hydra.run.dir=outputs/runs/third", "trainer.max_epochs=1", cwd=repo)
    info = json.loads((repo / "outputs" / "runs" / "third" / "provenance.json").read_text())
    assert info["git"]["changed_files"] == ["notes.txt"]
    assert "outputs/" in (REPO / "examples" / "my_project" / ".gitignore").read_text().splitlines()


def test_two_seeded_deterministic_runs_are_identical(tmp_path):
    def values(work):
        rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if "time" not in k} for r in rows]

    overrides = (
        "trainer.deterministic=true",
        "trainer.seed=7",
        "trainer.max_epochs=2",
        "model.dropout=0.2",
        "data.num_workers=2",
    )
    for name in ("a", "b"):
        build_runner(_compose(*overrides), tmp_path / name).run()
    assert values(tmp_path / "a") == values(tmp_path / "b")
    build_runner(_compose(*overrides[:1], "trainer.seed=8", *overrides[2:]), tmp_path / "c").run()
    assert values(tmp_path / "c") != values(tmp_path / "a")  # the seed matters
    assert not torch.are_deterministic_algorithms_enabled()  # restored after each run


def test_eval_is_a_hydra_app_with_hydras_habits(tmp_path):
    """hydra.run.dir, --help, --cfg job, and -m over several checkpoints with a summary."""
    for name, epochs in (("a", 1), ("b", 2)):
        proc = run_cli(
            f"hydra.run.dir={tmp_path / name}", f"trainer.max_epochs={epochs}", "default_hooks.logger.plot=false"
        )
        assert proc.returncode == 0, proc.output[-2000:]
    proc = _eval(
        f"checkpoint={tmp_path / 'a'}", f"hydra.run.dir={tmp_path / 'eval'}", "data.batch_size=64", "split=both"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "eval" / "result.json").read_text())
    assert result["status"] == "completed" and result["overrides"] == ["data.batch_size=64"]
    weights = Path(result["checkpoint"]).name  # both lines name the weights ("Validation (epoch 0)" before)
    assert f"Validation (weights {weights}):" in proc.stdout + proc.stderr
    assert f"Test (weights {weights}):" in proc.stdout + proc.stderr
    assert (tmp_path / "eval" / ".hydra" / "config.yaml").is_file()

    helped = _eval("--help")
    assert (
        helped.returncode == 0
        and "python -m expkit.eval checkpoint=" in helped.stdout
        and "split: test" in helped.stdout
    )
    shown = _eval(f"checkpoint={tmp_path / 'a'}", "split=val", "--cfg", "job")
    assert shown.returncode == 0 and "split: val" in shown.stdout and "checkpoint:" in shown.stdout

    sweep = tmp_path / "evals"
    proc = _eval("-m", f"checkpoint={tmp_path / 'a'},{tmp_path / 'b'}", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    scores = {
        Path(json.loads((sweep / r["job"] / "result.json").read_text())["checkpoint"]).parts[-3]: float(r["best"])
        for r in rows
    }
    assert sorted(scores) == ["a", "b"] and all(r["monitor"] == "test/acc" for r in rows)
    assert float(rows[0]["best"]) >= float(rows[1]["best"])  # best first
    assert json.loads((sweep / "best.json").read_text())["value"] == max(scores.values())
    progress = [line for line in proc.stdout.splitlines() if "jobs done" in line]
    assert len(progress) == 2, progress  # one line a job (its log line on the terminal was printed again too)
    assert "Sweep: 1/2 jobs done" in progress[0] and "Sweep: 2/2 jobs done" in progress[1], progress  # (the total)

    proc = _eval(f"checkpoint={tmp_path / 'a'}", "nosuchkey.x=1")
    assert proc.returncode == 2 and "nosuchkey: not a key of the stored config" in proc.stderr


def test_hydra_argv_moves_stored_config_overrides_into_one_quoted_list_hydra_parses():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from expkit.config.cli import hydra_argv
    from expkit.eval import OPTIONS

    argv = [
        "checkpoint=run",
        "--config-dir",
        "conf",
        "work_dir=out",
        "data.batch_size=256",
        "logger=[tensorboard]",
        "model.hidden=${data.size}",
        "data.root=C:\\x\\",
        "data.name=it's",
    ]
    out = hydra_argv(argv, OPTIONS)
    assert out[:5] == ["checkpoint=run", "--config-dir", "conf", "hydra.run.dir=out", "logger=[tensorboard]"]
    (parsed,) = OverridesParser.create().parse_overrides([out[-1]])
    assert parsed.key_or_group == "overrides"
    assert parsed.value() == ["data.batch_size=256", "model.hidden=${data.size}", "data.root=C:\\x\\", "data.name=it's"]
