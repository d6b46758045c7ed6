"""Compiles our Triton kernels ahead of time for a GPU target on any machine, no GPU needed (Triton's bundled ptxas and
cuobjdump), and prints per variant its registers, spills and a fingerprint of its SASS: the metric kernel
(`metrics_triton.rows_kernel`) or the EXL3 decode (`--kernel exl3`: `packs/exl3/decode_triton.decode_kernel`). A
refactor of a kernel's source that prints the same `sass` fingerprints compiles to the same machine code for that
Triton; the same `ops` alone: the same instructions, scheduled or allocated differently.

    python benchmarks/kernel_sass.py                                   # this tree's metric kernel, sm_90 (H200)
    python benchmarks/kernel_sass.py --source OLD.py --arch 121        # another copy of metrics_triton.py, GB10
    python benchmarks/kernel_sass.py --kernel exl3 [--source OLD_decode_triton.py]
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # Triton's own library is built for the interpreter when this is set at its import: nothing compiles
    sys.exit("benchmarks/kernel_sass.py: unset TRITON_INTERPRET (it compiles for a GPU target)")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # the default the kernel runs with (Triton 3.9 warns otherwise)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# metrics.triton_rows' launch: the exp table is int64 (metrics._exp_constants)
SIGNATURE = {"a_ptr": "*fp32", "b_ptr": "*fp32", "t_ptr": "*i64", "out_ptr": "*fp64", "top_ptr": "*i64",
             "match_ptr": "*i64", "retry_ptr": "*i8", "const_ptr": "*fp64", "table_ptr": "*i64", "stride_a": "i64",
             "stride_b": "i64"}


def launch_attrs(kernel, signature: dict, vocab: int) -> dict:
    """What Triton's launcher specializes at a device pass (runtime/jit.py: a pointer 16-byte aligned, an integer a
    multiple of 16 -> tt.divisibility 16): torch's allocations are aligned, and contiguous rows' strides are the
    vocabulary. Without it the compiled variant is not the one that runs (scalar instead of 16-byte loads)."""
    names = kernel.arg_names
    divisible = [k for k, kind in signature.items()
                 if kind.startswith("*") or (k.startswith("stride") and vocab % 16 == 0)]
    return {(names.index(k), ): [["tt.divisibility", 16]] for k in divisible}


# MetricKernel().block, lists of 2 (topk "fused-top2"), the top-5 match, shift "fixed", prefetch
DEFAULT = (512, 2, True, True, 2)


def load(source: Path):
    spec = importlib.util.spec_from_file_location(f"metrics_triton_{abs(hash(str(source)))}", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# codec._decode_weights_triton's launch: int16 trellis, int32 tables, int8 +-1 Hadamard, fp16 scales, fp32 out
EXL3_SIGNATURE = {
    "trellis_ptr": "*i16",
    "int_table_ptr": "*i32",
    "hi_ptr": "*i32",
    "lo_ptr": "*i32",
    "shift_ptr": "*i32",
    "hadamard_ptr": "*i8",
    "svh_ptr": "*fp16",
    "suh_ptr": "*fp16",
    "out_ptr": "*fp32",
    "n_tiles_n": "i32",
    "out_rows": "i32",
    "out_cols": "i32",
    "inv_scale_ptr": "*fp64",
    "trellis_stride": "i32",
    "svh_stride": "i32",
    "suh_stride": "i32",
    "out_stride": "i32",
}


def fingerprint(kernel, constexprs: dict, arch: int, warps: int, signature: dict = SIGNATURE,
                attrs: dict | None = None) -> str:
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([tools / "cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True).stdout
    resources = next(line for line in usage.splitlines() if "REG:" in line).split()
    regs = next(r for r in resources if r.startswith("REG:"))
    local = next(r for r in resources if r.startswith("LOCAL:"))
    # the instructions alone (addresses and encodings dropped); `ops`: their opcodes as a multiset, which a change of
    # instruction order or register names alone keeps
    body = [line.split(";")[0].split("*/")[-1].strip() for line in sass.splitlines() if "/*" in line and ";" in line]
    opcodes = sorted(Counter(words[1] if words[0].startswith("@") else words[0]
                             for words in (line.split() for line in body) if words).items())
    return (f"{regs} {local} instructions {len(body)} sass {hashlib.sha1(chr(10).join(body).encode()).hexdigest()[:12]}"
            f" ops {hashlib.sha1(repr(opcodes).encode()).hexdigest()[:12]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", choices=("metrics", "exl3"), default="metrics")
    p.add_argument("--source", type=Path, help="the kernel's file (default: this tree's)")
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200, 121: GB10)")
    p.add_argument("--vocab", type=int, default=129_280)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--default-only", action="store_true", help="only the variant a device pass runs by default")
    args = p.parse_args(argv)
    if args.kernel == "exl3":
        return exl3_table(args)
    args.source = args.source or ROOT / "fidelity" / "measuring" / "metrics_triton.py"
    kernel = load(args.source).rows_kernel
    sys.path.insert(0, str(ROOT))
    from fidelity.measuring.metrics import MetricKernel
    attrs = launch_attrs(kernel, SIGNATURE, args.vocab)
    print(f"Triton {triton.__version__}, sm_{args.arch}, {args.warps} warps, vocabulary {args.vocab}, {args.source}")
    print("| BLOCK | LISTS | MATCH | FIXED_SHIFT | PREFETCH | resources, SASS |")
    print("| --- | --- | --- | --- | --- | --- |")
    for block, lists, match, fixed, prefetch in itertools.product((256, 512), (2, 5), (True, False), (True, False),
                                                                  (0, 1, 2)):
        if lists == 5 and not match:
            continue                       # lists of 5 are only asked for with the top-5 match
        if args.default_only and (block, lists, match, fixed, prefetch) != DEFAULT:
            continue
        constexprs = dict(V=args.vocab, BLOCK=block, LISTS=lists, MATCH=match, FIXED_SHIFT=fixed, MAGIC=True,
                          PREFETCH=prefetch)
        # switches a later source added, where the source has them, as metrics.triton_rows launches them
        constexprs.update({k: v for k, v in MetricKernel().switches(fixed).items() if k in kernel.arg_names})
        print(f"| {block} | {lists} | {match} | {fixed} | {prefetch} | "
              f"{fingerprint(kernel, constexprs, args.arch, args.warps, attrs=attrs)} |", flush=True)
    return 0


def exl3_table(args) -> int:
    sys.path.insert(0, str(ROOT))
    from fidelity.packs.exl3 import codec
    source = args.source or ROOT / "fidelity" / "packs" / "exl3" / "decode_triton.py"
    kernel = load(source).decode_kernel
    warps = codec.TRITON_WARPS
    print(f"Triton {triton.__version__}, sm_{args.arch}, {warps} warps, {source}")
    print("| codebook | K (words per tile) | digits left / right | resources, SASS |")
    print("| --- | --- | --- | --- |")
    for codebook in ("3inst", "mcg", "mul1"):
        biggest = codec._int_codebook(codebook)[1]
        left, right = codec._digits(biggest), codec._digits(codec.HAD * biggest)
        for k in (2, 3, 4, 5):
            constexprs = dict(WORDS=16 * k, LEFT_DIGITS=left, RIGHT_DIGITS=right)
            print(f"| {codebook} | {k} ({16 * k}) | {left} / {right} | "
                  f"{fingerprint(kernel, constexprs, args.arch, warps, EXL3_SIGNATURE)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
