"""Checkpoints: file formats and atomic writes, the run's save and resume, sharded (DCP) checkpoints, background writes and object storage."""

__all__ = []  # (import its modules)
