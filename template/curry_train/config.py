"""The config contract shared by the template, the tools, the skills and the evals.

    python -m curry_train.config configs/tiny.yaml --set parallel.dp=2     # validate and print the resolved config

A config is five sections (model, train, parallel, hardware, data) of pydantic models. Unknown keys are errors, and
`validate_config` checks every cross-field rule (divisibility, world size, micro-batches) *before* any process
starts; each problem names the field(s), the values and the fix. Precedence: dotted overrides > file > defaults.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from curry_train.pipeline_split import check_pp_layers


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    vocab_size: int = Field(256, ge=2, description="Vocabulary size (divisible by parallel.tp).")
    d_model: int = Field(64, ge=1, description="Hidden size h.")
    n_layers: int = Field(4, ge=1, description="Transformer blocks L (at least parallel.pp * pp_virtual).")
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


class DataConfig(_Section):
    path: str | None = Field(None, description="Flat token file (nanoGPT .bin: raw uint16/uint32 ids, no header), "
                                               "memory-mapped; None = the synthetic stream. See prepare-data.")
    dtype: Literal["uint16", "uint32"] = Field("uint16", description="Element type of data.path's tokens.")


class ParallelConfig(_Section):
    dp: int = Field(1, ge=1, description="Data-parallel ranks.")
    dp_replicate: int = Field(1, ge=1, description="HSDP: replicate over this many groups of dp/dp_replicate "
                                                   "FSDP-sharded ranks (zero >= 2; divides dp); 1 = plain FSDP.")
    zero: Literal[0, 1, 2, 3] = Field(
        0, description="0 = DDP, 1 = optimizer-state sharding, 2 = + gradient sharding, 3 = + parameter sharding."
    )
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


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    data: DataConfig = Field(default_factory=DataConfig)

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


class Problem(BaseModel):
    """One thing wrong with a config: which fields, what is wrong, how to fix it."""

    fields: list[str]
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{', '.join(self.fields)}: {self.message}. Fix: {self.fix}"


class ConfigError(ValueError):
    """A config that must not be launched; `problems` lists every reason, `str()` explains them all."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check(cfg: Config) -> list[Problem]:
    """Every cross-field rule; an empty list means the config may launch."""
    m, t, p, h = cfg.model, cfg.train, cfg.parallel, cfg.hardware
    out: list[Problem] = []

    def bad(fields: list[str], message: str, fix: str) -> None:
        out.append(Problem(fields=fields, message=message, fix=fix))

    if m.d_model % m.n_heads:
        bad(["model.d_model", "model.n_heads"], f"d_model={m.d_model} is not divisible by n_heads={m.n_heads}",
            f"pick n_heads among {_divisors(m.d_model)[:12]}")
    elif (m.d_model // m.n_heads) % 2:
        bad(["model.d_model", "model.n_heads"], f"head dim {m.d_model // m.n_heads} is odd; RoPE rotates pairs",
            "use an even d_model / n_heads")
    if m.n_heads % m.n_kv_heads:
        bad(["model.n_kv_heads", "model.n_heads"], f"n_heads={m.n_heads} is not divisible by n_kv_heads={m.n_kv_heads}",
            f"pick n_kv_heads among {_divisors(m.n_heads)}")
    if p.tp > 1:
        for field, val in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                           ("model.vocab_size", m.vocab_size)):
            if val % p.tp:
                ok = [d for d in _divisors(val) if d > 1][:8]
                bad([field, "parallel.tp"], f"{field.split('.')[1]}={val} is not divisible by tp={p.tp}",
                    f"use tp in {ok or [1]}" + (" or pad the vocabulary to a multiple of tp" if "vocab" in field else ""))
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
                f"use ep in {_divisors(m.num_experts)}")
    elif p.ep > 1:
        bad(["parallel.ep", "model.num_experts"], "expert parallel needs a MoE model, but num_experts=0",
            "set parallel.ep=1 (dense models have no experts to shard)")
    if p.ep > 1 and p.dp % p.ep:
        bad(["parallel.ep", "parallel.dp"], f"ep={p.ep} is carved from the dp ranks but does not divide dp={p.dp}",
            f"use ep in {_divisors(p.dp)}")
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
                f"use dp_replicate in {_divisors(p.dp)}")
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
            "GPUs per node); TP all-reduces every layer and needs NVLink", "keep tp <= gpus_per_node")
    return out


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
