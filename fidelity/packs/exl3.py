"""EXL3 (exllamav3 trellis) tensors: an exact pure-PyTorch decoder, the claimer for standard exllamav3 checkpoints, and a
reference encoder for fixtures and error simulation.

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
  weight is W^T [out, in] with the padding cut off. We rebuild W exactly in float64 (every Hadamard sum of fp16 values is
  exact in float64) and round once to float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..errors import PackError
from .folder import CLAIMERS, KNOWN_QUANT_METHODS, register_claimer

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
        raise PackError(f"EXL3 trellis must have 3 dims [k/16, n/16, 16*K], got shape {list(shape)}", file=file, tensor=tensor)
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
def _tensor_core_perm_inv() -> torch.Tensor:
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
        inv = _tensor_core_perm_inv()
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
def _decode_tiles(trellis: torch.Tensor, codebook: str, file, tensor) -> torch.Tensor:
    """float32 [k/16, n/16, 16, 16]: every tile's values in row-major order (rows = input dim)."""
    if codebook not in CODEBOOKS:
        raise PackError(f"unknown EXL3 codebook {codebook!r}", file=file, tensor=tensor)
    rate = bitrate_from_trellis(tuple(trellis.shape), codebook, file=file, tensor=tensor)
    if trellis.dtype not in (torch.int16, torch.uint16):
        raise PackError(f"EXL3 trellis must be int16, got {trellis.dtype}", file=file, tensor=tensor)
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
def _hadamard_pm1(device: str, dtype: torch.dtype) -> torch.Tensor:
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
        H = _hadamard_pm1(str(x.device), torch.float64)
        x = torch.matmul(H, x.view(k // HAD, HAD, n))                   # left: rows within each 128-block
        x = torch.matmul(x.view(k, n // HAD, HAD), H).view(k, n)        # right: columns within each 128-block
    x.mul_((suh.to(torch.float64) / HAD)[:, None])                      # 1/sqrt(128) per side
    x.mul_(svh.to(torch.float64)[None, :])
    return x.to(torch.float32)


# Hadamard sums: "float64" (matmuls; every sum of these fp16 values is exact in float64) or "int64" (butterflies on the
# values times 2**24, exact integers: every fp16 value is a multiple of 2**-24). The same bits either way; int64 is for
# GPUs whose float64 matmuls are slow (consumer cards, GB10: 1/64 of the fp32 rate), which then run only elementwise
# float64 (one conversion, two scalings per weight).
HADAMARD_SUMS = ("float64", "int64")
INT_SHIFT = 24
FAST_FLOAT64 = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}   # P100, V100, A100, H100/H200, B200 (compute capability)


def default_sums(device: torch.device) -> str:
    """float64 on the CPU and on GPUs with fast float64, int64 elsewhere."""
    if device.type == "cpu":
        return "float64"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) in FAST_FLOAT64:
        return "float64"
    return "int64"


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


def decode_weight(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str = "3inst", *,
                  shape: tuple[int, int] | None = None, file=None, tensor=None, sums: str | None = None) -> torch.Tensor:
    """The torch weight [out, in] float32 of an EXL3 linear, on the trellis' device; `shape` = logical (out, in) cuts
    the padding off. `sums`: "float64" or "int64" Hadamard sums (bit-identical results; default `default_sums`)."""
    tiles = _decode_tiles(trellis, codebook, file, tensor)
    kt, nt = tiles.shape[:2]
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
        raise PackError(f"logical shape [{out}, {inp}] exceeds the padded EXL3 weight [{n_p}, {k_p}]", file=file, tensor=tensor)
    sums = sums or default_sums(tiles.device)
    if sums not in HADAMARD_SUMS:
        raise ValueError(f"Hadamard sums {sums!r}: expected one of {HADAMARD_SUMS}")
    if sums == "int64":
        tiles = tiles * 2.0 ** INT_SHIFT                                # exact in float32: fp16 values < 2**16
    inner_t = torch.empty(n_p, k_p, dtype=torch.float64 if sums == "float64" else torch.int64, device=tiles.device)
    inner_t.view(nt, TILE, kt, TILE).copy_(tiles.permute(1, 3, 0, 2))   # Q^T, so the result comes out as W^T
    w_t = _rotate_back_f64(inner_t, svh, suh)
    return w_t if (out, inp) == (n_p, k_p) else w_t[:out, :inp].contiguous()


# ---------------------------------------------------------------------------------------------------------------------
# reference encoder
# ---------------------------------------------------------------------------------------------------------------------
CODEBOOK_SCALE = 1.24371088     # std of the 3INST codebook: regularised rows are brought to this RMS (as exllamav3)
_VITERBI_BUDGET = {"cpu": 1 << 28, "cuda": 1 << 34}   # bytes of per-step minima kept for the traceback, per batch


def _viterbi_forward(x: torch.Tensor, rate: Bitrate, table: torch.Tensor, order: list[int],
                     start_edge: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Min-cost state sequences over the ring positions `order`. cost_t[s] = (cb[s] - x_t)^2 + m_{t-1}[s >> k_t], where
    m_{t-1}[e] is the least cost of a state at the previous position whose low 16-k_t bits are e. Returns the final
    costs [T, 65536] and every m_{t-1} (for the traceback, which recomputes the argmins)."""
    T = x.shape[0]
    steps = rate.steps().tolist()
    cb = table.expand(T, -1)
    cb2 = (table * table).expand(T, -1)
    minima = []
    cost = None
    for t in order:
        k = steps[t]
        xt = x[:, t : t + 1]
        err = torch.addcmul(cb2, cb, xt, value=-2.0).add_(xt * xt)
        if cost is None:
            if start_edge is not None:      # tail-biting: the first state must continue the ring's last one
                allowed = (torch.arange(65536, device=x.device)[None, :] >> k) == start_edge[:, None]
                err = err.masked_fill(~allowed, float("inf"))
            cost = err
            continue
        m = cost.view(T, 1 << k, 1 << (16 - k)).amin(dim=1)
        minima.append(m)
        cost = err.view(T, 1 << (16 - k), 1 << k).add_(m[:, :, None]).view(T, 65536)
    return cost, minima


def _viterbi_traceback(x: torch.Tensor, rate: Bitrate, table: torch.Tensor, order: list[int], minima: list[torch.Tensor],
                       last_state: torch.Tensor, stop_at: int = 0, start_edge: torch.Tensor | None = None) -> torch.Tensor:
    """States [T, len(order)] along `order`, walking back from `last_state` (down to index `stop_at`)."""
    steps = rate.steps().tolist()
    T = x.shape[0]
    states = torch.zeros(T, len(order), dtype=torch.int64, device=x.device)
    states[:, -1] = last_state
    rows = torch.arange(T, device=x.device)
    for i in range(len(order) - 1, stop_at, -1):
        k = steps[order[i]]
        k_prev = steps[order[i - 1]]
        e = states[:, i] >> k                                            # low 16-k bits of the previous state
        cand = (torch.arange(1 << k, device=x.device)[None, :] << (16 - k)) | e[:, None]   # [T, 2^k] predecessors
        xp = x[:, order[i - 1]][:, None]
        cost = (table[cand] - xp) ** 2
        if i - 1 > 0:
            cost = cost + minima[i - 2][rows[:, None], cand >> k_prev]
        elif start_edge is not None:
            cost = cost.masked_fill((cand >> k_prev) != start_edge[:, None], float("inf"))
        states[:, i - 1] = cand[rows, cost.argmin(dim=1)]
    return states


def viterbi_tiles(x: torch.Tensor, rate: Bitrate, codebook: str) -> torch.Tensor:
    """Tail-biting trellis quantization of tiles x [T, 256] (ring order): int64 states [T, 256] whose windows form one
    consistent ring. Two passes like exllamav3's kernel: a pass rotated by half a tile picks the state that wraps around
    position 0, a second pass from position 0 is constrained to start and end on it."""
    table = codebook_values(codebook, x.device)
    L = TILE_LEN
    out = torch.empty(x.shape[0], L, dtype=torch.int64, device=x.device)
    per_tile = 4 * L * (1 << (16 - rate.base))
    budget = _VITERBI_BUDGET.get(x.device.type, _VITERBI_BUDGET["cpu"])
    batch = max(1, min(256 if x.device.type == "cpu" else 8192, budget // per_tile))
    rolled = [(i + L // 2) % L for i in range(L)]
    natural = list(range(L))
    k0 = int(rate.steps()[0])
    for a in range(0, x.shape[0], batch):
        xb = x[a : a + batch].float()
        cost, minima = _viterbi_forward(xb, rate, table, rolled, None)
        walk = _viterbi_traceback(xb, rate, table, rolled, minima, cost.argmin(dim=1), stop_at=L // 2)
        wrap_edge = walk[:, L // 2] >> k0                   # in-edge of position 0 = low bits of position 255
        del cost, minima
        cost, minima = _viterbi_forward(xb, rate, table, natural, wrap_edge)
        ends_ok = (torch.arange(65536, device=x.device)[None, :] & ((1 << (16 - k0)) - 1)) == wrap_edge[:, None]
        last = cost.masked_fill(~ends_ok, float("inf")).argmin(dim=1)
        out[a : a + batch] = _viterbi_traceback(xb, rate, table, natural, minima, last, start_edge=wrap_edge)
    return out


@dataclass
class Encoded:
    """An EXL3 linear as exllamav3 stores it, and its exact decoded torch weight."""

    tensors: dict[str, torch.Tensor]    # trellis, suh, svh (+ the mcg / mul1 marker for those codebooks)
    weight: torch.Tensor                # decode_weight of `tensors`, cut to the input's shape: [out, in] float32
    K: float
    codebook: str
    g_scale: float


def codebook_marker(codebook: str) -> dict[str, torch.Tensor]:
    """The scalar marker stored next to the trellis (uint32 multiplier viewed as int32); none for 3INST."""
    mult = {"mcg": MCG_MULT, "mul1": MUL1_MULT}.get(codebook)
    return {} if mult is None else {codebook: torch.tensor(mult - (1 << 32), dtype=torch.int32)}


def _had(x: torch.Tensor, side: str) -> torch.Tensor:
    """Block Hadamard / sqrt(128) applied to rows ("left": H x) or columns ("right": x H) of a [k, n] matrix."""
    H = _hadamard_pm1(str(x.device), x.dtype) / math.sqrt(HAD)
    k, n = x.shape
    if side == "left":
        return torch.matmul(H, x.reshape(k // HAD, HAD, n)).reshape(k, n)
    return torch.matmul(x.reshape(k, n // HAD, HAD), H).reshape(k, n)


def _tiles_to_ring(w: torch.Tensor) -> torch.Tensor:
    """[k, n] -> [k/16 * n/16, 256] tiles in ring order."""
    k, n = w.shape
    tiles = w.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3).reshape(-1, TILE_LEN)
    return tiles[:, tensor_core_perm().to(w.device)]


def _ring_to_tiles(ring: torch.Tensor, k: int, n: int) -> torch.Tensor:
    tiles = ring[:, _tensor_core_perm_inv().to(ring.device)]
    return tiles.reshape(k // TILE, n // TILE, TILE, TILE).permute(0, 2, 1, 3).reshape(k, n)


def _quantize(w: torch.Tensor, rate: Bitrate, codebook: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of tiles of w [16*m, n]: (states [m, n/16, 256] ring order, quantized values [16*m, n])."""
    k, n = w.shape
    states = viterbi_tiles(_tiles_to_ring(w), rate, codebook)
    q = codebook_values(codebook, w.device)[states]
    return states.reshape(k // TILE, n // TILE, TILE_LEN), _ring_to_tiles(q, k, n)


def _search_g_scale(w: torch.Tensor, rate: Bitrate, codebook: str, n_sample: int = 8) -> float:
    """Global scale minimising the tile quantization MSE on a spread-out sample of tiles (coarse grid, then finer)."""
    ring = _tiles_to_ring(w)
    spread = torch.linspace(0, ring.shape[0] - 1, min(n_sample, ring.shape[0])).round().long().to(w.device)
    peaks = ring.abs().amax(dim=1).topk(min(n_sample // 2, ring.shape[0])).indices      # outliers clip first
    idx = torch.cat([spread, peaks]).unique()
    sample = ring[idx]

    def best_of(scales: list[float]) -> float:
        batch = torch.cat([sample * s for s in scales])
        q = codebook_values(codebook, w.device)[viterbi_tiles(batch, rate, codebook)]
        mse = [((q[i * len(idx):(i + 1) * len(idx)] / s - sample) ** 2).mean().item() for i, s in enumerate(scales)]
        return scales[min(range(len(scales)), key=mse.__getitem__)]

    g = best_of([0.5 + 0.1 * i for i in range(9)])
    return best_of([g - 0.05, g, g + 0.05])


def _block_ldl(H: torch.Tensor, block: int = TILE) -> torch.Tensor:
    """Unit block-lower-triangular L with H = L D L^T (D block diagonal), from the Cholesky factor."""
    C = torch.linalg.cholesky(H)
    L = torch.empty_like(C)
    for b in range(0, H.shape[0], block):
        diag = C[b : b + block, b : b + block]
        L[:, b : b + block] = torch.linalg.solve_triangular(diag, C[:, b : b + block], upper=False, left=False)
    return L


def _ldlq(w: torch.Tensor, L: torch.Tensor, rate: Bitrate, codebook: str) -> tuple[torch.Tensor, torch.Tensor]:
    """LDLQ: quantize rows of tiles from the bottom up, each target corrected by the error already made below it."""
    k, n = w.shape
    q = torch.zeros_like(w)
    states = torch.zeros(k // TILE, n // TILE, TILE_LEN, dtype=torch.int64, device=w.device)
    for b in range(k - TILE, -1, -TILE):
        target = w[b : b + TILE] + L[b + TILE :, b : b + TILE].t() @ (w[b + TILE :] - q[b + TILE :])
        s, qb = _quantize(target, rate, codebook)
        states[b // TILE], q[b : b + TILE] = s[0], qb
    return states, q


def _refit_scales(w: torch.Tensor, q: torch.Tensor, H: torch.Tensor | None, rounds: int = 2):
    """Per-column then per-row scales c, r minimising the (H-weighted) error of diag(r) q diag(c) against w."""
    k, n = w.shape
    r, c = torch.ones(k, 1, dtype=w.dtype, device=w.device), torch.ones(1, n, dtype=w.dtype, device=w.device)
    Hm = H if H is not None else None
    for _ in range(rounds):
        qq = q * r * c
        Hq, Hw = (Hm @ qq, Hm @ w) if Hm is not None else (qq, w)
        num, den = (qq * Hw).sum(0), (qq * Hq).sum(0)
        c = c * torch.where(den > 1e-30, num / den.clamp(min=1e-30), torch.ones_like(num))[None, :]
        qq = q * r * c
        if Hm is None:
            num, den = (qq * w).sum(1), (qq * qq).sum(1)
            step = torch.where(den > 1e-30, num / den.clamp(min=1e-30), torch.ones_like(num))
        else:
            A = (qq @ qq.t()) * Hm
            A.diagonal().add_(1e-6 * A.diagonal().mean())
            step = torch.linalg.solve(A, (qq * (Hm @ w)).sum(1))
            step = torch.where(torch.isfinite(step) & (step > 0), step, torch.ones_like(step))
        r = r * step[:, None]
    return r.flatten(), c.flatten()


def encode(weight: torch.Tensor, K: float, codebook: str = "mul1", hessian: torch.Tensor | None = None, *,
           seed: int = 0, sigma_reg: float = 0.025) -> Encoded:
    """Quantize a torch weight [out, in] to EXL3 the way exllamav3 does: random signs and channel scales, 128-block
    Hadamard rotations on both sides, a global scale searched on sample tiles, tail-biting Viterbi per 16x16 tile
    (with LDLQ error feedback when an input Hessian [in, in] is given), then the per-channel fp16 scales refit to the
    quantized weight. Pure torch: runs on the weight's device (CUDA makes it fast)."""
    rate = Bitrate.of(K)
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}")
    if rate.half and codebook != "mul1":
        raise ValueError(f"half-integer K={K} needs the mul1 codebook")
    out_f, in_f = weight.shape
    k_p, n_p = -(-in_f // HAD) * HAD, -(-out_f // HAD) * HAD
    dev = weight.device
    w0 = torch.zeros(k_p, n_p, dtype=torch.float32, device=dev)
    w0[:in_f, :out_f] = weight.t().float()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    su_sign = (torch.randint(0, 2, (k_p,), generator=gen) * 2 - 1).float().to(dev)
    sv_sign = (torch.randint(0, 2, (n_p,), generator=gen) * 2 - 1).float().to(dev)

    col_rms = w0.square().mean(0).sqrt()
    zero_cols = col_rms < 1e-30
    col_scale = col_rms / col_rms.mean().clamp(min=1e-30)
    sv = sv_sign * torch.where(zero_cols, torch.full_like(col_scale, 0.1), col_scale)
    w = _had(w0 / sv, "right")
    row_rms = w.square().mean(1).sqrt()
    su = su_sign * torch.where(row_rms < 1e-30, torch.full_like(row_rms, 0.1), row_rms) / CODEBOOK_SCALE
    w = _had(w / su[:, None], "left")
    g = _search_g_scale(w, rate, codebook)
    w, su = w * g, su / g

    H = None
    if hessian is None:
        states, q = _quantize(w, rate, codebook)
    else:
        H = torch.zeros(k_p, k_p, dtype=torch.float32, device=dev)
        H[:in_f, :in_f] = hessian.float().to(dev)
        H.diagonal().add_(sigma_reg * H.diagonal().mean())
        Hr = _had(_had(H * su[:, None] * su[None, :], "left"), "right")     # the Hessian of the rotated weight
        states, q = _ldlq(w, _block_ldl(Hr), rate, codebook)
    sv = torch.where(zero_cols, torch.zeros_like(sv), sv)
    w_hat = _had(_had(q, "left") * su[:, None], "right") * sv[None, :]        # original basis [k, n]
    r, c = _refit_scales(w0, w_hat, H)
    tensors = {"trellis": pack_states(states, rate).contiguous(), "suh": (su * r).half(), "svh": (sv * c).half(),
               **codebook_marker(codebook)}
    decoded = decode_weight(tensors["trellis"], tensors["suh"], tensors["svh"], codebook, shape=(out_f, in_f))
    return Encoded(tensors, decoded, rate.K, codebook, g)


# ---------------------------------------------------------------------------------------------------------------------
# the claimer (layouts in exl3_layouts.py)
# ---------------------------------------------------------------------------------------------------------------------
KNOWN_QUANT_METHODS.update({"exl3", "deepseek_v41_exl3"})


def claim(pack, pool: set):
    """EXL3 linears of any of the five layouts; for official-named layouts also every other tensor, renamed to HF."""
    from .exl3_layouts import claim as claim_layouts

    return claim_layouts(pack, pool)


# first: official-named EXL3 packs hold FP8 tensors that this claimer renames, so the fp8 claimer must not take them
register_claimer("exl3", claim, before=CLAIMERS[0][0] if CLAIMERS else None)
