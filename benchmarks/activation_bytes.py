"""Activation bytes per layer per s*b*h the estimator gives llama3-8b (tp 1, seq 4096, micro-batch 1, no recompute).

    .venv/bin/python benchmarks/activation_bytes.py [--config llama3-8b] [--seq 4096]

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198,
Table 2) count 34 s*b*h bytes per layer for a GPT layer with flash attention; SwiGLU (three [s, b, F]
intermediates with F = 3.5 h) and GQA (k, v at G/H of q) make it about 36 for llama3-8b. The figure is the
estimator's (estimator/acts.py, exact on the CPU tracker: tests/test_lean_activations.py), per precision path:
bf16 under FSDP2's MixedPrecisionPolicy on ZeRO-3 (the target line) and on ZeRO-0 (dp replicas of one shard: the
layout that ran under torch.autocast before every bf16 layout ran the policy, wrapping.py; 46.03 then), and fp32.
Final line: one JSON object.
"""

from __future__ import annotations

import argparse
import json

from curry_train.estimator import load_any
from curry_train.estimator.acts import _acts
from curry_train.estimator.layout import layout_of
from curry_train.paths import resolve_config_arg

TARGET = 40.0  # bytes per s*b*h per layer, bf16 FSDP (docs/ESTIMATION.md, "Activations")
PATHS = {"mp": {"train.dtype": "bfloat16", "parallel.dp": 8, "parallel.zero": 3},
         "mp-zero0": {"train.dtype": "bfloat16", "parallel.dp": 8, "parallel.zero": 0},
         "fp32": {"train.dtype": "float32", "parallel.dp": 8, "parallel.zero": 3}}


def per_sbh(config: str, seq: int, overrides: dict) -> float:
    cfg = load_any(resolve_config_arg(config), {"train.seq_len": seq, "train.micro_batch": 1, "parallel.tp": 1,
                                                "parallel.recompute": "none", **overrides})
    lay = layout_of(cfg)
    return _acts(lay).layer_full / (lay.micro_batch * lay.seq_len * lay.d_model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3-8b")
    ap.add_argument("--seq", type=int, default=4096)
    a = ap.parse_args()
    out = {}
    for name, overrides in PATHS.items():
        x = per_sbh(a.config, a.seq, overrides)
        out[name] = round(x, 2)
        if name == "mp":
            print(f"{a.config} activation bytes per layer per s·b·h: {x:.2f} (target ≤ {TARGET:g})")
        else:
            print(f"  {name}: {x:.2f}")
    print(json.dumps({"config": a.config, "seq": a.seq, "per_sbh": out, "target": TARGET,
                      "ok": out["mp"] <= TARGET}))


if __name__ == "__main__":
    main()
