"""The calibrated step-time model (estimator/compute.py, docs/ESTIMATION.md "Compute time"): GEMM efficiency by
shape, attention by block, element-wise bytes, the inter-node bandwidth of a group by its ranks per node, and the
published runs it is held to (benchmarks/published_throughput.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from curry_train.estimator import comm, compute, estimate_memory, get_profile, layout_of, load_any, replace_layout

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("published_throughput", REPO / "benchmarks" /
                                                  "published_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_tp_split_layer_and_a_short_micro_batch_run_below_a_large_gemm():
    hw = get_profile("A100-80")
    x = layout_of(load_any("megatron-18b", {"parallel.tp": 1, "parallel.sp": False, "parallel.dp": 256,
                                            "parallel.zero": 0}))
    whole = compute.linear_efficiency(x, hw)
    split = compute.linear_efficiency(replace_layout(x, tp=8, sp=True), hw)
    short = compute.linear_efficiency(replace_layout(x, seq_len=128), hw)
    assert split < whole <= hw.efficiency * compute.SUSTAINED_CLOCK
    assert short < split


def test_attention_runs_nearer_its_plateau_on_longer_blocks():
    hw = get_profile("H100")
    x = layout_of(load_any("llama3-8b"))
    assert compute.attention_efficiency(replace_layout(x, seq_len=1024), hw) < compute.attention_efficiency(x, hw)
    # CP's ring sees seq_len / cp keys per block
    assert compute.attention_efficiency(replace_layout(x, cp=8), hw) == pytest.approx(
        compute.attention_efficiency(replace_layout(x, seq_len=x.seq_len // 8), hw))


def test_elementwise_time_scales_with_memory_bandwidth_not_peak():
    x = layout_of(load_any("llama3-8b"))
    hw = get_profile("H100")
    slow_hbm = hw.model_copy(update={"mem_bw_gbps": hw.mem_bw_gbps / 2})
    b_fast, b_slow = comm._stage_costs(x, hw)[0], comm._stage_costs(x, slow_hbm)[0]
    elem = x.global_batch * x.seq_len / (x.dp * x.cp) * x.n_layers * compute.elementwise_bytes(x) / \
        (hw.mem_bw_gbps * 1e9)
    assert b_slow - b_fast >= elem  # at least the element-wise passes take twice as long


def test_dp_over_whole_nodes_crosses_on_every_nic():
    # DP 32 over 4 nodes of 8: 8 ranks per node, each on its own NIC; at stride TP 8 one rank per node per group
    whole = estimate_memory("megatron-1.7b", gpu="A100-80")
    dp = next(c for c in whole.communication if c.primitive == "dp")
    one_rail = comm._coll_time(whole.hardware, "all_reduce", 32, dp.bytes, dp.calls, "inter", 1)[1]
    assert dp.link == "inter" and dp.time_s < one_rail / 2  # 8 NICs for the bytes (the latency stays)


def test_the_published_runs_are_within_15_percent_and_the_doc_quotes_them():
    mod = _bench()
    rows = [mod.run_row(*r) for r in mod.ROWS]
    assert len(rows) >= 16 and all(r["fits"] for r in rows)
    worst = max(rows, key=lambda r: abs(r["rel_error"]))
    assert abs(worst["rel_error"]) <= 0.15, (worst["row"], worst["rel_error"])
    doc = (REPO / "docs" / "ESTIMATION.md").read_text(encoding="utf-8")
    missing = [mod.markdown_row(r) for r in rows if mod.markdown_row(r) not in doc]
    assert not missing, "docs/ESTIMATION.md table out of date (benchmarks/published_throughput.py --markdown):\n" + \
        "\n".join(missing)


def test_the_benchmark_prints_every_row_and_a_json_line(capsys):
    _bench().main([])
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert last["rows"] >= 16 and last["worst_rel_error"] <= 0.15
    prefixes = ("megatron-", "bloom", "opt", "mt-nlg", "fsdp-", "titan-")
    assert sum(line.startswith(prefixes) for line in out) == last["rows"]
    assert all(("eq3" in line) or ("tokens" in line) for line in out[1:-1])  # each row states its convention
