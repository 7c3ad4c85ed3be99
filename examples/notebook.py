"""expkit from Python, without Hydra: build the objects yourself and hand them to a Runner.

python examples/notebook.py [work dir]
"""

from __future__ import annotations

import sys

import torch

from expkit import Hook, Priority, Runner, TrainerSettings, default_hooks
from expkit.data import DigitsData
from expkit.hooks import EarlyStoppingHook, EMAHook, LoggerHook
from expkit.models import CNN


class CountBatches(Hook):
    """A hook defined right here: counts training batches per epoch."""

    priority = Priority.LOW

    def __init__(self) -> None:
        self.per_epoch: list[int] = []

    def before_train_epoch(self, runner) -> None:
        self.per_epoch.append(0)

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs) -> None:
        self.per_epoch[-1] += 1


def main(work_dir: str = "outputs/notebook") -> dict:
    torch.manual_seed(0)
    train, val, test = DigitsData(batch_size=64).loaders()
    model = CNN(in_channels=1, image_size=8, num_classes=10)
    counter = CountBatches()
    runner = Runner(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
        train_loader=train,
        val_loader=val,
        test_loader=test,
        settings=TrainerSettings(max_epochs=6, device="cpu"),
        default_hooks=default_hooks(logger=LoggerHook(interval=20, plot=False)),
        hooks={
            "ema": EMAHook(momentum=0.05),
            "early_stopping": EarlyStoppingHook("val/acc", patience=3),
            "count": counter,
        },
        work_dir=work_dir,
    )
    print(runner.hook_order_table())
    result = runner.run()
    print("batches per epoch:", counter.per_epoch)
    print("status:", result["status"], "| final:", result["final_metrics"])
    return result


if __name__ == "__main__":
    main(*sys.argv[1:])
