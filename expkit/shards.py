"""``python -m expkit.shards data=<group> out=<dir>``: a data module's splits as WebDataset shards.

Each split (train, validation, test) of the data group's module is written, sample by sample
and in order, with ``webdataset.ShardWriter`` into ``<out>/<split>-000000.tar``, ...: the
input as ``<key>.npy`` (the tensor as the dataset yields it) or ``<key>.png`` (an 8-bit image),
the class as ``<key>.cls``. The command ends by printing the ``data=webdataset`` overrides that
train from the shards (the brace patterns quoted for the shell and for Hydra).
"""

from __future__ import annotations

import io
import logging
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from expkit.core import hydra_compat
from expkit.core.errors import ConfigError, TaskExit, task_exits

__all__ = ["main", "run", "write_split"]

log = logging.getLogger("expkit")


def _encode(x: Any, input_key: str) -> bytes:
    import numpy as np
    import torch

    array = x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if input_key == "npy":
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        return buffer.getvalue()
    from PIL import Image

    if array.ndim == 3:  # (C, H, W) floats in [0, 1]
        array = array[0] if array.shape[0] == 1 else array.transpose(1, 2, 0)
    image = Image.fromarray((np.clip(array, 0, 1) * 255).round().astype(np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _class_of(y: Any, split: str, i: int) -> int:
    """A sample's target as the class ``<key>.cls`` holds: an int, or an integer tensor or array of
    one element; anything else (a regression value, a mask, a token sequence) is a ConfigError."""
    import numbers

    import numpy as np
    import torch

    if isinstance(y, numbers.Integral):  # (a bool too: 0 or 1, as int() writes it)
        return int(y)
    if isinstance(y, (torch.Tensor, np.ndarray, np.generic)):
        integer = (
            not y.is_floating_point() and not y.is_complex()
            if isinstance(y, torch.Tensor)
            else np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.bool_)
        )
        if integer and (y.numel() if isinstance(y, torch.Tensor) else y.size) == 1:
            return int(y.reshape(()))
        kind = "whole-number" if integer else str(y.dtype)
        what = f"a {kind} target of shape {tuple(y.shape)}" if y.ndim else f"a {kind} value as its target"
    else:
        what = f"a {type(y).__name__} target"
    raise ConfigError(
        f"the {split} split's sample {i} has {what}, not a class: python -m expkit.shards writes classification "
        "data (an input and one class index per sample), such as data=digits, data=fake or data=image_folder"
    )


def write_split(dataset: Any, out: Path, split: str, samples_per_shard: int, input_key: str) -> list[Path]:
    """Write `dataset`'s ``(input, class)`` samples, in order, as shards ``<out>/<split>-NNNNNN.tar``.

    Args:
        dataset: a map-style dataset of ``(input, class)`` pairs.
        out: the dir the shards go into (made when missing).
        split: the shards' name prefix (train, val, test).
        samples_per_shard: the samples in each shard.
        input_key: ``npy`` or ``png``.

    Returns:
        The shards written, in order.
    """
    import webdataset

    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    with webdataset.ShardWriter(
        str(out / f"{split}-%06d.tar"), maxcount=samples_per_shard, verbose=0, post=written.append
    ) as sink:
        for i in range(len(dataset)):
            x, y = dataset[i]
            cls = _class_of(y, split, i)
            sink.write({"__key__": f"{split}{i:09d}", input_key: _encode(x, input_key), "cls": str(cls).encode()})
    return [Path(p) for p in written]


def _pattern(shards: list[Path]) -> str:
    first, last = shards[0].name, shards[-1].name
    prefix = first.rpartition("-")[0]
    if len(shards) == 1:
        return str(shards[0])
    return str(shards[0].parent / f"{prefix}-{{{first[-10:-4]}..{last[-10:-4]}}}.tar")


def _shell(word: str) -> str:
    """`word` for a POSIX shell, in double quotes where it holds Hydra's single quotes (readable),
    else as shlex quotes it."""
    if "'" in word and not any(c in word for c in '"$`\\!'):
        return f'"{word}"'
    return shlex.quote(word)


def _out_dir(cfg: DictConfig) -> Path:
    """``out``: required, a dir (made when missing) that holds no shards yet; else one line, exit 2."""
    from omegaconf import OmegaConf

    problem = None
    if OmegaConf.is_missing(cfg, "out") or not str(cfg.out).strip():
        problem = "out is required: the dir the shards go into, e.g. out=outputs/shards/digits"
    elif (out := Path(str(cfg.out))).exists() and not out.is_dir():
        problem = f"out={out} is a file, not a dir: give the dir the shards go into"
    elif out.exists() and any(out.glob("*-[0-9][0-9][0-9][0-9][0-9][0-9].tar")):
        problem = f"out={out} already holds shards; give another dir, or remove them"
    elif any(parent.exists() and not parent.is_dir() for parent in out.parents):
        problem = f"out={out}: a parent of it is a file, not a dir"
    if problem:
        print(f"Error: {problem}", file=sys.stderr)
        raise TaskExit(2)
    return out


@hydra_compat.main(config_path="conf", config_name="shards")
def run(cfg: DictConfig) -> None:
    """The Hydra app: build the data group's module, write its splits, print the overrides.

    Args:
        cfg: the composed ``shards.yaml`` config.
    """
    with task_exits():
        from expkit.config.cli import hydra_quoted
        from expkit.core.hydra_compat import instantiate

        n = cfg.samples_per_shard
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            print(f"Error: samples_per_shard={n}: give a whole number >= 1", file=sys.stderr)
            raise TaskExit(2)
        if cfg.input_key not in ("npy", "png"):
            print(f"Error: input_key={cfg.input_key}: give npy or png", file=sys.stderr)
            raise TaskExit(2)
        out = _out_dir(cfg)
        import importlib.util

        if importlib.util.find_spec("webdataset") is None:
            print(
                "Error: python -m expkit.shards needs the shards extra: pip install 'expkit[shards]'", file=sys.stderr
            )
            raise TaskExit(2)
        try:
            module = instantiate(cfg.data)
            train, val, test = module.datasets()
        except ConfigError as exc:
            print(f"Error: {exc}", file=sys.stderr)
            raise TaskExit(2) from None
        overrides = ["data=webdataset"]
        splits = {}
        for split, dataset in (("train", train), ("val", val), ("test", test)):
            if dataset is None:
                continue
            if isinstance(dataset, Mapping):  # named validation sets: the first
                name, dataset = next(iter(dataset.items()))
                log.info("%s: writing the %r set of the named sets", split, name)
            splits[split] = dataset
        try:  # the first sample of each split says whether the data is classification data, before any write
            for split, dataset in splits.items():
                if len(dataset):
                    _class_of(dataset[0][1], split, 0)
            written = {
                split: write_split(dataset, out, split, n, str(cfg.input_key)) for split, dataset in splits.items()
            }
        except ConfigError as exc:
            for shard in out.glob("*-[0-9][0-9][0-9][0-9][0-9][0-9].tar"):  # (out held none: _out_dir)
                shard.unlink()
            from hydra.core.hydra_config import HydraConfig

            print(f"Error: data={HydraConfig.get().runtime.choices.get('data')}: {exc}", file=sys.stderr)
            raise TaskExit(2) from None
        for split, dataset in splits.items():
            shards = written[split]
            log.info(
                "%s: %d samples in %d shard%s (%s)",
                split,
                len(dataset),
                len(shards),
                "s" * (len(shards) > 1),
                _pattern(shards),
            )
            pattern = _pattern(shards)
            overrides.append(
                f"data.{split}={hydra_quoted(pattern) if '{' in pattern else pattern}"
            )  # (Hydra reads braces)
        classes = module.describe().get("num_classes")
        if classes:
            overrides.append(f"data.num_classes={classes}")
        print("Train from them with:\n  python -m expkit.train " + " ".join(_shell(o) for o in overrides))


def main() -> None:
    """``python -m expkit.shards``: run the Hydra app; Hydra's own errors (an unknown key) exit 2."""
    from expkit.config.cli import check_output_paths, flags_first, run_app
    from expkit.core import versions
    from expkit.core.signals import take_ctrl_c

    versions.require()
    take_ctrl_c()
    sys.argv[1:] = flags_first(sys.argv[1:])
    run_app(run, check_output_paths(sys.argv[1:], ("out",)))


if __name__ == "__main__":
    main()
