"""Sweep bookkeeping under the sweepers: job identity, records, summaries, and the Optuna search's helpers."""

__all__ = []  # (import its modules)
