"""``python -m expkit.check``: prove that an experiment is reproducible and resumes exactly,
and name what breaks it.

The check is a Hydra app over the same config as ``expkit.train`` (``check.yaml`` includes
``train.yaml``): the user passes the overrides, ``--config-dir`` and experiment they train with.
It trains that experiment for a short budget in a scratch dir, as real ``expkit.train``
processes, each with ``expkit.check.check_probe.CheckProbe`` added:

- ``a`` and ``b``: two runs from the same seed. They must match bit for bit.
- ``c``: the same run, killed with SIGKILL right after a checkpoint in the middle of an epoch,
  then resumed with ``resume=true``. It must match ``a``: the batches each iteration saw, the
  losses and weights, the final weights, optimizer, scheduler, hooks' state and RNG streams,
  the validation and test metrics, metrics.jsonl and result.json.

What differs between ``a`` and ``b`` only in a timing (an iteration's seconds, a timer hook's
clock) is what any two runs differ in; it is left out of every comparison. Each difference
found becomes a finding that names the piece at fault and what to change. Exit 0 when all
match, 1 on any divergence, 2 on bad input. A report goes to ``check.out`` (under ``outputs/``).

The package, in the order the check goes:

- ``command``: the Hydra app and ``main`` (``__main__`` runs it);
- ``planning``: each run's budget and the interruption point; the ``check.`` settings;
- ``training_runs``: the three ``expkit.train`` runs, started and waited for;
- ``check_probe``: the hook each run gets, which writes the trace of what it saw, and its reader;
- ``evidence``: what the runs left, read back; what two runs from one seed differ in anyway;
- ``comparison``: the rows in order, from ``same_seed`` (``a`` with ``b``) and ``resume``
  (``a`` with ``c``), one function per row; ``differences`` and ``batches`` are what they share;
- ``report``: the table, the findings, the text and ``check.out``.
"""

from __future__ import annotations

from expkit.check.command import main, run
from expkit.check.comparison import compare
from expkit.check.differences import TIMING, diff
from expkit.check.evidence import RESULT_RUN_KEYS
from expkit.check.planning import SETTINGS, Plan, plan, validate_settings
from expkit.check.report import Comparison, Finding, Row, render
from expkit.check.same_seed import DETERMINISM_WARNING
from expkit.check.traces import Trace, read_trace
from expkit.check.training_runs import TORCHRUN_ENV, Run, RunFailed, split_argv, train_all

__all__ = [
    "DETERMINISM_WARNING",
    "RESULT_RUN_KEYS",
    "SETTINGS",
    "TIMING",
    "TORCHRUN_ENV",
    "Comparison",
    "Finding",
    "Plan",
    "Row",
    "Run",
    "RunFailed",
    "Trace",
    "compare",
    "diff",
    "main",
    "plan",
    "read_trace",
    "render",
    "run",
    "split_argv",
    "train_all",
    "validate_settings",
]
