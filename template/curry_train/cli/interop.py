"""`curry-train import-hf | export`: Hugging Face configs in, layouts out for torchtitan, Megatron-LM, DeepSpeed
and Accelerate (cli.py adds these subcommands through `add_subcommands`).

    curry-train import-hf path/to/config.json --name qwen2-72b --accept attention_bias --json
    curry-train export --config llama3-70b --framework megatron --set parallel.tp=8 [--out megatron.args] --json

The same functions as the MCP tools import_hf_config and export_layout (store/hf_import.py, advice/export/).
A refusal is exit code 2 with every field named on stderr; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _human_import(r: Any) -> str:
    lines = [f"wrote {r.path} from a {r.model_type} config.json: {r.param_count:,} parameters",
             *(f"  {k} -> {v}" for k, v in r.mapped.items()),
             *(f"  default taken: {k} = {v}" for k, v in r.defaults_taken.items()),
             *(f"  accepted: {d.field} = {d.value}: {d.reason}" for d in r.accepted)]
    return "\n".join(lines)


def _cmd_import(a: argparse.Namespace) -> int:
    from curry_train.cli import emit
    from curry_train.store.hf_import import import_hf_config

    src = sys.stdin.read() if a.source == "-" else a.source
    emit(import_hf_config(src, a.name, accept=a.accept, seq_len=a.seq_len, root=a.root), a.json, _human_import)
    return 0


def _human_export(e: Any) -> str:
    lines = [e.text.rstrip(), "", f"# {e.framework} cannot express:"]
    lines += [f"#   - {x}" for x in e.not_expressed] or ["#   (nothing: the layout maps one to one)"]
    lines += ["# memory:", *(f"#   - {x}" for x in e.memory)]
    return "\n".join(lines)


def _cmd_export(a: argparse.Namespace) -> int:
    from curry_train.advice.export import export_layout
    from curry_train.cli import emit
    from curry_train.config import parse_sets
    from curry_train.paths import atomic_write_text

    e = export_layout(a.config, a.framework, parse_sets(a.set), root=a.root)
    if a.out:
        atomic_write_text(Path(a.out), e.text)
        print(f"curry-train export: wrote {a.out}", file=sys.stderr)
    emit(e, a.json, _human_export)
    return 0


def add_subcommands(subparsers: Any) -> None:
    from curry_train.advice.export import FRAMEWORKS
    from curry_train.cli import add_config_args, add_root_json
    from curry_train.cli.argtypes import int_at_least

    p = subparsers.add_parser("import-hf", help="write a config from a Hugging Face config.json (no network)")
    p.add_argument("source", help="a config.json, its folder, the JSON text itself, or - for stdin")
    p.add_argument("--name", required=True, help="the config name to write under configs/")
    p.add_argument("--accept", action="append", default=[], metavar="FIELD",
                   help="import without this behavioural difference the refusal named (repeatable)")
    p.add_argument("--seq-len", type=int_at_least(2), default=None,
                   help="train.seq_len (default: the config's, or min(4096, max_position_embeddings) when new)")
    add_root_json(p)
    p.set_defaults(fn=_cmd_import)

    p = subparsers.add_parser("export", help="the config's layout as torchtitan / Megatron / DeepSpeed / "
                                             "Accelerate config, with what the target cannot express")
    add_config_args(p)
    p.add_argument("--framework", required=True, choices=FRAMEWORKS, help="the framework to export to")
    p.add_argument("--out", default=None, help="also write the exported file here (atomically)")
    p.set_defaults(fn=_cmd_export)
