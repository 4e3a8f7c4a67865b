"""Hardware profiles for the estimator: the memory budget and the speed of one accelerator and its links.

    python -c "from curry_train.estimator.profiles import PROFILES; print(sorted(PROFILES))"

A GPU name (`gpu`) sets BOTH the memory budget and the speed (issue: "fits on A100-40?" must be answered against
40 GiB, and an 80 GiB budget alone must not silently mean H100 speed). `resolve_gpu` turns (gpu name |
gpu_memory_gib) into a profile and a sentence saying which profile it used and why; every estimate carries it.

Numbers are vendor datasheet peaks (dense, no sparsity; each row's source in estimator/datasheets.py); every
spelling of a name goes through the one resolver, `get_profile` (docs/ESTIMATION.md, "GPU profiles"); a probe
result (`curry-train probe --measure --json`, curry_train.measure.hardware.HardwareReport) scales them through
`compute.from_probe`.
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

import re
from typing import Any

from pydantic import BaseModel, Field

from curry_train.estimator.datasheets import DATASHEETS


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


# PCIe-only cards: collectives inside the box cross PCIe (busbw ~20 GB/s on Gen4, ~40 on Gen5, as L40S); a
# GeForce card has no peer-to-peer, so its all-reduce bounces through host memory (~12 GB/s: an ASSUMPTION).
# Workstations are assumed to have 25 GbE between boxes (~3 GB/s), cloud PCIe servers 100 Gb/s per node share.
# Each row's `reference` is its datasheet (estimator/datasheets.py).
PROFILES: dict[str, HardwareProfile] = {
    p.name: p.model_copy(update={"reference": DATASHEETS[p.name]})
    for p in (
        # 24564 MiB. GeForce: bf16/fp16 tensor with fp32 accumulate runs at half the fp16-accumulate rate
        HardwareProfile(name="RTX4090", memory_gib=23.99, peak_tflops_bf16=165.2, peak_tflops_fp32=82.6,
                        mem_bw_gbps=1008, intra_node_gbps=12, inter_node_gbps=3, alpha_intra_us=10,
                        alpha_inter_us=30, gpus_per_node=4),
        HardwareProfile(name="RTX3090", memory_gib=24.0, peak_tflops_bf16=71, peak_tflops_fp32=35.6,
                        mem_bw_gbps=936, intra_node_gbps=20, inter_node_gbps=3, alpha_intra_us=10,
                        alpha_inter_us=30, gpus_per_node=4),
        HardwareProfile(name="A6000", memory_gib=47.99, peak_tflops_bf16=154.8, peak_tflops_fp32=38.7,
                        mem_bw_gbps=768, intra_node_gbps=20, inter_node_gbps=3, alpha_intra_us=10,
                        alpha_inter_us=30),
        # 23034 MiB
        HardwareProfile(name="L4", memory_gib=22.49, peak_tflops_bf16=121, peak_tflops_fp32=30.3, mem_bw_gbps=300,
                        intra_node_gbps=20, inter_node_gbps=11, alpha_intra_us=10, alpha_inter_us=20),
        # 23028 MiB
        HardwareProfile(name="A10", memory_gib=22.49, peak_tflops_bf16=125, peak_tflops_fp32=31.2, mem_bw_gbps=600,
                        intra_node_gbps=20, inter_node_gbps=11, alpha_intra_us=10, alpha_inter_us=20,
                        gpus_per_node=4),
        # 23028 MiB. AWS publishes no datasheet: the A10G trades tensor rate for CUDA-core rate against the A10
        HardwareProfile(name="A10G", memory_gib=22.49, peak_tflops_bf16=70, peak_tflops_fp32=31.2, mem_bw_gbps=600,
                        intra_node_gbps=20, inter_node_gbps=11, alpha_intra_us=10, alpha_inter_us=20),
        # 16160 / 32510 MiB. No bf16 tensor cores (NO_BF16): the bf16 field holds the fp16 tensor peak
        HardwareProfile(name="V100-16", memory_gib=15.78, peak_tflops_bf16=125, peak_tflops_fp32=15.7,
                        mem_bw_gbps=900, intra_node_gbps=130, inter_node_gbps=5.6, alpha_intra_us=8,
                        alpha_inter_us=15),
        HardwareProfile(name="V100-32", memory_gib=31.75, peak_tflops_bf16=125, peak_tflops_fp32=15.7,
                        mem_bw_gbps=900, intra_node_gbps=130, inter_node_gbps=5.6, alpha_intra_us=8,
                        alpha_inter_us=15),
        # 40960 / 81920 MiB; PCIe boards, NVLink bridges join pairs only. The GEMM and attention ceilings are the
        # SXM part's (same GA100 die; an ASSUMPTION: no PCIe MAMF is published)
        HardwareProfile(name="A100-40-PCIe", memory_gib=40.0, peak_tflops_bf16=312, peak_tflops_fp32=19.5,
                        mem_bw_gbps=1555, intra_node_gbps=20, inter_node_gbps=11, alpha_intra_us=10,
                        alpha_inter_us=20, efficiency=0.869,
                        attention_efficiency=0.60),
        HardwareProfile(name="A100-80-PCIe", memory_gib=80.0, peak_tflops_bf16=312, peak_tflops_fp32=19.5,
                        mem_bw_gbps=1935, intra_node_gbps=20, inter_node_gbps=11, alpha_intra_us=10,
                        alpha_inter_us=20, efficiency=0.869,
                        attention_efficiency=0.60),
        # 81559 MiB; PCIe Gen5. H100 PCIe, NVL and H800 take the H100 SXM's GEMM ceiling (same GH100 die; an
        # ASSUMPTION: no MAMF is published for them)
        HardwareProfile(name="H100-PCIe", memory_gib=79.6, peak_tflops_bf16=756, peak_tflops_fp32=51,
                        mem_bw_gbps=2000, intra_node_gbps=40, inter_node_gbps=23, alpha_intra_us=10,
                        alpha_inter_us=15, efficiency=0.803),
        # 95830 MiB
        HardwareProfile(name="H100-NVL", memory_gib=93.58, peak_tflops_bf16=835, peak_tflops_fp32=60,
                        mem_bw_gbps=3900, intra_node_gbps=40, inter_node_gbps=23, alpha_intra_us=10,
                        alpha_inter_us=15, efficiency=0.803),
        # 81559 MiB; H100 compute with NVLink cut to 400 GB/s bidirectional (busbw scaled 360 x 400/900)
        HardwareProfile(name="H800", memory_gib=79.6, peak_tflops_bf16=989, peak_tflops_fp32=67,
                        mem_bw_gbps=3350, intra_node_gbps=160, inter_node_gbps=45, alpha_intra_us=6,
                        alpha_inter_us=12, efficiency=0.803),
        # 40960 MiB; the 40 GB SXM4 part runs HBM2 at 1,555 GB/s
        HardwareProfile(name="A100-40", memory_gib=40.0, peak_tflops_bf16=312, peak_tflops_fp32=19.5,
                        mem_bw_gbps=1555, intra_node_gbps=230, inter_node_gbps=23, alpha_intra_us=8,
                        alpha_inter_us=15, efficiency=0.869, attention_efficiency=0.60),
        # 81920 MiB
        HardwareProfile(name="A100-80", memory_gib=80.0, peak_tflops_bf16=312, peak_tflops_fp32=19.5,
                        mem_bw_gbps=2039, intra_node_gbps=230, inter_node_gbps=23, alpha_intra_us=8,
                        alpha_inter_us=15, efficiency=0.869, attention_efficiency=0.60),
        # 81559 MiB (H100 80GB HBM3, SXM5)
        HardwareProfile(name="H100", memory_gib=79.6, peak_tflops_bf16=989, peak_tflops_fp32=67,
                        mem_bw_gbps=3350, intra_node_gbps=360, inter_node_gbps=45, alpha_intra_us=6,
                        alpha_inter_us=12, efficiency=0.803),
        # 143771 MiB
        HardwareProfile(name="H200", memory_gib=140.4, peak_tflops_bf16=989, peak_tflops_fp32=67,
                        mem_bw_gbps=4800, intra_node_gbps=360, inter_node_gbps=45, alpha_intra_us=6,
                        alpha_inter_us=12, efficiency=0.803),
        # 183359 MiB; NVLink5 doubles NVLink4's bandwidth
        HardwareProfile(name="B200", memory_gib=179.1, peak_tflops_bf16=2250, peak_tflops_fp32=75,
                        mem_bw_gbps=8000, intra_node_gbps=720, inter_node_gbps=45, alpha_intra_us=6,
                        alpha_inter_us=12, efficiency=0.776),
        # the datasheet's 186 GB (NVL72: 13.4 TB over 72 GPUs) in GiB, not a measured size; one NVLink domain of 72
        HardwareProfile(name="GB200", memory_gib=173.2, peak_tflops_bf16=2500, peak_tflops_fp32=80,
                        mem_bw_gbps=8000, intra_node_gbps=720, inter_node_gbps=90, alpha_intra_us=6,
                        alpha_inter_us=12, gpus_per_node=72),
        # one Graphics Compute Die (GCD): torch sees each MI250X as two 64 GB devices, so the profile is per GCD;
        # efficiency: MI300X's MAMF share (60.1%), an ASSUMPTION (no MI250X MAMF is published)
        HardwareProfile(name="MI250X", memory_gib=64.0, peak_tflops_bf16=191.5, peak_tflops_fp32=23.95,
                        mem_bw_gbps=1638, intra_node_gbps=50, inter_node_gbps=11, alpha_intra_us=8,
                        alpha_inter_us=15, efficiency=0.601),
        # 205822885888 B (rocm-smi); RCCL all-reduce busbw inside the 8-GPU platform ~300 GB/s. efficiency: its
        # MAMF, 60.1% of peak (ROCm 6.2), far below H100's share; a probe overrides it
        HardwareProfile(name="MI300X", memory_gib=191.7, peak_tflops_bf16=1307.4, peak_tflops_fp32=163.4,
                        mem_bw_gbps=5300, intra_node_gbps=300, inter_node_gbps=45, alpha_intra_us=8,
                        alpha_inter_us=15, efficiency=0.601),
        # 46068 MiB; collectives inside the node go over PCIe (~20 GB/s busbw)
        HardwareProfile(name="L40S", memory_gib=45.0, peak_tflops_bf16=362, peak_tflops_fp32=91.6,
                        mem_bw_gbps=864, intra_node_gbps=20, inter_node_gbps=11, alpha_intra_us=10,
                        alpha_inter_us=20),
        # unified memory shared with the CPU: Metal's recommendedMaxWorkingSetSize is about 75% of it (144 of 192
        # GB); no tensor cores, fp16/bf16 at the fp32 rate (an ASSUMPTION from 76 cores x 128 ALUs x 2 x 1.4 GHz)
        HardwareProfile(name="M2-Ultra", memory_gib=134.1, peak_tflops_bf16=27.2, peak_tflops_fp32=27.2,
                        mem_bw_gbps=800, intra_node_gbps=2, inter_node_gbps=1, alpha_intra_us=50,
                        alpha_inter_us=100, gpus_per_node=1, efficiency=0.3),
        HardwareProfile(name="CPU", memory_gib=16, peak_tflops_bf16=0.2, peak_tflops_fp32=0.2, mem_bw_gbps=20,
                        intra_node_gbps=2, inter_node_gbps=1, alpha_intra_us=50, alpha_inter_us=100,
                        efficiency=0.5),
    )
}

GPU_NAMES: tuple[str, ...] = tuple(PROFILES)

# One resolver for every spelling a user or a driver gives (get_profile, from_device_name): lower case, vendor
# words and punctuation dropped, "80GB" read as "80". Aliases are written in that normal form.
_VENDOR = re.compile(r"nvidia|geforce|tesla|quadro|amd|instinct|apple")
_ALIASES = {"4090": "RTX4090", "3090": "RTX3090", "rtxa6000": "A6000", "a100": "A100-80", "a100sxm440": "A100-40",
            "a100sxm480": "A100-80", "a100pcie40": "A100-40-PCIe", "a100pcie80": "A100-80-PCIe", "h10080": "H100",
            "h100sxm": "H100", "h100sxm5": "H100", "h10080hbm3": "H100", "h100sxm580": "H100", "h100pcie80":
            "H100-PCIe", "h100nvl94": "H100-NVL", "h800sxm": "H800", "mi300": "MI300X", "mi250": "MI250X",
            "v100sxm216": "V100-16", "v100sxm232": "V100-32"}
# Names that mean more than one profile: refused with the choices rather than guessed.
_AMBIGUOUS = {"v100": ("V100-16", "V100-32"), "a100pcie": ("A100-40-PCIe", "A100-80-PCIe")}
NO_BF16 = frozenset({"V100-16", "V100-32"})  # Volta: fp16 tensor cores only (the bf16 field holds the fp16 peak)


def _norm(name: str) -> str:
    return re.sub(r"(\d)gb", r"\1", re.sub(r"[^a-z0-9]", "", _VENDOR.sub("", str(name).lower())))


_BY_NORM = {**{_norm(n): n for n in PROFILES}, **_ALIASES}


class UnknownGpu(KeyError, ValueError):
    """A GPU name that names no profile. A KeyError (a lookup) and a ValueError (bad input) both catch it."""

    def __init__(self, name: str, field: str = "gpu", choices: tuple[str, ...] = ()):
        self.name, self.field = name, field
        what = f"ambiguous GPU {name!r} (one of {', '.join(choices)})" if choices else f"unknown GPU {name!r}"
        super().__init__(f"{field}: {what}; valid names: {', '.join(GPU_NAMES)}. Fix: pass one of "
                         f"them, or leave {field} out and give gpu_memory_gib (the speed is then assumed and said)")

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def get_profile(name: str, field: str = "gpu") -> HardwareProfile:
    """A profile by name (GPU_NAMES) in any common spelling: case, spaces, dashes, vendor words and a "GB"
    suffix do not matter ('rtx4090', 'RTX 4090', '4090', 'a100-80gb', 'NVIDIA H100 SXM5'). An unknown or
    ambiguous name ('V100': 16 or 32 GB) raises UnknownGpu naming `field` and listing the valid names."""
    key = _norm(name)
    if key in _BY_NORM:
        return PROFILES[_BY_NORM[key]]
    raise UnknownGpu(name, field, _AMBIGUOUS.get(key, ()))


def bf16_note(hw: HardwareProfile, dtype: str) -> str:
    """The warning a bf16 config owes on a GPU without bf16 tensor cores (V100); empty otherwise."""
    if dtype != "bfloat16" or hw.name not in NO_BF16:
        return ""
    return (f"{hw.name} has no bf16 tensor cores (Volta: fp16 only): the step time uses its fp16 peak "
            f"({hw.peak_tflops_bf16:g} TFLOP/s), but bf16 is unsupported there (torch.cuda.is_bf16_supported() is "
            "False; bf16 kernels that run use no tensor cores); fp16 with loss scaling, which this template does "
            "not ship, is what this GPU trains in")


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


# Driver names (NVML / torch.cuda.get_device_name) in normal form, most specific first: the first needle found
# names the profile ('NVIDIA A100-SXM4-40GB', 'Tesla V100-SXM2-32GB', 'AMD Instinct MI250X/MI250').
_DEVICE_NEEDLES = (("gb200", "GB200"), ("b200", "B200"), ("h200", "H200"), ("h800", "H800"), ("h100nvl", "H100-NVL"),
                   ("h100pcie", "H100-PCIe"), ("h100", "H100"), ("mi300", "MI300X"), ("mi250", "MI250X"),
                   ("l40s", "L40S"), ("rtx4090", "RTX4090"), ("rtx3090", "RTX3090"), ("a6000", "A6000"),
                   ("a10g", "A10G"), ("l4", "L4"))


def from_device_name(device_name: str) -> HardwareProfile | None:
    """Match an NVML / torch device name ('NVIDIA H100 80GB HBM3') to a profile; None when unknown."""
    low = _norm(device_name)
    if low in ("", "cpu"):
        return PROFILES["CPU"]
    if low in _BY_NORM:
        return PROFILES[_BY_NORM[low]]
    for needle, name in _DEVICE_NEEDLES:
        if needle in low:
            return PROFILES[name]
    if "a100" in low or "a800" in low:
        size = "40" if "40" in low.replace("a100", "").replace("a800", "") else "80"
        return PROFILES[f"A100-{size}" + ("-PCIe" if "pcie" in low else "")]
    if "v100" in low:
        return PROFILES["V100-32" if "32" in low.replace("v100", "") else "V100-16"]
    return PROFILES["A10"] if "a10" in low else None
