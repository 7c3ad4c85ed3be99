"""``python -m expkit.export checkpoint=<run dir | .pth> format=safetensors|onnx|torch_export``.

A Hydra app over ``conf/export.yaml`` (``--help``, ``--cfg job``, ``hydra.run.dir``, ``-m``).
The model is built from the config stored in the checkpoint, through the same trust checks as
``expkit.eval``, with the checkpoint's weights (``ema=true``: the EMA weights). Formats:

  safetensors   the weights, loadable with ``safetensors.torch.load_file``; no pickle, no code
  onnx          torch.onnx (the dynamo exporter), a dynamic batch dimension; runs in onnxruntime
  torch_export  a ``torch.export`` program (.pt2) with a dynamic batch; ``torch.export.load``
  hf            a Hugging Face model (model=hf_causal_lm, hf_classifier, ...) as transformers'
                ``save_pretrained`` directory (config.json, model.safetensors, the tokenizer), any
                checkpoint of the run: ``AutoModelFor...from_pretrained(<out>)`` loads it
  pth           one ordinary checkpoint file: a sharded (``trainer.strategy=fsdp``) checkpoint
                consolidated (the whole ``state_dict``, config, counters; no optimizer state),
                for ``load_from=``, ``expkit.eval`` and ``torch.load(weights_only=True)``

Beside the file, ``<file>.json`` says what it is: the format, the stored config, the input
shape (batch first) and dtype, the preprocessing the data module applies to raw inputs
(``(raw - mean) / std``: the digits' 0-16 counts divided by 16), the range of the inputs in
training, the class names and a regressor's output scaling, the data's description (class
count...), the checkpoint and its sha256. ``python -m expkit.predict checkpoint=<model.onnx>``
reads it. The example input is one batch of the run's own validation (or test) data.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from expkit.config.model_inputs import example_input, training_range
from expkit.core import hydra_compat
from expkit.core.errors import ConfigError, ExpkitError, TaskExit, task_exits

__all__ = ["OPTIONS", "SUFFIX", "example_input", "export", "main", "run", "sha256"]


log = logging.getLogger("expkit")

SUFFIX = {"safetensors": ".safetensors", "onnx": ".onnx", "torch_export": ".pt2", "pth": ".pth", "hf": ""}


def sha256(path: Path) -> str:
    """Of a file; of a sharded checkpoint directory, over its files' names and bytes in name order.

    Args:
        path: a file, or a directory (a sharded checkpoint).

    Returns:
        The SHA-256 digest, in hex.
    """
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _output_name(model: Any) -> str:
    """The ONNX graph's output: ``logits`` for a classifier (the data names its classes), else ``output``."""
    return "logits" if getattr(model, "data_description", {}).get("num_classes") else "output"


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The ONNX exporter's progress lines and its optimizer's INFO records (onnxscript, onnx_ir:
    'No unused functions to remove', ...) say nothing a user can act on: kept to warnings while
    it runs; its warnings and errors still show."""
    loggers = [logging.getLogger(name) for name in ("onnxscript", "onnx_ir", "torch.onnx")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # '[torch.onnx] Translate the graph...' progress
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def export(cfg: DictConfig, work_dir: Path, config_dirs: Sequence[str | Path] = ()) -> dict[str, Any]:
    """Export a checkpoint's model, as ``python -m expkit.export`` does.

    Args:
        cfg: export.yaml's settings: ``checkpoint``, ``format`` (``safetensors``, ``onnx``,
            ``torch_export``, ``pth`` or ``hf``), ``out``, ``ema`` and the rest.
        work_dir: the command's own dir (its log).
        config_dirs: the ``--config-dir`` folders whose ``_target_``s are trusted, as for
            [evaluate][expkit.eval.evaluate].

    Returns:
        The JSON written beside the export: its format and file name, the checkpoint and its
            sha256, the input's shape and dtype, for a model called as ``model(x)`` the data's
            ``preprocessing``, ``postprocessing``, ``input_range`` and ``class_names``, the data's
            settings and description, and the stored config.

    Raises:
        ConfigError: bad input (an unknown format, an output in the way, a model the format
            cannot hold); the command exits 2 with its message.
    """
    import torch

    from expkit.config.cli import output_file_problem
    from expkit.config.restore import restore, stored_overrides, weights
    from expkit.core.trust import TrustPolicy

    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise ConfigError("give checkpoint=<run dir or .pth file>")
    fmt = str(cfg.format)
    if fmt not in SUFFIX:
        raise ConfigError(
            f"format={fmt}: use format=safetensors, format=onnx, format=torch_export, format=pth or format=hf"
        )
    out = Path(cfg.out) if cfg.out else work_dir / ("hf_model" if fmt == "hf" else f"model{SUFFIX[fmt]}")
    problem = _output_dir_problem(out) if fmt == "hf" else output_file_problem(out)
    if problem:
        raise ConfigError(f"out={out}: {problem}")
    opset = cfg.get("opset")
    if opset is not None and (isinstance(opset, bool) or not isinstance(opset, int) or opset < 7):
        raise ConfigError(f"opset={opset!r}: give an ONNX opset version, a whole number such as opset=18, or null")
    trust = TrustPolicy([str(t) for t in cfg.trusted_targets or []], config_dirs)
    path, stored, loaders, model, data_module = restore(
        cfg.checkpoint, str(cfg.which), bool(cfg.ema), stored_overrides(cfg), trust
    )
    model.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    x = example_input(loaders)
    if fmt != "hf" and not isinstance(x, torch.Tensor):
        raise ConfigError(
            f"{fmt}: the model's input is a {type(x).__name__}, not one tensor; export takes a model called as model(x)"
        )
    from expkit.checkpoint import checkpoint_io
    from expkit.core import atomic

    if fmt == "hf":
        _write_hf(model, out)
    elif fmt == "pth":
        checkpoint = checkpoint_io.load_checkpoint(path, "checkpoint")
        checkpoint.pop("sharded", None)
        checkpoint["state_dict"] = {k: v.detach().cpu().contiguous() for k, v in checkpoint["state_dict"].items()}
        atomic.save_atomic(checkpoint, out)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        state = weights(checkpoint_io.load_checkpoint(path, "checkpoint"), path, bool(cfg.ema))
        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}  # no shared storage
        save_file(tensors, str(out), metadata={"checkpoint": str(path.resolve()), "ema": str(bool(cfg.ema)).lower()})
    else:
        _check_model_takes(model, x, fmt)
        batch = torch.export.Dim("batch", min=1)
        if fmt == "onnx":
            kwargs = {"opset_version": opset} if opset is not None else {}
            names = {"input_names": ["input"], "output_names": [_output_name(model)]}
            with _quiet_exporter():
                program = torch.onnx.export(
                    model, (x,), dynamo=True, dynamic_shapes=({0: batch},), verbose=False, **names, **kwargs
                )
            program.save(str(out))
        else:
            program = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
            torch.export.save(program, str(out))
    data = OmegaConf.to_container(stored.data, resolve=True)
    info = {
        "format": fmt,
        "file": out.name,
        "checkpoint": str(path.resolve()),
        "checkpoint_sha256": sha256(path),
        "ema": bool(cfg.ema),
        **_input_description(x),
        **(_prediction_description(data_module, loaders) if isinstance(x, torch.Tensor) else {}),
        "data": data,
        "data_description": getattr(model, "data_description", {}),  # in_channels, image_size, num_classes, ...
        "num_classes": getattr(model, "data_description", {}).get("num_classes"),
        "config": OmegaConf.to_container(stored, resolve=True),
    }
    atomic.write_json_atomic(out.with_name(out.name + ".json"), info)
    log.info("Exported %s (%s) to %s", path, fmt, out)
    return info


def _input_description(x: Any) -> dict[str, Any]:
    """The input's shape (batch first) and dtype; for a dict batch (a Hugging Face model's),
    each entry's."""
    if isinstance(x, Mapping):
        return {
            "input_shape": {k: ["batch", *v.shape[1:]] for k, v in x.items() if hasattr(v, "shape")},
            "input_dtype": {k: str(v.dtype).removeprefix("torch.") for k, v in x.items() if hasattr(v, "dtype")},
        }
    return {"input_shape": ["batch", *x.shape[1:]], "input_dtype": str(x.dtype).removeprefix("torch.")}


def _prediction_description(data: Any, loaders: Any) -> dict[str, Any]:
    """What turns raw inputs into the model's and its outputs back, as the data module states it
    (another runtime cannot call ``predict_input``): ``preprocessing``, ``postprocessing``, the
    1st-99th percentile ``input_range`` of the training inputs, and the ``class_names``."""

    # a data module of the user's own need not subclass DataModule: what it lacks is null
    def stated(name: str) -> Any:
        method = getattr(data, name, None)
        return method() if callable(method) else None

    return {
        "preprocessing": stated("preprocessing"),
        "postprocessing": stated("postprocessing"),
        "input_range": training_range(loaders),
        "class_names": stated("class_names"),
    }


def _output_dir_problem(path: Path) -> str | None:
    """Why `path` cannot become the exported directory: a file stands there, it holds files
    already, or its parent cannot be written."""
    from expkit.config.cli import output_file_problem

    if path.is_dir():
        return "holds files already; give a new directory" if any(path.iterdir()) else None
    if path.exists():
        return "is a file; give a directory to create"
    return output_file_problem(path)


def _write_hf(model: Any, out: Path) -> None:
    """transformers' ``save_pretrained`` form into `out`, written beside it and renamed in:
    a reader never finds half of it."""
    import os
    import shutil

    from expkit.tasks.hf import HFModel, write_pretrained

    if not isinstance(model, HFModel):
        raise ConfigError(
            f"format=hf: the checkpoint's model is a {type(model).__name__}, not a Hugging Face model "
            "(model=hf_causal_lm, model=hf_classifier or a PreTrainedModel); use format=safetensors"
        )
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_pretrained(model, tmp)
        if out.is_dir():  # (empty: checked before)
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@hydra_compat.main(config_path="conf", config_name="export")
def run(cfg: DictConfig) -> None:
    """Hydra's task function: exports one checkpoint's model (``export``).

    Args:
        cfg: the composed ``export.yaml`` config; Hydra composes it from the command line and
            passes it, so the function is called with no arguments (as ``main`` does).

    Raises:
        SystemExit: with status 2 for bad input and 1 for another expkit error.
    """
    from hydra.core.hydra_config import HydraConfig

    work_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        from expkit.config.cli import config_dirs_of

        with task_exits():
            export(cfg, work_dir, config_dirs_of(sys.argv[1:])[1:])
    except ExpkitError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise TaskExit(2 if isinstance(exc, ConfigError) else 1) from None


OPTIONS = (
    "checkpoint",
    "format",
    "which",
    "ema",
    "out",
    "trusted_targets",
    "overrides",
    "opset",
)  # the yaml's keys; any other key=value overrides the stored config


def main() -> None:
    """``python -m expkit.export``: run the Hydra app (``run``) with the command's own options."""
    from expkit.config.cli import command_main

    command_main(run, OPTIONS)  # data.batch_size=8 means overrides=[...]


def _check_model_takes(model: Any, x: Any, fmt: str) -> None:
    """Refuse, in one line, a model that cannot run on a batch of its own data's inputs (a GAN's
    generator takes latent codes, not the images its data yields): traced, the same failure comes
    out as a wall of the exporter's fake-tensor log lines and a traceback."""
    import torch

    try:
        with torch.no_grad():
            model(x)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"format={fmt}: the model cannot take a batch of its data's inputs ({x.dtype}, shape "
            f"{tuple(x.shape[1:])}): {first}; export traces model(x) on such a batch, so a model called on "
            "anything else (a generator's latent codes) is exported from Python with torch.export instead"
        ) from None


if __name__ == "__main__":
    main()
