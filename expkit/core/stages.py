"""Where hooks fire (Stage) and in which order (Priority).

The whole run, with every stage marked where it fires:

```text
Runner.run():
    BEFORE_RUN
    if resuming or loading weights:
        read checkpoint -> AFTER_LOAD_CHECKPOINT(checkpoint)   # before it is applied: hooks may edit it
    Runner.train():                                            # only with a train loader and a budget
        BEFORE_TRAIN
        while epochs/iters remain and no stop was requested:
            BEFORE_TRAIN_EPOCH
            for batch_idx, window in windows of accumulate_grad_batches (k) batches:   # one iteration
                BEFORE_TRAIN_ITER(batch_idx, window[0])               # per optimizer step
                for data_batch in window:                             # k micro-batches (1 by default)
                    outputs = forward + loss
                    AFTER_FORWARD(batch_idx, data_batch, outputs)     # per micro-batch
                    (loss * its share of the window's samples).backward()   # DDP syncs on the last only
                    AFTER_BACKWARD(batch_idx, data_batch, outputs)    # per micro-batch
                clip gradients, optimizer.step(), optimizer.zero_grad()    # once per window
                AFTER_OPTIMIZER_STEP(batch_idx, window[-1], outputs)  # per step; outputs["loss"]: the window's
                AFTER_TRAIN_ITER(batch_idx, window[-1], outputs)      # runner.iter += 1 right after;
                                                      # log_steps_only hooks at logging steps only
                (iteration-based: validate here when due)
            AFTER_TRAIN_EPOCH                                  # runner.epoch += 1 right after
            (epoch-based: validate here when due)
        AFTER_TRAIN
    (nothing to train, a val loader: Runner.validate() once)
    test_with=best and a best checkpoint exists:
        read it -> AFTER_LOAD_CHECKPOINT(checkpoint)           # the test uses the best weights
    Runner.test():                                             # only with a test loader
        BEFORE_TEST, BEFORE_TEST_EPOCH,
        per batch BEFORE_TEST_ITER / AFTER_TEST_ITER(outputs),
        AFTER_TEST_EPOCH(metrics), AFTER_TEST
    AFTER_RUN                                                  # always, also after a stop or an error

Runner.validate():   BEFORE_VAL, BEFORE_VAL_EPOCH,
                     per batch BEFORE_VAL_ITER / AFTER_VAL_ITER(outputs),
                     AFTER_VAL_EPOCH(metrics), AFTER_VAL
Runner.save_checkpoint():  BEFORE_SAVE_CHECKPOINT(checkpoint)   # hooks may add keys
                           write to a temporary file, rename
                           AFTER_SAVE_CHECKPOINT(path, is_best, metric)
any exception in the run:  ON_EXCEPTION(exception), then AFTER_RUN, then it propagates
```

Counters follow MMEngine: inside an iteration ``runner.iter`` is the 0-based index of
the current iteration (= iterations completed before it). An iteration is one optimizer
step: with ``trainer.accumulate_grad_batches=k`` it spans k batches, and ``max_iters``,
iteration-based ``val_interval``, per-iteration schedulers, EMA, logging intervals,
iteration checkpoints and every log's ``step`` count steps; ``batch_idx`` is the step's
index in the epoch (the last window of an epoch may be shorter). Inside a train epoch
``runner.epoch`` is the 0-based index of the epoch; in validation both count completed
work.
"""

from __future__ import annotations

import enum

__all__ = ["PRIORITY_CHOICES", "Priority", "Stage", "get_priority", "priority_name"]


class Stage(str, enum.Enum):
    """The mount points. The value is the name of the Hook method that runs there."""

    BEFORE_RUN = "before_run"
    AFTER_LOAD_CHECKPOINT = "after_load_checkpoint"
    BEFORE_TRAIN = "before_train"
    BEFORE_TRAIN_EPOCH = "before_train_epoch"
    BEFORE_TRAIN_ITER = "before_train_iter"
    AFTER_FORWARD = "after_forward"
    AFTER_BACKWARD = "after_backward"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    AFTER_TRAIN_ITER = "after_train_iter"
    AFTER_TRAIN_EPOCH = "after_train_epoch"
    BEFORE_VAL = "before_val"
    BEFORE_VAL_EPOCH = "before_val_epoch"
    BEFORE_VAL_ITER = "before_val_iter"
    AFTER_VAL_ITER = "after_val_iter"
    AFTER_VAL_EPOCH = "after_val_epoch"
    AFTER_VAL = "after_val"
    BEFORE_SAVE_CHECKPOINT = "before_save_checkpoint"
    AFTER_SAVE_CHECKPOINT = "after_save_checkpoint"
    AFTER_TRAIN = "after_train"
    BEFORE_TEST = "before_test"
    BEFORE_TEST_EPOCH = "before_test_epoch"
    BEFORE_TEST_ITER = "before_test_iter"
    AFTER_TEST_ITER = "after_test_iter"
    AFTER_TEST_EPOCH = "after_test_epoch"
    AFTER_TEST = "after_test"
    AFTER_RUN = "after_run"
    ON_EXCEPTION = "on_exception"

    def __str__(self) -> str:
        return self.value


class Priority(enum.IntEnum):
    """MMEngine's nine levels. Lower runs first; equal priorities keep registration order."""

    HIGHEST = 0
    VERY_HIGH = 10
    HIGH = 30
    ABOVE_NORMAL = 40
    NORMAL = 50
    BELOW_NORMAL = 60
    LOW = 70
    VERY_LOW = 90
    LOWEST = 100


PRIORITY_CHOICES = ", ".join(f"{p.name} ({p.value})" for p in Priority)


def get_priority(priority: int | str | Priority) -> int:
    """Turn a level name (any case), a Priority or an int 0-100 into an int.

    Raises ValueError (bad name or range) or TypeError (bad type) with the valid choices.

    Args:
        priority: a level name of ``Priority`` (any case, surrounding spaces ignored), a Priority, an
            int 0-100, or a string of such an int.

    Returns:
        The priority as an int.

    Raises:
        ValueError: when a name is not a level or a number is out of range.
        TypeError: when `priority` is a bool or of another type.
    """
    if isinstance(priority, Priority):
        return priority.value
    if isinstance(priority, bool):  # bool is an int subclass: True is not a priority
        raise TypeError(f"priority must be a level name or an integer 0-100, got {priority!r}")
    if isinstance(priority, int):
        if not 0 <= priority <= 100:
            raise ValueError(f"priority {priority} is out of range: use an integer 0-100 or one of {PRIORITY_CHOICES}")
        return priority
    if isinstance(priority, str):
        name = priority.strip().upper()
        if name in Priority.__members__:
            return Priority[name].value
        if name.lstrip("-").isdigit():
            return get_priority(int(name))
        raise ValueError(f"priority {priority!r} is not a level: use one of {PRIORITY_CHOICES}, or an integer 0-100")
    raise TypeError(f"priority must be a level name or an integer 0-100, got {type(priority).__name__} {priority!r}")


def priority_name(value: int) -> str:
    """'NORMAL' for 50, '55' for a value between levels.

    Args:
        value: a priority as an int.

    Returns:
        The name of the ``Priority`` level of that value, else the value as a string.
    """
    try:
        return Priority(value).name
    except ValueError:
        return str(value)
