"""benchmarks/kernel_sass.py compiles the metric kernel for an H200 (sm_90) on this machine with Triton's own ptxas:
the default variant (the one every device pass runs) keeps everything in registers (no local memory: spills would cost
the kernel the memory bandwidth it is measured by), and the fingerprint it prints follows the source."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("triton")


def _run(*args: str) -> str:
    # a process of its own: conftest set TRITON_INTERPRET before this one imported Triton, so nothing compiles here
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), *args], capture_output=True,
                         text=True, env=env, timeout=900)
    if run.returncode != 0 and ("backends" in run.stderr or "ptxas" in run.stderr or "cuobjdump" in run.stderr):
        pytest.skip(f"missing tool: cannot compile for sm_90 here (Triton's ptxas, cuobjdump): {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def _fingerprint(source: Path) -> str:
    rows = [line for line in _run("--default-only", "--source", str(source)).splitlines() if line.startswith("| 512 |")]
    assert len(rows) == 1, rows
    return rows[0]


@pytest.mark.slow
def test_default_metric_kernel_compiles_for_sm90_without_spills(tmp_path):
    from fidelity.measuring.metrics import MetricKernel
    kernel = MetricKernel()
    assert (kernel.block, kernel.topk, kernel.shift, kernel.prefetch) == (
        512,
        "fused-top2",
        "fixed",
        2,
    )  # the variant the script calls default (with the kernel's switches)
    source = ROOT / "fidelity" / "measuring" / "metrics_triton.py"
    got = _fingerprint(source)
    assert " LOCAL:0 " in got, got
    # one changed operation in the source changes the machine code: the fingerprint is this kernel's
    edited = tmp_path / "metrics_triton.py"
    text = source.read_text()
    line = "tl.store(o + 2, best_a.to(tl.float64) - runner_up.to(tl.float64))"
    assert line in text
    edited.write_text(text.replace(line, line.replace(" - ", " + ")))
    assert _fingerprint(edited) != got


@pytest.mark.slow
def test_exl3_decode_kernel_compiles_for_sm90_without_spills():
    """Every codebook and K 2-5 of the fused EXL3 decode: all in registers (it sits at the 255-register limit, so a
    change that needs more would spill to local memory)."""
    rows = [line for line in _run("--kernel", "exl3").splitlines() if line.startswith("| 3inst") or
            line.startswith("| mcg") or line.startswith("| mul1")]
    assert len(rows) == 12, rows
    assert all(" LOCAL:0 " in row for row in rows), rows
