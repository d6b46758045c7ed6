"""The metrics on the logits' device (fidelity.measuring.metrics.device_metrics_columns: plain torch, and the Triton
kernel) agree with scipy in float64 and with the CPU kernel to float64 rounding; top-1 ids and margins are the same
numbers; compare's device head+metrics step (store.device_row_metrics) gives the CPU path's numbers with the logits
never leaving the device, and re-derives a reference store's top-K there. The torch path runs here on the CPU; the
Triton kernel runs in Triton's interpreter where Triton is installed, and compiled on CUDA (tests marked `device`)."""
from __future__ import annotations

import importlib.util
import re
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from test_metrics import _assert_matches_scipy, _scipy_reference

from fidelity.environment import Environment
from fidelity.errors import ConfigError

CUDA = torch.cuda.is_available()
HAVE_TRITON = importlib.util.find_spec("triton") is not None

from fidelity.measuring.metrics import (MetricKernel, device_metrics_columns, finish_columns,  # noqa: E402
                                        position_metrics, topk_logprobs)

TRITON_BLOCK = MetricKernel().block
# Device path vs the CPU kernel (both float64 after the float32 inputs, sums in another order and exps of another
# construction): KL to 2e-13 nats + 1e-11 relative, NLLs to 1e-12 relative, p(top-1) to 1e-13 relative.
KL_ATOL, KL_RTOL = 2e-13, 1e-11
DEFAULT = MetricKernel(backend="triton")


def variant(**settings) -> MetricKernel:
    return replace(DEFAULT, **settings)


# "triton" is the kernel as configured (one logsumexp shift per row, the exp's magic-number rounding, top-5 lists from
# lists of 2 per lane, 512 lanes, two blocks loaded ahead, the bit conversion, the 256-entry exp table, no clamp, two
# blocks per iteration); the others change what their names say: "running" the CPU kernel's running shift with a
# separate top-5 pass, "top5" lists of 5 per lane, "top1v" lists of a lane's best and its runner-up's value, "f2f" the
# conversion instruction instead of moving bits, "clamp" the conversion with the clamp kept, "e6" the 64-entry exp
# table (Taylor to r^5), "unroll1" one block per loop iteration, "torch-topk" topk_match by torch after the kernel,
# "plain-top1v" lists of one with every newer setting off (the first defaults); lanes (256, 1024), warps (8), blocks
# loaded ahead (0, 1) and a register cap. TRITON_VARIANTS is keyed by the kernels: one equal to another by value is
# one variant (and the test below names it: a change of the defaults can make a variant the default or another).
NAMED_VARIANTS = [
    ("triton", variant()),
    ("triton-top5", variant(topk="fused")),
    ("triton-top2-running", variant(shift="running")),
    ("triton-running", variant(shift="running", magic=False, topk="separate", block=1024)),
    ("triton-nomagic", variant(magic=False)),
    ("triton-512-plain", variant(prefetch=0)),
    ("triton-running-ahead1", variant(shift="running", prefetch=1)),
    ("triton-256-ahead1", variant(block=256, prefetch=1)),
    ("triton-256-ahead2-running", variant(block=256, shift="running")),
    ("triton-512-ahead1", variant(prefetch=1)),
    ("triton-top1v", variant(topk="fused-top1v")),
    ("triton-top1v-256", variant(topk="fused-top1v", block=256)),
    ("triton-256", variant(block=256)),
    ("triton-f2f", variant(convert=False)),
    ("triton-clamp", variant(lean=False)),
    ("triton-e6", variant(exp_table_bits=6)),
    ("triton-unroll1", variant(unroll=1)),
    ("triton-torch-topk-8warps", variant(topk="torch", warps=8)),
    ("triton-plain-top1v", variant(topk="fused-top1v", convert=False, lean=False, exp_table_bits=6, unroll=1)),
    ("triton-maxnreg", variant(maxnreg=128, topk="separate", topk_block=512))]
TRITON_VARIANTS = {}
for _name, _kernel in NAMED_VARIANTS:
    TRITON_VARIANTS.setdefault(_kernel, _name)
BACKENDS = [pytest.param(MetricKernel(backend="torch"), id="torch")] + [
    pytest.param(kernel, id=name, marks=pytest.mark.skipif(not HAVE_TRITON, reason="missing tool: triton"))
    for kernel, name in TRITON_VARIANTS.items()]


def test_the_variants_are_distinct_and_run_every_accepted_setting():
    """Each variant is its own kernel (no two equal by value), and every accepted value of every field with a few
    (MetricKernel.CHOICES: the backend's None runs in test_a_triton_kernel_that_fails_falls_back_to_torch_once), two
    lane counts and warp counts, and a register cap, run in at least one."""
    same = [(name, TRITON_VARIANTS[kernel]) for name, kernel in NAMED_VARIANTS if TRITON_VARIANTS[kernel] != name]
    assert not same, f"variants equal to another (first named) by value: {same}"
    kernels = [p.values[0] for p in BACKENDS]
    assert len(set(kernels)) == len(kernels) == 1 + len(NAMED_VARIANTS)
    for name, accepted in MetricKernel.CHOICES.items():
        ran = {getattr(k, name) for k in kernels}
        assert ran >= set(accepted) - ({None} if name == "backend" else set()), (name, ran)
    for name in ("block", "warps", "topk_block", "maxnreg"):
        assert len({getattr(k, name) for k in kernels}) >= 2, name


def device_pm(a, b, t, kernel, reverse=True, device="cpu"):
    out, top = device_metrics_columns(a.to(device), b.to(device), t.to(device), kernel)
    return finish_columns(out, top, reverse)


def assert_matches_cpu_kernel(pm, cpu):
    for k in ("kld", "kld_reverse"):
        np.testing.assert_allclose(getattr(pm, k).numpy(), getattr(cpu, k).numpy(), rtol=KL_RTOL, atol=KL_ATOL,
                                   err_msg=k)
    for k in ("ref_nll", "pack_nll"):
        np.testing.assert_allclose(getattr(pm, k).numpy(), getattr(cpu, k).numpy(), rtol=1e-12, atol=1e-13, err_msg=k)
    np.testing.assert_allclose(pm.ref_pmax.numpy(), cpu.ref_pmax.numpy(), rtol=1e-13, err_msg="ref_pmax")
    assert torch.equal(pm.finite, cpu.finite)
    f = cpu.finite
    assert torch.equal(pm.ref_top1[f], cpu.ref_top1[f]) and torch.equal(pm.pack_top1[f], cpu.pack_top1[f])
    assert torch.equal(pm.ref_margin[f], cpu.ref_margin[f])
    assert torch.equal(pm.topk_match[f], cpu.topk_match[f])


def _small(kernel: MetricKernel) -> int:
    return 1 if kernel.backend == "triton" and not CUDA else 4    # the interpreter runs programs one by one, in numpy


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab,noise", [(1001, 0.5), (3 * TRITON_BLOCK + 5, 2.0), (2 * TRITON_BLOCK, 0.05)])
def test_device_metrics_match_scipy_and_the_cpu_kernel(rng_seed, backend, vocab, noise):
    n = 3 * _small(backend)
    a = torch.randn(n, vocab) * 4
    b = a + torch.randn(n, vocab) * noise
    t = torch.randint(0, vocab, (n,))
    pm = device_pm(a, b, t, backend)
    _assert_matches_scipy(pm, a, b, t)
    assert_matches_cpu_kernel(pm, position_metrics(a, b, t, reverse=True))
    only_forward = device_pm(a, b, t, backend, reverse=False)
    assert torch.isnan(only_forward.kld_reverse).all() and torch.equal(only_forward.kld, pm.kld)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_kl_large_logits_offsets_rising_maxima_and_ties(rng_seed, backend):
    """KL ~5e-7 keeps its float64 digits; logits in the thousands; a pack 896 nats off (KL 0 both ways); a maximum that
    rises in every block (each one rescales the sums); ties and 1-ulp runner-ups inside and across blocks."""
    v = 3 * TRITON_BLOCK + 7
    a = torch.randn(8, v) * 3
    b = a + torch.randn(8, v) * 1e-3
    a[1] = torch.randn(v) * 2000
    b[1] = a[1] + torch.randn(v) * 50
    a[2] = torch.round(torch.randn(v) * 3 * 64) / 64      # multiples of 1/64: a - 896 is exact in float32
    b[2] = a[2] - 896.0
    a[3] += torch.linspace(0, 40, v)
    top = float(a.max() + 1)
    below = float(np.nextafter(np.float32(top), np.float32(-np.inf)))
    a[4, 70], a[4, 5] = top, below                        # 1-ulp margin in one block
    a[5, TRITON_BLOCK + 3], a[5, 9] = top, below          # across blocks
    a[6, 130], a[6, 131] = top, top                       # a tie inside a block: first index, margin 0
    a[7, 2 * TRITON_BLOCK + 1], a[7, 40] = top, top       # a tie across blocks, the later block partial
    rows = [0, 1, 2, 3, 4, 5, 6, 7] if _small(backend) > 1 else [0, 1, 2, 5, 7]
    a, b = a[rows], b[rows]
    t = torch.randint(0, v, (len(rows),))
    pm = device_pm(a, b, t, backend)
    cpu = position_metrics(a, b, t, reverse=True)
    assert_matches_cpu_kernel(pm, cpu)
    truth = _scipy_reference(a.numpy(), b.numpy(), t.numpy())
    assert abs(pm.kld[0].item() - truth["kld"][0]) < 1e-13          # the textbook float32 way is off by ~1e-6 here
    assert pm.kld[rows.index(2)] < 1e-13 and pm.kld_reverse[rows.index(2)] < 1e-13
    assert torch.equal(pm.ref_top1, torch.argmax(a, -1))
    if 6 in rows:
        assert pm.ref_top1[rows.index(6)] == 130 and pm.ref_margin[rows.index(6)] == 0
    assert pm.ref_top1[rows.index(7)] == 40 and pm.ref_margin[rows.index(7)] == 0
    assert pm.ref_margin[rows.index(5)] == top - below


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_far_above_their_first_block_match_the_cpu_kernel(rng_seed, backend):
    """Rows whose maximum lies 1,000-5,000 nats above their first block's (the fixed-shift kernel's terms would
    overflow: it flags them and measures them again with the running shift), next to ordinary rows."""
    v = 2 * TRITON_BLOCK + 11
    n = 2 * _small(backend)
    a = torch.randn(n, v) * 3
    b = a + 0.2 * torch.randn(n, v)
    a[0, :TRITON_BLOCK] -= 1000.0
    b[0, :TRITON_BLOCK] -= 1000.0
    a[-1, TRITON_BLOCK:] += torch.linspace(0, 5000, v - TRITON_BLOCK)
    b[-1] = a[-1] + 0.1 * torch.randn(v)
    t = torch.randint(0, v, (n,))
    pm = device_pm(a, b, t, backend)
    cpu = position_metrics(a, b, t, reverse=True)
    assert bool(cpu.finite.all())
    assert_matches_cpu_kernel(pm, cpu)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_huge_logits_match_the_cpu_kernel(rng_seed, backend):
    """Logits of 1e8 to 1e30 (a broken pack's, or a reference's in a test), where s - 700 rounds to s in float32: the
    kernel's float32 clamp would take the row's own maximum for a term below -700 (it did, and gave KL 1e22 where
    the CPU kernel gives 1e-279); rows with a shift of 2^24 or more are measured by the running shift's float64
    clamp. Rows of ordinary logits next to them."""
    v = 2 * TRITON_BLOCK + 11
    a = torch.randn(6, v) * 3
    b = a + 0.2 * torch.randn(6, v)
    for row, scale in ((1, 1e8), (2, 1e12), (3, 1e30)):
        a[row] *= scale
        b[row] = a[row] + 1e-3 * scale * torch.randn(v)
    a[4] += 3e7                                     # an offset, not a spread: the terms stay within 700 of the shift
    b[4] += 3e7
    t = torch.randint(0, v, (6,))
    pm = device_pm(a, b, t, backend)
    cpu = position_metrics(a, b, t, reverse=True)
    assert bool(cpu.finite.all()) and float(cpu.kld[3]) < 1e-200
    assert_matches_cpu_kernel(pm, cpu)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_positions_are_flagged_like_the_cpu_kernel(rng_seed, backend):
    v = TRITON_BLOCK + 300
    a = torch.randn(7, v)
    b = a + 0.1 * torch.randn(7, v)
    b[1, 17] = float("nan")
    b[2, 3] = float("inf")
    a[3, TRITON_BLOCK + 5] = float("-inf")     # one side only: infinite KL
    a[4, 40], b[4, 40] = float("-inf"), float("-inf")
    a[5, :] = float("nan")
    t = torch.randint(0, v, (7,))
    pm = device_pm(a, b, t, backend)
    cpu = position_metrics(a, b, t, reverse=True)
    assert (~pm.finite).nonzero()[:, 0].tolist() == [1, 2, 3, 4, 5] == (~cpu.finite).nonzero()[:, 0].tolist()
    for k in ("kld", "kld_reverse", "ref_nll", "pack_nll", "ref_margin", "ref_pmax"):
        assert torch.isnan(getattr(pm, k)[~pm.finite]).all(), k
    assert_matches_cpu_kernel(pm, cpu)


def test_bad_targets_are_named_on_the_device_path():
    with pytest.raises(ValueError, match=r"target token 5 at position 1 is outside the vocabulary of 5"):
        device_metrics_columns(torch.zeros(3, 5), torch.zeros(3, 5), torch.tensor([0, 5, 1]),
                               MetricKernel(backend="torch"))
    out, top = device_metrics_columns(torch.zeros(0, 7), torch.zeros(0, 7), torch.zeros(0, dtype=torch.long),
                                      MetricKernel(backend="torch"))
    pm = finish_columns(out, top, True)
    assert len(pm) == 0 and pm.kld.dtype == torch.float64 and pm.ref_top1.dtype == torch.int64


def test_a_triton_kernel_that_fails_falls_back_to_torch_once(rng_seed, monkeypatch):
    from fidelity.measuring import metrics

    def broken(*args):
        raise RuntimeError("no such instruction")
    choose = metrics.device_backend
    monkeypatch.setattr(metrics, "_TRITON", [object()])
    monkeypatch.setattr(metrics, "triton_rows", broken)
    monkeypatch.setattr(metrics, "device_backend", lambda device, kernel: kernel.backend or (
        "triton" if metrics._TRITON[0] is not None else "torch"))
    a, b = torch.randn(5, 300), torch.randn(5, 300)
    t = torch.randint(0, 300, (5,))
    with pytest.warns(UserWarning, match=r"Triton kernel failed \(RuntimeError: no such instruction\); measuring with "
                                         r"the plain torch path"):
        out, top = device_metrics_columns(a, b, t)
    want = device_metrics_columns(a, b, t, MetricKernel(backend="torch"))
    assert torch.equal(out, want[0]) and torch.equal(top, want[1]) and metrics._TRITON == [None]
    monkeypatch.setattr(metrics, "_TRITON", [object()])
    with pytest.raises(RuntimeError, match="no such instruction"):      # asked for by name: the failure is not hidden
        device_metrics_columns(a, b, t, MetricKernel(backend="triton"))
    assert choose("cpu", MetricKernel(backend="triton")) == "triton" and choose("cpu") == "torch"
    with pytest.raises(ConfigError, match="FIDELITY_METRICS_KERNEL='tpu'"):
        Environment.from_environ({"FIDELITY_METRICS_KERNEL": "tpu"})


@pytest.mark.parametrize("switch, value", [("shift", "runing"), ("topk", "fuse"), ("prefetch", "yes"), ("prefetch", 3),
                                           ("prefetch", True), ("exp_table_bits", 7), ("unroll", 4), ("convert", 1),
                                           ("block", 300), ("warps", 0), ("maxnreg", -1), ("backend", "tpu")])
def test_a_misspelt_kernel_switch_is_an_error_not_a_fallback(switch, value, monkeypatch):
    """Refused when the kernel's settings are made, naming the field: long before a kernel runs, and never taken for a
    kernel that fails to build (which falls back to torch with a warning)."""
    from fidelity.measuring import metrics
    ran = []
    monkeypatch.setattr(metrics, "_TRITON", [lambda *a, **k: ran.append(a)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # no "Triton kernel failed ... torch path" fallback
        with pytest.raises(ValueError, match=re.escape(f"MetricKernel.{switch}={value!r}")):
            replace(MetricKernel(), **{switch: value})
    assert not ran and metrics._TRITON[0] is not None


def test_blocked_topk_matches_scipy_and_does_not_depend_on_grouping(rng_seed):
    from scipy.special import log_softmax

    from fidelity.measuring.metrics import TOPK_BLOCK_ROWS, _topk_logprobs_blocks
    x = torch.randn(2 * TOPK_BLOCK_ROWS + 9, 500) * 3
    ids, lp = _topk_logprobs_blocks(x, 20)
    ref = log_softmax(x.double().numpy(), -1)
    order = np.argsort(-ref, -1)[:, :20]
    assert np.array_equal(ids.numpy(), order)
    np.testing.assert_allclose(lp.numpy(), np.take_along_axis(ref, order, -1), atol=2e-6)
    for lo, hi in ((0, 1), (5, 70), (63, 64 + 63), (100, x.shape[0])):
        i2, l2 = _topk_logprobs_blocks(x[lo:hi], 20)
        assert torch.equal(i2, ids[lo:hi]) and torch.equal(l2, lp[lo:hi])


# -- compare's device step ------------------------------------------------------------------------------------------
def _head_setup(seed: int, device: str, vocab: int = 3000, hidden_size: int = 64):
    from fidelity.oracle import Oracle
    from testkit.synthetic import SyntheticPack, llama_config
    from fidelity.panels.panel import TokenizedRow
    from fidelity.measuring.store import ReferenceRun

    cfg = llama_config(hidden_size=hidden_size, intermediate_size=32, n_layers=1, vocab_size=vocab, n_heads=2,
                       n_kv_heads=2)
    ref_oracle = Oracle(SyntheticPack(cfg, seed=seed), device=device)
    pack_oracle = Oracle(SyntheticPack(cfg, seed=seed + 1), device=device)
    g = torch.Generator().manual_seed(seed)
    rows, hidden, targets = [], [], []
    for i, n in enumerate([70, 1, 129, 64, 33]):
        tokens = torch.randint(0, vocab, (n + 1,), generator=g).tolist()
        rows.append(TokenizedRow(f"row-{i}", "d", tokens, [False] + [True] * n))
        hidden.append(torch.randn(n, hidden_size, generator=g))
        targets.append(torch.tensor(tokens[1:]))
    pack_hidden = [h + 0.1 * torch.randn(h.shape, generator=g) for h in hidden]
    return ref_oracle, pack_oracle, ReferenceRun(rows, hidden, targets, device=device), pack_hidden


def _cpu_path(ref, ref_oracle, pack_hidden, pack_oracle):
    from fidelity.measuring.metrics import PositionMetrics
    parts = [position_metrics(ref_oracle.apply_head(h).float(), pack_oracle.apply_head(p).float(), t, reverse=True)
             for h, p, t in zip(ref.hidden, pack_hidden, ref.targets)]
    return PositionMetrics.concat(parts)


@pytest.mark.parametrize("chunk", [64, 128, None])
def test_device_row_metrics_equal_the_cpu_path_and_check_the_store(rng_seed, chunk):
    """Chunks of whole head blocks that cut rows (70 + 1 + 129 + ... positions) give the per-row path's numbers; the
    stored top-K is checked in every chunk; a changed top-K is refused naming the row, position and rank."""
    from fidelity.measuring.store import ReferenceRun, StoreError, device_row_metrics
    ref_oracle, pack_oracle, ref, pack_hidden = _head_setup(rng_seed % 10_000, "cpu")
    want = _cpu_path(ref, ref_oracle, pack_hidden, pack_oracle)
    got = device_row_metrics(ref, ref_oracle, pack_hidden, pack_oracle, chunk_positions=chunk, progress=False)
    assert_matches_cpu_kernel(got, want)
    topk = [topk_logprobs(ref_oracle.apply_head(h).float(), 20) for h in ref.hidden]
    stored = ReferenceRun(ref.rows, ref.hidden, ref.targets, topk, device="cpu")
    again = device_row_metrics(stored, ref_oracle, pack_hidden, pack_oracle, chunk_positions=chunk, progress=False)
    assert torch.equal(again.kld, got.kld)
    bad = [(i.clone(), l.clone()) for i, l in topk]
    bad[2][1][100, 3] += 1e-6                       # row-2's scored position 101 (chunk 64/128 cut that row)
    with pytest.raises(StoreError, match=r"store-x: row 'row-2' position 100: .*first at rank 3"):
        device_row_metrics(ReferenceRun(ref.rows, ref.hidden, ref.targets, bad, device="cpu"), ref_oracle, pack_hidden,
                           pack_oracle, store_path="store-x", chunk_positions=chunk, progress=False)


# -- on the GPU -----------------------------------------------------------------------------------------------------
cuda_only = [pytest.mark.device, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("noise", [1e-3, 0.3, 3.0])
@pytest.mark.device
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_metrics_at_the_real_vocabulary_match_the_cpu_kernel(rng_seed, backend, noise):
    n, v = 300, 129_280
    a = torch.randn(n, v, device="cuda") * 4
    b = a + torch.randn(n, v, device="cuda") * noise
    a[7, 1000:] += torch.linspace(0, 30, v - 1000, device="cuda")
    t = torch.randint(0, v, (n,), device="cuda")
    pm = device_pm(a, b, t, backend, device="cuda")
    cpu = position_metrics(a.cpu(), b.cpu(), t.cpu(), reverse=True)
    assert_matches_cpu_kernel(pm, cpu)
    via_dispatch = position_metrics(a, b, t, reverse=True)       # CUDA tensors: measured where they are
    assert_matches_cpu_kernel(via_dispatch, cpu)


@pytest.mark.device
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_device_row_metrics_and_store_rederivation(rng_seed, tmp_path):
    """The head on CUDA, logits kept there: the numbers equal the CPU kernel's on the same CUDA logits, and a top-K
    computed on CUDA in fixed blocks (as write_store does there) re-derives bit for bit in other chunkings."""
    from fidelity.measuring.store import ReferenceRun, _device_topk_nll, device_row_metrics
    ref_oracle, pack_oracle, ref, pack_hidden = _head_setup(rng_seed % 10_000, "cuda", vocab=129_280, hidden_size=256)
    want = _cpu_path(ref, ref_oracle, pack_hidden, pack_oracle)      # apply_head: CUDA GEMMs, CPU kernel
    topk = [_device_topk_nll(ref_oracle, h, t, 20)[:2] for h, t in zip(ref.hidden, ref.targets)]
    stored = ReferenceRun(ref.rows, ref.hidden, ref.targets, topk, device="cuda")
    for chunk in (64, 192, None):
        got = device_row_metrics(stored, ref_oracle, pack_hidden, pack_oracle, chunk_positions=chunk, progress=False)
        assert_matches_cpu_kernel(got, want)


@pytest.mark.skipif(not HAVE_TRITON, reason="missing tool: triton")
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(CUDA, reason="CUDA: compiled below")),
                                    pytest.param("cuda", marks=cuda_only)])
@pytest.mark.parametrize("mode", ["fused", "fused-top2", "fused-top1v", "separate", "torch"])
def test_triton_topk_match_is_the_cpu_kernels_with_every_tie(rng_seed, mode, device, monkeypatch):
    """topk_match from the Triton pass (fused into the metric kernel, or its own pass) equals the CPU kernel's, on
    rows built to break a top-5 list: a tie straddling the 5th place, equal values in one lane (index j and
    j + BLOCK) and across lanes, the lists diverging at each place 1..5, fewer than 5 finite logits, and a row of
    fewer than 5 tokens."""
    kernel = variant(topk=mode)
    g = torch.Generator().manual_seed(rng_seed)
    v = 2 * TRITON_BLOCK + 37
    n = 10 if device == "cuda" else 6
    a = torch.randn(n, v, generator=g)
    b = a.clone()
    top = float(a.max()) + 1
    a[0, [10, 11, 12, 13]] = top + torch.arange(4, 0, -1).float()
    late = TRITON_BLOCK + 100
    a[0, [late, 7, TRITON_BLOCK + 7]] = top                      # the 5th place: a tie of three, lowest index 7
    b[0] = a[0]
    b[0, late] = top + 0.5                                       # pack: the latest of them takes the 5th place alone
    a[1, [3, 3 + TRITON_BLOCK, 3 + 2 * TRITON_BLOCK]] = top      # equal values in one lane
    b[1] = a[1]
    b[1, 3 + 2 * TRITON_BLOCK] = top + 1                         # pack's best is the last of them
    k = int(torch.randint(1, 6, (1,), generator=g))
    order = torch.randperm(v, generator=g)[:5]
    a[2, order] = top + torch.arange(5, 0, -1).float()
    b[2] = a[2]
    b[2, order[k - 1]] = top - 10                                # the lists part at place k
    a[3, :] = float("-inf")
    a[3, [4, v - 1]] = 1.0                                        # two finite logits, tied
    b[3] = a[3]
    a[4] = torch.round(a[4] * 4) / 4                             # many ties everywhere
    b[4] = a[4]
    b[5] = a[5] + 1e-3 * torch.randn(v, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    for x, y in ((a, b), (a[:3, :4], b[:3, :4])):                 # and a 4-token vocabulary: lists of 4
        tt = t[:x.shape[0]].clamp(max=x.shape[1] - 1)
        _, got = device_metrics_columns(x.to(device), y.to(device), tt.to(device), kernel)
        cpu = position_metrics(x, y, tt, reverse=True)
        assert torch.equal(got[:, 2].cpu(), cpu.topk_match), (got[:, 2], cpu.topk_match)
        if x.shape[1] == v:      # the rows do what they were built for (on the CPU kernel's numbers)
            assert cpu.topk_match[0] == 4 and cpu.topk_match[1] == 0 and cpu.topk_match[2] == k - 1
            assert cpu.topk_match[3] == 2           # two finite logits: the lists end there


def _rows_sent_to_the_exact_pass(metrics, monkeypatch) -> list:
    """The rows metrics.triton_rows hands top5_kernel, appended to the returned list as it does."""
    sent = []
    exact_pass = metrics._top5

    def spy(a, b, match, rows, kernel):
        sent.extend([] if rows is None else rows.tolist())
        exact_pass(a, b, match, rows, kernel)
    monkeypatch.setattr(metrics, "_top5", spy)
    return sent


def _lane_rows_against_the_cpu(rng_seed: int, device: str, kernel, write_rows) -> tuple:
    """Five reference rows of 3 * TRITON_BLOCK + 19 logits: rows 0, 2 and 3 lifted above the rest by
    `write_rows(a, top)` (a lane holding several of the top-5), row 1 a copy of row 0 whose pack row starts its list
    elsewhere, row 4 plain noise. The device's topk_match and top-1 ids equal the CPU kernel's, and rows 0-3 match
    5, 0, 5, 5 places. Returns (the device's out, the CPU metrics)."""
    g = torch.Generator().manual_seed(rng_seed)
    v = 3 * TRITON_BLOCK + 19
    a = torch.randn(5, v, generator=g)
    top = float(a.max()) + 1
    write_rows(a, top)
    a[1] = a[0]
    b = a.clone()
    b[1, 100] = top + 10                          # row 1: the pack's list starts elsewhere
    b[4] = a[4] + 1e-3 * torch.randn(v, generator=g)
    t = torch.randint(0, v, (5,), generator=g)
    out, got = device_metrics_columns(a.to(device), b.to(device), t.to(device), kernel)
    cpu = position_metrics(a, b, t, reverse=True)
    assert cpu.topk_match[:4].tolist() == [5, 0, 5, 5]
    assert torch.equal(got[:, 2].cpu(), cpu.topk_match)
    assert torch.equal(got[:, 0].cpu(), cpu.ref_top1) and torch.equal(got[:, 1].cpu(), cpu.pack_top1)
    return out, cpu


@pytest.mark.skipif(not HAVE_TRITON, reason="missing tool: triton")
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(CUDA, reason="CUDA: compiled below")),
                                    pytest.param("cuda", marks=cuda_only)])
@pytest.mark.parametrize("shift", ["fixed", "running"])
def test_lists_of_two_send_the_rows_they_cannot_answer_to_the_exact_pass(rng_seed, device, shift, monkeypatch):
    """topk "fused-top2": a lane holding three of a row's top-5 makes its list of two run out; the row goes to
    top5_kernel when its prefix reaches that place (rows 0, 2) and not when the lists part before it (row 1) or the
    lane holds only the 4th and 5th places (row 3). Every row's ids and topk_match equal the CPU kernel's."""
    from fidelity.measuring import metrics
    kernel = variant(topk="fused-top2", shift=shift)
    sent = _rows_sent_to_the_exact_pass(metrics, monkeypatch)
    B = TRITON_BLOCK

    def write_rows(a, top):
        lane = [5, 5 + B, 5 + 2 * B]                 # one lane (index mod BLOCK), three places
        others = [17, 40, 77]                        # three other lanes
        a[0, lane + others[:2]] = top + torch.tensor([5.0, 4, 3, 2, 1])      # the lane holds places 1-3
        a[2, others[:2] + lane] = top + torch.tensor([5.0, 4, 3, 2, 1])      # places 3-5
        a[3, others + lane[:2]] = top + torch.tensor([5.0, 4, 3, 2, 1])      # places 4-5 only
    _lane_rows_against_the_cpu(rng_seed, device, kernel, write_rows)
    assert {0, 2} <= set(sent) and not {1, 3} & set(sent), sent


@pytest.mark.skipif(not HAVE_TRITON, reason="missing tool: triton")
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(CUDA, reason="CUDA: compiled below")),
                                    pytest.param("cuda", marks=cuda_only)])
@pytest.mark.parametrize("shift", ["fixed", "running"])
def test_lists_of_one_send_the_rows_they_cannot_answer_to_the_exact_pass(rng_seed, device, shift, monkeypatch):
    """topk "fused-top1v": a lane keeps its best with its index and only the value of its runner-up, so a lane
    holding two of a row's top-5 leaves the place after its first one without an index; the row goes to top5_kernel
    when its prefix reaches that place (rows 0, 2), not when the lists part before it (row 1) or the lane's second
    entry lies past the 5th place (row 3). Ids, margins and topk_match equal the CPU kernel's."""
    from fidelity.measuring import metrics
    kernel = variant(topk="fused-top1v", shift=shift)
    sent = _rows_sent_to_the_exact_pass(metrics, monkeypatch)
    B = TRITON_BLOCK

    def write_rows(a, top):
        lane = [5, 5 + 2 * B]                        # one lane (index mod BLOCK), two places
        others = [17, 40, 77, 301]                   # four other lanes
        a[0, lane + others[:3]] = top + torch.tensor([5.0, 4, 3, 2, 1])      # the lane holds places 1-2
        a[2, others[:3] + lane] = top + torch.tensor([5.0, 4, 3, 2, 1])      # places 4-5
        a[3, others + lane] = top + torch.tensor([6.0, 5, 4, 3, 2, 1])       # places 5-6: the 6th is not asked for
        a[3, 5] = top + 2                                                    # (the lane's best is the 5th)
    out, cpu = _lane_rows_against_the_cpu(rng_seed, device, kernel, write_rows)
    assert torch.equal(out[:, 2].cpu(), cpu.ref_margin)       # the runner-up's value without its index
    assert {0, 2} <= set(sent) and not {1, 3} & set(sent), sent


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from fidelity.measuring.metrics_triton import exp_constants, exp_nonpositive, f64_bits_of_f32

    @triton.jit
    def _bits_kernel(x_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, f64_bits_of_f32(tl.load(x_ptr + offs)))

    @triton.jit
    def _exp_kernel(x_ptr, out_ptr, const_ptr, table_ptr, N: tl.constexpr, EXP_BITS: tl.constexpr):
        offs = tl.arange(0, N)
        inv_step, step_hi, step_lo, c2, c3, c4, c5, magic = exp_constants(const_ptr)
        tl.store(out_ptr + offs, exp_nonpositive(tl.load(x_ptr + offs), table_ptr, inv_step, step_hi, step_lo, c2, c3,
                                                 c4, c5, magic, True, EXP_BITS))


@pytest.mark.skipif(not HAVE_TRITON, reason="missing tool: triton")
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(CUDA, reason="CUDA: compiled below")),
                                    pytest.param("cuda", marks=cuda_only)])
@pytest.mark.parametrize("table_bits", [6, 8])
def test_the_kernels_exp_is_within_an_ulp_or_two_of_numpy(rng_seed, device, table_bits):
    """exp_nonpositive with its 64-entry table (Taylor to r^5) and its 256-entry one (exp_table_bits 8, Taylor to r^4)
    against numpy's float64 exp, over the range the kernel feeds it ([-700, 0] and, under the fixed shift, up to 600
    above it), with the points where the table index and the exponent change (multiples of ln2 / 2^bits)."""
    from fidelity.measuring import metrics
    g = np.random.default_rng(rng_seed)
    n = 8192
    step = np.log(2) / (1 << table_bits)
    x = np.concatenate([g.uniform(-700.0, 0.0, n // 4), g.uniform(-40.0, 0.0, n // 4), g.uniform(0.0, 600.0, n // 8),
                        (np.round(g.uniform(-700.0, 0.0, n // 8) / step) + g.uniform(-0.5, 0.5, n // 8)) * step,
                        g.uniform(-1e-3, 1e-3, n // 4 - 2), [0.0, -700.0]])
    consts, table = metrics._exp_constants(torch.device(device), table_bits)
    out = torch.empty(n, dtype=torch.float64, device=device)
    _exp_kernel[(1,)](torch.from_numpy(x).to(device), out, consts, table, N=n, EXP_BITS=table_bits)
    rel = np.abs(out.cpu().numpy() / np.exp(x) - 1)
    assert rel.max() < 4.5e-16, (table_bits, rel.max(), x[rel.argmax()])


@pytest.mark.skipif(not HAVE_TRITON, reason="missing tool: triton")
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(CUDA, reason="CUDA: compiled below")),
                                    pytest.param("cuda", marks=cuda_only)])
def test_the_bit_conversion_is_the_float_conversion_for_every_normal_float32(rng_seed, device):
    """f64_bits_of_f32 (convert) against torch's float32 -> float64 conversion, bit for bit: random bit patterns
    of every normal exponent and both signs, and the ends of the normal range."""
    g = torch.Generator().manual_seed(rng_seed)
    n = 4096
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) << 31
    exponent = torch.randint(1, 255, (n,), generator=g, dtype=torch.int64) << 23
    mantissa = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int64)
    bits = (sign | exponent | mantissa)
    bits[:4] = torch.tensor([0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF])   # +-2^-126, +-float32 max
    x = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    out = torch.empty(n, dtype=torch.float64, device=device)
    _bits_kernel[(1,)](x.to(device), out, N=n)
    assert torch.equal(out.cpu().view(torch.int64), x.double().view(torch.int64))


@pytest.mark.skipif(not HAVE_TRITON, reason="missing tool: triton")
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(CUDA, reason="CUDA: compiled below")),
                                    pytest.param("cuda", marks=cuda_only)])
@pytest.mark.parametrize("lean", [False, True])
def test_converted_rows_the_bits_cannot_cover_are_measured_again(rng_seed, device, lean, monkeypatch):
    """convert: zeros and subnormals come out of the bit conversion as +-2^-127-ish, which cannot move x - s
    while |s| >= 2^-60, so rows of zeros (a padded vocabulary) and subnormals stay in the fast pass; a row whose shift
    lies nearer zero, or with an inf or NaN, is measured again without the conversion, as is a row whose shift is 2^24
    or more (row 8: the fixed shift's float32 clamp cannot hold it). lean (no clamp before the exp) also sends
    the rows with a logit more than 700 below its shift (row 3). Every row equals the CPU kernel. (The conversion runs
    under the fixed shift only: the running one is the fallback.)"""
    from fidelity.measuring import metrics
    kernel = variant(convert=True, lean=lean, shift="fixed")
    real = metrics._triton_kernel()
    launches = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid[0], kwargs["CONVERT"], kwargs["LEAN"]))
                return real[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(metrics, "_TRITON", [Spy()])
    g = torch.Generator().manual_seed(rng_seed)
    B = TRITON_BLOCK
    v = 2 * B + 300
    a = torch.randn(9, v, generator=g) * 3
    b = a + 0.2 * torch.randn(9, v, generator=g)
    a[0, -200:], b[0, -200:] = 0.0, 0.0                 # a padded vocabulary's zero logits, on both sides
    b[1, 50:60] = -0.0
    a[2, 7:20] = torch.tensor(1e-40).expand(13)         # subnormals
    b[2, 30] = -1e-42
    a[3, -5:] = -3e38                                   # masked entries, finite
    a[4, :B] = -torch.rand(B, generator=g)              # the first block's maximum is exactly 0: shift 0
    a[4, 3] = 0.0
    b[5, :B] = -torch.rand(B, generator=g) - 1e-30      # and ~1e-30 below zero on the pack's side
    b[5, 11] = -1e-30
    a[6, 99] = float("nan")
    b[7, B + 1] = float("inf")
    a[8] *= 1e30
    b[8] = a[8] + 1e24 * torch.randn(v, generator=g)
    t = torch.randint(0, v, (9,), generator=g)
    out, top = device_metrics_columns(a.to(device), b.to(device), t.to(device), kernel)
    pm = finish_columns(out.cpu(), top.cpu(), True)
    cpu = position_metrics(a, b, t, reverse=True)
    assert (~cpu.finite).nonzero()[:, 0].tolist() == [6, 7]
    assert_matches_cpu_kernel(pm, cpu)
    again = [rows for rows, convert, _ in launches if not convert]
    assert launches[0] == (9, True, lean), launches
    assert again == ([6] if lean else [5]), launches        # rows 4 to 8 (lean: 3 to 8), once, without the conversion
