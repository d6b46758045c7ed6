"""The Triton kernel behind `fidelity.measuring.metrics` on CUDA (imported only when Triton is there): one program per
position walks both rows of logits once, as the CPU kernel does (see fidelity/measuring/metrics.py), with per-lane
float64 sums under one shift per row and side, combined at the end. The shift is the CPU kernel's running maximum
(FIXED_SHIFT off: a cross-lane maximum and a possible rescale per block) or the first block's maximum kept for the whole
row (FIXED_SHIFT: 1.5x faster on an H200; rows far above it are flagged for a running-shift pass). Its exp is the CPU
kernel's with a table: x = (64 k + j) ln2/64 + r, |r| <= ln2/128, exp(r) by Taylor to r^5 (4e-17), times 2^(j/64)
from the table with k added to its exponent bits (EXP_BITS 8, the default: 256 entries, |r| <= ln2/512, Taylor to r^4);
<= 1.5 ulp of numpy's exp. Constants come in as a float64 tensor: Triton would type a Python float as float32. By
default (MetricKernel.convert, .lean) the logits become float64 by moving bits and the exp takes x unclamped:
the rows where either could differ from the CPU kernel (an inf or NaN, a shift within 2^-60 of zero or 2^24 from it,
a logit more than 700 below its shift) are flagged and measured again by the running-shift kernel without them.

Each lane keeps its best LISTS (value, index) pairs per side, strictly-greater inserts so an equal later value goes
after the earlier one; at the end the program pops the best over the lanes (largest value, then lowest index): the
row's best, runner-up and first index, and for topk_match the CPU kernel's top-5 lists. LISTS 5 holds them exactly;
LISTS 2 (a fifth of the selects per logit) holds them unless one lane holds three of a row's five, which the program
detects and flags: those rows get the exact lists from top5_kernel, so topk_match is the CPU kernel's either way."""
import triton
import triton.language as tl


@triton.jit
def exp_nonpositive(x, table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5, magic, MAGIC: tl.constexpr,
                    EXP_BITS: tl.constexpr = 6, HI_WORD: tl.constexpr = False):
    # as the CPU kernel's _exp_nonpositive, with a table of 2^EXP_BITS entries (64 or 256): x = (64 k + j) ln2/64 + r
    # (256: (256 k + j) ln2/256 + r), for x >= -700.001 (the caller clamps) and x < 700 (the fixed-shift kernel's terms
    # above its shift). MAGIC rounds x / step by adding 1.5 * 2^52 (the integer then sits in the low mantissa bits): no
    # float->int conversion and no floor, which run on the GPU's slow units
    tl.static_assert((EXP_BITS == 6) or (EXP_BITS == 8))
    if MAGIC:
        shifted = x * inv_step + magic
        n = shifted - magic
        # the magic number's low 32 bits are zero, so the low word of the sum's bits is n (|n| < 2^18) as an int32
        ni = shifted.to(tl.int64, bitcast=True).to(tl.int32)
    else:
        n = tl.floor(x * inv_step + 0.5)
        ni = n.to(tl.int32)      # |n| <= 700 * 256 / ln2 < 2^18: int32 index arithmetic, one int64 add
    r = (x - n * step_hi) - n * step_lo
    if EXP_BITS == 6:
        p = 1.0 + r * (1.0 + r * (c2 + r * (c3 + r * (c4 + r * c5))))     # |r| <= ln2/128: to r^5, 4e-17
    else:
        p = 1.0 + r * (1.0 + r * (c2 + r * (c3 + r * c4)))                # |r| <= ln2/512: to r^4, 4e-17
    # 2^(j/64) with k added to its exponent: the table holds bits(2^(j/64)) - j * 2^46 (metrics._exp_constants), so
    # adding n * 2^46 = k * 2^52 + j * 2^46 needs no k = n >> 6 (exact integer arithmetic either way; 256 entries:
    # 2^44)
    entry = tl.load(table_ptr + (ni & ((1 << EXP_BITS) - 1)))
    if HI_WORD:
        # the same sum on the high word alone (n * 2^(52 - EXP_BITS) has a zero low word): one integer add, where
        # the 64-bit add is two on sm_90
        high = (entry >> 32).to(tl.int32) + (ni << (20 - EXP_BITS))
        scale = (high.to(tl.int64) << 32) | (entry & 0xFFFFFFFF)
    else:
        scale = entry + (ni.to(tl.int64) << (52 - EXP_BITS))
    return p * scale.to(tl.float64, bitcast=True)


@triton.jit
def exp_constants(const_ptr):
    # exp_nonpositive's float64 constants (metrics._exp_constants): inv_step, step_hi, step_lo, c2..c5, magic
    return (tl.load(const_ptr), tl.load(const_ptr + 1), tl.load(const_ptr + 2), tl.load(const_ptr + 3),
            tl.load(const_ptr + 4), tl.load(const_ptr + 5), tl.load(const_ptr + 6), tl.load(const_ptr + 7))


@triton.jit
def f64_bits_of_f32(x):
    # float32 -> float64 by moving bits, where sm_90's conversion (F2F.F64.F32) runs at a quarter of the float64 rate:
    # sign, exponent + (1023 - 127), mantissa. Exact for normal numbers; a zero or subnormal comes out as
    # +-2^-127 (1 + m 2^-23), an inf or NaN as a finite number: the caller flags what that could change
    # (an arithmetic shift copies the sign into bits 28-31: the mask keeps bit 31's; e + 896 < 2^11 cannot carry)
    i = x.to(tl.int32, bitcast=True)
    hi = ((i >> 3) & -1879048193) + 0x38000000           # -1879048193: 0x8FFFFFFF as an int32
    lo = (i << 29).to(tl.uint32, bitcast=True)
    return ((hi.to(tl.int64) << 32) | lo.to(tl.int64)).to(tl.float64, bitcast=True)


@triton.jit
def to_f64(x, CONVERT: tl.constexpr):
    if CONVERT:
        return f64_bits_of_f32(x)
    return x.to(tl.float64)


@triton.jit
def add_pair_terms(xa, xb, s_a, s_b, mask, z_a, z_b, k_a, k_b, table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5,
                   magic, MAGIC: tl.constexpr, MASKED: tl.constexpr, CONVERT: tl.constexpr = False,
                   EXP_BITS: tl.constexpr = 6, LEAN: tl.constexpr = False, EXACT_CLAMP: tl.constexpr = False):
    # one block's terms of the four sums, xa and xb the float32 logits of both sides, x and y their float64 values
    # shifted by s_a and s_b: Z = sum exp, K = sum exp * (x - y), d = x - y unclamped as in the CPU kernel. A full
    # block (MASKED off) has no lanes past the vocabulary: no selects. CONVERT: x and y from the logits' bits
    # (f64_bits_of_f32: the same values where the row's checks hold, rows_kernel)
    x = to_f64(xa, CONVERT) - s_a
    y = to_f64(xb, CONVERT) - s_b
    # the exp's clamp (x > -700, NaN false) compared on the float32 logits: a float32 compare and two selects, where a
    # float64 maximum or compare-and-select is seven instructions on sm_90 (and ~40 more registers in this kernel). The
    # float32 bound is s - 700 rounded (off by < 4e-5): a term near it is ~1e-304 either way, which the row's sums
    # (>= 1: the shift's own term is 1 or more) cannot hold, while |s| < 2^24 (the fixed-shift kernel sends rows with
    # a larger shift to the running one, whose EXACT_CLAMP compares x itself: above that s - 700 may round to s, and
    # the row's own maximum would be clamped). LEAN: no clamp (rows_kernel measures a row again where
    # a logit lies more than 700 below its shift) and the exp's scale added on its high word
    if LEAN:
        e_a = exp_nonpositive(x, table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5, magic, MAGIC, EXP_BITS, True)
        e_b = exp_nonpositive(y, table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5, magic, MAGIC, EXP_BITS, True)
    else:
        if EXACT_CLAMP:
            live_a, live_b = x > -700.0, y > -700.0
        else:
            live_a = xa > (s_a - 700.0).to(tl.float32)
            live_b = xb > (s_b - 700.0).to(tl.float32)
        e_a = exp_nonpositive(tl.where(live_a, x, -700.0), table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5,
                              magic, MAGIC, EXP_BITS)
        e_b = exp_nonpositive(tl.where(live_b, y, -700.0), table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5,
                              magic, MAGIC, EXP_BITS)
    d = x - y
    if MASKED:
        e_a = tl.where(mask, e_a, 0.0)
        e_b = tl.where(mask, e_b, 0.0)
        return z_a + e_a, z_b + e_b, k_a + tl.where(mask, e_a * d, 0.0), k_b + tl.where(mask, e_b * d, 0.0)
    return z_a + e_a, z_b + e_b, k_a + e_a * d, k_b + e_b * d


@triton.jit
def top5_insert(x, offs, v0, v1, v2, v3, v4, i0, i1, i2, i3, i4):
    # a lane's list is sorted (v0 >= ... >= v4), so x > v0 implies x > v1 ...: x lands at the first place it beats
    c0, c1, c2, c3, c4 = x > v0, x > v1, x > v2, x > v3, x > v4
    v4, i4 = tl.where(c3, v3, tl.where(c4, x, v4)), tl.where(c3, i3, tl.where(c4, offs, i4))
    v3, i3 = tl.where(c2, v2, tl.where(c3, x, v3)), tl.where(c2, i2, tl.where(c3, offs, i3))
    v2, i2 = tl.where(c1, v1, tl.where(c2, x, v2)), tl.where(c1, i1, tl.where(c2, offs, i2))
    v1, i1 = tl.where(c0, v0, tl.where(c1, x, v1)), tl.where(c0, i0, tl.where(c1, offs, i1))
    v0, i0 = tl.where(c0, x, v0), tl.where(c0, offs, i0)
    return v0, v1, v2, v3, v4, i0, i1, i2, i3, i4


@triton.jit
def top5_pop(v0, v1, v2, v3, v4, i0, i1, i2, i3, i4, V):
    # the next entry of the row's list: the best lane head, lowest index among equal ones (-1: none left)
    best = tl.max(v0, 0)
    pick = tl.min(tl.where(v0 == best, i0, V), 0)
    hit = i0 == pick
    v0, v1, v2, v3, v4 = (tl.where(hit, v1, v0), tl.where(hit, v2, v1), tl.where(hit, v3, v2), tl.where(hit, v4, v3),
                          tl.where(hit, float("-inf"), v4))
    i0, i1, i2, i3, i4 = (tl.where(hit, i1, i0), tl.where(hit, i2, i1), tl.where(hit, i3, i2), tl.where(hit, i4, i3),
                          tl.where(hit, V, i4))
    return tl.where(best > float("-inf"), pick, -1), v0, v1, v2, v3, v4, i0, i1, i2, i3, i4


@triton.jit
def top2_insert(x, offs, v0, v1, i0, i1):
    # a lane's best two (v0 >= v1), strictly-greater inserts as top5_insert
    c0, c1 = x > v0, x > v1
    v1, i1 = tl.where(c0, v0, tl.where(c1, x, v1)), tl.where(c0, i0, tl.where(c1, offs, i1))
    v0, i0 = tl.where(c0, x, v0), tl.where(c0, offs, i0)
    return v0, v1, i0, i1


@triton.jit
def top2_pop(v0, v1, i0, i1, V):
    # top5_pop on lists of two; `hit` marks the lane it took from (a lane taken from twice has run out of entries)
    best = tl.max(v0, 0)
    pick = tl.min(tl.where(v0 == best, i0, V), 0)
    hit = i0 == pick
    v0, v1 = tl.where(hit, v1, v0), tl.where(hit, float("-inf"), v1)
    i0, i1 = tl.where(hit, i1, i0), tl.where(hit, V, i1)
    return best, tl.where(best > float("-inf"), pick, -1), hit.to(tl.int32), v0, v1, i0, i1


@triton.jit
def top1v_insert(x, offs, v0, i0, v1):
    # a lane's best with its index and its runner-up's value alone (LISTS 1): five instructions per logit against
    # top2_insert's eight. Strictly greater for the index, as top2_insert; an equal later value becomes the runner-up
    c0 = x > v0
    return tl.maximum(v0, x), tl.where(c0, offs, i0), tl.maximum(v1, tl.minimum(v0, x))


@triton.jit
def top1v_pop(h, hi, known, V):
    # the next entry of the row's list from lane heads h (index hi where known, else only the value): the best head,
    # lowest index among equal ones. `unsure`: a head whose index is not known is among the best, so this entry (and
    # all after it) may be wrong
    best = tl.max(h, 0)
    cand = (h == best) & (h > float("-inf"))
    unsure = tl.max((cand & (known == 0)).to(tl.int32), 0)
    pick = tl.min(tl.where(cand & (known != 0), hi, V), 0)
    hit = (hi == pick) & (known != 0)
    return best, tl.where(best > float("-inf"), pick, -1), hit, unsure


@triton.jit
def prefix_start(pa, pb):
    # the top-5 lists' common prefix after their first pop (pa, pb: each side's index, -1: no entry): whether it
    # still holds, and its length
    same = (pa >= 0) & (pa == pb)
    return same, same.to(tl.int64)


@triton.jit
def prefix_extend(same, match, pa, pb):
    # the prefix after the next pop: it holds while every pop so far agreed
    same = same & (pa >= 0) & (pa == pb)
    return same, match + same.to(tl.int64)


@triton.jit
def top1v_match(a0, ai0, a1, b0, bi0, b1, V, MATCH: tl.constexpr):
    # top2_match from top1v lists: a lane once taken from shows its runner-up's value with no index; `reliable` is
    # the last entry before one such head is among the best (5: none), as in top2_match
    known_a = tl.full(ai0.shape, 1, tl.int32)
    known_b = tl.full(bi0.shape, 1, tl.int32)
    best_a, pa, hit_a, _ = top1v_pop(a0, ai0, known_a, V)
    _, pb, hit_b, _ = top1v_pop(b0, bi0, known_b, V)
    a0, known_a = tl.where(hit_a, a1, a0), tl.where(hit_a, 0, known_a)
    b0, known_b = tl.where(hit_b, b1, b0), tl.where(hit_b, 0, known_b)
    first_a, first_b = pa, pb
    runner_up = tl.max(a0, 0)
    same, match = prefix_start(pa, pb)
    reliable = 5
    if MATCH:
        for m in tl.static_range(2, 6):
            _, pa, hit_a, unsure_a = top1v_pop(a0, ai0, known_a, V)
            _, pb, hit_b, unsure_b = top1v_pop(b0, bi0, known_b, V)
            same, match = prefix_extend(same, match, pa, pb)
            reliable = tl.where(((unsure_a + unsure_b) > 0) & (reliable == 5), m - 1, reliable)
            a0, known_a = tl.where(hit_a, a1, a0), tl.where(hit_a, 0, known_a)
            b0, known_b = tl.where(hit_b, b1, b0), tl.where(hit_b, 0, known_b)
            a1 = tl.where(hit_a, float("-inf"), a1)
            b1 = tl.where(hit_b, float("-inf"), b1)
    return match, best_a, runner_up, first_a, first_b, reliable


@triton.jit
def top5_kernel(a_ptr, b_ptr, match_ptr, rows_ptr, stride_a, stride_b, V: tl.constexpr, BLOCK: tl.constexpr,
                INDIRECT: tl.constexpr):
    """topk_match alone: one program per position (INDIRECT: per entry of rows_ptr), both rows' top-5 lists, their
    common prefix length."""
    if INDIRECT:
        row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    a_row, b_row = a_ptr + row * stride_a, b_ptr + row * stride_b
    lanes = tl.arange(0, BLOCK)
    ninf = tl.full([BLOCK], float("-inf"), tl.float32)
    none = tl.full([BLOCK], V, tl.int32)
    a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4 = ninf, ninf, ninf, ninf, ninf, none, none, none, none, none
    b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4 = ninf, ninf, ninf, ninf, ninf, none, none, none, none, none
    for lo in range(0, V, BLOCK):
        offs = lo + lanes
        mask = offs < V
        xa = tl.load(a_row + offs, mask=mask, other=float("-inf"))
        xb = tl.load(b_row + offs, mask=mask, other=float("-inf"))
        a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4 = top5_insert(xa, offs, a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4)
        b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4 = top5_insert(xb, offs, b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4)
    match, _, _, _, _, _ = top5_match(
        a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4, b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4, V
    )
    tl.store(match_ptr + row, match)


@triton.jit
def top5_match(a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4, b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4, V):
    # (common prefix length, the reference's best value and its runner-up (the second entry: equal to it on a tie),
    # the first index of each side's best (-1: no entry), 5: every entry is right)
    best_a = tl.max(a0, 0)
    pa, a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4 = top5_pop(a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4, V)
    pb, b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4 = top5_pop(b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4, V)
    first_a, first_b = pa, pb
    runner_up = tl.max(a0, 0)
    same, match = prefix_start(pa, pb)
    for _ in tl.static_range(4):
        pa, a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4 = top5_pop(a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4, V)
        pb, b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4 = top5_pop(b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4, V)
        same, match = prefix_extend(same, match, pa, pb)
    return match, best_a, runner_up, first_a, first_b, 5


@triton.jit
def top2_match(a0, a1, ai0, ai1, b0, b1, bi0, bi1, V, MATCH: tl.constexpr):
    # top5_match from lists of two per lane. Such lists hold a row's top-5 unless one lane holds three of them: once a
    # lane is taken from twice (pop m), the entries after m may be wrong; `reliable` is that m (5: none ran out), and
    # the prefix length is right if it stopped before m (match < reliable), else the row is measured again
    best_a, pa, hit_a, a0, a1, ai0, ai1 = top2_pop(a0, a1, ai0, ai1, V)
    _, pb, hit_b, b0, b1, bi0, bi1 = top2_pop(b0, b1, bi0, bi1, V)
    first_a, first_b = pa, pb
    runner_up = tl.max(a0, 0)
    same, match = prefix_start(pa, pb)
    reliable = 5
    if MATCH:
        used_a, used_b = hit_a, hit_b
        for m in tl.static_range(2, 6):
            _, pa, hit_a, a0, a1, ai0, ai1 = top2_pop(a0, a1, ai0, ai1, V)
            _, pb, hit_b, b0, b1, bi0, bi1 = top2_pop(b0, b1, bi0, bi1, V)
            same, match = prefix_extend(same, match, pa, pb)
            used_a, used_b = used_a + hit_a, used_b + hit_b
            ran_out = (tl.max(used_a, 0) > 1) | (tl.max(used_b, 0) > 1)
            if m < 5:
                reliable = tl.where(ran_out & (reliable == 5), m, reliable)
    return match, best_a, runner_up, first_a, first_b, reliable


@triton.jit
def rows_kernel(a_ptr, b_ptr, t_ptr, out_ptr, top_ptr, match_ptr, retry_ptr, const_ptr, table_ptr, stride_a, stride_b,
                V: tl.constexpr, BLOCK: tl.constexpr, LISTS: tl.constexpr, MATCH: tl.constexpr,
                FIXED_SHIFT: tl.constexpr, MAGIC: tl.constexpr, PREFETCH: tl.constexpr, CONVERT: tl.constexpr = False,
                EXP_BITS: tl.constexpr = 6, LEAN: tl.constexpr = False, UNROLL: tl.constexpr = 1):
    """One position per program. Each lane keeps its LISTS (2 or 5) best logits per side with their indices (LISTS 1:
    its best with its index and its runner-up's value alone), from which the row's best, runner-up and (MATCH) top-5
    prefix come at the end. retry_ptr bit 0: the row lies too far above its fixed shift, or the shift is 2^24 or more
    (measure it again with the running shift); bit 1 (LISTS 1, 2): its top-5 prefix needs the exact lists of
    top5_kernel; bit 2 (CONVERT): a logit is not finite, or a shift lies within 2^-60 of zero, where f64_bits_of_f32 may
    differ from the conversion (measure it again without CONVERT); LEAN (with CONVERT): also a logit more than 700 below
    its side's shift, which the unclamped exp cannot take."""
    # CONVERT's check holds for one shift per row and side (the running shift passes through others)
    tl.static_assert(FIXED_SHIFT or not CONVERT)
    tl.static_assert(CONVERT or not LEAN)
    row = tl.program_id(0).to(tl.int64)
    a_row, b_row = a_ptr + row * stride_a, b_ptr + row * stride_b
    inv_step, step_hi, step_lo, c2, c3, c4, c5, magic = exp_constants(const_ptr)
    lanes = tl.arange(0, BLOCK)
    if FIXED_SHIFT:
        # one shift per side for the whole row, the first block's maximum: no cross-lane maximum, branch or rescale per
        # block. Later terms may exceed 1 (exp is good below 700; a row whose maximum lies further up is flagged in
        # retry_ptr and measured again by the running-shift kernel)
        first = lanes < V
        s_a = tl.max(tl.load(a_row + lanes, mask=first, other=float("-inf")), 0).to(tl.float64)
        s_b = tl.max(tl.load(b_row + lanes, mask=first, other=float("-inf")), 0).to(tl.float64)
    else:
        s_a, s_b = tl.load(a_row).to(tl.float64), tl.load(b_row).to(tl.float64)   # running shifts: maxima so far
    z_a = tl.zeros([BLOCK], tl.float64)    # per-lane sums under the row's one shift, added up at the end
    z_b = tl.zeros([BLOCK], tl.float64)
    k_a = tl.zeros([BLOCK], tl.float64)
    k_b = tl.zeros([BLOCK], tl.float64)
    ninf = tl.full([BLOCK], float("-inf"), tl.float32)
    none = tl.full([BLOCK], V, tl.int32)      # int32 indices: fewer registers (vocabularies are far below 2^31)
    # per side LISTS values then LISTS indices, side a first
    if LISTS == 1:
        lists = (ninf, none, ninf, ninf, none, ninf)       # per side: best, its index, runner-up
    else:
        lists = (ninf, ) * LISTS + (none, ) * LISTS + (ninf, ) * LISTS + (none, ) * LISTS
    sums = (s_a, s_b, z_a, z_b, k_a, k_b)
    # CONVERT: (a - b) * 0 summed per lane is NaN where either side holds an inf or NaN (or a - b overflows); LEAN:
    # each side's lane minimum instead (NaN if a NaN passed), against the shift at the end
    if LEAN:
        check = (tl.full([BLOCK], float("inf"), tl.float32), tl.full([BLOCK], float("inf"), tl.float32))
    else:
        check = (tl.zeros([BLOCK], tl.float32), )
    consts = (inv_step, step_hi, step_lo, c2, c3, c4, c5, magic)
    # PREFETCH (1 or 2): the next block's (and the one after's) loads are issued before this block's arithmetic, so
    # memory and float64 math overlap (same values, same order of operations: the results do not change)
    next_a, next_b, far_a, far_b = ninf, ninf, ninf, ninf
    if PREFETCH > 0:
        next_a = tl.load(a_row + lanes, mask=lanes < V, other=float("-inf"))
        next_b = tl.load(b_row + lanes, mask=lanes < V, other=float("-inf"))
    if PREFETCH > 1:
        far_a = tl.load(a_row + BLOCK + lanes, mask=BLOCK + lanes < V, other=float("-inf"))
        far_b = tl.load(b_row + BLOCK + lanes, mask=BLOCK + lanes < V, other=float("-inf"))
    ahead = (next_a, next_b, far_a, far_b)
    # the full blocks (no lane past the vocabulary: no masked selects), then the partial one, if any
    FULL: tl.constexpr = V // BLOCK * BLOCK
    for lo in tl.range(0, FULL, BLOCK, loop_unroll_factor=UNROLL):
        ahead, lists, sums, check = block_step(a_row, b_row, lo + lanes, ahead, lists, sums, check, table_ptr, consts,
                                               V, BLOCK, PREFETCH, LISTS, FIXED_SHIFT, MAGIC, False, CONVERT,
                                               EXP_BITS, LEAN)
    if FULL < V:
        ahead, lists, sums, check = block_step(a_row, b_row, FULL + lanes, ahead, lists, sums, check, table_ptr,
                                               consts, V, BLOCK, PREFETCH, LISTS, FIXED_SHIFT, MAGIC, True, CONVERT,
                                               EXP_BITS, LEAN)
    s_a, s_b, z_a, z_b, k_a, k_b = sums
    sum_za, sum_zb, sum_ka, sum_kb = tl.sum(z_a, 0), tl.sum(z_b, 0), tl.sum(k_a, 0), tl.sum(k_b, 0)
    if LISTS == 1:
        a0, ai0, a1, b0, bi0, b1 = lists
        match, best_a, runner_up, first_a, first_b, reliable = top1v_match(a0, ai0, a1, b0, bi0, b1, V, MATCH)
    elif LISTS == 5:
        a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4, b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4 = lists
        match, best_a, runner_up, first_a, first_b, reliable = top5_match(a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4,
                                                                          b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4,
                                                                          V)
    else:
        a0, a1, ai0, ai1, b0, b1, bi0, bi1 = lists
        match, best_a, runner_up, first_a, first_b, reliable = top2_match(a0, a1, ai0, ai1, b0, b1, bi0, bi1, V, MATCH)
    flags = 0
    if FIXED_SHIFT:
        best_b = tl.max(b0, 0)
        far = (best_a.to(tl.float64) - s_a > 600.0) | (best_b.to(tl.float64) - s_b > 600.0)
        # (and a shift of 2^24 or more, or not a number: add_pair_terms' float32 clamp needs |s| < 2^24)
        far = far | ~((tl.abs(s_a) < 16777216.0) & (tl.abs(s_b) < 16777216.0))
        flags = far.to(tl.int32)
    if MATCH and LISTS != 5:
        flags = flags | (((reliable < 5) & (match >= reliable)).to(tl.int32) << 1)
    if CONVERT:
        tiny = (tl.abs(s_a) < 8.673617379884035e-19) | (tl.abs(s_b) < 8.673617379884035e-19)    # 2^-60
        if LEAN:
            low_a, low_b = check
            unsure = tl.sum(((low_a != low_a) | (low_b != low_b)).to(tl.int32), 0) > 0
            # (a NaN shift fails both comparisons: measured again too)
            deep = ~(
                (tl.min(low_a, 0).to(tl.float64) - s_a >= -700.0) & (tl.min(low_b, 0).to(tl.float64) - s_b >= -700.0)
            )
            flags = flags | ((unsure | deep | tiny).to(tl.int32) << 2)
        else:
            bad = tl.sum(check[0], 0)
            flags = flags | (((bad != bad) | tiny).to(tl.int32) << 2)
    if FIXED_SHIFT or (MATCH and LISTS != 5):          # (CONVERT implies FIXED_SHIFT)
        tl.store(retry_ptr + row, flags.to(tl.int8))
    c = tl.log(sum_za / sum_zb)
    lse_a, lse_b = s_a + tl.log(sum_za), s_b + tl.log(sum_zb)
    target = tl.load(t_ptr + row)
    o = out_ptr + row * 6
    tl.store(o, sum_ka / sum_za - c)
    tl.store(o + 1, c - sum_kb / sum_zb)
    tl.store(o + 2, best_a.to(tl.float64) - runner_up.to(tl.float64))
    tl.store(o + 3, tl.exp(best_a.to(tl.float64) - lse_a))
    tl.store(o + 4, lse_a - tl.load(a_row + target).to(tl.float64))
    tl.store(o + 5, lse_b - tl.load(b_row + target).to(tl.float64))
    # a row without a finite (or non-NaN) logit has no list entry: index 0, as the CPU kernel's
    tl.store(top_ptr + row * 2, tl.maximum(first_a, 0).to(tl.int64))
    tl.store(top_ptr + row * 2 + 1, tl.maximum(first_b, 0).to(tl.int64))
    if MATCH:
        tl.store(match_ptr + row, match)


@triton.jit
def block_step(a_row, b_row, offs, ahead, lists, sums, check, table_ptr, consts, V, BLOCK: tl.constexpr,
               PREFETCH: tl.constexpr, LISTS: tl.constexpr, FIXED_SHIFT: tl.constexpr, MAGIC: tl.constexpr,
               MASKED: tl.constexpr, CONVERT: tl.constexpr, EXP_BITS: tl.constexpr = 6, LEAN: tl.constexpr = False):
    # one block of both rows: its logits (and the loads ahead: next_a, next_b, far_a, far_b), each lane's lists of
    # its best LISTS per side (values then indices, side a first), the sums (s_a, s_b, z_a, z_b, k_a, k_b), the
    # CONVERT check
    xa, xb, next_a, next_b, far_a, far_b = load_block(a_row, b_row, offs, ahead[0], ahead[1], ahead[2], ahead[3], V,
                                                      BLOCK, PREFETCH, MASKED)
    if LEAN:
        low_a, low_b = check
        if MASKED:
            xa_, xb_ = tl.where(offs < V, xa, float("inf")), tl.where(offs < V, xb, float("inf"))
        else:
            xa_, xb_ = xa, xb
        check = (tl.minimum(low_a, xa_, propagate_nan=tl.PropagateNan.ALL),
                 tl.minimum(low_b, xb_, propagate_nan=tl.PropagateNan.ALL))
    elif CONVERT:
        if MASKED:
            check = (check[0] + tl.where(offs < V, xa - xb, 0.0) * 0.0, )
        else:
            check = (check[0] + (xa - xb) * 0.0, )
    if LISTS == 1:
        a = top1v_insert(xa, offs, lists[0], lists[1], lists[2])
        b = top1v_insert(xb, offs, lists[3], lists[4], lists[5])
    elif LISTS == 5:
        a = top5_insert(xa, offs, lists[0], lists[1], lists[2], lists[3], lists[4],
                        lists[5], lists[6], lists[7], lists[8], lists[9])
        b = top5_insert(xb, offs, lists[10], lists[11], lists[12], lists[13], lists[14],
                        lists[15], lists[16], lists[17], lists[18], lists[19])
    else:
        a = top2_insert(xa, offs, lists[0], lists[1], lists[2], lists[3])
        b = top2_insert(xb, offs, lists[4], lists[5], lists[6], lists[7])
    sums = shift_and_sum(xa, xb, offs < V, sums[0], sums[1], sums[2], sums[3], sums[4], sums[5], table_ptr,
                         consts[0], consts[1], consts[2], consts[3], consts[4], consts[5], consts[6], consts[7],
                         FIXED_SHIFT, MAGIC, MASKED, CONVERT, EXP_BITS, LEAN)
    return (next_a, next_b, far_a, far_b), a + b, sums, check


@triton.jit
def load_block(a_row, b_row, offs, next_a, next_b, far_a, far_b, V, BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
               MASKED: tl.constexpr):
    # this block's logits of both sides (-inf past the vocabulary). PREFETCH 1: they were loaded one block earlier and
    # the next block's loads are issued now; 2: two blocks earlier, the block after next is loaded now (the last,
    # partial block has nothing left to load)
    if PREFETCH == 0:
        if MASKED:
            xa = tl.load(a_row + offs, mask=offs < V, other=float("-inf"))
            xb = tl.load(b_row + offs, mask=offs < V, other=float("-inf"))
        else:
            xa = tl.load(a_row + offs)
            xb = tl.load(b_row + offs)
    else:
        xa, xb = next_a, next_b
        if PREFETCH == 1:
            if not MASKED:
                ahead = offs + BLOCK
                next_a = tl.load(a_row + ahead, mask=ahead < V, other=float("-inf"))
                next_b = tl.load(b_row + ahead, mask=ahead < V, other=float("-inf"))
        else:
            next_a, next_b = far_a, far_b
            if not MASKED:
                ahead = offs + 2 * BLOCK
                far_a = tl.load(a_row + ahead, mask=ahead < V, other=float("-inf"))
                far_b = tl.load(b_row + ahead, mask=ahead < V, other=float("-inf"))
    return xa, xb, next_a, next_b, far_a, far_b


@triton.jit
def shift_and_sum(xa, xb, mask, s_a, s_b, z_a, z_b, k_a, k_b, table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5,
                  magic, FIXED_SHIFT: tl.constexpr, MAGIC: tl.constexpr, MASKED: tl.constexpr,
                  CONVERT: tl.constexpr = False, EXP_BITS: tl.constexpr = 6, LEAN: tl.constexpr = False):
    # the running shift's update for a block that raises a maximum (the fixed shift has none), then the block's terms
    if not FIXED_SHIFT:
        m_a, m_b = tl.max(xa, 0).to(tl.float64), tl.max(xb, 0).to(tl.float64)
        if (m_a > s_a) | (m_b > s_b):
            # a new maximum rescales the sums so far (k_* hold d - (s_a - s_b): they move by that offset's change)
            new_a, new_b = tl.maximum(s_a, m_a), tl.maximum(s_b, m_b)
            change = (new_a - new_b) - (s_a - s_b)
            scale_a, scale_b = tl.exp(s_a - new_a), tl.exp(s_b - new_b)
            k_a = (k_a - change * z_a) * scale_a
            k_b = (k_b - change * z_b) * scale_b
            z_a = z_a * scale_a
            z_b = z_b * scale_b
            s_a, s_b = new_a, new_b
    z_a, z_b, k_a, k_b = add_pair_terms(xa, xb, s_a, s_b, mask, z_a, z_b, k_a, k_b, table_ptr, inv_step, step_hi,
                                        step_lo, c2, c3, c4, c5, magic, MAGIC, MASKED, CONVERT, EXP_BITS, LEAN,
                                        not FIXED_SHIFT)
    return s_a, s_b, z_a, z_b, k_a, k_b
