"""What a layout needs per rank, the one function every "does it fit" reads (estimate, quick_layout, the
planner's rows): a pipeline rank needs the larger of its step peak (estimator/peak.py) and its init peak
(estimator/init.py), and the layout needs its worst rank's. Every pipeline rank counts: rank 0 is often not the
worst (the cost-based split gives stage 0 fewer layers for its embedding, and a middle rank holds both receive
buffers), so neither is "first and last".

The fast path (`rank_classes`) evaluates fewer ranks and is exact, not a guess. A rank's peak reads its pipeline
rank only through
  its stage content  the layers of each stage it holds, in order, and whether a stage is the first (embedding)
                     or the last (head): _states, _acts' per-chunk sums, the receive buffers and the init peak;
  its schedule       pipe_states(x, rank): the backward starts (and forward ends) the peak is evaluated at.
Each moment of the peak is a sum of non-negative per-micro-batch terms times the micro-batches held per chunk
(and the zero-bubble I's pending per chunk), the other fields of the state (gradient share, chunk, kept units,
kind) only choosing which terms. So a rank whose every schedule state is matched by a state of another rank with
the same stage content, the same other fields and at least as much held and pending, cannot peak higher:
`rank_classes` keeps only the ranks no other rank of their content dominates (1F1B's middle ranks: the first of
them). tests/test_every_rank.py checks the fast path against every rank on every layout the planner evaluates
for every setup of benchmarks/published_layouts.py.
"""

from __future__ import annotations

from functools import lru_cache

from curry_train.estimator.init import init_peak
from curry_train.estimator.layout import Layout, stage_split
from curry_train.estimator.peak import _peak
from curry_train.estimator.pipeline import _pipe_states, _PipeState, schedule_key, stage_ids


def rank_need(layout: Layout, pp_rank: int) -> int:
    """Bytes one pipeline rank needs: the larger of its step peak and its init peak."""
    return max(_peak(layout, pp_rank).total, init_peak(layout, pp_rank))


def layout_need(layout: Layout, limit: int | None = None) -> int:
    """Bytes the layout needs on its worst pipeline rank (every rank, through its dominating classes). With
    `limit`, a layout that some rank already shows over it returns that rank's need (a lower bound, above the
    limit) without the other ranks: enough for a caller that asks only whether it fits."""
    if layout.pp == 1:
        return rank_need(layout, 0)
    contents = stage_contents(layout)
    if limit is not None:
        firsts: dict[tuple, int] = {}
        for r, content in enumerate(contents):
            firsts.setdefault(content, r)
        low = max(rank_need(layout, r) for r in firsts.values())
        if low > limit:
            return low
    return max(rank_need(layout, r) for r in _classes(schedule_key(layout), contents))

def layout_need_every_rank(layout: Layout) -> int:
    """layout_need without the fast path: every pipeline rank evaluated (the reference the tests hold it to)."""
    return max(rank_need(layout, r) for r in range(layout.pp))


def stage_content(layout: Layout, pp_rank: int) -> tuple[tuple[int, bool, bool, int], ...]:
    """Per stage this rank holds, in order: (its layers, first stage, last stage, of its layers the dense first
    blocks of a MoE model: they hold less than its MoE blocks)."""
    return stage_contents(layout)[pp_rank]


def stage_contents(layout: Layout) -> tuple[tuple[tuple[int, bool, bool, int], ...], ...]:
    """stage_content of every pipeline rank (the split computed once)."""
    n_stages, split = layout.pp * layout.pp_virtual, stage_split(layout)
    k = layout.first_k_dense if layout.num_experts else 0

    def dense(s: int) -> int:  # layers of stage s below first_k_dense
        start = sum(split[:s])
        return max(0, min(k, start + split[s]) - start)

    return tuple(tuple((split[s], s == 0, s == n_stages - 1, dense(s)) for s in stage_ids(layout, r))
                 for r in range(layout.pp))


def rank_classes(layout: Layout) -> tuple[int, ...]:
    """The pipeline ranks whose peak no other rank's bounds (see the module docstring), lowest rank first."""
    if layout.pp == 1:
        return (0,)
    return _classes(schedule_key(layout), stage_contents(layout))

# Schedules whose every rank's states dominate those of the next rank (the head's rank apart), so that the lowest
# rank of each stage content is the only one evaluated and no other rank is simulated: GPipe (every rank runs the
# same order), 1F1B without tracked FSDP units (warm-up p - rank), 1F1B with them once m > p (at m <= p every
# rank's warm-up is all of the micro-batches, and the kept units differ), interleaved 1F1B without them when m is
# a multiple of p above p (the planner's interleaved layouts). tests/test_every_rank.py checks it by simulation
# over a grid of pipeline sizes and micro-batch counts; every other case compares the simulated states.
def rank_ordered(schedule: str, pp: int, m: int, units: bool) -> bool:
    """Whether a lower pipeline rank's schedule states dominate every higher one's (the head's rank apart)."""
    return schedule == "gpipe" or (schedule == "1f1b" and (not units or m > pp)) or \
        (schedule == "interleaved_1f1b" and not units and m > pp and m % pp == 0)


@lru_cache(maxsize=4096)
def _classes(key: tuple, contents: tuple) -> tuple[int, ...]:
    schedule, pp, _v, m, units = key
    if rank_ordered(schedule, pp, m, units):
        firsts: dict[tuple, int] = {}
        for r, content in enumerate(contents):
            firsts.setdefault(content, r)
        return tuple(sorted(firsts.values()))
    kept: list[tuple[int, dict[tuple, list[_PipeState]]]] = []
    for r, content in enumerate(contents):
        states = _by_kind(_pipe_states(*key[:4], r, *key[4:]))
        same = [(k, s) for k, s in kept if contents[k] == content]
        if any(_dominates(s, states) for _, s in same):
            continue
        kept = [(k, s) for k, s in kept if not (contents[k] == content and _dominates(states, s))]
        kept.append((r, states))
    return tuple(sorted(k for k, _ in kept))


def _kind(s: _PipeState) -> tuple:
    """What two states must share for one to cover the other (see _covers)."""
    return s.grads, s.chunk, s.kept, s.own_grads, s.fwd, s.weight


def _by_kind(states: list[_PipeState]) -> dict[tuple, list[_PipeState]]:
    out: dict[tuple, list[_PipeState]] = {}
    for s in states:
        out.setdefault(_kind(s), []).append(s)
    return out


def _dominates(a: dict[tuple, list[_PipeState]] | list[_PipeState],
               b: dict[tuple, list[_PipeState]] | list[_PipeState]) -> bool:
    """Every state of b is covered by one of a (states grouped by _kind: only a state of the same kind can)."""
    a = _by_kind(a) if isinstance(a, list) else a
    b = _by_kind(b) if isinstance(b, list) else b
    return all(any(_covers(sa, sb) for sa in a.get(kind, ())) for kind, group in b.items() for sb in group)


def _covers(sa: _PipeState, sb: _PipeState) -> bool:
    """sa's moments are each at least sb's: the same chunk, gradient share, kept units and kind, with at least
    as many micro-batches held and pending per chunk and head forwards run."""
    return ((sa.grads, sa.chunk, sa.kept, sa.own_grads, sa.fwd, sa.weight)
            == (sb.grads, sb.chunk, sb.kept, sb.own_grads, sb.fwd, sb.weight)
            and sa.head_fwds >= sb.head_fwds
            and all(p >= q for p, q in zip(sa.held, sb.held, strict=True))
            and all(p >= q for p, q in zip(sa.pending or (0,) * len(sa.held), sb.pending or (0,) * len(sb.held),
                                           strict=True)))
