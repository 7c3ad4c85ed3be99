"""What the Hugging Face data modules and models share: the optional packages checked, the
progress bars of ``datasets`` kept quiet, and the BPE tokenizer (``tokenizers``), trained on
local text or read from a local ``tokenizer.json``."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any

from expkit.core.errors import ConfigError

__all__ = ["SPECIAL", "bpe_tokenizer"]


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
