"""curry_train/rules.py is the one home of the layout rules: validity, anti-patterns and the pipeline split.

    .venv/bin/pytest tests/test_rules.py -q
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from curry_train import config, rules
from curry_train.advice.advisor import recommend_next
from curry_train.config import from_dict
from curry_train.estimator import layout_of
from curry_train.estimator import stage_ids as estimator_stage_ids
from curry_train.pipeline_split import layers_per_stage, pipeline_stage_ids, stage_layer_range
from curry_train.rules import ANTI_PATTERN_RULES, anti_patterns

REPO = Path(__file__).resolve().parents[1]
INTRO = REPO / "skills" / "stage4-parallel-primitive-intro" / "SKILL.md"
# The seed's "EP without TP" needs expert tensor parallelism, which this template does not have (its TP plan splits
# attention only on a MoE model), so it cannot be a rule on a layout here.
NOT_A_LAYOUT_RULE = {"EP without TP"}


def _cfg(validate: bool = True, **sections):
    return from_dict(dict(sections), validate=validate)


def test_config_check_is_the_rules_check():
    assert config.check is rules.check and config.Problem is rules.Problem


def test_rules_and_config_import_without_torch():
    code = "import sys, curry_train.rules, curry_train.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_clean_layout_has_no_anti_pattern():
    assert anti_patterns(_cfg()) == []
    assert anti_patterns(_cfg(parallel={"dp": 4, "zero": 3, "tp": 2, "sp": True})) == []
    hw = {"gpus_per_node": 2, "nodes": 2}
    assert anti_patterns(_cfg(parallel={"dp": 2, "pp": 2}, hardware=hw)) == []


@pytest.mark.parametrize("sections,rule_id,words", [
    ({"parallel": {"pp": 2}}, "pp-inside-node", "pp=2 on one node"),
    ({"parallel": {"cp": 2}}, "cp-without-need", "seq_len 64 < 32768"),
    ({"parallel": {"dp": 2, "ep": 2}}, "ep-on-dense", "dense model"),
    ({"parallel": {"tp": 4}, "hardware": {"gpus_per_node": 2, "nodes": 2}}, "tp-across-nodes", "tp=4"),
])
def test_each_anti_pattern_fires_with_its_fields_and_fix(sections, rule_id, words):
    found = {a.id: a for a in anti_patterns(_cfg(validate=False, **sections))}
    assert rule_id in found, found
    a = found[rule_id]
    assert words in a.message and a.fix and a.fields
    assert all(re.fullmatch(r"[a-z]+\.[a-z_]+", f) for f in a.fields)
    assert rule_id in str(a) and "Fix:" in str(a)


def test_cp_need_follows_the_activation_share_when_known():
    long = _cfg(validate=False, train={"seq_len": 65536}, parallel={"cp": 2})
    assert anti_patterns(long) == []
    assert [a.id for a in anti_patterns(long, act_share=0.2)] == ["cp-without-need"]
    assert "activations 20% < 40%" in anti_patterns(long, act_share=0.2)[0].message
    assert rules.cp_has_proven_need(65536, 0.5) and not rules.cp_has_proven_need(16384, 0.9)


def test_rule_ids_are_unique_and_the_skill_lists_the_same_anti_patterns():
    ids = [r.id for r in ANTI_PATTERN_RULES]
    assert len(ids) == len(set(ids))
    text = INTRO.read_text(encoding="utf-8")
    section = text[text.index("## Anti-patterns"):text.index("## Procedure")]
    listed = set(re.findall(r"^- \*\*(.+?)\.\*\*", section, flags=re.M))
    titles = {r.title for r in ANTI_PATTERN_RULES}
    assert listed - NOT_A_LAYOUT_RULE == titles, (listed - titles, titles - listed)


def test_every_anti_pattern_with_an_eval_tag_has_a_conversation():
    covered = set()
    for f in (REPO / "evals" / "conversations").glob("*.yaml"):
        covered.update((yaml.safe_load(f.read_text(encoding="utf-8")) or {}).get("covers") or [])
    tags = [r.eval_tag for r in ANTI_PATTERN_RULES if r.eval_tag]
    assert len(tags) >= 4 and set(tags) <= covered, set(tags) - covered


@pytest.mark.parametrize("pp,v,schedule", [(2, 1, "1f1b"), (4, 1, "gpipe"), (2, 2, "interleaved_1f1b"),
                                           (2, 2, "zero_bubble"), (2, 4, "zero_bubble"), (4, 2, "zero_bubble")])
def test_the_pipeline_split_is_one_function(pp, v, schedule):
    cfg = _cfg(model={"n_layers": 16}, train={"global_batch": 16, "micro_batch": 1},
               parallel={"pp": pp, "pp_virtual": v, "pp_schedule": schedule, "zero": 2})
    x = layout_of(cfg)
    held = [pipeline_stage_ids(pp, v, schedule, r) for r in range(pp)]
    assert held == [estimator_stage_ids(x, r) for r in range(pp)]
    assert sorted(s for h in held for s in h) == list(range(pp * v))  # every stage exactly once
    counts = layers_per_stage(n_layers=16, pp=pp, pp_virtual=v, pp_layers=None, d_model=64, n_heads=8, n_kv_heads=4,
                              d_ff=128, vocab_size=256, seq_len=32, num_experts=0, top_k=1)
    layers = [layer for s in range(pp * v) for layer in stage_layer_range(counts, s)]
    assert layers == list(range(16))
    if schedule == "zero_bubble" and v == 2:
        assert held[0] == [0, 2 * pp - 1]  # the V: rank 0 holds the first and the last stage


def test_the_advisor_never_proposes_an_anti_pattern(project):
    cases = [("tiny", "oom", {"parallel.dp": 4, "hardware.gpus_per_node": 4, "hardware.gpu_memory_gib": 0.002}),
             ("tiny", "oom", {"hardware.gpu_memory_gib": 0.004}),
             ("llama3-8b", None, {"parallel.zero": 0}),
             ("llama3-70b", None, {}), ("mixtral-8x7b", None, {}), ("tiny-moe", "oom", {"parallel.dp": 4}),
             ("llama3-8b", "oom", {"parallel.zero": 3, "parallel.recompute": "full",  # -> tp 4 + sp
                                   "hardware.gpu_memory_gib": 12}),
             ("llama3-8b", "oom", {"train.seq_len": 131072, "train.global_batch": 8, "parallel.zero": 3,
                                   "parallel.recompute": "full"}),  # -> tp 8 (faster than cp, which stays over)
             ("tiny", None, {"model.d_model": 512, "model.n_heads": 2, "model.n_kv_heads": 1, "model.d_ff": 1024,
                             "parallel.dp": 16, "parallel.zero": 3, "parallel.recompute": "full",
                             "hardware.gpus_per_node": 16, "hardware.gpu_memory_gib": 0.4, "train.seq_len": 32768,
                             "train.global_batch": 16, "train.micro_batch": 1})]  # -> cp 8 (2 heads: no TP)
    proposed = set()
    for name, symptom, over in cases:
        r = recommend_next(name, symptom, over, root=project)
        after = from_dict(config.load_yaml(project / "configs" / f"{name}.yaml"), {**over, **r.config_patch})
        assert anti_patterns(after) == [], (name, over, r.config_patch)
        proposed.add(r.primitive)
    assert {"zero3", "recompute", "tp", "cp"} <= proposed  # the test reaches the rungs that carry a rule


def test_pp_stages_inside_a_node_and_tp_straddling_nodes_are_anti_patterns():
    hw = {"gpus_per_node": 8, "nodes": 2}
    two_per_node = _cfg(validate=False, parallel={"dp": 2, "pp": 4, "zero": 2}, hardware=hw,
                        train={"global_batch": 16, "micro_batch": 1})
    found = {a.id: a.message for a in anti_patterns(two_per_node)}
    assert "pp-inside-node" in found and "2 GPU(s) per stage" in found["pp-inside-node"]
    whole_nodes = _cfg(validate=False, parallel={"dp": 8, "pp": 2, "zero": 2}, hardware=hw,
                       train={"global_batch": 16, "micro_batch": 1})
    assert anti_patterns(whole_nodes) == []
    straddle = _cfg(validate=False, parallel={"tp": 4, "dp": 3, "zero": 3, "sp": True},
                    hardware={"gpus_per_node": 6, "nodes": 2}, model={"n_heads": 8, "n_kv_heads": 4})
    assert [a.id for a in anti_patterns(straddle)] == ["tp-across-nodes"]
    assert any("straddle" in p.message for p in config.check(straddle))


def test_rules_that_need_numbers_read_the_context():
    from curry_train.rules import RuleContext

    tp = _cfg(parallel={"dp": 4, "zero": 3, "tp": 2, "sp": True})
    assert anti_patterns(tp, context=RuleContext(step_s=10.0, fsdp_step_s=10.5)) != []  # FSDP alone within 10%
    assert anti_patterns(tp, context=RuleContext(step_s=10.0, fsdp_step_s=12.0)) == []
    msg = anti_patterns(tp, context=RuleContext(step_s=10.0, fsdp_step_s=10.5))[0].message
    assert "10.5 s" in msg and "10 s" in msg and "tp=2" in msg
    # Once TP is needed (FSDP alone over 10% slower, or not fitting), pairing it with ZeRO-1/2 is clean:
    # Megatron's TP + distributed optimizer is not the seed's "TP before FSDP".
    for zero in (1, 2):
        megatron = _cfg(parallel={"dp": 4, "zero": zero, "tp": 2, "sp": True})
        assert anti_patterns(megatron) == []
        assert anti_patterns(megatron, context=RuleContext(step_s=10.0, fsdp_step_s=12.0)) == []
        assert anti_patterns(megatron, context=RuleContext(step_s=10.0, fsdp_step_s=None)) == []
        assert [a.id for a in anti_patterns(megatron, context=RuleContext(step_s=10.0, fsdp_step_s=10.5))] == [
            "tp-pp-where-fsdp-fits"]
    short_cp = _cfg(validate=False, parallel={"cp": 2})
    assert anti_patterns(short_cp, context=RuleContext(non_cp_fits=False)) == []  # nothing else fits: the need


def test_a_vocabulary_that_blocks_tp_gets_the_padding_hint():
    bad = config.check(_cfg(validate=False, model={"vocab_size": 50257}, parallel={"tp": 2, "sp": True}))
    assert any("pad model.vocab_size 50257 to 50304" in p.fix and "64*tp = 128" in p.fix for p in bad)


def test_moe_with_tp_and_ep_needs_sp_before_launch():
    """With tp > 1 the EP group spans the tp ranks (rules.ep_spans_tp), so each must route its own tokens: SP is
    required (sp=false refused by check, before any process starts, naming the fields and the fix); with SP the
    layout launches (tests/parallel/test_tp_ep.py white-boxes it)."""
    sec = {"model": {"vocab_size": 256, "d_model": 64, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "d_ff": 128,
                     "num_experts": 4, "top_k": 2},
           "train": {"seq_len": 64, "global_batch": 8, "micro_batch": 1},
           "parallel": {"dp": 2, "zero": 2, "tp": 2, "sp": False, "ep": 2},
           "hardware": {"gpus_per_node": 8, "nodes": 1}}
    cfg = from_dict(sec, validate=False)
    probs = [p for p in rules.check(cfg) if "parallel.ep" in p.fields and "parallel.sp" in p.fields]
    assert len(probs) == 1 and "parallel.sp=true" in probs[0].fix
    with pytest.raises(config.ConfigError):
        from_dict(sec)
    assert not rules.check(from_dict(sec, {"parallel.sp": True}, validate=False))


def test_tp_hints_offer_only_sizes_inside_a_node():
    """n_heads=71 has no divisor that fits a node of 8: the hint says tp 1, never 'use tp in [71]'."""
    cfg = from_dict({"model": {"d_model": 71 * 2, "n_heads": 71, "n_kv_heads": 71, "d_ff": 256, "vocab_size": 256},
                     "parallel": {"dp": 1, "tp": 2}, "hardware": {"gpus_per_node": 8}}, validate=False)
    fixes = [p.fix for p in rules.check(cfg) if p.fields == ["model.n_heads", "parallel.tp"]]
    assert fixes == ["use tp in [1]"]
    assert rules.tp_choices(96, 8) == [2, 4, 8]


def test_zero1_with_tp_is_megatrons_distributed_optimizer_and_keep_gathered_needs_zero2():
    # ZeRO-1 under TP runs on FSDP2 (wrapping.py); only ZeRO-0 with TP still asks for a wrapper that holds DTensors
    assert config.check(_cfg(validate=False, parallel={"dp": 2, "zero": 1, "tp": 2, "sp": True})) == []
    assert config.check(_cfg(validate=False, parallel={"dp": 2, "zero": 1, "tp": 2, "pp": 2},
                             train={"global_batch": 16}, hardware={"gpus_per_node": 4, "nodes": 2})) == []
    (ddp_tp,) = config.check(_cfg(validate=False, parallel={"dp": 2, "zero": 0, "tp": 2}))
    assert ddp_tp.fields == ["parallel.zero", "parallel.tp"] and "parallel.zero=1 with tp" in ddp_tp.fix
    assert config.check(_cfg(validate=False, parallel={"dp": 2, "zero": 2, "fsdp_keep_gathered": True})) == []
    for par in ({"dp": 2, "zero": 3}, {"dp": 1, "zero": 2}, {"dp": 2, "zero": 1, "tp": 2}):
        (bad,) = config.check(_cfg(validate=False, parallel={**par, "fsdp_keep_gathered": True}))
        assert bad.fields[0] == "parallel.fsdp_keep_gathered" and "zero=2" in bad.fix, bad
