"""Every collective torch lacks as a module: autograd all-to-all (expert parallel), ring exchange (context
parallel), and the small non-differentiable helpers (count exchange, gathers, gradient reductions).

    .venv/bin/pytest tests/parallel/test_expert_parallel.py tests/parallel/test_context_parallel.py

Math modules never call torch.distributed; they call these. Every function takes the process group explicitly
(no global state) and is the identity on a size-1 group, so the single-device reference runs the same code.
Device-agnostic: gloo on CPU, NCCL on CUDA; nothing here names a device.

Shape legend: S rows sent, R rows received, D feature dims (any trailing shape), W group size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (pytorch#186123) and kept the old name as a
# deprecated alias (FutureWarning); the old spelling (torch >= 1.13) serves an older torch. compat.py keeps the
# minimum torch and the API-by-API table.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


# --------------------------------------------------------------------------- all-to-all (expert parallel)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable all_to_all_single with uneven splits (GShard, Lepikhin et al. 2020, §2.2 dispatch /
    combine); the identity on a size-1 group.

    Rank r sends rows [sum(in_splits[:j]), +in_splits[j]) of x [S, D] to rank j and receives out_splits[j] rows
    from rank j, concatenated in rank order -> [R, D]. The backward is the transposed exchange (the splits swap
    roles), so gradients return to the rows they came from.

    Through torch's functional collective (`_c10d_functional.all_to_all_single`, whose autograd torch registers
    in torch.distributed._functional_collectives) rather than `dist.all_to_all_single` in an autograd.Function:
    the functional op is an aten-level op with an output, so selective recompute's policy can save that output
    and the recomputation never replays the exchange (parallel/recompute.py, docs/ARCHITECTURE.md#recompute).
    The wait follows at once: the result is a plain tensor, not an AsyncCollectiveTensor. Works on gloo (CPU)
    and NCCL alike; the list form `all_to_all` rejects uneven shapes on gloo (docs/CPU-DISTRIBUTED.md, quirk 3).
    """
    if group_size(group) == 1:
        return x
    import torch.distributed._functional_collectives  # noqa: F401  registers the ops' autograd formulas

    out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), out_splits, in_splits, group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)  # [R, D]


class _StartAllToAll(torch.autograd.Function):
    """Forward: issue the exchange and return its output unwaited. Backward: wait for the transposed exchange that
    _WaitAllToAll.backward issued into `box` (a gradient must have its input's shape, so it travels beside)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], name: str, box: dict):
        ctx.box = box
        return torch.ops._c10d_functional.all_to_all_single(x.contiguous(), out_splits, in_splits, name)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return torch.ops._c10d_functional.wait_tensor(ctx.box.pop("grad")), None, None, None, None


class _WaitAllToAll(torch.autograd.Function):
    """Forward: wait for the exchange _StartAllToAll issued. Backward: issue the transposed exchange of the
    gradient (the splits swap roles) into `box`, unwaited, and pass the gradient through."""

    @staticmethod
    def forward(ctx, pending: torch.Tensor, out_splits: list[int], in_splits: list[int], name: str, box: dict):
        ctx.args, ctx.box = (in_splits, out_splits, name), box
        return torch.ops._c10d_functional.wait_tensor(pending).view_as(pending)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.box["grad"] = torch.ops._c10d_functional.all_to_all_single(g.contiguous(), *ctx.args)
        return g, None, None, None, None


def all_to_all_overlapped(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any,
                          work: Callable[[], T]) -> tuple[torch.Tensor, T]:
    """`all_to_all(x, ...)` with `work()` computed while the exchange is in flight, in forward and in backward ->
    (the exchanged rows [R, D], work's result). On a size-1 group: (x, work()).

    Forward: the functional all_to_all_single returns before the exchange completes (NCCL runs it on its own
    stream, gloo on its own thread); `work()` runs, then the wait. Backward: autograd runs ready nodes in
    decreasing sequence number (the order they were recorded), so work's backward, recorded between the start
    and the wait, runs after the wait's backward (which issues the transposed exchange) and before the start's
    (which waits for it): the exchange of the gradient overlaps work's backward. Work must not depend on x and
    its result must be used after the wait (model/moe.py: the shared expert during the combine, DeepSeek-V2 /
    V3's shared expert, Megatron-LM's moe_shared_expert_overlap). The op is the same functional all-to-all as
    `all_to_all`'s, so selective recompute still saves its output (parallel/recompute.py).
    """
    if group_size(group) == 1:
        return x, work()
    import torch.distributed._functional_collectives  # noqa: F401  registers the ops (and wait_tensor)

    box: dict = {}
    pending = _StartAllToAll.apply(x, out_splits, in_splits, group.group_name, box)  # [R, D], not yet received
    done = work()
    return _WaitAllToAll.apply(pending, out_splits, in_splits, group.group_name, box), done


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """Even all-to-all of integer counts [W * k] -> [W * k]: block j of the result is what rank j sends here.

    Runs before the token all-to-all so every rank knows its receive split sizes (not differentiable).
    """
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


# --------------------------------------------------------------------------- gathers and gradient reductions


def all_gather_dim0(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate every rank's t [n, ...] along dim 0 in group-rank order -> [W * n, ...] (not differentiable;
    used to map expert shards back to the reference's full [E, ...] shape)."""
    if group_size(group) == 1:
        return t
    t = t.contiguous()
    out = t.new_empty((group_size(group) * t.shape[0], *t.shape[1:]))
    _all_gather_single(out, t, group=group)
    return out


@torch.no_grad()
def all_reduce_sum_scaled_(tensors: list[torch.Tensor], group: Any, scale: float) -> None:
    """In place: t <- scale * sum over the group of t, for every t, in one flattened all-reduce (one collective
    per call keeps the ranks' collective sequences trivially aligned)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if group_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat.mul_(scale)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


@torch.no_grad()
def all_reduce_sum_(t: torch.Tensor, group: Any) -> torch.Tensor:
    """In place sum over the group (diagnostics: counts, FLOPs); returns t."""
    if group_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous().clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g, None


def sum_grad_over(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward, gradient summed over `group` in backward: Megatron-LM's `f`
    (copy_to_tensor_model_parallel_region, Shoeybi et al. 2019 §3), put on a weight replicated over ranks that
    apply it to different tokens (the MoE router under TP + EP: each tp rank routes its own sequence shard)."""
    if group_size(group) == 1:
        return t
    return _SumGrad.apply(t, group)


def group_mean_value(t: torch.Tensor, group: Any) -> torch.Tensor:
    """A scalar whose value is the mean of `t` over `group` and whose gradient is this rank's t / W: every rank
    then holds the same loss term (the replicated loss tensor parallel computes), and the gradients W ranks add
    up (sum_grad_over) are those of the mean. The value's all-reduce is not differentiated."""
    W = group_size(group)
    if W == 1:
        return t
    total = all_reduce_sum_(t.detach().clone(), group)
    return t / W + (total - t.detach()) / W


# --------------------------------------------------------------------------- ring exchange (context parallel)


class RingExchange:
    """Asynchronous shift around a ring: send to group rank r+1, receive from r-1 (Liu et al. 2023, "Ring
    Attention with Blockwise Transformers", §3: the next block's transfer overlaps this block's compute).

    `start(t)` posts the isend/irecv pair and returns at once; `wait()` returns the received tensor.
    Used inside context_parallel.RingAttention's forward *and* backward, which run the same number of shifts
    on every rank, so the pairs always match (the hang of quirk 2 needs shifts that some rank skips).
    """

    def __init__(self, group: Any, tag: int = 0):
        self.group, self.tag = group, tag  # two rings in flight at once (K/V and dK/dV) match by tag on gloo
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.send_to = dist.get_global_rank(group, (rank + 1) % size)
        self.recv_from = dist.get_global_rank(group, (rank - 1) % size)
        self._works: list[Any] = []
        self._buf: torch.Tensor | None = None

    def start(self, t: torch.Tensor) -> None:
        assert not self._works, "wait() for the previous shift first"
        t = t.contiguous()
        self._buf = torch.empty_like(t)
        ops = [
            dist.P2POp(dist.isend, t, self.send_to, self.group, self.tag),
            dist.P2POp(dist.irecv, self._buf, self.recv_from, self.group, self.tag),
        ]
        self._works = dist.batch_isend_irecv(ops)
        self._sent = t  # keep the send buffer alive until the transfer completes

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        self._works, self._sent = [], None
        out, self._buf = self._buf, None
        return out

    def shift(self, t: torch.Tensor) -> torch.Tensor:
        self.start(t)
        return self.wait()
