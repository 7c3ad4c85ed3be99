"""A trained run rebuilt from its checkpoint: the checkpoint a source names (a file, a sharded
directory, a run dir's best or last one, a URL), the config stored in it (overridden, resolved,
and refused unless every ``_target_`` is trusted), the model with its weights. What
``expkit.eval``, ``expkit.predict``, ``expkit.export`` and ``load_model`` start from."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from expkit.config.old_targets import new_name
from expkit.core import confine
from expkit.core.errors import ConfigError
from expkit.core.trust import TrustPolicy
from expkit.workdir.records import read_result

if TYPE_CHECKING:
    import torch

# checkpoint_io (and so torch) is imported by the functions that read a checkpoint: eval's and predict's
# --help need neither

__all__ = ["load_model", "resolve_checkpoint", "restore", "stored_config", "stored_overrides", "weights"]


log = logging.getLogger("expkit")


def resolve_checkpoint(source: str | Path, which: str = "best") -> Path:
    """A checkpoint (a .pth file or a sharded .dcp dir) as given, or a run dir's best (or last) one;
    a URL (``s3://...``) to either, downloaded once into a local cache (``expkit.checkpoint.remote.fetch``).

    Args:
        source: a checkpoint file or sharded directory, a run dir, or a URL to one of them.
        which: for a run dir, ``"best"`` (its ``result.json``'s best checkpoint, else its first
            ``best_*`` by name, else its last one) or ``"last"`` (``checkpoints/last_checkpoint``).

    Returns:
        The local path of the checkpoint.

    Raises:
        ConfigError: when `source` is neither a checkpoint nor a run dir, `which` is neither ``best``
            nor ``last`` (for a run dir), the run dir has no checkpoint, or a URL cannot be fetched.
    """
    from expkit.checkpoint import checkpoint_io, remote

    if remote.is_url(source):
        return remote.fetch(str(source), which)
    path = remote.local_path(source)
    if checkpoint_io.is_checkpoint(path):
        return path
    if not path.is_dir():
        raise ConfigError(f"checkpoint={source}: no such file or run dir")
    if which not in ("best", "last"):
        raise ConfigError(f"which={which}: use which=best or which=last")
    if not (path / "checkpoints").is_dir():  # a sweep dir: its jobs' dirs hold the checkpoints
        from expkit.sweeps.sweep_jobs import job_order

        jobs = sorted((p for p in path.iterdir() if p.is_dir() and (p / "checkpoints").is_dir()), key=job_order)
        if jobs:
            best = f", or the best one, which {path / 'best.json'} names" if (path / "best.json").is_file() else ""
            raise ConfigError(
                f"checkpoint={source}: a sweep dir, not a run's: give one of its jobs' dirs ({jobs[0]}){best}"
            )
    result_file = path / "result.json"
    result = read_result(path) or {}  # (a torn or foreign one: as if there were none)
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
    resolved, and refused unless every ``_target_`` in it is trusted (`trust`, default: expkit's).

    Args:
        checkpoint: the loaded checkpoint.
        source: the checkpoint's path, named in error messages.
        overrides: ``key=value`` overrides of the stored config (a leading ``+`` or ``~`` is not
            honoured: the stored config is in struct mode).
        trust: the targets trusted; None: expkit's default policy.

    Returns:
        The stored config, overridden, resolved and in struct mode, every ``_target_`` at its current path.

    Raises:
        ConfigError: when the checkpoint carries no config or not a mapping, an override names an unknown
            key, or the config does not load.
        UntrustedTargetError: when a ``_target_`` is not trusted.
    """
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
    _renew_targets(plain)
    (trust or TrustPolicy()).check(plain, source)
    resolved = OmegaConf.create(plain)
    OmegaConf.set_struct(resolved, True)
    return resolved  # type: ignore[return-value]


def _renew_targets(node: Any) -> None:
    """A checkpoint written before expkit's modules moved into subpackages names them by their
    old paths (``expkit.backends.TensorBoardBackend``): each ``_target_`` at its new path, so that
    the trust rules judge, and the build imports, the module where it lives now."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "_target_" and isinstance(value, str):
                node[key] = new_name(value)
            else:
                _renew_targets(value)
    elif isinstance(node, list):
        for value in node:
            _renew_targets(value)


def weights(checkpoint: dict[str, Any], source: Path, ema: bool) -> dict[str, torch.Tensor]:
    """The weights to load into the model: the checkpoint's ``state_dict``, or with `ema` its EMA weights
    over it.

    Args:
        checkpoint: the loaded checkpoint.
        source: the checkpoint's path, named in messages.
        ema: take the averaged parameters (and buffers) of ``ema_state_dict`` in place of the raw ones.

    Returns:
        The weights by name (``checkpoint["state_dict"]`` itself when not `ema`).

    Raises:
        ConfigError: when `ema` is set and the checkpoint has no ``ema_state_dict``.
    """
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


def restore(
    source: str | Path, which: str, ema: bool, overrides: list[str], trust: TrustPolicy
) -> tuple[Path, DictConfig, Any, Any, Any]:
    """(checkpoint path, stored config, the data's loaders, model with the checkpoint's weights,
    the data module): what a trained run is rebuilt from.

    Args:
        source: a checkpoint, a run dir or a URL (``resolve_checkpoint``).
        which: ``"best"`` or ``"last"``, for a run dir.
        ema: load the EMA weights.
        overrides: ``key=value`` overrides of the stored config.
        trust: the targets the stored config may name.

    Returns:
        The checkpoint's path, its config, what ``data.loaders()`` returned, the model with its weights
        (``data_description`` set to the data module's ``describe()``), and the data module.

    Raises:
        ConfigError: when the checkpoint cannot be found or loaded, its config is refused, or a part
            cannot be built.
    """
    from expkit.checkpoint import checkpoint_io
    from expkit.config.build import build_model, instantiate_node

    path = resolve_checkpoint(source, which)
    checkpoint = checkpoint_io.load_checkpoint(path, "checkpoint")
    cfg = stored_config(checkpoint, path, overrides, trust)
    data = instantiate_node(cfg.data, "data")
    loaders = data.loaders()  # before describe(): a data module may learn its shape (a vocabulary) while loading
    model = build_model(cfg, data)
    model.load_state_dict(weights(checkpoint, path, ema))
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

    Args:
        source: a checkpoint, a run dir or a URL (``resolve_checkpoint``).
        ema: load the EMA weights instead of the raw ones.
        which: ``"best"`` or ``"last"``, for a run dir.
        device: the device to move the model to.
        overrides: ``key=value`` overrides of the stored config.
        trusted_targets: packages or objects whose targets are trusted besides expkit's.
        config_dirs: directories whose YAML files' targets are trusted.

    Returns:
        The model on `device`, in eval mode.

    Raises:
        ConfigError: when the checkpoint cannot be found or loaded, or its config is refused
            (UntrustedTargetError for an untrusted target).
    """
    trust = TrustPolicy(trusted_targets, config_dirs)
    return restore(source, which, ema, list(overrides), trust)[3].to(device).eval()


def stored_overrides(cfg: DictConfig) -> list[str]:
    """``overrides=[...]`` as written: ``${...}`` in them is for the stored config, not this one.

    Args:
        cfg: the command's config, with an ``overrides`` list.

    Returns:
        The overrides as strings, interpolations unresolved; an empty list when there are none.
    """
    return [str(o) for o in OmegaConf.to_container(cfg.overrides, resolve=False) or []]  # type: ignore[union-attr]
