"""Megatron-LM: the `pretrain_gpt.py` arguments for this layout and model.

Argument names are those of Megatron-LM core_v0.15.0's `megatron/training/arguments.py` (later releases build
the same flags from the TransformerConfig / ModelParallelConfig dataclass fields). Memory: with --bf16 Megatron
keeps bf16 parameters and an fp32 main-gradient buffer (6 B per parameter), and fp32 main params + Adam m and v
(12 B) that --use-distributed-optimizer shards over the data-parallel ranks (Megatron-LM
docs/source/api-guide/dist_optimizer.md, its table: 18 B non-distributed, 6 + 12/d distributed). ZeRO-2/3
go to Megatron FSDP (--use-megatron-fsdp, --data-parallel-sharding-strategy optim_grads / optim_grads_params).
"""

from __future__ import annotations

import shlex

from curry_train.advice.export.common import Rendered, dp_shard_group
from curry_train.config import Config
from curry_train.estimator import Estimate
from curry_train.moe_blocks import dense_width, shared_width

STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}


def _model_args(cfg: Config, gaps: list[str]) -> list[str]:
    """The model's shape; --vocab-size is V - 1 because NullTokenizer adds its end-of-document id on top
    (megatron/training/tokenizer/tokenizer.py, _NullTokenizer.vocab_size), and divisible-by 1 keeps it V.
    --ffn-hidden-size is the dense blocks' width (a MoE model's first_k_dense blocks), --moe-ffn-hidden-size
    the experts'."""
    m, t = cfg.model, cfg.train
    args = ["--num-layers", m.n_layers, "--hidden-size", m.d_model, "--ffn-hidden-size", dense_width(m),
            "--num-attention-heads", m.n_heads, "--seq-length", t.seq_len, "--max-position-embeddings",
            t.seq_len, "--tokenizer-type", "NullTokenizer", "--vocab-size", m.vocab_size - 1,
            "--make-vocab-size-divisible-by", 1, "--swiglu",
            "--normalization", "RMSNorm", "--norm-epsilon", m.norm_eps, "--position-embedding-type", "rope",
            "--rotary-base", int(m.rope_theta) if float(m.rope_theta).is_integer() else m.rope_theta,
            "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    if m.attention == "mla":
        # MLATransformerConfig (arguments.py _add_mla_args): --qk-head-dim is the per-head dims without RoPE,
        # --qk-pos-emb-head-dim the rotary ones; no --q-lora-rank = queries without a latent (q_lora_rank 0).
        # Megatron's MLA defaults to YaRN RoPE (--rope-type yarn); model/mla.py applies plain RoPE.
        args += ["--multi-latent-attention", "--kv-lora-rank", m.kv_lora_rank, "--qk-head-dim", m.qk_nope_head_dim,
                 "--qk-pos-emb-head-dim", m.qk_rope_head_dim, "--v-head-dim", m.v_head_dim, "--rope-type", "rope"]
        if m.q_lora_rank:
            args += ["--q-lora-rank", m.q_lora_rank]
    elif m.n_kv_heads != m.n_heads:
        args += ["--group-query-attention", "--num-query-groups", m.n_kv_heads]
    if m.num_experts:
        # the template dispatches with two all-to-alls (parallel/expert_parallel.py): Megatron's alltoall
        args += ["--num-experts", m.num_experts, "--moe-ffn-hidden-size", m.d_ff, "--moe-router-topk", m.top_k,
                 "--moe-aux-loss-coeff", m.aux_loss_coef, "--moe-token-dispatcher-type", "alltoall"]
        if m.capacity_factor > 0:
            args += ["--moe-expert-capacity-factor", m.capacity_factor]
        if m.z_loss_coef > 0:
            args += ["--moe-z-loss-coeff", m.z_loss_coef]
        if m.first_k_dense:
            args += ["--moe-layer-freq", f"([0]*{m.first_k_dense}+[1]*{m.n_layers - m.first_k_dense})"]
        if shared_width(m):
            args += ["--moe-shared-expert-intermediate-size", shared_width(m)]
            if cfg.parallel.ep > 1:  # model/moe.py runs the shared expert while the combine all-to-all is in flight
                args.append("--moe-shared-expert-overlap")
        if m.route_groups > 1:
            args += ["--moe-router-num-groups", m.route_groups, "--moe-router-group-topk", m.route_top_groups]
            if 2 * m.route_top_groups != m.top_k:
                gaps.append(f"route_groups: Megatron scores a group by its top top_k / group_topk = "
                            f"{m.top_k // m.route_top_groups} scores, this template by its top 2 (DeepSeek-V3's)")
            gaps.append("route_groups: Megatron's default routing scores the groups on the router logits (on "
                        "probabilities with --moe-router-pre-softmax, whose gates it does not renormalise); this "
                        "template on the softmax probabilities, with renormalised gates: a token's groups can differ")
    return [str(a) for a in args]


def render(cfg: Config, est: Estimate) -> Rendered:
    p, t = cfg.parallel, cfg.train
    gaps = ["data and tokenizer: --tokenizer-type NullTokenizer with --vocab-size stands in for yours; add "
            "--data-path and your --tokenizer-* arguments (Megatron pads a real tokenizer's vocabulary to "
            "--make-vocab-size-divisible-by)"]
    args = ["--tensor-model-parallel-size", p.tp, "--pipeline-model-parallel-size", p.pp,
            "--context-parallel-size", p.cp, "--expert-model-parallel-size", p.ep,
            "--micro-batch-size", t.micro_batch, "--global-batch-size", t.global_batch,
            "--train-iters", t.steps, "--lr", t.lr, "--weight-decay", t.weight_decay, "--clip-grad", t.grad_clip]
    if t.dtype == "bfloat16":
        args.append("--bf16")
    if p.sp:
        args.append("--sequence-parallel")
    d = dp_shard_group(cfg)
    if p.zero == 1:
        args.append("--use-distributed-optimizer")
        bpp, src = 6 + 12 / d, "bf16 params + fp32 main grads 6 B, fp32 main params + Adam 12 B over dp*cp"
    elif p.zero >= 2:
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", STRATEGY[p.zero],
                 "--ckpt-format", "fsdp_dtensor"]  # validate_args: Megatron FSDP saves only this format
        gaps.append("Megatron FSDP asserts CUDA_DEVICE_MAX_CONNECTIONS is not 1: leave it unset for this job")
        bpp = (2 + 16 / d) if p.zero == 2 else 18 / d
        src = ("Megatron FSDP: fp32 grads and optimizer (16 B) sharded, bf16 params (2 B) replicated"
               if p.zero == 2 else "Megatron FSDP: bf16 params, fp32 grads and optimizer, all sharded (18 B / d)")
        if p.dp_replicate > 1:
            args += ["--num-distributed-optimizer-instances", p.dp_replicate]
    else:
        bpp, src = 18.0, "bf16 params + fp32 main grads 6 B + fp32 main params and Adam 12 B, unsharded"
    if p.dp_replicate > 1 and p.zero < 2:
        gaps.append("dp_replicate: HSDP needs zero >= 2 here; nothing to export")
    if p.pp > 1:
        if p.pp_virtual > 1:
            args += ["--num-virtual-stages-per-pipeline-rank", p.pp_virtual]
        if p.pp_schedule in ("gpipe", "zero_bubble"):
            gaps.append(f"pp_schedule={p.pp_schedule}: pretrain_gpt.py runs 1F1B (interleaved with virtual "
                        "stages); the arguments give that schedule, with its bubble")
        if p.pp_layers:
            gaps.append(f"pp_layers={p.pp_layers}: Megatron splits evenly, or by --decoder-first-pipeline-num-"
                        "layers / --decoder-last-pipeline-num-layers (first and last stage only)")
    if p.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]
    elif p.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
        gaps.append("recompute=selective: Megatron's selective recompute reruns core attention (Korthikanti et al. "
                    "2022 §4.2) with its own kernels; this template's op-level policy keeps the matmul outputs")
    if t.lr_schedule == "cosine":
        args += ["--lr-decay-style", "cosine", "--min-lr", t.lr / 10, "--lr-warmup-iters", t.warmup_steps]
    args = [str(a) for a in args] + _model_args(cfg, gaps)
    lines, i = [], 0
    while i < len(args):  # one flag per line, with its value
        take = 2 if i + 1 < len(args) and not args[i + 1].startswith("--") else 1
        lines.append(shlex.join(args[i:i + take]))
        i += take
    text = " \\\n".join(lines)
    return Rendered(format="argv", filename="pretrain_gpt.args", text=text + "\n", bytes_per_param=bpp,
                    source=src, not_expressed=gaps,
                    memory=["Megatron's activations use Transformer Engine's fused attention and its own "
                            "cross-entropy; the template chunks the loss over the vocabulary "
                            f"({t.loss_chunks or 'auto'} chunks), Megatron materialises the logits"])
