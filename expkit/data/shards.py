"""``data=webdataset``: WebDataset tar shards (as ``webdataset.ShardWriter`` writes them), on a
local disk or in object storage (``s3://``, ``gs://``: fsspec), read by index.

Every shard is indexed once (where each sample's members lie in the tar: offsets and sizes,
read from the tar headers by the standard library's ``tarfile``), and the index is cached
beside the runs (``data.index_dir``), keyed by the shard's URL, size and modification time.
With the index the shards are a map-style dataset: a sample is one ranged read of its
members, nothing is loaded whole, and the epoch's length is known.

The train order is a function of (seed, epoch) alone (``ShardOrderSampler``): the shards in
a shuffled order, then the samples shuffled within windows of ``shuffle_buffer`` samples, so
that the reads of a window stay within a few shards. Because the order does not depend on
the number of processes or workers, expkit's exact resume works here as for data in memory:
a run killed in the middle of an epoch resumes at the next sample, with workers, under
torchrun, and on another number of processes (the sampler skips the samples the ranks went
through; nothing is read to skip them).

Why an index and not a stream with a stateful loader (torchdata's ``StatefulDataLoader``
over ``webdataset.WebDataset``): a streaming pipeline's position is a per-worker state whose
shards are split by worker and rank, so it resumes only with the same workers and processes,
and skipping means reading; its shuffle buffer makes the order a function of timing-free but
pipeline-shaped state. The index costs one pass over the tar headers per shard, once (see
docs/data-at-scale.md for the figures).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from expkit.core.errors import ConfigError
from expkit.data.datasets import DataModule
from expkit.samplers import SeededRandomSampler

__all__ = [
    "INPUT_KEYS",
    "ShardDataset",
    "ShardOrderSampler",
    "ShardReadError",
    "WebDatasetData",
    "expand_urls",
    "index_shard",
]

log = logging.getLogger("expkit")

INPUT_KEYS = ("png", "jpg", "jpeg", "npy")  # data.input_key null: the first of these a sample has
INDEX_VERSION = 1


class ShardReadError(RuntimeError):
    """A sample could not be read or decoded in the middle of a run: names the shard and the sample.

    Args:
        message: what could not be read; raised again in the main process by a DataLoader worker's
            wrapper (``Caught ShardReadError in DataLoader worker process 0. Original Traceback ...``),
            it is the worker's message alone again, so the run's one-line error names the shard.
    """

    def __init__(self, message: str) -> None:
        if message.startswith(f"Caught {type(self).__name__}"):
            lines = [line for line in message.splitlines() if line.strip()]
            message = lines[-1].partition(f"{type(self).__name__}: ")[2] or message
        super().__init__(message)


def _is_url(spec: str) -> bool:
    return "://" in spec and not spec.startswith("file://")


def expand_urls(spec: str, key: str) -> list[str]:
    """The shards a ``data.train``-style setting names: one path or URL, a brace pattern
    (``dir/train-{000000..000127}.tar``), or several separated by ``::``.

    Args:
        spec: the setting's value.
        key: the setting's name, for messages (``data.train``).

    Returns:
        The shard paths or URLs, in order.

    Raises:
        ConfigError: when `spec` is empty or its braces do not expand.
    """
    try:
        import braceexpand
    except ImportError:  # (webdataset's own dependency: the shards extra)
        raise ConfigError("data=webdataset needs the shards extra: pip install 'expkit[shards]'") from None

    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{key} is empty: give a shard path, a brace pattern or an s3:// URL")
    urls: list[str] = []
    for part in spec.split("::"):
        try:
            urls += list(braceexpand.braceexpand(part.strip()))
        except Exception as exc:  # (an unbalanced brace)
            raise ConfigError(f"{key}={spec}: the pattern does not expand ({exc})") from None
    return [u.removeprefix("file://") for u in urls]


def _filesystem(url: str) -> tuple[Any, str]:
    """fsspec's filesystem for `url` (s3:// reads AWS_ENDPOINT_URL and the credentials from the
    environment, as boto does) and the path in it."""
    import fsspec

    return fsspec.core.url_to_fs(url)


def _stat(url: str) -> tuple[int, str]:
    """(size, version) of a shard: the version is the mtime of a local file, the ETag or the
    modification time of an object; raises OSError (FileNotFoundError) when it is missing."""
    if not _is_url(url):
        st = os.stat(url)
        return st.st_size, str(st.st_mtime_ns)
    fs, path = _filesystem(url)
    info = fs.info(path)
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
    return int(info["size"]), str(version)


def index_shard(url: str) -> list[dict[str, Any]]:
    """The samples of one tar shard, in order: each ``{"key": ..., "members": {ext: [offset, size]}}``
    (the offset of the member's data in the file). WebDataset's rule: a member ``dir/name.ext.gz``
    belongs to sample ``dir/name``, extension ``ext.gz``; consecutive members of one key form one
    sample.

    Args:
        url: the shard's path or URL.

    Returns:
        The samples.

    Raises:
        tarfile.TarError: a truncated or corrupt tar.
        OSError: the shard cannot be read.
    """
    if _is_url(url):
        fs, path = _filesystem(url)
        opened = fs.open(path, "rb", block_size=1 << 22, cache_type="readahead")
    else:
        opened = open(url, "rb")  # noqa: SIM115 (closed below with the tar)
    samples: list[dict[str, Any]] = []
    with opened, tarfile.open(fileobj=opened, mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            directory, _, name = member.name.rpartition("/")
            stem, dot, ext = name.partition(".")
            if not dot or name.startswith("."):  # (no extension: not part of a sample)
                continue
            key = f"{directory}/{stem}" if directory else stem
            if not samples or samples[-1]["key"] != key:
                samples.append({"key": key, "members": {}})
            samples[-1]["members"][ext.lower()] = [member.offset_data, member.size]
    return samples


class _Index:
    """Where each sample of a list of shards lies: the shard, and its input's and target's
    (offset, size), as compact tensors (about 40 bytes a sample)."""

    def __init__(self, urls: list[str], shard_samples: list[list[dict[str, Any]]], input_key: str, target_key: str):
        self.urls = urls
        self.sizes = [len(samples) for samples in shard_samples]
        rows = []
        for shard, samples in enumerate(shard_samples):
            for sample in samples:
                members = sample["members"]
                if input_key not in members or target_key not in members:
                    missing = input_key if input_key not in members else target_key
                    raise ConfigError(
                        f"{urls[shard]}: sample {sample['key']!r} has no .{missing} member (it has "
                        f"{', '.join(sorted(members))}); set data.input_key / data.target_key to the extensions "
                        "the shards hold"
                    )
                rows.append([shard, *members[input_key], *members[target_key]])
        self.rows = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)

    def __len__(self) -> int:
        return len(self.rows)


def _read_cached(path: Path) -> list[dict[str, Any]] | None:
    """A cached shard index; None when it is missing or not what ``index_shard`` writes (a cut
    write, a file from elsewhere: the shard is indexed again)."""
    try:
        samples = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(samples, list) and all(
        isinstance(s, dict) and isinstance(s.get("members"), dict) and "key" in s for s in samples
    )
    return samples if ok else None


def _load_index(urls: list[str], key: str, index_dir: Path) -> list[list[dict[str, Any]]]:
    """Every shard's samples, from the cache when the shard is unchanged, else read (and cached).
    A missing shard, an unreachable store or a truncated tar raise a ConfigError naming it."""
    out = []
    built = 0
    for url in urls:
        try:
            size, version = _stat(url)
        except FileNotFoundError:
            raise ConfigError(
                f"{key}: {url} does not exist ({len(urls)} shard{'s' if len(urls) > 1 else ''} named); "
                "check the path or pattern (quote a brace pattern on the command line: "
                f"{key}='dir/train-{{000000..000009}}.tar'), or write shards first: python -m expkit.shards "
                "data=<data group> out=<dir>"
            ) from None
        except Exception as exc:  # an unreachable endpoint, a missing bucket, no credentials
            cause = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ConfigError(
                f"{key}: cannot reach {url} ({type(exc).__name__}: {cause}); check the bucket, the credentials "
                "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and the endpoint (AWS_ENDPOINT_URL)"
            ) from None
        digest = hashlib.sha256(json.dumps([INDEX_VERSION, url, size, version]).encode()).hexdigest()[:32]
        cached = index_dir / f"{digest}.json"
        samples = _read_cached(cached)
        if samples is None:
            try:
                samples = index_shard(url)
            except (tarfile.TarError, EOFError) as exc:
                raise ConfigError(
                    f"{key}: {url} is not a readable tar ({exc}); it may be truncated: write it again"
                ) from None
            if not samples:
                raise ConfigError(f"{key}: {url} holds no sample (an empty tar)")
            built += 1
            try:
                from expkit.core.atomic import write_json_atomic

                index_dir.mkdir(parents=True, exist_ok=True)
                write_json_atomic(cached, samples)
            except OSError as exc:  # (a read-only dir: indexed again next time)
                log.warning("Could not cache the index of %s in %s: %s", url, index_dir, exc)
        out.append(samples)
    if built:
        log.info("Indexed %d of %d shards of %s (cached in %s)", built, len(urls), key, index_dir)
    return out


class _Reader:
    """Ranged reads of shards, one open file per shard per process (a DataLoader worker opens its own)."""

    def __init__(self) -> None:
        self.pid = -1
        self.open: dict[str, Any] = {}

    def read(self, url: str, offset: int, size: int) -> bytes:
        if self.pid != os.getpid():  # a forked worker: the parent's handles are not its own
            self.pid, self.open = os.getpid(), {}
        handle = self.open.get(url)
        if handle is None:
            if len(self.open) >= 16:  # (a window of the order spans a few shards at a time)
                _, old = self.open.popitem()
                old.close()
            if _is_url(url):
                fs, path = _filesystem(url)
                handle = fs.open(path, "rb", block_size=1 << 22, cache_type="readahead")
            else:
                handle = open(url, "rb")  # noqa: SIM115 (kept open; closed when evicted)
            self.open[url] = handle
        if hasattr(handle, "fileno") and not _is_url(url):
            data = os.pread(handle.fileno(), size, offset)
        else:
            handle.seek(offset)
            data = handle.read(size)
        if len(data) != size:
            raise ShardReadError(f"{url}: a member at byte {offset} is cut short ({len(data)} of {size} bytes)")
        return data


def _decode(data: bytes, ext: str) -> torch.Tensor:
    """A member's bytes as a tensor: an image as (C, H, W) floats in [0, 1], an array as it is
    (floats as float32)."""
    import numpy as np

    if ext == "npy":
        array = np.load(io.BytesIO(data), allow_pickle=False)
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor.float() if tensor.is_floating_point() else tensor
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        array = np.asarray(image.convert("L" if image.mode in ("L", "1", "I", "I;16") else "RGB"))
    tensor = torch.from_numpy(array.copy())
    tensor = tensor.unsqueeze(0) if tensor.ndim == 2 else tensor.permute(2, 0, 1)
    return tensor.float().div_(255)


def _decode_target(data: bytes) -> int:
    return int(data.decode().strip())


class ShardDataset(Dataset):
    """The samples of a list of tar shards, by index: ``(input, target)`` pairs.

    Args:
        index: where each sample lies.
        input_key: the input member's extension (``png``, ``jpg``, ``jpeg``, ``npy``).
        on_error: ``raise``: a sample that cannot be read stops the run naming its shard; ``skip``:
            it is left out of its batch (counted and logged).
    """

    def __init__(self, index: _Index, input_key: str, on_error: str = "raise") -> None:
        self.index, self.input_key, self.on_error = index, input_key, on_error
        self.reader = _Reader()

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int] | None:
        shard, in_off, in_size, tg_off, tg_size = self.index.rows[i].tolist()
        url = self.index.urls[shard]
        try:
            x = _decode(self.reader.read(url, in_off, in_size), self.input_key)
            y = _decode_target(self.reader.read(url, tg_off, tg_size))
        except Exception as exc:
            message = f"{url}: sample {i - sum(self.index.sizes[:shard])} of the shard cannot be read ({exc})"
            if self.on_error == "skip":
                log.warning("Skipped: %s", message)
                return None
            raise ShardReadError(
                f"{message}. Replace the shard and resume (resume=true), or skip such samples with data.on_error=skip"
            ) from None
        return x, y

    def shard_sizes(self) -> list[int]:
        """The number of samples of each shard, in order."""
        return self.index.sizes


class ShardOrderSampler(SeededRandomSampler):
    """The train order over tar shards: the shards in a shuffled order, then the samples
    shuffled within consecutive windows of `window` samples; a function of (seed, epoch) only.
    The skip, the padding and the split between ranks are ``SeededRandomSampler``'s.

    Args:
        data_source: the dataset (``ShardDataset``).
        shard_sizes: the samples of each shard, in order.
        window: the samples shuffled together (``data.shuffle_buffer``); 0: the shards in order,
            each in order (no shuffle at all).
        seed: the seed of every epoch's order (with the epoch).
        rank: this process's rank among the `num_replicas`.
        num_replicas: the number of processes sharing the data.
    """

    def __init__(
        self,
        data_source: Dataset,
        shard_sizes: Sequence[int],
        window: int,
        seed: int = 0,
        rank: int = 0,
        num_replicas: int = 1,
    ) -> None:
        super().__init__(data_source, seed, rank, num_replicas)  # type: ignore[arg-type]
        self.shard_sizes, self.window = list(shard_sizes), window

    def permutation(self) -> list[int]:
        """This epoch's order of every sample of every shard (see the class).

        Returns:
            A permutation of ``range(n)``.
        """
        if self.window <= 0:
            return list(range(self.n))
        g = torch.Generator()
        g.manual_seed(self.seed * 100_003 + self.epoch)
        starts = [0]
        for size in self.shard_sizes:
            starts.append(starts[-1] + size)
        shards = torch.randperm(len(self.shard_sizes), generator=g).tolist()
        order = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in shards])
        for begin in range(0, self.n, self.window):
            window = order[begin : begin + self.window]
            order[begin : begin + self.window] = window[torch.randperm(len(window), generator=g)]
        return order.tolist()


def _skip_unreadable(batch: list[Any]) -> Any:
    """collate_fn for ``data.on_error=skip``: the samples that could be read, collated."""
    from torch.utils.data import default_collate

    return default_collate([sample for sample in batch if sample is not None])


class WebDatasetData(DataModule):
    """``data=webdataset``: image or array classification data in WebDataset tar shards.

    Args:
        train: the train shards: a path, a brace pattern (``dir/train-{000000..000127}.tar``), an
            ``s3://`` or ``gs://`` URL (fsspec; the store's standard variables), or several joined
            by ``::``.
        val: the validation shards, as `train`; None: no validation.
        test: the test shards, as `train`; None: no test set.
        num_classes: the number of classes (the ``cls`` targets are 0 to num_classes - 1).
        input_key: the input member's extension; None: the first of png, jpg, jpeg, npy that the
            first sample has.
        target_key: the target member's extension (an integer class as text).
        shuffle_buffer: the samples shuffled together within the shuffled shard order; 0: no
            shuffle.
        index_dir: where the shards' indexes are cached (relative paths: to the working dir).
        on_error: ``raise`` (a sample that cannot be read stops the run, naming its shard) or
            ``skip`` (left out of its batch, logged).
        **kwargs (Any): the ``DataModule`` arguments (``batch_size``, ``num_workers``, ``seed``, ...).

    Raises:
        ConfigError: for a setting out of range; the shards themselves are checked in ``datasets()``.
    """

    def __init__(
        self,
        train: str,
        val: str | None = None,
        test: str | None = None,
        num_classes: int = 10,
        input_key: str | None = None,
        target_key: str = "cls",
        shuffle_buffer: int = 1000,
        index_dir: str = "outputs/.shard_index",
        on_error: str = "raise",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ConfigError(f"data.num_classes must be a whole number >= 2, got {num_classes!r}")
        if isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, int) or shuffle_buffer < 0:
            raise ConfigError(
                f"data.shuffle_buffer must be a whole number >= 0 (0: no shuffle), got {shuffle_buffer!r}"
            )
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"data.on_error={on_error}: give raise (stop, naming the shard) or skip")
        if input_key is not None and input_key not in INPUT_KEYS:
            raise ConfigError(
                f"data.input_key={input_key}: give one of {', '.join(INPUT_KEYS)}, or null (the first present)"
            )
        self.urls = {
            "train": expand_urls(train, "data.train"),
            **{name: expand_urls(spec, f"data.{name}") for name, spec in (("val", val), ("test", test)) if spec},
        }
        self.num_classes, self.input_key, self.target_key = num_classes, input_key, target_key
        self.shuffle_buffer, self.index_dir, self.on_error = shuffle_buffer, Path(index_dir), on_error
        self._sizes: list[int] = []
        if on_error == "skip":
            self.collate = _skip_unreadable

    def _dataset(self, split: str, shards: list[list[dict[str, Any]]]) -> ShardDataset:
        return ShardDataset(
            _Index(self.urls[split], shards, self.input_key, self.target_key), self.input_key, self.on_error
        )  # type: ignore[arg-type]

    def datasets(self) -> tuple[Dataset, Dataset | None, Dataset | None]:
        """The train, validation and test shards as datasets, indexed (or the cached indexes read).

        Returns:
            The train set, then the validation and test sets (None where not given).

        Raises:
            ConfigError: a shard that does not exist or cannot be reached, a truncated tar, a sample
                without the input or target member, a first sample that cannot be decoded.
        """
        indexed = {split: _load_index(urls, f"data.{split}", self.index_dir) for split, urls in self.urls.items()}
        first = indexed["train"][0][0]
        if self.input_key is None:
            present = [k for k in INPUT_KEYS if k in first["members"]]
            if not present:
                raise ConfigError(
                    f"{self.urls['train'][0]}: its first sample has no input member of a known kind "
                    f"({', '.join(INPUT_KEYS)}; it has {', '.join(sorted(first['members']))}); set data.input_key"
                )
            self.input_key = present[0]
        sets = {split: self._dataset(split, shards) for split, shards in indexed.items()}
        train = sets["train"]
        try:
            x, _ = train[0]  # type: ignore[misc]
        except ShardReadError as exc:
            raise ConfigError(str(exc).partition(". Replace")[0]) from None
        self.input_shape = tuple(x.shape)
        self.in_channels = int(x.shape[0]) if x.ndim == 3 else 1
        self.image_size = int(x.shape[-1])
        self._sizes = train.shard_sizes()
        return train, sets.get("val"), sets.get("test")

    def train_sampler(self, train: Dataset, rank: int, replicas: int) -> SeededRandomSampler:
        """The shard-local shuffled order (``ShardOrderSampler``).

        Args:
            train: the train dataset.
            rank: this process's rank.
            replicas: the number of processes sharing the data.

        Returns:
            The sampler.
        """
        return ShardOrderSampler(train, self._sizes, self.shuffle_buffer, self.seed, rank, replicas)

    def describe(self) -> dict[str, Any]:
        """What models need to know: ``in_channels``, ``image_size`` (the last dimension of the
        first input) and ``num_classes``.

        Returns:
            The values by model-argument name.
        """
        return {"in_channels": self.in_channels, "image_size": self.image_size, "num_classes": self.num_classes}
