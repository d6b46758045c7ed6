"""A GGUF file's metadata and tensor directory, read in one sequential pass.

gguf-py's `GGUFReader` builds a numpy view for every element of every metadata array, so a tokenizer's 49k tokens and
49k merges cost ~5 s of CPU per SmolLM2 file, paid by every open (the demo opens six). This reads the same layout
(magic, version 2/3, counts, key/values, tensor infos, aligned data) with `struct` and returns what `GGUFReader` offers
for the parts we use: `fields[key].contents()` / `.types` with gguf-py's values, and `tensors` whose `data` is the
same memory-mapped view (typed for F32/F16/F64/I8..I64, raw bytes shaped by `gguf.quants.quant_shape_to_byte_shape`
otherwise) that `gguf.quants.dequantize` decodes. tests/test_gguf_file.py checks every field and tensor against
`GGUFReader` on every GGUF file of the test data.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4   # GGML_MAX_DIMS: llama.cpp refuses a tensor of more
# the fewest bytes an entry can take: a metadata key/value (key length, value type, a one-byte value) and a tensor
# info (name length, n_dims, type, offset); a count whose entries cannot fit in the file is refused before reading them
MIN_KV_BYTES = 8 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
# value type -> struct format character
SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
# tensor types stored as plain numbers; every other type is handed on as raw bytes
TYPED_TENSORS = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass
class Field:
    name: str
    types: list[GGUFValueType]   # as gguf-py: [type], or [ARRAY, element types of the first element...]
    value: Any                   # what contents() returns (nested arrays flattened, as gguf-py does)

    def contents(self) -> Any:
        return list(self.value) if isinstance(self.value, list) else self.value


@dataclass
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray            # uint64 dims in GGUF order (innermost first), as gguf-py's ReaderTensor.shape
    n_elements: int
    n_bytes: int
    data_offset: int             # absolute, in bytes
    data: np.ndarray = field(repr=False)


class GGUFFile:
    """GGUFFile(path): `fields` (key -> Field, in file order), `tensors` (TensorInfo list), `alignment`,
    `data_offset`. Malformed files raise ValueError naming what is wrong and where."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        self._buf = memoryview(self.data)
        if len(self._buf) < 24 or struct.unpack_from("<I", self._buf, 0)[0] != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        # a big-endian file shows its small version number in the high half when read little-endian
        self.order = "<" if struct.unpack_from("<I", self._buf, 4)[0] & 0xFFFF else ">"
        version = struct.unpack_from(self.order + "I", self._buf, 4)[0]
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (supported: {list(SUPPORTED_VERSIONS)})")
        self.version = version
        n_tensors, n_kv = self._unpack("QQ", 8)
        self._off = 24
        self._fits("the header's tensor count", n_tensors, MIN_TENSOR_INFO_BYTES, 8)
        self._fits("the header's metadata key/value count", n_kv, MIN_KV_BYTES, 16)
        self.fields: dict[str, Field] = {}
        for i in range(n_kv):
            at = self._off
            key = self._string(f"metadata key {i}")
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r} at byte {at}")
            types, value = self._value(self._value_type(f"metadata key {key!r}"), key)
            self.fields[key] = Field(key, types, value)
        infos = []
        for i in range(n_tensors):
            name = self._string(f"the name of tensor {i}")
            at = self._off
            n_dims = self._take("I")
            if n_dims > MAX_DIMS:
                raise ValueError(f"tensor {name!r}: n_dims {n_dims} (at byte {at}) is more than GGUF's {MAX_DIMS}")
            dims = np.array(self._unpack("Q" * n_dims, self._advance(8 * n_dims)), dtype=np.uint64)
            at = self._off
            code = self._take("I")
            try:
                kind = GGMLQuantizationType(code)
            except ValueError:
                raise ValueError(f"tensor {name!r}: type {code} (at byte {at}) is no GGML type gguf-py knows") from None
            infos.append((name, dims, kind, self._take("Q")))
        align = self.fields.get("general.alignment")
        self.alignment = GGUF_DEFAULT_ALIGNMENT
        if align is not None:
            if align.types != [GGUFValueType.UINT32]:
                raise ValueError("general.alignment is not a UINT32")
            self.alignment = align.value
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise ValueError(f"general.alignment {self.alignment} is not a power of two")
        self.data_offset = -(-self._off // self.alignment) * self.alignment
        self.tensors: list[TensorInfo] = []
        seen = set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"duplicate tensor {name!r}")
            seen.add(name)
            self.tensors.append(self._tensor(name, dims, kind, offset))

    # -- sequential reads ------------------------------------------------------------------------------------------
    def _unpack(self, fmt: str, at: int) -> tuple:
        try:
            return struct.unpack_from(self.order + fmt, self._buf, at)
        except struct.error:
            raise ValueError(f"the file ends inside its header (reading at byte {at} of {len(self._buf)})") from None

    def _advance(self, n: int) -> int:
        at, self._off = self._off, self._off + n
        return at

    def _take(self, fmt: str):
        return self._unpack(fmt, self._advance(struct.calcsize(fmt)))[0]

    def _fits(self, what: str, count: int, min_bytes: int, at: int) -> None:
        """A count read at byte `at` whose entries (each at least `min_bytes`) cannot fit in the rest of the file."""
        left = len(self._buf) - self._off
        if count * min_bytes > left:
            raise ValueError(f"{what} {count} (at byte {at}) runs past the end of the file: that many entries take at "
                             f"least {count * min_bytes} bytes, and {left} of its {len(self._buf)} bytes are left (a "
                             f"wrong count or a truncated file)")

    def _string(self, what: str) -> str:
        """A length-prefixed UTF-8 string; `what` names it in errors."""
        at = self._off
        n = self._take("Q")
        start = self._advance(n)
        if self._off > len(self._buf):
            raise ValueError(f"{what}: string length {n} (at byte {at}) runs past the end of the file "
                             f"({len(self._buf)} bytes)")
        try:
            return str(self._buf[start:self._off], "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{what}: the string at byte {start} is not UTF-8 ({e.reason} at its byte {e.start})"
            ) from None

    def _value_type(self, what: str) -> GGUFValueType:
        at = self._off
        code = self._take("I")
        try:
            return GGUFValueType(code)
        except ValueError:
            raise ValueError(f"{what}: value type {code} (at byte {at}) is no GGUF value type") from None

    def _value(self, kind: GGUFValueType, key: str) -> tuple[list[GGUFValueType], Any]:
        if kind == GGUFValueType.STRING:
            return [kind], self._string(f"metadata key {key!r}")
        if kind in SCALARS:
            return [kind], self._take(SCALARS[kind])
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"metadata key {key!r}: unknown value type {kind}")
        sub = self._value_type(f"metadata key {key!r}'s array")
        at = self._off
        n = self._take("Q")
        if n == 0:
            return [kind], []
        self._fits(f"metadata key {key!r}: array length", n, struct.calcsize(SCALARS[sub]) if sub in SCALARS else 8, at)
        if sub == GGUFValueType.STRING:
            return [kind, sub], [self._string(f"metadata key {key!r}[{j}]") for j in range(n)]
        if sub in SCALARS:
            fmt = SCALARS[sub]
            return [kind, sub], list(self._unpack(f"{n}{fmt}", self._advance(n * struct.calcsize(fmt))))
        values, types = [], None
        for _ in range(n):   # arrays of arrays: element types from the first, values flattened (gguf-py's reading)
            t, v = self._value(sub, key)
            types = types or t
            values += v if isinstance(v, list) else [v]
        return [kind] + types, values

    def _tensor(self, name: str, dims: np.ndarray, kind: GGMLQuantizationType, offset: int) -> TensorInfo:
        n_elements = math.prod(int(d) for d in dims)   # Python ints: dims whose product passes 2^64 do not wrap
        block, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * type_size // block
        start = self.data_offset + offset
        shape = tuple(reversed(dims.tolist()))
        if kind in TYPED_TENSORS:
            dtype = np.dtype(TYPED_TENSORS[kind]).newbyteorder(self.order)
            count = n_elements
        else:
            dtype, count, shape = np.dtype(np.uint8), n_bytes, quant_shape_to_byte_shape(shape, kind)
        end = start + count * dtype.itemsize
        view = self.data[start:end].view(dtype)[:count] if end <= len(self.data) else self.data[start:start]
        data = view.reshape(shape) if view.size == count else view
        return TensorInfo(name, kind, dims, n_elements, n_bytes, start, data)
