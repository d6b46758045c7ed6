"""Stored bytes on their way to the device that decodes them.

Every format decodes where the oracle runs: the host reads a tensor's stored bytes (a memory-mapped view), sends those
bytes, not fp32 values, and the decode runs in torch on the target device. On the CPU nothing moves: decoders get the
memory-mapped view itself, as they always did. To a CUDA device the bytes go through pinned host memory, so the copy is
plain DMA on the current stream that overlaps kernels running on other streams (layer prefetch,
`fidelity.oracle.parallel`).

`stage_bytes` / `staged` let a prefetcher read a layer's stored bytes ahead into (pinned) host buffers; a decoder that
asks for a stored tensor then finds it there instead of touching the file again.
"""
from __future__ import annotations

import threading

import torch

CPU = torch.device("cpu")


def as_device(device: torch.device | str | None) -> torch.device:
    return CPU if device is None else torch.device(device)


def host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A contiguous host copy of a stored (memory-mapped) tensor, in pinned memory when `pin`: its bytes, copied as
    uint8 (every stored dtype, e8m0 and uint16 included) and viewed back as the stored dtype."""
    src = t.reshape(-1).view(torch.uint8)
    out = torch.empty(src.shape, dtype=torch.uint8, pin_memory=pin)
    out.copy_(src)
    return out.view(t.dtype).reshape(t.shape)


_sent = [0]   # bytes to_device has sent off the host (benchmarks/decode_device.py, tests)


def bytes_sent() -> int:
    """Bytes `to_device` has copied from the host to other devices so far, in this process."""
    return _sent[0]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The stored tensor `t` (a host view, in its stored dtype) on `device`: `t` itself on the CPU; elsewhere its bytes,
    copied once (through pinned memory to CUDA, asynchronously on the current stream) and viewed as the stored dtype."""
    if device.type == "cpu" or t.device == device:
        return t
    shape, dtype = t.shape, t.dtype
    # bytes travel: every stored dtype (fp8, e8m0, uint16...) is copied as uint8 and viewed back on the device
    flat = t.reshape(-1).view(torch.uint8)
    if device.type == "cuda" and not flat.is_pinned():
        flat = host_copy(flat, pin=True)
    moved = flat.to(device, non_blocking=device.type == "cuda")
    _sent[0] += moved.numel()
    return moved.view(dtype).reshape(shape)


def stack_to_device(ts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Stored tensors of one shape and dtype (host views) stacked on `device` [len(ts), *shape]: `torch.stack` on the
    CPU; elsewhere each one's bytes copied once into one buffer there (as `to_device`: through pinned memory to CUDA,
    asynchronously on the current stream), so a batched decode reads them with no per-tensor device tensor."""
    if device.type == "cpu":
        return torch.stack(ts)
    shape, dtype = ts[0].shape, ts[0].dtype
    if any(t.shape != shape or t.dtype != dtype for t in ts):
        raise ValueError(f"stack_to_device takes tensors of one shape and dtype; got "
                         f"{sorted({(tuple(t.shape), str(t.dtype)) for t in ts})}")
    nbytes = shape.numel() * dtype.itemsize
    out = torch.empty(len(ts), nbytes, dtype=torch.uint8, device=device)
    for row, t in zip(out, ts):
        flat = t.reshape(-1).view(torch.uint8)
        if t.device.type == "cpu" and device.type == "cuda" and not flat.is_pinned():
            flat = host_copy(flat, pin=True)
        row.copy_(flat, non_blocking=device.type == "cuda")
    _sent[0] += out.numel()
    return out.view(dtype).view(len(ts), *shape)


class StagedBytes:
    """Stored tensors read ahead into host memory, keyed by (folder, stored name), each held until every `hold` of it
    is released. Thread-safe: a prefetch thread holds the next layer's tensors while the compute thread decodes the
    current layer's."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], list] = {}   # key -> [host tensor, holds]

    def hold(self, key: tuple[str, str], read) -> None:
        with self._lock:
            entry = self._held.get(key)
            if entry is not None:
                entry[1] += 1
                return
        t = read()                                     # outside the lock: the read is the slow part
        with self._lock:
            entry = self._held.setdefault(key, [t, 0])
            entry[1] += 1

    def get(self, key: tuple[str, str]) -> torch.Tensor | None:
        with self._lock:
            entry = self._held.get(key)
            return None if entry is None else entry[0]

    def release(self, keys) -> None:
        with self._lock:
            for k in keys:
                entry = self._held.get(k)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self._held[k]

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def nbytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for t, _ in self._held.values())
