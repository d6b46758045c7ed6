"""EXL3 decoder against exllamav3 1.6.5's CUDA kernels (golden data in ../shared/golden/exl3, else the committed subset:
tests/_golden.py) and against an independent numpy re-implementation of the bitstream on fresh random trellises."""
import numpy as np
import pytest
import scipy.linalg
import torch

import _golden
from fidelity import PackError
from fidelity.packs.exl3 import codec

LINEAR_CODEBOOKS = ["3inst", "mul1"]


def _prefixes(d: _golden.Golden) -> list[str]:
    return sorted(k[: -len(".trellis")] for k in d.keys() if k.endswith(".trellis"))


def _fp16_ulp(x: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(x.abs().double().clamp(min=2.0 ** -14))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 11)


@pytest.mark.parametrize("codebook", codec.CODEBOOKS)
def test_codebook_bit_exact(codebook):
    g = _golden.exl3_codebooks()
    assert g.same_bits("states", torch.arange(65536).to(torch.int16))   # every 16-bit state, in order
    assert g.same_bits(f"codebook.{codebook}", codec.codebook_values(codebook).half())


@pytest.mark.parametrize("codebook", LINEAR_CODEBOOKS)
def test_inner_tiles_bit_exact(codebook):
    d = _golden.exl3_linears(codebook)
    prefixes = _prefixes(d)
    rates = set()
    for p in prefixes:
        inner = codec.decode_inner(d[p + ".trellis"], codebook)
        assert inner.dtype == torch.float32
        assert d.same_bits(p + ".inner", inner.half()), p
        assert torch.equal(inner.half().float(), inner), p      # fp16 values held exactly
        rates.add(codec.bitrate_from_trellis(tuple(d[p + ".trellis"].shape), codebook).K)
    expected = set(range(1, 9)) | ({1.5, 2.5, 3.5} if codebook == "mul1" else set())
    assert rates == expected


def _numpy_exact_rebuild(inner: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> np.ndarray:
    """Independent float64 rebuild: W = diag(suh) Hb Q Hb diag(svh), Hb = blockdiag(scipy Hadamard(128)) / sqrt(128)."""
    q = inner.double().numpy()
    k, n = q.shape
    h = scipy.linalg.hadamard(128).astype(np.float64)
    w = np.einsum("ij,bjn->bin", h, q.reshape(k // 128, 128, n)).reshape(k, n)
    w = np.einsum("kbj,ji->kbi", w.reshape(k, n // 128, 128), h).reshape(k, n) / 128.0
    return w * suh.double().numpy()[:, None] * svh.double().numpy()[None, :]


def _fp16_steps(inner: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """exllamav3's LinearEXL3.get_weight_tensor steps (fp32 Hadamard matmuls, fp16 in between), re-done here."""
    h = torch.from_numpy(scipy.linalg.hadamard(128)).float() / 128 ** 0.5
    k, n = inner.shape
    x = (h @ inner.half().float().view(k // 128, 128, n)).view(k, n).half()
    x = x * suh[:, None]
    x = (x.float().view(k, n // 128, 128) @ h).view(k, n).half()
    return x * svh[None, :]


@pytest.mark.parametrize("codebook", LINEAR_CODEBOOKS)
def test_full_weight_against_exllamav3_recon(codebook):
    d = _golden.exl3_linears(codebook)
    worst_ulps = 0.0
    for p in _prefixes(d):
        tr, suh, svh = d[p + ".trellis"], d[p + ".suh"], d[p + ".svh"]
        w = codec.decode_weight(tr, suh, svh, codebook)            # torch layout [out, in]
        in_f, out_f = d.shape(p + ".recon")
        assert w.shape == (out_f, in_f)
        inner = codec.decode_inner(tr, codebook).half()
        assert d.same_bits(p + ".inner", inner), p                 # exllamav3's Q (the subset holds its digest)
        exact = _numpy_exact_rebuild(inner, suh, svh).T
        spacing = np.spacing(np.abs(exact).astype(np.float32))
        assert np.all(np.abs(w.double().numpy() - exact) <= spacing), p    # fp32 precision of the exact value
        # exllamav3 rounds to fp16 after each of its four steps: redoing those steps on our Q gives its bits ...
        recon = _fp16_steps(inner, suh, svh)
        assert d.same_bits(p + ".recon", recon), p
        # ... and our exact weight sits within two fp16 ulps (at the tensor's largest magnitude) of it (exllamav3's
        # recon, whose bits `recon` was just found to have)
        ulps = ((w.t().double() - recon.double()).abs().max() / _fp16_ulp(recon.abs().max())).item()
        worst_ulps = max(worst_ulps, ulps)
    assert worst_ulps <= 2.0, worst_ulps


def _numpy_reference_inner(trellis: np.ndarray, K: float, table: np.ndarray) -> np.ndarray:
    """Independent bit-level decoder: explode each tile into its ring of bits, read 16-bit windows."""
    kt, nt, width = trellis.shape
    base = int(K)
    steps = np.array([base + (t % 2 if K != base else 0) for t in range(256)])
    ends = np.cumsum(steps)
    n_bits = width * 16
    words32 = trellis.astype(np.uint16).reshape(kt, nt, width // 2, 2)
    words32 = words32[..., 0].astype(np.uint32) | (words32[..., 1].astype(np.uint32) << 16)
    bits = np.unpackbits(words32.astype(">u4").view(np.uint8).reshape(kt, nt, -1), axis=-1)   # MSB first
    out = np.zeros((kt * 16, nt * 16), dtype=np.float32)
    weights = 1 << np.arange(15, -1, -1)
    for t in range(256):
        idx = (ends[t] - 16 + np.arange(16)) % n_bits
        state = (bits[..., idx] * weights).sum(-1)
        lane, j = divmod(t, 8)
        r = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
        c = lane // 4 + 8 * (j >> 2)
        out[r::16, c::16] = table[state]
    return out


@pytest.mark.parametrize("codebook,K", [("3inst", 1), ("mcg", 3), ("mul1", 2.5), ("3inst", 5), ("mul1", 8), ("mcg", 7)])
def test_random_trellis_matches_independent_decoder(rng_seed, codebook, K):
    g = _golden.exl3_codebooks()
    table = codec.codebook_values(codebook).half()
    assert g.same_bits(f"codebook.{codebook}", table)             # exllamav3's table, bit for bit
    table = table.float().numpy()
    width = codec.Bitrate.of(K).words
    tr = torch.randint(-32768, 32768, (3, 2, width), dtype=torch.int16)
    ours = codec.decode_inner(tr, codebook)
    ref = _numpy_reference_inner(tr.numpy(), K, table)
    assert np.array_equal(ours.numpy(), ref)


def test_padding_cut_and_layout(rng_seed):
    tr = torch.randint(-32768, 32768, (16, 8, 48), dtype=torch.int16)     # padded [256 in, 128 out]
    suh, svh = torch.randn(256).half(), torch.randn(128).half()
    full = codec.decode_weight(tr, suh, svh, "3inst")
    cut = codec.decode_weight(tr, suh, svh, "3inst", shape=(100, 200))
    assert full.shape == (128, 256) and cut.shape == (100, 200)
    assert torch.equal(cut, full[:100, :200])
    exact = _numpy_exact_rebuild(codec.decode_inner(tr, "3inst"), suh, svh)
    assert np.allclose(cut.double().numpy(), exact[:200, :100].T, rtol=2 ** -23, atol=0)


def test_legacy_sign_bitfield(rng_seed):
    signs = torch.randint(0, 2, (256,)) * 2 - 1
    words = np.zeros(16, dtype=np.uint16)
    for i, s in enumerate(signs.tolist()):
        if s < 0:
            words[i // 16] |= np.uint16(1 << (i % 16))
    bitfield = torch.from_numpy(words.view(np.int16).copy())
    assert torch.equal(codec.unpack_sign_bits(bitfield).float(), signs.float())


@pytest.mark.parametrize("width,needle", [(20, "not divisible by 16"), (144, "K=9, outside 1..8"), (0, "K=0")])
def test_bad_trellis_width_names_tensor_and_file(width, needle):
    tr = torch.zeros((8, 8, width), dtype=torch.int16)
    with pytest.raises(PackError, match=needle) as e:
        codec.decode_weight(
            tr, torch.ones(128).half(), torch.ones(128).half(), "3inst", file="x.safetensors", tensor="a.trellis"
        )
    assert "a.trellis" in str(e.value) and "x.safetensors" in str(e.value)


def test_half_rate_needs_mul1():
    tr = torch.zeros((8, 8, 24), dtype=torch.int16)
    with pytest.raises(PackError, match="mul1"):
        codec.decode_inner(tr, "3inst", tensor="t")
    assert codec.decode_inner(tr, "mul1").shape == (128, 128)


@pytest.mark.device
def test_decodes_on_cuda_like_cpu(rng_seed):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tr = torch.randint(-32768, 32768, (16, 16, 64), dtype=torch.int16)
    suh, svh = torch.randn(256).half(), torch.randn(256).half()
    cpu = codec.decode_weight(tr, suh, svh, "mul1")
    gpu = codec.decode_weight(tr.cuda(), suh.cuda(), svh.cuda(), "mul1")
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
