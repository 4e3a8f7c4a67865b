"""Pipeline bookkeeping for the estimator: which stages a rank holds, each rank's schedule order (a port of
torch.distributed.pipelining's 2.13 schedules) and the micro-batches in flight at its fullest backward starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from curry_train.estimator.layout import _Layout, stage_split
from curry_train.pipeline_split import stage_costs


def stage_ids(x: _Layout, pp_rank: int) -> list[int]:
    """Stages a pipeline rank holds (pipeline.py: ZBV places rank r on stages r and 2p-1-r, otherwise looped)."""
    if x.pp == 1:
        return [0]
    if x.schedule == "zero_bubble" and x.v == 2:
        return [pp_rank, 2 * x.pp - 1 - pp_rank]
    return [pp_rank + k * x.pp for k in range(x.v)]


def pipeline_imbalance(x: _Layout) -> float:
    """Busiest pipeline rank's forward cost over the mean rank's (1.0 without a pipeline), in the cost units of
    pipeline_split.stage_costs (layers, embedding on stage 0, head + loss on the last stage)."""
    if x.pp == 1:
        return 1.0
    layer, embed, head = stage_costs(d_model=x.D, n_heads=x.H, n_kv_heads=x.G, d_ff=x.F, vocab_size=x.V,
                                     seq_len=x.s, num_experts=x.E, top_k=x.K)
    split, n_stages = stage_split(x), x.pp * x.v
    costs = [sum(split[s] * layer + (embed if s == 0 else 0) + (head if s == n_stages - 1 else 0)
                 for s in stage_ids(x, r)) for r in range(x.pp)]
    return max(costs) / (sum(costs) / x.pp)


def _actions(x: _Layout, rank: int) -> list[tuple[str, int]]:
    """This rank's compute actions in schedule order: ("F"|"B"|"I"|"W", local chunk index).

    Ports torch.distributed.pipelining's schedules (2.13): Schedule1F1B's warm-up of p - r micro-batches,
    ScheduleGPipe's all-forward-all-backward, the interleaved/zero-bubble warm-up of _get_warmup_ops and
    ScheduleZBVZeroBubble's V order. Only the order on one rank matters for the memory it holds.
    """
    p, m, v = x.pp, x.m, x.v
    if x.schedule == "gpipe" or p == 1:
        return [("F", 0)] * m + [("B", 0)] * m
    if x.schedule == "1f1b":
        warm = min(m, p - rank)
        acts = [("F", 0)] * warm
        for _ in range(m - warm):
            acts += [("B", 0), ("F", 0)]
        return acts + [("B", 0)] * warm
    if x.schedule == "zero_bubble" and v == 2:
        n = max(2 * p - 1, m)
        acts, f0, f1, b0, b1 = [], 0, 0, 0, 0
        for _ in range(2 * (p - rank) - 1):
            acts.append(("F", 0))
            f0 += 1
        for _ in range(rank):
            acts += [("F", 1), ("F", 0)]
            f1 += 1
            f0 += 1
        for _ in range(p - rank):
            acts += [("F", 1), ("I", 1), ("W", 1)]
            f1 += 1
            b1 += 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                acts.append(("F", 0))
                f0 += 1
            acts += [("I", 0), ("W", 0), ("F", 1), ("I", 1), ("W", 1)]
            b0 += 1
            f1 += 1
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(rank):
            acts += [("I", 0), ("I", 1)]
            b0 += 1
            b1 += 1
        for _ in range(p - rank):
            acts += [("I", 0), ("W", 0)]
            b0 += 1
            w0 += 1
        acts += [("W", 1)] * (b1 - w1) + [("W", 0)] * (b0 - w0)
        return acts
    # interleaved 1F1B / interleaved zero bubble (looped placement)
    zb = x.schedule == "zero_bubble"
    rounds = max(1, m // p)
    per_round = m // rounds
    warm = min((v - 1) * per_round + (1 if zb else 2) * (p - 1 - rank), m * v)
    total = m * v

    def fwd_chunk(step: int) -> int:
        return (step // per_round) % v

    def bwd_chunk(step: int) -> int:
        return v - 1 - ((step - warm) // per_round) % v

    acts: list[tuple[str, int]] = []
    pending_w: list[int] = []
    for op in range(total + warm):
        if op < total:
            acts.append(("F", fwd_chunk(op)))
        if op >= warm:  # steady state and cool-down: one backward per op
            c = bwd_chunk(op)
            acts.append(("I" if zb else "B", c))
            if zb:
                pending_w.append(c)
                if op - warm >= rank:
                    acts.append(("W", pending_w.pop(0)))
    acts += [("W", c) for c in pending_w]
    return acts


@dataclass(frozen=True)
class _PipeState:
    """A pipeline rank just before one of its backwards starts."""

    held: tuple[int, ...]  # per local chunk: micro-batches whose activations are alive
    grads: float  # share of this rank's chunks that already hold gradients (0 before the first backward)
    head_fwds: int  # forwards the head chunk has run so far (their logits are kept by step())
    chunk: int  # the chunk whose backward starts


def pipe_states(x: _Layout, rank: int) -> list[_PipeState]:
    """The backward starts worth evaluating: the one with the most activations alive, the most with gradients
    already there, and (last stage) the last one, when every micro-batch's logits are kept.

    A zero-bubble input-backward (I) keeps the graph, and so the activations, until its weight-backward (W)."""
    return _pipe_states(x.schedule, x.pp, x.v, x.m, rank)


@lru_cache(maxsize=8192)
def _pipe_states(schedule: str, pp: int, v: int, m: int, rank: int) -> list[_PipeState]:
    # The schedules are periodic after the warm-up: simulate at most 8 rounds of micro-batches (keeping m's
    # residue mod pp, which the interleaved warm-up reads) and let the head rank's kept logits count all m.
    m_sim = m if m <= 8 * pp * v else 8 * pp * v + m % pp
    states = _simulate_pipe(schedule, pp, v, m_sim, rank)
    if m_sim == m:
        return states
    return [_PipeState(s_.held, s_.grads, m, s_.chunk) if s_.head_fwds and i else s_ for i, s_ in enumerate(states)]


def _simulate_pipe(schedule: str, pp: int, v: int, m: int, rank: int) -> list[_PipeState]:
    x = _PipeKey(schedule=schedule, pp=pp, v=v, m=m)
    stages = stage_ids(x, rank)  # type: ignore[arg-type]
    n_chunks = len(stages)
    head = stages.index(pp * v - 1) if pp * v - 1 in stages else -1
    held = [0] * n_chunks
    has_grads = [False] * n_chunks
    fwd_head, n_grads = 0, 0
    most = with_grads = last = None
    most_key = wg_key = (-1, -1.0)
    for kind, c in _actions(x, rank):  # type: ignore[arg-type]
        if kind == "F":
            held[c] += 1
            fwd_head += c == head
            continue
        if kind in ("B", "I"):
            total, g = sum(held), n_grads / n_chunks
            if (total, g) > most_key or (g, total) > wg_key:
                state = _PipeState(tuple(held), g, fwd_head, c)
                if (total, g) > most_key:
                    most, most_key = state, (total, g)
                if (g, total) > wg_key:
                    with_grads, wg_key = state, (g, total)
            last = (tuple(held), n_grads / n_chunks, fwd_head, c)
        if kind in ("B", "W"):
            held[c] -= 1
            if not has_grads[c]:
                has_grads[c] = True
                n_grads += 1
    if most is None:
        return [_PipeState(tuple(held), 0.0, fwd_head, 0)]
    out = [most] + ([with_grads] if with_grads != most else [])
    if head >= 0 and last is not None:
        last_state = _PipeState(*last)
        if last_state not in out:
            out.append(last_state)
    return out


@dataclass(frozen=True)
class _PipeKey:
    """The fields of _Layout the schedule simulation reads."""

    schedule: str
    pp: int
    v: int
    m: int


def in_flight(x: _Layout, rank: int) -> tuple[list[int], int]:
    """(per local chunk: micro-batches held at the fullest backward start, their total)."""
    s_ = max(pipe_states(x, rank), key=lambda q: sum(q.held))
    return list(s_.held), sum(s_.held)


def bubble_fraction(x: _Layout) -> float:
    """Idle fraction of a pipeline step (estimation-formulas.md §3): (p-1)/m for GPipe and 1F1B, divided by
    v for interleaving, and about a third of that again for zero bubble (B/W split fills most of it)."""
    if x.pp == 1:
        return 0.0
    f = (x.pp - 1) / (x.m * (x.v if x.schedule in ("interleaved_1f1b", "zero_bubble") else 1))
    return f / 3 if x.schedule == "zero_bubble" else f
