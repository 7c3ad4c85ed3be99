"""expkit.core.signals: how a command's Ctrl-C ends it."""

from __future__ import annotations

import signal

import pytest

from expkit.core.signals import SweepInterrupted, quiet_ctrl_c


@pytest.mark.parametrize(
    ("stop", "status", "said"),
    [
        (KeyboardInterrupt(), 130, "expkit.eval: interrupted (SIGINT); nothing was written"),
        # an expkit sweeper's launch (eval -m) turns a Ctrl-C or SIGTERM into SweepInterrupted
        (SweepInterrupted(signal.SIGINT), 130, "expkit.eval: interrupted (SIGINT); nothing was written"),
        (SweepInterrupted(signal.SIGTERM), 143, "expkit.eval: interrupted (SIGTERM); nothing was written"),
    ],
)
def test_a_stop_inside_the_block_ends_in_one_line_and_128_plus_the_signal(stop, status, said, capsys):
    with pytest.raises(SystemExit) as ended, quiet_ctrl_c("expkit.eval", "nothing was written"):
        raise stop
    assert ended.value.code == status
    assert capsys.readouterr().err.strip() == said
    assert ended.value.__context__ is not None and ended.value.__suppress_context__  # (no traceback chained)
