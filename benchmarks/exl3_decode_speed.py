"""Time the pure-PyTorch EXL3 decoder on one 4096x2048 (in x out) K=4 linear: trellis -> fp32 torch weight [out, in].

    python benchmarks/exl3_decode_speed.py [--threads N] [--device cpu|cuda] [--repeats R]
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from fidelity.packs.exl3 import codec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--codebook", default="mul1", choices=codec.CODEBOOKS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k, n, K = 4096, 2048, 4
    g = torch.Generator().manual_seed(0)
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, generator=g).to(args.device)
    suh = torch.randn(k, generator=g).half().to(args.device)
    svh = torch.randn(n, generator=g).half().to(args.device)
    codec.decode_weight(trellis, suh, svh, args.codebook)        # warm-up: codebook table, plans
    times = []
    for _ in range(args.repeats):
        if args.device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        w = codec.decode_weight(trellis, suh, svh, args.codebook)
        if args.device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"exl3 decode {k}x{n} K={K} {args.codebook} on {args.device} ({args.threads} threads, "
        f"{platform.processor() or platform.machine()}, "
        f"load avg {load:.1f}): best {min(times):.3f} s, median {sorted(times)[len(times) // 2]:.3f} s, "
        f"out {tuple(w.shape)}"
    )


if __name__ == "__main__":
    main()
