"""The benchmarks' interleaved rounds: the order of the variants in each round, and the table of
the rounds, one row a variant: min and median seconds, each as a multiple of the base variant's,
the median of the rounds' own ratios, any extra columns, and every round's seconds."""

from __future__ import annotations

import functools
import itertools
import statistics
from collections import Counter


def round_order(names: list[str], r: int) -> list[str]:
    """The variants' order in round `r` (0, 1, ...), rounds run back to back. Over a cycle of
    2 * len(names) rounds each variant runs in every place twice, right after every other variant
    twice, and right after itself twice: each round starts with the variant that ended the one
    before, so the runs across a round's edge are balanced too (``_design``).

    A rotation (a b c, b c a, c a b) has each variant run after the same one every round, so what
    a run leaves behind (a warm or cold page cache, its files written back by the kernel) would
    weigh on one neighbour alone.

    Args:
        names: the variants.
        r: the round's index.

    Returns:
        `names` in the round's order.
    """
    rows = _design(len(names))
    return [names[i] for i in rows[r % len(rows)]]


@functools.cache
def _design(n: int) -> tuple[tuple[int, ...], ...]:
    """The rounds of one cycle for `n` variants (see ``round_order``), found by a depth-first search
    (milliseconds up to 5 variants, about 5 s for 6); past 6, the Williams design of the rows
    alone (balanced within rounds, not across their edges)."""
    if n < 2:
        return (tuple(range(n)),)
    if n > 6:
        first, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: the neighbours' differences all differ
        while len(first) < n:
            first.append(low)
            low += 1
            if len(first) < n:
                first.append(high)
                high -= 1
        rows = [tuple((i + k) % n for i in first) for k in range(n)]
        return tuple(rows + [row[::-1] for row in rows] if n % 2 else rows)
    cycle, orders = 2 * n, list(itertools.permutations(range(n)))
    after: Counter[tuple[int, int]] = Counter()
    place: Counter[tuple[int, int]] = Counter()
    rows: list[tuple[int, ...]] = []

    def fits(order: tuple[int, ...]) -> bool:
        return all(after[pair] < 2 for pair in itertools.pairwise(order)) and all(
            place[spot] < 2 for spot in enumerate(order)
        )

    def count(order: tuple[int, ...], step: int) -> None:
        after.update({pair: step for pair in itertools.pairwise(order)})
        place.update({spot: step for spot in enumerate(order)})

    def extend() -> bool:
        if len(rows) == cycle:
            return rows[-1][-1] == rows[0][0]  # (the next cycle's first round starts where this one ends)
        for order in orders:
            if order[0] == (rows[-1][-1] if rows else 0) and fits(order):
                count(order, 1)
                rows.append(order)
                if extend():
                    return True
                rows.pop()
                count(order, -1)
        return False

    extend()
    return tuple(rows)


def ratios(values: list[float], base_values: list[float]) -> tuple[float, float, float]:
    """`values` against `base_values` (seconds, one per round, in round order): min/min,
    median/median, and paired (the median of each round's own ratio)."""
    return (
        min(values) / min(base_values),
        statistics.median(values) / statistics.median(base_values),
        statistics.median(v / b for v, b in zip(values, base_values)),
    )


def ratio_table(times: dict[str, list[float]], base: str, extra: dict[str, dict[str, str]] | None = None) -> str:
    """A Markdown table of `times` against `base`.

    Beside min/min and median/median (the targets' figures), the paired ratio: each round's time
    over the base's time of the same round (run next to it), the median over the rounds. A slow
    stretch of a shared machine weighs on both runs of a round alike and mostly cancels there,
    while it can move one side's minimum alone; so this column says where the gap lies when the
    other two disagree.

    Args:
        times: each variant's seconds, one per round, in round order.
        base: the variant the others are measured against (its row reads 1.000).
        extra: more columns, by heading: each variant's cell as text.

    Returns:
        The table's lines, joined.
    """
    extra = extra or {}
    width = max(len(name) for name in times)
    header = [f"{'variant':<{width}}", "min s", "median s", f"x {base} (min/min)", f"x {base} (median)"]
    header += [f"x {base} (paired, median)", *extra]
    lines = [
        "| " + " | ".join(header) + " | every round (s) |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(extra) + "---|",
    ]
    for name, values in times.items():
        cells = [f"{name:<{width}}", f"{min(values):.3f}", f"{statistics.median(values):.3f}"]
        cells += [f"{r:.3f}" for r in ratios(values, times[base])]
        cells += [column[name] for column in extra.values()]
        lines.append("| " + " | ".join(cells) + f" | {' '.join(f'{v:.3f}' for v in values)} |")
    return "\n".join(lines)


def verdict(times: dict[str, list[float]], base: str, control: str, variant: str, limit: float) -> str:
    """Whether this invocation decides that `variant`'s min/min ratio to `base` is within `limit`,
    given the invocation's own noise: `control` is `base`'s program run again (an A/A control), so its
    ratios would all read 1.000 on a quiet machine. Its largest distance from 1 (min/min, median,
    paired; at least 0.005) is the resolution: `variant` is within when its ratio plus the resolution
    is at most `limit`, over when its ratio minus the resolution is above it, undecided otherwise. One
    control is one sample of the noise, not a bound: the line says what this invocation can tell.

    Args:
        times: each variant's seconds, one per round, in round order (`base`, `control`, `variant` among them).
        base: the variant the ratios are taken against.
        control: `base`'s program, run again in the same rounds.
        variant: the variant judged.
        limit: the promise, as a ratio (1.05).

    Returns:
        One line: ``within``, ``over`` or ``undecided``, the ratio and the resolution.
    """
    noise = ratios(times[control], times[base])
    resolution = max(0.005, *(abs(r - 1) for r in noise))
    ratio = ratios(times[variant], times[base])[0]
    if ratio + resolution <= limit:
        word = "within"
    elif ratio - resolution > limit:
        word = "over"
    else:
        word = "undecided"
    return (
        f"{word}: {variant} {ratio:.3f}x {base} (min/min) against at most {limit:.2f}x; this invocation's "
        f"resolution +-{resolution:.3f} ({control} against {base}: "
        + " / ".join(f"{r:.3f}x" for r in noise)
        + " min/min / median / paired)"
    )
