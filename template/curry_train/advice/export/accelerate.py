"""Accelerate: the `accelerate launch --config_file` YAML for FSDP2 (or DDP), with its parallelism_config.

Keys are accelerate 1.16's: the top level is ClusterConfig (accelerate/commands/config/config_args.py, which
refuses unknown keys), `fsdp_config` and `parallelism_config` hold `accelerate launch` arguments without the
leading dashes (accelerate/commands/launch.py: --fsdp_version, --fsdp_reshard_after_forward, ...,
--parallelism_config_tp_size). Memory: FSDP2 `fully_shard`, as this template's ZeRO-3: fp32 sharded params,
grads and AdamW state, 16 B per parameter over the shard group.
"""

from __future__ import annotations

import yaml

from curry_train.advice.beyond import FULL_ADAMW_B  # this template's AdamW model states per parameter
from curry_train.advice.export.common import Rendered, dp_shard_group
from curry_train.config import Config
from curry_train.estimator import Estimate


def render(cfg: Config, est: Estimate) -> Rendered:
    p, t, h = cfg.parallel, cfg.train, cfg.hardware
    gaps = [f"micro_batch={t.micro_batch}, global_batch={t.global_batch}: the YAML holds no batch sizes; give the "
            f"DataLoader batch_size={t.micro_batch} and Accelerator(gradient_accumulation_steps="
            f"{t.global_batch // (p.dp * t.micro_batch)}) in the script"]
    for name, size in (("pp", p.pp), ("ep", p.ep)):
        if size > 1:
            gaps.append(f"{name}={size}: Accelerate's FSDP config has no {name} degree; this file leaves it out")
    out: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False,
                 "mixed_precision": "bf16" if t.dtype == "bfloat16" else "no", "num_machines": h.nodes,
                 "num_processes": cfg.world_size, "machine_rank": 0, "main_training_function": "main",
                 "rdzv_backend": "static", "same_network": True, "use_cpu": h.device == "cpu"}
    if p.zero == 0 and p.tp == 1 and p.cp == 1:
        out["distributed_type"] = "MULTI_GPU" if h.device != "cpu" else "MULTI_CPU"
    else:
        if p.zero < 2:
            gaps.append(f"zero={p.zero}: Accelerate shards with FSDP; the file keeps parameters gathered after the "
                        "forward (fsdp_reshard_after_forward: false, ZeRO-2's traffic with FSDP's memory)")
        out["distributed_type"] = "FSDP"
        out["fsdp_config"] = {"fsdp_version": 2, "fsdp_reshard_after_forward": p.zero == 3,
                              "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_activation_checkpointing": p.recompute != "none", "fsdp_offload_params": False,
                              "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True}
        gaps.append("fsdp_transformer_layer_cls_to_wrap: absent, so Accelerate wraps the model's "
                    "_no_split_modules (transformers models); set it to your block class otherwise")
        if p.recompute == "selective":
            gaps.append("recompute=selective: fsdp_activation_checkpointing is full per-block checkpointing")
        if p.tp > 1 or p.cp > 1 or p.dp_replicate > 1:
            out["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": p.dp_replicate,
                "parallelism_config_dp_shard_size": p.dp // p.dp_replicate,
                "parallelism_config_tp_size": p.tp, "parallelism_config_cp_size": p.cp}
    sharded = out["distributed_type"] == "FSDP"
    return Rendered(format="yaml", filename="accelerate_fsdp.yaml", text=yaml.safe_dump(out, sort_keys=False),
                    bytes_per_param=FULL_ADAMW_B / dp_shard_group(cfg) if sharded else FULL_ADAMW_B,
                    source="FSDP2 over the shard group: fp32 params 4 + grads 4 + AdamW 8" if sharded else
                    "DDP: fp32 params 4 + grads 4 + AdamW 8, replicated", not_expressed=gaps,
                    memory=["a script that loads the model in bf16 (torch_dtype=bfloat16) shards bf16 params, "
                            "grads and AdamW state: 8 B per parameter, half of the figure above, and no fp32 "
                            "master copy"])
