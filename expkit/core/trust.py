"""Which ``_target_`` values expkit builds from a config it did not compose itself.

A checkpoint carries the config of the run that wrote it, and ``expkit.eval`` and
``load_model`` build the model, data and metrics from it. That config is data from whoever
wrote the file: ``torch.load(weights_only=True)`` keeps pickles out, but a plain string
``_target_: builtins.open`` would still be called by Hydra's ``instantiate``. So before
anything of a stored config is built, every ``_target_`` in it (nested ones, ``_args_`` and
``_partial_`` nodes included) must be trusted:

- expkit's buildable modules and the libraries its shipped configs build from
  (``DEFAULT_TRUSTED``), and every target a shipped YAML names;
- packages or objects the user names (``trusted_targets=[my_project]``), and the targets
  named in the user's own config dirs (``--config-dir``).

A target is checked as text before anything is imported (``a.b`` trusts ``a.b`` and
``a.b.c``, never ``a.bc``), then as the object it resolves to: no dunder hops
(``X.__init__.__globals__``), no hop through a module imported under another name
(``torch.nn.functional.torch.load``), and a function or class must itself live in a trusted
module (``from os import system`` in a trusted module does not make ``system`` trusted).
The text of a config is trusted only after interpolations are resolved, so
``${oc.decode:...}`` cannot smuggle a target in.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from expkit.core.errors import ConfigError

__all__ = [
    "DEFAULT_TRUSTED",
    "NEVER_TRUSTED",
    "SHIPPED_CONF",
    "TrustPolicy",
    "UntrustedTargetError",
    "config_dir_targets",
]


# Modules whose every public callable may be built from a stored config.
DEFAULT_TRUSTED = (
    "expkit.models",
    "expkit.data",
    "expkit.metrics",
    "expkit.schedulers",
    "torch.nn",
    "torch.optim",
    "torchvision.models",
    "torchvision.transforms",
    "torchmetrics",
)
# Within those: metrics whose string arguments load models or code from a path or a hub.
NEVER_TRUSTED = (
    "torchmetrics.text.bert",
    "torchmetrics.functional.text.bert",
    "torchmetrics.text.infolm",
    "torchmetrics.functional.text.infolm",
    "torchmetrics.multimodal",
    "torchmetrics.functional.multimodal",
)
SHIPPED_CONF = Path(__file__).parents[1] / "conf"


class UntrustedTargetError(ConfigError):
    """A stored config names a ``_target_`` this installation does not trust."""


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def config_dir_targets(dirs: Iterable[str | Path]) -> set[str]:
    """Every ``_target_`` string named in the YAML files under `dirs`.

    Args:
        dirs: the config directories, searched recursively for ``*.yaml`` files; a file that cannot be
            read or parsed is skipped.

    Returns:
        The ``_target_`` values, from every document of every file.
    """
    found: set[str] = set()
    for directory in dirs:
        for path in Path(directory).rglob("*.yaml"):
            try:
                docs = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                continue
            for doc in docs:
                found.update(target for _, target in _targets(doc, ""))
    return found


@functools.cache
def _shipped_targets() -> frozenset[str]:
    return frozenset(config_dir_targets([SHIPPED_CONF]))


def _targets(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every ``_target_`` in a plain container, depth first."""
    if isinstance(node, dict):
        for name, value in node.items():
            path = f"{key}.{name}" if key else str(name)
            if name == "_target_":
                yield path, value
            else:
                yield from _targets(value, path)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _targets(value, f"{key}[{i}]")


class TrustPolicy:
    """The targets one reader of stored configs trusts (see the module docstring).

    Args:
        trusted_targets: the user's dotted package, module or object names (e.g. ``["my_project"]``),
            trusted besides expkit's: each one and every name under it, except ``NEVER_TRUSTED``. Blank
            entries are ignored.
        config_dirs: directories whose YAML files (read recursively, now) name targets that are trusted
            exactly as named.

    Raises:
        ConfigError: an entry of `trusted_targets` is not a dotted name.
    """

    def __init__(self, trusted_targets: Sequence[str] | str = (), config_dirs: Sequence[str | Path] = ()) -> None:
        if isinstance(trusted_targets, str):  # trusted_targets=my_project: one name, not its letters
            trusted_targets = [trusted_targets]
        self.user = tuple(str(t).strip() for t in trusted_targets if str(t).strip())
        for entry in self.user:
            if not all(part.isidentifier() for part in entry.split(".")):
                raise ConfigError(
                    f"trusted_targets: {entry!r} is not a dotted module or object name "
                    "(e.g. trusted_targets=[my_project] or [my_project.models.Net])"
                )
        self.exact = _shipped_targets() | config_dir_targets(config_dirs)
        self.prefixes = (*DEFAULT_TRUSTED, *self.user)

    def _text_trusted(self, target: str) -> bool:
        if target in self.exact:
            return True
        return _under(target, self.prefixes) and not _under(target, NEVER_TRUSTED)

    def check(self, config: Any, source: str | Path) -> None:
        """Raise UntrustedTargetError for the first ``_target_`` of `config` (a plain, resolved
        container) that is not trusted; nothing is imported for a target refused as text."""
        for key, target in _targets(config, ""):
            if not isinstance(target, str) or not self._text_trusted(target):
                root = target.split(".")[0] if isinstance(target, str) else "?"
                raise self._refusal(key, target, source, "", f"trust its package, trusted_targets=[{root}]")
            problem, hint = self._object_problem(target)
            if problem:
                raise self._refusal(key, target, source, problem, hint)

    def _object_problem(self, target: str) -> tuple[str, str]:
        """(why the object `target` resolves to is not trusted, what to do), ('', '') when it is."""
        parts = target.split(".")
        if any(p.startswith("__") or not p.isidentifier() for p in parts):
            return " (a dunder or malformed name)", "no setting builds it"
        obj, walked = None, ""
        for part in parts:
            walked = f"{walked}.{part}" if walked else part
            try:
                obj = getattr(obj, part) if obj is not None else importlib.import_module(part)
            except AttributeError:
                try:
                    obj = importlib.import_module(walked)
                except ImportError:
                    return "", ""  # does not import: instantiate reports it, naming the key
            except ImportError:
                return "", ""
            if isinstance(obj, type(importlib)) and obj.__name__ != walked:
                return f" ({walked} is the module {obj.__name__} under another name)", "name the object by its own path"
        if target in self.exact or target in self.user:
            return "", ""  # named exactly by a config file or the user: that very object
        home = getattr(obj, "__module__", None)
        if isinstance(home, str) and (not _under(home, self.prefixes) or _under(home, NEVER_TRUSTED)):
            own = f"{home}.{getattr(obj, '__qualname__', parts[-1])}"
            return f" (it is {own})", f"trust exactly this object, trusted_targets=[{target}]"
        return "", ""

    @staticmethod
    def _refusal(key: str, target: Any, source: str | Path, why: str, hint: str) -> UntrustedTargetError:
        return UntrustedTargetError(
            f"{source}: refused to build {key}={target!r}{why}. A stored config is data from whoever wrote the "
            f"file; expkit builds only the targets it trusts (its own, {', '.join(DEFAULT_TRUSTED[4:])}, and "
            f"those its shipped configs and your --config-dir name). If you trust the file's author: {hint} "
            "(on the command line of expkit.eval, predict or export), or load_model(..., trusted_targets=[...])."
        )
