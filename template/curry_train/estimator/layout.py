"""The estimator's view of a config: a flat hashable layout, the parameter tensors one rank holds, counts and
FLOPs (part of curry_train.estimator; pure arithmetic, no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from curry_train.config import Config, loss_chunk_count
from curry_train.pipeline_split import layers_per_stage
from curry_train.wrapping import data_parallel_wrapper

GiB = 2**30


@dataclass(frozen=True)
class _Layout:
    """Everything the arithmetic needs, flattened from a Config (hashable for the caches)."""

    V: int
    D: int
    L: int
    H: int
    G: int
    F: int
    E: int
    K: int
    cf: float
    s: int
    gb: int
    b: int
    dp: int
    zero: int
    recompute: str
    tp: int
    sp: bool
    pp: int
    schedule: str
    v: int
    ep: int
    cp: int
    dtype: str
    device: str
    gpn: int
    nodes: int
    budget_gib: float
    has_z: bool
    has_aux: bool
    pp_layers: tuple[int, ...] | None = None  # parallel.pp_layers (explicit stage split), else split by cost
    dpr: int = 1  # HSDP replicas (parallel.dp_replicate): FSDP shards over dpcp / dpr ranks
    lc: int = 0  # train.loss_chunks (0 = auto): the LM head + loss in token chunks (config.loss_chunk_count)

    @property
    def shard(self) -> int:
        """Ranks a dense parameter is FSDP-sharded over: dp*cp, or dp*cp/dp_replicate under HSDP."""
        return self.dpcp // self.dpr

    @property
    def dp_replicate(self) -> int:
        """HSDP replica groups (parallel.dp_replicate); dp*cp = dp_replicate x the FSDP shard group."""
        return self.dpr

    @property
    def Dh(self) -> int:
        return self.D // self.H

    @property
    def m(self) -> int:
        return self.gb // (self.dp * self.b)

    @property
    def dpcp(self) -> int:
        return self.dp * self.cp

    @property
    def fsdp(self) -> bool:
        return data_parallel_wrapper(self.dp, self.cp, self.zero) == "fsdp"  # the template's rule, wrapping.py

    @property
    def ddp(self) -> bool:
        return data_parallel_wrapper(self.dp, self.cp, self.zero) == "ddp"

    @property
    def path(self) -> str:
        """fp32 | autocast | mp: which mixed-precision mechanism computes the model."""
        if self.dtype == "float32":
            return "fp32"
        return "mp" if self.fsdp else "autocast"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def _layout(cfg: Config) -> _Layout:
    m, t, p, h = cfg.model, cfg.train, cfg.parallel, cfg.hardware
    device = h.device if h.device != "auto" else "cuda"
    return _Layout(V=m.vocab_size, D=m.d_model, L=m.n_layers, H=m.n_heads, G=m.n_kv_heads, F=m.d_ff,
                   E=m.num_experts, K=m.top_k, cf=m.capacity_factor, s=t.seq_len, gb=t.global_batch,
                   b=t.micro_batch, dp=p.dp, zero=p.zero, recompute=p.recompute, tp=p.tp, sp=p.sp, pp=p.pp,
                   schedule=p.pp_schedule, v=p.pp_virtual, ep=p.ep, cp=p.cp, dtype=t.dtype, device=device,
                   gpn=h.gpus_per_node, nodes=h.nodes, budget_gib=h.gpu_memory_gib,
                   has_z=m.z_loss_coef > 0, has_aux=m.aux_loss_coef > 0,
                   pp_layers=tuple(p.pp_layers) if p.pp_layers else None, dpr=p.dp_replicate, lc=t.loss_chunks)


def stage_split(x: _Layout) -> tuple[int, ...]:
    """Layers per pipeline stage: pipeline_split.layers_per_stage, the function parallel/pipeline.py builds the
    stages with. A pp_layers list that no longer fits the stage count (the planner varying pp) is dropped."""
    n_stages = x.pp * x.v
    explicit = x.pp_layers if x.pp_layers and len(x.pp_layers) == n_stages and sum(x.pp_layers) == x.L else None
    return _split(x.L, x.pp, x.v, explicit, x.D, x.H, x.G, x.F, x.V, x.s, x.E, x.K)


@lru_cache(maxsize=4096)
def _split(L: int, pp: int, v: int, explicit: tuple[int, ...] | None, D: int, H: int, G: int, F: int, V: int,
           s: int, E: int, K: int) -> tuple[int, ...]:
    """layers_per_stage, cached: the planner asks for the same split once per rank and candidate."""
    return layers_per_stage(n_layers=L, pp=pp, pp_virtual=v, pp_layers=explicit, d_model=D, n_heads=H,
                            n_kv_heads=G, d_ff=F, vocab_size=V, seq_len=s, num_experts=E, top_k=K)


def rank_layers(x: _Layout, stages: list[int] | tuple[int, ...]) -> int:
    """Transformer layers a pipeline rank holding `stages` runs."""
    split = stage_split(x)
    return sum(split[s] for s in stages)


# One parameter tensor as one rank holds it before FSDP: (dim0, rest, global numel, fsdp group size kind)
#   kind: "dense" (sharded over dp*cp by FSDP) or "expert" (over edp*cp when ep > 1).
_Tensor = tuple[int, int, int, str]


def _block_tensors(x: _Layout) -> list[_Tensor]:
    """A transformer block's parameters, TP-local (colwise: dim 0 / tp; rowwise: dim 1 / tp)."""
    D, t, Dh = x.D, x.tp, x.Dh
    q, kv = x.H * Dh, x.G * Dh
    out: list[_Tensor] = [(D, 1, D, "dense"), (q // t, D, q * D, "dense"), (kv // t, D, kv * D, "dense"),
                          (kv // t, D, kv * D, "dense"), (D, q // t, D * q, "dense"), (D, 1, D, "dense")]
    if x.E:
        El = x.E // x.ep
        out.append((x.E, D, x.E * D, "dense"))  # router gate [E, D], replicated over tp
        kind = "expert" if x.ep > 1 else "dense"
        out += [(El, D * x.F, x.E * D * x.F, kind)] * 3  # w1, w3 [El, D, F]; w2 [El, F, D]
    else:
        Fl = x.F // t
        out += [(Fl, D, x.F * D, "dense"), (Fl, D, x.F * D, "dense"), (D, Fl, D * x.F, "dense")]
    return out


def _root_tensors(x: _Layout, embed: bool, head: bool) -> list[_Tensor]:
    out: list[_Tensor] = []
    if embed:
        out.append((x.V // x.tp, x.D, x.V * x.D, "dense"))
    if head:
        out += [(x.D, 1, x.D, "dense"), (x.V // x.tp, x.D, x.V * x.D, "dense")]
    return out


def param_count(cfg: Config) -> int:
    """Parameters of the whole model (model.py's module structure: untied head, separate q/k/v, router)."""
    x = _layout(cfg)
    blk = sum(g for _, _, g, _ in _block_tensors(_replace(x, tp=1, ep=1)))
    return x.L * blk + 2 * x.V * x.D + x.D


def _replace(x: _Layout, **kw: Any) -> _Layout:
    d = {f: getattr(x, f) for f in x.__dataclass_fields__}
    if "dp_replicate" in kw:  # the config's name for the field
        kw["dpr"] = kw.pop("dp_replicate")
    d.update(kw)
    return _Layout(**d)


def active_params(cfg: Config | _Layout) -> int:
    """Matmul parameters one token passes through: attention, the FFN (MoE: router + top-k experts), the head.
    The embedding is a lookup, not a matmul."""
    x = cfg if isinstance(cfg, _Layout) else _layout(cfg)
    D, Dh = x.D, x.Dh
    attn = D * x.H * Dh * 2 + D * x.G * Dh * 2
    ffn = (x.E * D + x.K * 3 * D * x.F) if x.E else 3 * D * x.F
    return x.L * (attn + ffn) + x.V * D


def flops_per_token(cfg: Config | _Layout) -> float:
    """Model FLOPs per token for forward + backward, PaLM convention (Chowdhery et al. 2022, App. B):
    6 N_active + 12 L H Dh s, attention counted without the causal half (as torchtitan and PaLM MFU do)."""
    x = cfg if isinstance(cfg, _Layout) else _layout(cfg)
    return 6.0 * active_params(x) + 12.0 * x.L * x.H * x.Dh * x.s


def hardware_flops_per_token(cfg: Config | _Layout) -> float:
    """FLOPs the kernels execute: causal attention does half the QK^T and PV work; full recompute reruns each
    block's forward (+1/3 of the block FLOPs), selective reruns only the cheap element-wise ops; a chunked loss
    reruns the LM head's forward in backward (model/gpt.py chunked_lm_loss: +2VD, +1/3 of the head FLOPs)."""
    x = cfg if isinstance(cfg, _Layout) else _layout(cfg)
    linears = 6.0 * (active_params(x) - x.V * x.D)
    head = 6.0 * x.V * x.D
    if loss_chunk_count(x.lc, x.b * (x.s // x.cp), x.V, x.D) > 1:
        head += 2.0 * x.V * x.D
    if x.recompute == "full":
        linears *= 4.0 / 3.0
    return linears + attention_flops_per_token(x) + head


def attention_flops_per_token(x: _Layout) -> float:
    """The core attention's share of hardware_flops_per_token: QK^T and PV forward + backward at the causal half
    (6 L H Dh s), a full recompute rerunning their forward (x 4/3). Under CP this is what the ring's kernel runs."""
    attn = 6.0 * x.L * x.H * x.Dh * x.s
    return attn * 4.0 / 3.0 if x.recompute == "full" else attn
