"""python -m expkit.predict: new inputs (a folder of images, .npy, .pt, CSV rows) through the
transform the run trained with; classes with top-k probabilities, or values in the data's units."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli

pytestmark = pytest.mark.slow


def _predict(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "expkit.predict", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def _export_onnx(run: Path, out: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "expkit.export", f"checkpoint={run}", "format=onnx", f"out={out}"],
        cwd=out.parent,
        capture_output=True,
        text=True,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("digits") / "run"
    proc = run_cli(f"hydra.run.dir={work}", "trainer.max_epochs=3", "default_hooks.logger.plot=false")
    assert proc.returncode == 0, proc.output[-2000:]
    return work


def _sklearn_digits(n: int) -> tuple[np.ndarray, np.ndarray]:
    import sklearn

    table = np.loadtxt(
        Path(sklearn.__file__).parent / "datasets" / "data" / "digits.csv.gz", delimiter=",", dtype=np.float32
    )
    return table[:n, :-1], table[:n, -1].astype(int)


def test_predict_digits_from_npy_and_pt_gives_the_models_classes_and_top_k(digits_run, tmp_path):
    from expkit.eval import load_model

    pixels, labels = _sklearn_digits(40)  # scikit-learn's own units: 64 pixel counts 0-16
    np.save(tmp_path / "digits.npy", pixels)
    proc = _predict(tmp_path, f"checkpoint={digits_run}", "input=digits.npy", "output=out.csv", "top_k=3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "out.csv").open()))
    assert list(rows[0]) == ["input", "prediction", "class1", "p1", "class2", "p2", "class3", "p3"]
    model = load_model(digits_run)
    with torch.no_grad():
        expected = model(torch.from_numpy(pixels).reshape(-1, 1, 8, 8) / 16).softmax(1)
    for i, row in enumerate(rows):
        assert row["input"] == str(i) and row["prediction"] == row["class1"] == str(int(expected[i].argmax()))
        assert float(row["p1"]) == pytest.approx(float(expected[i].max()), abs=1e-5)
        assert float(row["p1"]) >= float(row["p2"]) >= float(row["p3"])
    accuracy = np.mean([int(r["prediction"]) == y for r, y in zip(rows, labels)])
    assert accuracy > 0.7  # trained: it reads the digits, not noise

    torch.save(torch.from_numpy(pixels[:5]).reshape(5, 8, 8), tmp_path / "digits.pt")
    proc = _predict(tmp_path, f"checkpoint={digits_run}", "input=digits.pt", "output=out.jsonl")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["prediction"] for r in lines] == [r["prediction"] for r in rows[:5]] and len(lines[0]["top_k"]) == 5


def test_predict_a_folder_of_images_at_any_depth(digits_run, tmp_path):
    from PIL import Image
    from torchvision.transforms.functional import to_tensor

    from expkit.eval import load_model

    pixels, _ = _sklearn_digits(4)
    files = []
    for i, image in enumerate(pixels):
        folder = tmp_path / "images" / ("a" if i < 2 else "b/c")
        folder.mkdir(parents=True, exist_ok=True)
        files.append(folder / f"{i}.png")
        Image.fromarray((image.reshape(8, 8) * 255 / 16).astype(np.uint8)).convert("RGB").save(files[-1])
    (tmp_path / "images" / "notes.txt").write_text("not an image")
    proc = _predict(tmp_path, f"checkpoint={digits_run}", "input=images", "output=out.jsonl", "which=last")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["input"] for r in rows] == [str(f.relative_to(tmp_path)) for f in sorted(files)]
    model = load_model(digits_run, which="last")
    with torch.no_grad():  # the image as the data module reads one: grey, 8x8, [0, 1]
        expected = [str(int(model(to_tensor(Image.open(f).convert("L"))[None]).argmax())) for f in sorted(files)]
    assert [r["prediction"] for r in rows] == expected


def test_predict_from_an_exported_onnx_model_applies_the_preprocessing_its_sidecar_records(digits_run, tmp_path):
    """checkpoint=model.onnx runs the export in onnxruntime: raw digits (0-16 counts), a folder of
    images and preprocessed inputs give what the checkpoint gives, and the log names the
    preprocessing that ran. Without the sidecar's numbers it refuses raw inputs."""
    from PIL import Image

    _export_onnx(digits_run, tmp_path / "model.onnx")
    pixels, labels = _sklearn_digits(60)
    np.save(tmp_path / "raw.npy", pixels)
    np.save(tmp_path / "scaled.npy", pixels / 16)
    (tmp_path / "images").mkdir()
    for i, image in enumerate(pixels[:4]):
        Image.fromarray((image.reshape(8, 8) * 255 / 16).astype(np.uint8)).save(tmp_path / "images" / f"{i}.png")
    rows = {}
    for checkpoint, name, extra in (
        (digits_run, "raw.npy", []),
        ("model.onnx", "raw.npy", []),
        ("model.onnx", "scaled.npy", ["preprocessed=true"]),
        (digits_run, "images", []),
        ("model.onnx", "images", []),
    ):
        out = f"{Path(checkpoint).name}-{name}.csv"
        proc = _predict(tmp_path, f"checkpoint={checkpoint}", f"input={name}", f"output={out}", *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows[(checkpoint, name, *extra)] = list(csv.DictReader((tmp_path / out).open()))
        if checkpoint == "model.onnx" and not extra:
            said = "model.onnx.json's preprocessing (mean 0, std 16: (raw - mean) / std)"
            assert name == "images" or said in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    for onnx, checkpoint in (
        (rows["model.onnx", "raw.npy"], rows[digits_run, "raw.npy"]),
        (rows["model.onnx", "scaled.npy", "preprocessed=true"], rows[digits_run, "raw.npy"]),
        (rows["model.onnx", "images"], rows[digits_run, "images"]),
    ):
        assert [r["prediction"] for r in onnx] == [r["prediction"] for r in checkpoint]
        assert [float(r["p1"]) for r in onnx] == pytest.approx([float(r["p1"]) for r in checkpoint], abs=1e-5)
    assert np.mean([int(r["prediction"]) for r in rows["model.onnx", "raw.npy"]] == labels) > 0.7

    proc = _predict(tmp_path, "checkpoint=model.onnx", "input=scaled.npy", "output=refused.csv")
    assert proc.returncode == 2 and "they look already preprocessed" in proc.stderr, proc.stderr
    assert "model.onnx.json's preprocessing" in proc.stderr and not (tmp_path / "refused.csv").exists()
    sidecar = tmp_path / "model.onnx.json"
    info = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({k: v for k, v in info.items() if k != "preprocessing"}))  # an older export
    proc = _predict(tmp_path, "checkpoint=model.onnx", "input=raw.npy", "output=refused.csv")
    assert proc.returncode == 2 and "model.onnx.json records no preprocessing" in proc.stderr, proc.stderr
    assert "preprocessed=true" in proc.stderr and "Traceback" not in proc.stderr
    sidecar.unlink()
    proc = _predict(tmp_path, "checkpoint=model.onnx", "input=raw.npy", "output=refused.csv")
    assert proc.returncode == 2 and "model.onnx.json, which says what the model takes" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "refused.csv").exists()


def test_predict_a_regressor_from_csv_rows_in_the_targets_units(tmp_path):
    from expkit.eval import load_model
    from expkit.tasks.regression import DiabetesData, load_diabetes

    work = tmp_path / "run"
    proc = run_cli(
        f"hydra.run.dir={work}", "experiment=regression", "trainer.max_epochs=10", "default_hooks.logger.plot=false"
    )
    assert proc.returncode == 0, proc.output[-2000:]
    x, y = load_diabetes()
    with (tmp_path / "patients.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"])
        writer.writerows(x[:20].tolist())
    proc = _predict(tmp_path, f"checkpoint={work}", "input=patients.csv", "output=out.csv")
    assert proc.returncode == 0, proc.stderr[-2000:]
    values = [float(r["value"]) for r in csv.DictReader((tmp_path / "out.csv").open())]
    data = DiabetesData()
    data.datasets()
    with torch.no_grad():
        out = load_model(work)((x[:20] - data.feature_mean) / data.feature_std).reshape(-1)
    assert values == pytest.approx((out * data.target_std + data.target_mean).tolist(), rel=1e-5)
    assert np.corrcoef(values, y[:20].numpy())[0, 1] > 0.3  # in the target's units, and it learned something

    # the export records the features' standardisation and the target's: the same values from ONNX
    _export_onnx(work, tmp_path / "model.onnx")
    info = json.loads((tmp_path / "model.onnx.json").read_text())
    assert info["preprocessing"]["mean"] == pytest.approx(data.feature_mean.tolist())
    assert info["postprocessing"]["std"] == pytest.approx(data.target_std)
    proc = _predict(tmp_path, "checkpoint=model.onnx", "input=patients.csv", "output=onnx.csv")
    assert proc.returncode == 0, proc.stderr[-2000:]
    onnx_values = [float(r["value"]) for r in csv.DictReader((tmp_path / "onnx.csv").open())]
    assert onnx_values == pytest.approx(values, rel=1e-4)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: None, "input=missing.npy: no such file or folder"),
        (
            lambda d: np.save(d / "bad.npy", np.zeros((3, 5, 5), dtype=np.float32)),
            "input=bad.npy: inputs of shape (5, 5), but the model takes (1, 8, 8)",
        ),
        (
            lambda d: np.save(d / "bad.npy", np.zeros(5, dtype=np.float32)),
            (
                "input=bad.npy: inputs of shape (), but the model takes (1, 8, 8) (as its data, DigitsData, gives "
                "them); a 1-D array is read as one number per input: give one row per input"
            ),
        ),
        (lambda d: (d / "bad.csv").write_text("1,2\n3,x\n"), "input=bad.csv: row 2 is not all numbers"),
        (
            lambda d: (d / "broken").mkdir() or (d / "broken" / "x.png").write_bytes(b"not a png"),
            "input: broken/x.png is not a readable image",
        ),
    ],
)
def test_bad_input_is_a_clear_error_naming_it(digits_run, tmp_path, make, message):
    make(tmp_path)
    name = {"input=missing.npy": "missing.npy", "input=bad.npy": "bad.npy", "input=bad.csv": "bad.csv"}
    source = next((v for k, v in name.items() if message.startswith(k)), "broken")
    proc = _predict(tmp_path, f"checkpoint={digits_run}", f"input={source}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("device=gpu", "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        ("batch_size=0", "batch_size must be a positive integer, got 0"),
        ("batch_size=-1", "batch_size must be a positive integer, got -1"),
        ("batch_size=abc", "batch_size must be a positive integer, got 'abc'"),
    ],
)
def test_bad_settings_name_their_key_not_the_input(digits_run, tmp_path, setting, message):
    """device=gpu and batch_size=-1 ended in torch's traceback; batch_size=0 blamed the input."""
    np.save(tmp_path / "x.npy", np.zeros((3, 1, 8, 8), dtype=np.float32))
    proc = _predict(tmp_path, f"checkpoint={digits_run}", "input=x.npy", setting)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"Error: {message}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            torch.tensor([[0, 255]], dtype=torch.uint8),
            torch.tensor([[0.0, 1.0]]),
        ),  # 8-bit images: as ToTensor scales them
        (torch.tensor([[3, 7]]), torch.tensor([[3, 7]])),  # token ids stay integers
        (torch.tensor([[0.5, 2.0]], dtype=torch.float64), torch.tensor([[0.5, 2.0]])),
    ],
)
def test_the_default_input_transform_scales_bytes_and_keeps_integers(raw, expected):
    from expkit.data import DataModule

    out = DataModule().predict_input(raw)
    assert out.dtype == expected.dtype and torch.equal(out, expected)


def test_the_range_refusal_names_the_whole_first_sentence_of_the_transform():
    """A predict_input doc whose first sentence wraps (DiabetesData's) is named whole: no
    parenthesis left open, no reST markup."""
    from expkit.core.errors import ConfigError
    from expkit.data import DataModule, DigitsData
    from expkit.predict import check_range
    from expkit.tasks.regression import DiabetesData

    for data, named in (
        (DiabetesData(), "(Rows of the 10 raw features (age, sex, bmi, bp, s1-s6, as scikit-learn's scaled=False), "),
        (DigitsData(), "(Digits as scikit-learn holds them: 64 pixel counts 0-16 per image (N x 64 or N x 8 x 8))"),
        (DataModule(), "in the dataset's own units) -> what the model takes)"),
    ):
        with pytest.raises(ConfigError) as refused:
            check_range(torch.tensor([[500.0, 900.0]]), (0.0, 1.0), data, "x.csv")
        said = str(refused.value).split(" the inputs span")[0]
        assert named in said and said.count("(") == said.count(")") and "``" not in said, said


def test_a_data_module_states_as_numbers_what_its_predict_input_does():
    from expkit.data import DataModule, DigitsData, preprocess
    from expkit.tasks.regression import DiabetesData

    diabetes = DiabetesData()
    diabetes.datasets()
    for data, raw, shape in (
        (DataModule(), torch.tensor([[0, 128, 255]], dtype=torch.uint8), None),
        (DataModule(), torch.tensor([[3, 7]]), None),
        (DigitsData(), torch.arange(128.0).reshape(2, 64) % 17, (1, 8, 8)),
        (diabetes, torch.randn(4, 10) * 50 + 100, None),
    ):
        assert torch.equal(preprocess(raw, data.preprocessing(), shape), data.predict_input(raw))
    assert diabetes.predict_output(torch.tensor([0.0, 1.0])).tolist() == pytest.approx(
        [diabetes.target_mean, diabetes.target_mean + diabetes.target_std]
    )

    class OwnTransform(DataModule):
        def predict_input(self, raw: torch.Tensor) -> torch.Tensor:
            return raw.float().log1p()

    class Stated(DataModule):
        def preprocessing(self) -> dict:
            return {"mean": 1.0, "std": 2.0}

    # numbers that would not be what predict_input does are not stated; stated ones are applied
    assert OwnTransform().preprocessing() is None
    assert Stated().predict_input(torch.tensor([[3.0, 5.0]])).tolist() == [[1.0, 2.0]]


def test_inputs_preprocessed_already_are_refused_unless_declared(digits_run, tmp_path):
    """Digits scaled to [0, 1] (as the model takes them) were divided by 16 again and predicted
    at about 20% accuracy, exit 0. They are refused, naming both ranges and the option;
    preprocessed=true takes them as they are, and predicts as raw inputs do."""
    pixels, labels = _sklearn_digits(100)
    np.save(tmp_path / "raw.npy", pixels)
    np.save(tmp_path / "scaled.npy", pixels / 16)
    np.save(tmp_path / "bytes.npy", pixels * 16)  # 0-255, other units
    for name, looks in (("scaled", "already preprocessed"), ("bytes", "in other units")):
        proc = _predict(tmp_path, f"checkpoint={digits_run}", f"input={name}.npy", "output=out.csv")
        assert proc.returncode == 2, proc.stderr
        assert f"they look {looks}" in proc.stderr and "preprocessed=true" in proc.stderr, proc.stderr
        assert "trained on [0, 1]" in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "out.csv").exists()
    predictions = {}
    for name, extra in (("raw", []), ("scaled", ["preprocessed=true"])):
        proc = _predict(tmp_path, f"checkpoint={digits_run}", f"input={name}.npy", f"output={name}.csv", *extra)
        assert proc.returncode == 0, proc.stderr
        predictions[name] = [int(r["prediction"]) for r in csv.DictReader((tmp_path / f"{name}.csv").open())]
    assert predictions["raw"] == predictions["scaled"]
    assert np.mean(np.array(predictions["raw"]) == labels) > 0.7


def test_an_output_that_cannot_be_written_is_refused_before_predicting(digits_run, tmp_path):
    np.save(tmp_path / "raw.npy", _sklearn_digits(5)[0])
    (tmp_path / "a_file").write_text("")
    for output, named in (("a_file/out.csv", "is a file, not a directory"), (".", "output=.: use a .csv")):
        proc = _predict(tmp_path, f"checkpoint={digits_run}", "input=raw.npy", f"output={output}")
        assert proc.returncode == 2, proc.stderr
        assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
