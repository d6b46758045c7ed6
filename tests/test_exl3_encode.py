"""The reference EXL3 encoder: valid tail-biting trellises, decodable by our decoder, with error within 1.5x of
exllamav3 1.6.5's own quantizer on the golden linears (../shared/golden/exl3; the CPU case is also in the committed
subset, tests/_golden.py)."""
import sys
from pathlib import Path

import pytest
import torch

import _golden
from fidelity.packs.exl3 import encoder as exl3_encoder
from fidelity.packs.exl3 import codec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from exl3_encoder_vs_exllamav3 import SHAPES, errors, golden_hessian  # noqa: E402


@pytest.mark.parametrize("codebook,K", [("mul1", 2), ("3inst", 3), ("mul1", 2.5)])
def test_viterbi_ring_is_consistent_and_good(rng_seed, codebook, K):
    rate = codec.Bitrate.of(K)
    x = torch.randn(2, 256)
    states = exl3_encoder.viterbi_tiles(x, rate, codebook)
    trellis = codec.pack_states(states, rate)
    assert trellis.shape == (2, rate.words)
    assert torch.equal(codec.trellis_states(trellis, rate), states)      # every window continues the previous one
    q = codec.codebook_values(codebook)[states]
    rel = ((q - x).pow(2).mean() / x.pow(2).mean()).item()
    # Gaussian rate-distortion bound 4^-K (up to the sample's fluctuation); trellis codes get within ~1.3x of it
    assert 0.85 * 4.0 ** -K < rel < 1.6 * 4.0 ** -K, rel


def _golden_case(codebook: str, K: float, shape: str):
    d = _golden.exl3_linears(codebook)
    prefix = f"k{K:g}".replace(".", "p") + f".{codebook}.{shape}."
    w = d[f"weight.{shape}"].float()
    theirs = d[f"{prefix}recon"].float()[: w.shape[0], : w.shape[1]]
    meta = d.meta["entries"][prefix]
    return w, theirs, meta


def _check_against_exllamav3(codebook, K, shape, device, hessian: bool):
    w, theirs, meta = _golden_case(codebook, K, shape)
    H = golden_hessian(SHAPES.index(shape), w.shape[0])
    mse_x, proxy_x = errors(w, theirs, H)
    # the rebuilt Hessian is exllamav3's: its recorded proxy error (of the unrounded weight) is reproduced
    assert abs(proxy_x - meta["proxy_err"]) < 0.05 * meta["proxy_err"] + 1e-6
    enc = exl3_encoder.encode(w.t().to(device), K, codebook, hessian=H.to(device) if hessian else None)
    t = {k: v.cpu() for k, v in enc.tensors.items()}
    assert t["trellis"].shape[-1] == codec.Bitrate.of(K).words and ("mul1" in t) == (codebook == "mul1")
    ours = codec.decode_weight(t["trellis"], t["suh"], t["svh"], codebook, shape=(w.shape[1], w.shape[0]))
    assert torch.equal(ours, enc.weight.cpu())
    mse, proxy = errors(w, ours.t(), H)
    if hessian:
        assert proxy < 1.5 * proxy_x, (proxy, proxy_x)
    else:
        assert mse < 1.5 * mse_x, (mse, mse_x)
    return mse / mse_x, proxy / proxy_x


@pytest.mark.slow
def test_encoder_within_1p5x_of_exllamav3_on_cpu():
    ratio, _ = _check_against_exllamav3("mul1", 4, "s256x128", "cpu", hessian=False)
    print(f"ours/exllamav3 weight MSE at K=4 mul1: {ratio:.3f}")


@pytest.mark.device
@pytest.mark.parametrize("codebook", ["3inst", "mul1"])
def test_encoder_within_1p5x_of_exllamav3_every_golden_linear(codebook):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the full sweep is a GPU test (the CPU runs one case, above)")
    Ks = list(range(1, 9)) + ([1.5, 2.5, 3.5] if codebook == "mul1" else [])
    for K in Ks:
        for shape in SHAPES:
            for hessian in (False, True):
                _check_against_exllamav3(codebook, K, shape, "cuda", hessian)
