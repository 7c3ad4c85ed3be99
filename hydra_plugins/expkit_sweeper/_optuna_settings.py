"""The Optuna sweeper's settings, checked before anything starts, and its errors: a bad setting
is one ``Error:`` line and exit 2; the study's direction (or directions) from the settings or
from the run's own rule of which direction is better.

(A module whose name starts with ``_`` is not one Hydra's plugin scan runs again: its classes
stay the ones the sweeper's other modules imported, so ``except SearchConfigError`` holds.)
"""

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

from expkit.core.errors import TaskExit
from expkit.sweeps.search import shown_url
from hydra_plugins.expkit_sweeper.expkit_sweeper import SweepConfigError

__all__ = ["SearchConfigError", "SearchSettings", "one_line", "storage_error"]


log = logging.getLogger("expkit")


class SearchConfigError(SweepConfigError):
    """Bad sweeper settings: Hydra prints the message alone (no traceback) and expkit exits 2."""


@contextlib.contextmanager
def one_line() -> Iterator[None]:
    """A SearchConfigError inside leaves as one ``Error:`` line and exit 2 (Hydra would add a line
    about HYDRA_FULL_ERROR, and wrap one raised while it builds the sweeper in three more).

    Yields:
        Nothing: the block runs inside.
    """
    try:
        yield
    except SearchConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise TaskExit(2) from None


class SearchSettings:
    """The settings part of ``OptunaSweeper``: its checks, and the study's directions."""

    config: DictConfig | None
    direction: str | None
    n_trials: int
    n_jobs: int
    seeds_per_trial: int
    storage_wait_s: float
    objectives: list[str] | None
    directions: list[str] | None
    pruner_cfg: Any

    def _check_settings(self, config: DictConfig) -> None:
        """The settings, before anything starts (see the class's Raises)."""
        if self.direction not in (None, "maximize", "minimize"):
            raise SearchConfigError(
                f"hydra.sweeper.direction={self.direction}: use maximize, minimize, or null (from monitor)"
            )
        numbers = (("n_trials", self.n_trials), ("n_jobs", self.n_jobs), ("seeds_per_trial", self.seeds_per_trial))
        for key, number in numbers:
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise SearchConfigError(f"hydra.sweeper.{key}={number}: give a whole number >= 1")
        wait = self.storage_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
            raise SearchConfigError(f"hydra.sweeper.storage_wait_s={wait}: give seconds, a number >= 0")
        self.storage_wait_s = float(wait)
        if self.objectives is not None:
            names = self.objectives
            if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
                raise SearchConfigError(
                    f"hydra.sweeper.objectives={names}: give distinct keys, e.g. hydra.sweeper.objectives=[val/acc,model_params]"
                )
            if self.directions is not None and len(self.directions) != len(names):
                raise SearchConfigError(
                    f"hydra.sweeper.directions={self.directions}: give one per objective ({len(names)}: {', '.join(names)})"
                )
            if len(names) > 1 and self.pruner_cfg is not None:
                raise SearchConfigError(
                    "hydra.sweeper.pruner: Optuna cannot prune a study of several objectives (Trial.report takes "
                    "one value); set hydra.sweeper.pruner=null"
                )
        for direction in self.directions or []:
            if direction not in ("maximize", "minimize"):
                raise SearchConfigError(f"hydra.sweeper.directions: {direction}: use maximize or minimize")
        seed_keys = config.get("seed_keys")
        if self.seeds_per_trial > 1 and seed_keys is not None and len(seed_keys) == 0:
            raise SearchConfigError(
                f"hydra.sweeper.seeds_per_trial={self.seeds_per_trial} varies the first of seed_keys, but "
                "seed_keys=[] names none: give seed_keys=[trainer.seed] (or seeds_per_trial=1)"
            )

    def _study_directions(self) -> list[str]:
        """One direction per objective: ``directions``, else each metric's own rule (see
        ``_direction``); a key without a rule is refused, naming it."""
        if self.objectives is None:
            return [self._direction()]
        if self.directions is not None:
            return list(self.directions)
        from expkit.config.build import build_metrics
        from expkit.metrics import Directions

        assert self.config is not None
        try:
            rules = Directions(build_metrics(self.config.get("metrics")))
        except Exception:  # (the metrics cannot be built here: the names' rules still hold)
            rules = Directions({})
        found = {key: rules.rule(key) for key in self.objectives}
        unknown = [key for key, rule in found.items() if rule is None]
        if unknown:
            example = ",".join(
                "maximize" if rule == "greater" else "minimize" if rule == "less" else "<maximize|minimize>"
                for rule in found.values()
            )
            raise SearchConfigError(
                f"hydra.sweeper.objectives: {', '.join(unknown)} {'has' if len(unknown) == 1 else 'have'} no rule of "
                f"which direction is better; give one direction per objective: hydra.sweeper.directions=[{example}]"
            )
        return ["maximize" if rule == "greater" else "minimize" for rule in found.values()]

    def _direction(self) -> str:
        """`direction`, else the run's own rule for `monitor`: its metric's setting or the metric
        object's ``higher_is_better`` (torchmetrics' MeanSquaredError: less), then the name."""
        if self.direction is not None:
            return self.direction
        from expkit.config.build import build_metrics
        from expkit.metrics import Directions, monitor_of

        assert self.config is not None
        monitor, rule = monitor_of(OmegaConf.to_container(self.config, resolve=False))  # type: ignore[arg-type]
        try:
            rule = Directions(build_metrics(self.config.get("metrics"))).rule(monitor) or rule
        except Exception as exc:
            log.warning("Optuna: could not build the metrics to read %s's direction (%s); using %s", monitor, exc, rule)
        return "maximize" if rule == "greater" else "minimize"


def storage_error(storage: str, exc: Exception) -> str:
    """What went wrong opening `storage`, and how to check it.

    Args:
        storage: the storage setting, as the sweep opens it.
        exc: what opening it raised.

    Returns:
        One line: the setting (its password hidden), the error, and what to check.
    """
    cause = (str(exc).splitlines() or [""])[0]  # SQLAlchemy appends SQL and a link
    scheme = storage.partition("://")[0].partition("+")[0] if "://" in storage else ""
    if isinstance(exc, ModuleNotFoundError) and scheme in ("postgresql", "postgres"):
        check = "install the driver: pip install -e '.[postgres]' (psycopg)"
    elif scheme in ("postgresql", "postgres"):
        check = (
            f"check that the server runs and takes connections from here: pg_isready -d '{shown_url(storage)}' "
            "(or psql with the same URL); the form is postgresql://user:password@host:5432/database"
        )
    elif scheme == "sqlite":
        check = "check that the file's dir exists and is writable (sqlite:///relative/path.db, sqlite:////abs/path.db)"
    elif scheme:
        check = "check the URL (SQLAlchemy's form: dialect+driver://user:password@host:port/database)"
    else:
        check = "give a journal file (a path ending in .journal) in a writable dir, or a database URL"
    return f"hydra.sweeper.storage={shown_url(storage)}: {type(exc).__name__}: {cause}. {check}"
