"""The estimator's view of a config: a flat hashable layout, the parameter tensors one rank holds, counts and
FLOPs (part of curry_train.estimator; pure arithmetic, no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Any

from curry_train.config import Config, dense_width, loss_chunk_count, shared_width
from curry_train.estimator.mla import mla_core_flops_per_token, mla_linear_params, mla_matmuls, mla_tensors
from curry_train.fsdp_units import reshard_after_forward
from curry_train.pipeline_split import layers_per_stage, stage_layer_range
from curry_train.rules import ep_spans_tp
from curry_train.sac_rule import saved_matmuls
from curry_train.wrapping import data_parallel_wrapper, expert_replicas, fsdp_holds_step, fsdp_replicas, precision_path

GiB = 2**30
LAYOUT_CACHE = 1 << 15  # per layout-keyed cache: a DeepSeek-V3 plan visits ~10k (layout, rank) keys (8192 thrashed)


@dataclass(frozen=True)
class Layout:
    """Everything the arithmetic needs, flattened from a Config (hashable for the caches)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    num_experts: int
    top_k: int
    capacity_factor: float
    seq_len: int
    global_batch: int
    micro_batch: int
    dp: int
    zero: int
    recompute: str
    tp: int
    sp: bool
    pp: int
    pp_schedule: str
    pp_virtual: int
    ep: int
    cp: int
    dtype: str
    device: str
    gpus_per_node: int
    nodes: int
    gpu_memory_gib: float
    has_z_loss: bool  # model.z_loss_coef > 0
    has_aux_loss: bool  # model.aux_loss_coef > 0
    pp_layers: tuple[int, ...] | None = None  # parallel.pp_layers (explicit stage split), else split by cost
    dp_replicate: int = 1  # HSDP replicas (parallel.dp_replicate): FSDP shards over dpcp / dp_replicate ranks
    loss_chunks: int = 0  # train.loss_chunks (0 = auto): the LM head + loss in token chunks (config.loss_chunk_count)
    fsdp_keep_gathered: bool = False  # parallel.fsdp_keep_gathered: zero-2 units gathered across micro-batches
    shared_d_ff: int = 0  # config.shared_width: the fused shared expert of each MoE block (0 = none)
    first_k_dense: int = 0  # MoE models: the first blocks with a dense SwiGLU of width dense_d_ff
    dense_d_ff: int = 0  # config.dense_width (d_ff when there is no dense-first block)
    route_groups: int = 1  # group-limited routing (model.route_groups; 1 = off)
    attention: str = "gqa"  # model.attention; "mla": the five fields below (estimator/mla.py)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    fsdp_reshard: str = "default"  # parallel.fsdp_reshard: when zero-3 units reshard after forward (fsdp_units.py)

    @cached_property  # (read in the planner's hot loops; the fields are frozen)
    def replicas(self) -> int:
        """FSDP2's replica groups over dp*cp (wrapping.fsdp_replicas: HSDP's, bf16 ZeRO-0's dp*cp; else 1)."""
        return fsdp_replicas(self.dp, self.cp, self.zero, self.tp, self.dtype, self.dp_replicate)

    @cached_property  # (read in the planner's hot loops; the fields are frozen)
    def shard(self) -> int:
        """Ranks a dense parameter is FSDP-sharded over: dp*cp, divided by the replica groups (HSDP, ZeRO-0)."""
        return self.dpcp // self.replicas

    @cached_property
    def expert_shard(self) -> int:
        """Ranks an expert shard is FSDP-sharded over: its holders (`edp`), under HSDP (or ZeRO-0's replicas)
        those of one replica group (wrapping.expert_replicas; parallel/expert_parallel.py fully_shard_experts)."""
        return self.edp // (expert_replicas(self.dp, self.cp, self.ep, self.replicas) or 1)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        """Dims RoPE rotates per head (the cos/sin tables' width x 2): MLA's qk_rope_head_dim, else head_dim."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def mla(self) -> bool:
        return self.attention == "mla"

    @property
    def n_micro_batches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def micro_batch_tokens(self) -> int:
        """Tokens of one micro-batch on this rank: micro_batch x seq_len / cp."""
        return self.micro_batch * (self.seq_len // self.cp)

    @property
    def dpcp(self) -> int:
        return self.dp * self.cp

    @property
    def ep_over_tp(self) -> bool:
        """The EP groups are carved from dp x tp (rules.ep_spans_tp): each tp rank routes its own T/tp shard."""
        return ep_spans_tp(self.num_experts, self.tp, self.ep)

    @property
    def edp(self) -> int:
        """Ranks holding the same experts, over which their gradients are reduced (mesh.ep_meshes): dp*tp/ep
        when the EP group spans tp, else dp/ep x cp."""
        return self.dp * self.tp // self.ep if self.ep_over_tp else (self.dp // self.ep) * self.cp

    @property
    def moe_tokens(self) -> int:
        return routed_tokens(self)

    @cached_property  # (read in the planner's hot loops; the fields are frozen)
    def fsdp(self) -> bool:
        return self.wrapper == "fsdp"

    @cached_property  # (read in the planner's hot loops; the fields are frozen)
    def wrapper(self) -> str:  # fsdp | ddp | none: the template's rule (wrapping.data_parallel_wrapper)
        return data_parallel_wrapper(self.dp, self.cp, self.zero, self.tp, self.dtype)

    @cached_property  # (read in the planner's hot loops; the fields are frozen)
    def ddp(self) -> bool:
        return self.wrapper == "ddp"

    @cached_property  # (read in the planner's hot loops; the fields are frozen)
    def fsdp_defers_reduce(self) -> bool:
        """FSDP accumulates unsharded fp32 gradients across the step and reduces once: under PP (torch's
        schedule) and for ZeRO-0/1 on FSDP2 (wrapping.fsdp_holds_step)."""
        return self.fsdp and (self.pp > 1 or self.fsdp_holds_step)

    @cached_property  # (read in the planner's hot loops; the fields are frozen)
    def fsdp_holds_step(self) -> bool:  # ZeRO-0/1 on FSDP2: units and fp32 gradients held for the step (wrapping.py)
        return fsdp_holds_step(self.dp, self.cp, self.zero, self.tp, self.dtype)

    @cached_property  # (read in the planner's hot loops; the fields are frozen)
    def fsdp_holds_units(self) -> bool:
        """Without PP: FSDP keeps every unit gathered across the micro-batches of a step (parallel/fsdp.py
        holds_step): ZeRO-0/1 on FSDP2, or zero 2 with parallel.fsdp_keep_gathered."""
        return self.fsdp and self.pp == 1 and (self.fsdp_holds_step or (self.zero == 2 and self.fsdp_keep_gathered))

    @cached_property  # (read in the planner's hot loops; the fields are frozen)
    def reshards_blocks(self) -> bool:
        """FSDP frees the blocks (and the embedding, the experts) after their forward and gathers them again for
        their backward: zero 3, except under a pipeline with parallel.fsdp_reshard=default (fsdp_units.py)."""
        return self.fsdp and reshard_after_forward(self.zero, self.pp, self.fsdp_reshard, "block")

    @cached_property  # (read in the planner's hot loops; the fields are frozen)
    def head_reshards(self) -> bool:
        """FSDP frees the [norm, output] unit after its forward: only under parallel.fsdp_reshard=always."""
        return self.fsdp and reshard_after_forward(self.zero, self.pp, self.fsdp_reshard, "head")

    @cached_property  # (read in the planner's hot loops; the fields are frozen)
    def precision(self) -> str:
        """fp32 | mp: which mechanism computes the model (wrapping.precision_path: bf16 is FSDP2's policy)."""
        return precision_path(self.dtype)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def routed_tokens(x: Any) -> int:
    """Tokens one rank routes per micro-batch (a Layout or compute's stand-in): its sequence shard under TP + EP
    (T/tp, the SP slice: rules.ep_spans_tp), else every token of its micro-batch (the tp ranks of a MoE without
    EP route the gathered sequence)."""
    n = x.micro_batch * (x.seq_len // x.cp)
    return n // x.tp if ep_spans_tp(x.num_experts, x.tp, x.ep) else n


def layout_of(cfg: Config) -> Layout:
    m, t, p, h = cfg.model, cfg.train, cfg.parallel, cfg.hardware
    device = h.device if h.device != "auto" else "cuda"
    return Layout(vocab_size=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
                   n_kv_heads=m.n_kv_heads, d_ff=m.d_ff, num_experts=m.num_experts, top_k=m.top_k,
                   capacity_factor=m.capacity_factor, seq_len=t.seq_len, global_batch=t.global_batch,
                   micro_batch=t.micro_batch, dp=p.dp, zero=p.zero, recompute=p.recompute, tp=p.tp, sp=p.sp,
                   pp=p.pp, pp_schedule=p.pp_schedule, pp_virtual=p.pp_virtual, ep=p.ep, cp=p.cp, dtype=t.dtype,
                   device=device, gpus_per_node=h.gpus_per_node, nodes=h.nodes, gpu_memory_gib=h.gpu_memory_gib,
                   has_z_loss=m.z_loss_coef > 0, has_aux_loss=m.aux_loss_coef > 0,
                   pp_layers=tuple(p.pp_layers) if p.pp_layers else None, dp_replicate=p.dp_replicate,
                   loss_chunks=t.loss_chunks, fsdp_keep_gathered=p.fsdp_keep_gathered,
                   shared_d_ff=shared_width(m), first_k_dense=m.first_k_dense if m.num_experts else 0,
                   dense_d_ff=dense_width(m), route_groups=m.route_groups, attention=m.attention,
                   q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                   qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, fsdp_reshard=p.fsdp_reshard)


def stage_split(layout: Layout) -> tuple[int, ...]:
    """Layers per pipeline stage: pipeline_split.layers_per_stage, the function parallel/pipeline.py builds the
    stages with. A pp_layers list that no longer fits the stage count (the planner varying pp) is dropped."""
    n_stages = layout.pp * layout.pp_virtual
    given = layout.pp_layers
    explicit = given if given and len(given) == n_stages and sum(given) == layout.n_layers else None
    return _split(layout.n_layers, layout.pp, layout.pp_virtual, explicit, layout.d_model, layout.n_heads,
                  layout.n_kv_heads, layout.d_ff, layout.vocab_size, layout.seq_len, layout.num_experts, layout.top_k,
                  layout.shared_d_ff, layout.first_k_dense, layout.dense_d_ff)


@lru_cache(maxsize=4096)
def _split(L: int, pp: int, v: int, explicit: tuple[int, ...] | None, D: int, H: int, G: int, F: int, V: int,
           s: int, E: int, K: int, Fs: int = 0, k_dense: int = 0, Fd: int = 0) -> tuple[int, ...]:
    """layers_per_stage, cached: the planner asks for the same split once per rank and candidate."""
    return layers_per_stage(n_layers=L, pp=pp, pp_virtual=v, pp_layers=explicit, d_model=D, n_heads=H,
                            n_kv_heads=G, d_ff=F, vocab_size=V, seq_len=s, num_experts=E, top_k=K, shared_d_ff=Fs,
                            first_k_dense=k_dense, dense_d_ff=Fd)


def block_kinds(layout: Layout, stages: list[int] | tuple[int, ...]) -> tuple[int, int]:
    """(dense blocks, MoE blocks) a pipeline rank holding `stages` runs: a MoE model's first first_k_dense
    global layers are dense (config.is_moe_block); a dense model's are all dense."""
    split = stage_split(layout)
    layers = [i for s_ in stages for i in stage_layer_range(split, s_)]
    if not layout.num_experts:
        return len(layers), 0
    dense = sum(1 for i in layers if i < layout.first_k_dense)
    return dense, len(layers) - dense


def dense_view(layout: Layout) -> Layout:
    """A dense block of a MoE model seen as a dense model's (for its tensors and activations): SwiGLU of width
    dense_d_ff, no router, no experts."""
    return replace_layout(layout, num_experts=0, d_ff=layout.dense_d_ff, shared_d_ff=0, first_k_dense=0,
                          route_groups=1, has_aux_loss=False, has_z_loss=False)


def rank_layers(layout: Layout, stages: list[int] | tuple[int, ...]) -> int:
    """Transformer layers a pipeline rank holding `stages` runs."""
    split = stage_split(layout)
    return sum(split[s] for s in stages)


# One parameter tensor as one rank holds it before FSDP: (dim0, rest, global numel, fsdp group size kind)
#   kind: "dense" (sharded over dp*cp by FSDP) or "expert" (over edp*cp when ep > 1).
_Tensor = tuple[int, int, int, str]


def _block_tensors(layout: Layout, dense: bool = False) -> list[_Tensor]:
    """A transformer block's parameters, TP-local (colwise: dim 0 / tp; rowwise: dim 1 / tp); `dense`: one of a
    MoE model's first_k_dense blocks (SwiGLU of width dense_d_ff)."""
    if dense and layout.num_experts:
        return _block_tensors(dense_view(layout))
    D, t, Dh = layout.d_model, layout.tp, layout.head_dim
    q, kv = layout.n_heads * Dh, layout.n_kv_heads * Dh
    if layout.mla:  # model/mla.py's tensors between the two norms
        out: list[_Tensor] = [(D, 1, D, "dense"), *mla_tensors(layout), (D, 1, D, "dense")]
    else:
        out = [(D, 1, D, "dense"), (q // t, D, q * D, "dense"), (kv // t, D, kv * D, "dense"),
               (kv // t, D, kv * D, "dense"), (D, q // t, D * q, "dense"), (D, 1, D, "dense")]
    if layout.num_experts:
        E, F = layout.num_experts, layout.d_ff
        El = E // layout.ep
        out.append((E, D, E * D, "dense"))  # router gate [E, D], replicated over tp
        kind = "expert" if layout.ep > 1 else "dense"
        out += [(El, D * F, E * D * F, kind)] * 3  # w1, w3 [El, D, F]; w2 [El, F, D]
        Fs = layout.shared_d_ff  # the shared expert: replicated over ep, TP-split like a dense SwiGLU
        if Fs:
            out += [(Fs // t, D, Fs * D, "dense"), (Fs // t, D, Fs * D, "dense"), (D, Fs // t, D * Fs, "dense")]
    else:
        F = layout.d_ff
        Fl = F // t
        out += [(Fl, D, F * D, "dense"), (Fl, D, F * D, "dense"), (D, Fl, D * F, "dense")]
    return out


def _root_tensors(layout: Layout, embed: bool, head: bool) -> list[_Tensor]:
    V, D = layout.vocab_size, layout.d_model
    out: list[_Tensor] = []
    if embed:
        out.append((V // layout.tp, D, V * D, "dense"))
    if head:
        out += [(D, 1, D, "dense"), (V // layout.tp, D, V * D, "dense")]
    return out


def param_count(cfg: Config) -> int:
    """Parameters of the whole model (model.py's module structure: untied head, separate q/k/v, router)."""
    layout = layout_of(cfg)
    one = replace_layout(layout, tp=1, ep=1)
    blk, dense = (sum(g for _, _, g, _ in _block_tensors(one, dense=d)) for d in (False, True))
    k = layout.first_k_dense
    return (layout.n_layers - k) * blk + k * dense + 2 * layout.vocab_size * layout.d_model + layout.d_model


def replace_layout(layout: Layout, **fields: Any) -> Layout:
    """The layout with some fields changed (the planner's candidates)."""
    return replace(layout, **fields)


def active_params(cfg: Config | Layout) -> int:
    """Matmul parameters one token passes through: attention, the FFN (MoE: router + top-k experts), the head.
    The embedding is a lookup, not a matmul."""
    layout = cfg if isinstance(cfg, Layout) else layout_of(cfg)
    D, Dh = layout.d_model, layout.head_dim
    attn = mla_linear_params(layout) if layout.mla else D * layout.n_heads * Dh * 2 + D * layout.n_kv_heads * Dh * 2
    if layout.num_experts:  # router + top-k routed experts + the shared expert; the dense first blocks' SwiGLU
        ffn = layout.num_experts * D + layout.top_k * 3 * D * layout.d_ff + 3 * D * layout.shared_d_ff
        k = layout.first_k_dense
        ffn_all = (layout.n_layers - k) * ffn + k * 3 * D * layout.dense_d_ff
    else:
        ffn_all = layout.n_layers * 3 * D * layout.d_ff
    return layout.n_layers * attn + ffn_all + layout.vocab_size * D


def block_matmuls(layout: Layout, n: float, expert_rows: float) -> list[tuple[float, int, int, bool]]:
    """One block's matmuls in the forward order the selective policy counts them (parallel/recompute.py), as this rank
    runs them on n tokens: (rows, output width, input width, fp32). TP-local widths; MoE: the fp32 router, then the
    CPU loop kernel's three GEMMs per local expert (model/experts.py) on `expert_rows` rows each (uniform routing),
    then the shared expert's three on every token (model/moe.py adds it after the routed output; TP-split like a
    dense SwiGLU). The GPU grouped kernel runs three GEMMs for all experts: its parity differs. A MoE model's dense
    first blocks are `dense_view(layout)`'s."""
    D, Dh, t = layout.d_model, layout.head_dim, layout.tp
    Dq, Dkv, Fl = layout.n_heads // t * Dh, layout.n_kv_heads // t * Dh, layout.d_ff // t
    mms = mla_matmuls(layout, n) if layout.mla else [(n, Dq, D, False), (n, Dkv, D, False), (n, Dkv, D, False),
                                                       (n, D, Dq, False)]
    if not layout.num_experts:
        return mms + [(n, Fl, D, False), (n, Fl, D, False), (n, D, Fl, False)]
    F = layout.d_ff
    expert = [(expert_rows, F, D, False), (expert_rows, F, D, False), (expert_rows, D, F, False)]
    Fs = layout.shared_d_ff // t
    shared = [(n, Fs, D, False), (n, Fs, D, False), (n, D, Fs, False)] if Fs else []
    routed = n // t if layout.ep_over_tp else n  # TP + EP: the router sees this rank's sequence shard
    return mms + [(routed, layout.num_experts, D, True)] + expert * (layout.num_experts // layout.ep) + shared


def selective_rerun_fraction(layout: Layout) -> float:
    """Share of the blocks' matmul FLOPs that selective recompute reruns in backward (the unsaved matmuls); a
    MoE model's dense first blocks (dense_view) weighed in by their count."""
    def rerun_and_total(x: Layout) -> tuple[float, float]:
        mms = block_matmuls(x, 1.0, x.top_k / (x.num_experts or 1) * x.ep)
        flops = [rows * w_out * w_in for rows, w_out, w_in, _ in mms]
        return sum(f for f, keep in zip(flops, saved_matmuls(len(mms))) if not keep), sum(flops)

    rerun, total = rerun_and_total(layout)
    k = layout.first_k_dense
    if k:
        d_rerun, d_total = rerun_and_total(dense_view(layout))
        m = layout.n_layers - k
        rerun, total = m * rerun + k * d_rerun, m * total + k * d_total
    return rerun / total


# The one MFU convention (docs/ESTIMATION.md "MFU"): model FLOPs count causal attention at half, as the kernels run
# it and as Megatron-LM's num_floating_point_operations does; recompute is excluded (it is in hardware FLOPs, HFU)
MFU_CONVENTION = ("MFU: model FLOPs 6 N_active + 6 L H Dh s per token (causal attention counted as half, recompute "
                  "excluded); HFU: executed FLOPs, recompute included")


def flops_per_token(cfg: Config | Layout) -> float:
    """Model FLOPs per token for forward + backward, the MFU_CONVENTION: 6 N_active + 6 L H Dh s (Kaplan et al.
    2020 Table 1 with the causal half of the attention term, as Megatron-LM counts it; PaLM's App. B and
    torchtitan count the full 12 L H Dh s, which lets long-context MFU exceed what the kernels execute)."""
    layout = cfg if isinstance(cfg, Layout) else layout_of(cfg)
    return 6.0 * active_params(layout) + core_flops_per_token(layout)


def core_flops_per_token(layout: Layout) -> float:
    """The causal attention core at its half: 6 L H Dh s (MLA: QK^T over Dn + Dr dims, PV over Dv, estimator/mla.py)."""
    if layout.mla:
        return mla_core_flops_per_token(layout)
    return 6.0 * layout.n_layers * layout.n_heads * layout.head_dim * layout.seq_len


def hardware_flops_per_token(cfg: Config | Layout) -> float:
    """FLOPs the kernels execute: causal attention does half the QK^T and PV work; full recompute reruns each
    block's forward (+1/3 of the block FLOPs), selective reruns the matmuls its policy does not save (about half
    of them: +1/3 of their FLOPs) and the element-wise ops; a chunked loss
    reruns the LM head's forward in backward (model/gpt.py chunked_lm_loss: +2VD, +1/3 of the head FLOPs)."""
    layout = cfg if isinstance(cfg, Layout) else layout_of(cfg)
    linears = 6.0 * (active_params(layout) - layout.vocab_size * layout.d_model)
    head = 6.0 * layout.vocab_size * layout.d_model
    if loss_chunk_count(layout.loss_chunks, layout.micro_batch_tokens, layout.vocab_size, layout.d_model) > 1:
        head += 2.0 * layout.vocab_size * layout.d_model
    if layout.recompute == "full":
        linears *= 4.0 / 3.0
    elif layout.recompute == "selective":  # the unsaved matmuls rerun their forward (2 of the 6 FLOPs per param)
        linears *= 1.0 + selective_rerun_fraction(layout) / 3.0
    return linears + attention_flops_per_token(layout) + head


def attention_flops_per_token(layout: Layout) -> float:
    """The core attention's share of hardware_flops_per_token: QK^T and PV forward + backward at the causal half
    (6 L H Dh s), a full recompute rerunning their forward (x 4/3). Under CP this is what the ring's kernel runs."""
    attn = core_flops_per_token(layout)
    return attn * 4.0 / 3.0 if layout.recompute == "full" else attn
