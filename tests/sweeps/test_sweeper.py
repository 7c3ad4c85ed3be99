"""hydra/sweeper=expkit (the default): Hydra's BasicSweeper composing each in-process job once.

Real sweeps in a subprocess; compositions are counted by wrapping Hydra's own
ConfigLoaderImpl.load_configuration in that process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

COUNTING = """
import sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl
calls = []
original = ConfigLoaderImpl.load_configuration
def counted(self, *args, **kwargs):
    calls.append(1)
    return original(self, *args, **kwargs)
ConfigLoaderImpl.load_configuration = counted
sys.argv = ["expkit.train", *sys.argv[1:]]
from expkit.train import main
try:
    main()
finally:
    print(f"COMPOSITIONS {len(calls)}", flush=True)
"""


def _python(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def _sweep(tmp_path: Path, *overrides: str) -> tuple[int, subprocess.CompletedProcess]:
    proc = _python("-c", COUNTING, "-m", *overrides, "debug=fast", f"hydra.sweep.dir={tmp_path}")
    out = proc.stdout + proc.stderr
    counts = [int(line.split()[1]) for line in out.splitlines() if line.startswith("COMPOSITIONS")]
    assert counts, out
    return counts[0], proc


def _completed(sweep: Path, jobs: int) -> None:
    for job in range(jobs):
        assert json.loads((sweep / str(job) / "result.json").read_text())["status"] == "completed"


def test_each_job_is_composed_once_and_the_jobs_still_differ(tmp_path):
    ours, proc = _sweep(tmp_path / "expkit", "optim.lr=0.1,0.01,0.001")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hydras, proc = _sweep(tmp_path / "basic", "optim.lr=0.1,0.01,0.001", "hydra/sweeper=basic")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Hydra composes twice before the sweep (get_mode, then the sweep's own config); then
    # BasicSweeper composes each job to check it and BasicLauncher composes it again.
    assert hydras == 2 + 2 * 3
    assert ours == 2 + 3
    _completed(tmp_path / "expkit", 3)
    _completed(tmp_path / "basic", 3)
    for job, lr in enumerate(("0.1", "0.01", "0.001")):  # each job got its own config, not another's
        config = (tmp_path / "expkit" / str(job) / ".hydra" / "config.yaml").read_text()
        assert f"lr: {lr}\n" in config


def test_a_job_that_cannot_compose_stops_the_sweep_before_any_job_trains(tmp_path):
    # model.hidden exists for the MLP only: the cnn job fails to compose, and the check
    # (kept from BasicSweeper) finds it before job 0 trains.
    _, proc = _sweep(tmp_path, "model=mlp,cnn", "model.hidden=[8]")
    assert proc.returncode != 0
    assert "hidden" in proc.stdout + proc.stderr
    assert not (tmp_path / "0" / "result.json").exists()


def test_other_launchers_compose_as_hydra_does(tmp_path):
    count, proc = _sweep(tmp_path, "optim.lr=0.1,0.01", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _completed(tmp_path, 2)
    assert count == 2 + 2  # the check here; each job is composed again in its joblib worker


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["optim.lr=0.1,abc"], "optim.lr='abc' is not a number; give one, e.g. optim.lr="),
        (["optim.lr=0.1,nan", "hydra/launcher=joblib"], "optim.lr=nan is not a finite number"),
        (["optim._target_=torch.optim.SGD,torch.optim.Sgd"], "optim._target_='torch.optim.Sgd' cannot be imported"),
        (["data.num_workers=0,x"], "data.num_workers='x' is not a number"),  # (DigitsData's **kwargs: DataModule's)
    ],
)
def test_a_value_its_run_would_refuse_stops_the_sweep_before_any_job_trains(tmp_path, overrides, said):
    # the grid's last value is a typo: found before job 0 trains, not when its own job runs
    proc = _python("-m", "expkit.train", "-m", *overrides, "debug=fast", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "(the sweep's job " in proc.stderr and "no job of this batch was started" in proc.stderr
    assert not (tmp_path / "0").exists()


def test_another_hydra_app_on_the_expkit_sweeper_keeps_hydras_habits(tmp_path):
    # p=inf is a real argument of PairwiseDistance: expkit's own rules (no non-finite number) are
    # for expkit's commands, whose runs apply them too
    app = tmp_path / "app.py"
    app.write_text(
        "import hydra\nfrom hydra.utils import instantiate\n\n"
        "@hydra.main(version_base=None, config_path=None, config_name=None)\n"
        "def main(cfg):\n    print('built', instantiate(cfg.dist).norm)\n\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    proc = _python(
        str(app),
        "-m",
        "+dist={_target_:torch.nn.PairwiseDistance,p:2.0}",
        "dist.p=1.0,inf",
        "hydra/sweeper=expkit",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "built 1.0" in proc.stdout and "built inf" in proc.stdout
