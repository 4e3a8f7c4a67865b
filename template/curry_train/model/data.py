"""Deterministic, learnable synthetic tokens, sliced identically for the reference and every parallel layout.

    python -c "from curry_train.model.data import global_batch; from curry_train.config import Config; print(global_batch(Config(), 0)[0][:2])"

The stream is a sparse Markov chain: each token has 4 successors drawn once from the seed, taken with
probabilities 0.7/0.15/0.1/0.05. A model can learn it (entropy ~1.0 nat vs ln V at init), so the loss falls.
Every rank generates the *whole* global batch of a step (B*T ids, cheap) and slices its part, so the split
never changes the data.
"""

from __future__ import annotations

import torch

from curry_train.config import Config

_SUCC_PROBS = torch.tensor([0.70, 0.15, 0.10, 0.05])


def _successors(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    return torch.randint(0, vocab, (vocab, len(_SUCC_PROBS)), generator=g)  # [V, 4]


def global_batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each [global_batch, seq_len] int64, for optimizer step `step`."""
    V, B, T = cfg.model.vocab_size, cfg.train.global_batch, cfg.train.seq_len
    succ = _successors(V, cfg.train.seed)
    g = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
    tokens = torch.empty(B, T + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, V, (B,), generator=g)
    choice = torch.multinomial(_SUCC_PROBS.expand(B, -1), T, replacement=True, generator=g)  # [B, T]
    for t in range(T):
        tokens[:, t + 1] = succ[tokens[:, t], choice[:, t]]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


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
