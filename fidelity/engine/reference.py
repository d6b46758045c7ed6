"""The reference store (written by `fidelity reference`) as a gate `Reference`: token ids, scored positions and the oracle's full
log-distributions re-derived from the stored final hidden states."""
from __future__ import annotations

from ..errors import FidelityError


def reference_from_store(store_dir: str):
    try:
        from .. import store  # noqa: F401
    except ImportError:
        raise FidelityError(f"reading reference store {store_dir} needs fidelity.store, which this build lacks")
    raise FidelityError(f"reference store {store_dir}: the store reader is not wired to the gate yet")
