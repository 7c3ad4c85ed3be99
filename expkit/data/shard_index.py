"""The index of WebDataset tar shards (``data=webdataset``): where each sample's members lie in
its shard, read once from the tar headers by the standard library's ``tarfile`` and cached in
``data.index_dir``.

A shard's cached index is keyed by its URL, its size and its version: for a local file its
modification time and a content fingerprint (a hash of its first and last 64 KiB: ``cp -p`` and
``rsync -a`` keep the size and the modification time of a shard replaced by another), for an
object in a bucket its ETag (already a hash of its content). The fingerprint is kept in the
index too, so that a resume can tell that the data changed under it.

While it reads the headers, the index reads each sample's target (the ``.cls`` member, a few
bytes beside its header, in the same buffered read) and keeps the smallest and largest label
of the shard, so that labels out of ``data.num_classes`` are refused before training.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
from pathlib import Path
from typing import Any

from expkit.core.errors import ConfigError, counted

__all__ = ["expand_urls", "fingerprint", "index_shard", "is_url", "load_index", "open_shard"]

log = logging.getLogger("expkit")

INDEX_VERSION = 2  # 2: the fingerprint, the labels and the shard's size beside the samples
EDGE = 1 << 16  # the bytes hashed at each end of a shard: a tar's last 10 KiB are end-of-archive zeros
LABEL_BYTES = 64  # a target member up to this size is read as a label while indexing


def is_url(spec: str) -> bool:
    """Whether `spec` names an object in a store (``s3://``, ``gs://``), not a local file.

    Args:
        spec: a shard's path or URL.

    Returns:
        True for a URL other than ``file://``.
    """
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


def open_shard(url: str) -> Any:
    """A shard opened for reading: a local file, or through fsspec (``s3://`` reads
    AWS_ENDPOINT_URL and the credentials from the environment, as boto does) with a 4 MiB
    read-ahead.

    Args:
        url: the shard's path or URL.

    Returns:
        A seekable binary file; the caller closes it.
    """
    if not is_url(url):
        return open(url, "rb")
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return fs.open(path, "rb", block_size=1 << 22, cache_type="readahead")


def fingerprint(handle: Any, size: int) -> str:
    """A cheap hash of a shard's content: its size and its first and last 64 KiB (two reads).

    Args:
        handle: the shard, open for reading (seekable).
        size: its size in bytes.

    Returns:
        16 hex digits.
    """
    digest = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=8)
    for start in sorted({0, max(0, size - EDGE)}):
        handle.seek(start)
        digest.update(handle.read(min(EDGE, size - start)))
    return digest.hexdigest()


def _stat(url: str) -> tuple[int, str]:
    """(size, version) of a shard: the version is the modification time and the content
    fingerprint of a local file, the ETag or the modification time of an object; raises OSError
    (FileNotFoundError) when it is missing, IsADirectoryError for a directory."""
    if not is_url(url):
        with open(url, "rb") as handle:  # (a directory: IsADirectoryError)
            st = os.fstat(handle.fileno())
            return st.st_size, f"{st.st_mtime_ns}:{fingerprint(handle, st.st_size)}"
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    info = fs.info(path)
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
    return int(info["size"]), str(version)


def _label(tar: tarfile.TarFile, member: tarfile.TarInfo) -> int | None:
    if member.size > LABEL_BYTES:
        return None
    data = tar.extractfile(member)
    try:
        return int(data.read().decode().strip()) if data is not None else None
    except ValueError:  # (not an integer: the read in the run names it)
        return None


def index_shard(url: str, target_key: str = "cls") -> dict[str, Any]:
    """One tar shard's index. WebDataset's rule: a member ``dir/name.ext.gz`` belongs to sample
    ``dir/name``, extension ``ext.gz``; consecutive members of one key form one sample.

    Args:
        url: the shard's path or URL.
        target_key: the target member's extension: its integer labels are summed up.

    Returns:
        ``samples`` (each ``{"key": ..., "members": {ext: [offset, size]}}``, the offset of the
            member's data in the file), ``size`` (the shard's bytes), ``fingerprint``, ``labels``
            (``[smallest, largest, key of the largest]`` or None) and ``cut`` (why the headers stop
            before the end of the tar, or None).

    Raises:
        tarfile.TarError: not a tar at all (nothing could be read).
        OSError: the shard cannot be read.
    """
    samples: list[dict[str, Any]] = []
    labels: list[Any] | None = None
    cut = None
    with open_shard(url) as opened:
        size = opened.seek(0, os.SEEK_END)
        content = fingerprint(opened, size)
        opened.seek(0)
        with tarfile.open(fileobj=opened, mode="r:") as tar:
            try:
                for member in tar:
                    directory, _, name = member.name.rpartition("/")
                    stem, dot, ext = name.partition(".")
                    if not member.isfile() or not dot or name.startswith("."):  # (no extension: not a sample's)
                        continue
                    key = f"{directory}/{stem}" if directory else stem
                    if not samples or samples[-1]["key"] != key:
                        samples.append({"key": key, "members": {}})
                    samples[-1]["members"][ext.lower()] = [member.offset_data, member.size]
                    label = _label(tar, member) if ext.lower() == target_key else None
                    if label is not None and labels is None:
                        labels = [label, label, key]
                    elif label is not None:
                        labels[0] = min(labels[0], label)
                        labels[1:] = [label, key] if label > labels[1] else labels[1:]
            except (tarfile.TarError, EOFError) as exc:  # a cut tar: what was read before is kept
                if not samples:
                    raise
                cut = str(exc) or type(exc).__name__
            if cut is None and tar.offset + 2 * tarfile.BLOCKSIZE > size:  # (tarfile ends quietly at a cut header)
                cut = f"it ends at byte {size}, with no end-of-archive marker"
    return {"samples": samples, "size": size, "fingerprint": content, "labels": labels, "cut": cut}


def _read_cached(path: Path) -> dict[str, Any] | None:
    """A cached shard index; None when it is missing or not what ``index_shard`` writes (a cut
    write, a file from elsewhere: the shard is indexed again)."""
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    samples = entry.get("samples") if isinstance(entry, dict) else None
    ok = (
        isinstance(samples, list)
        and isinstance(entry.get("size"), int)
        and isinstance(entry.get("fingerprint"), str)
        and all(isinstance(s, dict) and isinstance(s.get("members"), dict) and "key" in s for s in samples)
    )
    return entry if ok else None


def _missing(url: str, key: str, count: int) -> ConfigError:
    return ConfigError(
        f"{key}: {url} does not exist ({counted(count, 'shard')} named); "
        "check the path or pattern (quote a brace pattern on the command line: "
        f"{key}='dir/train-{{000000..000009}}.tar'), or write shards first: python -m expkit.shards "
        "data=<data group> out=<dir>"
    )


def _version(url: str, key: str, count: int) -> tuple[int, str]:
    """``_stat`` with every way it fails as a ConfigError naming the shard."""
    try:
        return _stat(url)
    except FileNotFoundError:
        raise _missing(url, key, count) from None
    except IsADirectoryError:
        tars = sorted(p.name for p in Path(url).glob("*.tar"))
        held = f"it holds {len(tars)} .tar files: {', '.join(tars[:3])}{', ...' * (len(tars) > 3)}" if tars else ""
        raise ConfigError(
            f"{key}: {url} is a directory, not a tar shard; name its shards, e.g. as a quoted brace pattern "
            f"{key}='{url.rstrip('/')}/train-{{000000..000009}}.tar' ({held or 'it holds no .tar file'})"
        ) from None
    except Exception as exc:  # an unreachable endpoint, a missing bucket, no credentials, no permission
        cause = (str(exc).splitlines() or [type(exc).__name__])[0]
        hint = (
            "check the bucket, the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and the endpoint "
            "(AWS_ENDPOINT_URL)"
            if is_url(url)
            else "check its permissions"
        )
        raise ConfigError(f"{key}: cannot {'reach' if is_url(url) else 'read'} {url} ({cause}); {hint}") from None


def load_index(urls: list[str], key: str, index_dir: Path, target_key: str) -> list[dict[str, Any]]:
    """Every shard's index (``index_shard``), from the cache when the shard is unchanged, else
    read (and cached).

    Args:
        urls: the shards.
        key: the setting that names them, for messages (``data.train``).
        index_dir: the cache.
        target_key: the target member's extension.

    Returns:
        The indexes, in the order of `urls`.

    Raises:
        ConfigError: a missing shard, a directory, an unreachable store, a file that is not a tar, an
            empty tar: each named.
    """
    out = []
    built = 0
    for url in urls:
        size, version = _version(url, key, len(urls))
        identity = [INDEX_VERSION, url, size, version, target_key]
        cached = index_dir / f"{hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32]}.json"
        entry = _read_cached(cached)
        if entry is None:
            try:
                entry = index_shard(url, target_key)
            except (tarfile.TarError, EOFError) as exc:
                raise ConfigError(
                    f"{key}: {url} is not a readable tar ({exc}); it may be truncated: write it again"
                ) from None
            if not entry["samples"]:
                raise ConfigError(f"{key}: {url} holds no sample (an empty tar)")
            built += 1
            try:
                from expkit.core.atomic import write_json_atomic

                index_dir.mkdir(parents=True, exist_ok=True)
                write_json_atomic(cached, entry)
            except OSError as exc:  # (a read-only dir: indexed again next time)
                log.warning("Could not cache the index of %s in %s: %s", url, index_dir, exc)
        out.append(entry)
    if built:
        log.info("Indexed %d of %d shards of %s (cached in %s)", built, len(urls), key, index_dir)
    return out
