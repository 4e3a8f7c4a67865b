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

from curry_train.moe_blocks import dense_width, shared_width


def stage_costs(*, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, vocab_size: int, seq_len: int,
                num_experts: int = 0, top_k: int = 1, shared_d_ff: int = 0) -> tuple[int, int, int]:
    """(layer, embedding, head + loss) forward FLOPs per token, as integers (exact comparisons below).

    Layer: 2 * matmul params (q, k, v, o; SwiGLU w1, w3, w2, times top_k for a MoE, plus the router and the
    fused shared expert of width shared_d_ff) plus the causal attention scores and their product with V,
    2 * 2 * s * D / 2. A dense block of a MoE model (first_k_dense) is priced with num_experts=0 and its own
    d_ff (layers_per_stage). Embedding: a row gather, D (it is
    light in FLOPs but priced so that ties go away from stage 0). Head: 2 * D * V plus ~5 V for the
    softmax cross-entropy.
    """
    D, Dh = d_model, d_model // n_heads
    attn = 2 * (2 * D * n_heads * Dh + 2 * D * n_kv_heads * Dh) + 2 * seq_len * D
    ffn = 2 * 3 * D * d_ff * (top_k if num_experts else 1) + (2 * D * num_experts if num_experts else 0)
    if num_experts:
        ffn += 2 * 3 * D * shared_d_ff
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
                     num_experts: int = 0, top_k: int = 1, shared_d_ff: int = 0, first_k_dense: int = 0,
                     dense_d_ff: int = 0) -> tuple[int, ...]:
    """The split a config runs: `pp_layers` when given, else the cost-balanced split. A MoE model's first
    `first_k_dense` blocks (dense SwiGLU of width dense_d_ff) cost less than its MoE blocks: then the split
    balances the actual per-layer costs (split_costs)."""
    n_stages = pp * pp_virtual
    if pp_layers is not None:
        why = check_pp_layers(list(pp_layers), n_layers, n_stages)
        if why:
            raise ValueError(why)
        return tuple(pp_layers)
    layer, embed, head = stage_costs(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff,
                                     vocab_size=vocab_size, seq_len=seq_len, num_experts=num_experts, top_k=top_k,
                                     shared_d_ff=shared_d_ff)
    if num_experts and first_k_dense:
        dense = stage_costs(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=dense_d_ff or d_ff,
                            vocab_size=vocab_size, seq_len=seq_len)[0]
        if dense != layer:
            costs = (dense,) * first_k_dense + (layer,) * (n_layers - first_k_dense)
            return split_costs(costs, n_stages, embed, head)
    return split_layers(n_layers, n_stages, layer, embed, head)


@lru_cache(maxsize=1024)
def split_costs(costs: tuple[int, ...], n_stages: int, first_extra: int = 0, last_extra: int = 0) -> tuple[int, ...]:
    """split_layers for layers of unequal cost (`costs[i]` = layer i's): contiguous stages, each >= 1 layer,
    minimising the costliest stage, then the sum of squared stage costs, ties giving the earlier stage the layer.
    Exact dynamic programme over (stage, layers so far), O(n_stages * L^2); past ~4M steps (thousands of layers)
    the minimal maximum is found by bisection and the stages filled greedily from the front."""
    L, S = len(costs), n_stages
    if S < 1 or L < S:
        raise ValueError(f"n_layers={L} cannot fill {S} pipeline stages with at least one layer each")
    extra = [0] * S
    extra[0] += first_extra
    extra[-1] += last_extra
    pre = [0]
    for c in costs:
        pre.append(pre[-1] + c)
    if S * L * L > 4_000_000:
        return _split_costs_greedy(pre, S, extra)
    inf = (float("inf"), float("inf"))
    best = [[inf] * (L + 1) for _ in range(S + 1)]  # best[s][i]: (max, sum of squares) of layers [0, i) in s
    cut = [[0] * (L + 1) for _ in range(S + 1)]
    best[0][0] = (0, 0)
    for s in range(1, S + 1):
        for i in range(s, L - (S - s) + 1):
            for j in range(i - 1, s - 2, -1):  # descending: on a tie the earlier stages keep more layers
                prev = best[s - 1][j]
                if prev == inf:
                    continue
                c = pre[i] - pre[j] + extra[s - 1]
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[s][i]:
                    best[s][i], cut[s][i] = cand, j
    counts, i = [], L
    for s in range(S, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


def _split_costs_greedy(pre: list[int], S: int, extra: list[int]) -> tuple[int, ...]:
    """The smallest feasible maximum by bisection, then each stage filled as far as it allows from the front."""
    L = len(pre) - 1

    def fill(limit: int) -> list[int] | None:
        counts, i = [], 0
        for s in range(S):
            j = i + 1  # at least one layer; leave one for each later stage
            while j < L - (S - s - 1) and pre[j + 1] - pre[i] + extra[s] <= limit:
                j += 1
            if pre[j] - pre[i] + extra[s] > limit:
                return None
            counts.append(j - i)
            i = j
        return counts if i == L else None

    lo, hi = 0, pre[L] + max(extra)
    while lo < hi:
        mid = (lo + hi) // 2
        if fill(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return tuple(fill(lo))  # type: ignore[arg-type]


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
                            seq_len=cfg.train.seq_len, num_experts=m.num_experts, top_k=m.top_k,
                            shared_d_ff=shared_width(m), first_k_dense=m.first_k_dense if m.num_experts else 0,
                            dense_d_ff=dense_width(m))


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
