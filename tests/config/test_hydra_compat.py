"""expkit on the Hydra line installed here: it patches nothing of Hydra, OmegaConf or torch, its
one adapter (expkit/core/hydra_compat.py) works, Hydra finds its sweepers, and a default run prints
no deprecation or migration warning. CI runs this file on Hydra 1.3 and on Hydra 1.4."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import warnings

import hydra
import pytest
from conftest import REPO, run_cli
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf

from expkit.core import hydra_compat

# Run in a fresh interpreter: every attribute of every Hydra, OmegaConf and torch module loaded
# (and of every class they define), by identity, before expkit is imported, after, and after a
# whole run of `python -m expkit.train` in that same process.
SNAPSHOT = r"""
import importlib, json, pkgutil, sys, types

def load_all(package):
    mod = importlib.import_module(package)
    for info in pkgutil.walk_packages(mod.__path__, package + "."):
        if ".test_utils" in info.name or ".tests" in info.name or "._vendor" in info.name:
            continue
        try:
            importlib.import_module(info.name)
        except Exception:
            pass

for package in ("hydra", "omegaconf"):
    load_all(package)
import torch, torch.nn, torch.optim, torch.utils.data, torch.distributed, torch.serialization

WATCHED = ("hydra", "omegaconf", "torch")
SCANNED = "hydra._internal.core_plugins."

def snapshot():
    seen = {}
    for name, mod in list(sys.modules.items()):
        if not isinstance(mod, types.ModuleType) or name.split(".")[0] not in WATCHED:
            continue
        seen[name] = (id(mod), id(getattr(mod, "__spec__", None)))  # a module Hydra imports again is new
        for attr, value in list(vars(mod).items()):
            if callable(value) or isinstance(value, types.ModuleType):  # code, not a library's own state
                seen[f"{name}:{attr}"] = id(value)
            if isinstance(value, type) and value.__module__ == name:
                for cattr, cvalue in list(vars(value).items()):
                    if callable(cvalue) or isinstance(cvalue, (classmethod, staticmethod, property)):
                        seen[f"{name}:{attr}.{cattr}"] = id(cvalue)
    return seen

def changed(before, after):
    # attributes replaced in a module that was not imported afresh. Hydra's plugin scan executes
    # its plugin modules again, in place (Plugins._scan_all_plugins: exec_module on the module in
    # sys.modules): new classes there are nobody's patch
    renewed = {k for k, v in before.items() if ":" not in k and (after.get(k) != v or k.startswith(SCANNED))}
    return sorted(k for k, v in before.items()
                  if ":" in k and k.split(":")[0] not in renewed and k in after and after[k] != v)

before = snapshot()
import expkit.train, expkit.eval, expkit.predict, expkit.export, expkit.sweep
import hydra_plugins.expkit_sweeper.expkit_sweeper, hydra_plugins.expkit_sweeper.optuna_sweeper
imported = snapshot()
sys.argv = ["expkit.train", *sys.argv[1:]]
try:
    expkit.train.main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
ran = snapshot()
print("RESULT " + json.dumps({"import": changed(before, imported), "run": changed(imported, ran), "code": code}))
"""

# Functions the libraries replace themselves, whoever imports or uses them (not expkit's doing):
# torch._dynamo wraps torch.manual_seed when it is imported (building any optimizer imports it);
# torch.optim.Optimizer wraps its subclass's step at the first instance (its profiling hook);
# torch.compiler's cache registry sets CacheInfo's properties as artifact kinds register.
LIBRARIES_OWN = ("torch:manual_seed", "torch.optim.sgd:SGD.step", "torch.compiler._cache:CacheInfo.")


def _changed_by_expkit(keys: list[str]) -> list[str]:
    return [k for k in keys if not k.startswith(LIBRARIES_OWN)]


@pytest.mark.slow
def test_expkit_replaces_no_attribute_of_hydra_omegaconf_or_torch(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SNAPSHOT, f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_epochs=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["code"] == 0, proc.stderr[-3000:]
    assert _changed_by_expkit(result["import"]) == []
    assert _changed_by_expkit(result["run"]) == []


def test_the_adapter_takes_the_branch_of_the_installed_line():
    assert hydra_compat.HYDRA_VERSION == tuple(int(p) for p in hydra.__version__.split(".")[:2])
    if hydra_compat.HYDRA_VERSION >= (1, 4):
        assert "version_base" not in hydra_compat.MAIN_KWARGS
        assert "execution_whitelist" in hydra_compat.MAIN_KWARGS
    else:
        assert hydra_compat.MAIN_KWARGS == {"version_base": "1.3"}
    assert issubclass(hydra_compat.basic_launcher(), Launcher) and issubclass(hydra_compat.basic_sweeper(), Sweeper)
    import torch

    assert hydra_compat.locate("torch.nn.Linear") is torch.nn.Linear


def test_resolvers_and_instantiate_go_without_a_warning_on_this_line():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hydra_compat.register_resolver("expkit_test_twice", lambda x: 2 * int(x))
        assert OmegaConf.create({"a": "${expkit_test_twice:21}"}).a == 42
        node = OmegaConf.create(
            {
                "_target_": "torch.nn.Sequential",
                "_args_": [{"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3}],
            }
        )
        model = hydra_compat.instantiate(node)
    assert model[0].out_features == 3


def test_a_stored_config_is_judged_by_expkits_trust_rule_on_this_line_too(tmp_path):
    """On Hydra 1.4 expkit builds with Hydra's execution checks off (see hydra_compat): the
    guarantee for a config stored in a checkpoint is expkit.core.trust's, checked before anything
    is built, the same on both lines. A factory returning an nn.Module builds without a
    warning (a whitelist of the node's own target refused it on 1.4), and an untrusted stored
    target is still refused."""
    import torch

    from expkit.core.trust import TrustPolicy, UntrustedTargetError

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        node = {"_target_": "expkit.models.torchvision_resnet", "in_channels": 1, "image_size": 8, "num_classes": 3}
        model = hydra_compat.instantiate(OmegaConf.create(node))
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 3)
    with pytest.raises(UntrustedTargetError, match="builtins.eval"):
        TrustPolicy().check({"model": {"_target_": "builtins.eval", "_args_": ["1"]}}, tmp_path / "x.pth")


def test_hydra_finds_both_sweepers_through_entry_points():
    """Hydra 1.4 discovers plugins through entry points (1.3 scans the hydra_plugins package)."""
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group="hydra.plugins")}
    assert {"expkit-sweeper", "expkit-optuna-sweeper"} <= set(found), sorted(found)
    for name in ("expkit-sweeper", "expkit-optuna-sweeper"):
        assert issubclass(found[name].load(), Sweeper)


@pytest.mark.slow
def test_a_default_run_a_grid_sweep_and_an_optuna_search_print_no_warning(tmp_path):
    proc = run_cli(f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_epochs=1")
    assert proc.returncode == 0, proc.output
    assert "Warning" not in proc.output and "deprecated" not in proc.output.lower(), proc.output
    proc = run_cli(
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        "trainer.max_epochs=1",
        f"hydra.sweep.dir={tmp_path / 'search'}",
    )
    assert proc.returncode == 0, proc.output
    assert "Warning" not in proc.output and "deprecated" not in proc.output.lower(), proc.output
    assert sorted(p.name for p in (tmp_path / "search").iterdir() if p.name.isdigit()) == ["0", "1"]
    proc = run_cli("-m", "optim.lr=0.1,0.05", "trainer.max_epochs=1", f"hydra.sweep.dir={tmp_path / 'grid'}")
    assert proc.returncode == 0, proc.output  # (a BasicSweeper kept across Hydra 1.3's plugin scan failed here)
    assert "Warning" not in proc.output and "deprecated" not in proc.output.lower(), proc.output


def test_the_declared_lower_bounds_are_the_ones_checked_at_start():
    from expkit.core import versions

    declared = importlib.metadata.requires("expkit")  # pyproject's, as installed (Python 3.10 has no tomllib)
    bounds = {m.group(1).lower(): m.group(2) for d in declared if (m := re.match(r"([\w.-]+)(?:\[.*\])?>=([\d.]+)", d))}
    for package, (lowest, _why) in versions.MINIMUM.items():
        assert bounds[package] == lowest, package
    assert versions.parse("2.14.1+cu130") == (2, 14, 1) and versions.parse("1.4.0rc3") == (1, 4, 0)
    assert versions.check_installed() is None  # this environment


def test_an_older_torch_than_expkit_needs_is_named_with_the_version_it_needs(monkeypatch):
    """A torch older than the bound, in an existing environment (a stand-in module: only its
    version differs). Each command prints this line and exits 2 before anything else."""
    import types

    from expkit.core import versions

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(__version__="2.8.1+cpu"))
    message = versions.check_installed()
    assert message is not None and message.startswith("torch 2.8.1+cpu is installed; expkit needs torch>=2.9")
    assert "pip install 'torch>=2.9'" in message


# A plain Hydra app, run through expkit's hydra_compat.main or through hydra.main itself; the
# test's own spy counts the compositions (Hydra.compose_config) in that process.
APP = r"""
import sys

import hydra
from hydra._internal.hydra import Hydra
from hydra.core.hydra_config import HydraConfig

from expkit.core import hydra_compat

COMPOSED = []
real_compose = Hydra.compose_config

def counting_compose(self, *args, **kwargs):
    COMPOSED.append(1)
    return real_compose(self, *args, **kwargs)

Hydra.compose_config = counting_compose  # (this test's spy, on both lines; expkit patches nothing)

def task(cfg):
    print(f"TASK x={cfg.x} mode={HydraConfig.get().mode.name} job={HydraConfig.get().job.name}", flush=True)
    if cfg.x == "fail":
        raise ValueError("the task failed")

via = sys.argv.pop(1)
if via == "expkit":
    app = hydra_compat.main(config_path="conf", config_name="config")(task)
else:
    app = hydra.main(**hydra_compat.MAIN_KWARGS, config_path="conf", config_name="config")(task)
try:
    app()
finally:
    print(f"COMPOSED {len(COMPOSED)}", flush=True)
"""


def _run_app(tmp_path, via: str, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    work = tmp_path / via
    if not work.exists():
        (work / "conf" / "extra").mkdir(parents=True)
        (work / "app.py").write_text(APP)
        (work / "conf" / "config.yaml").write_text(
            "x: 1\ny: 2\nhydra:\n  run:\n    dir: out\n  sweep:\n    dir: multi\n"
        )
        (work / "conf" / "sweeping.yaml").write_text("defaults:\n  - config\n  - _self_\nhydra:\n  mode: MULTIRUN\n")
        (work / "mine").mkdir()
        (work / "mine" / "config.yaml").write_text("x: mine\n")
    proc = subprocess.run(
        [sys.executable, "app.py", via, *args],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    composed = re.search(r"COMPOSED (\d+)", proc.stdout)
    return proc, int(composed.group(1)) if composed else -1


def _records(work_dir, root) -> dict[str, str]:
    return {p.name: p.read_text().replace(str(root), "ROOT") for p in sorted((work_dir / ".hydra").glob("*.yaml"))}


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        [],  # a plain run
        ["x=3", "+z=[1,2]", "hydra.job.name=named"],
        ["--config-dir", "mine"],  # the user's config dir comes first
        ["--config-name", "sweeping"],  # the config asks for a multirun itself
        ["x=4", "-m"],
        ["x=5,6", "--config-name", "sweeping"],  # a sweep without -m
        ["x=fail"],  # the task raises
        ["nokey=1"],  # Hydra's own error
        ["x=5,6"],  # a sweep in a run: Hydra's own error
        ["--config-dir", "nowhere"],
        ["--cfg", "job"],
    ],
    ids=[
        "plain",
        "overrides",
        "config-dir",
        "config-asks-multirun",
        "m",
        "sweep-no-m",
        "task-fails",
        "bad-key",
        "sweep-in-run",
        "no-config-dir",
        "cfg",
    ],
)
def test_a_run_composes_its_config_once_and_does_what_hydras_own_path_does(tmp_path, args):
    """Hydra 1.3's hydra.main composes a run's config twice (once for its mode); expkit's commands
    compose it once on every line (hydra_compat.main) and otherwise behave as hydra.main does:
    the same output, exit status, job dirs and .hydra records."""
    ours, ours_composed = _run_app(tmp_path, "expkit", *args)
    hydras, hydras_composed = _run_app(tmp_path, "hydra", *args)
    if hydras.returncode != 0 and "TASK " not in hydras.stdout:  # Hydra refused the command line (1.3 adds
        # a HYDRA_FULL_ERROR hint to its lines, 1.4 does not)
        # expkit says it in one line and exits 2, the input being the user's to fix (issue 64, item 8)
        assert (ours.returncode, hydras.returncode) == (2, 1), ours.stderr
        assert ours.stderr.startswith("Error: ") and ours.stderr.count("\n") == 1, ours.stderr
        first = hydras.stderr.splitlines()[0].replace(str(tmp_path / "hydra"), "ROOT")
        named = re.search(r"'([^']+)'", first).group(1)  # (what Hydra's first line names: the key, the dir)
        assert named in ours.stderr.replace(str(tmp_path / "expkit"), "ROOT"), ours.stderr
        return
    assert ours.returncode == hydras.returncode, ours.stderr + hydras.stderr
    clean = re.compile(r"COMPOSED \d+|\[[\d:, -]+\]")
    assert clean.sub("", ours.stdout) == clean.sub("", hydras.stdout)
    wrapper = re.compile(
        r'  File "[^"]*hydra_compat.py", line \d+, in task\n    return task_function\(cfg\)\n( +\^+\n)?'
    )
    assert wrapper.sub("", ours.stderr).replace(str(tmp_path / "expkit"), "ROOT") == hydras.stderr.replace(
        str(tmp_path / "hydra"), "ROOT"
    )  # (a failed task's trace has one frame more: hydra_compat's, which tells a task's errors from Hydra's)
    for run_dir in ("out", "multi/0", "multi/1"):
        mine, theirs = tmp_path / "expkit" / run_dir, tmp_path / "hydra" / run_dir
        assert mine.exists() == theirs.exists(), run_dir
        if mine.exists():
            assert _records(mine, tmp_path / "expkit") == _records(theirs, tmp_path / "hydra"), run_dir
    if ours.returncode == 0 and "--cfg" not in args:
        runs = ours.stdout.count("TASK ")
        assert runs >= 1
        if runs == 1 and "-m" not in args and "sweeping" not in args:  # a run: composed once, on each line
            assert ours_composed == 1, ours.stdout
            assert hydras_composed == (2 if hydra_compat.HYDRA_VERSION < (1, 4) else 1)


def test_a_dotted_key_of_optunas_params_is_told_to_go_in_braces_which_then_works():
    """Optuna's search space has keys with a dot (``optim.lr``): ``hydra.sweeper.params.optim.lr=...``
    reads as nested keys. The refusal names the form that works, and that form changes this key only."""
    dotted = run_cli("hparams_search=optuna", "hydra.sweeper.params.optim.lr='interval(0.01,0.1)'", "--cfg", "hydra")
    assert dotted.returncode == 2, dotted.output
    assert 'set it in braces: "hydra.sweeper.params={optim.lr: <value>}"' in dotted.stderr, dotted.stderr
    assert "did you mean" not in dotted.stderr and "Traceback" not in dotted.stderr
    braces = run_cli(
        "hparams_search=optuna",
        "hydra.sweeper.params={optim.lr: 'interval(0.01,0.1)'}",
        "--cfg",
        "hydra",
        "-p",
        "hydra.sweeper.params",
    )
    assert braces.returncode == 0, braces.output
    params = OmegaConf.create(braces.stdout.split("\n", 1)[1])
    assert params["optim.lr"] == "interval(0.01,0.1)" and "model.hidden" in params
