"""The argument strategies of the tool fuzzer (tests/reliability/test_fuzz_tools.py), and the defects it forces.

For each of the nine tools: CHAOS draws argument dicts that are mostly wrong (path-like and unicode names, wrong
types, out-of-range numbers, unknown or contradictory overrides, unknown arguments, missing required ones), VALID
draws valid cheap ones, `mutated` makes one field of a valid call wrong (the rejection must name it) and `edge`
pushes real config keys to 0, 1, huge or tiny values. STRATEGIES mixes them per tool as (arguments, the field a
rejection must name or None). DEFECTS are the wrong arguments that must be caught before any launch.
"""

from __future__ import annotations

import json
from typing import Any

from curry_train.config import flatten, load_config
from curry_train_mcp import server as server_mod
from hypothesis import strategies as st

from tests.conftest import PRESETS

GOOD_CONFIGS = ["tiny", "tiny-moe"]
BAD_NAMES = ["", ".", "..", "../configs/tiny", "../../etc/passwd", "/etc/passwd", "configs/tiny", "tiny/", "tiny\n",
             "tiny\x00", "\x00", "con", "CON", "nul.yaml", "aux", "com1", "lpt9.txt", "x" * 65, "y" * 1000, "tiny.",
             " tiny", "tiny ", "\uff54\uff49\uff4e\uff59", "tiny;rm -rf ~", "$(id)", "~/x", "C:\\x", "tiny\\..\\x",
             "-rf", ".hidden", "%2e%2e%2f", "\u202etiny", "nope", "Tiny", "tiny.yml", "tiny.yaml/", "\ttiny"]
REAL_KEYS = sorted(flatten(load_config(PRESETS / "tiny.yaml").to_dict()))
BAD_KEYS = ["", ".", "parallel", "parallel.", ".dp", "parallel.dp.x", "a.b.c", "model.__class__", "__proto__",
            "parallel.nope", "PARALLEL.DP", "parallel..dp", "hardware.gpu_memory_gib.0", "train", "x" * 300]
VALID_OVERRIDES = [{}, {"parallel.dp": 2}, {"parallel.zero": 1, "parallel.dp": 2}, {"parallel.recompute": "full"},
                   {"hardware.gpu_memory_gib": 0.004}, {"parallel.tp": 2, "parallel.dp": 1}, {"train.seed": 3},
                   {"parallel": {"dp": 2}}]
INVALID_OVERRIDES = [{"parallel.nope": 1}, {"parallel.tp": 3}, {"parallel.dp": 0}, {"parallel.dp": "two"},
                     {"train.seq_len": -1}, {"parallel.recompute": "sometimes"}, {"": 1}, {"parallel": 1}]
NOT_BOOL = st.sampled_from(["maybe", 2, -1, 0.5, [], {}, [True], "tru", "enabled", None])  # lax bool refuses these

JUNK = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.sampled_from([-1, 0, 2**31, 2**63, 10**30, -(10**30), 10**400]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e-300, 1e300, -0.0, 5e-324]),
    st.text(max_size=30), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                                max_size=2))


def names(good: list[str]) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(good), st.sampled_from(BAD_NAMES), st.text(max_size=70),
                     st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,70}", fullmatch=True), JUNK)


OVERRIDE_VALUE = st.one_of(JUNK, st.sampled_from([1, 2, 3, 4, 0, "full", "none", "selective", "1f1b", "bfloat16",
                                                  True, False, 1e-6, 1e9, 10**12]))
OVERRIDES = st.one_of(
    st.sampled_from(VALID_OVERRIDES), st.sampled_from(INVALID_OVERRIDES),
    st.dictionaries(st.one_of(st.sampled_from(REAL_KEYS), st.sampled_from(BAD_KEYS), st.text(max_size=20)),
                    OVERRIDE_VALUE, max_size=4),
    JUNK)


def ints(lo: int, hi: int) -> st.SearchStrategy[Any]:
    return st.one_of(st.integers(lo, hi), st.sampled_from([lo - 1, hi + 1, -5, 3.5, "5", "five"]), JUNK)


def args_for(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Usually every required argument, some optional ones, sometimes an unknown one; now and then a missing one."""
    base = st.fixed_dictionaries(required, optional=optional)
    extra = st.dictionaries(
        st.sampled_from(["step", "config_name", "override", "path", "cmd", "__class__"]), JUNK, min_size=1,
        max_size=1)
    first = list(required)[:1]

    def shape(t: tuple[dict, dict, int]) -> dict[str, Any]:
        args, unknown, how = t
        if how == 0:  # a required argument missing
            return {k: v for k, v in args.items() if k not in first}
        if how == 1:  # an argument the tool does not take
            return {**args, **unknown}
        return args

    return st.tuples(base, extra, st.integers(0, 9)).map(shape)


BOOL = st.one_of(st.booleans(), NOT_BOOL)
TIMEOUT = st.one_of(st.sampled_from([0, -1, 1e-9, 86401, "soon", 900.0]), st.floats(0.1, 3600), JUNK)
HW = st.one_of(st.none(), st.sampled_from(["A100-40", "A100-80", "H100", "H200", "CPU", "B300", "h100", "", "\x00"]),
               JUNK)
RUN_IDS = st.one_of(st.sampled_from(["RUN_A", "RUN_B", "bench-nope", "../runs", "ledger.sqlite3", ".device.lock",
                                     "/etc", "run\n"]), names(["bench-20250101-000000-abcdef"]))

# Hugging Face config.json texts: valid ones (llama, mixtral) and ones each missing or adding a field.
_HF = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "rope_theta": 10000.0}
_HF_MOE = {**_HF, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
HF_VALID = st.sampled_from([json.dumps(_HF), json.dumps(_HF_MOE)])
HF_JSON = st.one_of(HF_VALID, st.sampled_from([
    json.dumps({k: v for k, v in _HF.items() if k != "hidden_size"}), json.dumps({**_HF, "model_type": "gpt2"}),
    json.dumps({**_HF, "num_key_value_heads": 3}), json.dumps({**_HF, "head_dim": 8}), json.dumps([1, 2]),
    json.dumps({**_HF, "hidden_size": "wide"}), json.dumps({**_HF, "num_hidden_layers": 0}), "{", "{}"]))

CHAOS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "probe_hardware": args_for({}, {"measure": BOOL}),
    "bench": args_for({"config": names(GOOD_CONFIGS)},
                      {"steps": ints(1, 1000), "warmup": ints(0, 100), "overrides": OVERRIDES, "plot": BOOL,
                       "timeout_s": TIMEOUT}),
    "whitebox_compare": args_for({"config": names(GOOD_CONFIGS)},
                                 {"steps": ints(1, 50), "overrides": OVERRIDES, "timeout_s": TIMEOUT,
                                  "inject": st.one_of(st.none(), names(["data-same-rows", "replica-lr", "nope"]))}),
    "update_config": args_for({"name": names(["fz-a", "fz-b", "fz-c.2"]), "changes": OVERRIDES},
                              {"base": st.one_of(st.none(), names(GOOD_CONFIGS))}),
    "runs_diff": args_for({"run_a": RUN_IDS, "run_b": RUN_IDS}, {}),
    "estimate_memory": args_for({"config": names(GOOD_CONFIGS + ["llama3-8b"])},
                                {"overrides": OVERRIDES, "hardware": HW, "plot": st.one_of(st.just(False), NOT_BOOL)}),
    "recommend_next": args_for({"config": names(GOOD_CONFIGS + ["llama3-8b"])},
                               {"symptom": st.one_of(st.sampled_from(["oom", "slow", "none", None, "OOM", "fast"]),
                                                     JUNK),
                                "overrides": OVERRIDES, "measured_peak_bytes": st.one_of(st.none(), ints(1, 2**50)),
                                "hardware": HW}),
    "plan": args_for({"model": names(GOOD_CONFIGS + ["llama3-8b"]),
                      "gpus_per_node": st.one_of(st.sampled_from([1, 2, 8]), ints(1, 1024)),
                      "nodes": st.one_of(st.sampled_from([1, 2, 4]), ints(1, 100_000)),
                      "gpu_memory_gib": st.one_of(st.sampled_from([0.001, 1.0, 80]), st.floats(-1, 5000), JUNK),
                      "seq_len": st.one_of(st.sampled_from([2, 64, 4096]), ints(2, 10**7)),
                      "global_batch": st.one_of(st.sampled_from([1, 8, 256]), ints(1, 10**8))},
                     {"micro_batch": st.one_of(st.sampled_from([1, 2, 1000]), ints(1, 10**9)), "hardware": HW,
                      "plot": st.one_of(st.just(False), NOT_BOOL)}),
    "capacity_sweep": args_for({"config": names(GOOD_CONFIGS)},
                               {"overrides": OVERRIDES, "measured": BOOL,
                                "rungs": st.one_of(st.none(), st.lists(st.sampled_from(["single", "zero3", "tp2",
                                                                                        "bogus", ""]), max_size=2),
                                                   JUNK),
                                "max_micro_batch": ints(1, 1 << 20), "max_runs_per_rung": ints(1, 64),
                                "timeout_s": TIMEOUT}),
    "import_hf_config": args_for({"path_or_json": st.one_of(HF_JSON, JUNK, st.sampled_from(BAD_NAMES[:8])),
                                  "name": names(["fz-hf", "fz-hf.2"])},
                                 {"accept": st.one_of(st.lists(st.sampled_from(["rope_scaling", "attention_bias",
                                                                                "head_dim", "", "nope"]),
                                                               max_size=2), JUNK),
                                  "seq_len": ints(2, 10**7)}),
    "export_layout": args_for({"config": names(GOOD_CONFIGS + ["llama3-8b"]),
                               "framework": st.one_of(st.sampled_from(["torchtitan", "megatron", "deepspeed",
                                                                       "accelerate", "jax", "Megatron"]), JUNK)},
                              {"overrides": OVERRIDES}),
}

# Valid arguments (the long tools' launches go to the stand-in in memory; cheap tools compute for real).
STEADY_OVERRIDES = st.sampled_from(VALID_OVERRIDES[:6])
VALID: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "probe_hardware": st.fixed_dictionaries({}, optional={"measure": st.booleans()}),
    "bench": st.fixed_dictionaries({"config": st.sampled_from(GOOD_CONFIGS)}, optional={
        "steps": st.integers(1, 1000), "warmup": st.integers(0, 100), "overrides": STEADY_OVERRIDES,
        "plot": st.booleans(), "timeout_s": st.floats(1, 3600)}),
    "whitebox_compare": st.fixed_dictionaries({"config": st.sampled_from(GOOD_CONFIGS)}, optional={
        "steps": st.integers(1, 50), "overrides": STEADY_OVERRIDES, "timeout_s": st.floats(1, 3600)}),
    "update_config": st.fixed_dictionaries({"name": st.sampled_from(["fz-a", "fz-b", "fz-c.2"]),
                                            "changes": st.one_of(STEADY_OVERRIDES, st.fixed_dictionaries(
                                                {"train.seed": st.integers(0, 2**31)}))},
                                           optional={"base": st.sampled_from(GOOD_CONFIGS)}),
    "runs_diff": st.fixed_dictionaries({"run_a": st.sampled_from(["RUN_A", "RUN_B"]),
                                        "run_b": st.sampled_from(["RUN_A", "RUN_B"])}),
    "estimate_memory": st.fixed_dictionaries({"config": st.sampled_from(GOOD_CONFIGS + ["llama3-8b"])}, optional={
        "overrides": STEADY_OVERRIDES, "hardware": st.sampled_from([None, "A100-80", "H100", "CPU"])}),
    "recommend_next": st.fixed_dictionaries({"config": st.sampled_from(GOOD_CONFIGS + ["llama3-8b"])}, optional={
        "symptom": st.sampled_from(["oom", "slow", "none", None]), "overrides": STEADY_OVERRIDES,
        "measured_peak_bytes": st.one_of(st.none(), st.integers(1, 2**40)),
        "hardware": st.sampled_from([None, "H100", "CPU"])}),
    "plan": st.fixed_dictionaries({"model": st.sampled_from(GOOD_CONFIGS), "gpus_per_node": st.sampled_from([1, 2, 8]),
                                   "nodes": st.sampled_from([1, 2]), "gpu_memory_gib": st.sampled_from([0.01, 1.0, 80]),
                                   "seq_len": st.sampled_from([64, 256]), "global_batch": st.sampled_from([8, 64])},
                                  optional={"micro_batch": st.sampled_from([1, 2])}),
    "capacity_sweep": st.fixed_dictionaries({"config": st.sampled_from(GOOD_CONFIGS)}, optional={
        "overrides": STEADY_OVERRIDES, "measured": st.booleans(), "rungs": st.sampled_from([None, ["single"]]),
        "max_micro_batch": st.integers(1, 64), "max_runs_per_rung": st.integers(1, 8)}),
    "import_hf_config": st.fixed_dictionaries({"path_or_json": HF_VALID, "name": st.sampled_from(["fz-hf"])},
                                              optional={"seq_len": st.sampled_from([64, 128])}),
    "export_layout": st.fixed_dictionaries({"config": st.sampled_from(GOOD_CONFIGS + ["llama3-8b"]),
                                            "framework": st.sampled_from(["torchtitan", "megatron", "deepspeed",
                                                                          "accelerate"])},
                                           optional={"overrides": STEADY_OVERRIDES}),
}


def mutated(tool: str) -> st.SearchStrategy[tuple[dict[str, Any], str]]:
    """Valid arguments with one field replaced by a wrong value: the error must name that field."""
    props = server_mod.mcp._tool_manager.get_tool(tool).parameters.get("properties", {})
    nullable = {k for k, v in props.items() if {"type": "null"} in v.get("anyOf", [])}  # None is valid there
    bad = st.one_of(JUNK, NOT_BOOL, st.sampled_from(BAD_NAMES[:20]), st.sampled_from(INVALID_OVERRIDES))
    return st.tuples(VALID[tool], st.sampled_from(sorted(props)), bad).filter(
        lambda t: not (t[2] is None and t[1] in nullable)).map(lambda t: ({**t[0], t[1]: t[2]}, t[1]))


EDGE_VALUES = [0, 1, 2, 3, 7, 10**9, 10**15, 2**63, 1e-12, 0.5, 1e300, "full", "bfloat16", True, False, ""]
EDGE_OVERRIDES = st.dictionaries(st.sampled_from(REAL_KEYS), st.sampled_from(EDGE_VALUES), min_size=1, max_size=2)


def edge(tool: str) -> st.SearchStrategy[tuple[dict[str, Any], None]]:
    """Valid arguments whose overrides push one or two real config keys to an edge (0, 1, huge, tiny): where a
    divide-by-zero or an overflow deep in the estimator would hide."""
    if tool == "update_config":
        return VALID[tool].flatmap(lambda a: EDGE_OVERRIDES.map(lambda o: ({**a, "changes": o}, None)))
    return VALID[tool].flatmap(lambda a: EDGE_OVERRIDES.map(lambda o: ({**a, "overrides": o}, None)))


# (arguments, the field a rejection must name or None): chaos, one wrong field, edge values, or valid.
STRATEGIES: dict[str, st.SearchStrategy[tuple[dict[str, Any], str | None]]] = {
    tool: st.one_of(CHAOS[tool].map(lambda a: (a, None)), mutated(tool),
                    *([edge(tool)] if tool not in ("probe_hardware", "runs_diff", "plan", "import_hf_config") else []),
                    VALID[tool].map(lambda a: (a, None)))
    for tool in CHAOS
}
TOOLS = sorted(STRATEGIES)

# Defects that must be caught before anything runs: (argument, value). Used over stdio for the long tools (always)
# and for plan / capacity_sweep once their budget of computed calls is spent.
DEFECTS = {
    "probe_hardware": [("measure", v) for v in ["maybe", 2, [], {}, 0.5, "tru", None]],
    "bench": [("config", "../configs/tiny"), ("config", "nope"), ("config", "tiny\n"), ("steps", 0), ("steps", "x"),
              ("warmup", 101), ("overrides", {"parallel.nope": 1}), ("overrides", {"parallel.tp": 3}),
              ("overrides", [1]), ("timeout_s", 0), ("timeout_s", -5), ("stepz", 3)],
    "whitebox_compare": [("config", "/etc/passwd"), ("config", "con"), ("steps", 51), ("steps", 0),
                         ("overrides", {"parallel.dp": 0}), ("timeout_s", "soon"), ("stepz", 1),
                         ("inject", "nope"), ("inject", "ep-expert-unreduced"), ("inject", 3)],
    "plan": [("model", "../x"), ("gpus_per_node", 0), ("nodes", -1), ("gpu_memory_gib", 0), ("seq_len", 1),
             ("global_batch", "many"), ("micro_batch", 0)],
    "capacity_sweep": [("config", "a/b"), ("max_micro_batch", 0), ("max_runs_per_rung", 65), ("rungs", ["bogus"]),
                       ("overrides", {"model.n_heads": 3}), ("measured", "maybe")],
}


def with_defect(tool: str, args: dict[str, Any], pick: int) -> tuple[dict[str, Any], str]:
    """(args with one defect, the argument the refusal must name)."""
    key, value = DEFECTS[tool][pick % len(DEFECTS[tool])]
    if tool == "capacity_sweep" and args.get("measured") is True:
        args = {**args, "measured": False}
    return {**args, key: value}, key
