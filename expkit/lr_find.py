"""``python -m expkit.lr_find``: an exponential learning-rate range test on your experiment.

The command is a Hydra app over the same config as ``expkit.train`` (``lr_find.yaml`` includes
``train.yaml``): the overrides, ``--config-dir`` and experiment you train with build the model,
the optimizer (its param groups included) and the data, as a run would. It then trains for
``lr_find.iters`` iterations while the learning rate grows exponentially from ``lr_find.min`` to
``lr_find.max``, every param group's lr multiplied by the same factor (a group with
``lr_mult: 10`` stays ten times the others), and stops early when the loss diverges: when the
smoothed loss exceeds ``lr_find.diverge`` times its lowest value, or is not finite.

The suggestion is the learning rate where the smoothed loss falls fastest against log10(lr),
as Lightning's tuner and fastai's ``steep`` rule pick it. It writes, in its run
dir (``outputs/lr_find/<date>_<time>/``): ``lr_find.json`` (``lrs``, ``losses``,
``smoothed_losses``, ``suggestion``, ``rule``) and ``lr_find.svg``. It keeps no checkpoint and
writes no result.json: the trained weights are thrown away. The experiment's scheduler, hooks,
loggers and validation are left out (the test sets the learning rate itself). Under torchrun
the loss is averaged over the ranks and rank 0 writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf, open_dict

from expkit.config import cli
from expkit.core import hydra_compat, versions
from expkit.core.atomic import write_text_atomic
from expkit.core.errors import ConfigError, config_errors_exit_2, exit_status
from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["RangeTest", "Settings", "main", "plot", "run", "suggest"]


log = logging.getLogger("expkit")

SKIP_END = 1  # the last point of the curve is left out of the suggestion (as Lightning's tuner does)


@dataclass
class Settings:
    """``lr_find``: the range test's settings, checked.

    Args:
        min: the first learning rate (of the optimizer's own ``lr``; every group scales with it).
        max: the last learning rate, reached at the last iteration unless the loss diverges first.
        iters: the iterations (optimizer steps) from `min` to `max`.
        smoothing: the weight of the past in the loss's exponential moving average (0: none).
        diverge: the test stops when the smoothed loss exceeds this many times its lowest value.
    """

    min: float
    max: float
    iters: int
    smoothing: float
    diverge: float

    def __post_init__(self) -> None:
        if not (isinstance(self.min, (int, float)) and self.min > 0 and math.isfinite(self.min)):
            raise ConfigError(f"lr_find.min={self.min}: give a positive learning rate, e.g. lr_find.min=1e-7")
        if not (isinstance(self.max, (int, float)) and math.isfinite(self.max) and self.max > self.min):
            raise ConfigError(f"lr_find.max={self.max}: give a learning rate above lr_find.min={self.min}, e.g. 10")
        if isinstance(self.iters, bool) or not isinstance(self.iters, int) or self.iters < 5:
            raise ConfigError(f"lr_find.iters={self.iters}: give 5 iterations or more, e.g. lr_find.iters=100")
        if not (isinstance(self.smoothing, (int, float)) and 0 <= self.smoothing < 1):
            raise ConfigError(f"lr_find.smoothing={self.smoothing}: give a number in [0, 1), e.g. 0.98 (0: none)")
        if not (isinstance(self.diverge, (int, float)) and self.diverge > 1):
            raise ConfigError(f"lr_find.diverge={self.diverge}: give a factor above 1, e.g. lr_find.diverge=4")

    def lr(self, i: int) -> float:
        """The learning rate of iteration `i` (0-based): ``min * (max / min) ** (i / (iters - 1))``."""
        return self.min * (self.max / self.min) ** (i / (self.iters - 1))


class RangeTest(Hook):
    """Sets every param group's learning rate before each iteration and records the loss after it;
    asks the runner to stop when the loss diverges.

    Args:
        settings: the test's settings.
    """

    priority = Priority.HIGHEST  # the learning rate is set before any other hook sees the iteration

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.smoothed: list[float] = []
        self.stop_reason: str | None = None
        self._average = 0.0
        self._best = math.inf
        self._bases: list[tuple[Any, list[float]]] = []
        self._reference = 1.0
        self._names: dict[str, Any] = {}

    def before_train(self, runner: Runner) -> None:
        optimizers = list(runner.optimizers.values())
        reference = optimizers[0].defaults.get("lr")
        if not isinstance(reference, (int, float)) or reference <= 0:
            raise ConfigError(
                f"the optimizer's own lr is {reference!r}: the range test scales every param group by lr_find's "
                "learning rate over it; give optim.lr a positive value"
            )
        self._reference = float(reference)
        self._bases = [(o, [float(g["lr"]) for g in o.param_groups]) for o in optimizers]
        self._names = dict(runner.optimizers)

    def groups(self) -> list[dict[str, Any]]:
        """Every param group's lr as the test left it: its optimizer's name, its index, its ratio to
        the optimizer's own lr (kept through the test) and its lr at the last iteration.

        Returns:
            One dict per param group, in the optimizers' order.
        """
        names = {id(o): n for n, o in self._names.items()}
        return [
            {"optimizer": names[id(o)], "group": i, "lr_ratio": base / self._reference, "last_lr": float(g["lr"])}
            for o, bases in self._bases
            for i, (g, base) in enumerate(zip(o.param_groups, bases))
        ]

    def before_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any) -> None:
        factor = self.settings.lr(runner.iter) / self._reference
        for optimizer, bases in self._bases:
            for group, base in zip(optimizer.param_groups, bases):
                group["lr"] = base * factor

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        from expkit.core import distributed  # (imported here, not at the top: --help imports no torch)

        loss = (
            outputs["loss"].detach().float().reshape(()).to(distributed.reduce_device())
        )  # (syncs: once per iteration)
        if distributed.is_distributed():
            loss = distributed.all_reduce_sum(loss.clone()) / distributed.world_size()
        value = float(loss)
        lr = self.settings.lr(runner.iter)
        if not math.isfinite(value):
            self.stop_reason = f"the loss was {value} at lr {lr:.3g}"
            runner.request_stop(self.stop_reason)
            return
        beta = self.settings.smoothing
        self._average = beta * self._average + (1 - beta) * value
        smoothed = self._average / (1 - beta ** (len(self.losses) + 1))  # the moving average, unbiased
        self.lrs.append(lr)
        self.losses.append(value)
        self.smoothed.append(smoothed)
        self._best = min(self._best, smoothed)
        every = max(1, self.settings.iters // 10)
        if len(self.losses) % every == 0 and runner.is_main:
            log.info("iteration %d: lr %.3g, loss %.4f (smoothed %.4f)", len(self.losses), lr, value, smoothed)
        if len(self.losses) > 1 and smoothed > self.settings.diverge * self._best:
            self.stop_reason = (
                f"the smoothed loss {smoothed:.4g} passed {self.settings.diverge:g}x its lowest ({self._best:.4g}) "
                f"at lr {lr:.3g}"
            )
            runner.request_stop(self.stop_reason)


def suggest(lrs: list[float], smoothed: list[float], skip_begin: int) -> tuple[float | None, str]:
    """The learning rate where the smoothed loss falls fastest against log10(lr): the most negative
    slope (central differences, one-sided at the ends), leaving out the first `skip_begin` points and
    the last one, as Lightning's tuner does.

    Args:
        lrs: the learning rates, ascending.
        smoothed: the smoothed loss at each of them.
        skip_begin: the points at the start left out (the average still settles there).

    Returns:
        The suggested learning rate and the rule that chose it, in words; None and the reason when
            fewer than 3 points are left or the smoothed loss never falls among them.
    """
    end = len(smoothed) - SKIP_END
    if end - skip_begin < 3:
        return None, (
            f"no suggestion: {len(smoothed)} points before the test stopped, {skip_begin} skipped at the start; "
            "lower lr_find.max or lr_find.min, or give more lr_find.iters"
        )
    xs = [math.log10(lr) for lr in lrs[skip_begin:end]]
    ys = smoothed[skip_begin:end]
    slopes = []
    for i in range(len(ys)):
        lo, hi = max(i - 1, 0), min(i + 1, len(ys) - 1)
        slopes.append((ys[hi] - ys[lo]) / (xs[hi] - xs[lo]))
    k = min(range(len(slopes)), key=slopes.__getitem__)
    if slopes[k] >= 0:
        return None, (
            f"no suggestion: the smoothed loss never fell between lr {lrs[skip_begin]:.3g} and {lrs[end - 1]:.3g}; "
            "lower lr_find.min, or check that the model learns at all"
        )
    chosen = lrs[skip_begin + k]
    rule = (
        f"the steepest descent of the smoothed loss ({slopes[k]:.4g} per decade of lr at iteration "
        f"{skip_begin + k + 1}), leaving out the first {skip_begin} and the last {SKIP_END} of {len(smoothed)} "
        "points, as Lightning's tuner picks it"
    )
    return chosen, rule


def plot(record: dict[str, Any], path: Path) -> None:
    """lr_find.svg: the smoothed loss against the learning rate (a log axis) with the suggestion
    marked, and the loss of each iteration beside it.

    Args:
        record: lr_find.json's content (``lrs``, ``losses``, ``smoothed_losses``, ``suggestion``).
        path: the SVG file to write.
    """
    from expkit.loggers.svgplot import Panel, Series, charts

    lrs, smoothed = record["lrs"], record["smoothed_losses"]
    series = [Series(list(zip(lrs, smoothed)), label="smoothed loss")]
    if record["suggestion"] is not None:
        at = smoothed[lrs.index(record["suggestion"])]
        series.append(Series([(record["suggestion"], at)], label=f"suggestion {record['suggestion']:.3g}", line=False))
    raw = [Series(list(zip(lrs, record["losses"])), label="loss")]
    charts(
        path,
        [
            Panel(
                "LR range test: smoothed loss", series, xlabel="learning rate", ylabel="loss", log_x=True, legend=True
            ),
            Panel("loss of each iteration", raw, xlabel="learning rate", ylabel="loss", log_x=True),
        ],
    )


def _test_config(cfg: DictConfig) -> DictConfig:
    """The experiment's config, for the test: its model, optimizer, data and trainer settings, for
    `lr_find.iters` iterations, without scheduler, hooks (but the sampler's seed), loggers, validation
    time limit or resume."""
    given = cfg.get("resume")
    if given not in (False, None, "false", "null"):
        raise ConfigError(
            f"resume={given}: the range test starts from the experiment's initial weights (or load_from=); leave out resume"
        )
    test = cfg.copy()
    with open_dict(test):
        if test.sched.get("scheduler") is not None:
            log.info("The experiment's scheduler is left out: the range test sets the learning rate itself")
            test.sched.scheduler = None
        seeds = (test.get("default_hooks") or {}).get("sampler_seed")
        test.default_hooks = {"sampler_seed": seeds} if seeds is not None else {}
        test.hooks = {}
        test.logger = {}
        test.trainer.max_iters = int(cfg.lr_find.iters)
        test.trainer.save_before_limit = False
        test.resume = False
    return test


def _lr_find(cfg: DictConfig) -> None:
    from expkit.core.rng import flush_denormals

    # set before the model's first op starts torch's threads (any value but true: TrainerSettings names it)
    flush = OmegaConf.select(cfg, "trainer.flush_denormal") is True
    with flush_denormals(True) if flush else contextlib.nullcontext():
        _range_test(cfg)


def _range_test(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from expkit.checkpoint import run_checkpoint
    from expkit.config.build import build_runner
    from expkit.core.rng import algorithm_settings

    node = OmegaConf.to_container(cfg.lr_find, resolve=True)
    settings = Settings(**node)  # type: ignore[arg-type]
    work_dir = Path(HydraConfig.get().runtime.output_dir)
    runner = build_runner(_test_config(cfg), work_dir)
    runner.val_loader = runner.test_loader = None  # (the test trains only)
    test = RangeTest(settings)
    runner.register_hook(test, name="lr_range_test")
    if runner.load_from:
        run_checkpoint.load_or_resume(runner)  # load_from: the weights only
    log.info(
        "LR range test: %d iterations, lr %.3g to %.3g, stopping when the smoothed loss passes %gx its lowest",
        settings.iters,
        settings.min,
        settings.max,
        settings.diverge,
    )
    started = time.perf_counter()
    s = runner.settings
    with algorithm_settings(s.deterministic, s.cudnn_benchmark, s.flush_denormal):
        runner.train()
    seconds = time.perf_counter() - started
    if not runner.is_main:
        return
    suggestion, rule = suggest(test.lrs, test.smoothed, settings.iters // 10)
    key = "optim.lr" if "_target_" in cfg.optim else f"optim.{next(iter(runner.optimizers))}.lr"
    record = {
        "lrs": test.lrs,
        "losses": test.losses,
        "smoothed_losses": test.smoothed,
        "suggestion": suggestion,
        "rule": rule,
        "stopped": test.stop_reason,
        "param_groups": test.groups(),
        "scaled": key,  # the lr the others keep their ratio to (lrs and suggestion are its values)
        "settings": node,
        "seconds": round(seconds, 2),
    }
    write_text_atomic(work_dir / "lr_find.json", json.dumps(record, indent=2) + "\n")
    plot(record, work_dir / "lr_find.svg")
    ended = f"stopped early: {test.stop_reason}" if test.stop_reason else "ran to lr_find.max"
    print(f"LR range test: {len(test.losses)} iterations in {seconds:.1f} s, {ended}")
    if suggestion is None:
        print(f"No suggestion: {rule.removeprefix('no suggestion: ')}")
    else:
        print(f"Suggested learning rate: {suggestion:.3g} ({key}={suggestion:.3g})")
        print(f"Rule: {rule}")
    print(f"Written: {work_dir / 'lr_find.json'} and {work_dir / 'lr_find.svg'}")


@hydra_compat.main(config_path="conf", config_name="lr_find")
def run(cfg: DictConfig) -> None:
    """Hydra's task function: bad input exits 2 with one line.

    Args:
        cfg: the composed ``lr_find.yaml`` config (train.yaml's keys and ``lr_find``); Hydra composes
            it from the command line and passes it, so the function is called with no arguments (as
            ``main`` does).

    Raises:
        SystemExit: with status 2 for bad input (a setting, a part that cannot be built).
    """
    with config_errors_exit_2():
        _lr_find(cfg)


def _share_run_dir() -> None:
    """Under torchrun: one test, one run dir, picked by rank 0 (the default, or hydra.run.dir when
    given); the other ranks write no .hydra/ there."""
    from expkit.core import distributed

    if not distributed.init_or_exit():
        return
    given = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("hydra.run.dir=")), None)
    default = time.strftime("outputs/lr_find/%Y-%m-%d_%H-%M-%S-") + f"{time.time_ns() // 1000 % 10**6:06d}"
    run_dir = str(Path(distributed.broadcast_object(given or default)).resolve())
    sys.argv = [a for a in sys.argv if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={run_dir}"]
    if distributed.rank() > 0:
        sys.argv += ["hydra.output_subdir=null"]


def main() -> None:
    """``python -m expkit.lr_find``: check the command line, then run the Hydra app (``run``).

    Raises:
        SystemExit: with status 2 for bad input (also Hydra's own errors), 130 after Ctrl-C; nothing
            when the test ran.
    """
    from expkit.core.signals import take_ctrl_c

    versions.require()
    take_ctrl_c()
    argv = cli.flags_first(sys.argv[1:])
    message = (
        "the range test is one run: leave out -m and hparams_search (run it once per setting)"
        if cli.sweeping(argv)
        else None
    )
    message = (
        message
        or cli.check_keys(argv)
        or cli.check_group_choices([a for a in argv if not a.lstrip("+~").startswith("lr_find.")])
    )
    if message:
        print(f"Error: {message}", file=sys.stderr)
        sys.exit(2)
    sys.argv[1:] = argv
    prints_only = cli.prints_only(argv)  # --help, --cfg, --info: Hydra prints and exits, without torch (1.5 s)
    try:
        if not prints_only:
            _share_run_dir()
        run()
    except KeyboardInterrupt:
        print("\nInterrupted: the range test stopped; nothing was written", file=sys.stderr)
        sys.exit(130)
    except SystemExit as exc:
        sys.exit(exit_status(exc))  # (Hydra's refusal was said in one line: hydra_compat.main)
    finally:
        if not prints_only:  # (Hydra only printed: no group was joined)
            from expkit.core import distributed

            distributed.shutdown()


if __name__ == "__main__":
    main()
