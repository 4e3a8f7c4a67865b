"""The one rule set, a package of three homes; import everything from `curry_train.rules`:

    python -c "from curry_train.config import Config; from curry_train.rules import anti_patterns; \
print(anti_patterns(Config.model_validate({'parallel': {'pp': 2, 'dp': 1}})))"

  validity.py   check: which layouts may launch (config.check / validate_config refuse a launch on any problem,
                before a process starts; the planner's enumeration uses it as its validity filter), divisors,
                vocab_pad_hint.
  gates.py      cp_has_proven_need, pp_allowed, ep_allowed (advice/decide.py never proposes CP
                without proven need, PP on one node, EP on a dense model), ep_spans_tp / ep_domain (EP over
                dp x tp under TP) and the sizes
                the planner searches: tp_sizes, pp_sizes, hsdp_replicas, cp_sizes.
  patterns.py   anti_patterns: any layout -> [AntiPattern(id, fields, message, fix)]; tests/test_rules.py checks
                that the advisor's proposals carry none and that skills/stage4-parallel-primitive-intro and the
                eval conversations list the same set.
  (the pipeline split: pipeline_split.py, shared by parallel/pipeline.py and the estimator)

Torch-free, without runtime imports from `curry_train.config` (it imports this package): the MCP server loads it
cheaply.
"""

from __future__ import annotations

from curry_train.rules.gates import (
    ACT_SHARE_FOR_CP,
    LONG_CONTEXT,
    WITHIN,
    cp_has_proven_need,
    cp_sizes,
    ep_allowed,
    ep_domain,
    ep_spans_tp,
    hsdp_replicas,
    pp_allowed,
    pp_sizes,
    tp_blocked_by_vocab,
    tp_sizes,
)
from curry_train.rules.patterns import ANTI_PATTERN_RULES, AntiPattern, AntiPatternRule, RuleContext, anti_patterns
from curry_train.rules.validity import Problem, check, divisors, tp_choices, vocab_pad_hint

__all__ = ["ACT_SHARE_FOR_CP", "ANTI_PATTERN_RULES", "LONG_CONTEXT", "WITHIN", "AntiPattern", "AntiPatternRule",
           "Problem", "RuleContext", "anti_patterns", "check", "cp_has_proven_need", "cp_sizes",
           "divisors", "ep_allowed", "ep_domain", "ep_spans_tp", "hsdp_replicas", "pp_allowed", "pp_sizes",
           "tp_blocked_by_vocab", "tp_choices", "tp_sizes", "vocab_pad_hint"]
