"""Paths read from files are data from a stranger: a recorded name is confined to its own dir.

A checkpoint's hook state, the ``last_checkpoint`` pointer, ``result.json`` and a sweep's job
index record the names of files and dirs that expkit wrote beside them. Before anything is
read, moved or deleted through such a record, ``confined`` turns it into a path directly
inside the dir it belongs to, with symlinks followed, or rejects it with one warning naming
the record and the file it came from. A crafted or corrupted file (``../../victim.txt``, a
symlink leading out) can then at most name a file of the run's own dir.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

__all__ = ["confined", "inside", "name_pattern"]

log = logging.getLogger("expkit")


def confined(directory: Path, recorded: object, source: str | Path, what: str = "file") -> Path | None:
    """`recorded` (read from `source`) as a path directly inside `directory`, or None (and a
    warning) when it names anything else. A relative record must be one plain name; an
    absolute one (written before records were relative, or by the run this dir was copied
    from) means the entry of that name here, so a copied run dir never reaches back into
    the original. A symlink whose target lies outside `directory` is rejected too.

    Args:
        directory: the dir the recorded name belongs to.
        recorded: the name as read from the file (any type: only a str or Path can pass).
        source: the file the name was read from, named in the warning.
        what: what the name stands for (``"checkpoint"``, ...), named in the warning.

    Returns:
        ``directory / name``, or None when `recorded` is not one plain name (after an absolute path
        is reduced to its entry here) or leads out of `directory` through a symlink.
    """
    name = _one_name(directory, recorded)
    if name is None:
        log.warning("Ignoring %r recorded in %s: not the name of a %s in %s", recorded, source, what, directory)
        return None
    path = directory / name
    if not inside(directory, path):
        log.warning("Ignoring %r recorded in %s: it leads out of %s (a symlink)", recorded, source, directory)
        return None
    return path


def inside(directory: Path, path: Path) -> bool:
    """Whether `path` resolves (symlinks followed) to an entry directly in `directory`.

    Args:
        directory: the dir.
        path: the path to test; it need not exist.

    Returns:
        True when the resolved `path`'s parent is the resolved `directory`; False for a symlink loop.
    """
    try:
        return path.resolve().parent == directory.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        return False


def _one_name(directory: Path, recorded: object) -> str | None:
    if not isinstance(recorded, (str, Path)) or "\x00" in str(recorded):
        return None
    path = Path(recorded)
    if path.is_absolute():
        try:
            path = path.relative_to(directory.resolve())
        except ValueError:
            path = Path(path.name)
    parts = path.parts
    if len(parts) != 1 or parts[0] in (".", "..") or "\\" in parts[0]:
        return None
    return parts[0]


def name_pattern(template: str) -> re.Pattern[str]:
    """The names a file name template (``epoch_{}.pth``) gives: ``{}`` stands for a count; the
    sharded form of each (``epoch_3.dcp``) too.

    Args:
        template: a file name template with ``{}`` where a count goes, e.g. ``epoch_{}.pth``.

    Returns:
        A pattern that matches such a name (with ``fullmatch``: it is not anchored), its count as digits,
        or the same name with ``.dcp`` in place of a ``.pth`` suffix.
    """
    regex = r"\d+".join(re.escape(part) for part in template.split("{}"))
    stem = regex.removesuffix(re.escape(".pth"))
    return re.compile(rf"(?:{regex}|{stem}\.dcp)")
