"""The step-time model's cost terms against the template code they model (docs/ESTIMATION.md, "Cost terms tied to
the code").

CP's ring attention: parallel/context_parallel.py states what its blocks run on (RING_KERNEL, RING_KERNEL_DTYPE)
and the estimator quotes it (estimator/comm.py CP_RING_KERNEL, CP_RING_KERNEL_DTYPE; it cannot import torch).
These tests fail when the two disagree, when the ring's blocks stop calling a fused SDPA op in the dtype the
estimator prices, and when the ring's attention is priced above the rest of the block (the fp32-tile surcharge an
old merge brought back).

    .venv/bin/python -m pytest tests/test_cost_terms.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from curry_train.estimator import comm, estimate, layout_of, load_any, replace_layout
from curry_train.estimator.profiles import get_profile
from curry_train.model.data import cp_positions
from curry_train.parallel import context_parallel as cpm
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.timeout(300)

# the fused attention ops the ring may call (CPU: flash; CUDA: memory-efficient), forward and backward
FUSED_SDPA = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_flash_attention_for_cpu_backward",
              "_scaled_dot_product_efficient_attention_backward")
TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class _Ops(TorchDispatchMode):
    """Every attention or matmul op dispatched, with the dtypes of its first three tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if "attention" in name or name in ("mm", "bmm", "baddbmm", "matmul", "addmm"):
            self.calls.append((name, tuple(a.dtype for a in args[:3] if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_cp2():
    """A 2-rank cp group on torch's fake backend (collectives are no-ops), in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    yield dist.new_group([0, 1])
    dist.destroy_process_group()


def _ring_ops(group, dtype: torch.dtype) -> list[tuple[str, tuple[torch.dtype, ...]]]:
    """The ops one ring-attention forward + backward of rank 0 runs (GQA: 4 query heads over 2 kv heads)."""
    T, cp = 16, 2
    pos = [cp_positions(T, cp, j) for j in range(cp)]
    plans = [cpm._fused_plan(cpm.plan_blocks(pos[0], pos[s], T // (2 * cp))) for s in range(cp)]
    q = torch.randn(1, 4, T // cp, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(1, 2, T // cp, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(1, 2, T // cp, 8, dtype=dtype, requires_grad=True)
    with _Ops() as rec:
        out = cpm.RingAttention.apply(q, k, v, group, plans, 0)
        out.float().sum().backward()
    return rec.calls


def _cp_layout(dtype: str = "bfloat16"):
    return layout_of(load_any("llama3-8b", {"train.seq_len": 32768, "train.global_batch": 8, "train.dtype": dtype,
                                          "train.loss_chunks": 1, "parallel.dp": 1, "parallel.cp": 8,
                                          "parallel.zero": 3, "parallel.recompute": "full"}))


def test_the_estimator_quotes_the_rings_kernel_and_dtype():
    assert comm.CP_RING_KERNEL == cpm.RING_KERNEL
    assert comm.CP_RING_KERNEL_DTYPE == cpm.RING_KERNEL_DTYPE


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_ring_runs_a_fused_sdpa_op_in_the_dtype_the_estimator_prices(fake_cp2, dtype):
    calls = _ring_ops(fake_cp2, TORCH_DTYPE[dtype])
    priced = TORCH_DTYPE[comm.ring_attention_dtype(_cp_layout(dtype))]
    assert calls and all(name in FUSED_SDPA for name, _ in calls), calls  # no unfused score matmul
    assert {d for _, dts in calls for d in dts} == {priced}, (calls, priced)


def test_flipping_the_rings_dtype_is_seen(fake_cp2, monkeypatch):
    # the check above is live: a ring that ran its blocks in fp32 under bf16 compute would differ from the price
    monkeypatch.setattr(cpm, "RING_KERNEL_DTYPE", "float32")
    calls = _ring_ops(fake_cp2, torch.bfloat16)
    assert {d for _, dts in calls for d in dts} == {torch.float32}
    assert TORCH_DTYPE[comm.ring_attention_dtype(_cp_layout())] != torch.float32
    assert comm.CP_RING_KERNEL_DTYPE != cpm.RING_KERNEL_DTYPE


def test_ring_attention_costs_what_the_rest_of_the_block_costs():
    # CP and DP over the same ranks give each rank the same tokens and the same executed FLOPs, priced at the same
    # peak: CP's shorter kernels (s/cp keys per ring block, s/cp tokens per GEMM) run a little slower, within 25%.
    # An fp32 price for the ring (67 instead of 989 TFLOP/s on H100) would cost it several times more.
    hw = get_profile("H100")
    x_cp = _cp_layout()
    x_dp = replace_layout(x_cp, dp=8, cp=1)
    blocks_cp, _, _ = comm._stage_costs(x_cp, hw)
    blocks_dp, _, _ = comm._stage_costs(x_dp, hw)
    assert blocks_dp < blocks_cp < 1.25 * blocks_dp


def test_an_fp32_priced_ring_would_be_seen(monkeypatch):
    hw = get_profile("H100")
    x = _cp_layout()
    before = comm._stage_costs(x, hw)[0]
    monkeypatch.setattr(comm, "CP_RING_KERNEL_DTYPE", "float32")
    assert comm._stage_costs(x, hw)[0] > 1.5 * before


def test_8b_at_128k_on_one_h100_node_plans_cp_at_the_hand_formula():
    # Llama 3 8B, 32 sequences of 128k tokens (4M tokens per step, the preset's), 8 H100: the plan's final uses CP
    # and its step is within 25% of its FLOPs by hand: the linears at the GEMM ceiling, the causal attention at the
    # fused kernel's ceiling, both at the sustained clock (estimator/compute.py), over 8 GPUs
    from curry_train.advice.planner import plan

    seq, gb = 131072, 32
    p = plan("llama3-8b", 8, 1, None, seq, gb, gpu="H100")
    assert p.final["cp"] > 1, p.final
    ov = {"train.seq_len": seq, "train.global_batch": gb, "train.micro_batch": p.micro_batch,
          **{f"parallel.{k}": v for k, v in p.final.items()}}
    e = estimate(load_any("llama3-8b", ov), gpu="H100")
    from curry_train.estimator.compute import SUSTAINED_CLOCK
    from curry_train.estimator.layout import attention_flops_per_token

    hw, attn = e.hardware, attention_flops_per_token(layout_of(load_any("llama3-8b", ov)))
    peak = hw.peak_flops("bfloat16") * SUSTAINED_CLOCK
    hand = gb * seq * ((e.hardware_flops_per_token - attn) / (peak * hw.efficiency) +
                       attn / (peak * hw.attention_efficiency)) / 8
    assert e.fits and e.step_time.total_s == pytest.approx(p.final_step_time_s, rel=1e-9)
    assert abs(p.final_step_time_s / hand - 1) <= 0.25, (p.final_step_time_s, hand)


# ------------------------------------------------------------------- overlapped collectives (estimator/comm.py)


def _fsdp_items(zero: int, t_compute: float, recompute: str = "none") -> tuple[list, int]:
    """FSDP's collectives of llama3-8b on dp8 (one node, no PP) against `t_compute` seconds of compute, and the
    units they gather (fsdp_units.py)."""
    x = layout_of(load_any("llama3-8b", {"parallel.dp": 8, "parallel.zero": zero, "parallel.tp": 1,
                                         "parallel.sp": False, "parallel.recompute": recompute,
                                         "train.global_batch": 8, "train.micro_batch": 1}))
    items = [c for c in comm._comm(x, get_profile("H100"), t_compute) if c.primitive == "fsdp"]
    return items, x.n_layers + 2  # a block each, the embedding and [norm, output] (fsdp_units.py)


def test_a_hidden_collective_slows_the_compute_it_overlaps():
    """Behind ample compute a collective still costs OVERLAP_SLOWDOWN / (1 + s) of its time (Lee et al. 2025:
    compute runs 18.9% slower while NCCL's kernels hold SMs), plus its first unit of each pass in full."""
    assert comm.OVERLAP_SLOWDOWN == 0.189
    k = comm.OVERLAP_SLOWDOWN / (1 + comm.OVERLAP_SLOWDOWN)
    items, units = _fsdp_items(3, 1e4)
    assert [c.overlaps for c in items] == ["forward", "backward", "backward"]
    for c in items:
        assert c.exposed_s == pytest.approx(c.time_s * (1 / units + k * (1 - 1 / units)), rel=1e-9)


def test_forward_gathers_hide_only_behind_the_forward():
    """FSDP2 prefetches one unit ahead, so the forward's all-gathers cannot use the backward's compute: with a
    forward shorter than its gathers the excess is exposed although all of FSDP's traffic fits the whole step."""
    k = comm.OVERLAP_SLOWDOWN / (1 + comm.OVERLAP_SLOWDOWN)
    probe, _ = _fsdp_items(3, 1e4)
    ag = probe[0].time_s
    t = 1.5 * ag  # forward window t / 3 = ag / 2; the whole step (1.5 ag) holds the forward's gathers alone
    items, units = _fsdp_items(3, t)
    fwd = next(c for c in items if c.overlaps == "forward")
    assert fwd.exposed_s >= (1 - k) * ag * (1 - 1 / units) - t / 3 - 1e-12 > 0.3 * ag


@pytest.mark.parametrize("zero", [2, 3])
def test_backward_gathers_are_priced_exactly_when_fsdp_reshards_after_forward(zero):
    """The estimator prices a backward all-gather iff parallel/fsdp.py frees the unit after its forward."""
    from curry_train.parallel.fsdp import fsdp_kwargs

    cfg = load_any("llama3-8b", {"parallel.dp": 8, "parallel.zero": zero, "parallel.tp": 1, "parallel.sp": False})
    items, _ = _fsdp_items(zero, 1e4)
    backward_gathers = [c for c in items if c.collective == "all_gather" and c.overlaps == "backward"]
    assert len(backward_gathers) == int(fsdp_kwargs(cfg)["reshard_after_forward"])


def test_full_recompute_runs_its_forward_replay_in_the_backward_window():
    """Full recompute (parallel/recompute.py: torch.utils.checkpoint) reruns each block's forward inside its
    backward, so the forward is 1/4 of the compute, not 1/3: a ZeRO-2 forward gather that fits a third of the
    step is partly exposed in a quarter of it."""
    k = comm.OVERLAP_SLOWDOWN / (1 + comm.OVERLAP_SLOWDOWN)
    (ag, rs), units = [c.time_s for c in _fsdp_items(2, 1e4)[0]], _fsdp_items(2, 1e4)[1]
    t, hide = 3.0 * ag, ag * (1 - 1 / units)
    assert (1 - k) * (ag + rs) < t and (1 - k) * rs < 0.75 * t  # only the forward window binds
    none = _fsdp_items(2, t, "none")[0][0].exposed_s
    full = _fsdp_items(2, t, "full")[0][0].exposed_s
    assert none == pytest.approx(ag / units + k * hide, rel=1e-9)
    assert full == pytest.approx(ag / units + k * hide + (1 - k) * hide - t / 4, rel=1e-9) and full > none


# ------------------------------------------------------- EP's combine behind the shared expert (estimator/comm_ep.py)


def _ep_items(overrides: dict) -> tuple[list, float, int]:
    """DeepSeek-V3's EP all-to-alls on its published cluster (EP64 across nodes), the shared expert's forward
    seconds per MoE block and micro-batch, and the MoE blocks x micro-batches of the busiest pipeline rank."""
    from curry_train.estimator import comm_ep

    x = layout_of(load_any("deepseek-v3", overrides))
    hw = get_profile("H800")
    items = [c for c in comm._comm(x, hw, 1e4) if c.primitive == "ep" and c.collective == "all_to_all"]
    return items, comm_ep.shared_expert_seconds(x, hw), sum(c.calls for c in items) // (4 + 2 * (
        x.recompute == "full"))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_the_combine_hides_behind_the_shared_expert_only(recompute):
    """model/moe.py runs the shared expert while the combine all-to-all is in flight, and its backward while the
    combine's transpose is (tests/parallel/test_expert_parallel.py shows the order): per call hidden = min((1 - k) C,
    W) with W the shared expert's forward (backward: 2 W), the dispatch and its transpose exposed in full, however
    much other compute the step has (1e4 s here). Full recompute replays both exchanges, the combine again behind
    the replayed shared expert. Without the overlap every exchange would be exposed in full."""
    k = comm.OVERLAP_SLOWDOWN / (1 + comm.OVERLAP_SLOWDOWN)
    items, w, n = _ep_items({"parallel.recompute": recompute})
    replay = recompute == "full"
    by = {c.overlaps: c for c in items}
    assert sorted(by) == sorted(["none", "shared expert", "shared expert backward"]
                                + (["shared expert replay"] if replay else []))
    assert by["none"].calls == (2 + replay) * n and by["none"].exposed_s == by["none"].time_s
    C = by["shared expert"].time_s / n  # one exchange
    assert 0 < w < C  # DeepSeek-V3 over 8 nodes: the shared expert hides part of each exchange
    for words, window in (("shared expert", w), ("shared expert replay", w), ("shared expert backward", 2 * w)):
        if words in by:
            assert by[words].calls == n
            assert by[words].exposed_s == pytest.approx(n * max(k * C, C - window), rel=1e-9)
    windows = [w, 2 * w] + ([w] if replay else [])
    hidden = sum(c.time_s - c.exposed_s for c in items)
    assert hidden == pytest.approx(n * sum(min((1 - k) * C, W) for W in windows), rel=1e-9)


def test_without_a_shared_expert_every_exchange_is_exposed():
    items, w, n = _ep_items({"model.n_shared_experts": 0})
    assert w == 0 and [c.overlaps for c in items] == ["none"]
    assert items[0].calls == 6 * n and items[0].exposed_s == items[0].time_s  # full recompute: 4 + 2 replayed
