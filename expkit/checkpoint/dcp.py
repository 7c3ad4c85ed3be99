"""Sharded checkpoints: the ``torch.distributed.checkpoint`` (DCP) file format of ``trainer.strategy=fsdp``.

A sharded checkpoint is a directory (``checkpoints/epoch_3.dcp/``) written with
``torch.distributed.checkpoint``: every rank writes its own shard of the weights and optimizer
state (``__<rank>_0.distcp``), rank 0 writes the index (``.metadata``) and ``state.pth``
(everything else: counters, config, random state, schedulers, hooks, the optimizers' settings).
It is written under a temporary name and renamed when complete, synchronously (``save``) or
in the background (``AsyncShards``). It loads on any number of processes (``load_into``: DCP
reshards), and in one process without a process group (``read_weights``, ``read_tensors``;
``expkit.checkpoint.checkpoint_io.load_checkpoint`` reads one whole). The model is sharded by
``expkit.engine.fsdp``; a checkpoint of one process keeps this form too, so that a run can
move between 1 and N processes.

Reading one never runs code from the files: tensors only go through DCP (the optimizers'
plain values go to ``state.pth``, read with ``weights_only=True``), and DCP's ``.metadata``, a
pickle, is read by an unpickler that builds only DCP's own metadata classes.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from expkit.core import distributed
from expkit.core.errors import ConfigError

__all__ = [
    "STATE_FILE",
    "SUFFIX",
    "AsyncShards",
    "check_shards",
    "checkpoint_name",
    "is_checkpoint_dir",
    "is_sharded",
    "load_into",
    "read_tensors",
    "read_weights",
    "save",
]


STATE_FILE = "state.pth"  # beside DCP's shards: everything but the tensors of weights and optimizers
SUFFIX = ".dcp"


# -- the model ------------------------------------------------------------------------------------
def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is sharded by FSDP2 (an ``FSDPModule``, ``expkit.engine.fsdp.shard``): its
    weights then load only through DCP's state-dict functions.

    Args:
        model: the model to test.

    Returns:
        True when ``fully_shard`` was applied to `model` itself.
    """
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# -- what goes through DCP (tensors) and what goes to state.pth (the rest) ---------------------------
def _split(tree: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tensor leaves, everything else) of a nested dict, each keeping the nesting."""
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, Mapping):
            t, r = _split(value)
            if t:
                tensors[key] = t
            if r or not t:
                rest[key] = r
        else:
            rest[key] = value
    return tensors, rest


def _merge(tensors: Mapping[str, Any], rest: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(rest)
    for key, value in tensors.items():
        merged[key] = _merge(value, merged.get(key, {})) if isinstance(value, Mapping) else value
    return merged


def _model_state(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter names (not positions): portable between any
    number of processes, sharded or not."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer)


# -- saving ---------------------------------------------------------------------------------------
def checkpoint_name(name: str) -> str:
    """The directory name of a sharded checkpoint for a file name (``epoch_3.pth`` -> ``epoch_3.dcp``).

    Args:
        name: a checkpoint file name, ``.pth`` or ``.dcp``.

    Returns:
        `name` with a ``.pth`` or ``.dcp`` suffix removed and ``.dcp`` appended.
    """
    return name.removesuffix(".pth").removesuffix(SUFFIX) + SUFFIX


def _begin(
    path: Path, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer]
) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """(the temporary directory every rank writes into, the tensors for DCP, the optimizers'
    plain values), collectively: the temporary name is rank 0's and cleared before any rank writes."""
    # under FSDP2 these are this rank's local shards (DTensors), views of the live parameters and
    # optimizer state: no communication, and no copy either (a caller that writes them in the
    # background stages them first)
    tensors: dict[str, Any] = {"model": _model_state(model)}
    plain: dict[str, Any] = {}
    for name, optimizer in optimizers.items():
        tensors[f"optimizer.{name}"], plain[name] = _split(_optimizer_state(model, optimizer))
    # one directory for every rank's shards: rank 0's pid names it, and a directory a killed
    # writer left under that name is gone before any rank writes into it
    tmp = path.with_name(f".{path.name}.tmp{distributed.broadcast_object(os.getpid())}")
    if distributed.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    distributed.barrier()
    return tmp, tensors, plain


def _complete(tmp: Path, path: Path, state: dict[str, Any], plain: dict[str, Any], durable: bool) -> None:
    """Rank 0, once every shard and DCP's index are in `tmp`: ``state.pth`` beside them, then the name."""
    from expkit.core import atomic

    atomic.save_atomic(
        {**state, "sharded": {"optimizers": plain, "world_size": distributed.rank_and_world()[1]}},
        tmp / STATE_FILE,
        durable=durable,
    )
    _replace_dir(tmp, path)


def _written(tmp: Path, write: Any) -> None:
    """Run DCP's save (`write`), its failure as the error a failed write is elsewhere (DCP
    raises a CheckpointException, a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # one process: "assuming the intent is to save in a single process", it is
            warnings.simplefilter("ignore", UserWarning)
            write()
    except CheckpointException as exc:
        raise RuntimeError(f"torch.distributed.checkpoint could not write {tmp}: {exc}") from exc


def save(
    path: Path,
    state: dict[str, Any],
    model: nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer],
    durable: bool = False,
) -> Path:
    """Write a sharded checkpoint at `path` (a directory), collectively: every rank calls this.
    `state` is rank 0's checkpoint without weights and optimizers. Written under a temporary
    name and renamed by rank 0 once every shard and the index are complete.

    Args:
        path: the checkpoint directory to write (``<name>.dcp``).
        state: the rest of the checkpoint (counters, config, ...), written by rank 0 to ``state.pth``.
        model: the model, sharded or not, whose weights are written.
        optimizers: the optimizers by name, whose state is written (tensors through DCP, the rest to
            ``state.pth``).
        durable: fsync the shards and ``state.pth``, so that they survive a power cut.

    Returns:
        `path`.

    Raises:
        RuntimeError: when DCP could not write the shards.
        OSError: on rank 0, its own error completing the checkpoint (e.g. FileExistsError when something
            that is not a sharded checkpoint is in the way); on the other ranks, one naming it.
    """
    import torch.distributed.checkpoint as torch_dcp

    tmp, tensors, plain = _begin(path, model, optimizers)
    _written(tmp, lambda: torch_dcp.save(tensors, storage_writer=torch_dcp.FileSystemWriter(tmp, sync_files=durable)))
    error = None
    if distributed.is_main():
        try:
            _complete(tmp, path, state, plain, durable)
        except Exception as exc:
            error = exc
    # no rank goes on (and may read it) before it has its name; a failure on rank 0 fails all
    failed = distributed.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed is not None:
        raise OSError(f"rank 0 could not complete {path}: {failed}")
    return path


class AsyncShards:
    """``async_save`` for sharded checkpoints: ``torch.distributed.checkpoint.async_save``, with
    a process group (gloo) of its own per kind of save for DCP's collectives in its thread, so
    that they never mix with training's collectives nor with each other's (a best and a
    regular save can be in flight together). Made collectively (every rank, in the same order).

    The shards are staged by the caller (``BackgroundWriter.stage``: each rank's local shards
    copied into host buffers kept from save to save) and handed to DCP as they are: for
    ResNet-50 with AdamW that copy takes 24 ms here against 40 ms for DCP's DefaultStager
    (``benchmarks/ckpt_stall.py --sharded``)."""

    KINDS = ("regular", "best")

    def __init__(self) -> None:
        import torch.distributed as dist

        joined = dist.is_available() and dist.is_initialized()
        self.groups = {kind: dist.new_group(backend="gloo") if joined else None for kind in self.KINDS}

    def save(
        self,
        path: Path,
        state: dict[str, Any],
        model: nn.Module,
        optimizers: Mapping[str, torch.optim.Optimizer],
        durable: bool,
        kind: str,
        stage: Any,
    ) -> Any:
        """Start writing a sharded checkpoint at `path`: returns once this rank's shards are
        copied to host memory (`stage`: a copy training does not change), with the call that
        completes it (in the writer's thread): wait for every rank's shards and the index,
        then rank 0 writes ``state.pth`` (`state`, a copy already) and gives the name. No rank
        may read the checkpoint before the ranks have agreed it is complete (``agree``)."""
        import copy

        import torch.distributed.checkpoint as torch_dcp

        tmp, tensors, plain = _begin(path, model, optimizers)
        # the optimizers' plain values are read in the writer's thread, after the scheduler has
        # changed the learning rates of the next steps: a copy of them as they are now
        plain = copy.deepcopy(plain)
        # `tensors` are views of the live shards, which the next optimizer step overwrites while
        # DCP writes: a host copy of each (DTensors rebuilt around the copies of their local
        # shards), complete (CUDA synchronised) when `stage` returns, so the loop goes on at once
        staged = stage(tensors)
        futures: list[Any] = []
        _written(
            tmp,
            lambda: futures.append(
                torch_dcp.async_save(
                    staged,
                    storage_writer=torch_dcp.FileSystemWriter(tmp, sync_files=durable),
                    # DCP's collectives (planning, gathering the write results) run in its own
                    # thread while training runs collectives on the default group: on a group of
                    # their own, one per kind, they can never pair with the wrong call
                    process_group=self.groups[kind],
                    # `staged` is a copy already: DCP's default stager would copy it a second time
                    async_stager=_Staged(),
                )
            ),
        )

        def complete() -> None:
            # DCP ends with a collective: rank 0 gathers every rank's write results, writes the
            # index, and sends the outcome back; so a result means every shard and the index are
            # in `tmp`, and rank 0 alone then writes state.pth and gives the name. Its failure
            # there reaches the other ranks only through ``agree``, at the next wait.
            _written(tmp, futures[0].result)
            if distributed.is_main():
                _complete(tmp, path, state, plain, durable)

        return complete

    @staticmethod
    def agree(error: BaseException | None) -> BaseException | None:
        """Every rank's outcome of the same background write, on every rank (collective, on the
        training thread): this rank's own error, or the first other rank's, or None."""
        from expkit.core.errors import CheckpointWriteError

        if not distributed.is_distributed():
            return error
        failed = distributed.first_problem(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            return error
        if failed is None:
            return None
        return CheckpointWriteError(f"rank {failed[0]} could not complete its part of the checkpoint: {failed[1]}")


class _Staged:
    """DCP's stager (``torch.distributed.checkpoint.staging.AsyncStager``) for a state dict that
    is a host copy already: hands it over as it is."""

    # nothing to wait for after DCP starts its thread: the copy was complete before async_save
    should_synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _replace_dir(new: Path, path: Path) -> None:
    """Give `new` the name `path`; an existing checkpoint of that name (saved again at the same
    count) is moved aside first and deleted after: a kill in between leaves a temporary name."""
    old = None
    if path.is_symlink() or (path.exists() and not is_checkpoint_dir(path)):
        raise FileExistsError(
            f"{path} is in the way of the checkpoint to be saved there and is not one of "
            "expkit's sharded checkpoints; move it out of the checkpoints dir"
        )
    if path.exists():
        old = path.with_name(f".{path.name}.tmp{os.getpid()}old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(new, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- reading --------------------------------------------------------------------------------------
def is_checkpoint_dir(path: Path) -> bool:
    """Whether `path` is a complete sharded checkpoint: a directory holding DCP's index (``.metadata``) and
    ``state.pth``.

    Args:
        path: the path to test.

    Returns:
        True when both files are there (the shards themselves are not checked).
    """
    return path.is_dir() and (path / ".metadata").is_file() and (path / STATE_FILE).is_file()


# the classes a DCP index is made of, by module: nothing else is built while reading one
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # (Python 3.13's name)
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes, torch dtypes, sizes and layouts, and paths: names
    are looked up exactly (no dotted names, which pickle would follow through the module)."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and name in _METADATA_CLASSES.get(module, ()):
            if module.startswith("pathlib"):  # an index written by any Python reads on any other
                import pathlib

                return getattr(pathlib, name)
            found = super().find_class(module, name)
            if getattr(found, "__module__", None) == module:
                return found
        if (
            module == "torch"
            and "." not in name
            and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def _check_index(metadata: Any, path: Path) -> None:
    """Every shard file the index names lies in the checkpoint's own directory."""
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = str(getattr(info, "relative_path", ""))
        if (
            not relative
            or relative.startswith(("/", "\\"))
            or ".." in Path(relative).parts
            or Path(relative).is_absolute()
        ):
            raise ConfigError(f"{path}: refused, its index names a shard outside the checkpoint ({relative!r})")


def check_shards(path: Path, key: str = "resume") -> None:
    """Every shard file the index of `path` names is there and long enough for what the index reads
    from it: a node that died mid-write, a disk that filled or a copy cut short leaves a shard
    missing or truncated, which DCP would find only while loading, after the run had chosen this
    checkpoint. DCP keeps no checksums: a shard damaged inside is not seen here.

    Args:
        path: a sharded checkpoint directory (``is_checkpoint_dir``).
        key: the config key that gave `path`, named in the error.

    Raises:
        ConfigError: when the index cannot be read, or names a shard that is missing or shorter than
            the index says.
    """
    try:
        metadata = _reader(path).read_metadata()
    except ConfigError:
        raise
    except Exception as exc:  # (a truncated index: pickle's EOFError, an OSError)
        raise ConfigError(
            f"{key}={path}: unreadable checkpoint index (.metadata: {type(exc).__name__}: {exc})"
        ) from None
    needs: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(info.relative_path)
        needs[name] = max(needs.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needs.items()):
        try:
            have = (path / name).stat().st_size
        except OSError:
            raise ConfigError(f"{key}={path}: damaged sharded checkpoint: its shard {name} is missing") from None
        if have < size:
            raise ConfigError(
                f"{key}={path}: damaged sharded checkpoint: its shard {name} holds {have} bytes, its index "
                f"reads {size} (a write cut short)"
            )


def _reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")  # (torch 2.9 and later may ask for a rank's own index)
            with open(Path(path) / (".metadata" if rank is None else f"__{rank}.metadata"), "rb") as f:
                data = f.read()
            try:
                metadata = _MetadataUnpickler(io.BytesIO(data)).load()
            except Exception as exc:
                raise ConfigError(
                    f"{path}: refused, its index (.metadata) is not a plain checkpoint index ({exc})"
                ) from None
            _check_index(metadata, path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _tensor_planner(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:  # our checkpoints hold no pickled values
            raise ConfigError(f"refused: the sharded checkpoint holds a pickled value ({read_item.dest_index.fqn})")

    return TensorsOnly(**kwargs)


def load_into(
    path: Path,
    state: Mapping[str, Any],
    model: nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
) -> None:
    """Load a sharded checkpoint's weights (and the state of those of `optimizers` it holds) into
    `model`, sharded or not, on any number of processes: every rank calls this.

    Args:
        path: the sharded checkpoint directory.
        state: the checkpoint's ``state.pth`` (``read_state``): its ``sharded.optimizers`` gives the
            optimizers' plain values and which optimizers were saved.
        model: the model to load the weights into.
        optimizers: the optimizers by name; those the checkpoint does not hold are left as they are.
            None: none.

    Raises:
        ConfigError: when the index is refused, or the tensors do not fit the model or an optimizer.
    """
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    template: dict[str, Any] = {"model": _model_state(model)}
    plain: dict[str, Any] = {}
    saved_plain = state.get("sharded", {}).get("optimizers", {})
    optimizers = {name: opt for name, opt in (optimizers or {}).items() if name in saved_plain}
    saved = set(_reader(path).read_metadata().state_dict_metadata)
    for name, optimizer in optimizers.items():
        tensors, _ = _split(_optimizer_state(model, optimizer))
        # a parameter the saved optimizer never stepped (unused in the loss) has no state there;
        # the template (from a zero step on every parameter) would ask for it
        state = tensors.get("state", {})
        for fqn in [
            f for f, entries in state.items() if not all(f"optimizer.{name}.state.{f}.{k}" in saved for k in entries)
        ]:
            del state[fqn]
        template[f"optimizer.{name}"] = tensors
        plain[name] = saved_plain[name]
    try:
        torch_dcp.load(template, storage_reader=_reader(path), planner=_tensor_planner())
    except ConfigError:
        raise
    except (Exception, CheckpointException) as exc:  # (DCP's CheckpointException is a BaseException)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{path}: does not fit this model or optimizer ({first})") from None
    set_model_state_dict(model, template["model"])
    for name, optimizer in optimizers.items():
        # strict=False: parameters without saved state (never stepped) stay without state, as they were
        set_optimizer_state_dict(
            model, optimizer, _merge(template[f"optimizer.{name}"], plain[name]), options=StateDictOptions(strict=False)
        )


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights of a sharded checkpoint, in this process (no process group).

    Args:
        path: the sharded checkpoint directory.

    Returns:
        The weights by parameter (and buffer) name, on the CPU.

    Raises:
        ConfigError: when the index is refused or the checkpoint holds a pickled value.
    """
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _reader(path)
    metadata = reader.read_metadata()
    weights: dict[str, torch.Tensor] = {}
    for key, entry in metadata.state_dict_metadata.items():  # an empty tensor of each size, to read into
        where = (metadata.planner_data or {}).get(key, ())
        if len(where) == 2 and where[0] == "model" and isinstance(entry, TensorStorageMetadata):
            weights[where[1]] = torch.empty(entry.size, dtype=entry.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        torch_dcp.load({"model": weights}, storage_reader=_reader(path), planner=_tensor_planner(), no_dist=True)
    return weights


def read_tensors(path: Path) -> dict[str, Any]:
    """Every tensor of a sharded checkpoint, whole, in this process: ``model`` (the weights) and
    ``optimizer.<name>`` (its state by parameter name), nested as they were saved. For
    comparing two checkpoints (``expkit.check``), not for loading into a model.

    Args:
        path: the sharded checkpoint directory.

    Returns:
        The tensors, on the CPU, nested by the path they were saved under.

    Raises:
        ConfigError: when the index is refused or the checkpoint holds a pickled value.
    """
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _reader(path).read_metadata()
    tree: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        where = (metadata.planner_data or {}).get(key, ())
        if not where or not isinstance(entry, TensorStorageMetadata):
            continue
        node = tree
        for part in where[:-1]:
            node = node.setdefault(part, {})
        node[where[-1]] = torch.empty(entry.size, dtype=entry.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        torch_dcp.load(tree, storage_reader=_reader(path), planner=_tensor_planner(), no_dist=True)
    return tree
