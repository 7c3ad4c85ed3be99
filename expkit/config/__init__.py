"""Reading what the user asked for: the command line (Hydra's units, checked before Hydra composes) the build of a run's parts from its composed config, and a trained model rebuilt from a checkpoint's stored config (eval, predict, export)."""

__all__ = []  # (import its modules)
