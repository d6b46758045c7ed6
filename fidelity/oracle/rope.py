"""Rotary position embeddings: the inverse-frequency schedules HF transformers uses (default, linear, llama3, yarn),
computed with the same float32 arithmetic so cos/sin agree bit for bit, plus half-split and interleaved rotation."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class RopeArgs:
    dim: int                      # rotated dims per head
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0     # llama3
    high_freq_factor: float = 4.0    # llama3
    beta_fast: float = 32.0          # yarn
    beta_slow: float = 1.0           # yarn
    mscale: float | None = None      # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn: scales cos/sin
    truncate: bool = True            # yarn

    @classmethod
    def from_config(cls, cfg: dict, dim: int) -> "RopeArgs":
        """Reads `rope_parameters` (transformers >= 5) or legacy `rope_scaling` + `rope_theta`."""
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if params and all(isinstance(v, dict) for v in params.values()):
            raise ConfigError(f"per-layer-type rope parameters are not supported (keys {sorted(params)})")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0
        original = (cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                    or cfg.get("max_position_embeddings"))
        factor = params.get("factor")
        if factor is None:
            factor = (cfg["max_position_embeddings"] / original) if rope_type == "yarn" and original else 1.0
        return cls(
            dim=int(dim * partial),
            theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_type=rope_type,
            factor=float(factor),
            original_max_position_embeddings=original,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(a: RopeArgs, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2], attention_factor that multiplies cos and sin)."""
    exponents = torch.arange(0, a.dim, 2, dtype=torch.int64).to(dtype) / a.dim
    base_inv = 1.0 / (a.theta ** exponents)
    if a.rope_type == "default":
        return base_inv, 1.0
    if a.rope_type == "linear":
        return base_inv / a.factor, 1.0
    if a.rope_type == "llama3":
        return _llama3(a, base_inv), 1.0
    return _yarn(a, dtype)


def _llama3(a: RopeArgs, inv_freq: torch.Tensor) -> torch.Tensor:
    old_context = a.original_max_position_embeddings
    low_freq_wavelen = old_context / a.low_freq_factor
    high_freq_wavelen = old_context / a.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / a.factor, inv_freq)
    smooth = (old_context / wavelen - a.low_freq_factor) / (a.high_freq_factor - a.low_freq_factor)
    smoothed = (1 - smooth) * scaled / a.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(a: RopeArgs, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    attention_factor = a.attention_factor
    if attention_factor is None:
        if a.mscale and a.mscale_all_dim:
            attention_factor = yarn_mscale(a.factor, a.mscale) / yarn_mscale(a.factor, a.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(a.factor)

    def correction_dim(rotations: float) -> float:
        return (a.dim * math.log(a.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(a.theta)
        )

    low, high = correction_dim(a.beta_fast), correction_dim(a.beta_slow)
    if a.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, a.dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = torch.clamp((torch.arange(a.dim // 2, dtype=dtype) - low) / (high - low), 0, 1)
    pos_freqs = a.theta ** (torch.arange(0, a.dim, 2).to(dtype) / a.dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (a.factor * pos_freqs)
    keep_extrapolated = 1 - ramp
    inv_freq = interpolation * (1 - keep_extrapolated) + extrapolation * keep_extrapolated
    return inv_freq, float(attention_factor)


def cos_sin(
    a: RopeArgs, length: int, dtype: torch.dtype = torch.float32, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [length, dim] (the dim/2 frequencies repeated twice, as HF lays them out)."""
    inv_freq, attention_factor = inverse_frequencies(a, dtype)
    positions = torch.arange(length, dtype=dtype)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(device), (emb.sin() * attention_factor).to(device)


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, dim]; cos/sin [T, dim]. Pairs are (i, i + dim/2)."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :half]  # sin's two halves are equal
    out = x * cos
    out[..., :half].sub_(x[..., half:] * sin)  # separate multiply and add (no FMA): HF's rounding, bit for bit
    out[..., half:].add_(x[..., :half] * sin)
    return out


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: pairs are (2i, 2i+1). Output is de-interleaved (evens then odds), as HF does; the layout
    only has to agree between q and k because they meet in a dot product."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
