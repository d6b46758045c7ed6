"""Long panel rows through the oracle on the CPU or a GPU (`--device cuda`): peak memory and time of one row of T
tokens, against the stated bound.

    python benchmarks/long_rows.py --lengths 2048 8192 32768 --layers 2
    python benchmarks/long_rows.py --device cuda --lengths 32768 131072 262144 --layers 2   # peak = CUDA allocator peak

Each length runs in a fresh subprocess on a synthetic Llama with SmolLM2-135M's geometry (hidden 576, MLP 1536, 9 query
/ 3 KV heads of 64, vocab 49,152; `--layers` of its 30 layers, weights random): `oracle.hidden_states([row])`, then the
head over every position chunk by chunk with a per-position reduction (what compare does with the logits). Peak memory
is the process's VmHWM after resetting it, minus its resident set before the row; the baseline is the same model on the
shortest length, in the same run. The bound, per the oracle's design (attention in query blocks of at most
ATTENTION_CHUNK_BYTES of scores, head in HEAD_ROWS-row chunks, the residual stream and one layer's activations live):

    bound = largest layer + embedding + head + T * (4 * hidden + 3 * intermediate + kept hidden) * 4 B
            + 3 * ATTENTION_CHUNK_BYTES (a query block's scores, their softmax, and the next block's scores, allocated
              while the previous ones are still referenced) + 2 * HEAD_CHUNK_BYTES (a logits chunk and the reduction's
              temporary)

A full [T, T] score matrix per head would instead need heads * T^2 * 4 B (38 GiB at T = 32768 for 9 heads).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GEOMETRY = dict(hidden_size=576, intermediate_size=1536, vocab_size=49152, n_heads=9, n_kv_heads=3)

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from fidelity.oracle import Oracle
from testkit.synthetic import SyntheticPack, llama_config

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

T, layers = int(sys.argv[1]), int(sys.argv[2])
geometry = json.loads(sys.argv[4])
cfg = llama_config(n_layers=layers, **geometry)
cfg["max_position_embeddings"] = max(T, 4096)
pack = SyntheticPack(cfg, seed=0)
device = sys.argv[5]
oracle = Oracle(pack, device=device)
tokens = torch.randint(0, cfg["vocab_size"], (T,), generator=torch.Generator().manual_seed(1)).tolist()
oracle.hidden_states([tokens[:64]], progress=False)  # thread pools, allocator, vector-math warm-up
try:
    open("/proc/self/clear_refs", "w").write("5")
    reset = True
except OSError:
    reset = False
base = status("VmRSS")
if device != "cpu":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
t0 = time.perf_counter()
hidden = oracle.hidden_states([tokens], progress=False)[0]
t1 = time.perf_counter()
nll = oracle.map_logits(hidden, lambda chunk: torch.logsumexp(chunk, -1))
if device != "cpu":
    torch.cuda.synchronize()
t2 = time.perf_counter()
peak = status("VmHWM") if device == "cpu" else torch.cuda.max_memory_allocated()
print(json.dumps({"T": T, "layers": layers, "reset": reset, "base": base, "peak": peak,
                  "forward_s": t1 - t0, "head_s": t2 - t1, "finite": bool(torch.isfinite(nll).all()),
                  "largest_layer": max(pack.layer_bytes(i) for i in range(layers))}))
"""


def bound_bytes(T: int, hidden: int, inner: int, vocab: int, largest_layer: int) -> int:
    """The module docstring's bound for one row of T tokens (tests/test_panels_long.py asserts it too)."""
    from fidelity.oracle.common import ATTENTION_CHUNK_BYTES
    from fidelity.oracle.runner import HEAD_CHUNK_BYTES

    embed_and_head = 2 * vocab * hidden * 4
    activations = T * (4 * hidden + 3 * inner + hidden) * 4
    head_chunks = 2 * min(HEAD_CHUNK_BYTES, T * vocab * 4)   # a logits chunk and the reduction's temporary
    return largest_layer + embed_and_head + activations + 3 * ATTENTION_CHUNK_BYTES + head_chunks


def row_bound(r: dict) -> int:
    return bound_bytes(r["T"], GEOMETRY["hidden_size"], GEOMETRY["intermediate_size"], GEOMETRY["vocab_size"],
                       r["largest_layer"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    rows = []
    for T in sorted(args.lengths):
        out = subprocess.run([sys.executable, "-c", CHILD, str(T), str(args.layers), str(args.threads),
                              json.dumps(GEOMETRY), args.device], capture_output=True, text=True, env=env)
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    mib = lambda b: b / 2**20
    print(
        f"synthetic Llama, SmolLM2-135M geometry, {args.layers} layers, {args.device}, {args.threads} threads; "
        f"baseline: T = {base['T']}"
    )
    print(
        "| tokens | peak growth (RSS, or CUDA allocator) | bound | growth / baseline's | forward | head + reduction "
        "| per layer and 1k tokens |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        growth = r["peak"] - r["base"]
        assert (r["reset"] or args.device != "cpu") and r["finite"], r
        print(f"| {r['T']:,} | {mib(growth):,.0f} MiB | {mib(row_bound(r)):,.0f} MiB | "
              f"{growth / max(base['peak'] - base['base'], 1):.1f}x | {r['forward_s']:.1f} s | {r['head_s']:.1f} s | "
              f"{r['forward_s'] / args.layers / (r['T'] / 1000):.2f} s |")
        if growth > row_bound(r):
            print(f"  over the bound at T = {r['T']}")


if __name__ == "__main__":
    main()
