"""The white-box comparison: a parallel run's losses, gradients and every rank's parameters against the reference.

Re-sync. From step 1 on, the reference (whitebox.reference) restarts each step from the parallel run's gathered
weights after the previous step, so step s's gradients and update are taken at the same weights on both sides and
every step is held to the step-0 bounds below: an error of one step can never loosen the next step's bounds (the
former drift term, 30 x the largest relative parameter difference, fed on the very divergence it should catch).
The optimizer state is the reference's own, built from its gradients at those weights; this is the equivalent of
also re-synchronising the AdamW moments, because they are a fixed linear filter (exp_avg) and one of squares
(exp_avg_sq) of the per-step gradients, each held to the step-0 gradient bound at the same weights, so the two
states differ by the accumulated gradient noise only and not by any feedback through the weights (Kingma & Ba
2015, "Adam", Algorithm 1; Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", Algorithm 2). A bug
in the parallel optimizer state shows as its update differing from the reference's. docs/CPU-DISTRIBUTED.md,
"White-box checks", lists every check with its measured clean noise and the smallest error it detects.

Tolerances, fp32 (noise measured on correct runs, CPU/gloo, 1 thread per rank, 2 steps, re-synchronised; each
fixed bound is >= 10x the largest noise seen over the layouts of tests/test_whitebox.py and tests/parallel/*, 2
and 4 ranks, dense and MoE; `Verdict.bound_use` reports the largest share of each bound a run used):
  loss        |d| <= 1e-5 * max(1, |ref|)       noise <= 9.5e-7: reductions sum in another order (dp/cp split
                                                 means, TP's loss_parallel softmax, CP's log-sum-exp merge)
  grad norm   |d| <= 1e-6 + 1e-5 * ref
  gradients   elementwise |d| <= 1e-6 + 1e-5 * |ref|   noise <= 3.4e-8 (relative error alone is meaningless for
              near-zero elements: it reached 3e-3 on correct runs), and per tensor
              ||g_par - g_ref||_2 <= 1e-4 * ||g_ref||_2   noise <= 4e-7 relative (tiny-moe tp2, cp2, cp4): the
              elementwise floor checks a tensor whose gradients are ~1e-5 to ~10% only, the per-tensor L2 to 1e-4
              of its own norm whatever its scale, so a 1% error in any one tensor fails (one rank's wq x 1.01).
              Exact zeros: an element whose reference gradient is exactly 0 (unseen embedding rows, unrouted
              experts) must be exactly 0 in the parallel run (measured: always, on every layout).
  updates     ||D_par - D_ref||_2 <= 1e-3 * ||D_ref||_2 + 1e-9 * sqrt(n), per parameter tensor, after every step,
              D = param_after - param_start, both from the same (re-synchronised) weights. Relative to the
              optimizer *update*, not derived from lr. Noise <= 7e-6 relative (cp2, zero3). Bugs it catches: a
              dropped weight decay (lr*wd*|p| against an update of ~lr: 1e-1 relative on the norm weights, whose
              value is 1), a different lr (9x relative), a lost reduction, a clip by the local shard's norm.
  sign-free   AdamW's update of an element is ~g/(|g|+eps) (eps 1e-8) while |g| is near eps: 1e-9 of reordering
              noise on g = -1e-8 moves that update by ~10% of lr, and one such element of a 4096-element tensor is
              1.4e-3 of its update's L2 norm (measured: tiny-moe dp2 ep2 cp2, layers.1.attention.wo, step 0). So
              elements whose reference gradient was ever below adam_free_grad = 1e-6 (the gradient bound's own
              absolute floor) leave the L2 sum, and their divergence accumulated over the steps (the sum of each
              step's |diff|, what the weights would have drifted without re-sync) is held below lr (free_lr = 1):
              a sign flip of one update fails. Noise <= 0.09 lr at 2 steps (tiny-moe cp2 and dp2 cp2 ep2).
              Elements whose reference gradient was exactly 0 at every step so far have m = v = 0 on both sides:
              their update is the weight decay alone, the same arithmetic on the same weights, held to exactly 0
              difference.
  replicas    every rank holding a parameter (dp/cp replicas under DDP and ZeRO-1, TP-replicated norms, ranks of
              the same pipeline stage) checksums its full copy after every update, and every rank its reduced
              gradients before it; a copy whose bits differ from the first holder's fails, in every dtype, naming
              its rank (`diverging_rank`), and is shipped to rank 0 and compared with the reference for detail.
              Correct runs keep replicas bitwise equal (the same reduced gradients, the same optimizer arithmetic;
              measured on every layout above), so only a bug ships any copy at all: a rank stepping on the sum of
              the gradients, which the clip hides in its update, fails on its gradient checksum.
CP and gradient accumulation change only the order of fp32 sums (per-chunk then merged, per micro-batch then
summed), which is the noise above; nothing in those paths runs in lower precision.

  activations every probed module's forward output (embedding, each block, final norm) as per-feature sums over
              the step's tokens, all ranks together (validation/activations.py states the bounds, act_rtol 1e-4):
              the first failing one in forward order is the verdict's first_diverging_layer, because a backward
              bug shows in every gradient below it but a forward bug only from its own layer on.
  per rank    every rank's own loss and the norm it clipped by (train.loop.StepResult.grad_norm) against the
              reference's, with the loss and grad-norm bounds: they are replicated values, so a rank whose value
              differs is named (diverging_rank) when no tensor copy diverged. And every gradient the step's
              zero-grad left non-zero on any rank (`grads_left`; "zero_grad" in bound_use): none may be left.

bfloat16 runs are compared with a reference that makes the same casts (whitebox.reference `cast`: FSDP2's bf16 units
reducing in fp32, which every bf16 layout runs, wrapping.py). Layouts that split the batch only at micro-batch
boundaries (dp, ZeRO/FSDP, HSDP, pp, recompute: `bf16_cast_exact`) then run the reference's bf16 operations on the
same shapes, so they are held to every fp32 bound above, updates included (measured: <= 0.7% of any bound on dp2,
zero3, pp2, dp2 + recompute, tiny-moe dp2); a gradient reduced in bf16 instead of fp32 fails at 100-180x. tp, cp and
ep split a matmul's inner or token dimension, so bf16 rounds other partial sums than the reference (8 mantissa bits,
~0.4% per rounding): they keep relative bounds, every step re-synchronised, BF16 below: gradients 5% relative L2 per
tensor (clean <= 18%: tiny tp2; tiny-moe tp2, tp2 sp, cp2 <= 16%), the grad norm 6e-4 relative (clean <= 32%: tiny-moe
tp2 sp ep2; a 1% error in one TP partial sum of one block fails at 1.4x), the loss 2e-4, activations 2e-3 (clean <=
15%). MoE there (validation/routing.py): other roundings flip 0-3 near-tied top-k choices per layer and step, which
moved the router gate's gradient (a near-cancelling sum) to 1.04x (tp2), 1.45x (cp2) of its bound: router logits are
held to a bf16 rounding bound (clean <= 29%), a flip is excused within the near-tie margin derived there (clean <=
12%) and replayed by the reference, any other fails (the planted route-drops-best at 74x). Updates are not compared
(AdamW's first updates are ~lr*sign(g): a gradient below bf16 resolution flips a whole lr-sized step; proven in fp32,
the same code). FSDP units' dtypes are checked against the policy in any layout (validation/dtypes.py): a bf16
reduction fails there inside the relative bounds. Replicas (parameters, reduced gradients): any bit differing fails.

GPU (ranks on CUDA, reference on one GPU of the same kind, TF32 off, deterministic kernels where torch has them):
the same fp32 bounds. cuBLAS picks its reduction split by matrix shape, so a TP or sequence shard sums in another
order than the full matrix: fp32 reordering noise as gloo's (~1e-7 relative); TF32 (10-bit mantissa, ~5e-4 relative)
would exceed the gradient bound, so it is off on both sides. Reasoned, not yet measured (benchmarks/gpu.py).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from curry_train.config import Config
from curry_train.validation.dtypes import bf16_cast_exact, policy_failures  # the bound class of a layout
from curry_train.validation.routing import route_check, route_summary
from curry_train.validation.verdict import ParamDiff, Verdict

FP32 = {"loss_rtol": 1e-5, "grad_atol": 1e-6, "grad_rtol": 1e-5, "grad_rel_l2": 1e-4, "grad_norm_rtol": 1e-5,
        "update_rtol": 1e-3, "update_atol": 1e-9, "adam_free_grad": 1e-6, "free_lr": 1.0, "act_rtol": 1e-4}
BF16 = {"loss_rtol": 2e-4, "grad_rel_l2": 5e-2, "grad_norm_rtol": 6e-4, "act_rtol": 2e-3}
# A compiled bf16 block keeps its fused elementwise chains in fp32 (bf16_cast_exact): its grad norm is nearer the
# exact one than the eager reference's by up to 9.3e-4 relative (measured); the grad-norm bound is the activations'
BF16_COMPILED = {"grad_norm_rtol": 2e-3}
HUGE = 1e30  # the ratio recorded for NaN (never <= 1, and JSON-safe unlike inf)


def layer_order(name: str) -> tuple[int, int]:
    if name.startswith("tok_embeddings"):
        return (0, 0)
    m = re.match(r"layers\.(\d+)(\.|$)", name)
    if m:
        return (1, int(m.group(1)))
    return (2, 0 if name.startswith("norm") else 1)


def module_of(name: str) -> str:
    m = re.match(r"(layers\.\d+)(\.|$)", name)
    return m.group(1) if m else name.split(".")[0]


def grads_left(parts: list[torch.nn.Module]) -> list[str]:
    """Rank side, after a step: this rank's parameters whose gradient is still non-zero (DDP zeroes its bucket
    views in place, FSDP sets None: either is clean)."""
    return [n for part in parts for n, p in part.named_parameters() if p.grad is not None
            and bool((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).any())]


def _ratio(x: float) -> float:
    return min(x, HUGE) if x == x else HUGE  # NaN fails: a comparison with NaN is False, never "within bound"


def _max(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def _exact(diff: float, scale: float) -> float:
    """Ratio of an exact check (allowed: 0): 0 when equal, else 1 + diff / scale, over 1 for any difference and
    growing with its size in the check's own unit (grad_atol for gradients, lr for updates), so that it ranks
    among the other checks' ratios when the verdict picks the worst tensor."""
    return 0.0 if diff == 0 else 1.0 + diff / scale


class _Checker:
    """Accumulates failures, the worst (diff / allowed) ratio per stage, and the largest fraction of each bound
    used (`use`, per check). A stage is (step, -1) for the step's forward activations, (step, 0) for its
    gradients and (step, 1) for the parameters after its update; the verdict localises in the earliest failing
    stage (a wrong step makes the next ones differ). `scalar_ranks`: stage -> ranks whose own loss or clip norm
    failed (used to name a rank only when no tensor copy did)."""

    def __init__(self, bf16: bool, tol: dict[str, float]):
        self.bf16, self.tol = bf16, tol
        self.stage = (0, 0)
        self.failures: list[str] = []
        self.failing: dict[tuple[int, int], list[str]] = {}  # stage -> reference names of failing tensors
        self.worst: dict[tuple[int, int], tuple[float, ParamDiff]] = {}
        self.ranks: dict[tuple[int, int], list[int]] = {}  # stage -> ranks whose copy fails
        self.scalar_ranks: dict[tuple[int, int], list[int]] = {}
        self.use: dict[str, float] = {}

    def used(self, check: str, ratio: float) -> float:
        ratio = _ratio(ratio)
        self.use[check] = max(self.use.get(check, 0.0), ratio)
        return ratio

    def _record(self, ratio: float, diff: ParamDiff, name: str, message: str, rank: int | None) -> None:
        worst = self.worst.get(self.stage, (-1.0, None))[0]
        # a replica copy (rank given) is the worst of its stage only when rank 0's own tensors all passed
        if ratio > worst and (rank is None or worst <= 1.0):
            self.worst[self.stage] = (ratio, diff)
        if ratio > 1.0:
            self.failures.append(message)
            self.failing.setdefault(self.stage, []).append(name)
            if rank is not None:
                self.ranks.setdefault(self.stage, []).append(rank)

    def _missing(self, kind: str, name: str, a: torch.Tensor, b: torch.Tensor | None) -> bool:
        if b is None:
            self.failures.append(f"{kind} {name}: missing from the parallel run")
        elif a.shape != b.shape:
            self.failures.append(f"{kind} {name}: shape {tuple(b.shape)} != reference {tuple(a.shape)}")
        else:
            return False
        self.failing.setdefault(self.stage, []).append(name)
        return True

    def _worst_of(self, checks: list[tuple[str, float, float, float, str]]) -> tuple[float, float, float, str]:
        """(ratio, measured, allowed, metric) of the check using the largest share of its bound."""
        best = (0.0, 0.0, 0.0, checks[0][4])
        for check, ratio, measured, allowed, metric in checks:
            ratio = self.used(check, ratio)
            if ratio >= best[0]:
                best = (ratio, measured, allowed, metric)
        return best

    def _replica(self, kind: str, name: str, rank: int, ratio: float, detail: str) -> None:
        """A copy whose bits differ from the first holder's fails in every dtype (docstring, "replicas")."""
        diff = ParamDiff(name=kind + " " + name, max_abs_diff=0.0, allowed=0.0, ref_max_abs=0.0,
                         metric="bitwise replica mismatch", measured=1.0)
        self._record(max(ratio, 1.0 + 1e-9), diff, name, f"{kind} {name}: rank {rank}'s copy differs from the "
                     f"first holder's (replicas must stay bitwise equal){detail}", rank)

    def grad(self, kind: str, name: str, a: torch.Tensor, b: torch.Tensor | None, rank: int | None = None) -> None:
        if self._missing(kind, name, a, b):
            return
        d = (a - b).abs()
        l2, ref_l2 = float((a - b).norm()), float(a.norm())
        if self.bf16:  # relative L2 of the whole tensor: bf16 rounding is relative, per element it is noise
            allowed = self.tol["grad_rel_l2"] * ref_l2
            checks = [("grad_rel_l2", l2 / max(allowed, 1e-30), l2, allowed, "L2 |diff|")]
        else:
            bound = (self.tol["grad_atol"] + self.tol["grad_rtol"] * a.abs()).flatten()
            elem = d.flatten() / bound
            i = int(elem.argmax()) if elem.numel() else 0  # the element using the largest share of its bound
            at = (float(d.flatten()[i]), float(bound[i])) if elem.numel() else (0.0, 0.0)
            zero = a == 0
            rel = self.tol["grad_rel_l2"] * ref_l2
            checks = [("grad_elementwise", _max(elem), *at, "|diff| (elementwise, worst element)"),
                      ("grad_rel_l2", l2 / rel if ref_l2 > 0 else 0.0, l2, rel, "L2 |diff|"),
                      ("grad_exact_zero", _exact(_max(d[zero]), self.tol["grad_atol"]), _max(d[zero]), 0.0,
                       "max |diff| where the reference gradient is exactly 0")]
        ratio, measured, allowed, metric = self._worst_of(checks)
        diff = ParamDiff(name=f"{kind} {name}", max_abs_diff=_max(d), allowed=allowed, ref_max_abs=_max(a.abs()),
                         metric=metric, measured=measured)
        if rank is not None:
            return self._replica(kind, name, rank, ratio, f"; {metric} vs the reference {measured:.3e}")
        self._record(ratio, diff, name, f"{kind} {name}: {metric} {measured:.3e} > allowed {allowed:.3e}", None)

    def update(self, kind: str, name: str, before: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None,
               cap: float, lr: float, rank: int | None = None, free: torch.Tensor | None = None,
               exact: torch.Tensor | None = None, acc: torch.Tensor | None = None) -> torch.Tensor | None:
        """Parameter after an update, held to the reference's update from the same starting weights. `exact`:
        elements whose reference gradient was exactly 0 at every step (held to 0 difference); `free`: the other
        sign-free elements, whose divergence accumulated over the steps (`acc` before this step) is held below
        `cap`; the rest to the L2 bound (docstring). Returns the accumulated divergence after this step."""
        if self._missing(kind, name, a, b):
            return acc
        d_ref, diff = a - before, b - a
        exact = exact if exact is not None else torch.zeros_like(a, dtype=torch.bool)
        free = (free if free is not None else torch.zeros_like(exact)) & ~exact
        acc = (acc if acc is not None else torch.zeros_like(a)) + torch.where(free, diff.abs(), 0.0)
        rest = ~(free | exact)
        measured = float(diff[rest].norm())
        allowed = self.tol["update_rtol"] * float(d_ref[rest].norm()) + self.tol["update_atol"] * math.sqrt(a.numel())
        checks = [("update_l2", measured / allowed, measured, allowed, "L2 |update diff|"),
                  ("update_free_accumulated", _max(acc[free]) / cap, _max(acc[free]), cap,
                   "accumulated |diff| of sign-free elements"),
                  ("update_exact_zero", _exact(_max(diff[exact].abs()), lr), _max(diff[exact].abs()), 0.0,
                   "|diff| where the reference gradient was always exactly 0")]
        ratio, got, lim, metric = self._worst_of(checks)
        pd = ParamDiff(name=f"{kind} {name}", max_abs_diff=_max(diff.abs()), allowed=lim, ref_max_abs=_max(a.abs()),
                       metric=metric, measured=got)
        if rank is not None:
            self._replica(kind, name, rank, ratio, f"; {metric} vs the reference {got:.3e} (bound {lim:.3e})")
            return acc
        self._record(ratio, pd, name, f"{kind} {name}: {metric} {got:.3e} > allowed {lim:.3e} (reference update "
                                      f"L2 {float(d_ref.norm()):.3e})", None)
        return acc

    def act(self, step: int, name: str, a: torch.Tensor, b: torch.Tensor | None) -> None:
        """One probed module's forward sums (validation/activations.py) against the reference's."""
        from curry_train.validation.activations import act_check

        ratio, measured, allowed, metric = act_check(a, b, self.tol["act_rtol"])
        ratio = self.used("activation", ratio)
        diff = ParamDiff(name=f"act[step {step}] {name}", max_abs_diff=measured, allowed=allowed,
                         ref_max_abs=float(a[1].sum()), metric=metric, measured=measured)
        self._record(ratio, diff, name, f"act[step {step}] {name} (forward output): {metric} {measured:.3e} > "
                                        f"allowed {allowed:.3e}", None)

    def rank_scalar(self, check: str, step: int, rank: int, got: float | None, ref: float, allowed: float) -> None:
        """One rank's own loss or clip norm (replicated values: every rank must hold the reference's)."""
        if got is None:
            return
        if not self.used(check, abs(got - ref) / allowed) <= 1.0:
            self.failures.append(f"{check.replace('_', ' ')} step {step}, rank {rank}: {got:.6g} vs reference "
                                 f"{ref:.6g} (allowed |diff| {allowed:.3e})")
            self.scalar_ranks.setdefault((step, 0), []).append(rank)

    def localise(self) -> tuple[ParamDiff | None, str | None, int | None]:
        """(worst tensor, first diverging module) of the earliest failing stage, and the lowest rank whose copy
        failed at the earliest stage where one did (else whose own loss or clip norm did). A failing verdict never
        names a passing tensor: when only a scalar (loss, grad norm) failed, worst and module are None. A passing
        one names its largest ratio."""
        ranks = self.ranks or ({} if self.failing else self.scalar_ranks)  # scalars name a rank only alone
        rank = min(ranks[min(ranks)]) if ranks else None
        if self.failing:
            stage = min(self.failing)
            first = min(self.failing[stage], key=layer_order)
            worst = self.worst.get(stage)
            return (worst[1] if worst and worst[0] > 1.0 else None), module_of(first), rank
        if self.failures:
            return None, None, rank
        best = max(self.worst.values(), key=lambda rd: rd[0], default=None)
        return (best[1] if best else None), None, None


def _norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))) if grads else 0.0


def compare(cfg: Config, ref: dict[str, Any], par: dict[str, Any], steps: int, first: int = 0) -> Verdict:
    """Verdict of parallel results `par` (whitebox.parallel_job's file) against whitebox.reference's `ref`,
    re-synchronised to `par`'s weights (docstring, "re-sync"). `first`: the optimizer step of the first compared
    step, for the labels (a resumed run's steps continue its checkpoint's, validation/resume.py)."""
    bf16 = cfg.train.dtype == "bfloat16" and not bf16_cast_exact(cfg, bool(par.get("compiled")))  # else fp32
    tol = dict(BF16 if bf16 else FP32)
    if bf16 and par.get("compiled"):
        tol.update(BF16_COMPILED)
    c = _Checker(bf16, tol)
    losses_ref, losses_par = list(ref.get("losses") or []), list(par.get("losses") or [])
    if steps < 1 or len(losses_ref) != steps or len(losses_par) != steps:
        c.failures.append(f"compared nothing: {len(losses_par)} parallel and {len(losses_ref)} reference step(s) "
                          f"for steps={steps}; a white-box needs at least one step on both sides")
    loss_diffs = [abs(a - b) for a, b in zip(losses_ref, losses_par)]
    loss_max = max(loss_diffs) if loss_diffs else float("inf")
    for a, d in zip(losses_ref, loss_diffs):
        if not c.used("loss", d / (tol["loss_rtol"] * max(1.0, abs(a)))) <= 1.0:
            c.failures.insert(0, f"loss: |diff| {d:.3e} > {tol['loss_rtol'] * max(1.0, abs(a)):.3e}")
            break
    gn_ref, gn_par = [], []
    zero: dict[str, torch.Tensor] = {}  # name -> reference gradient exactly 0 at every step so far
    free: dict[str, torch.Tensor] = {}  # name -> reference gradient below adam_free_grad at some step so far
    acc: dict[str, torch.Tensor] = {}  # name -> rank 0's accumulated divergence on the free elements
    before, n_copies = ref.get("params_before") or {}, 0
    starts = ref.get("starts") or [before, *(ref.get("params") or [])]
    cap = tol.get("free_lr", 1.0) * cfg.train.lr
    n = min(steps, len(ref.get("grads") or []), len(par.get("grads") or []))
    acts_ref, acts_par = list(ref.get("acts") or []), list(par.get("acts") or [])
    rank_scalars = list(par.get("rank_scalars") or [])
    for s in range(n):
        t = first + s  # the step's own index, in every label
        c.stage = (s, -1)
        route_check(c, t, (ref.get("routing") or [None] * n)[s])  # the judged top-k flips (validation/routing.py)
        if s < len(acts_ref):
            for name in sorted(acts_ref[s], key=layer_order):  # forward order: the first failing is the origin
                c.act(t, name, acts_ref[s][name], (acts_par[s] if s < len(acts_par) else {}).get(name))
        c.stage = (s, 0)
        rg, pg = ref["grads"][s], par["grads"][s] or {}
        gn_ref.append(_norm(rg))
        gn_par.append(_norm(pg))
        bound = 1e-6 + tol["grad_norm_rtol"] * gn_ref[-1]
        if not c.used("grad_norm", abs(gn_ref[-1] - gn_par[-1]) / bound) <= 1.0:
            c.failures.append(f"grad norm step {t}: {gn_par[-1]:.6g} vs reference {gn_ref[-1]:.6g}")
        for rank, mine in enumerate(rank_scalars):  # every rank's own loss and the norm it clipped by
            if s < len(mine):
                c.rank_scalar("rank_loss", t, rank, mine[s][0], losses_ref[s],
                              tol["loss_rtol"] * max(1.0, abs(losses_ref[s])))
                c.rank_scalar("rank_clip_norm", t, rank, mine[s][1], gn_ref[-1], bound)
                left = list(mine[s][2]) if len(mine[s]) > 2 else []  # a leftover joins the next step's gradient
                if not c.used("zero_grad", HUGE if left else 0.0) <= 1.0:
                    c.failures.append(f"zero-grad step {t}, rank {rank}: gradients left non-zero on {left[:3]}")
        for name in sorted(rg, key=layer_order):  # every step: re-synchronised, both start from the same weights
            c.grad(f"grad[step {t}]", name, rg[name], pg.get(name))
        for name in sorted(set(pg) - set(rg)):
            c.failures.append(f"grad {name}: not a reference parameter (name mapping broken)")
        for rank, copies in sorted(((par.get("grad_replicas") or [{}] * n)[s] or {}).items()):
            for name in sorted(copies, key=layer_order):
                if name in rg:
                    c.grad(f"grad[step {t}, rank {rank}]", name, rg[name], copies[name], rank=rank)
        c.stage = (s, 1)
        n_copies = sum((par["holders"][s] or {}).values())
        for name, g in rg.items():  # exact zeros and sign-free elements (docstring)
            zero[name] = (g == 0) if name not in zero else zero[name] & (g == 0)
            low = g.abs() < tol.get("adam_free_grad", 0.0)
            free[name] = low if name not in free else free[name] | low
        if bf16:  # no reference for bf16 weights (docstring); replicas must still be bitwise equal to each other
            for rank, copies in sorted((par["replicas"][s] or {}).items()):
                for name in sorted(copies, key=layer_order):
                    c._replica(f"param[step {t}, rank {rank}]", name, rank, 0.0, "")
            continue
        start, after, got = starts[s], ref["params"][s], par["params"][s] or {}
        for name in sorted(after, key=layer_order):
            acc[name] = c.update(f"param[step {t}]", name, start[name], after[name], got.get(name), cap,
                                 cfg.train.lr, free=free.get(name), exact=zero.get(name), acc=acc.get(name))
        for rank, copies in sorted((par["replicas"][s] or {}).items()):
            for name in sorted(copies, key=layer_order):
                c.update(f"param[step {t}, rank {rank}]", name, start[name], after[name], copies[name], cap,
                         cfg.train.lr, rank=rank, free=free.get(name), exact=zero.get(name), acc=acc.get(name))
    c.failures += policy_failures(cfg, par.get("fsdp_dtypes") or {})
    worst, first, rank = c.localise()
    return Verdict(
        passed=not c.failures, world_size=cfg.world_size, steps=steps,
        losses_ref=losses_ref, losses_parallel=losses_par, loss_max_diff=loss_max, grad_norm_ref=gn_ref,
        grad_norm_parallel=gn_par, worst_parameter=worst, first_diverging_layer=first, diverging_rank=rank,
        failures=c.failures[:20], tolerance=tol, n_params_compared=len(before), n_replica_copies=n_copies,
        bound_use={k: round(v, 6) for k, v in sorted(c.use.items())}, routing=route_summary(ref.get("routing")),
    )
