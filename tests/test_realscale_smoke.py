"""benchmarks/realscale.py --smoke runs every step on the CPU (tiny V4 / V4.1 layers in the seeds' storage, the head +
metrics step); the layers' outputs are finite and every head position is measured."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_realscale_smoke_runs_on_the_cpu(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import realscale
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert realscale.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "realscale.json").read_text())
    assert [x["arch"] for x in r["layers"]] == ["v4", "v41"]
    for layer in r["layers"]:
        assert layer["finite"] and sum(layer["expert_k_mix"].values()) == layer["experts"] and layer["compute_s"] > 0
    assert r["head"]["finite_positions"] == r["head"]["positions"] == 256


@pytest.mark.slow
def test_realscale_pipeline_smoke_builds_every_layer_and_prefetch_changes_nothing(tmp_path):
    """--layers 3: a 3-layer V4 and V4.1 in the seeds' storage, one pass through the Prefetcher and one with every layer
    resident; both passes give the same hidden states bit for bit and every layer went through the loader thread."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import realscale
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert (
        realscale.main(
            ["--smoke", "--device", "cpu", "--layers", "3", "--eager-experts", "--skip-head", "--out", str(tmp_path)]
        )
        == 0
    )
    r = json.loads((tmp_path / "realscale.json").read_text())
    assert r["layers"] == [] and [x["arch"] for x in r["pipeline"]] == ["v4", "v41"]
    for p in r["pipeline"]:
        assert p["layers"] == 3 and [x["layer"] for x in p["per_layer"]] == [0, 1, 2]
        assert p["prefetch_equals_resident"] and p["finite"] and p["eager_experts"]["equals_prefetch"]
        assert all(x["build_s"] > 0 and x["span_resident_s"] > 0 for x in p["per_layer"])
