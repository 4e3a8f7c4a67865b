"""The one-GPU question: when no layout fits, what does fit on the GPU and the options beyond the ladder, each
with its memory; never a first rung the estimate says cannot fit. Each bytes-per-parameter figure of
advice/beyond.py is checked against the arithmetic its source states."""

from __future__ import annotations

import pytest
from curry_train.advice import beyond
from curry_train.advice.advisor import recommend_next
from curry_train.advice.beyond import one_gpu_answer
from curry_train.advice.planner import plan
from curry_train.advice.sweep import capacity_sweep
from curry_train.config import from_dict
from curry_train.estimator import GiB, estimate, param_count

# Llama 2 13B (Touvron et al. 2023, arXiv:2307.09288): 40 layers, d_model 5120, 40 heads (no GQA), FFN 13824
L13 = {"model": {"vocab_size": 32000, "d_model": 5120, "n_layers": 40, "n_heads": 40, "n_kv_heads": 40,
                 "d_ff": 13824},
       "train": {"seq_len": 4096, "global_batch": 8, "micro_batch": 1, "dtype": "bfloat16"},
       "parallel": {"dp": 1}, "hardware": {"device": "cuda", "gpus_per_node": 1, "nodes": 1}}


def test_each_bytes_per_parameter_figure_matches_its_source():
    assert beyond.FULL_ADAMW_B == 4 + 4 + 8  # fp32 master + fp32 grad + AdamW's two fp32 moments
    assert beyond.BF16_B == 2
    # QLoRA sec. 3, double quantization: constants cost 8/64 + 32/(64*256) = 0.127 bits per parameter
    assert (beyond.NF4_B * 8 - 4) == pytest.approx(0.127, abs=5e-4)
    # 8-bit Adam: two 8-bit states, one fp32 absmax per 2048-value block of each
    assert beyond.ADAM8BIT_B == pytest.approx(2.0039, abs=1e-4)
    # DeepSpeed estimate_zero3_model_states_mem_needs: optimizer offload GPU 2 B/param, host 16 B x 1.5; params too:
    # GPU 4 B per largest-layer parameter, host 18 B x 1.5
    assert (beyond.OFFLOAD_OPT_GPU_B, beyond.OFFLOAD_OPT_HOST_B, beyond.OFFLOAD_ALL_LAYER_B,
            beyond.OFFLOAD_ALL_HOST_B, beyond.HOST_BUFFER_FACTOR) == (2, 16, 4, 18, 1.5)


def test_a_13b_on_one_rtx4090_gets_the_options_with_numbers_and_no_rung_that_cannot_fit():
    r = recommend_next(L13, gpu="rtx4090")
    assert r.config_patch == {} and r.more_gpus_needed and r.gpu_profile == "RTX4090"
    assert "one_gpu" in r.reason
    a = r.one_gpu
    n = param_count(from_dict(L13))
    assert a is not None and a.gpu == "RTX4090" and a.params == n
    opts = {o.name.split(",")[0].split(" of ")[0]: o for o in a.options}
    assert all(o.outside_template and o.gpu_bytes > 0 for o in a.options)
    # QLoRA's base: 0.516 B/param on the linears; the 13B's model states alone are 16 B/param
    assert opts["QLoRA"].fits and opts["QLoRA"].gpu_bytes < 13 * GiB
    assert not opts["LoRA"].fits and opts["LoRA"].gpu_bytes > 2 * n  # a bf16 base alone is 24 GiB
    assert not opts["8-bit AdamW states"].fits
    cpu = [o for o in a.options if o.host_bytes]
    assert [o.host_bytes for o in cpu] == [int(16 * n * 1.5), int(18 * n * 1.5)]
    assert cpu[1].fits and not cpu[0].fits  # parameters offloaded too: only the largest layer stays on the GPU
    assert a.what_fits.max_seq_len is None and a.what_fits.model_state_bytes >= 16 * n
    lm = a.what_fits.largest_model
    assert lm is not None and 0.5e9 < lm.params < 2e9 and a.what_fits.largest_model_peak_bytes <= a.usable_bytes
    assert any("outside this template" in t for t in a.text)


def test_recompute_that_fits_is_still_the_first_rung_and_carries_no_one_gpu_answer():
    # micro-batch 64: 48 fits without recompute since bf16 on one GPU is FSDP2's policy (a bf16 stream, no
    # autocast copies: wrapping.py) and fused AdamW holds no step transient
    small = {**L13, "model": {**L13["model"], "n_layers": 2, "d_model": 1024, "n_heads": 8, "n_kv_heads": 8,
                              "d_ff": 2816}, "train": {**L13["train"], "micro_batch": 64, "global_batch": 64}}
    r = recommend_next(small, gpu="RTX4090")
    assert r.primitive == "recompute" and r.fits_after and r.one_gpu is None


def test_plan_and_capacity_sweep_say_what_would_fit():
    p = plan({"model": L13["model"]}, 1, 1, None, 4096, 8, gpu="RTX 4090")
    assert not p.fits and p.one_gpu is not None and p.one_gpu.gpu == "RTX4090"
    s = capacity_sweep(L13, {"hardware.gpu_memory_gib": 24.0})
    assert all(r.max_micro_batch is None for r in s.rungs) and s.one_gpu is not None
    lm = s.one_gpu.what_fits.largest_model
    assert lm is not None and min(m.params for m in s.family) > lm.params  # below the sweep's own family


def test_a_model_that_fits_gets_its_largest_micro_batch_and_sequence():
    cfg = {**L13, "model": {**L13["model"], "n_layers": 4}}
    a = one_gpu_answer(cfg, "A100-80")
    assert a.what_fits.max_micro_batch >= 1 and a.what_fits.max_seq_len >= 4096
    e = estimate(beyond._single(from_dict(cfg), seq_len=a.what_fits.max_seq_len, micro_batch=1), gpu="A100-80")
    assert e.memory.total <= a.usable_bytes


def test_with_more_gpus_in_the_node_zero_that_fits_comes_before_recompute_that_cannot():
    r = recommend_next(L13, overrides={"hardware.gpus_per_node": 8}, gpu="A100-80")
    assert r.primitive.startswith("zero") and r.fits_after and r.one_gpu is None
    assert any("not a rung that fits" in x for x in r.rejected)


@pytest.mark.anyio
async def test_over_mcp_a_lowercase_rtx4090_gets_the_one_gpu_answer(project, monkeypatch):
    import yaml
    from curry_train_mcp.server import mcp
    from mcp import Client

    monkeypatch.setenv("CURRY_TRAIN_ROOT", str(project))
    (project / "configs" / "llama2-13b.yaml").write_text(yaml.safe_dump(L13), encoding="utf-8")
    async with Client(mcp, raise_exceptions=True) as c:
        r = (await c.call_tool("recommend_next", {"config": "llama2-13b", "gpu": "rtx4090"})).structured_content
        p = (await c.call_tool("plan", {"model": "llama2-13b", "gpus_per_node": 1, "nodes": 1, "gpu_memory_gib": 24,
                                        "seq_len": 4096, "global_batch": 8, "gpu": "RTX 4090"})).structured_content
    assert r["gpu_profile"] == "RTX4090" and r["config_patch"] == {} and r["more_gpus_needed"]
    assert any(o["name"].startswith("QLoRA") and o["fits"] for o in r["one_gpu"]["options"])
    assert p["fits"] is False and p["one_gpu"]["gpu"] == "RTX4090"


def test_the_cli_prints_the_one_gpu_answer(tmp_path):
    import subprocess
    import sys

    import yaml

    path = tmp_path / "llama2-13b.yaml"
    path.write_text(yaml.safe_dump(L13), encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "curry_train.cli", "recommend", "--config", str(path), "--gpu",
                          "rtx4090"], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert "On one RTX4090" in out and "QLoRA" in out and "outside this template" in out and "host" in out
    assert "next: none" in out and "recompute', 'selective'" not in out.split("\n")[0]


def test_the_capacity_skill_quotes_the_bytes_per_parameter_of_the_code():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "skills" / "stage4-capacity-sweep" / "SKILL.md").read_text()
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:4]] for r in text.splitlines()
            if r.startswith("| ") and "per parameter" not in r and not r.startswith("| option")}
    assert rows["this template (full training)"][0] == f"{beyond.FULL_ADAMW_B:g}"
    assert rows["LoRA, frozen bf16 base"][0].startswith(f"{beyond.BF16_B:g} (+ {beyond.ADAPTER_B:g} ")
    assert rows["QLoRA, 4-bit NF4 base"][0].startswith(f"{beyond.NF4_B:.3f} ")
    assert rows["8-bit AdamW states"][0] == f"{beyond.FULL_ADAMW_B - 8:g} + {beyond.ADAM8BIT_B:.3f}"
    off, both = rows["CPU offload of the optimizer state"], rows["CPU offload of optimizer state and parameters"]
    assert off == [f"{beyond.OFFLOAD_OPT_GPU_B:g}", f"{beyond.OFFLOAD_OPT_HOST_B * beyond.HOST_BUFFER_FACTOR:g}"]
    assert both == [f"{beyond.OFFLOAD_ALL_LAYER_B:g} per largest-layer parameter",
                    f"{beyond.OFFLOAD_ALL_HOST_B * beyond.HOST_BUFFER_FACTOR:g}"]
    states = beyond.FULL_ADAMW_B * param_count(from_dict(L13)) / GiB
    assert f"(about {states:.0f} GiB)" in " ".join(text.split())
