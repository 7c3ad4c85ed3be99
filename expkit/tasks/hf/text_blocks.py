"""``TextBlocks``: causal language modelling on local text: text -> a BPE tokenizer -> token ids
(``datasets``, cached beside the work dirs) -> fixed-length blocks, in memory or (``streaming``)
through memory-mapped token files."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from expkit.core.errors import ConfigError
from expkit.data import DataModule, check_fractions
from expkit.tasks.hf.tokenizer import SPECIAL, _check_tokenizer_file, _needs, _quiet_datasets, bpe_tokenizer

__all__ = ["TextBlocks"]


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
