"""Activation recomputation (checkpointing) per transformer block: `full` or `selective`.

    curry-train whitebox --config configs/tiny.yaml --set parallel.recompute=selective --json

Shape legend: B micro-batch, T local sequence, D d_model, H/G query/kv heads, Dh head dim, F d_ff.

full       Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": each block keeps only its input
           [B, T, D] and reruns its whole forward during backward (one extra forward, ~33% more FLOPs).
selective  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
           (arXiv:2205.05198) §4.2: keep what is expensive to recompute, recompute what is cheap in FLOPs but
           large in memory. Implemented with torch's selective activation checkpointing (SAC): an op-level
           policy over the block's forward (torch.utils.checkpoint.create_selective_checkpoint_contexts).

The selective policy (`SAVE_OPS`):
  SAVED       matmul outputs (aten.mm / addmm: the q, k, v, o and w1, w3, w2 projections; _grouped_mm for MoE
              experts): O(B*T*D*D) FLOPs each for O(B*T*D) bytes (w2's output is kept too, although only the
              residual add reads it: a policy by op kind cannot tell the last projection from the others);
              fused attention outputs (SDPA flash / efficient / cuDNN / CPU-flash: out [B, H, T, Dh] and its
              logsumexp [B, H, T]): rerunning the kernel costs O(B*H*T^2*Dh) FLOPs, the most expensive op of a
              block at long T, for O(B*T*D) bytes. Fused kernels never store the T x T softmax; their backward
              recomputes it tile by tile from q, k and the logsumexp (Dao et al. 2022, "FlashAttention", §3.1),
              which *is* the softmax recomputation Korthikanti et al. prescribe;
              functional-collective reduce-scatters (sequence-parallel TP): replaying them costs bandwidth.
  RECOMPUTED  everything else: RMSNorm (pow, mean, rsqrt, mul), RoPE, SiLU and the gate product, residual
              adds, reshapes, GQA head repeats, and every piece of an *unfused* attention (aten.bmm of the
              scores Q K^T and of P V, softmax, masking, the ring-attention LSE merges): these are the
              [B, H, T, T]-sized tensors selective recompute exists to drop. bmm is recomputed on purpose:
              in this model it only ever computes attention, so saving it would keep the T^2 scores.
Memory per block (fp32, SwiGLU, no TP): none ~ the sum of all saved inputs of every op; selective keeps the
block input, q/k/v/o, w1/w3/w2 outputs and the attention out + logsumexp; full keeps the block input only.

Both modes use non-reentrant checkpointing (torch.utils.checkpoint, use_reentrant=False): it composes with
DDP, FSDP2 (whose pre-backward all-gather runs before the recompute) and DTensor TP, and it supports
keyword arguments and grads of inputs that don't require grad. preserve_rng_state=False: the model has no
dropout or other randomness, so there is no RNG state to replay (set it True if you add dropout).

Parameter names do not change: the block's `forward` is replaced on the instance (no wrapper module), so
`layers.<i>.attention.wq.weight` stays as it is for the white-box comparison, TP plans and checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as _utils_checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from curry_train.config import Config

_aten = torch.ops.aten


def _ops(namespace: Any, *names: str) -> set:
    """The default overloads of the named ops that this torch build has (some kernels are build-specific)."""
    return {getattr(namespace, n).default for n in names if hasattr(namespace, n)}


SAVE_OPS = (
    _ops(_aten, "mm", "addmm", "_grouped_mm")
    | _ops(_aten, "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    | _ops(torch.ops._c10d_functional, "reduce_scatter_tensor")
)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """SAC policy: save the outputs of the ops in SAVE_OPS, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(selective_policy)


# SAC replays ops by (op, invocation index) and refuses an op that runs more often in the recomputation than in the
# forward. The profiler markers FSDP2's hooks emit do: a nested FSDP unit inside a block (MoE experts with ep > 1)
# marks its post-forward again during the recomputation. They compute nothing, so SAC may ignore them like the
# `detach` it already ignores (torch.utils.checkpoint.SAC_IGNORED_OPS).
_utils_checkpoint.SAC_IGNORED_OPS.update(
    getattr(packet, overload)
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
    if (packet := getattr(torch.ops.profiler, name, None)) is not None
    for overload in packet.overloads()
)


def checkpointed(forward: Callable, mode: str) -> Callable:
    """`forward` rerun in backward: all of it (`full`) or all but the SAVE_OPS outputs (`selective`)."""
    extra = {"context_fn": _selective_context} if mode == "selective" else {}

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)

    return run


def apply_recompute(model: nn.Module, mesh: Any, cfg: Config) -> None:
    """Checkpoint every transformer block of `model` (a full model or a pipeline stage) in place."""
    mode = cfg.parallel.recompute
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"parallel.recompute={mode!r}: expected none, selective or full")
    for block in model.layers.values():
        # An instance attribute shadows the class's forward: module hooks (FSDP) still run around the call.
        block.forward = checkpointed(block.forward, mode)
