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
            "--moe-router-topk", "--moe-aux-loss-coeff", "--moe-expert-capacity-factor"}
MEGATRON_CHOICES = {"--data-parallel-sharding-strategy": {"no_shard", "optim", "optim_grads", "optim_grads_params"},
                    "--recompute-granularity": {"full", "selective"}, "--recompute-method": {"uniform", "block"},
                    "--normalization": {"LayerNorm", "RMSNorm"},
                    "--position-embedding-type": {"learned_absolute", "rope", "mrope", "relative", "none"}}
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
