"""A checkpoint never runs code: a stored config may name only trusted targets (expkit.core.trust)."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from expkit.config.build import build_runner
from expkit.config.cli import CONF_DIR, available_options
from expkit.core.errors import ConfigError
from expkit.core.hydra_compat import INIT_KWARGS
from expkit.core.trust import TrustPolicy, UntrustedTargetError
from expkit.eval import load_model

PROJECT = REPO / "examples" / "my_project"


class _Payload:
    """Unpickling this creates the marker file: what `torch.load(weights_only=False)` would run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), **INIT_KWARGS):
        return compose(config_name="train", overrides=list(overrides))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A real checkpoint of the default experiment (one epoch), as a plain dict."""
    work = tmp_path_factory.mktemp("run")
    build_runner(_compose("trainer.max_epochs=1"), work).run()
    return torch.load(work / "checkpoints" / "epoch_1.pth", weights_only=True)


def _attacks(marker: Path, pickle_file: Path) -> dict[str, tuple[str, object]]:
    """name -> (config key to replace, malicious node), each creating `marker` if it were built."""
    touch = ["touch", str(marker)]
    return {
        "open": ("data", {"_target_": "builtins.open", "file": str(marker), "mode": "w"}),
        "torch_load": ("model", {"_target_": "torch.load", "f": str(pickle_file), "weights_only": False}),
        "popen": ("criterion", {"_target_": "subprocess.Popen", "args": touch}),
        "nested_argument": (
            "model",
            {"_target_": "expkit.models.MLP", "hidden": {"_target_": "subprocess.Popen", "args": touch}},
        ),
        "partial": ("criterion", {"_target_": "subprocess.Popen", "_partial_": True, "args": touch}),
        "args_list": (
            "criterion",
            {"_target_": "torch.nn.Sequential", "_args_": [{"_target_": "subprocess.Popen", "args": touch}]},
        ),
        "module_alias": (
            "model",
            {"_target_": "torch.nn.functional.torch.load", "f": str(pickle_file), "weights_only": False},
        ),
        "imported_name": ("data", {"_target_": "expkit.data.datasets.Path.touch", "self": str(marker)}),
        "dunder": ("data", {"_target_": "torch.nn.Module.__init__.__globals__"}),
        "interpolation": ("data", "${oc.decode:'{_target_: subprocess.Popen, args: [touch, " + str(marker) + "]}'}"),
    }


@pytest.fixture
def attacks(trained, tmp_path) -> tuple[Path, dict[str, Path]]:
    """Checkpoints that pass weights_only=True but carry a malicious config; the marker they aim at."""
    marker, pickle_file = tmp_path / "marker", tmp_path / "payload.pkl"
    pickle_file.write_bytes(pickle.dumps(_Payload(str(marker))))
    files = {}
    for name, (key, node) in _attacks(marker, pickle_file).items():
        checkpoint = copy.deepcopy(trained)
        checkpoint["config"][key] = node
        files[name] = tmp_path / f"{name}.pth"
        torch.save(checkpoint, files[name])
        torch.load(files[name], weights_only=True)  # the file itself is harmless to load
    return marker, files


def test_load_model_refuses_every_untrusted_target_before_it_runs(attacks):
    marker, files = attacks
    for name, path in files.items():
        with pytest.raises(
            UntrustedTargetError, match=r"refused to build \w+(\.hidden|\._args_\[0\])?\._target_="
        ) as info:
            load_model(path)
        assert "trusted_targets=" in str(info.value), name
        assert not marker.exists(), f"{name} ran: {marker} was created"


@pytest.mark.slow
def test_eval_refuses_them_with_exit_2_naming_the_target(attacks, tmp_path):
    marker, files = attacks
    expected = {
        "open": "builtins.open",
        "torch_load": "torch.load",
        "popen": "subprocess.Popen",
        "nested_argument": "subprocess.Popen",
        "partial": "subprocess.Popen",
        "args_list": "subprocess.Popen",
        "module_alias": "torch.nn.functional.torch.load",
        "imported_name": "expkit.data.datasets.Path.touch",
        "dunder": "__globals__",
        "interpolation": "subprocess.Popen",
    }
    for name, path in files.items():
        proc = subprocess.run(
            [sys.executable, "-m", "expkit.eval", f"checkpoint={path}", f"work_dir={tmp_path / name}"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2, (name, proc.stderr)
        assert "refused to build" in proc.stderr and expected[name] in proc.stderr, (name, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert not marker.exists(), f"{name} ran: {marker} was created"
        # refused before anything was built: the work dir holds Hydra's record of the command only
        assert not (tmp_path / name).exists() or sorted(p.name for p in (tmp_path / name).iterdir()) in (
            [".hydra"],
            [".hydra", "eval.log"],
        )


def test_a_trusted_package_is_built_and_an_exact_name_beats_the_module_check(trained, tmp_path):
    checkpoint = copy.deepcopy(trained)
    checkpoint["config"]["criterion"] = {"_target_": "operator.add", "_partial_": True}  # harmless, not trusted
    torch.save(checkpoint, tmp_path / "c.pth")
    with pytest.raises(UntrustedTargetError, match=r"trusted_targets=\[operator\]"):
        load_model(tmp_path / "c.pth")
    with pytest.raises(UntrustedTargetError, match=r"it is _operator\.add.*trusted_targets=\[operator\.add\]"):
        load_model(tmp_path / "c.pth", trusted_targets=["operator"])  # the object lives outside the package
    load_model(tmp_path / "c.pth", trusted_targets=["operator.add"])
    with pytest.raises(ConfigError, match="not a dotted"):
        load_model(tmp_path / "c.pth", trusted_targets=["operator; rm -rf"])


def test_the_users_own_package_loads_once_trusted(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(PROJECT))
    cfg = _compose("model=residual_mlp", "trainer.max_epochs=1", f"hydra.searchpath=[file://{PROJECT / 'conf'}]")
    build_runner(cfg, tmp_path).run()
    with pytest.raises(UntrustedTargetError, match=r"model\._target_='my_project\.models\.ResidualMLP'"):
        load_model(tmp_path)
    by_package = load_model(tmp_path, trusted_targets=["my_project"])
    assert TrustPolicy("my_project").user == ("my_project",)  # (trusted_targets=my_project: one name, not 10 letters)
    assert type(load_model(tmp_path, trusted_targets="my_project")).__name__ == "ResidualMLP"
    by_config_dir = load_model(tmp_path, config_dirs=[PROJECT / "conf"])  # the targets your YAML files name
    assert type(by_package).__name__ == type(by_config_dir).__name__ == "ResidualMLP"


@pytest.mark.slow
def test_eval_command_trusts_a_package_or_a_config_dir(tmp_path):
    env = {"PYTHONPATH": str(PROJECT), "PATH": "/usr/bin:/bin"}
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "expkit.train",
            "--config-dir",
            "conf",
            "model=residual_mlp",
            "trainer.max_epochs=1",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert train.returncode == 0, train.stderr
    base = [sys.executable, "-m", "expkit.eval", f"checkpoint={tmp_path / 'run'}"]
    refused = subprocess.run(
        [*base, f"work_dir={tmp_path / 'e0'}"], cwd=PROJECT, env=env, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "trusted_targets=[my_project]" in refused.stderr
    for i, extra in enumerate([["trusted_targets=[my_project]"], ["--config-dir", "conf"]]):
        proc = subprocess.run(
            [*base, *extra, f"work_dir={tmp_path / f'e{i + 1}'}"], cwd=PROJECT, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / f"e{i + 1}" / "result.json").is_file()
    # one trust rule for every command that reads a checkpoint: predict and export honour --config-dir too
    import numpy as np
    from sklearn.datasets import load_digits

    np.save(tmp_path / "x.npy", load_digits().data[:3].astype(np.float32))
    for command, args in (
        ("predict", [f"input={tmp_path / 'x.npy'}", f"output={tmp_path / 'p.csv'}"]),
        ("export", [f"out={tmp_path / 'm.safetensors'}"]),
    ):
        line = [
            sys.executable,
            "-m",
            f"expkit.{command}",
            f"checkpoint={tmp_path / 'run'}",
            *args,
            f"hydra.run.dir={tmp_path / command}",
        ]
        refused = subprocess.run(line, cwd=PROJECT, env=env, capture_output=True, text=True)
        assert refused.returncode == 2 and "trusted_targets=[my_project]" in refused.stderr, refused.stderr
        assert "expkit.eval, predict or export" in refused.stderr
        proc = subprocess.run(
            [line[0], *line[1:3], "--config-dir", "conf", *line[3:]],
            cwd=PROJECT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "p.csv").is_file() and (tmp_path / "m.safetensors").is_file()


def test_every_shipped_config_is_trusted():
    """Ordinary checkpoints load as before: every option of every shipped group passes the check."""
    policy = TrustPolicy()
    groups = ["model", "data", "optim", "sched", "logger", "hooks", "experiment", "hparams_search", "debug"]
    checked = 0
    for group in groups:
        for option in available_options(group, [CONF_DIR]):
            value = f"[{option}]" if group in ("hooks", "logger") else option
            cfg = _compose(f"{group}={value}")
            policy.check(OmegaConf.to_container(cfg, resolve=True), f"{group}={option}")
            checked += 1
    assert checked >= 30


@pytest.mark.slow
def test_a_sweep_summary_never_builds_a_run_dirs_config(tmp_path):
    """A copied sweep dir's .hydra/config.yaml is read as data (a safe YAML loader), never built."""
    marker = tmp_path / "marker"
    job = tmp_path / "sweep" / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text(
        f"monitor: !!python/object/apply:os.system ['touch {marker}']\n"
        f"model: {{_target_: subprocess.Popen, args: [touch, {marker}]}}\n"
    )
    (job / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "expkit.sweep", str(tmp_path / "sweep")], cwd=REPO, capture_output=True, text=True
    )
    assert not marker.exists(), proc.stderr
