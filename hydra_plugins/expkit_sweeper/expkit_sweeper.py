"""expkit's default sweeper (``hydra/sweeper=expkit``): Hydra's BasicSweeper, which composes
every job once more when the jobs run in this process.

BasicSweeper composes each job of a batch before launching any (so that a bad override
fails the sweep before the first job trains), then BasicLauncher composes each job again
to run it: two compositions per job, about 0.2 s each here. When the launcher is the
in-process BasicLauncher, this sweeper keeps the configs the check composed and hands
each to the launcher once, so a job is composed a single time and the early check stays.
Other launchers (joblib, submitit) compose in their own processes and are left as they are.

Hydra only instantiates plugins that live in the ``hydra_plugins`` package, hence this place.
Like Hydra's own plugins, it registers its config (``hydra/sweeper=expkit``) with Hydra's
ConfigStore, so it works in any Hydra app, not only in expkit's commands.
"""

import contextlib
import logging
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, ListConfig, OmegaConf

from expkit.core.errors import ConfigError, TaskExit
from expkit.core.hydra_compat import basic_launcher, basic_sweeper

__all__ = [
    "MAX_HELD",
    "ComposeOnce",
    "ExpkitSweeper",
    "ExpkitSweeperConf",
    "StopBetweenJobs",
    "SweepConfigError",
    "check_batch",
    "check_seed_keys",
    "compose_once",
    "count_jobs",
    "launcher_settings_checked",
    "stoppable",
]


log = logging.getLogger("expkit")

T = TypeVar("T")


@dataclass
class ExpkitSweeperConf:  # OmegaConf reads these annotations at run time (hence Optional)
    """``hydra/sweeper=expkit`` (the default of ``-m``): Hydra's grid, with a summary, the best
    run, resume and Ctrl-C that saves ([Sweeps](../sweeps.md)).

    Attributes:
        max_batch_size: jobs checked (composed) per batch before the batch launches; None: all.
        params: sweep values in the config, as ``hydra/sweeper=basic`` takes them:
            ``{optim.lr: "0.1,0.01"}``.
        check_values: also check each job's values as expkit's build does (``check_batch``); None:
            when the app is one of expkit's commands (another Hydra app keeps Hydra's habits).
    """

    _target_: str = "hydra_plugins.expkit_sweeper.expkit_sweeper.ExpkitSweeper"
    max_batch_size: int | None = None  # jobs checked (composed) per batch before the batch launches; None: all
    params: dict[str, str] | None = None  # sweep values in the config: {optim.lr: "0.1,0.01"}, as hydra/sweeper=basic
    check_values: bool | None = None  # also check each job's values as expkit's build does; None: in expkit's apps


ConfigStore.instance().store(group="hydra/sweeper", name="expkit", node=ExpkitSweeperConf, provider="expkit")

# The composed configs held between the check and the launch: a batch larger than this
# composes its later jobs a second time, as BasicSweeper does, instead of holding them all.
MAX_HELD = 256


class ComposeOnce:
    """A config loader that serves each sweep job's config composed during the check to the
    launch that follows, once; everything else goes to Hydra's loader.

    Args:
        loader: Hydra's config loader, which composes every config and answers every other call.
        max_held: the most configs held at a time; a job checked beyond that is composed again at
            its launch.
    """

    def __init__(self, loader: Any, max_held: int = MAX_HELD) -> None:
        self._loader = loader
        self._max_held = max_held
        self._held: dict[tuple[str, ...], DictConfig] = {}

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        key = tuple(sweep_overrides)
        held = self._held.pop(key, None)
        return held if held is not None else self._loader.load_sweep_config(master_config, sweep_overrides)

    def check(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        config = self._loader.load_sweep_config(master_config, sweep_overrides)
        if len(self._held) < self._max_held:
            self._held[tuple(sweep_overrides)] = config
        return config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def compose_once(launcher: Any, hydra_context: HydraContext) -> HydraContext:
    """A context whose config loader holds each job's config from the check to its launch by
    `launcher` (the in-process BasicLauncher); the sweeper checks through ``check_batch``.

    Args:
        launcher: the in-process BasicLauncher; its ``hydra_context`` is replaced by the new context.
        hydra_context: the sweep's context: its config loader is wrapped in a ``ComposeOnce`` and its
            callbacks are kept.

    Returns:
        The new context, the same object the launcher now holds.
    """
    shared = HydraContext(config_loader=ComposeOnce(hydra_context.config_loader), callbacks=hydra_context.callbacks)
    launcher.hydra_context = shared
    return shared


def check_batch(
    hydra_context: HydraContext, config: DictConfig, batch: Sequence[Sequence[str]], values: bool = False
) -> None:
    """Compose every job of a batch before any runs: an override that cannot compose fails the
    sweep before anything of the batch trains (each config held for the launch under
    ``compose_once``). With `values`, also check what each job sets as its run would before
    building (``expkit.config.targets.check_swept_values``): a target that does not import, a
    word or NaN for a number.

    Args:
        hydra_context: the sweep's context; its config loader composes each job (a ``ComposeOnce``
            also keeps the config for the launch, up to its ``max_held``).
        config: the sweep's config, which each job's overrides are applied to.
        batch: the batch's jobs, each a sequence of override strings (``key=value``).
        values: check the values too (the sweeper's ``check_values``: by default, for expkit's commands).

    Raises:
        SweepConfigError: with `values`, a job's value its run would refuse, with the run's message
            and the job's overrides.
    """
    from expkit.config.targets import check_swept_values
    from expkit.core.errors import ConfigError

    loader = hydra_context.config_loader
    for overrides in batch:
        if isinstance(loader, ComposeOnce):
            composed = loader.check(config, list(overrides))
        else:
            composed = loader.load_sweep_config(config, list(overrides))
        if not values:
            continue
        try:  # (a launcher that runs the jobs elsewhere: an import that fails here may work there)
            check_swept_values(composed, list(overrides), imports_here=isinstance(loader, ComposeOnce))
        except ConfigError as exc:
            raise SweepConfigError(
                f"{exc} (the sweep's job {' '.join(overrides)}); no job of this batch was started"
            ) from None


def count_jobs(overrides: Sequence[str]) -> int | None:
    """How many jobs a grid of `overrides` makes (the product of its sweeps' lengths); None when
    a sweep has no finite length (an interval).

    Args:
        overrides: the sweeper's ``params`` as ``key=value`` strings, then the command line's overrides.

    Returns:
        The product of the lengths of the choice and range sweeps (1 when there is none); None when the
            overrides do not parse or a sweep cannot be counted here (an interval, a ``glob``).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        lengths = [len(list(o.sweep_string_iterator())) for o in parsed if o.is_sweep_override()]
    except Exception:  # Hydra says what is wrong with them when it sweeps
        return None
    return math.prod(lengths)


class SweepConfigError(CompactHydraException):
    """Bad sweep settings: Hydra prints the message alone (no traceback) and expkit exits 2."""


def check_seed_keys(config: DictConfig) -> None:
    """``seed_keys`` (what makes seed groups): a list of keys of the config, checked before any
    job starts.

    Args:
        config: the sweep's config; its ``seed_keys`` entry is checked (absent or null: nothing to check).

    Raises:
        SweepConfigError: when ``seed_keys`` is not a list of strings, or one of its keys is not in the
            config (a key whose value is ``???`` counts as not in it).
    """
    keys = config.get("seed_keys")
    if keys is None:
        return
    if not isinstance(keys, ListConfig) or not all(isinstance(k, str) for k in keys):
        raise SweepConfigError(f"seed_keys={keys}: give a list of config keys, e.g. seed_keys=[trainer.seed]")
    missing = object()
    for key in keys:
        if OmegaConf.select(config, key, default=missing) is missing:
            raise SweepConfigError(
                f"seed_keys: {key} is not a key of the config; give the keys that hold a seed, "
                f"e.g. seed_keys=[trainer.seed] (see --cfg job)"
            )


class StopBetweenJobs:
    """A launcher whose jobs run in other processes (joblib workers, submitit), made to stop the
    way a terminal user stops it. Ctrl-C (SIGINT to the whole process group) or SIGTERM reaches
    the running jobs themselves, which save their interruption checkpoint and record
    themselves as a single run does; this process, meanwhile, only writes the sweep dir's stop
    file (jobs not started yet then never start) and waits for the launch to return, then
    raises ``SweepInterrupted``, so no further batch starts. A second Ctrl-C quits at once.
    Without this, the launcher's own KeyboardInterrupt handling kills its workers mid-save.

    Args:
        launcher: the launcher to wrap (joblib, submitit, ...); whatever this class does not define is
            looked up on it.
        sweep_dir: the sweep's dir (``hydra.sweep.dir``): where the stop file is written, and the dir
            ``SweepInterrupted`` names.
    """

    def __init__(self, launcher: Any, sweep_dir: Any) -> None:
        self._launcher, self._sweep_dir = launcher, Path(sweep_dir)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        return self.guarded(lambda: self.launch_unguarded(job_overrides, initial_job_idx))

    def launch_unguarded(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        """The launcher's own launch (past a job Slurm requeued: ``launch_through_requeues``): for
        the threads of a sweep whose main thread is ``guarded``."""
        if _submitit_launcher(self._launcher, "SlurmLauncher"):
            from hydra_plugins.expkit_sweeper._slurm_requeues import launch_through_requeues

            return launch_through_requeues(self._launcher, job_overrides, initial_job_idx)
        return self._launcher.launch(job_overrides, initial_job_idx=initial_job_idx)

    def guarded(self, work: Callable[[], T]) -> T:
        """``work()`` (which launches jobs, in this thread or in others), with the signals handled
        as above; raises ``SweepInterrupted`` after it returned if a signal came."""
        import signal
        import threading

        from expkit.core.signals import SweepInterrupted
        from expkit.sweeps.sweep_jobs import request_stop

        if threading.current_thread() is not threading.main_thread():
            return work()
        got: list[int] = []

        def on_signal(signum: int, frame: Any) -> None:
            if got and signum == signal.SIGINT:
                raise KeyboardInterrupt  # the second Ctrl-C: at once
            if not got:
                got.append(signum)
                request_stop(self._sweep_dir, signum)
                log.warning(
                    "%s: the running jobs save and stop; no other job starts (Ctrl-C again quits at once)",
                    signal.Signals(signum).name,
                )

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        watcher = None
        try:
            if _submitit_launcher(self._launcher, "LocalLauncher"):  # (its job controllers run in this process group)
                watcher = _StopWatcher(self._sweep_dir)  # hears Ctrl-C for this process, which ignores it
            returns = work()
        except Exception as exc:
            refused = _refused_submission(exc)
            if refused:  # (sbatch's one line, not submitit's traceback of 50)
                print(f"Error: {refused}", file=sys.stderr)
                raise TaskExit(2) from None
            if watcher is not None and watcher.heard():
                got.append(watcher.heard())  # type: ignore[arg-type]
            if got:  # a worker the signal ended (SIGTERM between jobs): the sweep stops all the same
                raise SweepInterrupted(got[0], self._sweep_dir) from None
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if watcher is not None:
                watcher.close()
        if watcher is not None and not got and watcher.heard():
            got.append(watcher.heard())  # type: ignore[arg-type]
        if got:
            raise SweepInterrupted(got[0], self._sweep_dir)
        return returns

    def __getattr__(self, name: str) -> Any:
        return getattr(self._launcher, name)


def _refused_submission(exc: Exception) -> str | None:
    """What the scheduler said when it refused to take the jobs (submitit's ``FailedJobError`` from
    ``sbatch``: a generic resource the cluster lacks, more CPUs than a node has, an unknown
    partition); None for any other error."""
    if type(exc).__name__ not in ("FailedJobError", "FailedSubmissionError") or "submitit" not in type(exc).__module__:
        return None
    said = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (
        f"the cluster refused the jobs: {said[-1] if said else type(exc).__name__} "
        "(check hydra.launcher's partition, gpus_per_node, tasks_per_node, cpus_per_task, mem_gb and timeout_min "
        "against what `sinfo --long --Node` shows)"
    )


def _submitit_launcher(launcher: Any, name: str) -> bool:
    """Whether `launcher` is Hydra's submitit launcher of class `name`: ``LocalLauncher`` (its job
    controllers are started from this process, in the terminal's process group) or ``SlurmLauncher``."""
    return type(launcher).__name__ == name and "submitit" in type(launcher).__module__


# A process that hears the terminal's Ctrl-C (or SIGTERM) for the sweep and writes the stop file
# (sweep_jobs.request_stop's record), started with the standard library only.
_WATCHER = """
import json, os, signal, sys
path, launch = sys.argv[1], sys.argv[2] or None
def on_signal(signum, frame):
    tmp = path + ".tmp%d" % os.getpid()
    with open(tmp, "w") as f:
        json.dump({"signal": signum, "launch": launch}, f)
    os.replace(tmp, path)
    sys.stderr.write("%s: the running jobs save and stop; no other job starts\\n" % signal.Signals(signum).name)
    os._exit(0)
signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
print("ready", flush=True)
while True:
    signal.pause()
"""


class _StopWatcher:
    """submitit's local job controllers are processes of the terminal's process group started
    while the sweep launches: one that gets Ctrl-C dies with a KeyboardInterrupt traceback and
    then interrupts its job a second time and kills it a second later, even mid-save. They
    inherit an ignored SIGINT, so the sweep ignores SIGINT while it launches them; this
    process hears the signal instead and records it in the sweep's stop file (jobs not
    started yet then do not start, and the sweep stops after the launch). The jobs hear
    Ctrl-C themselves, as in any sweep."""

    def __init__(self, sweep_dir: Path) -> None:
        import os
        import signal
        import subprocess
        import sys

        from expkit.sweeps.sweep_jobs import STOP_FILE, SWEEP_LAUNCHED_ENV

        self._sweep_dir = sweep_dir
        sweep_dir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                "-c",
                _WATCHER,
                str(sweep_dir / STOP_FILE),
                os.environ.get(SWEEP_LAUNCHED_ENV, ""),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        self._proc.stdout.readline()  # its handlers are in place
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controllers started now inherit this

    def heard(self) -> int | None:
        from expkit.sweeps.sweep_jobs import stop_requested

        return stop_requested(self._sweep_dir)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


@contextlib.contextmanager
def launcher_settings_checked() -> Iterator[None]:
    """Around the launcher's construction: a setting refused as it is resolved (``slurm_ddp`` asks
    sinfo for its defaults) leaves as one ``Error:`` line and exit 2, not as OmegaConf's
    interpolation error in a traceback.

    Yields:
        Nothing: the launcher is built inside.

    Raises:
        TaskExit: 2, for an error whose cause is a ConfigError (printed first).
    """
    try:
        yield
    except Exception as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        print(f"Error: {cause}", file=sys.stderr)
        raise TaskExit(2) from None


def stoppable(launcher: Any, config: DictConfig) -> Any:
    """`launcher`, stopped by signals as a sweep should be (see ``StopBetweenJobs``); the
    in-process BasicLauncher as it is (its jobs stop the sweep themselves).

    Args:
        launcher: the launcher Hydra instantiated for the sweep.
        config: the sweep's config; ``hydra.sweep.dir`` is where the stop file is written.

    Returns:
        `launcher` itself when its type is exactly BasicLauncher; otherwise `launcher` wrapped in a
            ``StopBetweenJobs``.
    """
    return launcher if type(launcher) is basic_launcher() else StopBetweenJobs(launcher, config.hydra.sweep.dir)


def _expkit_app(task_function: TaskFunction) -> bool:
    """Whether `task_function` is one of expkit's commands (``python -m expkit.train`` runs it as
    ``__main__``: the module's spec names it)."""
    module = str(getattr(task_function, "__module__", ""))
    if module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = str(getattr(spec, "name", ""))
    return module.startswith("expkit.")


class ExpkitSweeper(basic_sweeper()):  # type: ignore[misc]  # (the class this module's execution finds)
    """``hydra/sweeper=expkit``: Hydra's BasicSweeper (a grid) that checks ``seed_keys`` first, composes
    each job once when the jobs run in this process, and otherwise makes the launcher stop between
    jobs on a signal (``StopBetweenJobs``).

    Args:
        max_batch_size: the jobs composed (checked) per batch before the batch launches; None: all
            jobs in one batch.
        params: sweep values from the config, as ``hydra/sweeper=basic`` takes them (``{optim.lr:
            "0.1,0.01"}``); a command-line override of the same key replaces its entry. None: none.
        check_values: also check what each job sets as expkit's build checks it (``check_batch``);
            None: when the task function is one of expkit's commands.
    """

    def __init__(
        self, max_batch_size: int | None = None, params: dict[str, str] | None = None, check_values: bool | None = None
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.sweep_params = dict(params or {})
        self.check_values = check_values

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        with launcher_settings_checked():
            super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        if self.check_values is None:  # (expkit's own rules for expkit's apps only)
            self.check_values = _expkit_app(task_function)
        if type(self.launcher) is basic_launcher():  # jobs composed and run in this process
            self.hydra_context = compose_once(self.launcher, hydra_context)
        self.launcher = stoppable(self.launcher, config)

    def sweep(self, arguments: list[str]) -> Any:
        from expkit.sweeps.sweep_jobs import launch

        assert self.config is not None
        check_seed_keys(self.config)
        jobs = count_jobs([*(f"{k}={v}" for k, v in self.sweep_params.items()), *arguments])
        with launch(jobs, self.config.hydra.sweep.dir):
            return super().sweep(arguments)

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        assert self.config is not None and self.hydra_context is not None
        check_batch(self.hydra_context, self.config, batch, values=self.check_values)
