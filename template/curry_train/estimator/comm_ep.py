"""Expert parallel's collectives for the step-time model (estimator/comm.py): the all-to-alls, with the overlap
model/moe.py runs, and under TP + EP the router's all-reduces over tp.

    .venv/bin/python -m pytest tests/test_cost_terms.py -q -k shared_expert

Per MoE block and micro-batch the template exchanges S_kept x D rows four times (model/moe.py MoE._run_experts):
  dispatch   forward, and its transpose in backward: nothing independent of it is left to run meanwhile, so both
             sit on the critical path.
  combine    forward, while the shared expert computes (comms.all_to_all_overlapped), and its transpose in
             backward, while the shared expert's backward computes: each hides behind that compute only, so per
             call hidden = min((1 - k) x all-to-all, shared expert) with k the overlap slowdown's share
             (comm._expose, OVERLAP_SLOWDOWN: the compute a collective overlaps runs slower meanwhile). Without a
             shared expert the combine waits at once, on the critical path.
Full recompute (parallel/recompute.py) reruns the block's forward inside its backward: the dispatch again, and
the combine again behind the shared expert's replayed forward. Selective recompute saves both exchanges' outputs
and replays neither (tests/parallel/test_expert_parallel.py counts them).
"""

from __future__ import annotations

from collections.abc import Callable

from curry_train.estimator.acts import _moe_slots
from curry_train.estimator.compute import gemm_efficiency
from curry_train.estimator.layout import Layout, block_kinds
from curry_train.estimator.pipeline import stage_ids
from curry_train.estimator.profiles import HardwareProfile

# the windows the combine hides in, with their words (comm._WINDOW_SETS nests them in the forward's and backward's)
SHARED_WINDOWS = {"shared_fwd": "shared expert", "shared_replay": "shared expert replay",
                  "shared_bwd": "shared expert backward"}


def shared_expert_seconds(layout: Layout, hw: HardwareProfile) -> float:
    """Forward seconds of one MoE block's shared expert on one micro-batch on this rank: its three GEMMs ([M, D] x
    [D, Fs/tp] twice, [M, Fs/tp] x [Fs/tp, D]) at compute.gemm_efficiency, as compute._linears prices them. Its
    backward (input and weight gradients) runs twice these FLOPs. 0 without shared experts."""
    Fs = layout.shared_d_ff / layout.tp
    if not (layout.num_experts and Fs):
        return 0.0
    M, D = float(layout.micro_batch_tokens), float(layout.d_model)
    peak, bw, nbytes = hw.peak_flops(layout.dtype), hw.mem_bw_gbps * 1e9, 4 if layout.dtype == "float32" else 2
    return sum(2.0 * M * k * n / (peak * gemm_efficiency(M, k, n, peak, bw, hw.efficiency, nbytes))
               for k, n in ((D, Fs), (D, Fs), (Fs, D)))


def ep_all_to_alls(layout: Layout, hw: HardwareProfile, add: Callable[..., None], link: str,
                   rails: int) -> dict[str, float]:
    """Add the step's EP all-to-alls of the busiest pipeline rank through comm._comm's `add` and return the
    compute windows the combine hides in (seconds per step: the shared expert's forward, its replay under full
    recompute, its backward)."""
    m = layout.n_micro_batches
    layers = max(block_kinds(layout, stage_ids(layout, r))[1] for r in range(layout.pp))  # MoE blocks only
    _, Sk = _moe_slots(layout, layout.moe_tokens)  # TP + EP: this tp rank's T/tp shard only
    cb = 2 if layout.precision != "fp32" else 4
    one = Sk * layout.d_model * cb * layers * m  # one exchange of every MoE block of every micro-batch
    replay = int(layout.recompute == "full")
    _router_tp(layout, add, layers * m)
    shared = shared_expert_seconds(layout, hw) * layers * m
    if not shared:  # every exchange on the critical path
        add("ep", "all_to_all", layout.ep, one * (4 + 2 * replay), (4 + 2 * replay) * layers * m, link, None,
            rails=rails)
        return {}
    add("ep", "all_to_all", layout.ep, one * (2 + replay), (2 + replay) * layers * m, link, None, rails=rails)
    for calls, window in ((1, "shared_fwd"), (replay, "shared_replay"), (1, "shared_bwd")):
        add("ep", "all_to_all", layout.ep, one * calls, calls * layers * m, link, window, rails=rails)
    return dict(zip(SHARED_WINDOWS, (shared, shared, 2 * shared)))


def _router_tp(layout: Layout, add: Callable[..., None], blocks: int) -> None:
    """TP + EP (model/moe.py TopKRouter.tp_group): in each MoE block's forward the router sums its slot counts [E]
    (the load-balance loss) and its loss value (comms.group_mean_value) over tp, in its backward the gate's
    gradient [E, D] (comms.sum_grad_over, Megatron's f), `blocks` times per step: small and synchronous, on the
    critical path. Recompute replays the forward ones (the router runs again; neither is an op SAC saves)."""
    if not (layout.num_experts and layout.ep_over_tp):
        return
    E, gb = layout.num_experts, 2 if layout.precision == "mp" else 4  # the gate weight's (FSDP's bf16 copy)
    runs = 1 + int(layout.recompute != "none")
    fwd = [n for n, on in ((4 * E, layout.has_aux_loss), (4, layout.has_aux_loss or layout.has_z_loss)) if on]
    add("tp", "all_reduce", layout.tp, sum(fwd) * runs * blocks, len(fwd) * runs * blocks, "intra", None)
    add("tp", "all_reduce", layout.tp, E * layout.d_model * gb * blocks, blocks, "intra", None)
