"""Activation recomputation (checkpointing) per transformer block: `full` or `selective`.

    curry-train whitebox --config configs/tiny.yaml --set parallel.recompute=selective --json

Shape legend: B micro-batch, T local sequence, D d_model, H/G query/kv heads, Dh head dim, F d_ff.

full       Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": each block keeps only its input
           [B, T, D] and reruns its whole forward during backward (one extra forward, ~33% more FLOPs).
selective  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
           (arXiv:2205.05198) §4.2: keep what is expensive to recompute, recompute what is cheap in FLOPs but
           large in memory. Implemented with torch's selective activation checkpointing (SAC): an op-level
           policy over the block's forward (torch.utils.checkpoint.create_selective_checkpoint_contexts).

The selective policy (`selective_policy`, op-level SAC as torchtitan applies it to Llama and MoE models):
  SAVED       every other matmul output of a block (aten.mm / addmm / _grouped_mm, counted in forward order per
              block call: the 1st, 3rd, 5th, ... are kept, the others rerun; curry_train/sac_rule.py). Dense block:
              wq, wv, w1, w2 kept; wk, wo, w3 rerun. Half the projections' bytes for half their FLOPs;
              fused attention outputs (SDPA flash / efficient / cuDNN / CPU-flash: out [B, H, T, Dh] and its
              logsumexp [B, H, T]): rerunning the kernel costs O(B*H*T^2*Dh) FLOPs, the most expensive op of a
              block at long T, for O(B*T*D) bytes. Fused kernels never store the T x T softmax; their backward
              recomputes it tile by tile from q, k and the logsumexp (Dao et al. 2022, "FlashAttention", §3.1),
              which *is* the softmax recomputation Korthikanti et al. prescribe;
              MoE top-k (values and ids [N, K]): the routing decision is replayed bit for bit from it;
              functional-collective outputs: SP's reduce-scatters and EP's dispatch / combine all-to-alls
              (comms.all_to_all): replaying them costs bandwidth and, for the all-to-all, a host sync.
  RECOMPUTED  everything else: the other matmuls, RMSNorm (pow, mean, rsqrt, mul), RoPE, SiLU and the gate
              product, residual adds, reshapes, GQA head repeats, and every piece of an *unfused* attention
              (aten.bmm of the scores Q K^T and of P V, softmax, masking, the ring-attention LSE merges): these
              are the [B, H, T, T]-sized tensors selective recompute exists to drop. bmm is never saved: in this
              model it only computes attention (or the padded expert kernel), so saving it would keep T^2 scores.
  REPLAYED FROM THE FORWARD  the MoE dispatch's host read (split sizes) and the count exchange behind it:
              `host_once` runs them once per block forward, hidden from the policy, and hands the recomputation
              the forward's values, so EP + selective recompute replays no collective and no host sync.
Memory per block (fp32, SwiGLU, no TP): none ~ the sum of all saved inputs of every op; selective keeps the
block input, q, v, w1 and w2 outputs and the attention out + logsumexp; full keeps the block input only.

The ops SAC must not count. SAC (torch 2.13) replays by (op, invocation index) and refuses an op that runs more
often in the recomputation than in the forward. FSDP2's profiler markers do: a nested FSDP unit inside a block
(MoE experts with ep > 1) marks its post-forward again during the recomputation. They compute nothing, so the
checkpointed function adds them to torch's `SAC_IGNORED_OPS` while it runs (forward and recomputation) and
restores the set afterwards (`_ignoring_markers`): importing this module changes no torch global.

Both modes use non-reentrant checkpointing (torch.utils.checkpoint, use_reentrant=False): it composes with
DDP, FSDP2 (whose pre-backward all-gather runs before the recompute) and DTensor TP, and it supports
keyword arguments and grads of inputs that don't require grad. preserve_rng_state=False: the model has no
dropout or other randomness, so there is no RNG state to replay (set it True if you add dropout).

Parameter names do not change: the block's `forward` is replaced on the instance (no wrapper module), so
`layers.<i>.attention.wq.weight` stays as it is for the white-box comparison, TP plans and checkpoints.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as _utils_checkpoint
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from curry_train.config import Config
from curry_train.sac_rule import is_saved_matmul

_aten = torch.ops.aten
T_ = TypeVar("T_")


def _ops(namespace: Any, *names: str) -> set:
    """The default overloads of the named ops that this torch build has (some kernels are build-specific)."""
    return {getattr(namespace, n).default for n in names if hasattr(namespace, n)}


MATMUL_OPS = _ops(_aten, "mm", "addmm", "_grouped_mm")  # counted: every other one saved (sac_rule.py)
SAVE_OPS = (  # always saved
    _ops(_aten, "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_attention_math", "topk")
    | _ops(torch.ops._c10d_functional, "reduce_scatter_tensor", "all_to_all_single")
)


def selective_policy_for_block() -> Callable[..., CheckpointPolicy]:
    """A fresh SAC policy for one checkpointed block call: its own matmul counter, so the parity starts over in
    every block and micro-batch. torch 2.13 asks the policy in the forward only and replays its decisions by
    (op, invocation index); the counter skips recompute calls all the same, for torch versions that ask then."""
    seen = {"mm": 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in MATMUL_OPS:
            if ctx.is_recompute:
                return CheckpointPolicy.PREFER_RECOMPUTE
            k, seen["mm"] = seen["mm"], seen["mm"] + 1
            return CheckpointPolicy.MUST_SAVE if is_saved_matmul(k) else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_context():
    return create_selective_checkpoint_contexts(selective_policy_for_block())


_MARKERS = frozenset(
    getattr(packet, overload)
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
    if (packet := getattr(torch.ops.profiler, name, None)) is not None
    for overload in packet.overloads()
)


@contextlib.contextmanager
def _ignoring_markers() -> Iterator[None]:
    """SAC ignores the profiler markers while the block runs; torch's set is restored as it was."""
    added = _MARKERS - _utils_checkpoint.SAC_IGNORED_OPS
    _utils_checkpoint.SAC_IGNORED_OPS.update(added)
    try:
        yield
    finally:
        _utils_checkpoint.SAC_IGNORED_OPS.difference_update(added)


class _HostMemo:
    """Values computed once in a checkpointed block's forward and handed back, in order, to its recomputations."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.calls = 0
        self.pos = 0

    def once(self, compute: Callable[[], T_]) -> T_:
        if self.calls == 1:  # the forward: run, hidden from SAC so that the recomputation may skip it
            with _disable_current_modes():
                value = compute()
            self.values.append(value)
            return value
        value, self.pos = self.values[self.pos], self.pos + 1
        return value


_MEMO: contextvars.ContextVar[_HostMemo | None] = contextvars.ContextVar("curry_recompute_memo", default=None)


def host_once(compute: Callable[[], T_]) -> T_:
    """`compute()` (a host read, a metadata collective) run once per checkpointed block forward; the block's
    recomputation gets the forward's value without running it again. Outside a checkpointed block: `compute()`.
    Its ops are hidden from dispatch modes in the forward (SAC counts invocations per op, so an op the
    recomputation skips must never have been counted) and it must not compute anything autograd needs."""
    memo = _MEMO.get()
    return compute() if memo is None else memo.once(compute)


def checkpointed(forward: Callable, mode: str) -> Callable:
    """`forward` rerun in backward: all of it (`full`) or all but the policy's saved outputs (`selective`)."""
    extra = {"context_fn": _selective_context} if mode == "selective" else {}

    def run(*args: Any, **kwargs: Any) -> Any:
        memo = _HostMemo()

        def body(*a: Any, **k: Any) -> Any:
            memo.calls, memo.pos = memo.calls + 1, 0  # call 1 = the forward, later calls = recomputations
            token = _MEMO.set(memo)
            try:
                with _ignoring_markers() if mode == "selective" else contextlib.nullcontext():
                    return forward(*a, **k)
            finally:
                _MEMO.reset(token)

        return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)

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
