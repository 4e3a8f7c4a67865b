"""The config contract shared by the template, the tools, the skills and the evals.

    python -m curry_train.config configs/tiny.yaml --set parallel.dp=2     # validate and print the resolved config

A config is six sections (model, train, parallel, hardware, data, comm) of pydantic models. Unknown keys are errors, and
`validate_config` checks every cross-field rule (divisibility, world size, micro-batches) *before* any process
starts; each problem names the field(s), the values and the fix. Precedence: dotted overrides > file > defaults.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from curry_train.moe_blocks import dense_width, is_moe_block, shared_width  # noqa: F401  (re-exported)
from curry_train.rules import Problem, check  # the one rule set; re-exported here for callers of config.check


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    vocab_size: int = Field(256, ge=2, description="Vocabulary size (divisible by parallel.tp).")
    d_model: int = Field(64, ge=1, description="Hidden size h.")
    n_layers: int = Field(4, ge=1, le=4096,
                          description="Transformer blocks L (at least parallel.pp * pp_virtual; at most 4096).")
    n_heads: int = Field(8, ge=1, description="Query heads a (divisible by parallel.tp; d_model % n_heads == 0).")
    n_kv_heads: int = Field(4, ge=1, description="Key/value heads g for GQA (divides n_heads; divisible by tp).")
    d_ff: int = Field(128, ge=1, description="SwiGLU hidden size f (per expert when num_experts > 0).")
    num_experts: int = Field(0, ge=0, description="Routed experts per block; 0 = dense SwiGLU MLP.")
    top_k: int = Field(2, ge=1, description="Experts each token is routed to (MoE only).")
    capacity_factor: float = Field(
        0.0, ge=0.0, description="Expert capacity = ceil(cf * tokens * top_k / experts); 0 = no token dropping."
    )
    aux_loss_coef: float = Field(0.01, ge=0.0, description="Switch/GShard load-balancing loss weight (MoE only).")
    z_loss_coef: float = Field(0.0, ge=0.0, description="Router z-loss weight (ST-MoE); 0 = off.")
    n_shared_experts: int = Field(0, ge=0, description="Always-active shared SwiGLU experts per MoE block, run "
                                                      "as one SwiGLU of width shared_d_ff (DeepSeekMoE); 0 = none.")
    shared_d_ff: int = Field(0, ge=0, description="Hidden size of the fused shared expert; 0 = n_shared_experts "
                                                 "* d_ff (DeepSeek-V2/V3: each shared expert as wide as a routed one).")
    first_k_dense: int = Field(0, ge=0, description="The first k blocks keep a dense SwiGLU FFN (MoE models; "
                                                   "DeepSeek-V3: 3); < n_layers.")
    dense_d_ff: int = Field(0, ge=0, description="Hidden size of the first_k_dense blocks' FFN; 0 = d_ff.")
    route_groups: int = Field(1, ge=1, description="Group-limited routing: experts in this many equal groups "
                                                  "(DeepSeek-V3 node-limited routing); 1 = off.")
    route_top_groups: int = Field(1, ge=1, description="Groups each token may route into, chosen by the sum of "
                                                      "their top-2 router probabilities (<= route_groups).")
    attention: Literal["mha", "gqa", "mla"] = Field(
        "gqa", description="gqa: n_kv_heads K/V heads (mha: the n_kv_heads == n_heads case); mla: DeepSeek's "
                           "multi-head latent attention (model/mla.py) with the five ranks and head dims below.")
    q_lora_rank: int = Field(0, ge=0, description="MLA: query down-projection rank; 0 = no query compression.")
    kv_lora_rank: int = Field(0, ge=0, description="MLA: rank of the compressed KV latent c_kv (DeepSeek-V3: 512).")
    qk_nope_head_dim: int = Field(0, ge=0, description="MLA: per-head query/key dims without RoPE (V3: 128).")
    qk_rope_head_dim: int = Field(0, ge=0, description="MLA: per-head query/key RoPE dims, the key's shared by "
                                                      "every head (V3: 64; even).")
    v_head_dim: int = Field(0, ge=0, description="MLA: per-head value dims (V3: 128).")
    rope_theta: float = Field(10000.0, gt=0.0, description="RoPE base frequency.")
    norm_eps: float = Field(1e-5, gt=0.0, description="RMSNorm epsilon.")


class TrainConfig(_Section):
    seq_len: int = Field(64, ge=2, description="Tokens per sequence s.")
    global_batch: int = Field(8, ge=1, description="Sequences per optimizer step, summed over all ranks.")
    micro_batch: int = Field(2, ge=1, description="Sequences per data-parallel rank per forward pass.")
    steps: int = Field(20, ge=1, description="Optimizer steps for `train`.")
    lr: float = Field(3e-3, gt=0.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype; master params, grads and optimizer state stay fp32."
    )
    seed: int = Field(0, ge=0, description="Seeds the weights and the synthetic data; layout-independent.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="constant, or cosine decay to lr/10 at train.steps (after the warm-up).")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up from lr/(warmup_steps+1) to lr over these steps.")
    grad_clip: float = Field(0.0, ge=0.0, description="Clip the global gradient L2 norm to this value; 0 = off.")
    # Every read of the loss waits for the device (and all-reduces it), which drains the queue of kernels the host
    # had launched ahead; 10 is torchtitan's metrics.log_freq default (docs/ARCHITECTURE.md#training-step).
    log_every: int = Field(10, ge=1, description="Reduce, read and log the loss every N steps (plus the first and "
                           "the last step); the steps in between never wait for the device.")
    gc_every: int = Field(50, ge=0, description="Python's GC is off during `train`, with one collection every N "
                          "steps (torchtitan's default); 0 = leave GC on.")
    loss_chunks: int = Field(
        0, ge=0, description="Token chunks of the LM head + cross entropy (only one chunk's fp32 logits live at a "
                             "time); 0 = auto, ceil(vocab_size / d_model); 1 = unchunked.")
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile each transformer block (parallel/compile.py): true, false, or auto "
                            "(true on CUDA, false on CPU, where inductor needs a C++ compiler).")

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_choice(cls, v: Any) -> Any:
        # before pydantic's bool coercion, which would take "yes", "on" or 1 for true
        if v is True or v is False or v == "auto":
            return v
        raise ValueError(f"train.compile must be true, false or auto (auto = true on CUDA, false on CPU), "
                         f"got {v!r}")


class DataConfig(_Section):
    path: str | None = Field(None, description="Flat token file (nanoGPT .bin: raw uint16/uint32 ids, no header), "
                                               "memory-mapped; None = the synthetic stream. See prepare-data.")
    dtype: Literal["uint16", "uint32"] = Field("uint16", description="Element type of data.path's tokens.")


class ParallelConfig(_Section):
    dp: int = Field(1, ge=1, description="Data-parallel ranks.")
    dp_replicate: int = Field(1, ge=1, description="HSDP: replicate over this many groups of dp/dp_replicate "
                                                   "FSDP-sharded ranks (zero >= 2; divides dp); 1 = plain FSDP.")
    zero: Literal[0, 1, 2, 3] = Field(
        0, description="0 = DDP, 1 = optimizer-state sharding (with tp > 1: Megatron's distributed optimizer on "
        "FSDP2), 2 = + gradient sharding, 3 = + parameter sharding."
    )
    fsdp_keep_gathered: bool = Field(
        False, description="zero=2 only: keep each FSDP unit's gathered parameters across the micro-batches of a "
        "step (one all-gather per step, not per micro-batch; gradients still reduce-scattered every micro-batch).")
    fsdp_reshard: Literal["default", "always", "never"] = Field(
        "default", description="zero=3: when FSDP units free their gathered parameters after forward "
        "(fsdp_units.py): default = after each forward, except under PP (gathered for the whole step); always = "
        "also under PP; never = not (under PP only; without PP that is zero=2). The [norm, output] unit stays "
        "gathered after forward unless always.")
    recompute: Literal["none", "selective", "full"] = Field("none", description="Activation recomputation.")
    tp: int = Field(1, ge=1, description="Tensor-parallel ranks (within a node).")
    sp: bool = Field(False, description="Sequence parallel over the TP group (needs tp > 1).")
    pp: int = Field(1, ge=1, description="Pipeline stages (one per rank along the pp axis).")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = Field(
        "1f1b", description="Pipeline schedule; interleaved_1f1b and zero_bubble need pp_virtual >= 2."
    )
    pp_virtual: int = Field(1, ge=1, description="Model chunks (virtual stages) per pipeline rank.")
    pp_layers: list[int] | None = Field(
        None, description="Layers per pipeline stage, in stage order (pp*pp_virtual entries summing to n_layers); "
        "None = split by estimated cost (pipeline_split.py).")
    ep: int = Field(1, ge=1, description="Expert-parallel ranks, carved from the dp ranks (MoE only).")
    cp: int = Field(1, ge=1, description="Context-parallel ranks (ring attention over the sequence).")


class HardwareConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu.")
    gpus_per_node: int = Field(8, ge=1, description="Accelerators (or CPU ranks) per node.")
    nodes: int = Field(1, ge=1, description="Nodes in the cluster.")
    gpu_memory_gib: float = Field(80.0, gt=0.0, description="Per-device memory budget a run is held to (GiB).")


class CommConfig(_Section):
    """Collective timeouts (torchtitan's comm.init_timeout_seconds / comm.train_timeout_seconds; Wang et al. 2024,
    "TorchTitan", §3.4): generous while the first step builds and warms up, tight once steps are regular, so a
    hung rank fails the job in a bounded time (docs/ARCHITECTURE.md#cluster-robustness)."""

    init_timeout_s: float = Field(300.0, gt=0.0, description="Collective timeout (s) from process-group init "
                                  "through the first optimizer step.")
    train_timeout_s: float = Field(100.0, gt=0.0, description="Collective timeout (s) set on every group after "
                                   "the first optimizer step.")


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    comm: CommConfig = Field(default_factory=CommConfig)

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.dp * p.tp * p.pp * p.cp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step (gradient-accumulation steps)."""
        return self.train.global_batch // (self.parallel.dp * self.train.micro_batch)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def loss_chunk_count(setting: int, tokens: int, vocab_size: int, d_model: int) -> int:
    """Chunks the LM head + cross entropy split a micro-batch's `tokens` (on one rank) into.

    0 = auto: ceil(V / D) chunks, so one chunk's logits [tokens / chunks, V] are about the size of the hidden
    states [tokens, D], as Liger Kernel's fused linear cross entropy sizes them (Hsu et al. 2024, "Liger Kernel",
    arXiv:2410.10989; liger_kernel/ops/fused_linear_cross_entropy.py: inc_factor = cdiv(V, H)). Never more
    chunks than tokens; the model (model/gpt.py) and the estimator (estimator/acts.py) share this rule.
    """
    k = setting if setting > 0 else -(-vocab_size // d_model)
    return max(1, min(k, tokens))


class ConfigError(ValueError):
    """A config that must not be launched; `problems` lists every reason, `str()` explains them all."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def validate_config(cfg: Config) -> Config:
    problems = check(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


_KEY = re.compile(r"^[a-z_]+\.[a-z_]+$")


def parse_value(text: str) -> Any:
    """`--set k=v` values: YAML scalars (2, 1e-3, true, bfloat16)."""
    return yaml.safe_load(text) if text.strip() else text


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """Apply dotted overrides (`{"parallel.dp": 2}`) on a copy of a raw config dict."""
    out = copy.deepcopy(raw)
    for key, value in (overrides or {}).items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise ConfigError([Problem(fields=[str(key)], message="overrides use dotted keys section.field",
                                       fix="write e.g. parallel.dp=2")])
        section, field = key.split(".")
        if section not in Config.model_fields:
            raise ConfigError([Problem(fields=[key], message=f"unknown section {section!r}",
                                       fix=f"use one of {sorted(Config.model_fields)}")])
        known = Config.model_fields[section].annotation.model_fields  # type: ignore[union-attr]
        if field not in known:
            raise ConfigError([Problem(fields=[key], message=f"unknown field {field!r} in {section}",
                                       fix=f"use one of {sorted(known)}")])
        sec = out.setdefault(section, {})
        if not isinstance(sec, dict):
            raise ConfigError([Problem(fields=[section], message="section is not a mapping", fix="fix the YAML")])
        sec[field] = value
    return out


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """`["parallel.dp=2", ...]` -> `{"parallel.dp": 2}`."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError([Problem(fields=[item], message="expected key=value", fix="write e.g. parallel.dp=2")])
        k, v = item.split("=", 1)
        out[k.strip()] = parse_value(v)
    return out


def from_dict(raw: Any, overrides: dict[str, Any] | None = None, *, validate: bool = True) -> Config:
    """Build (and by default validate) a config; pydantic errors become a ConfigError naming each field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([Problem(fields=["<root>"], message="a config is a mapping of sections",
                                   fix="start from configs/tiny.yaml")])
    raw = apply_overrides(raw, overrides)
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        probs = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            fix = "remove it (unknown keys are errors)" if err["type"] == "extra_forbidden" else \
                f"got {err.get('input')!r}; see `{loc}` in configs/tiny.yaml"
            probs.append(Problem(fields=[loc], message=err["msg"], fix=fix))
        raise ConfigError(probs) from None
    return validate_config(cfg) if validate else cfg


def load_yaml(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([Problem(fields=[str(path)], message=f"not valid YAML: {e}", fix="fix the syntax")]) from None
    return raw or {}


def load_config(path: str | Path, overrides: dict[str, Any] | None = None, *, validate: bool = True) -> Config:
    return from_dict(load_yaml(path), overrides, validate=validate)


def dump_yaml(cfg: Config | dict[str, Any]) -> str:
    data = cfg.to_dict() if isinstance(cfg, Config) else cfg
    return yaml.safe_dump(data, sort_keys=False)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"parallel": {"dp": 2}}` -> `{"parallel.dp": 2}` (used by diffs)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


if __name__ == "__main__":  # pragma: no cover - thin CLI for humans
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args()
    try:
        print(dump_yaml(load_config(a.path, parse_sets(a.set))), end="")
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
