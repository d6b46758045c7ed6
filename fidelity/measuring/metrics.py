"""Per-position fidelity metrics between a reference distribution P and a pack's distribution Q, full vocabulary.

Direction: `kld` is always KL(P_ref || Q_pack) = sum_v p_ref(v) * (log p_ref(v) - log q_pack(v)), the expected extra
nats a sampler pays for drawing from the pack when the reference is the truth (llama.cpp's KLD). `kld_reverse` is
KL(Q_pack || P_ref).

The kernel reads each logit from memory once. A row is walked in blocks small enough to stay in L1: a vectorised max
over the block, then one exp per logit per side against running shifts s_a, s_b (the maxima so far; online logsumexp: a
block that raises a maximum rescales the sums before it). With a = reference, b = pack logits and
d = (a - s_a) - (b - s_b), it accumulates in float64
    z_a = sum exp(a - s_a),  z_b = sum exp(b - s_b),  k_a = sum exp(a - s_a) d,  k_b = sum exp(b - s_b) d
and with c = log(z_a / z_b) = lse(a) - lse(b) - (s_a - s_b): KL(P||Q) = k_a / z_a - c, KL(Q||P) = c - k_b / z_b.
Everything after the float32 inputs is float64, exp included (a polynomial good to ~2e-16), so the KL is right to ~1e-14
nats (float32 arithmetic leaves 1e-8 with care, 1e-6 the textbook way), and the shifts keep it so for logits in the
thousands or two sides hundreds of nats apart. Rows run in parallel on torch's thread count.

Logits on a GPU (or any non-CPU device) are measured where they are, chunk by chunk over positions, and only the
per-position numbers come back: the same sums in float64 by a Triton kernel (one program per position, the same
online shifts, a table-driven float64 exp good to ~3e-16), or, without Triton, by plain torch in float64 (one exact
max shift per row); `device_backend()` says which. Both agree with the CPU kernel to float64 rounding (see
tests/test_metrics_device.py for the bounds); top-1 ids and margins are the same numbers exactly.
"""
from __future__ import annotations

import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import ClassVar

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.extending import intrinsic

from ..vector_math import warm_up_vector_math

TOPK = 5                     # top-K agreement is reported for K = 1..TOPK (exllamav3 model_diff's range)
BLOCK = 2048                 # logits per side per block: both sides' block stays in L1 between the max and the exp pass
COPY_ELEMENTS = 1 << 22      # logits per side converted at a time when the input is not contiguous float32 on the CPU
# Fast-math without nnan/ninf: a NaN or inf logit must still reach the sums and make them non-finite.
_FAST = {"contract", "reassoc", "nsz", "arcp", "afn"}


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
    topk_match: torch.Tensor     # int64 0..TOPK: how many leading entries of the two top-TOPK lists (ordered by logit,
                                 # first index on ties) are the same tokens: top-K agreement holds where topk_match >= K

    def __len__(self) -> int:
        return self.kld.shape[0]

    @property
    def top1_agree(self) -> torch.Tensor:
        return self.ref_top1 == self.pack_top1

    @staticmethod
    def concat(parts: list["PositionMetrics"]) -> "PositionMetrics":
        return PositionMetrics(
            **{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(PositionMetrics)}
        )

    def select(self, index: torch.Tensor) -> "PositionMetrics":
        return PositionMetrics(**{f.name: getattr(self, f.name)[index] for f in fields(PositionMetrics)})

    def to_numpy(self) -> dict:
        return {f.name: getattr(self, f.name).numpy() for f in fields(PositionMetrics)}


@intrinsic
def _max_f32(typingctx, a, b):
    """llvm.maxnum (NaN-blind). numba's max() is a compare and select, which LLVM will not vectorise as a reduction."""
    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.maxnum", [f32], ir.FunctionType(f32, [f32, f32]))
        return builder.call(fn, args)
    return numba.float32(numba.float32, numba.float32), codegen


@intrinsic
def _f64_from_bits(typingctx, bits):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return numba.float64(numba.int64), codegen


_LOG2E = 1.4426950408889634
_LN2_HI = 0.693147180369123816490     # ln 2 split so that k * _LN2_HI is exact for |k| < 2^11
_LN2_LO = 1.90821492927058770002e-10
_EXP_TAYLOR = tuple(1 / math.factorial(k) for k in range(13, -1, -1))     # 1/13!, ..., 1/1!, 1/0!


@numba.njit(inline="always", fastmath=_FAST)
def _exp_nonpositive(x):
    """exp(x) in float64 for x <= 0, vectorisable (numba calls libm's scalar exp otherwise). x = k ln2 + r,
    |r| <= ln2/2, exp(r) by its Taylor series to r^13 (truncation < 4.2e-18 relative: to r^10 it was 2.2e-13 at
    |r| = ln2/2, up to 3e-13 measured against libm), times 2^k built in the exponent bits. x is clamped at
    -700 (NaN included), so k stays a small integer and exp > 0: a -inf or NaN logit reaches the sums through
    exp(..) * d as inf or NaN instead of vanishing."""
    x = x if x > -700.0 else -700.0
    k = np.floor(x * _LOG2E + 0.5)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = 0.0
    for c in _EXP_TAYLOR:
        p = p * r + c
    return p * _f64_from_bits((np.int64(k) + 1023) << 52)


@numba.njit(inline="always", fastmath=_FAST)
def _max(x):
    m = np.float32(-np.inf)
    for j in range(x.shape[0]):
        m = _max_f32(m, x[j])
    return m


@numba.njit(inline="always")
def _first_index(x, value):
    for j in range(x.shape[0]):
        if x[j] == value:
            return j
    return 0          # only when a NaN spoilt the block's max; the row is flagged non-finite anyway


@numba.njit(inline="always")
def _insert_top(blk, lo, vals, ids):
    """Merges a block into the sorted top list (vals descending, ids; an equal value keeps the earlier index first).
    Called only for a block whose maximum beats the list's last entry."""
    k = vals.shape[0]
    for j in range(blk.shape[0]):
        x = blk[j]
        if x > vals[k - 1]:
            p = k - 1
            while p > 0 and x > vals[p - 1]:
                vals[p], ids[p] = vals[p - 1], ids[p - 1]
                p -= 1
            vals[p], ids[p] = x, lo + j


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def _rows_kernel(a, b, targets, out, top):
    """For each row i of a, b [n, V] float32: out[i] = (KL(P||Q), KL(Q||P), ref top-1 minus top-2 logit, ref p(top-1),
    ref NLL, pack NLL) in float64, top[i] = (ref argmax, pack argmax, length of the common prefix of both top-TOPK
    lists), first index on ties."""
    n, v = a.shape
    tv_a, tv_b = np.empty(TOPK, np.float32), np.empty(TOPK, np.float32)
    ti_a, ti_b = np.empty(TOPK, np.int64), np.empty(TOPK, np.int64)
    for i in range(n):
        ar, br = a[i], b[i]
        top_a = second_a = top_b = np.float32(-np.inf)
        idx_a = idx_b = 0
        tv_a[:], tv_b[:], ti_a[:], ti_b[:] = -np.inf, -np.inf, -1, -1
        s_a, s_b = np.float64(ar[0]), np.float64(br[0])     # running shifts: the maxima so far
        z_a = z_b = k_a = k_b = 0.0
        for lo in range(0, v, BLOCK):
            # slices, not lo..hi indices: numba cannot prove such an index non-negative and turns the loads into gathers
            blk_a, blk_b = ar[lo:lo + BLOCK], br[lo:lo + BLOCK]
            m_a, m_b = _max(blk_a), _max(blk_b)
            if m_a > top_a:
                j = _first_index(blk_a, m_a)
                inside = max(_max(blk_a[:j]), _max(blk_a[j + 1:]))   # an equal value here is a tie: margin 0
                second_a, top_a, idx_a = max(top_a, inside), m_a, lo + j
            elif m_a > second_a:
                second_a = m_a
            if m_b > top_b:
                top_b, idx_b = m_b, lo + _first_index(blk_b, m_b)
            if m_a > tv_a[TOPK - 1]:
                _insert_top(blk_a, lo, tv_a, ti_a)
            if m_b > tv_b[TOPK - 1]:
                _insert_top(blk_b, lo, tv_b, ti_b)
            if m_a > s_a or m_b > s_b:
                # online logsumexp: a new maximum rescales the sums so far; k_* hold d - (s_a - s_b), so they move by
                # the change of that offset times z_*
                new_a, new_b = max(s_a, np.float64(m_a)), max(s_b, np.float64(m_b))
                offset_change = (new_a - new_b) - (s_a - s_b)
                scale_a, scale_b = math.exp(s_a - new_a), math.exp(s_b - new_b)
                z_a, k_a = z_a * scale_a, (k_a - offset_change * z_a) * scale_a
                z_b, k_b = z_b * scale_b, (k_b - offset_change * z_b) * scale_b
                s_a, s_b = new_a, new_b
            for j in range(blk_a.shape[0]):
                x, y = np.float64(blk_a[j]) - s_a, np.float64(blk_b[j]) - s_b
                e_a, e_b = _exp_nonpositive(x), _exp_nonpositive(y)
                d = x - y          # (a - b) - (s_a - s_b): small even when the two sides sit far apart
                z_a += e_a
                z_b += e_b
                k_a += e_a * d
                k_b += e_b * d
        c = math.log(z_a / z_b)                     # lse_a - lse_b - (s_a - s_b)
        lse_a, lse_b = s_a + math.log(z_a), s_b + math.log(z_b)
        out[i, 0] = k_a / z_a - c
        out[i, 1] = c - k_b / z_b
        out[i, 2] = np.float64(top_a) - np.float64(second_a)
        out[i, 3] = math.exp(np.float64(top_a) - lse_a)
        out[i, 4] = lse_a - ar[targets[i]]
        out[i, 5] = lse_b - br[targets[i]]
        top[i, 0], top[i, 1] = idx_a, idx_b
        match = 0
        while match < TOPK and ti_a[match] >= 0 and ti_a[match] == ti_b[match]:
            match += 1
        top[i, 2] = match


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None    # (pid, workers, pool): a forked child needs its own threads


def _run_rows(a: np.ndarray, b: np.ndarray, targets: np.ndarray, out: np.ndarray, top: np.ndarray) -> None:
    """Splits the rows over torch's thread count (the kernel releases the GIL)."""
    global _POOL
    threads = min(torch.get_num_threads(), a.shape[0])
    if threads <= 1:
        _rows_kernel(a, b, targets, out, top)
        return
    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] < threads:
        _POOL = os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix="fidelity-metrics")
    cuts = np.linspace(0, a.shape[0], threads + 1).astype(int)
    jobs = [_POOL[2].submit(_rows_kernel, a[lo:hi], b[lo:hi], targets[lo:hi], out[lo:hi], top[lo:hi])
            for lo, hi in zip(cuts[:-1], cuts[1:])]
    for job in jobs:
        job.result()


def _as_f32_numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().to("cpu", torch.float32).contiguous().numpy()


# Defaults: the fastest settings benchmarks/metric_kernel_roofline.py measured at 8,192 x 129,280 (on an H200: 512
# lanes, lists of 2 per lane, two blocks loaded ahead; on an H100, on top of that: the bit conversion, the 256-entry
# exp table, no clamp and two blocks per iteration); the timings are in benchmarks/RESULTS.md
# topk_match on the Triton path (MetricKernel.topk) -> lane lists of the fused kernel (1: best + runner-up's value;
# None: topk_match outside the kernel)
LIST_LENGTHS = {"fused": 5, "fused-top2": 2, "fused-top1v": 1, "separate": None, "torch": None}


def _power_of_two(value) -> bool:
    return type(value) is int and value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class MetricKernel:
    """How logits on a device are measured: the backend and the Triton kernel's settings. Frozen and equal by value
    (variants: `dataclasses.replace(MetricKernel(), shift="running")`); a setting outside `CHOICES` (or a block, warp
    count or register cap that is not a positive power of two / integer) is refused when the object is made, naming
    the field, before any kernel runs. The defaults are what every device pass runs."""

    backend: str | None = None      # None: Triton on CUDA where installed (a kernel that fails to build falls back to
                                    # torch, said once), else torch; "torch" | "triton": that one (its failure raised)
    block: int = 512                # logits per side per step of one Triton program (lanes: 4 per thread at 4 warps)
    warps: int = 4
    # topk_match: "fused-top2" (lists of 2 per lane in the metric kernel's pass; the rows they cannot answer, where one
    # lane holds three of a row's five, go through top5_kernel: the same numbers), "fused" (lists of 5 per lane in that
    # pass: 136 registers at 256 lanes, 1.7x slower; at 1024 lanes they spill), "fused-top1v" (a lane's best with its
    # index and its runner-up's value), "separate" (a second Triton pass of `topk_block` lanes) or "torch"
    topk: str = "fused-top2"
    topk_block: int = 1024
    # the logsumexp shift: "running" (the CPU kernel's: the maximum so far, a cross-lane maximum and a possible rescale
    # per block) or "fixed" (the first block's maximum for the whole row: 1.5x faster; rows whose maximum lies > 600
    # above it are measured again with "running")
    shift: str = "fixed"
    magic: bool = True              # the exp's rounding by adding 1.5 * 2^52 instead of floor + float->int conversion
    prefetch: int = 2               # blocks loaded ahead of the arithmetic (memory under the float64 math): 0, 1 or 2
    convert: bool = True            # float32 -> float64 by moving bits (metrics_triton.f64_bits_of_f32) under the fixed
                                    # shift; rows it may not cover measured again without it
    lean: bool = True               # with `convert`: no clamp before the exp (rows with a logit 700 below their
                                    # shift, an inf or NaN measured again without it) and the exp's scale added on
                                    # its high word
    unroll: int = 2                 # blocks per loop iteration (2: no register moves for the blocks loaded ahead)
    maxnreg: int | None = None      # registers per thread the compiler may use (None: its choice; fewer: more programs
                                    # per SM)
    exp_table_bits: int = 8         # 6: exp(x) = 2^k * 2^(j/64) * exp(r), |r| <= ln2/128, Taylor to r^5 (4e-17);
                                    # 8: 256 entries, |r| <= ln2/512, Taylor to r^4 (4e-17, one float64 FMA less
                                    # per exp)

    # every accepted value of the fields that take one of a few (bool fields: True or False, not 1 or 0)
    CHOICES: ClassVar[dict] = {"backend": (None, "torch", "triton"), "topk": tuple(LIST_LENGTHS),
                               "shift": ("running", "fixed"), "magic": (False, True), "prefetch": (0, 1, 2),
                               "convert": (False, True), "lean": (False, True), "unroll": (1, 2),
                               "exp_table_bits": (6, 8)}
    POWERS_OF_TWO: ClassVar[tuple] = ("block", "warps", "topk_block")

    def __post_init__(self):
        for name, accepted in self.CHOICES.items():
            value = getattr(self, name)
            # by type as well as value: True == 1 would pass as a count, 1 as a bool
            if not any(value is a or (type(value) is type(a) and value == a) for a in accepted):
                raise ValueError(f"MetricKernel.{name}={value!r}: expected one of {', '.join(map(repr, accepted))}")
        for name in self.POWERS_OF_TWO:
            if not _power_of_two(getattr(self, name)):
                raise ValueError(f"MetricKernel.{name}={getattr(self, name)!r}: expected a positive power of two")
        if self.maxnreg is not None and not (type(self.maxnreg) is int and self.maxnreg > 0):
            raise ValueError(f"MetricKernel.maxnreg={self.maxnreg!r}: expected None or a positive number of registers")

    def switches(self, fixed: bool) -> dict:
        """rows_kernel's switches as this kernel launches it, under the fixed shift or the running one: the bit
        conversion and the clampless exp only under the fixed shift (the running shift is the fallback; its shifts are
        not checked). benchmarks/kernel_sass.py compiles the same."""
        convert = self.convert and fixed
        return dict(CONVERT=convert, EXP_BITS=self.exp_table_bits, LEAN=convert and self.lean, UNROLL=self.unroll)


def position_metrics(ref_logits: torch.Tensor, pack_logits: torch.Tensor, targets: torch.Tensor, *,
                     reverse: bool = False, copy_elements: int = COPY_ELEMENTS,
                     kernel: MetricKernel = MetricKernel()) -> PositionMetrics:
    """Metrics for N positions: `ref_logits`, `pack_logits` [N, V] (any float dtype and device; read as float32),
    `targets` [N] the true next tokens. Contiguous float32 CPU logits are read in place; anything else is converted
    `copy_elements` logits at a time, so memory beyond the inputs stays flat whatever N is. Logits on another device
    are measured there, by `kernel` (device_metrics_columns)."""
    if ref_logits.shape != pack_logits.shape or ref_logits.dim() != 2:
        raise ValueError(
            f"logits must both be [N, V]; got reference {list(ref_logits.shape)} and pack {list(pack_logits.shape)}"
        )
    n, v = ref_logits.shape
    if targets.shape != (n,):
        raise ValueError(f"targets must be [N={n}]; got {list(targets.shape)}")
    if ref_logits.device.type != "cpu" and ref_logits.device == pack_logits.device:
        out, top = device_metrics_columns(ref_logits, pack_logits, targets, kernel)
        return finish_columns(out, top, reverse)
    t = targets.detach().to("cpu", torch.int64).contiguous().numpy()
    bad = np.flatnonzero((t < 0) | (t >= v))
    if bad.size:
        raise ValueError(f"target token {int(t[bad[0]])} at position {int(bad[0])} is outside the vocabulary of {v}")
    out, top = np.empty((n, 6)), np.empty((n, 3), dtype=np.int64)
    in_place = all(
        x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() for x in (ref_logits, pack_logits)
    )
    rows = max(n, 1) if in_place else max(1, copy_elements // max(v, 1))
    for s in range(0, n, rows):
        e = min(s + rows, n)
        _run_rows(_as_f32_numpy(ref_logits[s:e]), _as_f32_numpy(pack_logits[s:e]), t[s:e], out[s:e], top[s:e])
    finite = np.isfinite(out).all(1)
    out[:, :2] = np.maximum(out[:, :2], 0.0)     # rounding can leave -1e-17 on identical distributions; KL is >= 0
    out[~finite] = np.nan
    if not reverse:
        out[:, 1] = np.nan
    columns = torch.from_numpy(out.T.copy())
    return PositionMetrics(
        kld=columns[0], kld_reverse=columns[1], ref_top1=torch.from_numpy(top[:, 0].copy()),
        pack_top1=torch.from_numpy(top[:, 1].copy()), ref_margin=columns[2], ref_pmax=columns[3], ref_nll=columns[4],
        pack_nll=columns[5], finite=torch.from_numpy(finite), topk_match=torch.from_numpy(top[:, 2].copy()))


# -- on the logits' device ----------------------------------------------------------------------------------------
DEVICE_ROWS_ELEMENTS = 1 << 24  # torch path: logits per side per step (its float64 temporaries are ~6x this, x 8 bytes)


def device_backend(device: torch.device | str, kernel: MetricKernel = MetricKernel()) -> str:
    """"triton" or "torch": what measures logits on `device`; `kernel.backend` chooses where it is set."""
    if kernel.backend is not None:
        return kernel.backend
    return "triton" if torch.device(device).type == "cuda" and _triton_kernel() is not None else "torch"


def device_metrics_columns(ref_logits: torch.Tensor, pack_logits: torch.Tensor, targets: torch.Tensor,
                           kernel: MetricKernel = MetricKernel()) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's raw columns on the logits' device: out [N, 6] float64 (KL(P||Q), KL(Q||P), ref margin, ref
    p(top-1), ref NLL, pack NLL), top [N, 2] int64 (ref, pack argmax, first index on ties). Inputs [N, V] (read as
    float32) and targets [N] on one device; nothing goes to the host but the check of the targets. `kernel`: the
    backend and its settings (MetricKernel)."""
    n, v = ref_logits.shape
    t = targets.detach().to(ref_logits.device, torch.int64)
    bad = (t < 0) | (t >= v)
    if n and bool(bad.any()):
        first = int(bad.nonzero()[0])
        raise ValueError(f"target token {int(t[first])} at position {first} is outside the vocabulary of {v}")
    a, b = ref_logits.detach().float().contiguous(), pack_logits.detach().float().contiguous()
    out = torch.empty(n, 6, dtype=torch.float64, device=a.device)
    top = torch.empty(n, 2, dtype=torch.int64, device=a.device)
    match = None
    if n:
        chosen = device_backend(a.device, kernel)
        if chosen == "triton" and kernel.backend is None:
            try:
                match = torch.empty(n, dtype=torch.int64, device=a.device)
                triton_rows(a, b, t, out, top, match, kernel)
                chosen = None
            except Exception as e:           # a kernel this Triton or GPU cannot build: the torch path, said once
                _TRITON[:] = [None]
                warnings.warn(
                    f"fidelity.measuring.metrics: the Triton kernel failed ({type(e).__name__}: {e}); measuring "
                    f"with the plain torch path from now on"
                )
                chosen = "torch"
        if chosen == "triton":
            match = torch.empty(n, dtype=torch.int64, device=a.device)
            triton_rows(a, b, t, out, top, match, kernel)
        elif chosen is not None:
            match = None
            torch_rows(a, b, t, out, top)
    if match is None:
        match = topk_match_torch(a, b)
    return out, torch.cat([top, match[:, None]], 1)


def top_lists_torch(x: torch.Tensor) -> torch.Tensor:
    """[N, TOPK] token ids of each row's TOPK largest logits, by value then first index (the CPU kernel's order, ties
    straddling the TOPK-th place included): one torch.topk over int64 keys, the float32 value's order-preserving bits
    above the complement of the index (-0.0 taken as +0.0: the CPU kernel compares values). As in the CPU kernel's
    lists, a -inf or NaN logit is no entry: -1 (a row with fewer than TOPK others)."""
    x = x.float()
    x = torch.where(torch.isnan(x), float("-inf"), x) + 0.0     # + 0.0: -0.0 becomes +0.0
    bits = x.view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)               # negative floats: the magnitude bits flipped
    index = torch.arange(x.shape[1], dtype=torch.int64, device=x.device)
    keys = (ordered.to(torch.int64) << 32) | (0xFFFFFFFF - index)
    top = keys.topk(min(TOPK, x.shape[1]), dim=1).values
    ids = 0xFFFFFFFF - (top & 0xFFFFFFFF)
    return torch.where(x.gather(1, ids) == float("-inf"), -1, ids)


def topk_match_torch(a: torch.Tensor, b: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """PositionMetrics.topk_match on the logits' device: the common prefix length of both top-TOPK lists (entries
    only: two lists that both end early agree no further). Rows at a time: top_lists_torch's keys are 8 bytes per
    logit, 2^25 logits per step."""
    rows = rows or max(1, (1 << 25) // max(1, a.shape[1]))
    out = torch.empty(a.shape[0], dtype=torch.int64, device=a.device)
    for s in range(0, a.shape[0], rows):
        ids = top_lists_torch(a[s:s + rows])
        same = (ids == top_lists_torch(b[s:s + rows])) & (ids >= 0)
        out[s:s + rows] = same.long().cumprod(1).sum(1)
    return out


def finish_columns(out: torch.Tensor, top: torch.Tensor, reverse: bool) -> PositionMetrics:
    """PositionMetrics (on the CPU) from the raw columns (`top` [N, 3]: ref and pack argmax, topk_match), with the
    CPU path's rules: KL clamped at 0, every number of a position with a non-finite one set to NaN, KL(Q||P) NaN
    unless asked for."""
    finite = torch.isfinite(out).all(1)
    out = out.clone()
    out[:, :2] = out[:, :2].clamp(min=0.0)
    out[~finite] = float("nan")
    if not reverse:
        out[:, 1] = float("nan")
    columns, top, finite = out.t().contiguous().cpu(), top.cpu(), finite.cpu()
    return PositionMetrics(
        kld=columns[0], kld_reverse=columns[1], ref_top1=top[:, 0].contiguous(), pack_top1=top[:, 1].contiguous(),
        ref_margin=columns[2], ref_pmax=columns[3], ref_nll=columns[4], pack_nll=columns[5], finite=finite,
        topk_match=top[:, 2].contiguous() if top.shape[1] > 2 else torch.zeros(top.shape[0], dtype=torch.int64))


def torch_rows(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor, out: torch.Tensor, top: torch.Tensor) -> None:
    """The kernel's sums in plain torch, float64 after the float32 inputs, a few rows at a time: one exact max shift
    per row (so no rescaling), exp clamped at -700 like the CPU kernel's (a -inf logit reaches the sums as -inf)."""
    n, v = a.shape
    if a.device.type == "cpu":
        warm_up_vector_math()      # torch's CPU exp is MKL's: a process's first one split over threads can be inexact
    rows = max(1, DEVICE_ROWS_ELEMENTS // max(v, 1))
    for s in range(0, n, rows):
        e_ = min(n, s + rows)
        fa, fb = a[s:e_], b[s:e_]
        best = fa.topk(min(2, v), dim=1).values
        top[s:e_, 0], top[s:e_, 1] = fa.argmax(1), fb.argmax(1)       # argmax: the first index of the maximum
        shift_a, shift_b = best[:, :1].double(), fb.amax(1, keepdim=True).double()
        x, y = fa.double() - shift_a, fb.double() - shift_b
        e_a, e_b = x.clamp(min=-700.0).exp(), y.clamp(min=-700.0).exp()
        d = x - y
        z_a, z_b = e_a.sum(1), e_b.sum(1)
        k_a, k_b = (e_a * d).sum(1), (e_b * d).sum(1)
        del x, y, e_a, e_b, d
        c = torch.log(z_a / z_b)
        lse_a, lse_b = shift_a[:, 0] + torch.log(z_a), shift_b[:, 0] + torch.log(z_b)
        second = best[:, 1].double() if v > 1 else torch.full_like(lse_a, float("-inf"))
        rows_t = t[s:e_, None]
        out[s:e_, 0] = k_a / z_a - c
        out[s:e_, 1] = c - k_b / z_b
        out[s:e_, 2] = best[:, 0].double() - second
        out[s:e_, 3] = torch.exp(best[:, 0].double() - lse_a)
        out[s:e_, 4] = lse_a - fa.gather(1, rows_t)[:, 0].double()
        out[s:e_, 5] = lse_b - fb.gather(1, rows_t)[:, 0].double()


_EXP_CONSTANTS: dict = {}


def _exp_constants(device: torch.device, table_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 constants, int64 table) for the Triton kernel's exp, on `device`: entry j is the bits of 2^(j/64)
    minus j * 2^46, so that adding n * 2^46 (n = 64 k + j) to it puts k into the exponent (table_bits 8: 2^(j/256),
    2^44). Constants travel as a tensor: Triton would type a Python float argument or literal as float32."""
    key = (str(device), table_bits)
    if key not in _EXP_CONSTANTS:
        size = 1 << table_bits
        # ln2/size as the CPU kernel's two-part ln2 over size (exact scalings): n * hi is exact for |n| < 2^21, and hi +
        # lo holds ln2 to ~2^-86, where float64(ln2)/size - hi left the step's own rounding in, n * 1e-17 (a relative
        # error of |x| * 3e-17 at the exp's input, 2e-14 near -700)
        hi, lo = _LN2_HI / size, _LN2_LO / size
        consts = [size / math.log(2), hi, lo, 1 / 2, 1 / 6, 1 / 24, 1 / 120, 1.5 * 2.0**52]
        table = (np.array([2.0 ** (j / size) for j in range(size)], np.float64).view(np.int64)
                 - (np.arange(size, dtype=np.int64) << (52 - table_bits)))
        _EXP_CONSTANTS[key] = (torch.tensor(consts, dtype=torch.float64, device=device),
                               torch.from_numpy(table.copy()).to(device))
    return _EXP_CONSTANTS[key]


_TRITON: list = []


def _triton_kernel():
    """The Triton kernel (fidelity/measuring/metrics_triton.py), imported on first use; None without Triton."""
    if not _TRITON:
        try:
            from .metrics_triton import rows_kernel  # noqa: PLC0415 (Triton, CUDA only)
        except ImportError:
            rows_kernel = None
        _TRITON.append(rows_kernel)
    return _TRITON[0]


def triton_rows(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor, out: torch.Tensor, top: torch.Tensor,
                match: torch.Tensor | None = None, kernel: MetricKernel = MetricKernel()) -> None:
    """The fused kernel: one program per position reads both rows once (contiguous float32 [N, V]); with `match`
    ([N] int64) also topk_match, in the same pass (`kernel.topk` "fused*"), a second Triton pass ("separate") or
    topk_match_torch ("torch")."""
    rows_kernel = _triton_kernel()
    if rows_kernel is None:
        raise RuntimeError("the metric kernel's backend is triton, but triton is not installed")
    consts, table = _exp_constants(a.device, kernel.exp_table_bits)
    in_pass = match is not None and LIST_LENGTHS[kernel.topk] is not None
    lists = LIST_LENGTHS[kernel.topk] if in_pass else 2
    fixed = kernel.shift == "fixed"
    flagged = fixed or (in_pass and lists != 5)      # (the bit conversion implies the fixed shift)

    def run(x, y, targets, out_, top_, match_, retry_, fixed_):
        rows_kernel[(x.shape[0],)](x, y, targets, out_, top_, match_ if in_pass else top_, retry_, consts, table,
                                   x.stride(0), y.stride(0), V=x.shape[1], BLOCK=kernel.block, LISTS=lists,
                                   MATCH=in_pass, FIXED_SHIFT=fixed_, MAGIC=kernel.magic, PREFETCH=kernel.prefetch,
                                   **kernel.switches(fixed_), num_warps=kernel.warps,
                                   **({"maxnreg": kernel.maxnreg} if kernel.maxnreg else {}))

    # retry: bit 0 the row lies too far above its fixed shift, bit 1 its top-5 prefix needs top5_kernel, bit 2 the
    # bit conversion may not hold for it: those of bits 0 and 2 are measured again with the running shift, without it
    retry = torch.zeros(a.shape[0] if flagged else 1, dtype=torch.int8, device=a.device)
    run(a, b, t, out, top, match, retry, fixed)
    if flagged and bool(retry.any()):
        far = (retry & 5).nonzero()[:, 0]
        if len(far):
            sub_a, sub_b, sub_t = a[far].contiguous(), b[far].contiguous(), t[far].contiguous()
            sub_out, sub_top = out[far], top[far]
            sub_match = match[far] if in_pass else sub_top
            sub_retry = torch.zeros(len(far), dtype=torch.int8, device=a.device)
            run(sub_a, sub_b, sub_t, sub_out, sub_top, sub_match, sub_retry, False)
            out[far], top[far] = sub_out, sub_top
            if in_pass:
                match[far] = sub_match
            retry[far] = sub_retry
        if in_pass and lists != 5:
            exact = (retry & 2).nonzero()[:, 0]
            if len(exact):
                _top5(a, b, match, exact, kernel)
    if match is not None and not in_pass:
        if kernel.topk == "separate":
            _top5(a, b, match, None, kernel)
        else:
            match.copy_(topk_match_torch(a, b))


def _top5(a: torch.Tensor, b: torch.Tensor, match: torch.Tensor, rows: torch.Tensor | None,
          kernel: MetricKernel) -> None:
    """topk_match of every row (rows None) or of the given rows, by top5_kernel's exact lists."""
    from .metrics_triton import top5_kernel  # noqa: PLC0415 (Triton, CUDA only)
    count = a.shape[0] if rows is None else len(rows)
    top5_kernel[(count,)](a, b, match, match if rows is None else rows, a.stride(0), b.stride(0), V=a.shape[1],
                          BLOCK=kernel.topk_block, INDIRECT=rows is not None, num_warps=kernel.warps)


def naive_kld(ref_logits: torch.Tensor, pack_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || Q_pack) per position the textbook way (log_softmax both, then sum): the benchmark's baseline and a
    test reference."""
    lp = torch.log_softmax(ref_logits.float(), -1)
    lq = torch.log_softmax(pack_logits.float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


# On a GPU a reduction's thread layout depends on how many rows it reduces, so the top-K of a position would depend
# on how many positions were reduced with it; there they are always reduced in zero-padded blocks of this many rows
# (the head's HEAD_ROWS), and a reference store's top-K is re-derived bit for bit on the device that wrote it.
TOPK_BLOCK_ROWS = 64


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids and their log-probabilities (float32) for each row of `logits` [N, V], on the logits' device."""
    if logits.device.type != "cpu":
        return _topk_logprobs_blocks(logits, k)
    warm_up_vector_math()   # a thread's first MKL exp can be inexact (see there); stores are compared bit for bit
    logits = logits.float()
    lse = torch.logsumexp(logits, -1, keepdim=True)
    vals, ids = torch.topk(logits, k, dim=-1)
    return ids, vals - lse


def _topk_logprobs_blocks(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, v = logits.shape
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    lps = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    for s in range(0, n, TOPK_BLOCK_ROWS):
        block = logits[s:s + TOPK_BLOCK_ROWS].float()
        m = block.shape[0]
        if m < TOPK_BLOCK_ROWS:
            block = torch.cat([block, block.new_zeros(TOPK_BLOCK_ROWS - m, v)])
        lse = torch.logsumexp(block, -1, keepdim=True)
        vals, idx = torch.topk(block, k, dim=-1)
        ids[s:s + m], lps[s:s + m] = idx[:m], (vals - lse)[:m]
    return ids, lps
