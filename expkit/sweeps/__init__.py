"""A sweep's code, under the sweepers (``hydra_plugins/expkit_sweeper/``): ``sweep_jobs`` (a job's
identity, place and claim), ``rows`` (a job dir read as a row; seed groups), ``summary``
(summary.csv/.md, best.json), ``plots`` (sweep.svg), ``callback`` (the Hydra callback that keeps
the summary up to date), ``search`` (the Optuna search's helpers). ``python -m expkit.sweep`` is
the command."""

__all__ = []  # (import its modules)
