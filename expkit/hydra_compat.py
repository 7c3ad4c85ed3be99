"""The one place where expkit meets what differs between the Hydra and OmegaConf lines it supports.

expkit runs on Hydra 1.3 (OmegaConf 2.3) and Hydra 1.4 (OmegaConf 2.4). Everything else in
expkit uses their public API; what is here is either public API that one line deprecates or
lacks, or the two private names Hydra offers no public form of (its basic launcher and
sweeper, which expkit's sweeper builds on). Each has a branch per line, and
``tests/test_hydra_compat.py`` runs on each line CI installs. Nothing here replaces or wraps
an attribute of Hydra, OmegaConf or torch: expkit never patches another library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hydra
import omegaconf
from omegaconf import OmegaConf

from expkit import versions

__all__ = [
    "HYDRA_VERSION",
    "INIT_KWARGS",
    "MAIN_KWARGS",
    "basic_launcher",
    "basic_sweeper",
    "instantiate",
    "locate",
    "register_resolver",
]


HYDRA_VERSION = versions.parse(hydra.__version__)[:2]
OMEGACONF_VERSION = versions.parse(omegaconf.__version__)[:2]

# Hydra 1.4 builds a config-named ``_target_`` only where trusted code allows it (its execution
# whitelist; without one it warns, and Hydra 1.5 will refuse). expkit decides what a config may
# build by its own rule, the same on both lines: a command builds what its user composed (the
# command line, the shipped configs, their --config-dir: code they chose to run), and a config
# read from a checkpoint only after expkit.trust.TrustPolicy accepted every target in it. A
# whitelist of a node's own targets is not enough: Hydra 1.4 also asks for the class of every
# callable a target returns (a factory returning a torchvision ResNet, any nn.Module), so
# expkit's builds, and Hydra's own for its commands (callbacks, log handlers), run with Hydra's
# checks off: Hydra 1.3's behaviour, said explicitly.
INIT_KWARGS: dict[str, Any] = {} if HYDRA_VERSION >= (1, 4) else {"version_base": "1.3"}  # initialize_*()


def _checks_off() -> Any:
    from hydra.utils import UNSAFE_DISABLE_EXECUTION_CHECKS  # (Hydra 1.4)

    return UNSAFE_DISABLE_EXECUTION_CHECKS


# hydra.main: Hydra 1.3 needs version_base="1.3" (without it, 1.1's defaults: the job changes its
# working dir); Hydra 1.4 deprecates the argument (its defaults are 1.3's).
MAIN_KWARGS: dict[str, Any] = {"execution_whitelist": _checks_off()} if HYDRA_VERSION >= (1, 4) else INIT_KWARGS


def instantiate(node: Any, /, **kwargs: Any) -> Any:
    """Hydra's ``instantiate`` of a node expkit has decided to build (see above); on Hydra 1.4
    inside an execution whitelist that leaves that decision to expkit."""
    from hydra.utils import instantiate as hydra_instantiate

    if HYDRA_VERSION < (1, 4):
        return hydra_instantiate(node, **kwargs)
    from hydra.utils import execution_whitelist

    with execution_whitelist(_checks_off(), reset=True):
        return hydra_instantiate(node, **kwargs)


def register_resolver(name: str, resolver: Callable[..., Any]) -> None:
    """Register an OmegaConf resolver (replacing one of that name): ``register_resolver`` on
    OmegaConf 2.4, ``register_new_resolver`` (which 2.4 deprecates) on 2.3 (whose own
    ``register_resolver`` is an older, deprecated API)."""
    if OMEGACONF_VERSION >= (2, 4):
        OmegaConf.register_resolver(name, resolver, replace=True)
    else:
        OmegaConf.register_new_resolver(name, resolver, replace=True)


def locate(path: str) -> Any:
    """The object a ``_target_`` names (Hydra's public ``get_object``, on both lines)."""
    from hydra.utils import get_object

    return get_object(path)


# Hydra's in-process launcher and its grid sweeper: private modules on both lines, the same
# classes and constructor arguments on both (tests/test_hydra_compat.py checks). Looked up at each
# call, never kept: Hydra 1.3's plugin scan executes its plugin modules again, in place, so a
# class kept from an earlier import is no longer the one Hydra's own code names (BasicSweeper's
# __init__ calls super(BasicSweeper, self) with the module's current class).
def basic_launcher() -> type:
    """Hydra's in-process launcher class, as its module holds it now."""
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher

    return BasicLauncher


def basic_sweeper() -> type:
    """Hydra's grid sweeper class, as its module holds it now."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return BasicSweeper
