"""EXL3 (exllamav3 trellis) tensors: an exact pure-PyTorch decoder and the bitstream both ways (the claimer, for all
five layouts, is in layouts.py; the reference encoder for test packs and error simulation in encoder.py).

Format facts (checked bit for bit against exllamav3 1.6.5's CUDA kernels, see tests/test_exl3_decode.py):

- A linear with k inputs and n outputs is padded to multiples of 128 and stored as `trellis` int16 [k/16, n/16, 16*K],
  `suh` fp16 [k], `svh` fp16 [n], an optional scalar marker `mcg` or `mul1` naming the codebook (absent: 3INST), an
  optional `bias`. Older checkpoints store `su`/`sv` sign bitfields (int16, bit i of word j = sign of entry 16j+i, set =
  negative) instead of `suh`/`svh`.
- Each 16x16 tile is a ring of 256*K bits, MSB first in 32-bit little-endian words (uint16 pairs). Position t reads the
  16-bit window ending at bit (t+1)*K, wrapping around the ring (tail-biting), so consecutive states share 16-K bits.
  Half-integer rates K = KA + 0.5 (mul1 only, trellis last dim 16*KA + 8) alternate KA-bit and (KA+1)-bit steps, the odd
  positions taking the extra bit; a window ends where the running sum of the steps up to and including t ends.
- A state maps to an fp16 value through a procedural codebook (3INST, MCG or MUL1). Position t of the ring lands at row
  r, column c of the tile (rows index the input dimension) by the tensor-core permutation: lane = t // 8, j = t % 8,
  r = 2*(lane % 4) + (j & 1) + 8*((j >> 1) & 1), c = lane // 4 + 8*(j >> 2).
- W [k, n] = diag(suh) . H . Q . H . diag(svh) with H block-diagonal 128x128 Sylvester Hadamard / sqrt(128); the torch
  weight is W^T [out, in] with the padding cut off. We rebuild W exactly in float64 (every Hadamard sum of fp16 values
  is exact in float64) and round once to float32.
"""
from __future__ import annotations

from dataclasses import dataclass
import os
from functools import lru_cache

import torch

from ...errors import PackError

TILE = 16                 # tile side
TILE_LEN = 256            # weights per tile
HAD = 128                 # Hadamard block (and padding granularity)
CODEBOOKS = ("3inst", "mcg", "mul1")
MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
HALF_RATE_BASES = (1, 2, 3)   # the half-integer rates exllamav3 instantiates: 1.5, 2.5, 3.5


# ---------------------------------------------------------------------------------------------------------------------
# codebooks
# ---------------------------------------------------------------------------------------------------------------------
def _bits_to_half(bits: torch.Tensor) -> torch.Tensor:
    """16-bit patterns (int64 0..65535) -> float16 values with those bits."""
    return (((bits + 32768) & 0xFFFF) - 32768).to(torch.int16).view(torch.float16)


def round_to_half_grid(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the nearest fp16 value (ties to even) in one step, staying in float64.
    (torch's float64 -> float16 cast goes through float32 and can round twice.)"""
    _, e = torch.frexp(x)                          # |x| = m * 2^e, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(x), (e - 11).clamp(min=-24))
    return torch.round(x / ulp) * ulp              # torch.round is round-half-to-even


def _lop3_pair_sum(x: torch.Tensor) -> torch.Tensor:
    """The 3INST / MCG tail: (x & 0x8fff8fff) ^ 0x3b603b60 read as two fp16 halves, summed and rounded to fp16."""
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = _bits_to_half(x & 0xFFFF).double()
    hi = _bits_to_half(x >> 16).double()
    return round_to_half_grid(lo + hi)


@lru_cache(maxsize=None)
def _codebook_f64(codebook: str) -> torch.Tensor:
    s = torch.arange(65536, dtype=torch.int64)
    if codebook == "3inst":
        return _lop3_pair_sum((s * 89226354 + 64248484) & 0xFFFFFFFF)
    if codebook == "mcg":
        return _lop3_pair_sum((s * MCG_MULT) & 0xFFFFFFFF)
    if codebook == "mul1":
        x = (s * MUL1_MULT) & 0xFFFFFFFF
        byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        h = (1024 + byte_sum).double()                       # the fp16 bit pattern 0x6400 + byte_sum
        k_inv = _bits_to_half(torch.tensor([0x1EEE])).double()
        k_bias = _bits_to_half(torch.tensor([0xC931])).double()
        return round_to_half_grid(h * k_inv + k_bias)        # one fp16 fma: exact in float64, rounded once
    raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")


def codebook_values(codebook: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [65536]: the fp16 value of every 16-bit trellis state (exactly representable)."""
    return _codebook_table(codebook, str(torch.device(device)))


def codebook_marker(codebook: str) -> dict[str, torch.Tensor]:
    """The scalar marker stored next to the trellis (uint32 multiplier viewed as int32); none for 3INST."""
    mult = {"mcg": MCG_MULT, "mul1": MUL1_MULT}.get(codebook)
    return {} if mult is None else {codebook: torch.tensor(mult - (1 << 32), dtype=torch.int32)}


@lru_cache(maxsize=None)
def _codebook_table(codebook: str, device: str) -> torch.Tensor:
    return _codebook_f64(codebook).float().to(device)


# ---------------------------------------------------------------------------------------------------------------------
# bitrate and bitstream
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bitrate:
    """Bits per weight of a trellis: K = base (+ 0.5 for the half-integer mul1 rates)."""

    base: int
    half: bool = False

    @property
    def K(self) -> float | int:
        return self.base + 0.5 if self.half else self.base

    @property
    def words(self) -> int:
        """int16 words per tile: the trellis' last dim."""
        return 16 * self.base + (8 if self.half else 0)

    def steps(self) -> torch.Tensor:
        """New bits each of the 256 positions of a tile adds to the ring."""
        odd = torch.arange(TILE_LEN) % 2
        return self.base + (odd if self.half else 0 * odd)

    @classmethod
    def of(cls, K: float) -> "Bitrate":
        if float(K).is_integer() and 1 <= K <= 8:
            return cls(int(K))
        if K - 0.5 in HALF_RATE_BASES:
            return cls(int(K - 0.5), True)
        raise ValueError(f"K={K} is not an EXL3 bitrate (1..8, or 1.5/2.5/3.5 with the mul1 codebook)")


def bitrate_from_trellis(shape: tuple[int, ...], codebook: str, *, file=None, tensor=None) -> Bitrate:
    """K from the trellis shape alone, validated: [k/16, n/16, 16*K] (16*KA + 8 for half-integer K, mul1 only)."""
    if len(shape) != 3:
        raise PackError(
            f"EXL3 trellis must have 3 dims [k/16, n/16, 16*K], got shape {list(shape)}", file=file, tensor=tensor
        )
    width = shape[-1]
    if width % 16 == 0:
        K = width // 16
        if not 1 <= K <= 8:
            raise PackError(f"EXL3 trellis last dim {width} implies K={K}, outside 1..8", file=file, tensor=tensor)
        return Bitrate(K)
    if width % 16 == 8 and (width - 8) // 16 in HALF_RATE_BASES:
        if codebook != "mul1":
            raise PackError(f"EXL3 trellis last dim {width} implies the half-integer K={(width - 8) // 16}.5, which "
                            f"exllamav3 allows only with the mul1 codebook (this tensor uses {codebook})",
                            file=file, tensor=tensor)
        return Bitrate((width - 8) // 16, True)
    raise PackError(f"EXL3 trellis last dim {width} is not divisible by 16 (K = last dim / 16; only 24, 40, 56 are "
                    f"allowed otherwise, as the mul1 half-integer rates 1.5, 2.5, 3.5)", file=file, tensor=tensor)


@lru_cache(maxsize=None)
def tensor_core_perm() -> torch.Tensor:
    """[256]: row-major tile index (r*16 + c) of each ring position."""
    t = torch.arange(TILE_LEN)
    lane, j = t // 8, t % 8
    r = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    c = lane // 4 + 8 * (j >> 2)
    return r * TILE + c


@lru_cache(maxsize=None)
def tensor_core_perm_inv() -> torch.Tensor:
    return torch.argsort(tensor_core_perm())


@lru_cache(maxsize=None)
def _window_plan(rate: Bitrate, row_major: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per ring position (or per row-major tile element): the stored int16 word holding the window's last bit, the
    stored word before it in the stream, and the right shift that aligns the window."""
    ends = torch.cumsum(rate.steps(), 0)                 # exclusive end bit of each window
    n_units = rate.words                                 # 16-bit stream units per tile
    hi = (ends - 1) // 16
    lo = (hi - 1) % n_units
    shift = (hi + 1) * 16 - ends
    if row_major:
        inv = tensor_core_perm_inv()
        hi, lo, shift = hi[inv], lo[inv], shift[inv]
    # the stream is MSB first in 32-bit little-endian words: stream unit j is stored int16 word j ^ 1
    return hi ^ 1, lo ^ 1, shift.to(torch.int32)


@lru_cache(maxsize=None)
def _window_plan_on(rate: Bitrate, row_major: bool, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(x.to(device) for x in _window_plan(rate, row_major))


def trellis_states(trellis: torch.Tensor, rate: Bitrate, row_major: bool = False) -> torch.Tensor:
    """int32 [..., 256]: the 16-bit state at every ring position of every tile (or in row-major tile order)."""
    u16 = trellis.to(torch.int32) & 0xFFFF
    plan = _window_plan(rate, row_major) if trellis.device.type == "cpu" else \
        _window_plan_on(rate, row_major, str(trellis.device))
    hi, lo, shift = plan
    merged = (u16.index_select(-1, lo) << 16) | u16.index_select(-1, hi)
    return (merged >> shift) & 0xFFFF


def pack_states(states: torch.Tensor, rate: Bitrate) -> torch.Tensor:
    """Inverse of trellis_states for a consistent state sequence: int64 [..., 256] -> int16 [..., words]."""
    steps = rate.steps().to(states.device)
    ends = torch.cumsum(steps, 0)
    n_bits = int(ends[-1])
    new_bits = states & ((1 << steps) - 1)               # the bits each position adds, MSB first
    # bit b (0 = most significant) of position t's new bits goes to ring bit ends[t] - steps[t] + b
    b = torch.arange(8, device=states.device)
    valid = b[None, :] < steps[:, None]                   # [256, 8]
    ring_pos = (ends - steps)[:, None] + b[None, :]
    bit = (new_bits[..., :, None] >> (steps[:, None] - 1 - b[None, :]).clamp(min=0)) & 1
    bits = torch.zeros(states.shape[:-1] + (n_bits,), dtype=torch.int64, device=states.device)
    bits[..., ring_pos[valid]] = bit[..., valid]
    weights = (1 << torch.arange(31, -1, -1, device=states.device))
    words = (bits.view(states.shape[:-1] + (n_bits // 32, 32)) * weights).sum(-1)
    u16 = torch.stack([words & 0xFFFF, words >> 16], dim=-1).flatten(-2)
    return (((u16 + 32768) & 0xFFFF) - 32768).to(torch.int16)


# ---------------------------------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------------------------------
def _checked_rate(trellis: torch.Tensor, codebook: str, file, tensor) -> Bitrate:
    if codebook not in CODEBOOKS:
        raise PackError(f"unknown EXL3 codebook {codebook!r}", file=file, tensor=tensor)
    rate = bitrate_from_trellis(tuple(trellis.shape), codebook, file=file, tensor=tensor)
    if trellis.dtype not in (torch.int16, torch.uint16):
        raise PackError(f"EXL3 trellis must be int16, got {trellis.dtype}", file=file, tensor=tensor)
    return rate


def _decode_tiles(trellis: torch.Tensor, codebook: str, file, tensor) -> torch.Tensor:
    """float32 [k/16, n/16, 16, 16]: every tile's values in row-major order (rows = input dim)."""
    rate = _checked_rate(trellis, codebook, file, tensor)
    kt, nt, _ = trellis.shape
    states = trellis_states(trellis, rate, row_major=True)
    values = codebook_values(codebook, trellis.device).index_select(0, states.flatten())
    return values.view(kt, nt, TILE, TILE)


def decode_inner(trellis: torch.Tensor, codebook: str = "3inst", *, file=None, tensor=None) -> torch.Tensor:
    """Rotated-basis weight Q [k, n] (float32 holding fp16 values exactly), as exllamav3's `reconstruct` kernel."""
    tiles = _decode_tiles(trellis, codebook, file, tensor)
    kt, nt = tiles.shape[:2]
    return tiles.permute(0, 2, 1, 3).reshape(kt * TILE, nt * TILE)


@lru_cache(maxsize=None)
def hadamard_pm1(device: str, dtype: torch.dtype) -> torch.Tensor:
    """128x128 Sylvester Hadamard with +-1 entries: H[i, j] = (-1)^popcount(i & j)."""
    i = torch.arange(HAD)
    x = i[:, None] & i[None, :]
    parity = torch.zeros_like(x)
    while bool(x.any()):
        parity ^= x & 1
        x = x >> 1
    return (1 - 2 * parity).to(device=device, dtype=dtype)


def rotate_back(inner: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """W = diag(suh) . H . Q . H . diag(svh), computed in float64 (exact Hadamard sums), returned in float32.
    Also serves the transposed problem: rotate_back(Q^T, svh, suh) = W^T."""
    return _rotate_back_f64(inner.to(torch.float64), suh, svh)


def _rotate_back_f64(x: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """x: float64 (the float64 sums) or int64 (fp16 values times 2**24, the integer sums) [k, n]."""
    k, n = x.shape
    if x.dtype == torch.int64:
        x = _hadamard_int64(x).to(torch.float64).mul_(2.0 ** -INT_SHIFT)  # |sums| < 2**53: converted exactly
    else:
        H = hadamard_pm1(str(x.device), torch.float64)
        x = torch.matmul(H, x.view(k // HAD, HAD, n))                   # left: rows within each 128-block
        x = torch.matmul(x.view(k, n // HAD, HAD), H).view(k, n)        # right: columns within each 128-block
    x.mul_((suh.to(torch.float64) / HAD)[:, None])                      # 1/sqrt(128) per side
    x.mul_(svh.to(torch.float64)[None, :])
    return x.to(torch.float32)


# Hadamard sums: "float64" (matmuls; every sum of these fp16 values is exact in float64), "int64" (butterflies on the
# values times 2**24, exact integers: every fp16 value is a multiple of 2**-24) or "int8" (the whole decode in one
# Triton kernel, decode_triton.py: the sums as balanced int8 digits on integer tensor cores, exact). The same bits every
# way; int64 and int8 need no float64 matmul (consumer cards, GB10: float64 at 1/64 of the fp32 rate), only elementwise
# float64 (one conversion, two scalings per weight). int8 is the default on CUDA GPUs with int8 tensor cores in Triton
# (compute capability 8.0 and up) where Triton is installed; a pack's `PackSettings.exl3_sums` (the command line's
# FIDELITY_EXL3_SUMS) overrides the default.
HADAMARD_SUMS = ("float64", "int64", "int8")
INT_SHIFT = 24
FAST_FLOAT64 = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}   # P100, V100, A100, H100/H200, B200 (compute capability)


def default_sums(device: torch.device) -> str:
    """float64 on the CPU; on CUDA the fused int8 kernel where Triton runs it, else float64 on GPUs with fast float64
    and int64 elsewhere. A decode's `sums` argument overrides it (for a device the choice does not fit, decode_weight
    says so)."""
    if device.type == "cpu":
        return "float64"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0) and _triton_decode() is not None:
        return "int8"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) in FAST_FLOAT64:
        return "float64"
    return "int64"


_TRITON: list = []


def _triton_decode():
    """fidelity.packs.exl3.decode_triton's kernel, imported on first use; None without Triton."""
    if not _TRITON:
        try:
            from .decode_triton import decode_kernel  # noqa: PLC0415 (Triton, CUDA only)
        except ImportError:
            decode_kernel = None
        _TRITON.append(decode_kernel)
    return _TRITON[0]


# Every codebook value is a multiple of 2^-CODEBOOK_SHIFT (3INST/MCG: fp16 halves of exponent >= -3 summed, so of
# 2^-13; MUL1: h * k_inv + k_bias with k_inv a multiple of 2^-18), checked when the integer table is built.
CODEBOOK_SHIFT = 18


@lru_cache(maxsize=None)
def _int_codebook(codebook: str) -> tuple[torch.Tensor, int]:
    """int32 [65536] codebook values times 2^CODEBOOK_SHIFT (exact integers) and their largest magnitude."""
    scaled = _codebook_f64(codebook) * 2.0 ** CODEBOOK_SHIFT
    ints = scaled.round()
    if not torch.equal(ints, scaled) or ints.abs().max() >= 2 ** 30:
        raise AssertionError(f"EXL3 {codebook} codebook values are not multiples of 2^-{CODEBOOK_SHIFT}")
    return ints.to(torch.int32), int(ints.abs().max())


@lru_cache(maxsize=None)
def _triton_tables(codebook: str, rate: Bitrate, device: str) -> tuple:
    table, biggest = _int_codebook(codebook)
    hi, lo, shift = _window_plan(rate, row_major=True)
    return (table.to(device), hi.to(device=device, dtype=torch.int32), lo.to(device=device, dtype=torch.int32),
            shift.to(device), hadamard_pm1(device, torch.int8),
            torch.tensor([2.0 ** -CODEBOOK_SHIFT], dtype=torch.float64, device=device),
            _digits(biggest), _digits(HAD * biggest))


def _digits(bound: int) -> int:
    """Balanced base-256 digits that hold integers of magnitude <= bound (the last digit within int8)."""
    d = 1
    while bound > 127 * 256 ** (d - 1):
        d += 1
    return d


def _decode_weights_triton(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str, rate: Bitrate,
                           out: int, inp: int) -> torch.Tensor:
    """trellis [E, kt, nt, words], suh [E, k_p], svh [E, n_p] -> float32 [E, out, inp], one kernel launch."""
    kernel = _triton_decode()
    if kernel is None:
        raise RuntimeError("EXL3 Hadamard sums 'int8' run in a Triton kernel, but triton is not installed")
    if trellis.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"EXL3 Hadamard sums 'int8' run on a CUDA device (or in Triton's interpreter, "
                         f"TRITON_INTERPRET=1), not on {trellis.device}")
    E, kt, nt, words = trellis.shape
    table, hi, lo, shift, h, inv_scale, left, right = _triton_tables(codebook, rate, str(trellis.device))
    w_t = torch.empty(E, out, inp, dtype=torch.float32, device=trellis.device)
    trellis, svh, suh = trellis.contiguous(), svh.contiguous(), suh.contiguous()
    kernel[(nt * TILE // HAD, kt * TILE // HAD, E)](
        trellis, table, hi, lo, shift, h, svh, suh, w_t, nt, out, inp, inv_scale,
        kt * nt * words, nt * TILE, kt * TILE, out * inp,
        WORDS=words, LEFT_DIGITS=left, RIGHT_DIGITS=right, num_warps=TRITON_WARPS)
    return w_t


TRITON_WARPS = 8


def _butterflies(x: torch.Tensor) -> torch.Tensor:
    """x [A, 128, B] -> H x along dim 1 (Sylvester order, entries +-1), in log2(128) add/subtract stages."""
    A, _, B = x.shape
    h = 1
    while h < HAD:
        y = x.view(A, HAD // (2 * h), 2, h, B)
        lo, hi = y[:, :, 0], y[:, :, 1]
        x = torch.stack((lo + hi, lo - hi), dim=2).view(A, HAD, B)
        h *= 2
    return x


def _hadamard_int64(x: torch.Tensor) -> torch.Tensor:
    """H x H per 128x128 block of an int64 [k, n] (exact integer sums)."""
    k, n = x.shape
    x = _butterflies(x.view(k // HAD, HAD, n))                          # left: rows within each 128-block
    return _butterflies(x.view(k * (n // HAD), HAD, 1)).view(k, n)      # right: columns within each 128-block


def unpack_sign_bits(bitfield: torch.Tensor) -> torch.Tensor:
    """Legacy `su`/`sv`: int16 [m] -> +-1 float16 [16*m]; bit i of word j is the sign of entry 16*j + i (set = -1)."""
    bits = bitfield.to(torch.int64) & 0xFFFF
    b = (bits[:, None] >> torch.arange(16, device=bits.device)[None, :]) & 1
    return (1 - 2 * b).flatten().to(torch.float16)


def decode_weight(
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str = "3inst",
    *,
    shape: tuple[int, int] | None = None,
    file=None,
    tensor=None,
    sums: str | None = None,
) -> torch.Tensor:
    """The torch weight [out, in] float32 of an EXL3 linear, on the trellis' device; `shape` = logical (out, in) cuts
    the padding off. `sums`: "float64", "int64" or "int8" Hadamard sums (bit-identical results; default
    `default_sums`)."""
    rate, (out, inp), sums = _checked_decode(trellis, suh, svh, codebook, shape, file, tensor, sums)
    if sums == "int8":
        return _decode_weights_triton(trellis[None], suh[None], svh[None], codebook, rate, out, inp)[0]
    kt, nt = trellis.shape[:2]
    k_p, n_p = kt * TILE, nt * TILE
    tiles = _decode_tiles(trellis, codebook, file, tensor)
    if sums == "int64":
        tiles = tiles * 2.0 ** INT_SHIFT                                # exact in float32: fp16 values < 2**16
    inner_t = torch.empty(n_p, k_p, dtype=torch.float64 if sums == "float64" else torch.int64, device=tiles.device)
    inner_t.view(nt, TILE, kt, TILE).copy_(tiles.permute(1, 3, 0, 2))   # Q^T, so the result comes out as W^T
    w_t = _rotate_back_f64(inner_t, svh, suh)
    return w_t if (out, inp) == (n_p, k_p) else w_t[:out, :inp].contiguous()


def decode_weights(
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str = "3inst",
    *,
    shape: tuple[int, int] | None = None,
    files=None,
    tensors=None,
    sums: str | None = None,
) -> torch.Tensor:
    """E linears of one codebook, rate and shape at once: trellis [E, kt, nt, words], suh [E, k_p], svh [E, n_p] ->
    float32 [E, out, in], each matrix bit for bit `decode_weight`'s (sums "int8": one kernel launch for all; the
    others decode one by one). `files` / `tensors`: per matrix, for errors."""
    if trellis.dim() != 4 or suh.dim() != 2 or svh.dim() != 2 or not trellis.shape[0] == suh.shape[0] == svh.shape[0]:
        raise ValueError(f"decode_weights takes trellis [E, kt, nt, words], suh [E, k], svh [E, n]; got "
                         f"{list(trellis.shape)}, {list(suh.shape)}, {list(svh.shape)}")
    E = trellis.shape[0]
    files, tensors = files or [None] * E, tensors or [None] * E
    rate, (out, inp), sums = _checked_decode(trellis[0], suh[0], svh[0], codebook, shape, files[0], tensors[0], sums)
    if sums == "int8":
        return _decode_weights_triton(trellis, suh, svh, codebook, rate, out, inp)
    w = torch.empty(E, out, inp, dtype=torch.float32, device=trellis.device)
    for m in range(E):
        w[m] = decode_weight(trellis[m], suh[m], svh[m], codebook, shape=(out, inp), file=files[m], tensor=tensors[m],
                             sums=sums)
    return w


def _checked_decode(trellis, suh, svh, codebook, shape, file, tensor, sums) -> tuple[Bitrate, tuple[int, int], str]:
    """The rate, logical (out, in) and Hadamard sums of one decode, after checking the operands' shapes."""
    rate = _checked_rate(trellis, codebook, file, tensor)
    kt, nt = trellis.shape[:2]
    k_p, n_p = kt * TILE, nt * TILE
    if suh.dim() != 1 or suh.shape[0] != k_p:
        raise PackError(f"EXL3 suh has shape {list(suh.shape)}; the trellis {list(trellis.shape)} needs [{k_p}]",
                        file=file, tensor=tensor)
    if svh.dim() != 1 or svh.shape[0] != n_p:
        raise PackError(f"EXL3 svh has shape {list(svh.shape)}; the trellis {list(trellis.shape)} needs [{n_p}]",
                        file=file, tensor=tensor)
    if k_p % HAD or n_p % HAD:
        raise PackError(f"EXL3 trellis {list(trellis.shape)} decodes to [{k_p}, {n_p}], not a multiple of {HAD}",
                        file=file, tensor=tensor)
    out, inp = shape if shape is not None else (n_p, k_p)
    if out > n_p or inp > k_p:
        raise PackError(
            f"logical shape [{out}, {inp}] exceeds the padded EXL3 weight [{n_p}, {k_p}]", file=file, tensor=tensor
        )
    sums = sums or default_sums(trellis.device)
    if sums not in HADAMARD_SUMS:
        raise ValueError(f"Hadamard sums {sums!r}: expected one of {HADAMARD_SUMS}")
    return rate, (out, inp), sums
