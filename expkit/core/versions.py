"""The lowest versions of torch, Hydra and OmegaConf that expkit runs on, checked when a command
starts: an environment with an older one (installed before expkit, or downgraded since) gets one
line naming the package, the version found and the version needed, and exit 2, instead of an
AttributeError deep in a run. pyproject.toml declares the same bounds (a test checks)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

__all__ = ["MINIMUM", "check_installed", "parse", "require"]

# package -> (lowest version, why). The lowest versions CI runs (scripts/test_compat.sh lowest):
# with torch 2.6 FSDP2 fails on the CPU (Stream.record_event), with 2.7 its weights leave DDP's
MINIMUM: dict[str, tuple[str, str]] = {
    "torch": ("2.9", "the oldest torch CI runs: FSDP2 on the CPU, the ONNX exporter"),
    "hydra-core": ("1.3.2", "expkit's commands are Hydra 1.3 apps"),
    "omegaconf": ("2.3", "Hydra 1.3's config library"),
}


def parse(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: '2.14.1+cu130' -> (2, 14, 1), '1.4.0rc3' -> (1, 4, 0).

    Args:
        version: a version string, e.g. ``torch.__version__``.

    Returns:
        The leading dot-separated numbers, up to the first part that is not a plain number (that
        part's leading digits included); a local version (``+...``) is ignored.
    """
    numbers = []
    for part in version.split("+")[0].split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.end() < len(part):  # 0rc3: a pre-release of 0
            break
    return tuple(numbers)


def check_installed() -> str | None:
    """A message for the first installed package older than expkit needs, else None. Reads the
    modules' own versions, torch's without importing it (no package metadata scan: start-up stays cheap).

    Returns:
        One line naming the package, the version found, the version needed and the pip command to
        upgrade it; None when torch, Hydra and OmegaConf are all recent enough.
    """
    import hydra
    import omegaconf

    found = {"torch": _torch_version(), "hydra-core": hydra.__version__, "omegaconf": omegaconf.__version__}
    for package, (lowest, why) in MINIMUM.items():
        if parse(found[package]) < parse(lowest):
            return (
                f"{package} {found[package]} is installed; expkit needs {package}>={lowest} ({why}). "
                f"Upgrade it: pip install '{package}>={lowest}'"
            )
    return None


def _torch_version() -> str:
    """torch's version, read from the ``torch/version.py`` its build writes when torch is not imported
    yet: importing it costs about 1.5 s, and a command's ``--help`` or ``--cfg job`` never needs it."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    spec = importlib.util.find_spec("torch")
    for folder in (spec and spec.submodule_search_locations) or ():
        try:
            match = re.search(
                r"^__version__\s*=\s*['\"]([^'\"]+)", Path(folder, "version.py").read_text(), re.MULTILINE
            )
        except OSError:
            continue
        if match:
            return match.group(1)
    import torch  # (a torch without its version.py: ask the module itself)

    return torch.__version__


def require() -> None:
    """What each command does first: one line and exit 2 when ``check_installed`` finds a
    package older than expkit needs."""
    too_old = check_installed()
    if too_old:
        import sys

        print(f"Error: {too_old}", file=sys.stderr)
        sys.exit(2)
