"""The pictures, rendered at their largest realistic size: every text inside the figure, a legend entry for every
shade drawn, no white seams between blocks, and a pipeline beyond AGGREGATE_AT micro-batches drawn once with its
count instead of as a barcode.

    .venv/bin/pytest tests/test_plots.py -q
"""

from __future__ import annotations

import pytest
from curry_train.breakdown import CATEGORIES
from curry_train.plots import (
    AGGREGATE_AT,
    layout_title,
    memory_breakdown_figure,
    pipeline_timeline_figure,
    simulate_pipeline,
)
from matplotlib.colors import to_hex
from matplotlib.text import Text

# The largest a real call draws: a 64-character config name with every axis set (MCP estimate_memory's title),
# every category on both bars with a peak above each, an off-scale budget; pipelines as deep as published runs go
# (pp 16 for Llama-3 405B) at 128 micro-batches, and interleaved with 4 chunks per rank.
LONG = layout_title("x" * 48 + "-llama3-405b-cl", {"dp": 1024, "zero": 3, "tp": 8, "pp": 16, "cp": 16, "ep": 64,
                                                    "recompute": "selective"}) + ", estimate (MI300X profile)"
PIPELINES = [(16, 128, "1f1b", 1), (8, 128, "interleaved_1f1b", 4), (8, 64, "zero_bubble", 1), (8, 64, "gpipe", 1),
             (4, 8, "1f1b", 1)]


def _memory_figure():
    bars = {k: {c: (i + 1) * 3.1 * 2**30 * (1.1 if k == "measured" else 1) for i, c in enumerate(CATEGORIES)}
            for k in ("estimate", "measured")}
    peaks = {k: sum(v.values()) * 1.2 for k, v in bars.items()}
    return memory_breakdown_figure(bars, title=LONG, budget_bytes=8 * 2**40, usable_bytes=7.5 * 2**40, peaks=peaks)


def _outside(fig) -> list[str]:
    fig.canvas.draw()
    renderer, w, h = fig.canvas.get_renderer(), fig.bbox.width, fig.bbox.height
    bad = []
    for t in fig.findobj(Text):
        if not t.get_visible() or not t.get_text().strip():
            continue
        if t.axes is not None and t in t.axes.texts:  # a block's label: clipped to the axes on purpose
            continue
        b = t.get_window_extent(renderer)
        if b.x0 < -1 or b.y0 < -1 or b.x1 > w + 1 or b.y1 > h + 1:
            bad.append(f"{t.get_text()[:60]!r} at x {b.x0:.0f}..{b.x1:.0f} of {w:.0f}, "
                       f"y {b.y0:.0f}..{b.y1:.0f} of {h:.0f}")
    return bad


def test_every_text_of_the_memory_breakdown_fits_in_the_figure():
    fig = _memory_figure()
    assert _outside(fig) == []
    assert "MI300X profile" in fig._suptitle.get_text().replace("\n", " ")  # wrapped, whole


@pytest.mark.parametrize("p,m,schedule,v", PIPELINES)
def test_every_pipeline_timeline_fits_has_a_legend_for_every_shade_and_no_white_seams(p, m, schedule, v):
    fig = pipeline_timeline_figure(p, m, schedule, v)
    assert _outside(fig) == []
    ax = fig.axes[0]
    legend = {to_hex(h.get_facecolor()) for h in ax.get_legend().legend_handles}
    drawn = set()
    for coll in ax.collections:
        faces = {to_hex(c) for c in coll.get_facecolors()}
        drawn |= faces
        if coll.get_linewidths().max() > 0:  # an edge, if any, in the block's own colour: no seam reads as idle
            assert {to_hex(c) for c in coll.get_edgecolors()} <= faces
    assert drawn <= legend, sorted(drawn - legend)
    if v > 1:
        assert len(drawn) >= 2 * v + 1  # a shade per chunk, forward and backward, plus idle: each in the legend


def test_a_long_pipeline_is_drawn_once_with_its_count_and_the_bubble_of_all_micro_batches():
    fig = pipeline_timeline_figure(8, 128, "1f1b")
    ax = fig.axes[0]
    labels = {t.get_text() for t in ax.texts}
    assert max(int(s[1:]) for s in labels) < AGGREGATE_AT  # no block for micro-batch 127
    assert "9 of 128 micro-batches drawn" in ax.get_xlabel().replace("\n", " ")
    assert "repeats for 119 more" in ax.get_xlabel().replace("\n", " ")
    full = simulate_pipeline(8, 128, "1f1b")
    assert f"bubble {full.bubble_fraction * 100:.1f}%" in fig._suptitle.get_text().replace("\n", " ")
    assert len(ax.collections) < 8 * 2 * AGGREGATE_AT  # blocks for the drawn micro-batches only
    small = pipeline_timeline_figure(4, AGGREGATE_AT, "1f1b")  # up to AGGREGATE_AT: every micro-batch drawn
    assert "drawn" not in small.axes[0].get_xlabel()
