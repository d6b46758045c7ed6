"""The head's logits are a function of the hidden state alone (not of how many positions were computed with it, the
thread count or the process), which is what lets a reference store re-derive them exactly; and the store names the first
position, rank and token when a re-derivation still disagrees."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fidelity.oracle import Oracle
from fidelity.oracle.runner import HEAD_ROWS
from testkit.synthetic import SyntheticPack, llama_config
from fidelity.panels.panel import TokenizedRow
from fidelity.measuring.store import ReferenceRun, StoreError, check_topk, numerics

# SmolLM2's head shape: MKL multiplies it with another kernel below 16 rows, so groupings here differ in the last bits
# unless every GEMM has one shape.
HIDDEN, VOCAB = 576, 49152
ROOT = Path(__file__).resolve().parent.parent


def head_oracle(seed: int) -> Oracle:
    cfg = llama_config(hidden_size=HIDDEN, intermediate_size=64, n_layers=1, vocab_size=VOCAB, n_heads=4, n_kv_heads=4)
    return Oracle(SyntheticPack(cfg, seed=seed))


@pytest.fixture
def head(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    hidden = torch.randn(3 * HEAD_ROWS - 41, HIDDEN, generator=g)
    hidden /= hidden.pow(2).mean(-1, keepdim=True).sqrt()  # the scale of a final-normed hidden state
    oracle = head_oracle(rng_seed % 1000)
    return oracle, hidden, oracle.apply_head(hidden), g


def test_head_logits_do_not_depend_on_how_positions_are_grouped(head):
    oracle, hidden, want, g = head
    n = hidden.shape[0]
    for size in (1, 3, 4, 15, 16, 17, HEAD_ROWS - 1, HEAD_ROWS + 1, 2 * HEAD_ROWS + 5):
        idx = (
            torch.randperm(n, generator=g)[:size].sort().values
        )  # a store's scored positions vs serve's every position
        assert torch.equal(oracle.apply_head(hidden[idx]), want[idx]), f"{size} positions"
    assert torch.equal(oracle.apply_head(hidden[:40], chunk_positions=5), want[:40])
    assert torch.equal(oracle.apply_head(hidden.reshape(1, n, HIDDEN))[0], want)
    assert torch.equal(torch.cat([c for _, c in oracle.iter_logits(hidden, chunk_positions=HEAD_ROWS + 3)]), want)
    assert torch.equal(
        oracle.map_logits(hidden[:30], lambda c: c.max(-1).values, chunk_positions=7), want[:30].max(-1).values
    )
    # the same positions at other offsets inside a block (rows shifted by one)
    assert torch.equal(oracle.apply_head(torch.cat([hidden[:1] * 0, hidden]))[1:], want)
    # independent check of the values themselves (float64 reference; the head sums 576 float32 products)
    exact = hidden[:16].double() @ oracle.head_weight().double().t()
    assert (want[:16].double() - exact).abs().max().item() < 1e-4


def test_head_logits_do_not_depend_on_threads_or_process(head, tmp_path, rng_seed):
    oracle, hidden, want, _ = head
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = oracle.apply_head(hidden[:5])
        torch.set_num_threads(2)
        two = oracle.apply_head(hidden[:5])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, want[:5]) and torch.equal(two, want[:5])
    # a fresh process with one thread, other groupings (as `fidelity gate` re-derives a store built by another process)
    torch.save(hidden, tmp_path / "hidden.pt")
    script = (
        f"import sys, torch; sys.path.insert(0, {str(ROOT)!r}); torch.set_num_threads(1)\n"
        f"from tests.test_engine_store_exact import head_oracle\n"
        f"o, h = head_oracle({rng_seed % 1000}), torch.load({str(tmp_path / 'hidden.pt')!r})\n"
        f"torch.save([o.apply_head(h[:3]), o.apply_head(h[7:7 + 20]), o.apply_head(h)], {str(tmp_path / 'out.pt')!r})\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    a, b, c = torch.load(tmp_path / "out.pt")
    assert torch.equal(a, want[:3]) and torch.equal(b, want[7:27]) and torch.equal(c, want)


def _run(logits: torch.Tensor, k: int = 20) -> ReferenceRun:
    from fidelity.measuring.metrics import topk_logprobs
    n = logits.shape[0]
    row = TokenizedRow(
        "row-7", "chat", tokens=list(range(100, 100 + n + 3)), scored=[False, False] + [True] * n + [False]
    )
    ids, lps = topk_logprobs(logits, k)
    return ReferenceRun([row], [torch.zeros(n, 4)], [torch.tensor(row.tokens[2:2 + n])], [(ids, lps)],
                        built_with={**numerics(), "threads": 17})


def test_store_refusal_names_position_rank_token_and_size(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    logits = torch.randn(6, 1000, generator=g) * 3
    ref = _run(logits)
    check_topk(ref, 0, logits.clone(), "store-dir")  # the same logits pass
    changed = logits.clone()
    tok = int(changed[3].argsort(descending=True)[2])  # the rank-2 token of position 3 moves by one float32 step
    changed[3, tok] = torch.nextafter(changed[3, tok], torch.tensor(float("inf")))
    with pytest.raises(StoreError) as e:
        check_topk(ref, 0, changed, "store-dir")
    msg = str(e.value)
    # scored positions are 2..7, predicted by positions 1..6: the 4th (j=3) is position 4, predicting token 105
    assert msg.startswith("store-dir: row 'row-7' position 4: logits re-derived from the stored hidden state do not "
                          "reproduce the stored top-20")
    lse = torch.logsumexp(changed[3], -1)
    # rank 0 or 1 can move too (their log-probs share the changed log-sum-exp); the first differing rank is named
    rank = int(msg.split("first at rank ")[1].split(",")[0])
    assert rank <= 2 and f"token {int(ref.topk[0][0][3, rank])} (predicting token 105)" in msg
    if rank == 2:
        assert int(ref.topk[0][0][3, rank]) == tok
    want = float(ref.topk[0][1][3, rank])
    have = float(changed[3, int(ref.topk[0][0][3, rank])] - lse)
    assert f"stored log-prob {want:.9g}, re-derived {have:.9g}" in msg and f"|diff| {abs(have - want):.3g}" in msg
    assert (
        "1 of 6 scored positions of this row differ" in msg and "the same logits give the same log-probs again" in msg
    )
    assert f"threads=17 (now {torch.get_num_threads()})" in msg


def test_store_refusal_when_a_token_leaves_the_top_k(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    logits = torch.randn(3, 500, generator=g)
    ref = _run(logits, k=5)
    changed = logits.clone()
    top = changed[0].argsort(descending=True)
    changed[0, top[4]] = changed[0, top[5]] - 1  # the stored rank-4 token drops out of the top 5
    with pytest.raises(StoreError, match=rf"row 'row-7' position 1: .*top-5: first at rank 4, token {int(top[4])} "
                                         rf".*re-derived rank 4 is token {int(top[5])}"):
        check_topk(ref, 0, changed, "s")


def test_manifest_numerics_name_what_decides_the_bits():
    m = numerics()
    assert m["head_rows"] == HEAD_ROWS and m["threads"] == torch.get_num_threads() and m["torch"] == torch.__version__
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    json.dumps(m)
    assert np.isfinite(HEAD_ROWS) and HEAD_ROWS % 16 == 0  # MKL's small-M kernel is below 16 rows
