"""``data=webdataset``: WebDataset tar shards (as ``webdataset.ShardWriter`` writes them), on a
local disk or in object storage (``s3://``, ``gs://``: fsspec), read by index.

Every shard is indexed once (where each sample's members lie in the tar: offsets and sizes,
read from the tar headers by the standard library's ``tarfile``), and the index is cached
beside the runs (``data.index_dir``), keyed by the shard's URL, size, modification time and a
content fingerprint (``expkit.data.shard_index``).
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

import io
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from expkit.core.errors import ConfigError
from expkit.data.datasets import DataModule
from expkit.data.shard_index import expand_urls, is_url, load_index, open_shard
from expkit.samplers import SeededRandomSampler

__all__ = [
    "INPUT_KEYS",
    "ShardDataset",
    "ShardOrderSampler",
    "ShardReadError",
    "WebDatasetData",
]

log = logging.getLogger("expkit")

INPUT_KEYS = ("png", "jpg", "jpeg", "npy")  # data.input_key null: the first of these a sample has


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


class _Index:
    """Where each readable sample of a list of shards lies: the shard, and its input's and target's
    (offset, size), as compact tensors (about 40 bytes a sample).

    Args:
        urls: the shards.
        entries: their indexes (``shard_index.load_index``).
        input_key: the input member's extension.
        target_key: the target member's extension.
        skip: leave out (and count) the samples that cannot be read (a member missing, or past the
            end of a cut tar); False: refuse the shard, naming it.
        key: the setting that names the shards, for messages (``data.train``).

    Raises:
        ConfigError: without `skip`, a cut tar or a sample without its input or target member.
    """

    def __init__(
        self, urls: list[str], entries: list[dict[str, Any]], input_key: str, target_key: str, skip: bool, key: str
    ):
        self.urls = urls
        self.fingerprints = [entry["fingerprint"] for entry in entries]
        self.sizes: list[int] = []
        self.left_out = 0  # the samples of the index that cannot be read (skip)
        rows = []
        for shard, entry in enumerate(entries):
            if entry.get("cut") and not skip:
                raise ConfigError(
                    f"{key}: {urls[shard]} is not a readable tar ({entry['cut']}); it may be truncated: write it again, "
                    "or skip what cannot be read with data.on_error=skip"
                )
            problems = []
            for sample in entry["samples"]:
                problem = _unreadable(sample["members"], input_key, target_key, entry["size"])
                if problem is None:
                    rows.append([shard, *sample["members"][input_key], *sample["members"][target_key]])
                elif not skip:
                    raise ConfigError(f"{key}: {urls[shard]}: sample {sample['key']!r} {problem}")
                else:
                    problems.append(f"sample {sample['key']!r} {problem.partition(';')[0]}")
            if problems:
                log.warning("Skipped: %s: %d samples cannot be read (%s)", urls[shard], len(problems), problems[0])
            self.sizes.append(len(entry["samples"]) - len(problems))
            self.left_out += len(problems)
        self.rows = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)

    def __len__(self) -> int:
        return len(self.rows)


def _unreadable(members: dict[str, list[int]], input_key: str, target_key: str, size: int) -> str | None:
    """Why a sample of the index cannot be read (a member missing or cut short), or None."""
    for ext in (input_key, target_key):
        if ext not in members:
            return (
                f"has no .{ext} member (it has {', '.join(sorted(members))}); set data.input_key / "
                "data.target_key to the extensions the shards hold"
            )
        if sum(members[ext]) > size:
            return (
                f"is cut short: its .{ext} member ends at byte {sum(members[ext])} of {size}; the tar is truncated: "
                "write it again, or skip what cannot be read with data.on_error=skip"
            )
    return None


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
            handle = self.open[url] = open_shard(url)  # (kept open; closed when evicted)
        if not is_url(url):
            data = os.pread(handle.fileno(), size, offset)
        else:
            handle.seek(offset)
            data = handle.read(size)
        if len(data) != size:
            raise ShardReadError(f"{url}: a member at byte {offset} is cut short ({len(data)} of {size} bytes)")
        return data


def _unreachable(where: str, url: str, exc: BaseException) -> str:
    """What to say when a shard's bytes did not come: the store was down or the disk failed, which
    says nothing against the shard itself (so ``data.on_error=skip`` does not skip it: an outage
    would drop samples without a word)."""
    cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    if is_url(url):
        return (
            f"{where}: the store did not answer or refused the read ({cause}); the shard is not known to be "
            "damaged. Check that the store is up and reachable from here, then resume (resume=true)"
        )
    return f"{where}: the disk did not give it ({cause}). Check the file system, then resume (resume=true)"


def _decode(data: bytes, ext: str) -> torch.Tensor:
    """A member's bytes as a tensor: an image as (C, H, W) floats in [0, 1]; an array of floats as
    float32, of 8-bit values (uint8: how images are stored) as floats in [0, 1], as torchvision's
    ``ToTensor`` and ``ToDtype(torch.float32, scale=True)`` scale them and as ``expkit.predict``
    scales raw uint8 inputs; any other array as it is (``WebDatasetData.datasets`` refuses those)."""
    import numpy as np

    if ext == "npy":
        array = np.load(io.BytesIO(data), allow_pickle=False)
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if tensor.dtype == torch.uint8:
            return tensor.float().div_(255)
        return tensor.float() if tensor.is_floating_point() else tensor
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        array = np.asarray(image.convert("L" if image.mode in ("L", "1", "I", "I;16") else "RGB"))
    tensor = torch.from_numpy(array.copy())
    tensor = tensor.unsqueeze(0) if tensor.ndim == 2 else tensor.permute(2, 0, 1)
    return tensor.float().div_(255)


def _decode_target(data: bytes) -> int:
    return int(data.decode().strip())


class _Skipped:
    """The samples ``data.on_error=skip`` left out, by split (result.json's ``skipped_samples``): those
    the index showed cannot be read, counted at the start, and those that failed in the run, each
    marked in a shared-memory flag (a DataLoader worker's marks reach the main process; a sample
    that fails every epoch counts once)."""

    def __init__(self) -> None:
        self.at_start: dict[str, int] = {}
        self.failed: dict[str, torch.Tensor] = {}

    def add(self, split: str, index: _Index) -> None:
        self.at_start[split] = index.left_out
        self.failed[split] = torch.zeros(len(index), dtype=torch.bool).share_memory_()

    def counts(self) -> dict[str, int]:
        return {split: self.at_start[split] + int(flags.sum()) for split, flags in self.failed.items()}


class ShardDataset(Dataset):
    """The samples of a list of tar shards, by index: ``(input, target)`` pairs.

    Args:
        index: where each sample lies.
        input_key: the input member's extension (``png``, ``jpg``, ``jpeg``, ``npy``).
        num_classes: the targets are 0 to num_classes - 1; one outside stops the run naming its shard.
        skipped: where ``data.on_error=skip`` counts what it leaves out, and `split` the split this is;
            None: a sample that cannot be read stops the run naming its shard.
        split: the name of this split in `skipped`.
    """

    def __init__(
        self, index: _Index, input_key: str, num_classes: int, skipped: _Skipped | None = None, split: str = "train"
    ) -> None:
        self.index, self.input_key, self.num_classes = index, input_key, num_classes
        self.skipped, self.split = skipped, split
        if skipped is not None:
            skipped.add(split, index)
        self.reader = _Reader()

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int] | None:
        shard, in_off, in_size, tg_off, tg_size = self.index.rows[i].tolist()
        url = self.index.urls[shard]
        where = f"{url}: sample {i - sum(self.index.sizes[:shard])} of the shard"
        try:
            members = self.reader.read(url, in_off, in_size), self.reader.read(url, tg_off, tg_size)
        except ShardReadError as exc:  # (the shard holds less than its index says: its content)
            return self._damaged(i, where, exc)
        except Exception as exc:  # the store or the disk did not give the bytes: the shard may be fine
            raise ShardReadError(_unreachable(where, url, exc)) from None
        try:
            x, y = _decode(members[0], self.input_key), _decode_target(members[1])
        except Exception as exc:
            return self._damaged(i, where, exc)
        if not 0 <= y < self.num_classes:  # (the index's labels are checked at the start: a label it could not read)
            raise ShardReadError(
                f"{where} has the label {y}, out of data.num_classes={self.num_classes} (0 to "
                f"{self.num_classes - 1}): set data.num_classes to the number of classes"
            )
        return x, y

    def _damaged(self, i: int, where: str, exc: BaseException) -> None:
        """Sample `i`, whose content cannot be read: skipped and counted (``data.on_error=skip``), else
        the run stops naming it."""
        if self.skipped is None:
            raise ShardReadError(
                f"{where} cannot be read ({exc}). Replace the shard and resume (resume=true), or skip such "
                "samples with data.on_error=skip"
            ) from None
        log.warning("Skipped: %s cannot be read (%s)", where, exc)
        self.skipped.failed[self.split][i] = True

    def shard_sizes(self) -> list[int]:
        """The number of samples of each shard, in order."""
        return self.index.sizes

    def skipped_samples(self) -> dict[str, int] | None:
        """The samples ``data.on_error=skip`` left out so far, by split (in this process: under
        torchrun, rank 0's share of what failed in the run); None without ``on_error=skip``.

        Returns:
            The counts by split (``train``, ``val``, ``test``).
        """
        return self.skipped.counts() if self.skipped is not None else None

    def data_state(self) -> dict[str, Any]:
        """What a checkpoint records of the data (``expkit.checkpoint.run_checkpoint``): the
        number of shards and each one's content fingerprint, in order.

        Returns:
            ``shards`` and ``fingerprints`` (16 hex digits a shard, joined).
        """
        return {"shards": len(self.index.urls), "fingerprints": "".join(self.index.fingerprints)}

    def check_data_state(self, saved: dict[str, Any]) -> None:
        """Refuse to resume on other data than the checkpoint's (``data_state``): a shard replaced by
        one with other content (``cp -p`` and ``rsync -a`` keep its size and time) would mix two
        datasets in one run.

        Args:
            saved: the checkpoint's ``data_state``.

        Raises:
            ConfigError: naming the first shard that changed, or the numbers of shards.
        """
        then, now = saved.get("fingerprints"), self.data_state()["fingerprints"]
        if not isinstance(then, str) or then == now:
            return
        if len(then) != len(now):
            raise ConfigError(
                f"the data changed: data.{self.split} names {len(self.index.urls)} shards, the checkpoint's run "
                f"trained on {saved.get('shards')}; resume with the shards it was trained on, or start a new run "
                "from its weights with load_from=<checkpoint> in another hydra.run.dir"
            )
        changed = next(i for i in range(0, len(now), 16) if then[i : i + 16] != now[i : i + 16]) // 16
        raise ConfigError(
            f"the data changed: {self.index.urls[changed]} is not the shard the checkpoint's run trained on "
            "(its content differs); put the original back to resume, or start a new run from the weights with "
            "load_from=<checkpoint> in another hydra.run.dir"
        )


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

    readable = [sample for sample in batch if sample is not None]
    if not readable:  # (a batch has no size 0: the loss of nothing is not a number)
        raise ShardReadError(
            f"none of the {len(batch)} samples of a batch can be read (the Skipped: lines name them): the shards "
            "are damaged beyond skipping; replace them and resume (resume=true)"
        )
    return default_collate(readable)


class WebDatasetData(DataModule):
    """``data=webdataset``: image or array classification data in WebDataset tar shards.

    Args:
        train: the train shards: a path, a brace pattern (``dir/train-{000000..000127}.tar``), an
            ``s3://`` or ``gs://`` URL (fsspec; the store's standard variables), or several joined
            by ``::``.
        val: the validation shards, as `train`; None: no validation.
        test: the test shards, as `train`; None: no test set.
        num_classes: the number of classes (the ``cls`` targets are 0 to num_classes - 1: the
            largest label the index read is checked before training).
        input_key: the input member's extension; None: the first of png, jpg, jpeg, npy that the
            first sample has.
        target_key: the target member's extension (an integer class as text).
        shuffle_buffer: the samples shuffled together within the shuffled shard order; 0: no
            shuffle.
        index_dir: where the shards' indexes are cached (relative paths: to the working dir).
        on_error: ``raise`` (a sample that cannot be read stops the run, naming its shard) or
            ``skip`` (left out of the index or of its batch, logged, counted in result.json).
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
        self._skipped = _Skipped() if on_error == "skip" else None
        if on_error == "skip":
            self.collate = _skip_unreadable

    def _dataset(self, split: str, entries: list[dict[str, Any]]) -> ShardDataset:
        skip = self._skipped is not None
        index = _Index(self.urls[split], entries, self.input_key, self.target_key, skip, f"data.{split}")  # type: ignore[arg-type]
        if not len(index):
            raise ConfigError(f"data.{split}: no sample of its {len(entries)} shards can be read (see Skipped: above)")
        return ShardDataset(index, self.input_key, self.num_classes, self._skipped, split)  # type: ignore[arg-type]

    def _check_labels(self, indexed: dict[str, list[dict[str, Any]]]) -> None:
        """The labels the index read are classes 0 to num_classes - 1 (else a cross-entropy fails at
        the first step, on a target out of bounds): the largest and the smallest, with their shards."""
        seen = [
            (entry["labels"], f"data.{split}: {url}")
            for split, entries in indexed.items()
            for url, entry in zip(self.urls[split], entries)
            if entry.get("labels")
        ]
        if not seen:
            return
        (_, high, key), where = max(seen, key=lambda s: s[0][1])
        (low, _, _), low_where = min(seen, key=lambda s: s[0][0])
        rule = f"the .{self.target_key} labels must be 0 to data.num_classes - 1"
        if high >= self.num_classes:
            raise ConfigError(
                f"data.num_classes={self.num_classes}, but the largest label is {high} ({where}, sample {key!r}): "
                f"set data.num_classes={high + 1} ({rule})"
            )
        if low < 0:
            raise ConfigError(f"data.{self.target_key}: the label {low} in {low_where} is negative ({rule})")

    def _first_input(self, train: ShardDataset) -> torch.Tensor:
        """The first readable sample's input (with on_error=skip, the first of those that can be read)."""
        for i in range(len(train)):
            try:
                sample = train[i]
            except ShardReadError as exc:
                raise ConfigError(str(exc).partition(". Replace")[0]) from None
            if sample is not None:
                x = sample[0]
                break
        else:
            raise ConfigError(f"data.train: no sample of its {len(self.urls['train'])} shards can be read")
        if not x.is_floating_point():  # (uint8 arrays are floats in [0, 1] by now)
            raise ConfigError(
                f"data.train: the .{self.input_key} inputs are {str(x.dtype).removeprefix('torch.')} arrays, which "
                "the models cannot take: store float32, or uint8 (read as floats in [0, 1], as torchvision's "
                "ToTensor scales images)"
            )
        return x

    def datasets(self) -> tuple[Dataset, Dataset | None, Dataset | None]:
        """The train, validation and test shards as datasets, indexed (or the cached indexes read).

        Returns:
            The train set, then the validation and test sets (None where not given).

        Raises:
            ConfigError: a shard that does not exist or cannot be reached, a truncated tar, a sample
                without the input or target member, a first sample that cannot be decoded.
        """
        indexed = {
            split: load_index(urls, f"data.{split}", self.index_dir, self.target_key)
            for split, urls in self.urls.items()
        }
        first = indexed["train"][0]["samples"][0]
        if self.input_key is None:
            present = [k for k in INPUT_KEYS if k in first["members"]]
            if not present:
                raise ConfigError(
                    f"{self.urls['train'][0]}: its first sample has no input member of a known kind "
                    f"({', '.join(INPUT_KEYS)}; it has {', '.join(sorted(first['members']))}); set data.input_key"
                )
            self.input_key = present[0]
        self._check_labels(indexed)
        sets = {split: self._dataset(split, entries) for split, entries in indexed.items()}
        train = sets["train"]
        x = self._first_input(train)
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
