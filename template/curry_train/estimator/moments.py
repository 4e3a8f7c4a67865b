"""What the moments of a step on one pipeline rank read (part of curry_train.estimator): the rank's constants
(RankView), the rank at one schedule state (StateView), the implementation facts the moments encode, and Moment,
the bytes live at one moment beyond the rank's stored parameters and optimizer state, split into memory.py's
components. phases.py has one function per phase; peak.py takes the largest. Reads model states (states.py),
activations (acts.py) and the schedule's states (pipeline.py); imports nothing after them.

Phases, in the order peak.py evaluates them (the order breaks ties between equal totals):
  at each schedule state (pipeline.pipe_states; one state without a pipeline)
    units_gathered_zero_bubble   a zero-bubble I / W pass gathering its whole chunk
    forward_units_kept           the end of a forward while other chunks' FSDP units stay gathered
    loss_backward                the loss's gradients (log_softmax and nll, or loss_parallel's)
    lm_head_backward             d(logits), dW_out and d(head input)
    last_block_backward          the chunk's last block: zero bubble's input backward, at the SwiGLU gradient,
                                 in RMSNorm's backward
    first_block_units_kept       zero 3 under a pipeline: the chunk's first block with every unit gathered
    ring_attention_backward      inside CP's ring attention backward
  once per step
    first_layer_backward         the step's last block backward (the first layer of the first chunk)
    root_reduce_scatter          FSDP's reduce-scatter of the root unit (no pipeline)
    optimizer_step               AdamW's temporaries
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from curry_train.estimator.acts import _Acts, _acts
from curry_train.estimator.layout import Layout, _block_tensors, block_kinds, dense_view, stage_split
from curry_train.estimator.pipeline import _PipeState, stage_ids
from curry_train.estimator.states import _States, _states

# Implementation facts this estimator encodes (change them here when the template changes).
# pipeline.py calls schedule.step(return_outputs=False): a micro-batch's logits live only from its forward to its
# backward (the stage's fwd_cache), not in output_chunks for the whole step
PP_KEEPS_OUTPUTS = False
# parallelize._grad_sync_fn: FSDP reduce-scatters on every micro-step (sharded grads accumulate), but a pipeline
# schedule turns sync (and resharding) off for every backward and reduce-scatters in perform_reduce_grad after
# the last (torch 2.13 pipelining/stage.py), so FSDP under PP keeps unsharded fp32 accumulators
FSDP_ACCUMULATES_UNSHARDED_UNDER_PP = True
# model/gpt.py: the model computes the loss in its forward (chunked_lm_loss), so nothing outside holds the logits:
# log_softmax saves its fp32 output, not its input, and each chunk's logits are recomputed in backward (one at a time)
LOSS_IN_MODEL = True
# parallel/ddp.py: gradient_as_bucket_view=True, so DDP's buckets (states.ddp_buckets, alive from the wrap on)
# *are* the gradients of the parameters DDP manages; only parameters outside DDP (EP's expert shards) add grads
DDP_GRADS_ARE_BUCKET_VIEWS = True
# parallel/pipeline.py _split_backward_stage: under zero_bubble every FSDP unit of a stage is gathered
# (FSDPModule.unshard, root first, then the blocks) before each input- and weight-gradient pass
ZB_GATHERS_BEFORE_SPLIT_BACKWARD = True
# torch 2.13 ProcessGroupGloo's reduce-scatter copies its whole input into a buffer of its own (allocated on the
# backend's worker thread, split in two on the caller's) before it reduces; NCCL reduces from FSDP's input
# buffer straight into the output, so on CUDA that copy does not exist.
GLOO_COPIES_RS_INPUT = True


class Moment(NamedTuple):
    """Bytes live at one moment beyond the rank's stored parameters and optimizer state, filed by the category
    contract of curry_train/breakdown.py (`grads` the .grad tensors the optimizer reads, DDP's bucket views
    included; `grad_buffers` FSDP's unsharded gradients and accumulators; the loss gradients and the pipeline's
    receive buffers are named in `detail` and leave `other` in estimator._breakdown)."""

    phase: str
    param_copies: int  # gathered FSDP units
    grads: int
    activations: int
    other: int
    detail: dict[str, int]
    grad_buffers: int = 0

    @property
    def total(self) -> int:
        return self.param_copies + self.grads + self.grad_buffers + self.activations + self.other


def _with_buckets(grads: int, buckets: int) -> int:
    """Gradient bytes alive given `grads` of .grad tensors (DDP-managed ones included) and DDP's buckets."""
    if DDP_GRADS_ARE_BUCKET_VIEWS:
        return buckets + max(0, grads - buckets)
    return grads + buckets


def _data_bytes(layout: Layout) -> int:
    """Token ids alive at the peak: a rank builds only its own rows (data.rank_micro_batches), one micro-batch's
    inputs and targets [b, s/cp] int64 at a time, and its positions; a pipeline's first and last stages hold all
    m micro-batches concatenated (pipeline.py: tokens on the first, targets on the last), a middle stage none."""
    T = layout.seq_len // layout.cp
    if layout.pp > 1:
        return 2 * layout.n_micro_batches * layout.micro_batch * T * 8 + T * 8
    return 2 * layout.micro_batch * T * 8 + T * 8


@dataclass(frozen=True)
class RankView:
    """What every moment of one pipeline rank reads that does not change over the step."""

    layout: Layout
    stages: list[int]  # the stages (chunks) this rank holds, in order
    st: _States
    a: _Acts  # one micro-batch's activations
    chunk_layers: list[int]  # layers of each chunk (pipeline_split)
    n_blocks: int
    has_embed: bool
    has_head: bool
    head_chunk: int  # local index of the last stage, -1 if not held
    n_stages: int
    fsdp: bool
    zero3: bool  # the blocks reshard after forward (layout.reshards_blocks: zero 3, not under PP by default)
    fsdp_accum: bool  # FSDP under PP or ZeRO-1 on FSDP2: unsharded fp32 accumulators between micro-batches
    compute_bytes: int  # of a gathered unit: 2 under FSDP mixed precision, else 4
    grad_bytes: int  # of a new unsharded gradient
    data: int
    other_base: int  # RoPE tables and the pipeline's receive buffers
    detail: dict[str, int]
    tp_embed: int  # the vocab-parallel embedding's full-size gradient beyond its shard
    recompute_extra: int  # what a recomputed block materialises again in its backward
    block_local: int  # parameters of one block on this rank (TP/EP-local)
    w2: int  # parameters of the FFN's output projection (experts: all local ones)
    head_numel: int  # LM head weight and final norm, TP-local
    # per chunk: every layer's saved activations (dense first blocks and MoE blocks each at their own size), and
    # its first layer's
    chunk_saved: tuple[int, ...] = ()
    first_saved: tuple[int, ...] = ()


def rank_view(layout: Layout, pp_rank: int) -> RankView:
    stages = stage_ids(layout, pp_rank)
    st = _states(layout, stages)
    kinds = block_kinds(layout, stages)
    a_dense = _acts(dense_view(layout)) if layout.num_experts and kinds[0] else None
    a = _acts(layout) if kinds[1] or a_dense is None else a_dense  # the MoE blocks' where the rank has any
    per_kind = (a_dense or a, a)

    def saved(stage_set: tuple[int, ...]) -> int:
        return sum(n * k.layer_saved for n, k in zip(block_kinds(layout, stage_set), per_kind))

    def first(stage: int) -> int:  # the stage's first global layer: dense when below first_k_dense
        return per_kind[0 if sum(stage_split(layout)[:stage]) < layout.first_k_dense else 1].layer_saved
    n_stages = layout.pp * layout.pp_virtual
    chunk_layers = [stage_split(layout)[s_] for s_ in stages]
    has_embed, has_head = 0 in stages, n_stages - 1 in stages
    m = layout.n_micro_batches
    fsdp = layout.fsdp
    cb = 2 if layout.precision == "mp" else 4
    buffers = 2 * layout.seq_len * (layout.rope_dim // 2) * 4 * len(stages)  # RoPE tables: persistent buffers
    other = buffers
    detail: dict[str, int] = {"rope_buffers": buffers}
    if layout.pp > 1:
        # torch.distributed.pipelining allocates one receive buffer per micro-batch per stage: activations
        # into every non-first stage, gradients into every non-last stage.
        recv = sum((m if s_ != 0 else 0) + (m if s_ != n_stages - 1 else 0) for s_ in stages) * a.stream
        detail["pp_recv_buffers"] = recv
        other += recv
    V, D, tp = layout.vocab_size, layout.d_model, layout.tp
    tp_embed = 4 * (V - V // tp) * D if (tp > 1 and has_embed) else 0  # full-size embedding grad
    rec = a.layer_full - a.layer_saved if layout.recompute != "none" else 0
    if layout.recompute == "selective":
        # SAC keeps one of its cached [n, D] matmul outputs until the block's backward ends (measured)
        rec += layout.micro_batch_tokens * D * (4 if layout.precision == "fp32" else 2)
    if kinds[1]:
        w2 = (layout.num_experts // layout.ep) * layout.d_ff * D + D * (layout.shared_d_ff // tp)  # shared: TP-split
    else:
        w2 = D * (layout.dense_d_ff // tp if layout.num_experts else layout.d_ff // tp)
    return RankView(layout=layout, stages=stages, st=st, a=a, chunk_layers=chunk_layers, n_blocks=sum(chunk_layers),
                    has_embed=has_embed, has_head=has_head,
                    head_chunk=stages.index(n_stages - 1) if has_head else -1, n_stages=n_stages, fsdp=fsdp,
                    zero3=layout.reshards_blocks,
                    fsdp_accum=_fsdp_accumulates(layout), compute_bytes=cb,
                    grad_bytes=cb if fsdp else 4, data=_data_bytes(layout), other_base=other, detail=detail,
                    tp_embed=tp_embed, recompute_extra=rec,
                    block_local=sum(d0 * r_ for d0, r_, _, _ in _block_tensors(layout, dense=not kinds[1])), w2=w2,
                    head_numel=(V // tp) * D + D, chunk_saved=tuple(saved((s_,)) for s_ in stages),
                    first_saved=tuple(first(s_) for s_ in stages))


def _fsdp_accumulates(layout: Layout) -> bool:
    """Unsharded fp32 accumulators between micro-batches: FSDP under PP (the schedule's no-sync), and ZeRO-1 on
    FSDP2 holding the step (layout.fsdp_defers_reduce) once there is more than one micro-batch to accumulate."""
    if layout.pp > 1:
        return layout.fsdp and FSDP_ACCUMULATES_UNSHARDED_UNDER_PP
    return layout.fsdp_defers_reduce and layout.n_micro_batches > 1


def single_state(layout: Layout) -> _PipeState:
    """The one state of a step without a pipeline: its micro-batch's backward start."""
    m = layout.n_micro_batches
    return _PipeState((1,), 1.0 if m > 1 else 0.0, m, 0)


@dataclass
class StateView:
    """The rank at one schedule state: what is alive when that backward (or forward end, or W) starts."""

    ps: _PipeState
    other: int  # other_base + zero bubble's pending graphs
    acts: int  # forward-created tensors of every in-flight micro-batch
    head_acts: int  # acts + the head's saved tensors (and logits, where kept)
    logits_alive: int
    lsm_kept: int
    grads_prev: int  # .grad tensors alive when this backward starts (sharded under FSDP, DDP's bucket views)
    gbuf_prev: int  # FSDP's unsharded gradient accumulators alive when this backward starts (under PP)
    fresh: bool  # new gradients are fresh tensors (not added in place)
    kept: tuple[bool, ...]  # per chunk: every FSDP unit gathered
    kept_other: int  # bytes of the other chunks' kept units
    own_kept: bool  # the starting chunk's units are all gathered
    # the step's last micro-batch of a layout that holds its units for the step (parallel/fsdp.py holds_step:
    # ZeRO-0/1 on FSDP2, fsdp_keep_gathered): its units reshard after their backward and reduce as ZeRO-2's do
    last: bool = False


def state_view(r: RankView, ps: _PipeState, last: bool = False) -> StateView:
    """`last`: the step's last micro-batch of a layout holding its units (StateView.last); with one micro-batch
    that is every one."""
    layout, a, st, lay, held = r.layout, r.a, r.st, r.chunk_layers, ps.held
    last = layout.fsdp_holds_units and (last or layout.n_micro_batches == 1)
    # zero bubble: each I whose W has not run keeps its graph, with its linears' output gradients (and the
    # head's logits gradient) for the W; the activations are in `held` already
    other = r.other_base + sum(n * (lay[ci] * a.lin_out_grads + (a.grad_logits_all if ci == r.head_chunk else 0))
                               for ci, n in enumerate(ps.pending))
    acts = sum(k * (r.chunk_saved[ci] + a.rope) for ci, k in enumerate(held)) + r.data
    if r.has_embed:  # (a pipeline's ids are views of the concatenated batch: only TP's masks are new)
        acts += held[r.stages.index(0)] * (a.embed - (layout.micro_batch_tokens * 8 if layout.pp > 1 else 0))
    if layout.pp > 1:  # a stage's output stays in the schedule's fwd_cache until its backward (+1, measured)
        outs = sum(k for ci, k in enumerate(held) if r.stages[ci] != r.n_stages - 1)
        acts += (outs + (1 if outs else 0)) * a.stream
    lsm_kept = a.lsm if a.chunks == 1 else 0  # a chunked loss keeps a scalar per chunk, not the log-softmax
    if r.has_head and layout.pp > 1:
        k_head = held[r.head_chunk]
        logits_alive = (ps.head_fwds if PP_KEEPS_OUTPUTS else k_head) * a.logits * (not LOSS_IN_MODEL)
        head_acts = acts + k_head * (a.head + lsm_kept) + logits_alive  # targets: views of the batch
    else:
        logits_alive = a.logits if r.has_head and not LOSS_IN_MODEL else 0
        head_acts = acts + a.head + lsm_kept + a.targets + logits_alive
    if r.fsdp_accum:  # the unsharded parameters' .grad: grad_buffers (breakdown.py)
        grads_prev, gbuf_prev = 0, int(ps.grads * (4 * st.n_local + r.tp_embed))
    else:  # DDP / ZeRO-1 .grad, or FSDP's sharded grads (reduce-scattered every micro-step)
        grads_prev, gbuf_prev = int(ps.grads * st.grads_full), 0
    grads_prev = _with_buckets(grads_prev, st.ddp_buckets)
    # New gradients are fresh tensors until the first backward has run (then autograd adds into .grad in
    # place), except under FSDP: each micro-step's unsharded grads are new (reduce-scattered away, or, under
    # mixed precision, folded into the fp32 accumulator only at the unit's post-backward).
    # (DDP's bucket views are written in place: zeroed, never set to None, parallelize.Parallelized.zero_grad)
    fresh = (ps.grads < 1 and not (layout.ddp and DDP_GRADS_ARE_BUCKET_VIEWS)) or \
        (r.fsdp and (not r.fsdp_accum or layout.precision == "mp"))
    # Gathered units: zero 2 keeps every unit (root included). Zero 3 under a pipeline: torch's schedule leaves
    # a chunk's units gathered from its backward until its next forward (pipeline._kept_units cites torch).
    kept = ps.kept if (r.zero3 and layout.pp > 1 and ps.kept) else (False,) * len(r.stages)
    kept_other = sum(u for ci, u in enumerate(st.chunk_units) if kept[ci] and ci != ps.chunk)
    return StateView(ps=ps, other=other, acts=acts, head_acts=head_acts,
                     logits_alive=logits_alive, lsm_kept=lsm_kept, grads_prev=grads_prev, gbuf_prev=gbuf_prev,
                     fresh=fresh, kept=kept, kept_other=kept_other, own_kept=kept[ps.chunk], last=last)
