"""`curry-train prepare-data`: the template at real scale, from the command line.

    curry-train prepare-data --text input.txt --out data/input.bin     # byte-level tokens, vocab 256
    curry-train train --config tiny --set data.path=data/input.bin

prepare-data writes the nanoGPT `.bin` layout (flat uint16 ids, no header) that `data.path` memory-maps
(model/data.py); any pre-tokenized file in that layout works too (data.dtype=uint32 for vocabularies > 65536).
"""

from __future__ import annotations

import argparse


def _cmd_prepare_data(a: argparse.Namespace) -> int:
    from curry_train.cli import EXIT_OK, emit
    from curry_train.model.data import prepare_text

    out = prepare_text(a.text, a.out)
    emit(out, a.json, lambda o: f"wrote {o['tokens']} byte-level tokens ({o['dtype']}, vocab {o['vocab_size']}) "
                                f"to {o['out']}; train on it with --set data.path={o['out']}")
    return EXIT_OK


def add_subcommands(sub) -> None:
    p = sub.add_parser("prepare-data", help="write a text file as byte-level tokens (vocab 256) for data.path")
    p.add_argument("--text", required=True, help="a UTF-8 (or any) text file")
    p.add_argument("--out", required=True, help="the token file to write (e.g. data/input.bin)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_cmd_prepare_data)
