"""What each Hugging Face model family's config.json means for this template: the field map and the differences.

    from curry_train.store.hf_families import differences; differences(json.load(open("config.json")), 4096)

The field names and their defaults when absent are those of transformers' configuration classes
(`transformers/models/<family>/configuration_<family>.py`: LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config,
GemmaConfig, DeepseekV3Config) and of the modelling code where a fact is no field (Qwen2Attention builds q/k/v
with bias=True). A difference is *structural* when the template's shapes cannot hold it (its parameter count
would be wrong: a tied head, head_dim != hidden_size / heads, MLA outside DeepSeek-V3), so no `accept` admits it; the
others change behaviour, not shapes, and are refused unless the caller names them in `accept`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field, field_validator

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "gemma", "deepseek_v3")
TIE_DEFAULT = {"gemma": True}  # GemmaConfig(tie_word_embeddings=True); the others default to False
SLIDING_DEFAULT = {"mistral": 4096}  # MistralConfig(sliding_window=4096); Mixtral None; Qwen2 gated by a flag
MOE_FIELDS = {"mixtral": ("num_local_experts", "num_experts_per_tok"),
              "deepseek_v3": ("n_routed_experts", "num_experts_per_tok")}
# Fields that describe no architecture the template models: tokens ids, init, caching, bookkeeping.
IGNORED = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id",
           "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "_name_or_path", "auto_map",
           "pretraining_tp", "output_router_logits", "max_position_embeddings", "ep_size", "seq_aux",
           "return_dict", "output_hidden_states", "output_attentions", "is_decoder", "tokenizer_class"}
MAPPED = {"vocab_size": "model.vocab_size", "hidden_size": "model.d_model", "num_hidden_layers": "model.n_layers",
          "num_attention_heads": "model.n_heads", "num_key_value_heads": "model.n_kv_heads",
          "intermediate_size": "model.d_ff", "rope_theta": "model.rope_theta", "rms_norm_eps": "model.norm_eps",
          "num_local_experts": "model.num_experts", "n_routed_experts": "model.num_experts",
          "num_experts_per_tok": "model.top_k", "router_aux_loss_coef": "model.aux_loss_coef",
          "aux_loss_alpha": "model.aux_loss_coef", "moe_intermediate_size": "model.d_ff",
          "n_shared_experts": "model.n_shared_experts", "first_k_dense_replace": "model.first_k_dense",
          "n_group": "model.route_groups", "topk_group": "model.route_top_groups",
          # DeepSeek-V3's multi-head latent attention (model/mla.py); hf_import sets model.attention=mla
          "q_lora_rank": "model.q_lora_rank", "kv_lora_rank": "model.kv_lora_rank",
          "qk_nope_head_dim": "model.qk_nope_head_dim", "qk_rope_head_dim": "model.qk_rope_head_dim",
          "v_head_dim": "model.v_head_dim"}
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


class Difference(BaseModel):
    field: str = Field(description="The config.json field (or the family fact) the template cannot express.")
    value: str = Field(description="Its value in the config.json (a string, or else its JSON), or the family "
                                   "default it takes when absent.")
    reason: str = Field(description="What the template does instead, and what that changes.")
    params: int = Field(0, description="Parameters the difference accounts for (0: none, behaviour only).")
    structural: bool = Field(description="The template's shapes cannot hold it: no `accept` admits it.")

    @field_validator("value", mode="before")
    @classmethod
    def _as_json(cls, v: Any) -> str:  # a value may be an object (rope_scaling): one typed field for all
        return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


@dataclass
class _Ctx:
    raw: dict[str, Any]
    family: str
    seq_len: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)


def _attention(c: _Ctx) -> list[Difference]:
    out = []
    d, h = c.get("hidden_size"), c.get("num_attention_heads")
    g = c.get("num_key_value_heads") or h
    layers = c.get("num_hidden_layers")
    head_dim = c.get("head_dim")
    if head_dim is not None and head_dim * h != d and c.family != "deepseek_v3":
        out.append(Difference(field="head_dim", value=head_dim, structural=True, params=0,
                              reason=f"the template's head dim is hidden_size / num_attention_heads = {d / h:g} "
                                     "(model/gpt.py); q/k/v/o of another width are other shapes"))
    bias = c.get("attention_bias", c.family == "qwen2")
    if bias:
        field = "attention_bias" if "attention_bias" in c.raw else "attention_bias (Qwen2 q/k/v always biased)"
        hd = d // h
        per_layer = (h + 2 * g) * hd + (d if c.family != "qwen2" else 0)  # Qwen2's o_proj has no bias
        out.append(Difference(field=field, value=True, structural=False, params=layers * per_layer,
                              reason="the template's linear layers have no bias (model/gpt.py)"))
    if c.get("attention_dropout"):
        out.append(Difference(field="attention_dropout", value=c.get("attention_dropout"), structural=False,
                              reason="the template's attention has no dropout"))
    window = c.get("sliding_window", SLIDING_DEFAULT.get(c.family))
    if c.family == "qwen2" and not c.get("use_sliding_window", False):
        window = None
    layer_types = c.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        out.append(Difference(field="layer_types", value=sorted(set(layer_types)), structural=False,
                              reason="the template attends over the full causal context in every layer"))
    if window is not None and c.seq_len > window:
        out.append(Difference(field="sliding_window", value=window, structural=False,
                              reason=f"the template attends over the whole sequence; the same as a {window}-token "
                                     f"window only for seq_len <= {window} (import with seq_len <= {window})"))
    if c.get("rope_scaling"):
        out.append(Difference(field="rope_scaling", value=c.get("rope_scaling"), structural=False,
                              reason="the template's RoPE has no frequency scaling (plain theta, model/gpt.py)"))
    for key in MLA_KEYS:  # mapped onto model.attention=mla for DeepSeek-V3 (hf_import._mapping)
        if c.get(key) is not None and c.family != "deepseek_v3":
            out.append(Difference(field=key, value=c.get(key), structural=True,
                                  reason="multi-head latent attention (DeepSeek-V2 §2.1) is imported for "
                                         "model_type deepseek_v3 only"))
    return out


def _mlp(c: _Ctx) -> list[Difference]:
    out = []
    act = c.get("hidden_activation") or c.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        out.append(Difference(field="hidden_act", value=act, structural=False,
                              reason="the template's MLP is SwiGLU (silu gate); a GeGLU/other gate has the same "
                                     "shapes but computes another function"))
    if c.get("mlp_bias"):
        d, f, n = c.get("hidden_size"), c.get("intermediate_size"), c.get("num_hidden_layers")
        out.append(Difference(field="mlp_bias", value=True, structural=False, params=n * (2 * f + d),
                              reason="the template's linear layers have no bias"))
    if c.family == "deepseek_v3":  # shared experts, dense first layers and group-limited routing map (MAPPED)
        if c.get("moe_layer_freq", 1) != 1:
            out.append(Difference(field="moe_layer_freq", value=c.get("moe_layer_freq"), structural=True,
                                  reason="the template puts the MoE FFN in every layer"))
        if c.get("num_nextn_predict_layers"):  # params: hf_import.mtp_params (the estimator's block count)
            out.append(Difference(field="num_nextn_predict_layers", value=c.get("num_nextn_predict_layers"),
                                  structural=False, reason="multi-token prediction (DeepSeek-V3 §2.2) is an extra "
                                  "training objective this template does not train: the main model is imported "
                                  "without its MTP module (which V3 discards at inference, §2.2); the checkpoint's "
                                  "MTP layer holds one MoE block, its two norms and 2D x D projection and copies "
                                  "of the embedding and head"))
        for key, ok in (("scoring_func", "softmax"), ("topk_method", "greedy"), ("routed_scaling_factor", 1.0),
                        ("norm_topk_prob", True)):
            if key in c.raw and c.get(key) != ok:
                out.append(Difference(field=key, value=c.get(key), structural=False,
                                      reason="the template's router is softmax top-k (group-limited by "
                                             "route_groups), renormalised over the k choices (model/moe.py)"))
    if c.get("router_jitter_noise"):
        out.append(Difference(field="router_jitter_noise", value=c.get("router_jitter_noise"), structural=False,
                              reason="the template's router adds no noise"))
    return out


def normalise(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers v5 saves RoPE as `rope_parameters` ({"rope_type", "rope_theta", ...}) instead of `rope_theta`
    and `rope_scaling`: read it back into those two, so its theta is mapped and a scaled type is refused."""
    rp = raw.get("rope_parameters")
    if not isinstance(rp, dict):
        return raw
    out = {k: v for k, v in raw.items() if k != "rope_parameters"}
    if "rope_theta" in rp:
        out.setdefault("rope_theta", rp["rope_theta"])
    if rp.get("rope_type", "default") != "default":
        out.setdefault("rope_scaling", {k: v for k, v in rp.items() if k != "rope_theta"})
    return out


def differences(raw: dict[str, Any], seq_len: int) -> list[Difference]:
    """Every way this config.json's model differs from what the template builds (empty: it builds the same)."""
    c = _Ctx(raw, raw.get("model_type", ""), seq_len)
    out = _attention(c) + _mlp(c)
    tie = raw.get("tie_word_embeddings", TIE_DEFAULT.get(c.family, False))
    if tie:
        v, d = raw.get("vocab_size"), raw.get("hidden_size")
        out.append(Difference(field="tie_word_embeddings", value=True, structural=True, params=-v * d,
                              reason=f"the template's output head is untied (model/gpt.py): it would hold "
                                     f"{v * d:,} parameters more than this model"))
    if c.family == "gemma":
        out.append(Difference(field="model_type", value="gemma", structural=False,
                              reason="Gemma scales the embedding by sqrt(hidden_size) and its RMSNorm weight is "
                                     "(1 + w); the template does neither"))
    known = IGNORED | set(MAPPED) | {d.field.split(" ")[0] for d in out} | {
        "head_dim", "attention_bias", "attention_dropout", "sliding_window", "use_sliding_window",
        "max_window_layers", "layer_types", "rope_scaling", "hidden_act", "hidden_activation", "mlp_bias",
        "tie_word_embeddings", "router_jitter_noise", "scoring_func", "topk_method", "routed_scaling_factor",
        "n_group", "topk_group", "norm_topk_prob", "moe_layer_freq", "num_nextn_predict_layers",
        "n_shared_experts", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
        "qk_nope_head_dim", "v_head_dim"}
    for key in sorted(set(raw) - known):
        out.append(Difference(field=key, value=raw[key], structural=False,
                              reason="a field this importer does not know; check that it changes nothing the "
                                     "template models before accepting it"))
    return out
