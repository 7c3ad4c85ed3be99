"""The hand-drawn charts read right (issue 68, item 4): no text runs into another or past the
svg's edge, and each series has its legend's color, in the shapes that broke them: the LR range
test's nine decades, compare's long legend entries side by side, a sweep's two-objective front."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest
from conftest import SVG_NS, assert_svg_reads_right

from expkit.loggers.svgplot import Panel, Series, charts


def test_the_lr_range_tests_decade_labels_stay_apart(tmp_path):
    """lr_find's default range, 1e-7 to 10: nine decades on one axis wrote "1e-050.00010.001"."""
    from expkit.lr_find import plot

    lrs = [1e-7 * (1e8 ** (i / 99)) for i in range(100)]
    losses = [2.3 - 0.5 * math.tanh(math.log10(lr) + 2) for lr in lrs]
    plot({"lrs": lrs, "losses": losses, "smoothed_losses": losses, "suggestion": lrs[60]}, tmp_path / "lr_find.svg")
    assert_svg_reads_right(tmp_path / "lr_find.svg")
    root = ET.parse(tmp_path / "lr_find.svg").getroot()
    ticks = [t.text for t in root.iter(f"{SVG_NS}text") if t.get("y") == "201.0"]
    assert "1e-7" in ticks and "10" in ticks  # the ends are labelled: the axis still reads


def test_long_legend_entries_stay_in_their_panel(tmp_path):
    """compare.svg's shape: a run per line, its overrides in its legend entry, three panels side by side."""
    labels = [f"grid/{i} (completed): model=mlp model._target_=expkit.models.MLP optim.lr=0.{i + 1}" for i in range(3)]
    panels = [
        Panel(metric, [Series([(1, 0.1 * i), (2, 0.2 * i)], label) for i, label in enumerate(labels)], legend=True)
        for metric in ("val/acc", "val/loss", "train/loss")
    ]
    charts(tmp_path / "compare.svg", panels)
    colors = assert_svg_reads_right(tmp_path / "compare.svg")
    assert len({colors[label] for label in labels}) == 3
    root = ET.parse(tmp_path / "compare.svg").getroot()
    tips = [t.find(f"{SVG_NS}title") for t in root.iter(f"{SVG_NS}text")]
    assert labels[0] in [tip.text for tip in tips if tip is not None]  # the whole entry in the cut one's tooltip


def test_a_fronts_jobs_have_their_legends_colors_and_its_title_fits(tmp_path):
    """sweep.svg of a two-objective search: job 0's point on the front had another color than job 0
    in the legend (the front's line took the first), and the panel's title ran past the svg's edge."""
    from expkit.sweeps.plots import plot_sweep

    (tmp_path / "objectives.json").write_text(
        json.dumps({"objectives": ["val/acc", "model_params"], "directions": ["maximize", "minimize"]})
    )
    rows = [
        {
            "job": str(job),
            "monitor": "val/acc",
            "best": acc,
            "status": "completed",
            "overrides": f"optim.lr={lr} model.hidden={hidden}",
            "override_values": {"optim.lr": lr, "model.hidden": hidden},
            "curve": [(1, acc / 2), (2, acc)],
            "objectives": {"val/acc": acc, "model_params": params},
            "pareto": pareto,
        }
        for job, (lr, hidden, acc, params, pareto) in enumerate(
            [(0.1, 32, 0.64, 26122.0, True), (0.01, 64, 0.55, 51000.0, False), (0.05, 128, 0.83, 85002.0, True)]
        )
    ]
    plot_sweep(rows, tmp_path / "sweep.svg")
    colors = assert_svg_reads_right(tmp_path / "sweep.svg")
    root = ET.parse(tmp_path / "sweep.svg").getroot()
    children = list(root)
    legend = {
        children[i + 1].text.split(":")[0]: r.get("fill") for i, r in enumerate(children) if r.get("class") == "legend"
    }
    front = {
        c.find(f"{SVG_NS}title").text: c.get("fill")
        for c in children
        if c.get("class") == "point" and c.find(f"{SVG_NS}title").text in ("job 0", "job 1", "job 2")
    }
    assert front == {f"job {job}": legend[str(job)] for job in range(3)}, (front, legend)
    assert colors["job 0"] == legend["0"]


@pytest.mark.parametrize("count", [1, 8])
def test_category_names_are_cut_to_the_room_between_ticks(tmp_path, count):
    names = [f"expkit.models.SomeVeryLongModelName{i}" for i in range(count)]
    panel = Panel("best val/acc", [Series([(float(i), 0.5)], f"job {i}", line=False) for i in range(count)])
    panel.categories = names
    charts(tmp_path / "c.svg", [panel])
    assert_svg_reads_right(tmp_path / "c.svg")
