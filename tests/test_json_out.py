"""Reports are standard JSON: non-finite numbers become null, numpy / torch scalars numbers (fidelity.json_out)."""
import json
import math

import numpy as np
import pytest
import torch

from fidelity import json_out


def strict_loads(text):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def test_nonfinite_numbers_become_null_at_any_depth(rng_seed):
    rng = np.random.default_rng(rng_seed)
    values = rng.normal(size=12).tolist()
    holes = sorted(rng.choice(12, size=4, replace=False).tolist())
    for i, bad in zip(holes, (math.nan, math.inf, -math.inf, float("nan"))):
        values[i] = bad
    doc = {"a": values[:4], "b": {"c": tuple(values[4:8]), "d": [{"e": v} for v in values[8:]]}, "s": "NaN", "n": None}
    with pytest.raises(ValueError):            # what json.dumps would have written is refused by a strict parser
        strict_loads(json.dumps(doc))
    back = strict_loads(json_out.dumps(doc))
    flat = back["a"] + back["b"]["c"] + [x["e"] for x in back["b"]["d"]]
    assert [i for i, v in enumerate(flat) if v is None] == holes
    assert all(v == values[i] for i, v in enumerate(flat) if v is not None)   # finite values round-trip exactly
    assert back["s"] == "NaN" and back["n"] is None


def test_numpy_and_torch_scalars_are_numbers_not_strings(rng_seed):
    x = float(np.random.default_rng(rng_seed).normal())
    doc = {
        "f32": np.float32(x),
        "i64": np.int64(7),
        "t": torch.tensor(x, dtype=torch.float64),
        "bad32": np.float32("nan"),
        "tbad": torch.tensor(float("inf")),
        "b": np.bool_(True),
        "path": __import__("pathlib").Path("/x"),
    }
    back = strict_loads(json_out.dumps(doc))
    assert back["f32"] == float(np.float32(x)) and isinstance(back["f32"], float)
    assert back["i64"] == 7 and back["t"] == x
    assert back["bad32"] is None and back["tbad"] is None
    assert back["b"] is True and back["path"] == "/x"
