"""Pipeline bookkeeping for the estimator: which stages a rank holds, each rank's schedule order (a port of
torch.distributed.pipelining's 2.13 schedules) and the micro-batches in flight at its fullest backward starts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from operator import itemgetter

from curry_train.estimator.layout import Layout
from curry_train.pipeline_split import pipeline_stage_ids


def stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """Stages a pipeline rank holds: the template's own split (rules.pipeline_stage_ids)."""
    return pipeline_stage_ids(layout.pp, layout.pp_virtual, layout.pp_schedule, pp_rank)


def _actions(layout: Layout, rank: int) -> list[tuple[str, int]]:
    """This rank's compute actions in schedule order: ("F"|"B"|"I"|"W", local chunk index).

    Ports torch.distributed.pipelining's schedules (2.13): Schedule1F1B's warm-up of p - r micro-batches,
    ScheduleGPipe's all-forward-all-backward, the interleaved/zero-bubble warm-up of _get_warmup_ops and
    ScheduleZBVZeroBubble's V order. Only the order on one rank matters for the memory it holds.
    """
    p, m, v = layout.pp, layout.n_micro_batches, layout.pp_virtual
    if layout.pp_schedule == "gpipe" or p == 1:
        return [("F", 0)] * m + [("B", 0)] * m
    if layout.pp_schedule == "1f1b":
        warm = min(m, p - rank)
        acts = [("F", 0)] * warm
        for _ in range(m - warm):
            acts += [("B", 0), ("F", 0)]
        return acts + [("B", 0)] * warm
    if layout.pp_schedule == "zero_bubble" and v == 2:
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
    zb = layout.pp_schedule == "zero_bubble"
    rounds = max(1, m // p)
    per_round = m // rounds
    warm = min((v - 1) * per_round + (1 if zb else 2) * (p - 1 - rank), m * v)
    total = m * v

    # forward op `step` runs chunk (step // per_round) % v, backward op `step` v-1 - ((step-warm) // per_round) % v
    acts: list[tuple[str, int]] = []
    pending_w: list[int] = []
    bwd = "I" if zb else "B"
    for op in range(total + warm):
        if op < total:
            acts.append(("F", (op // per_round) % v))
        if op >= warm:  # steady state and cool-down: one backward per op
            c = v - 1 - ((op - warm) // per_round) % v
            acts.append((bwd, c))
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
    kept: tuple[bool, ...] = ()  # per local chunk: every FSDP unit still unsharded (zero 3; see _kept_units)
    own_grads: bool = True  # the starting chunk already holds gradients from an earlier backward
    fwd: bool = False  # not a backward start: the end of chunk's forward (held counts its micro-batch)
    weight: bool = False  # not a backward start: a zero-bubble W whose chunk a forward resharded (held counts it)
    pending: tuple[int, ...] = ()  # per local chunk: zero-bubble I's whose W has not run yet (this W's own included)


def pipe_states(layout: Layout, rank: int) -> list[_PipeState]:
    """The backward starts worth evaluating: the one with the most activations alive, the most with gradients
    already there, each for every pattern of chunks whose FSDP units torch keeps gathered (_kept_units), and
    (last stage) the last one, when every micro-batch's logits are kept. Also the fullest forward ends while
    another chunk's units are kept (`fwd`), and zero 3's fullest zero-bubble W starts that gather again (`weight`).
    A zero-bubble input-backward (I) keeps the graph, and so the activations, until its weight-backward (W)."""
    key = schedule_key(layout)
    return _pipe_states(*key[:4], rank, *key[4:])


def schedule_key(layout: Layout) -> tuple[str, int, int, int, bool]:
    """What a rank's schedule states depend on besides the rank: (schedule, pp, v, m, units tracked: zero 3)."""
    return layout.pp_schedule, layout.pp, layout.pp_virtual, layout.n_micro_batches, layout.reshards_blocks


def periodic_rounds(schedule: str, pp: int, v: int, m: int) -> int:
    """Rounds of pp x v micro-batches after which a rank's schedule states repeat (but for the head's count of
    forwards): 3 for 1F1B, ZBV and interleaved 1F1B at m a multiple of pp (tests/test_every_rank.py compares
    them with longer simulations over a grid); 8 otherwise (GPipe holds every micro-batch, so it does not repeat;
    interleaved rounds of uneven size)."""
    if schedule == "1f1b" or (schedule == "zero_bubble" and v == 2) or \
            (schedule == "interleaved_1f1b" and m % pp == 0):
        return 3
    return 8


@lru_cache(maxsize=8192)
def _pipe_states(schedule: str, pp: int, v: int, m: int, rank: int, units: bool = False) -> list[_PipeState]:
    # The schedules are periodic after the warm-up: simulate at most a few rounds of micro-batches (keeping m's
    # residue mod pp, which the interleaved warm-up reads) and let the head rank's kept logits count all m.
    rounds = periodic_rounds(schedule, pp, v, m)
    m_sim = m if m <= rounds * pp * v else rounds * pp * v + m % pp
    states = _simulate_pipe(schedule, pp, v, m_sim, rank, units)
    if m_sim == m:
        return states
    return [replace(s_, head_fwds=m) if s_.head_fwds and i else s_ for i, s_ in enumerate(states)]


def _simulate_pipe(schedule: str, pp: int, v: int, m: int, rank: int, units: bool) -> list[_PipeState]:
    """`units`: track the chunks whose units torch keeps gathered (zero 3; otherwise none are, as before)."""
    layout = _PipeKey(pp_schedule=schedule, pp=pp, pp_virtual=v, n_micro_batches=m)
    stages = stage_ids(layout, rank)  # type: ignore[arg-type]
    n_chunks = len(stages)
    head = stages.index(pp * v - 1) if pp * v - 1 in stages else -1
    held = [0] * n_chunks
    has_grads = [False] * n_chunks
    fwd_head, n_grads = 0, 0
    last = None
    pending = [0] * n_chunks  # I's awaiting their W: each keeps its graph and its linears' output gradients
    acts = _kept_units(layout, rank) if units else [(k, c, 0) for k, c in _actions(layout, rank)]  # type: ignore
    top = 1 << n_chunks

    def fields(fwd: bool = False, weight: bool = False) -> tuple:  # the _PipeState fields now (kept: a mask)
        return (tuple(held), n_grads / n_chunks, fwd_head, c, kept, has_grads[c], fwd, weight, tuple(pending))

    # Kept per pattern of kept units: the fullest backward start, the one with the most gradients, the fullest
    # forward end while another chunk is kept, the fullest zero-bubble W that gathers again (the first of equal
    # ones; the loop is the planner's hot path, so the slots are updated inline). Only the head's rank reports
    # its last backward start, snapshot at that action.
    last_bwd = next((i for i in range(len(acts) - 1, -1, -1) if acts[i][0] in ("B", "I")), -1) if head >= 0 else -1
    zb_gathers = units and schedule == "zero_bubble"  # a W gathers its chunk again (_split_backward_stage)
    total = 0  # sum(held)
    # the rankings (total held, gradient share) and (gradient share, total held) as one integer each, in the same
    # order: n_grads is 0 ... n_chunks and total 0 ... len(acts)
    by_total, by_grads = n_chunks + 1, len(acts) + 1
    # per slot (ranking * 2**n_chunks + kept mask): its best key (-1: none yet) and state; `order`: the slots in
    # the order they were first filled (the order ties keep below)
    keys, found, order = [-1] * (4 * top), [()] * (4 * top), []
    for i, (kind, c, kept) in enumerate(acts):
        if kind == "F":
            held[c] += 1
            total += 1
            fwd_head += c == head
            if kept & ~(1 << c):  # (interleaved: the measured peak)
                key, slot = total * by_total + n_grads, 2 * top + kept
                if key > keys[slot]:
                    if keys[slot] < 0:
                        order.append(slot)
                    keys[slot], found[slot] = key, fields(fwd=True)
            continue
        if kind == "W":
            if zb_gathers and not kept >> c & 1:
                key, slot = total * by_total + n_grads, 3 * top + kept
                if key > keys[slot]:
                    if keys[slot] < 0:
                        order.append(slot)
                    keys[slot], found[slot] = key, fields(weight=True)
            if pending[c] > 0:
                pending[c] -= 1
        else:  # B or I: a backward start
            key = total * by_total + n_grads
            if key > keys[kept]:
                if keys[kept] < 0:
                    order.append(kept)
                keys[kept], found[kept] = key, fields()
            key, slot = n_grads * by_grads + total, top + kept
            if key > keys[slot]:
                if keys[slot] < 0:
                    order.append(slot)
                keys[slot], found[slot] = key, fields()
            if i == last_bwd:
                last = fields()
            if kind == "I":
                pending[c] += 1
                continue
        held[c] -= 1  # B and W
        total -= 1
        if not has_grads[c]:
            has_grads[c] = True
            n_grads += 1
    best = {slot: (keys[slot], found[slot]) for slot in order}

    def pattern(mask: int) -> tuple[bool, ...]:
        return tuple(bool(mask >> ci & 1) for ci in range(n_chunks))

    if not best:
        return [_PipeState(tuple(held), 0.0, fwd_head, 0, pattern(0))]
    out: list[_PipeState] = []
    for ranking in range(4):  # most in flight, most gradients, forward ends, W gathers; the fullest state first
        for _, f in sorted((v_ for k, v_ in best.items() if k // top == ranking), key=lambda q: q[0], reverse=True):
            state = _PipeState(f[0], f[1], f[2], f[3], pattern(f[4]), *f[5:])
            if state not in out:
                out.append(state)
    if head >= 0 and last is not None:
        last_state = _PipeState(*last[:4], pattern(last[4]), *last[5:])  # type: ignore[misc]
        if last_state not in out:
            out.append(last_state)
    return out


def _kept_units(layout: Layout, rank: int) -> list[tuple[str, int, int]]:
    """_actions, each with a bit mask of the local chunks whose FSDP units are all unsharded when it starts
    (bit c: chunk c).

    torch 2.13 `pipelining/stage.py`, `_PipelineStageBase.backward_maybe_with_nosync`: for an FSDPModule stage,
    every backward (B, I and W) first calls `set_reshard_after_backward(False)` and
    `set_requires_gradient_sync(False)`, so each unit stays gathered after its backward; only
    `perform_reduce_grad` (after the chunk's last backward: `ScheduleGPipe`/`Schedule1F1B._step_microbatches`,
    or the REDUCE_GRAD action `schedules._add_reduce_grad` inserts) turns resharding back on and reshards.
    In between, the chunk's next forward reshards each unit after its forward (zero 3:
    `_fsdp_param_group.FSDPParamGroup.post_forward` -> `reshard`, reshard_after_forward=True); zero 2 keeps
    every unit anyway. The multi-chunk runtime (interleaved 1F1B, zero bubble:
    `_PipelineScheduleRuntime._step_microbatches`) also runs `_add_unshard_reshard`'s UNSHARD / RESHARD:
    every unit of the next max_active_stages=3 distinct stages of this rank is gathered ahead of its action, the
    others resharded (with v <= 3 chunks, all of them from the step's first action). Zero bubble: the template's
    split-backward stage (parallel/pipeline.py `_split_backward_stage`) gathers every unit of the chunk at the
    start of each I and W pass (FSDPModule.unshard), so a W also leaves its chunk gathered; the masks are those
    before that gather (estimator/phases.py puts the gather itself at the start of the pass)."""
    acts = _actions(layout, rank)
    runtime = layout.pp_schedule in ("interleaved_1f1b", "zero_bubble") and layout.pp > 1
    n_chunks = 1 + max(map(itemgetter(1), acts))
    few = runtime and n_chunks <= 3  # every chunk is among the next 3 from the start until its last action
    last_action: dict[int, int] = {}  # chunk -> index of its last action (read when few)
    for i in range(len(acts) - 1 if few else -1, -1, -1):
        last_action.setdefault(acts[i][1], i)
        if len(last_action) == n_chunks:
            break
    # the chunks whose units are all gathered, as bits (bit c: chunk c)
    mask = (1 << n_chunks) - 1 if few else 0
    if few:
        runtime = False
    active: set[int] = set()
    backwards = [0] * n_chunks
    # the next 3 distinct chunks from each action on (_add_unshard_reshard's next_stage_indices), built backwards;
    # an action whose next 3 are those of the action after it shares that list (nothing to unshard or reshard)
    upcoming: list[list[int]] = [[]] * len(acts)
    cur: list[int] = []
    for i in range(len(acts) - 1 if runtime else -1, -1, -1):
        c = acts[i][1]
        if not cur or cur[0] != c:
            cur = [c] + [c2 for c2 in cur if c2 != c][:2]
        upcoming[i] = cur
    out = []
    prev: list[int] | None = None
    zero_bubble, m = layout.pp_schedule == "zero_bubble", layout.n_micro_batches
    for i, (kind, c) in enumerate(acts):
        if runtime and upcoming[i] is not prev:  # (the same list again: active is already exactly it)
            nxt = prev = upcoming[i]
            for c2 in [c2 for c2 in active if c2 not in nxt]:  # RESHARD
                active.discard(c2)
                mask &= ~(1 << c2)
            for c2 in nxt:
                if c2 not in active:  # UNSHARD: every unit of the stage, all-gathered before it computes
                    active.add(c2)
                    mask |= 1 << c2
        out.append((kind, c, mask))
        bit = 1 << c
        if kind == "F":
            mask &= ~bit  # each unit resharded after its forward (zero 3)
        else:
            if kind != "W" or zero_bubble:
                mask |= bit  # every unit left gathered by the backward (a zero-bubble W gathers them again)
            if kind != "I":  # B and W
                backwards[c] += 1
                if backwards[c] == m:  # perform_reduce_grad: reduce-scatter and reshard
                    mask &= ~bit
        if few and i == last_action[c]:
            mask &= ~bit  # RESHARD once no action of the chunk is left
    return out


@dataclass(frozen=True)
class _PipeKey:
    """The fields of Layout the schedule simulation reads."""

    pp_schedule: str
    pp: int
    pp_virtual: int
    n_micro_batches: int


def in_flight(layout: Layout, rank: int) -> tuple[list[int], int]:
    """(per local chunk: micro-batches held at the fullest backward start, their total)."""
    s_ = max((q for q in pipe_states(layout, rank) if not (q.fwd or q.weight)), key=lambda q: sum(q.held))
    return list(s_.held), sum(s_.held)


def bubble_fraction(layout: Layout) -> float:
    """The TEXTBOOK bubble, idle over ideal time (Narayanan et al. 2021 §2.2; docs/ESTIMATION.md): (p-1)/m for
    GPipe and 1F1B, divided by v for interleaving, and a third of that again for zero bubble (Qi et al. 2024,
    with F = B = W). The step time uses `bubble_ratio` (the schedule's simulated action order) instead."""
    if layout.pp == 1:
        return 0.0
    interleaved = layout.pp_schedule in ("interleaved_1f1b", "zero_bubble")
    f = (layout.pp - 1) / (layout.n_micro_batches * (layout.pp_virtual if interleaved else 1))
    return f / 3 if layout.pp_schedule == "zero_bubble" else f
