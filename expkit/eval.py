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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from expkit import checkpoint_io
from expkit.errors import ConfigError, ExpkitError
from expkit.trust import TrustPolicy

log = logging.getLogger("expkit")
OPTIONS = ("checkpoint", "which", "split", "ema", "logger", "work_dir", "trusted_targets")


def resolve_checkpoint(source: str | Path, which: str = "best") -> Path:
    """A checkpoint (a .pth file or a sharded .dcp dir) as given, or a run dir's best (or last) one."""
    path = Path(source)
    if checkpoint_io.is_checkpoint(path):
        return path
    if not path.is_dir():
        raise ConfigError(f"checkpoint={source}: no such file or run dir")
    if which not in ("best", "last"):
        raise ConfigError(f"which={which}: use which=best or which=last")
    result_file = path / "result.json"
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if which == "best" and result.get("best_checkpoint"):
        best = checkpoint_io.own_file(path / "checkpoints", result["best_checkpoint"])  # never another run's file
        if checkpoint_io.is_checkpoint(best):
            return best
    if which == "best":
        best = sorted(p for p in (path / "checkpoints").glob("best_*") if p.suffix in (".pth", ".dcp"))
        if best:
            return best[0]
        log.warning("%s has no best checkpoint; using its last one", path)
    last = checkpoint_io.find_last_checkpoint(path)
    if last is None:
        raise ConfigError(f"checkpoint={source}: the run dir has no checkpoint (checkpoints/last_checkpoint)")
    return last


def stored_config(checkpoint: dict[str, Any], source: Path, overrides: Sequence[str] = (),
                  trust: TrustPolicy | None = None) -> DictConfig:  # fmt: skip
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
        if exc.full_key and any(o.split("=", 1)[0].lstrip("+~") == exc.full_key for o in overrides):
            raise ConfigError(f"{exc.full_key}: not a key of the stored config ({first}); the stored config is in "
                              "the run's .hydra/config.yaml") from None  # fmt: skip
        raise ConfigError(f"{source}: its stored config does not load ({exc.full_key}: {first})") from None
    (trust or TrustPolicy()).check(plain, source)
    resolved = OmegaConf.create(plain)
    OmegaConf.set_struct(resolved, True)
    return resolved  # type: ignore[return-value]


def _weights(checkpoint: dict[str, Any], source: Path, ema: bool) -> dict[str, torch.Tensor]:
    if not ema:
        if "ema_state_dict" in checkpoint:
            log.info("%s also holds EMA weights, which its run validated and tested with: pass ema=true for those",
                     source.name)  # fmt: skip
        return checkpoint["state_dict"]
    if "ema_state_dict" not in checkpoint:
        raise ConfigError(f"ema=true but {source} has no ema_state_dict (the run had no hooks=[ema])")
    weights = dict(checkpoint["state_dict"])
    weights.update(checkpoint["ema_state_dict"])  # averaged parameters (and buffers) over the raw ones
    return weights


def _restore(source: str | Path, which: str, ema: bool, overrides: list[str],
             trust: TrustPolicy) -> tuple[Path, DictConfig, Any, Any]:  # fmt: skip
    """(checkpoint path, stored config, the data's loaders, model with the checkpoint's weights)."""
    return restore(source, which, ema, overrides, trust)[:4]  # type: ignore[return-value]


def restore(source: str | Path, which: str, ema: bool, overrides: list[str],
            trust: TrustPolicy) -> tuple[Path, DictConfig, Any, Any, Any]:  # fmt: skip
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


def load_model(source: str | Path, *, ema: bool = False, which: str = "best", device: str = "cpu",
               overrides: Sequence[str] = (), trusted_targets: Sequence[str] = (),
               config_dirs: Sequence[str | Path] = ()) -> torch.nn.Module:  # fmt: skip
    """A trained model in one call: built from the checkpoint's config, weights loaded, eval mode.

    The stored config may name only trusted targets: expkit's own and those of its shipped
    configs, plus `trusted_targets` (packages or objects, e.g. ``["my_project"]``) and the
    targets named in the YAML files of `config_dirs`. Others raise UntrustedTargetError.
    """
    trust = TrustPolicy(trusted_targets, config_dirs)
    return _restore(source, which, ema, list(overrides), trust)[3].to(device).eval()


def _list_value(value: str) -> list[str]:
    """`[a,b]`, `a,b` or `a` -> the names."""
    return [n.strip().strip("'\"") for n in value.strip().strip("[]").split(",") if n.strip()]


def evaluate(args: dict[str, str], overrides: list[str], config_dirs: Sequence[str | Path] = ()) -> dict[str, Any]:
    from expkit import Runner, default_hooks
    from expkit.build import _build_loggers, build_metrics, build_trainer_settings, instantiate_node

    if "checkpoint" not in args:
        raise ConfigError("give checkpoint=<.pth file or run dir>")
    split = args.get("split", "test")
    if split not in ("test", "val", "both"):
        raise ConfigError(f"split={split}: use split=test, split=val or split=both")
    ema = args.get("ema", "false").lower() == "true"
    trust = TrustPolicy(_list_value(args.get("trusted_targets", "")), config_dirs)
    path, cfg, (_, val_loader, test_loader), model = _restore(args["checkpoint"], args.get("which", "best"), ema,
                                                            overrides, trust)  # fmt: skip
    settings = build_trainer_settings(cfg)
    loggers = {}
    if args.get("logger"):
        from expkit.train import CONF_DIR

        names = _list_value(args["logger"])
        nodes = {}
        for name in names:
            file = CONF_DIR / "logger" / f"{name}.yaml"
            if not file.is_file():
                available = ", ".join(sorted(p.stem for p in (CONF_DIR / "logger").glob("*.yaml")))
                raise ConfigError(f"logger={name}: no such backend; available: {available}")
            nodes.update(OmegaConf.load(file))
        loggers = _build_loggers(OmegaConf.create(nodes), "logger")
    work_dir = Path(args.get("work_dir") or f"outputs/evals/{time.strftime('%Y-%m-%d_%H-%M-%S')}_{time.time_ns() % 10**6:06d}")
    runner = Runner(
        model=model,
        optimizer=None,
        train_loader=None,
        val_loader=val_loader if split in ("val", "both") else None,
        test_loader=test_loader if split in ("test", "both") else None,
        criterion=instantiate_node(cfg.criterion, "criterion"),
        metrics=build_metrics(cfg.metrics),
        settings=settings,
        default_hooks=default_hooks(timer=None, sampler_seed=None, param_scheduler=None, checkpoint=None),
        loggers=loggers,
        work_dir=work_dir,
        config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
        run_info={"checkpoint": str(path.resolve()), "ema": args.get("ema", "false"), "overrides": overrides,
                  "command": " ".join(["python -m expkit.eval", *sys.argv[1:]])},  # fmt: skip
    )
    if split in ("test", "both") and test_loader is None:
        raise ConfigError("split=test but the data has no test set (data.test_fraction=0?); use split=val")
    from expkit.ownership import WorkDirLock

    with WorkDirLock(work_dir, runner.run_info["command"]):  # one writer per work dir (exit 2 when taken)
        return runner.run()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from expkit.train import config_dirs_of

    config_dirs = config_dirs_of(argv)[1:]
    args, overrides = {}, []
    flags = [i for i, a in enumerate(argv) if a.split("=", 1)[0] in ("--config-dir", "-cd")]
    skip = {i + 1 for i in flags if "=" not in argv[i]} | set(flags)
    for item in (a for i, a in enumerate(argv) if i not in skip):
        key, sep, value = item.partition("=")
        if not sep:
            print(f"Error: {item!r} is not key=value; see python -m expkit.eval --help", file=sys.stderr)
            return 2
        if key in OPTIONS:
            args[key] = value
        else:
            overrides.append(item)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    try:
        result = evaluate(args, overrides, config_dirs)
    except ExpkitError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    log.info("Evaluated %s: %s", result["checkpoint"], json.dumps(result["final_metrics"]))
    log.info("Work dir: %s", result["work_dir"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
