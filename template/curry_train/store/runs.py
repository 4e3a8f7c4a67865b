"""The run ledger: every train / bench / white-box run in SQLite (runs/ledger.sqlite3, WAL) plus a folder per run.

    python -c "from curry_train.store.runs import Ledger; print(Ledger().list()[:3])"

A run is created before anything launches (status "running") and finished in one transaction with its metrics,
so a killed process leaves a "running" row (shown as such), never a half-written one. Each run folder holds
`config.yaml` (the resolved config) and `metrics.json`. Run ids are safe names: `<kind>-<UTC time>-<6 hex>`.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from curry_train.breakdown import CATEGORIES, JsonValue
from curry_train.config import Config, dump_yaml, flatten
from curry_train.paths import atomic_write_text, check_name, run_dir, runs_dir

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id      TEXT PRIMARY KEY,
    kind        TEXT NOT NULL,
    config_name TEXT,
    status      TEXT NOT NULL,          -- running | ok | failed | cancelled
    created     REAL NOT NULL,
    finished    REAL,
    config_json TEXT NOT NULL,
    metrics_json TEXT NOT NULL DEFAULT '{}',
    error       TEXT
);
"""


class RunRecord(BaseModel):
    run_id: str
    kind: str
    config_name: str | None
    status: str
    created: float
    finished: float | None = None
    config: dict[str, Any]
    metrics: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None


class Change(BaseModel):
    key: str
    a: JsonValue = Field(description="Value in run_a (null when absent).")
    b: JsonValue = Field(description="Value in run_b (null when absent).")


class MetricChange(BaseModel):
    metric: str
    a: JsonValue = Field(description="Value in run_a (null when absent).")
    b: JsonValue = Field(description="Value in run_b (null when absent).")
    ratio: float | None = Field(None, description="b / a for numbers (None when a is 0 or not a number)")


class RunsDiff(BaseModel):
    run_a: str
    run_b: str
    config_changes: list[Change]
    metric_changes: list[MetricChange]
    verdict: str


class Ledger:
    def __init__(self, root: str | Path | None = None):
        self.root = root
        self.path = runs_dir(root) / "ledger.sqlite3"
        with self._conn() as c:
            c.execute("PRAGMA journal_mode=WAL")
            c.executescript(SCHEMA)

    @contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            conn.execute("PRAGMA busy_timeout=30000")
            yield conn
        finally:
            conn.close()

    def start(self, kind: str, cfg: Config, config_name: str | None = None) -> RunRecord:
        """Create the run's folder and row (status running); returns the record with its id."""
        run_id = f"{check_name(kind, 'kind')}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
        d = run_dir(run_id, self.root)
        d.mkdir(parents=True, exist_ok=False)
        atomic_write_text(d / "config.yaml", dump_yaml(cfg))
        rec = RunRecord(run_id=run_id, kind=kind, config_name=config_name, status="running",
                        created=time.time(), config=cfg.to_dict())
        with self._conn() as c:
            c.execute("BEGIN IMMEDIATE")
            c.execute("INSERT INTO runs (run_id, kind, config_name, status, created, config_json) VALUES (?,?,?,?,?,?)",
                      (rec.run_id, kind, config_name, "running", rec.created, json.dumps(rec.config)))
            c.execute("COMMIT")
        return rec

    def finish(self, run_id: str, *, status: str, metrics: dict[str, Any] | None = None,
               error: str | None = None) -> RunRecord:
        metrics = metrics or {}
        atomic_write_text(run_dir(run_id, self.root) / "metrics.json", json.dumps(metrics, indent=1, default=str))
        with self._conn() as c:
            c.execute("BEGIN IMMEDIATE")
            c.execute("UPDATE runs SET status=?, finished=?, metrics_json=?, error=? WHERE run_id=?",
                      (status, time.time(), json.dumps(metrics, default=str), error, run_id))
            c.execute("COMMIT")
        return self.get(run_id)

    def get(self, run_id: str) -> RunRecord:
        check_name(run_id, "run id")
        with self._conn() as c:
            row = c.execute("SELECT run_id, kind, config_name, status, created, finished, config_json, metrics_json, "
                            "error FROM runs WHERE run_id=?", (run_id,)).fetchone()
        if row is None:
            raise KeyError(f"no run {run_id!r}; list runs with `curry-train runs` or the run:// resources")
        return _record(row)

    def list(self, limit: int = 50) -> list[RunRecord]:
        with self._conn() as c:
            rows = c.execute("SELECT run_id, kind, config_name, status, created, finished, config_json, metrics_json, "
                             "error FROM runs ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
        return [_record(r) for r in rows]


def _record(row: tuple) -> RunRecord:
    return RunRecord(run_id=row[0], kind=row[1], config_name=row[2], status=row[3], created=row[4], finished=row[5],
                     config=json.loads(row[6]), metrics=json.loads(row[7] or "{}"), error=row[8])


# Metrics that describe the call rather than the run's result: never a "change" (run ids, wall time, file paths,
# echoes of the config, per-step / per-rank lists whose headline is compared instead, the fine category maxima).
_BOOKKEEPING = ("run_id", "wall_s", "plot_path", "config_name", "overrides.", "parallel.", "steps", "warmup",
                "step_times_s", "per_rank_peak_bytes", "memory_breakdown.categories.", "memory_breakdown.rank",
                "world_size", "device", "memory_budget_bytes", "config_overrides.", "losses", "tolerance.",
                "failures", "n_params_compared")


def _scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    """Comparable metrics: numbers and short strings, flattened, bookkeeping left out."""
    out = {}
    for k, v in flatten(metrics).items():
        if k == "losses" and isinstance(v, list) and v:
            out["losses[-1]"] = v[-1]  # the final loss; the verdict compares every step
        if k.startswith(_BOOKKEEPING) or k in ("steps", "warmup", "device", "world_size"):
            continue
        if isinstance(v, (int, float, bool, str)) or v is None:
            out[k] = v
    return out


def _loss_verdict(a: RunRecord, b: RunRecord) -> str | None:
    la, lb = a.metrics.get("losses") or [], b.metrics.get("losses") or []
    if not la or not lb:
        return None
    if la == lb:
        return f"identical losses ({len(la)} steps, final {la[-1]:.4f})"
    n = min(len(la), len(lb))
    worst = max(abs(x - y) for x, y in zip(la[:n], lb[:n], strict=True)) if n else 0.0
    rel = (lb[-1] - la[-1]) / abs(la[-1]) if la[-1] else float("inf")
    return (f"losses differ: final {la[-1]:.4f} -> {lb[-1]:.4f} ({rel:+.2%}), largest per-step difference "
            f"{worst:.3g} over {n} steps")


def _memory_verdict(by: dict[str, MetricChange]) -> str | None:
    m = by.get("peak_memory_bytes")
    if not m or m.ratio is None:
        return None
    cats = [(c, by[f"memory_breakdown.{c}"]) for c in CATEGORIES if f"memory_breakdown.{c}" in by]
    moved = sorted(cats, key=lambda cm: -abs((cm[1].b or 0) - (cm[1].a or 0)))[:3]
    detail = ", ".join(f"{c} {(x.a or 0) / 2**20:.2f} -> {(x.b or 0) / 2**20:.2f} MiB" for c, x in moved)
    return f"peak memory x{m.ratio:.2f}" + (f" ({detail})" if detail else "")


def diff_runs(a: RunRecord, b: RunRecord) -> RunsDiff:
    """Config keys that differ, metrics that changed with b/a ratios, and a one-line verdict."""
    fa, fb = flatten(a.config), flatten(b.config)
    changes = [Change(key=k, a=fa.get(k), b=fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
    ma, mb = _scalars(a.metrics), _scalars(b.metrics)
    metric_changes = []
    for k in sorted(set(ma) | set(mb)):
        x, y = ma.get(k), mb.get(k)
        if x == y:
            continue
        num = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
        metric_changes.append(MetricChange(metric=k, a=x, b=y, ratio=(y / x) if num and x else None))
    parts = []
    if a.kind != b.kind:
        parts.append(f"different kinds: run_a is a {a.kind} run, run_b a {b.kind} run, so their metrics do not "
                     f"compare; diff two {a.kind} runs (run://index lists them)")
    parts.append(f"{len(changes)} config change(s)" + (f" ({', '.join(c.key for c in changes[:3])})" if changes
                                                        else ""))
    by = {m.metric: m for m in metric_changes}
    for key, label in (("step_time_s", "step time"), ("tokens_per_s", "throughput")):
        m = by.get(key)
        if m and m.ratio is not None:
            parts.append(f"{label} x{m.ratio:.2f}")
    parts += [v for v in (_memory_verdict(by), _loss_verdict(a, b)) if v]
    return RunsDiff(run_a=a.run_id, run_b=b.run_id, config_changes=changes, metric_changes=metric_changes,
                    verdict="; ".join(parts))
