"""Reports as standard JSON: every non-finite float written as null (json.dumps would write NaN / Infinity, which JSON
parsers outside Python refuse), numpy and torch scalars as numbers, anything else unknown as its str()."""
from __future__ import annotations

import json
import math


def finite(x):
    """`x` with every non-finite float (nested in dicts, lists, tuples) replaced by None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def _scalar(x):
    if hasattr(x, "item") and getattr(x, "shape", None) == ():        # numpy / torch scalars (np.float32 is no float)
        v = x.item()
        return finite(v) if isinstance(v, float) else v
    if hasattr(x, "__float__") and not isinstance(x, (str, bytes)):
        return finite(float(x))
    return str(x)


def dumps(obj, **kwargs) -> str:
    """json.dumps of `obj` as standard JSON (allow_nan=False after the non-finite floats became null)."""
    return json.dumps(finite(obj), allow_nan=False, default=lambda x: finite(_scalar(x)), **kwargs)
