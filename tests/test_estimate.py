"""The estimator: public cases, exact model-state arithmetic, schedule bookkeeping, purity and speed, and a
small estimate-vs-measurement check (the full matrix is benchmarks/estimator_accuracy.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from curry_train.config import from_dict
from curry_train.estimator import (
    bubble_fraction,
    estimate,
    estimate_memory,
    flops_per_token,
    in_flight,
    layout_of,
    load_any,
    model_states,
    param_count,
)
from curry_train.estimator.compute import from_probe, probe_gemm_tflops
from curry_train.estimator.profiles import PROFILES


def test_llama3_8b_at_dp8_zero3_holds_two_bytes_of_model_state_per_parameter():
    e = estimate_memory("llama3-8b", {"parallel.dp": 8, "parallel.zero": 3})
    # fp32 params + fp32 grads + AdamW (2 fp32 states) = 16 B/param, sharded over 8 ranks
    assert e.model_state_bytes_per_param == pytest.approx(2.0, rel=1e-3)
    assert 8.0e9 < e.param_count < 8.1e9


def test_ddp_holds_sixteen_bytes_per_parameter_plus_a_bucket_copy_of_the_gradients():
    # float32: DDP (bf16's ZeRO-0 is FSDP2 replicas of one shard, wrapping.py, with no buckets)
    e = estimate_memory("llama3-8b", {"parallel.zero": 0, "parallel.recompute": "none", "train.dtype": "float32"})
    assert e.model_state_bytes_per_param == pytest.approx(16.0, rel=1e-6)
    assert e.memory.detail["ddp_buckets"] == 4 * e.param_count  # the buckets hold the grads (bucket views)
    assert e.memory.grads == 4 * e.param_count  # no second copy (gradient_as_bucket_view=True)
    assert not e.fits


def test_model_states_of_one_device_are_sixteen_bytes_per_parameter_exactly():
    cfg = load_any("tiny")
    n = param_count(cfg)
    st = model_states(cfg)
    assert st["params"] == 4 * n and st["grads"] == 4 * n
    n_tensors = 4 * 9 + 3  # 9 per block, embedding, final norm, head
    assert st["optimizer"] == 8 * n + 4 * n_tensors  # AdamW exp_avg + exp_avg_sq, and a CPU `step` per tensor


def test_zero_stages_shard_what_the_zero_paper_says():
    base = {"parallel.dp": 4, "train.global_batch": 8}
    s = [model_states(load_any("tiny", {**base, "parallel.zero": z})) for z in range(4)]
    n = param_count(load_any("tiny"))
    assert s[1]["optimizer"] < s[0]["optimizer"] / 3  # greedy whole-tensor partition: ~1/4
    assert s[1]["grads"] == s[0]["grads"] == 4 * n
    assert s[2]["grads"] < s[1]["grads"] / 3
    assert s[3]["params"] == s[2]["params"] < s[1]["params"] / 3  # FSDP2 shards params in both (2 keeps copies)


def test_fsdp_pads_a_dim0_split_like_fsdp2():
    # 4 experts over 8 ranks: each rank holds one padded row of every expert tensor, not half a row
    cfg = load_any("tiny-moe", {"parallel.dp": 8, "parallel.zero": 3, "train.global_batch": 16,
                                "hardware.gpus_per_node": 8})
    st = model_states(cfg)
    expert_rows = 4 * 3 * (64 * 128)  # 4 layers x (w1, w3, w2) x one expert's [D, F]
    assert st["params"] >= 4 * expert_rows


def test_recompute_and_tp_lower_the_activation_peak():
    none = estimate_memory("tiny", {"train.micro_batch": 8})
    full = estimate_memory("tiny", {"train.micro_batch": 8, "parallel.recompute": "full"})
    sel = estimate_memory("tiny", {"train.micro_batch": 8, "parallel.recompute": "selective"})
    assert full.memory.total < sel.memory.total < none.memory.total
    tp = estimate_memory("tiny", {"train.micro_batch": 8, "parallel.tp": 2, "parallel.sp": True})
    assert tp.memory.total < none.memory.total
    assert tp.params_per_rank < none.params_per_rank


def test_pipeline_schedules_hold_the_textbook_number_of_micro_batches():
    def held(schedule: str, v: int = 1, gb: int = 16) -> list[int]:
        x = layout_of(load_any("tiny", {"parallel.pp": 4, "parallel.pp_schedule": schedule, "parallel.pp_virtual": v,
                                      "train.global_batch": gb, "train.micro_batch": 1}))
        return [in_flight(x, r)[1] for r in range(4)]

    assert held("gpipe") == [16, 16, 16, 16]  # all forwards, then all backwards
    assert held("1f1b") == [4, 3, 2, 1]  # stage r warms up p - r micro-batches
    # interleaved (torch's _get_warmup_ops): rank 0 holds (v-1) p + 2 (p-1) + 1 chunk-micro-batches
    x = layout_of(load_any("tiny", {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b",
                                  "parallel.pp_virtual": 2, "train.global_batch": 8, "train.micro_batch": 1}))
    assert in_flight(x, 0)[1] == (2 - 1) * 2 + 2 * (2 - 1) + 1


def test_bubble_fraction_is_p_minus_one_over_m_divided_by_v_when_interleaved():
    x = layout_of(load_any("tiny", {"parallel.pp": 4, "train.global_batch": 16, "train.micro_batch": 1}))
    assert bubble_fraction(x) == pytest.approx(3 / 16)
    x = layout_of(load_any("tiny", {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b",
                                  "parallel.pp_virtual": 2, "train.global_batch": 8, "train.micro_batch": 1}))
    assert bubble_fraction(x) == pytest.approx(1 / (2 * 8))


def test_first_pipeline_stage_carries_the_embedding_and_the_last_the_head():
    e = estimate_memory("llama3-405b")
    first, last = e.per_pp_rank[0], e.per_pp_rank[-1]
    assert first.detail.get("pp_recv_buffers") and last.detail.get("pp_recv_buffers")
    assert len(e.per_pp_rank) == 9


def test_flops_per_token_count_causal_attention_at_half():
    cfg = load_any("llama3-8b")
    m = cfg.model
    n_active = m.n_layers * (2 * m.d_model * m.d_model + 2 * m.d_model * m.n_kv_heads * (m.d_model // m.n_heads)
                             + 3 * m.d_model * m.d_ff) + m.vocab_size * m.d_model
    # the MFU convention (layout.MFU_CONVENTION): 6 N + 6 L H Dh s, the causal half PaLM's 12 L H Dh s doubles
    assert flops_per_token(cfg) == pytest.approx(6 * n_active + 6 * m.n_layers * m.d_model * cfg.train.seq_len)


def test_mfu_and_hfu_are_both_reported_with_their_convention():
    # full recompute executes one more forward of the blocks: HFU counts it, MFU does not
    st = estimate_memory("llama3-8b", {"parallel.recompute": "full"}).step_time
    assert st.hfu > st.mfu > 0 and "causal" in st.mfu_convention and "recompute" in st.mfu_convention


def test_communication_counts_the_implementations_collectives():
    e = estimate_memory("tiny", {"parallel.dp": 2})
    dp = [c for c in e.communication if c.primitive == "dp"]
    assert dp and dp[0].bytes == 4 * param_count(load_any("tiny"))  # fp32 gradients all-reduced once a step
    e = estimate_memory("tiny", {"parallel.tp": 2})
    tp = next(c for c in e.communication if c.primitive == "tp")
    assert tp.calls == 4 * 4 * 4  # 4 all-reduces per layer per micro-batch, 4 layers, 4 micro-batches
    e = estimate_memory("llama3-70b")
    assert {c.link for c in e.communication if c.primitive == "fsdp"} == {"inter"}
    assert {c.link for c in e.communication if c.primitive == "tp"} == {"intra"}


def test_a_probe_overrides_the_profile():
    base = PROFILES["H100"]
    got = from_probe(base, {"gpus": [{"name": "NVIDIA H200", "memory_bytes": 141 * 10**9}],
                            "measured": {"matmul_tflops": [600.0], "matmul_dtype": "bfloat16",
                                         "allreduce_busbw_gbps": 300.0}})
    assert got.name == "H200" and got.intra_node_gbps == 300.0 and got.source == "probe"
    # 600 TFLOP/s against the 748.8 the H200 row predicts for the probe's 8192^3 burst scales its MAMF ceiling
    h200 = PROFILES["H200"]
    assert got.efficiency == pytest.approx(h200.efficiency * 600 / probe_gemm_tflops(h200, 8192, "bfloat16"))
    e = estimate(load_any("llama3-8b"), probe={"efficiency": 0.3})
    assert e.hardware.efficiency == 0.3


def _probed(tflops: float, n: int = 8192) -> dict:
    """A probe report as measure/hardware.py writes it, with a made-up GEMM figure (no timing involved)."""
    return {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85520809984}],
            "measured": {"matmul_tflops": [tflops, tflops * 1.1], "matmul_dtype": "bfloat16", "matmul_size": n}}


def test_a_probe_scales_the_datasheet_by_measured_over_predicted_gemm_throughput():
    h100, cfg = PROFILES["H100"], load_any("llama3-8b")
    predicted = probe_gemm_tflops(h100, 8192, "bfloat16")  # the H100 row's own figure for the probe's GEMM
    # the ceiling, lowered by the square GEMM's traffic: the fraction the old replacement took (docs/ESTIMATION.md)
    assert predicted / h100.peak_tflops_bf16 == pytest.approx(0.739, abs=5e-4) and 0.739 < h100.efficiency
    same = from_probe(h100, _probed(predicted))  # a GPU exactly as its datasheet: nothing changes
    assert same.efficiency == pytest.approx(h100.efficiency) and same.source == "probe"
    assert same.attention_efficiency == pytest.approx(h100.attention_efficiency)
    ref = estimate(cfg, hardware="H100").step_time
    assert estimate(cfg, hardware="H100", probe=_probed(predicted)).step_time.compute_s == pytest.approx(ref.compute_s)
    slow = from_probe(h100, _probed(0.8 * predicted))  # the slowest rank is 20% short: every kernel is
    assert slow.efficiency == pytest.approx(0.8 * h100.efficiency)
    assert slow.attention_efficiency == pytest.approx(0.8 * h100.attention_efficiency)
    got = estimate(cfg, hardware="H100", probe=_probed(0.8 * predicted)).step_time
    assert ref.compute_s < got.compute_s < ref.compute_s / 0.8 + 1e-9  # element-wise passes are memory-bound
    # A smaller probe GEMM is compared with the model's figure for that size, not with the large one's
    small = from_probe(h100, _probed(probe_gemm_tflops(h100, 1024, "bfloat16"), n=1024))
    assert small.efficiency == pytest.approx(h100.efficiency)


def test_every_preset_validates_and_estimates():  # its speed: benchmarks/planner_speed.py
    for name in ("llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b", "mixtral-8x7b"):
        cfg = load_any(name)
        e = estimate(cfg)
        assert e.memory.total > 0 and e.step_time.total_s > 0
    assert 4.0e11 < param_count(load_any("llama3-405b")) < 4.1e11
    assert 1.74e11 < param_count(load_any("gpt3-175b")) < 1.76e11
    assert 4.6e10 < param_count(load_any("mixtral-8x7b")) < 4.8e10


def test_the_estimator_never_imports_torch():
    code = ("import sys, curry_train.estimator, curry_train.advice.advisor, curry_train.advice.planner, "
            "curry_train.advice.sweep; "
            "from curry_train.advice.planner import plan; plan('llama3-8b', 8, 1, 80.0, 8192, 512); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_estimate_prints_one_json_object(capsys):
    from curry_train.cli import main

    assert main(["estimate", "--config", "tiny", "--set", "parallel.dp=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory"]["total"] > 0 and out["param_count"] == param_count(load_any("tiny"))
    assert main(["estimate", "--config", "tiny", "--set", "parallel.dp=3", "--json"]) == 2  # invalid: 8 % 6


@pytest.mark.multirank
def test_estimate_matches_measurement_on_tiny_layouts():
    """Looser than the benchmark's goal (3%): 5% on the total, model states exact."""
    from curry_train.measure.memory import memory_spec
    from curry_train.train.jobs import rank_jobs
    from curry_train.train.launch import launch_forkserver

    cases = {2: [{"parallel.dp": 2, "parallel.zero": 3}, {"parallel.dp": 2}, {"parallel.tp": 2}],
             1: [{}, {"parallel.recompute": "full"}]}
    for world, overrides in cases.items():
        cfgs = [from_dict(load_any("tiny").to_dict(), ov) for ov in overrides]
        specs = [memory_spec(c) for c in cfgs]
        per_rank = launch_forkserver(rank_jobs, world, specs, timeout=300)
        for i, cfg in enumerate(cfgs):
            reports = [per_rank[r][i] for r in range(world)]
            worst = max(reports, key=lambda rep: rep["peak"])
            est = estimate(cfg)
            states = model_states(cfg)
            assert worst["params"] == states["params"] and worst["optimizer"] == states["optimizer"]
            assert worst["grads"] == states["grads"]
            assert est.memory.total == pytest.approx(worst["peak"], rel=0.05), overrides[i]


def _fsdp_comm(cfg) -> dict[str, tuple[int, int]]:
    """collective -> (calls, bytes) of FSDP's own collectives per step."""
    return {c.collective: (c.calls, c.bytes) for c in estimate(cfg).communication if c.primitive == "fsdp"}


def test_megatrons_distributed_optimizer_and_kept_units_are_modelled():
    base = {"parallel.dp": 2, "parallel.tp": 2, "parallel.sp": True, "train.micro_batch": 1}  # 4 micro-batches
    z1, z2 = load_any("tiny", {**base, "parallel.zero": 1}), load_any("tiny", {**base, "parallel.zero": 2})
    keep = load_any("tiny", {**base, "parallel.zero": 2, "parallel.fsdp_keep_gathered": True})
    n_units = 4 + 2  # a block each, the embedding and [norm, output] (fsdp_units.py)
    # ZeRO-1 on FSDP2: one all-gather and one reduce-scatter per step (Megatron: the volume of one all-reduce);
    # zero 2 gathers and reduces every micro-batch; kept units gather once and still reduce every micro-batch
    assert [_fsdp_comm(c)["all_gather"][0] for c in (z1, z2, keep)] == [n_units, 4 * n_units, n_units]
    # (zero 2: the chunked loss reduce-scatters the [norm, output] unit twice per backward, estimator/comm.py)
    assert [_fsdp_comm(c)["reduce_scatter"][0] for c in (z1, z2, keep)] == [n_units, 4 * (n_units + 1), 4 * n_units]
    assert _fsdp_comm(z1)["all_gather"][1] == _fsdp_comm(z2)["all_gather"][1] // 4
    # memory: the same sharded states, but ZeRO-1 holds every unsharded fp32 gradient across the step
    e1, e2 = estimate(z1), estimate(z2)
    assert e1.model_state_bytes == e2.model_state_bytes
    # (filed as grad_buffers by breakdown.py's contract: FSDP's unsharded accumulators)
    held1, held2 = (e.memory.grads + e.memory.grad_buffers for e in (e1, e2))
    assert held1 - held2 >= 4 * e1.params_per_rank  # full accumulators vs shards
    # under PP the schedule holds the units and reduces once for zero 1 and 2 alike: one layout (the planner
    # searches zero 1 only there, advice/search.py)
    pp = {"parallel.dp": 2, "parallel.tp": 2, "parallel.pp": 2, "train.global_batch": 16}
    assert estimate(load_any("tiny", {**pp, "parallel.zero": 1})).model_dump() == \
        estimate(load_any("tiny", {**pp, "parallel.zero": 2})).model_dump()
