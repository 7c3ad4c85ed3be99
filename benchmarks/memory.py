"""Memory: peak RSS of the default run (python -m expkit.train) against a hand-written loop
training the same model on the same data, each in its own process. Target: <= 1.2x. The
hand-written side imports nothing from expkit.

    python benchmarks/memory.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

from _handwritten import MLP, READ_DIGITS

HAND = (
    READ_DIGITS
    + f"""
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
order = torch.randperm(len(y))  # expkit's split: 70% train, 15% val, 15% test
n_train, n_val = int(0.7 * len(y)), int(0.15 * len(y))
train_idx, val_idx = order[:n_train], order[n_train:n_train + n_val]
train = DataLoader(TensorDataset(x[train_idx], y[train_idx]), batch_size=32, shuffle=True)
val = DataLoader(TensorDataset(x[val_idx], y[val_idx]), batch_size=32)
model = {MLP}
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
for epoch in range(EPOCHS):
    for xb, yb in train:
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.save({{"state_dict": model.state_dict(), "optimizer": opt.state_dict()}}, "/dev/null")
    with torch.no_grad():
        acc = sum((model(xb).argmax(-1) == yb).sum().item() for xb, yb in val)
"""
)


WRAP = """
import resource, runpy, sys
target, sys.argv = sys.argv[1], sys.argv[1:]
try:
    if target == "-c":
        exec(compile(sys.argv[1], "<hand>", "exec"), {"__name__": "__main__"})
    else:
        runpy.run_module(target, run_name="__main__")
except SystemExit:
    pass
finally:
    print(f"PEAK_RSS_KB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True)
"""


def peak_rss_mb(args: list[str]) -> float:
    """The process's own peak RSS, reported from inside it at exit."""
    out = subprocess.run([sys.executable, "-c", WRAP, *args], capture_output=True, text=True, check=True).stdout
    return next(int(line.split()[1]) for line in out.splitlines() if line.startswith("PEAK_RSS_KB")) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="1 epoch, for CI: checks the script runs")
    epochs = 1 if parser.parse_args().quick else 20
    hand = peak_rss_mb(["-c", HAND.replace("EPOCHS", str(epochs))])
    with tempfile.TemporaryDirectory() as tmp:
        ours = peak_rss_mb(["expkit.train", f"trainer.max_epochs={epochs}", f"hydra.run.dir={tmp}/run"])
    print(
        f"peak RSS: hand-written {hand:.0f} MB, expkit default run {ours:.0f} MB, ratio {ours / hand:.2f}"
        "   (target <= 1.2)"
    )


if __name__ == "__main__":
    main()
