"""Logging backends the LoggerHook writes to, besides metrics.jsonl and the terminal.

Config group ``logger`` (multi-select): ``python -m expkit.train logger=[tensorboard,wandb]``.
Each backend imports its library only when it opens (``import wandb`` alone costs about a
second). A backend that fails gets one warning and is dropped for the rest of the run;
metrics.jsonl and checkpoints are not affected.
"""

from __future__ import annotations

import logging
import math
import netrc
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expkit.core.atomic import write_text_atomic
from expkit.loggers.wandb_files import wait_for_wandb_run

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = [
    "AXIS_KEYS",
    "TABLE_COLUMNS",
    "Backend",
    "TensorBoardBackend",
    "WandbBackend",
    "hparams_of",
    "markdown_table",
    "scalars",
]


log = logging.getLogger("expkit")

AXIS_KEYS = ("step", "epoch", "iter")


TABLE_COLUMNS = ["sample", "target", "prediction"]  # a predictions table's (log_table's rows: [i, target, prediction])


def markdown_table(rows: list[list[Any]]) -> str:
    """A predictions table (``log_table``'s rows) as Markdown.

    Args:
        rows: the rows, each [sample index, target, prediction]; cells are written with ``str``, unescaped.

    Returns:
        The table with a header row of ``TABLE_COLUMNS``, ending with a newline.
    """
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|---|---|---|"]
    lines += [f"| {i} | {t} | {p} |" for i, t, p in rows]
    return "\n".join(lines) + "\n"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The plottable values of a metrics.jsonl record (not the axis fields).

    Args:
        record: a metrics.jsonl record.

    Returns:
        Its int and float values (bools left out) as floats, by key, without ``step``, ``epoch`` and ``iter``.
    """
    return {
        k: float(v)
        for k, v in record.items()
        if k not in AXIS_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


# the keys that make one run's training differ from another's, read from the resolved config: runs
# made apart compare on them in TensorBoard's HParams tab even when their command lines say nothing
# (a group's node gives its class name: model -> "MLP", optim -> "SGD")
MAIN_HPARAMS = (
    "model",
    "optim",
    "optim.lr",
    "optim.weight_decay",
    "optim.momentum",
    "sched",
    "data",
    "data.batch_size",
    "trainer.max_epochs",
    "trainer.max_iters",
    "trainer.seed",
    "trainer.precision",
    "trainer.accumulate_grad_batches",
)
# overrides that say where a run's numbers go or how it runs, not what it trains
NOT_HPARAMS = ("logger", "hydra", "resume", "load_from", "show_hooks")


def _hparam_value(node: Any) -> Any:
    """A config value as TensorBoard's HParams take it (a bool, number or string), None for none."""
    if isinstance(node, dict):
        target = node.get("_target_")
        return target.rpartition(".")[2] if isinstance(target, str) else None
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    return str(node)


def hparams_of(runner: Runner) -> dict[str, Any]:
    """The run's hyperparameters: the main keys' resolved values (``MAIN_HPARAMS``), then the
    overrides (what distinguishes the jobs of a sweep) over them.

    Args:
        runner: the runner; its ``config`` (the resolved config, when the run has one) and
            ``run_info["overrides"]`` are read.

    Returns:
        Each value by key: a group's class name, a number or a string; the overrides' values (a leading
        ``+`` or ``~`` dropped) as an int or float when they parse as one. Keys without a value, and
        overrides of ``logger``, ``hydra.*`` and the like (``NOT_HPARAMS``), are left out.
    """
    params: dict[str, Any] = {}
    config = runner.config if isinstance(runner.config, dict) else {}
    for key in MAIN_HPARAMS:
        node: Any = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        value = _hparam_value(node)
        if value is not None:
            params[key] = value
    for override in runner.run_info.get("overrides", []):
        key, _, value = override.lstrip("+~").partition("=")
        if key.split(".")[0] in NOT_HPARAMS or not value:
            continue
        try:
            params[key] = float(value) if any(c in value for c in ".e") else int(value)
        except ValueError:
            params[key] = value
    return params


class Backend:
    """open at the start, log each record (one step axis for train, val and test), finish
    with the run's result, close (safe twice)."""

    name = "backend"

    def open(self, runner: Runner) -> None: ...

    def log(self, record: dict[str, Any], step: int) -> None: ...

    def resume(self, step: int) -> None:
        """The run resumes at `step`: what an earlier attempt logged at `step` and later is void
        (the logger then logs the records of `step` that the checkpoint covers again)."""

    def flush(self) -> None:
        """Put everything logged so far on disk (called before each checkpoint is written)."""

    def log_image(self, tag: str, image: Any, step: int) -> None:
        """An RGB uint8 array (H, W, 3) at `step` (hooks=[log_predictions]); default: not shown."""

    def log_table(self, tag: str, rows: list[list[Any]], step: int) -> None:
        """Rows of (sample, target, prediction) at `step` (hooks=[log_predictions]); default: not shown."""

    def finish(self, runner: Runner, result: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardBackend(Backend):
    """``<work dir>/<log_dir>/``: scalars under the metrics.jsonl names and steps, the resolved
    config as text, and the hyperparameters (the main keys' resolved values and the run's
    overrides: ``hparams_of``) with the best and final metrics in the HPARAMS tab. ``tensorboard --logdir outputs/`` shows every run and job.

    Args:
        log_dir: the event files' directory, relative to the work dir.
        flush_secs: SummaryWriter's ``flush_secs``: the most seconds events wait in memory before they
            are written to disk (every checkpoint and the end of the run flush them too).
    """

    name = "tensorboard"

    def __init__(self, log_dir: str = "tb", flush_secs: int = 10) -> None:
        self.log_dir = log_dir
        self.flush_secs = flush_secs
        self.writer: Any = None

    def open(self, runner: Runner) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(runner.work_dir / self.log_dir), flush_secs=self.flush_secs)
        if runner.config is not None:
            import yaml

            text = yaml.safe_dump(runner.config, sort_keys=False)
            self.writer.add_text("config", "```yaml\n" + text + "\n```", 0)

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)

    def log_image(self, tag: str, image: Any, step: int) -> None:
        self.writer.add_image(tag, image, step, dataformats="HWC")

    def log_table(self, tag: str, rows: list[list[Any]], step: int) -> None:
        self.writer.add_text(tag, markdown_table(rows), step)

    def resume(self, step: int) -> None:
        """What SummaryWriter(purge_step=step) writes: readers drop the events of earlier files
        from that step on."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self.writer.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))

    def finish(self, runner: Runner, result: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        metrics = {f"best/{k}": v["value"] for k, v in runner.best_metrics.items()}
        metrics.update({f"final/{k}": v for k, v in result.get("final_metrics", {}).items()})
        metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        params = hparams_of(runner) or {"run": runner.work_dir.name}
        experiment, start, end = hparams(params, metrics)
        for summary in (experiment, start, end):
            self.writer.file_writer.add_summary(summary)
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, runner.iter)
        self.writer.flush()

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbBackend(Backend):
    """A wandb run in ``<work dir>/wandb/``: offline unless you are logged in (``wandb login``
    or WANDB_API_KEY) or set ``mode`` / WANDB_MODE. Name: the job's overrides; group: the
    sweep, so a sweep's jobs sit together; config: the resolved config; summary: the best and
    final metrics. The run is always finished, also when the job fails, so the next job of a
    sweep gets a run of its own. Offline runs upload later with ``wandb sync <dir>``.

    A resumed run (``resume=true``) continues the same wandb run: the id is kept in
    ``<work dir>/wandb/run_id`` and the run opens when the resume step is known. Online,
    ``rewind=true`` rewinds the run to that step (wandb's ``resume_from``, where the server
    offers it); otherwise it resumes with ``resume="allow"`` and wandb keeps the first value
    it got per step, which exact resume makes the same value. Offline, each attempt writes its
    own ``offline-run-*`` dir of that id; ``wandb_history(work_dir)`` reads them as one run.

    Args:
        project: the wandb project.
        entity: the team or user the run belongs to; None: wandb's default.
        mode: ``online``, ``offline`` or ``disabled``; None: WANDB_MODE if set, else online when logged
            in and offline otherwise.
        name: the run's display name; None: the job's overrides (``hydra.*`` left out), or the work
            dir's name when there are none.
        group: the run's group; None: the sweep dir's name (none outside a sweep).
        tags: the run's tags; empty: none.
        job_type: wandb's job type.
        flush_timeout: the seconds to wait after ``finish()`` for wandb to write the run's log out
            (a warning when it has not); at least 0.
        rewind: when resuming online, rewind the wandb run to the checkpoint's step (``resume_from``)
            instead of resuming it with ``resume="allow"``.

    Raises:
        ValueError: `mode` is not online, offline, disabled or None, or `flush_timeout` is not a number
            >= 0.
    """

    ID_FILE = "run_id"

    name = "wandb"

    def __init__(
        self,
        project: str = "expkit",
        entity: str | None = None,
        mode: str | None = None,
        name: str | None = None,
        group: str | None = None,
        tags: Sequence[str] = (),
        job_type: str = "train",
        flush_timeout: float = 30.0,
        rewind: bool = False,
    ) -> None:
        if mode not in (None, "online", "offline", "disabled"):
            raise ValueError(f"mode must be online, offline, disabled or null, got {mode!r}")
        self.project, self.entity, self.mode = project, entity, mode
        self.run_name, self.group, self.tags, self.job_type = name, group, list(tags), job_type
        if isinstance(flush_timeout, bool) or not isinstance(flush_timeout, (int, float)) or not flush_timeout >= 0:
            raise ValueError(f"logger.wandb.flush_timeout must be a number of seconds >= 0, got {flush_timeout!r}")
        self.flush_timeout = float(flush_timeout)
        self.rewind = bool(rewind)
        self.run: Any = None
        self._runner: Runner | None = None
        self._resume_step = 0

    def open(self, runner: Runner) -> None:
        """The wandb run starts at the first record, once a resume has said its step."""
        import wandb  # noqa: F401 - a missing wandb fails here, at start-up

        self._runner, self._resume_step = runner, 0

    def resume(self, step: int) -> None:
        self._resume_step = step

    def _started(self) -> Any:
        if self.run is None and self._runner is not None:
            runner, self._runner = self._runner, None  # a start that fails is not tried again by close()
            self._start(runner)
            self._runner = runner
        return self.run

    def _start(self, runner: Runner) -> None:
        import wandb

        mode = self.mode or os.environ.get("WANDB_MODE") or ("online" if _wandb_logged_in() else "offline")
        overrides = [o for o in runner.run_info.get("overrides", []) if not o.startswith("hydra.")]
        id_file = runner.work_dir / "wandb" / self.ID_FILE
        run_id = id_file.read_text().strip() if self._resume_step > 0 and id_file.is_file() else None
        resume: dict[str, Any] = {}
        if run_id is None:  # a new run (also a run that starts again from step 0)
            run_id = secrets.token_hex(4)  # wandb's ids: 8 lowercase letters and digits
            write_text_atomic(id_file, run_id + "\n")
        elif self.rewind and mode == "online":
            resume = {"resume_from": f"{run_id}?_step={self._resume_step}"}
        else:
            resume = {"id": run_id, "resume": "allow"}
        self.run = wandb.init(
            **(resume or {"id": run_id}),
            project=self.project,
            entity=self.entity,
            name=self.run_name or (" ".join(overrides) or runner.work_dir.name),
            group=self.group or runner.run_info.get("sweep_dir_name"),
            tags=self.tags or None,
            job_type=self.job_type,
            config=runner.config or {},
            dir=str(runner.work_dir),
            mode=mode,
            reinit="finish_previous",
        )

    def log(self, record: dict[str, Any], step: int) -> None:
        self._started().log(scalars(record), step=step)

    def log_image(self, tag: str, image: Any, step: int) -> None:
        import wandb

        self._started().log({tag: wandb.Image(image)}, step=step)

    def log_table(self, tag: str, rows: list[list[Any]], step: int) -> None:
        import wandb

        self._started().log({tag: wandb.Table(columns=TABLE_COLUMNS, data=rows)}, step=step)

    def _never_resumed(self) -> bool:
        """A resume that failed before its checkpoint loaded: no run of its own, so that the id
        the next attempt continues stays the original run's."""
        runner = self._runner
        return (
            self.run is None
            and runner is not None
            and self._resume_step == 0
            and bool(runner.resume_from)
            and (runner.work_dir / "wandb" / self.ID_FILE).is_file()
        )

    def finish(self, runner: Runner, result: dict[str, Any]) -> None:
        if self._never_resumed():
            self._runner = None
            return
        self._started()
        summary = {f"best/{k}": v["value"] for k, v in runner.best_metrics.items()}
        summary.update({f"final/{k}": v for k, v in result.get("final_metrics", {}).items()})
        summary["status"] = result.get("status")
        self.run.summary.update(summary)
        self._finish_run(exit_code=0 if result.get("status") in ("completed", "stopped", "pruned") else 1)

    def close(self) -> None:
        # finish() did not run (a failure before it)
        if self._runner is not None and not self._never_resumed() and self._started() is not None:
            self._finish_run(exit_code=1)
        self._runner = None

    def _finish_run(self, exit_code: int) -> None:
        """Finish the run and wait until its log is on disk: wandb's service writes it out
        after ``finish()`` returns, and the work dir should be complete when the job ends
        (``wandb sync`` right away, the next job of a sweep, a copy off the node)."""
        sync_file = getattr(getattr(self.run, "settings", None), "sync_file", None)  # wandb >= 0.16
        self.run.finish(exit_code=exit_code)
        self.run = self._runner = None
        path = Path(sync_file) if sync_file else None
        if path is not None and path.is_file() and not wait_for_wandb_run(path, self.flush_timeout):
            log.warning(
                "wandb: %s still lacks the run's exit record %.0f s after finish(); it may be "
                "incomplete (logger.wandb.flush_timeout sets the wait)",
                path,
                self.flush_timeout,
            )
