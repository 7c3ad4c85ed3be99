"""Evaluate a checkpoint: ``python -m expkit.eval checkpoint=<.pth file or run dir>``.

The model, data and metrics come from the config stored in the checkpoint; any other
``key=value`` overrides it (``data.batch_size=256``, ``trainer.device=cpu``). Options:

    checkpoint=PATH     a .pth file, or a run dir (its best checkpoint, or last with which=last)
    which=best|last     for a run dir
    split=test|val|both which loaders to evaluate (default test)
    ema=true            evaluate the EMA weights (ema_state_dict) instead of the raw ones
    trusted_targets=[my_project]  packages (or objects) whose _target_ the stored config may name
    --config-dir DIR    your config dir: the targets its YAML files name are trusted too
    logger=[tensorboard,wandb,mlflow]  the same backends as training
    work_dir=DIR        default outputs/evals/<date>_<time>/

The stored config is data from whoever wrote the checkpoint: every ``_target_`` in it must be
trusted before anything is built (expkit's own, torch.nn, torch.optim, torchvision.models,
torchmetrics, and what you trust; see ``expkit.core.trust``). Results go to the work dir (metrics.jsonl, result.json) and the terminal. In Python,
``load_model(path)`` returns the trained model, weights loaded, in eval mode.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from expkit.config.cli import command_main, command_words, config_dirs_of
from expkit.config.restore import load_model, resolve_checkpoint, restore, stored_config, stored_overrides
from expkit.core import hydra_compat
from expkit.core.errors import ConfigError, ExpkitError, TaskExit, task_exits
from expkit.core.trust import TrustPolicy
from expkit.workdir.results import write_failure

__all__ = ["evaluate", "load_model", "main", "resolve_checkpoint", "restore", "run", "stored_config"]

log = logging.getLogger("expkit")
OPTIONS = ("checkpoint", "which", "split", "ema", "logger", "trusted_targets", "overrides")  # eval.yaml's keys


def evaluate(cfg: DictConfig, work_dir: Path, config_dirs: Sequence[str | Path] = ()) -> dict[str, Any]:
    """Evaluate a checkpoint on the test or validation split, as ``python -m expkit.eval`` does.

    Args:
        cfg: eval.yaml's settings: ``checkpoint`` (a ``.pth`` file, a ``.dcp`` dir or a run dir),
            ``split`` (``test``, ``val`` or ``both``), ``ema``, ``which`` and the rest.
        work_dir: where result.json, metrics.jsonl and the loggers' files go.
        config_dirs: the ``--config-dir`` folders whose ``_target_``s are trusted beside
            expkit's own ([What is trusted](../evaluation.md#what-is-trusted)).

    Returns:
        result.json's content: the metrics of each split, the checkpoint and its epoch.

    Raises:
        ConfigError: bad input (no checkpoint, an unknown split, no test set); the command
            exits 2 with its message.
    """
    from expkit import Runner, default_hooks
    from expkit.config.build import build_loggers, build_metrics, build_trainer_settings, instantiate_node

    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise ConfigError("give checkpoint=<.pth file, .dcp dir or run dir>")
    split = str(cfg.split)
    if split not in ("test", "val", "both"):
        raise ConfigError(f"split={split}: use split=test, split=val or split=both")
    overrides = stored_overrides(cfg)
    trust = TrustPolicy([str(t) for t in cfg.trusted_targets or []], config_dirs)
    path, stored, (_, val_loader, test_loader), model, _ = restore(
        cfg.checkpoint, str(cfg.which), bool(cfg.ema), overrides, trust
    )
    settings = build_trainer_settings(stored)
    if split in ("test", "both") and test_loader is None:
        raise ConfigError("split=test but the data has no test set (data.test_fraction=0?); use split=val")
    monitor = str(stored.get("monitor") or "val/acc")  # ranks a sweep of evaluations, on the split evaluated
    if split == "test":
        monitor = "test/" + monitor.partition("/")[2]
    command = shlex.join([*command_words("expkit.eval"), *sys.argv[1:]])
    runner = Runner(
        model=model,
        optimizer=None,
        train_loader=None,
        val_loader=val_loader if split in ("val", "both") else None,
        test_loader=test_loader if split in ("test", "both") else None,
        criterion=instantiate_node(stored.criterion, "criterion"),
        metrics=build_metrics(stored.metrics),
        monitor=monitor,
        settings=settings,
        default_hooks=default_hooks(timer=None, sampler_seed=None, param_scheduler=None, checkpoint=None),
        loggers=build_loggers(cfg.get("logger"), "logger"),
        work_dir=work_dir,
        config=OmegaConf.to_container(stored, resolve=True),  # type: ignore[arg-type]
        run_info={
            "checkpoint": str(path.resolve()),
            "ema": bool(cfg.ema),
            "split": split,
            "overrides": overrides,
            "evaluation": True,
            "command": command,
        },
    )
    runner.test_checkpoint = str(path.resolve())  # (the test's line names these weights, not "epoch 0")
    from expkit.workdir.ownership import WorkDirLock

    with WorkDirLock(work_dir, command):  # one writer per work dir (exit 2 when taken)
        return runner.run()


@hydra_compat.main(config_path="conf", config_name="eval")
def run(cfg: DictConfig) -> float | None:
    """Hydra's task function: evaluates one checkpoint; returns the monitored value (sweeps).

    Args:
        cfg: the composed ``eval.yaml`` config; Hydra composes it from the command line and
            passes it, so the function is called with no arguments (as ``main`` does).

    Returns:
        The value of the stored config's ``monitor`` on the split evaluated (for ``split=test``,
            its ``test/`` key); None when it is not a number, or when the evaluation failed in a sweep
            (its result.json then says ``failed``).

    Raises:
        SystemExit: outside a sweep, with status 2 for bad input and 1 for another expkit error.
    """
    from hydra.core.hydra_config import HydraConfig

    work_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        with task_exits():
            result = evaluate(cfg, work_dir, config_dirs_of(sys.argv[1:])[1:])
    except ExpkitError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # one bad checkpoint of several: recorded, the others go on
            write_failure(work_dir, str(exc), evaluation=True)
            return None
        raise TaskExit(2 if isinstance(exc, ConfigError) else 1) from None
    log.info("Evaluated %s: %s", result["checkpoint"], json.dumps(result["final_metrics"]))
    log.info("Work dir: %s", result["work_dir"])
    value = result["final_metrics"].get(result.get("monitor") or "")
    return float(value) if isinstance(value, (int, float)) else None


def main() -> None:
    """``python -m expkit.eval``: run the Hydra app (``run``) with the command's own options."""
    command_main(run, OPTIONS)  # (checkpoint=... key=value: the stored config's overrides)


if __name__ == "__main__":
    main()
