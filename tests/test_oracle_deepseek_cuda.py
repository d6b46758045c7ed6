"""DeepSeek V3.2, V4 and V4.1 on CUDA equal the CPU oracle, float32 (1e-5 of the largest |logit|) and float64 (1e-10),
for every seed layout of the miniature V4 and V4.1 packs (testkit/minipacks_v4.py, minipacks_v41.py: the
committed tiny V4 in tests/fixtures/v4 and what is derived from it) and the tiny V3.2 models of
test_oracle_deepseek_v32.py, on rows past every boundary: the sliding window, many compression windows, at least
4 x index_topk compressed entries (V4, V4.1) or tokens (V3.2), so the indexers' top-k selects among many candidates.
Runs only where CUDA is available (the device machine)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fidelity import open_pack
from fidelity.oracle import Oracle
from fidelity.packs.exl3.encoder import EncodingCache
from testkit.minipacks_v4 import LAYOUTS, V4MiniSpec, write_all
from testkit.minipacks_v41 import V41_SPEC, build_native_v41, write_all_v41

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

V4_FIXTURES = Path(__file__).parent / "fixtures" / "v4"
LIMIT = {torch.float32: 1e-5, torch.float64: 1e-10}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])


def cuda_vs_cpu(pack, tokens: torch.Tensor, dtype: torch.dtype, label: str) -> float:
    """max |CUDA - CPU| / max |CPU| over all logits; prints where along the rows the gap appears."""
    cpu = Oracle(pack, dtype=dtype).logits(tokens)
    gpu = Oracle(pack, device="cuda", dtype=dtype).logits(tokens)
    assert not torch.backends.cuda.matmul.allow_tf32
    scale = cpu.abs().max()
    per_position = ((gpu - cpu).abs().amax(dim=-1) / scale).amax(dim=0)   # [T]
    over = (per_position > LIMIT[dtype]).nonzero().flatten().tolist()
    gap = per_position.max().item()
    print(f"{label} {str(dtype)[6:]} T={tokens.shape[1]}: CUDA vs CPU max |dlogit| / max |logit| = {gap:.3g}"
          + (f", over {LIMIT[dtype]:g} from position {over[0]} ({len(over)} positions)" if over else ""))
    assert scale > 1.0
    return gap


def long_rows(vocab: int, T: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(seed))


def v4_length(cfg: dict) -> int:
    """A row past the window and with >= 4 x index_topk CSA entries (and several HCA entries), not a whole number of
    windows."""
    ratios = cfg["compress_rates"]
    return max(4 * cfg["index_topk"] * ratios["compressed_sparse_attention"],
               4 * ratios["heavily_compressed_attention"], 4 * cfg["sliding_window"]) + 39


@pytest.fixture(scope="module")
def v4_packs(tmp_path_factory):
    native = V4_FIXTURES / "tiny_v4"
    packs = write_all(open_pack(native), tmp_path_factory.mktemp("v4cuda"), V4MiniSpec(),
                      EncodingCache(V4_FIXTURES / "tiny_v4_encodings.safetensors"))
    return {"native": native, **packs}


@pytest.fixture(scope="module")
def v41_packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41cuda")
    native = build_native_v41(V4_FIXTURES / "tiny_v4", root / "native")
    packs = write_all_v41(native, root / "packs", V41_SPEC,
                          EncodingCache(V4_FIXTURES / "tiny_v4_encodings.safetensors"))
    return {"native": native, **packs}


@DTYPES
@pytest.mark.parametrize("layout", ["native", *LAYOUTS])
def test_v4_cuda_equals_cpu(v4_packs, layout, dtype, rng_seed):
    pack = open_pack(v4_packs[layout])
    cfg = pack.config
    T = v4_length(cfg)
    assert T // cfg["compress_rates"]["compressed_sparse_attention"] >= 4 * cfg["index_topk"]
    assert cuda_vs_cpu(pack, long_rows(cfg["vocab_size"], T, rng_seed), dtype, f"V4 {layout}") <= LIMIT[dtype]


@DTYPES
@pytest.mark.parametrize("layout", ["native", *LAYOUTS])
def test_v41_cuda_equals_cpu(v41_packs, layout, dtype, rng_seed):
    pack = open_pack(v41_packs[layout])
    cfg = pack.config
    ratio = min(r for r in cfg["compress_ratios"] if r)
    T = 8 * cfg["index_topk"] * max(cfg["compress_ratios"]) + 4 * cfg["sliding_window"] + 7
    assert (
        T // ratio >= 4 * cfg["index_topk"] and T // ratio > cfg["candidate_topk_blocks"] * cfg["candidate_block_size"]
    )
    assert cuda_vs_cpu(pack, long_rows(cfg["vocab_size"], T, rng_seed), dtype, f"V4.1 {layout}") <= LIMIT[dtype]


@DTYPES
@pytest.mark.parametrize("case", ["default-rope", "yarn-no-renorm-two-dense"])
def test_v32_cuda_equals_cpu(tmp_path, case, dtype, rng_seed):
    T_ = pytest.importorskip("transformers")
    if not hasattr(T_, "DeepseekV32Config"):
        pytest.skip("missing tool: this transformers has no DeepSeek-V3.2")
    from test_oracle_deepseek_v32 import BASE, make
    _, pack = make(tmp_path, case, rng_seed)
    T = max(200, 4 * pack.config["index_topk"] + 3)
    assert cuda_vs_cpu(pack, long_rows(BASE["vocab_size"], T, rng_seed), dtype, f"V3.2 {case}") <= LIMIT[dtype]


@pytest.mark.parametrize("layout", ["native", "fp8-mxfp4", "deepseek_v41_exl3"])
@pytest.mark.parametrize("arch", ["V4", "V4.1"])
def test_deepseek_numerics_cuda_equals_cpu(v4_packs, v41_packs, arch, layout, rng_seed):
    """numerics "deepseek" (FP8/FP4 rounding, power-of-two scales from exponent bits; on the fp8-mxfp4 layout also the
    FP8-stored linears' inputs) rounds alike on both devices, in float64. In float32 it cannot be held to 1e-5: rounding
    onto the FP4/FP8 grids is discontinuous, so a GEMM's last-bit difference between the devices now and then moves a
    value across a rounding boundary (H200, 2026-12-01: V4.1 float32 3.5e-7 on one seed, 2.9e-2 on another; float64
    5e-16 on both)."""
    dtype = torch.float64
    pack = open_pack((v4_packs if arch == "V4" else v41_packs)[layout])
    tokens = long_rows(pack.config["vocab_size"], 103, rng_seed)
    cpu, gpu = (
        Oracle(pack, dtype=dtype, numerics="deepseek"),
        Oracle(pack, device="cuda", dtype=dtype, numerics="deepseek"),
    )
    want, got = cpu.logits(tokens), gpu.logits(tokens)
    exact = Oracle(pack, dtype=dtype).logits(tokens)
    gap = ((got - want).abs().max() / want.abs().max()).item()
    effect = ((want - exact).abs().max() / exact.abs().max()).item()
    print(
        f"{arch} {layout} {cpu.family.numerics_label} {str(dtype)[6:]}: CUDA vs CPU {gap:.3g}, "
        f"rounding moves {effect:.3g}"
    )
    assert gap <= LIMIT[dtype] and effect > 1e-4
