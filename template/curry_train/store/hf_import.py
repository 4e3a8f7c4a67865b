"""Import a Hugging Face config.json as a config: every field the template models, and a refusal for the rest.

    curry-train import-hf path/to/config.json --name llama3-8b-hf [--accept attention_bias] --json

`import_hf_config(path_or_json, name)` reads a config.json (a file, a folder holding one, or the JSON text itself;
never the network) of the Llama, Mistral, Mixtral, Qwen2, Gemma or DeepSeek-V3 family (`model_type`), maps its
fields onto the model section (store/hf_families.py holds the map and the differences), and writes
configs/local/<name>.yaml through `update_config` (validated, atomic, the replaced version kept in history). Anything
the template cannot express is refused field by field (ConfigError, nothing written): a structural difference
always (a tied head, another head_dim, MLA outside DeepSeek-V3), a behavioural one (biases, MTP layers,
sliding window beyond seq_len, RoPE scaling, another activation, an unknown field) unless named in `accept`,
and every accepted one is reported with the parameters it accounts for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from curry_train.config import ConfigError, ModelConfig, Problem, from_dict, load_yaml
from curry_train.estimator import param_count
from curry_train.paths import config_path
from curry_train.store.configs import update_config
from curry_train.store.hf_families import (
    FAMILIES,
    MAPPED,
    MLA_KEYS,
    MOE_FIELDS,
    REQUIRED,
    Difference,
    differences,
    normalise,
)

DEFAULT_SEQ_LEN = 4096  # the sequence length an import trains when none is given (capped by the model's context)


class HfImport(BaseModel):
    name: str
    path: str = Field(description="The config file written (configs/local/<name>.yaml).")
    model_type: str = Field(description="The config.json's model_type (its family).")
    mapped: dict[str, str] = Field(description="config.json field -> config key it set.")
    defaults_taken: dict[str, Any] = Field(description="Fields absent from config.json that took their "
                                                       "transformers default (e.g. num_key_value_heads).")
    accepted: list[Difference] = Field(description="Differences the caller accepted (named in accept); the "
                                                   "written config leaves each out.")
    param_count: int = Field(description="Parameters of the written config, as estimate_memory counts them.")
    param_count_of_accepted: int = Field(description="Parameters the accepted differences account for: the "
                                                     "config.json's model has param_count + this many.")
    created: bool = Field(description="True when configs/local/<name>.yaml did not exist before.")
    previous_version: str | None = Field(None, description="Where the replaced version was saved (history).")
    config: dict[str, Any] = Field(description="The resolved config now in the file.")


def read_hf_json(path_or_json: str) -> dict[str, Any]:
    """The config.json as a dict: JSON text (starts with '{'), a file, or a folder holding config.json."""
    text = path_or_json.strip()
    if not text.startswith("{"):
        p = Path(text).expanduser()
        if p.is_dir():
            p = p / "config.json"
        if p.suffix != ".json":  # a tool argument must not turn into a read of any file on this machine
            raise ConfigError([Problem(fields=["path_or_json"], message=f"{text!r} is not a .json file",
                                       fix="pass the path of the model's config.json (or its folder), or its JSON")])
        if not p.is_file():
            raise ConfigError([Problem(fields=["path_or_json"], message=f"{text!r} is neither JSON nor a file",
                                       fix="pass the path of a config.json (or its folder), or paste its JSON")])
        text = p.read_text(encoding="utf-8")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError([Problem(fields=["path_or_json"], message=f"not valid JSON: {e}",
                                   fix="pass the config.json exactly as the model repository has it")]) from None
    if not isinstance(raw, dict):
        raise ConfigError([Problem(fields=["path_or_json"], message="config.json is not a JSON object",
                                   fix="pass the model's config.json (an object with model_type)")])
    return raw


def _mapping(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """(dotted changes, field -> key, defaults taken) for the fields the template models."""
    family = raw["model_type"]
    missing = [k for k in REQUIRED + MOE_FIELDS.get(family, ()) if raw.get(k) is None]
    if family == "deepseek_v3" and raw.get("moe_intermediate_size") is None:
        missing.append("moe_intermediate_size")
    if missing:
        raise ConfigError([Problem(fields=[f"config.json:{k}" for k in missing], message="required field(s) absent",
                                   fix="pass the model's complete config.json")])
    fields = [k for k in MAPPED if raw.get(k) is not None]
    if family != "deepseek_v3":  # DeepSeek-V3's MoE keys only (a stray n_group elsewhere maps nothing)
        fields = [k for k in fields if k not in ("n_shared_experts", "first_k_dense_replace", "n_group", "topk_group")]
    if family != "deepseek_v3":  # MLA is DeepSeek's (elsewhere its keys are refused by hf_families._attention)
        fields = [k for k in fields if k not in MLA_KEYS]
    if family not in MOE_FIELDS:  # a dense family's stray MoE keys map nothing
        fields = [k for k in fields if MAPPED[k] not in ("model.num_experts", "model.top_k", "model.aux_loss_coef")]
    # every model field, so a re-import leaves nothing of the model it replaces (top_k of an old MoE, say)
    changes = {f"model.{k}": v for k, v in ModelConfig().model_dump().items()}
    changes.update({MAPPED[k]: raw[k] for k in fields if k != "intermediate_size" or family != "deepseek_v3"})
    if family == "deepseek_v3":  # d_ff is the expert width; intermediate_size the first_k_dense layers' width
        changes["model.dense_d_ff"] = raw["intermediate_size"] if raw.get("first_k_dense_replace") else 0
        if raw.get("kv_lora_rank"):  # multi-head latent attention (model/mla.py); q_lora_rank null = 0
            changes["model.attention"] = "mla"
    taken: dict[str, Any] = {}
    if raw.get("num_key_value_heads") is None:  # transformers: None means multi-head attention
        changes["model.n_kv_heads"] = taken["num_key_value_heads"] = raw["num_attention_heads"]
    if raw.get("rope_theta") is None:
        changes["model.rope_theta"] = taken["rope_theta"] = 10000.0  # every family's class default
    if family in MOE_FIELDS:
        changes["model.capacity_factor"] = 0.0  # dropless, as Mixtral and DeepSeek-V3 route
    else:
        changes["model.num_experts"] = 0
    keys = {k: MAPPED[k] for k in fields}
    if family == "deepseek_v3":
        keys["intermediate_size"] = "model.dense_d_ff"
    return changes, keys, taken


def import_hf_config(path_or_json: str, name: str, *, accept: list[str] | None = None, seq_len: int | None = None,
                     root: str | Path | None = None) -> HfImport:
    """Map a Hugging Face config.json onto a new or updated configs/local/<name>.yaml; refuse what does not map."""
    raw = normalise(read_hf_json(path_or_json))
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise ConfigError([Problem(fields=["config.json:model_type"], message=f"model_type {family!r} is not "
                                   "imported", fix=f"import one of {', '.join(FAMILIES)}, or write the model "
                                   "section with update_config")])
    changes, mapped, taken = _mapping(raw)
    target = config_path(name, root)
    context = raw.get("max_position_embeddings") or DEFAULT_SEQ_LEN
    if seq_len is not None:
        changes["train.seq_len"] = seq = seq_len
    elif target.is_file():  # a re-import keeps the config's train, parallel and hardware sections
        seq = from_dict(load_yaml(target), validate=False).train.seq_len
    else:
        changes["train.seq_len"] = seq = min(DEFAULT_SEQ_LEN, context)
    if not target.is_file():
        changes["train.dtype"] = "bfloat16"  # the families' checkpoints are bf16 (config.json torch_dtype)
    diffs = [d.model_copy(update={"params": mtp_params(changes, raw)}) if d.field == "num_nextn_predict_layers"
             else d for d in differences(raw, seq)]
    accept = list(accept or [])
    by_field = {d.field.split(" ")[0]: d for d in diffs}
    problems = [Problem(fields=["accept"], message=f"{a!r} names no difference of this config.json",
                        fix=f"accept only some of: {', '.join(by_field) or '(none: nothing differs)'}")
                for a in accept if a not in by_field]
    for key, d in by_field.items():
        if d.structural or key not in accept:
            extra = f" ({d.params:,} parameters)" if d.params else ""
            fix = ("not expressible in this template; import another model or write the model section by hand"
                   if d.structural else f"accept it (accept=[{key!r}], CLI --accept {key}) to import without "
                                        "it, if that difference does not matter for your purpose")
            problems.append(Problem(fields=[f"config.json:{key}"], message=f"{d.value}: {d.reason}{extra}",
                                    fix=fix))
    if problems:
        raise ConfigError(problems)
    if target.is_file():
        upd = update_config(name, changes, root=root)
    else:
        upd = update_config(name, changes, base=f"hf:{family}", root=root, base_raw={})
    accepted = [by_field[a] for a in accept]
    return HfImport(name=upd.name, path=upd.path, model_type=family, mapped=mapped, defaults_taken=taken,
                    accepted=accepted, param_count=param_count(from_dict(upd.config)),
                    param_count_of_accepted=sum(d.params for d in accepted), created=upd.created,
                    previous_version=upd.previous_version, config=upd.config)


def mtp_params(changes: dict[str, Any], raw: dict[str, Any]) -> int:
    """Parameters of DeepSeek-V3's multi-token-prediction layers as its checkpoint holds them (§2.2, Fig. 3): per
    layer one more block like the last (the estimator's count: the model with one layer more, less the model),
    the two RMSNorms of its inputs and the [D, 2D] projection, the final norm, and its own copies of the
    embedding and the output head. V3: 13.5B, the card's 685B less its 671B main model."""
    cfg = from_dict({}, changes, validate=False)
    d, v = cfg.model.d_model, cfg.model.vocab_size
    more = from_dict({}, {**changes, "model.n_layers": cfg.model.n_layers + 1}, validate=False)
    block = param_count(more) - param_count(cfg)
    return int(raw.get("num_nextn_predict_layers") or 0) * (block + 2 * d * d + 3 * d + 2 * v * d)
