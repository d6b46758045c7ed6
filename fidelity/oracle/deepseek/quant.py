"""Optional emulation of the activation fake-quantisation DeepSeek's V4 reference code performs, for comparing against
numbers that code produced. Off by default: the oracle is pure fp32 (or fp64), which is what transformers computes.

    from fidelity.oracle.deepseek.quant import QuantEmulation, emulate_reference_quant
    label = emulate_reference_quant(oracle, QuantEmulation())   # e.g. "reference fake-quant: act fp8-e4m3/128 ..."

Where it rounds (quantise then dequantise, in the oracle's dtype):
- `activations`: the input of every linear whose weight the release stores in FP8/FP4 (attention wq_a, wq_b, wkv,
  wo_a, wo_b; routed and shared experts' w1/w3 and w2) goes to FP8 e4m3 in blocks of `act_block` along the last dim,
  scale amax / 448 (amax floored at 1e-4), rounded up to a power of two when `pow2_scales` (ue8m0);
- `kv`: the non-rotary dims of the window KV and of the compressed entries, after their norm: `"fp8"` (e4m3, blocks
  of `kv_block`, power-of-two scales) or `"fp4"` (e2m1, blocks of `kv_fp4_block`, e4m3-rounded scales amax / 6 with
  amax floored at 6 * 2^-9), or None.
Not emulated: the lightning indexer's Hadamard rotation + FP4 scoring, bf16 storage of intermediate activations.
These points follow descriptions of the reference (its kernel semantics: round-to-nearest-even onto the e4m3/e2m1
grids, power-of-two scales = 2^ceil(log2(amax / max))); they are not checked against DeepSeek's code here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import ConfigError

FP8_MAX, FP4_MAX = 448.0, 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_E4M3_AMAX_FLOOR = 6 * 2.0 ** -9
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
POW2_BITS = {torch.float32: (23, 127, torch.int32), torch.float64: (52, 1023, torch.int64)}  # mantissa bits, bias


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Nearest float8 e4m3fn value (ties to even); |x| must be <= 448."""
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest fp4 e2m1 value (ties to the even code); |x| must be <= 6."""
    grid = torch.tensor(E2M1_GRID, dtype=x.dtype, device=x.device)
    mag = x.abs()
    upper = torch.bucketize(mag, grid).clamp(1, len(E2M1_GRID) - 1)   # grid[upper - 1] <= mag <= grid[upper]
    lo, hi = grid[upper - 1], grid[upper]
    below, above = mag - lo, hi - mag
    take_hi = (above < below) | ((above == below) & (upper % 2 == 0))
    return torch.where(take_hi, hi, lo).copysign(x)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The least power of two >= s (s > 0), from s's exponent bits (frexp: s = m * 2^e, 0.5 <= m < 1), exact on every
    device; log2 rounds to the integer just below for s slightly above a power of two."""
    mantissa, exponent = torch.frexp(s)
    k = exponent.long() - (mantissa == 0.5).long()           # 2^(k-1) < s <= 2^k
    bits, bias, int_dtype = POW2_BITS[s.dtype]
    return ((k + bias) << bits).to(int_dtype).view(s.dtype)  # 2^k built from its exponent field (normal range)


def fake_fp8(x: torch.Tensor, block: int, pow2_scales: bool = True) -> torch.Tensor:
    """Block-wise FP8 quantise-dequantise along the last dim (length a multiple of `block`)."""
    blocks = _blocks(x, block)
    scale = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR) / FP8_MAX
    if pow2_scales:
        scale = pow2_ceil(scale)
    return (round_e4m3((blocks / scale).clamp(-FP8_MAX, FP8_MAX)) * scale).flatten(-2)


def fake_fp4_e4m3_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """Block-wise FP4 (e2m1) quantise-dequantise with e4m3-rounded scales."""
    blocks = _blocks(x, block)
    scale = round_e4m3(blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_E4M3_AMAX_FLOOR) / FP4_MAX)
    return (round_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX)) * scale).flatten(-2)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ConfigError(f"fake quantisation: last dim {x.shape[-1]} is not a multiple of the block size {block}")
    return x.unflatten(-1, (-1, block))


@dataclass
class QuantEmulation:
    activations: bool = True
    act_block: int = 128
    pow2_scales: bool = True
    kv: str | None = "fp8"
    kv_block: int = 64
    kv_fp4_block: int = 16
    compressed_kv: str | None = "same"   # DeepSeek-V4.1 only: the compressed entries' format when it differs from kv
    kv_rope_too: bool = False            # DeepSeek-V4.1 only: round whole vectors after RoPE, rotary dims included

    def __post_init__(self):
        for name, value in (("kv", self.kv), ("compressed_kv", self.compressed_kv)):
            if value not in (None, "fp8", "fp4") and not (name == "compressed_kv" and value == "same"):
                raise ConfigError(f"{name} fake quantisation {value!r} is not one of None, 'fp8', 'fp4'")

    @classmethod
    def deepseek_v41(cls) -> "QuantEmulation":
        """What DeepSeek-V4.1's reference (inference/model.py) rounds: fp8_block_size 32 with ue8m0 scales for
        activations and the window KV (whole post-RoPE vector), compressed KV as fp4 e2m1 in groups of 16 with e4m3
        scales (whole post-RoPE latent)."""
        return cls(act_block=32, kv="fp8", kv_block=32, compressed_kv="fp4", kv_fp4_block=16, kv_rope_too=True)

    @property
    def label(self) -> str:
        scales = "ue8m0" if self.pow2_scales else "fp32"
        act = f"act fp8-e4m3/{self.act_block} {scales} scales" if self.activations else "act fp32"

        def kv_text(fmt, what):
            return {None: f"{what} fp32", "fp8": f"{what} fp8-e4m3/{self.kv_block} {scales} scales",
                    "fp4": f"{what} fp4-e2m1/{self.kv_fp4_block} e4m3 scales"}[fmt]

        kv = kv_text(self.kv, "kv")
        if self.compressed_kv != "same":
            kv = f"{kv_text(self.kv, 'window kv')}, {kv_text(self.compressed_kv, 'compressed kv')}"
        if self.kv_rope_too:
            kv += " (rotary dims too)"
        return f"reference fake-quant: {act}, {kv} (indexer unquantised)"

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return fake_fp8(x, self.act_block, self.pow2_scales) if self.activations else x

    def round_kv(self, kv: torch.Tensor, rope_dim: int, compressed: bool = False) -> torch.Tensor:
        """kv [..., D] after RoPE, as the window (or, with compressed, the compressed entries) is stored: the
        non-rotary dims, or with kv_rope_too the whole vector."""
        fmt = self.compressed_kv if compressed and self.compressed_kv != "same" else self.kv
        if fmt is None:
            return kv
        rounded = (lambda v: fake_fp8(v, self.kv_block, self.pow2_scales)) if fmt == "fp8" else \
            (lambda v: fake_fp4_e4m3_scales(v, self.kv_fp4_block))
        if self.kv_rope_too:
            return rounded(kv)
        nope = kv.shape[-1] - rope_dim
        return torch.cat((rounded(kv[..., :nope]), kv[..., nope:]), dim=-1)

    def kv_nope(self, kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
        """Rounds the leading (non-rotary) dims of kv [..., D]."""
        if self.kv is None:
            return kv
        nope = kv[..., :kv.shape[-1] - rope_dim]
        nope = fake_fp8(nope, self.kv_block, self.pow2_scales) if self.kv == "fp8" else \
            fake_fp4_e4m3_scales(nope, self.kv_fp4_block)
        return torch.cat((nope, kv[..., kv.shape[-1] - rope_dim:]), dim=-1)


def emulate_reference_quant(oracle, emulation: QuantEmulation | None) -> str:
    """Switches a DeepSeek-V4 oracle to (or, with None, back from) the emulation; returns the label to record with
    its results ("fp32" when off). Cached layers are dropped so the next forward uses the new setting."""
    family = oracle.family
    if not hasattr(family, "emulation"):
        raise ConfigError(f"fake quantisation emulation is not available for {type(family).__name__}")
    family.emulation = emulation
    oracle.release()
    return family.numerics
