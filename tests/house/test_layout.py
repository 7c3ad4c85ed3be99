"""The layout (CONTRIBUTING.md, "The layout"): the top of the package holds what users touch; a
checkpoint's stored config that names a module's old path is read at the new one."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from conftest import REPO

from expkit.config.old_targets import MOVED, new_name

FIXTURE = REPO / "tests" / "fixtures" / "iter_50-2026-11-27.pth"  # (written before the move)
COMMANDS = {
    "train",
    "eval",
    "predict",
    "export",
    "sweep",
    "compare",
    "lr_find",
    "report",
    "dashboard",
    "reproduce",
    "shards",
}  # (and check/, a package)
NAMED_BY_CONFIGS = {"models", "metrics", "optimizers", "schedulers", "samplers"}
PACKAGES = {
    "check",
    "data",
    "config",
    "sweeps",
    "engine",
    "checkpoint",
    "loggers",
    "workdir",
    "core",
    "hooks",
    "tasks",
    "conf",
}


def test_the_top_of_the_package_holds_the_commands_and_what_configs_name():
    top = REPO / "expkit"
    modules = {p.stem for p in top.glob("*.py")} - {"__init__", "testing"}
    assert modules == COMMANDS | NAMED_BY_CONFIGS
    assert {p.name for p in top.iterdir() if p.is_dir() and p.name != "__pycache__"} == PACKAGES


def test_the_old_import_paths_are_gone_and_only_stored_targets_are_renamed():
    """No import finder of expkit's own bridges the old paths (issue 64: no release had them); a
    stored config's old ``_target_``s are renamed as data, before the trust rules read them."""
    script = """
import importlib, json, sys
import expkit
out = {"finders": [type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith("expkit")]}
for old in ("expkit.runner", "expkit.backends", "expkit.shard_data", "expkit._moved"):
    try:
        importlib.import_module(old)
        out[old] = "imported"
    except ModuleNotFoundError:
        out[old] = "gone"
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == {
        "finders": [],
        **dict.fromkeys(("expkit.runner", "expkit.backends", "expkit.shard_data", "expkit._moved"), "gone"),
    }
    assert len(MOVED) == 36
    assert new_name("expkit.backends.TensorBoardBackend") == "expkit.loggers.backends.TensorBoardBackend"
    assert new_name("expkit.shard_data.WebDatasetData") == "expkit.data.shards.WebDatasetData"
    assert new_name("expkit.sharding.shard") == "expkit.engine.fsdp.shard"
    assert new_name("expkit.checkpoint.sharding.read_state") == "expkit.checkpoint.checkpoint_io.read_sharded_state"
    assert new_name("expkit.checkpoint.sharding.AsyncShards.save") == "expkit.checkpoint.dcp.AsyncShards.save"
    assert new_name("expkit.models.MLP") == "expkit.models.MLP" and new_name("my.runner.X") == "my.runner.X"
    assert new_name("expkit.shard_data_x.Y") == "expkit.shard_data_x.Y"


def test_a_stored_config_naming_an_old_path_is_trusted_and_built_at_the_new_one(tmp_path):
    from expkit.config.restore import stored_config

    checkpoint = torch.load(FIXTURE, weights_only=True)
    checkpoint["config"]["logger"] = {"tb": {"_target_": "expkit.backends.TensorBoardBackend"}}
    checkpoint["config"]["data"] = {"_target_": "expkit.shard_data.WebDatasetData", "train": "x.tar"}
    cfg = stored_config(checkpoint, FIXTURE)
    assert cfg.logger.tb._target_ == "expkit.loggers.backends.TensorBoardBackend"
    assert cfg.data._target_ == "expkit.data.shards.WebDatasetData"
