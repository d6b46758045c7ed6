import multiprocessing

import numpy as np
import pytest
import torch
from scipy.special import log_softmax

from fidelity.measuring.metrics import BLOCK, TOPK, naive_kld, position_metrics, topk_logprobs

KL_ATOL = 1e-12   # the kernel is float64 after the float32 inputs; scipy in float64 is the truth


def _scipy_reference(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> dict:
    a, b = a.astype(np.float64), b.astype(np.float64)
    lp, lq = log_softmax(a, -1), log_softmax(b, -1)
    p, q = np.exp(lp), np.exp(lq)
    srt = np.sort(a, -1)
    top_a, top_b = (np.argsort(-x, axis=-1, kind="stable")[:, :TOPK] for x in (a, b))   # first index on ties
    # in log space, so that logits thousands apart (p underflowing to 0 where q does not, or back) stay finite
    return {"kld": (p * (lp - lq)).sum(-1), "kld_reverse": (q * (lq - lp)).sum(-1),
            "ref_nll": -lp[np.arange(len(t)), t], "pack_nll": -lq[np.arange(len(t)), t],
            "ref_top1": a.argmax(-1), "pack_top1": b.argmax(-1), "ref_margin": srt[:, -1] - srt[:, -2],
            "ref_pmax": p.max(-1), "topk_match": np.cumprod(top_a == top_b, axis=1).sum(1)}


def _assert_matches_scipy(pm, a: torch.Tensor, b: torch.Tensor, t: torch.Tensor, kl_rtol: float = 1e-10):
    ref = _scipy_reference(a.float().numpy(), b.float().numpy(), t.numpy())
    for k in ("kld", "kld_reverse"):
        np.testing.assert_allclose(getattr(pm, k).numpy(), ref[k], rtol=kl_rtol, atol=KL_ATOL, err_msg=k)
    for k in ("ref_nll", "pack_nll"):
        np.testing.assert_allclose(getattr(pm, k).numpy(), ref[k], rtol=1e-12, atol=1e-11, err_msg=k)
    assert np.array_equal(pm.ref_margin.numpy(), ref["ref_margin"])  # a difference of two float32s: exact in float64
    np.testing.assert_allclose(pm.ref_pmax.numpy(), ref["ref_pmax"], rtol=1e-12)
    assert np.array_equal(pm.ref_top1.numpy(), ref["ref_top1"]) and np.array_equal(
        pm.pack_top1.numpy(), ref["pack_top1"]
    )
    assert np.array_equal(pm.topk_match.numpy(), ref["topk_match"])
    assert pm.finite.all()


def test_topk_match_counts_the_common_ordered_prefix(rng_seed):
    """The pack's top-5 list equals the reference's up to a swap of ranks j and j + 1 (or a tie the first index wins):
    exactly j leading entries agree; the top-K tokens sit in different blocks of the kernel's walk."""
    n, v = 24, 3 * BLOCK + 17
    a = torch.randn(n, v)
    b = a + torch.randn(n, v) * 1e-3
    want = np.empty(n, dtype=np.int64)
    for i in range(n):
        ids = torch.randperm(v)[:TOPK + 1]
        a[i, ids] = torch.arange(TOPK + 1, 0, -1, dtype=torch.float32) + 10     # ranks 0..5 at random places
        b[i, ids] = a[i, ids]
        j = i % (TOPK + 1)
        if j < TOPK:
            b[i, ids[j]], b[i, ids[j + 1]] = a[i, ids[j + 1]], a[i, ids[j]]
        want[i] = j
    t = torch.randint(0, v, (n,))
    pm = position_metrics(a, b, t)
    assert np.array_equal(pm.topk_match.numpy(), want)
    _assert_matches_scipy(position_metrics(a, b, t, reverse=True), a, b, t)
    tie = a.clone()
    tie[:, :TOPK] = 100.0       # five equal maxima: both lists are 0..4, first index first
    assert (position_metrics(tie, tie.clone(), t).topk_match == TOPK).all()


@pytest.mark.parametrize("vocab,noise", [(49152, 0.05), (1001, 0.5), (4096, 2.0), (3 * BLOCK + 5, 0.3)])
def test_position_metrics_match_scipy(rng_seed, vocab, noise):
    n = 37
    a = torch.randn(n, vocab) * 4
    b = a + torch.randn(n, vocab) * noise
    t = torch.randint(0, vocab, (n,))
    _assert_matches_scipy(position_metrics(a, b, t, reverse=True), a, b, t)


def test_tiny_kl_keeps_its_digits(rng_seed):
    """Near-identical distributions (KL ~5e-7, well under a bf16 noise floor): float64 digits, where the textbook
    float32 log_softmax-then-sum is off by ~1e-6."""
    n, v = 16, 49152
    a = torch.randn(n, v) * 3
    b = a + torch.randn(n, v) * 1e-3
    t = torch.randint(0, v, (n,))
    truth = _scipy_reference(a.numpy(), b.numpy(), t.numpy())["kld"]
    ours = position_metrics(a, b, t).kld.numpy()
    naive_err = np.abs(naive_kld(a, b).double().numpy() - truth)
    assert np.abs(ours - truth).max() < 1e-13
    assert naive_err.max() > 2e-7, "the float32 baseline is expected to lose these digits"


def test_large_magnitude_and_offset_logits(rng_seed):
    """Logits in the thousands, and a pack off by a constant 900 nats (the same distribution: KL 0 both ways), where a
    shared exp shift would underflow one side entirely."""
    n, v = 9, 3 * BLOCK + 100
    a = torch.randn(n, v) * 2000
    b = a + torch.randn(n, v) * 50
    t = torch.randint(0, v, (n,))
    _assert_matches_scipy(position_metrics(a, b, t, reverse=True), a, b, t, kl_rtol=1e-9)
    a = torch.round(torch.randn(n, v) * 3 * 64) / 64     # multiples of 1/64: a - 896 is exact in float32
    shifted = position_metrics(a, a - 896.0, t, reverse=True)
    _assert_matches_scipy(shifted, a, a - 896.0, t)
    assert shifted.kld.max() < 1e-13 and shifted.kld_reverse.max() < 1e-13


def test_max_in_every_block_position(rng_seed):
    """Online logsumexp: a row whose maximum rises in every block (each block rescales the sums), one whose maximum is
    the very last logit of a partial last block, one whose maximum is the first logit."""
    v = 4 * BLOCK + 7
    a = torch.randn(4, v)
    a[0] += torch.linspace(0, 40, v)           # rising: a new maximum in every block
    a[1, -1] = a[1].max() + 5
    a[2, 0] = a[2].max() + 5
    a[3, BLOCK - 1] = a[3, BLOCK] = a[3].max() + 1   # a tie across a block boundary: first index, margin 0
    b = a + 0.2 * torch.randn(4, v)
    t = torch.tensor([v - 1, 0, BLOCK, 17])
    pm = position_metrics(a, b, t, reverse=True)
    _assert_matches_scipy(pm, a, b, t)
    assert pm.ref_top1[1] == v - 1 and pm.ref_top1[2] == 0 and pm.ref_top1[3] == BLOCK - 1 and pm.ref_margin[3] == 0


def test_near_ties_resolve_like_argmax(rng_seed):
    """Runner-up one float32 ulp below the top, exact ties inside a block and across blocks: top-1 is the first index
    (torch.argmax, numpy.argmax), the margin is the exact float64 difference of the two float32 logits."""
    v = 2 * BLOCK + 64
    a = torch.randn(5, v)
    top = float(np.float32(a.max() + 1))
    below = float(np.nextafter(np.float32(top), np.float32(-np.inf)))
    a[0, 70], a[0, 5] = top, below                        # 1-ulp margin in one block
    a[1, BLOCK + 3], a[1, 9] = top, below                 # 1-ulp margin across blocks
    a[2, 130], a[2, 131] = top, top                       # tie inside a block
    a[3, 2 * BLOCK + 1], a[3, 40] = top, top              # tie across blocks, the later block is partial
    a[4, 200] = top                                       # a clear winner
    pm = position_metrics(a, a.clone(), torch.zeros(5, dtype=torch.long))
    assert pm.ref_top1.tolist() == [70, BLOCK + 3, 130, 40, 200]
    assert torch.equal(pm.ref_top1, torch.argmax(a, -1)) and torch.equal(pm.ref_top1, pm.pack_top1)
    assert pm.ref_margin[:4].tolist() == [top - below, top - below, 0.0, 0.0]
    assert pm.kld.abs().max() < 1e-15
    flip = a.clone()
    flip[0, 5] = top                                      # now a tie: first index 5 wins on the pack side
    pm = position_metrics(a, flip, torch.zeros(5, dtype=torch.long))
    assert pm.pack_top1[0] == 5 and pm.ref_top1[0] == 70 and not pm.top1_agree[0]


def test_copy_chunks_threads_and_dtypes_do_not_change_results(rng_seed):
    """bf16 inputs go through the chunked copy path (N not a multiple of the copy chunk); the per-row kernel gives the
    same bits whatever the chunking or the thread count."""
    n, v = 53, 2 * BLOCK + 11
    a, b = torch.randn(n, v) * 3, torch.randn(n, v) * 3
    t = torch.randint(0, v, (n,))
    whole = position_metrics(a, b, t, reverse=True)
    chunked = position_metrics(a.t().contiguous().t(), b, t, reverse=True, copy_elements=7 * v)   # non-contiguous input
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = position_metrics(a, b, t, reverse=True)
        torch.set_num_threads(3)
        three = position_metrics(a, b, t, reverse=True)
    finally:
        torch.set_num_threads(threads)
    for other in (chunked, one_thread, three):
        for k in ("kld", "kld_reverse", "ref_nll", "pack_nll", "ref_margin", "ref_pmax", "ref_top1", "pack_top1"):
            assert torch.equal(getattr(whole, k), getattr(other, k)), k
    a16, b16 = a.bfloat16(), b.bfloat16()
    from_bf16 = position_metrics(a16, b16, t, reverse=True, copy_elements=5 * v)
    _assert_matches_scipy(from_bf16, a16, b16, t)
    assert torch.equal(from_bf16.kld, position_metrics(a16.float(), b16.float(), t).kld)


def _kld_in_child(a, b, t, queue):
    torch.set_num_threads(2)
    queue.put(position_metrics(a, b, t).kld.numpy())   # numpy: torch would share the tensor through a file descriptor


def test_forked_child_gets_its_own_threads(rng_seed):
    """The kernel's thread pool does not survive fork(); a child that inherited it must still finish."""
    a, b = torch.randn(8, 300), torch.randn(8, 300)
    t = torch.randint(0, 300, (8,))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        parent = position_metrics(a, b, t).kld          # the parent's pool now exists
    finally:
        torch.set_num_threads(threads)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_kld_in_child, args=(a, b, t, queue))
    child.start()
    try:
        got = queue.get(timeout=60)
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0 and np.array_equal(got, parent.numpy())


def test_nonfinite_positions_are_flagged_not_averaged(rng_seed):
    n, v = 10, BLOCK + 300
    a = torch.randn(n, v)
    b = a + 0.1 * torch.randn(n, v)
    b[2, 17] = float("nan")
    b[5, 3] = float("inf")
    a[6, 9] = float("nan")
    a[7, BLOCK + 5] = float("-inf")                 # -inf on one side only: infinite KL, excluded
    a[8, 40], b[8, 40] = float("-inf"), float("-inf")
    b[9, :] = float("nan")
    t = torch.randint(0, v, (n,))
    pm = position_metrics(a, b, t, reverse=True)
    bad = [2, 5, 6, 7, 8, 9]
    assert (~pm.finite).nonzero()[:, 0].tolist() == bad
    for k in ("kld", "kld_reverse", "ref_nll", "pack_nll", "ref_margin", "ref_pmax"):
        assert torch.isnan(getattr(pm, k)[~pm.finite]).all(), k
    good = pm.finite.nonzero()[:, 0]
    _assert_matches_scipy(pm.select(good), a[good], b[good], t[good])   # the bad rows leave the others untouched


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"reference \[2, 5\] and pack \[2, 6\]"):
        position_metrics(torch.zeros(2, 5), torch.zeros(2, 6), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        position_metrics(torch.zeros(2, 5), torch.zeros(2, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target token 5 at position 1 is outside the vocabulary of 5"):
        position_metrics(torch.zeros(3, 5), torch.zeros(3, 5), torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match=r"target token -1 at position 0"):
        position_metrics(torch.zeros(3, 5), torch.zeros(3, 5), torch.tensor([-1, 0, 1]))


def test_no_positions():
    pm = position_metrics(torch.zeros(0, 7), torch.zeros(0, 7), torch.zeros(0, dtype=torch.long), reverse=True)
    assert len(pm) == 0 and pm.kld.dtype == torch.float64 and pm.ref_top1.dtype == torch.int64


def test_topk_logprobs_match_scipy(rng_seed):
    x = torch.randn(4, 300) * 3
    ids, lp = topk_logprobs(x, 20)
    ref = log_softmax(x.double().numpy(), -1)
    order = np.argsort(-ref, -1)[:, :20]
    assert np.array_equal(ids.numpy(), order)
    np.testing.assert_allclose(lp.numpy(), np.take_along_axis(ref, order, -1), atol=2e-6)


def test_the_cpu_kernels_exp_is_good_to_the_last_bits(rng_seed):
    """The CPU kernel's float64 exp (metrics._exp_nonpositive, the reference every device path is held to) against
    libm's through numpy (<= 1 ulp): within 2 ulp over [-700, 0], the ends of its reduction interval included. Its
    Taylor series stopped at r^10 until 2026-12-05: 3e-13 relative near |r| = ln2/2, which made the device kernel's
    p(top-1) miss the CPU's at rtol 1e-13 now and then."""
    import numba
    from fidelity.measuring import metrics

    @numba.njit
    def exps(x):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = metrics._exp_nonpositive(x[i])
        return out
    rng = np.random.default_rng(rng_seed)
    ln2 = np.log(2.0)
    k = rng.integers(-1000, 1, 20_000)
    edges = (k * ln2 + rng.choice([-0.5, 0.5], k.size) * ln2 * (1 - rng.random(k.size) * 1e-3))   # |r| near ln2/2
    x = np.concatenate([-700 * rng.random(200_000), -30 * rng.random(200_000), edges[edges >= -700], [0.0, -700.0]])
    np.testing.assert_allclose(exps(x), np.exp(x), rtol=4.5e-16, atol=0)
