"""A command's ``--help`` (and ``--cfg job``, ``--info``) prints without importing torch (issue 64,
item 11): torch was 1.5 s of each command's 2-4 s ``--help``. Each command runs in a subprocess through
a tiny wrapper that says, as the process exits, whether torch was imported and, when it was, where
from. Hydra scans ``hydra_plugins/`` (the sweepers) for every one of these: the scan is covered too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # (the repository: this file is tests/house/test_help_imports.py)

# python WRAPPER MODULE ARGS...: runs `python -m MODULE ARGS...`; at exit prints "torch: no", or
# "torch: imported" and the expkit and hydra_plugins lines that imported it first
WRAPPER = r"""
import atexit, runpy, sys, traceback

first = []

class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not first:
            first.extend(f"{f.filename}:{f.lineno} {f.line}" for f in traceback.extract_stack()
                         if "expkit" in f.filename or "hydra_plugins" in f.filename)
        return None

def said():
    imported = "torch" in sys.modules
    print("torch: " + ("imported, first by:\n" + "\n".join(first) if imported else "no"), file=sys.stderr)
    print("plugins scanned: " + str(any(m.startswith("hydra_plugins.expkit_sweeper") for m in sys.modules)),
          file=sys.stderr)

sys.meta_path.insert(0, Spy())
atexit.register(said)
module = sys.argv.pop(1)
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""

COMMANDS = ["train", "eval", "predict", "export", "check", "compare", "lr_find", "shards", "sweep"]


@pytest.mark.parametrize(
    "words",
    [[command, "--help"] for command in COMMANDS]
    + [["train", "--cfg", "job"], ["train", "--info", "plugins"], ["eval", "--cfg", "job"]],
    ids=" ".join,
)
def test_a_commands_help_and_config_print_without_importing_torch(words):
    command, *args = words
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, f"expkit.{command}", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch: no" in proc.stderr, proc.stderr[-2000:]
    assert "plugins scanned: True" in proc.stderr  # (Hydra imported the sweepers, and they no torch)


def test_every_public_name_of_the_lazy_packages_resolves_to_its_module_own_object():
    """``expkit`` and ``expkit.hooks`` load their torch-bound names on first use (``_LAZY``): a hook
    added to ``__all__`` but not to ``_LAZY`` (three entries per hook) would fail only when a config
    names it. Every public name resolves, and a lazy one is the object of the module it names."""
    import importlib

    for package in ("expkit", "expkit.hooks"):
        module = importlib.import_module(package)
        lazy = module._LAZY
        for name in module.__all__:
            value = getattr(module, name)  # (AttributeError: in __all__, neither bound nor lazy)
            if name in lazy:
                home = lazy[name] if package == "expkit" else f"expkit.hooks.{lazy[name]}"
                assert value is getattr(importlib.import_module(home), name), (package, name)
        assert set(lazy) <= set(module.__all__), (package, sorted(set(lazy) - set(module.__all__)))
