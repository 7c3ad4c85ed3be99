"""expkit.testing, as a user tests a hook of their own with it."""

from __future__ import annotations

import json

from expkit import Hook
from expkit.testing import RecordingHook, toy_loaders, toy_runner


class CountIterations(Hook):
    """A user's hook: counts the training iterations and writes the count into result's work dir."""

    def __init__(self) -> None:
        self.count = 0

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        self.count += 1

    def after_train(self, runner):
        (runner.work_dir / "count.json").write_text(json.dumps(self.count))


def test_a_users_hook_runs_in_the_toy_runner_and_its_order_is_recorded(tmp_path):
    seen: list[str] = []
    hook = CountIterations()
    result = toy_runner(
        tmp_path, hooks={"count": hook, "rec": RecordingHook("rec", seen, priority="LOWEST")}, max_epochs=3
    ).run()
    assert result["status"] == "completed" and hook.count == 6  # 8 samples, batch 4, 3 epochs
    assert json.loads((tmp_path / "count.json").read_text()) == 6
    assert seen[0] == "rec.before_run" and seen[-1] == "rec.after_run"
    assert seen.count("rec.after_train_iter") == 6 and seen.count("rec.after_val_epoch") == 3


def test_the_toy_loaders_are_the_same_every_call_and_seeded_in_order():
    a, b = toy_loaders(), toy_loaders()
    assert all((x == y).all() for (x, _), (y, _) in zip(a[1], b[1]))  # the same validation data
    first = [batch[1].tolist() for batch in toy_loaders(seed=1)[0]]
    assert first == [batch[1].tolist() for batch in toy_loaders(seed=1)[0]]
    assert first != [batch[1].tolist() for batch in toy_loaders(seed=2)[0]] or len(first) == 1
