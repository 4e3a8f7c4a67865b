"""The storage tracker behind measure/memory.py: every tensor storage alive during one training step, by category.

    python -c "from curry_train.config import load_config; from curry_train.measure.memory import measure_memory; \
               print(measure_memory(load_config('configs/tiny.yaml')))"     # measure_memory drives the tracker

`StepMemoryTracker(par)` is a TorchDispatchMode: entered around one `train.loop.train_step`, it counts each storage
once (views and shared storages de-duplicated; a DTensor counts its local shard) in one of the categories that
measure/memory.py defines (curry_train/breakdown.py's), keeping each category's maximum and the split at the peak.

Exactness (CPU): storages are tracked with a TorchDispatchMode and weakref finalizers and the total is checked
after every aten op that allocates and every storage resize, so the numbers are exact at op granularity and
repeat run to run, with one exception: a buffer handed to an asynchronous collective is freed by the backend's
thread when the collective completes (FSDP's reduce-scatter input), so `other` and `peak` can differ between
runs and ranks by up to one FSDP unit's gradient bytes. DDP's buckets live in C++: they count by size until
the reducer's first write into one reveals its storage. The pipeline's receive buffers are allocated in the first
step and filled by c10d without an aten op: they are registered by role when tracking starts. Not seen: workspaces a
kernel allocates and frees internally, the communication backend's own buffers (gloo threads, NCCL), allocator
rounding. On CUDA the report also carries torch.cuda's own peak figures for the same step (`cuda_*`, which include
the 512-byte rounding and kernel workspaces; the CUDA context is in neither). torch's MemTracker was not used: it
refuses a root module called more than once per step (gradient accumulation) and lacks the DDP-bucket and FSDP
categories above.
"""


from __future__ import annotations

import threading
import weakref
from collections import Counter
from functools import partial
from typing import Any

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from curry_train.breakdown import CATEGORIES

# FSDPParamGroup methods that run FSDP's all-gathers, reduce-scatters and their copy-in / copy-out.
_FSDP_METHODS = ("unshard", "wait_for_unshard", "reshard", "pre_backward", "post_backward", "finalize_backward")
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# The categories are curry_train/breakdown.py's, shared with the estimator. The loss gradients ([tokens, vocab]
# fp32) are found by the aten ops that make them (F.cross_entropy's backward decomposes into these).
_LOSS_OPS = {torch.ops.aten._log_softmax_backward_data.default, torch.ops.aten.nll_loss_backward.default}
# Under TP's loss_parallel (parallel/tensor_parallel.py) DTensor runs these two ops through its own handlers
# (torch.distributed.tensor.parallel.loss.customized_loss_ops, installed each time loss_parallel() is entered),
# which make the same gradients from elementwise ops on the local shard: allocations inside them are `loss` too.


def _storages(t: torch.Tensor):
    if type(t) in _PLAIN:
        return (t.untyped_storage(),)
    local = getattr(t, "_local_tensor", None)  # DTensor (fast path of the general case below)
    if type(local) in _PLAIN:
        return (local.untyped_storage(),)
    if is_traceable_wrapper_subclass(t):  # DTensor, AsyncCollectiveTensor: their inner (local) tensors
        return get_untyped_storages(t)
    return (t.untyped_storage(),)


def _real(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_meta and not isinstance(t, torch._subclasses.FakeTensor)


def _is_recomputing() -> bool:
    """Inside a non-reentrant checkpoint's recomputation (torch.utils.checkpoint._recomputation_hook)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return bool(hooks) and "_recomputation_hook" in getattr(hooks[0], "__qualname__", "")


def _pipeline_recv_buffers(par: Any) -> list[torch.Tensor]:
    """torch.distributed.pipelining's receive buffers on this rank (torch 2.13 stage.py): per stage, one activation
    buffer per micro-batch unless it is the first stage (`args_recv_info`) and one gradient buffer per micro-batch
    unless it is the last (`grad_recv_info`). The first step allocates them and every step reuses them; a V
    schedule's same-rank hand-over replaces a buffer with the tensor handed over (kept until the next one)."""
    schedule = getattr(par, "schedule", None)
    if schedule is None:
        return []
    stages = getattr(schedule, "_stages", None) or [schedule._stage]  # multi-stage / single-stage schedules
    infos = [info for st in stages for recv in (*st.args_recv_info.values(), *st.grad_recv_info.values())
             for info in recv]
    return [info.buffer for info in infos if _real(info.buffer)]


class StepMemoryTracker(TorchDispatchMode):
    """Tracks every storage alive while it is active; `par` (train.Parallelized) names the persistent roles."""

    def __init__(self, par: Any):
        super().__init__()
        self.lock = threading.RLock()  # storages may be released on a backend thread
        self.live: dict[int, list] = {}  # storage key -> [bytes, tag]; tags: pre fwd bwd opt pcopy
        self.refs: dict[int, weakref.ref] = {}
        self.tag_bytes: Counter = Counter()
        self.total, self.peak, self.in_optimizer, self.in_fsdp, self.in_loss = 0, 0, False, 0, 0
        self.maxima = dict.fromkeys(CATEGORIES, 0)
        self.at_peak = dict.fromkeys(CATEGORIES, 0)
        self._roots(par)

    # ------------------------------------------------------------------ what exists before the step
    def _roots(self, par: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.fsdp_groups = []
        for part in par.parts:
            for m in part.modules():
                state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
                if getattr(state, "_fsdp_param_group", None) is not None:
                    self.fsdp_groups.append(state._fsdp_param_group)
        self.fsdp_params = [fp for g in self.fsdp_groups for fp in g.fsdp_params]
        # FSDP's sharded params, whichever of sharded / unsharded the modules hold now, then every other param.
        managed = {id(fp.sharded_param) for fp in self.fsdp_params}
        managed |= {id(fp.__dict__["_unsharded_param"]) for fp in self.fsdp_params if "_unsharded_param" in fp.__dict__}
        self.params = [fp.sharded_param for fp in self.fsdp_params]
        for part in par.parts:
            self.params += [p for p in part.parameters() if id(p) not in managed and not managed.add(id(p))]
        static: dict[str, list] = {"params": [], "optimizer": [], "pp_buffers": []}
        for p in self.params:
            static["params"] += self._register(p, "pre")
        from curry_train.parallel.zero import zero_optimizers  # ZeRO-1 with experts: two (parallel/zero.py)

        opts = [o for z in zero_optimizers(par.optimizer) for o in (z, getattr(z, "optim", None))]  # ZeRO-1: .optim
        for opt in filter(None, opts):
            for state in opt.state.values():
                for v in state.values():
                    if _real(v):
                        static["optimizer"] += self._register(v, "pre")
        for part in par.parts:
            for b in part.buffers():
                self._register(b, "pre")
        for t in _pipeline_recv_buffers(par):  # filled by c10d, not by an aten op: only found by role
            static["pp_buffers"] += self._register(t, "pre")
        self.copy_keys = set()  # FSDP's unsharded parameters: storages it resizes to 0 and back, so keys persist
        for fp in self.fsdp_params:
            for t in [*fp.all_gather_outputs, fp.__dict__.get("_unsharded_param")]:
                if t is not None:
                    self.copy_keys.update(self._register(t, "pre"))
        buckets, self.buckets_are_grads = [], False
        for part in par.parts:
            if isinstance(part, DistributedDataParallel):
                buckets += [b.buffer().nbytes for b in part.reducer._get_zeros_like_grad_buckets()]
                # gradient_as_bucket_view: the buckets are the .grad storage whether or not a .grad points into
                # them right now (breakdown.py: grads)
                self.buckets_are_grads = bool(part.gradient_as_bucket_view)
        # The reducer owns its buckets in C++: they are counted by size until the reducer's first in-place write
        # into one shows its storage (`_adopt`), which then replaces the placeholder.
        self.bucket_keys = set()
        for i, nbytes in enumerate(buckets):
            self.live[-1 - i] = [nbytes, "pre"]
            self.bucket_keys.add(-1 - i)
            self.tag_bytes["pre"] += nbytes
            self.total += nbytes
        self.static_keys = {k for keys in static.values() for k in keys}
        self.static_cat = dict.fromkeys(CATEGORIES, 0) | {
            c: sum(self.live[k][0] for k in set(keys)) for c, keys in static.items()}
        self.static_tags = Counter()
        for k in self.static_keys:
            self.static_tags[self.live[k][1]] += self.live[k][0]
        self.param_keys = set(static["params"])

    # ------------------------------------------------------------------ storage bookkeeping
    def _register(self, t: torch.Tensor, tag: str) -> list[int]:
        return [self._register_storage(st, tag) for st in _storages(t)]

    def _register_storage(self, st: torch.UntypedStorage, tag: str) -> int:
        k, n = st._cdata, st.nbytes()
        entry = self.live.get(k)
        if entry is None:
            self.live[k] = [n, tag]
            self.refs[k] = weakref.ref(st, partial(self._freed, k))
            self.tag_bytes[tag] += n
            self.total += n
        elif entry[0] != n:  # resized in place (aten.resize_, set_)
            self.tag_bytes[entry[1]] += n - entry[0]
            self.total += n - entry[0]
            entry[0] = n
        return k

    def _adopt(self, st: torch.UntypedStorage) -> None:
        """A storage that existed before the step and was not registered, seen when an op writes into it."""
        n = st.nbytes()
        placeholder = next((k for k in self.bucket_keys if k < 0 and self.live[k][0] == n), None)
        if placeholder is not None:  # a DDP bucket: swap the size placeholder for the real storage
            self.bucket_keys.discard(placeholder)
            self.tag_bytes["pre"] -= self.live.pop(placeholder)[0]
            self.total -= n
            self.bucket_keys.add(st._cdata)
        self._register_storage(st, "pre")

    def _freed(self, key: int, _ref: Any) -> None:
        with self.lock:
            entry = self.live.pop(key, None)
            self.refs.pop(key, None)
            if entry is not None:
                self.tag_bytes[entry[1]] -= entry[0]
                self.total -= entry[0]

    def _split(self) -> dict[str, int]:
        """Bytes per category now: static roles, then the roles found by following params and FSDP state."""
        live, cat, seen = self.live, dict(self.static_cat), set()  # static and dynamic roles never share storages
        rest = {tag: n - self.static_tags.get(tag, 0) for tag, n in self.tag_bytes.items()}

        def take(c: str, keys) -> None:
            for k in keys:
                if k not in seen and k in live:
                    seen.add(k)
                    n, tag = live[k]
                    cat[c] += n
                    rest[tag] -= n

        # .grad first; under gradient_as_bucket_view a DDP bucket *is* the gradients it holds views of, also while
        # no .grad points into it (forward, after zero_grad): the contract of breakdown.py files it with grads
        take("grads", [st._cdata for p in self.params if p.grad is not None for st in _storages(p.grad)])
        take("grads" if self.buckets_are_grads else "grad_buffers", list(self.bucket_keys))
        unsharded_grads = []
        for fp in self.fsdp_params:
            unsharded = fp.__dict__.get("_unsharded_param")
            for g in (fp.unsharded_accumulated_grad, unsharded.grad if unsharded is not None else None):
                unsharded_grads += [st._cdata for st in _storages(g)] if g is not None else []
        take("grad_buffers", unsharded_grads)
        take("param_copies", self.copy_keys)
        cat["param_copies"] += rest.pop("pcopy", 0)
        cat["activations"] += rest.pop("fwd", 0)
        cat["loss"] += rest.pop("loss", 0)
        cat["other"] += sum(rest.values())
        return cat

    def _event(self) -> None:
        split = self._split()
        for c, n in split.items():
            self.maxima[c] = max(self.maxima[c], n)
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, split

    # ------------------------------------------------------------------ hooks
    def _tag(self, func: Any, args: tuple) -> str:
        if self.in_optimizer:
            return "opt"
        if self.in_loss:
            return "loss"
        if self.in_fsdp:
            return "comm"  # FSDP's staging buffers; its unsharded params and sharded grads are found by role
        if (func is torch.ops.aten._to_copy.default and args and _real(args[0])
                and any(st._cdata in self.param_keys for st in _storages(args[0]))):
            return "pcopy"  # a cast of a parameter outside FSDP (e.g. the MoE router's fp32 upcast)
        if func in _LOSS_OPS:
            return "loss"
        if torch._C._current_graph_task_id() == -1 or _is_recomputing():
            return "fwd"
        return "bwd"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops; they come back here as plain tensors
        out = func(*args, **(kwargs or {}))
        with self.lock:
            tag, inputs, before = None, None, self.total
            for t in tree_leaves(out):
                for st in _storages(t) if _real(t) else ():
                    entry = self.live.get(st._cdata)
                    if entry is not None and entry[0] == st.nbytes():
                        continue  # a view or an in-place result: nothing allocated
                    if entry is None:
                        if inputs is None:  # an out= / in-place op returns the storage it was handed
                            inputs = {s._cdata for a in tree_leaves((args, kwargs)) if _real(a) for s in _storages(a)}
                        if st._cdata in inputs:
                            self._adopt(st)
                            continue
                    self._register_storage(st, tag or (tag := self._tag(func, args)))
            if self.total > before:  # bytes only enter a category through an allocation
                self._event()
        return out

    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int):  # not an aten op: FSDP2 frees / refills this way
            out = tracker._orig_resize(st, size)
            with tracker.lock:
                before = tracker.total
                tracker._register_storage(st, tracker._tag(None, ()))  # updates the size of a known storage
                if tracker.total > before:
                    tracker._event()
            return out

        torch.UntypedStorage.resize_ = resize_
        for group in self.fsdp_groups:  # mark allocations made by FSDP's own collectives and copies
            for name in _FSDP_METHODS:
                setattr(group, name, self._inside("in_fsdp", getattr(group, name)))
        from torch.distributed.tensor.parallel import loss as tp_loss

        self._loss_handlers = {op: tp_loss.customized_loss_ops[op] for op in _LOSS_OPS}
        for op, handler in self._loss_handlers.items():
            tp_loss.customized_loss_ops[op] = self._inside("in_loss", handler)
        with self.lock:
            self._event()
        return super().__enter__()

    def _inside(self, counter: str, fn: Any) -> Any:
        """`fn`, counting its calls in progress in the attribute `counter` (in_fsdp, in_loss), which _tag reads."""
        def run(*args: Any, **kwargs: Any) -> Any:
            setattr(self, counter, getattr(self, counter) + 1)
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) - 1)

        return run

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize
        from torch.distributed.tensor.parallel import loss as tp_loss

        tp_loss.customized_loss_ops.update(self._loss_handlers)
        for group in self.fsdp_groups:
            for name in _FSDP_METHODS:
                group.__dict__.pop(name, None)
        super().__exit__(*exc)
        self.refs.clear()  # finalizers off: the tracker is done
