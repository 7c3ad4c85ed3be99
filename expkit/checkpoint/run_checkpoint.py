"""A run's state to a checkpoint and back: what a checkpoint holds, writing it, resuming.

``Runner.state_checkpoint`` / ``Runner.save_checkpoint`` call into here; so does the start of
``Runner.run`` (``load_or_resume``) and the test pass (``load_test_weights``). Files on disk
(atomic writes, ``last_checkpoint``, reading safely) are ``expkit.checkpoint.checkpoint_io``'s; sharded
checkpoints are ``expkit.checkpoint.dcp``'s.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from expkit.checkpoint import checkpoint_io, dcp
from expkit.core import atomic, distributed
from expkit.core.errors import CheckpointWriteError, ConfigError, ResumeRefused
from expkit.core.stages import Stage

if TYPE_CHECKING:
    from expkit.checkpoint.async_writer import BackgroundWriter
    from expkit.checkpoint.remote import RemoteDir
    from expkit.engine.runner import Runner

__all__ = [
    "apply_checkpoint",
    "check_start",
    "checkpoint_name",
    "load_or_resume",
    "load_test_weights",
    "save_checkpoint",
    "state_checkpoint",
]


log = logging.getLogger("expkit")
T = TypeVar("T")


def state_checkpoint(
    runner: Runner, save_optimizer: bool = True, save_scheduler: bool = True, *, weights_on_host: bool = True
) -> dict[str, Any]:
    """Everything needed to continue this run exactly.

    Args:
        runner: the run whose state is saved.
        save_optimizer: include the optimizers' state (a sharded run's shards hold it instead).
        save_scheduler: include the schedulers' state.
        weights_on_host: copy the weights to the CPU now; False leaves them on their device, for a
            save whose writer stages every tensor to host memory itself (``async_save``: on a GPU the
            copies are queued on a staging stream, and the loop does not wait for them).

    Returns:
        ``meta`` (counters, metrics, world size, samples of the epoch trained on, seed, time, work dir),
            ``rng``, ``config`` and ``hooks``; unless the run is sharded, the weights (``state_dict``, on
            the CPU unless `weights_on_host` is False) and with `save_optimizer` ``optimizer`` (or
            ``optimizers`` by name, their state where the optimizer keeps it); with
            `save_scheduler` ``scheduler`` (or ``schedulers``); ``grad_scaler`` when the run has a scaler.
    """
    r = runner
    checkpoint = r.state.state_dict()  # {"meta": counters and metrics, "rng": the RNG streams}
    checkpoint["meta"].update(
        world_size=distributed.rank_and_world()[1],
        epoch_samples=r.epoch_samples() if r.position.inner_iter else 0,  # (a resume on another number of processes)
        seed=r.settings.seed,
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        work_dir=str(r.work_dir),
    )
    checkpoint["config"] = r.config
    checkpoint["hooks"] = r.hook_table.state_dict()
    data_state = getattr(getattr(r.train_loader, "dataset", None), "data_state", None)
    if callable(data_state):  # (data=webdataset: each shard's fingerprint, for _check_same_data)
        checkpoint["data"] = data_state()
    named = r.named_optimizers
    if not r.sharded:  # (sharded: weights and optimizer state go to the shards, see save_checkpoint)
        # (detached already; a CPU tensor as it is: .cpu() would be a no-op dispatched per tensor, 1-3 us each)
        weights = r.model.state_dict()
        checkpoint["state_dict"] = {k: v if v.is_cpu or not weights_on_host else v.cpu() for k, v in weights.items()}
        if save_optimizer and r.optimizers:
            if named:
                checkpoint["optimizers"] = {name: opt.state_dict() for name, opt in r.optimizers.items()}
            else:
                checkpoint["optimizer"] = r.optimizer.state_dict()  # type: ignore[union-attr]
    if save_scheduler and r.schedulers:
        if named:
            checkpoint["schedulers"] = {name: sched.state_dict() for name, sched in r.schedulers.items()}
        else:
            checkpoint["scheduler"] = r.scheduler.state_dict()
    if r.scaler is not None:
        checkpoint["grad_scaler"] = r.scaler.state_dict()
    return checkpoint


def checkpoint_name(runner: Runner, name: str) -> str:
    """The name a checkpoint file name gets on disk: ``epoch_3.pth``, or with
    trainer.strategy=fsdp the sharded directory ``epoch_3.dcp``.

    Args:
        runner: the run; only whether it is sharded matters.
        name: a checkpoint file name, e.g. ``epoch_3.pth``.

    Returns:
        `name` as it is; for a sharded run, `name` without a ``.pth`` (or ``.dcp``) suffix, plus ``.dcp``.
    """
    if not runner.sharded:
        return name
    return dcp.checkpoint_name(name)


def save_checkpoint(
    runner: Runner,
    path: Path,
    *,
    save_optimizer: bool = True,
    save_scheduler: bool = True,
    is_best: bool = False,
    metric: str | None = None,
    durable: bool = False,
    writer: BackgroundWriter | None = None,
) -> Path:
    """See ``Runner.save_checkpoint``.

    Args:
        runner: the run to save.
        path: the checkpoint file; for a sharded run its name becomes ``<name>.dcp`` (``checkpoint_name``).
        save_optimizer: include the optimizers' state.
        save_scheduler: include the schedulers' state.
        is_best: a best checkpoint: ``runner.last_checkpoint`` and the ``last_checkpoint`` pointer stay.
        metric: the monitored key a best checkpoint is for, passed to the ``after_save_checkpoint`` hooks.
        durable: fsync what is written, so that it survives a power cut.
        writer: the background writer; None writes now. With one, the previous save of the same kind is
            waited for, the state is copied now and written in the writer's thread, and
            ``after_save_checkpoint`` runs once it is complete.

    Returns:
        The path written or being written (the ``.dcp`` dir for a sharded run). On ranks other than 0 an
            unsharded run writes nothing: `path` is returned (and, for a regular checkpoint, becomes
            ``runner.last_checkpoint``).

    Raises:
        CheckpointWriteError: when the checkpoint or the ``last_checkpoint`` pointer cannot be written
            (without a `writer`), when the previous save of the same kind failed (with one), or when a
            sharded save cannot start writing its shards.
    """
    r = runner
    if r.sharded:
        path = path.with_name(checkpoint_name(r, path.name))
    elif not r.is_main:  # one writer: rank 0 (every rank holds the same weights)
        if not is_best:
            r.last_checkpoint = path
        return path
    kind = "best" if is_best else "regular"
    if writer is not None:  # one save of a kind in flight: its host buffers are reused for this one
        writer.wait(kind, position=r.position, why=f"saving {path.name}")
    # with a writer the weights stay on their device: its staging copies them without stopping the loop
    # (a synchronous .cpu() here would wait for the GPU and for a copy to pageable memory)
    checkpoint = (
        state_checkpoint(r, save_optimizer, save_scheduler, weights_on_host=writer is None) if r.is_main else {}
    )
    if r.is_main:
        r.call_hook(Stage.BEFORE_SAVE_CHECKPOINT, checkpoint=checkpoint)

    def saved() -> None:
        if r.is_main:
            r.call_hook(Stage.AFTER_SAVE_CHECKPOINT, path=path, is_best=is_best, metric=metric)

    if writer is None:
        _write(r, checkpoint, path, is_best, durable, save_optimizer)
        saved()
    else:  # the loop goes on once the tensors are copied; the file is written in the background
        # unsharded: the writer's thread waits for the copies from GPU memory, the loop does not; DCP's
        # own thread (sharded) reads what it is given at once, so there they complete here
        staged = writer.stage(checkpoint, kind, complete=r.sharded) if r.is_main else {}
        del checkpoint
        files = None
        if r.sharded:  # every rank's shards staged by DCP's async_save, written in its thread
            assert writer.shards is not None
            optimizers = r.optimizers if save_optimizer else {}
            stage = functools.partial(writer.stage, kind=f"{kind} shards")
            shards = writer.shards
            files = _failing_as_writes(
                r, path, lambda: shards.save(path, staged, r.model, optimizers, durable, kind, stage)
            )
        job = functools.partial(_write, r, staged, path, is_best, durable, files=files)
        writer.submit(job, then=saved, kind=kind, position=r.position)
    return path


def _write(
    r: Runner,
    checkpoint: dict[str, Any],
    path: Path,
    is_best: bool,
    durable: bool,
    save_optimizer: bool = True,
    files: Callable[[], None] | None = None,
) -> None:
    """Write the checkpoint file (or, collectively, the sharded directory; `files`: complete
    one started by async_save), then, for a regular checkpoint, move the ``last_checkpoint``
    pointer to it."""
    _failing_as_writes(r, path, lambda: _write_files(r, checkpoint, path, durable, save_optimizer, files))
    if not is_best:
        r.last_checkpoint = path  # complete: the newest checkpoint, with or without the pointer
        if r.is_main:
            try:
                checkpoint_io.point_last_checkpoint(path.parent, path, durable=durable)
            except OSError as exc:
                pointer = path.parent / checkpoint_io.LAST_CHECKPOINT
                found = (
                    "resume=true finds it without the pointer"
                    if not os.path.lexists(pointer)
                    else f"the old {pointer.name} is still there: remove it, and resume=true finds {path.name}"
                )
                raise CheckpointWriteError(
                    f"could not point {pointer} at {path.name}: {_cause(exc)}; {path} itself is complete ({found})"
                ) from exc


def _write_files(
    r: Runner,
    checkpoint: dict[str, Any],
    path: Path,
    durable: bool,
    save_optimizer: bool,
    files: Callable[[], None] | None,
) -> None:
    if files is not None:
        files()
    elif r.sharded:
        optimizers = r.optimizers if save_optimizer else {}
        dcp.save(path, checkpoint, r.model, optimizers, durable=durable)
    else:
        atomic.save_atomic(checkpoint, path, durable=durable)


def _failing_as_writes(r: Runner, path: Path, write: Callable[[], T]) -> T:
    """`write`'s result; an OSError or RuntimeError (disk full, permissions; torch's zip writer
    and DCP raise RuntimeError) as a CheckpointWriteError that says what is left intact."""
    try:
        return write()
    except (OSError, RuntimeError) as exc:  # disk full (torch's zip writer raises RuntimeError), permissions, ...
        cause = _cause(exc)
        kept = (
            f"the previous complete checkpoint {r.last_checkpoint} (and last_checkpoint) is intact"
            if r.last_checkpoint
            else "no earlier checkpoint of this run exists"
        )
        raise CheckpointWriteError(f"could not write {path}: {cause}; {kept}") from exc


def _cause(exc: BaseException) -> str:
    """Why a checkpoint write failed, in words, on one line."""
    return (
        "no space left on the device" if atomic.disk_full(exc) else f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    )


def check_start(runner: Runner) -> None:
    """Read the checkpoint a run starts from (``resume``: true for the work dir's last complete
    one, or a path; ``load_from``: weights only) and check that it fits this run, before any
    hook runs or any file is written: a refused start raises ResumeRefused and leaves the run
    dir it names as it was. Kept for ``load_or_resume``; done once.

    Args:
        runner: the run about to start; its ``start_checkpoint`` gets the checkpoint's path and content
            (empty when there is none to read).

    Raises:
        ResumeRefused: when the checkpoint is missing, unreadable or refused as untrusted (any ConfigError
            of reading it), or does not fit the model or the optimizers.
    """
    r = runner
    if r.start_checkpoint is not None:
        return
    found: tuple[Path, dict[str, Any]] | None = None
    try:
        if r.resume_from is True or r.resume_from == "true":
            _download_resumable(r)
            found = _agreed_resumable(r)
        elif r.resume_from or r.load_from:
            key = "resume" if r.resume_from else "load_from"
            path = _local(r, r.resume_from if r.resume_from else r.load_from, key)  # type: ignore[arg-type]
            found = path, checkpoint_io.load_checkpoint(path, key, consolidate=False)
        if found is not None:
            _check_fits(r, found[1], found[0], resume=bool(r.resume_from))
            if r.resume_from:
                _check_same_data(r, found[1], found[0])
    except ResumeRefused:
        raise
    except ConfigError as exc:  # missing, unreadable or refused as untrusted: refused all the same
        raise ResumeRefused(str(exc)) from None
    r.start_checkpoint = found or ()


def _agreed_resumable(runner: Runner) -> tuple[Path, dict[str, Any]] | None:
    """resume=true: the work dir's last complete checkpoint, the same on every rank. Rank 0 picks
    it (``load_resumable``: the pointer's, else the newest that loads) and every other rank loads
    that one: a rank that chose for itself could fall back to an older checkpoint on a read error
    or a stale NFS listing, and train from other weights and counters than rank 0, or wait in a
    collective the others never reach. A checkpoint that some rank cannot read refuses the start
    on every rank.

    Returns:
        The checkpoint's path and content (``load_resumable``'s), or None when the dir has none.

    Raises:
        ConfigError: when no checkpoint loads on rank 0, or rank 0's does not load on another rank.
    """
    if not distributed.is_distributed():
        return checkpoint_io.load_resumable(runner.work_dir)
    found, problem = None, None
    if runner.is_main:
        try:
            found = checkpoint_io.load_resumable(runner.work_dir)
        except Exception as exc:  # (any: the other ranks wait for this rank's answer)
            problem = str(exc) if isinstance(exc, ConfigError) else f"resume=true: {type(exc).__name__}: {exc}"
    chosen, problem = distributed.broadcast_object((None if found is None else str(found[0]), problem))
    if problem is not None:  # (every rank refuses alike)
        raise ConfigError(problem)
    if chosen is not None and not runner.is_main:
        try:
            found = Path(chosen), checkpoint_io.load_checkpoint(chosen, "resume", consolidate=False)
        except Exception as exc:  # (any: rank 0 and the others wait for every rank's answer)
            problem = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ConfigError) else str(exc)
    failed = distributed.first_problem(problem)
    if failed is not None:
        raise ConfigError(
            f"resume=true: rank {failed[0]} cannot read {chosen}, the checkpoint rank 0 resumes: {failed[1]}"
        )
    return found


def _check_same_data(runner: Runner, checkpoint: dict[str, Any], source: Path) -> None:
    """A resume reads the data the checkpoint's run trained on: a train dataset that records its
    data in checkpoints (``data_state``: data=webdataset's shard fingerprints) refuses other data
    (``check_data_state``), so that one run never mixes two datasets."""
    check = getattr(getattr(runner.train_loader, "dataset", None), "check_data_state", None)
    if callable(check) and isinstance(checkpoint.get("data"), dict):
        try:
            check(checkpoint["data"])
        except ConfigError as exc:
            raise ResumeRefused(f"resume ({source}): {exc}. Nothing in {runner.work_dir} was changed.") from None


def _store(runner: Runner) -> RemoteDir | None:
    """This run's checkpoint dir in object storage (the checkpoint hook's ``out_dir`` a URL), or None."""
    for hook in runner.hooks:
        remote_for = getattr(hook, "remote_for", None)
        if callable(remote_for) and (found := remote_for(runner.work_dir)) is not None:
            return found
    return None


def _download_resumable(runner: Runner) -> None:
    """resume=true with checkpoints in object storage: the local cache (``checkpoints/``) is used
    when it holds the checkpoint the store's ``last_checkpoint`` names (it may hold a newer one:
    local writes come first); otherwise that checkpoint is downloaded (a requeue on another
    machine) and the local pointer moved to it."""
    store = _store(runner)
    if store is None:
        return
    name = store.pointer() if runner.is_main else None
    local_dir = runner.work_dir / "checkpoints"
    if name is not None and not checkpoint_io.is_checkpoint(local_dir / name):
        path = store.download(name, local_dir)
        checkpoint_io.point_last_checkpoint(local_dir, path)
        for best in store.bests():  # (the best files too: test_with=best and the best scores read them)
            store.download(best, local_dir)
    distributed.barrier()  # (torchrun: the other ranks read the work dir rank 0 downloaded into)


def _local(runner: Runner, given: str, key: str) -> Path:
    """`given` as a local path: a URL is downloaded, into this run's ``checkpoints/`` when it is
    one of this run's own stored checkpoints (a cache hit the next time), else into the cache of
    ``expkit.checkpoint.remote.fetch`` (the host's temporary dir).

    With several ranks, one rank downloads into each place and the others take its path: rank 0
    into the run's ``checkpoints/`` (one dir, shared by the nodes), the lowest rank of each host
    into that host's cache. Each rank downloading for itself sent the store one request per rank,
    and two ranks replacing one ``.dcp`` dir could remove it under a third one reading it. A run's
    dir URL is resolved once, by rank 0, to the checkpoint its pointer names then: every host
    downloads that one, also when the pointer moves meanwhile."""
    from expkit.checkpoint import remote

    if not remote.is_url(given):
        return remote.local_path(given)
    store = _store(runner)
    head, _, name = str(given).rstrip("/").rpartition("/")
    own = store is not None and head == store.url

    def download(url: str) -> Path:
        if store is not None and own:
            return store.download(name, runner.work_dir / "checkpoints")
        return remote.fetch(url, "last", key)

    if not distributed.is_distributed():
        return download(str(given))
    source = 0 if own else distributed.host_leader()
    url, problem = str(given), None
    if not own and distributed.is_main():
        try:
            found, picked = remote.resolve(url, "last", key)
            url = f"{found.url}/{picked}"
        except Exception as exc:  # (any: the other ranks wait for this rank's answer)
            problem = _download_problem(exc, key, given)
    if not own:
        url, problem = distributed.broadcast_object((url, problem))
    path = None
    if problem is None and distributed.rank() == source:
        try:
            path = download(url)
        except Exception as exc:  # (any: the other ranks wait for this rank's answer)
            problem = _download_problem(exc, key, given)
    gathered = distributed.all_gather((None if path is None else str(path), problem))
    failed = next((what for _, what in gathered if what is not None), None)
    if failed is not None:
        raise ConfigError(failed)
    return Path(gathered[source][0])


def _download_problem(exc: BaseException, key: str, given: str) -> str:
    return str(exc) if isinstance(exc, ConfigError) else f"{key}={given}: {type(exc).__name__}: {exc}"


def _check_fits(runner: Runner, checkpoint: dict[str, Any], source: Path, resume: bool) -> None:
    """The checkpoint's weights fit the model (names and shapes), and its optimizer state the
    optimizers (groups and their sizes): what loading would find only after the hooks ran."""
    r = runner
    given = (
        f"resume=true ({source})"
        if r.resume_from in (True, "true")
        else f"{'resume' if resume else 'load_from'}={source}"
    )
    unchanged = f"Nothing in {r.work_dir} was changed." if resume else ""
    sharded_model = dcp.is_sharded(r.model)
    if "state_dict" not in checkpoint:  # a sharded checkpoint: torch.distributed.checkpoint checks its shards
        return
    if sharded_model and resume and ("optimizer" in checkpoint or "optimizers" in checkpoint):
        raise ResumeRefused(
            f"{given}: a checkpoint file of an unsharded run cannot resume with trainer.strategy=fsdp "
            "(its optimizer state is not keyed by parameter name); resume it with trainer.strategy=ddp, or "
            f"start from its weights with load_from=. {unchanged}"
        )
    stored = {k.removeprefix("module."): v for k, v in checkpoint["state_dict"].items()}
    wanted = {k.removeprefix("module."): v for k, v in r.model.state_dict().items()}
    missing, unexpected = sorted(set(wanted) - set(stored)), sorted(set(stored) - set(wanted))
    resized = (
        []
        if sharded_model
        else [
            f"{k} {tuple(stored[k].shape)} for {tuple(wanted[k].shape)}"
            for k in sorted(set(stored) & set(wanted))
            if getattr(stored[k], "shape", None) != wanted[k].shape
        ]
    )
    problems = [
        f"{len(names)} {what} ({_few(names)})"
        for names, what in (
            (missing, "weights missing"),
            (unexpected, "unexpected weights"),
            (resized, "of another shape"),
        )
        if names
    ]
    if problems:
        config = checkpoint.get("config")
        model = config.get("model") if isinstance(config, dict) else None
        trained_with = model.get("_target_") if isinstance(model, dict) else None
        hint = f" (it was trained with model._target_={trained_with})" if trained_with else ""
        raise ResumeRefused(
            f"{given}: the checkpoint does not fit this model{hint}: {'; '.join(problems)}. "
            f"Give the model it was trained with, or train from scratch in another hydra.run.dir. {unchanged}"
        )
    if not resume:
        return
    saved = checkpoint.get("optimizers") or (
        {"optimizer": checkpoint["optimizer"]} if "optimizer" in checkpoint else {}
    )
    owned = r.optimizers or ({"optimizer": r.optimizer} if r.optimizer is not None else {})
    for name, state in saved.items():
        optimizer = owned.get(name)
        if optimizer is None or not isinstance(state, dict) or "param_groups" not in state:
            continue
        sizes = [len(group["params"]) for group in state["param_groups"]]
        if sizes != [len(group["params"]) for group in optimizer.param_groups]:
            raise ResumeRefused(
                f"{given}: the checkpoint's optimizer {name!r} has parameter groups of {sizes} "
                f"parameters, this run's {[len(g['params']) for g in optimizer.param_groups]} (another optim= "
                f"or param_groups setting). Resume with the settings it was trained with, or start from its "
                f"weights with load_from=. {unchanged}"
            )
    if saved:
        _check_same_optimizer_settings(r, checkpoint, given, source, unchanged)


def _check_same_optimizer_settings(
    runner: Runner, checkpoint: dict[str, Any], given: str, source: Path, unchanged: str
) -> None:
    """A resumed run's optimizer continues from the checkpoint's state, its hyperparameters (the
    learning rate, momentum, weight decay, betas) included: a new ``optim.*`` value would not take,
    while the run's record would say it did. Refused, naming each changed key. Only where both
    configs are known (a run built from one; a checkpoint that keeps its own)."""
    stored, current = checkpoint.get("config"), runner.config
    if not isinstance(stored, Mapping) or not isinstance(current, Mapping):
        return
    before, now = _leaves(stored.get("optim"), "optim"), _leaves(current.get("optim"), "optim")
    if not before or not now:
        return
    changed = [
        f"{key}={now.get(key, '(removed)')} (the run has {before.get(key, '(none)')})"
        for key in sorted(set(before) | set(now))
        if before.get(key) != now.get(key)
    ]
    if changed:
        raise ResumeRefused(
            f"{given}: {', '.join(changed)}: a resumed run's optimizer continues from the checkpoint's state, "
            "its settings included, so the new value would not take. Drop it to continue the run as it was, or "
            f"start a new run from these weights with it: load_from={source} (another hydra.run.dir). {unchanged}"
        )


def _leaves(node: Any, prefix: str) -> dict[str, Any]:
    """The leaves of a nested config section as ``prefix.a.b`` -> value (lists as they are)."""
    if not isinstance(node, Mapping):
        return {prefix: node} if node is not None else {}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_leaves(value, f"{prefix}.{key}") if isinstance(value, Mapping) else {f"{prefix}.{key}": value})
    return out


def _earlier_run_hint(work_dir: Path) -> str:
    """For resume=true in a dir without checkpoints (a new timestamped dir: no hydra.run.dir given),
    the newest other run beside it that has some, as the command's word that continues it; "" when
    there is none. Read only on this path: a run that resumes, or starts without resume, lists nothing."""
    try:
        runs = [
            d
            for d in work_dir.parent.iterdir()
            if d != work_dir and d.is_dir() and (d / "checkpoints" / checkpoint_io.LAST_CHECKPOINT).is_file()
        ]
        newest = max(runs, key=lambda d: d.stat().st_mtime, default=None)
    except OSError:
        return ""
    if newest is None:
        return ""
    return f". To continue the newest run beside it instead, give its dir: hydra.run.dir={newest} resume=true"


def _few(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", ... {len(names) - shown} more" if len(names) > shown else "")


def load_or_resume(runner: Runner) -> None:
    """At the start of a run: ``resume`` (true: the work dir's last complete checkpoint; a
    path: that one) puts the whole run state back; ``load_from`` only the weights. The
    checkpoint was read and checked by ``check_start``.

    Args:
        runner: the run about to start. With ``resume=true``, rank 0 first removes the temporary files an
            interrupted write left; with no checkpoint yet, the run trains from scratch (a warning).

    Raises:
        ResumeRefused: from ``check_start``, when the checkpoint cannot be read or does not fit.
        ConfigError: from ``apply_checkpoint``, when the weights (or a sharded checkpoint's tensors) do not
            fit the model or optimizers.
    """
    r = runner
    check_start(r)
    if r.resume_from is True or r.resume_from == "true":
        if r.is_main:  # what a killed writer left half-written is never read: remove it
            for directory in (r.work_dir, r.work_dir / "checkpoints"):
                for name in checkpoint_io.remove_stale_temporaries(directory):
                    log.info("Removed %s, a temporary file left by an interrupted write", name)
        if not r.start_checkpoint:
            if r.run_info.get("sweep_dir"):  # a job of a resumed sweep that had not saved yet: it starts
                log.info("resume=true: this job has no checkpoint in %s/checkpoints yet; starting it", r.work_dir)
                return
            log.warning(
                "resume=true: no checkpoint in %s/checkpoints yet; training from scratch%s",
                r.work_dir,
                _earlier_run_hint(r.work_dir),
            )
            return
    if r.start_checkpoint:
        path, checkpoint = r.start_checkpoint  # type: ignore[misc]
        r.start_checkpoint = ()  # (its tensors are the model's now: not kept twice)
        apply_checkpoint(r, checkpoint, resume=bool(r.resume_from), source=path)


def _resume_inside_epoch(r: Runner, meta: dict[str, Any]) -> None:
    """A checkpoint saved inside an epoch, resumed with another number of processes (or another
    batch size): the epoch goes on after the samples the saving run trained on, counted over all
    its processes; the new processes share the rest of the epoch's order."""
    saved, world = meta.get("epoch_samples"), distributed.rank_and_world()[1]
    # r.epoch_start is EpochStart(0, 0) here (RunState.load_state_dict): the epoch as this run counts it
    if not r.inner_iter or not isinstance(saved, int) or saved == r.epoch_samples():
        return
    r.epoch_start = r.epoch_start._replace(samples=saved, inner_iter=r.inner_iter)
    log.info(
        "Resuming inside epoch %d after %d samples of its order (saved with %s processes, now %d): the %d "
        "processes share the rest of it",
        r.epoch + 1,
        saved,
        meta.get("world_size", "?"),
        world,
        world,
    )


def load_test_weights(runner: Runner) -> None:
    """test_with=best: test the best checkpoint by the first monitored metric (model
    selection on validation, report on test); otherwise, or without one, the final weights.

    Args:
        runner: the run about to test; its ``test_checkpoint`` is set to the best checkpoint loaded, else
            to its ``last_checkpoint``; left as it is when there is none (an evaluation sets the file it loaded).

    Raises:
        ConfigError: when the best checkpoint cannot be read or does not fit the model.
    """
    r = runner
    path = next(iter(r.best_checkpoints.values()), None)
    distributed.barrier()  # rank 0 may still be writing the best checkpoint
    if r.settings.test_with == "best" and path and checkpoint_io.is_checkpoint(Path(path)):
        checkpoint = checkpoint_io.load_checkpoint(path, "best checkpoint", consolidate=False)
        apply_checkpoint(r, checkpoint, resume=False, source=Path(path), purpose="test")
        r.test_checkpoint = str(path)
    elif r.last_checkpoint:
        r.test_checkpoint = str(r.last_checkpoint)
    # else: no checkpoint of this run; an evaluation has set the weights it loaded (or None)


def apply_checkpoint(
    runner: Runner, checkpoint: dict[str, Any], *, resume: bool, source: Path, purpose: str = ""
) -> None:
    """Put a checkpoint's weights (and, to resume, the whole run state) in place.
    ``runner.load_purpose`` tells hooks why: resume, load_from or test.

    Args:
        runner: the run to load into.
        checkpoint: the checkpoint's content; a sharded one without its weights (they are read from
            ``checkpoint["sharded"]["path"]``).
        resume: put back the whole run state (counters, metrics, RNG, optimizers, schedulers, grad scaler,
            hooks), not only the weights.
        source: the file or sharded dir the checkpoint was read from: logged, set as
            ``runner.load_source``, and where the best checkpoints it names are looked for.
        purpose: ``runner.load_purpose``; empty: ``resume`` or ``load_from``, by `resume`.

    Raises:
        ConfigError: when the weights do not fit the model, or a sharded checkpoint's index is refused or
            its tensors do not fit the model or (to resume) the optimizers.
    """
    r = runner
    r.resuming = r.resuming or resume
    r.load_purpose = purpose or ("resume" if resume else "load_from")
    r.load_source = source
    r.call_hook(Stage.AFTER_LOAD_CHECKPOINT, checkpoint=checkpoint)
    _load_weights(r, checkpoint, source, resume)
    if not resume:
        log.info("Loaded weights from %s%s", source, " for the test" if purpose == "test" else "")
        return
    r.state.load_state_dict(checkpoint, source)  # counters, metrics, best checkpoints (beside source), RNG
    _resume_inside_epoch(r, checkpoint["meta"])
    # one optimizer and scheduler ("optimizer", "scheduler"), or several by name
    if r.optimizer is not None and "optimizer" in checkpoint:
        r.optimizer.load_state_dict(checkpoint["optimizer"])
    if r.scheduler is not None and "scheduler" in checkpoint:
        r.scheduler.load_state_dict(checkpoint["scheduler"])
    for owned, saved in ((r.optimizers, "optimizers"), (r.schedulers, "schedulers")):
        for name, state in checkpoint.get(saved, {}).items():
            if name in owned:
                owned[name].load_state_dict(state)
    if r.scaler is not None and "grad_scaler" in checkpoint:
        r.scaler.load_state_dict(checkpoint["grad_scaler"])
    r.hook_table.load_state_dict(checkpoint.get("hooks", {}))
    log.info("Resumed from %s at epoch %d, iteration %d", source, r.epoch, r.iter)
    _warn_when_past_the_budget(r)


def _warn_when_past_the_budget(runner: Runner) -> None:
    """A resume from beyond the run's budget (``resume=true trainer.max_epochs=100`` at epoch 257)
    trains nothing and completes: said, with the setting that would train on. At the budget (a
    finished run resumed, a requeue after the end) nothing is said."""
    s = runner.settings
    if s.max_iters is not None:
        key, budget, done = "max_iters", s.max_iters, runner.iter
    else:
        key, budget, done = "max_epochs", s.max_epochs, runner.epoch
    if budget is not None and done > budget:
        unit = "iteration" if key == "max_iters" else "epoch"
        log.warning(
            "The checkpoint is at %s %d, past trainer.%s=%d: this run trains nothing more. "
            "To train on, give trainer.%s above %d",
            unit,
            done,
            key,
            budget,
            key,
            done,
        )


def _load_weights(runner: Runner, checkpoint: dict[str, Any], source: Path, resume: bool) -> None:
    """The checkpoint's weights into the model (sharded or not); a sharded checkpoint's
    optimizer state too, to resume."""
    if "state_dict" not in checkpoint:  # a sharded checkpoint, read collectively
        optimizers = runner.optimizers if resume else None
        dcp.load_into(Path(checkpoint["sharded"]["path"]), checkpoint, runner.model, optimizers)
        return
    state = {k.removeprefix("module."): v for k, v in checkpoint["state_dict"].items()}
    try:
        if dcp.is_sharded(runner.model):  # (a file of an unsharded run to resume: refused by check_start)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(runner.model, state, options=StateDictOptions(full_state_dict=True))
        else:
            runner.model.load_state_dict(state)
    except RuntimeError as exc:
        raise ConfigError(f"checkpoint {source} does not fit this model: {exc}") from None
