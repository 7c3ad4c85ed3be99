"""The old import paths of the modules that moved into subpackages (issues 42 and 59).

``import expkit.runner`` (or a stored config's ``_target_: expkit.backends.TensorBoardBackend``)
gives the module at its new path, ``expkit.engine.runner``, the same module object, after a
``DeprecationWarning`` that names the new path. Done with an import finder of expkit's own on
``sys.meta_path`` (Python's documented hook for this), not with a file per old name: the top of
the package keeps only what users touch (CONTRIBUTING.md, "The layout").

Why it stays although no release had the old paths: a checkpoint stores its run's config, and
checkpoints written before the moves name the old paths in their ``_target_``s (the fixture
``tests/fixtures/iter_50-2026-11-27.pth`` is one). Resuming, evaluating, predicting with or
exporting such a checkpoint builds those targets, and checkpoints outlive the code that wrote
them. So no version is set for removing it; it goes when such checkpoints need no longer load.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import warnings
from functools import partial
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "SPLIT", "MovedModules", "install", "new_name"]

# old module (under expkit.) -> the subpackage it lives in now
MOVED: dict[str, str] = {
    **dict.fromkeys(("build", "cli", "restore"), "config"),
    "check_probe": "check",
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


# a module whose names went to more than one module (issue 59): its old path -> (where its names
# are now, unless listed; the names listed, at their new dotted paths). Importing the old path
# gives a module that only forwards: each name, read there, warns with its new path.
SPLIT: dict[str, tuple[str, dict[str, str]]] = {
    # FSDP2 sharding went beside DDP in the engine; the DCP file format stayed in checkpoint/, and the
    # readers of a whole sharded checkpoint went to checkpoint_io (the reader of every format)
    "expkit.checkpoint.sharding": (
        "expkit.checkpoint.dcp",
        {
            **{
                name: f"expkit.engine.fsdp.{name}"
                for name in ("DTYPES", "FORWARD_METHODS", "block_names", "check_hooks", "check_runner_inputs", "shard")
            },
            "read_consolidated": "expkit.checkpoint.checkpoint_io.read_consolidated",
            "read_state": "expkit.checkpoint.checkpoint_io.read_sharded_state",
        },
    ),
}


def _split_name(module: str, name: str) -> str:
    """The dotted path where `name` of the split module `module` lives now."""
    first, listed = SPLIT[module]
    return listed.get(name, f"{first}.{name}")


def _forward(module: str, name: str) -> Any:
    """A split module's ``__getattr__``: `name` from the module that holds it now, with a warning."""
    if name.startswith("__"):  # (the import system asks for __path__ and the like: not forwarded)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = _split_name(module, name)
    home, _, attribute = new.rpartition(".")
    try:
        value = getattr(importlib.import_module(home), attribute)
    except AttributeError:
        raise AttributeError(f"module {module!r} has no attribute {name!r}") from None
    warnings.warn(f"{module}.{name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
    return value


def new_name(dotted: str) -> str:
    """``expkit.runner.Runner`` -> ``expkit.engine.runner.Runner``: a dotted name written
    before the move, at its new path (anything else unchanged); a name of a split module
    (``expkit.checkpoint.sharding.shard``) at the module that holds it now (``expkit.engine.fsdp.shard``).

    Args:
        dotted: a dotted name, e.g. a ``_target_`` of a stored config.

    Returns:
        `dotted` with the moved module's subpackage inserted after ``expkit.``, and a split module's
        name at its new path; `dotted` itself when it names neither.
    """
    head, _, rest = dotted.partition(".")
    module, _, tail = rest.partition(".")
    if head == "expkit" and module in MOVED:
        dotted = ".".join(filter(None, ("expkit", MOVED[module], module, tail)))
    split = next((m for m in SPLIT if dotted.startswith(f"{m}.")), None)
    if split is None:
        return dotted
    name, _, tail = dotted[len(split) + 1 :].partition(".")
    return ".".join(filter(None, (_split_name(split, name), tail)))


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``expkit.<old>`` and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname.startswith("expkit.") and fullname.count(".") == 1 and fullname[7:] in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        if fullname in SPLIT:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        if spec.name in SPLIT:  # names read from it warn one by one, each with its own new path
            forwarding = ModuleType(spec.name, f"The names of {spec.name}, now in {SPLIT[spec.name][0]} and beside it.")
            forwarding.__getattr__ = partial(_forward, spec.name)  # type: ignore[method-assign]
            return forwarding
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
