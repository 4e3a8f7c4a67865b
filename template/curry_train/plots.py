"""Pictures without matplotlib: a per-rank memory breakdown (estimate vs measured) and a pipeline timeline.

    curry-train bench --config tiny --set parallel.dp=2 --plot mem.png
    python -m curry_train.plots --pipeline 4 --microbatches 8 --schedule 1f1b --out pp.png

A ~60-line PNG encoder (zlib + struct, RGB, filter 0) and a 5x7 bitmap font are enough for labelled bars, so the
pictures work on any machine the template runs on and travel as MCP image content. The pipeline timeline is a
small discrete-event simulation of the schedule's per-rank op order (GPipe, 1F1B, interleaved 1F1B as Megatron
orders it, zero-bubble with weight-gradient ops filling the idle slots); idle cells are the bubble.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

RGB = tuple[int, int, int]
WHITE, BLACK, GREY, LIGHT = (255, 255, 255), (20, 20, 20), (150, 150, 150), (228, 228, 228)
COMPONENT_COLOURS: dict[str, RGB] = {
    "params": (66, 133, 244), "grads": (219, 68, 55), "optimizer": (244, 180, 0),
    "activations": (15, 157, 88), "other": (171, 71, 188),
}
COMPONENTS = tuple(COMPONENT_COLOURS)

# 5x7 glyphs, one string of 5 bits per row (upper case; lower case is drawn as upper case).
_FONT = {
    " ": ["00000"] * 7,
    "A": ["01110", "10001", "10001", "11111", "10001", "10001", "10001"],
    "B": ["11110", "10001", "10001", "11110", "10001", "10001", "11110"],
    "C": ["01110", "10001", "10000", "10000", "10000", "10001", "01110"],
    "D": ["11110", "10001", "10001", "10001", "10001", "10001", "11110"],
    "E": ["11111", "10000", "10000", "11110", "10000", "10000", "11111"],
    "F": ["11111", "10000", "10000", "11110", "10000", "10000", "10000"],
    "G": ["01110", "10001", "10000", "10111", "10001", "10001", "01111"],
    "H": ["10001", "10001", "10001", "11111", "10001", "10001", "10001"],
    "I": ["01110", "00100", "00100", "00100", "00100", "00100", "01110"],
    "J": ["00111", "00010", "00010", "00010", "00010", "10010", "01100"],
    "K": ["10001", "10010", "10100", "11000", "10100", "10010", "10001"],
    "L": ["10000", "10000", "10000", "10000", "10000", "10000", "11111"],
    "M": ["10001", "11011", "10101", "10101", "10001", "10001", "10001"],
    "N": ["10001", "10001", "11001", "10101", "10011", "10001", "10001"],
    "O": ["01110", "10001", "10001", "10001", "10001", "10001", "01110"],
    "P": ["11110", "10001", "10001", "11110", "10000", "10000", "10000"],
    "Q": ["01110", "10001", "10001", "10001", "10101", "10010", "01101"],
    "R": ["11110", "10001", "10001", "11110", "10100", "10010", "10001"],
    "S": ["01111", "10000", "10000", "01110", "00001", "00001", "11110"],
    "T": ["11111", "00100", "00100", "00100", "00100", "00100", "00100"],
    "U": ["10001", "10001", "10001", "10001", "10001", "10001", "01110"],
    "V": ["10001", "10001", "10001", "10001", "10001", "01010", "00100"],
    "W": ["10001", "10001", "10001", "10101", "10101", "10101", "01010"],
    "X": ["10001", "10001", "01010", "00100", "01010", "10001", "10001"],
    "Y": ["10001", "10001", "01010", "00100", "00100", "00100", "00100"],
    "Z": ["11111", "00001", "00010", "00100", "01000", "10000", "11111"],
    "0": ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    "1": ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    "2": ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    "3": ["11111", "00010", "00100", "00010", "00001", "10001", "01110"],
    "4": ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    "5": ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    "6": ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    "7": ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    "8": ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    "9": ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
    ".": ["00000", "00000", "00000", "00000", "00000", "01100", "01100"],
    ",": ["00000", "00000", "00000", "00000", "01100", "00100", "01000"],
    ":": ["00000", "01100", "01100", "00000", "01100", "01100", "00000"],
    "%": ["11000", "11001", "00010", "00100", "01000", "10011", "00011"],
    "-": ["00000", "00000", "00000", "11111", "00000", "00000", "00000"],
    "+": ["00000", "00100", "00100", "11111", "00100", "00100", "00000"],
    "=": ["00000", "00000", "11111", "00000", "11111", "00000", "00000"],
    "(": ["00010", "00100", "01000", "01000", "01000", "00100", "00010"],
    ")": ["01000", "00100", "00010", "00010", "00010", "00100", "01000"],
    "/": ["00000", "00001", "00010", "00100", "01000", "10000", "00000"],
    "_": ["00000", "00000", "00000", "00000", "00000", "00000", "11111"],
    "<": ["00010", "00100", "01000", "10000", "01000", "00100", "00010"],
    ">": ["01000", "00100", "00010", "00001", "00010", "00100", "01000"],
    "*": ["00000", "00100", "10101", "01110", "10101", "00100", "00000"],
    "?": ["01110", "10001", "00001", "00010", "00100", "00000", "00100"],
}


class Canvas:
    """An RGB raster with rectangles and text; `png()` encodes it."""

    def __init__(self, width: int, height: int, background: RGB = WHITE):
        self.w, self.h = width, height
        self.rows = [bytearray(bytes(background) * width) for _ in range(height)]

    def rect(self, x0: float, y0: float, x1: float, y1: float, colour: RGB) -> None:
        xa, xb = sorted((max(0, round(x0)), min(self.w, round(x1))))
        ya, yb = sorted((max(0, round(y0)), min(self.h, round(y1))))
        if xb <= xa or yb <= ya:
            return
        span = bytes(colour) * (xb - xa)
        for y in range(ya, yb):
            self.rows[y][3 * xa:3 * xb] = span

    def outline(self, x0: float, y0: float, x1: float, y1: float, colour: RGB = BLACK) -> None:
        self.rect(x0, y0, x1, y0 + 1, colour)
        self.rect(x0, y1 - 1, x1, y1, colour)
        self.rect(x0, y0, x0 + 1, y1, colour)
        self.rect(x1 - 1, y0, x1, y1, colour)

    def text(self, x: float, y: float, s: str, colour: RGB = BLACK, scale: int = 2) -> int:
        """Draw `s` with its top-left at (x, y); returns the width drawn in pixels."""
        cx = int(x)
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT["?"])
            for r, bits in enumerate(glyph):
                for c, bit in enumerate(bits):
                    if bit == "1":
                        self.rect(cx + c * scale, y + r * scale, cx + (c + 1) * scale, y + (r + 1) * scale, colour)
            cx += 6 * scale
        return cx - int(x)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + \
            chunk(b"IEND", b"")


def text_width(s: str, scale: int = 2) -> int:
    return len(s) * 6 * scale


def _mib(b: float) -> str:
    if b >= 2**30:
        return f"{b / 2**30:.2f} GIB"
    return f"{b / 2**20:.2f} MIB"


# --------------------------------------------------------------------------------------- memory breakdown


def memory_breakdown_png(bars: dict[str, dict[str, float]], *, title: str = "PER-RANK MEMORY",
                         budget_bytes: float | None = None, peaks: dict[str, float] | None = None) -> bytes:
    """Stacked bars, one per label (e.g. {"estimate": {...}, "measured": {...}}), components params..other.

    `peaks` marks a peak above the stacked components (e.g. the allocator's high-water mark); `budget_bytes` draws
    the per-rank budget as a dashed line when it is on the same scale as the bars (else it is stated in text).
    """
    width, height = 820, 440
    c = Canvas(width, height)
    c.text(20, 14, title, scale=2)
    top, bottom, left = 70, height - 50, 100
    chart_right = left + 40 + 130 * max(1, len(bars))
    totals = {k: sum(float(v.get(comp) or 0) for comp in COMPONENTS) for k, v in bars.items()}
    biggest = max([*totals.values(), *(peaks or {}).values(), 1.0])
    show_budget = bool(budget_bytes) and budget_bytes <= 2.5 * biggest
    vmax = max(biggest, budget_bytes if show_budget else 0) * 1.15
    scale_y = (bottom - top) / vmax
    c.rect(left, top, left + 1, bottom, BLACK)
    c.rect(left, bottom, chart_right, bottom + 1, BLACK)
    for i in range(5):  # y ticks
        v = vmax * i / 4
        y = bottom - v * scale_y
        c.rect(left - 5, y, left, y + 1, BLACK)
        c.text(left - 8 - text_width(_mib(v), 1), y - 3, _mib(v), GREY, scale=1)
    for i, (label, comp) in enumerate(bars.items()):
        x0 = left + 40 + i * 130
        y = bottom
        for name in COMPONENTS:
            h = float(comp.get(name) or 0) * scale_y
            c.rect(x0, y - h, x0 + 80, y, COMPONENT_COLOURS[name])
            y -= h
        c.outline(x0, y, x0 + 80, bottom + 1)
        c.text(x0 + 40 - text_width(label, 1) / 2, bottom + 8, label, scale=1)
        peak = (peaks or {}).get(label) or 0
        if peak and abs(peak - totals[label]) > 0.005 * peak:
            py = bottom - peak * scale_y
            c.rect(x0 - 6, py, x0 + 86, py + 2, BLACK)
            c.text(x0 + 40 - text_width("PEAK " + _mib(peak), 1) / 2, py - 12, "PEAK " + _mib(peak), scale=1)
        else:
            c.text(x0 + 40 - text_width(_mib(totals[label]), 1) / 2, y - 12, _mib(totals[label]), scale=1)
    lx, ly = chart_right + 30, top
    if budget_bytes:
        note = "BUDGET " + _mib(budget_bytes) + ("" if show_budget else " (OFF SCALE)")
        c.text(lx, ly, note, (200, 0, 0), scale=1)
        ly += 24
    if show_budget:
        by = bottom - budget_bytes * scale_y
        for x in range(left, chart_right, 10):
            c.rect(x, by, x + 6, by + 2, (200, 0, 0))
    labels = list(bars)
    c.text(lx + 110, ly, "".join(f"{lab[:10]:>11}" for lab in labels), scale=1)
    ly += 18
    for name in reversed(COMPONENTS):
        c.rect(lx, ly, lx + 14, ly + 14, COMPONENT_COLOURS[name])
        c.text(lx + 20, ly + 4, name, scale=1)
        c.text(lx + 110, ly + 4, "".join(f"{_mib(float(bars[lab].get(name) or 0)):>11}" for lab in labels), scale=1)
        ly += 24
    c.text(lx + 20, ly + 4, "TOTAL", scale=1)
    c.text(lx + 110, ly + 4, "".join(f"{_mib(totals[lab]):>11}" for lab in labels), scale=1)
    return c.png()


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
    """Ranks as rows, time left to right: forward, backward, weight-grad blocks; grey gaps are the bubble."""
    tl = simulate_pipeline(p, m, schedule, v)
    width = 900
    row_h, top, left = 34, 70, 90
    height = top + p * row_h + 70
    c = Canvas(width, height)
    c.text(16, 12, f"{schedule} PP={p} V={v} M={m}", scale=2)
    c.text(16, 38, f"BUBBLE {tl.bubble_fraction * 100:.1f}% SIMULATED (TEXTBOOK (P-1)/(V*M) GIVES "
                   f"{tl.analytic_bubble * 100:.1f}%)", GREY, scale=1)
    sx = (width - left - 20) / tl.makespan
    fcol = [(66, 133, 244), (120, 170, 250), (30, 90, 200), (150, 190, 255)]
    bcol = [(15, 157, 88), (90, 200, 140), (10, 110, 60), (140, 220, 170)]
    for r in range(p):
        y = top + r * row_h
        c.rect(left, y + 4, left + tl.makespan * sx, y + row_h - 4, LIGHT)
        c.text(10, y + 12, f"RANK {r}", scale=1)
        for op in tl.ops[r]:
            chunk = op.stage // p
            colour = (fcol if op.kind == "F" else bcol)[chunk % 4] if op.kind != "W" else (0, 150, 160)
            x0, x1 = left + op.start * sx, left + op.end * sx
            c.rect(x0, y + 4, x1, y + row_h - 4, colour)
            c.outline(x0, y + 4, x1 + 1, y + row_h - 4, WHITE)
            if x1 - x0 >= 14:
                c.text(x0 + 3, y + 12, f"{op.kind}{op.mb}", WHITE, scale=1)
    ly = top + p * row_h + 20
    x = left
    for label, colour in (("FORWARD", fcol[0]), ("BACKWARD", bcol[0]), ("WEIGHT GRAD", (0, 150, 160)),
                          ("IDLE = BUBBLE", LIGHT)):
        c.rect(x, ly, x + 14, ly + 14, colour)
        x += 20 + c.text(x + 20, ly + 3, label, scale=1) + 20
    return c.png()


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
