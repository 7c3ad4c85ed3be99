"""``python -m expkit.predict checkpoint=<run dir | .pth | .dcp> input=<path> output=<file>``.

A Hydra app over ``conf/predict.yaml`` (``--help``, ``--cfg job``, ``hydra.run.dir``, ``-m``).
The model is built from the config stored in the checkpoint, through the same trust checks as
``expkit.eval``, with its weights (``ema=true``: the EMA ones; ``which=best|last``). Inputs:

  a folder      its images, at any depth (png, jpg, jpeg, bmp, gif, webp, tif, tiff), in path order
  .npy / .pt    one array of inputs, first dimension the batch
  .csv          feature rows for tabular models (a header line, if any, is skipped)
  .txt          texts, one per line, for a Hugging Face model: a language model continues each
                by ``max_new_tokens`` tokens (``model.generate``), a classifier classifies each

The run's data module turns them into what the model was trained on (``predict_image``,
``predict_input``: the digits' 0-16 pixel counts are scaled, the diabetes features standardised
with the training statistics). ``checkpoint=<model.onnx>``, a model ``expkit.export`` wrote, runs
in onnxruntime with the preprocessing its sidecar ``<model.onnx>.json`` records (``expkit.data.exported.ExportedData``).
Output, CSV or JSON lines (by the file's suffix), one row per
input: its path or index, then for a classifier the predicted class (its name when the data
has names) and the ``top_k`` classes with their probabilities; for a regressor, the value in
the data's own units.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from expkit.config.model_inputs import example_input, training_range
from expkit.core import hydra_compat
from expkit.core.errors import ConfigError, ExpkitError, TaskExit, task_exits

if TYPE_CHECKING:
    import torch

    from expkit.data.exported import ExportedData

# torch and the data modules are imported by the functions that predict: --help needs neither (1.5 s)

__all__ = [
    "IMAGE_SUFFIXES",
    "OPTIONS",
    "check_range",
    "main",
    "predict",
    "read_inputs",
    "run",
    "training_range",
]


log = logging.getLogger("expkit")

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def read_inputs(
    source: Path, data: Any, preprocessed: bool = False, shape: tuple[int, ...] | None = None
) -> tuple[list[str], torch.Tensor]:
    """(a name per input, the inputs as the model takes them) from a folder, .npy, .pt or .csv.
    `preprocessed`: file inputs are already what the model takes (as the training transform
    made them): taken as float tensors, reshaped to `shape` when their size per input is its.

    Args:
        source: a folder of images (read recursively, in path order), or a ``.npy``, ``.pt``
            (one tensor) or ``.csv`` file.
        data: the run's data module, whose ``predict_image`` / ``predict_input`` transform the inputs.
        preprocessed: whether file inputs are already what the model takes (not transformed).
        shape: the shape of one input as the model takes it, for reshaping preprocessed inputs;
            None: not reshaped.

    Returns:
        A name per input (its path for images, its index otherwise) and the inputs, first
            dimension the batch.

    Raises:
        ConfigError: when `source` does not exist, is of another kind, cannot be read, holds no
            inputs, or its inputs do not fit the data's transform.
    """
    import torch

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
    if preprocessed:
        x = raw.float() if raw.is_floating_point() else raw
        if shape is not None and tuple(x.shape[1:]) != shape and x[0].numel() == math.prod(shape):
            x = x.reshape(len(x), *shape)
        return [str(i) for i in range(len(raw))], x
    try:
        return [str(i) for i in range(len(raw))], data.predict_input(raw)
    except ExpkitError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"input={source}: inputs of shape {tuple(raw.shape[1:])} do not fit {type(data).__name__}'s "
            f"transform ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        ) from None


_ONE_D = "; a 1-D array is read as one number per input: give one row per input"


def check_range(x: torch.Tensor, trained: tuple[float, float] | None, data: Any, source: str) -> None:
    """Inputs that, after the data's transform, lie a whole training range beyond it (other
    units: 0-255 for 0-1), or span under a quarter of it (preprocessed twice: digits scaled to
    [0, 1], then divided by 16 again), are refused: they would be predicted silently wrong.
    The training range is its 1st to 99th percentile.

    Args:
        x: the inputs after the data's transform.
        trained: the training range from ``training_range``; None: nothing is checked.
        data: the run's data module (its ``predict_input`` is named in the message).
        source: the inputs' path, named in the message.

    Raises:
        ConfigError: when the inputs lie more than the training range's span outside it, or
            span less than a quarter of it.
    """
    if trained is None or not x.is_floating_point() or x.numel() == 0:
        return
    low, high = float(x.min()), float(x.max())
    span = trained[1] - trained[0]
    if span <= 0:
        return
    outside = low < trained[0] - span or high > trained[1] + span
    squeezed = high - low < 0.25 * span
    if not (outside or squeezed):
        return
    looks = "already preprocessed" if squeezed else "in other units than the training data"
    raise ConfigError(
        f"input={source}: after {_preprocessing_named(data)} the inputs span "
        f"[{low:.4g}, {high:.4g}], while the model was trained on [{trained[0]:.4g}, {trained[1]:.4g}] (1st-99th "
        f"percentile): they look {looks}. Give raw inputs as the dataset holds them, or preprocessed=true when "
        "they already are what the model takes (scaled as training scaled them)."
    )


def _preprocessing_named(data: Any) -> str:
    """The preprocessing ``predict_input`` applies, for messages: what an export's sidecar
    records, or the data module's class and the first line of its ``predict_input`` doc."""
    from expkit.data.exported import ExportedData

    if isinstance(data, ExportedData):
        return data.named()
    doc = (getattr(type(data), "predict_input", None).__doc__ or "").strip()  # type: ignore[union-attr]
    summary = " ".join(doc.split("\n\n")[0].split()).replace("``", "")  # (its first paragraph, one line)
    transform = summary.split(". ")[0].rstrip(".") or "predict_input"
    return f"{type(data).__name__}'s preprocessing ({transform})"


def _exported(source: Path, device: str) -> tuple[Any, ExportedData]:
    """An exported ONNX model as a callable on batches (in onnxruntime), and its data as its
    sidecar JSON records it."""
    import torch

    from expkit.data.exported import ExportedData

    sidecar = source.with_name(source.name + ".json")
    if not source.is_file():
        raise ConfigError(f"checkpoint={source}: no such file; give a model.onnx that python -m expkit.export wrote")
    try:
        import numpy as np

        info = json.loads(sidecar.read_text(encoding="utf-8"))
        shape = [int(n) for n in info["input_shape"][1:]]
        numpy_dtype = np.dtype(str(info["input_dtype"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"checkpoint={source}: its {sidecar.name}, which says what the model takes, is missing or unreadable "
            f"({type(exc).__name__}: {exc}); export it again with python -m expkit.export format=onnx"
        ) from None
    try:
        import onnxruntime
    except ImportError:
        raise ConfigError("checkpoint=<model.onnx> needs onnxruntime: pip install 'expkit[export]'") from None
    available = onnxruntime.get_available_providers()
    if device == "cpu":
        providers: list[Any] = ["CPUExecutionProvider"]
    elif device.startswith("cuda"):
        if "CUDAExecutionProvider" not in available:
            raise ConfigError(
                f"device={device}: this onnxruntime has no CUDA ({', '.join(available)}); give device=cpu"
            )
        index = int(device.partition(":")[2] or 0)
        providers = [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
    else:
        providers = available
    # onnxruntime raises its own types (InvalidProtobuf, Fail, ...), none of them exported
    try:
        session = onnxruntime.InferenceSession(str(source), providers=providers)
    except Exception as exc:
        raise ConfigError(
            f"checkpoint={source}: onnxruntime cannot load it ({str(exc).splitlines()[0][:200]})"
        ) from None
    name = session.get_inputs()[0].name

    def model(batch: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {name: batch.numpy().astype(numpy_dtype, copy=False)})[0])

    # as restore() sets it on a checkpoint's model: predict tells a classifier by its num_classes
    model.data_description = info.get("data_description") or {}  # type: ignore[attr-defined]
    info["input_shape"] = ["batch", *shape]
    return model, ExportedData(info, sidecar)


def _read_csv(path: Path) -> torch.Tensor:
    import torch

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


def predict(cfg: DictConfig, work_dir: Path, config_dirs: Sequence[str | Path] = ()) -> dict[str, Any]:
    """Predict new inputs with a checkpoint's model, as ``python -m expkit.predict`` does.

    Args:
        cfg: predict.yaml's settings: ``checkpoint`` (a run dir, a checkpoint, or a ``.onnx``
            file ``expkit.export`` wrote, beside its sidecar JSON), ``input`` (a folder of images, a ``.npy``,
            ``.pt`` or ``.csv`` file, or a ``.txt`` file of texts, one per line, for a Hugging Face
            model), ``output`` (``.csv`` or ``.jsonl``), ``top_k`` and the rest.
        work_dir: the command's own dir (its log).
        config_dirs: the ``--config-dir`` folders whose ``_target_``s are trusted, as for
            [evaluate][expkit.eval.evaluate].

    Returns:
        A summary: the ``checkpoint``, the ``output`` file and the number of ``rows`` written.

    Raises:
        ConfigError: bad input (an unreadable or empty input, an output of another kind,
            inputs outside what the model was trained on); the command exits 2 with its message.
    """
    import torch

    from expkit.config.cli import output_file_problem
    from expkit.config.restore import restore, stored_overrides
    from expkit.core.settings import check_device
    from expkit.core.trust import TrustPolicy

    for key in ("checkpoint", "input"):
        if OmegaConf.is_missing(cfg, key):
            raise ConfigError(
                f"give {key}=..., e.g. python -m expkit.predict checkpoint=outputs/runs/<run> "
                "input=images/ output=predictions.csv"
            )
    output = Path(cfg.output) if cfg.output else work_dir / "predictions.csv"
    if output.suffix.lower() not in (".csv", ".jsonl", ".json"):
        raise ConfigError(f"output={output}: use a .csv or .jsonl file")
    problem = output_file_problem(output)
    if problem:
        raise ConfigError(f"output={output}: {problem}")
    for key in ("top_k", "batch_size"):
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ConfigError(f"{key} must be a positive integer, got {cfg[key]!r}")
    check_device("device", cfg.device, torch_runs_it=Path(str(cfg.checkpoint)).suffix.lower() != ".onnx")
    preprocessed = cfg.get("preprocessed", False)
    if not isinstance(preprocessed, bool):
        raise ConfigError(f"preprocessed must be true or false, got {preprocessed!r}")
    # a folder's images go through the image transform, whose range is not the training inputs'
    range_checked = not preprocessed and not Path(cfg.input).is_dir()
    if Path(str(cfg.checkpoint)).suffix.lower() == ".onnx":
        # an export has no data module to call: its sidecar JSON says what the model takes
        path = Path(str(cfg.checkpoint))
        if Path(cfg.input).suffix.lower() == ".txt":
            raise ConfigError(f"input={cfg.input}: an exported ONNX model takes tensors, not texts")
        model, data = _exported(path, str(cfg.device))
        # onnxruntime takes and gives arrays in host memory, whichever device it runs on
        device = torch.device("cpu")
        expected, trained = data.shape, data.info.get("input_range")
        data_name = str((data.info.get("data") or {}).get("_target_", "?"))
    else:
        trust = TrustPolicy([str(t) for t in cfg.trusted_targets or []], config_dirs)
        path, stored, loaders, model, data = restore(
            cfg.checkpoint, str(cfg.which), bool(cfg.ema), stored_overrides(cfg), trust
        )
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
        model = model.to(device).eval()
        if Path(cfg.input).suffix.lower() == ".txt":  # texts: prompts for a language model, or texts to classify
            rows = _text_rows(model, data, Path(cfg.input), cfg, device)
            _write(output, rows)
            log.info("Predicted %d texts of %s with %s: %s", len(rows), cfg.input, path, output)
            return {"checkpoint": str(path), "output": str(output), "rows": len(rows)}
        expected = tuple(example_input(loaders).shape[1:])
        trained = training_range(loaders) if range_checked else None
        data_name = str(stored.data._target_)
    names, x = read_inputs(Path(cfg.input), data, preprocessed, expected)
    if tuple(x.shape[1:]) != expected:
        raise ConfigError(
            f"input={cfg.input}: inputs of shape {tuple(x.shape[1:])}, but the model takes "
            f"{expected} (as its data, {data_name.rsplit('.', 1)[-1]}, gives them){_ONE_D if x.dim() == 1 else ''}"
        )
    if range_checked:
        check_range(x, tuple(trained) if trained else None, data, str(cfg.input))
    outputs = []
    try:
        with torch.no_grad():
            for batch in _batches(x, int(cfg.batch_size)):
                outputs.append(model(batch.to(device)).float().cpu())
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:  # inputs the model cannot take
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"input={cfg.input}: the model cannot take these inputs ({x.dtype}, shape {tuple(x.shape[1:])}): {first}"
        ) from None
    y = torch.cat(outputs)
    classes = data.class_names()
    num_classes = getattr(model, "data_description", {}).get("num_classes")
    classifier = y.dim() == 2 and y.shape[1] > 1 and (bool(classes) or num_classes == y.shape[1])
    rows = _rows(names, y, data, classes if classifier else None, int(cfg.top_k), classifier)
    _write(output, rows)
    how = _how_preprocessed(data, preprocessed)
    log.info("Predicted %d inputs of %s (%s) with %s: %s", len(rows), cfg.input, how, path, output)
    return {"checkpoint": str(path), "output": str(output), "rows": len(rows)}


def _how_preprocessed(data: Any, preprocessed: bool) -> str:
    """How the inputs reached the model, for the log: as given, through the data module's
    ``predict_input``, or through the preprocessing an export's sidecar records (its numbers, not
    a data module's code: which ones ran is said)."""
    from expkit.data.exported import ExportedData

    if preprocessed:
        return "as given (preprocessed=true)"
    if isinstance(data, ExportedData):
        return f"through {data.named()}"
    return f"through {type(data).__name__}.predict_input"


def _text_rows(model: Any, data: Any, source: Path, cfg: DictConfig, device: torch.device) -> list[dict[str, Any]]:
    """For each line of `source`: a language model's continuation (``max_new_tokens`` tokens,
    greedy at ``temperature=0``, else sampled from ``seed``), or a text classifier's classes."""
    import torch

    from expkit.tasks.hf import HFModel, fast_tokenizer

    tokenizer = fast_tokenizer(model) if isinstance(model, HFModel) else None
    if tokenizer is None:
        raise ConfigError(
            f"input={source}: text inputs need a Hugging Face model trained with its tokenizer "
            "(experiment=hf_causal_lm or hf_text_classification); this checkpoint's model is not one"
        )
    try:
        lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"input={source}: cannot be read as text ({exc})") from None
    if not lines:
        raise ConfigError(f"input={source}: no texts (one per line)")
    with torch.no_grad():
        if not model.causal:  # a classifier: the classes of each line, as for any classifier
            length = data.describe().get("max_length", 512)
            encoded = tokenizer(lines, padding="max_length", truncation=True, max_length=length, return_tensors="pt")
            logits = model(**{k: v.to(device) for k, v in encoded.items() if k != "token_type_ids"}).logits
            return _rows(lines, logits.float().cpu(), data, data.class_names(), int(cfg.top_k), True)
        temperature = float(cfg.get("temperature", 0.0))
        sampling: dict[str, Any] = (
            {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        )
        torch.manual_seed(int(cfg.get("seed", 0)))
        rows = []
        for prompt in lines:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
            out = model.generate(
                ids,
                max_new_tokens=int(cfg.get("max_new_tokens", 50)),
                pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )
            rows.append({"input": prompt, "text": tokenizer.decode(out[0], skip_special_tokens=True)})
    return rows


def _rows(
    names: list[str], y: torch.Tensor, data: Any, classes: list[str] | None, top_k: int, classifier: bool
) -> list[dict[str, Any]]:
    if classifier:  # logits over the data's classes
        probabilities = y.softmax(dim=1)
        k = min(top_k, y.shape[1])
        top = probabilities.topk(k, dim=1)

        def label(index: int) -> str | int:
            return classes[index] if classes and index < len(classes) else index

        return [
            {
                "input": name,
                "prediction": label(int(idx[0])),
                "top_k": [[label(int(i)), round(float(p), 6)] for i, p in zip(idx, prob)],
            }
            for name, idx, prob in zip(names, top.indices, top.values)
        ]
    if y.dim() == 1 or (y.dim() == 2 and y.shape[1] == 1):  # a regressor: one value each
        values = data.predict_output(y.reshape(-1))
        return [{"input": name, "value": float(v)} for name, v in zip(names, values)]
    if y.dim() == 2:  # several values each (a multi-output regressor, an embedding)
        values = data.predict_output(y)
        return [{"input": name, "value": [round(float(v), 7) for v in row]} for name, row in zip(names, values)]
    raise ConfigError(
        f"the model outputs shape {tuple(y.shape[1:])} per input; predict writes classifiers' classes "
        "(N x classes) and values (N, or N x k)"
    )


def _write(output: Path, rows: list[dict[str, Any]]) -> None:
    from expkit.core.atomic import write_text_atomic

    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix.lower() in (".jsonl", ".json"):
        write_text_atomic(output, "".join(json.dumps(row) + "\n" for row in rows))
        return
    buffer = io.StringIO()
    if "value" in rows[0] or "text" in rows[0]:
        fields = ["input", "value" if "value" in rows[0] else "text"]
        flat = rows
    else:
        k = len(rows[0]["top_k"])
        fields = ["input", "prediction"] + [f"{kind}{i}" for i in range(1, k + 1) for kind in ("class", "p")]
        flat = [
            {
                "input": r["input"],
                "prediction": r["prediction"],
                **{
                    f"{kind}{i}": pair[j]
                    for i, pair in enumerate(r["top_k"], start=1)
                    for j, kind in enumerate(("class", "p"))
                },
            }
            for r in rows
        ]
    writer = csv.DictWriter(buffer, fieldnames=fields)
    writer.writeheader()
    writer.writerows(flat)
    write_text_atomic(output, buffer.getvalue())


@hydra_compat.main(config_path="conf", config_name="predict")
def run(cfg: DictConfig) -> None:
    """Hydra's task function: predicts the inputs with one checkpoint's model (``predict``).

    Args:
        cfg: the composed ``predict.yaml`` config; Hydra composes it from the command line and
            passes it, so the function is called with no arguments (as ``main`` does).

    Raises:
        SystemExit: with status 2 for bad input and 1 for another expkit error.
    """
    from hydra.core.hydra_config import HydraConfig

    try:
        from expkit.config.cli import config_dirs_of

        with task_exits():
            predict(cfg, Path(HydraConfig.get().runtime.output_dir), config_dirs_of(sys.argv[1:])[1:])
    except ExpkitError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise TaskExit(2 if isinstance(exc, ConfigError) else 1) from None


OPTIONS = (
    "checkpoint",
    "input",
    "output",
    "which",
    "ema",
    "top_k",
    "max_new_tokens",
    "temperature",
    "seed",
    "preprocessed",
    "batch_size",
    "device",
    "trusted_targets",
    "overrides",
)  # the yaml's keys; any other key=value overrides the stored config


def main() -> None:
    """``python -m expkit.predict``: run the Hydra app (``run``) with the command's own options."""
    from expkit.config.cli import command_main

    command_main(run, OPTIONS)  # data.batch_size=8 means overrides=[...]


if __name__ == "__main__":
    main()
