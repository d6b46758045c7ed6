"""A long panel row (16k tokens) runs through the oracle within the bound benchmarks/long_rows.py states: linear in the
row length plus the fixed attention-block and head-chunk buffers, far below one [T, T] score matrix per head. Measured
in a subprocess as VmHWM growth after a reset (as tests/test_oracle_memory.py does)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from _peak_rss import run_child

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from long_rows import bound_bytes  # noqa: E402 (the bound the benchmark prints)
T, HIDDEN, INNER, HEADS, KV, VOCAB = 16384, 64, 128, 4, 2, 512
SCRIPT = f"T, HIDDEN, INNER, HEADS, KV, VOCAB = {T}, {HIDDEN}, {INNER}, {HEADS}, {KV}, {VOCAB}\n" + r"""
import json, sys, torch
torch.set_num_threads(1)
from fidelity.oracle import Oracle
from testkit.synthetic import SyntheticPack, llama_config
from fidelity.panels.panel import PanelRow, tokenize_row

cfg = llama_config(hidden_size=HIDDEN, intermediate_size=INNER, n_layers=2, vocab_size=VOCAB, n_heads=HEADS,
                   n_kv_heads=KV)
cfg["max_position_embeddings"] = T
oracle = Oracle(SyntheticPack(cfg, seed=int(sys.argv[1])))
gen = torch.Generator().manual_seed(int(sys.argv[1]))
row = PanelRow("long-1", "long_context", tokens=torch.randint(0, VOCAB, (T,), generator=gen).tolist(),
               scored=[False] + [True] * (T - 1))

class Vocab:  # token-exact rows are checked against the tokenizer's length
    def __len__(self):
        return VOCAB

tok_row = tokenize_row(row, Vocab(), max_len=T)
oracle.hidden_states([tok_row.tokens[:64]], progress=False)
reset = reset_peak()
base = status("VmRSS")
hidden = oracle.hidden_states([tok_row.tokens], progress=False)[0]
lse = oracle.map_logits(hidden[1:], lambda c: torch.logsumexp(c, -1))
print(json.dumps({"reset": reset, "growth": status("VmHWM") - base, "finite": bool(torch.isfinite(lse).all()),
                  "positions": int(lse.numel())}))
"""


@pytest.mark.slow
def test_a_16k_token_row_stays_within_the_linear_bound(rng_seed):
    r = run_child(SCRIPT, rng_seed % 1000, timeout=900, PYTHONPATH=str(REPO))
    assert r["finite"] and r["positions"] == T - 1
    # one layer's weights at most (wk, wv counted as [HIDDEN, HIDDEN]); embedding and head are bound_bytes' own
    bound = bound_bytes(T, HIDDEN, INNER, VOCAB, largest_layer=4 * HIDDEN * HIDDEN * 4 + 3 * HIDDEN * INNER * 4)
    full_scores = HEADS * T * T * 4
    print(f"peak RSS growth {r['growth'] / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB, "
          f"one full score matrix per head {full_scores / 2**20:.0f} MiB")
    assert r["growth"] <= 1.25 * bound
    assert r["growth"] < full_scores / 4
