"""Native float tensors (bf16 / fp16 / fp32 / fp64 / ints): the stored value, widened exactly to float32."""
from __future__ import annotations

import torch

from ..errors import PackError
from .base import LogicalTensor, Storage
from .folder import SafetensorsPack
from ..registry import CLAIMERS
from .staging import to_device

# Stored codes of these types are not values without scales: a weight of such a type left to `native` is refused.
_NEEDS_SCALES = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8", "I16", "I32", "U16", "U32"}
_FLOAT_FORMAT = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}


@CLAIMERS.register("native")
def claim(pack: SafetensorsPack, pool: set) -> dict[str, LogicalTensor]:
    out = {}
    for name in sorted(pool):
        out[name] = _entry(pack, name)
    pool.clear()
    return out


def _entry(pack: SafetensorsPack, name: str) -> LogicalTensor:
    raw = pack.raw
    if not raw.available(name):
        path = raw.file_path(name)

        def missing():
            raise PackError("the index names a shard that is absent", file=path, tensor=name)

        return LogicalTensor(Storage(name, "absent", "?", (), 0, files=(str(path),), raw=(name,)), missing)
    info = raw.info(name)

    if info.dtype in _NEEDS_SCALES and name.endswith(".weight") and len(info.shape) >= 2:
        def refuse():
            raise PackError(
                f"a {info.dtype} weight that no format module claimed: its scales (e.g. .weight_scale_inv, "
                f".weight_scale, .scale) are missing or in a layout we do not know, so its stored codes are "
                f"not its values",
                file=raw.file_path(name),
                tensor=name,
            )

        return LogicalTensor(Storage(name, "unclaimed", info.dtype, info.shape, info.nbytes, files=raw.files_of(name),
                                     raw=(name,)), refuse)

    def decode(device: torch.device) -> torch.Tensor:
        t = to_device(raw.get(name), device)
        if info.dtype == "F64":
            f = t.to(torch.float32)
            if not torch.equal(f.to(torch.float64), t):
                raise PackError(
                    "float64 tensor is not representable in float32 exactly", file=raw.file_path(name), tensor=name
                )
            return f
        return t.to(torch.float32)

    fmt = _FLOAT_FORMAT.get(info.dtype, info.dtype.lower())
    return LogicalTensor(
        Storage(name, fmt, info.dtype, info.shape, info.nbytes, files=raw.files_of(name), raw=(name,)),
        decode,
        on_device=True,
    )


