"""The one rule set: which layouts may launch (`check`), which are anti-patterns (`anti_patterns`), the gates
the ladder applies before it proposes a primitive, and how a pipeline splits (`pipeline_stage_ids`).

    python -c "from curry_train.config import Config; from curry_train.rules import anti_patterns; \
print(anti_patterns(Config.model_validate({'parallel': {'pp': 2, 'dp': 1}})))"

Who reads what:
  check                      config.check / validate_config: an error refuses the launch; the planner's
                             enumeration uses it as its validity filter.
  cp_has_proven_need, pp_allowed, tp_allowed, ep_allowed
                             advice/decide.py: the advisor never proposes CP without proven need, PP on one node,
                             TP on MoE (EP instead), EP on a dense model.
  tp_sizes, pp_sizes, hsdp_replicas  advice/search.py's TP, PP, HSDP sizes (TP and HSDP's shard group inside a
                             node, PP across); advice/tune.py proposes the same HSDP.
  anti_patterns              any layout -> [AntiPattern(id, fields, message, fix)]; tests/test_rules.py checks
                             that the advisor's proposals carry none and that skills/stage4-parallel-primitive-intro
                             and the eval conversations list the same set.
  (the pipeline split: pipeline_split.py, shared by parallel/pipeline.py and the estimator)

Anti-patterns follow the stage-4 ladder (skills/stage4-parallel-primitive-intro; Ultra-Scale Playbook, Hugging
Face 2025; Megatron-LM's context-parallel guide). A new one is one entry in `ANTI_PATTERN_RULES`: a function of the
config (and, when known, the estimator's activation share) that returns the message, or None when clean.

Torch-free, without runtime imports from `curry_train.config` (it imports this module): the MCP server loads it cheaply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel

from curry_train.pipeline_split import check_pp_layers

if TYPE_CHECKING:  # type hints only: config.py imports this module at runtime
    from curry_train.config import Config, ModelConfig

LONG_CONTEXT = 32768  # seed: "CP only when sequences > 32k actually drive your task"
ACT_SHARE_FOR_CP = 0.40  # ... and activations are what overflows (share of the per-rank peak)
WITHIN = 0.10  # "within 10%": a lighter layout this close to the fastest is the one to run (issue 15, plan's final)


class Problem(BaseModel):
    """One thing wrong with a config: which fields, what is wrong, how to fix it."""

    fields: list[str]
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{', '.join(self.fields)}: {self.message}. Fix: {self.fix}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ----------------------------------------------------------------------------------------------- validity


def check(cfg: Config) -> list[Problem]:
    """Every cross-field rule; an empty list means the config may launch."""
    m, t, p, h = cfg.model, cfg.train, cfg.parallel, cfg.hardware
    out: list[Problem] = []

    def bad(fields: list[str], message: str, fix: str) -> None:
        out.append(Problem(fields=fields, message=message, fix=fix))

    if m.d_model % m.n_heads:
        bad(["model.d_model", "model.n_heads"], f"d_model={m.d_model} is not divisible by n_heads={m.n_heads}",
            f"pick n_heads among {divisors(m.d_model)[:12]}")
    elif (m.d_model // m.n_heads) % 2:
        bad(["model.d_model", "model.n_heads"], f"head dim {m.d_model // m.n_heads} is odd; RoPE rotates pairs",
            "use an even d_model / n_heads")
    if m.n_heads % m.n_kv_heads:
        bad(["model.n_kv_heads", "model.n_heads"], f"n_heads={m.n_heads} is not divisible by n_kv_heads={m.n_kv_heads}",
            f"pick n_kv_heads among {divisors(m.n_heads)}")
    if p.tp > 1:
        for field, val in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                           ("model.vocab_size", m.vocab_size)):
            if val % p.tp:
                ok = [d for d in divisors(val) if d > 1][:8]
                bad([field, "parallel.tp"], f"{field.split('.')[1]}={val} is not divisible by tp={p.tp}",
                    f"use tp in {ok or [1]}" + (f" or {vocab_pad_hint(val, p.tp)}" if "vocab" in field else ""))
        if m.d_ff % p.tp:
            bad(["model.d_ff", "parallel.tp"], f"d_ff={m.d_ff} is not divisible by tp={p.tp}",
                "use a tp that divides d_ff")
    if p.sp and p.tp == 1:
        bad(["parallel.sp", "parallel.tp"], "sp=true shards the sequence over the TP group, but tp=1",
            "set parallel.tp >= 2 or parallel.sp=false")
    if p.sp and t.seq_len % p.tp:
        bad(["train.seq_len", "parallel.tp", "parallel.sp"], f"seq_len={t.seq_len} is not divisible by tp={p.tp}",
            "with sp=true seq_len must be a multiple of tp")
    stages = p.pp * p.pp_virtual
    if m.n_layers < stages:
        bad(["model.n_layers", "parallel.pp", "parallel.pp_virtual"],
            f"n_layers={m.n_layers} cannot give each of pp*pp_virtual={stages} stages a layer",
            f"use pp*pp_virtual <= {m.n_layers}")
    else:
        why = check_pp_layers(p.pp_layers, m.n_layers, stages)
        if why:
            bad(["parallel.pp_layers", "model.n_layers"], why,
                f"give {stages} positive layer counts summing to {m.n_layers}, or drop pp_layers to split by cost")
    if p.pp_schedule in ("interleaved_1f1b", "zero_bubble") and p.pp > 1 and p.pp_virtual < 2:
        bad(["parallel.pp_schedule", "parallel.pp_virtual"], f"{p.pp_schedule} needs pp_virtual >= 2 chunks per rank",
            "set parallel.pp_virtual=2, or use pp_schedule=1f1b")
    if p.pp_virtual > 1 and p.pp == 1:
        bad(["parallel.pp_virtual", "parallel.pp"], "pp_virtual > 1 needs a pipeline (pp >= 2)",
            "set parallel.pp_virtual=1 or parallel.pp >= 2")
    if p.pp_virtual > 1 and p.pp_schedule in ("gpipe", "1f1b"):
        bad(["parallel.pp_schedule", "parallel.pp_virtual"], f"{p.pp_schedule} runs one chunk per rank",
            "use pp_schedule=interleaved_1f1b or zero_bubble, or pp_virtual=1")
    if m.num_experts:
        if m.top_k > m.num_experts:
            bad(["model.top_k", "model.num_experts"], f"top_k={m.top_k} > num_experts={m.num_experts}",
                "use top_k <= num_experts")
        if m.num_experts % p.ep:
            bad(["model.num_experts", "parallel.ep"], f"num_experts={m.num_experts} is not divisible by ep={p.ep}",
                f"use ep in {divisors(m.num_experts)}")
    elif p.ep > 1:
        bad(["parallel.ep", "model.num_experts"], "expert parallel needs a MoE model, but num_experts=0",
            "set parallel.ep=1 (dense models have no experts to shard)")
    if p.ep > 1 and p.dp % p.ep:
        bad(["parallel.ep", "parallel.dp"], f"ep={p.ep} is carved from the dp ranks but does not divide dp={p.dp}",
            f"use ep in {divisors(p.dp)}")
    if t.seq_len % (2 * p.cp) and p.cp > 1:
        bad(["train.seq_len", "parallel.cp"],
            f"seq_len={t.seq_len} is not divisible by 2*cp={2 * p.cp} (each CP rank holds a head and a tail chunk)",
            f"use a seq_len that is a multiple of {2 * p.cp}")
    if p.cp > 1 and p.sp:
        bad(["parallel.cp", "parallel.sp"], "context parallel and sequence parallel both shard the sequence",
            "use parallel.sp=false with cp > 1")
    if p.dp_replicate > 1:
        if p.dp % p.dp_replicate:
            bad(["parallel.dp_replicate", "parallel.dp"], f"dp_replicate={p.dp_replicate} does not divide "
                f"dp={p.dp} (HSDP splits the dp ranks into replica groups of equal size)",
                f"use dp_replicate in {divisors(p.dp)}")
        if p.zero < 2:
            bad(["parallel.dp_replicate", "parallel.zero"], f"dp_replicate={p.dp_replicate} needs sharded "
                f"parameters (HSDP = FSDP inside a group, replicas across groups), but zero={p.zero}",
                "set parallel.zero=2 or 3, or parallel.dp_replicate=1")
        if m.num_experts and p.ep > 1:
            bad(["parallel.dp_replicate", "parallel.ep"], "HSDP with expert parallel is not supported (experts "
                "are sharded over their own expert-data-parallel group)", "use parallel.dp_replicate=1 with ep")
    if t.global_batch % (p.dp * t.micro_batch):
        bad(["train.global_batch", "parallel.dp", "train.micro_batch"],
            f"global_batch={t.global_batch} is not divisible by dp*micro_batch={p.dp * t.micro_batch}",
            f"use global_batch a multiple of {p.dp * t.micro_batch}, or change micro_batch")
    elif p.pp > 1:
        n_micro = cfg.num_microbatches
        if n_micro < p.pp:
            bad(["train.global_batch", "train.micro_batch", "parallel.pp"],
                f"the pipeline needs at least pp={p.pp} micro-batches per step, got "
                f"global_batch/(dp*micro_batch)={n_micro}",
                f"raise global_batch to {p.pp * p.dp * t.micro_batch} or lower micro_batch")
        elif p.pp_virtual > 1 and n_micro % p.pp:
            bad(["train.global_batch", "train.micro_batch", "parallel.pp"],
                f"{p.pp_schedule} needs the micro-batch count ({n_micro}) to be a multiple of pp={p.pp}",
                f"use global_batch a multiple of {p.pp * p.dp * t.micro_batch}")
    if p.dp * p.cp > 1 and p.zero < 2 and p.tp > 1:  # DDP's bucketed all-reduce takes plain tensors only
        bad(["parallel.zero", "parallel.tp"], f"zero={p.zero} wraps the model in DDP, which cannot hold "
            "tensor-parallel (DTensor) parameters", "use parallel.zero=2 or 3 with tp (FSDP2 shards the TP "
            "shards along dp, as torchtitan does)")
    if p.dp * p.cp > 1 and p.zero < 2 and p.pp > 1 and p.pp_schedule == "zero_bubble":
        bad(["parallel.zero", "parallel.pp_schedule"], f"zero={p.zero} (DDP) all-reduces when the last "
            "micro-batch's backward ends, but zero_bubble runs some weight-gradient passes after it (gradients "
            "would be wrong)", "use parallel.zero=2 or 3 with zero_bubble, or pp_schedule=interleaved_1f1b")
    if m.num_experts and p.ep > 1 and p.zero == 1 and p.dp * p.cp > 1:
        bad(["parallel.zero", "parallel.ep"], "ZeRO-1 (ZeroRedundancyOptimizer) broadcasts every updated "
            "parameter from its owner, which would overwrite one EP rank's experts with another's",
            "use parallel.zero=0 (DDP) or 2/3 (FSDP, experts sharded over the expert-data-parallel ranks)")
    nodes_gpus = h.gpus_per_node * h.nodes
    if cfg.world_size > nodes_gpus:
        bad(["hardware.gpus_per_node", "hardware.nodes"],
            f"world size dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {cfg.world_size} exceeds "
            f"gpus_per_node*nodes = {nodes_gpus}",
            "shrink the parallel sizes or raise hardware.nodes")
    if p.tp > h.gpus_per_node:
        bad(["parallel.tp", "hardware.gpus_per_node"], f"tp={p.tp} spans more than one node ({h.gpus_per_node} "
            "GPUs per node); TP all-reduces every layer and needs the node's fast link", "keep tp <= gpus_per_node")
    elif h.gpus_per_node % p.tp:
        bad(["parallel.tp", "hardware.gpus_per_node"], f"tp={p.tp} does not divide gpus_per_node="
            f"{h.gpus_per_node}: some TP groups would straddle two nodes",
            f"use tp in {divisors(h.gpus_per_node)}")
    return out


def vocab_pad_hint(vocab: int, tp: int) -> str:
    """Megatron pads the vocabulary to a multiple of 64 * tp (make-vocab-size-divisible-by 128 by default, times
    tp), so the embedding and the LM head split evenly over the TP group."""
    mult = 64 * tp
    return f"pad model.vocab_size {vocab} to {-(-vocab // mult) * mult} (a multiple of 64*tp = {mult}, as Megatron does)"


# ----------------------------------------------------------------------------------------------- the ladder's gates


def cp_has_proven_need(seq_len: int, act_share: float) -> bool:
    """CP only for long sequences whose activations are what overflows."""
    return seq_len >= LONG_CONTEXT and act_share >= ACT_SHARE_FOR_CP


def pp_allowed(nodes: int) -> bool:
    """PP only across nodes: inside one node NVLink carries TP + FSDP and the bubble is not worth it."""
    return nodes > 1


def tp_allowed(model: ModelConfig) -> bool:
    """This template's TP plan splits attention only on a MoE model (experts stay replicated): EP is the rung."""
    return not model.num_experts


def ep_allowed(model: ModelConfig) -> bool:
    """Experts to shard exist only in a MoE model."""
    return model.num_experts > 0


def tp_sizes(model: ModelConfig, gpus_per_node: int) -> list[int]:
    """TP sizes the planner searches: every divisor of gpus_per_node (a TP group never straddles two nodes) that
    divides the heads, the kv heads, d_ff and the vocabulary (`tp_blocked_by_vocab` names the ones only the
    vocabulary blocks, for the padding hint)."""
    if not tp_allowed(model):
        return [1]
    return [k for k in divisors(gpus_per_node)
            if k == 1 or all(val % k == 0 for val in (model.n_heads, model.n_kv_heads, model.vocab_size, model.d_ff))]


def tp_blocked_by_vocab(model: ModelConfig, gpus_per_node: int) -> list[int]:
    """TP sizes inside a node that only the vocabulary's divisibility blocks (pad it: `vocab_pad_hint`)."""
    if not tp_allowed(model):
        return []
    return [k for k in divisors(gpus_per_node) if k > 1 and model.vocab_size % k
            and all(val % k == 0 for val in (model.n_heads, model.n_kv_heads, model.d_ff))]


def pp_sizes(n_layers: int, world: int, nodes: int) -> list[int]:
    """PP sizes the planner searches: stages of whole nodes (pp divides nodes; pp is outermost, curry_train/mesh.py)
    with a layer each; pp need not divide the layers (pipeline_split.py splits by cost: BLOOM's 70 over PP12)."""
    if not pp_allowed(nodes):
        return [1]
    return [p for p in divisors(nodes) if p <= n_layers and world % p == 0]


def hsdp_replicas(dp: int, cp: int, tp: int, gpus_per_node: int, zero: int, ep: int = 1) -> int | None:
    """HSDP's dp_replicate where dp*cp spans nodes: the fewest replicas r (dividing dp) whose shard group dp*cp/r
    (at stride tp, curry_train/mesh.py) sits in one node, so only the replica all-reduce crosses nodes (Zhao et
    al. 2023, "PyTorch FSDP", hybrid sharding). None when FSDP stays in a node, zero < 2 or ep > 1."""
    if zero < 2 or ep > 1 or dp * cp * tp <= gpus_per_node:
        return None
    for r in divisors(dp):
        shard = dp * cp // r
        if r > 1 and gpus_per_node % (shard * tp) == 0:  # whole shard groups per node, none straddling two
            return r if shard >= 2 else None
    return None


def cp_sizes(seq_len: int, world: int) -> list[int]:
    """CP sizes: every cp with seq_len divisible by 2*cp (each rank holds a head and a tail chunk of the
    sequence, parallel/context_parallel.py), up to the cluster."""
    return [1] + [c for c in range(2, world + 1) if world % c == 0 and seq_len % (2 * c) == 0]


# ----------------------------------------------------------------------------------------------- anti-patterns


@dataclass(frozen=True)
class AntiPattern:
    """A layout that is valid but that the ladder never proposes: stable id, the fields, what and how to fix."""

    id: str
    fields: tuple[str, ...]
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.id} ({', '.join(self.fields)}): {self.message}. Fix: {self.fix}"


@dataclass(frozen=True)
class RuleContext:
    """What the estimator (or the planner's ranking) knows about a layout, for the rules that need numbers.
    Each field is None when unknown; a rule that needs it then stays silent.
      act_share       activations / the per-rank peak of this layout
      step_s          this layout's estimated step time
      fsdp_step_s     the fastest fitting layout of the same cluster with data parallelism + ZeRO (+ recompute)
                      alone (no TP, PP, CP, EP); None when none fits
      non_cp_fits     whether any layout without CP fits the cluster"""

    act_share: float | None = None
    step_s: float | None = None
    fsdp_step_s: float | None = None
    non_cp_fits: bool | None = None


@dataclass(frozen=True)
class AntiPatternRule:
    """One anti-pattern: `message(cfg, ctx)` returns what is wrong, or None when the layout is clean."""

    id: str
    title: str
    fields: tuple[str, ...]
    message: Callable[[Config, RuleContext], str | None]
    fix: str
    eval_tag: str | None = None  # the `covers` tag of the eval conversations that check it (evals/conversations)


def _tp_before_fsdp(cfg: Config, _c: RuleContext) -> str | None:
    p = cfg.parallel
    if p.tp > 1 and p.dp * p.cp > 1 and p.zero < 3:
        return f"tp={p.tp} with zero={p.zero}: TP comes only after full sharding (ZeRO-3 solves more with less)"
    return None


def _pp_inside_node(cfg: Config, _c: RuleContext) -> str | None:
    p, h = cfg.parallel, cfg.hardware
    if p.pp <= 1:
        return None
    if not pp_allowed(h.nodes):
        return f"pp={p.pp} on one node: the bubble is rarely worth it where the node's fast link carries TP + FSDP"
    stage = p.dp * p.cp * p.tp  # GPUs per stage: the mesh puts pp outermost (curry_train/mesh.py)
    if stage < h.gpus_per_node:
        return (f"pp={p.pp} with {stage} GPU(s) per stage puts {h.gpus_per_node // stage} stages inside one node of "
                f"{h.gpus_per_node}: PP belongs across nodes")
    return None


def _tp_pp_where_fsdp_fits(cfg: Config, c: RuleContext) -> str | None:
    p = cfg.parallel
    if (p.tp > 1 or p.pp > 1) and c.fsdp_step_s is not None and c.step_s is not None \
            and c.fsdp_step_s <= c.step_s * (1 + WITHIN):
        what = " and ".join(f"{k}={v}" for k, v in (("tp", p.tp), ("pp", p.pp)) if v > 1)
        return (f"{what} although data parallelism with ZeRO (+ recompute) alone fits at {c.fsdp_step_s:.3g} s per "
                f"step, within {WITHIN:.0%} of this layout's {c.step_s:.3g} s")
    return None


def _cp_without_need(cfg: Config, c: RuleContext) -> str | None:
    p, s, share = cfg.parallel, cfg.train.seq_len, c.act_share
    if p.cp <= 1 or c.non_cp_fits is False:  # CP when nothing else fits is the need
        return None
    if s < LONG_CONTEXT:
        return f"cp={p.cp} without proven need (seq_len {s} < {LONG_CONTEXT})"
    if share is not None and share < ACT_SHARE_FOR_CP:
        return f"cp={p.cp} without proven need (activations {share:.0%} < {ACT_SHARE_FOR_CP:.0%} of the peak)"
    return None


def _ep_on_dense(cfg: Config, _c: RuleContext) -> str | None:
    if cfg.parallel.ep > 1 and not ep_allowed(cfg.model):
        return f"ep={cfg.parallel.ep} on a dense model (num_experts=0)"
    return None


def _tp_across_nodes(cfg: Config, _c: RuleContext) -> str | None:
    p, h = cfg.parallel, cfg.hardware
    if p.tp > h.gpus_per_node:
        return f"tp={p.tp} spans more than one node ({h.gpus_per_node} GPUs per node)"
    if p.tp > 1 and h.gpus_per_node % p.tp:
        return f"tp={p.tp} does not divide gpus_per_node={h.gpus_per_node}: some TP groups straddle two nodes"
    return None


ANTI_PATTERN_RULES: tuple[AntiPatternRule, ...] = (
    AntiPatternRule("tp-before-fsdp", "TP before FSDP", ("parallel.tp", "parallel.zero"), _tp_before_fsdp,
                    "set parallel.zero=3 (and recompute) first; add tp only if that still does not fit",
                    "no-tp-before-fsdp"),
    AntiPatternRule("pp-inside-node", "PP on a single node", ("parallel.pp", "hardware.nodes"), _pp_inside_node,
                    "set parallel.pp=1 (or pp <= nodes, whole nodes per stage) and use ZeRO-3 / TP inside the node",
                    "no-pp-single-node"),
    AntiPatternRule("tp-pp-where-fsdp-fits", "TP or PP where FSDP alone fits", ("parallel.tp", "parallel.pp"),
                    _tp_pp_where_fsdp_fits, "set parallel.tp=1 and parallel.pp=1 with zero=3 (+ recompute) over all "
                    "the ranks", "remove-unneeded-primitive"),
    AntiPatternRule("cp-without-need", "CP without a proven need", ("parallel.cp", "train.seq_len"), _cp_without_need,
                    "set parallel.cp=1; use recompute or TP+SP first", "no-cp-short-context"),
    AntiPatternRule("ep-on-dense", "EP for a dense model", ("parallel.ep", "model.num_experts"), _ep_on_dense,
                    "set parallel.ep=1 (dense models have no experts to shard)", "no-ep-dense"),
    AntiPatternRule("tp-across-nodes", "TP across nodes", ("parallel.tp", "hardware.gpus_per_node"),
                    _tp_across_nodes, "keep tp <= gpus_per_node and a divisor of it"),
)


def anti_patterns(cfg: Config, *, act_share: float | None = None,
                  context: RuleContext | None = None) -> list[AntiPattern]:
    """Every anti-pattern `cfg` shows (empty when clean), in ANTI_PATTERN_RULES order. `context` carries the
    numbers some rules need (RuleContext); `act_share` alone is a shortcut for its first field."""
    ctx = context or RuleContext(act_share=act_share)
    out = []
    for rule in ANTI_PATTERN_RULES:
        msg = rule.message(cfg, ctx)
        if msg is not None:
            out.append(AntiPattern(id=rule.id, fields=rule.fields, message=msg, fix=rule.fix))
    return out


__all__ = ["ACT_SHARE_FOR_CP", "ANTI_PATTERN_RULES", "LONG_CONTEXT", "WITHIN", "AntiPattern", "AntiPatternRule",
           "Problem", "RuleContext", "anti_patterns", "check", "cp_has_proven_need", "cp_sizes", "divisors",
           "ep_allowed", "hsdp_replicas", "pp_allowed", "pp_sizes", "tp_allowed", "tp_blocked_by_vocab", "tp_sizes",
           "vocab_pad_hint"]
