"""The one-GPU answer: when no layout of the ladder fits the user's GPUs, what does fit on one of them, and the
options beyond this template's ladder, each with the per-GPU and host memory it would need.

    curry-train recommend --config llama3-8b --gpu rtx4090 --set hardware.gpus_per_node=1 --set parallel.dp=1
    python -c "from curry_train.advice.beyond import one_gpu_answer; print(one_gpu_answer('llama3-8b', 'RTX4090').text)"

What fits: the largest model of the config's width x depth family (advice/family.py, scaled down as far as one
layer of a sixteenth of the width) with full recompute on one GPU, and, when the model states alone leave room,
the largest micro-batch at the config's sequence and the longest sequence at micro-batch 1.

Beyond the ladder (outside this template: it trains every parameter in fp32 master weights with AdamW and keeps
them on the device): LoRA on a frozen bf16 base, QLoRA on a 4-bit NF4 base, 8-bit AdamW states, optimizer-state
offload to the CPU, and optimizer + parameter offload to the CPU or NVMe. Each option's per-GPU need is its model
states from the bytes per parameter below plus the activations and workspace the estimator computes for this
config with full recompute (the frozen-base options keep the same activations: the input gradients still flow
through every layer). The bytes per parameter are written once, here, with their sources.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from curry_train.advice.family import FamilyMember, family, member
from curry_train.config import Config, from_dict
from curry_train.estimator import GiB, estimate, layout_of, load_any, model_states, param_count, with_gpu
from curry_train.estimator.peak import step_moments
from curry_train.estimator.profiles import get_profile

# --- bytes per parameter (one home; tests/test_beyond.py checks each against its source) ---------------------
# This template's full training (estimator dtype policy): fp32 master 4 + fp32 grad 4 + AdamW exp_avg/exp_avg_sq 8.
FULL_ADAMW_B = 16.0
# A frozen bf16 weight (LoRA's base; Hu et al. 2021, arXiv:2106.09685).
BF16_B = 2.0
# QLoRA (Dettmers et al. 2023, arXiv:2305.14314, sec. 3): 4-bit NormalFloat weights plus double-quantized block
# constants: 8/64 + 32/(64*256) = 0.127 bits per parameter on top of the 4 bits, so (4 + 0.127) / 8 bytes.
NF4_B = (4 + 8 / 64 + 32 / (64 * 256)) / 8
# bitsandbytes 8-bit AdamW (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization",
# arXiv:2110.02861): exp_avg and exp_avg_sq in 8 bits, one fp32 absmax per block of 2048 values for each.
ADAM8BIT_B = 2 * (1 + 4 / 2048)
# LoRA adapters train like any parameter: fp32 weight, fp32 grad, AdamW state.
ADAPTER_B = FULL_ADAMW_B
LORA_RANK = 16  # adapters on every linear of attention and MLP (q, k, v, o, gate, up, down), rank 16
# ZeRO-Offload (Ren et al. 2021, arXiv:2101.06840) as DeepSpeed sizes it (deepspeed.readthedocs.io memory.html,
# estimate_zero3_model_states_mem_needs): optimizer offload keeps the bf16 parameters on the GPU (2 B) and puts
# the fp32 master, the AdamW state and the gradients on the host (16 B); offloading the parameters too leaves
# the GPU the largest layer's bf16 weight and gradient (4 B per parameter of it) and the host 18 B. DeepSpeed
# multiplies host memory by 1.5 for its pinned buffers.
OFFLOAD_OPT_GPU_B, OFFLOAD_OPT_HOST_B = 2.0, 16.0
OFFLOAD_ALL_LAYER_B, OFFLOAD_ALL_HOST_B = 4.0, 18.0
HOST_BUFFER_FACTOR = 1.5
SMALLER_WIDTHS = (0.0625, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
SMALLER_DEPTHS = (1e-9, 1 / 32, 1 / 16, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)  # 1e-9: a single layer


class Option(BaseModel):
    """One way past the ladder, with what it needs."""

    name: str
    outside_template: bool = Field(True, description="True: this template does not implement it; use the named "
                                   "library.")
    how: str = Field(description="The library or setting that provides it.")
    trains: str = Field(description="Which parameters it updates.")
    gpu_bytes: int = Field(description="Per-GPU peak it would need (model states + the estimator's activations).")
    fits: bool = Field(description="gpu_bytes <= the usable budget of this GPU.")
    host_bytes: int = Field(0, description="Host (CPU) memory it needs; 0 when it offloads nothing.")
    nvme_bytes: int = Field(0, description="NVMe space it needs instead of host memory (NVMe offload).")
    text: str


class WhatFits(BaseModel):
    """What this template trains on one GPU of this type."""

    largest_model: FamilyMember | None = Field(description="Largest member of the config's width x depth family "
                                               "that fits with full recompute at the config's micro-batch.")
    largest_model_peak_bytes: int | None = None
    model_state_bytes: int = Field(description="The config's model states alone (params, grads, AdamW).")
    max_micro_batch: int | None = Field(description="Largest micro-batch at the config's seq_len (full "
                                        "recompute); None when not even 1 fits.")
    max_seq_len: int | None = Field(description="Longest sequence (a multiple of 128) at micro-batch 1; None when "
                                    "the model states alone do not fit.")


class OneGpuAnswer(BaseModel):
    """When no layout fits: what fits on one GPU, and the options beyond this template, with their memory."""

    gpu: str
    usable_bytes: int
    params: int
    what_fits: WhatFits
    options: list[Option]
    text: list[str] = Field(description="The answer in lines, numbers included.")


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _linear_params(cfg: Config) -> int:
    """Parameters in the blocks' linear layers (what LoRA adapts and QLoRA quantizes); the embedding, the head
    and the norms stay bf16 (bitsandbytes quantizes nn.Linear, and the head is skipped by default)."""
    m = cfg.model
    hd = m.d_model // m.n_heads
    attn = 2 * m.d_model * m.n_heads * hd + 2 * m.d_model * m.n_kv_heads * hd
    ffn = m.num_experts * (3 * m.d_model * m.d_ff + m.d_model) if m.num_experts else 3 * m.d_model * m.d_ff
    return m.n_layers * (attn + ffn)


def _adapter_params(cfg: Config) -> int:
    """LoRA rank-r adapters on q, k, v, o and the MLP's three projections: r * (d_in + d_out) each."""
    m = cfg.model
    hd = m.d_model // m.n_heads
    q, kv = m.n_heads * hd, m.n_kv_heads * hd
    per = (m.d_model + q) * 2 + (m.d_model + kv) * 2 + 3 * (m.d_model + m.d_ff) * max(1, m.num_experts)
    return LORA_RANK * m.n_layers * per


def _single(cfg: Config, **train: Any) -> Config:
    """cfg on one device with full recompute (the most the ladder saves there)."""
    raw = cfg.to_dict()
    raw["parallel"] = {"dp": 1, "recompute": "full"}
    raw["hardware"] = {**raw["hardware"], "gpus_per_node": 1, "nodes": 1}
    t = {**raw["train"], **train}
    t["global_batch"] = t["micro_batch"]
    raw["train"] = t
    return from_dict(raw, validate=False)


def _states(cfg: Config) -> int:
    """The model states alone: params, the gradients the optimizer reads and AdamW state (estimator.model_states),
    not the peak moment's split (with fused AdamW on CUDA the peak can be in a backward where some gradients do
    not exist yet)."""
    return sum(model_states(cfg).values())


def _fits(cfg: Config, usable: int, hw: Any) -> tuple[bool, int]:
    e = estimate(cfg, hardware=hw)
    need = max(e.memory.total, e.init_peak_bytes)
    return need <= usable, need


def _largest(lo: int, fits: Any, cap: int) -> int | None:
    """Largest n in [lo, cap] with fits(n) (monotone), doubling then bisecting; None when fits(lo) fails."""
    if not fits(lo):
        return None
    n = lo
    while n * 2 <= cap and fits(n * 2):
        n *= 2
    hi = min(2 * n, cap + 1)
    while hi - n > 1:
        mid = (n + hi) // 2
        n, hi = (mid, hi) if fits(mid) else (n, mid)
    return n


def what_fits(cfg: Config, usable: int, hw: Any) -> WhatFits:
    """The largest family model, micro-batch and sequence this template fits on one GPU (full recompute)."""
    base = _single(cfg)
    best, best_peak = None, None
    for sec in reversed(family(base, SMALLER_WIDTHS, SMALLER_DEPTHS)):  # largest first
        c = from_dict({**base.to_dict(), "model": sec}, validate=False)
        ok, need = _fits(c, usable, hw)
        if ok:
            best, best_peak = member(sec, param_count(c)), need
            break
    mb = _largest(1, lambda n: _fits(_single(cfg, micro_batch=n), usable, hw)[0], 1 << 14)
    seq = _largest(1, lambda n: _fits(_single(cfg, micro_batch=1, seq_len=128 * n), usable, hw)[0], 1 << 12)
    return WhatFits(largest_model=best, largest_model_peak_bytes=best_peak, model_state_bytes=_states(base),
                    max_micro_batch=mb, max_seq_len=None if seq is None else 128 * seq)


def options(cfg: Config, usable: int, hw: Any) -> list[Option]:
    """Each option beyond the ladder with the per-GPU and host memory it needs for this config on one GPU."""
    one = _single(cfg)
    # The backward's moments (estimator/peak.py) with full recompute; the optimizer step's are AdamW's own.
    back = [q for q in step_moments(layout_of(one), 0) if q.phase != "optimizer step"]
    acts = max(q.activations + q.other for q in back)  # activations, loss and workspace, no model state
    n, lin, ad = param_count(cfg), _linear_params(cfg), _adapter_params(cfg)
    m = cfg.model
    layer = max(lin // m.n_layers, m.vocab_size * m.d_model)  # the largest unit gathered at once (a block or the head)
    # this template's fp32 master weights and gradients, the backward's own peak, 8-bit states
    full8 = int((FULL_ADAMW_B - 8) * n) + max(q.total for q in back) + int(ADAM8BIT_B * n)
    rows = [
        ("LoRA, frozen bf16 base", "PEFT LoraConfig(r=16, target_modules=all linear) on a bf16 model",
         f"adapters only ({ad / 1e6:.0f}M parameters, r={LORA_RANK})",
         int(BF16_B * n + ADAPTER_B * ad) + acts, 0, 0),
        ("QLoRA, frozen 4-bit NF4 base", "bitsandbytes BitsAndBytesConfig(load_in_4bit=True, nf4, double quant) "
         "+ PEFT LoRA", f"adapters only ({ad / 1e6:.0f}M parameters)",
         int(NF4_B * lin + BF16_B * (n - lin) + ADAPTER_B * ad) + acts, 0, 0),
        ("8-bit AdamW states", "bitsandbytes.optim.AdamW8bit in place of torch.optim.AdamW", "all parameters",
         full8, 0, 0),
        ("CPU offload of the optimizer state", "DeepSpeed ZeRO-Offload (zero_optimization.offload_optimizer."
         "device=cpu)", "all parameters (the optimizer step runs on the CPU)",
         int(OFFLOAD_OPT_GPU_B * n + OFFLOAD_ALL_LAYER_B * layer) + acts,
         int(OFFLOAD_OPT_HOST_B * n * HOST_BUFFER_FACTOR), 0),
        ("CPU offload of optimizer state and parameters", "FSDP2 fully_shard(offload_policy=CPUOffloadPolicy()) "
         "or DeepSpeed ZeRO-3 offload_param + offload_optimizer device=cpu", "all parameters",
         int(OFFLOAD_ALL_LAYER_B * layer) + acts, int(OFFLOAD_ALL_HOST_B * n * HOST_BUFFER_FACTOR), 0),
        ("NVMe offload of optimizer state and parameters", "DeepSpeed ZeRO-Infinity (offload_param / "
         "offload_optimizer device=nvme; Rajbhandari et al. 2021, arXiv:2104.07857)", "all parameters",
         int(OFFLOAD_ALL_LAYER_B * layer) + acts, 0, int(OFFLOAD_ALL_HOST_B * n)),
    ]
    out = []
    for name, how, trains, gpu, host, nvme in rows:
        ok = gpu <= usable
        extra = (f", host {_gib(host)}" if host else "") + (f", NVMe {_gib(nvme)}" if nvme else "")
        out.append(Option(name=name, how=how, trains=trains, gpu_bytes=gpu, fits=ok, host_bytes=host,
                          nvme_bytes=nvme, text=f"{name} (outside this template: {how}): GPU {_gib(gpu)} "
                          f"({'fits' if ok else 'over'} {_gib(usable)} usable){extra}; trains {trains}"))
    return out


def one_gpu_answer(config: str | Path | dict[str, Any] | Config, gpu: str | None = None,
                   overrides: dict[str, Any] | None = None, *, hardware: Any = None,
                   probe: dict[str, Any] | None = None, root: str | Path | None = None) -> OneGpuAnswer:
    """What fits on one GPU (`gpu`, or the config's gpu_memory_gib) and the options beyond the ladder."""
    cfg = load_any(config, overrides, root=root)
    if gpu:
        cfg = with_gpu(cfg, gpu)
        hardware = hardware or get_profile(gpu).name
    e = estimate(_single(cfg), hardware=hardware, probe=probe)
    usable, hw = e.usable_bytes, e.hardware
    fit, opts = what_fits(cfg, usable, hw), options(cfg, usable, hw)
    n = param_count(cfg)
    lines = [f"On one {hw.name} ({_gib(usable)} usable) this template trains, with full recompute:"]
    lm = fit.largest_model
    layers = f"{lm.n_layers} layer{'s' * (lm.n_layers > 1)}" if lm else ""
    lines.append(f"  the largest model of this shape: {lm.params / 1e9:.2f}B parameters (d_model {lm.d_model}, "
                 f"{layers}; peak {_gib(fit.largest_model_peak_bytes or 0)})" if lm else
                 "  no model of this shape, even one layer at a sixteenth of the width")
    if fit.max_seq_len is None:
        lines.append(f"  this {n / 1e9:.2f}B model: no micro-batch or sequence length (its model states alone are "
                     f"{_gib(fit.model_state_bytes)}, {FULL_ADAMW_B:g} B per parameter)")
    else:
        lines.append(f"  this {n / 1e9:.2f}B model: micro-batch up to {fit.max_micro_batch or 0} at seq_len "
                     f"{cfg.train.seq_len}, seq_len up to {fit.max_seq_len} at micro-batch 1")
    lines.append("Beyond this template's ladder (other libraries; per-GPU need with the estimator's activations):")
    lines += [f"  {o.text}" for o in opts]
    return OneGpuAnswer(gpu=hw.name, usable_bytes=usable, params=n, what_fits=fit, options=opts, text=lines)
