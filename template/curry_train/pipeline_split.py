"""Pipeline stage boundaries: how many transformer layers each of the pp * pp_virtual stages holds (torch-free).

    python -c "from curry_train.pipeline_split import split_layers; print(split_layers(70, 12))"

One function for the template (parallel/pipeline.py builds the stages from it) and the estimator (which counts
each rank's layers from it), so the two can never disagree.

Stage 0 also runs the token embedding and the last stage the final norm, the LM head and the loss. Megatron-LM
lets a user move whole layers off those stages (`decoder_first_pipeline_num_layers`,
`decoder_last_pipeline_num_layers`, `account_for_embedding_in_pipeline_split` /
`account_for_loss_in_pipeline_split` in megatron/core/transformer/transformer_config.py); here the boundaries are
chosen to minimise the costliest stage, with the embedding and head+loss priced in forward FLOPs per token next
to a layer's. Published uneven splits this makes expressible: BLOOM 176B (70 layers over PP12, Scao et al.
2022), Llama 3 405B (126 layers over PP16, one fewer layer on the first and last stage, Dubey et al. 2024 §3.3.2),
DeepSeek-V3 (61 layers). `parallel.pp_layers` overrides the choice.
"""

from __future__ import annotations

from functools import lru_cache


def stage_costs(*, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, vocab_size: int, seq_len: int,
                num_experts: int = 0, top_k: int = 1) -> tuple[int, int, int]:
    """(layer, embedding, head + loss) forward FLOPs per token, as integers (exact comparisons below).

    Layer: 2 * matmul params (q, k, v, o; SwiGLU w1, w3, w2, times top_k for a MoE, plus the router) plus the
    causal attention scores and their product with V, 2 * 2 * s * D / 2. Embedding: a row gather, D (it is
    light in FLOPs but priced so that ties go away from stage 0). Head: 2 * D * V plus ~5 V for the
    softmax cross-entropy.
    """
    D, Dh = d_model, d_model // n_heads
    attn = 2 * (2 * D * n_heads * Dh + 2 * D * n_kv_heads * Dh) + 2 * seq_len * D
    ffn = 2 * 3 * D * d_ff * (top_k if num_experts else 1) + (2 * D * num_experts if num_experts else 0)
    return attn + ffn, D, 2 * D * vocab_size + 5 * vocab_size


@lru_cache(maxsize=4096)
def split_layers(n_layers: int, n_stages: int, layer_cost: int = 1, first_extra: int = 0,
                 last_extra: int = 0) -> tuple[int, ...]:
    """Layers per stage (stage order), each >= 1, summing to n_layers, minimising the costliest stage, then the
    sum of squared stage costs (balance), ties giving the earlier stage the layer (the last stage already
    carries the head). With no extras and n_layers % n_stages == 0 this is the even split.

    Layers cost the same, so: (1) the smallest feasible maximum M is found by bisection over the candidate
    stage costs n * layer_cost + extra (stage s fits floor((M - extra_s) / layer_cost) layers); (2) under those
    caps, layers are handed out one at a time to the currently cheapest stage (greedy is optimal for a
    separable convex objective). O((n_layers + n_stages) log) per call, and cached.
    """
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(f"n_layers={n_layers} cannot fill {n_stages} pipeline stages with at least one layer each")
    S, L, c = n_stages, n_layers, max(1, layer_cost)
    extra = [0] * S
    extra[0] += first_extra
    extra[-1] += last_extra

    def caps(limit: int) -> list[int]:
        return [max(0, (limit - e) // c) for e in extra]

    def fits(limit: int) -> bool:
        k = caps(limit)
        return min(k) >= 1 and sum(k) >= L

    if S == 1:
        return (L,)
    # (1) the smallest feasible maximum: fits() only changes at stage costs n * c + e, so the smallest feasible
    # integer is one of them; bisect over integers (O(S log) whatever n_layers is).
    lo, hi = 0, (L - S + 1) * c + max(extra)  # hi always fits: every stage can take L - S + 1 layers
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    cap = caps(lo)
    # (2) "give the next layer to the cheapest stage, the earlier on a tie" in closed form: gifts happen in order
    # of the receiving stage's current cost, so every gift at a cost below V happens before any at V. gifts(V)
    # counts those below V; the last level V* takes the remaining gifts in stage order.
    def gifts(v: int) -> list[int]:
        return [min(cap[s] - 1, max(0, -(-(v - extra[s]) // c) - 1)) if cap[s] > 1 else 0 for s in range(S)]

    need = L - S
    a, b = 0, (L + 1) * c + max(extra)
    while a < b:  # the largest V with sum(gifts(V)) <= need
        mid = (a + b + 1) // 2
        if sum(gifts(mid)) <= need:
            a = mid
        else:
            b = mid - 1
    counts = [1 + g for g in gifts(a)]
    left = L - sum(counts)
    for s in range(S):  # the stages whose next layer costs exactly V*, earliest first
        if left and counts[s] < cap[s] and (counts[s]) * c + extra[s] == a:
            counts[s] += 1
            left -= 1
    assert left == 0 and sum(counts) == L, (L, S, counts)
    return tuple(counts)


def check_pp_layers(pp_layers: list[int] | None, n_layers: int, n_stages: int) -> str | None:
    """Why an explicit `parallel.pp_layers` cannot be used (None when it can)."""
    if pp_layers is None:
        return None
    if len(pp_layers) != n_stages:
        return f"pp_layers has {len(pp_layers)} entries but there are pp*pp_virtual={n_stages} stages"
    if any(n < 1 for n in pp_layers):
        return f"pp_layers={list(pp_layers)} has a stage with no layer"
    if sum(pp_layers) != n_layers:
        return f"pp_layers={list(pp_layers)} sums to {sum(pp_layers)}, not n_layers={n_layers}"
    return None


def layers_per_stage(*, n_layers: int, pp: int, pp_virtual: int, pp_layers: list[int] | tuple[int, ...] | None,
                     d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, vocab_size: int, seq_len: int,
                     num_experts: int = 0, top_k: int = 1) -> tuple[int, ...]:
    """The split a config runs: `pp_layers` when given, else the cost-balanced split."""
    n_stages = pp * pp_virtual
    if pp_layers is not None:
        why = check_pp_layers(list(pp_layers), n_layers, n_stages)
        if why:
            raise ValueError(why)
        return tuple(pp_layers)
    layer, embed, head = stage_costs(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff,
                                     vocab_size=vocab_size, seq_len=seq_len, num_experts=num_experts, top_k=top_k)
    return split_layers(n_layers, n_stages, layer, embed, head)


def stage_layer_range(counts: tuple[int, ...] | list[int], stage: int) -> range:
    """Global layer indices of `stage` for a split `counts`."""
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def split_for(cfg) -> tuple[int, ...]:
    """`layers_per_stage` of a config.Config (duck-typed: config.py imports this module)."""
    m, p = cfg.model, cfg.parallel
    return layers_per_stage(n_layers=m.n_layers, pp=p.pp, pp_virtual=p.pp_virtual,
                            pp_layers=tuple(p.pp_layers) if p.pp_layers else None, d_model=m.d_model,
                            n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, d_ff=m.d_ff, vocab_size=m.vocab_size,
                            seq_len=cfg.train.seq_len, num_experts=m.num_experts, top_k=m.top_k)


def pipeline_stage_ids(pp: int, v: int, schedule: str, pp_rank: int) -> list[int]:
    """Stage indices pipeline rank `pp_rank` holds, in the order the schedule expects.

    Zero-bubble with two chunks is torch's ScheduleZBVZeroBubble: a V, down the ranks and back up, so rank r
    holds stages r and 2p-1-r and the turn stays local (Qi et al. 2024, "Zero Bubble Pipeline Parallelism").
    Every other schedule is looped: rank r holds r, r+p, ... (Narayanan et al. 2021, interleaved 1F1B)."""
    if pp == 1:
        return [0]
    if schedule == "zero_bubble" and v == 2:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(v)]
