"""python -m expkit.predict: new inputs (a folder of images, .npy, .pt, CSV rows) through the
transform the run trained with; classes with top-k probabilities, or values in the data's units."""

from __future__ import annotations

import csv
import json
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


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: None, "input=missing.npy: no such file or folder"),
        (
            lambda d: np.save(d / "bad.npy", np.zeros((3, 5, 5), dtype=np.float32)),
            "input=bad.npy: inputs of shape (5, 5), but the model takes (1, 8, 8)",
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
