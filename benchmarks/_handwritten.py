"""Code the benchmarks' hand-written sides run in their own processes. It imports nothing
from expkit, so a hand-written process pays for torch and numpy only."""

# Sets x (N, 1, 8, 8 floats in [0, 1]) and y (N labels): the digits expkit trains on by
# default, read from the CSV inside scikit-learn without importing scikit-learn, as
# expkit.data.load_digits does.
READ_DIGITS = """
import importlib.util
from pathlib import Path
import numpy as np, torch
sklearn_dir = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
table = np.loadtxt(sklearn_dir / "datasets" / "data" / "digits.csv.gz", delimiter=",", dtype=np.float32)
x = torch.from_numpy(table[:, :-1]).reshape(-1, 1, 8, 8) / 16
y = torch.from_numpy(table[:, -1]).long()
"""

# the default model (model=mlp) as plain torch
MLP = "nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))"
