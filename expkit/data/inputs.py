"""The fingerprint of what a run read, for ``provenance.json`` (``expkit.reproduce`` names a
change of it "the data changed", apart from the metrics).

The files come from the data module: WebDataset shards by the fingerprints their index already
holds (``expkit.data.shard_index``: size, first and last 64 KiB), other modules by their
``input_files()`` (the digits: the CSV that scikit-learn ships; an image folder: its files).
Each file is recorded by its path, size and a content hash: the whole file while the run's files
total at most ``WHOLE_BYTES``, else the shard fingerprint's cheap hash (two reads per file). A
module that names no files is not fingerprinted.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any

__all__ = ["MAX_FILES", "WHOLE_BYTES", "fingerprint_inputs"]

WHOLE_BYTES = 64 << 20  # read whole while the files total this much (the digits: 60 KB)
MAX_FILES = 10_000  # more files are counted and their names and sizes hashed, but not their content
LISTED = 100  # the entries provenance.json lists by name (the digest covers every file)


def _shards(loaders: Iterable[Any]) -> list[dict[str, Any]]:
    """Each shard of the loaders' datasets that has an index (``ShardDataset``), with its fingerprint."""
    entries = []
    for loader in loaders:
        for one in loader.values() if isinstance(loader, dict) else [loader]:
            index = getattr(getattr(one, "dataset", None), "index", None)
            for url, print_ in zip(getattr(index, "urls", []), getattr(index, "fingerprints", [])):
                entries.append({"path": str(url), "fingerprint": str(print_)})
    return entries


def _files(paths: list[str]) -> list[dict[str, Any]]:
    sizes = []
    for path in paths:
        try:
            sizes.append(os.stat(path).st_size)
        except OSError:
            sizes.append(None)
    whole = sum(s or 0 for s in sizes) <= WHOLE_BYTES
    from expkit.data.shard_index import fingerprint  # (tarfile's import, only for large data)

    entries = []
    for i, (path, size) in enumerate(zip(paths, sizes)):
        entry: dict[str, Any] = {"path": path, "size": size}
        if size is not None and i < MAX_FILES:
            try:
                with open(path, "rb") as handle:
                    entry["hash" if whole else "fingerprint"] = (
                        hashlib.blake2b(handle.read(), digest_size=16).hexdigest()
                        if whole
                        else fingerprint(handle, size)
                    )
            except OSError:
                pass
        entries.append(entry)
    return entries


def fingerprint_inputs(data: Any, loaders: Iterable[Any]) -> dict[str, Any] | None:
    """What the run reads: its files, their sizes and content hashes, and one digest of them all.

    Args:
        data: the data module (its ``input_files()``, when it has one).
        loaders: its train, validation and test loaders (a dict of them for named sets; None where none).

    Returns:
        ``files`` (the count), ``bytes``, ``digest`` (of every entry) and ``entries`` (the first
            ``LISTED``: ``path``, ``size`` and ``hash`` or ``fingerprint``); None when the data module
            names no files.
    """
    entries = _shards([loader for loader in loaders if loader is not None])
    if not entries:
        named = getattr(data, "input_files", None)
        paths = [str(p) for p in named()] if callable(named) else []
        entries = _files(paths)
    if not entries:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for entry in entries:
        digest.update(repr(sorted(entry.items())).encode())
    return {
        "files": len(entries),
        "bytes": sum(e.get("size") or 0 for e in entries),
        "digest": digest.hexdigest(),
        "entries": entries[:LISTED],
    }
