import numpy as np
import pytest
import torch
from scipy.special import log_softmax, rel_entr, softmax

from fidelity.metrics import naive_kld, position_metrics, topk_logprobs


def _scipy_reference(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> dict:
    a, b = a.astype(np.float64), b.astype(np.float64)
    p, q = softmax(a, -1), softmax(b, -1)
    srt = np.sort(a, -1)
    return {"kld": rel_entr(p, q).sum(-1), "kld_reverse": rel_entr(q, p).sum(-1),
            "ref_nll": -log_softmax(a, -1)[np.arange(len(t)), t], "pack_nll": -log_softmax(b, -1)[np.arange(len(t)), t],
            "ref_top1": a.argmax(-1), "pack_top1": b.argmax(-1), "ref_margin": srt[:, -1] - srt[:, -2],
            "ref_pmax": p.max(-1)}


@pytest.mark.parametrize("vocab,noise", [(49152, 0.05), (1001, 0.5), (4096, 2.0)])
def test_position_metrics_match_scipy(rng_seed, vocab, noise):
    n = 37
    a = torch.randn(n, vocab) * 4
    b = a + torch.randn(n, vocab) * noise
    t = torch.randint(0, vocab, (n,))
    pm = position_metrics(a, b, t, reverse=True, chunk_elements=5 * vocab)
    ref = _scipy_reference(a.numpy(), b.numpy(), t.numpy())
    # float32 inputs: first-order sums of size ~|a - b| cancel to a second-order KL, so the floor grows with the noise
    for k in ("kld", "kld_reverse"):
        np.testing.assert_allclose(getattr(pm, k).numpy(), ref[k], rtol=1e-4, atol=1e-9 + 3e-6 * noise**2, err_msg=k)
        np.testing.assert_allclose(getattr(pm, k).numpy().mean(), ref[k].mean(), rtol=2e-5, err_msg=k)
    for k in ("ref_nll", "pack_nll", "ref_margin"):
        np.testing.assert_allclose(getattr(pm, k).numpy(), ref[k], rtol=1e-6, atol=2e-6, err_msg=k)
    np.testing.assert_allclose(pm.ref_pmax.numpy(), ref["ref_pmax"], rtol=1e-6)
    assert np.array_equal(pm.ref_top1.numpy(), ref["ref_top1"]) and np.array_equal(pm.pack_top1.numpy(), ref["pack_top1"])
    assert pm.finite.all()


def test_tiny_kl_keeps_its_digits(rng_seed):
    """Near-identical distributions (KL ~5e-7, well under a bf16 noise floor): ~1e-8 absolute error, where the textbook
    float32 log_softmax-then-sum is off by ~1e-6."""
    n, v = 16, 49152
    a = torch.randn(n, v) * 3
    b = a + torch.randn(n, v) * 1e-3
    t = torch.randint(0, v, (n,))
    truth = _scipy_reference(a.numpy(), b.numpy(), t.numpy())["kld"]
    ours = position_metrics(a, b, t).kld.numpy()
    naive_err = np.abs(naive_kld(a, b).double().numpy() - truth)
    assert np.abs(ours - truth).max() < 5e-8
    assert naive_err.max() > 2e-7, "the float32 baseline is expected to lose these digits"
    assert abs(ours.mean() - truth.mean()) < 1e-2 * truth.mean()


def test_chunking_does_not_change_results(rng_seed):
    n, v = 50, 2048
    a, b = torch.randn(n, v), torch.randn(n, v)
    t = torch.randint(0, v, (n,))
    one = position_metrics(a, b, t, chunk_elements=v)
    many = position_metrics(a, b, t, chunk_elements=7 * v)
    assert torch.equal(one.kld, many.kld) and torch.equal(one.pack_nll, many.pack_nll)


def test_ties_and_first_index(rng_seed):
    v = 640
    a = torch.randn(3, v)
    top = a.max() + 1
    a[0, 70], a[0, 5] = top, top            # exact tie across blocks: first index wins, margin 0
    a[1, 130], a[1, 131] = top, top          # tie inside one block
    pm = position_metrics(a, a.clone(), torch.zeros(3, dtype=torch.long))
    assert pm.ref_top1.tolist()[:2] == [5, 130]
    assert pm.ref_margin[:2].tolist() == [0.0, 0.0]
    assert torch.equal(pm.ref_top1, pm.pack_top1) and pm.kld.abs().max() < 1e-12


def test_nonfinite_positions_are_flagged_not_averaged(rng_seed):
    n, v = 8, 512
    a = torch.randn(n, v)
    b = a + 0.1 * torch.randn(n, v)
    b[2, 17] = float("nan")
    b[5, 3] = float("inf")
    a[6, 9] = float("nan")
    pm = position_metrics(a, b, torch.randint(0, v, (n,)), reverse=True)
    assert pm.finite.tolist() == [True, True, False, True, True, False, False, True]
    assert torch.isnan(pm.kld[~pm.finite]).all() and torch.isfinite(pm.kld[pm.finite]).all()


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"reference \[2, 5\] and pack \[2, 6\]"):
        position_metrics(torch.zeros(2, 5), torch.zeros(2, 6), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        position_metrics(torch.zeros(2, 5), torch.zeros(2, 5), torch.zeros(3, dtype=torch.long))


def test_topk_logprobs_match_scipy(rng_seed):
    x = torch.randn(4, 300) * 3
    ids, lp = topk_logprobs(x, 20)
    ref = log_softmax(x.double().numpy(), -1)
    order = np.argsort(-ref, -1)[:, :20]
    assert np.array_equal(ids.numpy(), order)
    np.testing.assert_allclose(lp.numpy(), np.take_along_axis(ref, order, -1), atol=2e-6)
