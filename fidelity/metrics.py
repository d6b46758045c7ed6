"""Per-position fidelity metrics between a reference distribution P and a pack's distribution Q, full vocabulary.

Direction: `kld` is always KL(P_ref || Q_pack) = sum_v p_ref(v) * (log p_ref(v) - log q_pack(v)), the expected extra nats a
sampler pays for drawing from the pack when the reference is the truth (llama.cpp's KLD). `kld_reverse` is KL(Q_pack || P_ref).

The kernel works on chunks of positions small enough to stay in cache, touches each logit a few times, and never builds
log-softmax tensors: with `a` = reference logits, `b` = pack logits, `lse` = logsumexp and `c = lse(a) - lse(b)`,
    KL(P||Q) = sum_v softmax(a)_v * ((a_v - b_v) - c).
Subtracting `c` per element (rather than from the sum) keeps the first-order terms small, so a KL of 1e-7 survives float32;
`c` itself comes from z_a - z_b summed directly. Float32 exp rounding leaves ~1e-8 nats of absolute error per position,
four orders below a bf16 noise floor (the textbook float32 computation is off by ~1e-6).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

CHUNK_ELEMENTS = 1 << 18  # logits per operand per chunk (1 MiB of float32): stays in L2


@dataclass
class PositionMetrics:
    """One entry per scored position (all tensors 1-D, same length). Non-finite positions carry NaN and finite=False."""

    kld: torch.Tensor            # KL(P_ref || Q_pack), nats (float64)
    kld_reverse: torch.Tensor    # KL(Q_pack || P_ref), nats (float64); NaN if not computed
    ref_top1: torch.Tensor       # argmax of the reference (int64)
    pack_top1: torch.Tensor      # argmax of the pack (int64)
    ref_margin: torch.Tensor     # reference top-1 minus top-2 log-probability, nats (float64)
    ref_pmax: torch.Tensor       # reference probability of its own top-1 token: its confidence (float64)
    ref_nll: torch.Tensor        # -log p_ref(true token) (float64)
    pack_nll: torch.Tensor       # -log q_pack(true token) (float64)
    finite: torch.Tensor         # bool: every number above is finite (no NaN/inf logits reached it)

    def __len__(self) -> int:
        return self.kld.shape[0]

    @property
    def top1_agree(self) -> torch.Tensor:
        return self.ref_top1 == self.pack_top1

    @staticmethod
    def concat(parts: list["PositionMetrics"]) -> "PositionMetrics":
        return PositionMetrics(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(PositionMetrics)})

    def select(self, index: torch.Tensor) -> "PositionMetrics":
        return PositionMetrics(**{f.name: getattr(self, f.name)[index] for f in fields(PositionMetrics)})

    def to_numpy(self) -> dict:
        return {f.name: getattr(self, f.name).numpy() for f in fields(PositionMetrics)}


def _block_size(v: int) -> int:
    for blk in (64, 32, 16, 8):
        if v % blk == 0 and v // blk >= 2:
            return blk
    return 0


def _top2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, argmax, second largest value) per row. torch's max-with-index and topk are ~10x slower than amax on CPU,
    so reduce 64-wide blocks with amax, then look inside the winning block only. Ties resolve to the first index,
    as torch.argmax does; an exact tie gives second == max."""
    n, v = x.shape
    blk = _block_size(v)
    if not blk:
        top = torch.topk(x, 2, dim=-1)
        return top.values[:, 0], top.indices[:, 0], top.values[:, 1]
    block_max = x.view(n, v // blk, blk).amax(-1)
    bvals = torch.topk(block_max, 2, dim=-1).values
    best_block = torch.argmax(block_max, dim=-1)      # first occurrence (topk's order among ties is unspecified)
    inside = x.view(n, v // blk, blk).gather(1, best_block[:, None, None].expand(n, 1, blk))[:, 0]
    ivals = torch.topk(inside, 2, dim=-1).values
    argmax = best_block * blk + torch.argmax(inside, dim=-1)
    second = torch.maximum(bvals[:, 1], ivals[:, 1])
    return bvals[:, 0], argmax, second


def _reductions(a: torch.Tensor, b: torch.Tensor):
    """The full-vocabulary passes: per row max, argmax and runner-up of the reference, max and argmax of the pack, and
    with one shared shift s = max(max_a, max_b): z = sum exp(x - s) of each side, z_a - z_b, sum e_a (a - b) and
    sum e_b (a - b), accumulated in float64. Plain tensor math, so torch.compile fuses it (`compiled=True`)."""
    max_a, top_a = a.max(-1)
    max_b, top_b = b.max(-1)
    idx = torch.arange(a.shape[-1], device=a.device)
    second_a = torch.where(idx[None, :] == top_a[:, None], float("-inf"), a).amax(-1)
    shift = torch.maximum(max_a, max_b)[:, None]
    e_a = torch.exp(a - shift)
    e_b = torch.exp(b - shift)
    d = a - b
    f64 = torch.float64
    return (max_a, top_a, second_a, top_b, shift[:, 0], e_a.sum(-1, dtype=f64), e_b.sum(-1, dtype=f64),
            (e_a - e_b).sum(-1, dtype=f64), (e_a * d).sum(-1, dtype=f64), (e_b * d).sum(-1, dtype=f64))


def _reductions_eager(a, b, e_a, e_b, d, tmp):
    """Same numbers as `_reductions` from preallocated scratch buffers (no allocation per chunk); float32 sums, which
    torch accumulates pairwise, then widened."""
    max_a = a.view(a.shape[0], -1).amax(-1)
    max_b = b.amax(-1)
    shift = torch.maximum(max_a, max_b)[:, None]
    torch.sub(a, shift, out=e_a).exp_()
    torch.sub(b, shift, out=e_b).exp_()
    torch.sub(a, b, out=d)
    z_a, z_b = e_a.sum(-1).double(), e_b.sum(-1).double()
    dz = torch.sub(e_a, e_b, out=tmp).sum(-1).double()
    kl_num = torch.mul(e_a, d, out=tmp).sum(-1).double()
    rev_num = torch.mul(e_b, d, out=tmp).sum(-1).double()
    return shift[:, 0], z_a, z_b, dz, kl_num, rev_num


_COMPILED = None


def _compiled_reductions():
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_reductions, dynamic=True)
    return _COMPILED


def _chunk_metrics(a: torch.Tensor, b: torch.Tensor, target: torch.Tensor, reverse: bool, scratch, compiled: bool
                   ) -> PositionMetrics:
    if compiled:
        max_a, ref_top1, second_a, pack_top1, shift, z_a, z_b, dz, kl_num, rev_num = _compiled_reductions()(a, b)
    else:
        max_a, ref_top1, second_a = _top2(a)
        _, pack_top1, _ = _top2(b)
        shift, z_a, z_b, dz, kl_num, rev_num = _reductions_eager(a, b, *scratch)
    # KL = sum_v p_v (d_v - c), c = lse(a) - lse(b) = log(z_a / z_b): both terms are first order in (a - b) and cancel
    # to a second-order KL, so c comes from z_a - z_b summed directly (a shared shift keeps its terms small)
    c = torch.log1p(dz / z_b)
    lse_a = shift.double() + torch.log(z_a)
    lse_b = lse_a - c
    kld = kl_num / z_a - c
    kld_reverse = c - rev_num / z_b if reverse else torch.full_like(kld, float("nan"))
    t = target[:, None]
    ref_nll = lse_a - a.gather(1, t)[:, 0].double()
    pack_nll = lse_b - b.gather(1, t)[:, 0].double()
    ref_margin = (max_a - second_a).double()
    ref_pmax = torch.exp(max_a.double() - lse_a)
    finite = torch.isfinite(kld) & torch.isfinite(ref_nll) & torch.isfinite(pack_nll) & torch.isfinite(ref_margin)
    kld = kld.clamp_min(0.0)  # rounding can leave -1e-12 on identical distributions; KL is >= 0
    if reverse:
        finite &= torch.isfinite(kld_reverse)
        kld_reverse = kld_reverse.clamp_min(0.0)
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    return PositionMetrics(
        kld=torch.where(finite, kld, nan), kld_reverse=torch.where(finite, kld_reverse, nan),
        ref_top1=ref_top1, pack_top1=pack_top1, ref_margin=torch.where(finite, ref_margin, nan),
        ref_pmax=torch.where(finite, ref_pmax, nan), ref_nll=torch.where(finite, ref_nll, nan),
        pack_nll=torch.where(finite, pack_nll, nan), finite=finite)


def position_metrics(ref_logits: torch.Tensor, pack_logits: torch.Tensor, targets: torch.Tensor, *,
                     reverse: bool = False, chunk_elements: int = CHUNK_ELEMENTS, compiled: bool | None = None
                     ) -> PositionMetrics:
    """Metrics for N positions: `ref_logits`, `pack_logits` [N, V] (any float dtype, computed in float32), `targets` [N] the
    true next tokens. Memory beyond the inputs stays at a few chunks of `chunk_elements` logits, whatever N is.
    `compiled=True` (or FIDELITY_COMPILE=1) fuses the vocabulary passes with torch.compile (~1.4x the eager kernel on a
    2-core CPU, after a one-off compile of ~45 s), worth it from some 10^5 positions on."""
    if compiled is None:
        compiled = os.environ.get("FIDELITY_COMPILE", "") not in ("", "0")
    if ref_logits.shape != pack_logits.shape or ref_logits.dim() != 2:
        raise ValueError(f"logits must both be [N, V]; got reference {list(ref_logits.shape)} and pack {list(pack_logits.shape)}")
    n, v = ref_logits.shape
    if targets.shape != (n,):
        raise ValueError(f"targets must be [N={n}]; got {list(targets.shape)}")
    rows = max(1, (chunk_elements * (8 if compiled else 1)) // max(v, 1))   # fused passes need no cache-sized chunks
    parts = []
    scratch = [torch.empty(min(rows, n), v) for _ in range(4)] if not compiled else None
    with torch.no_grad():
        for s in range(0, n, rows):
            a = ref_logits[s:s + rows].to(torch.float32).contiguous()
            b = pack_logits[s:s + rows].to(torch.float32).contiguous()
            bufs = [t[:a.shape[0]] for t in scratch] if scratch else None
            parts.append(_chunk_metrics(a, b, targets[s:s + rows].long(), reverse, bufs, compiled))
    if not parts:
        empty = torch.empty(0, dtype=torch.float64)
        return PositionMetrics(empty, empty, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                               empty, empty, empty, empty, torch.empty(0, dtype=torch.bool))
    return PositionMetrics.concat(parts)


def naive_kld(ref_logits: torch.Tensor, pack_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || Q_pack) per position the textbook way (log_softmax both, then sum): the benchmark's baseline and a
    test reference."""
    lp = torch.log_softmax(ref_logits.float(), -1)
    lq = torch.log_softmax(pack_logits.float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids and their log-probabilities (float32) for each row of `logits` [N, V]."""
    logits = logits.float()
    lse = torch.logsumexp(logits, -1, keepdim=True)
    vals, ids = torch.topk(logits, k, dim=-1)
    return ids, vals - lse
