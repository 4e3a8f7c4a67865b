"""Anti-patterns: layouts that are valid but that the ladder never proposes (PP inside a node, TP/PP where FSDP
alone fits, CP without need, EP on a dense model, TP across nodes).

    python -c "from curry_train.config import Config; from curry_train.rules import anti_patterns; \
print(anti_patterns(Config.model_validate({'parallel': {'pp': 2, 'dp': 1}})))"

They follow the stage-4 ladder (skills/stage4-parallel-primitive-intro; Ultra-Scale Playbook, Hugging Face 2025;
Megatron-LM's context-parallel guide). A new one is one entry in `ANTI_PATTERN_RULES`: a function of the config
(and, when known, the estimator's numbers in a RuleContext) that returns the message, or None when clean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from curry_train.rules.gates import ACT_SHARE_FOR_CP, LONG_CONTEXT, WITHIN, ep_allowed, pp_allowed

if TYPE_CHECKING:  # type hints only: config.py imports this package at runtime
    from curry_train.config import Config


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
    """The seed's "TP before FSDP", as a rule over numbers: TP (or PP) is an anti-pattern only where data
    parallelism + ZeRO (+ recompute) alone fits and is within WITHIN of this layout's step. Once TP is needed, any
    ZeRO stage may pair with it: TP + PP + ZeRO-1 is Megatron's distributed-optimizer layout (Narayanan et al.
    2021), and the ZeRO stage is then a speed/memory trade, not a ladder order."""
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
