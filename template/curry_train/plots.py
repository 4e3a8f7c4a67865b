"""Pictures: a per-rank memory breakdown (estimate vs measured) and a pipeline-schedule timeline, drawn with
matplotlib's Agg backend (no display needed) and returned as PNG bytes for files and MCP image content.

    curry-train bench --config tiny --set parallel.dp=2 --plot mem.png
    python -m curry_train.plots --pipeline 4 --microbatches 8 --schedule 1f1b --out pp.png

matplotlib is imported inside the drawing functions, so importing this module (and starting the MCP server) stays
cheap. The memory bars use the categories of curry_train/breakdown.py, the ones the estimator and the measurement
share. The pipeline timeline is a small discrete-event simulation of the schedule's per-rank op order (GPipe,
1F1B, interleaved 1F1B as Megatron orders it, zero-bubble with weight-gradient ops filling the idle slots); idle
time is the bubble. Beyond AGGREGATE_AT micro-batches it draws the warm-up, the steady state once and the cool-down,
and says how many steady-state micro-batches it left out; every shade drawn has a legend entry, and titles and
labels are wrapped to fit the figure (tests/test_plots.py renders each picture at its largest and checks).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from curry_train.breakdown import CATEGORIES

# One colour per category (matplotlib's tab10 order), the same in every picture.
COLOURS = {"params": "#1f77b4", "param_copies": "#aec7e8", "grads": "#d62728", "grad_buffers": "#ff9896",
           "optimizer": "#ff7f0e", "activations": "#2ca02c", "loss": "#98df8a", "pp_buffers": "#17becf",
           "other": "#9467bd"}
DPI = 100


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only: never a window, works without a display
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    _pyplot().close(fig)
    return buf.getvalue()


def fit_text(fig: Any, make: Any, text: str, max_frac: float) -> Any:
    """`make(wrapped text)` with `text` wrapped onto as many lines as keep it within `max_frac` of the figure's
    width. A layout title names every axis and a profile: at 11 pt it is wider than a 9-inch figure and used to be
    clipped at both ends (tests/test_bench.py renders each picture at its largest and checks every text fits)."""
    import textwrap

    limit, width = max_frac * fig.get_figwidth() * fig.dpi, len(text)
    while True:
        t = make(textwrap.fill(text, width=width))
        if t.get_window_extent(fig.canvas.get_renderer()).width <= limit or width <= 20:
            return t
        width = int(width * 0.85)


def fit_title(fig: Any, title: str, fontsize: float) -> Any:
    """The figure's title, centred on the figure (not on an axes a right-hand legend pushes left), wrapped."""
    return fit_text(fig, lambda t: fig.suptitle(t, fontsize=fontsize), title, 0.96)


def _unit(vmax: float) -> tuple[float, str]:
    return (2**30, "GiB") if vmax >= 2**30 else (2**20, "MiB") if vmax >= 2**20 else (2**10, "KiB")


def layout_title(name: str, parallel: dict[str, Any]) -> str:
    """`tiny: dp2 zero1 tp1 pp1 cp1 ep1 recompute=none`: every axis, so two pictures never look alike by accident."""
    p = parallel
    return (f"{name}: dp{p.get('dp', 1)} zero{p.get('zero', 0)} tp{p.get('tp', 1)} pp{p.get('pp', 1)} "
            f"cp{p.get('cp', 1)} ep{p.get('ep', 1)} recompute={p.get('recompute', 'none')}")


def budget_label(budget_bytes: float, usable_bytes: float | None) -> str:
    """The one wording every picture uses for the per-rank budget line."""
    u, unit = _unit(budget_bytes)
    if usable_bytes is None or usable_bytes >= budget_bytes:
        return f"budget {budget_bytes / u:.2f} {unit} per rank"
    return f"usable {usable_bytes / u:.2f} {unit} of the {budget_bytes / u:.2f} {unit} budget per rank"


# --------------------------------------------------------------------------------------- memory breakdown


def memory_breakdown_png(bars: dict[str, dict[str, float]], **kw: Any) -> bytes:
    """memory_breakdown_figure as PNG bytes."""
    return _png(memory_breakdown_figure(bars, **kw))


def memory_breakdown_figure(bars: dict[str, dict[str, float]], *, title: str = "Per-rank memory",
                            budget_bytes: float | None = None, usable_bytes: float | None = None,
                            peaks: dict[str, float] | None = None) -> Any:
    """Stacked bars, one per label (e.g. {"estimate": {...}, "measured": {...}}), one segment per category.

    `peaks` marks a peak above the stacked categories when they differ (e.g. the CUDA allocator's high-water mark);
    the budget line is the usable budget (`usable_bytes`, the budget less the estimator's reserve) when given, else
    `budget_bytes`; it is drawn when it is on the scale of the bars and stated in the legend otherwise.
    """
    plt = _pyplot()
    totals = {k: sum(float(v.get(c) or 0) for c in CATEGORIES) for k, v in bars.items()}
    biggest = max([*totals.values(), *(peaks or {}).values(), 1.0])
    line = usable_bytes if usable_bytes is not None else budget_bytes
    show_line = bool(line) and line <= 2.5 * biggest
    div, unit = _unit(max(biggest, line if show_line else 0))
    fig, ax = plt.subplots(figsize=(9, 5.2))
    labels = list(bars)
    for cat in CATEGORIES:
        if not any(float(bars[k].get(cat) or 0) for k in labels):
            continue  # a category nothing holds stays out of the legend
        bottoms = [sum(float(bars[k].get(c) or 0) for c in CATEGORIES[:CATEGORIES.index(cat)]) / div for k in labels]
        ax.bar(labels, [float(bars[k].get(cat) or 0) / div for k in labels], bottom=bottoms, width=0.5,
               color=COLOURS[cat], label=cat, edgecolor="white", linewidth=0.5)
    for i, k in enumerate(labels):
        peak = (peaks or {}).get(k) or 0
        if peak and abs(peak - totals[k]) > 0.005 * peak:
            ax.hlines(peak / div, i - 0.3, i + 0.3, colors="black", linewidth=2)
            ax.annotate(f"peak {peak / div:.2f} {unit}", (i, peak / div), textcoords="offset points",
                        xytext=(0, 4), ha="center", fontsize=9)
        else:
            ax.annotate(f"{totals[k] / div:.2f} {unit}", (i, totals[k] / div), textcoords="offset points",
                        xytext=(0, 4), ha="center", fontsize=9)
    if budget_bytes:
        text = budget_label(budget_bytes, usable_bytes)
        if show_line:
            ax.axhline(line / div, color="#c00000", linestyle="--", linewidth=1.2, label=text)
        else:
            ax.plot([], [], " ", label=f"{text} (off scale)")
    ax.set_ylabel(f"bytes per rank ({unit})")
    ax.set_ylim(0, max(biggest, line if show_line else 0) / div * 1.15)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    fit_title(fig, title, 11)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------- pipeline timeline


@dataclass
class Op:
    kind: str  # F, B (input grad, or B+W when weights are not split), W (weight grad)
    stage: int  # virtual stage 0 .. p*v-1
    mb: int
    start: float = 0.0
    end: float = 0.0


@dataclass
class Timeline:
    p: int
    v: int
    m: int
    schedule: str
    ops: list[list[Op]]  # per rank, in execution order
    makespan: float

    @property
    def bubble_fraction(self) -> float:
        busy = sum(o.end - o.start for rank in self.ops for o in rank)
        return 1.0 - busy / (self.p * self.makespan) if self.makespan else 0.0

    @property
    def analytic_bubble(self) -> float:
        """(p-1)/(v*m) of the ideal time, as a fraction of the total: the textbook figure."""
        r = (self.p - 1) / (self.v * self.m)
        return r / (1 + r)


def _rank_order(schedule: str, p: int, v: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """(kind, virtual stage, micro-batch) in the order rank r issues its F and B ops."""
    if v == 1:
        fwd = [("F", r, i) for i in range(m)]
        bwd = [("B", r, i) for i in range(m)]
        warm = m if schedule == "gpipe" else min(p - r - 1, m)
    else:  # Megatron interleaved order: groups of p micro-batches per model chunk
        def mb(k: int) -> int:
            return (k // (p * v)) * p + k % p

        fwd = [("F", ((k // p) % v) * p + r, mb(k)) for k in range(m * v)]
        bwd = [("B", (v - 1 - (k // p) % v) * p + r, mb(k)) for k in range(m * v)]
        warm = min((p - r - 1) * 2 + (v - 1) * p, m * v)
    order = fwd[:warm]
    f, b = warm, 0
    while f < len(fwd):
        order.append(fwd[f])
        f += 1
        order.append(bwd[b])
        b += 1
    order += bwd[b:]
    return order


def simulate_pipeline(p: int, m: int, schedule: str = "1f1b", v: int = 1, *, t_f: float = 1.0,
                      t_b: float = 2.0) -> Timeline:
    """Run the schedule's per-rank op order against its data dependencies; zero_bubble splits B into B + W."""
    split = schedule == "zero_bubble"
    n_stages = p * v
    dur = {"F": t_f, "B": t_b / 2 if split else t_b, "W": t_b / 2}
    queues = [[Op(k, s, i) for k, s, i in _rank_order(schedule, p, v, m, r)] for r in range(p)]
    pending_w: list[list[Op]] = [[] for _ in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    done_ops: list[list[Op]] = [[] for _ in range(p)]
    free_at = [0.0] * p
    t = 0.0

    def ready(op: Op) -> float | None:
        """When op's inputs exist, or None if they do not yet."""
        if op.kind == "F":
            dep = done.get(("F", op.stage - 1, op.mb)) if op.stage else 0.0
        elif op.kind == "B":
            dep = done.get(("B", op.stage + 1, op.mb)) if op.stage < n_stages - 1 else done.get(("F", op.stage, op.mb))
        else:
            dep = done.get(("B", op.stage, op.mb))
        return dep

    n_ops = sum(len(q) for q in queues)
    total = n_ops + (n_ops // 2 if split else 0)  # split: one W per B
    while sum(len(d) for d in done_ops) < total:
        for r in range(p):  # one pass suffices: an op started at t cannot make another ready at t
            if free_at[r] > t:
                continue
            op = None
            if queues[r]:
                dep = ready(queues[r][0])
                if dep is not None and dep <= t:
                    op = queues[r].pop(0)
            if op is None and pending_w[r]:
                op = pending_w[r].pop(0)  # zero bubble: weight grads fill what would be idle time
            if op is None:
                continue
            op.start, op.end = t, t + dur[op.kind]
            free_at[r] = op.end
            done[(op.kind, op.stage, op.mb)] = op.end
            done_ops[r].append(op)
            if split and op.kind == "B":
                pending_w[r].append(Op("W", op.stage, op.mb))
        future = [f for f in free_at if f > t]
        if not future and sum(len(d) for d in done_ops) < total:
            raise RuntimeError(f"pipeline simulation deadlocked ({schedule}, p={p}, v={v}, m={m})")
        t = min(future) if future else t
    makespan = max(o.end for rank in done_ops for o in rank)
    return Timeline(p=p, v=v, m=m, schedule=schedule, ops=done_ops, makespan=makespan)


AGGREGATE_AT = 16  # more micro-batches than this: draw the steady state once, with its count (a barcode otherwise)
FCOL = ["#1f77b4", "#6baed6", "#08519c", "#9ecae1"]  # forward, one shade per model chunk (interleaved)
BCOL = ["#2ca02c", "#74c476", "#006d2c", "#a1d99b"]  # backward, the same
WCOL, IDLE = "#17becf", "#e6e6e6"


def drawn_microbatches(p: int, m: int, v: int = 1) -> int:
    """How many micro-batches the timeline draws: all of them up to AGGREGATE_AT, else the fewest that show the
    warm-up, the steady state and the cool-down. 1F1B: rank 0 warms up with p-1 forwards, so p+1 micro-batches
    give it two steady F/B pairs. Interleaved (Megatron groups micro-batches by p): 2p, since its warm-up is
    2(p-1) + (v-1)p of the 2pv chunk-forwards and 2pv exceeds it by pv - p + 2 >= 2."""
    if m <= AGGREGATE_AT:
        return m
    return min(m, 2 * p if v > 1 else p + 1)


def pipeline_timeline_png(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> bytes:
    """pipeline_timeline_figure as PNG bytes."""
    return _png(pipeline_timeline_figure(p, m, schedule, v))


def pipeline_timeline_figure(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> Any:
    """Ranks as rows, time left to right: forward, backward and weight-grad blocks; grey is the bubble.

    Beyond AGGREGATE_AT micro-batches the picture draws drawn_microbatches() of them (warm-up, one steady-state
    cycle, cool-down) and says how many steady-state micro-batches repeat unseen; the bubble figures in the title
    are simulated for all `m`. Blocks have no white edges: at 128 micro-batches those seams read as idle time."""
    from matplotlib.patches import Patch

    plt = _pyplot()
    full = simulate_pipeline(p, m, schedule, v)
    shown = drawn_microbatches(p, m, v)
    tl = full if shown == m else simulate_pipeline(p, shown, schedule, v)
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.55 * p))
    used: dict[str, str] = {}  # colour -> legend label: every shade drawn gets an entry
    for r in range(p):
        ax.broken_barh([(0, tl.makespan)], (r - 0.4, 0.8), facecolors=IDLE, linewidth=0)
        for op in tl.ops[r]:
            chunk = op.stage // p
            colour = WCOL if op.kind == "W" else (FCOL if op.kind == "F" else BCOL)[chunk % 4]
            name = {"F": "forward", "B": "backward", "W": "weight grad"}[op.kind]
            used[colour] = name + (f", chunk {chunk % 4}" if v > 1 and op.kind != "W" else "")
            # an edge of the block's own colour closes the anti-aliasing seams between neighbours
            ax.broken_barh([(op.start, op.end - op.start)], (r - 0.4, 0.8), facecolors=colour, edgecolors=colour,
                           linewidth=0.6)
            if (op.end - op.start) / tl.makespan > 0.02:
                ax.text((op.start + op.end) / 2, r, f"{op.kind}{op.mb}", ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, tl.makespan)
    xlabel = "time (forward = 1 unit, backward = 2 units)"
    if shown < m:
        xlabel += (f"; {shown} of {m} micro-batches drawn: the steady state (each rank alternating F and B) "
                   f"repeats for {m - shown} more, not drawn")
    fit_text(fig, lambda t: ax.set_xlabel(t, fontsize=9), xlabel, 0.6)  # the axes is ~70% of the width
    handles = [Patch(color=c, label=label) for c, label in used.items()]
    handles.append(Patch(color=IDLE, label="idle = bubble"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fit_title(fig, f"{schedule}, pp={p}, virtual stages={v}, micro-batches={m}: bubble "
              f"{full.bubble_fraction * 100:.1f}% simulated (textbook (p-1)/(v*m): {full.analytic_bubble * 100:.1f}%)",
              10)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Draw a pipeline-schedule timeline as PNG.")
    ap.add_argument("--pipeline", type=int, default=4, help="pipeline stages p")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
    ap.add_argument("--virtual", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    with open(a.out, "wb") as f:
        f.write(pipeline_timeline_png(a.pipeline, a.microbatches, a.schedule, a.virtual))
    tl = simulate_pipeline(a.pipeline, a.microbatches, a.schedule, a.virtual)
    print(f"{a.out}: bubble {tl.bubble_fraction:.3f} (textbook {tl.analytic_bubble:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
