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
torchmetrics, and what you trust; see ``expkit.trust``). Results go to the work dir (metrics.jsonl, result.json) and the terminal. In Python,
``load_model(path)`` returns the trained model, weights loaded, in eval mode.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from expkit import checkpoint_io, confine, hydra_compat, versions
from expkit.cli import config_dirs_of, flags_first, hydra_quoted
from expkit.errors import ConfigError, ExpkitError
from expkit.results import write_failure
from expkit.trust import TrustPolicy

log = logging.getLogger("expkit")
OPTIONS = ("checkpoint", "which", "split", "ema", "logger", "trusted_targets", "overrides")  # eval.yaml's keys


def resolve_checkpoint(source: str | Path, which: str = "best") -> Path:
    """A checkpoint (a .pth file or a sharded .dcp dir) as given, or a run dir's best (or last) one;
    a URL (``s3://...``) to either, downloaded once into a local cache (``expkit.remote.fetch``)."""
    from expkit import remote

    if remote.is_url(source):
        return remote.fetch(str(source), which)
    path = remote.local_path(source)
    if checkpoint_io.is_checkpoint(path):
        return path
    if not path.is_dir():
        raise ConfigError(f"checkpoint={source}: no such file or run dir")
    if which not in ("best", "last"):
        raise ConfigError(f"which={which}: use which=best or which=last")
    result_file = path / "result.json"
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if which == "best" and result.get("best_checkpoint"):
        best = confine.confined(path / "checkpoints", result["best_checkpoint"], result_file, "checkpoint")
        if best is not None and checkpoint_io.is_checkpoint(best):  # never another run's file
            return best
    if which == "best":
        best = sorted(
            p
            for p in (path / "checkpoints").glob("best_*")
            if p.suffix in (".pth", ".dcp") and confine.inside(path / "checkpoints", p)
        )
        if best:
            return best[0]
        log.warning("%s has no best checkpoint; using its last one", path)
    last = checkpoint_io.find_last_checkpoint(path)
    if last is None:
        raise ConfigError(f"checkpoint={source}: the run dir has no checkpoint (checkpoints/last_checkpoint)")
    return last


def stored_config(
    checkpoint: dict[str, Any], source: Path, overrides: Sequence[str] = (), trust: TrustPolicy | None = None
) -> DictConfig:
    """The config saved in the checkpoint, with `key=value` overrides (unknown keys refused),
    resolved, and refused unless every ``_target_`` in it is trusted (`trust`, default: expkit's)."""
    stored = checkpoint.get("config")
    if not stored:
        raise ConfigError(f"{source} carries no config; it was not written by a Hydra run of expkit")
    if not isinstance(stored, dict):
        raise ConfigError(f"{source}: its stored config is a {type(stored).__name__}, not a mapping")
    try:
        cfg = OmegaConf.create(stored)
        OmegaConf.set_struct(cfg, True)
        merged = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        plain = OmegaConf.to_container(merged, resolve=True)  # no ${...} left to smuggle a target in later
    except OmegaConfBaseException as exc:
        first = str(exc.msg).strip().splitlines()[0]
        named = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
        if exc.full_key and any(k == exc.full_key or k.startswith(exc.full_key + ".") for k in named):
            raise ConfigError(
                f"{exc.full_key}: not a key of the stored config ({first}); the stored config is in "
                "the run's .hydra/config.yaml"
            ) from None
        raise ConfigError(f"{source}: its stored config does not load ({exc.full_key}: {first})") from None
    (trust or TrustPolicy()).check(plain, source)
    resolved = OmegaConf.create(plain)
    OmegaConf.set_struct(resolved, True)
    return resolved  # type: ignore[return-value]


def _weights(checkpoint: dict[str, Any], source: Path, ema: bool) -> dict[str, torch.Tensor]:
    if not ema:
        if "ema_state_dict" in checkpoint:
            log.info(
                "%s also holds EMA weights, which its run validated and tested with: pass ema=true for those",
                source.name,
            )
        return checkpoint["state_dict"]
    if "ema_state_dict" not in checkpoint:
        raise ConfigError(f"ema=true but {source} has no ema_state_dict (the run had no hooks=[ema])")
    weights = dict(checkpoint["state_dict"])
    weights.update(checkpoint["ema_state_dict"])  # averaged parameters (and buffers) over the raw ones
    return weights


def _restore(
    source: str | Path, which: str, ema: bool, overrides: list[str], trust: TrustPolicy
) -> tuple[Path, DictConfig, Any, Any]:
    """(checkpoint path, stored config, the data's loaders, model with the checkpoint's weights)."""
    return restore(source, which, ema, overrides, trust)[:4]  # type: ignore[return-value]


def restore(
    source: str | Path, which: str, ema: bool, overrides: list[str], trust: TrustPolicy
) -> tuple[Path, DictConfig, Any, Any, Any]:
    """(checkpoint path, stored config, the data's loaders, model with the checkpoint's weights,
    the data module): what a trained run is rebuilt from."""
    from expkit.build import build_model, instantiate_node

    path = resolve_checkpoint(source, which)
    checkpoint = checkpoint_io.load_checkpoint(path, "checkpoint")
    cfg = stored_config(checkpoint, path, overrides, trust)
    data = instantiate_node(cfg.data, "data")
    loaders = data.loaders()  # before describe(): a data module may learn its shape (a vocabulary) while loading
    model = build_model(cfg, data)
    model.load_state_dict(_weights(checkpoint, path, ema))
    model.data_description = getattr(data, "describe", dict)()  # what it was built for: in_channels, num_classes...
    return path, cfg, loaders, model, data


def load_model(
    source: str | Path,
    *,
    ema: bool = False,
    which: str = "best",
    device: str = "cpu",
    overrides: Sequence[str] = (),
    trusted_targets: Sequence[str] = (),
    config_dirs: Sequence[str | Path] = (),
) -> torch.nn.Module:
    """A trained model in one call: built from the checkpoint's config, weights loaded, eval mode.

    The stored config may name only trusted targets: expkit's own and those of its shipped
    configs, plus `trusted_targets` (packages or objects, e.g. ``["my_project"]``) and the
    targets named in the YAML files of `config_dirs`. Others raise UntrustedTargetError.
    """
    trust = TrustPolicy(trusted_targets, config_dirs)
    return _restore(source, which, ema, list(overrides), trust)[3].to(device).eval()


def evaluate(cfg: DictConfig, work_dir: Path, config_dirs: Sequence[str | Path] = ()) -> dict[str, Any]:
    """Evaluate ``cfg.checkpoint`` (eval.yaml's settings) into `work_dir`; returns result.json's content."""
    from expkit import Runner, default_hooks
    from expkit.build import build_loggers, build_metrics, build_trainer_settings, instantiate_node

    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise ConfigError("give checkpoint=<.pth file, .dcp dir or run dir>")
    split = str(cfg.split)
    if split not in ("test", "val", "both"):
        raise ConfigError(f"split={split}: use split=test, split=val or split=both")
    overrides = stored_overrides(cfg)
    trust = TrustPolicy([str(t) for t in cfg.trusted_targets or []], config_dirs)
    path, stored, (_, val_loader, test_loader), model = _restore(
        cfg.checkpoint, str(cfg.which), bool(cfg.ema), overrides, trust
    )
    settings = build_trainer_settings(stored)
    if split in ("test", "both") and test_loader is None:
        raise ConfigError("split=test but the data has no test set (data.test_fraction=0?); use split=val")
    monitor = str(stored.get("monitor") or "val/acc")  # ranks a sweep of evaluations, on the split evaluated
    if split == "test":
        monitor = "test/" + monitor.partition("/")[2]
    command = " ".join(["python -m expkit.eval", *sys.argv[1:]])
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
    from expkit.ownership import WorkDirLock

    with WorkDirLock(work_dir, command):  # one writer per work dir (exit 2 when taken)
        return runner.run()


_STARTED = False


@hydra_compat.main(config_path="conf", config_name="eval")
def run(cfg: DictConfig) -> float | None:
    """Hydra's task function: evaluates one checkpoint; returns the monitored value (sweeps)."""
    from hydra.core.hydra_config import HydraConfig

    global _STARTED
    _STARTED = True
    work_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = evaluate(cfg, work_dir, config_dirs_of(sys.argv[1:])[1:])
    except ExpkitError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # one bad checkpoint of several: recorded, the others go on
            write_failure(work_dir, str(exc), evaluation=True)
            return None
        sys.exit(2 if isinstance(exc, ConfigError) else 1)
    log.info("Evaluated %s: %s", result["checkpoint"], json.dumps(result["final_metrics"]))
    log.info("Work dir: %s", result["work_dir"])
    value = result["final_metrics"].get(result.get("monitor") or "")
    return float(value) if isinstance(value, (int, float)) else None


def stored_overrides(cfg: DictConfig) -> list[str]:
    """``overrides=[...]`` as written: ``${...}`` in them is for the stored config, not this one."""
    return [str(o) for o in OmegaConf.to_container(cfg.overrides, resolve=False) or []]  # type: ignore[union-attr]


def hydra_argv(argv: list[str], options: Sequence[str] = OPTIONS) -> list[str]:
    """The command line as Hydra takes it. ``work_dir=DIR`` is ``hydra.run.dir=DIR``, and any
    ``key=value`` that is not one of eval.yaml's settings overrides the checkpoint's stored
    config: it goes into ``overrides=[...]``, so ``data.batch_size=256`` works as before."""
    out, stored, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        key, sep, value = arg.partition("=")
        root = key.lstrip("+~").split(".", 1)[0]
        if arg.startswith("-") or not sep:  # a flag (--config-dir DIR takes the next word along)
            out.append(arg)
            if arg in (
                "--config-dir",
                "-cd",
                "--config-name",
                "-cn",
                "--config-path",
                "-cp",
                "--cfg",
                "-c",
                "--package",
                "-p",
                "--info",
                "-i",
            ) and i + 1 < len(argv):
                out.append(argv[i + 1])
                i += 1
        elif key == "work_dir":
            out.append(f"hydra.run.dir={value}")
        elif root in options or root.startswith("hydra"):
            out.append(arg)
        else:
            stored.append(arg)
        i += 1
    if stored:
        quoted = ",".join(hydra_quoted(a) for a in stored)
        explicit = next((j for j, a in enumerate(out) if a.startswith("overrides=")), None)
        if explicit is None:
            out.append(f"overrides=[{quoted}]")
        else:  # an explicit overrides=[...] too: one list
            inner = out[explicit].split("=", 1)[1].strip()
            inner = inner[1:-1] if inner.startswith("[") and inner.endswith("]") else inner
            out[explicit] = f"overrides=[{inner + ',' if inner else ''}{quoted}]"
    return out


def command_main(run: Callable[[], Any], options: Sequence[str], started: Callable[[], bool]) -> None:
    """The entry point of a command over a checkpoint (eval, predict, export): the command line
    made Hydra's (``hydra_argv``, flags first), then the Hydra app `run`. Hydra's own errors
    before the task `started` (a missing key, an unknown one) are the user's to fix: exit 2."""
    versions.require()
    sys.argv[1:] = flags_first(hydra_argv(sys.argv[1:], options))  # (Hydra's parser takes flags before overrides)
    try:
        run()
    except SystemExit as exc:
        if exc.code == 1 and not started():
            sys.exit(2)
        raise


def main() -> None:
    command_main(run, OPTIONS, lambda: _STARTED)


if __name__ == "__main__":
    main()
