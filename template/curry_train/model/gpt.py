"""GPT decoder: token embedding, RoPE, RMSNorm, causal SDPA attention with GQA, SwiGLU MLP (or MoE FFN), untied head.

    python -c "from curry_train.model.gpt import build_model; from curry_train.config import Config; \
print(build_model(Config()))"

Shape legend: B batch (micro-batch), T sequence (local), D d_model, H query heads, G kv heads (H % G == 0),
Dh head dim = D / H, F d_ff, V vocab. Under TP the local H, G, F and V are divided by tp; reshapes use -1 heads.

Parameter names are the contract with the white-box comparison: every parallel layout maps its gradients back to
these names (`tok_embeddings.weight`, `layers.<i>.attention.wq.weight`, ..., `output.weight`). `layers` is a
ModuleDict keyed by the global layer index, so a pipeline stage that keeps a subset keeps the same names.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from curry_train.config import Config, ModelConfig, dense_width, is_moe_block, loss_chunk_count, shared_width
from curry_train.model.lean import rms_norm, swiglu
from curry_train.rules.attention import attn_head_dims


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019; normalises in fp32 so bf16 compute keeps a stable denominator."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # model/lean.py: saves x and the fp32 rstd only


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_len, Dh/2] (Su et al. 2021, RoFormer §3.4)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # [max_len, Dh/2]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, Dh]; cos/sin [T, Dh/2] for the tokens' *global* positions (CP chunks are not contiguous)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # rotate-half convention: pairs (i, i + Dh/2)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


# CUDA: the fused kernels first, cuDNN's ahead of flash (faster on Hopper), math last; a backend that cannot take
# the inputs (dtype, head dim, GQA) is skipped for the next. CPU keeps torch's own choice (its flash kernel).
SDPA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, Dh], k/v [B, G, T, Dh] -> [B, H, T, Dh]. Context parallel swaps this for ring attention.

    GQA (each kv head serves H/G consecutive query heads) inside the kernel (enable_gqa): k and v are saved for
    backward as [B, G, T, Dh], never repeated to H heads."""
    if q.device.type == "cuda":
        with sdpa_kernel(SDPA_PRIORITY, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.head_dim = m.d_model // m.n_heads
        self.wq = nn.Linear(m.d_model, m.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(m.d_model, m.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(m.d_model, m.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(m.n_heads * self.head_dim, m.d_model, bias=False)
        self.core_attention = causal_attention  # replaced by apply_cp with ring attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, H, T, Dh]
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, G, T, Dh]
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, G, T, Dh]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.core_attention(q, k, v)  # [B, H, T, Dh]
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # [B, T, D]


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)  # gate
        self.w3 = nn.Linear(d_model, d_ff, bias=False)  # up
        self.w2 = nn.Linear(d_ff, d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))  # [B, T, F] -> [B, T, D]; lean.py saves w1 x, w3 x only


class Block(nn.Module):
    def __init__(self, m: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(m.d_model, m.norm_eps)
        if m.attention == "mla":  # DeepSeek's multi-head latent attention (model/mla.py)
            from curry_train.model.mla import MLAttention

            self.attention: nn.Module = MLAttention(m, RMSNorm, apply_rope, causal_attention)
        else:
            self.attention = Attention(m)
        self.ffn_norm = RMSNorm(m.d_model, m.norm_eps)
        if is_moe_block(m, layer):  # a MoE model's blocks past its first_k_dense (DeepSeek-V3: 3 dense)
            from curry_train.model.moe import MoE  # the MoE FFN slot

            fs = shared_width(m)  # DeepSeekMoE's shared experts: one SwiGLU every token passes (model/moe.py)
            self.feed_forward: nn.Module = MoE(m, FeedForward(m.d_model, fs) if fs else None)
        else:
            self.feed_forward = FeedForward(m.d_model, dense_width(m))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The full model, or a pipeline stage of it: a stage sets the parts it does not own to None."""

    def __init__(self, cfg: Config):
        super().__init__()
        m = cfg.model
        self.model_args = m
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(m.vocab_size, m.d_model)
        self.layers = nn.ModuleDict({str(i): Block(m, i) for i in range(m.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(m.d_model, m.norm_eps)
        self.output: nn.Linear | None = nn.Linear(m.d_model, m.vocab_size, bias=False)
        cos, sin = rope_tables(attn_head_dims(m)[2], cfg.train.seq_len, m.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # [T_max, Dh/2]
        self.register_buffer("rope_sin", sin, persistent=False)
        self.loss_chunks = cfg.train.loss_chunks  # config.loss_chunk_count: 0 = auto, 1 = unchunked

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] ids (or [B, T, D] hidden states on a later pipeline stage) -> logits [B, T, V] or hidden;
        with `targets` [B, T] the part that owns the head returns the mean loss instead (chunked_lm_loss).

        `positions` [T] are the global positions of the local tokens (context parallel); default 0..T-1.
        The loss is computed here, inside the model's forward, so that FSDP's root unit (which holds `output`)
        is gathered while the head runs and again, by its pre-backward hook, while backward recomputes it.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # [B, T, D]
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [T, Dh/2]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        if targets is None:
            return self.output(h)
        k = loss_chunk_count(self.loss_chunks, targets.numel(), self.model_args.vocab_size, self.model_args.d_model)
        return chunked_lm_loss(self.output, h, targets, k)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the micro-batch; logits [B, T, V] (fp32 for the softmax), targets [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _chunk_loss(head: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of one chunk: h [c, D] -> logits [c, V] (upcast to fp32 for the softmax)."""
    return F.cross_entropy(head(h).float(), targets, reduction="sum")


def chunked_lm_loss(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """lm_loss(head(h), targets) without the full logits: the mean over the B*T tokens of h [B, T, D].

    chunks == 1 is lm_loss itself. Otherwise the tokens are split into `chunks` near-equal runs and each run's
    head + summed cross entropy is an activation checkpoint (non-reentrant): forward keeps only the scalar
    per chunk, and backward recomputes one chunk's logits, log-softmax and their gradients at a time (the
    autograd engine runs the newest chunk's nodes first, so chunks do not interleave). The fp32 [n, V] logits
    and their gradient never exist at once: the idea of Liger's fused linear cross entropy (Hsu et al. 2024,
    arXiv:2410.10989) in plain torch, at the price of one more head matmul per chunk in backward.
    Under TP the chunk logits are vocab-sharded DTensors and the cross entropy runs under loss_parallel() (the
    caller's context must cover this forward and the backward); under SP h is a Shard(1) DTensor, gathered
    once here, as the head's ColwiseParallel input would be, so every chunk is a replicated slice.
    """
    if chunks <= 1:
        return lm_loss(head(h), targets)
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(h, DTensor) and any(not p.is_replicate() for p in h.placements):
        h = h.redistribute(placements=[Replicate()] * h.device_mesh.ndim)
    h, y = h.flatten(0, 1), targets.flatten()
    n = y.numel()
    sizes = [n // chunks + (1 if i < n % chunks else 0) for i in range(chunks)]
    total = None
    for hc, yc in zip(h.split(sizes), y.split(sizes), strict=True):
        part = checkpoint(_chunk_loss, head, hc, yc, use_reentrant=False, preserve_rng_state=False)
        total = part if total is None else total + part
    return total / n


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the auxiliary losses (MoE load balance, z-loss) the last forward left on its modules."""
    terms = [m.aux_loss for m in model.modules() if getattr(m, "aux_loss", None) is not None]
    return torch.stack(terms).sum() if terms else None


def _std(name: str, m: ModelConfig) -> float | None:
    if name.endswith("norm.weight"):
        return None  # ones
    if name.endswith(("wo.weight", "w2.weight", "w2")):
        return 0.02 / math.sqrt(2 * m.n_layers)  # GPT-2 residual scaling (Radford et al. 2019, §2.3)
    return 0.02


def init_tensor(name: str, shape: tuple[int, ...] | torch.Size, m: ModelConfig, seed: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` on the CPU, from its own generator seeded by (seed, name).

    Nothing else enters, so the single-device reference and every layout (each materialising only its local
    shard of this tensor, parallel/materialize.py) start from identical weights. One full tensor is allocated
    (randn, then scaled in place): the largest of these is the init-peak term above the local shards.
    """
    std = _std(name, m)
    if std is None:
        return torch.ones(shape)
    return torch.randn(shape, generator=_generator(name, seed), dtype=torch.float32).mul_(std)


def drawn(name: str, m: ModelConfig) -> bool:
    """Whether parameter `name` starts random (False: ones, the norm weights)."""
    return _std(name, m) is not None


def _generator(name: str, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def init_rows_into(out: torch.Tensor, name: str, shape: tuple[int, ...] | torch.Size, m: ModelConfig, seed: int,
                   lo: int) -> torch.Tensor:
    """Fill `out` (contiguous fp32 on the CPU: rows [lo, lo + len(out)) of the [d0, ...] parameter) with exactly
    those rows of `init_tensor(name, shape, m, seed)`, drawing only them: the generator first consumes the
    lo * row_numel earlier uniform draws through `out` itself, so no other buffer is allocated. Bit-identical
    when curry_train.wrapping.rows_drawn_exactly holds for the rows (the RNG's 16-draw blocks)."""
    std = _std(name, m)
    if std is None:
        return out.fill_(1.0)
    flat = out.view(-1)  # [rows * row_numel]
    k = flat.numel()
    if k == 0:
        return out
    g, skip = _generator(name, seed), lo * (flat.numel() // out.shape[0])
    while skip > 0:
        step = min(skip, k)
        flat[:step].uniform_(0.0, 1.0, generator=g)  # one draw per element, like randn's own uniform pass
        skip -= step
    flat.normal_(generator=g)
    return out.mul_(std)


@torch.no_grad()
def init_weights(model: nn.Module, m: ModelConfig, seed: int) -> None:
    """Each parameter from its own generator seeded by (seed, name): identical for any layout or subset."""
    for name, p in model.named_parameters():
        p.copy_(init_tensor(name, p.shape, m, seed))


def reset_buffers(model: nn.Module) -> None:
    """Recompute the RoPE tables of a model (or pipeline stage) built on the meta device (they are not state)."""
    if getattr(model, "rope_cos", None) is None:
        return
    m = model.model_args
    cos, sin = rope_tables(attn_head_dims(m)[2], model.rope_cos.shape[0], m.rope_theta)
    device = model.rope_cos.device
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)


def build_model(cfg: Config) -> Transformer:
    """The full fp32 model on CPU, initialised from the seed only (the single-device reference starts here)."""
    model = Transformer(cfg)
    init_weights(model, cfg.model, cfg.train.seed)
    return model


def build_meta_model(cfg: Config) -> Transformer:
    """The model's structure with no storage (device "meta"): every rank shards it first and materialises only
    its local shards afterwards (parallel/materialize.py), so no rank ever holds the full model."""
    with torch.device("meta"):
        return Transformer(cfg)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
