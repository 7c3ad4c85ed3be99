"""The layout (CONTRIBUTING.md, "The layout"): the top of the package holds what users touch; the
modules that moved into subpackages keep their old import paths, with a DeprecationWarning; a
checkpoint's stored config that names an old path is read at the new one."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from conftest import REPO

from expkit._moved import MOVED, new_name

FIXTURE = REPO / "tests" / "fixtures" / "iter_50-2026-11-27.pth"  # (written before the move)
COMMANDS = {"train", "eval", "predict", "export", "sweep", "compare", "lr_find", "shards"}  # (and check/, a package)
NAMED_BY_CONFIGS = {"models", "data", "shard_data", "metrics", "optimizers", "schedulers", "samplers"}
PACKAGES = {"check", "config", "sweeps", "engine", "checkpoint", "loggers", "workdir", "core", "hooks", "tasks", "conf"}


def test_the_top_of_the_package_holds_the_commands_and_what_configs_name():
    top = REPO / "expkit"
    modules = {p.stem for p in top.glob("*.py")} - {"__init__", "_moved", "testing"}
    assert modules == COMMANDS | NAMED_BY_CONFIGS
    assert {p.name for p in top.iterdir() if p.is_dir() and p.name != "__pycache__"} == PACKAGES


def test_every_old_import_path_gives_the_moved_module_with_a_deprecation_warning():
    script = """
import importlib, json, warnings
from expkit._moved import MOVED
out = {}
for old, package in MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"expkit.{old}")
    new = importlib.import_module(f"expkit.{package}.{old}")
    out[old] = [module is new, [str(w.message) for w in caught if w.category is DeprecationWarning]]
from expkit.runner import Runner  # (the form user code has)
from expkit.engine.runner import Runner as Moved
out["from-import"] = [Runner is Moved, []]
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    assert set(seen) == set(MOVED) | {"from-import"} and len(MOVED) == 36
    for old, (same, warned) in seen.items():
        assert same, old
        if old != "from-import":
            assert warned == [f"expkit.{old} moved to expkit.{MOVED[old]}.{old}; import it from there"], old
    assert new_name("expkit.backends.TensorBoardBackend") == "expkit.loggers.backends.TensorBoardBackend"
    assert new_name("expkit.models.MLP") == "expkit.models.MLP" and new_name("my.runner.X") == "my.runner.X"


def test_a_stored_config_naming_an_old_path_is_trusted_and_built_at_the_new_one(tmp_path):
    from expkit.config.restore import stored_config
    from expkit.core.trust import TrustPolicy

    checkpoint = torch.load(FIXTURE, weights_only=True)
    checkpoint["config"]["logger"] = {"tb": {"_target_": "expkit.backends.TensorBoardBackend"}}
    cfg = stored_config(checkpoint, FIXTURE)
    assert cfg.logger.tb._target_ == "expkit.loggers.backends.TensorBoardBackend"
    # what the renaming spares: the old path is the new module under another name, which the trust
    # rules refuse to build (a name that hides what it is)
    refused = TrustPolicy()._object_problem("expkit.backends.TensorBoardBackend")[0]
    assert "expkit.backends is the module expkit.loggers.backends under another name" in refused
