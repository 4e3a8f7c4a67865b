"""Tensor parallel (Megatron-LM) and sequence parallel over the mesh's "tp" axis, with torch DTensor.

    curry-train whitebox --config configs/tiny.yaml --set parallel.tp=2 --set parallel.sp=true --json

Shape legend: B micro-batch, T sequence, D d_model, H / G query / kv heads, Dh head dim, F d_ff, V vocab,
t = tp. "local" = what one rank holds.

Shoeybi et al. 2019, "Megatron-LM" (arXiv:1909.08053) §3 splits each block's two matmul pairs so that one
collective in forward and one in backward cover a whole sub-block:
  column-parallel A = [A_1 .. A_t] (split output features): rank r computes X A_r, no communication; the input
      X must be replicated, so its gradient is a *sum* over ranks (Megatron's `f`: identity fwd, all-reduce bwd).
  row-parallel B = [B_1; ..; B_t] (split input features): rank r computes Y_r B_r, a partial sum of Y B
      (Megatron's `g`: all-reduce fwd, identity bwd).
Attention: wq/wk/wv are column-parallel, so each rank holds H/t query heads and G/t kv heads (whole heads, so
RoPE and GQA's head grouping stay rank-local: query head j uses kv head j // (H/G) on every rank); wo is
row-parallel. SwiGLU: w1 (gate) and w3 (up) column-parallel, silu(.)*(.) elementwise on the local F/t slice, w2
row-parallel. Embedding: rows (vocab) sharded, each rank looks up its own ids and leaves zeros elsewhere; the
sum over ranks (all-reduce) is exact. LM head: column-parallel over the vocab, logits stay sharded
[B, T, V/t] and the cross entropy runs under `loss_parallel()` (the softmax max and sum are all-reduced over
V instead of gathering [B, T, V]).

Sequence parallel (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198 §4.2.2): between the row-parallel output and the next column-parallel input the activations
are identical on every rank, so the norms (and dropout, which this model has none of) run on a T/t slice each.
`g` becomes a reduce-scatter to [B, T/t, D] and `f` an all-gather back to [B, T, D]: the same bytes as the
all-reduce, with 1/t of the norm activations per rank. The residual stream between blocks is then a DTensor
Shard(1) (global shape [B, T, D], so the model's default positions stay right).

torch's building blocks: `ColwiseParallel` / `RowwiseParallel` shard a Linear's weight (Shard(0) / Shard(1)) and
convert inputs/outputs; `PrepareModuleInput` is the `f` (Replicate, or all-gather under SP) once per sub-block,
so q, k and v share one backward all-reduce; `SequenceParallel` marks the norm weights Replicate and its
inputs Shard(1).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from curry_train.config import Config
from curry_train.model.gpt import FeedForward
from curry_train.model.mla import MLAttention
from curry_train.rules import ep_spans_tp


def mla_plan(stream: Any, sp: bool, q_lora: bool) -> dict[str, Any]:
    """TP plan of model/mla.py's attention (DeepSeek-V2 arXiv:2405.04434 §2.1), relative to the block: the query
    up-projection (wq, or wq_b after the q latent) and the KV up-projection wkv_b column-parallel by heads, wo
    row-parallel; wq_a, q_norm, wkv_a and kv_norm unplanned, so their weights stay plain replicated tensors and each
    rank computes the full latents from the full input. The input reaches the module as a plain replicated tensor
    (all-gathered under SP): the latents' gradients are made whole by each column-parallel input's backward
    all-reduce (DTensor.from_local of a Replicate input), and the rotary key shared by every head by `shared_key`
    (`_sum_grad_over_tp`), so every gradient leaving the module is complete and Replicate -> Shard(1) under SP is
    the local slice."""
    return {
        "attention": PrepareModuleInput(input_layouts=(stream, None, None),
                                        desired_input_layouts=(Replicate(), None, None), use_local_output=True),
        "attention.wq_b" if q_lora else "attention.wq": ColwiseParallel(),  # -> local [B, T, H/t * (Dn + Dr)]
        "attention.wkv_b": ColwiseParallel(),  # [B, T, Rkv] -> local [B, T, H/t * (Dn + Dv)]
        "attention.wo": RowwiseParallel(output_layouts=stream, use_local_output=not sp),  # g -> stream
    }


def _sum_grad_over_tp(tp_mesh: Any) -> Any:
    """Megatron's f for a replicated tensor that each rank uses with its own heads only (MLA's rotary key): identity
    forward; backward all-reduces the rank's partial gradient (DTensor: a Replicate view whose local gradient is
    declared Partial)."""
    def f(x: Any) -> Any:
        return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    return f


def block_plan(sp: bool, dense_ffn: bool = True, shared: bool = False, ep_over_tp: bool = False,
               mla_q_lora: bool | None = None) -> dict[str, Any]:
    """TP plan of one transformer block (module name -> ParallelStyle), relative to the block. `shared`: the MoE
    FFN has shared experts; `ep_over_tp`: its experts are expert-parallel over dp x tp (mesh.Topology.ep_over_tp),
    so each tp rank routes its own T/t tokens; `mla_q_lora` is not None for an MLA block (whether its queries have
    a latent)."""
    stream = Shard(1) if sp else Replicate()  # residual stream layout: [B, T/t, D] under SP, else [B, T, D]
    plan: dict[str, Any] = mla_plan(stream, sp, mla_q_lora) if mla_q_lora is not None else {
        # f: [B, T/t, D] --all-gather--> [B, T, D] (SP) or replicated -> one backward reduce for wq, wk and wv.
        # Attention.forward(x, cos, sin): only x is a DTensor; the RoPE tables stay plain tensors.
        "attention": PrepareModuleInput(input_layouts=(stream, None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),  # [B, T, D] -> local [B, T, H/t * Dh]
        "attention.wk": ColwiseParallel(),  # [B, T, D] -> local [B, T, G/t * Dh]
        "attention.wv": ColwiseParallel(),  # [B, T, D] -> local [B, T, G/t * Dh]
        # g: local [B, T, H/t * Dh] -> partial [B, T, D] --all-reduce / reduce-scatter--> stream
        "attention.wo": RowwiseParallel(output_layouts=stream, use_local_output=not sp),
    }
    if dense_ffn:
        plan.update({
            "feed_forward": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),  # [B, T, D] -> local [B, T, F/t]
            "feed_forward.w3": ColwiseParallel(),  # [B, T, D] -> local [B, T, F/t]
            "feed_forward.w2": RowwiseParallel(output_layouts=stream, use_local_output=not sp),  # -> stream
        })
    elif ep_over_tp:
        # MoE FFN under TP + EP (Megatron-LM's expert-tensor-parallel size 1): the routed experts stay whole and
        # the EP group spans the tp ranks, so each tp rank routes its own [B, T/t, D] sequence shard as a plain
        # tensor (no gather: the dispatch sees every token once) and hands back its T/t slice. The router is
        # replicated over tp and its gradient summed there (model/moe.py TopKRouter.tp_group).
        plan["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(stream,), desired_input_layouts=(stream,), use_local_input=True,
            output_layouts=(stream,), desired_output_layouts=(stream,), use_local_output=False)
    elif sp:
        # MoE FFN without EP: experts are not tensor-parallel and every tp rank routes all B*T tokens as plain
        # tensors: all-gather in, keep this rank's T/t slice out. Without SP the stream is already a plain
        # replicated tensor and the MoE needs no plan.
        plan["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(stream,), use_local_output=False)
    if shared and not dense_ffn:
        # The shared experts are a dense SwiGLU every token passes: Megatron's column / row pair, on the plain
        # tensor the MoE holds ([B, T/t, D] under ep_over_tp, else [B, T, D] replicated): all-gathered in (or
        # already replicated), reduce-scattered (or all-reduced) back to the same layout, a plain tensor again.
        held = stream if ep_over_tp else Replicate()
        plan.update({
            "feed_forward.shared_experts": PrepareModuleInput(input_layouts=(held,),
                                                              desired_input_layouts=(Replicate(),)),
            "feed_forward.shared_experts.w1": ColwiseParallel(),  # -> local [B, T, Fs/t]
            "feed_forward.shared_experts.w3": ColwiseParallel(),
            "feed_forward.shared_experts.w2": RowwiseParallel(output_layouts=held),  # -> plain, as it came in
        })
    if sp:  # norms run on the local T/t tokens; their weights are replicated, weight grads summed over ranks
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def apply_tp(model: nn.Module, mesh: Any, cfg: Config) -> bool:
    """Shard `model` (the full model or a pipeline stage of it) over mesh["tp"], in place.

    Returns True when this part produces vocab-sharded logits (a DTensor Shard(-1) [B, T, V]), so the caller
    computes the loss under `torch.distributed.tensor.parallel.loss_parallel()` (train.forward_backward).
    MoE models get all-gathered plain logits instead (False): their auxiliary losses are plain tensors added
    to the cross entropy. Needs H, G, F, V (and T under SP) divisible by tp, which config.check enforces.
    """
    tp_mesh = mesh["tp"]
    sp = cfg.parallel.sp
    stream = Shard(1) if sp else Replicate()
    vocab_sharded_loss = cfg.model.num_experts == 0
    ep_over_tp = ep_spans_tp(cfg.model.num_experts, cfg.parallel.tp, cfg.parallel.ep)
    for block in model.layers.values():
        ffn, mla = block.feed_forward, isinstance(block.attention, MLAttention)
        parallelize_module(block, tp_mesh, block_plan(sp, isinstance(ffn, FeedForward),
                                                      getattr(ffn, "shared_experts", None) is not None, ep_over_tp,
                                                      hasattr(block.attention, "wq_a") if mla else None))
        if mla:
            block.attention.shared_key = _sum_grad_over_tp(tp_mesh)

    root: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        # ids [B, T] replicated -> rows of the local vocab slice, zeros elsewhere (partial) -> summed to the stream
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream,
                                                 use_local_output=not sp)
    if model.norm is not None and sp:
        root["norm"] = SequenceParallel()
    if model.output is not None and vocab_sharded_loss:
        # [B, T, D] (all-gathered under SP) -> logits [B, T, V/t], kept sharded for loss_parallel
        root["output"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
    elif model.output is not None:  # -> logits all-gathered to a plain [B, T, V]
        root["output"] = ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
    if root:
        parallelize_module(model, tp_mesh, root)
    return model.output is not None and vocab_sharded_loss
