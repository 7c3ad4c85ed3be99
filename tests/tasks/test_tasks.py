"""The shipped tasks beyond image classification train, improve their metric and pick the right best."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import REPO, sweep_train
from hydra import compose, initialize_config_dir

from expkit.config.build import build_runner
from expkit.config.cli import CONF_DIR
from expkit.core.hydra_compat import INIT_KWARGS
from expkit.eval import load_model
from expkit.metrics import better

pytest.importorskip("torchmetrics")


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), **INIT_KWARGS):
        return compose(config_name="train", overrides=list(overrides))


def _validations(work, key: str) -> list[float]:
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if key in r]


@pytest.mark.parametrize(
    ("experiment", "monitor", "rule", "shrink"),
    [
        ("regression", "val/mse", "less", ["trainer.max_epochs=8"]),
        ("segmentation", "val/iou", "greater", ["trainer.max_epochs=3", "data.num_train=500"]),
        (
            "char_lm",
            "val/perplexity",
            "less",
            ["trainer.max_epochs=2", "data.max_chars=120000", "model.hidden_size=128"],
        ),
    ],
)
def test_a_shipped_task_trains_and_its_monitored_metric_improves(tmp_path, experiment, monitor, rule, shrink):
    result = build_runner(_compose(f"experiment={experiment}", *shrink), tmp_path).run()
    assert result["status"] == "completed"
    assert (result["monitor"], result["monitor_rule"]) == (monitor, rule)
    best = result["best_metrics"][monitor]
    assert best["rule"] == rule
    values = _validations(tmp_path, monitor)
    assert best["value"] == (min(values) if rule == "less" else max(values))  # picked by its own direction
    assert better(best["value"], values[0], rule)  # it learned something after the first validation
    assert result["best_checkpoint"].endswith(f"best_{monitor.replace('/', '_')}_epoch_{best['epoch']}.pth")
    assert all(type(v) is float for v in result["final_metrics"].values())


def test_regression_reaches_a_useful_r2_and_loads_back(tmp_path):
    result = build_runner(_compose("experiment=regression"), tmp_path).run()
    assert result["final_metrics"]["val/r2"] > 0.35  # a linear model gets about 0.49 on this split
    assert result["best_metrics"]["val/r2"]["rule"] == "greater"  # the metric's own direction
    assert "val/acc" not in result["final_metrics"]  # metrics.acc: null drops the default accuracy
    model = load_model(tmp_path)  # the stored config names expkit.tasks and torchmetrics targets: trusted
    assert type(model).__name__ == "RegressionMLP"


def test_char_lm_writes_samples_and_a_loaded_model_generates(tmp_path):
    overrides = [
        "experiment=char_lm",
        "trainer.max_epochs=1",
        "data.max_chars=60000",
        "model.hidden_size=64",
        "hooks.text_sample.length=40",
    ]
    result = build_runner(_compose(*overrides), tmp_path).run()
    assert result["final_metrics"]["val/perplexity"] < 30  # uniform over ~90 characters would be ~90
    samples = (tmp_path / "samples.txt").read_text()
    assert samples.count("--- sample") == 3 and "The " in samples
    model = load_model(tmp_path)
    assert isinstance(model.generate("The ", 20), str)


def test_a_model_config_reads_what_the_data_describes(tmp_path):
    cfg = _compose("experiment=regression", "trainer.max_epochs=1", "model.hidden=[${data_info:num_features}]")
    runner = build_runner(cfg, tmp_path)
    assert runner.model.net[0].out_features == 10  # the diabetes data has 10 features
    assert runner.config["model"]["hidden"] == [10]  # stored resolved: the checkpoint needs no resolver


@pytest.mark.slow
def test_a_regression_sweep_picks_the_lowest_mse(tmp_path):
    proc = subprocess.run(
        sweep_train(
            "experiment=regression", "optim.lr=0.1,0.01,0.001", "monitor=val/mse", f"hydra.sweep.dir={tmp_path}"
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    bests = {
        job: json.loads((tmp_path / job / "result.json").read_text())["best_metrics"]["val/mse"]["value"]
        for job in ("0", "1", "2")
    }
    chosen = json.loads((tmp_path / "best.json").read_text())
    assert chosen["job"] == min(bests, key=bests.get) and chosen["rule"] == "less"
    assert chosen["value"] == pytest.approx(min(bests.values()))
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"{value:.4f}" in summary for value in bests.values())  # each job's best is shown
