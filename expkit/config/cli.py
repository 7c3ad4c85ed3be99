"""What every command checks on its command line before Hydra composes, and the commands
it prints: group options that exist, overrides that parse, output dirs that can be written,
a work dir no live process owns, Hydra's flags before the overrides, the resume command.

Hydra's own messages for these (``hooks=[typo]``, an unbalanced bracket) name nothing; these
name the key and what to type instead, and the command exits 2 before writing anything.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from expkit.core.errors import suggest

__all__ = [
    "CONF_DIR",
    "INFO_TOPICS",
    "NO_RUN_FLAGS",
    "OUTPUT_KEYS",
    "VALUED_FLAGS",
    "available_options",
    "check_group_choices",
    "check_keys",
    "check_output_dirs",
    "check_output_paths",
    "check_owner",
    "check_parsable",
    "check_rerun",
    "command_main",
    "command_words",
    "config_dirs_of",
    "continue_command",
    "continue_sweep_command",
    "dirs_command_main",
    "flags_first",
    "hydra_argv",
    "hydra_quoted",
    "output_file_problem",
    "prints_only",
    "run_app",
    "search_is_multirun",
    "searching",
    "show_hooks_value",
    "shown_program",
    "sweeping",
    "tokens",
    "with_run_overrides",
]


CONF_DIR = Path(__file__).parents[1] / "conf"


# -- group choices, checked before Hydra composes (its message for hooks=[typo] lists nothing) --
def config_dirs_of(argv: list[str]) -> list[Path]:
    """expkit's shipped config dir, then every --config-dir / -cd on the command line.

    Args:
        argv: the command line, without the program name.

    Returns:
        ``CONF_DIR``, then the dir of each ``--config-dir`` / ``-cd`` (``--config-dir DIR`` or
            ``--config-dir=DIR``) in the order given; none is checked to exist.
    """
    dirs = [CONF_DIR]
    for token in tokens(argv):
        flag, _, value = token[0].partition("=")
        if flag in ("--config-dir", "-cd") and (len(token) == 2 or value):
            dirs.append(Path(token[1] if len(token) == 2 else value))
    return dirs


def available_options(group: str, dirs: Iterable[Path]) -> list[str]:
    """The options of a config group: the .yaml files in <dir>/<group>/ of every config dir.

    Args:
        group: the config group, e.g. ``model`` or ``hooks``.
        dirs: the config dirs to look in; one without a `group` subdir is skipped.

    Returns:
        The names of those files without ``.yaml``, sorted, each once.
    """
    return sorted({p.stem for d in dirs if (d / group).is_dir() for p in (d / group).glob("*.yaml")})


def _names(value: Any) -> list[str]:
    """Option names in an override value: 'a', [a, b], a,b (sweep) or [a],[a,b]."""
    from hydra.core.override_parser.types import ChoiceSweep

    if isinstance(value, ChoiceSweep):
        return [n for v in value.list for n in _names(v)]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _names(v)]
    return [str(value)] if isinstance(value, str) else []


def check_group_choices(argv: list[str]) -> str | None:
    """An error message for the first override that names an option no config dir has.

    Args:
        argv: the command line, without the program name.

    Returns:
        The message naming the unknown option, the group's options and an example; when the overrides
            cannot be parsed, ``check_parsable``'s message instead; None when every option exists. Only
            overrides of a config group are checked (not deletions, ``group@package=``, ``hydra...``);
            ``null`` is always accepted.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    dirs = config_dirs_of(argv)
    groups = {p.name for d in dirs if d.is_dir() for p in d.iterdir() if p.is_dir()}
    words = [t[0] for t in tokens(argv) if len(t) == 1]  # (not a flag's value: --config-dir a=b)
    candidates = [a for a in words if "=" in a and not a.startswith("-") and not a.lstrip("+~").startswith("hydra")]
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except Exception:  # a malformed override: name it (Hydra's message does not)
        return check_parsable(candidates)
    for override in overrides:
        group = override.key_or_group
        if group not in groups or override.is_delete() or override.package:
            continue
        known = available_options(group, dirs)
        for name in _names(override.value()):
            if name != "null" and name not in known:
                label = "hook" if group == "hooks" else f"{group} option"
                close = suggest(name, known)  # (resnet: resnet18, not the first option)
                hint = f"; did you mean {_retyped(override.input_line, group, name, close[0])}?" if close else "."
                example = f" For example: {_choice(group, known[0])}." if known and not close else ""
                return (
                    f"Unknown {label} {name!r} in '{override.input_line}'{hint} "
                    f"Available {group}: {', '.join(known) or '(none)'}.{example} "
                    f"Add your own as {group}/<name>.yaml in a config dir passed with --config-dir."
                )
    return None


def _retyped(line: str, group: str, wrong: str, right: str) -> str:
    """The override `line` as the user typed it, with the option `wrong` replaced by `right`
    (``logger=[tensorbord]``: ``logger=[tensorboard]``; ``-m model=mlp,nope``: ``model=mlp,nope``
    with the one name fixed); a bare value as ``_choice`` writes it."""
    key, _, value = line.partition("=")
    if not value.lstrip().startswith("[") and "," not in value:
        return _choice(group, right)
    fixed = re.sub(rf"(?<![\w.-]){re.escape(wrong)}(?![\w.-])", lambda _: right, value, count=1)
    return f"{key}={fixed}"


def _choice(group: str, option: str) -> str:
    """A group's option as typed on the command line (``hooks=[ema]``, ``model=cnn``)."""
    return f"{group}=[{option}]" if group == "hooks" else f"{group}={option}"


def shown_program(path: str | os.PathLike[str]) -> str:
    """A program's path as it pastes into a shell here: relative to the current directory when it
    lies under it (``.venv/bin/python``; ``./python`` in it, never a bare name a shell would look
    up in PATH), else absolute.

    Args:
        path: the program, e.g. ``sys.executable``; not resolved (a venv's python is a link to the
            base interpreter, which would run without the venv's packages).

    Returns:
        The path to print.
    """
    program = Path(os.path.abspath(path))
    try:
        shown = program.relative_to(Path.cwd())
    except (OSError, ValueError):  # (outside the current directory, or that directory is gone)
        return str(program)
    return str(shown) if shown.parent != Path(".") else f"./{shown}"


def command_words(module: str) -> list[str]:
    """The start of a command that runs `module` with the interpreter running now, for every
    command expkit prints for the user to paste (``continue with:``, ``Resume it with:``): the
    ``python`` on PATH is not the venv's unless one is activated.

    Args:
        module: the module to run, e.g. ``expkit.train``.

    Returns:
        ``[<interpreter>, "-m", module]``, the interpreter shown by ``shown_program``.
    """
    return [shown_program(sys.executable or "python"), "-m", module]


def continue_command(argv: list[str], work_dir: Path) -> str:
    """The command that resumes this run, quoted for a POSIX shell (paths with spaces paste);
    under torchrun, a torchrun command with the same number of processes.

    Args:
        argv: the run's command line, without the program name; its ``hydra.run.dir=``, ``resume=`` and
            ``hydra.output_subdir=`` words are left out.
        work_dir: the run's work dir, given as ``hydra.run.dir``.

    Returns:
        ``command_words("expkit.train")`` (under torchrun with more than one process, the ``torchrun``
            beside the interpreter, else ``<interpreter> -m torch.distributed.run``, with
            ``--nproc_per_node=N``, ``--nnodes`` for several nodes, and ``-m expkit.train``), the kept words,
            ``hydra.run.dir=<work_dir>`` and ``resume=true``.
    """
    kept = [a for a in argv if not a.startswith(("hydra.run.dir=", "resume=", "hydra.output_subdir="))]
    start = command_words("expkit.train")
    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        local, world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ["WORLD_SIZE"])
        nodes = [f"--nnodes={world // local}"] if world > local else []
        torchrun = Path(sys.executable).with_name("torchrun")
        launcher = [shown_program(torchrun)] if torchrun.is_file() else [*start[:2], "torch.distributed.run"]
        start = [*launcher, *nodes, f"--nproc_per_node={local}", "-m", "expkit.train"]
    return shlex.join([*start, *kept, f"hydra.run.dir={work_dir}", "resume=true"])


def continue_sweep_command(argv: list[str], sweep_dir: Path) -> str:
    """The command that resumes this sweep in `sweep_dir` (its jobs found by their overrides).

    Args:
        argv: the sweep's command line, without the program name; its ``hydra.sweep.dir=`` and ``resume=``
            words are left out.
        sweep_dir: the sweep dir, given as ``hydra.sweep.dir``.

    Returns:
        ``command_words("expkit.train")``, the kept words, ``hydra.sweep.dir=<sweep_dir>`` and
            ``resume=true``, quoted for a POSIX shell.
    """
    kept = [a for a in argv if not a.startswith(("hydra.sweep.dir=", "resume="))]
    return shlex.join([*command_words("expkit.train"), *kept, f"hydra.sweep.dir={sweep_dir}", "resume=true"])


VALUED_FLAGS = (
    "--config-dir",
    "-cd",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--experimental-rerun",
)
INFO_TOPICS = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def tokens(argv: Sequence[str]) -> list[list[str]]:
    """The command line in the units Hydra's parser reads, for every command's argv handling: a
    flag with the value it takes (``["--config-dir", "conf"]``, ``["--info", "plugins"]``), a flag
    alone (``["-m"]``), or one word that is not a flag (an override, a bare path).

    Args:
        argv: the command line, without the program name.

    Returns:
        One list per unit, in order: two words for a flag of ``VALUED_FLAGS`` followed by another word (for
            ``--info`` / ``-i``, only when that word is one of ``INFO_TOPICS``), one word otherwise.
    """
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        takes_value = i + 1 < len(argv) and (
            arg in VALUED_FLAGS or (arg in ("--info", "-i") and argv[i + 1] in INFO_TOPICS)
        )
        out.append(list(argv[i : i + 2]) if takes_value else [arg])
        i += 2 if takes_value else 1
    return out


def flags_first(argv: list[str]) -> list[str]:
    """Hydra's flags (with their values) before the overrides: Hydra's argument parser takes the
    overrides only as one block, so `model=x --config-dir conf optim.lr=1` would be refused.

    Args:
        argv: the command line, without the program name.

    Returns:
        The words of the units of ``tokens`` that begin with ``-`` (each flag with its value), then the
            other words, each part in its original order.
    """
    parts = tokens(argv)
    return [a for t in parts if t[0].startswith("-") for a in t] + [t[0] for t in parts if not t[0].startswith("-")]


def output_file_problem(path: Path) -> str | None:
    """Why a command's output file cannot be written there, checked before the work starts: it
    is a directory, or a file stands where a directory of its path should be.

    Args:
        path: the file the command is to write.

    Returns:
        Why it cannot be written: `path` is a directory, its nearest existing parent is a file, or that
            parent cannot be written to; None otherwise.
    """
    if path.is_dir():
        return "is a directory; give a file name in it"
    blocked = _blocking_ancestor(path.parent)
    if blocked is None:
        return None
    existing, reason = blocked
    return (
        f"{existing} cannot be written"
        if reason
        else f"{existing} is a file, not a directory; give a path in a directory"
    )


def _blocking_ancestor(path: Path) -> tuple[Path, str | None] | None:
    """The nearest existing of `path` and its parents when nothing can be created in it: (it, None)
    for a file, (it, the system's reason) for a directory where a file cannot be made (tried, not
    asked: root's access() says yes to /proc); None when one can."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return None
    if not existing.is_dir():
        return existing, None
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return existing, exc.strerror or str(exc)
    return None


def check_output_dirs(argv: list[str]) -> str | None:
    """An output dir that is empty (the current directory would become the work dir) or cannot
    be written, named before Hydra tries to log into it.

    Args:
        argv: the command line, without the program name; a ``hydra.run.dir`` / ``hydra.sweep.dir`` it gives
            (without ``${``) is created when missing, as Hydra would do next.

    Returns:
        The message for the first ``hydra.run.dir=`` / ``hydra.sweep.dir=`` that is empty or cannot be
            created or written; when neither is given, for ``outputs/`` (or, without it, the current
            directory) that cannot be written; None otherwise.
    """
    given = False
    for arg in argv:
        key, sep, value = arg.partition("=")
        key, value = key.lstrip("+"), value.strip().strip("'\"")
        if not sep or key not in ("hydra.run.dir", "hydra.sweep.dir"):
            continue
        example = "outputs/runs/my_run" if key.endswith("run.dir") else "outputs/sweeps/my_sweep"
        if not value:
            return (
                f"{key} is empty, which would write this run's files into the current directory. "
                f"Give a directory ({key}={example}) or leave the key out for a new dated one."
            )
        given = True
        if "${" not in value and not _writable(Path(value)):
            return f"{key}={value}: cannot create or write this directory; give a writable one, e.g. {key}={example}"
    default = Path("outputs") if Path("outputs").is_dir() else Path.cwd()  # checked, not created (--help, --cfg)
    if not given and not os.access(default, os.W_OK | os.X_OK):
        return (
            f"cannot write {Path('outputs').resolve()} (runs go to outputs/ under the current directory); "
            "run from a writable directory or give hydra.run.dir=<a writable dir>"
        )
    return None


OUTPUT_KEYS = ("out", "output", "work_dir")  # the keys whose values are paths a command writes


def check_output_paths(argv: list[str], keys: Sequence[str]) -> str | None:
    """An output a command writes (``out=``, ``output=``, ``work_dir=``) where nothing can be created,
    named before the command's work: a path under a file or an unwritable directory (``/proc/x``)
    failed after the work, in a traceback. Nothing is created here.

    Args:
        argv: the command line, without the program name.
        keys: the command's own keys whose values are paths it writes (a file or a directory).

    Returns:
        The message for the first such value (without ``${``) whose nearest existing ancestor (or
            itself, when it exists) is not a directory this process can write in; None otherwise.
    """
    for arg in argv:
        key, sep, value = arg.partition("=")
        key, value = key.lstrip("+"), value.strip().strip("'\"")
        if not sep or key not in keys or not value or "${" in value:
            continue
        path = Path(value).expanduser().absolute()
        blocked = _blocking_ancestor(path.parent if path.is_file() else path)  # (a file there: written over)
        if blocked is None:
            continue
        where, reason = blocked
        if reason is None:
            return f"{key}={value}: a parent of it is a file, not a directory ({where}); give another path"
        return f"{key}={value}: cannot write in {where} ({reason}); give a path in a writable directory"
    return None


def search_is_multirun(argv: list[str]) -> list[str]:
    """`argv` with ``--multirun`` added when it picks a search (``hparams_search=optuna``) without
    ``-m``: a search is a sweep. (Hydra 1.4 takes ``hydra.mode`` only from the primary config or
    the command line, so the search's config cannot set it.)

    Args:
        argv: the command line, without the program name.

    Returns:
        ``["--multirun", *argv]`` when `argv` picks a search and holds none of ``-m``, ``--multirun``,
            ``hydra.mode=...`` or a flag of ``NO_RUN_FLAGS``; otherwise `argv` itself.
    """
    search = searching(argv)
    asks_hydra = any(a in NO_RUN_FLAGS for a in argv)  # --cfg, --help, --info: Hydra allows no -m beside them
    if search and not asks_hydra and not any(a in ("-m", "--multirun") or a.startswith("hydra.mode=") for a in argv):
        return ["--multirun", *argv]
    return argv


def searching(argv: list[str]) -> bool:
    """Whether the command line picks a search (``hparams_search=optuna``).

    Args:
        argv: the command line, without the program name.

    Returns:
        True when an ``hparams_search=`` word has a value other than empty or ``null``.
    """
    return any(a.startswith("hparams_search=") and a.partition("=")[2] not in ("", "null") for a in argv)


def sweeping(argv: list[str]) -> bool:
    """Whether the command line makes a sweep (-m, or an Optuna search, which sets Hydra's mode).

    Args:
        argv: the command line, without the program name.

    Returns:
        True when `argv` holds ``-m``, ``--multirun``, ``hydra.mode=MULTIRUN`` or any ``hparams_search=`` word
            (``hparams_search=null`` included).
    """
    return searching(argv) or any(a in ("-m", "--multirun", "hydra.mode=MULTIRUN") for a in argv)


def with_run_overrides(argv: list[str]) -> list[str]:
    """``hydra.run.dir=<run> resume=true``: the run's own overrides (its ``.hydra/overrides.yaml``)
    come first, then the command line's, which win for a key both set. A run started with
    ``model=cnn`` resumes as a cnn without retyping it; a new value of a key the checkpoint
    cannot take (another model) is refused when the checkpoint is checked, naming the key.

    The command line is read in ``tokens``' units, as every command reads it, and given back as
    Hydra's parser takes it (``flags_first``): Hydra's flags (``--config-dir conf``, ``-cn exp``)
    with their values, then the run's overrides, then the command line's own.

    Args:
        argv: the command line, without the program name.

    Returns:
        ``flags_first`` of `argv` with the run's overrides before its own (leaving out ``resume`` and
            every key `argv` sets); ``flags_first(argv)`` for a sweep, without ``resume=true`` or
            ``hydra.run.dir``, or when the run's overrides.yaml is missing or is not a list of strings
            (read as data from a stranger).
    """
    import yaml

    words = [t[0] for t in tokens(argv) if len(t) == 1 and not t[0].startswith("-")]  # (not a flag's value)
    run_dir = next((a.partition("=")[2] for a in reversed(words) if a.startswith("hydra.run.dir=")), None)
    if run_dir is None or sweeping(argv) or not any(a.lower() == "resume=true" for a in words):
        return flags_first(argv)
    try:
        stored = yaml.safe_load((Path(run_dir) / ".hydra" / "overrides.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return flags_first(argv)
    if not isinstance(stored, list) or not all(isinstance(o, str) for o in stored):
        return flags_first(argv)

    def key(word: str) -> str:
        return word.partition("=")[0].lstrip("+~")

    given = {key(a) for a in words if "=" in a}
    kept = [o for o in stored if key(o) not in given and key(o) != "resume" and not key(o).startswith("hydra.")]
    if kept:  # said, so that an error about one of them (a hook from a --config-dir not given) is understood
        print(
            f"resume=true: the run's own overrides come first ({Path(run_dir) / '.hydra' / 'overrides.yaml'}): "
            f"{' '.join(kept)}; drop one with ~KEY, or give a new value",
            file=sys.stderr,
        )
    return flags_first([*kept, *argv])


NO_RUN_FLAGS = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc")


def prints_only(argv: Sequence[str]) -> bool:
    """Whether Hydra only prints (its help, the config, its info) and exits, running no task.

    Args:
        argv: the command line, without the program name.

    Returns:
        True when a flag of ``NO_RUN_FLAGS`` (or ``--cfg=``, ``--info=``) is given.
    """
    return any(a in NO_RUN_FLAGS or a.startswith(("--cfg=", "--info=")) for a in argv)


def show_hooks_value(argv: list[str]) -> str | None:
    """The last ``show_hooks=`` value of the command line, as typed (Hydra reads true and false in
    any case: ``True``, ``TRUE``); None when it is not given.

    Args:
        argv: the command line, without the program name.

    Returns:
        The value, or None.
    """
    given = [a.partition("=")[2] for a in argv if a.partition("=")[0].lstrip("+") == "show_hooks"]
    return given[-1] if given else None


def check_rerun(argv: list[str]) -> str | None:
    """A command aimed at a dir that already holds a run (hydra.run.dir) or sweep jobs
    (hydra.sweep.dir with -m or an Optuna search), without resume: refused before anything
    is written there, naming what the dir holds and the two ways on.

    Args:
        argv: the command line, without the program name.

    Returns:
        The refusal message; None when a flag of ``NO_RUN_FLAGS`` (or ``--cfg=``, ``--info=``) or
            ``show_hooks=true`` is given, the last ``resume=`` is set, this is not rank 0 or is a torchrun
            or Slurm restart, the dir is not given, holds ``${`` or does not exist, or it holds no run or
            sweep jobs (or, for a search, a live worker of it runs there).
    """
    if prints_only(argv) or str(show_hooks_value(argv)).lower() == "true":
        return None  # (nothing is written)
    resume = next((a.partition("=")[2] for a in reversed(argv) if a.lstrip("+").startswith("resume=")), "false")
    if resume.strip().strip("'\"").lower() not in ("false", "null", "none", "0", ""):
        return None
    restarted = any(
        os.environ.get(v, "0") not in ("0", "") for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    )
    if os.environ.get("RANK", "0") != "0" or restarted:
        return None  # (rank 0 checks; a torchrun restart or a Slurm requeue continues its run)
    key = "hydra.sweep.dir" if sweeping(argv) else "hydra.run.dir"
    given = next(
        (a.partition("=")[2].strip().strip("'\"") for a in reversed(argv) if a.lstrip("+").startswith(key + "=")), None
    )  # (the last one wins, as in Hydra)
    if not given or "${" in given or not Path(given).is_dir():
        return None
    holds = _sweep_holds(Path(given), searching(argv)) if sweeping(argv) else _run_holds(Path(given))
    if holds is None:
        return None
    fresh = "outputs/sweeps/my_sweep_2" if sweeping(argv) else "outputs/runs/my_run_2"
    return (
        f"{key}={given} already holds {holds}. Nothing was changed. Add resume=true to continue it, "
        f"or give another {key} (e.g. {key}={fresh}) for a fresh start"
    )


def _run_holds(run_dir: Path) -> str | None:
    from expkit.workdir.records import read_result

    status = (read_result(run_dir) or {}).get("status")
    checkpoints = run_dir / "checkpoints"
    saved = checkpoints.is_dir() and any(p.suffix in (".pth", ".dcp") for p in checkpoints.iterdir())
    if status is None and not saved and not (run_dir / "metrics.jsonl").is_file():
        return None
    if status is None:
        return "a run that did not finish (no result.json)"
    return {"completed": "a completed run", "failed": "a failed run"}.get(status, f"a run that {status}")


def _sweep_holds(sweep_dir: Path, search: bool) -> str | None:
    from expkit.sweeps.search import live_workers
    from expkit.sweeps.sweep_jobs import tally_jobs

    if search and live_workers(sweep_dir):  # an Optuna search runs there: this command is one more worker of it
        return None
    counts = tally_jobs(sweep_dir)
    if not any(counts.values()):
        return None
    return "sweep jobs: " + ", ".join(f"{n} {status}" for status, n in counts.items())


def _writable(directory: Path) -> bool:
    """Whether `directory` can be created (Hydra creates it next anyway) and written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


def check_keys(argv: list[str]) -> str | None:
    """Keys no config can have (none at all, or longer than a file name can be).

    Args:
        argv: the command line, without the program name.

    Returns:
        The message for the first override (a word with ``=`` that does not begin with ``-``) with no key,
            or with a dot-separated part of its key longer than 200 characters; None otherwise.
    """
    for arg in argv:
        key = arg.partition("=")[0].lstrip("+~")
        if "=" in arg and not arg.startswith("-") and not key.strip():
            return f"'{arg}' has no key before '='; write KEY=VALUE, e.g. optim.lr=0.01 (see --cfg job for the keys)"
        if "=" in arg and not arg.startswith("-") and any(len(part) > 200 for part in key.split(".")):
            return f"{key[:40]}...: a {len(key)}-character key is not a key of the config; see --cfg job for the keys"
    return None


def check_parsable(argv: list[str]) -> str | None:
    """The first override Hydra's grammar cannot parse, named (Hydra's own message does not).

    Args:
        argv: the words to check; those without ``=`` and flags (beginning with ``-``) are skipped.

    Returns:
        The message naming the first word Hydra's override parser refuses, with the parser's first line
            and examples; None when each one parses.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            continue
        try:
            parser.parse_overrides([arg])
        except Exception as exc:  # Hydra's OverrideParseException, or a grammar error
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return (
                f"'{arg}' cannot be parsed ({first}); check its brackets and quotes, e.g. 'optim.lr=0.1', "
                "'hooks=[ema,profiler]' (https://hydra.cc/docs/advanced/override_grammar/basic/)"
            )
    return None


def check_owner(argv: list[str]) -> str | None:
    """A run given a work dir that a live process owns is refused before Hydra writes .hydra/
    and train.log into it (torchrun's other ranks share rank 0's dir and lock).

    Args:
        argv: the command line, without the program name.

    Returns:
        ``busy_message`` for the dir of the last ``hydra.run.dir=`` word when a live process owns it; None
            when none does, when no such word is given, in a sweep (``-m`` / ``--multirun``), on ranks
            other than 0, and when the owner is an earlier attempt of this Slurm job (the lock waits
            for it to end: ``WorkDirLock.acquire``).
    """
    from expkit.workdir.ownership import busy_message, earlier_attempt, live_owner

    if any(a in ("-m", "--multirun") for a in argv) or os.environ.get("RANK", "0") != "0":
        return None
    given = next((a.split("=", 1)[1] for a in reversed(argv) if a.startswith("hydra.run.dir=")), None)
    owner = live_owner(Path(given)) if given else None
    if owner is not None and earlier_attempt(owner):  # a requeued Slurm job: the lock waits for it (WorkDirLock)
        return None
    return busy_message(Path(given), owner) if given and owner is not None else None


def hydra_quoted(value: str) -> str:
    """`value` as a quoted string in Hydra's override grammar: single-quoted; a quote, and the
    backslashes before a quote or at the end, escaped (Hydra unescapes only those).

    Args:
        value: the string to quote.

    Returns:
        `value` in single quotes, each run of backslashes before a quote or at the end doubled, then each
            single quote preceded by a backslash.
    """
    import re

    escaped = re.sub(r"\\+(?='|$)", lambda m: m.group(0) * 2, value).replace("'", "\\'")
    return f"'{escaped}'"


def hydra_argv(argv: list[str], options: Sequence[str]) -> list[str]:
    """The command line as Hydra takes it. ``work_dir=DIR`` is ``hydra.run.dir=DIR``, and any
    ``key=value`` that is not one of the command's settings (`options`) overrides the checkpoint's stored
    config: it goes into ``overrides=[...]``, so ``data.batch_size=256`` works as before.

    Args:
        argv: the command line, without the program name.
        options: the command's own settings (the top-level keys of its config).

    Returns:
        Flags (with their values), words without ``=``, ``hydra...`` overrides and the command's own
            settings as given, ``work_dir=DIR`` as ``hydra.run.dir=DIR``, and the other overrides, each
            quoted by ``hydra_quoted``, in one ``overrides=[...]`` (added to the first explicit one, if any).
    """
    out, stored = [], []
    for token in tokens(argv):
        arg = token[0]
        key, sep, value = arg.partition("=")
        root = key.lstrip("+~").split(".", 1)[0]
        if arg.startswith("-") or not sep:  # a flag, with its value
            out += token
        elif key == "work_dir":
            out.append(f"hydra.run.dir={value}")
        elif root in options or root.startswith("hydra"):
            out.append(arg)
        else:
            stored.append(arg)
    if stored:
        quoted = ",".join(hydra_quoted(a) for a in stored)
        explicit = next((j for j, a in enumerate(out) if a.startswith("overrides=")), None)
        if explicit is None:
            out.append(f"overrides=[{quoted}]")
        else:  # an explicit overrides=[...] too: one list
            inner = out[explicit].split("=", 1)[1].strip()
            inner = inner[1:-1] if inner.startswith("[") and inner.endswith("]") else inner
            out[explicit] = f"overrides=[{inner + ',' if inner else ''}{quoted}]"
    return out


def dirs_command_main(run: Callable[[], Any], to_hydra: Callable[[list[str]], list[str]]) -> None:
    """The entry point of a command over dirs given as bare words (compare, report, reproduce,
    dashboard): the command line made Hydra's by the command's `to_hydra` (bare words into its
    own setting), flags first; a mistyped key refused in one line; then the Hydra app `run`.

    Args:
        run: the command's Hydra app (its ``hydra.main`` function), called with no arguments.
        to_hydra: the command's own rewriting of its command line into Hydra's overrides.

    Raises:
        SystemExit: when `run` exits, with the status ``errors.exit_status`` gives; with status 2 for a
            mistyped key, or when ``versions.require`` finds a package older than expkit needs.
    """
    from expkit.core import versions
    from expkit.core.signals import quiet_ctrl_c

    with quiet_ctrl_c(_command_name()):  # (these commands read runs and write reports whole or not at all)
        versions.require()
        sys.argv[1:] = argv = flags_first(to_hydra(sys.argv[1:]))
        run_app(run, check_keys(argv) or check_output_paths(argv, ("out",)))


def run_app(run: Callable[[], Any], refused: str | None) -> None:
    """A command's last step: bad input found on its command line said in one line (exit 2), or its
    Hydra app run, exiting with the status ``errors.exit_status`` gives.

    Args:
        run: the command's Hydra app (its ``hydra.main`` function), called with no arguments.
        refused: the message for bad input, or None to run.

    Raises:
        SystemExit: with status 2 after `refused`; with `run`'s status when it exits.
    """
    from expkit.core import errors

    if refused:
        print(f"Error: {refused}", file=sys.stderr)
        sys.exit(2)
    try:
        run()
    except SystemExit as exc:
        sys.exit(errors.exit_status(exc))


def _command_name() -> str:
    """The running command's module (``expkit.eval``), for its messages."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name.removesuffix(".__main__") if spec is not None else "expkit"


def command_main(run: Callable[[], Any], options: Sequence[str]) -> None:
    """The entry point of a command over a checkpoint (eval, predict, export): the command line
    made Hydra's (``hydra_argv``, flags first), then the Hydra app `run`. Hydra's own errors
    before the task began (a missing key, an unknown one) are the user's to fix: exit 2.

    Args:
        run: the command's Hydra app (its ``hydra.main`` function), called with no arguments.
        options: the command's own settings, for ``hydra_argv``.

    Raises:
        SystemExit: when `run` exits, with the status ``errors.exit_status`` gives (2 for Hydra's own errors
            before the task began); before that, with status 2 when ``versions.require`` finds a package
            older than expkit needs.
    """
    from expkit.core import versions
    from expkit.core.signals import quiet_ctrl_c, take_ctrl_c

    with quiet_ctrl_c(_command_name()):
        versions.require()
        take_ctrl_c()
        sys.argv[1:] = argv = flags_first(hydra_argv(sys.argv[1:], options))  # (Hydra's parser takes flags first)
        given_dir = any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv)  # (not the default: some write none)
        run_app(run, (check_output_dirs(argv) if given_dir else None) or check_output_paths(argv, OUTPUT_KEYS))
