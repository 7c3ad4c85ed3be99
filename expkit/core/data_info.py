"""``${data_info:KEY}``: what the data module describes (``num_classes``, ``in_channels``,
``vocab_size``...), for any config value, in YAML or on the command line; and ``${runs_dir:}``,
the directory that holds the run's work dir (where caches shared by runs go); and the two that
``hydra/launcher=slurm_ddp`` fills its defaults with: ``${slurm_gpus_per_node:PARTITION}`` (what
``sinfo`` says a node has), ``${slurm_cpus_per_task:PARTITION,TASKS}`` (a node's CPUs shared by
its tasks) and ``${tasks_for_gpus:N}`` (one task per GPU, at least one).

Registered with OmegaConf when expkit is imported, before Hydra composes and before anything
reads the config (a command-line interpolation is resolved as early as the run's record);
filled by ``expkit.config.build.build_model`` once the data module is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from expkit.core.errors import ConfigError
from expkit.core.hydra_compat import register_resolver

__all__ = ["DATA_INFO"]

DATA_INFO: dict[str, Any] = {}  # what the current data module describes


def _data_info(key: str) -> Any:
    if not DATA_INFO:
        raise ConfigError(
            f"${{data_info:{key}}} is known only once the data module is built: it may be used in the model's "
            "and later config values (model, optim, metrics, hooks), which are built after the data"
        )
    if key not in DATA_INFO:
        raise ConfigError(f"${{data_info:{key}}}: the data module describes {sorted(DATA_INFO)}, not {key!r}")
    return DATA_INFO[key]


register_resolver("data_info", _data_info)


def _runs_dir() -> str:
    """The parent of the run's work dir (``hydra.runtime.output_dir``): a sweep's dir for its
    jobs, ``outputs/runs`` for single runs; ``.`` outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "."
    return str(Path(HydraConfig.get().runtime.output_dir).parent)


register_resolver("runs_dir", _runs_dir)


def _slurm_gpus_per_node(partition: str | None = None) -> int | None:
    from expkit.core.slurm import partition_nodes  # (sinfo, asked only by a Slurm launch)

    return partition_nodes(partition or None).gpus or None  # (None: no GPU asked for, no --gpus-per-node)


def _slurm_cpus_per_task(partition: str | None, tasks: int) -> int:
    from expkit.core.slurm import partition_nodes

    return max(1, partition_nodes(partition or None).cpus // max(1, int(tasks)))


def _tasks_for_gpus(gpus: int | None) -> int:
    return max(1, int(gpus or 0))


register_resolver("slurm_gpus_per_node", _slurm_gpus_per_node)
register_resolver("slurm_cpus_per_task", _slurm_cpus_per_task)
register_resolver("tasks_for_gpus", _tasks_for_gpus)
