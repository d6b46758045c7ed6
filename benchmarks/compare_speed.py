"""Speed of the compare path and size of the reference store.

    python benchmarks/compare_speed.py        # kernel only (random logits, vocab 49152), 1 and 2 threads
    python benchmarks/compare_speed.py --e2e  # also end-to-end compare and store size on SmolLM2
                                              # (builds the demo packs)

1. Full-vocab metric kernel (`fidelity.measuring.metrics.position_metrics` with reverse=True, as `compare` calls it: KL
   both ways, reference top-1/top-2 margin and confidence, top-1 of both, both NLLs) against what a user would write in
   torch on the same float32 logits: log_softmax of both, KL = sum(exp(lp) * (lp - lq)), argmax of both, NLL by gather.
   Same thread count (torch.set_num_threads; the kernel splits rows over the same count), same inputs, repeats
   interleaved, medians reported with the load average. Both must agree (top-1 equal, KL and NLL within float32
   rounding), and both are checked against float64.
2. End-to-end `compare` positions/s (reference + one pack through the oracle, metrics, bootstrap).
3. Reference-store bytes per scored position against llama.cpp's `--kl-divergence-base` file (2 bytes x vocab each).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from fidelity.measuring.metrics import position_metrics


def naive_metrics(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor) -> dict:
    lp, lq = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    return {"kld": (lp.exp() * (lp - lq)).sum(-1), "ref_top1": a.argmax(-1), "pack_top1": b.argmax(-1),
            "ref_nll": -lp.gather(1, t[:, None])[:, 0], "pack_nll": -lq.gather(1, t[:, None])[:, 0]}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kernel(n: int, vocab: int, reps: int, noise: float, threads: int, call_positions: int) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, vocab, generator=g) * 3
    b = a + noise * torch.randn(n, vocab, generator=g)
    t = torch.randint(0, vocab, (n,), generator=g)
    per_call = lambda: [position_metrics(a[s:s + call_positions], b[s:s + call_positions], t[s:s + call_positions],
                                         reverse=True) for s in range(0, n, call_positions)]
    position_metrics(a[:2], b[:2], t[:2])          # numba's first call loads (or compiles) the kernel
    load = os.getloadavg()[0]
    ours_t, calls_t, naive_t = [], [], []
    for _ in range(reps):                          # interleaved: the machine is shared, its load drifts
        ours_t.append(timed(lambda: position_metrics(a, b, t, reverse=True)))
        calls_t.append(timed(per_call))
        naive_t.append(timed(lambda: naive_metrics(a, b, t)))
    load = (load + os.getloadavg()[0]) / 2
    ours, naive = position_metrics(a, b, t, reverse=True), naive_metrics(a, b, t)
    lp, lq = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
    exact = (lp.exp() * (lp - lq)).sum(-1)
    kl_diff = float((ours.kld - naive["kld"].double()).abs().max())
    nll_diff = max(float((ours.ref_nll - naive["ref_nll"].double()).abs().max()),
                   float((ours.pack_nll - naive["pack_nll"].double()).abs().max()))
    assert torch.equal(ours.ref_top1, naive["ref_top1"]) and torch.equal(ours.pack_top1, naive["pack_top1"]), (
        "top-1 differs"
    )
    assert kl_diff < 1e-5 and nll_diff < 1e-4, f"kernel and naive disagree: KL by {kl_diff:.3g}, NLL by {nll_diff:.3g}"
    ours_s, calls_s, naive_s = (statistics.median(x) for x in (ours_t, calls_t, naive_t))
    return {"positions": n, "vocab": vocab, "threads": threads, "noise": noise, "load": load,
            "ours_pos_per_s": n / ours_s, "calls_pos_per_s": n / calls_s, "naive_pos_per_s": n / naive_s,
            "speedup": naive_s / ours_s, "calls_speedup": naive_s / calls_s, "kld_mean": float(exact.mean()),
            "max_kl_diff_vs_naive": kl_diff, "max_nll_diff_vs_naive": nll_diff,
            "ours_max_abs_err": float((ours.kld - exact).abs().max()),
            "naive_max_abs_err": float((naive["kld"].double() - exact).abs().max())}


def end_to_end(rows_per_domain: int) -> dict:
    from fidelity.commands.demo import build_demo_packs, default_cache
    from fidelity.commands.reference import build_store
    from fidelity.environment import Environment
    from fidelity.measuring.compare import compare
    from fidelity.panels.panel import load_panel

    environment = Environment.from_environ(os.environ)  # FIDELITY_CACHE, FIDELITY_SMOLLM2_GGUF, as the CLI reads them
    packs = build_demo_packs(default_cache(environment), gguf=environment.smollm2_gguf)
    panel = load_panel().subset(rows_per_domain)
    t0 = time.perf_counter()
    res = compare(packs["native"], [packs["Q4_K_M"]], panel=panel, noise_floor=False, progress=False)
    dt = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        m = build_store(packs["native"], panel, d, progress=False)
    vocab = 49152
    return {"rows": len(panel.rows), "scored_positions": res.report["panel"]["scored_positions"], "compare_s": dt,
            "compare_pos_per_s": res.report["panel"]["scored_positions"] / dt,
            "store_bytes_per_position": m["bytes_per_scored_position"], "llamacpp_bytes_per_position": 2 * vocab,
            "store_fraction": m["bytes_per_scored_position"] / (2 * vocab)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--call-positions", type=int, default=128, help="positions per call in the compare-style column")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--rows-per-domain", type=int, default=2)
    args = ap.parse_args()
    print(f"kernel: {args.positions} positions x vocab {args.vocab}, float32, median of {args.reps} interleaved; "
          f"{os.cpu_count()} CPUs")
    for threads in (int(x) for x in args.threads.split(",")):
        for noise in (0.01, 0.3):
            r = kernel(args.positions, args.vocab, args.reps, noise, threads, args.call_positions)
            print(
                f"threads={threads} noise={noise} load~{r['load']:.1f}: kernel {r['ours_pos_per_s']:.0f} pos/s "
                f"({r['speedup']:.2f}x), in calls of {args.call_positions} {r['calls_pos_per_s']:.0f} pos/s "
                f"({r['calls_speedup']:.2f}x), naive {r['naive_pos_per_s']:.0f} pos/s; KL mean {r['kld_mean']:.3g}; "
                f"kernel vs naive max |dKL| {r['max_kl_diff_vs_naive']:.2g}, |dNLL| {r['max_nll_diff_vs_naive']:.2g}, "
                f"top-1 equal; max |KL - float64|: kernel {r['ours_max_abs_err']:.2g}, "
                f"naive {r['naive_max_abs_err']:.2g}"
            )
    if args.e2e:
        e = end_to_end(args.rows_per_domain)
        print(f"end to end: {e['scored_positions']} scored positions ({e['rows']} rows) in {e['compare_s']:.1f} s = "
              f"{e['compare_pos_per_s']:.1f} pos/s (reference + one GGUF Q4_K_M pack through the oracle)")
        print(f"store: {e['store_bytes_per_position']:.0f} bytes per scored position vs llama.cpp's "
              f"{e['llamacpp_bytes_per_position']} ({e['store_fraction']:.4f} = 1/{1 / e['store_fraction']:.0f})")


if __name__ == "__main__":
    main()
