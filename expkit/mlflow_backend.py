"""``logger=[mlflow]``: one MLflow run per expkit run, through ``mlflow.tracking.MlflowClient``.

The store is ``logger.mlflow.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else a local
SQLite store, ``outputs/mlflow.db`` under the directory the command runs in (MLflow 3 no longer
takes the old file store), with artifacts in ``outputs/mlartifacts/``. The run gets the
resolved config as params (``optim.lr``, ...), every metrics.jsonl record on the same step
axis, the run's status when it ends, its best and final metrics, ``curves.svg`` and the
config as artifacts, and the best checkpoint's path and the work dir as tags. The jobs of a
sweep share one experiment, ``<experiment>/<sweep dir name>``; single runs go to
``<experiment>``. A resumed run (``resume=true``) continues its MLflow run: the id is kept in
``<work dir>/mlflow/run_id``. MLflow cannot delete logged points, so after a resume the steps
an interrupted attempt logged past its checkpoint appear twice (with exact resume, with the
same values). Browse with ``mlflow ui --backend-store-uri sqlite:///outputs/mlflow.db``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expkit.atomic import write_text_atomic
from expkit.backends import Backend, scalars

if TYPE_CHECKING:
    from expkit.runner import Runner

PARAM_VALUE_LIMIT = 6000  # MLflow's longest param value
BATCH = 100  # params per log_batch request (MLflow's limit)


def default_tracking_uri() -> str:
    return f"sqlite:///{(Path.cwd() / 'outputs' / 'mlflow.db').resolve()}"


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": "0.1"}``: the config as MLflow params."""
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
    ``tags``: extra tags; ``artifacts``: log curves.svg and the config."""

    name = "mlflow"
    ID_FILE = "run_id"

    def __init__(self, tracking_uri: str | None = None, experiment: str = "expkit", run_name: str | None = None,
                 tags: Mapping[str, str] | None = None, artifacts: bool = True) -> None:  # fmt: skip
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.tags = dict(tags or {})
        self.artifacts = artifacts
        self.client: Any = None
        self.run_id: str | None = None

    def open(self, runner: Runner) -> None:
        import os

        from mlflow.tracking import MlflowClient

        id_file = runner.work_dir / "mlflow" / self.ID_FILE
        uri_file = id_file.with_name("tracking_uri")  # the store the run lives in, read again by a resume
        resuming = bool(runner.resume_from) and id_file.is_file()
        saved = uri_file.read_text().strip() if resuming and uri_file.is_file() else None
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or saved or default_tracking_uri()
        if uri.startswith("sqlite:///"):
            Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        sweep = runner.run_info.get("sweep_dir_name")
        experiment_id = self._experiment(f"{self.experiment}/{sweep}" if sweep else self.experiment, uri)
        if resuming:  # continue this run's own MLflow run
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        overrides = [o for o in runner.run_info.get("overrides", []) if not o.startswith("hydra.")]
        tags = {"work_dir": str(runner.work_dir.resolve()), **self.tags}
        if sweep:
            tags["sweep"] = sweep
        run = self.client.create_run(experiment_id, run_name=self.run_name or " ".join(overrides) or runner.work_dir.name,
                                     tags=tags)  # fmt: skip
        self.run_id = run.info.run_id
        write_text_atomic(id_file, self.run_id + "\n")
        write_text_atomic(uri_file, uri + "\n")
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flatten(runner.config or {}).items()]
        for start in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + BATCH])

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
        from expkit.hooks.log_predictions import TABLE_COLUMNS

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
        metrics = [Metric(k, float(v), now, runner.iter) for k, v in values.items()
                   if isinstance(v, (int, float)) and math.isfinite(v)]  # fmt: skip
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
