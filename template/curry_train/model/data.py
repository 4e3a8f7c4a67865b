"""Training tokens, sliced identically for the reference and every parallel layout: a synthetic stream or a file.

    python -c "from curry_train.model.data import global_batch; from curry_train.config import Config; \
print(global_batch(Config(), 0)[0][:2])"

The stream is a sparse Markov chain: each token has 4 successors drawn once from the seed, taken with
probabilities 0.7/0.15/0.1/0.05. A model can learn it (entropy ~1.0 nat vs ln V at init), so the loss falls.
Row i of step s has its own generator (seeded by seed, s, i), so a rank generates only its own rows and the
split never changes the data: at the llama3-8b preset (512 x 8192 tokens, dp 8) a rank builds 64 rows, not 512.
The chain is sequential in t, so a CP rank still generates its rows' whole sequences (T ids per row) and keeps
its positions. A rank's rows of one step are built in one pass (`rank_micro_batches`: the chain advanced
for all of them at once), which train/feed.py runs one step ahead on a background thread.

A token file (`data.path`, data.dtype uint16 | uint32: the nanoGPT `.bin` layout, raw ids and no header, e.g.
from `curry-train prepare-data`) is memory-mapped (numpy.memmap): row i of step s is the window
tokens[o : o + T + 1] with o = ((s * global_batch + i) * T) mod (N - T - 1), consecutive windows through the
file, wrapping around. A rank reads only its own rows and, under CP, only its positions (`rank_micro_batches`),
so nothing beyond what it trains on is read or generated. Opening checks the file: missing, empty, a size that
is not whole tokens, shorter than one sequence, or an id >= model.vocab_size is a ConfigError naming data.path.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from curry_train.config import Config, ConfigError, Problem

_SUCC_PROBS = torch.tensor([0.70, 0.15, 0.10, 0.05])


@lru_cache(maxsize=4)
def _successors(vocab: int, seed: int) -> np.ndarray:
    """[V, 4] int64: the successor table, drawn once per (vocab, seed) and cached (read-only)."""
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    table = torch.randint(0, vocab, (vocab, len(_SUCC_PROBS)), generator=g).numpy()
    table.flags.writeable = False
    return table


def global_batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each [global_batch, seq_len] int64, for optimizer step `step` (the reference's view)."""
    return batch_rows(cfg, step, range(cfg.train.global_batch))


def batch_rows(cfg: Config, step: int, rows,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) [len(rows), T or len(positions)] int64: global rows `rows` of step `step`."""
    if cfg.data.path:
        return file_rows(cfg, step, rows, positions)
    x, y = _synthetic_rows(cfg, step, rows)
    return (x, y) if positions is None else (x[:, positions], y[:, positions])


def _synthetic_rows(cfg: Config, step: int, rows) -> tuple[torch.Tensor, torch.Tensor]:
    V, T, seed = cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed
    succ = _successors(V, seed)  # [V, 4]
    rows = list(rows)
    tokens = np.empty((T + 1, len(rows)), dtype=np.int64)  # [T+1, R]: time-major, each step a contiguous row
    choice = np.empty((T, len(rows)), dtype=np.int64)  # [T, R]: which of the 4 successors follows
    for j, i in enumerate(rows):  # one generator per row: any subset of rows is generated identically
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_033 + i)
        tokens[0, j] = int(torch.randint(0, V, (1,), generator=g))
        choice[:, j] = torch.multinomial(_SUCC_PROBS, T, replacement=True, generator=g).numpy()
    # The chain is sequential in t, vectorised over the rows; the successor lookup goes through the flat table
    # (id * 4 + choice), one numpy gather per position on contiguous [R] rows (several times cheaper per
    # position than torch's indexing; the prefetcher runs it off the training thread, train/feed.py).
    flat, k = succ.reshape(-1), succ.shape[1]
    for t in range(T):
        np.take(flat, tokens[t] * k + choice[t], out=tokens[t + 1])
    ids = torch.from_numpy(np.ascontiguousarray(tokens.T))  # [R, T+1]
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def cp_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by a context-parallel rank: chunks r and 2cp-1-r of 2cp equal chunks.

    Causal attention makes late chunks costlier; pairing a head chunk with a tail chunk evens the work per rank
    (Brandon et al. 2023 "Striped Attention"; Megatron-LM context parallel load balancing).
    """
    if cp == 1:
        return torch.arange(seq_len)
    c = seq_len // (2 * cp)
    head = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    tail = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)
    return torch.cat([head, tail])  # [T / cp]


def micro_batches(cfg: Config, inputs: torch.Tensor, targets: torch.Tensor, dp_rank: int, cp_rank: int = 0):
    """Yield (inputs, targets, positions) for each micro-batch of one data-parallel rank, in accumulation order.

    dp rank r owns sequences [r*B/dp, (r+1)*B/dp) of the global batch; micro-batch m of them is rows
    [m*mb, (m+1)*mb). A CP rank keeps only its positions of each sequence.
    """
    mb, n = cfg.train.micro_batch, cfg.num_microbatches
    per_rank = mb * n
    pos = cp_positions(cfg.train.seq_len, cfg.parallel.cp, cp_rank)
    for m in range(n):
        lo = dp_rank * per_rank + m * mb
        x, y = inputs[lo : lo + mb], targets[lo : lo + mb]  # [mb, T]
        if cfg.parallel.cp > 1:
            x, y = x[:, pos], y[:, pos]  # [mb, T/cp]: this rank's head and tail chunks
        yield x, y, pos


# --------------------------------------------------------------------------- token file (data.path)


def _bad(message: str, fix: str) -> ConfigError:
    return ConfigError([Problem(fields=["data.path"], message=message, fix=fix)])


@lru_cache(maxsize=8)
def _open(path: str, dtype: str, vocab: int, min_tokens: int, mtime_ns: int, size: int) -> np.memmap:
    item = np.dtype(dtype).itemsize
    if size == 0:
        raise _bad(f"{path} is empty", "point data.path at a token file (curry-train prepare-data --text FILE "
                   "--out FILE.bin)")
    if size % item:
        raise _bad(f"{path} has {size} bytes, not a whole number of {dtype} tokens",
                   "check data.dtype (uint16 for vocabularies up to 65536, else uint32)")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if len(tokens) < min_tokens:
        raise _bad(f"{path} holds {len(tokens)} tokens, fewer than one sequence needs ({min_tokens})",
                   "use a longer file or a smaller train.seq_len")
    top, chunk = 0, 1 << 24
    for lo in range(0, len(tokens), chunk):  # streamed: the file need not fit in memory
        top = max(top, int(tokens[lo:lo + chunk].max()))
    if top >= vocab:
        raise _bad(f"{path} holds token id {top} >= model.vocab_size={vocab}",
                   f"set model.vocab_size >= {top + 1}, or re-tokenize with a vocabulary of {vocab}")
    return tokens


def token_file(cfg: Config) -> np.memmap:
    """The memory-mapped, checked token file of `cfg.data.path` (cached per process)."""
    path = cfg.data.path
    try:
        st = os.stat(path)
    except OSError:
        raise _bad(f"{path} does not exist", "create it with curry-train prepare-data --text FILE --out FILE.bin, "
                   "or unset data.path for the synthetic stream") from None
    return _open(str(path), cfg.data.dtype, cfg.model.vocab_size, cfg.train.seq_len + 2, st.st_mtime_ns, st.st_size)


def file_rows(cfg: Config, step: int, rows, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) [len(rows), T or len(positions)] int64 of global rows `rows` of step `step`."""
    tokens = token_file(cfg)
    T, B = cfg.train.seq_len, cfg.train.global_batch
    span = len(tokens) - T - 1
    pos = np.arange(T) if positions is None else positions.numpy()
    starts = np.array([((step * B + i) * T) % span for i in rows], dtype=np.int64)
    idx = starts[:, None] + pos[None, :]  # [rows, T_local]: only these ids (and their successors) are read
    x = torch.from_numpy(np.asarray(tokens[idx]).astype(np.int64))
    y = torch.from_numpy(np.asarray(tokens[idx + 1]).astype(np.int64))
    return x, y


def rank_micro_batches(cfg: Config, step: int, dp_rank: int, cp_rank: int = 0):
    """`micro_batches` of step `step` for one rank, built from that rank's rows only (and, from a token file,
    only its CP positions): the same tensors as slicing `global_batch`, without the rest of the batch. All of
    the rank's mb * n rows are built in one call (one pass of the chain), then split into micro-batches."""
    mb, n = cfg.train.micro_batch, cfg.num_microbatches
    pos = cp_positions(cfg.train.seq_len, cfg.parallel.cp, cp_rank)
    lo = dp_rank * mb * n
    x, y = batch_rows(cfg, step, range(lo, lo + mb * n), pos if cfg.parallel.cp > 1 else None)  # [mb*n, T_local]
    for m in range(n):
        yield x[m * mb : (m + 1) * mb], y[m * mb : (m + 1) * mb], pos


def prepare_text(text: str | Path, out: str | Path) -> dict[str, int | str]:
    """Byte-level tokens (vocab 256, no tokenizer) of a text file, written as uint16 to `out` atomically."""
    src, dst = Path(text), Path(out)
    data = src.read_bytes()
    if not data:
        raise _bad(f"{src} is empty", "give prepare-data a text file with some content")
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    ids.tofile(tmp)
    os.replace(tmp, dst)
    return {"out": str(dst), "tokens": int(len(ids)), "dtype": "uint16", "vocab_size": 256}
