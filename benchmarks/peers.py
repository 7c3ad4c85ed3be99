"""Whole runs side by side: a raw PyTorch loop, expkit, Lightning and MMEngine on one workload.

The peer workload: MLP 64-256-256-10 on scikit-learn's digits (1,257 training and 270
validation images, the same split for everyone), batch 32, SGD (lr 0.1, momentum 0.9), 20
epochs with a validation (loss and accuracy) after each, one torch thread, on the CPU. Each
variant runs in its own fresh process; the time is the wall time of the run itself, after
imports and set-up: the raw loop's loops, ``Runner.run()`` (expkit), ``trainer.fit()``
(Lightning), ``runner.train()`` (MMEngine). Rounds are interleaved (every variant once per
round, in a balanced order: ``_table.round_order``, whose cycle is twice the number of variants,
so 7 rounds of 4 are one short of a whole one) and the table gives every round, the minimum and
the median, and each one's ratio to the raw loop (min/min and median/median). A run's work
dir is deleted as soon as it ends: its files would otherwise be written back by the kernel about
30 s later (the raw loop leaves 13.5 MB of checkpoints dirty), in the middle of another run.

Each framework runs with its defaults, as a user gets them: a checkpoint every epoch and
the training loss logged (expkit: metrics.jsonl every 10 iterations and the last/best
checkpoints; Lightning: its checkpoint callback and default logger, progress bar and model
summary off; MMEngine: its default hooks, checkpoint every epoch). The raw loop does the same
work by hand: the mean loss every 10 iterations to a JSON-lines file and a checkpoint (model
and optimizer) after every validation. A second hand-written side, "raw loop, resumable", saves
what expkit's default checkpoint guarantees, written the shortest way by hand: the RNG states of
torch, NumPy and Python beside the weights and optimizer (an exact resume), through a temporary
file and a rename (never a torn file), a ``last_checkpoint`` pointer, and only the newest two
epochs kept; a second table gives each side against it. The promise (at most 1.05x) is against
the plain raw loop. "raw loop, again" is the raw loop's own program once more, a variant of its
own in the rounds: what it reads against the raw loop is this invocation's noise (an A/A
control; two runs of the same program differ by several percent on a shared machine), the
resolution that expkit's ratio in the same table has. The last line says what this invocation can
tell of the promise at its own noise (``_table.verdict``; one control is one sample of the noise,
not a bound): within, over, or undecided when expkit's min/min ratio lies within that resolution
of 1.05x. On a quiet machine the control reads within 1-2% (2026-11-30: 0.986x,
0.983x, 1.008x, 0.999x min/min), on a busy one it moved by up to 15%.

``--hosted`` adds "raw loop in a Runner": the raw loop's own body run from a ``before_train``
hook of a Runner built as expkit's side builds it (the Runner then stops before its first
epoch). Its ratio to the raw loop is what expkit's process (its imports, the Runner's start, its
state in memory) does to the same loop, apart from anything expkit runs during training.

    python benchmarks/peers.py [--rounds 7] [--epochs 20] [--hosted] [--quick]

Lightning and MMEngine come from the optional ``bench`` extra
(``.venv/bin/pip install -e '.[bench]' -c constraints.txt``); a missing one is skipped with
that command printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _handwritten import MLP, READ_DIGITS
from _table import ratio_table, round_order, verdict

COMMON = (
    READ_DIGITS
    + f"""
import json, sys, time
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
torch.set_num_threads(1)
torch.manual_seed(0)
EPOCHS, WORK = int(sys.argv[1]), sys.argv[2]
order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
n_train, n_val = int(0.7 * len(y)), int(0.15 * len(y))
train_set = TensorDataset(x[order[:n_train]], y[order[:n_train]])
val_set = TensorDataset(x[order[n_train:n_train + n_val]], y[order[n_train:n_train + n_val]])
train = DataLoader(train_set, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
val = DataLoader(val_set, batch_size=32)
def make_net():
    return {MLP}
def report(seconds, accuracy):
    print(f"RESULT {{seconds}} {{accuracy}}", flush=True)
"""
)

RAW = (
    COMMON
    + """
model = make_net()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
log = open(f"{WORK}/metrics.jsonl", "w")
start, step, losses = time.perf_counter(), 0, []
for epoch in range(EPOCHS):
    model.train()
    for xb, yb in train:
        loss = F.cross_entropy(model(xb), yb)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        losses.append(loss.detach()); step += 1
        if step % 10 == 0:
            log.write(json.dumps({"step": step, "train/loss": torch.stack(losses).mean().item()}) + "\\n"); losses = []
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for xb, yb in val:
            logits = model(xb)
            loss_sum += F.cross_entropy(logits, yb, reduction="sum").item()
            correct += (logits.argmax(-1) == yb).sum().item(); total += len(yb)
    log.write(json.dumps({"step": step, "val/loss": loss_sum / total, "val/acc": correct / total}) + "\\n"); log.flush()
    SAVE
report(time.perf_counter() - start, correct / total)
"""
)
PLAIN_SAVE = (
    'torch.save({"state_dict": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1}, '
    'f"{WORK}/epoch_{epoch + 1}.pth")'
)
# what expkit's default checkpoint guarantees, by hand: exact resume (RNG states), no torn file
# (temporary file + rename), a pointer to the newest, the newest two kept (max_keep_ckpts=2)
RESUMABLE_SAVE = """rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    name = f"epoch_{epoch + 1}.pth"
    torch.save({"state_dict": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1, "rng": rng},
               f"{WORK}/.{name}.tmp")
    os.replace(f"{WORK}/.{name}.tmp", f"{WORK}/{name}")
    with open(f"{WORK}/.last_checkpoint.tmp", "w") as f:
        f.write(name)
    os.replace(f"{WORK}/.last_checkpoint.tmp", f"{WORK}/last_checkpoint")
    if epoch >= 2:
        os.unlink(f"{WORK}/epoch_{epoch - 1}.pth")"""
RAW_RESUMABLE = "import os, random\n" + RAW.replace("SAVE\n", RESUMABLE_SAVE + "\n")  # (np: READ_DIGITS's)
RAW = RAW.replace("SAVE\n", PLAIN_SAVE + "\n")

EXPKIT = (
    COMMON
    + """
import logging
logging.basicConfig(level=logging.WARNING)
from expkit import Runner, TrainerSettings
model = make_net()
runner = Runner(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                train_loader=train, val_loader=val, work_dir=WORK,
                settings=TrainerSettings(max_epochs=EPOCHS, device="cpu", seed=None))
start = time.perf_counter()
result = runner.run()
report(time.perf_counter() - start, result["final_metrics"]["val/acc"])
"""
)

LIGHTNING = (
    COMMON
    + """
import logging, warnings
warnings.filterwarnings("ignore")
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
import lightning as L

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_net()
    def training_step(self, batch, batch_idx):
        xb, yb = batch
        loss = F.cross_entropy(self.net(xb), yb)
        self.log("train/loss", loss)
        return loss
    def validation_step(self, batch, batch_idx):
        xb, yb = batch
        logits = self.net(xb)
        self.log("val/loss", F.cross_entropy(logits, yb))
        self.log("val/acc", (logits.argmax(-1) == yb).float().mean())
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, default_root_dir=WORK,
                    enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=10)
module = Net()
start = time.perf_counter()
trainer.fit(module, train, val)
report(time.perf_counter() - start, float(trainer.callback_metrics["val/acc"]))
"""
)

MMENGINE = (
    COMMON
    + """
import logging, warnings
warnings.filterwarnings("ignore")
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.runner import Runner

class Net(BaseModel):
    def __init__(self):
        super().__init__()
        self.net = make_net()
    def forward(self, inputs, labels, mode="tensor"):
        logits = self.net(inputs)
        if mode == "loss":
            return {"loss": F.cross_entropy(logits, labels)}
        if mode == "predict":
            return [(logits, labels)]
        return logits

class Accuracy(BaseMetric):
    def process(self, data_batch, data_samples):
        for logits, labels in data_samples:
            self.results.append(((logits.argmax(-1) == labels).sum().item(), len(labels)))
    def compute_metrics(self, results):
        return {"acc": sum(r[0] for r in results) / sum(r[1] for r in results)}

runner = Runner(model=Net(), work_dir=WORK, train_dataloader=train, val_dataloader=val, val_evaluator=[Accuracy()],
                train_cfg=dict(by_epoch=True, max_epochs=EPOCHS, val_interval=1), val_cfg=dict(),
                optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9)),
                default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1)),
                log_level="WARNING")
start = time.perf_counter()
runner.train()
report(time.perf_counter() - start, runner.message_hub.get_scalar("val/acc").current()
       if "val/acc" in runner.message_hub.log_scalars else float("nan"))
"""
)

# --hosted: the raw loop's own body run inside a Runner (from a before_train hook, on the Runner's
# model and optimizer; the Runner then stops before its first epoch): what the process that builds and
# starts a Runner does to the raw loop's time, expkit's imports, start and its state in memory included
_BODY = RAW.split("model = make_net()\n", 1)[1].replace(
    "report(time.perf_counter() - start, correct / total)",
    "HOSTED.append((time.perf_counter() - start, correct / total))",
)
HOSTED = (
    EXPKIT.replace(
        "from expkit import Runner, TrainerSettings",
        "from expkit import Hook, Runner, TrainerSettings\nHOSTED = []\nclass Hosted(Hook):\n"
        "    def before_train(self, runner):\n        model, opt = runner.model, runner.optimizer\n"
        + "".join(f"        {line}\n" for line in _BODY.splitlines())
        + "        runner.request_stop('the raw loop ran', resumable=False)\n",
    )
    .replace("settings=TrainerSettings(", "hooks=[Hosted()], settings=TrainerSettings(")
    .replace('report(time.perf_counter() - start, result["final_metrics"]["val/acc"])', "report(*HOSTED[0])")
)

VARIANTS = {
    "raw loop": (RAW, None),
    "raw loop, again": (RAW, None),  # the A/A control: the same program, its ratio is the noise
    "raw loop, resumable": (RAW_RESUMABLE, None),
    "expkit": (EXPKIT, None),
    "Lightning": (LIGHTNING, "lightning"),
    "MMEngine": (MMENGINE, "mmengine"),
}
PROMISE = 1.05  # a whole run at most this multiple of the raw loop's (min/min)
INSTALL = ".venv/bin/pip install -e '.[bench]' -c constraints.txt"


def run_tagged(
    code: str, epochs: int, tmp: Path, tags: tuple[str, ...] = ("RESULT",), keep: bool = True
) -> dict[str, str]:
    """Run a variant in a fresh process, in its own work dir under `tmp`, on one thread; its
    output lines that start with a tag (``RESULT seconds accuracy``), by tag. `keep`: False
    deletes the work dir when the process has ended (its dirty pages go without being written)."""
    work = Path(tempfile.mkdtemp(dir=tmp))
    # as on a user's machine, Python caches compiled modules (this VM's tools set
    # PYTHONDONTWRITEBYTECODE=1: what a run imports lazily would be compiled again every time)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent))
    out = subprocess.run(
        [sys.executable, "-c", code, str(epochs), str(work)],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
        timeout=900,
    )
    if not keep:
        shutil.rmtree(work, ignore_errors=True)  # (a failed run's own error is the one to see)
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in out.stdout.splitlines() if " " in ln}
    if out.returncode != 0 or any(tag not in lines for tag in tags):
        raise RuntimeError(f"exit {out.returncode}: {out.stderr[-2000:]}")
    return lines


def run_once(code: str, epochs: int, tmp: Path, keep: bool = True) -> tuple[float, float]:
    seconds, accuracy = run_tagged(code, epochs, tmp, keep=keep)["RESULT"].split()
    return float(seconds), float(accuracy)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs: checks the script runs (CI)")
    parser.add_argument("--hosted", action="store_true", help="also the raw loop run inside a Runner (see HOSTED)")
    args = parser.parse_args()
    rounds, epochs = (1, 2) if args.quick else (args.rounds, args.epochs)
    variants = {}
    chosen = dict(VARIANTS)
    if args.hosted:
        chosen["raw loop in a Runner"] = (HOSTED, None)
    for name, (code, module) in chosen.items():
        if module is not None and importlib.util.find_spec(module) is None:
            print(f"{name}: not installed, skipped; install it with: {INSTALL}")
            continue
        variants[name] = code
    times: dict[str, list[float]] = {name: [] for name in variants}
    accuracy: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        names = list(variants)
        for name in names:  # not counted: writes the byte-code caches (see run_tagged), as a user's first run does
            run_once(variants[name], 1, tmp, keep=False)
        for r in range(rounds):
            for name in round_order(names, r):
                seconds, accuracy[name] = run_once(variants[name], epochs, tmp, keep=False)
                times[name].append(seconds)
    print(
        f"peer workload: MLP 64-256-256-10, digits, batch 32, SGD, {epochs} epochs with validation, 1 thread, CPU; "
        f"{rounds} interleaved rounds, each variant its own process"
    )
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; {time.strftime('%Y-%m-%d')}"
    )
    print(ratio_table(times, "raw loop", {"val/acc": {name: f"{accuracy[name]:.3f}" for name in times}}))
    print("\nagainst the hand-written loop that saves the same guarantees:")
    print(
        ratio_table({n: t for n, t in times.items() if n not in ("raw loop", "raw loop, again")}, "raw loop, resumable")
    )
    print()
    line = verdict(times, "raw loop", "raw loop, again", "expkit", PROMISE)
    print(line + (" [--quick: 1 round of 2 epochs, not the promise's run]" if args.quick else ""))


if __name__ == "__main__":
    main()
