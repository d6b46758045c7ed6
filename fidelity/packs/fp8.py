"""FP8 (e4m3 / e5m2) weights with scales: the DeepSeek `weight_scale_inv` 128x128 block grid (fp32 or power-of-two
ue8m0 scales, stored as F32, F8_E8M0 or uint8 exponents), per-channel and per-tensor `weight_scale`, ModelOpt's
FP8 / FP8_PER_CHANNEL_PER_TOKEN / FP8_PB_WO (`weight_scale` [R, 1, C, 1]) and MXFP8 (uint8 e8m0 `weight_scale` per 32
inputs).

value = float(fp8) * scale, computed in fp32 (one rounding: an fp8 x fp32 product is exact unless it overflows).
The scale helpers here are shared by the other scaled formats (fp4, compressed-tensors).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PackError
from .base import LogicalTensor, Storage
from .folder import KNOWN_QUANT_METHODS, SafetensorsPack
from ..registry import CLAIMERS
from .staging import CPU, to_device

FP8_DTYPES = {"F8_E4M3": "fp8_e4m3", "F8_E5M2": "fp8_e5m2"}
E8M0_DTYPES = ("F8_E8M0", "U8")
FLOAT_SCALE_DTYPES = ("F32", "BF16", "F16", "F64", "F8_E4M3")
DEFAULT_BLOCK = (128, 128)

KNOWN_QUANT_METHODS.update({"fp8", "modelopt", "fbgemm_fp8"})  # fbgemm_fp8: per-channel `weight_scale` [out, 1]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- scales -------------------------------------------------------------------------------------------------------
def e8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    """2**(e - 127) built from its fp32 bit pattern (exact, including e = 0 -> 2**-127, an fp32 subnormal)."""
    e = exponents.to(torch.int32)
    bits = torch.where(e > 0, e << 23, torch.full_like(e, 0x00400000))
    return bits.view(torch.float32)


def read_scales(
    pack: SafetensorsPack, name: str, *, power_of_two: bool = False, device: torch.device = CPU
) -> torch.Tensor:
    """A stored scale tensor as exact fp32 on `device`. NaN/inf scales (or e8m0's NaN code 255) are errors naming the
    tensor."""
    raw = pack.raw
    info = raw.info(name)
    t = to_device(raw.get(name), device)
    if info.dtype in E8M0_DTYPES:
        e = t.view(torch.uint8)
        if bool((e == 255).any()):
            raise PackError(f"NaN in scales: {int((e == 255).sum())} e8m0 exponents are 255 (the NaN code)",
                            file=raw.file_path(name), tensor=name)
        return e8m0_to_float(e)
    if info.dtype not in FLOAT_SCALE_DTYPES:
        raise PackError(f"scale dtype {info.dtype} is not a float or e8m0 type", file=raw.file_path(name), tensor=name)
    s = t.to(torch.float32)
    bad = ~torch.isfinite(s)
    if bool(bad.any()):
        kind = "NaN" if bool(torch.isnan(s).any()) else "inf"
        raise PackError(f"{kind} in scales: {int(bad.sum())} of {s.numel()} are not finite",
                        file=raw.file_path(name), tensor=name)
    if power_of_two:
        mantissa, _ = torch.frexp(s)  # 0.5 exactly for a positive power of two, subnormals included
        if bool((mantissa != 0.5).any()):
            raise PackError("the config declares ue8m0 (power-of-two) scales but some are not powers of two",
                            file=raw.file_path(name), tensor=name)
    return s


@dataclass(frozen=True)
class ScaleLayout:
    """How a scale tensor covers its weight's last two axes: one value, one per row, or one per (rows x cols) block."""

    kind: str                            # "tensor" | "channel" | "block"
    block: tuple[int, int] | None = None

    def describe(self) -> str:
        return f"block {self.block[0]}x{self.block[1]}" if self.kind == "block" else f"per-{self.kind}"


def block_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    *lead, rows, cols = shape
    return (*lead, ceil_div(rows, block[0]), ceil_div(cols, block[1]))


MX_BLOCK = (1, 32)  # MXFP8: one e8m0 scale per 32 consecutive inputs


def scale_layout(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], blocks: list[tuple[int, int]],
                 *, file, tensor: str) -> ScaleLayout:
    """Recognise the scale grid from the shapes: one value, one per row, or one per block of any of `blocks` (stored
    [.., R, C] or as ModelOpt's [.., R, 1, C, 1]). A grid that fits none is an error naming the scale tensor."""
    *lead, rows, _ = weight_shape
    numel = 1
    for s in scale_shape:
        numel *= s
    if numel == 1:
        return ScaleLayout("tensor")
    if tuple(scale_shape) in ((*lead, rows), (*lead, rows, 1)):
        return ScaleLayout("channel")
    for block in blocks:
        *glead, gr, gc = block_grid(weight_shape, block)
        if tuple(scale_shape) in ((*glead, gr, gc), (*glead, gr, 1, gc, 1)):
            return ScaleLayout("block", tuple(block))
    want = ", ".join(f"{list(block_grid(weight_shape, b))} for {b[0]}x{b[1]} blocks" for b in blocks)
    raise PackError(f"scales of the wrong grid: shape {list(scale_shape)} fits weight {list(weight_shape)} neither "
                    f"per-tensor, per-channel nor in blocks (expected {want})", file=file, tensor=tensor)


def apply_block_scales(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w[..., r, c] * s[..., r // bh, c // bw]; the last row/column blocks may be partial (ceil-div grid)."""
    *lead, rows, cols = w.shape
    bh, bw = block
    gr, gc = ceil_div(rows, bh), ceil_div(cols, bw)
    pr, pc = gr * bh, gc * bw
    if (pr, pc) != (rows, cols):
        padded = w.new_zeros(*lead, pr, pc)
        padded[..., :rows, :cols] = w
        w = padded
    w.view(*lead, gr, bh, gc, bw).mul_(s.reshape(*lead, gr, 1, gc, 1))
    return w[..., :rows, :cols]


def apply_scales(w: torch.Tensor, s: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    """Scale a freshly decoded fp32 weight in place."""
    if layout.kind == "tensor":
        return w.mul_(s.reshape(()))
    if layout.kind == "channel":
        return w.mul_(s.reshape(*w.shape[:-1], 1))
    return apply_block_scales(w, s, layout.block)


def absent_entry(pack: SafetensorsPack, logical: str, raw_names: tuple[str, ...]) -> LogicalTensor | None:
    """If a part of a quantized tensor sits in an absent shard, the whole logical tensor is absent (an error only when
    decoded), never decoded from the parts that are there. None when every part is present."""
    missing = [n for n in raw_names if not pack.raw.available(n)]
    if not missing:
        return None
    path = pack.raw.file_path(missing[0])

    def fail():
        raise PackError(f"the index names a shard that is absent (it holds {missing[0]})", file=path, tensor=logical)

    return LogicalTensor(Storage(logical, "absent", "?", (), 0, files=(str(path),), raw=raw_names), fail)


# -- the claimer --------------------------------------------------------------------------------------------------
def config_block(pack: SafetensorsPack) -> tuple[int, int] | None:
    qc = pack.quant_config or {}
    b = qc.get("weight_block_size")
    return (int(b[0]), int(b[1])) if b else None


def declares_ue8m0(pack: SafetensorsPack) -> bool:
    return (pack.quant_config or {}).get("scale_fmt") == "ue8m0"


def fp8_entry(pack: SafetensorsPack, name: str, scale_name: str, block: tuple[int, int] | None,
              *, power_of_two: bool = False, logical_name: str | None = None) -> LogicalTensor:
    """A scaled fp8 weight: `name` holds the fp8 values, `scale_name` the scales (grid recognised from the shapes)."""
    raw = pack.raw
    info, sinfo = raw.info(name), raw.info(scale_name)
    blocks = [block or DEFAULT_BLOCK] + ([MX_BLOCK] if sinfo.dtype in E8M0_DTYPES else [])
    layout = scale_layout(info.shape, sinfo.shape, blocks, file=raw.file_path(scale_name), tensor=scale_name)
    logical = logical_name or name

    def decode(device: torch.device) -> torch.Tensor:
        s = read_scales(pack, scale_name, power_of_two=power_of_two, device=device)
        return apply_scales(to_device(raw.get(name), device).to(torch.float32), s, layout)

    storage = Storage(logical, FP8_DTYPES[info.dtype], f"{info.dtype} x {sinfo.dtype} {layout.describe()}", info.shape,
                      info.nbytes + sinfo.nbytes, block=layout.block, files=raw.files_of(name, scale_name),
                      raw=(name, scale_name))
    return LogicalTensor(storage, decode, on_device=True)


@CLAIMERS.register("fp8")
def claim(pack: SafetensorsPack, pool: set) -> dict[str, LogicalTensor]:
    if pack.format == "compressed-tensors":  # its own module reads its scheme
        return {}
    raw = pack.raw
    out = {}
    for name in sorted(pool):
        if not name.endswith(".weight") or name not in pool:
            continue
        base = name[: -len(".weight")]
        # `.scale` is DeepSeek's official naming (inference/convert.py), a multiplier on the 128x128 grid like _inv
        scale_name = next(
            (f"{base}.{s}" for s in ("weight_scale_inv", "weight_scale", "scale") if f"{base}.{s}" in pool), None
        )
        if scale_name is None:
            continue
        absent = absent_entry(pack, name, (name, scale_name))
        if absent is not None:
            out[name] = absent
            pool.difference_update({name, scale_name})
            continue
        if raw.info(name).dtype not in FP8_DTYPES:
            continue
        inv = scale_name.endswith(("_inv", ".scale"))
        block = config_block(pack) or (DEFAULT_BLOCK if inv else None)
        out[name] = fp8_entry(pack, name, scale_name, block, power_of_two=declares_ue8m0(pack))
        pool.difference_update({name, scale_name})
    return out


