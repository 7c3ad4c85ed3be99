"""The benchmarks' table of interleaved rounds, one row a variant: min and median seconds, each
as a multiple of the base variant's, the median of the rounds' own ratios, any extra columns,
and every round's seconds."""

from __future__ import annotations

import statistics


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
