"""Checkpoints in object storage: ``default_hooks.checkpoint.out_dir=s3://bucket/prefix`` (or
``gs://``, ``memory://``, any fsspec URL), through fsspec (s3fs, gcsfs: the ``s3`` / ``gcs`` extras).

A run writes each checkpoint into its work dir's ``checkpoints/`` as it always does (the local
cache), then uploads it to ``<out_dir>/<work dir name>/`` and only then moves the
``last_checkpoint`` object there: an object store writes an object whole or not at all, so a
reader that follows the pointer never finds half a checkpoint. Retention deletes a remote
checkpoint only after the new one and the pointer are uploaded, and a failed upload deletes
nothing, local or remote. ``resume=true`` reads the local cache first and downloads only a
checkpoint it does not hold (another machine's, after a requeue); ``resume=``, ``load_from=``
and ``checkpoint=`` (eval, predict, export) take a URL, downloaded once into a cache.

What is read from the store is data: a pointer names one object directly in its own dir, and a
checkpoint downloaded is loaded with the same trust rules as a local file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from expkit.core.errors import CheckpointWriteError, ConfigError

__all__ = [
    "EXTRAS",
    "LAST_CHECKPOINT",
    "RemoteDir",
    "checked_url",
    "fetch",
    "filesystem",
    "is_url",
    "local_path",
    "resolve",
]


log = logging.getLogger("expkit")

LAST_CHECKPOINT = "last_checkpoint"
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # scheme -> the expkit extra that brings its package
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.=+-]*")  # a checkpoint name a pointer may give
# seconds each call of the start-up probe may take, connecting and answering together: writing an
# empty object takes well under a second on a working store, and an endpoint that accepts a
# connection and never answers would otherwise hold the run for upload_timeout before it trains
PROBE_TIMEOUT = 10.0
_ADVICE = "check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and the endpoint (AWS_ENDPOINT_URL)"


def is_url(path: object) -> bool:
    """A URL with a scheme other than file:// (a local path stays a local path).

    Args:
        path: anything; only a str or path-like can be a URL.

    Returns:
        True when `path` starts with ``<scheme>://`` and the scheme is not ``file``.
    """
    match = _SCHEME.match(str(path)) if isinstance(path, (str, os.PathLike)) else None
    return match is not None and match.group(1).lower() != "file"


def checked_url(url: str | os.PathLike, key: str) -> str:
    """`url` without its trailing ``/``, once it names something after its scheme.

    Args:
        url: a URL (``is_url`` is true of it).
        key: the config key that gave `url`, named in error messages.

    Returns:
        `url` without a trailing ``/``.

    Raises:
        ConfigError: when nothing but slashes follows ``<scheme>://`` (``s3://``), naming `key`.
    """
    text = os.fspath(url)
    scheme = _SCHEME.match(text).group(1)  # type: ignore[union-attr]
    if not text[len(scheme) + 3 :].strip("/"):
        raise ConfigError(f"{key}={text}: the URL names no bucket; type {scheme}://<bucket>/<prefix>")
    return text.rstrip("/")


def local_path(path: str | os.PathLike) -> Path:
    """``file:///x`` as ``/x``; any other path as it is.

    Args:
        path: a local path or a ``file://`` URL.

    Returns:
        The path, with a leading ``file://`` (any case) removed.
    """
    text = os.fspath(path)
    return Path(text[len("file://") :]) if text.lower().startswith("file://") else Path(text)


def _cause(exc: BaseException, deadline: str = "default_hooks.checkpoint.upload_timeout") -> str:
    if isinstance(exc, TimeoutError) or type(exc).__name__ == "FSTimeoutError":
        return f"no answer within {deadline}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def filesystem(url: str, storage_options: Mapping[str, Any] | None, key: str) -> tuple[Any, str]:
    """fsspec's filesystem for `url` and the path in it; ConfigError naming `key` for an unknown
    scheme or a scheme whose package is not installed (with the extra to install).

    Args:
        url: a URL with a scheme, e.g. ``s3://bucket/prefix``.
        storage_options: keyword arguments for the fsspec filesystem (credentials, endpoint, ...); None: none.
        key: the config key that gave `url`, named in error messages.

    Returns:
        The fsspec filesystem and the path in it, without a trailing ``/``.

    Raises:
        ConfigError: when fsspec does not know the scheme, the scheme's package is not installed, or
            `storage_options` are refused.
    """
    import fsspec
    from fsspec.registry import known_implementations

    scheme = _SCHEME.match(url).group(1).lower()  # type: ignore[union-attr]
    if scheme not in known_implementations and scheme not in fsspec.available_protocols():
        raise ConfigError(
            f"{key}={url}: unknown URL scheme {scheme}://; use s3://, gs://, memory:// or a local "
            "path (any scheme fsspec knows works)"
        )
    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as exc:
        extra = EXTRAS.get(scheme)
        install = f"pip install 'expkit[{extra}]'" if extra else f"install the package fsspec names: {_cause(exc)}"
        raise ConfigError(f"{key}={url}: {scheme}:// needs a package that is not installed; {install}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}={url}: {_cause(exc)} (check default_hooks.checkpoint.storage_options)") from None
    return fs, path.rstrip("/")


class RemoteDir:
    """A run's checkpoint dir in object storage: ``<url>/<name>`` objects and a ``last_checkpoint``.

    Args:
        url: the dir's URL, e.g. ``s3://bucket/prefix/run``; a trailing ``/`` is dropped.
        storage_options: keyword arguments for the fsspec filesystem (credentials, endpoint, ...); None: none.
        key: the config key that gave the URL, named in error messages.
        given: the value that key was given (the dir's parent URL, for a checkpoint hook), named in
            error messages; None: `url`.
        timeout: the seconds each call to the store may take (fsspec's ``timeout``, passed to
            asynchronous filesystems such as s3 and gs only); None or 0: no limit.

    Raises:
        ConfigError: fsspec does not know the URL's scheme, the scheme's package is not installed, or
            `storage_options` are refused.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        key: str = "default_hooks.checkpoint.out_dir",
        given: str | None = None,
        timeout: float | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.key, self.given = key, given or self.url  # (errors name the key with the value it was given)
        self.fs, self.root = filesystem(self.url, storage_options, key)
        self.timeout = timeout
        self._async = getattr(self.fs, "async_impl", False)

    def _call(self, method: str, *args: Any, deadline: float | None = None, **kwargs: Any) -> Any:
        # a store that stops answering in the middle of a request body is waited for by nothing in
        # aiohttp (its timeouts are for connecting and reading): fsspec's own deadline on each call
        # (asynchronous filesystems only), `deadline` when given, else the dir's timeout
        limit = deadline or self.timeout
        return getattr(self.fs, method)(*args, **kwargs, **({"timeout": limit} if limit and self._async else {}))

    def __repr__(self) -> str:
        return f"RemoteDir({self.url!r})"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def check(self) -> None:
        """Write and delete a small object: a missing bucket, bad credentials or a dead endpoint
        is a ConfigError (exit 2) before training, naming the URL and the call that failed. Each
        call has PROBE_TIMEOUT seconds, whatever the dir's own timeout (upload_timeout) is."""
        probe = self._path(f".expkit-write-test-{os.getpid()}")
        for call, action in (
            ("write", lambda: self._call("pipe_file", probe, b"", deadline=PROBE_TIMEOUT)),
            ("delete", lambda: self._call("rm", probe, deadline=PROBE_TIMEOUT)),
        ):
            try:
                action()
            except Exception as exc:
                cause = _cause(exc, f"{PROBE_TIMEOUT:g} s")
                raise ConfigError(
                    f"{self.key}={self.given}: cannot {call} {self.url}/{probe.rsplit('/', 1)[-1]} ({cause}); check "
                    "the bucket's name and that it exists, the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                    "or default_hooks.checkpoint.storage_options) and the endpoint (AWS_ENDPOINT_URL)"
                ) from None

    # -- writing --------------------------------------------------------------------------------
    def upload(self, local: Path, previous: str | None = None) -> None:
        """Upload a checkpoint file, or a sharded checkpoint dir (its index last), as ``<name>``."""
        target = self._path(local.name)
        try:
            if local.is_dir():
                files = sorted((p for p in local.rglob("*") if p.is_file()), key=lambda p: p.name == ".metadata")
                for path in files:  # (the index last: a dir without it is not a checkpoint)
                    self._call("put_file", str(path), f"{target}/{path.relative_to(local).as_posix()}")
            else:
                self._call("put_file", str(local), target)
        except Exception as exc:
            kept = (
                f"{self.url}/{previous} (and last_checkpoint there) is intact"
                if previous
                else f"{self.url} holds no earlier checkpoint of this run"
            )
            raise CheckpointWriteError(
                f"could not upload {local.name} to {self.url} ({_cause(exc)}); {kept}, and nothing local was "
                f"deleted: resume=true continues from {local.parent}"
            ) from exc

    def point(self, name: str) -> None:
        """Move ``last_checkpoint`` to `name` (one object written whole)."""
        try:
            self._call("pipe_file", self._path(LAST_CHECKPOINT), name.encode("utf-8"))
        except Exception as exc:
            raise CheckpointWriteError(
                f"could not point {self.url}/{LAST_CHECKPOINT} at {name} ({_cause(exc)}); {name} itself is uploaded"
            ) from exc

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call("rm", self._path(name), recursive=True)

    # -- reading --------------------------------------------------------------------------------
    def pointer(self) -> str | None:
        """The name ``last_checkpoint`` gives, when it is one object directly in this dir; else None."""
        path = self._path(LAST_CHECKPOINT)
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.root)
        try:
            name = self._call("cat_file", path).decode("utf-8").strip()
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise ConfigError(
                f"{self.key}={self.given}: cannot read {self.url}/{LAST_CHECKPOINT} ({_cause(exc)}); {_ADVICE}"
            ) from None
        return name if _NAME.fullmatch(name) and name != LAST_CHECKPOINT else None

    def bests(self) -> list[str]:
        """The ``best_*`` checkpoints of this dir, by name."""
        try:
            names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self._call("ls", self.root, detail=False))
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise ConfigError(f"{self.key}={self.given}: cannot list {self.url} ({_cause(exc)}); {_ADVICE}") from None
        return [n for n in names if n.startswith("best_") and n.endswith((".pth", ".dcp")) and _NAME.fullmatch(n)]

    def download(self, name: str, into: Path) -> Path:
        """``<name>`` into the dir `into` (through a temporary name, renamed when complete); the
        local copy is reused when it is there and has the remote's size."""
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{self.url}: {name!r} is not a checkpoint name")
        source, local = self._path(name), into / name
        try:
            info = self._call("info", source)
        except FileNotFoundError:
            raise ConfigError(f"{self.url}/{name}: no such checkpoint") from None
        except Exception as exc:
            raise ConfigError(f"cannot read {self.url}/{name} ({_cause(exc)})") from None
        directory = info.get("type") == "directory"
        # the object's identity (ETag, else size and time): a cached copy of another object of the same name
        # (a run trained again into the same dir) is downloaded again
        identity = repr(
            [info.get(k) for k in ("ETag", "etag", "md5Hash", "size", "LastModified", "mtime", "updated", "created")]
        )
        stamp = into / f".{name}.source"
        with contextlib.suppress(OSError):
            if (local.exists() or local.is_symlink()) and stamp.read_text() == identity and not local.is_symlink():
                return local  # (downloaded before: the cache)
        into.mkdir(parents=True, exist_ok=True)
        tmp = into / f".{name}.tmp{os.getpid()}"
        log.info("Downloading %s/%s into %s", self.url, name, into)
        try:
            self._call("get", source, str(tmp), recursive=directory)
            if local.is_dir() and not local.is_symlink():
                shutil.rmtree(local)
            os.replace(tmp, local)
            stamp.write_text(identity)
        except Exception as exc:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            raise ConfigError(f"cannot download {self.url}/{name} ({_cause(exc)})") from None
        return local


def fetch(url: str, which: str = "best", key: str = "checkpoint") -> Path:
    """A checkpoint URL as a local path: a ``.pth`` object or a ``.dcp`` dir, or a run's remote
    checkpoint dir (its best or, with ``which=last``, its ``last_checkpoint``), downloaded once
    into ``<temp dir>/expkit-checkpoints/<hash of the dir's URL>/``. Credentials and the endpoint
    come from the standard variables of the store (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...).

    Args:
        url: a ``.pth`` object's or ``.dcp`` directory's URL, or a run's remote checkpoint dir.
        which: for a dir, ``"best"`` takes its first ``best_*`` checkpoint by name, falling back to
            ``last_checkpoint`` when there is none; any other value takes ``last_checkpoint``.
        key: the config key that gave `url`, named in error messages.

    Returns:
        The local path of the downloaded checkpoint (a cached copy when it matches the remote object).

    Raises:
        ConfigError: when the store cannot be reached, the dir holds no checkpoint, or the download fails.
    """
    remote, name = resolve(url, which, key)
    cache = Path(tempfile.gettempdir()) / "expkit-checkpoints" / hashlib.sha256(remote.url.encode()).hexdigest()[:16]
    return remote.download(name, cache)


def resolve(url: str, which: str = "best", key: str = "checkpoint") -> tuple[RemoteDir, str]:
    """The checkpoint a URL names, as ``fetch`` picks it, without downloading it: for a run's remote
    checkpoint dir, the name its best or ``last_checkpoint`` gives now.

    Args:
        url: a ``.pth`` object's or ``.dcp`` directory's URL, or a run's remote checkpoint dir.
        which: for a dir, ``"best"`` (else ``last_checkpoint``), as for ``fetch``.
        key: the config key that gave `url`, named in error messages.

    Returns:
        (the dir, the checkpoint's name in it); ``f"{dir.url}/{name}"`` names that checkpoint alone.

    Raises:
        ConfigError: when the URL is refused, the store cannot be reached, or the dir holds no checkpoint.
    """
    url = checked_url(url, key)
    head, _, name = url.rpartition("/")
    if name.endswith((".pth", ".dcp")):
        return RemoteDir(head, key=key, given=url), name
    remote = RemoteDir(url, key=key)
    picked = next(iter(remote.bests()), None) if which == "best" else None
    name = picked or remote.pointer() or ""
    if not name:
        raise ConfigError(f"{key}={url}: no checkpoint there (no {LAST_CHECKPOINT}, no best_* checkpoint)")
    return remote, name
