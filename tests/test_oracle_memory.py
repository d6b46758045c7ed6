"""Streaming bounds memory: a synthetic model several times larger than the budget runs in a subprocess whose peak RSS
growth (VmHWM after resetting it, minus the resident set before the run) is measured, not assumed."""
from __future__ import annotations

from _peak_rss import run_child

HIDDEN, INNER, HEADS, ROWS, LENGTH = 1536, 4096, 16, 2, 64
SCRIPT = (
    f"HIDDEN, INNER, HEADS, ROWS, LENGTH = {HIDDEN}, {INNER}, {HEADS}, {ROWS}, {LENGTH}\n"
    + r"""
import json, sys, torch
torch.set_num_threads(1)
from fidelity.oracle import Oracle
from testkit.synthetic import SyntheticPack, llama_config

cfg = llama_config(hidden_size=HIDDEN, intermediate_size=INNER, n_layers=6, vocab_size=2048, n_heads=HEADS,
                   n_kv_heads=4)
pack = SyntheticPack(cfg, seed=int(sys.argv[1]))
oracle = Oracle(pack)
torch.ones(64, 64) @ torch.ones(64, 64)  # thread pools and allocator warm-up before the baseline
tokens = torch.randint(0, cfg["vocab_size"], (ROWS, LENGTH))
reset = reset_peak()
base = status("VmRSS")
logits = oracle.logits(tokens)
peak = status("VmHWM")
print(json.dumps({"base": base, "peak": peak, "reset": reset, "finite": bool(torch.isfinite(logits).all()),
                  "largest_layer": max(pack.layer_bytes(i) for i in range(cfg["num_hidden_layers"])),
                  "total": pack.total_bytes(), "logits_bytes": logits.numel() * 4}))
"""
)


def test_streaming_peak_rss_is_about_one_layer(rng_seed):
    r = run_child(SCRIPT, rng_seed % 1000, timeout=300)  # (the oracle also trims the heap after each layer)
    assert r["finite"]
    growth = r["peak"] - r["base"]
    # residual stream, q/k/v/attention output, gate/up/product: all fp32; attention scores; the logits
    activations = ROWS * LENGTH * (4 * HIDDEN + 3 * INNER) * 4 + ROWS * HEADS * LENGTH**2 * 4 + r["logits_bytes"]
    budget = 1.5 * (r["largest_layer"] + activations)
    print(f"model {r['total'] / 2**20:.0f} MiB fp32, largest layer {r['largest_layer'] / 2**20:.1f} MiB, "
          f"budget {budget / 2**20:.1f} MiB, measured peak RSS growth {growth / 2**20:.1f} MiB")
    assert r["total"] >= 3 * budget  # the model really is bigger than the budget
    assert growth <= budget
