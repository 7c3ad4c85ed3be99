"""Datasets as small data modules: digits (embedded in scikit-learn), ImageFolder, random images.

A data module describes its data for models (``describe()``: ``in_channels``, ``image_size``,
``num_classes`` for images; anything else, e.g. ``num_features`` or ``vocab_size``, for other
data), which fills the model arguments of those names and which configs read as
``${data_info:KEY}``; and it builds the train/val/test DataLoaders. The train order depends
only on (seed, epoch), so a resumed run sees exactly the batches an uninterrupted one would
(``expkit.samplers``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from expkit.core.errors import ConfigError
from expkit.samplers import SeededRandomSampler, ShardSampler, seed_worker

__all__ = [
    "DataModule",
    "DigitsData",
    "FakeImageData",
    "ImageFolderData",
    "RandomImages",
    "check_fractions",
    "digits_csv",
    "load_digits",
    "preprocess",
    "stratified_split",
]

# scikit-learn's digits count the ink in 4x4 blocks of a 32x32 bitmap: pixel values 0-16
DIGIT_LEVELS = 16.0


def preprocess(raw: torch.Tensor, preprocessing: Mapping[str, Any], shape: Sequence[int] | None = None) -> torch.Tensor:
    """Raw inputs -> the model's, as a data module's ``preprocessing()`` (or an export's sidecar
    JSON) records it: ``(raw - mean) / std`` as float32, reshaped to `shape` when each input has
    its size. Inputs of another dtype than ``only_dtype``, when it is set, are taken as they are
    (floats as float32, integers unchanged).

    Args:
        raw: the inputs, first dimension the batch.
        preprocessing: ``mean`` and ``std`` (numbers, or one per feature: the last dimension),
            and optionally ``only_dtype`` (e.g. ``uint8``).
        shape: the shape of one input as the model takes it; None: not reshaped.

    Returns:
        The inputs as the model takes them.
    """
    only = preprocessing.get("only_dtype")
    if only is not None and str(raw.dtype).removeprefix("torch.") != only:
        return raw.float() if raw.is_floating_point() else raw
    mean = torch.as_tensor(preprocessing["mean"], dtype=torch.float32)
    std = torch.as_tensor(preprocessing["std"], dtype=torch.float32)
    x = (raw.float() - mean) / std
    if shape is not None and len(x) and x[0].numel() == torch.Size(shape).numel():
        x = x.reshape(len(x), *shape)
    return x


def check_fractions(val_fraction: float, test_fraction: float) -> None:
    """The shares of the data held out for validation and test: each in (0, 1) (test may be 0:
    no test set), together less than all of it.

    Args:
        val_fraction: the share held out for validation, in (0, 1).
        test_fraction: the share held out for test, in [0, 1); 0 means no test set.

    Raises:
        ConfigError: when a fraction is out of its range or the two sum to 1 or more.
    """
    if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ConfigError("data.val_fraction and data.test_fraction must be in (0, 1) and sum to less than 1")


class DataModule:
    """Base class: subclasses implement ``datasets()`` -> (train, val, test-or-None), and say
    what models need to know of the data in ``describe()`` (image modules set the class
    attributes ``in_channels``, ``image_size``, ``num_classes``, which the default returns).

    Args:
        batch_size: the batch size of every loader (per process under DDP).
        num_workers: the DataLoader worker processes; 0 loads in the main process. Workers are
            kept across epochs and prefetch two batches each.
        pin_memory: whether the loaders pin host memory; ``"auto"``: when CUDA is available.
        seed: the seed of the train order (with the epoch) and of the workers' base seed.

    Raises:
        ConfigError: when `batch_size` is not a positive integer or `num_workers` is not an
            integer >= 0.
    """

    IMAGE_KEYS = ("in_channels", "image_size", "num_classes")

    def __init__(self, batch_size: int = 32, num_workers: int = 0, pin_memory: bool | str = "auto", seed: int = 0):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"data.batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"data.num_workers must be an integer >= 0, got {num_workers!r}")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = torch.cuda.is_available() if pin_memory == "auto" else bool(pin_memory)
        self.seed = seed

    def datasets(
        self,
    ) -> tuple[Dataset, Dataset | Mapping[str, Dataset] | None, Dataset | Mapping[str, Dataset] | None]:
        """(train, val, test); val and test may each be None, one dataset, or named datasets
        (``{"clean": ..., "noisy": ...}``: reported as ``val/clean/acc``, ``val/noisy/acc``).

        Returns:
            The train dataset, then the validation and the test data, each None, one dataset or a
                mapping of names to datasets.
        """
        raise NotImplementedError

    def input_files(self) -> list[str]:
        """The files the data is read from, for the run's provenance (``expkit.data.inputs``).

        Returns:
            Their paths; none here (a subclass names its own).
        """
        return []

    def describe(self) -> dict[str, Any]:
        """What models need to know of the data, by argument name; called after ``loaders()``,
        so values found while loading (a vocabulary) can be given.

        Returns:
            The values by model-argument name; by default those of ``in_channels``,
                ``image_size`` and ``num_classes`` that the class sets.
        """
        return {key: getattr(self, key) for key in self.IMAGE_KEYS if hasattr(self, key)}

    # -- prediction on new data (python -m expkit.predict): the transforms training used ----------
    def predict_input(self, raw: torch.Tensor) -> torch.Tensor:
        """A batch of new inputs as users hold them (rows of a .npy/.pt file or a CSV, in the
        dataset's own units) -> what the model takes. Default: the numbers ``preprocessing()``
        states, by default 8-bit images scaled to [0, 1] (as ToTensor does), other floats
        unchanged, integers (token ids) kept as they are.

        Args:
            raw: the inputs, first dimension the batch, as read from the file.

        Returns:
            The inputs as the model takes them.
        """
        steps = self.preprocessing()
        # a subclass that states no numbers: its inputs are taken as they are
        if steps is None:
            return raw.float() if raw.is_floating_point() else raw
        return preprocess(raw, steps)

    def preprocessing(self) -> dict[str, Any] | None:
        """What ``predict_input`` does to raw inputs, as numbers another runtime can apply
        (``expkit.export`` writes them beside an exported model): ``(raw - mean) / std``, then
        reshaped to the model's input shape (``preprocess``). A subclass may override this
        alone (the default ``predict_input`` applies it); one that overrides ``predict_input``
        overrides this too.

        Returns:
            ``raw`` (what raw inputs are), ``mean`` and ``std`` (numbers, or one per feature),
                ``formula``, and ``only_dtype`` when only inputs of that dtype are scaled. By
                default 8-bit values divided by 255. None when a subclass overrides
                ``predict_input`` but not this: its transform is not known as numbers.
        """
        # a subclass's own predict_input would not match the default numbers: an export would
        # record numbers that are not what the model was trained on, so none are stated
        if type(self).predict_input is not DataModule.predict_input:
            return None
        return {
            "raw": "8-bit values (uint8) are scaled to [0, 1], as ToTensor scales images; other inputs as they are",
            "mean": 0.0,
            "std": 255.0,
            "only_dtype": "uint8",
            "formula": "(raw - mean) / std",
        }

    def postprocessing(self) -> dict[str, Any] | None:
        """What ``predict_output`` does to a regressor's outputs, as numbers another runtime can
        apply: ``output * std + mean``. A subclass may override this alone (the default
        ``predict_output`` applies it).

        Returns:
            ``mean``, ``std`` and ``formula``; by default 0 and 1 (outputs as they are). None when a
                subclass overrides ``predict_output`` but not this.
        """
        # as for preprocessing(): no numbers rather than ones that are not what predict_output does
        if type(self).predict_output is not DataModule.predict_output:
            return None
        return {"mean": 0.0, "std": 1.0, "formula": "output * std + mean"}

    def predict_image(self, image: Any) -> torch.Tensor:
        """A PIL image -> one input, as this data's images reach the model: ``in_channels``
        (grey or RGB), resized to ``image_size``, scaled to [0, 1].

        Args:
            image: a PIL image.

        Returns:
            A float tensor of shape (``in_channels``, ``image_size``, ``image_size``).

        Raises:
            ConfigError: when the data module is not image data (it has no ``image_size``).
        """
        if not hasattr(self, "image_size"):
            raise ConfigError(f"{type(self).__name__} is not image data: give a .npy, .pt or .csv input")
        from torchvision.transforms import functional

        image = image.convert("L" if getattr(self, "in_channels", 3) == 1 else "RGB")
        size = self.image_size  # type: ignore[attr-defined]
        return functional.to_tensor(functional.resize(image, [size, size]))

    def class_names(self) -> list[str] | None:
        """The name of each class index, when the data has names (predictions report them).

        Returns:
            The names, in class-index order; None by default (no names).
        """
        return None

    def predict_output(self, values: torch.Tensor) -> torch.Tensor:
        """A regressor's outputs -> values in the dataset's own units. Default: unchanged.

        Args:
            values: the model's outputs.

        Returns:
            The values in the dataset's own units.
        """
        steps = self.postprocessing()
        return values if steps is None else values * steps["std"] + steps["mean"]

    def loaders(self) -> tuple[DataLoader, DataLoader | None, DataLoader | None]:
        """(train, val, test) DataLoaders; val or test is None when the data has none.

        Returns:
            The train loader (a ``SeededRandomSampler`` order, sharded under DDP), then the
                validation and test loaders: None, one loader, or a dict of loaders for named sets,
                each in order and sharded under DDP.
        """
        train, val, test = self.datasets()
        extra = {}
        if self.num_workers > 0:  # keep workers across epochs; prefetch two batches each
            extra = {"persistent_workers": True, "prefetch_factor": 2}

        def loader(ds: Dataset, sampler: Sampler | None) -> DataLoader:
            return DataLoader(
                ds,
                batch_size=self.batch_size,
                sampler=sampler,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                generator=torch.Generator().manual_seed(self.seed),  # the workers' base seed
                worker_init_fn=seed_worker,
                collate_fn=self.collate,
                **extra,
            )

        from expkit.core import distributed

        rank, replicas = distributed.rank_and_world()

        def eval_sampler(ds: Dataset) -> Sampler | None:
            return ShardSampler(ds, rank, replicas) if replicas > 1 else None  # type: ignore[arg-type]

        def eval_loader(ds: Any) -> Any:  # one loader, or one per named set, each sharded under DDP
            if ds is None:
                return None
            if isinstance(ds, Mapping):
                return {str(name): loader(d, eval_sampler(d)) for name, d in ds.items()}
            return loader(ds, eval_sampler(ds))

        return (
            loader(train, self.train_sampler(train, rank, replicas)),
            eval_loader(val),
            eval_loader(test),
        )

    def train_sampler(self, train: Dataset, rank: int, replicas: int) -> SeededRandomSampler:
        """The train order: a function of (seed, epoch) that a resume skips into, shared by the ranks.

        Args:
            train: the train dataset (its length is used).
            rank: this process's rank.
            replicas: the number of processes sharing the data.

        Returns:
            A ``SeededRandomSampler`` (a uniform permutation per epoch); a data module whose reads
                are faster in order (tar shards) returns one whose ``permutation`` keeps them near.
        """
        return SeededRandomSampler(train, self.seed, rank, replicas)  # type: ignore[arg-type]

    collate: Any = None  # the loaders' collate_fn; None: torch's default


class DigitsData(DataModule):
    """scikit-learn's 8x8 digits (1,797 images, 10 classes), split train/val/test, stratified.

    ``noisy_val`` > 0 validates on two named sets: ``clean`` (the val split) and ``noisy``
    (the same images plus Gaussian noise of that standard deviation, fixed by ``split_seed``),
    reported as ``val/clean/<metric>`` and ``val/noisy/<metric>``.

    Args:
        val_fraction: the share of the images held out for validation.
        test_fraction: the share held out for test (0: no test set).
        split_seed: the seed of the stratified split (and of the noise of the noisy set).
        noisy_val: the standard deviation of the noise of the ``noisy`` validation set; 0: one
            validation set.
        **kwargs (Any): the ``DataModule`` arguments (``batch_size``, ``num_workers``, ...).

    Raises:
        ConfigError: when the fractions are out of range or `noisy_val` is not a number >= 0.
    """

    in_channels, image_size, num_classes = 1, 8, 10

    def __init__(
        self,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
        noisy_val: float = 0.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_fractions(val_fraction, test_fraction)
        if not isinstance(noisy_val, (int, float)) or not 0 <= noisy_val < float("inf"):
            raise ConfigError(f"data.noisy_val must be a noise level >= 0 (0: no noisy set), got {noisy_val!r}")
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.noisy_val = noisy_val

    def input_files(self) -> list[str]:
        """The CSV the digits are read from (inside scikit-learn).

        Returns:
            Its path; none when this scikit-learn keeps the digits elsewhere.
        """
        csv = digits_csv()
        return [str(csv)] if csv.is_file() else []

    def predict_input(self, raw: torch.Tensor) -> torch.Tensor:
        """Digits as scikit-learn holds them: 64 pixel counts 0-16 per image (N x 64 or N x 8 x 8).

        Args:
            raw: the inputs, first dimension the batch.

        Returns:
            Inputs of 64 values each as (N, 1, 8, 8) floats in [0, 1]; others as floats, unchanged.
        """
        return preprocess(raw, self.preprocessing(), (1, 8, 8)) if raw[0].numel() == 64 else raw.float()

    def preprocessing(self) -> dict[str, Any]:
        """The digits' scaling (``load_digits``'s), as numbers.

        Returns:
            ``raw``, ``mean`` 0 and ``std`` 16 (the pixel counts' top), ``formula``.
        """
        return {
            "raw": "64 pixel counts 0-16 per image, as scikit-learn's load_digits holds them (N x 64 or N x 8 x 8)",
            "mean": 0.0,
            "std": DIGIT_LEVELS,
            "formula": "(raw - mean) / std",
        }

    def class_names(self) -> list[str]:
        """The digits' class names.

        Returns:
            ``"0"`` to ``"9"``.
        """
        return [str(digit) for digit in range(10)]

    def datasets(self) -> tuple[Dataset, Dataset | None, Dataset | None]:
        """The stratified train, validation and test splits of the digits.

        Returns:
            The train set, the validation set (a dict of ``clean`` and ``noisy`` sets when
                ``noisy_val`` > 0) and the test set (None when ``test_fraction`` is 0).
        """
        x, y = load_digits()
        held = self.val_fraction + self.test_fraction
        train_idx, rest = stratified_split(y, held, self.split_seed)
        test = None
        val_idx = rest
        if self.test_fraction > 0:
            val_part, test_part = stratified_split(y[rest], self.test_fraction / held, self.split_seed + 1)
            val_idx, test_idx = rest[val_part], rest[test_part]
            test = TensorDataset(x[test_idx], y[test_idx])
        val: Dataset | dict[str, Dataset] = TensorDataset(x[val_idx], y[val_idx])
        if self.noisy_val > 0:
            noise = torch.randn(x[val_idx].shape, generator=torch.Generator().manual_seed(self.split_seed + 2))
            val = {"clean": val, "noisy": TensorDataset(x[val_idx] + self.noisy_val * noise, y[val_idx])}
        return TensorDataset(x[train_idx], y[train_idx]), val, test


def digits_csv() -> Path:
    """The digits' CSV inside scikit-learn, found without importing it.

    Returns:
        The path of ``sklearn/datasets/data/digits.csv.gz`` (which a scikit-learn that stores the
            digits elsewhere lacks).

    Raises:
        ConfigError: when scikit-learn is not installed.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ConfigError("data=digits needs scikit-learn, which ships the digits: pip install scikit-learn")
    return Path(next(iter(spec.submodule_search_locations or [""]))) / "datasets" / "data" / "digits.csv.gz"


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The digits as (N, 1, 8, 8) floats in [0, 1] and (N,) labels.

    Reads the CSV that ships inside scikit-learn without importing scikit-learn (which
    costs about 1.5 s at start-up); falls back to ``sklearn.datasets.load_digits``.

    Returns:
        The images, shape (1797, 1, 8, 8), and their int64 labels, shape (1797,).

    Raises:
        ConfigError: when scikit-learn is not installed.
    """
    import numpy as np

    csv = digits_csv()
    if csv.is_file():
        table = np.loadtxt(csv, delimiter=",", dtype=np.float32)
        images, target = table[:, :-1], table[:, -1]
    else:  # a scikit-learn that stores it elsewhere
        from sklearn.datasets import load_digits as sklearn_digits

        bunch = sklearn_digits()
        images, target = bunch.data.astype(np.float32), bunch.target
    x = torch.from_numpy(images).reshape(-1, 1, 8, 8) / DIGIT_LEVELS
    return x, torch.as_tensor(target, dtype=torch.long)


def stratified_split(labels: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (kept, held out): about `fraction` of each class held out, chosen by `seed`.

    Args:
        labels: the class label of each sample.
        fraction: the share of each class to hold out (rounded per class).
        seed: the seed of the random choice.

    Returns:
        The sorted indices of the kept samples and the sorted indices of the held-out ones.
    """
    g = torch.Generator().manual_seed(seed)
    kept, held = [], []
    for c in torch.unique(labels):
        idx = torch.nonzero(labels == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_held = round(fraction * len(idx))
        held.append(idx[:n_held])
        kept.append(idx[n_held:])
    return torch.sort(torch.cat(kept)).values, torch.sort(torch.cat(held)).values


class RandomImages(Dataset):
    """``size`` random images and labels, each a function of ``offset + index`` alone: what
    torchvision's FakeData gives, without its per-item PIL round trip and without reseeding
    torch's global generator on every item. Pixels are uniform over the 256 levels of an
    8-bit image, scaled to [0, 1] as ``ToTensor`` scales them.

    Args:
        size: the number of images.
        shape: the shape of each image, (channels, height, width).
        num_classes: the number of classes the labels are drawn from.
        offset: added to each index to seed its item: datasets with other offsets hold other images.
    """

    def __init__(self, size: int, shape: tuple[int, ...], num_classes: int, offset: int = 0) -> None:
        self.size, self.shape, self.num_classes, self.offset = size, tuple(shape), num_classes, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} images")
        g = torch.Generator().manual_seed(self.offset + index)
        image = torch.randint(0, 256, self.shape, generator=g, dtype=torch.uint8).float().div_(255)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        return image, label


class FakeImageData(DataModule):
    """Random images (``RandomImages``), for throughput tests: the same images every run, no
    download, no torchvision needed.

    Args:
        train_size: the number of training images.
        val_size: the number of validation images (0: no validation set).
        test_size: the number of test images (0: no test set).
        in_channels: the number of channels of each image.
        image_size: the height and width of each image, in pixels.
        num_classes: the number of classes.
        **kwargs (Any): the ``DataModule`` arguments (``batch_size``, ``num_workers``, ...).
    """

    def __init__(
        self,
        train_size: int = 1024,
        val_size: int = 256,
        test_size: int = 0,
        in_channels: int = 3,
        image_size: int = 64,
        num_classes: int = 10,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.sizes = (train_size, val_size, test_size)
        self.in_channels, self.image_size, self.num_classes = in_channels, image_size, num_classes

    def datasets(self) -> tuple[Dataset, Dataset | None, Dataset | None]:
        """The random train, validation and test images.

        Returns:
            A ``RandomImages`` for each split, None for a split of size 0.
        """
        shape = (self.in_channels, self.image_size, self.image_size)
        train, val, test = (
            RandomImages(n, shape, self.num_classes, offset=i * 1_000_000) if n > 0 else None
            for i, n in enumerate(self.sizes)
        )
        return train, val, test  # type: ignore[return-value]


class ImageFolderData(DataModule):
    """Images on disk in torchvision's ImageFolder layout: ``root/{train,val[,test]}/<class>/<image>``.

    Args:
        root: the directory holding ``train/`` and ``val/`` (and optionally ``test/``).
        image_size: the height and width the images are resized to, in pixels.
        in_channels: 1 converts the images to greyscale; otherwise they are read as RGB.
        num_classes: the expected number of classes; None takes the number of class folders
            in ``train/``.
        **kwargs (Any): the ``DataModule`` arguments (``batch_size``, ``num_workers``, ...).

    Raises:
        ConfigError: when ``root/train`` or ``root/val`` is missing, or `num_classes` differs from
            the number of class folders.
    """

    def __init__(self, root: str, image_size: int = 32, in_channels: int = 3, num_classes: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.root = Path(root).expanduser()
        self.image_size, self.in_channels = image_size, in_channels
        if not (self.root / "train").is_dir() or not (self.root / "val").is_dir():
            raise ConfigError(
                f"data.root={root}: expected {self.root}/train/<class>/*.png and {self.root}/val/<class>/*.png "
                "(torchvision ImageFolder layout); nothing is downloaded. Point data.root at such a directory."
            )
        classes = sorted(p.name for p in (self.root / "train").iterdir() if p.is_dir())
        if num_classes is not None and num_classes != len(classes):
            raise ConfigError(f"data.num_classes={num_classes} but {self.root}/train has {len(classes)} class folders")
        self.num_classes = len(classes)
        self.classes = classes

    def class_names(self) -> list[str]:
        """The class folders' names.

        Returns:
            The names of the folders in ``root/train``, sorted (the class-index order).
        """
        return list(self.classes)

    def input_files(self) -> list[str]:
        """The files of the ``train``, ``val`` and ``test`` folders.

        Returns:
            Their paths, sorted.
        """
        return sorted(
            str(p) for split in ("train", "val", "test") for p in (self.root / split).rglob("*") if p.is_file()
        )

    def datasets(self) -> tuple[Dataset, Dataset | None, Dataset | None]:
        """The ``train``, ``val`` and ``test`` folders as torchvision ``ImageFolder`` datasets.

        Returns:
            The train and validation sets, and the test set (None without a ``test`` folder).
        """
        from torchvision import datasets, transforms

        steps = [transforms.Resize((self.image_size, self.image_size))]
        if self.in_channels == 1:
            steps.append(transforms.Grayscale(1))
        transform = transforms.Compose([*steps, transforms.ToTensor()])
        split = {s: datasets.ImageFolder(str(self.root / s), transform=transform) for s in ("train", "val")}
        test = (
            datasets.ImageFolder(str(self.root / "test"), transform=transform)
            if (self.root / "test").is_dir()
            else None
        )
        return split["train"], split["val"], test
