"""python -m expkit.export: safetensors read back, ONNX run in onnxruntime, torch.export loaded
and run, each with a dynamic batch, against the model load_model builds from the checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, run_cli

from expkit.eval import load_model

pytestmark = pytest.mark.slow


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "expkit.export", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
        timeout=300,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("trained") / "run"
    proc = run_cli(f"hydra.run.dir={work}", "trainer.max_epochs=2", "hooks=[ema]")
    assert proc.returncode == 0, proc.output
    return work


def test_safetensors_hold_the_checkpoint_weights_and_the_ema_ones(run_dir, tmp_path):
    from safetensors.torch import load_file

    from expkit.checkpoint.checkpoint_io import load_checkpoint

    for ema in ("false", "true"):
        out = tmp_path / f"ema_{ema}.safetensors"
        proc = _export(
            f"checkpoint={run_dir}", "format=safetensors", f"ema={ema}", f"out={out}", f"hydra.run.dir={tmp_path / ema}"
        )
        assert proc.returncode == 0, proc.stderr
        info = json.loads(out.with_name(out.name + ".json").read_text())
        checkpoint = load_checkpoint(Path(info["checkpoint"]), "test")
        expected = dict(checkpoint["state_dict"]) | (checkpoint["ema_state_dict"] if ema == "true" else {})
        weights = load_file(str(out))
        assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)
        assert (
            info["checkpoint_sha256"] == __import__("hashlib").sha256(Path(info["checkpoint"]).read_bytes()).hexdigest()
        )
    assert not torch.equal(
        load_file(str(tmp_path / "ema_true.safetensors"))["net.1.weight"],
        load_file(str(tmp_path / "ema_false.safetensors"))["net.1.weight"],
    )


def test_onnx_runs_in_onnxruntime_with_any_batch_and_matches_torch(run_dir, tmp_path):
    import onnxruntime

    proc = _export(f"checkpoint={run_dir}", "format=onnx", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / "model.onnx.json").read_text())
    assert info["input_shape"] == ["batch", 1, 8, 8] and info["num_classes"] == 10 and info["format"] == "onnx"
    model = load_model(run_dir)
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"))
    assert [i.name for i in session.get_inputs()] == ["input"] and [o.name for o in session.get_outputs()] == ["logits"]
    assert session.get_inputs()[0].shape[0] == "batch"
    assert "No unused functions" not in proc.stderr + proc.stdout and "[torch.onnx]" not in proc.stdout
    name = session.get_inputs()[0].name
    for batch in (1, 3, 17):
        x = torch.randn(batch, 1, 8, 8, generator=torch.Generator().manual_seed(batch))
        (y,) = session.run(None, {name: x.numpy()})
        assert y.shape == (batch, 10)
        assert np.abs(y - model(x).detach().numpy()).max() < 1e-4


def test_onnx_sidecar_records_the_preprocessing_so_raw_digits_give_the_models_classes(run_dir, tmp_path):
    """The digits' 0-16 pixel counts are divided by 16 before the model sees them: an ONNX user
    who fed raw pixels got silently other outputs. The sidecar JSON records the scaling the data
    module applies, the input shape and dtype, the class names and the training inputs' range."""
    import onnxruntime
    import sklearn

    proc = _export(f"checkpoint={run_dir}", "format=onnx", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / "model.onnx.json").read_text())
    steps = info["preprocessing"]
    assert (steps["mean"], steps["std"], steps["formula"]) == (0.0, 16.0, "(raw - mean) / std")
    assert "0-16" in steps["raw"] and info["input_dtype"] == "float32"
    assert info["class_names"] == [str(d) for d in range(10)] and info["input_range"] == [0.0, 1.0]
    table = np.loadtxt(
        Path(sklearn.__file__).parent / "datasets" / "data" / "digits.csv.gz", delimiter=",", dtype=np.float32
    )
    pixels = table[-50:, :-1]  # as scikit-learn holds them: 64 counts 0-16 per digit
    x = ((pixels - steps["mean"]) / steps["std"]).reshape(-1, *info["input_shape"][1:]).astype(info["input_dtype"])
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"))
    (y,) = session.run(None, {"input": x})
    with torch.no_grad():
        expected = load_model(run_dir)(torch.from_numpy(pixels).reshape(-1, 1, 8, 8) / 16).numpy()
    assert np.abs(y - expected).max() < 1e-4


def test_torch_export_program_loads_and_runs_with_any_batch(run_dir, tmp_path):
    proc = _export(f"checkpoint={run_dir}", "format=torch_export", "which=last", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    program = torch.export.load(str(tmp_path / "model.pt2"))
    model = load_model(run_dir, which="last")
    for batch in (2, 9):
        x = torch.randn(batch, 1, 8, 8)
        assert torch.allclose(program.module()(x), model(x), atol=1e-6)
    assert json.loads((tmp_path / "model.pt2.json").read_text())["checkpoint"].endswith("epoch_2.pth")


def test_export_is_a_hydra_app_and_bad_input_exits_2(run_dir, tmp_path):
    assert "format=safetensors|onnx|torch_export" in _export("--help").stdout
    assert "format: safetensors" in _export(f"checkpoint={run_dir}", "--cfg", "job").stdout
    for args, named in (
        (["format=tflite"], "format=tflite: use format=safetensors"),
        ([], "checkpoint"),
        (["checkpoint=/nonexistent"], "checkpoint=/nonexistent: no such file or run dir"),
        (["format=safetensors", f"out={tmp_path}"], "is a directory; give a file name in it"),
        (["format=safetensors", f"out={tmp_path / 'f' / 'm.st'}"], "is a file, not a directory"),
        (["format=onnx", "opset=abc"], "opset='abc': give an ONNX opset version"),
        (["format=hf"], "format=hf: the checkpoint's model is a MLP, not a Hugging Face model"),
        (["format=hf", f"out={tmp_path / 'f'}"], "is a file; give a directory to create"),
    ):
        (tmp_path / "f").write_text("")
        if args and args[0].startswith("format"):
            args = [f"checkpoint={run_dir}", *args]
        proc = _export(*args, f"hydra.run.dir={tmp_path / 'bad'}")
        assert proc.returncode == 2, proc.stderr
        assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_model_that_cannot_take_its_datas_inputs_is_refused_in_one_line(tmp_path):
    """The GAN's generator takes latent codes, its data yields images: refused before tracing, in one
    line (traced, torch's fake-tensor log and a traceback of about 300 lines came out)."""
    work = tmp_path / "gan"
    trained = run_cli(f"hydra.run.dir={work}", "experiment=gan", "trainer.max_epochs=1")
    assert trained.returncode == 0, trained.output
    for fmt in ("onnx", "torch_export"):
        proc = _export(f"checkpoint={work}", f"format={fmt}", f"hydra.run.dir={tmp_path / fmt}")
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert f"format={fmt}: the model cannot take a batch of its data's inputs" in proc.stderr, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) < 5, proc.stderr[-3000:]
        assert not list((tmp_path / fmt).glob("model.*"))
