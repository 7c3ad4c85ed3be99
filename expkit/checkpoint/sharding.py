"""``trainer.strategy=fsdp``: FSDP2 sharding and sharded checkpoints.

Under torchrun, ``shard()`` applies PyTorch's FSDP2 (``fully_shard``) to the chosen blocks of
the model, then to the root, before the optimizer is built: every rank then holds 1/N of the
parameters, gradients and optimizer state. In one process nothing is sharded, but checkpoints
keep the sharded form, so a run can move between 1 and N processes.

A sharded checkpoint is a directory (``checkpoints/epoch_3.dcp/``) written with
``torch.distributed.checkpoint``: every rank writes its own shard of the weights and optimizer
state (``__<rank>_0.distcp``), rank 0 writes the index (``.metadata``) and ``state.pth``
(everything else: counters, config, random state, schedulers, hooks, the optimizers' settings).
It is written under a temporary name and renamed when complete. It loads on any number of
processes (DCP reshards), and in one process without a process group (``read_consolidated``).

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
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from expkit.core import activation_checkpointing as act_ckpt
from expkit.core import distributed
from expkit.core.errors import ConfigError

__all__ = [
    "DTYPES",
    "FORWARD_METHODS",
    "STATE_FILE",
    "SUFFIX",
    "AsyncShards",
    "block_names",
    "check_hooks",
    "check_runner_inputs",
    "checkpoint_name",
    "is_checkpoint_dir",
    "is_sharded",
    "load_into",
    "read_consolidated",
    "read_state",
    "read_tensors",
    "read_weights",
    "save",
    "shard",
]


STATE_FILE = "state.pth"  # beside DCP's shards: everything but the tensors of weights and optimizers
SUFFIX = ".dcp"
FORWARD_METHODS = ("train_step", "eval_step", "generate")  # model methods that run like forward under FSDP2


# -- sharding -------------------------------------------------------------------------------------
def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is sharded by FSDP2 (an ``FSDPModule``).

    Args:
        model: the model to test.

    Returns:
        True when ``fully_shard`` was applied to `model` itself.
    """
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def block_names(model: nn.Module, given: Iterable[str] | None) -> list[str]:
    """The module class names to shard one by one: `given` (``trainer.fsdp_blocks``), else the
    model's ``fsdp_blocks`` (or Hugging Face's ``_no_split_modules``), else the classes of the
    root's children that hold parameters.

    Args:
        model: the model to shard.
        given: the class names the config gives (``trainer.fsdp_blocks``); None: not given.

    Returns:
        The class names, in the order given or found.

    Raises:
        ConfigError: when `given` names a class the model does not contain.
    """
    if given is not None:
        names = [str(n) for n in given]
        present = {type(m).__name__ for m in model.modules()}
        missing = [n for n in names if n not in present]
        if missing:
            raise ConfigError(
                f"trainer.fsdp_blocks names {missing}, which the model does not contain; its module "
                f"classes are {sorted(present)}"
            )
        return names
    declared = getattr(model, "fsdp_blocks", None) or getattr(model, "_no_split_modules", None)
    if declared:
        return [str(n) for n in declared]
    return list(dict.fromkeys(type(c).__name__ for c in model.children() if any(True for _ in c.parameters())))


def check_hooks(hooks: Mapping[str, Any]) -> None:
    """Refuse, at start-up, the hooks that say they do not work with sharded parameters
    (``supports_sharding = False``): better than a failure, or a hang, later.

    Args:
        hooks: every hook of the run, by name.

    Raises:
        ConfigError: when a hook has ``supports_sharding = False``, naming each such hook.
    """
    refused = [
        f"{name} ({type(hook).__name__})"
        for name, hook in hooks.items()
        if not getattr(hook, "supports_sharding", True)
    ]
    if refused:
        raise ConfigError(
            f"trainer.strategy=fsdp: the hook(s) {', '.join(refused)} do not work with sharded parameters "
            "yet; remove them (hooks=[...] without them) or use trainer.strategy=ddp"
        )


DTYPES = {"bf16": torch.bfloat16, "32": torch.float32}  # trainer.fsdp_param_dtype / fsdp_reduce_dtype


def shard(
    model: nn.Module,
    blocks: Iterable[str] | None,
    device: torch.device,
    *,
    activation_checkpointing: str | Sequence[str] | None = None,
    compiled: bool = False,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    offload: bool = False,
) -> nn.Module:
    """FSDP2 over `model` in place (on `device`): each module whose class is in the blocks
    (innermost first), then the root. The model's ``train_step`` / ``eval_step`` / ``generate``
    methods are registered as forward methods: calling them gathers the parameters as
    ``forward`` does (on every rank: a hook that calls the model must do so on all of them).

    Activation checkpointing wraps its blocks first, and a wrapped block is sharded as its wrapper
    (torchtitan's order): the all-gather stays outside the recomputed part.

    Args:
        model: the model to shard; moved to `device` and changed in place.
        blocks: the class names of the blocks (``trainer.fsdp_blocks``); None: found by ``block_names``.
        device: the device of this rank.
        activation_checkpointing: ``trainer.activation_checkpointing`` (None, ``"full"`` or class
            names), applied before sharding.
        compiled: whether the model will be compiled (``trainer.compile``), for activation checkpointing.
        param_dtype: ``trainer.fsdp_param_dtype``: the dtype the gathered parameters compute in
            (``bf16``, ``32``); the sharded master weights, the optimizer and checkpoints stay as they
            are. None: the parameters' own.
        reduce_dtype: ``trainer.fsdp_reduce_dtype``: the dtype gradients are reduce-scattered in;
            None: the compute dtype.
        offload: ``trainer.fsdp_offload``: keep the sharded parameters, gradients and optimizer state in
            (pinned) CPU memory, the optimizer stepping there; CUDA only.

    Returns:
        `model`, sharded.

    Raises:
        ConfigError: when the model owns its update (``train_step(batch, optimizers)``), `blocks` names a
            class the model does not contain, `offload` is asked on a device other than CUDA, or
            ``fully_shard`` fails on a module.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    from expkit.optimizers import owns_its_update

    if owns_its_update(model):
        raise ConfigError(
            "a model that owns its update (train_step(batch, optimizers)) is not supported with "
            "trainer.strategy=fsdp yet; train it with trainer.strategy=ddp"
        )
    if offload and device.type != "cuda":
        raise ConfigError(
            f"trainer.fsdp_offload=true moves shards between CUDA and CPU memory; this run's device is "
            f"{device.type}: set trainer.fsdp_offload=false"
        )
    model = model.to(device)  # (with offload, fully_shard moves the shards to CPU memory)
    names = set(block_names(model, blocks))
    act_ckpt.apply(model, activation_checkpointing, blocks, compiled=compiled)
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[param_dtype] if param_dtype else None,
        reduce_dtype=DTYPES[reduce_dtype] if reduce_dtype else None,
    )
    options = {"mp_policy": policy, "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
    mesh = init_device_mesh(device.type, (distributed.rank_and_world()[1],))
    chosen = [
        (path, m)
        for path, m in model.named_modules()
        if act_ckpt.block_class(m) in names
        and m is not model
        and not path.endswith(act_ckpt.WRAPPED_STEP)  # a wrapped block: its wrapper is sharded
        and any(True for _ in m.parameters())
    ]
    for path, module in [*reversed(chosen), ("(the root)", model)]:  # pre-order reversed: inner blocks first
        try:
            fully_shard(module, mesh=mesh, **options)
        except Exception as exc:
            raise ConfigError(
                f"trainer.strategy=fsdp: could not shard {path} ({type(module).__name__}): "
                f"{type(exc).__name__}: {exc}. Choose other blocks with trainer.fsdp_blocks=[ClassName,...] "
                "(a module used in two places cannot be its own block), or use trainer.strategy=ddp"
            ) from None
    for method in FORWARD_METHODS:
        if callable(getattr(model, method, None)):
            register_fsdp_forward_method(model, method)
    return model


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
    tensors: dict[str, Any] = {"model": _model_state(model)}
    plain: dict[str, Any] = {}
    for name, optimizer in optimizers.items():
        tensors[f"optimizer.{name}"], plain[name] = _split(_optimizer_state(model, optimizer))
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
    import torch.distributed.checkpoint as dcp

    tmp, tensors, plain = _begin(path, model, optimizers)
    _written(tmp, lambda: dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=durable)))
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

        import torch.distributed.checkpoint as dcp

        tmp, tensors, plain = _begin(path, model, optimizers)
        plain = copy.deepcopy(plain)  # (learning rates: the scheduler changes them meanwhile)
        staged = stage(tensors)
        futures: list[Any] = []
        _written(
            tmp,
            lambda: futures.append(
                dcp.async_save(
                    staged,
                    storage_writer=dcp.FileSystemWriter(tmp, sync_files=durable),
                    process_group=self.groups[kind],
                    async_stager=_Staged(),
                )
            ),
        )

        def complete() -> None:
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
        import torch.distributed as dist

        outcomes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            return error
        failed = next(((rank, what) for rank, what in enumerate(outcomes) if what is not None), None)
        if failed is None:
            return None
        return CheckpointWriteError(f"rank {failed[0]} could not complete its part of the checkpoint: {failed[1]}")


class _Staged:
    """DCP's stager (``torch.distributed.checkpoint.staging.AsyncStager``) for a state dict that
    is a host copy already: hands it over as it is."""

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


def read_state(path: Path, key: str) -> dict[str, Any]:
    """``state.pth`` of a sharded checkpoint (no weights), read as a checkpoint is.

    Args:
        path: the sharded checkpoint directory.
        key: the config key that gave `path`, named in error messages.

    Returns:
        The checkpoint without weights, its ``sharded`` entry with ``path`` (the directory, for
        ``load_into``) added.

    Raises:
        ConfigError: when `path` is not a complete sharded checkpoint, or ``state.pth`` does not load.
    """
    from expkit.checkpoint import checkpoint_io

    if not is_checkpoint_dir(path):
        raise ConfigError(
            f"{key}={path}: not a complete sharded checkpoint (a directory with .metadata and {STATE_FILE})"
        )
    state = checkpoint_io.load_checkpoint_file(path / STATE_FILE, key, need_weights=False)
    state["sharded"] = dict(state.get("sharded") or {}, path=str(path))
    return state


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
    import torch.distributed.checkpoint as dcp
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
        dcp.load(template, storage_reader=_reader(path), planner=_tensor_planner())
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
    import torch.distributed.checkpoint as dcp
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
        dcp.load({"model": weights}, storage_reader=_reader(path), planner=_tensor_planner(), no_dist=True)
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
    import torch.distributed.checkpoint as dcp
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
        dcp.load(tree, storage_reader=_reader(path), planner=_tensor_planner(), no_dist=True)
    return tree


def read_consolidated(path: Path, key: str) -> dict[str, Any]:
    """A sharded checkpoint as an ordinary one (``state_dict`` = the whole model's weights, no
    optimizer state), read in this process: for evaluation, export, ``load_from`` and the test.

    Args:
        path: the sharded checkpoint directory.
        key: the config key that gave `path`, named in error messages.

    Returns:
        The checkpoint, as ``read_state`` gives it, with ``state_dict`` (the weights) added.

    Raises:
        ConfigError: when `path` is not a complete sharded checkpoint, or a part of it is refused.
    """
    state = read_state(path, key)
    state["state_dict"] = read_weights(path)
    return state


def check_runner_inputs(
    model: nn.Module, hooks: Mapping[str, Any] | Sequence[Any], default_hooks: Mapping[str, Any] | None
) -> None:
    """trainer.strategy=fsdp: the model is sharded under torchrun, and every hook works with it.

    Args:
        model: the model the runner is given.
        hooks: the hooks, by name or as a list (each named after its class).
        default_hooks: the default hooks by name; None: none.

    Raises:
        ConfigError: when the model is not sharded in a distributed run, or a hook does not support
            sharding.
    """
    if distributed.is_distributed() and not is_sharded(model):
        raise ConfigError(
            "trainer.strategy=fsdp under torchrun needs the model sharded before its optimizer is built: "
            "expkit.config.build does it; from Python, call expkit.checkpoint.sharding.shard(model, blocks, device) first"
        )
    named = list(hooks.items()) if isinstance(hooks, Mapping) else [(type(h).__name__, h) for h in hooks]
    check_hooks(dict(named, **(default_hooks or {})))
