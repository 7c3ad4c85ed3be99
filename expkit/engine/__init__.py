"""The engine: the Runner, its loops (one iteration body for train, val, test and predict), hook dispatch and the device a run trains on."""

__all__ = []  # (import its modules)
