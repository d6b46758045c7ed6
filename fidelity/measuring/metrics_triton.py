"""The Triton kernel behind `fidelity.measuring.metrics` on CUDA (imported only when Triton is there): one program per
position walks both rows of logits once, as the CPU kernel does (see fidelity/measuring/metrics.py), with per-lane float64 sums
under one shift per row and side and per-lane top-1/top-2 tracking, combined at the end. The shift is the CPU kernel's
running maximum (FIXED_SHIFT off: a cross-lane maximum and a possible rescale per block) or the first block's maximum
kept for the whole row (FIXED_SHIFT: 1.5x faster on an H200; rows far above it are flagged for a running-shift pass). Its exp is the CPU kernel's
with a 64-entry table: x = (64 k + j) ln2/64 + r, |r| <= ln2/128, exp(r) by Taylor to r^5 (4e-17), times 2^(j/64) from
the table with k added to its exponent bits. Constants come in as a float64 tensor: Triton would type a Python float
as float32.

With TOP5, the program also keeps each lane's top-5 (value, index) list, strictly-greater inserts so an equal later
value goes after the earlier one, and at the end pops the 5 best over the lanes (largest value, then lowest index):
the CPU kernel's top-5 lists exactly, whose common prefix is topk_match."""
import triton
import triton.language as tl


@triton.jit
def exp_nonpositive(x, table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5, magic, MAGIC: tl.constexpr):
    # as the CPU kernel's _exp_nonpositive, with a 64-entry table: x = (64 k + j) ln2/64 + r. Good for x < 700 too
    # (the fixed-shift kernel's terms above its shift). MAGIC rounds x / step by adding 1.5 * 2^52 (the integer then
    # sits in the low mantissa bits): no float->int conversion and no floor, which run on the GPU's slow units
    x = tl.where(x > -700.0, x, -700.0)
    if MAGIC:
        shifted = x * inv_step + magic
        n = shifted - magic
        ni = (shifted.to(tl.int64, bitcast=True) - magic.to(tl.int64, bitcast=True)).to(tl.int32)
    else:
        n = tl.floor(x * inv_step + 0.5)
        ni = n.to(tl.int32)      # |n| <= 700 * 64 / ln2 < 2^16: int32 index arithmetic, one int64 add
    r = (x - n * step_hi) - n * step_lo
    p = 1.0 + r * (1.0 + r * (c2 + r * (c3 + r * (c4 + r * c5))))
    scale = tl.load(table_ptr + (ni & 63)) + ((ni >> 6).to(tl.int64) << 52)      # 2^(j/64), k added to its exponent
    return p * scale.to(tl.float64, bitcast=True)


@triton.jit
def exp_constants(const_ptr):
    # exp_nonpositive's float64 constants (metrics._exp_constants): inv_step, step_hi, step_lo, c2..c5, magic
    return (tl.load(const_ptr), tl.load(const_ptr + 1), tl.load(const_ptr + 2), tl.load(const_ptr + 3),
            tl.load(const_ptr + 4), tl.load(const_ptr + 5), tl.load(const_ptr + 6), tl.load(const_ptr + 7))


@triton.jit
def add_pair_terms(x, y, mask, z_a, z_b, k_a, k_b, table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5, magic,
                   MAGIC: tl.constexpr):
    # one block's terms of the four sums, x and y the shifted logits of both sides: Z = sum exp, K = sum exp * (x - y)
    e_a = tl.where(mask, exp_nonpositive(x, table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5, magic, MAGIC), 0.0)
    e_b = tl.where(mask, exp_nonpositive(y, table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5, magic, MAGIC), 0.0)
    d = x - y
    return z_a + e_a, z_b + e_b, k_a + tl.where(mask, e_a * d, 0.0), k_b + tl.where(mask, e_b * d, 0.0)


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
def top5_kernel(a_ptr, b_ptr, match_ptr, stride_a, stride_b, V: tl.constexpr, BLOCK: tl.constexpr):
    """topk_match alone: one program per position, both rows' top-5 lists, their common prefix length."""
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
    tl.store(match_ptr + row, top5_match(a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4,
                                         b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4, V))


@triton.jit
def top5_match(a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4, b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4, V):
    match = 0
    same = True
    for _ in tl.static_range(5):
        pa, a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4 = top5_pop(a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4, V)
        pb, b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4 = top5_pop(b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4, V)
        same = same & (pa >= 0) & (pa == pb)
        match += same.to(tl.int64)
    return match


@triton.jit
def rows_kernel(a_ptr, b_ptr, t_ptr, out_ptr, top_ptr, match_ptr, retry_ptr, const_ptr, table_ptr, stride_a, stride_b,
                V: tl.constexpr, BLOCK: tl.constexpr, TOP5: tl.constexpr, FIXED_SHIFT: tl.constexpr,
                MAGIC: tl.constexpr, PREFETCH: tl.constexpr):
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
    top_a = tl.full([BLOCK], float("-inf"), tl.float32)     # per lane: best, runner-up, index of the best
    second_a = tl.full([BLOCK], float("-inf"), tl.float32)
    top_b = tl.full([BLOCK], float("-inf"), tl.float32)
    idx_a = tl.zeros([BLOCK], tl.int32)     # int32: fewer registers (vocabularies are far below 2^31)
    idx_b = tl.zeros([BLOCK], tl.int32)
    if TOP5:
        ninf = tl.full([BLOCK], float("-inf"), tl.float32)
        none = tl.full([BLOCK], V, tl.int32)
        a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4 = ninf, ninf, ninf, ninf, ninf, none, none, none, none, none
        b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4 = ninf, ninf, ninf, ninf, ninf, none, none, none, none, none
    if PREFETCH:
        # the next block's loads are issued before this block's arithmetic, so memory and float64 math overlap
        # (same values, same order of operations: the results do not change)
        next_a = tl.load(a_row + lanes, mask=lanes < V, other=float("-inf"))
        next_b = tl.load(b_row + lanes, mask=lanes < V, other=float("-inf"))
    for lo in range(0, V, BLOCK):
        offs = lo + lanes
        mask = offs < V
        if PREFETCH:
            xa, xb = next_a, next_b
            ahead = offs + BLOCK
            next_a = tl.load(a_row + ahead, mask=ahead < V, other=float("-inf"))
            next_b = tl.load(b_row + ahead, mask=ahead < V, other=float("-inf"))
        else:
            xa = tl.load(a_row + offs, mask=mask, other=float("-inf"))
            xb = tl.load(b_row + offs, mask=mask, other=float("-inf"))
        up_a = xa > top_a               # strictly greater: a lane keeps the first index of its best
        second_a = tl.where(up_a, top_a, tl.maximum(second_a, xa))
        top_a = tl.where(up_a, xa, top_a)
        idx_a = tl.where(up_a, offs, idx_a)
        up_b = xb > top_b
        top_b = tl.where(up_b, xb, top_b)
        idx_b = tl.where(up_b, offs, idx_b)
        if TOP5:
            a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4 = top5_insert(xa, offs, a0, a1, a2, a3, a4,
                                                                      ai0, ai1, ai2, ai3, ai4)
            b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4 = top5_insert(xb, offs, b0, b1, b2, b3, b4,
                                                                      bi0, bi1, bi2, bi3, bi4)
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
        x = xa.to(tl.float64) - s_a
        y = xb.to(tl.float64) - s_b
        z_a, z_b, k_a, k_b = add_pair_terms(x, y, mask, z_a, z_b, k_a, k_b, table_ptr, inv_step, step_hi, step_lo,
                                            c2, c3, c4, c5, magic, MAGIC)
    sum_za, sum_zb, sum_ka, sum_kb = tl.sum(z_a, 0), tl.sum(z_b, 0), tl.sum(k_a, 0), tl.sum(k_b, 0)
    best_a = tl.max(top_a, 0)
    first_a = tl.min(tl.where(top_a == best_a, idx_a, V), 0)
    runner_up = tl.maximum(tl.max(second_a, 0), tl.max(tl.where(idx_a == first_a, float("-inf"), top_a), 0))
    best_b = tl.max(top_b, 0)
    first_b = tl.min(tl.where(top_b == best_b, idx_b, V), 0)
    if FIXED_SHIFT:
        tl.store(retry_ptr + row, ((best_a.to(tl.float64) - s_a > 600.0) | (best_b.to(tl.float64) - s_b > 600.0)).to(tl.int8))
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
    tl.store(top_ptr + row * 2, first_a.to(tl.int64))
    tl.store(top_ptr + row * 2 + 1, first_b.to(tl.int64))
    if TOP5:
        tl.store(match_ptr + row, top5_match(a0, a1, a2, a3, a4, ai0, ai1, ai2, ai3, ai4,
                                             b0, b1, b2, b3, b4, bi0, bi1, bi2, bi3, bi4, V))
