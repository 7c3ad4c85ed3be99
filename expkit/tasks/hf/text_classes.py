"""``TextClasses``: text classification on snippets of the standard library's sources (labelled
by package) or a local ``.csv``/``.jsonl`` file, tokenised to a fixed length."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from expkit.core.errors import ConfigError
from expkit.data import DataModule, check_fractions
from expkit.tasks.hf.tokenizer import SPECIAL, _check_tokenizer_file, _needs, _quiet_datasets, bpe_tokenizer

__all__ = ["STDLIB_PACKAGES", "TextClasses"]


STDLIB_PACKAGES = ("asyncio", "email", "unittest", "xml")


class TextClasses(DataModule):
    """Text classification through ``tokenizers`` and ``datasets``.

    ``source``: ``stdlib`` (snippets of ``lines`` non-blank lines of the Python source files of
    the standard-library packages ``packages`` that ship with CPython, labelled by package,
    at most ``max_per_class`` each) or a local ``.csv``/``.jsonl`` file with ``text`` and
    ``label`` columns (read with ``load_dataset``). Texts are shuffled with ``split_seed`` and
    split into train, val and test; a BPE tokenizer is trained on the training texts (or
    ``tokenizer`` loaded); each text is cut or padded to ``max_length`` tokens. Batches are
    dicts: ``input_ids``, ``attention_mask``, ``labels``. ``describe()``: ``num_classes``,
    ``vocab_size``, ``tokenizer_json``, ``pad_token_id``; ``class_names()``: the labels.

    Args:
        source: ``stdlib``, or a local ``.csv`` or ``.jsonl`` file with ``text`` and ``label`` columns.
        packages: the standard-library packages whose sources are the classes (``source=stdlib``).
        lines: the non-blank lines per snippet (``source=stdlib``).
        max_per_class: the most snippets per package (``source=stdlib``).
        tokenizer: a ``tokenizer.json`` to load; None trains a BPE on the training texts.
        vocab_size: the vocabulary size of the trained BPE.
        max_length: the tokens each text is cut or padded to.
        val_fraction: the share of the texts for validation (at least one text).
        test_fraction: the share of the texts for test (0: no test set).
        split_seed: the seed of the shuffle before the split.
        cache_dir: the cache dir of ``datasets`` and the trained tokenizer; None: ``.hf_cache``.
        **kwargs: the ``DataModule`` arguments (``batch_size``, ``num_workers``, ...).

    Raises:
        ConfigError: when ``tokenizers`` or ``datasets`` is not installed, the fractions are out
            of range, or `tokenizer` is not a file.
    """

    def __init__(
        self,
        source: str = "stdlib",
        packages: tuple[str, ...] | list[str] = STDLIB_PACKAGES,
        lines: int = 6,
        max_per_class: int = 600,
        tokenizer: str | None = None,
        vocab_size: int = 2000,
        max_length: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
        cache_dir: str | None = None,
        streaming: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _needs("tokenizers")
        _needs("datasets")
        self.streaming = bool(streaming)
        check_fractions(val_fraction, test_fraction)
        _check_tokenizer_file(tokenizer)
        self.source, self.packages, self.lines, self.max_per_class = source, list(packages), lines, max_per_class
        self.tokenizer_path, self.vocab_size, self.max_length = tokenizer, vocab_size, max_length
        self.val_fraction, self.test_fraction, self.split_seed = val_fraction, test_fraction, split_seed
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else Path(".hf_cache")
        self.tokenizer: Any = None
        self.names: list[str] = []

    def _stdlib(self) -> Any:
        """(text, label) rows: snippets of each package's source, in a fixed order."""
        root = _stdlib()
        for label, package in enumerate(self.packages):
            files = sorted(f for f in (root / package).rglob("*.py") if "test" not in f.relative_to(root).parts)
            count = 0
            for file in files:
                lines = [
                    line for line in file.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()
                ]
                for start in range(0, len(lines) - self.lines + 1, self.lines):
                    if count >= self.max_per_class:
                        break
                    yield {"text": "\n".join(lines[start : start + self.lines]), "label": label}
                    count += 1

    def _rows(self) -> Any:
        from datasets import Dataset, load_dataset

        cache = str(self.cache_dir / "datasets")
        if self.source == "stdlib":
            root = _stdlib()
            for package in self.packages:  # (checked here: an error inside the generator reaches us wrapped)
                if not list((root / package).glob("*.py")):
                    raise ConfigError(
                        f"data.packages: {package} is not a standard-library package of this Python "
                        f"({root}); e.g. asyncio, email, json, unittest, xml"
                    )
            self.names = list(self.packages)
            return Dataset.from_generator(self._stdlib, cache_dir=cache)
        path = Path(self.source).expanduser()
        kind = {".csv": "csv", ".jsonl": "json", ".json": "json"}.get(path.suffix.lower())
        if kind is None or not path.is_file():
            raise ConfigError(
                f"data.source={self.source}: give stdlib, or a .csv or .jsonl file with text and label columns"
            )
        rows = load_dataset(kind, data_files=str(path), split="train", cache_dir=cache)
        missing = {"text", "label"} - set(rows.column_names)
        if missing:
            raise ConfigError(
                f"data.source={self.source}: no {', '.join(sorted(missing))} column (it has "
                f"{', '.join(rows.column_names)})"
            )
        if not len(rows):
            raise ConfigError(f"data.source={self.source}: the file holds no rows")
        self.names = sorted({str(v) for v in rows["label"]})
        index = {name: i for i, name in enumerate(self.names)}
        labels = [index[str(v)] for v in rows["label"]]
        return rows.remove_columns("label").add_column("label", labels)

    def datasets(self) -> tuple[Any, Any, Any]:
        """The tokenised train, validation and test texts; loads or trains the tokenizer.

        Returns:
            The train and validation sets, and the test set (None when it is empty); their items
                are dicts of ``input_ids``, ``attention_mask`` and ``labels``.

        Raises:
            ConfigError: when a package is not in the standard library, the file is of another
                kind, lacks a column or holds no rows, `tokenizer` is not a tokenizer.json, or there
                are too few texts to split.
        """
        with _quiet_datasets():
            rows = self._rows().shuffle(seed=self.split_seed)
        n = len(rows)
        n_val, n_test = max(1, int(self.val_fraction * n)), int(self.test_fraction * n)
        train = rows.select(range(n - n_val - n_test))
        if not len(train):
            raise ConfigError(f"data.source={self.source}: too few texts ({n}) to split into train and val")
        self.tokenizer = bpe_tokenizer(list(train["text"]), self.tokenizer_path, self.vocab_size, self.cache_dir)
        self.tokenizer.enable_truncation(self.max_length)
        pad = self.tokenizer.token_to_id(SPECIAL[1])
        self.tokenizer.enable_padding(pad_id=pad, pad_token=SPECIAL[1], length=self.max_length)

        def encoded(part: Any) -> Any:
            if not len(part):
                return None
            encodings = self.tokenizer.encode_batch(list(part["text"]))
            return _Encoded(
                torch.tensor([e.ids for e in encodings]),
                torch.tensor([e.attention_mask for e in encodings]),
                torch.tensor(list(part["label"])),
            )

        parts = (train, rows.select(range(n - n_val - n_test, n - n_test)), rows.select(range(n - n_test, n)))
        return tuple(encoded(part) for part in parts)  # type: ignore[return-value]

    def describe(self) -> dict[str, Any]:
        """What a model needs to know of the data, by constructor-argument name.

        Returns:
            ``num_classes``, ``vocab_size``, ``tokenizer_json``, ``pad_token_id`` and ``max_length``.

        Raises:
            RuntimeError: when ``datasets()`` has not run yet.
        """
        if self.tokenizer is None:
            raise RuntimeError("TextClasses.describe() needs the tokenizer: call loaders() or datasets() first")
        return {
            "num_classes": len(self.names),
            "vocab_size": self.tokenizer.get_vocab_size(),
            "tokenizer_json": self.tokenizer.to_str(),
            "pad_token_id": self.tokenizer.token_to_id(SPECIAL[1]),
            "max_length": self.max_length,
        }

    def class_names(self) -> list[str] | None:
        """The labels, in class-index order.

        Returns:
            The package names (``source=stdlib``) or the file's labels, sorted; None before
                ``datasets()`` has run.
        """
        return self.names or None


def _stdlib() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"])


class _Encoded(torch.utils.data.Dataset):
    """Tokenised texts with their labels: dict items as a sequence classifier takes them."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> None:
        self.ids, self.mask, self.labels = ids, mask, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index], "labels": self.labels[index]}
