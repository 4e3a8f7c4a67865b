"""Hardware profiles for the estimator: the memory budget and the speed of one accelerator and its links.

    python -c "from curry_train.estimator.profiles import PROFILES; print(sorted(PROFILES))"

A GPU name (`gpu`) sets BOTH the memory budget and the speed (issue: "fits on A100-40?" must be answered against
40 GiB, and an 80 GiB budget alone must not silently mean H100 speed). `resolve_gpu` turns (gpu name |
gpu_memory_gib) into a profile and a sentence saying which profile it used and why; every estimate carries it.

Numbers are vendor datasheet peaks (dense, no sparsity); a probe result (`curry-train probe --measure --json`,
curry_train.measure.hardware.HardwareReport) overrides them through `from_probe`.
  memory_gib        the device's total memory as nvidia-smi / rocm-smi reports it, in GiB (not marketing GB).
  intra_node_gbps   NCCL bus bandwidth of an all-reduce inside a node (NVIDIA/nccl-tests doc/PERFORMANCE.md
                    defines busbw); about 75-80% of the per-direction NVLink bandwidth on DGX/HGX systems.
  inter_node_gbps   bus bandwidth per GPU across nodes: one NIC per GPU on DGX/HGX (HDR 200 Gb/s = 25 GB/s,
                    NDR 400 Gb/s = 50 GB/s per direction), about 90% of it achieved.
  efficiency        the fraction of the dense peak the best-shaped bf16 GEMM reaches: the maximum achievable matmul
                    FLOP/s (MAMF) of stas00/ml-engineering compute/accelerator/README.md, "Maximum Achievable Matmul
                    FLOPS comparison table" (A100 SXM 86.9%, H100 SXM 80.3%, GH200 83.6%, MI300X 60.1%, B200 77.6%);
                    0.80 where no measurement is published. estimator/compute.py lowers it by each GEMM's shape.
  attention_efficiency  the fraction of peak a fused causal attention (fwd + bwd) reaches at long sequences: 0.60
                    for FlashAttention-2 on Ampere (Dao 2023, "FlashAttention-2", §4: 50-73% of peak forward, less
                    backward), 0.35 on Hopper and later, where FlashAttention-2 (torch's SDPA flash backend) does not
                    use the new tensor-core instructions (Shah et al. 2024, "FlashAttention-3", §1: "only 35%
                    utilization on H100"); the generic default is the Hopper figure.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class HardwareProfile(BaseModel):
    """One accelerator type and its links: the memory budget and the numbers the step-time model uses."""

    name: str
    memory_gib: float = Field(description="Device memory (GiB): the budget when this profile is named as `gpu`.")
    peak_tflops_bf16: float = Field(description="Dense bf16 peak, TFLOP/s.")
    peak_tflops_fp32: float = Field(description="Dense fp32 peak (no TF32), TFLOP/s.")
    mem_bw_gbps: float = Field(description="Device memory bandwidth, GB/s (optimizer step is memory-bound).")
    intra_node_gbps: float = Field(description="All-reduce bus bandwidth inside a node, GB/s.")
    inter_node_gbps: float = Field(description="Bus bandwidth per GPU across nodes, GB/s.")
    alpha_intra_us: float = Field(description="Per-hop latency inside a node, microseconds.")
    alpha_inter_us: float = Field(description="Per-hop latency across nodes, microseconds.")
    gpus_per_node: int = Field(8, description="Accelerators per node of the usual server (DGX/HGX/OAM: 8).")
    efficiency: float = Field(0.80, description="Fraction of peak the best-shaped GEMM reaches (MAMF); "
                              "estimator/compute.py lowers it by each GEMM's shape.")
    attention_efficiency: float = Field(0.35, description="Fraction of peak of fused causal attention (fwd + bwd) "
                                        "at long sequences (FlashAttention-2 class kernel).")
    source: str = Field("datasheet", description="datasheet, or probe when measured numbers replaced it.")
    reference: str = Field("", description="Where the datasheet numbers come from.")

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for the compute dtype ('bfloat16' or 'float32')."""
        return (self.peak_tflops_bf16 if dtype == "bfloat16" else self.peak_tflops_fp32) * 1e12


_A100 = ("NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): 312 TFLOP/s bf16 dense, 19.5 fp32, "
         "1,555 / 2,039 GB/s HBM2e (40 / 80 GB SXM4), NVLink3 600 GB/s bidirectional; DGX A100: 8 GPUs, "
         "8 x 200 Gb/s HDR InfiniBand")
_H100 = ("NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s bf16 dense, 67 fp32, 3.35 TB/s HBM3, NVLink4 "
         "900 GB/s bidirectional; DGX H100: 8 GPUs, 8 x 400 Gb/s NDR (ConnectX-7)")
_H200 = ("NVIDIA H200 datasheet (SXM): H100 compute (989 TFLOP/s bf16 dense, 67 fp32), 141 GB HBM3e at 4.8 TB/s, "
         "NVLink4 900 GB/s; HGX H200: 8 GPUs, 400 Gb/s per GPU")
_B200 = ("NVIDIA HGX B200 datasheet: 2.25 PFLOP/s bf16 dense per GPU (4.5 sparse), 75 TFLOP/s fp32, 180 GB HBM3e at "
         "7.7-8 TB/s, NVLink5 1.8 TB/s bidirectional; DGX B200: 8 GPUs, 8 x 400 Gb/s ConnectX-7")
_MI300X = ("AMD Instinct MI300X data sheet: 1,307.4 TFLOP/s bf16 dense, 163.4 fp32 (vector), 192 GB HBM3 at "
           "5.3 TB/s, 7 Infinity Fabric links x 64 GB/s per direction (fully connected 8-GPU OAM platform); "
           "typical clusters 400 Gb/s per GPU (e.g. Azure ND MI300X v5: 8 x 400 Gb/s NDR)")
_L40S = ("NVIDIA L40S datasheet: 362 TFLOP/s bf16 dense (733 sparse), 91.6 fp32, 48 GB GDDR6 at 864 GB/s, no "
         "NVLink (PCIe Gen4 x16: 32 GB/s per direction); OVX/PCIe servers: 4-8 GPUs, ~100 Gb/s per GPU assumed")

PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        # 40960 MiB; the 40 GB SXM4 part runs HBM2 at 1,555 GB/s
        HardwareProfile(name="A100-40", memory_gib=40.0, peak_tflops_bf16=312, peak_tflops_fp32=19.5,
                        mem_bw_gbps=1555, intra_node_gbps=230, inter_node_gbps=23, alpha_intra_us=8,
                        alpha_inter_us=15, efficiency=0.869, attention_efficiency=0.60, reference=_A100),
        # 81920 MiB
        HardwareProfile(name="A100-80", memory_gib=80.0, peak_tflops_bf16=312, peak_tflops_fp32=19.5,
                        mem_bw_gbps=2039, intra_node_gbps=230, inter_node_gbps=23, alpha_intra_us=8,
                        alpha_inter_us=15, efficiency=0.869, attention_efficiency=0.60, reference=_A100),
        # 81559 MiB (H100 80GB HBM3, SXM5)
        HardwareProfile(name="H100", memory_gib=79.6, peak_tflops_bf16=989, peak_tflops_fp32=67,
                        mem_bw_gbps=3350, intra_node_gbps=360, inter_node_gbps=45, alpha_intra_us=6,
                        alpha_inter_us=12, efficiency=0.803, reference=_H100),
        # 143771 MiB
        HardwareProfile(name="H200", memory_gib=140.4, peak_tflops_bf16=989, peak_tflops_fp32=67,
                        mem_bw_gbps=4800, intra_node_gbps=360, inter_node_gbps=45, alpha_intra_us=6,
                        alpha_inter_us=12, efficiency=0.803, reference=_H200),
        # 183359 MiB; NVLink5 doubles NVLink4's bandwidth
        HardwareProfile(name="B200", memory_gib=179.1, peak_tflops_bf16=2250, peak_tflops_fp32=75,
                        mem_bw_gbps=8000, intra_node_gbps=720, inter_node_gbps=45, alpha_intra_us=6,
                        alpha_inter_us=12, efficiency=0.776, reference=_B200),
        # 205822885888 B (rocm-smi); RCCL all-reduce busbw inside the 8-GPU platform ~300 GB/s. efficiency: its
        # MAMF, 60.1% of peak (ROCm 6.2), far below H100's share; a probe overrides it
        HardwareProfile(name="MI300X", memory_gib=191.7, peak_tflops_bf16=1307.4, peak_tflops_fp32=163.4,
                        mem_bw_gbps=5300, intra_node_gbps=300, inter_node_gbps=45, alpha_intra_us=8,
                        alpha_inter_us=15, efficiency=0.601, reference=_MI300X),
        # 46068 MiB; collectives inside the node go over PCIe (~20 GB/s busbw)
        HardwareProfile(name="L40S", memory_gib=45.0, peak_tflops_bf16=362, peak_tflops_fp32=91.6,
                        mem_bw_gbps=864, intra_node_gbps=20, inter_node_gbps=11, alpha_intra_us=10,
                        alpha_inter_us=20, reference=_L40S),
        HardwareProfile(name="CPU", memory_gib=16, peak_tflops_bf16=0.2, peak_tflops_fp32=0.2, mem_bw_gbps=20,
                        intra_node_gbps=2, inter_node_gbps=1, alpha_intra_us=50, alpha_inter_us=100,
                        efficiency=0.5, reference="a gloo-over-loopback development box: exercises the code path "
                        "only; its numbers are not an accelerator's"),
    )
}

GPU_NAMES: tuple[str, ...] = tuple(PROFILES)

_ALIASES = {"a100": "A100-80", "a100-40gb": "A100-40", "a100-80gb": "A100-80", "a100-sxm4-40gb": "A100-40",
            "a100-sxm4-80gb": "A100-80", "h100": "H100", "h100-80gb": "H100", "h100-sxm": "H100", "h200": "H200",
            "b200": "B200", "mi300x": "MI300X", "mi300": "MI300X", "l40s": "L40S", "cpu": "CPU"}


class UnknownGpu(KeyError, ValueError):
    """A GPU name that names no profile. A KeyError (a lookup) and a ValueError (bad input) both catch it."""

    def __init__(self, name: str, field: str = "gpu"):
        self.name, self.field = name, field
        super().__init__(f"{field}: unknown GPU {name!r}; valid names: {', '.join(GPU_NAMES)}. Fix: pass one of "
                         f"them, or leave {field} out and give gpu_memory_gib (the speed is then assumed and said)")

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def get_profile(name: str, field: str = "gpu") -> HardwareProfile:
    """A profile by name (A100-40, A100-80, H100, H200, B200, MI300X, L40S, CPU; case-insensitive, a few
    aliases). An unknown name raises UnknownGpu naming `field` and listing the valid names."""
    key = str(name).strip()
    if key in PROFILES:
        return PROFILES[key]
    low = key.lower()
    for cand, prof in PROFILES.items():
        if cand.lower() == low:
            return prof
    if low in _ALIASES:
        return PROFILES[_ALIASES[low]]
    raise UnknownGpu(name, field)


def guess_profile(device: str, gpu_memory_gib: float) -> HardwareProfile:
    """The speed profile a bare memory size most likely means: CPU for device=cpu, else 40 -> A100-40, <= 96 ->
    H100, <= 150 -> H200, larger -> B200. resolve_gpu says so in words; name `gpu` when the guess is wrong
    (A100-80 and H100 share 80 GiB at a 3x different speed)."""
    if device == "cpu":
        return PROFILES["CPU"]
    if gpu_memory_gib <= 48:
        return PROFILES["A100-40"]
    if gpu_memory_gib <= 96:
        return PROFILES["H100"]
    if gpu_memory_gib <= 150:
        return PROFILES["H200"]
    return PROFILES["B200"]


def resolve_gpu(gpu: str | None = None, gpu_memory_gib: float | None = None,
                device: str = "cuda") -> tuple[HardwareProfile, float, str]:
    """(speed profile, memory budget GiB, why): a named `gpu` sets both; `gpu_memory_gib` alone sets the budget
    and a *guessed* speed, and the sentence says which one and how to change it. Both: the name's speed with
    the given budget (a cap below the device's memory)."""
    if gpu:
        prof = get_profile(gpu)
        if gpu_memory_gib is None or gpu_memory_gib == prof.memory_gib:
            return prof, prof.memory_gib, (f"gpu={prof.name}: {prof.memory_gib:g} GiB budget and {prof.name} "
                                           f"speed ({prof.source})")
        return prof, float(gpu_memory_gib), (f"gpu={prof.name}: {prof.name} speed ({prof.source}) with the "
                                             f"given gpu_memory_gib={gpu_memory_gib:g} as the budget (the device "
                                             f"has {prof.memory_gib:g} GiB)")
    mem = float(gpu_memory_gib) if gpu_memory_gib is not None else 80.0
    prof = guess_profile(device, mem)
    if prof.name == "CPU":
        return prof, mem, f"device=cpu: CPU profile, {mem:g} GiB budget (gpu_memory_gib)"
    return prof, mem, (f"no gpu named: {prof.name} speed ASSUMED for a {mem:g} GiB budget (gpu_memory_gib); "
                       f"name gpu ({', '.join(n for n in GPU_NAMES if n != 'CPU')}) to set the speed")


def check_cluster(*, gpus_per_node: int | None = None, nodes: int | None = None, seq_len: int | None = None,
                  gpu_memory_gib: float | None = None, global_batch: int | None = None,
                  micro_batch: int | None = None, gpu: str | None = None) -> None:
    """Reject impossible planning inputs before anything runs: a ValueError naming the field and the fix.
    (An unknown gpu raises UnknownGpu, which is also a ValueError.) A cluster too small for the model is NOT an
    error here: the planner answers it with fits=false."""
    problems = []

    def need(field: str, value: Any, ok: bool, fix: str) -> None:
        if value is not None and not ok:
            problems.append(f"{field}={value!r}: {fix}")

    need("gpus_per_node", gpus_per_node, isinstance(gpus_per_node, int) and gpus_per_node >= 1,
         "must be an integer >= 1 (accelerators per node, e.g. 8)")
    need("nodes", nodes, isinstance(nodes, int) and nodes >= 1, "must be an integer >= 1 (nodes in the cluster)")
    need("seq_len", seq_len, isinstance(seq_len, int) and seq_len >= 2, "must be an integer >= 2 (tokens per "
         "sequence, e.g. 4096)")
    need("gpu_memory_gib", gpu_memory_gib, isinstance(gpu_memory_gib, (int, float)) and gpu_memory_gib > 0,
         "must be > 0 (GiB per accelerator, e.g. 80), or name gpu instead")
    need("global_batch", global_batch, isinstance(global_batch, int) and global_batch >= 1,
         "must be an integer >= 1 (sequences per optimizer step)")
    need("micro_batch", micro_batch, isinstance(micro_batch, int) and micro_batch >= 1,
         "must be an integer >= 1 (sequences per rank per forward)")
    if problems:
        raise ValueError("invalid input: " + "; ".join(problems))
    if gpu:
        get_profile(gpu)


def gpu_budget(gpu: str | None, gpu_memory_gib: float | None = None,
               hardware: str | None = None) -> tuple[str | None, float | None]:
    """(speed profile name, memory budget GiB) for the entry points that take a gpu name next to the older
    hardware / gpu_memory_gib arguments (MCP tools, CLI): the gpu sets the speed unless hardware names one, and
    the budget is the device's memory, or gpu_memory_gib when that is smaller (a cap). Without gpu both pass
    through unchanged. An unknown name raises UnknownGpu."""
    if not gpu:
        return hardware, gpu_memory_gib
    prof = get_profile(gpu)
    mem = prof.memory_gib if gpu_memory_gib is None else min(float(gpu_memory_gib), prof.memory_gib)
    return hardware or prof.name, mem


def from_device_name(device_name: str) -> HardwareProfile | None:
    """Match an NVML / torch device name ('NVIDIA H100 80GB HBM3') to a profile; None when unknown."""
    low = device_name.lower()
    if "h200" in low:
        return PROFILES["H200"]
    if "h100" in low or "h800" in low:
        return PROFILES["H100"]
    if "b200" in low:
        return PROFILES["B200"]
    if "mi300x" in low or "mi300" in low:
        return PROFILES["MI300X"]
    if "l40s" in low:
        return PROFILES["L40S"]
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
