"""The estimator's hardware profiles and its time model: named GPUs set budget and speed, collectives on one link
share it and the compute they hide behind, FSDP/HSDP traffic, the pipeline follows its slowest stage and the
bubble comes from the schedule's simulated action order."""

from __future__ import annotations

import pytest
from curry_train.estimator import estimate, estimate_memory, layout_of, load_any, replace_layout
from curry_train.estimator.comm import _comm, _step_time
from curry_train.estimator.makespan import bubble_ratio, simulate_makespan, simulated_bubble
from curry_train.estimator.pipeline import bubble_fraction
from curry_train.estimator.profiles import (
    GPU_NAMES,
    PROFILES,
    UnknownGpu,
    check_cluster,
    get_profile,
    gpu_budget,
    resolve_gpu,
)

# ----------------------------------------------------------------------------------------------- profiles


def test_every_named_gpu_has_a_budget_a_speed_and_a_source():
    assert set(GPU_NAMES) == {"RTX4090", "RTX3090", "A6000", "L4", "A10", "A10G", "V100-16", "V100-32", "A100-40",
                              "A100-80", "A100-40-PCIe", "A100-80-PCIe", "H100", "H100-PCIe", "H100-NVL", "H800",
                              "H200", "B200", "GB200", "MI250X", "MI300X", "L40S", "M2-Ultra", "CPU"}
    for name, p in PROFILES.items():
        assert p.memory_gib > 0 and p.peak_tflops_bf16 > 0 and p.mem_bw_gbps > 0 and p.gpus_per_node >= 1
        assert p.intra_node_gbps >= p.inter_node_gbps > 0 and p.reference, name


def test_an_unknown_gpu_names_the_field_and_lists_the_valid_names():
    with pytest.raises(UnknownGpu) as err:
        get_profile("V100")
    msg = str(err.value)
    assert msg.startswith("gpu:") and "V100" in msg and all(n in msg for n in GPU_NAMES)
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    with pytest.raises(UnknownGpu):
        estimate_memory("tiny", gpu="TPUv5")


def test_a_named_gpu_sets_the_budget_and_the_speed():
    a40 = estimate_memory("llama3-70b", gpu="A100-40")
    a80 = estimate_memory("llama3-70b", gpu="A100-80")
    h100 = estimate_memory("llama3-70b", gpu="H100")
    assert a40.budget_bytes == 40 * 2**30 and a80.budget_bytes == 80 * 2**30
    assert a40.memory.total == a80.memory.total  # same layout, same bytes; only the budget differs
    # same peak; the element-wise passes run at HBM bandwidth (1,555 vs 2,039 GB/s): A100-40 a little slower
    assert a80.step_time.total_s < a40.step_time.total_s < 1.15 * a80.step_time.total_s
    assert a80.step_time.total_s > 2 * h100.step_time.total_s  # 312 vs 989 TFLOP/s
    assert a80.gpu_profile == "A100-80" and "A100-80" in a80.hardware_note


def test_memory_alone_never_silently_picks_a_speed():
    e = estimate_memory("llama3-70b")
    assert e.gpu_profile == "H100" and "ASSUMED" in e.hardware_note and "gpu" in e.hardware_note
    prof, mem, why = resolve_gpu(None, 80.0)
    assert prof.name == "H100" and mem == 80.0 and "ASSUMED" in why
    prof, mem, why = resolve_gpu("A100-80", 70.0)
    assert prof.name == "A100-80" and mem == 70.0 and "70" in why
    assert gpu_budget("A100-40", 80.0) == ("A100-40", 40.0)  # a gpu's memory caps a larger budget
    assert gpu_budget(None, 80.0, "H100") == ("H100", 80.0)


@pytest.mark.parametrize("field,kw", [("gpus_per_node", {"gpus_per_node": 0}), ("nodes", {"nodes": -1}),
                                      ("seq_len", {"seq_len": 0}), ("micro_batch", {"micro_batch": 0})])
def test_bad_cluster_inputs_name_the_field_and_the_fix(field, kw):
    with pytest.raises(ValueError) as err:
        check_cluster(**kw)
    assert f"{field}=" in str(err.value) and "must be" in str(err.value)
    check_cluster(gpus_per_node=8, nodes=2, seq_len=4096, gpu_memory_gib=80.0, global_batch=64, micro_batch=1)


# ----------------------------------------------------------------------------------------------- communication


def test_collectives_on_one_link_share_the_compute_they_hide_behind():
    """Llama 3 70B, dp32 ZeRO-3 on 32 one-GPU nodes (every rank on its own NIC): the all-gathers and the
    reduce-scatters over the network each fit behind the compute alone, together they do not: exposed >= link
    time - compute."""
    e = estimate_memory("llama3-70b", {"parallel.dp": 32, "parallel.tp": 1, "parallel.sp": False,
                                       "hardware.gpus_per_node": 1, "hardware.nodes": 32})
    fsdp = [c for c in e.communication if c.primitive == "fsdp"]
    link = sum(c.time_s for c in fsdp)
    assert all(c.link == "inter" and c.time_s < e.step_time.compute_s for c in fsdp)
    assert link > e.step_time.compute_s
    assert e.step_time.comm_exposed_s >= link - e.step_time.compute_s
    assert e.step_time.total_s >= e.step_time.compute_s + (link - e.step_time.compute_s)


def test_tp_collectives_sit_on_the_critical_path():
    e = estimate_memory("llama3-70b")
    for c in e.communication:
        if c.primitive == "tp":
            assert c.exposed_s == pytest.approx(c.time_s) and c.overlaps == "none"


def test_fsdp_regathers_every_micro_batch_and_hsdp_adds_a_replica_all_reduce():
    x = layout_of(load_any("llama3-70b", {"parallel.dp": 32, "parallel.tp": 1, "parallel.sp": False}))
    hw = PROFILES["H100"]
    one = {(c.collective): c for c in _comm(replace_layout(x, global_batch=32), hw, 100.0)}
    four = {(c.collective): c for c in _comm(replace_layout(x, global_batch=128), hw, 400.0)}
    assert four["all_gather"].bytes == 4 * one["all_gather"].bytes  # m = 4 re-gathers (ZeRO-3: fwd + bwd)
    assert four["reduce_scatter"].bytes == 4 * one["reduce_scatter"].bytes
    hs = {c.collective: c for c in _comm(replace_layout(x, dp_replicate=4), hw, 400.0)}
    assert hs["all_gather"].group_size == 8 and hs["all_gather"].link == "intra"  # shard group inside a node
    assert hs["all_reduce"].group_size == 4 and hs["all_reduce"].link == "inter"
    assert hs["all_reduce"].bytes * 8 == hs["reduce_scatter"].bytes  # the reduced shard crosses the replicas


# ----------------------------------------------------------------------------------------------- pipeline


@pytest.mark.parametrize("sched,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16), (4, 64)])
def test_the_simulated_bubble_equals_the_closed_form_where_one_holds(sched, v, p, m):
    x = replace_layout(layout_of(load_any("tiny")), pp=p, pp_schedule=sched, pp_virtual=v, global_batch=m,
                       micro_batch=1, dp=1, n_layers=16)
    assert simulated_bubble(x) == pytest.approx((p - 1) / (v * m), rel=1e-6)
    assert bubble_ratio(x) == pytest.approx(simulated_bubble(x), rel=1e-6)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
def test_zero_bubble_equals_a_third_of_the_interleaved_bubble_from_two_rounds_on(p):
    x0 = replace_layout(layout_of(load_any("tiny")), pp=p, pp_schedule="zero_bubble", pp_virtual=2,
                        micro_batch=1, dp=1, n_layers=4 * p)
    for m in range(2 * p, 5 * p + 1):
        x = replace_layout(x0, global_batch=m)
        assert simulated_bubble(x) == pytest.approx((p - 1) / (3 * 2 * m), rel=1e-9)
        assert bubble_ratio(x) == pytest.approx(simulated_bubble(x), rel=1e-9)
    short = replace_layout(x0, global_batch=p)
    assert simulated_bubble(short) > 1.5 * bubble_fraction(short)  # m < 2p: more


@pytest.mark.parametrize("p,m,idle", [(2, 4, 0.040), (2, 8, 0.020), (4, 4, 0.200), (4, 8, 0.059)])
def test_zero_bubble_follows_torchs_action_order(p, m, idle):
    """The idle fractions benchmarks/pipeline_bubble.py simulates from torch's own ZBV order (BENCHMARKS.md);
    at m < 2p - 1 the textbook (p-1)/(3 v m) is half of it."""
    x = replace_layout(layout_of(load_any("tiny")), pp=p, pp_schedule="zero_bubble", pp_virtual=2,
                       global_batch=m, micro_batch=1, dp=1, n_layers=16)
    r = bubble_ratio(x)
    assert r / (1 + r) == pytest.approx(idle, abs=1e-3)
    if m < 2 * p - 1:
        assert r > 1.9 * bubble_fraction(x)


def test_a_long_schedule_is_extrapolated_from_its_period():
    one = (1 / 3, 1 / 3, 1 / 3)
    for sched, v in (("1f1b", 1), ("zero_bubble", 2)):
        cost = (tuple(c / v for c in one),) * (4 * v)
        long, _ = simulate_makespan(sched, 4, v, 64, cost)
        # the schedule is periodic: 64 micro-batches cost the 8-micro-batch step plus 56 more units of work
        short, _ = simulate_makespan(sched, 4, v, 8, cost)
        assert long == pytest.approx(short + 56, rel=1e-6)


def test_pipeline_step_follows_the_slowest_stage_with_the_head():
    cfg = load_any("gpt3-175b", {"parallel.pp_schedule": "1f1b", "parallel.pp_virtual": 1})
    st, _ = _step_time(layout_of(cfg), PROFILES["A100-80"])
    assert len(st.stage_compute_s) == 16
    assert st.stage_compute_s[-1] > st.stage_compute_s[1]  # LM head + loss on the last stage
    assert st.compute_s == max(st.stage_compute_s)
    m = cfg.num_microbatches
    avg = sum(st.stage_compute_s) / 16
    assert st.compute_s + st.bubble_s == pytest.approx(max(st.stage_compute_s) + (16 - 1) / m * avg)


def test_every_estimate_names_its_profile():
    e = estimate(load_any("tiny"))
    assert e.gpu_profile == e.hardware.name and e.hardware_note


def test_the_chunked_loss_recomputes_the_head_forward_and_docs_quote_its_cost():
    """model/gpt.py chunked_lm_loss reruns each chunk's head matmul in backward: +2VD FLOPs per token."""
    from pathlib import Path

    from curry_train.estimator.layout import hardware_flops_per_token

    x = layout_of(load_any("llama3-8b"))
    unchunked = replace_layout(x, loss_chunks=1)
    assert hardware_flops_per_token(x) - hardware_flops_per_token(unchunked) == 2.0 * x.vocab_size * x.d_model
    one, auto = (estimate(load_any("llama3-8b", {"train.loss_chunks": k})).step_time for k in (1, 0))
    text = " ".join((Path(__file__).parents[1] / "docs" / "ESTIMATION.md").read_text(encoding="utf-8").split())
    quoted = (f"+{100 * (auto.total_s / one.total_s - 1):.1f}% of the step at the llama3-8b preset, "
              f"{one.total_s:.1f} s → {auto.total_s:.1f} s, MFU {100 * one.mfu:.1f}% → {100 * auto.mfu:.1f}%")
    assert quoted in text, quoted
