"""DeepSpeed: the ds_config JSON (batch sizes, bf16, ZeRO stage and offload, clipping, AdamW).

Keys are those DeepSpeed 0.19 reads: `train_batch_size`, `train_micro_batch_size_per_gpu`,
`gradient_accumulation_steps`, `gradient_clipping` (deepspeed/runtime/constants.py) and the
`zero_optimization` section (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig; offload_config.py).
Memory: the ZeRO paper's mixed-precision Adam accounting (Rajbhandari et al. 2020, arXiv:1910.02054, §3 and
Fig. 1: 2 B half params + 2 B half grads + K = 12 B fp32 master params, momentum and variance): 16 B per
parameter at stage 0, 4 + 12/d at stage 1, 2 + 14/d at stage 2, 16/d at stage 3.
"""

from __future__ import annotations

import json

from curry_train.advice.export.common import Rendered, dp_shard_group
from curry_train.config import Config
from curry_train.estimator import Estimate


def zero_bytes_per_param(stage: int, d: int) -> float:
    return {0: 16.0, 1: 4 + 12 / d, 2: 2 + 14 / d, 3: 16 / d}[stage]


def render(cfg: Config, est: Estimate) -> Rendered:
    p, t = cfg.parallel, cfg.train
    gaps: list[str] = []
    for name, size, how in (("tp", p.tp, "AutoTP or Megatron-DeepSpeed model code"),
                            ("pp", p.pp, "deepspeed.pipe.PipelineModule in the model code"),
                            ("cp", p.cp, "DeepSpeed-Ulysses sequence parallelism in the model code"),
                            ("ep", p.ep, "deepspeed.moe.layer.MoE(ep_size=...) in the model code")):
        if size > 1:
            gaps.append(f"{name}={size}: the JSON has no {name} degree ({how}); this file is the data-parallel "
                        f"part only, over dp={p.dp} ranks")
    if p.recompute != "none":
        gaps.append(f"recompute={p.recompute}: DeepSpeed's activation_checkpointing section only configures "
                    "deepspeed.checkpointing.checkpoint calls in the model code; wrap each block with it (or "
                    "torch.utils.checkpoint) yourself")
    zero: dict = {"stage": p.zero, "overlap_comm": True, "contiguous_gradients": True,
                  "offload_optimizer": {"device": "none"}}
    if p.zero == 3:
        zero["offload_param"] = {"device": "none"}
    if p.dp_replicate > 1:
        gaps.append(f"dp_replicate={p.dp_replicate}: ZeRO has no HSDP; ZeRO++'s hpZ (zero_hpz_partition_size) "
                    "keeps a secondary parameter shard per group but still shards the primary over every rank")
    if p.zero >= 1 and p.dp * p.cp == 1:
        gaps.append("zero >= 1 at one data-parallel rank shards nothing")
    out: dict = {"train_batch_size": t.global_batch, "train_micro_batch_size_per_gpu": t.micro_batch,
                 "gradient_accumulation_steps": t.global_batch // (p.dp * t.micro_batch),
                 "bf16": {"enabled": t.dtype == "bfloat16"}, "zero_optimization": zero,
                 "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "weight_decay": t.weight_decay}}}
    if t.grad_clip > 0:
        out["gradient_clipping"] = t.grad_clip
    if t.lr_schedule == "cosine" or t.warmup_steps:
        gaps.append(f"lr_schedule={t.lr_schedule}, warmup_steps={t.warmup_steps}: DeepSpeed's WarmupCosineLR "
                    "decays to a ratio of lr, not to lr/10 after a linear warm-up from lr/(w+1); set the scheduler "
                    "in the script")
    d = dp_shard_group(cfg) if p.zero >= 2 else p.dp * p.cp
    return Rendered(format="json", filename="ds_config.json", text=json.dumps(out, indent=2) + "\n",
                    bytes_per_param=zero_bytes_per_param(p.zero, d),
                    source=f"ZeRO stage {p.zero}, bf16 weights and grads + 12 B fp32 Adam state (ZeRO paper Fig. 1)",
                    not_expressed=gaps,
                    memory=["DeepSpeed keeps bf16 weights and gradients beside its fp32 master copy; this template "
                            "keeps fp32 weights and gradients and casts each block to bf16 for compute, so the "
                            "estimate also holds the bf16 working copies (param_copies) DeepSpeed does not"])
