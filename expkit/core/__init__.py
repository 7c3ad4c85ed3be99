"""What every layer uses and that uses nothing of expkit's above it: errors, atomic files, path confinement, trust, distributed helpers, stages, RNG, settings, version checks, the Hydra adapter, signals, data info and parameter groups."""

__all__ = []  # (import its modules)
