"""Where expkit's whole-run time over the raw loop goes, on the peer workload of peers.py.

Each round runs the raw loop and expkit in their own processes, as ``peers.py`` does, with
timers around the pieces only one side has or both do differently: expkit's start-up
bookkeeping (provenance.json with its git processes, the metric probe), its validations and
checkpoints (state, atomic write, the ``last_checkpoint`` pointer), the hooks, and its end
(curves.svg, result.json); the raw loop's validations and ``torch.save`` calls. What is
left of expkit's time after these is its training loop. Prints, per piece, the minimum and
median over the rounds, in milliseconds per run.

``--iterations`` times the training iterations one by one instead (no timers around the pieces):
both sides get the same loader, each batch request stamped, and the table gives expkit's excess at
each place in the epoch (the median over the rounds, averaged over the epochs after the first),
the logging steps apart: whether the gap is in every iteration or in a few. The same stamps split
the whole run alike on both sides, with nothing of either side's own code named: the start (the
run's start to the first batch request), the first epoch's iterations, the later epochs'
iterations, the time between epochs (from the end of an epoch's last iteration to the next
epoch's first batch request: validation, checkpoint, epoch hooks, a new loader iterator) and the
end (from the last iteration to the run's end), each with the median of the rounds' paired
differences.

    python benchmarks/run_costs.py [--rounds 5] [--iterations] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path

from _table import round_order
from peers import EXPKIT, RAW, run_tagged

TIMERS = """
import collections, functools, json as _json, time as _t
T = collections.defaultdict(float)
def timed(owner, name, label):
    f = getattr(owner, name)
    @functools.wraps(f)
    def g(*a, **k):
        s = _t.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[label] += _t.perf_counter() - s
    setattr(owner, name, g)
"""

EXPKIT_TIMED = EXPKIT.replace(
    "from expkit import Runner, TrainerSettings",
    "from expkit import Runner, TrainerSettings\n"
    + TIMERS
    + """
import expkit.engine.runner as R, expkit.checkpoint.run_checkpoint as RC, expkit.checkpoint.checkpoint_io as CIO, expkit.core.atomic as A
import expkit.hooks.logger as LG
timed(R.provenance, "start", "provenance.json: collected, git started")
timed(R.provenance._GitQuery, "state", "provenance.json: git's answers waited for")
timed(R.provenance, "_write", "provenance.json: written")
timed(R, "probe_metrics", "metric probe (two validation samples)")
timed(R.Runner, "validate", "validations, the checkpoint after each included")
timed(RC, "save_checkpoint", "checkpoints")
timed(RC, "state_checkpoint", "  of which: the state (RNG, hooks, counters)")
timed(A, "save_atomic", "  of which: torch.save to a temporary file, then rename")
timed(CIO, "point_last_checkpoint", "  of which: the last_checkpoint pointer (old removed, new renamed in)")
timed(LG, "plot_curves", "curves.svg")
timed(R.results, "write_run_result", "result.json and provenance.json at the end")
""",
).replace(
    "report(time.perf_counter() - start",
    "print('PIECES ' + _json.dumps(T))\nreport(time.perf_counter() - start",
)

RAW_TIMED = (
    RAW.replace("log = open(", "VT, ST = [0.0], [0.0]\nlog = open(")
    .replace("    model.eval()\n", "    _v0 = time.perf_counter()\n    model.eval()\n")
    .replace(
        '    log.write(json.dumps({"step": step, "val/loss"',
        '    VT[0] += time.perf_counter() - _v0\n    log.write(json.dumps({"step": step, "val/loss"',
    )
    .replace("    torch.save(", "    _s0 = time.perf_counter()\n    torch.save(")
    .replace(
        "report(time.perf_counter() - start, correct / total)",
        "    ST[0] += time.perf_counter() - _s0\n"
        "print('PIECES ' + json.dumps({'validations': VT[0], 'checkpoints (torch.save)': ST[0]}))\n"
        "report(time.perf_counter() - start, correct / total)",
    )
)


# the training loader, each batch request stamped (the end of the iteration before it), on both sides
STAMPED = """
class Stamped:
    def __init__(self, loader):
        self.loader, self.stamps = loader, []
        self.batch_size, self.dataset, self.sampler = loader.batch_size, loader.dataset, loader.sampler
    def __len__(self):
        return len(self.loader)
    def __iter__(self):
        stamps, clock = [], time.perf_counter
        self.stamps.append(stamps)
        for batch in self.loader:
            stamps.append(clock())
            yield batch
        stamps.append(clock())
train = Stamped(train)
def make_net():"""


def _stamped(code: str) -> str:
    # the run's own start and end (both sides name its start `start` and report right after the run)
    return code.replace("def make_net():", STAMPED, 1).replace(
        "\nreport(",
        "\n_end = time.perf_counter()\nprint('STAMPS ' + json.dumps({'run': [start, _end], 'batches': train.stamps}))"
        "\nreport(",
        1,
    )


RUN_PIECES = (
    "start: to the first batch request",
    "epoch 1: its iterations",
    "epochs 2-n: their iterations",
    "between epochs: validation, checkpoint, hooks",
    "end: after the last iteration",
    "whole run",
)


def run_pieces(run: dict[str, list]) -> list[float]:
    """The seconds of each of ``RUN_PIECES`` in one run's stamps."""
    (begin, end), epochs = run["run"], run["batches"]
    return [
        epochs[0][0] - begin,
        epochs[0][-1] - epochs[0][0],
        sum(e[-1] - e[0] for e in epochs[1:]),
        sum(later[0] - earlier[-1] for earlier, later in itertools.pairwise(epochs)),
        end - epochs[-1][-1],
        end - begin,
    ]


def iterations(rounds: int, epochs: int) -> None:
    """Expkit's excess over the raw loop at each place of the epoch's training iterations, and the
    whole run split by the same stamps."""
    sides = {"raw loop": _stamped(RAW), "expkit": _stamped(EXPKIT)}
    runs: dict[str, list[dict[str, list]]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp_name:
        for code in sides.values():  # not counted: writes the byte-code caches
            run_tagged(code, 1, Path(tmp_name), ("RESULT", "STAMPS"), keep=False)
        for r in range(rounds):
            for name in round_order(list(sides), r):
                lines = run_tagged(sides[name], epochs, Path(tmp_name), ("RESULT", "STAMPS"), keep=False)
                runs[name].append(json.loads(lines["STAMPS"]))
    stamps = {name: [run["batches"] for run in runs[name]] for name in sides}

    def per_place(name: str) -> list[float]:
        """Each place's iteration time in us: the median over the rounds, the mean over epochs 2..n."""
        runs = stamps[name]
        places = len(runs[0][0]) - 1
        later = range(1, len(runs[0]))
        return [
            statistics.mean(statistics.median((run[e][i + 1] - run[e][i]) * 1e6 for run in runs) for e in later)
            for i in range(places)
        ]

    raw, ours = per_place("raw loop"), per_place("expkit")
    excess = [o - r for o, r in zip(ours, raw)]
    logging = [i for i in range(len(excess)) if (i + 1) % 10 == 0 or i == len(excess) - 1]  # (every 10: both sides)
    between = [e for i, e in enumerate(excess) if i not in logging]
    print(
        f"peer workload ({epochs} epochs), {rounds} interleaved rounds; the training iterations of epochs 2-{epochs}, "
        "each place's median over the rounds, in us"
    )
    print(f"raw loop: {statistics.mean(raw):.0f} us an iteration; expkit: {statistics.mean(ours):.0f} us")
    print(
        f"excess an iteration between logging steps: median {statistics.median(between):+.1f} us, "
        f"range {min(between):+.1f} to {max(between):+.1f} us ({len(between)} places)"
    )
    print("excess at the logging steps: " + ", ".join(f"place {i + 1} {excess[i]:+.1f} us" for i in logging))
    print("every place: " + " ".join(f"{e:+.0f}" for e in excess))
    pieces = {name: [run_pieces(run) for run in runs[name]] for name in sides}
    print(
        "\nthe whole run by the same stamps, ms a run: median (min) over the rounds, and the median of the paired differences"
    )
    print(f"| {'piece':<46} | {'raw loop':>16} | {'expkit':>16} | {'expkit - raw, paired':>20} |")
    print("|---|---:|---:|---:|")
    for i, label in enumerate(RUN_PIECES):
        mine, theirs = ([p[i] * 1e3 for p in pieces[name]] for name in ("expkit", "raw loop"))
        paired = statistics.median(m - t for m, t in zip(mine, theirs))
        cells = [f"{statistics.median(v):7.1f} ({min(v):6.1f})" for v in (theirs, mine)]
        print(f"| {label:<46} | {cells[0]:>16} | {cells[1]:>16} | {paired:>+20.1f} |")


def run_once(code: str, epochs: int, tmp: Path) -> tuple[float, dict[str, float]]:
    lines = run_tagged(code, epochs, tmp, ("RESULT", "PIECES"), keep=False)  # (see peers.py: no writeback later)
    return float(lines["RESULT"].split()[0]), json.loads(lines["PIECES"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--iterations", action="store_true", help="the training iterations one by one instead")
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs: checks the script runs (CI)")
    args = parser.parse_args()
    rounds, epochs = (1, 2) if args.quick else (args.rounds, args.epochs)
    if args.iterations:
        iterations(rounds, epochs)
        return
    runs: dict[str, list[tuple[float, dict[str, float]]]] = {"raw loop": [], "expkit": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        for code in (RAW_TIMED, EXPKIT_TIMED):  # not counted: writes the byte-code caches, as peers.py does
            run_once(code, 1, Path(tmp_name))
        for r in range(rounds):
            for name in round_order(list(runs), r):
                runs[name].append(run_once(RAW_TIMED if name == "raw loop" else EXPKIT_TIMED, epochs, Path(tmp_name)))
    print(
        f"peer workload ({epochs} epochs), {rounds} interleaved rounds; ms per run, median over the rounds "
        "(min in brackets)"
    )

    def stat(name: str, piece: str | None) -> tuple[float, float]:
        values = [(t if piece is None else pieces.get(piece, 0.0)) * 1000 for t, pieces in runs[name]]
        return statistics.median(values), min(values)

    raw_total, ours_total = stat("raw loop", None), stat("expkit", None)
    ours = {piece: stat("expkit", piece) for piece in runs["expkit"][0][1]}
    raw = {piece: stat("raw loop", piece) for piece in runs["raw loop"][0][1]}
    ckpt = ours["checkpoints"]
    val = tuple(v - c for v, c in zip(ours["validations, the checkpoint after each included"], ckpt))
    ends = [ours[k] for k in ours if not k.startswith(("  ", "checkpoints", "validations"))]
    rest_ours = tuple(
        total - v - c - sum(e[i] for e in ends) for i, (total, v, c) in enumerate(zip(ours_total, val, ckpt))
    )
    rest_raw = tuple(t - v - c for t, v, c in zip(raw_total, raw["validations"], raw["checkpoints (torch.save)"]))
    rows = [
        ("training iterations and hooks (the rest)", rest_raw, rest_ours),
        ("validations", raw["validations"], val),
        ("checkpoints", raw["checkpoints (torch.save)"], ckpt),
    ]
    rows += [(k.strip(), (0.0, 0.0), v) for k, v in ours.items() if k.startswith("  ")]
    rows += [
        (k, (0.0, 0.0), v) for k, v in zip([k for k in ours if not k.startswith(("  ", "checkpoints", "valid"))], ends)
    ]
    rows.append(("whole run", raw_total, ours_total))
    print(f"| {'piece':<58} | {'raw loop':>16} | {'expkit':>16} | {'expkit - raw':>12} |")
    print("|---|---:|---:|---:|")
    for label, (r_med, r_min), (o_med, o_min) in rows:
        sub = label.startswith("of which")
        diff = "" if sub else f"{o_med - r_med:+.1f}"
        print(f"| {label:<58} | {r_med:7.1f} ({r_min:6.1f}) | {o_med:7.1f} ({o_min:6.1f}) | {diff:>12} |")
    print(
        f"\nexpkit / raw loop, medians: {ours_total[0] / raw_total[0]:.3f}x; minimums: {ours_total[1] / raw_total[1]:.3f}x"
    )


if __name__ == "__main__":
    main()
