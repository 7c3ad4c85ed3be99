"""``python -m expkit.sweep <sweep dir>``: rebuild a sweep's summary (summary.csv/.md, best.json,
sweep.svg) from its job dirs on disk and print it.

The summary itself is ``expkit.sweeps.summary`` (rows: ``expkit.sweeps.rows``, sweep.svg:
``expkit.sweeps.plots``); ``SweepSummaryCallback`` (``expkit.sweeps.callback``) is importable
from here because configs name it so (``_target_: expkit.sweep.SweepSummaryCallback``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from expkit.core import hydra_compat
from expkit.sweeps.callback import SweepSummaryCallback
from expkit.sweeps.summary import summarize

__all__ = ["SweepSummaryCallback", "main", "rebuild"]


def rebuild(sweep_dir: Path, plot: bool = True, quiet: bool = False, seed_keys: list[str] | None = None) -> int:
    """Rebuild `sweep_dir`'s summary from disk and print it; the exit status (2: nothing to summarise).

    Args:
        sweep_dir: the sweep dir.
        plot: whether to draw sweep.svg too.
        quiet: whether to leave out summary.md and print only best.json.
        seed_keys: the override keys that only change the seed; None: the sweep's own setting.

    Returns:
        0 when the summary was written, 2 when the sweep dir holds no job dir.
    """
    # (checked first: summarizing takes the sweep's lock file, which a run dir must not be left holding)
    has_jobs = any(p.is_dir() and (p / ".hydra").is_dir() for p in sweep_dir.iterdir() if not p.name.startswith("."))
    best = summarize(sweep_dir, plot=plot, fresh=True, seed_keys=seed_keys) if has_jobs else None
    if best is None:
        print(f"Error: no job dirs (with .hydra/) in {sweep_dir}", file=sys.stderr)
        return 2
    if not quiet:
        print((sweep_dir / "summary.md").read_text())
    print(json.dumps(best, indent=2))
    return 0


def _hydra_argv(argv: list[str]) -> list[str]:
    """The older command line (``DIR [--no-plot] [--quiet]``) as Hydra's ``sweep_dir=DIR plot=false quiet=true``."""
    from expkit.config.cli import hydra_quoted, tokens

    aliases, out = {"--no-plot": "plot=false", "--quiet": "quiet=true"}, []
    for token in tokens(argv):
        arg = token[0]
        if len(token) == 1 and not arg.startswith("-") and ("=" not in arg or Path(arg).is_dir()):  # the sweep dir
            out.append(f"sweep_dir={hydra_quoted(arg)}")
        else:
            out += [aliases.get(arg, arg), *token[1:]]
    return out


def main() -> None:
    """``python -m expkit.sweep``: a Hydra app over conf/sweep.yaml (``--help``, ``--cfg job``).

    Raises:
        SystemExit: with status 2 when no ``sweep_dir`` is given, it is not a directory, or it
            holds no job dir.
    """

    from expkit.core import versions

    versions.require()
    sys.argv[1:] = argv = _hydra_argv(sys.argv[1:])
    asks_hydra = any(a in ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c") for a in argv)
    if not asks_hydra and not any(a.startswith("sweep_dir=") for a in argv):
        print("Error: which sweep? python -m expkit.sweep sweep_dir=outputs/sweeps/<sweep>", file=sys.stderr)
        sys.exit(2)

    @hydra_compat.main(config_path="conf", config_name="sweep")
    def run(cfg: Any) -> None:
        sweep_dir = Path(cfg.sweep_dir)
        if not sweep_dir.is_dir():  # (Hydra parsed it: quotes, interpolations, the last of several)
            print(
                f"Error: sweep_dir={sweep_dir} is not a directory; give a sweep dir (outputs/sweeps/<sweep>)",
                file=sys.stderr,
            )
            sys.exit(2)
        keys = cfg.get("seed_keys")
        code = rebuild(
            sweep_dir,
            plot=bool(cfg.plot),
            quiet=bool(cfg.quiet),
            seed_keys=None if keys is None else [str(k) for k in keys],
        )
        if code:
            sys.exit(code)

    run()


if __name__ == "__main__":
    main()
