"""logger=[mlflow]: real MLflow runs in a local SQLite store, read back with MlflowClient, a sweep
grouped in one experiment, and `mlflow server` answering a REST query about them."""

from __future__ import annotations

import json
import os
import socket
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


def test_a_sweep_is_one_experiment_and_mlflow_server_answers_for_it(tmp_path):
    proc = run_cli("-m", "logger=[mlflow]", "hydra.sweep.dir=outputs/sweeps/lr", "trainer.max_epochs=1",
                   "optim.lr=0.1,0.05", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.output[-3000:]
    client = _client(tmp_path)
    experiment = client.get_experiment_by_name("expkit/lr")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.params["optim.lr"] for r in runs) == ["0.05", "0.1"]
    assert all(r.info.status == "FINISHED" and r.data.tags["sweep"] == "lr" for r in runs)

    with socket.socket() as s:  # a free port on localhost
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--backend-store-uri", f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}", "--workers", "1"],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # fmt: skip
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
        query = json.dumps({"experiment_ids": [experiment.experiment_id], "max_results": 10}).encode()
        request = urllib.request.Request(f"{url}/api/2.0/mlflow/runs/search", data=query,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            found = json.loads(response.read())["runs"]
        assert sorted(r["info"]["run_id"] for r in found) == sorted(r.info.run_id for r in runs)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def test_a_failing_mlflow_store_warns_once_and_the_run_goes_on(tmp_path):
    proc = run_cli("logger=[mlflow]", "logger.mlflow.tracking_uri=unknownscheme://nowhere", f"hydra.run.dir={tmp_path / 'r'}",
                   "trainer.max_epochs=1", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.output[-3000:]
    assert proc.output.count("Logging backend mlflow failed") == 1
    assert json.loads((tmp_path / "r" / "result.json").read_text())["status"] == "completed"
