"""``python -m expkit.check`` (and ``torchrun ... -m expkit.check``): the command's ``main``."""

from __future__ import annotations

from expkit.check.command import main

__all__ = []

if __name__ == "__main__":
    main()
