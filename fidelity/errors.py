"""Every error the library raises on bad input is a FidelityError that names what it is about."""
from __future__ import annotations


class FidelityError(Exception):
    """Base class: bad input, never a silent wrong number."""


class PackError(FidelityError):
    """A pack (checkpoint) is malformed or unsupported. Names the file and the tensor when known."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        where = []
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        if file is not None:
            where.append(f"file {self.file}")
        super().__init__(f"{message} [{', '.join(where)}]" if where else message)


class ConfigError(FidelityError):
    """A model config is missing a field or asks for something we do not support."""


class NonFiniteActivations(FidelityError):
    """NaN or Inf in the oracle's activations: after `layer` (None: the embeddings), in row index `row`."""

    def __init__(self, message: str, *, kind: str, layer: int | None, row: int, position: int):
        self.kind, self.layer, self.row, self.position = kind, layer, row, position
        super().__init__(message)
