"""The old import paths of the modules that moved into subpackages (0.1 to 0.2, issue 42).

``import expkit.runner`` (or a stored config's ``_target_: expkit.backends.TensorBoardBackend``)
gives the module at its new path, ``expkit.engine.runner``, the same module object, after a
``DeprecationWarning`` that names the new path. Done with an import finder of expkit's own on
``sys.meta_path`` (Python's documented hook for this), not with a file per old name: the top of
the package keeps only what users touch (CONTRIBUTING.md, "The layout").
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import warnings
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "MovedModules", "install", "new_name"]

# old module (under expkit.) -> the subpackage it lives in now
MOVED: dict[str, str] = {
    **dict.fromkeys(("build", "cli", "restore"), "config"),
    **dict.fromkeys(("search", "sweep_jobs"), "sweeps"),
    **dict.fromkeys(("devices", "hook_table", "loops", "runner"), "engine"),
    **dict.fromkeys(("async_writer", "checkpoint_io", "remote", "run_checkpoint", "sharding"), "checkpoint"),
    **dict.fromkeys(("backends", "logs", "mlflow_backend", "svgplot", "wandb_files"), "loggers"),
    **dict.fromkeys(("ownership", "provenance", "results"), "workdir"),
    **dict.fromkeys(
        (
            "atomic",
            "confine",
            "data_info",
            "distributed",
            "errors",
            "hydra_compat",
            "param_groups",
            "rng",
            "settings",
            "signals",
            "stages",
            "trust",
            "versions",
        ),
        "core",
    ),
}


def new_name(dotted: str) -> str:
    """``expkit.runner.Runner`` -> ``expkit.engine.runner.Runner``: a dotted name written
    before the move, at its new path (anything else unchanged).

    Args:
        dotted: a dotted name, e.g. a ``_target_`` of a stored config.

    Returns:
        `dotted` with the moved module's subpackage inserted after ``expkit.``; `dotted` itself when
        it does not start with ``expkit.<old module>``.
    """
    head, _, rest = dotted.partition(".")
    module, _, tail = rest.partition(".")
    if head != "expkit" or module not in MOVED:
        return dotted
    return ".".join(filter(None, ("expkit", MOVED[module], module, tail)))


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``expkit.<old>`` and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname.startswith("expkit.") and fullname.count(".") == 1 and fullname[7:] in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = new_name(spec.name)
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # (the module at its new path ran already)


def install(meta_path: list[Any]) -> None:
    """Put the finder on `meta_path` (``sys.meta_path``), once.

    Args:
        meta_path: the finder list to extend, normally ``sys.meta_path``; changed in place.
    """
    if not any(isinstance(f, MovedModules) for f in meta_path):
        meta_path.append(MovedModules())
