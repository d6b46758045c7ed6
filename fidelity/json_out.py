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
    """What json.dumps cannot write itself: numpy / torch scalars (np.float32 is no float) and other numbers as
    numbers (non-finite: null), anything else as its str()."""
    if hasattr(x, "item") and getattr(x, "shape", None) == ():
        x = x.item()
    elif hasattr(x, "__float__") and not isinstance(x, (str, bytes)):
        x = float(x)
    else:
        return str(x)
    return finite(x)


def dumps(obj, **kwargs) -> str:
    """json.dumps of `obj` as standard JSON (allow_nan=False after the non-finite floats became null)."""
    return json.dumps(finite(obj), allow_nan=False, default=_scalar, **kwargs)
