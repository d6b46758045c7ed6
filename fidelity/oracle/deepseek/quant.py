"""DeepSeek's reference rounding: what DeepSeek's own `inference/model.py` rounds, for the oracle's
`numerics="deepseek"`.

The oracle's default numerics, "exact", is pure fp32 (or fp64), which is what transformers computes. DeepSeek's
reference code (the one every seed card measures against) also rounds some activations to FP8/FP4 and back, where its
trained model expects them rounded (quantisation-aware training). Under "deepseek" the oracle does what model.py does,
no more and no less (quantise then dequantise, in the oracle's dtype):

| where | V4 (V4-Flash) | V4.1 |
| --- | --- | --- |
| window KV | FP8 e4m3, its non-rotary dims, blocks of 64 | FP8 e4m3, the whole post-RoPE vector, blocks of 32 |
| compressed KV | as the window KV (non-rotary dims, 64) | FP4 e2m1, whole post-RoPE latent, blocks of 16, e4m3 scales |
| indexer queries and keys | Hadamard rotation, then FP4 e2m1, blocks of 32 | FP4 e2m1, blocks of 32 (no rotation) |
| a linear's input | FP8 e4m3 in blocks of 128 where the linear's stored weight is FP8 or FP4 | the same, blocks of 32 |

FP8 scales and the indexer's FP4 scales are powers of two (ue8m0: 2^ceil(log2(amax * (1 / max))), amax floored at
1e-4 for FP8 and 6 * 2^-126 for FP4); the compressed KV's FP4 scales are amax / 6 rounded to e4m3 (amax floored at
6 * 2^-9). Values round to the nearest grid point, ties to the even code (the kernels' `fp4_act_quant` / `act_quant`,
checked against DeepSeek's own dump: tests/test_deepseek_v41_upstream.py).

A linear's input is rounded only where the weight the pack stores is FP8 or FP4 (`ROUNDED_WEIGHT_FORMATS`), decided
per tensor from the pack's storage, as model.py's `linear()` decides by the weight's dtype: an EXL3, GGUF or bf16
weight's input is not rounded, a native FP8/MXFP4 one's is. Never rounded (model.py computes them in fp32 or through
einsum): the router, the head, the hyper-connections, `wo_a`. In the experts the routing weight multiplies the
SwiGLU output before `w2` (model.py's `Expert.forward`), so before its input is rounded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import ConfigError

FP8_MAX, FP4_MAX = 448.0, 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_POW2_AMAX_FLOOR = 6 * 2.0 ** -126
FP4_E4M3_AMAX_FLOOR = 6 * 2.0 ** -9
POW2_BITS = {torch.float32: (23, 127, torch.int32), torch.float64: (52, 1023, torch.int64)}  # mantissa bits, bias
ROUNDED_WEIGHT_FORMATS = frozenset({"fp8_e4m3", "fp8_e5m2", "mxfp4", "nvfp4"})


# ---------------------------------------------------------------------------------------------------------------------
# rounding primitives
# ---------------------------------------------------------------------------------------------------------------------
def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Nearest float8 e4m3fn value (ties to even); |x| must be <= 448."""
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest fp4 e2m1 value (ties to the even code); |x| must be <= 6. The grid's spacing is 0.5 below 2, 1 below 4
    and 2 up to 6, and each even code sits on an even multiple of its spacing, so rounding |x| / spacing half to even
    is the nearest grid point with ties to the even code (exact: the spacings are powers of two)."""
    mag = x.abs()
    spacing = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0)).to(x.dtype)
    return (torch.round(mag / spacing) * spacing).copysign(x)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The least power of two >= s (s > 0), from s's exponent bits (frexp: s = m * 2^e, 0.5 <= m < 1), exact on every
    device; log2 rounds to the integer just below for s slightly above a power of two."""
    mantissa, exponent = torch.frexp(s)
    k = exponent.long() - (mantissa == 0.5).long()           # 2^(k-1) < s <= 2^k
    bits, bias, int_dtype = POW2_BITS[s.dtype]
    return ((k + bias) << bits).to(int_dtype).view(s.dtype)  # 2^k built from its exponent field (normal range)


def _blocked(x: torch.Tensor, block: int, rounding: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Applies `rounding` to blocks of `block` along the last dim; a last dim that is not a multiple of the block ends
    in a shorter block (zero padding, which changes no block's maximum)."""
    if block <= 0:
        raise ConfigError(f"rounding block size must be positive, got {block}")
    n = x.shape[-1]
    pad = -n % block
    padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
    out = rounding(padded.unflatten(-1, (-1, block))).flatten(-2)
    return out[..., :n] if pad else out


def fake_fp8(x: torch.Tensor, block: int, pow2_scales: bool = True) -> torch.Tensor:
    """Block-wise FP8 e4m3 quantise-dequantise along the last dim (model.py's `act_quant(..., inplace=True)`): scale
    amax * (1 / 448), amax floored at 1e-4, rounded up to a power of two when `pow2_scales` (ue8m0)."""
    def rounding(blocks):
        scale = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR) * (1.0 / FP8_MAX)
        if pow2_scales:
            scale = pow2_ceil(scale)
        return round_e4m3((blocks / scale).clamp(-FP8_MAX, FP8_MAX)) * scale
    return _blocked(x, block, rounding)


def fake_fp4_pow2_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """Block-wise FP4 e2m1 quantise-dequantise with power-of-two (e8m0) scales: the indexer's `fp4_act_quant`."""
    def rounding(blocks):
        amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_POW2_AMAX_FLOOR)
        scale = pow2_ceil(amax * (1.0 / FP4_MAX))
        return round_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX)) * scale
    return _blocked(x, block, rounding)


def fake_fp4_e4m3_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """Block-wise FP4 e2m1 quantise-dequantise with e4m3-rounded scales: the compressed KV's `fp4_act_quant`."""
    def rounding(blocks):
        scale = round_e4m3(blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_E4M3_AMAX_FLOOR) / FP4_MAX)
        return round_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX)) * scale
    return _blocked(x, block, rounding)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x H / sqrt(d) along the last dim (d a power of two; H the Sylvester Hadamard matrix): model.py's
    `rotate_activation`, as a butterfly (exact adds and subtracts, one scale at the end)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ConfigError(f"the Hadamard rotation needs a power-of-two width, got {d}")
    y, h = x, 1
    while h < d:
        y = y.unflatten(-1, (d // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return y * d ** -0.5


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


# ---------------------------------------------------------------------------------------------------------------------
# what one version of the reference rounds
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeepSeekRounding:
    """The roundings of one version of DeepSeek's inference/model.py (`v4()`, `v41()`), bound to a pack's storage:
    `rounds_input(official weight name)` says whether that linear's input is rounded (its stored weight is FP8/FP4)."""

    version: str
    act_block: int                        # FP8 blocks of a rounded linear input
    window_kv_block: int                  # FP8 blocks of the window KV
    whole_vectors: bool                   # V4.1: window and compressed KV rounded whole, after RoPE
    compressed_fp4_block: int | None      # V4.1: compressed KV to FP4 (e4m3 scales); V4: None (FP8 as the window)
    index_block: int = 32                 # indexer queries and keys: FP4, power-of-two scales
    index_hadamard: bool = False          # V4 rotates them first
    rounds_input: Callable[[str], bool] = lambda name: False

    @classmethod
    def v4(cls, rounds_input: Callable[[str], bool]) -> "DeepSeekRounding":
        return cls("V4", act_block=128, window_kv_block=64, whole_vectors=False, compressed_fp4_block=None,
                   index_hadamard=True, rounds_input=rounds_input)

    @classmethod
    def v41(cls, rounds_input: Callable[[str], bool]) -> "DeepSeekRounding":
        return cls("V4.1", act_block=32, window_kv_block=32, whole_vectors=True, compressed_fp4_block=16,
                   index_hadamard=False, rounds_input=rounds_input)

    @property
    def label(self) -> str:
        kv = "whole post-RoPE vector" if self.whole_vectors else "non-rotary dims"
        compressed = (f"compressed KV fp4-e2m1/{self.compressed_fp4_block} e4m3 scales" if self.compressed_fp4_block
                      else f"compressed KV fp8-e4m3/{self.window_kv_block}")
        index = ("hadamard + " if self.index_hadamard else "") + f"fp4-e2m1/{self.index_block}"
        return (
            f"deepseek ({self.version} inference/model.py): window KV fp8-e4m3/{self.window_kv_block} ({kv}), "
            f"{compressed}, indexer q/k {index}, linear inputs fp8-e4m3/{self.act_block} where the stored weight is "
            f"FP8/FP4; ue8m0 scales"
        )

    def linear_input(self, official_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The rounding of the input of the linear whose weight is `official_name` (identity where none)."""
        if not self.rounds_input(official_name):
            return identity
        return lambda x: fake_fp8(x, self.act_block)

    def window_kv(self, kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
        """The window KV [..., D] after RoPE, as model.py stores it."""
        if self.whole_vectors:
            return fake_fp8(kv, self.window_kv_block)
        return self._nope_fp8(kv, rope_dim)

    def compressed_kv(self, kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
        """The compressed entries [..., D] after RoPE, as model.py stores them."""
        if self.compressed_fp4_block:
            return fake_fp4_e4m3_scales(kv, self.compressed_fp4_block)
        return self._nope_fp8(kv, rope_dim)

    def index_qk(self, x: torch.Tensor) -> torch.Tensor:
        """The indexer's queries [..., d] or keys [..., d] after RoPE, as model.py scores them."""
        if self.index_hadamard:
            x = hadamard_rotate(x)
        return fake_fp4_pow2_scales(x, self.index_block)

    def _nope_fp8(self, kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
        nope = kv.shape[-1] - rope_dim
        return torch.cat((fake_fp8(kv[..., :nope], self.window_kv_block), kv[..., nope:]), dim=-1)


def rounds_stored_input(pack, stored_name: Callable[[str], str]) -> Callable[[str], bool]:
    """official weight name -> True where the pack stores that weight as FP8 or FP4 (cached per name)."""
    cache: dict[str, bool] = {}
    have: set[str] = set()

    def rounds(official: str) -> bool:
        if official not in cache:
            if not have:
                have.update(pack.names())
            name = stored_name(official)
            cache[official] = name in have and pack.storage(name).format in ROUNDED_WEIGHT_FORMATS
        return cache[official]
    return rounds
