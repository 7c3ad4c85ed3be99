"""Start-up: wall time from process start to the first training iteration of
``python -m expkit.train``, against ``python -c "import torch"`` and a hand-written script
that imports torch, builds the same model and optimizer and takes its first batch.
Interleaved rounds; medians and ratios printed. Target: expkit.train <= 1.10x the hand-written
script (expkit's own share under 0.4 s).

The hand-written script imports nothing from expkit: it reads the digits as expkit does (the
CSV inside scikit-learn, without importing scikit-learn), builds the same model and SGD, and
takes its first batch. It is the floor any training script pays: building a torch.optim
optimizer imports torch._dynamo (its methods are wrapped by torch._disable_dynamo, and
``Optimizer.step`` imports it on every call), about 1.5-2 s here. expkit / hand-written is
the framework's own share: Hydra's import and composition, and the build.

    python benchmarks/startup.py [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _handwritten import MLP, READ_DIGITS

FIRST_ITER_HOOK = """
import os, time
from expkit import Hook

class FirstIter(Hook):
    def before_train_iter(self, runner, *, batch_idx, data_batch):
        print(f"FIRST_ITER {time.time()}", flush=True)
        os._exit(0)
"""

HAND = (
    READ_DIGITS
    + f"""
import time
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
train = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
model = {MLP}
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, y = next(iter(train))
print(f"FIRST_ITER {{time.time()}}", flush=True)
"""
)

# the same script as a Hydra app of its own (one small config, Hydra's run dir and job log): the
# floor of any Hydra app on this Hydra line, to tell Hydra's share of expkit's from expkit's own
HYDRA_APP = (
    "import hydra\n\n\n"
    '@hydra.main(version_base=None, config_path="hydra_app_conf", config_name="config")\n'
    "def main(cfg):\n"
    + "".join(
        f"    {line}\n"
        for line in HAND.replace("lr=0.1", "lr=cfg.lr")
        .replace("batch_size=32", "batch_size=cfg.batch_size")
        .splitlines()
        if line
    )
    + "\n\nmain()\n"
)


def _until_first_iter(command: list[str], env: dict | None = None) -> float:
    start = time.time()
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout
    marks = [float(line.split()[1]) for line in out.splitlines() if line.startswith("FIRST_ITER")]
    return (marks[0] if marks else time.time()) - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one round, for CI: checks the script runs")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1
    import os

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "conf" / "hooks").mkdir(parents=True)
        (tmp_path / "conf" / "hooks" / "first_iter.yaml").write_text("first_iter:\n  _target_: firstiter.FirstIter\n")
        (tmp_path / "firstiter.py").write_text(FIRST_ITER_HOOK)
        (tmp_path / "hydra_app_conf").mkdir()
        (tmp_path / "hydra_app_conf" / "config.yaml").write_text("lr: 0.1\nbatch_size: 32\n")
        (tmp_path / "hydra_app.py").write_text(HYDRA_APP)
        # as on a user's machine: Python caches compiled modules (this VM's tools set
        # PYTHONDONTWRITEBYTECODE=1, which recompiles every module of an editable install on
        # every start); a round that is not counted writes the caches first
        base_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env = {**base_env, "PYTHONPATH": tmp}
        sides = {
            "import torch": lambda r: _until_first_iter([sys.executable, "-c", "import torch"], base_env),
            "hand-written": lambda r: _until_first_iter([sys.executable, "-c", HAND], base_env),
            "Hydra app": lambda r: _until_first_iter(
                [sys.executable, str(tmp_path / "hydra_app.py"), f"hydra.run.dir={tmp_path / f'app{r}'}"], base_env
            ),
            "expkit.train": lambda r: _until_first_iter(
                [
                    sys.executable,
                    "-m",
                    "expkit.train",
                    "--config-dir",
                    str(tmp_path / "conf"),
                    "hooks=[first_iter]",
                    "trainer.max_epochs=1",
                    f"hydra.run.dir={tmp_path / f'run{r}'}",
                ],
                env,
            ),
        }
        times: dict[str, list[float]] = {k: [] for k in sides}
        for name, fn in sides.items():
            fn(-1)  # warm-up: byte-code caches, the OS page cache
        for r in range(args.rounds):
            for name, fn in sides.items():
                times[name].append(fn(r))
    base = statistics.median(times["import torch"])
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"{name:<14} min {min(values):.2f} s  median {median:.2f} s  ({median / base:.2f}x import torch)   runs: "
            + " ".join(f"{v:.2f}" for v in values)
        )
    hand, ours = times["hand-written"], times["expkit.train"]
    print(
        f"expkit.train / hand-written: min/min {min(ours) / min(hand):.2f}x, median/median "
        f"{statistics.median(ours) / statistics.median(hand):.2f}x "
        f"(the framework's own share: {statistics.median(ours) - statistics.median(hand):.2f} s)"
    )
    app = times["Hydra app"]
    print(
        f"Hydra app / hand-written: min/min {min(app) / min(hand):.2f}x, median/median "
        f"{statistics.median(app) / statistics.median(hand):.2f}x (Hydra's floor); expkit.train / Hydra app: "
        f"min/min {min(ours) / min(app):.2f}x, median/median {statistics.median(ours) / statistics.median(app):.2f}x"
    )
    print("target: expkit.train <= 1.10x hand-written, share < 0.4 s (to the first training iteration)")


if __name__ == "__main__":
    main()
