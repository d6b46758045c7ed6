"""Compiles the metric kernel (`rows_kernel`) ahead of time for a GPU target on any machine, no GPU needed (Triton's
bundled ptxas and cuobjdump), and prints per variant its registers, spills and a fingerprint of its SASS. A refactor
of the kernel's source that prints the same fingerprints compiles to the same machine code for that Triton.

    python benchmarks/kernel_sass.py                                   # this tree's kernel, sm_90 (H200)
    python benchmarks/kernel_sass.py --source OLD.py --arch 121        # another copy of metrics_triton.py, GB10
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
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # Triton's own library is built for the interpreter when this is set at its import: nothing compiles
    sys.exit("benchmarks/kernel_sass.py: unset TRITON_INTERPRET (it compiles for a GPU target)")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # the default the kernel runs with (Triton 3.9 warns otherwise)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIGNATURE = {"a_ptr": "*fp32", "b_ptr": "*fp32", "t_ptr": "*i64", "out_ptr": "*fp64", "top_ptr": "*i64",
             "match_ptr": "*i64", "retry_ptr": "*i8", "const_ptr": "*fp64", "table_ptr": "*fp64", "stride_a": "i64",
             "stride_b": "i64"}


# metrics.TRITON_BLOCK, lists of 2 ("fused-top2"), the top-5 match, TRITON_SHIFT "fixed", TRITON_PREFETCH
DEFAULT = (512, 2, True, True, 2)


def load(source: Path):
    spec = importlib.util.spec_from_file_location(f"metrics_triton_{abs(hash(str(source)))}", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fingerprint(kernel, constexprs: dict, arch: int, warps: int) -> str:
    signature = {**SIGNATURE, **{k: "constexpr" for k in constexprs}}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
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
    # the instructions alone (addresses and encodings dropped)
    body = [line.split(";")[0].split("*/")[-1].strip() for line in sass.splitlines() if "/*" in line and ";" in line]
    return f"{regs} {local} instructions {len(body)} sass {hashlib.sha1(chr(10).join(body).encode()).hexdigest()[:12]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, default=ROOT / "fidelity" / "measuring" / "metrics_triton.py")
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200, 121: GB10)")
    p.add_argument("--vocab", type=int, default=129_280)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--default-only", action="store_true", help="only the variant a device pass runs by default")
    args = p.parse_args(argv)
    kernel = load(args.source).rows_kernel
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
        print(f"| {block} | {lists} | {match} | {fixed} | {prefetch} | "
              f"{fingerprint(kernel, constexprs, args.arch, args.warps)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
