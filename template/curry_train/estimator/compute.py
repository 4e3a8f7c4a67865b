"""Per-rank compute time for the estimator: GEMMs by their TP-local shape, fused attention by sequence block, and
the memory-bound element-wise passes by the bytes they move (docs/ESTIMATION.md "Compute time").

    python -c "from curry_train.estimator.compute import gemm_efficiency as g; print(g(2048, 4096, 4096, 312e12,
               2.039e12, 0.869, 2))"

Every constant comes from the hardware profile (estimator/profiles.py) or names its source here; nothing is fitted
per run, and one constant (SUSTAINED_CLOCK) is calibrated once for every GPU. Three terms, for one rank's share of a
step:
  GEMMs      each Linear's FLOPs at gemm_efficiency(M, K, N): the profile's best-shape ceiling (`efficiency`, the
             maximum achievable matmul FLOP/s, MAMF) at the sustained clock, lowered by the operand traffic the
             kernel does not hide: t = 2MKN / (ceiling x SUSTAINED_CLOCK x peak) + bytes(MK + KN + MN) / mem_bw
             (the additive roofline: a GEMM whose arithmetic intensity nears the ridge point peak / mem_bw is
             slowed by its loads; NVIDIA "Matrix Multiplication Background User's Guide", arithmetic intensity).
             M is the micro-batch's tokens, K and N the TP-local widths, so a TP-split layer and a small
             micro-batch run below a large GEMM.
  attention  the causal core's FLOPs at attention_efficiency x SUSTAINED_CLOCK x s_blk / (s_blk + ATTN_HALF_BLOCK):
             a fused kernel (FlashAttention-2, Dao 2023 Fig. 4) reaches its plateau from a few thousand keys per
             block and about half of it near 512; s_blk is the keys one kernel call sees (seq_len / cp under CP).
  element    norms, RoPE, casts, SiLU x gate, residual adds (the template's eager kernels, one at a time) and the
             weight-gradient writes, as bytes read + written over mem_bw (`elementwise_bytes`,
             `param_pass_bytes`): a backward moves about twice a forward's bytes, full and selective recompute
             replay the forward's. No weight casts: bf16 runs on FSDP2's gathered bf16 units (wrapping.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from curry_train.estimator.layout import Layout, routed_tokens
from curry_train.estimator.mla import mla_matmuls
from curry_train.estimator.profiles import HardwareProfile, from_device_name

# A fused attention kernel at s_blk keys per block runs at s_blk / (s_blk + 512) of its plateau (FlashAttention-2,
# Dao 2023, Fig. 4, A100 causal fwd+bwd head dim 128: about half the long-sequence throughput at 512, ~90% at 4k)
ATTN_HALF_BLOCK = 512
# Compute-bound kernels in a sustained multi-GPU run settle at a power-limited clock, below the short benchmark
# their ceilings come from (MAMF: 100 iterations after 50 warm-up): "measured throughput fell 15-30% below the
# roofline estimate for a clearly compute-bound kernel" (diomgis.com, "Power, Thermals, and Clock Throttling").
# 0.75 is the value inside that range on which the 18 published runs of benchmarks/published_throughput.py (A100 and
# H100, 8 to 3,072 GPUs) agree within 15%: the time model's one calibrated constant, the same for every GPU.
SUSTAINED_CLOCK = 0.75
BACKWARD_BYTES = 2.0  # an element-wise backward reads the saved input and the output gradient, writes one gradient


def gemm_efficiency(m: float, k: float, n: float, peak: float, mem_bw: float, ceiling: float, nbytes: int,
                    clock: float = SUSTAINED_CLOCK) -> float:
    """Fraction of `peak` an [m, k] x [k, n] GEMM reaches: the ceiling, lowered by its operand traffic (see top).
    `clock` = 1 for a short benchmark (MAMF's own, or `probe --measure`), which runs before the clock settles."""
    flops = 2.0 * m * k * n
    if flops <= 0:
        return ceiling
    t = flops / (ceiling * clock * peak) + nbytes * (m * k + k * n + m * n) / mem_bw
    return flops / (t * peak)


def probe_gemm_tflops(hw: HardwareProfile, n: int, dtype: str) -> float:
    """TFLOP/s the profile predicts for the probe's benchmark (measure/hardware.py: a short burst of n x n x n
    GEMMs in `dtype`): what a measured figure is compared with to scale the profile (from_probe below)."""
    peak = hw.peak_flops(dtype)
    nbytes = 2 if dtype == "bfloat16" else 4
    return peak * gemm_efficiency(n, n, n, peak, hw.mem_bw_gbps * 1e9, hw.efficiency, nbytes, clock=1.0) / 1e12


def _linears(layout: Layout) -> list[tuple[float, float, float, float]]:
    """(M tokens, K, N, blocks) of the Linears of a rank's blocks: TP-local widths (colwise splits N, rowwise K); a
    local MoE expert sees top_k / num_experts of the tokens of the ep ranks its all-to-all gathers (uniform routing;
    under TP + EP each rank routes its T/tp shard), the shared expert every token (TP-split); `blocks` counts the
    blocks that run the Linear (a MoE model's first_k_dense blocks run a dense SwiGLU of width dense_d_ff instead of
    the experts)."""
    M = float(layout.micro_batch_tokens)
    D, t, Dh = layout.d_model, layout.tp, layout.head_dim
    q, kv = layout.n_heads * Dh / t, layout.n_kv_heads * Dh / t
    L = float(layout.n_layers)
    out = [(M, D, q, L), (M, D, kv, L), (M, D, kv, L), (M, q, D, L)]
    if layout.attention == "mla":  # estimator/mla.py: the latents' down- and up-projections, wo
        out = [(M, k_in, n_out, L) for _, n_out, k_in, _ in mla_matmuls(layout, M)]
    if layout.num_experts:
        Me = max(1.0, layout.moe_tokens * layout.top_k * layout.ep / layout.num_experts)
        F, Fs, k = layout.d_ff, layout.shared_d_ff / t, float(layout.first_k_dense)
        out += [(Me, D, F, L - k)] * 2 + [(Me, F, D, L - k)]
        if Fs:
            out += [(M, D, Fs, L - k)] * 2 + [(M, Fs, D, L - k)]
        if k:
            Fd = layout.dense_d_ff / t
            out += [(M, D, Fd, k)] * 2 + [(M, Fd, D, k)]
    else:
        F = layout.d_ff / t
        out += [(M, D, F, L)] * 2 + [(M, F, D, L)]
    return out


def linear_efficiency(layout: Layout, hw: HardwareProfile) -> float:
    """The block Linears' FLOP-weighted efficiency (their time sums: the harmonic mean of gemm_efficiency)."""
    peak, bw = hw.peak_flops(layout.dtype), hw.mem_bw_gbps * 1e9
    nbytes = 4 if layout.dtype == "float32" else 2
    flops = time = 0.0
    for m, k, n, blocks in _linears(layout):
        f = 2.0 * m * k * n * blocks
        flops += f
        time += f / gemm_efficiency(m, k, n, peak, bw, hw.efficiency, nbytes)
    return flops / time if time > 0 else hw.efficiency


def head_efficiency(layout: Layout, hw: HardwareProfile) -> float:
    """The LM head's GEMM [tokens, D] x [D, V/tp] (chunked by the loss: the chunks are rows of M)."""
    nbytes = 4 if layout.dtype == "float32" else 2
    return gemm_efficiency(layout.micro_batch_tokens, layout.d_model, layout.vocab_size / layout.tp,
                           hw.peak_flops(layout.dtype), hw.mem_bw_gbps * 1e9, hw.efficiency, nbytes)


def attention_efficiency(layout: Layout, hw: HardwareProfile) -> float:
    """Fraction of peak the fused causal attention reaches at this layout's block length (see top)."""
    s_blk = layout.seq_len / layout.cp
    return SUSTAINED_CLOCK * hw.attention_efficiency * s_blk / (s_blk + ATTN_HALF_BLOCK)


def _norm_bytes(b_s: int) -> int:
    """model/gpt.py RMSNorm, eager, bytes per element: x.float() (a copy unless the stream is fp32), pow, mean,
    the rsqrt multiply (fp32 reads and writes), type_as back to the stream dtype, the weight multiply."""
    upcast = 0 if b_s == 4 else (b_s + 4) * 2  # x.float() and type_as(x)
    return upcast + 8 + 4 + 8 + 2 * b_s


def _rope_bytes(b_c: int) -> int:
    """model/gpt.py apply_rope, eager, bytes per element of q or k: x.float(), four multiplies and two adds over the
    halves, the cat, type_as back (fp32 intermediates)."""
    return (b_c + 4) + 4 * 8 // 2 + 2 * 12 // 2 + 8 + (4 + b_c)


def elementwise_bytes(layout: Layout) -> float:
    """Bytes one rank's element-wise kernels move per token per layer, forward, backward and replays included: the
    template's eager ops one kernel at a time (model/gpt.py), b_s the residual stream's bytes (4 in fp32, 2 under
    FSDP's bf16 policy), b_c the compute dtype's, widths TP-local, norms and residual adds on
    1/tp of the tokens under SP. Forward per token: 2 RMSNorms (_norm_bytes x D); RoPE on q and k (_rope_bytes);
    the GQA repeat of k and v (read kv, write q, when G < H); the transpose copy before wo (2 b_c q); SiLU and the
    gate product (5 b_c F); 2 residual adds (2 b_s + b_c) D. Backward BACKWARD_BYTES x the forward; full and
    selective recompute replay the
    forward (selective reruns exactly these ops, parallel/recompute.py)."""
    b_c = 4 if layout.dtype == "float32" else 2
    b_s = 4 if layout.precision == "fp32" else 2
    t = layout.tp
    D, q, kv = layout.d_model, layout.n_heads * layout.head_dim / t, layout.n_kv_heads * layout.head_dim / t
    if layout.num_experts:  # SwiGLU widths one token passes, averaged over the MoE and the dense first blocks
        k = layout.first_k_dense
        F = ((layout.n_layers - k) * (layout.d_ff * layout.top_k + layout.shared_d_ff)
             + k * layout.dense_d_ff / t) / layout.n_layers
    else:
        F = layout.d_ff / t
    seq_share = 1 / t if layout.sp else 1.0
    fwd = (2 * _norm_bytes(b_s) + 2 * (2 * b_s + b_c)) * D * seq_share + _rope_bytes(b_c) * (q + kv) + \
        2 * b_c * q + 5 * b_c * F
    if layout.n_kv_heads < layout.n_heads:
        fwd += b_c * (2 * kv + 2 * q)
    replays = 1 if layout.recompute in ("full", "selective") else 0
    return fwd * (1 + BACKWARD_BYTES + replays)


def param_pass_bytes(layout: Layout) -> float:
    """Bytes per local parameter per micro-batch outside the GEMMs: the weight gradient's write. bf16 runs on
    FSDP2's gathered bf16 units (wrapping.py), which reduce the bf16 gradient in their own collectives: 2 B; fp32
    writes and accumulates into .grad in place: 8 B. No layout casts its weights per forward (no autocast)."""
    return 2.0 if layout.precision == "mp" else 8.0


def block_rates(layout: Layout, hw: HardwareProfile) -> tuple[float, float, float, float, float]:
    """(linear, head and attention efficiency, element-wise bytes per token per layer, bytes per parameter per
    micro-batch) of a layout on a profile, cached on the fields they read: the planner asks for thousands of
    candidates that share a handful of shapes."""
    return _rates(layout.micro_batch, layout.seq_len, layout.cp, layout.tp, layout.ep, layout.sp, layout.d_model,
                  layout.n_heads, layout.n_kv_heads, layout.d_ff, layout.num_experts, layout.top_k,
                  layout.vocab_size, layout.dtype, layout.precision, layout.recompute, hw.peak_tflops_bf16,
                  hw.peak_tflops_fp32, hw.mem_bw_gbps, hw.efficiency, hw.attention_efficiency,
                  (layout.n_layers, layout.shared_d_ff, layout.first_k_dense, layout.dense_d_ff),
                  (layout.attention, layout.q_lora_rank, layout.kv_lora_rank, layout.qk_nope_head_dim,
                   layout.qk_rope_head_dim, layout.v_head_dim))


@lru_cache(maxsize=4096)
def _rates(mb: int, s: int, cp: int, tp: int, ep: int, sp: bool, D: int, H: int, G: int, F: int, E: int, K: int, V: int,
           dtype: str, precision: str, recompute: str, bf16: float, fp32: float, bw: float, eff: float,
           attn: float, blocks: tuple[int, int, int, int] = (1, 0, 0, 0),
           mla: tuple[str, int, int, int, int, int] = ("gqa", 0, 0, 0, 0, 0),
           ) -> tuple[float, float, float, float, float]:
    L, Fs, k, Fd = blocks
    x = _Shape(micro_batch=mb, seq_len=s, cp=cp, tp=tp, ep=ep, sp=sp, d_model=D, n_heads=H, n_kv_heads=G, d_ff=F,
               num_experts=E, top_k=K, vocab_size=V, dtype=dtype, precision=precision, recompute=recompute,
               n_layers=L, shared_d_ff=Fs, first_k_dense=k, dense_d_ff=Fd or F, attention=mla[0],
               q_lora_rank=mla[1], kv_lora_rank=mla[2], qk_nope_head_dim=mla[3], qk_rope_head_dim=mla[4],
               v_head_dim=mla[5])
    hw = _Speed(peak_tflops_bf16=bf16, peak_tflops_fp32=fp32, mem_bw_gbps=bw, efficiency=eff,
                attention_efficiency=attn)
    return (linear_efficiency(x, hw), head_efficiency(x, hw), attention_efficiency(x, hw),  # type: ignore[arg-type]
            elementwise_bytes(x), param_pass_bytes(x))  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Shape:
    """The Layout fields the rates read (a Layout stand-in for the cache)."""

    micro_batch: int
    seq_len: int
    cp: int
    tp: int
    ep: int
    sp: bool
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    num_experts: int
    top_k: int
    vocab_size: int
    dtype: str
    precision: str
    recompute: str
    n_layers: int = 1
    shared_d_ff: int = 0
    first_k_dense: int = 0
    dense_d_ff: int = 0
    attention: str = "gqa"  # the MLA fields (estimator/mla.py)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def micro_batch_tokens(self) -> int:
        return self.micro_batch * (self.seq_len // self.cp)

    @property
    def moe_tokens(self) -> int:
        return routed_tokens(self)


@dataclass(frozen=True)
class _Speed:
    """The HardwareProfile fields the rates read."""

    peak_tflops_bf16: float
    peak_tflops_fp32: float
    mem_bw_gbps: float
    efficiency: float
    attention_efficiency: float

    def peak_flops(self, dtype: str) -> float:
        return (self.peak_tflops_bf16 if dtype == "bfloat16" else self.peak_tflops_fp32) * 1e12


# The probe's GEMM when a report does not say (measure/hardware.py times 8192^3 in bf16 on a GPU).
PROBE_GEMM_N = 8192


def probe_scale(hw: HardwareProfile, measured: dict[str, Any]) -> float | None:
    """Measured / predicted throughput of the probe's own GEMM (the slowest local rank's), or None without a
    datasheet peak for its dtype.

    The profile's `efficiency` is a MAMF ceiling, the best shape over a sweep, which estimator/compute.py then
    lowers by each GEMM's shape and the sustained clock. A probe times one square GEMM in a short burst, so it is
    compared with what the same model predicts for that GEMM (compute.probe_gemm_tflops: the ceiling, its operand
    traffic, no clock derating) and scales the ceilings by the ratio: a GPU that matches its datasheet changes
    nothing; one 20% slower (power cap, lower clocks, a PCIe part named like the SXM one) is 20% slower for every
    GEMM and attention kernel of the model. Replacing the ceiling by that GEMM's fraction of peak counted its
    shape losses twice and discarded the datasheet row (docs/ESTIMATION.md, "GPU profiles")."""
    dtype = measured.get("matmul_dtype", "bfloat16")
    dtype = "bfloat16" if dtype == "bfloat16" else "float32"
    if hw.peak_flops(dtype) <= 0:
        return None
    predicted = probe_gemm_tflops(hw, int(measured.get("matmul_size") or PROBE_GEMM_N), dtype)
    return min(measured["matmul_tflops"]) / predicted if predicted > 0 else None


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
        scale = probe_scale(HardwareProfile(**data), measured)
        if scale is not None:
            data["efficiency"] = min(1.0, data["efficiency"] * scale)
            data["attention_efficiency"] = min(1.0, data["attention_efficiency"] * scale)
        data["source"] = "probe"
    if measured.get("allreduce_busbw_gbps"):
        data["intra_node_gbps"] = float(measured["allreduce_busbw_gbps"])
        data["source"] = "probe"
    for key in HardwareProfile.model_fields:
        if key in probe and key != "name":
            data[key] = probe[key]
            data["source"] = "probe"
    return HardwareProfile(**data)
