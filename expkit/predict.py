"""``python -m expkit.predict checkpoint=<run dir | .pth | .dcp> input=<path> output=<file>``.

A Hydra app over ``conf/predict.yaml`` (``--help``, ``--cfg job``, ``hydra.run.dir``, ``-m``).
The model is built from the config stored in the checkpoint, through the same trust checks as
``expkit.eval``, with its weights (``ema=true``: the EMA ones; ``which=best|last``). Inputs:

  a folder      its images, at any depth (png, jpg, jpeg, bmp, gif, webp, tif, tiff), in path order
  .npy / .pt    one array of inputs, first dimension the batch
  .csv          feature rows for tabular models (a header line, if any, is skipped)

The run's data module turns them into what the model was trained on (``predict_image``,
``predict_input``: the digits' 0-16 pixel counts are scaled, the diabetes features standardised
with the training statistics). Output, CSV or JSON lines (by the file's suffix), one row per
input: its path or index, then for a classifier the predicted class (its name when the data
has names) and the ``top_k`` classes with their probabilities; for a regressor, the value in
the data's own units.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from expkit.errors import ConfigError, ExpkitError

log = logging.getLogger("expkit")

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def read_inputs(source: Path, data: Any) -> tuple[list[str], torch.Tensor]:
    """(a name per input, the inputs as the model takes them) from a folder, .npy, .pt or .csv."""
    if source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ConfigError(f"input={source}: the folder holds no images ({', '.join(IMAGE_SUFFIXES)})")
        from PIL import Image, UnidentifiedImageError

        images = []
        for file in files:
            try:
                with Image.open(file) as image:
                    images.append(data.predict_image(image))
            except (UnidentifiedImageError, OSError) as exc:
                raise ConfigError(f"input: {file} is not a readable image ({exc})") from None
        return [str(f) for f in files], torch.stack(images)
    if not source.is_file():
        raise ConfigError(f"input={source}: no such file or folder; give a folder of images, a .npy, .pt or .csv file")
    suffix = source.suffix.lower()
    try:
        if suffix == ".npy":
            import numpy as np

            raw = torch.from_numpy(np.load(source, allow_pickle=False))
        elif suffix == ".pt":
            raw = torch.load(source, map_location="cpu", weights_only=True)
            if not isinstance(raw, torch.Tensor):
                raise ConfigError(f"input={source}: holds a {type(raw).__name__}, not one tensor of inputs")
        elif suffix == ".csv":
            raw = _read_csv(source)
        else:
            raise ConfigError(
                f"input={source}: use a folder of images, a .npy, .pt or .csv file (not {suffix or 'no suffix'})"
            )
    except ExpkitError:
        raise
    except Exception as exc:
        raise ConfigError(f"input={source}: cannot be read ({type(exc).__name__}: {exc})") from None
    if raw.dim() == 0 or len(raw) == 0:
        raise ConfigError(f"input={source}: holds no inputs (shape {tuple(raw.shape)})")
    try:
        return [str(i) for i in range(len(raw))], data.predict_input(raw)
    except ExpkitError:
        raise
    except Exception as exc:
        raise ConfigError(f"input={source}: inputs of shape {tuple(raw.shape[1:])} do not fit {type(data).__name__}'s "
                          f"transform ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None  # fmt: skip


def _read_csv(path: Path) -> torch.Tensor:
    lines = [(n, row) for n, row in enumerate(csv.reader(io.StringIO(path.read_text(encoding="utf-8"))), 1) if row]
    if lines and not _numeric(lines[0][1]):
        lines = lines[1:]  # a header
    for number, row in lines:
        if not _numeric(row):
            raise ConfigError(f"input={path}: row {number} is not all numbers: {row[:6]}")
        if len(row) != len(lines[0][1]):
            raise ConfigError(f"input={path}: row {number} has {len(row)} values, the first row {len(lines[0][1])}")
    return torch.tensor([[float(v) for v in row] for _, row in lines], dtype=torch.float32)


def _numeric(row: Sequence[str]) -> bool:
    try:
        [float(v) for v in row]
    except ValueError:
        return False
    return True


def _batches(x: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, len(x), size):
        yield x[start : start + size]


def predict(cfg: DictConfig, work_dir: Path) -> dict[str, Any]:
    """Predict `cfg.input` with `cfg.checkpoint`'s model; write `cfg.output`; returns a summary."""
    from expkit.eval import restore, stored_overrides
    from expkit.export import example_input
    from expkit.trust import TrustPolicy

    for key in ("checkpoint", "input"):
        if OmegaConf.is_missing(cfg, key):
            raise ConfigError(f"give {key}=..., e.g. python -m expkit.predict checkpoint=outputs/runs/<run> "
                              "input=images/ output=predictions.csv")  # fmt: skip
    output = Path(cfg.output) if cfg.output else work_dir / "predictions.csv"
    if output.suffix.lower() not in (".csv", ".jsonl", ".json"):
        raise ConfigError(f"output={output}: use a .csv or .jsonl file")
    if not isinstance(cfg.top_k, int) or cfg.top_k < 1:
        raise ConfigError(f"top_k must be a positive integer, got {cfg.top_k!r}")
    trust = TrustPolicy(list(cfg.trusted_targets or []))
    path, stored, loaders, model, data = restore(cfg.checkpoint, str(cfg.which), bool(cfg.ema),
                                                 stored_overrides(cfg), trust)  # fmt: skip
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    model = model.to(device).eval()
    names, x = read_inputs(Path(cfg.input), data)
    expected = tuple(example_input(loaders).shape[1:])
    if tuple(x.shape[1:]) != expected:
        raise ConfigError(f"input={cfg.input}: inputs of shape {tuple(x.shape[1:])}, but the model takes "
                          f"{expected} (as its data, {stored.data._target_.rsplit('.', 1)[-1]}, gives them)")  # fmt: skip
    outputs = []
    try:
        with torch.no_grad():
            for batch in _batches(x, int(cfg.batch_size)):
                outputs.append(model(batch.to(device)).float().cpu())
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:  # inputs the model cannot take
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"input={cfg.input}: the model cannot take these inputs ({x.dtype}, shape "
                          f"{tuple(x.shape[1:])}): {first}") from None  # fmt: skip
    y = torch.cat(outputs)
    classes = data.class_names()
    num_classes = getattr(model, "data_description", {}).get("num_classes")
    classifier = y.dim() == 2 and y.shape[1] > 1 and (bool(classes) or num_classes == y.shape[1])
    rows = _rows(names, y, data, classes if classifier else None, int(cfg.top_k), classifier)
    _write(output, rows)
    log.info("Predicted %d inputs of %s with %s: %s", len(rows), cfg.input, path, output)
    return {"checkpoint": str(path), "output": str(output), "rows": len(rows)}


def _rows(names: list[str], y: torch.Tensor, data: Any, classes: list[str] | None, top_k: int,
          classifier: bool) -> list[dict[str, Any]]:  # fmt: skip
    if classifier:  # logits over the data's classes
        probabilities = y.softmax(dim=1)
        k = min(top_k, y.shape[1])
        top = probabilities.topk(k, dim=1)

        def label(index: int) -> str | int:
            return classes[index] if classes and index < len(classes) else index

        return [
            {"input": name, "prediction": label(int(idx[0])),
             "top_k": [[label(int(i)), round(float(p), 6)] for i, p in zip(idx, prob)]}
            for name, idx, prob in zip(names, top.indices, top.values)
        ]  # fmt: skip
    if y.dim() == 1 or (y.dim() == 2 and y.shape[1] == 1):  # a regressor: one value each
        values = data.predict_output(y.reshape(-1))
        return [{"input": name, "value": float(v)} for name, v in zip(names, values)]
    if y.dim() == 2:  # several values each (a multi-output regressor, an embedding)
        values = data.predict_output(y)
        return [{"input": name, "value": [round(float(v), 7) for v in row]} for name, row in zip(names, values)]
    raise ConfigError(f"the model outputs shape {tuple(y.shape[1:])} per input; predict writes classifiers' classes "
                      "(N x classes) and values (N, or N x k)")  # fmt: skip


def _write(output: Path, rows: list[dict[str, Any]]) -> None:
    from expkit.atomic import write_text_atomic

    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix.lower() in (".jsonl", ".json"):
        write_text_atomic(output, "".join(json.dumps(row) + "\n" for row in rows))
        return
    buffer = io.StringIO()
    if "value" in rows[0]:
        fields = ["input", "value"]
        flat = rows
    else:
        k = len(rows[0]["top_k"])
        fields = ["input", "prediction"] + [f"{kind}{i}" for i in range(1, k + 1) for kind in ("class", "p")]
        flat = [{"input": r["input"], "prediction": r["prediction"],
                 **{f"{kind}{i}": pair[j] for i, pair in enumerate(r["top_k"], start=1)
                    for j, kind in enumerate(("class", "p"))}} for r in rows]  # fmt: skip
    writer = csv.DictWriter(buffer, fieldnames=fields)
    writer.writeheader()
    writer.writerows(flat)
    write_text_atomic(output, buffer.getvalue())


_STARTED = False


@hydra.main(version_base="1.3", config_path="conf", config_name="predict")
def run(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    global _STARTED
    _STARTED = True
    try:
        predict(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ExpkitError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(2 if isinstance(exc, ConfigError) else 1)


OPTIONS = (
    "checkpoint",
    "input",
    "output",
    "which",
    "ema",
    "top_k",
    "batch_size",
    "device",
    "trusted_targets",
    "overrides",
)  # the yaml's keys; any other key=value overrides the stored config


def main() -> None:
    from expkit.eval import command_main

    command_main(run, OPTIONS, lambda: _STARTED)  # data.batch_size=8 means overrides=[...]


if __name__ == "__main__":
    main()
