"""The config tree: a package, so that Hydra finds it as pkg://expkit.conf when expkit.train is imported (the expkit-train command) rather than run with -m."""

__all__ = []
