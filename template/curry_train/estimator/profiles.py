"""Hardware profiles for the estimator: peak FLOP/s, memory bandwidth, collective bandwidth and latency per link.

    python -c "from curry_train.estimator.profiles import PROFILES; print(sorted(PROFILES))"

Numbers are vendor datasheet peaks (dense, no sparsity) and typical nccl-tests bus bandwidths; a probe result
(`curry-train probe --measure --json`, curry_train.measure.hardware.HardwareReport) overrides them through `from_probe`.
  A100 SXM4: 312 TFLOP/s bf16, 19.5 fp32 (no TF32: torch's default matmul precision is "highest"),
             1.56 / 2.04 TB/s HBM (40 / 80 GB); NVLink3 600 GB/s bidirectional -> ~230 GB/s all-reduce busbw;
             HDR 200 Gb/s per GPU across nodes -> ~23 GB/s.
  H100 SXM5: 989 TFLOP/s bf16, 67 fp32; 3.35 TB/s HBM3; NVLink4 900 GB/s -> ~360 GB/s busbw; NDR 400 Gb/s per
             GPU -> ~45 GB/s (NVIDIA/nccl-tests doc/PERFORMANCE.md defines busbw).
  H200 SXM:  H100 compute, 141 GB HBM3e at 4.8 TB/s.
  CPU:       a gloo-over-loopback development box; only good for exercising the code path.
`efficiency` is the fraction of peak a well-shaped GEMM-dominated step reaches (MFU 0.3-0.5 is typical:
torchtitan reports 33-39% for Llama 3 8B on H100, Megatron-LM up to 47%).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class HardwareProfile(BaseModel):
    """One accelerator type and its links, as the step-time model uses them."""

    name: str
    memory_gib: float = Field(description="Device memory (GiB).")
    peak_tflops_bf16: float = Field(description="Dense bf16 peak, TFLOP/s.")
    peak_tflops_fp32: float = Field(description="Dense fp32 peak (no TF32), TFLOP/s.")
    mem_bw_gbps: float = Field(description="Device memory bandwidth, GB/s (optimizer step is memory-bound).")
    intra_node_gbps: float = Field(description="All-reduce bus bandwidth inside a node, GB/s.")
    inter_node_gbps: float = Field(description="Bus bandwidth per GPU across nodes, GB/s.")
    alpha_intra_us: float = Field(description="Per-hop latency inside a node, microseconds.")
    alpha_inter_us: float = Field(description="Per-hop latency across nodes, microseconds.")
    efficiency: float = Field(0.45, description="Achieved fraction of peak FLOP/s for the model's GEMMs.")
    source: str = Field("datasheet", description="datasheet, or probe when measured numbers replaced it.")

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for the compute dtype ('bfloat16' or 'float32')."""
        return (self.peak_tflops_bf16 if dtype == "bfloat16" else self.peak_tflops_fp32) * 1e12


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile(name="A100-40", memory_gib=40, peak_tflops_bf16=312, peak_tflops_fp32=19.5, mem_bw_gbps=1555,
                        intra_node_gbps=230, inter_node_gbps=23, alpha_intra_us=8, alpha_inter_us=15),
        HardwareProfile(name="A100-80", memory_gib=80, peak_tflops_bf16=312, peak_tflops_fp32=19.5, mem_bw_gbps=2039,
                        intra_node_gbps=230, inter_node_gbps=23, alpha_intra_us=8, alpha_inter_us=15),
        HardwareProfile(name="H100", memory_gib=80, peak_tflops_bf16=989, peak_tflops_fp32=67, mem_bw_gbps=3350,
                        intra_node_gbps=360, inter_node_gbps=45, alpha_intra_us=6, alpha_inter_us=12),
        HardwareProfile(name="H200", memory_gib=141, peak_tflops_bf16=989, peak_tflops_fp32=67, mem_bw_gbps=4800,
                        intra_node_gbps=360, inter_node_gbps=45, alpha_intra_us=6, alpha_inter_us=12),
        HardwareProfile(name="CPU", memory_gib=16, peak_tflops_bf16=0.2, peak_tflops_fp32=0.2, mem_bw_gbps=20,
                        intra_node_gbps=2, inter_node_gbps=1, alpha_intra_us=50, alpha_inter_us=100,
                        efficiency=0.5),
    )
}

_ALIASES = {"a100": "A100-80", "a100-40gb": "A100-40", "a100-80gb": "A100-80", "a100-sxm4-40gb": "A100-40",
            "a100-sxm4-80gb": "A100-80", "h100": "H100", "h100-80gb": "H100", "h100-sxm": "H100", "h200": "H200",
            "cpu": "CPU"}


def get_profile(name: str) -> HardwareProfile:
    """A profile by name (A100-40, A100-80, H100, H200, CPU; case-insensitive, a few aliases)."""
    key = name.strip()
    if key in PROFILES:
        return PROFILES[key]
    low = key.lower()
    for cand, prof in PROFILES.items():
        if cand.lower() == low:
            return prof
    if low in _ALIASES:
        return PROFILES[_ALIASES[low]]
    raise KeyError(f"unknown hardware profile {name!r}; known: {', '.join(PROFILES)}")


def guess_profile(device: str, gpu_memory_gib: float) -> HardwareProfile:
    """The profile a config most likely means: CPU for device=cpu, else by memory size (40 -> A100-40,
    <= 96 -> H100, larger -> H200). Name the profile explicitly when the guess is wrong (A100-80 vs H100)."""
    if device == "cpu":
        return PROFILES["CPU"]
    if gpu_memory_gib <= 48:
        return PROFILES["A100-40"]
    if gpu_memory_gib <= 96:
        return PROFILES["H100"]
    return PROFILES["H200"]


def from_device_name(device_name: str) -> HardwareProfile | None:
    """Match an NVML / torch device name ('NVIDIA H100 80GB HBM3') to a profile; None when unknown."""
    low = device_name.lower()
    if "h200" in low:
        return PROFILES["H200"]
    if "h100" in low or "h800" in low:
        return PROFILES["H100"]
    if "a100" in low or "a800" in low:
        return PROFILES["A100-40"] if "40" in low else PROFILES["A100-80"]
    if low in ("", "cpu"):
        return PROFILES["CPU"]
    return None


def from_probe(base: HardwareProfile, probe: dict[str, Any] | None) -> HardwareProfile:
    """Override `base` with what a probe measured. Accepts a HardwareReport dict (gpus, measured.matmul_tflops,
    measured.allreduce_busbw_gbps) or flat keys named like HardwareProfile's fields."""
    if not probe:
        return base
    data = base.model_dump()
    gpus = probe.get("gpus") or []
    if gpus and isinstance(gpus[0], dict):
        named = from_device_name(str(gpus[0].get("name", "")))
        if named is not None:
            data.update(named.model_dump())
        if gpus[0].get("memory_bytes"):
            data["memory_gib"] = gpus[0]["memory_bytes"] / 2**30
    measured = probe.get("measured") or {}
    if measured.get("matmul_tflops"):
        tflops = min(measured["matmul_tflops"])
        # A probe measures achieved GEMM throughput: keep the datasheet peak for MFU and fold the measurement
        # into the efficiency (capped at 0.9: a large square GEMM is the best case the model's GEMMs reach).
        key = "peak_tflops_bf16" if measured.get("matmul_dtype", "bfloat16") == "bfloat16" else "peak_tflops_fp32"
        if data[key] > 0:
            data["efficiency"] = min(0.9, tflops / data[key])
        data["source"] = "probe"
    if measured.get("allreduce_busbw_gbps"):
        data["intra_node_gbps"] = float(measured["allreduce_busbw_gbps"])
        data["source"] = "probe"
    for key in HardwareProfile.model_fields:
        if key in probe and key != "name":
            data[key] = probe[key]
            data["source"] = "probe"
    return HardwareProfile(**data)
