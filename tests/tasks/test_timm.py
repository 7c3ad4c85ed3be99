"""model=timm: any timm model built for the data (classes, channels) without downloading;
pretrained weights only from local files; and the start-up guard that refuses a classifier
whose head does not match the data's classes (what a timm model with its default 1000-class
head on the 10 digits would otherwise train silently)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import run_cli

timm = pytest.importorskip("timm")

from expkit.core.errors import ConfigError
from expkit.models import timm_model


@pytest.mark.slow
def test_timm_digits_trains_and_evaluates(tmp_path):
    work = tmp_path / "run"
    proc = run_cli(f"hydra.run.dir={work}", "experiment=timm_digits", "trainer.max_epochs=4")
    assert proc.returncode == 0, proc.output[-3000:]
    result = json.loads((work / "result.json").read_text())
    assert result["status"] == "completed" and result["final_metrics"]["val/acc"] > 0.9
    assert "Model ResNet" in proc.output  # timm's ResNet class, 10 classes on 1 channel
    evaluated = subprocess.run(
        [sys.executable, "-m", "expkit.eval", f"checkpoint={work}", "which=best", f"work_dir={tmp_path / 'eval'}"],
        capture_output=True,
        text=True,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    got = json.loads((tmp_path / "eval" / "result.json").read_text())["final_metrics"]
    assert got["test/acc"] == result["final_metrics"]["test/acc"]


def test_the_model_takes_the_datas_classes_and_channels():
    model = timm_model("test_resnet", num_classes=10, in_channels=1)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert model.num_classes == 10


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["model=timm", "model.name=resnet_18"], "model.name='resnet_18' is not a timm model; close matches: resnet18"),
        (
            ["model=timm", "model.name=resnet18", "model.pretrained=true"],
            "model.pretrained=true: no local weights for timm model 'resnet18' (looked in the Hugging Face cache",
        ),
        (
            ["model=timm", "model.pretrained=true", "model.weights=/nonexistent/model.safetensors"],
            "model.weights=/nonexistent/model.safetensors: no such file",
        ),
        (["model=timm", "model.weights=/nonexistent/model.safetensors"], "add model.pretrained=true"),
        # timm's own factory with its default head: 1000 classes on the 10 digits
        (
            [
                "model=cnn",
                "model._target_=timm.create_model",
                "+model.model_name=test_resnet",
                "+model.in_chans=1",
                "~model.channels",
            ],
            "the model outputs 1000 classes (logits of shape [1000] a sample) but the data has 10: set model.num_classes=10",
        ),
    ],
    ids=["unknown name", "no local weights", "missing weights file", "weights without pretrained", "1000-class head"],
)
def test_what_cannot_be_built_here_exits_2_before_training(tmp_path, overrides, says):
    proc = run_cli(f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_epochs=1", *overrides)
    assert proc.returncode == 2, proc.output[-3000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def _pretrained_file(path) -> dict[str, torch.Tensor]:
    """test_resnet's weights in the form timm publishes them (1000 classes, 3 channels), saved
    locally; shifted by 1, so that no fresh initialisation can equal them."""
    from safetensors.torch import save_file

    model = timm.create_model("test_resnet", pretrained=False)
    weights = {k: (v + 1 if v.is_floating_point() else v).contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(path))
    return weights


def test_pretrained_weights_from_a_local_file_are_adapted_to_the_data(tmp_path):
    weights = _pretrained_file(tmp_path / "model.safetensors")
    model = timm_model(
        "test_resnet", num_classes=10, in_channels=1, pretrained=True, weights=str(tmp_path / "model.safetensors")
    )
    state = model.state_dict()
    inner = [k for k in weights if k.startswith("layer") and k.endswith("conv1.weight")]
    assert inner and all(torch.equal(state[k], weights[k]) for k in inner)  # the body: the file's weights
    assert state["fc.weight"].shape == (10, weights["fc.weight"].shape[1])  # a new 10-class head
    assert state["conv1.0.weight"].shape[1] == 1  # the stem folded to one channel


def test_pretrained_weights_come_from_the_hugging_face_cache_timm_downloaded_to(tmp_path):
    """The layout huggingface_hub leaves after a download: models--<org>--<name>/refs/main names a
    snapshot holding the file. Found there, nothing is fetched (there is no network here)."""
    weights = _pretrained_file(tmp_path / "w.safetensors")
    repo = tmp_path / "hub" / "models--timm--test_resnet.r160_in1k"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (tmp_path / "w.safetensors").rename(repo / "snapshots" / ("0" * 40) / "model.safetensors")
    code = (
        "import torch; from expkit.models import timm_model; "
        "m = timm_model('test_resnet', num_classes=10, in_channels=3, pretrained=True); "
        "torch.save(m.state_dict(), 'loaded.pth')"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = torch.load(tmp_path / "loaded.pth", weights_only=True)
    assert torch.equal(loaded["conv1.0.weight"], weights["conv1.0.weight"])


def test_a_model_name_timm_does_not_know_is_a_config_error_with_close_matches():
    with pytest.raises(ConfigError, match="close matches: test_resnet"):
        timm_model("test_resnett", num_classes=10, in_channels=1)
