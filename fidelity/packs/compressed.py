"""compressed-tensors packs (`quant_method: compressed-tensors`, as written by llm-compressor).

Per module the scheme (from `config_groups`, matched by `targets`) says the stored form:
- `pack-quantized`: `weight_packed` int32 (num_bits-wide two's-complement-offset integers, densely packed from bit 0 of
  each row), `weight_shape`, `weight_scale`, optional `weight_zero_point` (packed the same way along dim 0) and
  `weight_g_idx` (activation order: column j uses group g_idx[j]);
- `naive-quantized` / `int-quantized` / `float-quantized` / `mxfp8-quantized`: `weight` int8 or fp8 + `weight_scale`
  (float, or uint8 e8m0 exponents for MXFP8) (+ zero point);
- `nvfp4-pack-quantized` (the global scale divides) and `mxfp4-pack-quantized`, decoded by `fp4`.
value = (q - zero_point) * scale, computed in fp32 with one rounding (the library's own order of operations; its bf16
output is this value rounded to bf16).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import PackError
from .base import LogicalTensor, Storage
from .folder import KNOWN_QUANT_METHODS, SafetensorsPack
from ..registry import CLAIMERS
from .fp4 import MX_BLOCK, NV_BLOCK, check_group_grid, dequantize_mxfp4, dequantize_nvfp4
from .fp8 import FP8_DTYPES, absent_entry, ceil_div, read_scales
from .staging import CPU, to_device

KNOWN_QUANT_METHODS.add("compressed-tensors")

SIDE_PARAMS = ("weight_scale", "weight_zero_point", "weight_global_scale", "weight_shape", "weight_g_idx")
UNSUPPORTED_FORMATS = ("sparse-bitmask", "sparse-24-bitmask", "marlin-24", "mxfp6-pack-quantized")
NAIVE_FORMATS = ("naive-quantized", "int-quantized", "float-quantized", "mxfp8-quantized")


@dataclass(frozen=True)
class WeightArgs:
    """The `weights` QuantizationArgs of a scheme, with compressed-tensors' strategy inference."""

    num_bits: int
    type: str
    symmetric: bool
    strategy: str
    group_size: int | None
    block: tuple[int, int] | None

    @classmethod
    def from_json(cls, w: dict) -> "WeightArgs":
        group_size = w.get("group_size")
        strategy = w.get("strategy")
        if strategy is None:
            strategy = "tensor" if group_size is None else ("channel" if group_size == -1 else "group")
        block = w.get("block_structure")
        if isinstance(block, str):
            block = [int(x) for x in block.split("x")]
        return cls(int(w.get("num_bits", 8)), str(w.get("type", "int")).lower(), bool(w.get("symmetric", True)),
                   str(strategy).lower(), group_size, tuple(block) if block else None)


@dataclass(frozen=True)
class Scheme:
    group: str
    targets: tuple[str, ...]
    weights: WeightArgs | None
    format: str


def schemes_of(pack: SafetensorsPack) -> list[Scheme]:
    qc = pack.quant_config or {}
    default_format = qc.get("format") or "dense"
    out = []
    for gname, g in (qc.get("config_groups") or {}).items():
        w = g.get("weights")
        out.append(Scheme(gname, tuple(g.get("targets") or ()), WeightArgs.from_json(w) if w else None,
                          g.get("format") or default_format))
    return out


def matches_by_name(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def scheme_for(module: str, schemes: list[Scheme]) -> list[Scheme]:
    """Candidate schemes, most specific first: name/regex targets, then class-name targets (e.g. "Linear"), which a
    safetensors file cannot check, so they stand for any module that has quantization parameters."""
    named = [s for s in schemes if any(matches_by_name(module, t) for t in s.targets)]
    by_class = [
        s for s in schemes if s not in named and any(not t.startswith("re:") and "." not in t for t in s.targets)
    ]
    return named + by_class


# -- integer unpacking ------------------------------------------------------------------------------------------------
def unpack_int32(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """int32 words [..., W] -> signed integers [..., cols]: element j occupies bits [j*b, j*b + b) of the row's
    little-endian bit stream; stored values carry an offset of 2**(b-1)."""
    mask = (1 << num_bits) - 1
    if 32 % num_bits == 0:
        shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device)
        vals = ((packed.unsqueeze(-1) >> shifts) & mask).flatten(-2)[..., :cols]
    else:  # an element may straddle two words
        words = packed.to(torch.int64) & 0xFFFFFFFF
        words = torch.cat([words, torch.zeros_like(words[..., :1])], dim=-1)
        bit = torch.arange(cols, device=packed.device) * num_bits
        idx, off = bit // 32, bit % 32
        vals = ((words[..., idx] >> off) | (words[..., idx + 1] << (32 - off))) & mask
    return vals.to(torch.int32) - (1 << (num_bits - 1))


def apply_param_(w: torch.Tensor, t: torch.Tensor, op, args: WeightArgs, g_idx: torch.Tensor | None) -> torch.Tensor:
    """In place: w = op(w, t broadcast from its per-tensor/channel/group/block grid to w's [..., rows, cols])."""
    *lead, rows, cols = w.shape
    if args.strategy == "tensor":
        return op(w, t.reshape(()))
    if args.strategy == "channel":
        return op(w, t.reshape(*lead, rows, 1))
    if args.strategy in ("group", "tensor_group"):
        gs = args.group_size
        whole = cols // gs
        if g_idx is None and whole * gs == cols:  # the common case: a view, no full-size temporary
            op(w.unflatten(-1, (whole, gs)), t[..., None])
            return w
        cols_group = g_idx if g_idx is not None else torch.arange(cols, device=w.device) // gs
        return op(w, t[..., cols_group])
    bh, bw = args.block
    r, c = torch.arange(rows, device=w.device), torch.arange(cols, device=w.device)
    return op(w, t[..., r // bh, :][..., c // bw])


def param_grid(args: WeightArgs, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Shapes a scale/zero-point may have for this strategy."""
    *lead, rows, cols = shape
    if args.strategy == "tensor":
        return [(1,), ()]
    if args.strategy == "channel":
        return [(*lead, rows, 1), (*lead, rows)]
    if args.strategy in ("group", "tensor_group"):
        return [(*lead, rows, ceil_div(cols, args.group_size))]
    if args.strategy == "block" and args.block:
        return [(*lead, ceil_div(rows, args.block[0]), ceil_div(cols, args.block[1]))]
    return []


# -- one module -----------------------------------------------------------------------------------------------------
class ModuleParams:
    """The stored tensors of one quantized module (`<module>.weight_packed`, `.weight_scale`, ...)."""

    def __init__(self, pack: SafetensorsPack, module: str, pool: set):
        self.pack, self.module = pack, module
        self.names = {p: f"{module}.{p}" for p in ("weight", "weight_packed", *SIDE_PARAMS) if f"{module}.{p}" in pool}

    def has(self, p: str) -> bool:
        return p in self.names

    def name(self, p: str) -> str:
        if p not in self.names:
            raise PackError(
                f"compressed-tensors module lacks its {p}", file=self.pack.root, tensor=f"{self.module}.{p}"
            )
        return self.names[p]

    def info(self, p: str):
        return self.pack.raw.info(self.name(p))

    def get(self, p: str, device: torch.device = CPU) -> torch.Tensor:
        return to_device(self.pack.raw.get(self.name(p)), device)

    def file(self, p: str):
        return self.pack.raw.file_path(self.name(p))

    def error(self, msg: str, p: str) -> PackError:
        return PackError(msg, file=self.file(p) if self.has(p) else self.pack.root, tensor=f"{self.module}.{p}")

    def storage(self, fmt: str, dtype: str, shape, block=None) -> Storage:
        raw = self.pack.raw
        names = tuple(self.names.values())
        nbytes = sum(raw.info(n).nbytes for n in names)
        return Storage(f"{self.module}.weight", fmt, dtype, tuple(shape), nbytes, block=block,
                       files=raw.files_of(*names), raw=names)

    def check_grid(self, p: str, args: WeightArgs, shape) -> None:
        got = tuple(self.info(p).shape)
        allowed = param_grid(args, shape)
        if got not in allowed:
            kind = "zero points" if p.endswith("zero_point") else "scales"
            raise self.error(f"{kind} of the wrong grid: {p} has shape {list(got)}, the {args.strategy} strategy on a "
                             f"{list(shape)} weight needs {[list(a) for a in allowed]}", p)

    def check_zero_point_grid(self, args: WeightArgs, shape, packed: bool) -> None:
        if args.symmetric or not self.has("weight_zero_point"):
            return
        if packed and args.strategy in ("group", "channel"):  # packed along the rows
            n_groups = self.info("weight_scale").shape[-1]
            want = (*shape[:-2], ceil_div(shape[-2] * args.num_bits, 32), n_groups)
            if tuple(self.info("weight_zero_point").shape) != want:
                raise self.error(f"zero points of the wrong grid: shape {list(self.info('weight_zero_point').shape)}, "
                                 f"expected {list(want)} (packed along the rows)", "weight_zero_point")
        else:
            self.check_grid("weight_zero_point", args, shape)

    def g_idx(self, args: WeightArgs, shape, device: torch.device = CPU) -> torch.Tensor | None:
        if not self.has("weight_g_idx"):
            return None
        g = self.get("weight_g_idx", device).to(torch.int64)
        if bool((g == -1).any()):  # compressed-tensors' "not initialised": column order
            return None
        n_groups = ceil_div(shape[-1], args.group_size or shape[-1])
        if args.strategy != "group" or tuple(g.shape) != (shape[-1],) or bool(((g < 0) | (g >= n_groups)).any()):
            raise self.error(f"g_idx must map each of {shape[-1]} columns to one of {n_groups} groups", "weight_g_idx")
        return g

    def zero_point(self, args: WeightArgs, shape, packed: bool, device: torch.device = CPU) -> torch.Tensor | None:
        if args.symmetric or not self.has("weight_zero_point"):
            if not args.symmetric and args.strategy != "tensor":
                raise self.error("asymmetric scheme without a zero point", "weight_zero_point")
            return None
        zp = self.get("weight_zero_point", device)
        if packed and args.strategy in ("group", "channel"):
            rows, n_groups = shape[-2], self.info("weight_scale").shape[-1]
            return unpack_int32(zp.transpose(-1, -2), args.num_bits, rows).transpose(-1, -2).reshape(
                *shape[:-2], rows, n_groups)
        return zp.to(torch.int32)


def weight_shape_of(m: ModuleParams, args: WeightArgs) -> tuple[int, ...]:
    shape = tuple(int(v) for v in m.get("weight_shape").tolist())
    pshape = m.info("weight_packed").shape
    width = ceil_div(shape[-1] * args.num_bits, 32)
    if len(shape) != len(pshape) or shape[:-1] != tuple(pshape[:-1]) or pshape[-1] != width:
        hint = ""
        if len(shape) == len(pshape) and pshape[-1] == ceil_div(shape[-1], 32 // args.num_bits):
            hint = " (this is the older compressed-tensors layout without values straddling words; not supported)"
        raise m.error(f"weight_packed {list(pshape)} does not hold weight_shape {list(shape)} at "
                      f"{args.num_bits} bits{hint}", "weight_packed")
    return shape


def int_dequantize(m: ModuleParams, args: WeightArgs, q: torch.Tensor, shape, zp) -> torch.Tensor:
    """On q's device."""
    s = read_scales(m.pack, m.name("weight_scale"), device=q.device)
    g_idx = m.g_idx(args, shape, q.device)
    w = q.to(torch.float32).reshape(shape)
    if zp is not None:
        apply_param_(w, zp.to(torch.float32), torch.Tensor.sub_, args, g_idx)
    return apply_param_(w, s, torch.Tensor.mul_, args, g_idx)


def pack_quantized_entry(m: ModuleParams, args: WeightArgs) -> LogicalTensor:
    if args.type != "int" or not 1 <= args.num_bits <= 8:
        raise m.error(f"pack-quantized needs int weights of 1..8 bits, the scheme says {args.type}{args.num_bits}",
                      "weight_packed")
    if m.info("weight_packed").dtype != "I32":
        raise m.error(f"weight_packed must be int32, got {m.info('weight_packed').dtype}", "weight_packed")
    shape = weight_shape_of(m, args)
    m.check_grid("weight_scale", args, shape)
    m.check_zero_point_grid(args, shape, packed=True)

    def decode(device: torch.device) -> torch.Tensor:
        q = unpack_int32(m.get("weight_packed", device), args.num_bits, shape[-1])
        return int_dequantize(m, args, q, shape, m.zero_point(args, shape, packed=True, device=device))

    dtype = f"I32 x{32 // args.num_bits if 32 % args.num_bits == 0 else 32 / args.num_bits:g}, scale " \
            f"{m.info('weight_scale').dtype} {args.strategy}" + ("" if args.symmetric else " +zp") + \
            (" +g_idx" if m.has("weight_g_idx") else "")
    block = (1, args.group_size) if args.strategy == "group" else args.block
    return LogicalTensor(m.storage(f"int{args.num_bits}-pack-quantized", dtype, shape, block), decode, on_device=True)


def naive_entry(m: ModuleParams, args: WeightArgs, fmt: str) -> LogicalTensor:
    info = m.info("weight")
    shape = tuple(info.shape)
    m.check_grid("weight_scale", args, shape)
    m.check_zero_point_grid(args, shape, packed=False)
    is_float = info.dtype in FP8_DTYPES
    if not is_float and info.dtype not in ("I8", "I16", "I32"):
        raise m.error(f"{fmt} weight must be int or fp8, got {info.dtype}", "weight")

    def decode(device: torch.device) -> torch.Tensor:
        return int_dequantize(m, args, m.get("weight", device), shape,
                              m.zero_point(args, shape, packed=False, device=device))

    if fmt == "mxfp8-quantized":
        kind = "mxfp8"
    else:
        kind = FP8_DTYPES[info.dtype] if is_float else f"int{args.num_bits}-quantized"
    desc = f"block {args.block[0]}x{args.block[1]}" if args.strategy == "block" else args.strategy
    block = (1, args.group_size) if args.strategy == "group" else args.block
    return LogicalTensor(m.storage(kind, f"{info.dtype} x {m.info('weight_scale').dtype} {desc}", shape, block), decode,
                         on_device=True)


def nvfp4_entry(m: ModuleParams, args: WeightArgs) -> LogicalTensor:
    shape = check_group_grid(m.pack, m.name("weight_packed"), m.name("weight_scale"), NV_BLOCK)
    if m.info("weight_scale").dtype != "F8_E4M3":
        raise m.error(f"NVFP4 block scales must be F8_E4M3, got {m.info('weight_scale').dtype}", "weight_scale")
    m.name("weight_global_scale")

    def decode(device: torch.device) -> torch.Tensor:
        s = read_scales(m.pack, m.name("weight_scale"), device=device)
        g = read_scales(m.pack, m.name("weight_global_scale"), device=device)
        return dequantize_nvfp4(m.get("weight_packed", device), s, g, global_divides=True)

    return LogicalTensor(m.storage("nvfp4", "E2M1 x F8_E4M3 per-16 / F32 global", shape, (1, NV_BLOCK)), decode,
                         on_device=True)


def mxfp4_entry(m: ModuleParams, args: WeightArgs) -> LogicalTensor:
    shape = check_group_grid(m.pack, m.name("weight_packed"), m.name("weight_scale"), MX_BLOCK)

    def decode(device: torch.device) -> torch.Tensor:
        return dequantize_mxfp4(
            m.get("weight_packed", device), read_scales(m.pack, m.name("weight_scale"), device=device)
        )

    sdtype = m.info("weight_scale").dtype
    return LogicalTensor(
        m.storage("mxfp4", f"E2M1 x {sdtype} e8m0 per-32", shape, (1, MX_BLOCK)), decode, on_device=True
    )


def stored_format(m: ModuleParams) -> str:
    """The format a module's stored tensors imply, for configs that name none (or "dense"/"mixed-precision")."""
    if m.has("weight_packed"):
        if m.info("weight_packed").dtype == "I32":
            return "pack-quantized"
        return "nvfp4-pack-quantized" if m.has("weight_global_scale") else "mxfp4-pack-quantized"
    if m.info("weight").dtype not in FP8_DTYPES:
        return "int-quantized"
    return "mxfp8-quantized" if m.info("weight_scale").dtype == "U8" else "float-quantized"


def module_entry(m: ModuleParams, scheme: Scheme) -> LogicalTensor:
    fmt, args = scheme.format, scheme.weights
    if fmt in ("dense", "mixed-precision"):
        fmt = stored_format(m)
    if fmt in UNSUPPORTED_FORMATS:
        raise m.error(f"compressed-tensors format {fmt!r} is not supported", "weight_scale")
    if args is None:
        raise m.error(f"config group {scheme.group!r} has no weights scheme but the module stores quantization "
                      "parameters", "weight_scale")
    if fmt == "pack-quantized":
        return pack_quantized_entry(m, args)
    if fmt == "nvfp4-pack-quantized":
        return nvfp4_entry(m, args)
    if fmt == "mxfp4-pack-quantized":
        return mxfp4_entry(m, args)
    if fmt in NAIVE_FORMATS:
        return naive_entry(m, args, fmt)
    raise m.error(f"compressed-tensors format {fmt!r} is not known", "weight_scale")


def stored_form_fits(m: ModuleParams, scheme: Scheme) -> bool:
    packed = m.has("weight_packed")
    if scheme.format in UNSUPPORTED_FORMATS or scheme.format in ("dense", "mixed-precision"):
        return True  # so that `module_entry` says what is unsupported
    if scheme.format in ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        return packed
    return not packed


@CLAIMERS.register("compressed-tensors")
def claim(pack: SafetensorsPack, pool: set) -> dict[str, LogicalTensor]:
    if pack.format != "compressed-tensors":
        return {}
    qc = pack.quant_config or {}
    cfg_file = pack.root / "config.json"
    sparsity = (pack.config.get("sparsity_config") or qc.get("sparsity_config") or {}).get("format", "dense")
    if sparsity not in ("dense", None):
        raise PackError(f"compressed-tensors sparsity format {sparsity!r} is not supported", file=cfg_file)
    if qc.get("transform_config"):
        raise PackError("compressed-tensors transform_config (online rotations) is not supported: the stored weights "
                        "are rotated", file=cfg_file)
    if qc.get("quantization_status") not in (None, "compressed"):
        return {}  # weights were saved unpacked (fake-quantized floats): they are plain tensors
    schemes = schemes_of(pack)
    modules = sorted({n.rsplit(".", 1)[0] for n in pool if n.endswith((".weight_packed", ".weight_scale"))})
    out = {}
    for module in modules:
        m = ModuleParams(pack, module, pool)
        absent = absent_entry(pack, f"{module}.weight", tuple(m.names.values()))
        if absent is not None:
            out[f"{module}.weight"] = absent
            pool.difference_update(m.names.values())
            continue
        if not m.has("weight_packed"):
            if not m.has("weight") or pack.raw.info(m.name("weight")).dtype in ("BF16", "F16", "F32"):
                continue  # an unquantized weight stored beside its scales
        candidates = [s for s in scheme_for(module, schemes) if stored_form_fits(m, s)]
        if not candidates:
            raise m.error("no config group of quantization_config targets this module's stored form",
                          "weight_packed" if m.has("weight_packed") else "weight")
        out[f"{module}.weight"] = module_entry(m, candidates[0])
        pool.difference_update(m.names.values())
    return out


