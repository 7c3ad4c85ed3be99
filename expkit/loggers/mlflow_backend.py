"""``logger=[mlflow]``: one MLflow run per expkit run, through ``mlflow.tracking.MlflowClient``.

The store is ``logger.mlflow.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else a local
SQLite store, ``outputs/mlflow.db`` under the directory the command runs in (MLflow 3 no longer
takes the old file store), with artifacts in ``outputs/mlartifacts/``. The run gets the
resolved config as params (``optim.lr``, ...), every metrics.jsonl record on the same step
axis, the run's status when it ends, its best and final metrics, ``curves.svg`` and the
config as artifacts, and the best checkpoint's path and the work dir as tags. The jobs of a
sweep share one experiment, ``<experiment>/<sweep dir name>``, as children of the sweep's parent
run (``expkit.loggers.mlflow_sweep``); single runs go to ``<experiment>``. A resumed run (``resume=true``) continues its MLflow run: the id is kept in
``<work dir>/mlflow/run_id``. MLflow cannot delete logged points, so after a resume the steps
an interrupted attempt logged past its checkpoint appear twice (with exact resume, with the
same values). Browse with ``mlflow ui --backend-store-uri sqlite:///outputs/mlflow.db``.

A SQLite store is made whole or not at all. MLflow makes a new store's tables with some 70
schema migrations (a few seconds), and SQLite commits most of their steps one by one, so a run
killed meanwhile used to leave a half-made store that MLflow can never open again ("table
_alembic_tmp_datasets already exists", "table jobs already exists", ...), and every later run
then logged nothing there. Now a store that does not exist yet is made under a temporary name
beside it (``.mlflow.db.partial-*``) and hard-linked into place once MLflow has made all its
tables: the link is atomic, and never replaces a store another job made meanwhile (that one is
used). A kill leaves only the partial file, which a later run removes once it is an hour old.

A half-made store from before (or from an ``mlflow ui``/``mlflow server``/``mlflow db upgrade``
killed while it made or upgraded one) fails the run, exit 2, before training, with one message
naming the file, what happened and the repair: a :class:`~expkit.core.errors.ConfigError`, as for
any input the user has to fix, raised when the backend is built, found by the scratch tables
(``_alembic_tmp_<table>``) that alembic's interrupted table rebuild left in it. Failing beats
the warn-and-go-on of a backend that fails (``expkit.loggers.backends``): that suits a dashboard hiccup,
but a half-made store stays broken, so every run would train for hours and log nothing to the
dashboard that was asked for. The repair it gives loses no data: a store that holds no runs,
experiments or models is deleted (``rm``; the next run makes it again, whole); one that holds
runs is kept, backed up, and its scratch tables, empty (their copy was never committed), are
dropped, after which MLflow finishes its upgrade. MLflow and alembic offer no repair of their own
(``mlflow db upgrade`` fails the same way), and expkit changes no existing store by itself.
A half-made store with no scratch table left shows only when MLflow fails to open it (``open``
cannot fail the run): if it holds nothing, the backend's one warning then says so, and ``rm``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shlex
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expkit.core.atomic import write_text_atomic
from expkit.core.errors import ConfigError
from expkit.loggers.backends import Backend, scalars
from expkit.loggers.mlflow_sweep import PARENT_RUN_TAG, log_sweep_summary, sweep_parent

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = [
    "BATCH",
    "BOOKKEEPING",
    "PARAM_VALUE_LIMIT",
    "SCRATCH",
    "STALE_PARTIAL_S",
    "MLflowBackend",
    "StoreState",
    "check_store",
    "default_tracking_uri",
    "flatten",
    "half_made_message",
    "has_scratch",
    "inspect_store",
    "make_store",
    "sqlite_file",
]


log = logging.getLogger("expkit")

PARAM_VALUE_LIMIT = 6000  # MLflow's longest param value
BATCH = 100  # params per log_batch request (MLflow's limit)


SCRATCH = "_alembic_tmp_"  # alembic's copy of a table it rebuilds (SQLite cannot ALTER most things)
BOOKKEEPING = {"alembic_version", "workspaces"}  # tables MLflow fills itself: not the user's data
STALE_PARTIAL_S = 3600  # a store being made this long ago was killed: its partial file is removed


def default_tracking_uri() -> str:
    """The tracking URI used when neither ``logger.mlflow.tracking_uri`` nor ``MLFLOW_TRACKING_URI``
    gives one: the SQLite store ``outputs/mlflow.db`` under the current directory.

    Returns:
        ``sqlite:///<absolute path of outputs/mlflow.db>``.
    """
    return f"sqlite:///{(Path.cwd() / 'outputs' / 'mlflow.db').resolve()}"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI; None for other stores and in-memory ones.

    Args:
        uri: an MLflow tracking URI.

    Returns:
        The path after ``sqlite:///`` without a ``?query`` (relative when the URI has three slashes,
        absolute with four), or None.
    """
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///").partition("?")[0]
    return Path(path) if path and path != ":memory:" else None


@dataclass
class StoreState:
    """What a read-only look at an existing SQLite store finds."""

    revision: str | None  # alembic's schema revision (None: no alembic_version table)
    scratch: dict[str, int] = field(default_factory=dict)  # leftover _alembic_tmp_<table>: its row count
    missing: list[str] = field(default_factory=list)  # tables a scratch table stands in for that are gone
    runs: int = 0
    content: int = 0  # tables with rows of the user's: runs, experiments but Default, models, traces, ...


def _connect_ro(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True, timeout=10)


def _tables(conn: sqlite3.Connection) -> set[str]:
    names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return {name for name in names if not name.startswith("sqlite_")}


def has_scratch(db: Path) -> bool:
    """Whether the SQLite store `db` holds alembic's scratch tables (one query: cheap on any store).

    Args:
        db: the SQLite file, opened read-only.

    Returns:
        True when a table named ``_alembic_tmp_*`` exists; False also when `db` is not a file.

    Raises:
        sqlite3.Error: when the file cannot be read as a SQLite database.
    """
    if not db.is_file():
        return False
    with contextlib.closing(_connect_ro(db)) as conn:
        return any(name.startswith(SCRATCH) for name in _tables(conn))


def inspect_store(db: Path) -> StoreState | None:
    """The state of the SQLite store `db` (None: no such file), read without writing anything.

    Args:
        db: the SQLite file, opened read-only.

    Returns:
        The schema revision, the scratch tables with their row counts, the tables they stand in for
        that are gone, the number of runs, and how many tables hold the user's rows; None when `db` is
        not a file.

    Raises:
        sqlite3.Error: when the file cannot be read as a SQLite database.
    """
    if not db.is_file():
        return None
    with contextlib.closing(_connect_ro(db)) as conn:

        def rows(table: str, where: str = "", exists: bool = False) -> int:
            """The rows of `table`; with `exists`, 1 if it has any (no scan of a big table), else 0."""
            source = '"' + table.replace('"', '""') + '" ' + where
            query = f"SELECT EXISTS (SELECT 1 FROM {source})" if exists else f"SELECT count(*) FROM {source}"
            return int(conn.execute(query).fetchone()[0])

        tables = _tables(conn)
        revision = None
        if "alembic_version" in tables:
            row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
            revision = row[0] if row else None
        scratch = {t: rows(t) for t in sorted(tables) if t.startswith(SCRATCH)}
        missing = [t.removeprefix(SCRATCH) for t in scratch if t.removeprefix(SCRATCH) not in tables]
        content = sum(rows(t, exists=True) for t in tables - BOOKKEEPING - set(scratch) - {"experiments"})
        if "experiments" in tables:  # but the Default one (id 0) MLflow makes itself
            content += rows("experiments", "WHERE experiment_id != 0", exists=True)
        runs = rows("runs") if "runs" in tables else 0
        return StoreState(revision, scratch, missing, runs, content)


def half_made_message(db: Path, state: StoreState, cause: str | None = None) -> str:
    """What happened to the store `db`, and the repair that loses nothing. Only for a store with
    alembic's scratch tables, or one that MLflow failed to open (`cause`) and that holds nothing.

    Args:
        db: the SQLite file, named in the message and its commands.
        state: what ``inspect_store`` found in it.
        cause: MLflow's error on opening it, for a store without scratch tables.

    Returns:
        One message: what happened, then ``rm`` for a store that holds nothing, else a backup and
        either the ``DROP TABLE`` command for empty scratch tables or a manual repair.
    """
    quoted = shlex.quote(str(db))
    if state.scratch:
        left = ", ".join(state.scratch)
        what = (
            f"the MLflow store {db} is half made: MLflow was stopped (a run killed, most likely) while it "
            f"made or upgraded its tables, and left alembic's scratch table(s) {left} in it (schema "
            f"revision {state.revision}), so MLflow cannot open it again "
            f"('table {next(iter(state.scratch))} already exists') and the run would log nothing there. "
        )
    else:
        what = (
            f"MLflow cannot open the store {db} ({cause}); its schema is at revision "
            f"{state.revision or 'none'}, not this MLflow's: it was left half made, most likely, by a run "
            "killed while MLflow made its tables. "
        )
    if state.content == 0:
        return (
            what + "It holds no runs, experiments or models, so nothing is lost by deleting it; the next run "
            f"makes it again, whole: rm {quoted}"
        )
    held = f"It holds {state.runs} run(s): keep it, and back it up first (cp {quoted} {quoted}.bak). "
    if not state.missing and not any(state.scratch.values()):
        drops = " ".join(f"DROP TABLE {t};" for t in state.scratch)
        return (
            what + held + "The scratch table(s) are empty and the table(s) they were copying are intact, so "
            f"dropping them loses nothing, and the next run (or `mlflow db upgrade sqlite:///{db}`) finishes "
            f"MLflow's upgrade: sqlite3 {quoted} {shlex.quote(drops)}"
        )
    return (
        what + held + "A scratch table holds rows, or stands in for a table that is gone, so expkit cannot tell "
        "a safe repair: restore the copy you had before MLflow upgraded it, or repair it by hand "
        "(`mlflow db upgrade` alone fails the same way)."
    )


def check_store(db: Path, recheck_s: float = 1.0) -> None:
    """Raise ConfigError if the SQLite store `db` holds alembic's scratch tables: one left half made.
    A migration running now also has them, for milliseconds at a time: the store is looked at again
    after `recheck_s`, and only the same leftovers, at the same schema revision, count.

    Args:
        db: the SQLite file; a file that is missing, unreadable or locked is left to MLflow.
        recheck_s: the seconds to wait before looking again.

    Raises:
        ConfigError: when the same scratch tables, at the same schema revision, are there both times.
    """
    try:
        if not has_scratch(db):
            return
        state = inspect_store(db)
        time.sleep(recheck_s)
        again = inspect_store(db)
    except sqlite3.Error:  # unreadable, or locked long: MLflow says what it finds when it opens it
        return
    if state is None or again is None or not again.scratch:
        return
    if (again.scratch.keys(), again.revision) == (state.scratch.keys(), state.revision):
        raise ConfigError(f"logger.mlflow: {half_made_message(db, again)}")


def make_store(db: Path) -> None:
    """Make the SQLite store `db` if it does not exist, whole or not at all: MLflow makes every table
    in ``.<name>.partial-*`` beside it, which is then hard-linked to `db` (atomic, and it fails
    rather than replace a store another job made meanwhile; that one is used). A kill meanwhile
    leaves only the partial file, removed by a later run once it is an hour old.

    Args:
        db: the SQLite file to make; nothing is done when it exists. Its directory must exist.
    """
    if db.exists():
        return
    now = time.time()
    for stale in db.parent.glob(f".{db.name}.partial-*"):
        with contextlib.suppress(OSError):
            if now - stale.stat().st_mtime > STALE_PARTIAL_S:
                stale.unlink()
    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    partial = db.with_name(f".{db.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        # the artifact root MLflow gives the Default experiment when it makes a store itself
        store = SqlAlchemyStore(f"sqlite:///{partial}", DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH)
        store.engine.dispose()  # every connection closed: the file is complete, with no journal
        try:
            os.link(partial, db)
        except FileExistsError:
            pass  # another job made it meanwhile: use that one
        except OSError:  # a file system without hard links: a rename, unless one appeared meanwhile
            if not db.exists():
                os.replace(partial, db)
    finally:
        for leftover in (partial, partial.with_name(partial.name + "-journal")):
            leftover.unlink(missing_ok=True)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": "0.1"}``: the config as MLflow params.

    Args:
        config: the (nested) config as plain containers.
        prefix: prepended to every key (with the dots of the nesting).

    Returns:
        Every leaf value (an empty mapping counts as one) as a string cut to ``PARAM_VALUE_LIMIT``
        characters, by its dotted key.
    """
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = str(value)[:PARAM_VALUE_LIMIT]
    return flat


class MLflowBackend(Backend):
    """See the module docstring. ``experiment``: the experiment of single runs, and the prefix
    of a sweep's; ``run_name``: null gives the job's overrides (or the work dir's name);
    ``tags``: extra tags; ``artifacts``: log curves.svg and the config.

    Args:
        tracking_uri: the MLflow store; None: MLFLOW_TRACKING_URI, else (on resume) the store the run
            was made in, else ``sqlite:///<cwd>/outputs/mlflow.db``. A SQLite store is checked here.
        experiment: the experiment of single runs; a sweep's jobs go to ``<experiment>/<sweep dir name>``.
        run_name: the new MLflow run's name; None: the job's overrides (``hydra.*`` left out), or the work
            dir's name when there are none.
        tags: extra tags set on a new run (after ``work_dir``, which one of them may replace); None: none.
        artifacts: at the end, store ``curves.svg`` and ``.hydra/config.yaml`` as the run's artifacts.

    Raises:
        ConfigError: the SQLite store holds the scratch tables an interrupted schema migration left
            (a half-made store).
    """

    name = "mlflow"
    ID_FILE = "run_id"

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "expkit",
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        artifacts: bool = True,
    ) -> None:
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.tags = dict(tags or {})
        self.artifacts = artifacts
        self.client: Any = None
        self.run_id: str | None = None
        # a half-made store fails the run here, before training (a resume's saved store is looked at in open)
        db = sqlite_file(self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri())
        if db is not None:
            check_store(db)

    def open(self, runner: Runner) -> None:
        id_file = runner.work_dir / "mlflow" / self.ID_FILE
        uri_file = id_file.with_name("tracking_uri")  # the store the run lives in, read again by a resume
        resuming = bool(runner.resume_from) and id_file.is_file()
        saved = uri_file.read_text().strip() if resuming and uri_file.is_file() else None
        if saved is not None and (db := sqlite_file(saved)) is not None and not db.is_file():
            # a record is data: a store it names must be the one the run made, never a new file elsewhere
            log.warning(
                "Ignoring %r recorded in %s: no such MLflow store; logging to the default store", saved, uri_file
            )
            saved = None
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or saved or default_tracking_uri()
        sweep = runner.run_info.get("sweep_dir_name")
        experiment_id = self._connect(uri, f"{self.experiment}/{sweep}" if sweep else self.experiment)
        if resuming:  # continue this run's own MLflow run
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        overrides = [o for o in runner.run_info.get("overrides", []) if not o.startswith("hydra.")]
        tags = {"work_dir": str(runner.work_dir.resolve()), **self.tags}
        if sweep:
            tags["sweep"] = sweep
        if runner.run_info.get("sweep_dir"):  # a job of a sweep: a child of the sweep's parent run
            parent = sweep_parent(self.client, experiment_id, Path(runner.run_info["sweep_dir"]))
            tags[PARENT_RUN_TAG] = parent
        run = self.client.create_run(
            experiment_id, run_name=self.run_name or " ".join(overrides) or runner.work_dir.name, tags=tags
        )
        self.run_id = run.info.run_id
        write_text_atomic(id_file, self.run_id + "\n")
        write_text_atomic(uri_file, uri + "\n")
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flatten(runner.config or {}).items()]
        for start in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + BATCH])

    def _connect(self, uri: str, experiment: str) -> str:
        """Make `uri`'s SQLite store if needed (whole or not at all), open a client on it as
        ``self.client``, and return the id of `experiment` (made if missing)."""
        from mlflow.tracking import MlflowClient

        db = sqlite_file(uri)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
            check_store(db)
            make_store(db)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            return self._experiment(experiment, uri)
        except Exception as exc:
            if db is not None:
                self._diagnose(db, exc)
            raise

    def record_sweep(self, sweep_dir: Path) -> str:
        """At the end of a sweep (its launching process): the sweep's parent run gets the best
        job's metrics, best.json's value, the summary files, and the status of the whole.

        Args:
            sweep_dir: the sweep dir, with summary.md, summary.csv, best.json as the summary wrote them.

        Returns:
            The parent run's id.
        """
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
        experiment_id = self._connect(uri, f"{self.experiment}/{sweep_dir.name}")
        parent = sweep_parent(self.client, experiment_id, sweep_dir)
        log_sweep_summary(self.client, parent, sweep_dir, artifacts=self.artifacts)
        return parent

    @staticmethod
    def _diagnose(db: Path, exc: Exception) -> None:
        """MLflow failed to open `db`: if it holds alembic's scratch tables, or holds nothing and its
        schema is not this MLflow's, say that it is half made and how to repair it (a ConfigError,
        which the LoggerHook shows as its warning: open cannot fail the run)."""
        try:
            from alembic.script import ScriptDirectory
            from mlflow.store import db_migrations

            state = inspect_store(db)
            heads = ScriptDirectory(str(Path(db_migrations.__file__).parent)).get_heads()
        except Exception:  # no diagnosis: MLflow's own error stands
            return
        # with runs and no scratch table, MLflow's own error stands (an older store: `mlflow db upgrade`)
        if state is not None and (state.scratch or (state.content == 0 and state.revision not in heads)):
            cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            raise ConfigError(f"logger.mlflow: {half_made_message(db, state, cause)}") from exc

    def _experiment(self, name: str, uri: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = None
        if uri == default_tracking_uri():  # artifacts beside the store, not in ./mlruns
            location = (Path.cwd() / "outputs" / "mlartifacts").resolve().as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except Exception:
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log(self, record: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in scalars(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def log_image(self, tag: str, image: Any, step: int) -> None:
        self.client.log_image(self.run_id, image, key=tag.replace("/", "_"), step=step)

    def log_table(self, tag: str, rows: list[list[Any]], step: int) -> None:
        from expkit.loggers.backends import TABLE_COLUMNS

        columns = {name: [row[i] for row in rows] for i, name in enumerate(TABLE_COLUMNS)}
        self.client.log_table(self.run_id, data=columns, artifact_file=f"{tag}/step_{step}.json")

    def finish(self, runner: Runner, result: dict[str, Any]) -> None:
        import math

        from mlflow.entities import Metric

        if self.run_id is None:
            return
        now = int(time.time() * 1000)
        values = {f"best/{k}": v["value"] for k, v in runner.best_metrics.items()}
        values.update({f"final/{k}": v for k, v in result.get("final_metrics", {}).items()})
        metrics = [
            Metric(k, float(v), now, runner.iter)
            for k, v in values.items()
            if isinstance(v, (int, float)) and math.isfinite(v)
        ]
        best = next(iter(runner.best_checkpoints.values()), None)
        tags = {"status": str(result.get("status")), **({"best_checkpoint": str(best)} if best else {})}
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])
        if self.artifacts:
            for path in (runner.work_dir / "curves.svg", runner.work_dir / ".hydra" / "config.yaml"):
                if path.is_file():
                    self.client.log_artifact(self.run_id, str(path))
        status = {"completed": "FINISHED", "stopped": "KILLED", "pruned": "KILLED"}.get(
            str(result.get("status")), "FAILED"
        )
        self.client.set_terminated(self.run_id, status=status)
        self.run_id = None

    def close(self) -> None:
        if self.run_id is not None:  # finish() did not run: the run failed before it
            self.client.set_terminated(self.run_id, status="FAILED")
            self.run_id = None
