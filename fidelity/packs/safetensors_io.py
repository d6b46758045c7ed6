"""A lazy, memory-mapped safetensors reader that validates headers against the file before anything is read."""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ..errors import PackError

# safetensors dtype string -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "U16": (torch.uint16, 2),
    "U32": (torch.uint32, 4),
    "U64": (torch.uint64, 8),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = (torch.float8_e8m0fnu, 1)


@dataclass(frozen=True)
class RawTensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One .safetensors file. Opening reads only the header; tensors are memory-mapped views."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise PackError("safetensors file not found", file=self.path) from None
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise PackError("truncated safetensors file: no header length", file=self.path)
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8 or header_len > 512 * 1024 * 1024:
                raise PackError(f"header length {header_len} exceeds the file size {size}", file=self.path)
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise PackError(f"unreadable safetensors header: {e}", file=self.path) from None
        if not isinstance(header, dict):
            raise PackError(f"safetensors header is not a JSON object (got {type(header).__name__})", file=self.path)
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise PackError("safetensors header's __metadata__ is not an object", file=self.path)
        self.metadata: dict[str, str] = meta
        data_start = 8 + header_len
        self.tensors: dict[str, RawTensorInfo] = {}
        for name, h in header.items():
            dtype, shape, (b, e) = _entry(h, self.path, name)
            if dtype not in DTYPES:
                raise PackError(f"unknown safetensors dtype {dtype!r}", file=self.path, tensor=name)
            expected = math.prod(shape) * DTYPES[dtype][1]
            if e - b != expected:
                raise PackError(
                    f"header says dtype {dtype} shape {list(shape)} ({expected} bytes) "
                    f"but its data span is {e - b} bytes",
                    file=self.path,
                    tensor=name,
                )
            if data_start + e > size:
                raise PackError(
                    f"truncated file: tensor data ends at byte {data_start + e} but the file has {size} bytes",
                    file=self.path, tensor=name)
            self.tensors[name] = RawTensorInfo(name, dtype, shape, data_start + b, data_start + e)
        self._mmap: np.memmap | None = None

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> RawTensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise PackError("tensor not in file", file=self.path, tensor=name) from None

    def get(self, name: str) -> torch.Tensor:
        """A read-only view of the stored tensor, in its stored dtype (memory-mapped, copy-on-write)."""
        info = self.info(name)
        torch_dtype, _ = DTYPES[info.dtype]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=torch_dtype)
        size = self.path.stat().st_size   # pages past a truncated file's end kill the process (SIGBUS) when touched
        if size < info.end:
            raise PackError(f"the file shrank to {size} bytes after it was opened, and this tensor's data ends at byte "
                            f"{info.end} (was it rewritten while being read?)", file=self.path, tensor=name)
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="c")
        buf = self._mmap[info.begin:info.end]
        return torch.from_numpy(buf).view(torch_dtype).reshape(info.shape)


def _entry(h, path: Path, name: str) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, data_offsets) of one header entry, checked the way the safetensors library checks them: a
    string dtype, a list of non-negative integer dims, two non-negative integer offsets in order."""
    if not isinstance(h, dict):
        raise PackError(f"header entry is not an object (got {type(h).__name__})", file=path, tensor=name)
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in h]
    if missing:
        raise PackError(f"header entry lacks {', '.join(missing)}", file=path, tensor=name)
    dtype, shape, offsets = h["dtype"], h["shape"], h["data_offsets"]

    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if not isinstance(dtype, str):
        raise PackError(f"header dtype {dtype!r} is not a string", file=path, tensor=name)
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise PackError(f"header shape {shape!r} is not a list of non-negative integers", file=path, tensor=name)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(x) for x in offsets)):
        raise PackError(f"header data_offsets {offsets!r} is not two integers", file=path, tensor=name)
    b, e = offsets
    if b < 0 or e < b:
        raise PackError(f"header data_offsets {offsets!r} are negative or out of order", file=path, tensor=name)
    return dtype, tuple(shape), (b, e)


def write_safetensors(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
):
    """Write tensors with the reference `safetensors` library (contiguous CPU copies)."""
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=metadata)
