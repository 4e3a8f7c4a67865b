"""Flip-aware routing for the white-box of MoE models in bf16: the parallel run's top-k choices, recorded per token,
judged and replayed by the single-device reference (imports torch).

Why. Where bf16 is held to relative bounds (tp, cp, ep: validation/compare.py, "bfloat16") the ranks round other
bf16 partial sums than the reference, so the router's input x (the bf16 residual stream after ffn_norm) differs
by a few bf16 roundings, and a token whose top-k scores are nearly tied may choose another expert. The router
gate's gradient is a near-cancelling sum over tokens, so a handful of such flips moves it by 5-7% (more than the
5% gradient bound) although the parallel run computes correctly. Loosening that bound would hide real bugs; here
every flip is judged instead, and the excused ones are replayed so both sides compute the same thing.

Record (ranks, `RouteRecorder`): every TopKRouter's chosen experts [N, K] and fp32 logits [N, E] of every
micro-batch, put at their global token positions [global_batch, seq_len] (rows: this dp rank's micro-batches,
model/data.micro_batches; positions: this cp rank's, data.cp_positions, and under TP + EP this tp rank's T/tp
slice of them) and merged on rank 0; ranks holding the same tokens (tp replicas) must have chosen the same.

Judge and replay (reference, `RouteReplay`, installed per micro-batch on the routers of the model that runs it):
  bound     x differs from the reference's router input by bf16 roundings placed elsewhere: model each as an
            independent, mean-zero relative error of at most u = 2^-8 (bf16 keeps 8 significant bits, round to
            nearest) per component, c of them (`roundings`; the probabilistic model of Higham & Mary 2019, "A New
            Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5)). The logits
            l = x W^T are computed in fp32 from the bf16 x and gate weight W (model/moe.py TopKRouter), so by
            Hoeffding's inequality, with probability >= 1 - 2 exp(-LAMBDA^2 / 2) each,
                |dl_e| <= LAMBDA sqrt(c) u ||x * W_e||_2                        every logit, every token
                |d(l_a - l_b)| <= LAMBDA sqrt(c) u ||x * (W_a - W_b)||_2         every pair of experts a, b
            (* elementwise). The worst-case form (sum_d |x_d| |W_ed|, Higham 2002 §3.1) would be ~sqrt(D) looser
            and excuse a wrong choice on a large share of tokens; the errors measured below sit well inside this one.
  logits    the first bound is checked on every token and expert against the parallel run's own logits
            ("router_logits" in bound_use): it is the premise of the excuse below, so it is measured, not assumed.
  flips     a pair (a, b) is discordant when the two runs rank it in opposite orders (a in the reference's top-k
            and b not while the parallel run chose b and not a, or their order inside the top-k swapped). The
            softmax is monotone, so a discordant pair needs |l_a - l_b| <= |d(l_a - l_b)|: it is excused only when
            the reference's own gap is within the second bound ("routing_tie": the largest share of it), and then
            the reference replays the parallel run's choice for that token (same experts in the same order, gates
            from its own probabilities: the parallel run's computation). A discordant pair beyond the margin is a
            divergence (a wrong expert, not rounding): the verdict fails with the layer and the number of tokens,
            and the token is not replayed. A token no rank recorded, or tp replicas that chose differently, fail.
  c         roundings whose placement differs from the reference's before this router: per block up to and
            including its own, 2 (TP: each rank's attention.wo partial sum and their bf16 sum, where the reference
            rounds the full sum once; CP: the ring's per-block attention outputs and their merge; the residual
            add then rounds a different value), which the residual stream carries on with gain 1, and ffn_norm's
            output: c = 2 (layer + 1) + 1. LAMBDA = 6: 3e-8 per logit, so over the ~16k logits of a tiny-moe
            white-box (512 tokens, 4 experts, 4 layers, 2 steps) a false alarm has probability < 1e-3.
Measured (tiny-moe in bf16, 2 steps, docs/CPU-DISTRIBUTED.md "bf16"): tp2, tp2 sp, cp2 flip 0-3 tokens per layer
and step, all within 12% of the margin; the logits use <= 29% of their bound; the planted route-drops-best (every
8th token drops its best expert) fails 64 of 64 planted tokens in layer 0, worst 74x the margin. The margin
holds a token's K-th and (K+1)-th experts on 8-13% of tokens, its best and (K+1)-th on 0.1-0.9%.

Where it applies (`flip_aware`): MoE models in bf16 held to the relative bounds, eager. fp32 and the bf16 layouts
that compute the reference's exact bf16 ops (dtypes.bf16_cast_exact) record nothing and replay nothing: there
the router's input differs by fp32 reordering at most (~1e-7 relative), a flip would need a tie that close, and
a flipped token changes its experts' gradients by O(1), which the fp32 gradient bounds fail as before.
"""

from __future__ import annotations

import math
from typing import Any

import torch

U = 2.0 ** -8  # bf16 unit roundoff
LAMBDA = 6.0  # Hoeffding: a bound exceeded with probability <= 2 exp(-LAMBDA^2 / 2) = 3e-8 per logit


def flip_aware(cfg, compiled: bool = False) -> bool:
    """Whether this white-box records and replays routing (module docstring, "Where it applies")."""
    from curry_train.validation.dtypes import bf16_cast_exact

    return (cfg.model.num_experts > 0 and cfg.train.dtype == "bfloat16" and not compiled
            and not bf16_cast_exact(cfg, compiled))


def layer_index(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("layers.") else 0


def roundings(name: str) -> int:
    """c of the module docstring for the router `name` (layers.<i>.feed_forward.router): 2 per block up to and
    including its own, and ffn_norm's output."""
    return 2 * (layer_index(name) + 1) + 1


# --------------------------------------------------------------------------- ranks


class RouteRecorder:
    """Forward hooks on every TopKRouter of `par.parts`; `take()` after each step's forward (every rank)."""

    def __init__(self, par: Any, canonical, paused=lambda: False) -> None:
        import torch.distributed as dist

        from curry_train.model.data import cp_positions
        from curry_train.model.moe import TopKRouter

        cfg, topo = par.cfg, par.topo
        at = topo.coords(dist.get_rank() if dist.is_initialized() else 0)
        self.cfg, self.tp, self.tp_rank, self.paused = cfg, topo.tp, at["tp"], paused
        self.first_row = at["dp"] * cfg.train.micro_batch * cfg.num_microbatches  # data.micro_batches' rows
        self.positions = cp_positions(cfg.train.seq_len, topo.cp, at["cp"])  # [T / cp]
        self.calls: dict[str, int] = {}
        self.seen: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.routers = [(n, m) for part in par.parts for n, m in part.named_modules() if isinstance(m, TopKRouter)]
        for _, m in self.routers:
            m.keep_logits = True  # Routing carries the logits while recorded (model/moe.py TopKRouter)
        self.handles = [m.register_forward_hook(self._hook(canonical(n)), with_kwargs=True) for n, m in self.routers]

    def _hook(self, name: str):
        from curry_train.parallel.recompute import host_once

        def hook(module, args, kwargs, out) -> None:
            if self.paused() or not torch.is_grad_enabled() or out.logits is None or out.logits.is_meta:
                return  # `paused`: not a forward of the step (the activation probe's pipeline shape inference)
            host_once(lambda: self._record(name, int(kwargs.get("batch", 1)), out))  # not in recomputation
        return hook

    def _record(self, name: str, batch: int, out: Any) -> None:
        m = self.calls.get(name, 0)  # this router's micro-batch index in the step
        self.calls[name] = m + 1
        local = out.logits.shape[0] // batch  # tokens per sequence this router saw
        pos = self.positions
        if local != len(pos):  # TP + EP: this tp rank's contiguous T/tp slice (tensor_parallel.block_plan)
            pos = pos.view(self.tp, -1)[self.tp_rank]
        rows = torch.arange(batch) + self.first_row + m * self.cfg.train.micro_batch
        self.seen.setdefault(name, []).append((rows, pos, out.experts.detach().cpu().view(batch, local, -1),
                                               out.logits.detach().float().cpu().view(batch, local, -1)))

    def take(self) -> dict[str, dict[str, Any]] | None:
        """This step's routes of every layer at full [global_batch, seq_len] on rank 0 (None elsewhere):
        {router name: {"experts": int64 [B, T, K] (-1 where no rank routed the token), "logits": fp32 [B, T, E],
        "conflicts": {rank: tokens it routed otherwise than the first holder}}}. A collective; then reset."""
        import torch.distributed as dist

        B, T = self.cfg.train.global_batch, self.cfg.train.seq_len
        mine = {}
        for name, parts in self.seen.items():
            K, E = parts[0][2].shape[-1], parts[0][3].shape[-1]
            experts, logits = torch.full((B, T, K), -1, dtype=torch.long), torch.full((B, T, E), float("nan"))
            for rows, pos, e, lg in parts:
                experts[rows[:, None], pos[None, :]] = e
                logits[rows[:, None], pos[None, :]] = lg
            mine[name] = (experts, logits)
        self.seen, self.calls = {}, {}
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(mine, everyone, dst=0)
            if dist.get_rank() != 0:
                return None
        merged: dict[str, dict[str, Any]] = {}
        for rank, theirs in enumerate(everyone):
            for name, (e, lg) in theirs.items():
                if name not in merged:
                    merged[name] = {"experts": e, "logits": lg, "conflicts": {}}
                    continue
                into, held = merged[name], e[..., 0] >= 0
                known = into["experts"][..., 0] >= 0
                differ = int((held & known & (e != into["experts"]).any(-1)).sum())
                if differ:
                    into["conflicts"][rank] = differ
                new = held & ~known
                into["experts"][new], into["logits"][new] = e[new], lg[new]
        return merged

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for _, m in self.routers:
            m.keep_logits = False


# --------------------------------------------------------------------------- reference


def _positions(top: torch.Tensor, E: int) -> torch.Tensor:
    """top [N, K] expert ids -> [N, E]: each expert's place in the choice (0 = first), K where not chosen."""
    N, K = top.shape
    pos = torch.full((N, E), K, dtype=torch.long)
    return pos.scatter_(1, top, torch.arange(K).expand(N, K).contiguous())


class RouteReplay:
    """One step's judge (module docstring): `install(model, micro)` before each micro-batch's forward sets every
    router's `replay`; `stats` per router name: tokens compared, discordant (other set or order), set flips,
    replayed (excused), diverged, unrecorded, the largest share of the tie margin and of the logit bound."""

    def __init__(self, recorded: dict[str, dict[str, Any]], micro_batch: int):
        self.recorded, self.mb = recorded, micro_batch
        self.stats: dict[str, dict[str, Any]] = {}

    def install(self, model: torch.nn.Module, micro: int) -> None:
        from curry_train.model.moe import TopKRouter

        for name, m in model.named_modules():
            if isinstance(m, TopKRouter):
                m.replay = self._judge(name, micro)

    def _judge(self, name: str, micro: int):
        def replay(x: torch.Tensor, w: torch.Tensor, logits: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return self._replay(name, micro, x.detach().cpu(), w.detach().cpu(), logits.detach().cpu(), top)
        return replay

    def _replay(self, name: str, micro: int, x: torch.Tensor, w: torch.Tensor, logits: torch.Tensor,
                top: torch.Tensor) -> torch.Tensor:
        (N, K), E = top.shape, logits.shape[1]
        st = self.stats.setdefault(name, {"tokens": 0, "discordant": 0, "flips": 0, "replayed": 0, "diverged": 0,
                                          "unrecorded": 0, "conflicts": {}, "tie_share": 0.0, "worst_share": 0.0,
                                          "logit_share": 0.0, "roundings": roundings(name)})
        rec = self.recorded.get(name)
        rows = slice(micro * self.mb, (micro + 1) * self.mb)
        if rec is None:
            st["unrecorded"] += N
            return top
        st["conflicts"] = rec.get("conflicts") or {}
        par_top = rec["experts"][rows].reshape(N, K)  # [N, K] in the reference's token order (b, t)
        par_logits = rec["logits"][rows].reshape(N, E)
        seen = (par_top >= 0).all(-1)  # [N]
        st["tokens"] += N
        st["unrecorded"] += int((~seen).sum())
        scale, ref_top = LAMBDA * math.sqrt(st["roundings"]) * U, top.cpu()
        bound = scale * ((x * x) @ (w * w).t()).sqrt()  # [N, E] the per-logit bound
        share = ((par_logits - logits).abs() / bound)[seen]
        st["logit_share"] = max(st["logit_share"], float(share.max()) if share.numel() else 0.0)
        pos_ref, pos_par = _positions(ref_top, E), _positions(par_top.clamp(min=0), E)
        disc = (pos_ref[:, :, None] < pos_ref[:, None, :]) & (pos_par[:, :, None] > pos_par[:, None, :])  # [N,E,E]
        idx = (disc.flatten(1).any(1) & seen).nonzero().flatten()
        if not idx.numel():
            return top
        dw = w[:, None, :] - w[None, :, :]  # [E, E, D]
        margin = scale * torch.einsum("nd,abd->nab", x[idx] ** 2, dw * dw).sqrt()  # [n, E, E]
        gap = (logits[idx][:, :, None] - logits[idx][:, None, :]).abs()  # [n, E, E]
        tie = torch.where(disc[idx], gap / margin, 0.0).flatten(1).max(1).values  # [n] worst pair per token
        ok = tie <= 1.0
        st["discordant"] += len(idx)
        st["flips"] += int(((pos_ref[idx] < K) != (pos_par[idx] < K)).any(1).sum())  # the chosen set differs
        st["replayed"] += int(ok.sum())
        st["diverged"] += int((~ok).sum())
        st["tie_share"] = max(st["tie_share"], float(tie[ok].max()) if ok.any() else 0.0)
        st["worst_share"] = max(st["worst_share"], float(tie.max()))
        out = top.clone()
        out[idx[ok].to(top.device)] = par_top[idx[ok]].to(top.device)
        return out


def route_check(c: Any, step: int, stats: dict[str, dict[str, Any]] | None) -> None:
    """Hold one step's judged routing (RouteReplay.stats) to its bounds on the white-box checker `c`
    (compare._Checker): every divergence, unrecorded token and tp-replica conflict fails, naming the layer."""
    from curry_train.validation.verdict import ParamDiff

    for name, st in sorted((stats or {}).items(), key=lambda kv: layer_index(kv[0])):
        c.used("router_logits", st["logit_share"])
        tie = c.used("routing_tie", st["worst_share"])
        why = []
        if st["diverged"]:
            why.append(f"{st['diverged']} of {st['tokens']} tokens chose other experts than the reference beyond "
                       f"the bf16 near-tie margin (worst gap {st['worst_share']:.3g}x the margin)")
        if st["unrecorded"]:
            why.append(f"{st['unrecorded']} tokens the ranks did not route")
        for rank, n in sorted(st["conflicts"].items()):
            why.append(f"rank {rank} routed {n} tokens otherwise than the first rank holding them")
        if st["logit_share"] > 1:
            why.append(f"router logits moved {st['logit_share']:.3g}x the bf16 rounding bound")
        ratio = max(tie, st["logit_share"], 1.0 + 1e-9 if why else 0.0)
        diff = ParamDiff(name=f"routing[step {step}] {name}", max_abs_diff=float(st["diverged"]), allowed=1.0,
                         ref_max_abs=float(st["tokens"]), metric="worst discordant gap / near-tie margin",
                         measured=st["worst_share"])
        c._record(ratio, diff, name, f"routing[step {step}] {name}: " + "; ".join(why), None)


def route_summary(routing: list[dict[str, dict[str, Any]] | None] | None) -> list[dict[str, dict[str, int]]] | None:
    """The verdict's `routing`: per step and router, the token counts of RouteReplay.stats (None: not recorded)."""
    if not routing or all(r is None for r in routing):
        return None
    keys = ("tokens", "discordant", "flips", "replayed", "diverged")
    return [{name: {k: int(st[k]) for k in keys} for name, st in (r or {}).items()} for r in routing]
