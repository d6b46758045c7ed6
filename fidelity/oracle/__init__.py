"""The oracle: an exact fp32 reference forward, streamed layer by layer, for every architecture family we support.

    from fidelity.oracle import Oracle
    oracle = Oracle(pack, device="cpu")
    logits = oracle.logits(tokens)                 # [B, T] -> [B, T, vocab], float32
    hidden = oracle.hidden_states(rows)            # list of [T_i, hidden] after the final norm
    for where, chunk in oracle.iter_logits(h): ... # the head, chunk by chunk
    with oracle.tapped(OracleTaps(routing_counts=counts)): ...   # observers of the passes inside
"""
from __future__ import annotations

from .common import Family, OracleTaps
from .families import ARCHITECTURES, family_for, supported_architectures
from .runner import LoadChain, Oracle

__all__ = ["Oracle", "LoadChain", "OracleTaps", "ARCHITECTURES", "supported_architectures", "family_for", "Family"]
