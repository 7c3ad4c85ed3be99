"""Hugging Face models, tokenizers and datasets (``pip install 'expkit[hf]'``), without any
download: models are built from a config (or a local ``from_pretrained`` directory),
tokenizers are trained on local text (or read from a local ``tokenizer.json``), text is read
through ``datasets`` from local files or the Python documentation that ships with CPython.

- ``TextBlocks``: a causal-LM data module: text -> a BPE tokenizer (``tokenizers``) ->
  token ids (``datasets``, cached beside the work dirs, not in the home dir) -> fixed-length
  blocks; batches are dicts (``input_ids``, ``labels``).
- ``causal_lm``: ``AutoModelForCausalLM.from_config`` (or ``from_pretrained`` of a local dir)
  sized to the tokenizer; wrapped in ``HFModel``.
- ``HFModel``: any ``transformers`` PreTrainedModel as an expkit model: dict batches passed as
  keyword arguments, the loss from the model's output, logits (shifted for a causal LM) for
  the metrics, ``generate`` for samples. ``expkit.config.build`` wraps a bare PreTrainedModel in it.
- ``SavePretrained`` and ``SampleText`` hooks: the trained model in transformers' own form
  (``save_pretrained``: config + safetensors, with the tokenizer), and generated samples
  after each validation.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from expkit.core.errors import ConfigError
from expkit.core.stages import Priority
from expkit.data import DataModule, check_fractions
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = [
    "SPECIAL",
    "STDLIB_PACKAGES",
    "HFModel",
    "SampleText",
    "SavePretrained",
    "TextBlocks",
    "TextClasses",
    "bpe_tokenizer",
    "causal_lm",
    "fast_tokenizer",
    "is_transformers_model",
    "sequence_classifier",
    "write_pretrained",
]


log = logging.getLogger("expkit")

SPECIAL = ("<|endoftext|>", "<|pad|>")  # the BPE tokenizer's special tokens: documents' end, padding


@contextlib.contextmanager
def _quiet_datasets() -> Any:
    """datasets' progress bars ("Generating train split", "Map") off while expkit reads data."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def _needs(package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"this config needs {package}: pip install 'expkit[hf]'")


def is_transformers_model(model: Any) -> bool:
    """A ``transformers`` PreTrainedModel (told without importing transformers).

    Args:
        model: any object.

    Returns:
        True when ``transformers.modeling_utils.PreTrainedModel`` is among its type's bases.
    """
    return any(
        c.__module__ == "transformers.modeling_utils" and c.__name__ == "PreTrainedModel" for c in type(model).__mro__
    )


def _check_tokenizer_file(tokenizer: str | None) -> None:
    if tokenizer is not None and not Path(tokenizer).expanduser().is_file():
        raise ConfigError(
            f"data.tokenizer={tokenizer}: no such file; give a tokenizer.json (tokenizers' "
            "Tokenizer.save), or data.tokenizer=null to train one on the text"
        )


def bpe_tokenizer(train_docs: list[str], path: str | None, vocab_size: int, cache_dir: Path) -> Any:
    """The tokenizer: loaded from `path`, or a byte-level BPE of `vocab_size` tokens trained on
    the training documents (cached in `cache_dir` under a digest of the text and settings).

    Args:
        train_docs: the training documents the BPE is trained on (not read when `path` is given).
        path: a ``tokenizer.json`` to load; None trains the BPE.
        vocab_size: the vocabulary size of the trained BPE, special tokens included.
        cache_dir: the cache dir; the trained tokenizer goes to its ``tokenizers/`` folder.

    Returns:
        The ``tokenizers.Tokenizer``.

    Raises:
        ConfigError: when `path` is not a tokenizer.json that ``tokenizers`` can read.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if path is not None:
        try:
            return Tokenizer.from_file(str(Path(path).expanduser()))
        except Exception as exc:  # tokenizers raises a bare Exception for a file that is not its JSON
            raise ConfigError(
                f"data.tokenizer={path}: not a tokenizer.json tokenizers can read ({exc}); give a tokenizer.json "
                "(tokenizers' Tokenizer.save), or data.tokenizer=null to train one on the text"
            ) from None
    digest = hashlib.sha256()
    for doc in train_docs:
        digest.update(doc.encode())
    digest.update(f"bpe {vocab_size}".encode())
    cached = cache_dir / "tokenizers" / f"bpe-{digest.hexdigest()[:16]}.json"
    if cached.is_file():
        return Tokenizer.from_file(str(cached))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(train_docs, trainer=trainer)
    cached.parent.mkdir(parents=True, exist_ok=True)
    from expkit.core import atomic

    atomic.write_bytes_atomic(cached, tokenizer.to_str().encode())
    return Tokenizer.from_file(str(cached))


# -- data -----------------------------------------------------------------------------------------
class TextBlocks(DataModule):
    """Causal language modelling on local text, through ``tokenizers`` and ``datasets``.

    ``text``: ``pydoc`` (the Python documentation topics that ship with CPython, about 465K
    characters) or local text files (a path or glob, read with ``load_dataset("text", ...)``),
    split contiguously into train, val and test. ``tokenizer``: a ``tokenizer.json`` to load;
    null trains a byte-level BPE of ``vocab_size`` tokens on the training text (kept in the
    cache, reused by the next run). The token stream is packed into blocks of ``block_size``
    tokens, documents separated by ``<|endoftext|>``. ``cache_dir``: where ``datasets`` and the
    trained tokenizer are cached (the config puts it beside the work dirs).
    ``describe()``: ``vocab_size``, ``tokenizer_json``, ``eos_token_id``, ``pad_token_id``,
    ``block_size``.

    Args:
        text: ``pydoc``, or the path or glob of local text files (each non-blank line a document).
        tokenizer: a ``tokenizer.json`` to load; None trains a BPE on the training text.
        vocab_size: the vocabulary size of the trained BPE (at least 300).
        block_size: the tokens per block (at least 2).
        max_chars: the most characters of the text used; None: all of it.
        val_fraction: the share of the documents for validation (at least one document).
        test_fraction: the share of the documents for test (0: no test set).
        cache_dir: the cache dir of ``datasets`` and the trained tokenizer; None: ``.hf_cache``.
        streaming: read the text files with ``datasets``' streaming (``load_dataset(...,
            streaming=True)``) and tokenize them into token files in the cache (memory-mapped), so
            that neither the text nor its tokens are ever in memory whole; the blocks are the same
            as without it, and a run resumes exactly the same way (a map-style dataset of blocks).
        **kwargs: the ``DataModule`` arguments (``batch_size``, ``num_workers``, ...).

    Raises:
        ConfigError: when ``tokenizers`` or ``datasets`` is not installed, `block_size` or
            `vocab_size` is too small, the fractions are out of range, or `tokenizer` is not a file.
    """

    def __init__(
        self,
        text: str = "pydoc",
        tokenizer: str | None = None,
        vocab_size: int = 2000,
        block_size: int = 64,
        max_chars: int | None = None,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        cache_dir: str | None = None,
        streaming: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _needs("tokenizers")
        _needs("datasets")
        self.streaming = bool(streaming)
        if block_size < 2:
            raise ConfigError(f"data.block_size must be >= 2, got {block_size}")
        if vocab_size < 300:
            raise ConfigError(f"data.vocab_size must be >= 300 (256 bytes and merges), got {vocab_size}")
        check_fractions(val_fraction, test_fraction)
        _check_tokenizer_file(tokenizer)
        self.text, self.tokenizer_path, self.vocab_size = text, tokenizer, vocab_size
        self.block_size, self.max_chars = block_size, max_chars
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else Path(".hf_cache")
        self.tokenizer: Any = None

    def _documents(self) -> list[str]:
        """The text as documents (pydoc's topics, or the lines of the files), in a fixed order."""
        if self.text == "pydoc":
            from pydoc_data.topics import topics

            docs = [topics[key] for key in sorted(topics)]
        else:
            files = self._files()
            from datasets import load_dataset

            with _quiet_datasets():
                lines = load_dataset(
                    "text", data_files=files, split="train", cache_dir=str(self.cache_dir / "datasets")
                )
            docs = [line for line in lines["text"] if line.strip()]
        return self._limited(docs)

    def _files(self) -> list[str]:
        """The text files ``text`` names, with text in them (checked: one line of error each)."""
        import glob

        # Path('') is '.', which glob finds: an empty value would reach datasets as the cwd
        if not str(self.text).strip():
            raise ConfigError(
                "data.text is empty: give pydoc, or the path or glob of text files, e.g. data.text='corpus/*.txt'"
            )
        found = sorted(glob.glob(str(Path(self.text).expanduser())))
        if not found:
            raise ConfigError(f"data.text={self.text}: no such file (a path or a glob of text files, or pydoc)")
        files = [f for f in found if Path(f).is_file()]
        if not files:
            folder = found[0].rstrip("/")
            raise ConfigError(
                f"data.text={self.text}: {'is a directory' if len(found) == 1 else 'names only directories'}; "
                f"give the text files in it, e.g. data.text='{folder}/*.txt'"
            )
        # datasets fails on a zero-byte file ("An error occurred while generating the dataset"):
        # it holds no documents, so it is left out, and text that is all empty is named below
        files = [f for f in files if Path(f).stat().st_size]
        if not files:
            raise ConfigError(f"data.text={self.text}: the text is empty; give files with text in them")
        return files

    def _limited(self, docs: Any) -> Any:
        """`docs` (an iterable) cut at ``max_chars`` characters, the text's empty end named."""
        kept: list[str] = []
        size = 0
        for doc in docs:
            if self.max_chars is not None and size >= self.max_chars:
                break
            kept.append(doc if self.max_chars is None else doc[: self.max_chars - size])
            size += len(kept[-1])
        if not size:
            raise ConfigError(f"data.text={self.text}: the text is empty; give files with text in them")
        return kept

    def _streamed(self) -> Iterator[str]:
        """The documents of the text files, streamed (``datasets``' streaming: a line at a time),
        cut at ``max_chars``."""
        from datasets import load_dataset

        with _quiet_datasets():
            lines = load_dataset("text", data_files=self._files(), split="train", streaming=True)
        size = 0
        for row in lines:
            line = row["text"]
            if not line.strip():
                continue
            if self.max_chars is not None:
                if size >= self.max_chars:
                    return
                line = line[: self.max_chars - size]
            size += len(line)
            yield line

    def datasets(self) -> tuple[Any, Any, Any]:
        """The train, validation and test blocks; loads or trains the tokenizer.

        Returns:
            The train and validation sets, and the test set (None when it holds no block); their
                items are dicts of ``input_ids`` and ``labels``.

        Raises:
            ConfigError: when `text` is empty or names directories, the text files are missing or
                empty, `tokenizer` is not a tokenizer.json, there are too few documents to split, or a
                block is longer than the train or validation text.
        """
        from datasets import Dataset

        if self.streaming and self.text != "pydoc":
            return self._streamed_datasets()
        docs = self._documents()
        n = len(docs)
        n_val, n_test = max(1, int(self.val_fraction * n)), int(self.test_fraction * n)
        splits = [docs[: n - n_val - n_test], docs[n - n_val - n_test : n - n_test], docs[n - n_test :]]
        if not splits[0]:
            raise ConfigError(f"data.text={self.text}: too few documents ({n}) to split into train and val")
        self.tokenizer = bpe_tokenizer(splits[0], self.tokenizer_path, self.vocab_size, self.cache_dir)
        eos = self.tokenizer.token_to_id(SPECIAL[0])
        block = self.block_size

        def blocks(part: list[str]) -> Any:
            ids: list[int] = []
            for encoding in self.tokenizer.encode_batch(part):
                ids += encoding.ids
                ids.append(eos)
            usable = len(ids) // block * block
            if not usable:
                return None
            rows = torch.tensor(ids[:usable], dtype=torch.long).reshape(-1, block)
            data = Dataset.from_dict({"input_ids": rows.tolist()})
            data.set_format("torch")
            return data

        train, val, test = (blocks(part) for part in splits)
        if train is None or val is None:
            raise ConfigError(f"data.block_size={block}: longer than the train or val text in tokens; lower it")
        return _Labelled(train), _Labelled(val), _Labelled(test) if test is not None else None

    def _streamed_datasets(self) -> tuple[Any, Any, Any]:
        """``streaming=true``: the same split and blocks as in memory, through token files.

        A first pass counts the documents (the split is by document, as in memory); the
        tokenizer is trained on the streamed training documents (or loaded); a second pass
        tokenizes a thousand documents at a time into ``<cache>/token_blocks/<digest>/<split>.bin``
        (int32, the documents separated by ``<|endoftext|>``), written once per text, tokenizer
        and settings. The blocks are windows of those files, memory-mapped.
        """
        import numpy as np

        n = self._limited_count()
        n_val, n_test = max(1, int(self.val_fraction * n)), int(self.test_fraction * n)
        n_train = n - n_val - n_test
        if n_train < 1:
            raise ConfigError(f"data.text={self.text}: too few documents ({n}) to split into train and val")
        streamed = self._streamed

        class TrainDocs:  # (iterated twice by bpe_tokenizer: its digest, then its training)
            def __iter__(self) -> Iterator[str]:
                for i, doc in enumerate(streamed()):
                    if i >= n_train:
                        return
                    yield doc

        self.tokenizer = bpe_tokenizer(TrainDocs(), self.tokenizer_path, self.vocab_size, self.cache_dir)  # type: ignore[arg-type]
        eos = self.tokenizer.token_to_id(SPECIAL[0])
        files = self._files()
        key = hashlib.sha256(
            repr(
                (
                    [(f, Path(f).stat().st_size, Path(f).stat().st_mtime_ns) for f in files],
                    hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest(),
                    self.max_chars,
                    n_train,
                    n_val,
                    n_test,
                )
            ).encode()
        ).hexdigest()[:16]
        where = self.cache_dir / "token_blocks" / key
        if not (where / "done").is_file():
            where.mkdir(parents=True, exist_ok=True)
            sinks = [open(where / f"{name}.bin", "wb") for name in ("train", "val", "test")]  # noqa: SIM115
            try:
                batch: list[str] = []
                first = 0  # the index of batch[0] among the documents

                def flush() -> None:
                    for offset, encoding in enumerate(self.tokenizer.encode_batch(batch)):
                        i = first + offset
                        split = 0 if i < n_train else 1 if i < n_train + n_val else 2
                        np.asarray([*encoding.ids, eos], dtype=np.int32).tofile(sinks[split])

                for doc in streamed():
                    batch.append(doc)
                    if len(batch) == 1000:
                        flush()
                        first, batch = first + len(batch), []
                if batch:
                    flush()
            finally:
                for sink in sinks:
                    sink.close()
            (where / "done").touch()
        train, val, test = (_TokenBlocks(where / f"{name}.bin", self.block_size) for name in ("train", "val", "test"))
        if not len(train) or not len(val):
            raise ConfigError(
                f"data.block_size={self.block_size}: longer than the train or val text in tokens; lower it"
            )
        return _Labelled(train), _Labelled(val), _Labelled(test) if len(test) else None

    def _limited_count(self) -> int:
        """How many documents the streamed text holds (within ``max_chars``); the empty text named."""
        count = 0
        for count, _ in enumerate(self._streamed(), start=1):
            pass
        if not count:
            raise ConfigError(f"data.text={self.text}: the text is empty; give files with text in them")
        return count

    def describe(self) -> dict[str, Any]:
        """What a model needs to know of the data, by constructor-argument name.

        Returns:
            ``vocab_size``, ``tokenizer_json``, ``eos_token_id``, ``pad_token_id`` and ``block_size``.

        Raises:
            RuntimeError: when ``datasets()`` has not run yet.
        """
        if self.tokenizer is None:
            raise RuntimeError("TextBlocks.describe() needs the tokenizer: call loaders() or datasets() first")
        return {
            "vocab_size": self.tokenizer.get_vocab_size(),
            "tokenizer_json": self.tokenizer.to_str(),
            "eos_token_id": self.tokenizer.token_to_id(SPECIAL[0]),
            "pad_token_id": self.tokenizer.token_to_id(SPECIAL[1]),
            "block_size": self.block_size,
        }


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


class _TokenBlocks(torch.utils.data.Dataset):
    """Blocks of `block` tokens of an int32 token file, memory-mapped (opened in each process
    that reads it: a DataLoader worker maps its own)."""

    def __init__(self, path: Path, block: int) -> None:
        self.path, self.block = path, block
        self.n = path.stat().st_size // 4 // block
        self._tokens: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        import numpy as np

        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.int32, mode="r")
        start = int(index) * self.block
        return {"input_ids": torch.from_numpy(self._tokens[start : start + self.block].astype(np.int64))}


class _Labelled(torch.utils.data.Dataset):
    """A dataset of token blocks as a causal LM takes them: ``labels`` are the ``input_ids``
    (transformers shifts them inside the model)."""

    def __init__(self, blocks: Any) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[int(index)]["input_ids"]
        return {"input_ids": ids, "labels": ids}


# -- models -----------------------------------------------------------------------------------------
class HFModel(nn.Module):
    """A ``transformers`` PreTrainedModel as an expkit model. A batch is a dict passed as
    keyword arguments; the loss is the model's own (it computes one when ``labels`` are
    given); ``logits`` and ``targets`` go to the metrics, for a causal LM shifted so that
    position t predicts token t + 1 (``torchmetrics.text.Perplexity`` reads them).

    Args:
        model: the ``transformers`` model.
        tokenizer_json: the tokenizer the model is trained with, as ``tokenizer.json`` text (for
            ``expkit.predict``, ``SampleText`` and ``save_pretrained``); None: none.
    """

    def __init__(self, model: nn.Module, tokenizer_json: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.tokenizer_json = tokenizer_json
        self.causal = type(model).__name__.endswith("ForCausalLM") or "LMHead" in type(model).__name__
        self.fsdp_blocks = tuple(getattr(model, "_no_split_modules", None) or ())
        # a training step reads no KV cache: none is built (activation checkpointing would fill one
        # twice, recomputing each block in backward)
        takes_cache = "use_cache" in inspect.signature(model.forward).parameters
        self._train_options: dict[str, Any] = {"use_cache": False} if takes_cache else {}

    def forward(self, **batch: Any) -> Any:
        return self.model(**batch)

    def counted_tokens(self, batch: Mapping[str, Any]) -> torch.Tensor | None:
        """The number of tokens a causal LM's loss is the mean over: the labels after the first
        position that are not -100 (transformers' ignored label: padding). Gradient accumulation
        weighs micro-batches by it, so they add up to the gradient of one batch of all of them.

        Args:
            batch: the model's keyword arguments, ``labels`` included.

        Returns:
            The count, a tensor on the labels' device; None when the model is not a causal LM or
            the batch has no labels (the loss is then a mean over samples).
        """
        labels = batch.get("labels") if self.causal and isinstance(batch, Mapping) else None
        if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
            return None
        return (labels[..., 1:] != -100).sum()

    def _outputs(self, batch: Mapping[str, Any], **options: Any) -> tuple[Any, Any]:
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"a Hugging Face model takes dict batches (input_ids, labels, ...), got {type(batch).__name__}"
            )
        out = self.model(**batch, **options)
        if getattr(out, "loss", None) is None:
            raise ValueError("the model computed no loss: the batch needs labels (a `labels` entry)")
        return out, batch.get("labels")

    def train_step(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The model's own loss on the batch.

        Args:
            batch: the model's keyword arguments, ``labels`` included.

        Returns:
            The ``loss`` and the ``logits``.

        Raises:
            TypeError: when the batch is not a mapping.
            ValueError: when the model computes no loss (the batch has no ``labels``).
        """
        out, _ = self._outputs(batch, **self._train_options)
        return {"loss": out.loss, "logits": out.logits}

    def eval_step(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The model's own loss, and the logits and labels for the metrics.

        Args:
            batch: the model's keyword arguments, ``labels`` included.

        Returns:
            The ``loss``, the ``logits`` and the labels as ``targets``; for a causal LM, shifted so
                that position t predicts token t + 1.

        Raises:
            TypeError: when the batch is not a mapping.
            ValueError: when the model computes no loss (the batch has no ``labels``).
        """
        out, labels = self._outputs(batch)
        logits = out.logits
        if self.causal and labels is not None:  # position t predicts token t + 1
            logits, labels = logits[:, :-1], labels[:, 1:]
        return {"loss": out.loss, "logits": logits, "targets": labels}

    @torch.no_grad()
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate``, without gradients.

        Args:
            *args: its positional arguments (the input ids).
            **kwargs: its keyword arguments (``max_new_tokens``, ``do_sample``, ...).

        Returns:
            What the wrapped model's ``generate`` returns (the generated token ids).
        """
        return self.model.generate(*args, **kwargs)


def _auto_config(kind: str, **settings: Any) -> Any:
    """``AutoConfig.for_model(kind, **settings)``; a model type transformers does not know is a
    ConfigError with the close matches."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if kind not in CONFIG_MAPPING:
        import difflib

        close = difflib.get_close_matches(kind, list(CONFIG_MAPPING.keys()), n=5, cutoff=0.6)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise ConfigError(f"model.config.model_type={kind!r} is not a transformers model type{hint}")
    try:
        return AutoConfig.for_model(kind, **settings)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"model.config: {exc}") from None


def _check_pretrained(model: Any, pretrained: str, vocab_size: int, length_key: str, length: int | None) -> None:
    """A model read from `pretrained` must hold the data's token ids and sequence length:
    otherwise its embedding lookup fails deep in the first step (an IndexError)."""
    config = model.config
    rows = model.get_input_embeddings().num_embeddings
    if vocab_size > rows:
        own = Path(pretrained).expanduser() / "tokenizer.json"
        hint = (
            f"give the model's own tokenizer, data.tokenizer={own}"
            if own.is_file()
            else f"give data.tokenizer=<the tokenizer.json the model was trained with>, or data.vocab_size={rows}"
        )
        raise ConfigError(
            f"model.pretrained={pretrained}: the model embeds {rows} token ids but the data's tokenizer "
            f"has {vocab_size}; {hint}"
        )
    _check_positions(config, f"model.pretrained={pretrained}: the model", length_key, length)


def _check_positions(config: Any, who: str, length_key: str, length: int | None) -> None:
    """A model config (`who` in the message) must allow the data's sequence length."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if length is not None and isinstance(positions, int) and positions < length:
        raise ConfigError(f"{who} allows {positions} positions, fewer than {length_key}={length}")


def _local_dir(pretrained: str) -> str:
    """`pretrained` as a local save_pretrained directory; never a hub name (nothing is downloaded)."""
    path = Path(pretrained).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.pretrained={pretrained}: not a local model directory (no config.json in it); "
            "expkit does not download: give a directory written by save_pretrained"
        )
    return str(path)


def causal_lm(
    vocab_size: int,
    config: Mapping[str, Any] | None = None,
    pretrained: str | None = None,
    tokenizer_json: str | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    block_size: int | None = None,
) -> HFModel:
    """A causal language model: ``AutoModelForCausalLM.from_config`` of ``config`` (a dict
    with ``model_type``, e.g. ``gpt2``, and that model type's settings), sized to the data's
    vocabulary; or ``from_pretrained`` of a local directory (``pretrained``: never downloaded).

    Args:
        vocab_size: the data's vocabulary size.
        config: ``model_type`` and that model type's settings; not used with `pretrained`.
        pretrained: a local ``save_pretrained`` directory to load instead.
        tokenizer_json: the data's tokenizer, kept with the model.
        eos_token_id: the end-of-text token, set as the config's ``bos_token_id`` and
            ``eos_token_id`` unless `config` sets them.
        pad_token_id: the padding token, set as the config's ``pad_token_id`` unless `config` sets it.
        block_size: the data's sequence length, checked against the model's positions.

    Returns:
        The model, wrapped in ``HFModel``.

    Raises:
        ConfigError: when `config` has no ``model_type`` or an unknown one or a bad setting,
            `pretrained` is not a local model directory, or the model cannot hold the data's
            vocabulary or sequence length.
    """
    _needs("transformers")
    from transformers import AutoModelForCausalLM

    if pretrained is not None:
        model = AutoModelForCausalLM.from_pretrained(_local_dir(pretrained), local_files_only=True)
        _check_pretrained(model, pretrained, vocab_size, "data.block_size", block_size)
        return HFModel(model, tokenizer_json)
    settings = dict(config or {})
    kind = settings.pop("model_type", None)
    if kind is None:
        raise ConfigError("model.config needs a model_type (e.g. model.config.model_type=gpt2)")
    for key, value in (("bos_token_id", eos_token_id), ("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if value is not None:
            settings.setdefault(key, value)
    hf_config = _auto_config(kind, vocab_size=vocab_size, **settings)
    _check_positions(hf_config, "model.config", "data.block_size", block_size)
    return HFModel(AutoModelForCausalLM.from_config(hf_config), tokenizer_json)


def sequence_classifier(
    vocab_size: int,
    num_classes: int,
    config: Mapping[str, Any] | None = None,
    pretrained: str | None = None,
    tokenizer_json: str | None = None,
    pad_token_id: int | None = None,
    max_length: int | None = None,
) -> HFModel:
    """A sequence classifier: ``AutoModelForSequenceClassification.from_config`` of ``config``
    (``model_type`` and its settings), with the data's vocabulary and ``num_labels`` = the data's
    classes; or ``from_pretrained`` of a local directory (its head resized to the classes).

    Args:
        vocab_size: the data's vocabulary size.
        num_classes: the data's number of classes.
        config: ``model_type`` and that model type's settings; not used with `pretrained`.
        pretrained: a local ``save_pretrained`` directory to load instead.
        tokenizer_json: the data's tokenizer, kept with the model.
        pad_token_id: the padding token, set as the config's ``pad_token_id`` unless `config` sets it.
        max_length: the data's sequence length, checked against the model's positions.

    Returns:
        The model, wrapped in ``HFModel``.

    Raises:
        ConfigError: when `config` has no ``model_type`` or an unknown one or a bad setting,
            `pretrained` is not a local model directory, or the model cannot hold the data's
            vocabulary or sequence length.
    """
    _needs("transformers")
    from transformers import AutoModelForSequenceClassification

    if pretrained is not None:
        model = AutoModelForSequenceClassification.from_pretrained(
            _local_dir(pretrained),
            num_labels=num_classes,
            ignore_mismatched_sizes=True,
            local_files_only=True,
        )
        _check_pretrained(model, pretrained, vocab_size, "data.max_length", max_length)
        return HFModel(model, tokenizer_json)
    settings = dict(config or {})
    kind = settings.pop("model_type", None)
    if kind is None:
        raise ConfigError("model.config needs a model_type (e.g. model.config.model_type=bert)")
    if pad_token_id is not None:
        settings.setdefault("pad_token_id", pad_token_id)
    hf_config = _auto_config(kind, vocab_size=vocab_size, num_labels=num_classes, **settings)
    _check_positions(hf_config, "model.config", "data.max_length", max_length)
    return HFModel(AutoModelForSequenceClassification.from_config(hf_config), tokenizer_json)


# -- hooks ------------------------------------------------------------------------------------------
def fast_tokenizer(model: HFModel) -> Any:
    """The tokenizer the model was trained with, as transformers' PreTrainedTokenizerFast; None without one.

    Args:
        model: the wrapped model (its ``tokenizer_json`` is read).

    Returns:
        The tokenizer, with ``<|endoftext|>`` as its end-of-text and ``<|pad|>`` as its padding
            token; None when the model has no ``tokenizer_json``.
    """
    from transformers import PreTrainedTokenizerFast

    if not model.tokenizer_json:
        return None
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(model.tokenizer_json), eos_token=SPECIAL[0], pad_token=SPECIAL[1]
    )


def _unwrapped(runner: Runner) -> HFModel:
    model = runner.model
    if not isinstance(model, HFModel):
        raise ConfigError(
            f"this hook needs a Hugging Face model (expkit.tasks.hf.HFModel, e.g. model=hf_causal_lm), "
            f"not {type(model).__name__}"
        )
    return model


class SavePretrained(Hook):
    """At the end of the run: the trained model in transformers' own form, ``<work dir>/<dir>``
    (``config.json``, ``model.safetensors``, and the tokenizer when the data trained one),
    which plain transformers loads with ``from_pretrained``. With FSDP2 the full weights are
    gathered first (every rank takes part; rank 0 writes).

    Nothing is written when the run trained nothing or failed.

    Args:
        dir: the directory, relative to the work dir.
    """

    priority = Priority.LOW

    def __init__(self, dir: str = "hf_model") -> None:
        self.dir = dir

    def before_run(self, runner: Runner) -> None:
        _unwrapped(runner)  # (another model: refused before training, not after it)

    def after_run(self, runner: Runner) -> None:
        if runner.optimizer is None or runner.error is not None or not isinstance(runner.model, HFModel):
            return  # (nothing trained, or the run failed: before_run said why)
        model = runner.model
        state = None
        if runner.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(model.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not runner.is_main:
            return
        write_pretrained(model, runner.work_dir / self.dir, state)


def write_pretrained(model: HFModel, target: Path, state: dict[str, Any] | None = None) -> None:
    """`model` in transformers' own form in the directory `target` (``config.json``,
    ``model.safetensors``, the tokenizer when the data trained one), for ``from_pretrained``.
    `state`: the full weights when the model's own are sharded (FSDP2).

    Args:
        model: the wrapped model.
        target: the directory to write.
        state: the full state dict to save; None saves the model's own weights.
    """
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # (its "Writing model shards" bar, in a run's log)
    try:
        model.model.save_pretrained(str(target), state_dict=state)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer = fast_tokenizer(model)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(target))
    log.info("Saved the model for transformers' from_pretrained: %s", target)


class SampleText(Hook):
    """After each validation (rank 0): ``num_samples`` texts of ``max_new_tokens`` tokens
    generated from ``prompt`` by ``model.generate`` (sampling at ``temperature``, from the
    run's seed), appended to ``<work dir>/samples.txt`` and shown in the log.

    Args:
        prompt: the text the samples start with.
        max_new_tokens: the tokens generated for each sample.
        num_samples: the number of samples after each validation.
        temperature: the sampling temperature.
    """

    priority = Priority.LOW

    def __init__(
        self, prompt: str = "The ", max_new_tokens: int = 40, num_samples: int = 2, temperature: float = 0.8
    ) -> None:
        self.prompt, self.max_new_tokens = prompt, max_new_tokens
        self.num_samples, self.temperature = num_samples, temperature

    def before_run(self, runner: Runner) -> None:
        _unwrapped(runner)

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        model = _unwrapped(runner)
        tokenizer = fast_tokenizer(model)
        if tokenizer is None or not (runner.is_main or runner.sharded):
            return
        from expkit.core.rng import rng_states, set_rng_states

        states, was_training = rng_states(), model.training
        try:
            torch.manual_seed(runner.settings.seed or 0)  # (the same on every rank: the same samples)
            model.eval()
            if runner.sharded:  # generate() calls the inner model, not this root: its own parameters gathered here
                model.unshard()  # type: ignore[operator]
            ids = tokenizer(self.prompt, return_tensors="pt")["input_ids"].to(runner.device)
            # synced_gpus: under FSDP2 every rank runs as many forward passes (each gathers weights)
            out = model.generate(
                ids,
                do_sample=True,
                temperature=self.temperature,
                max_new_tokens=self.max_new_tokens,
                num_return_sequences=self.num_samples,
                pad_token_id=tokenizer.pad_token_id,
                synced_gpus=runner.sharded,
            )
        finally:
            if runner.sharded:
                model.reshard()  # type: ignore[operator]
            model.train(was_training)
            set_rng_states(states)
        if not runner.is_main:
            return
        texts = tokenizer.batch_decode(out, skip_special_tokens=True)
        with open(runner.work_dir / "samples.txt", "a", encoding="utf-8") as f:
            f.writelines(f"--- epoch {runner.epoch} iteration {runner.iter}\n{text}\n" for text in texts)
        log.info("Sample: %s", texts[0].replace("\n", " ")[:200])
