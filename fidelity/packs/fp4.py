"""FP4 e2m1 weights, two per byte (low nibble = even element): MXFP4 (blocks of 32, e8m0 power-of-two scales) and
NVFP4 (blocks of 16, e4m3 scales, one fp32 global scale).

Stored forms read here (compressed-tensors' `weight_packed` forms are read by `compressed`, through these decoders):
- gpt-oss MXFP4 (`quant_method: mxfp4`): `P_blocks` uint8 [..., G, 16] + `P_scales` uint8/F8_E8M0 [..., G]. Exposed as
  the tensor transformers' dequantizing loader builds, under the name `P`: a 3-D expert tensor is transposed to
  gpt-oss's HF layout, e.g. `model.layers.L.mlp.experts.gate_up_proj` [E, hidden, 2*intermediate] (columns interleave
  gate and up: gate = [..., ::2], up = [..., 1::2], as stored) and `...experts.down_proj` [E, intermediate, hidden];
  a 2-D `P_blocks` stays [out, in].
- DeepSeek official MXFP4 (V4 experts): `X.weight` int8/uint8 [out, in/2] + `X.scale` e8m0 (F8_E8M0/uint8) [out, in/32].
- ModelOpt NVFP4 (`quant_method: modelopt`, `quant_algo: NVFP4`): `X.weight` uint8 [..., out, in/2], `X.weight_scale`
  F8_E4M3 [..., out, in/16], `X.weight_scale_2` fp32 scalar: value = e2m1 * scale * scale_2 (scale_2 multiplies).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..errors import PackError
from .base import LogicalTensor, Storage
from .folder import KNOWN_QUANT_METHODS, SafetensorsPack
from ..registry import CLAIMERS
from .fp8 import absent_entry, ceil_div, read_scales
from .staging import to_device
from . import fp8

KNOWN_QUANT_METHODS.update({"mxfp4", "modelopt"})

# e2m1 code -> value; bit 3 is the sign
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_CODES = torch.arange(256)
E2M1_PAIRS = torch.stack((E2M1_VALUES[_CODES & 0x0F], E2M1_VALUES[_CODES >> 4]), dim=-1)  # byte -> (even, odd) values
MX_BLOCK = 32
NV_BLOCK = 16
# ModelOpt algorithms whose tensors `fp8` and this module read (vLLM's list, less none)
MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "MXFP8", "NVFP4", "W4A16_NVFP4", "MIXED_PRECISION")


@lru_cache(maxsize=None)
def _pairs_on(device: str) -> torch.Tensor:
    return E2M1_PAIRS.to(device)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> fp32 [..., 2n] on packed's device; element 2i is the low nibble of byte i. One table lookup
    per byte, in slices so that the index temporary stays small next to the fp32 result."""
    b = packed.view(torch.uint8)
    out = torch.empty(*b.shape[:-1], 2 * b.shape[-1], device=b.device)
    flat, pairs = b.reshape(-1), out.view(-1, 2)
    table = E2M1_PAIRS if b.device.type == "cpu" else _pairs_on(str(b.device))
    step = 1 << 22
    for i in range(0, flat.numel(), step):
        torch.index_select(table, 0, flat[i:i + step].int(), out=pairs[i:i + step])
    return out


def scale_groups_(q: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """In place: q[..., j] *= s[..., j // group] (the last group may be partial)."""
    whole = q.shape[-1] // group
    if whole:
        q[..., :whole * group].unflatten(-1, (whole, group)).mul_(s[..., :whole, None])
    if q.shape[-1] > whole * group:
        q[..., whole * group:].mul_(s[..., whole:whole + 1])
    return q


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., in/2], fp32 power-of-two scales [..., in/32] -> fp32 [..., in] (products are exact)."""
    return scale_groups_(unpack_e2m1(packed), scales, MX_BLOCK)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *,
                     global_divides: bool) -> torch.Tensor:
    """NVFP4 in each convention's own order of operations, in fp32:
    ModelOpt  q * s * s2   (q * s is exact; one rounding for * s2);
    compressed-tensors  q * (s / g)   (its dequantize divides the block scale by the global scale first)."""
    q = unpack_e2m1(packed)
    g = global_scale.reshape(())
    if global_divides:
        return scale_groups_(q, scales / g, NV_BLOCK)
    return scale_groups_(q, scales, NV_BLOCK).mul_(g)


def check_group_grid(pack: SafetensorsPack, packed_name: str, scale_name: str, group: int) -> tuple[int, ...]:
    """Scales [..., ceil(in/group)] for packed [..., in/2]; returns the logical shape [..., in]."""
    raw = pack.raw
    shape, sshape = raw.info(packed_name).shape, raw.info(scale_name).shape
    logical = (*shape[:-1], 2 * shape[-1])
    want = (*shape[:-1], ceil_div(logical[-1], group))
    if tuple(sshape) != want:
        raise PackError(f"scales of the wrong grid: shape {list(sshape)}, expected {list(want)} for a weight of "
                        f"{list(logical)} in groups of {group}", file=raw.file_path(scale_name), tensor=scale_name)
    return logical


# -- gpt-oss MXFP4 blocks -----------------------------------------------------------------------------------------
def gpt_oss_entry(pack: SafetensorsPack, blocks: str, scales: str) -> LogicalTensor:
    raw = pack.raw
    name = blocks[: -len("_blocks")]
    info, sinfo = raw.info(blocks), raw.info(scales)
    if info.dtype != "U8" or len(info.shape) < 3 or info.shape[-1] != MX_BLOCK // 2:
        raise PackError(f"MXFP4 blocks must be uint8 [..., groups, 16], got {info.dtype} {list(info.shape)}",
                        file=raw.file_path(blocks), tensor=blocks)
    if tuple(sinfo.shape) != tuple(info.shape[:-1]):
        raise PackError(f"scales of the wrong grid: shape {list(sinfo.shape)}, expected {list(info.shape[:-1])} "
                        f"(one per 32-element block of {blocks})", file=raw.file_path(scales), tensor=scales)
    *lead, groups, _ = info.shape
    stored = (*lead, groups * MX_BLOCK)
    transpose = len(stored) == 3  # transformers' convert_moe_packed_tensors: [E, out, in] -> [E, in, out]
    shape = (stored[0], stored[2], stored[1]) if transpose else stored

    def decode(device: torch.device) -> torch.Tensor:
        s = read_scales(pack, scales, device=device)
        w = dequantize_mxfp4(to_device(raw.get(blocks), device).reshape(*lead, groups * MX_BLOCK // 2), s)
        return w.transpose(1, 2) if transpose else w

    storage = Storage(name, "mxfp4", f"E2M1 x {sinfo.dtype} e8m0 per-32", shape, info.nbytes + sinfo.nbytes,
                      block=(1, MX_BLOCK), files=raw.files_of(blocks, scales), raw=(blocks, scales))
    return LogicalTensor(storage, decode, on_device=True)


# -- ModelOpt NVFP4 ---------------------------------------------------------------------------------------------
def modelopt_nvfp4_entry(pack: SafetensorsPack, weight: str, scale: str, scale_2: str) -> LogicalTensor:
    raw = pack.raw
    info, sinfo, ginfo = raw.info(weight), raw.info(scale), raw.info(scale_2)
    if sinfo.dtype != "F8_E4M3":
        raise PackError(
            f"NVFP4 block scales must be F8_E4M3, got {sinfo.dtype}", file=raw.file_path(scale), tensor=scale
        )
    if len(ginfo.shape) > 1 or (ginfo.shape and ginfo.shape[0] != 1):
        raise PackError(f"NVFP4 weight_scale_2 must be a single value, got shape {list(ginfo.shape)}",
                        file=raw.file_path(scale_2), tensor=scale_2)
    shape = check_group_grid(pack, weight, scale, NV_BLOCK)

    def decode(device: torch.device) -> torch.Tensor:
        s, g = read_scales(pack, scale, device=device), read_scales(pack, scale_2, device=device)
        return dequantize_nvfp4(to_device(raw.get(weight), device), s, g, global_divides=False)

    storage = Storage(weight, "nvfp4", "E2M1 x F8_E4M3 per-16 x F32 global", shape,
                      info.nbytes + sinfo.nbytes + ginfo.nbytes, block=(1, NV_BLOCK),
                      files=raw.files_of(weight, scale, scale_2), raw=(weight, scale, scale_2))
    return LogicalTensor(storage, decode, on_device=True)


def _check_modelopt_algo(pack: SafetensorsPack):
    qc = pack.quant_config or {}
    if pack.format != "modelopt":
        return
    algo = str(qc.get("quant_algo") or "").upper()
    if algo and algo not in MODELOPT_ALGOS:
        raise PackError(f"ModelOpt quant_algo {algo!r} is not supported (supported: {', '.join(MODELOPT_ALGOS)})",
                        file=pack.root / "config.json")


def mxfp4_entry(pack: SafetensorsPack, name: str, scale: str, logical: str | None = None) -> LogicalTensor:
    """DeepSeek official MXFP4: int8/uint8 [out, in/2] (low nibble = even element) and e8m0 scales [out, in/32]."""
    raw = pack.raw
    shape = check_group_grid(pack, name, scale, MX_BLOCK)
    nbytes = raw.info(name).nbytes + raw.info(scale).nbytes

    def decode(device: torch.device) -> torch.Tensor:
        return dequantize_mxfp4(to_device(raw.get(name), device).view(torch.uint8),
                                fp8.read_scales(pack, scale, device=device))

    return LogicalTensor(Storage(logical or name, "mxfp4", "MXFP4", tuple(shape), nbytes, block=(1, MX_BLOCK),
                                 files=raw.files_of(name, scale), raw=(name, scale)), decode, on_device=True)


@CLAIMERS.register("fp4")
def claim(pack: SafetensorsPack, pool: set) -> dict[str, LogicalTensor]:
    if pack.format == "compressed-tensors":
        return {}
    _check_modelopt_algo(pack)
    raw = pack.raw
    out = {}
    for name in sorted(pool):
        if name not in pool:
            continue
        if name.endswith("_blocks"):
            scales = name[: -len("_blocks")] + "_scales"
            if scales in pool:
                logical = name[: -len("_blocks")]
                entry = absent_entry(pack, logical, (name, scales)) or gpt_oss_entry(pack, name, scales)
                out[logical] = entry
                pool.difference_update({name, scales})
        elif name.endswith(".weight"):
            base = name[: -len(".weight")]
            scale, scale_2 = f"{base}.weight_scale", f"{base}.weight_scale_2"
            if scale in pool and scale_2 in pool:
                absent = absent_entry(pack, name, (name, scale, scale_2))
                if absent is None and raw.info(name).dtype != "U8":
                    continue  # e.g. an FP8 weight with a second scale: not FP4
                out[name] = absent or modelopt_nvfp4_entry(pack, name, scale, scale_2)
                pool.difference_update({name, scale, scale_2})
            elif f"{base}.scale" in pool and raw.available(name) and raw.info(name).dtype in ("I8", "U8"):
                official = f"{base}.scale"
                if raw.available(official) and raw.info(official).dtype in ("F8_E8M0", "U8"):
                    out[name] = mxfp4_entry(pack, name, official)
                    pool.difference_update({name, official})
            elif scale in pool and raw.available(name) and raw.info(name).dtype == "U8":
                raise PackError("packed uint8 weight with a weight_scale but no weight_scale_2 (NVFP4 global scale)",
                                file=raw.file_path(name), tensor=name)
    return out


