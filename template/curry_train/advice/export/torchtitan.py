"""torchtitan: the job TOML's [model], [training], [parallelism], [activation_checkpoint] and [compile] sections.

Keys are those of torchtitan v0.2.2's `torchtitan/config/job_config.py` (Training, Parallelism,
ActivationCheckpoint, Compile; the last release that reads TOML job files, `--job.config_file`). torchtitan 0.3
dropped the TOML files for Python config registries but kept the same `<section>.<key>` names as command-line
overrides, so each line here is also `--parallelism.tensor_parallel_degree 8` there.
Memory: torchtitan applies FSDP2 `fully_shard` with MixedPrecisionPolicy(param bf16, reduce fp32) to each block
(torchtitan/models/llama3/infra/parallelize.py), as this template does: fp32 sharded params, grads and AdamW
state, 16 B per parameter over the shard group.
"""

from __future__ import annotations

from curry_train.advice.beyond import FULL_ADAMW_B  # this template's AdamW model states per parameter
from curry_train.advice.export.common import Rendered, dp_shard_group, toml_text
from curry_train.config import Config
from curry_train.estimator import Estimate
from curry_train.moe_blocks import dense_width, shared_width
from curry_train.pipeline_split import split_for, stage_layer_range

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}  # torch's schedule names
# torchtitan/models/llama3/__init__.py flavors: (dim, n_layers, n_heads, n_kv_heads, ffn hidden, vocab)
FLAVORS = {(4096, 32, 32, 8, 14336, 128256): "8B", (8192, 80, 64, 8, 28672, 128256): "70B",
           (16384, 126, 128, 8, 53248, 128256): "405B"}


def _stage_fqns(cfg: Config) -> list[list[str]]:
    """The template's own split (pipeline_split.py) in torchtitan's module names, which are the template's."""
    counts = split_for(cfg)
    parts = []
    for s in range(len(counts)):
        names = [f"layers.{i}" for i in stage_layer_range(counts, s)]
        parts.append((["tok_embeddings"] if s == 0 else []) + names + (["norm", "output"] if s == len(counts) - 1
                                                                        else []))
    return parts


def deepseek_v3_args(cfg: Config, gaps: list[str]) -> str:
    """This MLA model as torchtitan's deepseek_v3 model arguments (v0.2.2: DeepSeekV3ModelArgs in
    torchtitan/models/deepseek_v3/model/args.py, MoEArgs in torchtitan/models/moe/moe.py), the one torchtitan
    model with MLA. Its router as this template's: softmax over the experts, top-k, gates renormalised (route_norm)
    and applied to the expert outputs (score_before_experts false), groups scored by their top-2 probabilities.
    original_seq_len = the sequence length turns YaRN off (model/mla.py applies plain RoPE). A dense model is all
    dense layers (n_dense_layers = n_layers)."""
    m, E = cfg.model, cfg.model.num_experts
    moe = (f"MoEArgs(num_experts={E}, num_shared_experts={m.n_shared_experts}, top_k={m.top_k}, "
           f'score_func="softmax", route_norm=True, score_before_experts=False, load_balance_coeff=None'
           + (f", num_expert_groups={m.route_groups}, num_limited_groups={m.route_top_groups}"
              if m.route_groups > 1 else "") + ")") if E else "MoEArgs()"
    if E and (m.aux_loss_coef > 0 or m.z_loss_coef > 0):
        gaps.append("aux_loss_coef / z_loss_coef: torchtitan's MoE has no router loss (its load_balance_coeff is "
                    "DeepSeek-V3's bias balancing, left off here)")
    if E and m.capacity_factor > 0:
        gaps.append("capacity_factor: torchtitan's token-choice routing drops no token")
    if E and shared_width(m) != m.n_shared_experts * m.d_ff:
        gaps.append(f"shared_d_ff={m.shared_d_ff}: torchtitan's shared experts are num_shared_experts x "
                    "moe_inter_dim wide")
    return (f"DeepSeekV3ModelArgs(vocab_size={m.vocab_size}, dim={m.d_model}, inter_dim={dense_width(m)}, "
            f"moe_inter_dim={m.d_ff}, n_layers={m.n_layers}, n_dense_layers={m.first_k_dense if E else m.n_layers}, "
            f"n_heads={m.n_heads}, norm_eps={m.norm_eps}, moe_args={moe}, q_lora_rank={m.q_lora_rank}, "
            f"kv_lora_rank={m.kv_lora_rank}, qk_nope_head_dim={m.qk_nope_head_dim}, "
            f"qk_rope_head_dim={m.qk_rope_head_dim}, v_head_dim={m.v_head_dim}, rope_theta={m.rope_theta}, "
            f"max_seq_len={cfg.train.seq_len}, original_seq_len={cfg.train.seq_len})")


def render(cfg: Config, est: Estimate) -> Rendered:
    p, t, m = cfg.parallel, cfg.train, cfg.model
    gaps: list[str] = []
    flavor = FLAVORS.get((m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size))
    mla = deepseek_v3_args(cfg, gaps) if m.attention == "mla" else ""
    if mla:
        gaps.append("[model] flavor: register flavor 'custom' in torchtitan/models/deepseek_v3/__init__.py "
                    f"deepseekv3_args as {mla} (also in the file's header)")
    elif flavor is None or m.num_experts:
        gaps.append("[model] flavor: torchtitan builds a model from a registered flavor (model name + flavor); "
                    "no llama3 flavor has these dims, so register one with them (the file names 'custom')")
    par: dict = {"data_parallel_replicate_degree": p.dp if p.zero == 0 else p.dp_replicate,
                 "data_parallel_shard_degree": 1 if p.zero == 0 else dp_shard_group(cfg) // p.cp,
                 "tensor_parallel_degree": p.tp, "pipeline_parallel_degree": p.pp,
                 "context_parallel_degree": p.cp, "expert_parallel_degree": p.ep}
    if p.zero in (1, 2):
        par["fsdp_reshard_after_forward"] = "never"  # parameters stay gathered to the backward: ZeRO-2's traffic
        gaps.append(f"zero={p.zero}: torchtitan shards with FSDP only; the file shards parameters too and keeps "
                    "them gathered after the forward (fsdp_reshard_after_forward = never), ZeRO-2's communication "
                    "with FSDP's memory")
    elif p.zero == 3:
        par["fsdp_reshard_after_forward"] = "default"
    if p.zero == 0 and p.cp > 1:
        gaps.append("zero=0 with cp > 1: torchtitan's context parallelism needs FSDP over the cp ranks")
    if p.tp > 1 and not p.sp:
        gaps.append("sp=false: torchtitan's tensor parallelism always shards norms and the residual stream "
                    "over the sequence (SequenceParallel); the file gets SP")
    if p.pp > 1:
        if p.pp_schedule == "zero_bubble":
            par["pipeline_parallel_schedule"] = "ZBVZeroBubble" if p.pp_virtual == 2 else "InterleavedZeroBubble"
        else:
            par["pipeline_parallel_schedule"] = SCHEDULES[p.pp_schedule]
        par["pipeline_parallel_microbatch_size"] = t.micro_batch
        par["module_fqns_per_model_part"] = _stage_fqns(cfg)
    training = {"local_batch_size": t.global_batch // p.dp, "global_batch_size": t.global_batch,
                "seq_len": t.seq_len, "steps": t.steps,
                "mixed_precision_param": "bfloat16" if t.dtype == "bfloat16" else "float32"}
    if p.pp == 1:
        training["local_batch_size"] = t.micro_batch  # torchtitan accumulates global / (local * dp) micro-batches
    if t.grad_clip > 0:
        training["max_norm"] = t.grad_clip
    else:
        training["max_norm"] = 1e30
        gaps.append("grad_clip=0: torchtitan always clips (max_norm, default 1.0); the file sets 1e30, clipping "
                    "nothing")
    sections = {"model": {"name": "llama3", "flavor": flavor or "custom"}, "training": training,
                "parallelism": par,
                "activation_checkpoint": {"mode": p.recompute, **({"selective_ac_option": "op"}
                                                                   if p.recompute == "selective" else {})},
                "compile": {"enable": False}}
    if m.num_experts or mla:
        sections["model"]["name"] = "deepseek_v3" if mla else "custom"
    header = (f"torchtitan job config (v0.2.x TOML; 0.3: the same keys as --<section>.<key> overrides),\n"
              f"exported by curry-train from this layout: {p.model_dump()}"
              + (f"\nflavor 'custom' of deepseek_v3 (models/deepseek_v3/__init__.py):\n{mla}" if mla else ""))
    return Rendered(format="toml", filename="torchtitan.toml", text=toml_text(sections, header),
                    bytes_per_param=FULL_ADAMW_B / max(dp_shard_group(cfg), 1) if p.zero >= 1 else FULL_ADAMW_B,
                    source="FSDP2 with bf16 compute: fp32 params 4 + grads 4 + AdamW 8, over the shard group",
                    not_expressed=gaps,
                    memory=["compile.enable = false as here; torch.compile (and async TP with it) lowers "
                            "activation memory in torchtitan, which this estimate does not model"])
