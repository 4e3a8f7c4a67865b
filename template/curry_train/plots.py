"""Pictures: a per-rank memory breakdown (estimate vs measured) and a pipeline-schedule timeline, drawn with
matplotlib's Agg backend (no display needed) and returned as PNG bytes for files and MCP image content.

    curry-train bench --config tiny --set parallel.dp=2 --plot mem.png
    python -m curry_train.plots --pipeline 4 --microbatches 8 --schedule 1f1b --out pp.png

matplotlib is imported inside the drawing functions, so importing this module (and starting the MCP server) stays
cheap. The memory bars use the categories of curry_train/breakdown.py, the ones the estimator and the measurement
share. The pipeline timeline is a small discrete-event simulation of the schedule's per-rank op order (GPipe,
1F1B, interleaved 1F1B as Megatron orders it, zero-bubble with weight-gradient ops filling the idle slots); idle
time is the bubble.
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


def memory_breakdown_png(bars: dict[str, dict[str, float]], *, title: str = "Per-rank memory",
                         budget_bytes: float | None = None, usable_bytes: float | None = None,
                         peaks: dict[str, float] | None = None) -> bytes:
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
    ax.set_title(title, fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    fig.tight_layout()
    return _png(fig)


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


def pipeline_timeline_png(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> bytes:
    """Ranks as rows, time left to right: forward, backward and weight-grad blocks; gaps are the bubble."""
    from matplotlib.patches import Patch

    plt = _pyplot()
    tl = simulate_pipeline(p, m, schedule, v)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.55 * p))
    fcol = ["#1f77b4", "#6baed6", "#08519c", "#9ecae1"]
    bcol = ["#2ca02c", "#74c476", "#006d2c", "#a1d99b"]
    for r in range(p):
        ax.broken_barh([(0, tl.makespan)], (r - 0.4, 0.8), facecolors="#eeeeee")
        for op in tl.ops[r]:
            chunk = op.stage // p
            colour = "#17becf" if op.kind == "W" else (fcol if op.kind == "F" else bcol)[chunk % 4]
            ax.broken_barh([(op.start, op.end - op.start)], (r - 0.4, 0.8), facecolors=colour, edgecolor="white")
            if (op.end - op.start) / tl.makespan > 0.012:
                ax.text((op.start + op.end) / 2, r, f"{op.kind}{op.mb}", ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, tl.makespan)
    ax.set_xlabel("time (forward = 1 unit, backward = 2 units)")
    ax.set_title(f"{schedule}, pp={p}, virtual stages={v}, micro-batches={m}: bubble "
                 f"{tl.bubble_fraction * 100:.1f}% simulated (textbook (p-1)/(v*m): {tl.analytic_bubble * 100:.1f}%)",
                 fontsize=10)
    handles = [Patch(color=fcol[0], label="forward"), Patch(color=bcol[0], label="backward"),
               Patch(color="#17becf", label="weight grad"), Patch(color="#eeeeee", label="idle = bubble")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return _png(fig)


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
