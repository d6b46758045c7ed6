"""benchmarks/metric_kernel_roofline.py on the CPU in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET):
every kernel variant it times (lists of 5 and of 2 per lane, 0-2 blocks ahead) agrees with the float64 torch path and
bit for bit with every other variant, at a vocabulary with a partial last block."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the script runs compiled (benchmarks/RESULTS.md)")
def test_roofline_variants_agree_in_the_interpreter(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import metric_kernel_roofline
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert metric_kernel_roofline.main(["--device", "cpu", "--positions", "3", "--vocab", "1100", "--configs",
                                        "256x4", "--repeat", "1", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "metric_kernel_roofline.json").read_text())["rows"][0]
    variants = [f"kernel_{lists}{ahead}" for lists in ("top5", "top2") for ahead in ("", "_prefetch", "_ahead2")]
    for name in variants:
        assert row[f"{name}_max_kl_diff_vs_torch"] < 1e-13, name
        assert row[f"{name}_top1_topk_equal_torch"], name
    assert all(row[f"{name}_bit_identical"] for name in variants[1:])
    assert not [k for k in row if k.endswith("_error")]
