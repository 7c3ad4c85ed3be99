"""The one place where expkit meets what differs between the Hydra and OmegaConf lines it supports.

expkit runs on Hydra 1.3 (OmegaConf 2.3) and Hydra 1.4 (OmegaConf 2.4). Everything else in
expkit uses their public API; what is here is either public API that one line deprecates or
lacks, or private API Hydra offers no public form of: its basic launcher and sweeper (which
expkit's sweeper builds on), and on Hydra 1.3 the steps of ``hydra.main``'s run, taken so
that a run composes its config once (``main``). Each has a branch per line, and
``tests/config/test_hydra_compat.py`` runs on each line CI installs. Nothing here replaces or wraps
an attribute of Hydra, OmegaConf or torch: expkit never patches another library.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import hydra
import omegaconf
from omegaconf import OmegaConf

from expkit.core import versions
from expkit.core.errors import suggest

__all__ = [
    "HYDRA_VERSION",
    "INIT_KWARGS",
    "MAIN_KWARGS",
    "RECORD_DEFERRED",
    "basic_launcher",
    "basic_sweeper",
    "instantiate",
    "locate",
    "main",
    "refusal_line",
    "register_resolver",
]

# A command that ran Hydra with hydra.output_subdir=null so that its task writes the run's .hydra/
# itself, later (train: a resume, once its checkpoint is known to fit). Set around the app's call,
# read by its task; here, not in the command's module, whose functions a joblib launcher pickles by
# value when the command runs as __main__ (a ContextVar cannot be pickled).
RECORD_DEFERRED: ContextVar[bool] = ContextVar("expkit_record_deferred", default=False)


HYDRA_VERSION = versions.parse(hydra.__version__)[:2]
OMEGACONF_VERSION = versions.parse(omegaconf.__version__)[:2]

# Hydra 1.4 builds a config-named ``_target_`` only where trusted code allows it (its execution
# whitelist; without one it warns, and Hydra 1.5 will refuse). expkit decides what a config may
# build by its own rule, the same on both lines: a command builds what its user composed (the
# command line, the shipped configs, their --config-dir: code they chose to run), and a config
# read from a checkpoint only after expkit.core.trust.TrustPolicy accepted every target in it. A
# whitelist of a node's own targets is not enough: Hydra 1.4 also asks for the class of every
# callable a target returns (a factory returning a torchvision ResNet, any nn.Module), so
# expkit's builds, and Hydra's own for its commands (callbacks, log handlers), run with Hydra's
# checks off: Hydra 1.3's behaviour, said explicitly.
INIT_KWARGS: dict[str, Any] = {} if HYDRA_VERSION >= (1, 4) else {"version_base": "1.3"}  # initialize_*()


def _checks_off() -> Any:
    from hydra.utils import UNSAFE_DISABLE_EXECUTION_CHECKS  # (Hydra 1.4)

    return UNSAFE_DISABLE_EXECUTION_CHECKS


# hydra.main: Hydra 1.3 needs version_base="1.3" (without it, 1.1's defaults: the job changes its
# working dir); Hydra 1.4 deprecates the argument (its defaults are 1.3's).
MAIN_KWARGS: dict[str, Any] = {"execution_whitelist": _checks_off()} if HYDRA_VERSION >= (1, 4) else INIT_KWARGS


def instantiate(node: Any, /, **kwargs: Any) -> Any:
    """Hydra's ``instantiate`` of a node expkit has decided to build (see above); on Hydra 1.4
    inside an execution whitelist that leaves that decision to expkit.

    Args:
        node: the config node to build.
        **kwargs: extra keyword arguments for the target, as Hydra's ``instantiate`` takes them.

    Returns:
        What Hydra's ``instantiate`` built.
    """
    from hydra.utils import instantiate as hydra_instantiate

    if HYDRA_VERSION < (1, 4):
        return hydra_instantiate(node, **kwargs)
    from hydra.utils import execution_whitelist

    with execution_whitelist(_checks_off(), reset=True):
        return hydra_instantiate(node, **kwargs)


def register_resolver(name: str, resolver: Callable[..., Any]) -> None:
    """Register an OmegaConf resolver (replacing one of that name): ``register_resolver`` on
    OmegaConf 2.4, ``register_new_resolver`` (which 2.4 deprecates) on 2.3 (whose own
    ``register_resolver`` is an older, deprecated API).

    Args:
        name: the resolver's name, as written in ``${name:...}``.
        resolver: the function that computes the value.
    """
    if OMEGACONF_VERSION >= (2, 4):
        OmegaConf.register_resolver(name, resolver, replace=True)
    else:
        OmegaConf.register_new_resolver(name, resolver, replace=True)


def locate(path: str) -> Any:
    """The object a ``_target_`` names (Hydra's public ``get_object``, on both lines).

    Args:
        path: the dotted import path of a module attribute, e.g. ``torch.optim.AdamW``.

    Returns:
        The object.
    """
    from hydra.utils import get_object

    return get_object(path)


# Hydra's in-process launcher and its grid sweeper: private modules on both lines, the same
# classes and constructor arguments on both (tests/config/test_hydra_compat.py checks). Looked up at each
# call, never kept: Hydra 1.3's plugin scan executes its plugin modules again, in place, so a
# class kept from an earlier import is no longer the one Hydra's own code names (BasicSweeper's
# __init__ calls super(BasicSweeper, self) with the module's current class).
def basic_launcher() -> type:
    """Hydra's in-process launcher class, as its module holds it now.

    Returns:
        ``hydra._internal.core_plugins.basic_launcher.BasicLauncher``.
    """
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher

    return BasicLauncher


def basic_sweeper() -> type:
    """Hydra's grid sweeper class, as its module holds it now.

    Returns:
        ``hydra._internal.core_plugins.basic_sweeper.BasicSweeper``.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return BasicSweeper


# -- hydra.main, composing once ---------------------------------------------------------------
# A run composes its config once. Hydra 1.4 does so itself: it reads ``hydra.mode`` from the
# command line and the primary config file alone. Hydra 1.3's ``hydra.main`` composes the whole
# config twice for a run: once to read ``hydra.mode`` (Hydra.get_mode), once to run it, about
# 0.1 s of expkit's 0.3 s start-up share here (benchmarks/startup.py). So on 1.3 a plain run
# (overrides only, none a sweep, no --help/--cfg/--info/-m) takes the steps of Hydra 1.3's own
# run path (hydra/_internal/utils.py `_run_hydra`, Hydra.run) with one composition, and learns
# the mode from it; anything else, or a config that asks for a multirun, is Hydra's as before.
def main(config_path: str, config_name: str) -> Callable[[Callable[[Any], Any]], Callable[..., Any]]:
    """``hydra.main`` for expkit's commands: the same app on every Hydra line, composing a run's
    config once.

    Args:
        config_path: the config directory, relative to the command's module.
        config_name: the primary config's name.

    Returns:
        A decorator that turns a task function into the command's entry point. On Hydra 1.3 that
        entry point runs a plain run itself, composing once, and gives everything else to ``hydra.main``.
    """

    def decorator(task_function: Callable[[Any], Any]) -> Callable[..., Any]:
        @functools.wraps(task_function)  # (Hydra finds the command's module through __wrapped__)
        def task(cfg: Any) -> Any:
            _task_begins()
            return task_function(cfg)

        hydra_app = hydra.main(**MAIN_KWARGS, config_path=config_path, config_name=config_name)(task)

        @functools.wraps(task_function)
        def app(cfg_passthrough: Any = None) -> Any:
            with _refusals_in_one_line():
                if (
                    HYDRA_VERSION < (1, 4)
                    and cfg_passthrough is None
                    and _run_composing_once(task, config_path, config_name)
                ):
                    return None
                return hydra_app(cfg_passthrough)

        return app

    return decorator


# -- Hydra's refusal of a command line, in one line -----------------------------------------------
# Hydra prints its own refusal (a key the config lacks, a missing --config-dir: 2 to 6 lines and
# "Set the environment variable HYDRA_FULL_ERROR=1") and exits 1; expkit's line would come after
# it. With HYDRA_FULL_ERROR=1, Hydra's documented switch, it raises the error instead: set from the
# app's call until its first task begins (then put back, so that a task's own errors, and the
# processes a task starts, are as before), the refusal reaches ``_refusals_in_one_line``, which
# prints one line for it. A user who set HYDRA_FULL_ERROR=1 gets Hydra's full trace, untouched.
_HELD: list[str | None] = []  # HYDRA_FULL_ERROR's own value while the app holds it at 1, until a task begins


def _task_begins() -> None:
    """A task of the app begins: HYDRA_FULL_ERROR back to what it was."""
    while _HELD:
        before = _HELD.pop()
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


@contextlib.contextmanager
def _refusals_in_one_line() -> Iterator[None]:
    """Around the app's call: Hydra's refusal before any task began as one line and exit 2 (the
    input is the user's to fix); any other error raised on, with its traceback."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        yield
        return
    _HELD.append(os.environ.get("HYDRA_FULL_ERROR"))
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except Exception as exc:
        if not _HELD:  # (a task began: its errors are the command's own)
            raise
        _task_begins()
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if not isinstance(exc, (HydraException, OmegaConfBaseException)):
            raise  # (not a refusal: its traceback, as Hydra prints an error outside a job)
        print(f"Error: {refusal_line(exc)}", file=sys.stderr)
        sys.exit(2)
    finally:
        _task_begins()


def refusal_line(exc: BaseException) -> str:
    """Hydra's refusal of a command line as one line that names the key and what to type instead:
    a key the config lacks with the nearest keys it has (``trainer.max_epch is not a key of the
    config; did you mean trainer.max_epochs?``), an unknown option of a config group with the
    nearest option, otherwise Hydra's own words joined into one line.

    Args:
        exc: what Hydra raised while it composed the config (its ``ConfigCompositionException``,
            ``MissingConfigException``, ``SearchPathException``...).

    Returns:
        The line, without ``Error:``.
    """
    from hydra.errors import MissingConfigException, SearchPathException
    from omegaconf import DictConfig
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = exc.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and isinstance(cause.parent_node, DictConfig):
        typed = re.match(r"Could not override '([^']+)'", str(exc))
        return _unknown_key(typed.group(1) if typed else str(cause.full_key), str(cause.full_key), cause.parent_node)
    if isinstance(exc, MissingConfigException) and exc.options and exc.missing_cfg_file:
        group, _, name = str(exc.missing_cfg_file).rpartition("/")
        close = suggest(name, exc.options)
        hint = f"did you mean {group}={close[0]}? " if close else ""
        return f"Unknown {group} option {name!r}; {hint}Available {group}: {', '.join(exc.options)}"
    if isinstance(exc, SearchPathException):
        return f"{exc}; give --config-dir a directory that exists (a relative path is from the current directory)"
    lines = [*str(exc).splitlines(), *(str(cause).splitlines()[:1] if cause is not None else [])]
    kept = [
        line.strip() for line in lines if line.strip() and not line.strip().startswith(("full_key:", "object_type"))
    ]
    return "; ".join(kept) or type(exc).__name__


def _unknown_key(typed: str, missing: str, parent: Any) -> str:
    """The sentence for an override of a key the config lacks: `missing` (the first part of `typed`
    that is not there) under its `parent` node, with the keys that look like it."""
    from omegaconf import OmegaConf

    above, _, name = missing.rpartition(".")
    tree = OmegaConf.to_container(parent, resolve=False)
    rest = typed[len(above) + 1 :] if above and typed.startswith(f"{above}.") else ""
    if "." in rest and rest in tree:  # type: ignore[operator]  # (a key that holds dots: Optuna's params' optim.lr)
        return (
            f"{typed}: {rest!r} is one key of {above}, with a dot in its name, which a dotted override "
            f'reads as nested keys; set it in braces: "{above}={{{rest}: <value>}}" (the other keys stay)'
        )
    if above:  # a typo among the keys of one node
        close = [f"{above}.{k}" for k in suggest(name, [str(k) for k in tree], cutoff=0.6)]  # type: ignore[union-attr]
    else:  # a bare key: the dotted keys that end in it (seed: trainer.seed), else the nearest
        known = {k: v for k, v in _dotted_keys(tree).items() if not k.startswith("hydra")}
        own = sorted(k for k, v in known.items() if not (isinstance(v, str) and v.startswith("${")))
        close = [k for k in own if k.endswith(f".{name}")][:3]
        by_name = {k.rpartition(".")[2]: k for k in sorted(own, key=lambda k: -k.count("."))}  # (the shallowest)
        close = close or [by_name[n] for n in suggest(name, sorted(by_name), n=2, cutoff=0.6)]
    hint = f"did you mean {' or '.join(close)}?" if close else "see --cfg job for the keys"
    where = f"{typed}: {missing}" if typed != missing else typed
    return f"{where} is not a key of the config; {hint}"


def _dotted_keys(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of a config container with its value, its dicts' keys included
    (``trainer``, ``trainer.seed``)."""
    found: dict[str, Any] = {}
    if isinstance(tree, dict):
        for name, value in tree.items():
            key = f"{prefix}{name}"
            found[key] = value
            found.update(_dotted_keys(value, f"{key}."))
    return found


def _run_composing_once(task_function: Callable[[Any], Any], config_path: str, config_name: str) -> bool:
    """Hydra 1.3: run a plain run as ``hydra.main`` would, composing once; False (nothing done)
    for any other command line, which Hydra's own path then takes."""
    import os

    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import (
        create_automatic_config_search_path,
        detect_calling_file_or_module_from_task_function,
        detect_task_name,
        get_args_parser,
        run_and_report,
    )
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import SearchPathException
    from hydra.types import RunMode
    from omegaconf import open_dict

    args = get_args_parser().parse_args()  # (sys.argv; a bad flag exits 2 here as in Hydra's path)
    if not _is_plain_run(args):
        return False
    calling_file, calling_module = detect_calling_file_or_module_from_task_function(task_function)
    if calling_file is None and calling_module is None:
        return False
    config_name = args.config_name if args.config_name is not None else config_name
    config_path = args.config_path if args.config_path is not None else config_path
    search_path = create_automatic_config_search_path(calling_file, calling_module, config_path)

    def add_config_dir() -> None:
        if args.config_dir is not None:
            config_dir = os.path.abspath(args.config_dir)
            if not os.path.isdir(config_dir):
                raise SearchPathException(f"Additional config directory '{config_dir}' not found")
            search_path.prepend(provider="command-line", path=f"file://{config_dir}", anchor="schema")

    run_and_report(add_config_dir)
    task_name = detect_task_name(calling_file, calling_module)
    app = run_and_report(lambda: Hydra.create_main_hydra2(task_name=task_name, config_search_path=search_path))
    overrides = list(args.overrides)
    try:
        cfg = run_and_report(
            lambda: app.compose_config(config_name, overrides, run_mode=RunMode.RUN, with_log_configuration=True)
        )
        if cfg.hydra.mode == RunMode.MULTIRUN:  # the config asks for a sweep: Hydra's multirun
            run_and_report(
                lambda: app.multirun(config_name=config_name, task_function=task_function, overrides=overrides)
            )
            return True
        if cfg.hydra.mode is None:  # as Hydra's path records it: a run by default, hydra.mode=RUN
            cfg.hydra.mode = RunMode.RUN
            with open_dict(cfg.hydra.overrides):
                cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
        run_and_report(lambda: _run_job(app, cfg, config_name, task_function))
    finally:
        GlobalHydra.instance().clear()
    return True


def _is_plain_run(args: Any) -> bool:
    """Whether Hydra 1.3's parsed command line (`args`) asks for a plain run: no --help, --cfg,
    --info, -m or other flag of Hydra's own, and no override that is a sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if (
        args.help
        or args.hydra_help
        or args.cfg is not None
        or args.resolve
        or args.multirun
        or args.shell_completion
        or args.info is not None
        or args.experimental_rerun is not None
    ):
        return False
    try:
        # a sweep without -m: Hydra's path says what to do
        return not any(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(args.overrides))
    except Exception:  # an override Hydra cannot parse: its own path reports it
        return False


def _run_job(app: Any, cfg: Any, config_name: str, task_function: Callable[[Any], Any]) -> None:
    """Hydra 1.3's run of one job (Hydra.run) on the config `app` composed: the callbacks around
    it, its work dir and logging; the job's exception raised."""
    from hydra._internal.callbacks import Callbacks
    from hydra.core.utils import run_job
    from hydra.types import HydraContext

    callbacks = Callbacks(cfg)
    callbacks.on_run_start(config=cfg, config_name=config_name)
    ret = run_job(
        hydra_context=HydraContext(config_loader=app.config_loader, callbacks=callbacks),
        task_function=task_function,
        config=cfg,
        job_dir_key="hydra.run.dir",
        job_subdir_key=None,
        configure_logging=True,
    )
    callbacks.on_run_end(config=cfg, config_name=config_name, job_return=ret)
    _ = ret.return_value  # (raises the job's exception)
