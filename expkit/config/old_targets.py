"""The ``_target_``s of configs stored before expkit's modules moved, at their paths today.

A checkpoint stores its run's config, and checkpoints written before the moves (issues 42, 59
and 64) name the old module paths in their ``_target_``s (``expkit.backends.TensorBoardBackend``;
the fixture ``tests/fixtures/iter_50-2026-11-27.pth`` is one). ``restore.stored_config`` renames
them with ``new_name`` before the trust rules read them, so that such a checkpoint resumes,
evaluates, predicts and exports. Only stored configs are renamed: the old import paths
themselves (``import expkit.runner``) are gone, as no release ever had them.
"""

from __future__ import annotations

__all__ = ["MOVED", "RENAMED", "SPLIT", "new_name"]

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
# are now, unless listed; the names listed, at their new dotted paths)
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

# a module that became a module of a package (issue 64): its old dotted path -> its new one
RENAMED: dict[str, str] = {"expkit.shard_data": "expkit.data.shards"}


def _split_name(module: str, name: str) -> str:
    """The dotted path where `name` of the split module `module` lives now."""
    first, listed = SPLIT[module]
    return listed.get(name, f"{first}.{name}")


def new_name(dotted: str) -> str:
    """``expkit.runner.Runner`` -> ``expkit.engine.runner.Runner``: a dotted name written
    before the moves, at its new path (anything else unchanged); a name of a split module
    (``expkit.checkpoint.sharding.shard``) at the module that holds it now (``expkit.engine.fsdp.shard``).

    Args:
        dotted: a dotted name, e.g. a ``_target_`` of a stored config.

    Returns:
        `dotted` at the path its object has today; `dotted` itself when it names no moved module.
    """
    renamed = next((old for old in RENAMED if dotted == old or dotted.startswith(f"{old}.")), None)
    if renamed is not None:
        return RENAMED[renamed] + dotted[len(renamed) :]
    head, _, rest = dotted.partition(".")
    module, _, tail = rest.partition(".")
    if head == "expkit" and module in MOVED:
        dotted = ".".join(filter(None, ("expkit", MOVED[module], module, tail)))
    split = next((m for m in SPLIT if dotted.startswith(f"{m}.")), None)
    if split is None:
        return dotted
    name, _, tail = dotted[len(split) + 1 :].partition(".")
    return ".".join(filter(None, (_split_name(split, name), tail)))
