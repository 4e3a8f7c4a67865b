"""export_layout: the llama3-70b plan's final layout (and a 4-D one) as each target framework's own config.

    .venv/bin/pytest -n 0 -q tests/test_export.py

Every key or flag an export writes must be one the target reads. Where the target's own config class is
importable here (torchtitan's JobConfig dataclasses, DeepSpeed's DeepSpeedZeroConfig, Accelerate's ClusterConfig
and `accelerate launch` parser) a test feeds it the export; none of them is a dependency of this project, so
those tests skip when the package is absent. The name checks below always run, against the target's documented
names quoted here with their source.
"""

from __future__ import annotations

import json
import shlex
import tomllib

import pytest
import yaml
from curry_train.advice.export import FRAMEWORKS, export_layout
from curry_train.advice.export.common import local_params
from curry_train.advice.planner import plan
from curry_train.config import ConfigError, load_config

# torchtitan v0.2.2, torchtitan/config/job_config.py: the fields of the sections an export writes.
TORCHTITAN = {
    "model": {"name", "flavor", "hf_assets_path", "tokenizer_path", "converters", "print_after_conversion"},
    "training": {"dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps",
                 "enable_cpu_offload", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq",
                 "gc_debug", "dataloader"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel",
                    "pipeline_parallel_degree", "module_fqns_per_model_part",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_expert_parallel_overlap", "context_parallel_degree",
                    "context_parallel_load_balancer", "context_parallel_rotate_method", "expert_parallel_degree",
                    "expert_tensor_parallel_degree", "expert_parallel_comm_backend"},
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
                              "early_stop", "memory_budget", "visualize_memory_budget_pareto",
                              "preserve_rng_state", "determinism_check", "debug"},
    "compile": {"enable", "components", "backend"},
}
TORCHTITAN_AC_MODES = {"selective", "full", "memory_budget", "none"}  # ActivationCheckpoint.mode's Literal
# Megatron-LM core_v0.15.0, megatron/training/arguments.py: group.add_argument('--...') of each flag an export
# may write, with the choices of the ones that have them.
MEGATRON = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
            "--expert-model-parallel-size", "--micro-batch-size", "--global-batch-size", "--train-iters", "--lr",
            "--weight-decay", "--clip-grad", "--bf16", "--sequence-parallel", "--use-distributed-optimizer",
            "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--ckpt-format",
            "--num-distributed-optimizer-instances", "--num-virtual-stages-per-pipeline-rank",
            "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--lr-decay-style",
            "--min-lr", "--lr-warmup-iters", "--num-layers", "--hidden-size", "--ffn-hidden-size",
            "--num-attention-heads", "--seq-length", "--max-position-embeddings", "--tokenizer-type",
            "--vocab-size", "--make-vocab-size-divisible-by", "--swiglu", "--normalization", "--norm-epsilon",
            "--position-embedding-type", "--rotary-base", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "--num-experts",
            "--moe-router-topk", "--moe-aux-loss-coeff", "--moe-expert-capacity-factor",
            # _add_network_size_args / _add_mla_args (MLATransformerConfig) / _add_moe_args
            "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
            "--v-head-dim", "--rope-type", "--moe-ffn-hidden-size", "--moe-layer-freq", "--moe-z-loss-coeff",
            "--moe-shared-expert-intermediate-size", "--moe-shared-expert-overlap", "--moe-token-dispatcher-type",
            "--moe-router-num-groups", "--moe-router-group-topk"}
MEGATRON_CHOICES = {"--data-parallel-sharding-strategy": {"no_shard", "optim", "optim_grads", "optim_grads_params"},
                    "--rope-type": {"rope", "yarn"}, "--moe-token-dispatcher-type": {"allgather", "alltoall", "flex"},
                    "--recompute-granularity": {"full", "selective"}, "--recompute-method": {"uniform", "block"},
                    "--normalization": {"LayerNorm", "RMSNorm"},
                    "--position-embedding-type": {"learned_absolute", "rope", "mrope", "relative", "none"}}
# torchtitan v0.2.2: DeepSeekV3ModelArgs (torchtitan/models/deepseek_v3/model/args.py) and MoEArgs
# (torchtitan/models/moe/moe.py) fields, the model arguments of its one model with MLA
TORCHTITAN_DSV3 = {"max_batch_size", "max_seq_len", "vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers",
                   "n_dense_layers", "n_heads", "norm_eps", "moe_args", "expert_parallel_comm_backend",
                   "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "attn_type",
                   "attn_mask_type", "original_seq_len", "rope_theta", "rope_factor", "beta_fast", "beta_slow",
                   "mscale"}
TORCHTITAN_MOE = {"num_experts", "num_shared_experts", "score_func", "route_norm", "route_scale", "gate_bias",
                  "score_before_experts", "top_k", "num_expert_groups", "num_limited_groups", "use_grouped_mm",
                  "load_balance_coeff"}
# DeepSpeed 0.19.8: deepspeed/runtime/constants.py (top level) and deepspeed/runtime/zero/config.py,
# offload_config.py (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig / ParamConfig fields).
DEEPSPEED_TOP = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16",
                 "gradient_clipping", "zero_optimization", "optimizer"}
DEEPSPEED_ZERO = {"stage", "contiguous_gradients", "overlap_comm", "offload_optimizer", "offload_param",
                  "reduce_bucket_size", "allgather_bucket_size", "zero_hpz_partition_size"}
# Accelerate 1.16.0: accelerate/commands/config/config_args.py (BaseConfig + ClusterConfig fields) and
# accelerate/commands/launch.py (the --fsdp_* and --parallelism_config_* arguments these sections hold).
ACCELERATE_TOP = {"compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug",
                  "num_processes", "machine_rank", "num_machines", "gpu_ids", "main_process_ip",
                  "main_process_port", "rdzv_backend", "same_network", "main_training_function",
                  "enable_cpu_affinity", "deepspeed_config", "fsdp_config", "parallelism_config",
                  "megatron_lm_config", "mpirun_config", "dynamo_config"}
ACCELERATE_FSDP = {"fsdp_version", "fsdp_offload_params", "fsdp_min_num_params", "fsdp_sharding_strategy",
                   "fsdp_reshard_after_forward", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
                   "fsdp_backward_prefetch", "fsdp_state_dict_type", "fsdp_forward_prefetch",
                   "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states",
                   "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload"}
ACCELERATE_PARALLELISM = {"parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size",
                          "parallelism_config_tp_size", "parallelism_config_cp_size"}

FOUR_D = {"parallel.dp": 2, "parallel.tp": 8, "parallel.sp": True, "parallel.pp": 4, "parallel.pp_virtual": 2,
          "parallel.pp_schedule": "interleaved_1f1b", "parallel.zero": 2, "parallel.recompute": "selective",
          "train.micro_batch": 1, "train.global_batch": 64, "hardware.nodes": 8}
ZERO1 = {"parallel.dp": 8, "parallel.tp": 1, "parallel.sp": False, "parallel.pp": 4, "parallel.zero": 1,
         "parallel.recompute": "full", "train.micro_batch": 1, "train.global_batch": 64, "hardware.nodes": 4}


@pytest.fixture(scope="module")
def plan_final() -> dict:
    """The llama3-70b plan of the README (4 nodes of 8 x 80 GiB, 4096 tokens, 256 sequences): its final layout."""
    p = plan("llama3-70b", 8, 4, 80.0, 4096, 256)
    assert p.fits
    return {**p.final_patch, "train.seq_len": 4096, "train.global_batch": 256, "hardware.nodes": 4,
            "hardware.gpus_per_node": 8}


def _argv(text: str) -> list[str]:
    return shlex.split(text.replace("\\\n", " "))


def _flags(text: str) -> list[str]:
    return [a for a in _argv(text) if a.startswith("--")]


def _parsed(e) -> dict:
    return {"toml": tomllib.loads, "json": json.loads, "yaml": yaml.safe_load}[e.format](e.text)


@pytest.mark.parametrize("overrides", ["plan", "4d", "zero1"])
def test_every_key_is_one_the_target_reads(project, plan_final, overrides):
    ov = {"plan": plan_final, "4d": FOUR_D, "zero1": ZERO1}[overrides]
    tt = _parsed(export_layout("llama3-70b", "torchtitan", ov, root=project))
    for section, keys in tt.items():
        assert set(keys) <= TORCHTITAN[section], (section, set(keys) - TORCHTITAN[section])
    assert tt["activation_checkpoint"]["mode"] in TORCHTITAN_AC_MODES
    meg = export_layout("llama3-70b", "megatron", ov, root=project).text
    assert set(_flags(meg)) <= MEGATRON, set(_flags(meg)) - MEGATRON
    argv = _argv(meg)
    for flag, choices in MEGATRON_CHOICES.items():
        if flag in argv:
            assert argv[argv.index(flag) + 1] in choices, flag
    ds = _parsed(export_layout("llama3-70b", "deepspeed", ov, root=project))
    assert set(ds) <= DEEPSPEED_TOP and set(ds["zero_optimization"]) <= DEEPSPEED_ZERO
    acc = _parsed(export_layout("llama3-70b", "accelerate", ov, root=project))
    assert set(acc) <= ACCELERATE_TOP and set(acc.get("fsdp_config", {})) <= ACCELERATE_FSDP
    assert set(acc.get("parallelism_config", {})) <= ACCELERATE_PARALLELISM


def test_plan_final_values_reach_every_target(project, plan_final):
    """ZeRO-3 over 32 ranks, full recompute, micro-batch from the plan: each target says so in its own terms."""
    mb = plan_final["train.micro_batch"]
    assert plan_final["parallel.zero"] == 3 and plan_final["parallel.recompute"] == "full"
    tt = _parsed(export_layout("llama3-70b", "torchtitan", plan_final, root=project))
    assert tt["parallelism"]["data_parallel_shard_degree"] == 32 and tt["model"]["flavor"] == "70B"
    assert tt["activation_checkpoint"]["mode"] == "full" and tt["training"]["local_batch_size"] == mb
    argv = _argv(export_layout("llama3-70b", "megatron", plan_final, root=project).text)
    assert argv[argv.index("--data-parallel-sharding-strategy") + 1] == "optim_grads_params"
    assert argv[argv.index("--micro-batch-size") + 1] == str(mb) and "--recompute-granularity" in argv
    assert argv[argv.index("--vocab-size") + 1] == "128255"  # + NullTokenizer's eod id = 128256
    ds = _parsed(export_layout("llama3-70b", "deepspeed", plan_final, root=project))
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 32
    acc = _parsed(export_layout("llama3-70b", "accelerate", plan_final, root=project))
    assert acc["distributed_type"] == "FSDP" and acc["num_processes"] == 32 and acc["num_machines"] == 4
    assert acc["fsdp_config"]["fsdp_reshard_after_forward"] is True


def test_four_d_layout_names_what_each_target_cannot_express(project):
    by = {f: export_layout("llama3-70b", f, FOUR_D, root=project) for f in FRAMEWORKS}
    ds = " ".join(by["deepspeed"].not_expressed)
    assert "tp=8" in ds and "pp=4" in ds and "recompute=selective" in ds
    assert any(g.startswith("pp=4") for g in by["accelerate"].not_expressed)
    assert any(g.startswith("zero=2") for g in by["torchtitan"].not_expressed)
    argv = _argv(by["megatron"].text)
    assert {"--sequence-parallel", "--use-megatron-fsdp"} <= set(argv)
    assert argv[argv.index("--data-parallel-sharding-strategy") + 1] == "optim_grads"
    assert argv[argv.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    parts = _parsed(by["torchtitan"])["parallelism"]["module_fqns_per_model_part"]
    assert len(parts) == 8 and parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    assert [n for p in parts for n in p if n.startswith("layers.")] == [f"layers.{i}" for i in range(80)]
    zb = export_layout("llama3-70b", "megatron", {**FOUR_D, "parallel.pp_schedule": "zero_bubble"}, root=project)
    assert any(g.startswith("pp_schedule=zero_bubble") for g in zb.not_expressed)


def test_memory_figures_are_the_estimators_and_the_targets_documented_bytes(project):
    """Megatron's distributed optimizer at d = 8: 6 + 12/8 = 7.5 B per local parameter (dist_optimizer.md);
    DeepSpeed ZeRO-1: 4 + 12/8 = 5.5 B (ZeRO paper Fig. 1)."""
    from curry_train.estimator import estimate

    cfg = load_config(project / "configs" / "llama3-70b.yaml", ZERO1)
    n = local_params(cfg)
    assert 70.6e9 / 4 < n < 70.6e9 / 4 * 1.1  # pp 4 of the 70.6B, a stage with the embedding or head the largest
    for f, bpp in (("megatron", 7.5), ("deepspeed", 5.5)):
        e = export_layout("llama3-70b", f, ZERO1, root=project)
        assert e.target_model_states_gib == pytest.approx(n * bpp / 2**30)
        assert e.template_model_states_gib == pytest.approx(estimate(cfg).model_state_bytes / 2**30)
        assert f"{bpp:.2f} B/param" in e.memory[0]


def test_bad_framework_and_config_are_refused(project):
    with pytest.raises(ConfigError, match="framework"):
        export_layout("llama3-70b", "jax", root=project)
    with pytest.raises(FileNotFoundError):
        export_layout("nope", "megatron", root=project)


# ------------------------------------------------------------------ the targets' own classes, where installed


def test_torchtitan_job_config_accepts_the_export(project, plan_final, tmp_path):
    job_config = pytest.importorskip("torchtitan.config.job_config")
    from torch.distributed.pipelining.schedules import get_schedule_class

    for ov in (plan_final, FOUR_D, ZERO1):
        doc = _parsed(export_layout("llama3-70b", "torchtitan", ov, root=project))
        fields = job_config.JobConfig.__dataclass_fields__
        for section, values in doc.items():
            fields[section].default_factory(**values)  # a key it does not read is a TypeError
        if "pipeline_parallel_schedule" in doc["parallelism"]:
            get_schedule_class(doc["parallelism"]["pipeline_parallel_schedule"])


def test_deepspeed_zero_config_accepts_the_export(project, plan_final):
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    for ov in (plan_final, FOUR_D, ZERO1):
        doc = _parsed(export_layout("llama3-70b", "deepspeed", ov, root=project))
        zero_config.DeepSpeedZeroConfig(**doc["zero_optimization"])  # extra="forbid": unknown keys fail


def test_accelerate_cluster_config_and_launch_parser_accept_the_export(project, plan_final, tmp_path):
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    from accelerate.commands.launch import launch_command_parser

    for i, ov in enumerate((plan_final, FOUR_D, ZERO1)):
        e = export_layout("llama3-70b", "accelerate", ov, root=project)
        path = tmp_path / f"acc{i}.yaml"
        path.write_text(e.text)
        config_args.ClusterConfig.from_yaml_file(path)  # refuses unknown top-level keys
        doc = _parsed(e)
        argv = [f"--{k}={v}" for sec in ("fsdp_config", "parallelism_config") for k, v in doc.get(sec, {}).items()]
        launch_command_parser().parse_args([*argv, "train.py"])  # an unknown --fsdp_* argument exits


# ------------------------------------------------------------------ MLA and DeepSeekMoE (configs/deepseek-v3.yaml)


def _call_kwargs(src: str, name: str) -> dict:
    """The keyword arguments of the call `name(...)` in `src` as Python values (nested calls as their kwargs)."""
    import ast

    def value(node):
        if isinstance(node, ast.Call):
            return {"": node.func.id, **{k.arg: value(k.value) for k in node.keywords}}
        return ast.literal_eval(node)

    call = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == name)
    return value(call)


def test_mla_and_deepseek_moe_reach_megatron_and_torchtitan_by_their_own_names(project):
    """DeepSeek-V3's published run: MLA's ranks and head dims, the dense first blocks, the shared expert and the
    node-limited routing, each as the flag (Megatron-LM core_v0.15.0 arguments.py) or model argument (torchtitan
    v0.2.2 deepseek_v3) that builds it; the template's plain RoPE, not the YaRN both default MLA to."""
    meg = export_layout("deepseek-v3", "megatron", root=project)
    argv = _argv(meg.text)
    assert set(_flags(meg.text)) <= MEGATRON, set(_flags(meg.text)) - MEGATRON
    val = {f: argv[i + 1] for i, f in enumerate(argv[:-1]) if f.startswith("--") and not argv[i + 1].startswith("--")}
    assert {"--multi-latent-attention", "--moe-shared-expert-overlap"} <= set(argv)  # EP64: overlapped combine
    assert {k: val[k] for k in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                                "--v-head-dim", "--rope-type", "--ffn-hidden-size", "--moe-ffn-hidden-size",
                                "--moe-layer-freq", "--moe-shared-expert-intermediate-size",
                                "--moe-router-num-groups", "--moe-router-group-topk",
                                "--moe-token-dispatcher-type")} == {
        "--q-lora-rank": "1536", "--kv-lora-rank": "512", "--qk-head-dim": "128", "--qk-pos-emb-head-dim": "64",
        "--v-head-dim": "128", "--rope-type": "rope", "--ffn-hidden-size": "18432", "--moe-ffn-hidden-size": "2048",
        "--moe-layer-freq": "([0]*3+[1]*58)", "--moe-shared-expert-intermediate-size": "2048",
        "--moe-router-num-groups": "8", "--moe-router-group-topk": "4", "--moe-token-dispatcher-type": "alltoall"}
    for flag, choices in MEGATRON_CHOICES.items():
        if flag in val:
            assert val[flag] in choices, flag
    assert "--group-query-attention" not in argv  # MLA has a K/V head per query head
    tt = export_layout("deepseek-v3", "torchtitan", root=project)
    doc = _parsed(tt)
    assert doc["model"] == {"name": "deepseek_v3", "flavor": "custom"}
    assert doc["parallelism"]["expert_parallel_degree"] == 64
    args = _call_kwargs(next(ln[2:] for ln in tt.text.splitlines() if ln.startswith("# DeepSeekV3ModelArgs(")),
                        "DeepSeekV3ModelArgs")
    moe = args.pop("moe_args")
    assert args.pop("") == "DeepSeekV3ModelArgs" and moe.pop("") == "MoEArgs"
    assert set(args) <= TORCHTITAN_DSV3 and set(moe) <= TORCHTITAN_MOE
    assert {k: args[k] for k in ("dim", "inter_dim", "moe_inter_dim", "n_layers", "n_dense_layers", "n_heads",
                                 "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                 "v_head_dim")} == {
        "dim": 7168, "inter_dim": 18432, "moe_inter_dim": 2048, "n_layers": 61, "n_dense_layers": 3, "n_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    assert args["original_seq_len"] == args["max_seq_len"] == 4096  # no YaRN
    assert moe == {"num_experts": 256, "num_shared_experts": 1, "top_k": 8, "score_func": "softmax",
                   "route_norm": True, "score_before_experts": False, "load_balance_coeff": None,
                   "num_expert_groups": 8, "num_limited_groups": 4}


def test_a_dense_mla_model_without_a_query_latent(project):
    """tiny-mla with q_lora_rank 0: Megatron gets no --q-lora-rank (its None: queries without a latent);
    torchtitan's deepseek_v3 gets every layer dense."""
    argv = _argv(export_layout("tiny-mla", "megatron", {"model.q_lora_rank": 0}, root=project).text)
    assert "--multi-latent-attention" in argv and "--q-lora-rank" not in argv and "--num-experts" not in argv
    tt = export_layout("tiny-mla", "torchtitan", {"model.q_lora_rank": 0}, root=project)
    args = _call_kwargs(next(ln[2:] for ln in tt.text.splitlines() if ln.startswith("# DeepSeekV3ModelArgs(")),
                        "DeepSeekV3ModelArgs")
    assert args["n_dense_layers"] == args["n_layers"] == 4 and args["q_lora_rank"] == 0
