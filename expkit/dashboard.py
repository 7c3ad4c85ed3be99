"""``python -m expkit.dashboard <search dir> [port=N] [host=127.0.0.1]``: optuna-dashboard on a
search's own study.

An Optuna search (``hparams_search=...``) records in its sweep dir the study its trials belong to:
``.search.json`` (the sweeper's binding: study name and storage, written by its first worker), and
``multirun.yaml``'s ``hydra.sweeper`` (``study_name``, ``storage``: null means the sweep dir's
``optuna.journal``). The command reads them, opens that storage (a journal file, SQLite or
PostgreSQL, as the search itself does), checks that it holds the study, prints the URL and
serves optuna-dashboard there, live while the search runs, until Ctrl-C or SIGTERM (exit 0).

The storage named in a record is used only where it exists: a journal file or SQLite database
that is not there is never made (a relative path is read from the current directory, as the
search wrote it, else by its name in the sweep dir). A dir that is no search, a storage that
cannot be opened or does not hold the study: exit 2, one line. optuna-dashboard is in the
``sweep`` extra (``pip install 'expkit[sweep]'``).
"""

from __future__ import annotations

import json
import signal
import socketserver
import sys
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import yaml
from omegaconf import DictConfig

from expkit.config import cli
from expkit.core import hydra_compat
from expkit.core.confine import confined
from expkit.core.errors import ConfigError, config_errors_exit_2

__all__ = ["main", "open_study_storage", "run", "serve", "study_of"]

BINDING = ".search.json"  # the Optuna sweeper's record of its study (hydra_plugins/expkit_sweeper/_optuna_ledger.py)
DEFAULT_JOURNAL = "optuna.journal"  # the sweeper's storage when none is given


def _sweeper_settings(sweep_dir: Path) -> dict[str, Any] | None:
    """multirun.yaml's ``hydra.sweeper`` when it is an Optuna sweeper's, else None."""
    try:
        loaded = yaml.safe_load((sweep_dir / "multirun.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    sweeper = ((loaded or {}).get("hydra") or {}).get("sweeper") if isinstance(loaded, dict) else None
    if not isinstance(sweeper, dict) or "optuna" not in str(sweeper.get("_target_", "")).lower():
        return None
    return sweeper


def study_of(sweep_dir: Path) -> tuple[str, str]:
    """The study name and storage setting an Optuna search recorded in its sweep dir.

    Args:
        sweep_dir: the search's sweep dir.

    Returns:
        (study name, storage): ``.search.json``'s, else ``multirun.yaml``'s ``hydra.sweeper`` ones (no
            storage: the sweep dir's ``optuna.journal``).

    Raises:
        ConfigError: when `sweep_dir` is no dir, or records no Optuna search.
    """
    if not sweep_dir.is_dir():
        raise ConfigError(f"search={sweep_dir}: no such dir; give the sweep dir of an Optuna search")
    try:
        bound = json.loads((sweep_dir / BINDING).read_text())
    except (OSError, ValueError):
        bound = None
    sweeper = _sweeper_settings(sweep_dir)
    if isinstance(bound, dict) and isinstance(bound.get("study_name"), str):
        name, storage = bound["study_name"], bound.get("storage")
    elif sweeper is not None:
        name, storage = str(sweeper.get("study_name") or "expkit"), sweeper.get("storage")
    else:
        raise ConfigError(
            f"search={sweep_dir}: not the sweep dir of an Optuna search (no {BINDING}, and no multirun.yaml "
            "naming the Optuna sweeper); give the hydra.sweep.dir of an hparams_search=... run"
        )
    return name, str(storage) if storage else str(sweep_dir / DEFAULT_JOURNAL)


def _existing_journal(spec: str, sweep_dir: Path) -> Path:
    path = Path(spec)
    if path.is_file():
        return path
    here = confined(sweep_dir, path.name, sweep_dir / BINDING, "journal file")  # the sweep dir moved or copied
    if here is not None and here.is_file():
        return here
    raise ConfigError(f"the search's journal {spec} does not exist (run this where the search ran, or check the dir)")


def open_study_storage(name: str, spec: str, sweep_dir: Path) -> Any:
    """The Optuna storage `spec` as the search opens it, holding the study `name`; nothing is made.

    Args:
        name: the study's name.
        spec: the storage setting: a database URL or a journal file path.
        sweep_dir: the sweep dir (a journal is looked for there by its name when `spec` is not found).

    Returns:
        Optuna's storage.

    Raises:
        ConfigError: when a journal or SQLite file does not exist, the storage cannot be opened, or it
            holds no study `name`.
    """
    import optuna

    from expkit.sweeps.search import open_storage, shown_url

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if "://" not in spec:
        spec = str(_existing_journal(spec, sweep_dir))
    elif spec.startswith("sqlite:///") and not Path(spec.removeprefix("sqlite:///").partition("?")[0]).is_file():
        raise ConfigError(f"the search's storage {spec} does not exist (run this where the search ran)")
    try:
        storage = open_storage(spec)
        names = [s.study_name for s in storage.get_all_studies()]
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise ConfigError(
            f"cannot open the search's storage {shown_url(spec)}: {type(exc).__name__}: {first}"
        ) from None
    if name not in names:
        raise ConfigError(
            f"the storage {shown_url(spec)} holds no study {name!r} (it holds: {', '.join(names) or 'none'})"
        )
    return storage


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # (a browser's open requests never hold the exit)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # (the dashboard polls every few seconds: a line per request would bury the URL)


class _Stop(Exception):
    """SIGTERM: stop serving, as Ctrl-C does."""


def _stop(signum: int, frame: Any) -> None:
    raise _Stop


def serve(storage: Any, host: str, port: int) -> None:
    """Serve optuna-dashboard on `storage` at http://`host`:`port`/ until Ctrl-C or SIGTERM.

    Args:
        storage: an Optuna storage (``open_study_storage``).
        host: the address to listen on.
        port: the port to listen on; 0: a free one (the printed URL names it).

    Raises:
        ConfigError: when the address cannot be listened on (a port in use, a host not of this machine).
    """
    from optuna_dashboard import wsgi

    try:
        server = make_server(host, port, wsgi(storage), server_class=_Server, handler_class=_QuietHandler)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; give another port=N") from None
    shown = f"[{host}]" if ":" in host else host
    print(f"optuna-dashboard on http://{shown}:{server.server_address[1]}/ (Ctrl-C stops it)", flush=True)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        server.serve_forever()
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.server_close()


@hydra_compat.main(config_path="conf", config_name="dashboard")
def run(cfg: DictConfig) -> None:
    """Hydra's task function: bad input exits 2 with one line.

    Args:
        cfg: the composed ``dashboard.yaml`` config; Hydra composes it from the command line and passes
            it, so the function is called with no arguments (as ``main`` does).

    Raises:
        SystemExit: with status 2 for bad input: no dir given, a dir that is no search, a storage that
            cannot be opened or holds no such study, an address that cannot be listened on;
            optuna-dashboard missing.
    """
    with config_errors_exit_2():
        if not cfg.get("search"):
            raise ConfigError("give the search's sweep dir: python -m expkit.dashboard <search dir> [port=N]")
        sweep_dir = Path(str(cfg.search))
        name, spec = study_of(sweep_dir)
        try:
            import optuna_dashboard  # noqa: F401
        except ImportError:
            raise ConfigError("the dashboard needs optuna-dashboard: pip install 'expkit[sweep]'") from None
        storage = open_study_storage(name, spec, sweep_dir)
        print(f"Study {name!r} of {sweep_dir}", flush=True)
        serve(storage, str(cfg.host), int(cfg.port))


def _hydra_argv(argv: list[str]) -> list[str]:
    """A bare word (the search's dir) as Hydra's ``search=<dir>``."""
    out, given = [], []
    for token in cli.tokens(argv):
        arg = token[0]
        if len(token) == 1 and not arg.startswith("-") and ("=" not in arg or Path(arg).is_dir()):
            given.append(arg)
        else:
            out += token
    if len(given) > 1:
        print(f"Error: give one search dir, not {len(given)}: {' '.join(given)}", file=sys.stderr)
        sys.exit(2)
    return [*out, f"search={cli.hydra_quoted(given[0])}"] if given else out


def main() -> None:
    """``python -m expkit.dashboard``: a Hydra app over conf/dashboard.yaml (``--help``, ``--cfg job``).

    Raises:
        SystemExit: with status 2 for bad input (also Hydra's own errors), 0 when stopped by Ctrl-C or
            SIGTERM.
    """
    cli.dirs_command_main(run, _hydra_argv)


if __name__ == "__main__":
    main()
