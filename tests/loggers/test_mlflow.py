"""logger=[mlflow]: real MLflow runs in a local SQLite store, read back with MlflowClient, a sweep
as one parent run with its jobs as children, and `mlflow server` answering a REST query about them. A store whose
making is SIGKILLed (for real, during MLflow's own migrations) is never left half made; one left
half made before fails the run with its repair, and following that repair works."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow
mlflow = pytest.importorskip("mlflow")


def _client(cwd: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{cwd / 'outputs' / 'mlflow.db'}")


def test_a_run_logs_params_metrics_status_and_artifacts_equal_to_its_own_records(tmp_path):
    work = tmp_path / "run"
    proc = run_cli("logger=[mlflow]", f"hydra.run.dir={work}", "trainer.max_epochs=2", "optim.lr=0.05", cwd=tmp_path)
    assert proc.returncode == 0, proc.output[-3000:]
    assert "Logging backend" not in proc.output  # no warning: the backend worked
    client = _client(tmp_path)
    experiment = client.get_experiment_by_name("expkit")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_id == (work / "mlflow" / "run_id").read_text().strip()
    assert run.data.params["optim.lr"] == "0.05" and run.data.params["trainer.max_epochs"] == "2"
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    for key in ("train/loss", "val/acc", "val/loss", "test/acc"):
        expected = [(r["step"], r[key]) for r in records if key in r]
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == expected, key
    result = json.loads((work / "result.json").read_text())
    assert run.data.metrics["best/val/acc"] == result["best_metrics"]["val/acc"]["value"]
    assert run.data.tags["status"] == "completed" and run.data.tags["best_checkpoint"] == result["best_checkpoint"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"curves.svg", "config.yaml"} <= artifacts


def test_a_sweep_is_one_parent_run_with_its_jobs_as_children_and_mlflow_server_answers(tmp_path):
    """Jobs in processes of their own (joblib, two at once) make one parent between them; an
    MLFLOW_RUN_ID in the environment (mlflow#15713) takes no part; a re-run with resume=true finds
    the same parent; the parent holds best.json's best job's metrics and the summary."""
    client = _client(tmp_path)
    sweep = ["-m", "logger=[mlflow]", "hydra.sweep.dir=outputs/sweeps/lr", "trainer.max_epochs=1", "optim.lr=0.1,0.05"]
    proc = run_cli("logger=[mlflow]", f"hydra.run.dir={tmp_path / 'outside'}", "trainer.max_epochs=1", cwd=tmp_path)
    assert proc.returncode == 0, proc.output[-3000:]
    outside = (tmp_path / "outside" / "mlflow" / "run_id").read_text().strip()
    jobs = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    proc = run_cli(*sweep, *jobs, cwd=tmp_path, env={"MLFLOW_RUN_ID": outside})
    assert proc.returncode == 0, proc.output[-3000:]
    assert "Logging backend" not in proc.output and "Could not record" not in proc.output, proc.output[-3000:]
    experiment = client.get_experiment_by_name("expkit/lr")

    def parent_and_children():
        runs = client.search_runs([experiment.experiment_id])
        parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
        assert len(parents) == 1, [(r.info.run_name, r.data.tags) for r in parents]
        return parents[0], [r for r in runs if r is not parents[0]]

    parent, runs = parent_and_children()
    sweep_dir = (tmp_path / "outputs" / "sweeps" / "lr").resolve()
    assert parent.info.run_name == "lr" and parent.data.tags["expkit.sweep_dir"] == str(sweep_dir)
    assert parent.info.status == "FINISHED"
    assert sorted(r.data.params["optim.lr"] for r in runs) == ["0.05", "0.1"]
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in runs)
    assert all(r.info.status == "FINISHED" and r.data.tags["sweep"] == "lr" for r in runs)
    assert client.get_run(outside).data.tags.get("mlflow.parentRunId") is None  # MLFLOW_RUN_ID took no part
    assert not client.search_runs([client.get_experiment_by_name("expkit").experiment_id], "tags.sweep = 'lr'")
    best = json.loads((sweep_dir / "best.json").read_text())
    (best_run,) = [r for r in runs if r.data.tags["work_dir"] == best["work_dir"]]
    assert parent.data.metrics[f"best/{best['metric']}"] == best["value"]
    summary_of_best = {k: v for k, v in best_run.data.metrics.items() if k.startswith(("best/", "final/"))}
    assert parent.data.metrics == summary_of_best and summary_of_best  # the best job's best/* and final/*
    assert parent.data.tags["best_job"] == best["job"]
    assert parent.data.tags["mlflow.note.content"] == (sweep_dir / "summary.md").read_text()
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"summary.md", "summary.csv", "best.json", "sweep.svg"} <= artifacts

    proc = run_cli(*sweep[:-1], "optim.lr=0.1,0.05,0.02", "resume=true", cwd=tmp_path)  # one more job runs
    assert proc.returncode == 0, proc.output[-3000:]
    again, rerun = parent_and_children()
    assert again.info.run_id == parent.info.run_id and len(rerun) == 3
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in rerun)

    found = _server_search(tmp_path, experiment.experiment_id)
    assert found == sorted(r.info.run_id for r in [again, *rerun])


def _server_search(cwd: Path, experiment_id: str) -> list[str]:
    """The run ids `mlflow server` on the store of `cwd` answers a REST search of the experiment with."""
    with socket.socket() as s:  # a free port on localhost
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{cwd / 'outputs' / 'mlflow.db'}",
            "--workers",
            "1",
        ],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"mlflow server did not start: {server.stderr.read().decode()[-2000:] if server.stderr else ''}"
                    )
                time.sleep(0.5)
        query = json.dumps({"experiment_ids": [experiment_id], "max_results": 10}).encode()
        request = urllib.request.Request(
            f"{url}/api/2.0/mlflow/runs/search", data=query, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            found = json.loads(response.read())["runs"]
        return sorted(r["info"]["run_id"] for r in found)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def test_a_failing_mlflow_store_warns_once_and_the_run_goes_on(tmp_path):
    proc = run_cli(
        "logger=[mlflow]",
        "logger.mlflow.tracking_uri=unknownscheme://nowhere",
        f"hydra.run.dir={tmp_path / 'r'}",
        "trainer.max_epochs=1",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.output[-3000:]
    assert proc.output.count("Logging backend mlflow failed") == 1
    assert json.loads((tmp_path / "r" / "result.json").read_text())["status"] == "completed"


# python -c KILLER PATTERN MODULE ARGS...: runs `python -m MODULE ARGS` (MODULE "-c": `python -c ARGS[0]`),
# SIGKILLed right after MLflow's database runs a statement containing PATTERN (a SQLAlchemy event
# listener: no library is patched).
KILLER = """
import os, runpy, signal, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine
pattern, module = sys.argv[1], sys.argv[2]
def kill(conn, cursor, statement, *rest):
    if pattern in statement:
        os.kill(os.getpid(), signal.SIGKILL)
event.listen(Engine, "after_cursor_execute", kill)
if module == "-c":
    exec(sys.argv[3])
else:
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
# the batch migration that rebuilds `datasets` in a scratch copy: a kill here left the store of issue 43 (D)
SCRATCH_MADE = "CREATE TABLE _alembic_tmp_datasets"


def _killed(cwd: Path, module: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, SCRATCH_MADE, module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def half_made_store(tmp_path_factory) -> Path:
    """A store left half made the way issue 43 (D) found it: MLflow making it in place (here its own
    store, SqlAlchemyStore, as expkit's backend did before: `mlflow db upgrade` cannot make a new
    store with MLflow 3.0 to 3.4), SIGKILLed in its migrations."""
    db = tmp_path_factory.mktemp("half_made") / "mlflow.db"
    make = "from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as S; S(sys.argv[4], sys.argv[5])"
    _killed(db.parent, "-c", make, f"sqlite:///{db}", str(db.parent / "artifacts"))
    with contextlib.closing(sqlite3.connect(db)) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "_alembic_tmp_datasets" in tables and "runs" in tables
    return db


def _half_made_copy(half_made_store: Path, cwd: Path) -> Path:
    db = cwd / "outputs" / "mlflow.db"
    db.parent.mkdir(parents=True)
    shutil.copyfile(half_made_store, db)
    return db


def test_a_run_killed_while_mlflow_makes_the_store_leaves_no_half_made_store(tmp_path):
    # the first run with logger=[mlflow] makes outputs/mlflow.db, and is SIGKILLed in MLflow's migrations
    _killed(tmp_path, "expkit.train", "logger=[mlflow]", f"hydra.run.dir={tmp_path / 'killed'}", "trainer.max_epochs=1")
    assert not (tmp_path / "outputs" / "mlflow.db").exists()  # only the partial file beside it, never half a store
    work = tmp_path / "next"
    proc = run_cli("logger=[mlflow]", f"hydra.run.dir={work}", "trainer.max_epochs=1", cwd=tmp_path)
    assert proc.returncode == 0, proc.output[-3000:]
    assert "Logging backend" not in proc.output, proc.output[-3000:]  # was: "... _alembic_tmp_datasets already exists"
    (run,) = _client(tmp_path).search_runs([_client(tmp_path).get_experiment_by_name("expkit").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_id == (work / "mlflow" / "run_id").read_text().strip()


def test_a_half_made_store_that_holds_nothing_fails_the_run_with_its_repair(tmp_path, half_made_store):
    db = _half_made_copy(half_made_store, tmp_path)
    work = tmp_path / "refused"
    proc = run_cli("logger=[mlflow]", f"hydra.run.dir={work}", "trainer.max_epochs=1", cwd=tmp_path)
    assert proc.returncode == 2, proc.output[-3000:]  # before training, not a warning and a run that logs nothing
    message = proc.stderr
    assert f"the MLflow store {db.resolve()} is half made" in message and "_alembic_tmp_datasets" in message
    assert "It holds no runs, experiments or models, so nothing is lost by deleting it" in message
    assert not (work / "metrics.jsonl").exists()
    assert json.loads((work / "result.json").read_text())["status"] == "failed"
    assert f"rm {db.resolve()}" in message
    db.unlink()  # the repair the message gives
    proc = run_cli("logger=[mlflow]", f"hydra.run.dir={tmp_path / 'repaired'}", "trainer.max_epochs=1", cwd=tmp_path)
    assert proc.returncode == 0 and "Logging backend" not in proc.output, proc.output[-3000:]
    assert len(_client(tmp_path).search_runs([_client(tmp_path).get_experiment_by_name("expkit").experiment_id])) == 1


def test_a_half_made_store_that_holds_runs_is_kept_and_its_repair_keeps_them(tmp_path, half_made_store):
    db = _half_made_copy(half_made_store, tmp_path)
    with (
        contextlib.closing(sqlite3.connect(db)) as conn,
        conn,
    ):  # a run of an older MLflow, whose upgrade was killed (the same leftovers)
        conn.execute("INSERT INTO experiments (experiment_id, name, lifecycle_stage) VALUES (1, 'older', 'active')")
        conn.execute(
            "INSERT INTO runs (run_uuid, name, source_type, user_id, status, start_time, lifecycle_stage, "
            "artifact_uri, experiment_id) VALUES ('0123456789abcdef0123456789abcdef', 'kept', 'LOCAL', "
            "'someone', 'FINISHED', 1, 'active', '', 1)"
        )
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    proc = run_cli("logger=[mlflow]", f"hydra.run.dir={tmp_path / 'refused'}", "trainer.max_epochs=1", cwd=tmp_path)
    assert proc.returncode == 2, proc.output[-3000:]
    assert "It holds 1 run(s): keep it, and back it up first" in proc.stderr and f"rm {db.resolve()}" not in proc.stderr
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before  # untouched
    sql = re.search(r"sqlite3 \S+ '([^']+)'", proc.stderr)
    assert sql is not None and sql[1] == "DROP TABLE _alembic_tmp_datasets;", proc.stderr
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:  # the repair the message gives (`sqlite3 DB 'SQL'`)
        conn.executescript(sql[1])
    proc = run_cli("logger=[mlflow]", f"hydra.run.dir={tmp_path / 'repaired'}", "trainer.max_epochs=1", cwd=tmp_path)
    assert proc.returncode == 0 and "Logging backend" not in proc.output, proc.output[-3000:]
    client = _client(tmp_path)
    assert client.get_run("0123456789abcdef0123456789abcdef").info.run_name == "kept"
    assert len(client.search_runs([client.get_experiment_by_name("expkit").experiment_id])) == 1


def test_a_resume_does_not_make_a_store_where_a_crafted_record_points(tmp_path):
    """<work dir>/mlflow/tracking_uri is data: a resume uses the store it names only if that store
    exists (the one the run made), never creating a database (or its dir) elsewhere."""
    work = tmp_path / "run"
    proc = run_cli("logger=[mlflow]", f"hydra.run.dir={work}", "trainer.max_epochs=1", cwd=tmp_path)
    assert proc.returncode == 0, proc.output
    elsewhere = tmp_path / "elsewhere" / "made.db"
    (work / "mlflow" / "tracking_uri").write_text(f"sqlite:///{elsewhere}")
    proc = run_cli("logger=[mlflow]", f"hydra.run.dir={work}", "trainer.max_epochs=2", "resume=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.output
    assert not elsewhere.parent.exists()
    assert "no such MLflow store" in proc.output
