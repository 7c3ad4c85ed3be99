"""Test your own hooks the way expkit tests its own: a toy runner that trains in milliseconds,
small seeded loaders, and a hook that records every stage it sees.

    from expkit.testing import RecordingHook, toy_runner

    def test_my_hook_counts_iterations(tmp_path):
        hook = MyCountingHook()
        result = toy_runner(tmp_path, hooks={"count": hook}, max_epochs=2).run()
        assert result["status"] == "completed" and hook.count == 4   # 8 samples, batch 4, 2 epochs

    def test_my_hook_runs_before_the_logger(tmp_path):
        seen = []
        toy_runner(tmp_path, hooks={"mine": MyHook(), "after": RecordingHook("rec", seen)}).run()
        assert seen[0] == "rec.before_run"

Everything here is real: a real ``Runner`` with the six default hooks (curves.svg off), real
checkpoints, metrics.jsonl and result.json in ``work_dir`` (``tmp_path``); resume with
``toy_runner(tmp_path, resume=True, ...)``. MMEngine's ``RunnerTestCase`` is the model.

Your whole experiment, as you train it, proven reproducible and resumable bit for bit
(``python -m expkit.check`` run from a test)::

    from expkit.testing import assert_resumes_exactly

    def test_my_experiment_resumes_exactly(tmp_path):
        assert_resumes_exactly("experiment=my_exp", config_dir="conf", scratch=tmp_path)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from expkit.core.settings import TrainerSettings
from expkit.core.stages import Stage
from expkit.engine.runner import Runner
from expkit.hooks import default_hooks as _make_default_hooks
from expkit.hooks.base import Hook
from expkit.samplers import SeededRandomSampler

__all__ = ["RecordingHook", "assert_resumes_exactly", "toy_loaders", "toy_model", "toy_runner"]


def toy_loaders(
    n_train: int = 8, n_val: int = 4, n_test: int = 4, batch_size: int = 4, seed: int = 0
) -> tuple[DataLoader, DataLoader | None, DataLoader | None]:
    """(train, val, test) loaders of 4-feature points labelled by the sign of the first feature;
    the same data every call, the train order a function of `seed` (as on resume). A size of
    0 gives None for val or test.

    Args:
        n_train: the number of training points.
        n_val: the number of validation points (0: no validation loader).
        n_test: the number of test points (0: no test loader).
        batch_size: the batch size of every loader.
        seed: the seed of the train order (a ``SeededRandomSampler``).

    Returns:
        The train loader, then the validation and test loaders (each None when its size is 0).
    """
    g = torch.Generator().manual_seed(123)

    def points(n: int) -> TensorDataset:
        x = torch.randn(n, 4, generator=g)
        return TensorDataset(x, (x[:, 0] > 0).long())

    train = points(n_train)
    return (
        DataLoader(train, batch_size=batch_size, sampler=SeededRandomSampler(train, seed)),
        DataLoader(points(n_val), batch_size=batch_size) if n_val else None,
        DataLoader(points(n_test), batch_size=batch_size) if n_test else None,
    )


def toy_model() -> nn.Module:
    """Linear 4-8, ReLU, Linear 8-2: the toy loaders' classifier.

    Returns:
        A new, randomly initialised ``nn.Sequential`` (torch's global generator draws its weights).
    """
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def toy_runner(
    work_dir: str | Path,
    *,
    hooks: Mapping[str, Hook] | Sequence[Hook] = (),
    default_hooks: Mapping[str, Hook] | None = None,
    seed: int = 0,
    metrics: Any = None,
    monitor: str | None = None,
    model: nn.Module | None = None,
    **settings: Any,
) -> Runner:
    """A Runner over the toy loaders and model (SGD, lr 0.1), 2 epochs unless `settings` say
    otherwise (any ``TrainerSettings`` field: ``max_epochs=3``, ``max_iters=5``, ...; and
    ``resume=True`` or ``load_from=<checkpoint>``). The default hooks are the six defaults
    with curves.svg off.

    Args:
        work_dir: the run's work dir (e.g. pytest's ``tmp_path``).
        hooks: the hooks to add, by name or as a list (named by their class).
        default_hooks: the default hooks by name; None: the six defaults with curves.svg off.
        seed: the run's seed (``TrainerSettings.seed``); torch's global generator is seeded with
            it before the model is built.
        metrics: the run's metrics, as the Runner takes them; None: the Runner's default (``acc``).
        monitor: the monitored metric key (the Runner's ``monitor``); None: the Runner's default.
        model: the model to train; None: a new ``toy_model()``.
        **settings: ``TrainerSettings`` fields (``seed`` is set here; ``device`` is ``cpu`` unless
            given), and ``resume`` and ``load_from``, which go to the Runner.

    Returns:
        The Runner, ready to ``run()``.
    """
    from expkit.hooks import LoggerHook

    torch.manual_seed(seed)
    model = model if model is not None else toy_model()
    train, val, test = toy_loaders()  # the data order is config, the same on resume
    resume, load_from = settings.pop("resume", False), settings.pop("load_from", None)
    if default_hooks is None:  # the six defaults, without drawing curves.svg in every test
        default_hooks = _make_default_hooks(logger=LoggerHook(plot=False))
    settings.setdefault("max_epochs", 2)
    settings.setdefault("device", "cpu")
    return Runner(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        train_loader=train,
        val_loader=val,
        test_loader=test,
        settings=TrainerSettings(seed=seed, **settings),
        work_dir=work_dir,
        hooks=hooks,
        default_hooks=default_hooks,
        resume=resume,
        load_from=load_from,
        metrics=metrics,
        monitor=monitor,
    )


class RecordingHook(Hook):
    """Overrides every stage and appends ``"<label>.<stage>"`` to `log` when it fires: the
    order hooks and stages run in, for asserting on (``priority`` as for any hook).

    Args:
        label: the hook's label in the entries it appends.
        log: the list the entries are appended to.
        priority: the hook's priority; None keeps the ``Hook`` default.
    """

    def __init__(self, label: str, log: list[str], priority: Any = None) -> None:
        self.label = label
        self.log = log
        if priority is not None:
            self.priority = priority  # type: ignore[misc]


def _recording(stage: str) -> Any:
    def method(self: RecordingHook, runner: Runner, **payload: Any) -> None:
        self.log.append(f"{self.label}.{stage}")

    method.__name__ = stage
    return method


for _stage in Stage:
    setattr(RecordingHook, _stage.value, _recording(_stage.value))


def assert_resumes_exactly(
    *overrides: str,
    config_dir: str | Path | None = None,
    iters: int | None = None,
    scratch: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 1800,
) -> dict[str, Any]:
    """Run ``python -m expkit.check`` on the experiment the `overrides` (and `config_dir`) make, as
    ``expkit.train`` would train it, and fail with the check's table and findings unless two runs
    from the same seed match bit for bit and a run killed mid-epoch resumes exactly. `iters`:
    ``check.iters``; `scratch`: where the runs go (e.g. pytest's ``tmp_path``); `env`: added to the
    environment (``PYTHONPATH`` for your package). Returns the report (check.json).

    Args:
        *overrides: the overrides you train with (``experiment=my_exp``, ``data.batch_size=8``, ...).
        config_dir: your config dir, passed as ``--config-dir``; None: expkit's own configs only.
        iters: the iterations each run of the check trains (``check.iters``); None: the check's default.
        scratch: where the check's runs go (``check.dir``); None: a temporary dir.
        env: variables added to the check's environment.
        timeout: the longest the check may take, in seconds.

    Returns:
        The check's report (check.json): ``ok``, the budget, the rows and findings, and timings.

    Raises:
        AssertionError: when the check exits non-zero (a divergence, bad input or a failed run)
            or writes no report; the message holds its output.
        subprocess.TimeoutExpired: when the check runs longer than `timeout`.
    """
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="expkit-check-report-") as tmp:
        report = Path(tmp) / "check.json"
        command = [sys.executable, "-m", "expkit.check", *overrides, f"check.out={report}"]
        if config_dir is not None:
            command[3:3] = ["--config-dir", str(config_dir)]
        if iters is not None:
            command.append(f"check.iters={iters}")
        if scratch is not None:
            command.append(f"check.dir={scratch}")
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
        output = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("["))
        if proc.returncode != 0 or not report.exists():
            raise AssertionError(f"python -m expkit.check {' '.join(overrides)} exited {proc.returncode}:\n{output}")
        return json.loads(report.read_text())
