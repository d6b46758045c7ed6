"""The Triton kernel behind `fidelity.metrics` on CUDA (imported only when Triton is there): one program per
position walks both rows of logits once, as the CPU kernel does (see fidelity/metrics.py), with per-lane float64 sums
under the row's one running shift and per-lane top-1/top-2 tracking, combined at the end. Its exp is the CPU kernel's
with a 64-entry table: x = (64 k + j) ln2/64 + r, |r| <= ln2/128, exp(r) by Taylor to r^5 (4e-17), times 2^(j/64) from
the table with k added to its exponent bits. Constants come in as a float64 tensor: Triton would type a Python float
as float32."""
import triton
import triton.language as tl


@triton.jit
def exp_nonpositive(x, table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5):
    # as the CPU kernel's _exp_nonpositive, with a 64-entry table: x = (64 k + j) ln2/64 + r
    x = tl.where(x > -700.0, x, -700.0)
    n = tl.floor(x * inv_step + 0.5)
    r = (x - n * step_hi) - n * step_lo
    p = 1.0 + r * (1.0 + r * (c2 + r * (c3 + r * (c4 + r * c5))))
    ni = n.to(tl.int64)
    scale = tl.load(table_ptr + (ni & 63)) + ((ni >> 6) << 52)      # 2^(j/64) with k added to its exponent
    return p * scale.to(tl.float64, bitcast=True)


@triton.jit
def rows_kernel(a_ptr, b_ptr, t_ptr, out_ptr, top_ptr, const_ptr, table_ptr, stride_a, stride_b, V: tl.constexpr,
                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    a_row, b_row = a_ptr + row * stride_a, b_ptr + row * stride_b
    inv_step, step_hi, step_lo = tl.load(const_ptr), tl.load(const_ptr + 1), tl.load(const_ptr + 2)
    c2, c3, c4, c5 = tl.load(const_ptr + 3), tl.load(const_ptr + 4), tl.load(const_ptr + 5), tl.load(const_ptr + 6)
    lanes = tl.arange(0, BLOCK)
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
    for lo in range(0, V, BLOCK):
        offs = lo + lanes
        mask = offs < V
        xa = tl.load(a_row + offs, mask=mask, other=float("-inf"))
        xb = tl.load(b_row + offs, mask=mask, other=float("-inf"))
        up_a = xa > top_a               # strictly greater: a lane keeps the first index of its best
        second_a = tl.where(up_a, top_a, tl.maximum(second_a, xa))
        top_a = tl.where(up_a, xa, top_a)
        idx_a = tl.where(up_a, offs, idx_a)
        up_b = xb > top_b
        top_b = tl.where(up_b, xb, top_b)
        idx_b = tl.where(up_b, offs, idx_b)
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
        e_a = tl.where(mask, exp_nonpositive(x, table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5), 0.0)
        e_b = tl.where(mask, exp_nonpositive(y, table_ptr, inv_step, step_hi, step_lo, c2, c3, c4, c5), 0.0)
        d = x - y
        z_a += e_a
        z_b += e_b
        k_a += tl.where(mask, e_a * d, 0.0)
        k_b += tl.where(mask, e_b * d, 0.0)
    sum_za, sum_zb, sum_ka, sum_kb = tl.sum(z_a, 0), tl.sum(z_b, 0), tl.sum(k_a, 0), tl.sum(k_b, 0)
    best_a = tl.max(top_a, 0)
    first_a = tl.min(tl.where(top_a == best_a, idx_a, V), 0)
    runner_up = tl.maximum(tl.max(second_a, 0), tl.max(tl.where(idx_a == first_a, float("-inf"), top_a), 0))
    best_b = tl.max(top_b, 0)
    first_b = tl.min(tl.where(top_b == best_b, idx_b, V), 0)
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
