"""A work dir's own records: the ownership lock, provenance, result.json."""

__all__ = []  # (import its modules)
