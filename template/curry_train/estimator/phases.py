"""One function per moment of the step on one pipeline rank (part of curry_train.estimator): each returns the
Moments of its phase (none where the phase does not happen), read from the rank's RankView and, for the phases
of a schedule state, its StateView (estimator/moments.py). peak.py evaluates them in the order of
moments.py's docstring and takes the largest.
"""

from __future__ import annotations

from curry_train.estimator.layout import Layout, _root_tensors
from curry_train.estimator.moments import (
    GLOO_COPIES_RS_INPUT,
    LOSS_IN_MODEL,
    PP_KEEPS_OUTPUTS,
    ZB_GATHERS_BEFORE_SPLIT_BACKWARD,
    Moment,
    RankView,
    StateView,
    _with_buckets,
)
from curry_train.estimator.states import _States

# ----------------------------------------------------------------------------------- at each schedule state


def units_gathered_zero_bubble(r: RankView, s: StateView) -> list[Moment]:
    """Zero 3 under a zero-bubble schedule: the I (or W) pass gathers the whole chunk before it computes; at the
    last unit's copy-out its flat all-gather output sits next to every unit (FSDPParamGroup.wait_for_unshard
    frees it after; the root is gathered first, so its own copy-out is the larger moment only for a root above
    the blocks). The pass then runs with every unit of the chunk gathered (sets s.own_kept)."""
    layout, st, ps = r.layout, r.st, s.ps
    if not (r.zero3 and layout.pp > 1 and layout.pp_schedule == "zero_bubble" and ZB_GATHERS_BEFORE_SPLIT_BACKWARD
            and not s.own_kept and not ps.fwd):
        return []
    c, lay = ps.chunk, r.chunk_layers
    root_c = st.chunk_roots[c]
    p_g, o_g = max((st.chunk_units[c], st.unit_max if lay[c] else root_c), (root_c, root_c), key=sum)
    acts_g = s.head_acts if r.has_head and layout.pp > 1 else s.acts + s.logits_alive
    s.own_kept = True
    return [Moment("units gathered (zero bubble)", s.kept_other + p_g, s.grads_prev, acts_g,
                   s.other + o_g, {}, s.gbuf_prev)]


def forward_units_kept(r: RankView, s: StateView) -> list[Moment]:
    """The end of this chunk's forward while other chunks' units are kept: its root and last block are gathered,
    and FSDP2 holds that block's flat all-gather output until the next copy-out
    (_fsdp_param_group.FSDPParamGroup.wait_for_unshard, implicit forward prefetch)."""
    st, a, ps = r.st, r.a, s.ps
    root_c = st.chunk_roots[ps.chunk]
    acts_f = s.acts + (a.logits if ps.chunk == r.head_chunk else 0)
    return [Moment("forward (units kept)", s.kept_other + root_c + st.unit_max, s.grads_prev,
                   acts_f, s.other + st.unit_max + a.stream, {}, s.gbuf_prev)]


def _gathered(r: RankView, s: StateView, past_head: bool = False) -> int:
    """Units gathered as a backward starts: every unit under zero 2, the kept ones under zero 3. Without a
    pipeline the [norm, output] unit is gathered from its forward to its backward (fsdp_units.py, not resharded
    after forward) and resharded after it (`past_head`: the blocks' backward)."""
    single = r.fsdp and r.layout.pp == 1
    head = r.st.head_unit if single and r.has_head else 0
    if r.layout.fsdp_holds_units and not s.last:  # (fsdp.holds_step: no unit resharded after backward but in the
        past_head = False  # last micro-batch)
    if r.fsdp and not r.zero3:
        return r.st.all_units - (head if past_head else 0)
    if single and not r.layout.head_reshards:
        return 0 if past_head else head
    return s.kept_other + (r.st.chunk_units[s.ps.chunk] if s.own_kept else 0)


def _head_weight_grads(r: RankView) -> tuple[int, int]:
    """(dW_out, the chunked loss's summed head-weight gradient, as large as one chunk's)."""
    layout, a = r.layout, r.a
    w_out = r.grad_bytes * (layout.vocab_size // layout.tp) * layout.d_model
    return w_out, (0 if a.chunks == 1 else w_out)


def _at_head(r: RankView, s: StateView) -> bool:
    return r.has_head and s.ps.chunk == r.head_chunk


def _head_reduced(r: RankView, s: StateView) -> tuple[int, int, int]:
    """(grads, grad_buffers, other) a held step adds once its [norm, output] unit has reduced in the last
    micro-batch (StateView.last): its fp32 accumulator (TP-local) gone into the fp32 reduce-scatter input, which
    stays until the next unit's post-backward pops it (reduce_scatter_max_input_buffers = 1), and its sharded
    output, a .grad. Zeros elsewhere. The chunked loss reduces the unit after its first chunk's backward already
    (the second forward call registers a second post-backward: comm.py _fsdp)."""
    if not (s.last and r.fsdp_accum and r.has_head and r.layout.pp == 1):
        return 0, 0, 0
    return 4 * r.st.head_stored, -4 * r.head_numel, 4 * (r.st.head_unit // r.compute_bytes)


def _head_ar_kept(r: RankView, s: StateView) -> bool:
    """A held step's replicas (bf16 ZeRO-0) with a chunked loss: the head unit's second reduction in the last
    micro-batch adds into the .grad its first made, and the replica all-reduce's output stays with the unit until
    the next unit's post-backward (FSDPParamGroup._all_reduce_state, torch 2.13 foreach_reduce). Measured on the
    CPU tracker (ddp2-bf16-selective); not seen with one micro-batch (ddp4-bf16)."""
    return s.last and r.fsdp_accum and r.layout.replicas > 1 and r.a.chunks > 1


def loss_backward(r: RankView, s: StateView) -> list[Moment]:
    """The loss backward: log_softmax's gradient next to the nll gradient (two fp32 [n, V/tp]); under TP's
    loss_parallel: the nll gradient, exp(log_softmax) and their sum, plus index masks. Chunked: the last chunk
    backward runs (the first chunk) recomputes its log-softmax; the earlier chunks left their summed head-weight
    gradient and their [nc, D] input gradients (in the split's input buffer until all chunks are in); a held
    step's last micro-batch has reduced the head unit after the first of them (_head_reduced)."""
    if not _at_head(r, s):
        return []
    layout, a = r.layout, r.a
    loss_grads = 3 * a.lsm + 4 * a.chunk_targets if layout.tp > 1 and not layout.num_experts else 2 * a.lsm
    _, w_acc = _head_weight_grads(r)
    chunk_acc = w_acc + a.dy_head if a.chunks > 1 else 0
    dg, db, do = _head_reduced(r, s) if a.chunks > 1 else (0, 0, 0)
    return [Moment("loss backward", _gathered(r, s), s.grads_prev + dg, s.head_acts + a.lsm - s.lsm_kept,
                   s.other + loss_grads + chunk_acc + do, {"loss_grads": loss_grads}, s.gbuf_prev + db)]


def lm_head_backward(r: RankView, s: StateView) -> list[Moment]:
    """The LM head's backward: d(logits), dW_out, d(head input); zero 3 re-gathers the root and prefetches the
    last block (its flat all-gather output waits in a staging buffer). Chunked: the engine sums each chunk's
    dW_out into the accumulated one out of place (torch's InputBuffer), so three [V, D] gradients meet at that
    add, next to the chunks' input gradients."""
    if not _at_head(r, s):
        return []
    a = r.a
    w_out, w_acc = _head_weight_grads(r)
    head_grads = a.grad_logits + a.dy_head + w_out if a.chunks == 1 else 3 * w_acc + a.dy_head
    dg, db, do = _head_reduced(r, s) if a.chunks > 1 else (0, 0, 0)
    p2, o2 = _gathered(r, s), s.other + head_grads + do
    if r.zero3 and not s.own_kept:
        if r.layout.pp > 1 or r.layout.head_reshards:  # (the head re-gathered; without PP: only under "always")
            p2 += r.st.head_unit if r.layout.pp == 1 else r.st.root_unit
        o2 += r.st.unit_max
    return [Moment("LM head backward", p2, s.grads_prev + dg, s.head_acts - s.lsm_kept, o2, {"head_grads": head_grads},
                   s.gbuf_prev + db)]


def _new_grads(r: RankView, s: StateView, new: int) -> tuple[int, int]:
    """(grads, grad_buffers) with `new` parameter-gradient bytes the backward has just made: FSDP's land on its
    unsharded parameters (grad_buffers until the reduce-scatter), the others are the .grad the optimizer reads."""
    return (s.grads_prev, s.gbuf_prev + new) if r.fsdp else (s.grads_prev + new, s.gbuf_prev)


def _block_backward(r: RankView, s: StateView) -> tuple[int, int, int, int, int]:
    """(param copies, grads, grad buffers, other, activations) in the backward of the chunk's last block. New
    gradients of the head and of w2 are fresh tensors until the first backward has run; then autograd adds into
    .grad in place, except FSDP mixed precision, whose bf16 unsharded grads join the fp32 accumulator only at the
    unit's post-backward. Zero 3 gathers units one by one: root + this block (+ the prefetched one's staging buffer).
    Zero bubble: the input backward (I) retains the graph for the weight backward (W), with every linear's
    output gradient of the chunk."""
    layout, st, a = r.layout, r.st, r.a
    # the head unit reduce-scattered after its backward (a held step: in its last micro-batch)
    single = r.fsdp and layout.pp == 1 and (not r.fsdp_accum or s.last)
    head_grads = r.grad_bytes * r.head_numel if _at_head(r, s) and s.fresh and not single else 0
    g3, b3 = _new_grads(r, s, head_grads + (r.grad_bytes * r.w2 if s.fresh else 0))
    gathering = r.zero3 and not s.own_kept
    root = st.root_unit if layout.pp > 1 else 0  # without PP the embedding is gathered for its backward only
    p3 = (_gathered(r, s, True) + (root + st.unit_max if gathering else 0) if r.fsdp else 0)
    # a chunk without the head receives its output gradient into the pipeline's receive buffer (pp_buffers):
    # no fresh [n, D] gradient in `other` until its last block's backward makes one
    d_out = a.d_stream if layout.pp == 1 or _at_head(r, s) else 0
    o3 = s.other + d_out + (st.unit_max if gathering else 0)
    if single and _at_head(r, s):
        # the head's reduce-scatter input (fp32) stays until the next unit's post-backward pops it
        # (FSDPParamGroup.post_backward, reduce_scatter_max_input_buffers = 1); its sharded output is a grad
        o3 += 4 * (st.head_unit // r.compute_bytes)
        if s.ps.grads < 1:
            g3 += 4 * st.head_stored
        elif r.fsdp_accum:  # a held step's accumulator became the input above and a sharded .grad
            g3, b3 = g3 + 4 * st.head_stored, b3 - 4 * r.head_numel
        if _head_ar_kept(r, s):
            o3 += 4 * st.head_stored
    acts3 = s.acts + s.logits_alive + r.recompute_extra
    if layout.pp > 1 and layout.pp_schedule == "zero_bubble":
        o3 += r.chunk_layers[s.ps.chunk] * a.lin_out_grads
    return p3, g3, b3, o3, acts3


def last_block_backward(r: RankView, s: StateView) -> list[Moment]:
    """The chunk's last block backward: zero bubble's input backward (the loss part of the graph retained too,
    with the head's output gradient of every loss chunk), then at the SwiGLU product's gradient and in
    RMSNorm's backward."""
    layout, a = r.layout, r.a
    p3, g3, b3, o3, acts3 = _block_backward(r, s)
    out = []
    if layout.pp > 1 and layout.pp_schedule == "zero_bubble":
        if _at_head(r, s):
            acts_i, o_i = s.head_acts + r.recompute_extra, o3 + a.grad_logits_all
        else:
            acts_i, o_i = acts3, o3
        out.append(Moment("input backward (zero bubble)", p3, g3, acts_i, o_i + a.norm_bwd, {}, b3))
    # zero 3 with ep > 1: the experts' own FSDP unit is gathered only for their backward (fully_shard_experts) and
    # FSDP2 prefetches one unit ahead in reverse forward order: the experts' unit while the block's dense part
    # computes (a copy, no staging buffer, when their shard group is one rank), the previous block's dense part
    # while the experts do (measured; the staging buffer `o3` holds is unit_max)
    own_unit = r.zero3 and layout.ep > 1 and not s.own_kept and layout.num_experts > 0
    experts = r.compute_bytes * 3 * (layout.num_experts // layout.ep) * layout.d_model * layout.d_ff
    stage = (r.st.unit_max - (experts if layout.expert_shard > 1 else 0), experts) if own_unit else (0, 0)
    if a.shared_prod:  # MoE: the shared expert's SwiGLU backward before the experts', which keep their activations
        out.append(Moment("block backward (shared expert)", p3 - (experts if own_unit else 0), g3,
                          acts3 - a.shared_prod - a.combine_rows,
                          o3 + 3 * a.shared_prod + a.combine_grad - stage[0], {}, b3))
    out.append(Moment("block backward (SwiGLU)", p3, g3, acts3 - a.prod, o3 + a.ffn_bwd - stage[1], {}, b3))
    out.append(Moment("block backward (norm)", p3 - (experts if own_unit else 0), g3, acts3 - a.ffn_saved,
                      o3 + a.norm_bwd - stage[1], {}, b3))
    return out + _second_block_backward(r, s, p3, g3, b3, o3, acts3)


def _second_block_backward(r: RankView, s: StateView, p3: int, g3: int, b3: int, o3: int, acts3: int) -> list[Moment]:
    """FSDP without a pipeline, the next block's SwiGLU backward once the last block has reduced: that block is
    resharded after its backward (zero 2, a held step's last micro-batch; zero 3 holds one block either way), its
    saved activations are freed, and its gradient is a sharded .grad (an accumulator or nothing before) whose
    fp32 reduce-scatter input replaced the head's in FSDP's one kept input buffer. In bf16 the input (4 B per
    parameter) outweighs the resharded unit (2 B), so with one micro-batch this moment can top the last block's."""
    layout, st, a = r.layout, r.st, r.a
    if not (r.fsdp and layout.pp == 1 and r.n_blocks >= 2 and (not r.fsdp_accum or s.last)):
        return []
    stored = (st.n_stored - st.root_stored) // r.n_blocks  # one block's shard
    p = p3 - (0 if r.zero3 else st.unit_max)
    g, b = g3, b3
    if r.fsdp_accum:
        g, b = g + 4 * stored, b - 4 * r.block_local
    elif s.ps.grads < 1:
        g += 4 * stored
    head = 4 * (st.head_unit // r.compute_bytes) if r.has_head else 0  # the input buffer the block's replaced
    if r.has_head and _head_ar_kept(r, s):
        head += 4 * st.head_stored  # (and the head's kept all-reduce output)
    o = o3 - head + 4 * (st.unit_max // r.compute_bytes)
    acts = acts3 - a.layer_saved
    return [Moment("block backward (SwiGLU, second)", p, g, acts - a.prod, o + a.ffn_bwd, {}, b)]


def first_block_units_kept(r: RankView, s: StateView) -> list[Moment]:
    """Zero 3 under a pipeline, the start of the chunk's first block backward: every unit of the chunk stays
    gathered (set_reshard_after_backward(False)) while this micro-batch's later blocks have freed their
    activations; unless they were kept, the first block's prefetched all-gather output (FSDP2 staging, freed
    only after its copy-out) sits next to its unsharded copy (measured, memory.py "comm")."""
    layout, st, a, c = r.layout, r.st, r.a, s.ps.chunk
    if not (r.zero3 and layout.pp > 1):
        return []
    acts3 = _block_backward(r, s)[-1]
    lay = r.chunk_layers
    acts_end = acts3 - (r.chunk_saved[c] - r.first_saved[c]) - (a.logits if c == r.head_chunk else 0)
    if c == r.head_chunk:  # the other micro-batches' saved head activations (GPipe holds m, measured)
        acts_end += (s.ps.held[c] - 1) * a.head
    g_end, b_end = s.grads_prev, s.gbuf_prev
    if not s.ps.own_grads:  # the chunk's first backward: accumulators of its later blocks and its head
        root_c = sum(d0 * r_ for d0, r_, _, _ in _root_tensors(layout, False, r.stages[c] == r.n_stages - 1))
        b_end += 4 * ((lay[c] - 1) * r.block_local + root_c)
    p_end = s.kept_other + st.chunk_units[c]
    if not s.own_kept and r.stages[c] == 0:  # the embedding's own unit: resharded after its forward, gathered
        p_end -= st.embed_unit  # again only for its backward (fsdp_units.py)
    out = []
    if not s.own_kept:
        out.append(Moment("first block gathered (units kept)", p_end, g_end, acts_end,
                          s.other + a.d_stream + st.unit_max, {}, b_end))
    out.append(Moment("first block backward (units kept)", p_end, g_end, acts_end - a.prod,
                      s.other + a.d_stream + a.ffn_bwd, {}, b_end + r.grad_bytes * r.w2))
    return out


def ring_attention_backward(r: RankView, s: StateView) -> list[Moment]:
    """CP: inside ring attention's backward (its fp32 working set, acts._ring_backward)."""
    layout, a = r.layout, r.a
    if layout.cp <= 1:
        return []
    p3, g3, b3, o3, acts3 = _block_backward(r, s)
    new = r.grad_bytes * r.block_local - r.grad_bytes * r.w2 if s.fresh and not layout.num_experts else 0
    g_attn, b_attn = (g3, b3 + new) if r.fsdp else (g3 + new, b3)
    return [Moment("ring attention backward", p3, g_attn, acts3 - a.ffn_saved - a.post_attn, o3 + a.ring_bwd, {},
                   b_attn)]


# ----------------------------------------------------------------------------------- once per step


def first_layer_backward(r: RankView) -> list[Moment]:
    """The step's last block backward (first layer of the first chunk): gradients are nearly all there; with
    full recompute or small batches this is where the peak is."""
    layout, st, a = r.layout, r.st, r.a
    m, cb, n_blk, blk_local = layout.n_micro_batches, r.compute_bytes, r.n_blocks, r.block_local
    acc = m > 1 or layout.pp > 1
    logits_end = (m if (r.has_head and layout.pp > 1 and PP_KEEPS_OUTPUTS) else
                  (1 if r.has_head and layout.pp == 1 and not LOSS_IN_MODEL else 0))
    V, D, tp = layout.vocab_size, layout.d_model, layout.tp
    held: list[Moment] = []
    if r.fsdp:
        blk_shard = st.n_stored - st.root_stored
        root_local = st.n_local - blk_local * n_blk
        g4 = 4 * (blk_shard - blk_shard // max(n_blk, 1))  # reduced blocks: sharded grads
        if r.fsdp_accum:  # unsharded: grad_buffers
            b4 = 4 * (root_local + blk_local)  # accumulators of the root and of this block
            if layout.precision == "mp":  # this micro-step's bf16 gradients before they join the fp32 ones
                b4 += cb * (root_local + r.w2)
        else:
            if m > 1:  # sharded grads of this block and the root from the earlier micro-steps
                g4 += 4 * (st.n_stored - (blk_shard - blk_shard // max(n_blk, 1)))
            b4 = cb * (root_local - ((V // tp) * D if r.has_embed else 0) + r.w2)
            if layout.pp == 1:  # the head unit's gradients were reduce-scattered after its backward
                b4 -= cb * r.head_numel
                if m == 1:
                    g4 += 4 * st.head_stored
        p4, o4 = st.root_unit + st.unit_max, st.rs_buffer
        if layout.pp == 1:  # the embedding (prefetched by this block's pre-backward) and this block
            p4 = st.embed_unit + st.unit_max
        if layout.pp > 1:  # the chunk's units all stay gathered until perform_reduce_grad (pipeline._kept_units)
            p4 = st.chunk_units[0]
        if layout.fsdp_holds_units and m > 1:
            # an earlier micro-step's last block backward (fsdp.holds_step): every unit stays gathered; ZeRO-1
            # holds the unsharded accumulators of all and reduces nothing, zero 2 reduce-scatters as usual
            # filed as breakdown.py files them: the unsharded accumulators (ZeRO-1) and the unsharded gradients in
            # flight (zero 2) are grad_buffers, zero 2's reduced shards grads
            if r.fsdp_accum:
                g_h = 0
                b_h = 4 * st.n_local + r.tp_embed + (cb * (root_local + r.w2) if layout.precision == "mp" else 0)
            else:
                g_h = 4 * st.n_stored
                b_h = cb * (root_local - ((V // tp) * D if r.has_embed else 0) - r.head_numel + r.w2)
            held.append(Moment("block backward (first, units held)", st.all_units, g_h, 0,
                               r.other_base + a.d_stream + a.ffn_bwd + (0 if r.fsdp_accum else st.rs_buffer), {},
                               b_h))
    else:
        embed_grad = 4 * V * D if (r.has_embed and tp > 1) else (4 * (V // tp) * D if r.has_embed else 0)
        g4 = _with_buckets(st.grads_full if acc else st.grads_full - 4 * blk_local - embed_grad + 4 * r.w2,
                           st.ddp_buckets)
        p4, o4, b4 = 0, 0, 0
    acts4 = r.data + a.rope + (a.embed if r.has_embed else 0) + a.layer_saved + r.recompute_extra + \
        logits_end * a.logits - a.prod
    if layout.pp > 1 and min(r.stages) != r.n_stages - 1:
        acts4 += a.stream
    return [Moment("block backward (first)", p4, g4, acts4,
                   r.other_base + a.d_stream + a.ffn_bwd + o4, {}, b4)] + [h._replace(activations=acts4) for h in held]


def head_reduce_scatter(r: RankView, s: StateView) -> list[Moment]:
    """FSDP without a pipeline: the [norm, output] unit's reduce-scatter right after its backward (its
    post-backward runs when the final norm's input gradient is made, fsdp_units.py), with every block's saved
    activations still alive; the unit is resharded first (FSDPParamGroup.post_backward), and under zero 3 the
    last block's prefetched all-gather output waits in its staging buffer. Zero 2 holds every other unit. A held
    step reduces in its last micro-batch only, its fp32 accumulator in place of the new compute-dtype gradient."""
    if not (r.fsdp and r.layout.pp == 1 and r.has_head and (not r.fsdp_accum or s.last)):
        return []
    st, a = r.st, r.a
    held = (0 if r.zero3 else st.all_units - st.head_unit)
    if r.fsdp_accum:  # the accumulator (in grad_buffers) copied into the input, then freed before the collective
        accum = 4 * r.head_numel
        rs = _unit_reduce_scatter(r.layout, st.head_unit, st.head_stored, r.compute_bytes, copy_in=accum) - accum
    else:
        rs = _unit_reduce_scatter(r.layout, st.head_unit, st.head_stored, r.compute_bytes)
    return [Moment("head reduce-scatter", held, s.grads_prev, s.acts,
                   s.other + a.d_stream + (st.unit_max if r.zero3 else 0) + rs, {"head_reduce_scatter": rs},
                   s.gbuf_prev)]


def root_reduce_scatter(r: RankView) -> list[Moment]:
    """FSDP without a pipeline: the embedding unit's reduce-scatter at the end of every backward."""
    if not (r.fsdp and r.layout.pp == 1):
        return []
    # ZeRO-1 on FSDP2 reduces only on the last micro-step: no sharded gradient from an earlier one
    m = 1 if r.fsdp_accum else r.layout.n_micro_batches
    return [_root_reduce_scatter(r.layout, r.st, r.compute_bytes, m, r.data, r.other_base)]


def _unit_reduce_scatter(layout: Layout, unit: int, stored: int, cb: int, copy_in: int | None = None) -> int:
    """Bytes one unit's reduce-scatter adds (`unit`: its gathered compute bytes, `stored`: its shard's numel):
    the copy-in (every unsharded gradient + the fp32 input; `copy_in`: other gradient bytes than `unit` there, a
    held step's fp32 accumulator) or the collective (input + output + one [V/tp, D] compute-dtype gradient the
    autograd engine still holds + gloo's own copy of the input), see _root_reduce_scatter."""
    rs_in = 4 * (unit // cb)  # padded unsharded numel, fp32
    held = cb * (layout.vocab_size // layout.tp) * layout.d_model
    # (a shard group of one rank, bf16 ZeRO-0's replicas or degree 1, copies instead of reduce-scattering)
    gloo = rs_in if (layout.device == "cpu" and GLOO_COPIES_RS_INPUT and layout.shard > 1) else 0
    return rs_in + max(unit if copy_in is None else copy_in, 4 * stored + held + gloo)


def _root_reduce_scatter(layout: Layout, st: _States, cb: int, m: int, data: int, other0: int) -> Moment:
    """The last unit's reduce-scatter at the end of every backward: the embedding's (fsdp_units.py; FSDP2 runs
    its post_backward from FSDPState._root_post_backward_final_callback, after every block's, since the token
    ids need no gradient). foreach_reduce (torch 2.13 fsdp/_fully_shard/_fsdp_collectives.py) allocates the
    reduce-scatter input in reduce_dtype, fp32 here (parallel/fsdp.py: MixedPrecisionPolicy(reduce_dtype=
    float32)), so the [V, D] embedding gradient gets an fp32 copy, padded to the whole unit;
    foreach_reduce_scatter_copy_in fills it while the unsharded gradient (compute dtype) is alive, then the list
    is cleared and the fp32 output shard is allocated next to the input. Measured on CPU (vocab-zero3-dp2-bf16,
    memory.py) at the collective: input + output + one [V/tp, D] compute-dtype gradient the autograd engine still
    holds (no Python reference; the graph task ends after this callback) + gloo's own copy of the input
    (GLOO_COPIES_RS_INPUT). The previous unit's reduce-scatter input is not alive: FSDPParamGroup.post_backward
    pops comm_ctx.reduce_scatter_states down to reduce_scatter_max_input_buffers (1) before this reduce appends.
    On CUDA the estimator assumes the same moment without gloo's copy (the held gradient is the engine's, not the
    backend's). Sharded gradients: all of them after an earlier micro-step, else every unit's but the
    embedding's (its output is the new one)."""
    rs = _unit_reduce_scatter(layout, st.embed_unit, st.embed_stored, cb)
    grads = st.grads_full if m > 1 else st.grads_full - 4 * st.embed_stored
    return Moment("embedding reduce-scatter", 0, grads, data, other0 + rs, {"embedding_reduce_scatter": rs})


def optimizer_step(r: RankView) -> list[Moment]:
    """The optimizer step (AdamW temporaries); a pipeline's last stage holds the logits step() kept, if it
    keeps them."""
    layout, st, a = r.layout, r.st, r.a
    kept_logits = layout.n_micro_batches * a.logits if (r.has_head and layout.pp > 1 and PP_KEEPS_OUTPUTS) else 0
    return [Moment("optimizer step", 0, _with_buckets(st.grads_full, st.ddp_buckets), kept_logits,
                   r.other_base + st.step_transient, {"adamw_step": st.step_transient})]
