"""import_hf_config: published config.json files in, configs whose parameter count matches the model card out.

    .venv/bin/pytest -n 0 -q tests/test_hf_import.py

Each config.json is written here with the numbers of the model's Hugging Face repository (its config.json as
published; nothing is downloaded), and the published parameter count is the model card's: Llama-3-8B 8.03B
(meta-llama/Meta-Llama-3-8B), Qwen2-72B 72.7B (Qwen/Qwen2-72B), Mistral-7B 7.24B (mistralai/Mistral-7B-v0.1),
Mixtral-8x7B 46.7B (mistralai/Mixtral-8x7B-v0.1; Jiang et al. 2024, arXiv:2401.04088).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from curry_train.config import ConfigError
from curry_train.estimator import estimate_memory
from curry_train.store.hf_import import import_hf_config

_COMMON = {"attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
           "initializer_range": 0.02, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True}
LLAMA3_8B = {**_COMMON, "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_size": 4096,
             "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
             "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
             "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "vocab_size": 128256,
             "transformers_version": "4.40.0.dev0"}
QWEN2_72B = {**_COMMON, "architectures": ["Qwen2ForCausalLM"], "hidden_size": 8192, "intermediate_size": 29568,
             "max_position_embeddings": 131072, "max_window_layers": 80, "model_type": "qwen2",
             "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
             "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False, "vocab_size": 152064,
             "transformers_version": "4.40.1"}
MISTRAL_7B = {**_COMMON, "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
              "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
              "sliding_window": 4096, "vocab_size": 32000, "transformers_version": "4.34.0.dev0"}
MIXTRAL_8X7B = {**_COMMON, "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
                "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05,
                "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None, "vocab_size": 32000,
                "transformers_version": "4.36.0.dev0"}
DEEPSEEK_V3 = {**_COMMON, "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
               "aux_loss_alpha": 0.001, "ep_size": 1, "first_k_dense_replace": 3, "hidden_size": 7168,
               "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
               "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
               "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
               "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
               "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "rms_norm_eps": 1e-06, "rope_scaling": {"factor": 40, "type": "yarn",
                                                       "original_max_position_embeddings": 4096},
               "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
               "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280}
GEMMA_7B = {**_COMMON, "architectures": ["GemmaForCausalLM"], "attention_bias": False, "head_dim": 256,
            "hidden_act": "gelu", "hidden_size": 3072, "intermediate_size": 24576, "max_position_embeddings": 8192,
            "model_type": "gemma", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 16,
            "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
            "vocab_size": 256000}
del GEMMA_7B["tie_word_embeddings"]  # Gemma's config.json leaves it out: GemmaConfig defaults it to True


INTEROP_DOC = (Path(__file__).resolve().parents[1] / "docs" / "INTEROP.md").read_text(encoding="utf-8")


def _write(tmp_path, raw: dict) -> str:
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    return str(d / "config.json")


def _root(tmp_path):
    (tmp_path / "configs").mkdir(exist_ok=True)
    return tmp_path


@pytest.mark.parametrize(("raw", "accept", "published"), [
    (LLAMA3_8B, [], 8.03e9), (QWEN2_72B, ["attention_bias"], 72.7e9), (MISTRAL_7B, [], 7.24e9),
    (MIXTRAL_8X7B, [], 46.7e9)], ids=["llama3-8b", "qwen2-72b", "mistral-7b", "mixtral-8x7b"])
def test_published_models_import_to_their_parameter_count(tmp_path, raw, accept, published):
    root = _root(tmp_path)
    out = import_hf_config(_write(tmp_path, raw), "imported", accept=accept, root=root)
    written = yaml.safe_load((root / "configs" / "local" / "imported.yaml").read_text())
    est = estimate_memory(written)
    assert est.param_count == out.param_count
    assert abs(est.param_count + out.param_count_of_accepted - published) / published < 0.01
    assert f"{est.param_count:,}" in INTEROP_DOC  # the page quotes the count this import gives
    m = written["model"]
    assert (m["d_model"], m["n_layers"], m["n_heads"], m["n_kv_heads"], m["d_ff"], m["vocab_size"]) == (
        raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"], raw["num_key_value_heads"],
        raw["intermediate_size"], raw["vocab_size"])
    assert m["rope_theta"] == raw["rope_theta"] and m["norm_eps"] == raw["rms_norm_eps"]
    assert m["num_experts"] == raw.get("num_local_experts", 0)
    if m["num_experts"]:
        assert (m["top_k"], m["aux_loss_coef"], m["capacity_factor"]) == (2, 0.02, 0.0)


def test_pasted_json_and_refusal_of_qwen2_biases_without_accept(tmp_path):
    root = _root(tmp_path)
    with pytest.raises(ConfigError) as e:
        import_hf_config(json.dumps(QWEN2_72B), "q", root=root)
    (p,) = e.value.problems
    assert p.fields == ["config.json:attention_bias"] and "819,200 parameters" in p.message
    assert "accept=['attention_bias']" in p.fix and "--accept attention_bias" in p.fix
    assert not (root / "configs" / "local" / "q.yaml").exists()  # refused: nothing written
    out = import_hf_config(json.dumps(QWEN2_72B), "q", accept=["attention_bias"], root=root)
    assert [d.field for d in out.accepted] == ["attention_bias (Qwen2 q/k/v always biased)"]
    assert out.param_count_of_accepted == 819_200


def test_sliding_window_is_exact_up_to_its_length_and_refused_beyond(tmp_path):
    root = _root(tmp_path)
    assert import_hf_config(json.dumps(MISTRAL_7B), "m", seq_len=4096, root=root).config["train"][
        "seq_len"] == 4096
    with pytest.raises(ConfigError) as e:
        import_hf_config(json.dumps(MISTRAL_7B), "m8", seq_len=8192, root=root)
    assert [p.fields for p in e.value.problems] == [["config.json:sliding_window"]]
    assert "seq_len <= 4096" in e.value.problems[0].message


DS_BEHAVIOUR = ["rope_scaling", "scoring_func", "topk_method", "routed_scaling_factor", "num_nextn_predict_layers"]


def test_deepseek_v3_refuses_only_what_the_template_lacks(tmp_path):
    """MLA, the shared expert, dense first layers and group-limited routing map onto the model; what is left is
    behavioural and named field by field: YaRN RoPE scaling, V3's sigmoid router with its aux-loss-free bias
    (topk_method noaux_tc) and scaling, and the MTP layer the template does not train. Nothing is structural."""
    root = _root(tmp_path)
    with pytest.raises(ConfigError) as e:
        import_hf_config(json.dumps(DEEPSEEK_V3), "ds", root=root)
    named = {f for p in e.value.problems for f in p.fields}
    assert named == {f"config.json:{k}" for k in DS_BEHAVIOUR}
    assert all("accept it" in p.fix for p in e.value.problems)  # each behavioural: accept admits it
    from curry_train.store.hf_import import _mapping

    changes, keys, _ = _mapping(DEEPSEEK_V3)
    assert {k: changes[k] for k in ("model.n_shared_experts", "model.first_k_dense", "model.dense_d_ff",
                                    "model.d_ff", "model.route_groups", "model.route_top_groups")} == {
        "model.n_shared_experts": 1, "model.first_k_dense": 3, "model.dense_d_ff": 18432, "model.d_ff": 2048,
        "model.route_groups": 8, "model.route_top_groups": 4}
    assert keys["intermediate_size"] == "model.dense_d_ff"


def test_deepseek_v3_imports_as_mla_to_its_parameter_count(tmp_path):
    """The card's 671B main model within 1% (its 685B less the 14B MTP module, which the accepted
    num_nextn_predict_layers difference accounts for)."""
    root = _root(tmp_path)
    out = import_hf_config(_write(tmp_path, DEEPSEEK_V3), "ds", accept=DS_BEHAVIOUR, root=root)
    written = yaml.safe_load((root / "configs" / "local" / "ds.yaml").read_text())
    m = written["model"]
    assert (m["attention"], m["q_lora_rank"], m["kv_lora_rank"], m["qk_nope_head_dim"], m["qk_rope_head_dim"],
            m["v_head_dim"]) == ("mla", 1536, 512, 128, 64, 128)
    est = estimate_memory(written)
    assert est.param_count == out.param_count and abs(est.param_count - 671e9) / 671e9 < 0.01
    (mtp,) = [d for d in out.accepted if d.field == "num_nextn_predict_layers"]
    assert abs(est.param_count + mtp.params - 685e9) / 685e9 < 0.01 and out.param_count_of_accepted == mtp.params
    assert f"{est.param_count:,}" in INTEROP_DOC


def test_gemma_refused_for_its_tied_head_head_dim_and_geglu(tmp_path):
    with pytest.raises(ConfigError) as e:
        import_hf_config(json.dumps(GEMMA_7B), "g", accept=["hidden_act"], root=_root(tmp_path))
    named = {f for p in e.value.problems for f in p.fields}
    assert {"config.json:tie_word_embeddings", "config.json:head_dim", "config.json:model_type"} <= named
    assert "config.json:hidden_act" not in named


def test_bad_input_names_the_field(tmp_path):
    root = _root(tmp_path)
    cases = [("{not json", "path_or_json"), (str(tmp_path / "absent.json"), "path_or_json"),
             (json.dumps({**LLAMA3_8B, "model_type": "gpt2"}), "config.json:model_type"),
             (json.dumps({k: v for k, v in LLAMA3_8B.items() if k != "hidden_size"}), "config.json:hidden_size"),
             (json.dumps({**LLAMA3_8B, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
              "config.json:rope_scaling"),
             (json.dumps({**LLAMA3_8B, "new_field": 1}), "config.json:new_field")]
    for text, field in cases:
        with pytest.raises(ConfigError) as e:
            import_hf_config(text, "bad", root=root)
        assert field in [f for p in e.value.problems for f in p.fields], (field, str(e.value))
    with pytest.raises(ConfigError, match="names no difference"):
        import_hf_config(json.dumps(LLAMA3_8B), "bad", accept=["sliding_window"], root=root)
    assert not (root / "configs" / "local" / "bad.yaml").exists()


def test_transformers_v5_rope_parameters_are_read_back(tmp_path):
    """transformers v5 writes rope_parameters instead of rope_theta / rope_scaling: its theta is mapped, not the
    10000 default, and a scaled RoPE is refused as rope_scaling."""
    root = _root(tmp_path)
    v5 = {k: v for k, v in LLAMA3_8B.items() if k not in ("rope_theta", "rope_scaling")}
    out = import_hf_config(json.dumps({**v5, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
                           "v5", root=root)
    assert out.config["model"]["rope_theta"] == 500000.0 and not out.defaults_taken
    scaled = {**v5, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}}
    with pytest.raises(ConfigError) as e:
        import_hf_config(json.dumps(scaled), "v5s", root=root)
    assert [p.fields for p in e.value.problems] == [["config.json:rope_scaling"]]


def test_reimport_keeps_the_layout_and_resets_the_model(tmp_path):
    root = _root(tmp_path)
    import_hf_config(json.dumps(MIXTRAL_8X7B), "x", root=root)
    from curry_train.store.configs import history, update_config

    update_config("x", {"parallel.dp": 8, "parallel.zero": 3, "train.global_batch": 16}, root=root)
    out = import_hf_config(json.dumps(LLAMA3_8B), "x", root=root)
    assert out.config["parallel"]["dp"] == 8 and out.config["model"]["num_experts"] == 0
    assert len(history("x", root)) == 2  # each replaced version kept
