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
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        data_start = 8 + header_len
        self.tensors: dict[str, RawTensorInfo] = {}
        for name, h in header.items():
            dtype, shape, (b, e) = h["dtype"], tuple(int(s) for s in h["shape"]), h["data_offsets"]
            if dtype not in DTYPES:
                raise PackError(f"unknown safetensors dtype {dtype!r}", file=self.path, tensor=name)
            expected = math.prod(shape) * DTYPES[dtype][1]
            if e - b != expected:
                raise PackError(
                    f"header says dtype {dtype} shape {list(shape)} ({expected} bytes) but its data span is {e - b} bytes",
                    file=self.path, tensor=name)
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


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None):
    """Write tensors with the reference `safetensors` library (contiguous CPU copies)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=metadata)
