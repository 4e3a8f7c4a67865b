"""The per-rank peak for the estimator: the largest of a few moments of the step (loss and LM-head backward,
block backwards, FSDP's root reduce-scatter, the optimizer step; with a pipeline at the schedule's fullest
backward starts), each split into memory.py's components.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from curry_train.estimator.acts import _acts
from curry_train.estimator.layout import Layout, _block_tensors, _root_tensors, stage_split
from curry_train.estimator.pipeline import _PipeState, pipe_states, stage_ids
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


@lru_cache(maxsize=8192)
def _peak(layout: Layout, pp_rank: int) -> _Peak:
    """The peak of one pipeline rank: the largest of a few moments of the step, each split into the components
    memory.py measures (bench folds param copies into params, DDP buckets / FSDP unsharded gradients into
    grads). Moments: the loss backward, the LM head's backward, the backward of the last and of the first
    block (at the SwiGLU product's gradient or in RMSNorm's backward), FSDP's root reduce-scatter, the
    optimizer step. With a pipeline they are evaluated at the backward starts where the most micro-batches are
    in flight (pipe_states)."""
    stages = stage_ids(layout, pp_rank)
    st = _states(layout, stages)
    a = _acts(layout)
    n_stages = layout.pp * layout.pp_virtual
    lay = [stage_split(layout)[s_] for s_ in stages]  # layers of each chunk this rank holds (pipeline_split)
    n_blk = sum(lay)
    has_embed, has_head = 0 in stages, n_stages - 1 in stages
    head_chunk = stages.index(n_stages - 1) if has_head else -1
    m = layout.n_micro_batches
    fsdp, zero3 = layout.fsdp, layout.fsdp and layout.zero == 3
    fsdp_accum = fsdp and layout.pp > 1 and FSDP_ACCUMULATES_UNSHARDED_UNDER_PP
    cb = 2 if layout.precision == "mp" else 4
    buffers = 2 * layout.seq_len * (layout.head_dim // 2) * 4 * len(stages)  # RoPE tables: persistent module buffers
    data = _data_bytes(layout)
    other0 = buffers
    detail: dict[str, int] = {"rope_buffers": buffers}
    if layout.pp > 1:
        # torch.distributed.pipelining allocates one receive buffer per micro-batch per stage: activations
        # into every non-first stage, gradients into every non-last stage.
        recv = sum((m if s_ != 0 else 0) + (m if s_ != n_stages - 1 else 0) for s_ in stages) * a.stream
        detail["pp_recv_buffers"] = recv
        other0 += recv
    other_base = other0
    V, D = layout.vocab_size, layout.d_model
    tp_embed = 4 * (V - V // layout.tp) * D if (layout.tp > 1 and has_embed) else 0  # full-size embedding grad
    rec = a.layer_full - a.layer_saved if layout.recompute != "none" else 0
    if layout.recompute == "selective":
        # SAC keeps one of its cached [n, D] matmul outputs until the block's backward ends (measured)
        rec += layout.micro_batch_tokens * layout.d_model * (4 if layout.precision == "fp32" else 2)
    blk_local = sum(d0 * r_ for d0, r_, _, _ in _block_tensors(layout))
    w2 = D * (layout.d_ff // layout.tp) if not layout.num_experts else \
        (layout.num_experts // layout.ep) * layout.d_ff * D
    gb_ = cb if fsdp else 4
    vd = (layout.vocab_size // layout.tp) * layout.d_model + layout.d_model

    if layout.pp > 1:
        states = pipe_states(layout, pp_rank)
    else:
        states = [_PipeState((1,), 1.0 if m > 1 else 0.0, m, 0)]
    moments: list[tuple[str, int, int, int, int, dict[str, int]]] = []  # phase, params+, grads, acts, other
    for ps in states:
        held = ps.held
        # zero bubble: each I whose W has not run keeps its graph, with its linears' output gradients (and the
        # head's logits gradient) for the W; the activations are in `held` already
        other0 = other_base + sum(n * (lay[ci] * a.lin_out_grads + (a.grad_logits_all if ci == head_chunk else 0))
                                  for ci, n in enumerate(ps.pending))
        k_total = sum(held)
        # forward-created tensors of every in-flight micro-batch
        acts = sum(k * (lay[ci] * a.layer_saved + a.rope) for ci, k in enumerate(held)) + data
        if has_embed:  # (a pipeline's ids are views of the concatenated batch: only TP's masks are new)
            acts += held[stages.index(0)] * (a.embed - (layout.micro_batch_tokens * 8 if layout.pp > 1 else 0))
        if layout.pp > 1:  # a stage's output stays in the schedule's fwd_cache until its backward (+1, measured)
            outs = sum(k for ci, k in enumerate(held) if stages[ci] != n_stages - 1)
            acts += (outs + (1 if outs else 0)) * a.stream
        # autocast caches its weight casts for the whole `with autocast()` region: one set per micro-batch
        # (train.forward_backward), or one for the whole pipeline step (all micro-batches inside one region)
        pcopies = (n_blk if layout.pp > 1 else k_total * n_blk) * a.pcopy_layer + (a.pcopy_head if has_head else 0)
        lsm_kept = a.lsm if a.chunks == 1 else 0  # a chunked loss keeps a scalar per chunk, not the log-softmax
        if has_head and layout.pp > 1:
            k_head = held[head_chunk]
            logits_alive = (ps.head_fwds if PP_KEEPS_OUTPUTS else k_head) * a.logits * (not LOSS_IN_MODEL)
            head_acts = acts + k_head * (a.head + lsm_kept) + logits_alive  # targets: views of the batch
        else:
            logits_alive = a.logits if has_head and not LOSS_IN_MODEL else 0
            head_acts = acts + a.head + lsm_kept + a.targets + logits_alive
        # gradients alive when this backward starts
        if fsdp_accum:
            grads_prev = int(ps.grads * (4 * st.n_local + tp_embed))
        else:  # DDP / ZeRO-1 .grad, or FSDP's sharded grads (reduce-scattered every micro-step)
            grads_prev = int(ps.grads * st.grads_full)
        grads_prev = _with_buckets(grads_prev, st.ddp_buckets)
        # New gradients are fresh tensors until the first backward has run (then autograd adds into .grad in
        # place), except under FSDP: each micro-step's unsharded grads are new (reduce-scattered away, or, under
        # mixed precision, folded into the fp32 accumulator only at the unit's post-backward).
        # (DDP's bucket views are written in place: zeroed, never set to None, parallelize.Parallelized.zero_grad)
        fresh = (ps.grads < 1 and not (layout.ddp and DDP_GRADS_ARE_BUCKET_VIEWS)) or \
            (fsdp and (not fsdp_accum or layout.precision == "mp"))
        # Gathered units: zero 2 keeps every unit (root included). Zero 3 under a pipeline: torch's schedule leaves
        # a chunk's units gathered from its backward until its next forward (pipeline._kept_units cites torch).
        kept = ps.kept if (zero3 and layout.pp > 1 and ps.kept) else (False,) * len(stages)
        kept_other = sum(u for ci, u in enumerate(st.chunk_units) if kept[ci] and ci != ps.chunk)
        own_kept = kept[ps.chunk]
        if ps.fwd and not any(kept):
            continue  # (only zero 3 keeps units a forward could sit next to)
        if zero3 and layout.pp > 1 and layout.pp_schedule == "zero_bubble" and ZB_GATHERS_BEFORE_SPLIT_BACKWARD and \
                not own_kept and not ps.fwd:
            # the I (or W) pass gathers the whole chunk before it computes: at the last unit's copy-out its flat
            # all-gather output sits next to every unit (FSDPParamGroup.wait_for_unshard frees it after; the root
            # is gathered first, so its own copy-out is the larger moment only for a root above the blocks)
            c = ps.chunk
            root_c = st.chunk_units[c] - lay[c] * st.unit_max
            p_g, o_g = max((st.chunk_units[c], st.unit_max if lay[c] else root_c), (root_c, root_c), key=sum)
            acts_g = head_acts if has_head and layout.pp > 1 else acts + logits_alive
            moments.append(("units gathered (zero bubble)", pcopies + kept_other + p_g, grads_prev, acts_g,
                            other0 + o_g, {}))
            own_kept = True  # the pass then runs with every unit of the chunk gathered
        if ps.weight:
            continue
        if ps.fwd:
            # the end of this chunk's forward while other chunks' units are kept: its root and last block are
            # gathered, and FSDP2 holds that block's flat all-gather output until the next copy-out
            # (_fsdp_param_group.FSDPParamGroup.wait_for_unshard, implicit forward prefetch)
            root_c = st.chunk_units[ps.chunk] - lay[ps.chunk] * st.unit_max
            acts_f = acts + (a.logits if ps.chunk == head_chunk else 0)
            moments.append(("forward (units kept)", pcopies + kept_other + root_c + st.unit_max,
                            grads_prev, acts_f, other0 + st.unit_max + a.stream, {}))
            continue
        gathered_fwd = st.all_units if (fsdp and not zero3) else \
            kept_other + (st.chunk_units[ps.chunk] if own_kept else 0)

        if has_head and ps.chunk == head_chunk:
            # the loss backward: log_softmax's gradient next to the nll gradient (two fp32 [n, V/tp]); under
            # TP's loss_parallel: the nll gradient, exp(log_softmax) and their sum, plus index masks
            loss_grads = 3 * a.lsm + 4 * a.chunk_targets if layout.tp > 1 and not layout.num_experts else 2 * a.lsm
            w_out = gb_ * (layout.vocab_size // layout.tp) * layout.d_model
            # chunked: the last chunk backward runs (the first chunk) recomputes its log-softmax; the earlier
            # chunks left their summed head-weight gradient and their [nc, D] input gradients (in the split's
            # input buffer until all chunks are in)
            # (under autocast in the compute dtype: the chunks share autocast's cached bf16 cast of the weight,
            # whose backward node sums them before the one cast back to fp32)
            w_acc = (2 * (V // layout.tp) * D if layout.precision == "autocast" else w_out) if a.chunks > 1 else 0
            chunk_acc = w_acc + a.dy_head if a.chunks > 1 else 0
            moments.append(("loss backward", pcopies + gathered_fwd, grads_prev, head_acts + a.lsm - lsm_kept,
                            other0 + loss_grads + chunk_acc, {"loss_grads": loss_grads}))
            # the LM head's backward: d(logits), dW_out, d(head input); zero 3 re-gathers the root and
            # prefetches the last block (its flat all-gather output waits in a staging buffer). Chunked: the
            # engine sums each chunk's dW_out into the accumulated one out of place (torch's InputBuffer), so
            # three [V, D] gradients meet at that add, next to the chunks' input gradients.
            head_grads = a.grad_logits + a.dy_head + w_out if a.chunks == 1 else 3 * w_acc + a.dy_head
            p2, o2 = pcopies + gathered_fwd, other0 + head_grads
            if zero3 and not own_kept:
                p2 += st.root_unit
                o2 += st.unit_max
            moments.append(("LM head backward", p2, grads_prev, head_acts - lsm_kept, o2,
                            {"head_grads": head_grads}))
        # the backward of the chunk's last block. New gradients of the head and of w2 are fresh tensors until
        # the first backward has run; then autograd adds into .grad in place, except FSDP mixed precision,
        # whose bf16 unsharded grads join the fp32 accumulator only at the unit's post-backward.
        head_grads = gb_ * vd if has_head and ps.chunk == head_chunk and fresh else 0
        g3 = grads_prev + head_grads + (gb_ * w2 if fresh else 0)
        gathering = zero3 and not own_kept  # units gathered one by one: root + this block (+ the prefetched one)
        p3 = pcopies + (gathered_fwd + (st.root_unit + st.unit_max if gathering else 0) if fsdp else 0)
        o3 = other0 + a.d_stream + (st.unit_max if gathering else 0)  # + the prefetched block's staging buffer
        acts3 = acts + logits_alive + rec
        if layout.pp > 1 and layout.pp_schedule == "zero_bubble":
            # input-backward (I) retains the graph for the weight-backward (W): nothing is freed, and every
            # linear's output gradient of the chunk is kept for W
            o3 += lay[ps.chunk] * a.lin_out_grads
            if has_head and ps.chunk == head_chunk:  # the loss part of the graph is retained too, with the
                # head's output gradient of every loss chunk (the weight pass needs them all)
                acts_i, o_i = head_acts + rec, o3 + a.grad_logits_all
            else:
                acts_i, o_i = acts3, o3
            moments.append(("input backward (zero bubble)", p3, g3, acts_i, o_i + 5 * a.stream, {}))
        moments.append(("block backward (SwiGLU)", p3, g3, acts3 - a.prod, o3 + a.ffn_bwd, {}))
        moments.append(("block backward (norm)", p3, g3, acts3 - a.ffn_saved, o3 + 5 * a.stream, {}))
        if zero3 and layout.pp > 1:
            # the start of the chunk's first block backward: every unit of the chunk stays gathered
            # (set_reshard_after_backward(False)) while this micro-batch's later blocks have freed their
            # activations; unless they were kept, the first block's prefetched all-gather output (FSDP2 staging,
            # freed only after its copy-out) sits next to its unsharded copy (measured, memory.py "comm")
            c = ps.chunk
            acts_end = acts3 - (lay[c] - 1) * a.layer_saved - (a.logits if c == head_chunk else 0)
            if c == head_chunk:  # the other micro-batches' saved head activations (GPipe holds m, measured)
                acts_end += (held[c] - 1) * a.head
            g_end = grads_prev
            if not ps.own_grads:  # the chunk's first backward: accumulators of its later blocks and its head
                root_c = sum(d0 * r_ for d0, r_, _, _ in _root_tensors(layout, False, stages[c] == n_stages - 1))
                g_end += 4 * ((lay[c] - 1) * blk_local + root_c)
            p_end = pcopies + kept_other + st.chunk_units[c]
            if not own_kept:
                moments.append(("first block gathered (units kept)", p_end, g_end, acts_end,
                                other0 + a.d_stream + st.unit_max, {}))
            moments.append(("first block backward (units kept)", p_end, g_end + gb_ * w2, acts_end - a.prod,
                            other0 + a.d_stream + a.ffn_bwd, {}))
        if layout.cp > 1:  # inside ring attention's backward (its fp32 working set, see _ring_backward)
            g_attn = g3 + (gb_ * blk_local - gb_ * w2 if fresh and not layout.num_experts else 0)
            moments.append(("ring attention backward", p3, g_attn, acts3 - a.ffn_saved - a.post_attn,
                            o3 + a.ring_bwd, {}))

    other0 = other_base
    # the step's last block backward (first layer of the first chunk): gradients are nearly all there; with
    # full recompute or small batches this is where the peak is
    acc = m > 1 or layout.pp > 1
    logits_end = (m if (has_head and layout.pp > 1 and PP_KEEPS_OUTPUTS) else
                  (1 if has_head and layout.pp == 1 and not LOSS_IN_MODEL else 0))
    if fsdp:
        blk_shard = st.n_stored - st.root_stored
        root_local = st.n_local - blk_local * n_blk
        g4 = 4 * (blk_shard - blk_shard // max(n_blk, 1))  # reduced blocks: sharded grads
        if fsdp_accum:
            g4 += 4 * (root_local + blk_local)  # accumulators of the root and of this block
            if layout.precision == "mp":
                g4 += cb * (root_local + w2)
        else:
            if m > 1:  # sharded grads of this block and the root from the earlier micro-steps
                g4 += 4 * (st.n_stored - (blk_shard - blk_shard // max(n_blk, 1)))
            g4 += cb * (root_local - ((layout.vocab_size // layout.tp) * layout.d_model if has_embed else 0) + w2)
        p4, o4 = st.root_unit + st.unit_max, st.rs_buffer
        if layout.pp > 1:  # the chunk's units all stay gathered until perform_reduce_grad (pipeline._kept_units)
            p4 = st.chunk_units[0]
    else:
        embed_grad = 4 * V * D if (has_embed and layout.tp > 1) else (4 * (V // layout.tp) * D if has_embed else 0)
        g4 = _with_buckets(st.grads_full if acc else st.grads_full - 4 * blk_local - embed_grad + 4 * w2,
                           st.ddp_buckets)
        p4, o4 = 0, 0
    acts4 = data + a.rope + (a.embed if has_embed else 0) + a.layer_saved + rec + logits_end * a.logits - a.prod
    if layout.pp > 1 and min(stages) != n_stages - 1:
        acts4 += a.stream
    moments.append(("block backward (first)", p4 + a.pcopy_layer, g4, acts4, other0 + a.d_stream + a.ffn_bwd + o4,
                    {}))
    if fsdp and layout.pp == 1:
        moments.append(_root_reduce_scatter(layout, st, cb, m, data, other0))
    # the optimizer step (AdamW temporaries); a pipeline's last stage holds the logits step() kept, if it keeps them
    moments.append(("optimizer step", 0, _with_buckets(st.grads_full, st.ddp_buckets),
                    m * a.logits if (has_head and layout.pp > 1 and PP_KEEPS_OUTPUTS) else 0,
                    other0 + st.step_transient, {"adamw_step": st.step_transient}))

    phase, p_extra, grads, acts_, other, extra = max(moments, key=lambda q: q[1] + q[2] + q[3] + q[4])
    d = {**detail, **{k: v for k, v in extra.items() if v}}
    if st.ddp_buckets:
        d["ddp_buckets"] = st.ddp_buckets
    if p_extra:
        d["param_copies"] = p_extra
    return _Peak(st.params + p_extra, grads, st.opt, acts_, other, phase, d)


@dataclass(frozen=True)
class _Peak:
    params: int
    grads: int
    optimizer: int
    activations: int
    other: int
    phase: str
    detail: dict

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.other


# torch 2.13 ProcessGroupGloo's reduce-scatter copies its whole input into a buffer of its own (allocated on the
# backend's worker thread, split in two on the caller's) before it reduces; NCCL reduces from FSDP's input
# buffer straight into the output, so on CUDA that copy does not exist.
GLOO_COPIES_RS_INPUT = True


def _root_reduce_scatter(layout: Layout, st: _States, cb: int, m: int, data: int, other0: int):
    """The root unit's reduce-scatter at the end of every backward (FSDP2 runs the root's post_backward from
    FSDPState._root_post_backward_final_callback, after every block's). foreach_reduce (torch 2.13
    fsdp/_fully_shard/_fsdp_collectives.py) allocates the reduce-scatter input in reduce_dtype, fp32 here
    (parallel/fsdp.py: MixedPrecisionPolicy(reduce_dtype=float32)), so the root's [V, D] embedding and head
    gradients get an fp32 copy, padded to the whole unit; foreach_reduce_scatter_copy_in fills it while every
    unsharded root gradient (compute dtype) is alive, then the list is cleared and the fp32 output shard is
    allocated next to the input. Measured on CPU (vocab-zero3-dp2-bf16, memory.py) at the collective: input
    + output + one [V/tp, D] compute-dtype gradient the autograd engine still holds (no Python reference; the
    graph task ends after this callback) + gloo's own copy of the input (GLOO_COPIES_RS_INPUT). The previous
    unit's reduce-scatter input is not alive: FSDPParamGroup.post_backward pops comm_ctx.reduce_scatter_states
    down to reduce_scatter_max_input_buffers (1) before this reduce appends. On CUDA the estimator assumes the
    same moment without gloo's copy (the held gradient is the engine's, not the backend's). Sharded gradients:
    all of them after an earlier micro-step, else every block's but the root's (its output is the new one)."""
    rs_in = 4 * (st.root_unit // cb)  # padded unsharded root numel, fp32
    rs_out = 4 * st.root_stored
    held = cb * (layout.vocab_size // layout.tp) * layout.d_model
    gloo = rs_in if (layout.device == "cpu" and GLOO_COPIES_RS_INPUT) else 0
    # copy-in (all unsharded root grads + input) or the collective (input + output + held grad + gloo's copy)
    rs = rs_in + max(st.root_unit, rs_out + held + gloo)
    grads = st.grads_full if m > 1 else st.grads_full - rs_out
    return ("root reduce-scatter", 0, grads, data, other0 + rs, {"root_reduce_scatter": rs})
