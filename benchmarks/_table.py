"""The benchmarks' interleaved rounds: the order of the variants in each round, and the table of
the rounds, one row a variant: min and median seconds, each as a multiple of the base variant's,
the median of the rounds' own ratios, any extra columns, and every round's seconds."""

from __future__ import annotations

import statistics


def round_order(names: list[str], r: int) -> list[str]:
    """The variants' order in round `r` (0, 1, ...): a Williams design. Over a cycle of len(names)
    rounds (twice that for an odd count) each variant runs in every place equally often and right
    after every other variant equally often. A rotation (a b c, b c a, c a b) has each variant run
    after the same one every round, so what a run leaves behind (its files written back by the
    kernel, a warm or cold page cache) weighs on one neighbour alone: in peers.py the raw loop's
    copy, which always ran after the raw loop, read 1.063x of it paired over 15 rounds.

    Args:
        names: the variants.
        r: the round's index.

    Returns:
        `names` in the round's order.
    """
    n = len(names)
    first, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: the differences of neighbours all differ
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    row = r % (n if n % 2 == 0 else 2 * n)
    order = [names[(i + row) % n] for i in first]
    return order if row < n else order[::-1]  # (odd n: the second half of the cycle, reversed)


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
    base_min, base_median = min(times[base]), statistics.median(times[base])
    width = max(len(name) for name in times)
    header = [f"{'variant':<{width}}", "min s", "median s", f"x {base} (min/min)", f"x {base} (median)"]
    header += [f"x {base} (paired, median)", *extra]
    lines = [
        "| " + " | ".join(header) + " | every round (s) |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(extra) + "---|",
    ]
    for name, values in times.items():
        low, median = min(values), statistics.median(values)
        cells = [
            f"{name:<{width}}",
            f"{low:.3f}",
            f"{median:.3f}",
            f"{low / base_min:.3f}",
            f"{median / base_median:.3f}",
            f"{statistics.median(v / b for v, b in zip(values, times[base])):.3f}",
        ]
        cells += [column[name] for column in extra.values()]
        lines.append("| " + " | ".join(cells) + f" | {' '.join(f'{v:.3f}' for v in values)} |")
    return "\n".join(lines)
