"""The step's makespan for the estimator: each pipeline rank's schedule order (estimator/pipeline.py `_actions`,
a port of torch.distributed.pipelining's 2.13 schedules) run with per-stage costs, and the bubble it leaves.
"""

from __future__ import annotations

from functools import lru_cache

from curry_train.estimator.layout import Layout
from curry_train.estimator.pipeline import _actions, _PipeKey, stage_ids


def _numbered(layout: Layout, rank: int) -> list[tuple[str, int, int]]:
    """_actions with global stage ids and micro-batch numbers: every schedule runs a stage's micro-batches in
    order, so the n-th F (B, I, W) of a chunk is micro-batch n. ZBV plans max(2p - 1, m) micro-batches and, like
    torch's ScheduleZBVZeroBubble, skips the actions of those beyond m."""
    ids = stage_ids(layout, rank)
    seen: dict[tuple[str, int], int] = {}
    out = []
    for kind, c in _actions(layout, rank):
        n = seen.get((kind, c), 0)
        seen[(kind, c)] = n + 1
        if n < layout.n_micro_batches:
            out.append((kind, ids[c], n))
    return out


def simulate_makespan(schedule: str, pp: int, v: int, m: int,
                      cost: tuple[tuple[float, float, float], ...]) -> tuple[float, tuple[float, ...]]:
    """(makespan, busy time per pipeline rank) of one step: each rank runs its schedule's action order (the
    port of torch.distributed.pipelining in `_actions`), each action as soon as its inputs exist, with zero
    communication cost. `cost[stage]` = (forward, input-backward, weight-backward) seconds of one micro-batch;
    a fused backward B costs I + W. torch 2.13 runs stage 0's whole backward in its W pass (benchmarks/
    pipeline_bubble.py shows it), so stage 0's I is free and its W costs I + W.

    For m beyond a few rounds the schedule is periodic and paced by its busiest rank: simulate m' <= 3p
    micro-batches with m' = m (mod p) and add (m - m') x the busiest rank's work per micro-batch."""
    m_sim = m if m <= 3 * pp else 2 * pp + m % pp
    span, busy = _simulate(schedule, pp, v, m_sim, cost)
    if m_sim == m:
        return span, busy
    per_mb = [b / m_sim for b in busy]
    extra = (m - m_sim) * max(per_mb)
    return span + extra, tuple(b * m / m_sim for b in busy)


@lru_cache(maxsize=4096)
def _simulate(schedule: str, pp: int, v: int, m: int,
              cost: tuple[tuple[float, float, float], ...]) -> tuple[float, tuple[float, ...]]:
    key = _PipeKey(pp_schedule=schedule, pp=pp, pp_virtual=v, n_micro_batches=m)
    n_stages = pp * v
    queues = [_numbered(key, r) for r in range(pp)]  # type: ignore[arg-type]
    ptr = [0] * pp
    free = [0.0] * pp
    busy = [0.0] * pp
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "G" (input grad ready) | "I", stage, mb) -> finish

    def run(kind: str, s: int, mb: int) -> tuple[list[tuple[str, int, int]], float]:
        f, i, w = cost[s]
        if kind == "F":
            return ([("F", s - 1, mb)] if s > 0 else []), f
        if kind == "W":
            return [("I", s, mb)], (i + w if s == 0 else w)
        deps = [("F", s, mb)] + ([("G", s + 1, mb)] if s < n_stages - 1 else [])
        if kind == "I":
            return deps, (0.0 if s == 0 else i)
        return deps, i + w  # B

    # worklist: a rank runs its actions in order until one waits for an input; it is woken when that input is
    # produced (each action runs once: linear in the number of actions)
    waiting: dict[tuple[str, int, int], list[int]] = {}
    ready = list(range(pp))
    while ready:
        r = ready.pop()
        q = queues[r]
        while ptr[r] < len(q):
            kind, s, mb = q[ptr[r]]
            deps, c = run(kind, s, mb)
            missing = next((d for d in deps if d not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            end = max([free[r]] + [done[d] for d in deps]) + c
            free[r] = end
            busy[r] += c
            made = [("F", s, mb)] if kind == "F" else \
                ([("G", s, mb)] if kind in ("B", "I") else []) + ([(kind, s, mb)] if kind in ("I", "W") else [])
            for key in made:
                done[key] = end
                ready.extend(waiting.pop(key, ()))
            ptr[r] += 1
    if any(ptr[r] < len(queues[r]) for r in range(pp)):
        raise RuntimeError(f"pipeline simulation deadlocked: {schedule} p={pp} v={v} m={m}")
    return max(free), tuple(busy)


def simulated_bubble(layout: Layout) -> float:
    """Idle time over ideal time, (makespan - work) / work, of the schedule's real action order with equal stages
    and F = I = W (backward = 2 x forward): (p-1)/m for GPipe and 1F1B, (p-1)/(v m) interleaved, and for zero
    bubble the warm-up/cool-down torch's ZBV really leaves (benchmarks/pipeline_bubble.py measures it)."""
    if layout.pp == 1:
        return 0.0
    one = 1.0 / (3 * layout.pp_virtual)
    span, busy = simulate_makespan(layout.pp_schedule, layout.pp, layout.pp_virtual, layout.n_micro_batches,
                                   ((one, one, one),) * (layout.pp * layout.pp_virtual))
    return span / max(busy) - 1.0


def bubble_ratio(layout: Layout) -> float:
    """The step-time model's bubble, idle over ideal time with equal stages: `simulated_bubble`, except where the
    simulation is known to equal a closed form, which the planner's thousands of layouts take without
    simulating (tests/test_estimate_time.py checks each against the simulation):
      GPipe, 1F1B                          (p-1)/m
      interleaved 1F1B, m a multiple of p   (p-1)/(v m)
      ZBV (zero bubble, v = 2), m >= 2p     (p-1)/(3 v m)   (Qi et al. 2024 with F = I = W)
    Below m = 2p torch's ZBV leaves far more than (p-1)/(3 v m) (p=4, m=4: 0.25 vs 0.125): simulated."""
    if layout.pp == 1:
        return 0.0
    p, m, v = layout.pp, layout.n_micro_batches, layout.pp_virtual
    if layout.pp_schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if layout.pp_schedule == "interleaved_1f1b" and m % p == 0:
        return (p - 1) / (v * m)
    if layout.pp_schedule == "zero_bubble" and v == 2 and m >= 2 * p:
        return (p - 1) / (3 * v * m)
    return simulated_bubble(layout)
