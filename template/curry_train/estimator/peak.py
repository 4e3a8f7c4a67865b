"""The per-rank peak for the estimator: the largest of the moments of the step (estimator/phases.py, one
function per phase; with a pipeline at the schedule's fullest backward starts, pipeline.pipe_states), split
into memory.py's components.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from curry_train.estimator import phases
from curry_train.estimator.layout import LAYOUT_CACHE, Layout
from curry_train.estimator.moments import (  # re-exported: the facts the breakdown and the tests name
    DDP_GRADS_ARE_BUCKET_VIEWS,
    FSDP_ACCUMULATES_UNSHARDED_UNDER_PP,
    GLOO_COPIES_RS_INPUT,
    LOSS_IN_MODEL,
    PP_KEEPS_OUTPUTS,
    ZB_GATHERS_BEFORE_SPLIT_BACKWARD,
    Moment,
    RankView,
    rank_view,
    single_state,
    state_view,
)
from curry_train.estimator.pipeline import _PipeState, pipe_states

__all__ = ["DDP_GRADS_ARE_BUCKET_VIEWS", "FSDP_ACCUMULATES_UNSHARDED_UNDER_PP", "GLOO_COPIES_RS_INPUT",
           "LOSS_IN_MODEL", "PP_KEEPS_OUTPUTS", "ZB_GATHERS_BEFORE_SPLIT_BACKWARD", "_Peak", "_peak", "moment_peaks",
           "step_moments"]


@dataclass(frozen=True)
class _Peak:
    params: int
    grads: int
    optimizer: int
    activations: int
    other: int
    phase: str
    detail: dict
    grad_buffers: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.grad_buffers + self.optimizer + self.activations + self.other


def step_moments(layout: Layout, pp_rank: int) -> list[Moment]:
    """Every moment of one pipeline rank's step, in the order of estimator/moments.py's docstring."""
    return _moments(rank_view(layout, pp_rank), pp_rank)


def _moments(r: RankView, pp_rank: int) -> list[Moment]:
    layout = r.layout
    states = pipe_states(layout, pp_rank) if layout.pp > 1 else [single_state(layout)]
    out: list[Moment] = []
    for ps in states:
        out += _state_moments(r, ps)
    if layout.fsdp_holds_units and layout.n_micro_batches > 1:  # its last micro-batch reduces (fsdp.holds_step)
        out += _state_moments(r, states[0], last=True)
    return out + phases.first_layer_backward(r) + phases.root_reduce_scatter(r) + phases.optimizer_step(r)


def _state_moments(r: RankView, ps: _PipeState, last: bool = False) -> list[Moment]:
    """The moments at one schedule state: a backward start, a forward end (units kept) or a zero-bubble W;
    `last`: a held step's last micro-batch (moments.StateView.last)."""
    s = state_view(r, ps, last)
    if ps.fwd and not any(s.kept):
        return []  # (only zero 3 keeps units a forward could sit next to)
    out = phases.units_gathered_zero_bubble(r, s)
    if ps.weight:
        return out
    if ps.fwd:
        return out + phases.forward_units_kept(r, s)
    return (out + phases.loss_backward(r, s) + phases.lm_head_backward(r, s) + phases.head_reduce_scatter(r, s)
            + phases.last_block_backward(r, s)
            + phases.first_block_units_kept(r, s) + phases.ring_attention_backward(r, s))


def _largest(r: RankView, found: list[Moment]) -> _Peak:
    """The largest moment (the first of equal ones) on top of the rank's stored parameters and optimizer state."""
    return _on_states(r, max(found, key=lambda q: q.total))


def moment_peaks(layout: Layout, pp_rank: int) -> list[_Peak]:
    """Every moment of one pipeline rank's step as a whole-rank split (stored parameters and optimizer state
    added), in step_moments' order: what the rank would hold if that moment were its peak."""
    r = rank_view(layout, pp_rank)
    return [_on_states(r, q) for q in _moments(r, pp_rank)]


def _on_states(r: RankView, top: Moment) -> _Peak:
    """One moment on top of the rank's stored parameters and optimizer state."""
    d = {**r.detail, **{k: v for k, v in top.detail.items() if v}}
    if r.st.ddp_buckets:
        d["ddp_buckets"] = r.st.ddp_buckets
    if top.param_copies:
        d["param_copies"] = top.param_copies
    return _Peak(r.st.params + top.param_copies, top.grads, r.st.opt, top.activations, top.other, top.phase, d,
                 top.grad_buffers)


@lru_cache(maxsize=LAYOUT_CACHE)
def _peak(layout: Layout, pp_rank: int) -> _Peak:
    """The peak of one pipeline rank: the largest of the moments of its step, each split into the components
    memory.py measures (bench folds param copies into params, DDP buckets / FSDP unsharded gradients into
    grads)."""
    r = rank_view(layout, pp_rank)
    return _largest(r, _moments(r, pp_rank))
