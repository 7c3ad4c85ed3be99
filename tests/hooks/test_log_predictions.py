"""hooks=[log_predictions]: validation samples with their predictions in TensorBoard's events
(an image grid for image classifiers, a table otherwise) and in MLflow, read back."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow


def _events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    return events


def test_an_image_grid_of_validation_predictions_is_in_tensorboard_and_mlflow(tmp_path):
    from PIL import Image

    work = tmp_path / "run"
    proc = run_cli(
        f"hydra.run.dir={work}",
        "hooks=[log_predictions]",
        "hooks.log_predictions.num_samples=12",
        "logger=[tensorboard,mlflow,wandb]",
        "logger.wandb.mode=offline",
        "trainer.max_epochs=2",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.output[-3000:]
    assert "LogPredictionsHook:" not in proc.output and "Logging backend" not in proc.output  # no warning
    steps = [r["step"] for r in map(json.loads, (work / "metrics.jsonl").read_text().splitlines()) if "val/acc" in r]
    images = _events(work / "tb").Images("val/predictions")
    assert [image.step for image in images] == steps  # every validation, at its step
    # 12 digits, 8 a row: 2 rows of 64-pixel tiles with a label line under each
    shown = np.asarray(Image.open(io.BytesIO(images[-1].encoded_image_string)).convert("RGB"))
    assert shown.shape == (2 * (64 + 14), 8 * 64, 3)
    saved = np.asarray(Image.open(work / "predictions" / f"step_{steps[-1]}.png").convert("RGB"))
    assert np.array_equal(shown, saved)
    assert (shown[:64, :64] != 255).any()  # a digit drawn, not a blank tile

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("expkit").experiment_id])
    logged = [a.path for a in client.list_artifacts(run.info.run_id, "images")]
    assert len(logged) >= len(steps)  # MLflow's log_image: one image (and its thumbnail files) per step
    media = list((work / "wandb").glob("offline-run-*/files/media/images/val/predictions_*.png"))
    assert len(media) == len(steps)  # wandb's Image, one per validation


def test_a_regressor_gets_a_table_of_targets_and_predictions(tmp_path):
    work = tmp_path / "run"
    proc = run_cli(
        f"hydra.run.dir={work}",
        "experiment=regression",
        "hooks=[log_predictions]",
        "hooks.log_predictions.interval=5",
        "logger=[tensorboard]",
        "trainer.max_epochs=10",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.output[-3000:]
    texts = _events(work / "tb").Tensors("val/predictions/text_summary")
    steps = [r["step"] for r in map(json.loads, (work / "metrics.jsonl").read_text().splitlines()) if "val/mse" in r]
    assert [t.step for t in texts] == steps[4::5]  # every 5th validation
    table = (work / "predictions" / f"step_{steps[-1]}.md").read_text().splitlines()
    assert table[0] == "| sample | target | prediction |" and len(table) == 2 + 16
    assert texts[-1].tensor_proto.string_val[0].decode() == "\n".join(table) + "\n"
