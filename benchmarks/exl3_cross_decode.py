"""exllamav3's own CUDA `reconstruct` kernel decodes trellises written by our encoder exactly as our decoder does.

Builds only exllamav3_ext/quant/reconstruct.cu (header-only dependencies) from an exllamav3 wheel's sources with a
two-line binding, then compares, bit for bit, ext.reconstruct(trellis) with fidelity's decode_inner(trellis) for our
encodings (every codebook, K 1..8 and the mul1 half rates) and for random trellises. Needs CUDA and nvcc:

    python benchmarks/exl3_cross_decode.py --ext-src path/to/exllamav3/exllamav3_ext
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from fidelity.packs.exl3 import encoder as exl3_encoder
from fidelity.packs.exl3 import codec

BINDING = """
#include <torch/extension.h>
#include "quant/reconstruct.cuh"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("reconstruct", &reconstruct); }
"""


def build(src: Path):
    from torch.utils.cpp_extension import load

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    tmp = Path(tempfile.mkdtemp())
    (tmp / "binding.cpp").write_text(BINDING)
    return load(name="exl3_reconstruct_only", sources=[str(tmp / "binding.cpp"), str(src / "quant" / "reconstruct.cu")],
                extra_include_paths=[str(src)], extra_cuda_cflags=["-O3", "--use_fast_math", "-std=c++17"],
                extra_cflags=["-O3", "-std=c++17"], extra_ldflags=["-lcublas"], verbose=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ext-src", required=True)
    args = ap.parse_args()
    t0 = time.perf_counter()
    ext = build(Path(args.ext_src))
    print(f"built reconstruct.cu in {time.perf_counter() - t0:.0f} s")
    cases = [(cb, K) for cb in codec.CODEBOOKS for K in range(1, 9)] + [("mul1", K) for K in (1.5, 2.5, 3.5)]
    g = torch.Generator().manual_seed(0)
    bad = 0
    for cb, K in cases:
        w = (torch.randn(256, 384, generator=g) * 0.02).cuda()                 # torch layout [out, in]
        enc = exl3_encoder.encode(w, K, cb)
        rand = torch.randint(-32768, 32768, (16, 8, codec.Bitrate.of(K).words), dtype=torch.int16, generator=g).cuda()
        for what, trellis in (("our encoding", enc.tensors["trellis"]), ("random trellis", rand)):
            kt, nt, _ = trellis.shape
            theirs = torch.empty(kt * 16, nt * 16, dtype=torch.half, device="cuda")
            ext.reconstruct(theirs, trellis.contiguous(), float(K), cb == "mcg", cb == "mul1")
            ours = codec.decode_inner(trellis, cb).half()
            same = torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
            bad += not same
            print(f"{cb:5s} K={K:<4g} {what:15s} {list(trellis.shape)}: {'bit-identical' if same else 'DIFFERENT'}")
    print(f"{len(cases) * 2 - bad}/{len(cases) * 2} bit-identical")


if __name__ == "__main__":
    main()
