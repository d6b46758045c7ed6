"""EXL3 decode in one Triton kernel (imported only where Triton is; codec.decode_weight picks it on CUDA): one program
per 128x128 Hadamard block of W^T reads its 64 tiles' trellis words, forms every 16-bit state, looks the codebook up
as exact integers, does both Hadamard sums on integer tensor cores and writes float32 W^T once.

Why it is bit-identical to the torch decode: every codebook value is a multiple of 2^-CODEBOOK_SHIFT with magnitude
below 4, so Q * 2^CODEBOOK_SHIFT is an integer X (|X| < 2^20). The Hadamard sums H X H of such integers are exact in
any order. Each side is split into balanced base-256 digits (int8 in [-128, 127]) multiplied by the +-1 matrix on
int8 tensor cores with int32 accumulation (|digit sums| <= 128 * 128: exact), and recombined exactly (int32 after the
first side, |H X| < 2^27; int64 after the second, |H X H| < 2^34). The float64 steps are the torch decode's, in its
order: S = sums * 2^-CODEBOOK_SHIFT (exact), S * (svh / 128), then * suh, rounded once to float32. No float64 matmul
anywhere: the path does not need a GPU's float64 rate (GB10 and consumer cards have 1/64 of the float32 one).
"""
import triton
import triton.language as tl


@triton.jit
def _balanced_digit(x):
    # x = d + 256 * rest with d in [-128, 127] (two's complement: the low byte of x + 128, minus 128)
    d = ((x + 128) & 255) - 128
    return d, (x - d) >> 8


@triton.jit
def _digit_product(h, d, LEFT: tl.constexpr):
    if LEFT:
        return tl.dot(h, d.to(tl.int8), out_dtype=tl.int32)
    return tl.dot(d.to(tl.int8), h, out_dtype=tl.int32)


@triton.jit
def _hadamard(h, x, LEFT: tl.constexpr, DIGITS: tl.constexpr, ACC: tl.constexpr):
    """h [128, 128] int8 +-1, x [128, 128] int32 with |x| < 2^(8 DIGITS - 1): h @ x (LEFT) or x @ h, exact, summed
    in ACC (int32 holds h @ x of the trellis values; the second product needs int64), one int8 dot per digit."""
    d, rest = _balanced_digit(x)
    acc = _digit_product(h, d, LEFT).to(ACC)
    for i in tl.static_range(1, DIGITS):
        if i == DIGITS - 1:
            d = rest
        else:
            d, rest = _balanced_digit(rest)
        acc += _digit_product(h, d, LEFT).to(ACC) << (8 * i)
    return acc


# Stored tensors sit at any even offset of a staged or memory-mapped buffer: specialising on their alignment would
# compile a variant per offset pattern during a pass (a second or more each)
@triton.jit(do_not_specialize_on_alignment=["trellis_ptr", "svh_ptr", "suh_ptr"],
            do_not_specialize=["trellis_stride", "svh_stride", "suh_stride", "out_stride"])
def decode_kernel(trellis_ptr, int_table_ptr, hi_ptr, lo_ptr, shift_ptr, hadamard_ptr, svh_ptr, suh_ptr, out_ptr,
                  n_tiles_n, out_rows, out_cols, inv_scale_ptr, trellis_stride, svh_stride, suh_stride, out_stride,
                  WORDS: tl.constexpr, LEFT_DIGITS: tl.constexpr, RIGHT_DIGITS: tl.constexpr):
    """Block (program_id 0 = n block, 1 = k block) of matrix program_id 2 of a batch of W^T [out_rows, out_cols] (the
    padding cut off by the mask); each operand of matrix m starts m strides (elements) after the first one's.
    Rows of the block index n (outputs), columns k (inputs): the block is Q^T, and W^T = diag(svh) H Q^T H diag(suh)."""
    nb = tl.program_id(0)
    kb = tl.program_id(1)
    m = tl.program_id(2).to(tl.int64)
    trellis_ptr += m * trellis_stride
    svh_ptr += m * svh_stride
    suh_ptr += m * suh_stride
    out_ptr += m * out_stride
    n = tl.arange(0, 128)
    k = tl.arange(0, 128)
    # element (n, k) of Q^T is row r = k % 16, column c = n % 16 of tile (k // 16, n // 16)
    pos = (k % 16)[None, :] * 16 + (n % 16)[:, None]
    tile = (kb * 8 + k // 16)[None, :] * n_tiles_n + (nb * 8 + n // 16)[:, None]
    words = trellis_ptr + tile.to(tl.int64) * WORDS
    hi = tl.load(words + tl.load(hi_ptr + pos)).to(tl.int32) & 0xFFFF
    lo = tl.load(words + tl.load(lo_ptr + pos)).to(tl.int32) & 0xFFFF
    state = (((lo << 16) | hi) >> tl.load(shift_ptr + pos)) & 0xFFFF
    x = tl.load(int_table_ptr + state)
    h = tl.load(hadamard_ptr + n[:, None] * 128 + k[None, :])
    sums = _hadamard(h, _hadamard(h, x, True, LEFT_DIGITS, tl.int32), False, RIGHT_DIGITS, tl.int64)
    rows = nb * 128 + n
    cols = kb * 128 + k
    w = sums.to(tl.float64) * tl.load(inv_scale_ptr)
    w = w * (tl.load(svh_ptr + rows).to(tl.float64) / 128.0)[:, None]
    w = w * tl.load(suh_ptr + cols).to(tl.float64)[None, :]
    mask = (rows < out_rows)[:, None] & (cols < out_cols)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_cols + cols[None, :], w.to(tl.float32), mask=mask)
