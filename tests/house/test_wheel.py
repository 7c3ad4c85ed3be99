"""The package works from a built wheel, outside the repo: the configs ship inside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def test_wheel_contains_the_configs_and_runs_outside_the_repo(tmp_path):
    dist, site, work = tmp_path / "dist", tmp_path / "site", tmp_path / "run"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(REPO)], check=True)
    (wheel,) = dist.glob("expkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for config in (
        "expkit/conf/train.yaml",
        "expkit/conf/hooks/ema.yaml",
        "expkit/conf/model/cnn.yaml",
        "hydra_plugins/expkit_sweeper/expkit_sweeper.py",
        "hydra_plugins/expkit_sweeper/optuna_sweeper.py",
    ):
        assert config in names
    assert "hydra_plugins/__init__.py" not in names  # a namespace package, shared with Hydra's other plugins
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)

    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "import expkit; print(expkit.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.strip().startswith(str(site))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "expkit.train",
            f"hydra.run.dir={work}",
            "model=cnn",
            "hooks=[ema]",
            "trainer.max_epochs=1",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((work / "result.json").read_text())["status"] == "completed"

    # the expkit-train command imports expkit.train instead of running it with -m: Hydra then
    # looks the configs up as the package expkit.conf
    command = site / "bin" / "expkit-train"
    proc = subprocess.run(
        [str(command), f"hydra.run.dir={work}_cmd", "debug=fast"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "run_cmd" / "result.json").read_text())["status"] == "completed"
