"""The examples run as documented, so they cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

pytestmark = pytest.mark.slow
PROJECT = REPO / "examples" / "my_project"


def test_user_project_experiment_with_its_own_hook_model_and_data(tmp_path):
    proc = run_cli(
        "--config-dir",
        "conf",
        "experiment=my_exp",
        f"hydra.run.dir={tmp_path}",
        "trainer.max_epochs=3",
        cwd=PROJECT,
        env={"PYTHONPATH": str(PROJECT)},
    )
    assert proc.returncode == 0, proc.output
    assert "Hooks: runtime_info, weight_norm, timer," in proc.output  # ABOVE_NORMAL: before the NORMAL timer
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "completed" and result["hooks"] == ["ema", "weight_norm"]
    assert result["final_metrics"]["val/acc"] > 0.8
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum("train/weight_norm" in r for r in records) >= 2  # published by the user's hook, logged
    config = (tmp_path / ".hydra" / "config.yaml").read_text()
    assert "my_project.models.ResidualMLP" in config and "my_project.data.NoisyDigits" in config


def test_user_options_sit_beside_expkits_own(tmp_path):
    proc = run_cli(
        "--config-dir",
        "conf",
        "show_hooks=true",
        "hooks=[ema,weight_norm]",
        "model=residual_mlp",
        f"hydra.run.dir={tmp_path}",
        cwd=PROJECT,
        env={"PYTHONPATH": str(PROJECT)},
    )
    assert proc.returncode == 0, proc.output
    table = proc.stdout
    epoch_stage = table.split("after_train_epoch:")[1].split(":\n")[0]
    assert epoch_stage.index("WeightNormHook") < epoch_stage.index("CheckpointHook")
    bad = run_cli("--config-dir", "conf", "hooks=[weight_nrm]", cwd=PROJECT, env={"PYTHONPATH": str(PROJECT)})
    assert bad.returncode == 2 and "weight_norm" in bad.stderr  # the user's hook is listed among the options


def test_notebook_script(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "notebook.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "batches per epoch: [20, 20" in proc.stdout  # 1,258 training images / 64, rounded up
    assert "(LOW         ) CountBatches [count]" in proc.stdout
    assert json.loads((tmp_path / "result.json").read_text())["status"] in ("completed", "stopped")
