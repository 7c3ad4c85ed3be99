"""CheckpointHook: periodic, last and best checkpoints with MMEngine's parameters (VERY_LOW).

VERY_LOW so that it runs after the scheduler stepped: a saved scheduler state matches
the epoch count the checkpoint records.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import re
import shutil
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from expkit.checkpoint import checkpoint_io
from expkit.core import atomic, confine
from expkit.core.errors import ConfigError, ExpkitError
from expkit.core.stages import Priority, Stage
from expkit.hooks.base import Hook
from expkit.metrics import better, infer_rule

if TYPE_CHECKING:
    from expkit.checkpoint.async_writer import BackgroundWriter
    from expkit.checkpoint.remote import RemoteDir
    from expkit.engine.runner import Runner
    from expkit.engine.state import Position

__all__ = ["CHECKPOINT_KEYS", "CheckpointHook"]


log = logging.getLogger("expkit")


def _as_list(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


_FLAGS = (
    "by_epoch",
    "save_optimizer",
    "save_param_scheduler",
    "save_last",
    "best_save_optimizer",
    "fsync",
    "async_save",
)
# the top-level keys of an expkit checkpoint (a hook may add its own, e.g. the EMA hook's ema_state_dict)
CHECKPOINT_KEYS = (
    "meta",
    "state_dict",
    "config",
    "optimizer",
    "optimizers",
    "scheduler",
    "schedulers",
    "grad_scaler",
    "rng",
    "hooks",
    "ema_state_dict",
)


def _check_settings(given: dict[str, Any]) -> None:
    """Settings that would be taken wrongly, refused before training (``by_epoch=flase`` reads
    as true, a template without ``{}`` names every save alike, ``max_keep_ckpts=0`` keeps all)."""
    for name in _FLAGS:
        if not isinstance(given[name], bool):
            raise TypeError(f"{name} must be true or false, got {given[name]!r}")
    for name in ("interval", "max_keep_ckpts", "save_begin"):
        if isinstance(given[name], bool) or not isinstance(given[name], int):
            raise TypeError(f"{name} must be a whole number, got {given[name]!r}")
    if given["save_begin"] < 0:
        raise ValueError(f"save_begin must be >= 0, got {given['save_begin']}")
    if given["max_keep_ckpts"] == 0 or given["max_keep_ckpts"] < -1:
        raise ValueError(
            f"max_keep_ckpts must be -1 (keep every checkpoint) or at least 1, got {given['max_keep_ckpts']}"
        )
    tmpl = given["filename_tmpl"]
    if tmpl is not None and (not isinstance(tmpl, str) or tmpl.count("{}") != 1 or "/" in tmpl or tmpl.startswith(".")):
        raise ValueError(
            f"filename_tmpl must be a file name with one {{}} for the count (e.g. ckpt_{{}}.pth), got {tmpl!r}"
        )
    published = _as_list(given["published_keys"])
    if published and not set(published) & {"meta", "state_dict"}:
        raise ValueError(
            f"published_keys {published} names none of a checkpoint's keys; "
            f"choose from {', '.join(CHECKPOINT_KEYS)}, e.g. [meta,state_dict]"
        )


def _plain(value: Any) -> Any:
    """A config node as plain dicts and lists (fsspec and botocore take no DictConfig)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


def _mb(size: float) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.0f} kB"


def _check_writable_dir(directory: Path, key: str) -> None:
    """A dir that exists or can be made, and written: checked at the start, not at the first save."""
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}: {existing} is a file, so {directory} cannot hold checkpoints; give a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {existing} cannot be written; give a directory you can write")


class CheckpointHook(Hook):
    """Saves ``checkpoints/epoch_{n}.pth`` (or ``iter_{n}.pth``), ``best_{metric}_epoch_{n}.pth``
    (``best_{metric}_iter_{n}.pth`` where validation counts iterations) and moves
    ``checkpoints/last_checkpoint`` after each complete regular save.

    ``interval``: every n epochs (``by_epoch``) or iterations; <= 0 disables periodic saves.
    ``save_begin``: first epoch/iter counted (interval 2, save_begin 5 saves 5, 7, 9...).
    ``save_last``: also save where training ends, whatever the interval, including an early stop.
    ``max_keep_ckpts``: keep the newest n regular checkpoints (best ones are not counted).
    ``save_best``: metric key(s) such as ``val/acc``, or ``auto`` (the first metric validation reports).
    ``rule``: ``greater``/``less`` per key, declared for the whole run (best tracking, the sweep
    summary); None asks the run's one direction rule (the metric's ``higher_is_better``, its
    own attribute, then its name, with ``greater_keys`` / ``less_keys`` added to the name rules).
    ``best_save_optimizer``: whether best checkpoints carry optimizer and scheduler state.
    ``published_keys``: at the end of training, also write the last and best checkpoints with
    only these keys (e.g. ``[meta, state_dict]``) as ``<name>-<sha256[:8]>.pth``.
    ``fsync``: also force each file to disk before it gets its name (survives a power cut,
    not just a kill; costs an fsync per save).
    ``async_save``: the loop waits only for the state to be copied to host memory; the file is
    written, named and the retired ones deleted in a background thread (``expkit.checkpoint.async_writer``),
    one save of each kind (regular, best) in flight at a time. The end of training waits for
    the last write. Sharded checkpoints (``trainer.strategy=fsdp``) go through
    ``torch.distributed.checkpoint.async_save``, and the ranks agree that a write is complete
    at the next save (``expkit.checkpoint.dcp.AsyncShards``).
    ``out_dir`` may be a URL (``s3://bucket/prefix``, ``gs://...``, any fsspec URL): checkpoints
    are written to ``<work dir>/checkpoints`` (the local cache), then uploaded to
    ``<out_dir>/<work dir name>/`` with its own ``last_checkpoint`` (``expkit.checkpoint.remote``);
    ``storage_options`` go to fsspec (``endpoint_url``, ``key``, ``secret``, ...); ``upload_timeout``:
    the seconds a call to the store (an upload) may take before the save fails.

    Args:
        interval: save every ``interval`` epochs (or iterations with `by_epoch` False); <= 0: no periodic
            saves (`save_last` still saves at the end).
        by_epoch: count `interval` and `save_begin` in epochs (True) or iterations (False); it also picks
            the default file name template.
        save_optimizer: regular checkpoints carry the optimizers' state (needed to resume exactly).
        save_param_scheduler: regular checkpoints carry the schedulers' state.
        out_dir: None: ``<work dir>/checkpoints``; a local path (or ``file://`` URL): ``<out_dir>/<work dir
            name>``, which must be writable (checked at the start); any other URL: the checkpoints are
            written to ``<work dir>/checkpoints`` and uploaded to ``<out_dir>/<work dir name>/``.
        max_keep_ckpts: keep the newest n regular checkpoints, deleting older ones once a new one is
            complete; -1: keep all. Best checkpoints are not counted.
        save_last: also save where training ends (the budget reached or a stop), unless that position
            is saved already.
        save_best: the metric key(s) whose best value gets a ``best_<key>_<name>`` checkpoint (the older
            best file of that key is deleted); ``auto``: the first metric validation reports; None: none.
        rule: ``greater`` or ``less``: one for every `save_best` key, or one per key; declared for the
            whole run. None: the run's direction rule decides.
        greater_keys: words that mark a key without a rule as greater-is-better (matched on its last
            part), tried before the run's own direction rule; None: none.
        less_keys: the same for less-is-better.
        save_begin: the first epoch (or iteration) counted by `interval`: interval 2 with save_begin 5
            saves at 5, 7, 9, ...; at least 0.
        filename_tmpl: the regular file name, with one ``{}`` for the epoch or iteration count (no ``/``,
            not starting with ``.``); None: ``epoch_{}.pth`` or ``iter_{}.pth`` after `by_epoch`.
        published_keys: at the end of training, the main process also writes slim copies of the last
            (with `save_last`) and best checkpoints holding only these top-level keys, named
            ``<name>-<sha256[:8]>.pth``; they must include ``meta`` or ``state_dict``. None: no copies.
        best_save_optimizer: best checkpoints carry the optimizers' and schedulers' state.
        fsync: force each checkpoint to disk before it gets its name (survives a power cut; an fsync
            per save).
        async_save: training waits only while the state is copied to host memory; the file is written
            in a background thread, one save of each kind in flight at a time.
        storage_options: with a URL `out_dir`: fsspec's options (``endpoint_url``, ``key``, ``secret``,
            ...); None: none.
        upload_timeout: with a URL `out_dir`: the seconds one call to the store may take before the
            save fails.

    Raises:
        TypeError: a flag is not a bool, or `interval`, `max_keep_ckpts` or `save_begin` is not an integer.
        ValueError: `save_begin` is negative, `max_keep_ckpts` is 0 or below -1, `filename_tmpl` is not
            a file name with one ``{}``, `published_keys` names neither ``meta`` nor ``state_dict`` or
            lists a key twice, `save_best` lists a key twice or ``auto`` with others, or `rule` has a
            value other than greater or less or a count other than 1 or one per `save_best` key.
    """

    priority = Priority.VERY_LOW

    def __init__(
        self,
        interval: int = 1,
        by_epoch: bool = True,
        save_optimizer: bool = True,
        save_param_scheduler: bool = True,
        out_dir: str | Path | None = None,
        max_keep_ckpts: int = 2,
        save_last: bool = True,
        save_best: str | Sequence[str] | None = None,
        rule: str | Sequence[str] | None = None,
        greater_keys: str | Sequence[str] | None = None,
        less_keys: str | Sequence[str] | None = None,
        save_begin: int = 0,
        filename_tmpl: str | None = None,
        published_keys: str | Sequence[str] | None = None,
        best_save_optimizer: bool = False,
        fsync: bool = False,
        async_save: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        upload_timeout: float = 1800.0,
    ) -> None:
        _check_settings(locals())
        self.interval = interval
        self.by_epoch = by_epoch
        self.save_optimizer = save_optimizer
        self.save_param_scheduler = save_param_scheduler
        from expkit.checkpoint import remote

        self.remote_url: str | None = None
        if out_dir and remote.is_url(out_dir):
            self.remote_url = remote.checked_url(out_dir, "default_hooks.checkpoint.out_dir")
        self.out_dir = remote.local_path(out_dir) if out_dir and self.remote_url is None else None
        self.storage_options = _plain(storage_options or {})
        self.upload_timeout = upload_timeout
        self._remote: remote.RemoteDir | None = None
        self.max_keep_ckpts = max_keep_ckpts
        self.save_last = save_last
        self.save_begin = save_begin
        self.filename_tmpl = filename_tmpl or ("epoch_{}.pth" if by_epoch else "iter_{}.pth")
        # a best checkpoint's name and count, as validation counts (set in before_run)
        self.best_tmpl = self.filename_tmpl
        self._best_by_epoch = by_epoch
        self.best_save_optimizer = best_save_optimizer
        self.published_keys = _as_list(published_keys)
        if len(set(self.published_keys)) != len(self.published_keys):
            raise ValueError(f"published_keys lists a key twice: {self.published_keys}")
        self.fsync = fsync
        self.async_save = async_save
        self.writer: BackgroundWriter | None = None  # async_save: made in before_run
        self.greater_keys, self.less_keys = tuple(_as_list(greater_keys)), tuple(_as_list(less_keys))
        self.save_best = _as_list(save_best)
        if len(set(self.save_best)) != len(self.save_best):
            raise ValueError(f"save_best lists a key twice: {self.save_best}")
        if "auto" in self.save_best and len(self.save_best) > 1:
            raise ValueError('save_best="auto" must stand alone')
        rules = _as_list(rule)
        if rules and len(rules) not in (1, len(self.save_best)):
            raise ValueError(f"rule needs 1 entry or one per save_best key ({len(self.save_best)}), got {rules}")
        for r in rules:
            if r not in ("greater", "less"):
                raise ValueError(f"rule must be 'greater' or 'less', got {r!r}")
        self.given_rules: dict[str, str | None] = {
            key: rules[0] if len(rules) == 1 else (rules[i] if rules else None) for i, key in enumerate(self.save_best)
        }
        self.rules: dict[str, str] = {}  # decided at before_run (auto: at the first validation)
        self.best_scores: dict[str, float] = {}
        self.best_paths: dict[str, str] = {}
        self.dir = Path("checkpoints")  # the run's checkpoint dir, set in before_run
        self.kept: deque[str] = deque()  # regular checkpoints max_keep_ckpts counts, oldest first
        self._dropping: list[str] = []  # retired by the save in progress; deleted once it is complete
        self._last_saved_position: Position | None = None
        self._resumed_at: Position | None = None  # where a resume from this dir's own checkpoint started
        self._deferred: int | None = None  # a regular save waiting for the validation that follows
        self._source: Path | None = None  # the checkpoint a resume loads, known before this hook's state
        self._foreign = False  # resumed from a checkpoint outside this run's checkpoint dir
        self._uploaded: str | None = None  # the store's last_checkpoint (out_dir a URL)

    def remote_for(self, work_dir: Path) -> RemoteDir | None:
        """With a URL ``out_dir``: this run's checkpoint dir in the store (None otherwise)."""
        if self.remote_url is None:
            return None
        from expkit.checkpoint.remote import RemoteDir

        url = f"{self.remote_url}/{work_dir.name}"
        if self._remote is None or self._remote.url != url:
            self._remote = RemoteDir(url, self.storage_options, given=self.remote_url, timeout=self.upload_timeout)
        return self._remote

    def _decide_rule(self, runner: Runner, key: str, given: str | None) -> None:
        """The direction of `key`, from the run's one rule; a given rule, or one the extra
        greater_keys / less_keys name, is declared for the whole run."""
        if given is None and runner.directions.rule(key) is None and (self.greater_keys or self.less_keys):
            given = infer_rule(key, self.greater_keys, self.less_keys)
        self.rules[key] = runner.metric_rule(key, "default_hooks.checkpoint.save_best", given)

    # -- state: file names relative to self.dir, so that a copied run dir resumes from its own files --
    def state_dict(self) -> dict[str, Any]:
        return {
            "best_scores": self.best_scores,
            "best_paths": dict(self.best_paths),
            "kept": list(self.kept),
            "dropping": list(self._dropping),
        }

    def after_load_checkpoint(self, runner: Runner, *, checkpoint: dict[str, Any]) -> None:
        self._source = runner.load_source if runner.load_purpose == "resume" else None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The names a checkpoint records are data: each must be one of this hook's own names
        (``epoch_{}.pth``, ``best_<key>_epoch_{}.pth``) directly in this run's checkpoint dir,
        else it is ignored with a warning. Resumed from a file in another dir (``resume=<file>``),
        the run inherits none of them, nor the best scores: it keeps and retires its own files only."""
        source = self._source or Path("the resumed checkpoint")
        self._foreign = self._source is not None and not confine.inside(self.dir, Path(self._source))
        if self._foreign:
            self.best_scores, self.best_paths, self.kept, self._dropping = {}, {}, deque(), []
            return
        regular = [confine.name_pattern(t) for t in (self.filename_tmpl, "iter_{}.pth")]
        recorded = state.get("best_paths", {})
        self.best_paths = {}
        for key, name in recorded.items() if isinstance(recorded, Mapping) else ():
            best = confine.name_pattern(f"best_{str(key).replace('/', '_')}_{self.best_tmpl}")
            if (own := self._own(name, source, [best])) is not None:
                self.best_paths[key] = own
        self.best_scores = {k: v for k, v in dict(state.get("best_scores", {})).items() if k in self.best_paths}
        self.kept = deque(self._own_list(state.get("kept"), source, regular))
        self._dropping = self._own_list(state.get("dropping"), source, regular)

    def _own_list(self, recorded: object, source: Path | str, patterns: list[re.Pattern[str]]) -> list[str]:
        if not isinstance(recorded, (list, tuple)):
            return []
        return [name for name in (self._own(r, source, patterns) for r in recorded) if name is not None]

    def _own(self, recorded: object, source: Path | str, patterns: list[re.Pattern[str]]) -> str | None:
        path = confine.confined(self.dir, recorded, source, "checkpoint")
        if path is None:
            return None
        if not any(p.fullmatch(path.name) for p in patterns):
            log.warning("Ignoring %r recorded in %s: not a name this checkpoint hook gives its files", recorded, source)
            return None
        return path.name

    # -- saving -----------------------------------------------------------------------------
    def before_run(self, runner: Runner) -> None:
        # iteration-based training validates inside epochs: its best checkpoints are named by iteration
        # (best_val_acc_iter_40.pth), not by an epoch that two validations share
        self._best_by_epoch = self.by_epoch and runner.settings.by_epoch
        self.best_tmpl = "iter_{}.pth" if self.by_epoch and not self._best_by_epoch else self.filename_tmpl
        if self.by_epoch and type(self).after_train_iter is CheckpointHook.after_train_iter:
            runner.hook_table.mute(self, Stage.AFTER_TRAIN_ITER)  # saves come at epoch ends only
        for key in self.save_best:
            if key != "auto":
                self._decide_rule(runner, key, self.given_rules[key])
        if self.async_save:
            from expkit.checkpoint.async_writer import BackgroundWriter

            shards = None
            if runner.sharded:  # (collective: every rank makes DCP's process groups here, in the same order)
                from expkit.checkpoint.dcp import AsyncShards

                shards = AsyncShards()
            self.writer = BackgroundWriter(shards)
        self._remote = self.remote_for(runner.work_dir)
        if self._remote is not None and runner.is_main:  # (sharded: rank 0 uploads the whole dir, every shard)
            self._remote.check()  # a missing bucket or bad credentials: exit 2 now, not at the first save
        base = runner.work_dir / "checkpoints"
        self.dir = base if self.out_dir is None else self.out_dir / runner.work_dir.name
        if self.out_dir is not None:
            _check_writable_dir(self.dir, "default_hooks.checkpoint.out_dir")
        if not log.isEnabledFor(logging.INFO):  # (nothing to format for a silent log)
            return
        unit = "epochs" if self.by_epoch else "iterations"
        policy = [f"every {self.interval} {unit} from {self.save_begin}" if self.interval > 0 else "no periodic saves"]
        if self.save_last:
            policy.append("the last")
        if self.save_best:
            policy.append(
                "best by "
                + ", ".join(f"{k} ({self.rules.get(k, 'decided at the first validation')})" for k in self.save_best)
            )
        if self.max_keep_ckpts > 0:
            policy.append(f"keeping the newest {self.max_keep_ckpts} (max_keep_ckpts; -1 keeps all)")
        else:
            policy.append("keeping all (max_keep_ckpts=-1)")
        where = f"{self.dir} (uploaded to {self._remote.url})" if self._remote is not None else self.dir
        log.info("Checkpoints in %s: %s", where, "; ".join(policy))

    def _due(self, n: int) -> bool:
        passed = n - self.save_begin
        return self.interval > 0 and passed >= 0 and passed % self.interval == 0

    def _save_regular(self, runner: Runner, count: int, tmpl: str | None = None) -> None:
        """Retention deletes the oldest kept checkpoints only after the new one is complete and
        `last_checkpoint` names it: at every instant a complete regular checkpoint exists. The
        checkpoint records the names it retires, so a resume after a kill in between deletes them."""
        name = runner.checkpoint_name((tmpl or self.filename_tmpl).format(count))
        if self.max_keep_ckpts > 0:
            if name in self.kept:  # saved again at the same count (e.g. save_last after a resume)
                self.kept.remove(name)
            while len(self.kept) >= self.max_keep_ckpts:
                self._dropping.append(self.kept.popleft())
            self.kept.append(name)
        first = self._last_saved_position is None and runner.is_main
        runner.save_checkpoint(
            self.dir / name,
            save_optimizer=self.save_optimizer,
            save_scheduler=self.save_param_scheduler,
            durable=self.fsync,
            writer=self.writer,
        )
        self._last_saved_position = runner.position
        if self._remote is not None and runner.is_main:
            self._after_write(functools.partial(self._upload, self.dir / name, True))
        self._delete_retired(runner)
        if first:
            self._after_write(lambda: self._report_size(runner, self.dir / name))

    def _report_size(self, runner: Runner, path: Path) -> None:
        """Once, at the first save: what one checkpoint weighs and what the run will keep; in the
        first job of a sweep, a warning when the sweep's checkpoints would not fit on the disk."""
        try:
            size = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*"))
        except OSError:
            return
        kept = f"{self.max_keep_ckpts} regular" if self.max_keep_ckpts > 0 else "every regular checkpoint"
        best = f" + {len(self.save_best)} best" if self.save_best else ""
        total = (
            f", about {_mb(size * (self.max_keep_ckpts + len(self.save_best)))} in all"
            if self.max_keep_ckpts > 0
            else ""
        )
        log.info("Checkpoint %s: %s; keeping %s%s%s", path.name, _mb(size), kept, best, total)
        job, jobs = runner.run_info.get("sweep_job") or (None, 0)
        if job != 0 or jobs < 2:
            return
        per_run = self.max_keep_ckpts if self.max_keep_ckpts > 0 else self._saves_planned(runner)
        projected = size * (per_run + len(self.save_best)) * jobs
        try:
            free = shutil.disk_usage(path.parent).free
        except OSError:
            return
        if projected > free:
            log.warning(
                "The sweep's %d jobs would keep about %s of checkpoints (%s each, %d a job), but %s holds %s free: "
                "keep fewer (default_hooks.checkpoint.max_keep_ckpts=1), save less often (interval=), or write "
                "elsewhere (out_dir=)",
                jobs,
                _mb(projected),
                _mb(size),
                per_run + len(self.save_best),
                path.parent,
                _mb(free),
            )

    def _saves_planned(self, runner: Runner) -> int:
        """Regular saves of a whole run (keeping all of them)."""
        s = runner.settings
        total = (s.max_epochs if self.by_epoch else s.max_iters or runner.max_iters) or 1
        return max(1, (total - self.save_begin) // max(self.interval, 1) + 1) if self.interval > 0 else 1

    def _delete_retired(self, runner: Runner) -> None:
        if runner.is_main and self._dropping:
            doomed = [name for name in self._dropping if name not in self.kept]
            self._after_write(functools.partial(self._remove, doomed))
        self._dropping = []

    def _upload(self, path: Path, point: bool) -> None:
        """A complete local checkpoint to the store, then (regular ones) the store's pointer."""
        assert self._remote is not None
        self._remote.upload(path, previous=self._uploaded)
        if point:
            self._remote.point(path.name)
            self._uploaded = path.name

    def _remove(self, names: list[str]) -> None:
        """Retention: the local copies, then the stored ones (after the new checkpoint is complete everywhere)."""
        for name in names:
            checkpoint_io.remove_checkpoint(self.dir / name)
            if self._remote is not None:
                self._remote.remove(name)

    def _after_write(self, step: Callable[[], Any]) -> None:
        """`step` once the checkpoint just saved is complete: now, or with async_save after its
        background write (never when that write fails)."""
        if self.writer is None:
            step()
        else:
            self.writer.after(step)

    def _save_or_defer(self, runner: Runner, count: int) -> None:
        """When validation follows, save after it (in after_val): the checkpoint then holds the
        state validation updates (best scores, early stopping, plateau schedulers), so a
        resume is not one validation behind, and never validates (and records) it again."""
        if self._validation_follows(runner, count):
            self._deferred = count
        else:
            self._save_regular(runner, count)

    def _validation_follows(self, runner: Runner, count: int) -> bool:
        """Whether validation comes before training goes on: at this count, when both count
        the same unit; for an iteration save in epoch-based training, when the iteration ends
        an epoch that validates (its checkpoint would otherwise resume before that validation)."""
        if runner.settings.by_epoch == self.by_epoch:
            return runner.validation_due(count)
        if self.by_epoch:  # (iteration-based training validates inside the epoch, before its end)
            return False
        size = runner.epoch_batches or (len(runner.train_loader) if hasattr(runner.train_loader, "__len__") else None)  # type: ignore[arg-type]
        return size is not None and runner.position.inner_iter >= size and runner.validation_due(runner.epoch + 1)

    def after_train_epoch(self, runner: Runner) -> None:
        if self.by_epoch and runner.epoch_complete and self._due(runner.epoch + 1):
            self._save_or_defer(runner, runner.epoch + 1)

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        if not self.by_epoch and self._due(runner.iter + 1):
            self._save_or_defer(runner, runner.iter + 1)

    def after_val(self, runner: Runner) -> None:
        if self._deferred is not None:
            count, self._deferred = self._deferred, None
            self._save_regular(runner, count)

    def after_train(self, runner: Runner) -> None:
        """save_last: where training ended (the budget or a stop), unless that is saved already."""
        if self._deferred is not None:  # validation did not happen after all (a stop)
            count, self._deferred = self._deferred, None
            self._save_regular(runner, count)
        # (a stop before the first step of a resumed run: its checkpoint is the one it started from)
        saved = runner.position in (self._last_saved_position, self._resumed_at)
        self._resumed_at = None  # (used once: a resumed run's hooks end as an uninterrupted run's do)
        if self.save_last and not saved and runner.iter > 0:
            if self.by_epoch and runner.inner_iter == 0:
                self._save_regular(runner, runner.epoch)
            else:  # iteration-based, or a stop in the middle of an epoch
                self._save_regular(runner, runner.iter, None if not self.by_epoch else "iter_{}.pth")
        if self.writer is not None:  # the test and result.json read complete files: the last write's error is the run's
            self.writer.wait()

    def on_exception(self, runner: Runner, *, exception: BaseException) -> None:
        if self.writer is not None:  # a write in flight completes (or fails) before the run ends
            self.writer.close()

    def before_train(self, runner: Runner) -> None:
        """On resume, finish the retention of a save a kill interrupted, and trust the best files
        on disk over the (possibly older) state restored from a regular checkpoint: each best
        file carries its own score."""
        if not runner.resuming:
            return
        if runner.resume_from in (True, "true"):  # (the dir's newest: a resume=<file> may start a branch)
            self._resumed_at = runner.position
        if self._remote is not None and runner.is_main:
            self._uploaded = self._remote.pointer()  # (named if an upload fails)
        if self._foreign:
            runner.best_checkpoints = {}
            log.info(
                "Resumed from %s, outside %s: this run keeps, retires and ranks only its own checkpoints",
                self._source,
                self.dir,
            )
            return
        self._delete_retired(runner)
        for key in self.save_best:
            own = confine.name_pattern(f"best_{key.replace('/', '_')}_{self.best_tmpl}")  # not best_<key>_top5_*
            files = sorted(
                p
                for p in self.dir.glob(f"best_{key.replace('/', '_')}_*")
                if own.fullmatch(p.name) and confine.inside(self.dir, p)
            )
            scored = []
            for path in files:
                try:
                    checkpoint = checkpoint_io.load_checkpoint(path, "best checkpoint", consolidate=False)
                    state = checkpoint["hooks"][self._name(runner)]
                    scored.append((state["best_scores"][key], path))
                except (ExpkitError, KeyError) as exc:
                    log.warning("Ignoring best checkpoint %s: %s", path, exc)
            if not scored:
                continue
            pick = max if self.rules.get(key) == "greater" else min
            score, path = pick(scored, key=lambda item: item[0])
            self.best_scores[key], self.best_paths[key] = score, path.name
            runner.best_checkpoints[key] = str(path)
            for _, other in scored:
                if other != path and runner.is_main:
                    self._remove([other.name])
                    log.info("Removed stale best checkpoint %s", other.name)

    def _name(self, runner: Runner) -> str:
        return next(name for name, hook in zip(runner.hook_names(), runner.hooks) if hook is self)

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        if not self.save_best or runner.optimizer is None:
            return
        if self.save_best == ["auto"]:
            if not metrics:
                return
            key = next(iter(metrics))
            self.save_best = [key]
            self._decide_rule(runner, key, self.given_rules.pop("auto"))
            self.given_rules[key] = None
        for key in self.save_best:
            if key not in metrics:
                raise ConfigError(
                    f"default_hooks.checkpoint.save_best={key!r} is not a metric that validation reports; "
                    f"available: {', '.join(sorted(metrics))}"
                )
            score = metrics[key]
            if not better(score, self.best_scores.get(key), self.rules[key]):  # NaN never wins
                continue
            count = runner.epoch if self._best_by_epoch else runner.iter
            name = runner.checkpoint_name(f"best_{key.replace('/', '_')}_{self.best_tmpl.format(count)}")
            old = self.best_paths.get(key)
            self.best_scores[key] = score
            self.best_paths[key] = name
            runner.best_checkpoints[key] = str(self.dir / name)
            runner.save_checkpoint(
                self.dir / name,
                save_optimizer=self.best_save_optimizer,
                save_scheduler=self.best_save_optimizer,
                is_best=True,
                metric=key,
                durable=self.fsync,
                writer=self.writer,
            )
            if self._remote is not None and runner.is_main:
                self._after_write(functools.partial(self._upload, self.dir / name, False))
            if old and old != name and runner.is_main:  # once the new best is complete (and uploaded)
                self._after_write(functools.partial(self._remove, [old]))
            log.info("New best %s = %.4f: %s", key, score, name)

    def after_run(self, runner: Runner) -> None:
        """published_keys: slim copies of the last and best checkpoints, named by content hash."""
        if self.writer is not None:
            self.writer.close()
        if not self.published_keys or runner.optimizer is None or not runner.is_main:
            return
        sources = [str(self.dir / name) for name in self.best_paths.values()]
        if self.save_last and runner.last_checkpoint is not None:
            sources.insert(0, str(runner.last_checkpoint))
        for source in dict.fromkeys(sources):
            path = Path(source)  # (a last checkpoint resumed from another dir gets no copy there)
            if not checkpoint_io.is_checkpoint(path) or not confine.inside(self.dir, path):
                continue
            full = checkpoint_io.load_checkpoint(path, "published checkpoint")
            absent = [key for key in self.published_keys if key not in full]
            if absent:
                log.warning("published_keys: %s has no %s (it holds %s)", path.name, ", ".join(absent), ", ".join(full))
            dropped = sorted(set(full) - set(self.published_keys))
            slim = {k: v for k, v in full.items() if k in self.published_keys}
            buffer = io.BytesIO()
            torch.save(slim, buffer)
            digest = hashlib.sha256(buffer.getvalue()).hexdigest()[:8]
            target = path.with_name(f"{path.stem}-{digest}.pth")
            atomic.write_bytes_atomic(target, buffer.getvalue())
            log.info("Published %s (dropped keys: %s)", target.name, ", ".join(dropped) or "none")
