"""Human-readable output of `curry-train`: units that scale, run summaries, run diffs, layout warnings.

    human_bytes(5_900)       -> '5.76 KiB'       human_bytes(16 * 2**30) -> '16.00 GiB'
    human_count(181_248)     -> '181k'           human_count(8.03e9)      -> '8.0B'
    human_flops(1.18e6)      -> '1.18 MFLOP'     human_flops(5.79e10)     -> '57.9 GFLOP'

The estimator works in bytes and counts; printing them in one fixed unit gave '0.00 GiB' and '0.000181B params'
for the tiny config, so every human line goes through these.
"""

from __future__ import annotations

import sys
from typing import Any

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def say(msg: str) -> None:
    """Progress and warnings: stderr, flushed (stdout carries only the result)."""
    print(msg, file=sys.stderr, flush=True)


def human_bytes(n: float | None) -> str:
    """Binary units that scale with the value: 512 B, 5.76 KiB, 3.75 MiB, 74.00 GiB; '-' for None."""
    if n is None:
        return "-"
    v, unit = float(n), _BYTE_UNITS[0]
    for unit in _BYTE_UNITS:
        if abs(v) < 1024 or unit == _BYTE_UNITS[-1]:
            break
        v /= 1024
    return f"{int(v)} B" if unit == "B" else f"{v:.2f} {unit}"


def human_count(n: float) -> str:
    """Parameter / FLOP counts: 950, 181k, 38.0M, 8.0B, 1.2T (decimal, as model sizes are quoted)."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            v = n / div
            return f"{v:.0f}{suffix}" if v >= 100 else f"{v:.1f}{suffix}"
    return f"{n:.0f}"


def human_flops(n: float) -> str:
    """FLOP counts with SI prefixes: 1.2 MFLOP, 57.9 GFLOP."""
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g} {prefix}FLOP"
    return f"{n:.0f} FLOP"


def warn_layout(command: str, config: str, overrides: dict[str, Any] | None, root: Any) -> list[str]:
    """Print (stderr) the layout warnings for a config the command is about to use; silent when it cannot load it
    (the command itself then reports the error, with exit 2)."""
    from curry_train.layout_warnings import layout_warnings
    from curry_train.measure.service import resolve

    try:
        cfg, _ = resolve(config, overrides, root)
    except Exception:  # noqa: BLE001 - the command reports bad input itself
        return []
    out = layout_warnings(cfg)
    for w in out:
        say(f"curry-train {command}: warning: {w}")
    return out


# ----------------------------------------------------------------------------------------------- runs


def run_summary(metrics: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of any run kind: final loss, median step time, per-rank peak, white-box verdict."""
    losses = metrics.get("losses") or metrics.get("losses_parallel") or []
    loss = metrics.get("last_loss", losses[-1] if losses else None)
    out = {"loss": loss, "step_time_s": metrics.get("step_time_s"),
           "peak_memory_bytes": metrics.get("peak_memory_bytes"), "passed": metrics.get("passed")}
    return {k: v for k, v in out.items() if v is not None}


def _summary_text(s: dict[str, Any]) -> str:
    parts = []
    if "passed" in s:
        parts.append("parity " + ("passed" if s["passed"] else "FAILED"))
    if isinstance(s.get("loss"), (int, float)):
        parts.append(f"loss {s['loss']:.4f}")
    if isinstance(s.get("step_time_s"), (int, float)):
        parts.append(f"step {s['step_time_s'] * 1e3:.1f} ms")
    if isinstance(s.get("peak_memory_bytes"), (int, float)):
        parts.append(f"peak {human_bytes(s['peak_memory_bytes'])}")
    return ", ".join(parts) or "-"


def human_runs(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no runs)"
    w = max(len(r["run_id"]) for r in rows)
    lines = [f"{'run':<{w}}  {'status':9s} {'config':14s} metrics"]
    for r in rows:
        lines.append(f"{r['run_id']:<{w}}  {r['status']:9s} {str(r['config_name']):14s} "
                     f"{_summary_text(r.get('summary') or {})}")
    return "\n".join(lines)


_HEADLINE = (("final loss", ("last_loss", "losses[-1]", "losses_parallel[-1]"), lambda v: f"{v:.4f}"),
             ("step time", ("step_time_s",), lambda v: f"{v * 1e3:.1f} ms"),
             ("tokens/s", ("tokens_per_s",), lambda v: f"{v:.0f}"),
             ("peak memory", ("peak_memory_bytes",), human_bytes),
             ("white-box", ("passed",), lambda v: "passed" if v else "FAILED"))


def _pick(values: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((values[k] for k in keys if values.get(k) is not None), None)


def human_diff(d: Any) -> str:
    """Every config change (the verdict names at most three), then the headline metrics side by side."""
    n = len(d.config_changes)
    lines = [f"{d.run_a} -> {d.run_b}: {n} config change(s){':' if n else ''}"]
    lines += [f"  {c.key}: {c.a!r} -> {c.b!r}" for c in d.config_changes]
    va = {m.metric: m.a for m in d.metric_changes}
    vb = {m.metric: m.b for m in d.metric_changes}
    for label, keys, fmt in _HEADLINE:
        x, y = _pick(va, keys), _pick(vb, keys)
        if x is None and y is None:
            continue
        num = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
        ratio = f" (x{y / x:.2f})" if num and x and label != "final loss" else ""
        lines.append(f"  {label}: {'-' if x is None else fmt(x)} -> {'-' if y is None else fmt(y)}{ratio}")
    lines.append(f"  ({len(d.metric_changes)} metrics compared; --json lists them all)")
    return "\n".join(lines)
