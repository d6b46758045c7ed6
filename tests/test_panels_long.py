"""A long panel row (16k tokens) runs through the oracle within the bound benchmarks/long_rows.py states: linear in the
row length plus the fixed attention-block and head-chunk buffers, far below one [T, T] score matrix per head. Measured
in a subprocess as VmHWM growth after a reset (as tests/test_oracle_memory.py does)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
T, HIDDEN, INNER, HEADS, KV, VOCAB = 16384, 64, 128, 4, 2, 512
SCRIPT = f"T, HIDDEN, INNER, HEADS, KV, VOCAB = {T}, {HIDDEN}, {INNER}, {HEADS}, {KV}, {VOCAB}\n" + r"""
import json, sys, torch
torch.set_num_threads(1)
from fidelity.oracle import Oracle
from fidelity.oracle.synthetic import SyntheticPack, llama_config
from fidelity.panels import PanelRow, tokenize_row

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

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
try:
    open("/proc/self/clear_refs", "w").write("5")
    reset = True
except OSError:
    reset = False
base = status("VmRSS")
hidden = oracle.hidden_states([tok_row.tokens], progress=False)[0]
lse = oracle.map_logits(hidden[1:], lambda c: torch.logsumexp(c, -1))
print(json.dumps({"reset": reset, "growth": status("VmHWM") - base, "finite": bool(torch.isfinite(lse).all()),
                  "positions": int(lse.numel())}))
"""


@pytest.mark.slow
def test_a_16k_token_row_stays_within_the_linear_bound(rng_seed):
    from fidelity.oracle.common import ATTENTION_CHUNK_BYTES
    from fidelity.oracle.runner import HEAD_CHUNK_BYTES

    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(rng_seed % 1000)], capture_output=True, text=True,
                         timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["reset"]:
        pytest.skip("cannot reset VmHWM here (/proc/self/clear_refs not writable)")
    assert r["finite"] and r["positions"] == T - 1
    weights = 2 * VOCAB * HIDDEN * 4 + 4 * HIDDEN * HIDDEN * 4 + 3 * HIDDEN * INNER * 4
    activations = T * (4 * HIDDEN + 3 * INNER + HIDDEN) * 4
    head = 2 * min(HEAD_CHUNK_BYTES, T * VOCAB * 4)
    # attention: a block's scores, their softmax, and the next block's scores allocated while those are still held
    bound = weights + activations + 3 * ATTENTION_CHUNK_BYTES + head
    full_scores = HEADS * T * T * 4
    print(f"peak RSS growth {r['growth'] / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB, "
          f"one full score matrix per head {full_scores / 2**20:.0f} MiB")
    assert r["growth"] <= 1.25 * bound
    assert r["growth"] < full_scores / 4
