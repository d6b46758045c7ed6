"""Where the metric kernel's time goes (issue 24 item 6: ">= 70 % of HBM bandwidth"), on one CUDA device.

    python benchmarks/metric_kernel_roofline.py [--positions 8192 --vocab 129280] [--configs 512x4,256x4,...]
    TRITON_INTERPRET=1 python benchmarks/metric_kernel_roofline.py --device cpu --positions 4 --vocab 1000 \
        --configs 256x4
                                                    # checks the script itself (timings mean nothing)

Times, on the same [N, V] float32 logits of reference and pack (random, 2 x N x V x 4 bytes read):
- copy:        torch's device copy of the same bytes (read + write): the baseline the RESULTS figures divide by;
- read-only:   a Triton kernel with the metric kernel's access pattern (one program per position, BLOCK lanes, both
               rows) that only sums the values in float32: the memory floor of this access pattern;
- fp64 math:   the metric kernel's float64 arithmetic per pair of logits (the shift, then its own add_pair_terms: two
               exps, the four sums) on values made from the lane index, nothing loaded: the ALU floor;
- the library kernel (fidelity.measuring.metrics.triton_rows) at each BLOCK x warps configuration, with 0, 1 and 2
  blocks loaded ahead of the arithmetic: without top-5 lists, with them fused as lists of 5 per lane ("fused") and as
  lists of 2 with the exact pass for the rows they cannot answer ("fused-top2"), and its agreement with the float64
  torch path (max |KL difference|, top-1 / topk_match equal) and across those variants (bit for bit).
Each is the median of --repeat timed runs after a warm-up. Prints a table against the copy baseline.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fidelity.measuring import metrics  # noqa: E402
from fidelity.measuring.metrics import MetricKernel  # noqa: E402
from fidelity.measuring.metrics_triton import add_pair_terms, exp_constants  # noqa: E402


@triton.jit
def read_only_kernel(a_ptr, b_ptr, out_ptr, stride, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for lo in range(0, V, BLOCK):
        offs = lo + lanes
        mask = offs < V
        acc += tl.load(a_ptr + row * stride + offs, mask=mask, other=0.0)
        acc += tl.load(b_ptr + row * stride + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row, tl.sum(acc, 0))


@triton.jit
def fp64_math_kernel(out_ptr, const_ptr, table_ptr, V: tl.constexpr, BLOCK: tl.constexpr, CONVERT: tl.constexpr = False,
                     EXP_BITS: tl.constexpr = 6):
    # the metric kernel's per-pair float64 work (fixed shift, magic rounding) on values derived from the lane index
    row = tl.program_id(0).to(tl.int64)
    inv_step, step_hi, step_lo, c2, c3, c4, c5, magic = exp_constants(const_ptr)
    lanes = tl.arange(0, BLOCK)
    s_a = row.to(tl.float64) * 1e-6
    s_b = s_a + 0.5
    z_a = tl.zeros([BLOCK], tl.float64)
    z_b = tl.zeros([BLOCK], tl.float64)
    k_a = tl.zeros([BLOCK], tl.float64)
    k_b = tl.zeros([BLOCK], tl.float64)
    for lo in range(0, V, BLOCK):
        offs = lo + lanes
        mask = offs < V
        xa = -(offs & 4095).to(tl.float32) * 0.01        # float32 "logits", as loaded
        xb = xa - (offs & 7).to(tl.float32) * 0.001
        z_a, z_b, k_a, k_b = add_pair_terms(xa, xb, s_a, s_b, mask, z_a, z_b, k_a, k_b, table_ptr, inv_step, step_hi,
                                            step_lo, c2, c3, c4, c5, magic, True, False, CONVERT, EXP_BITS)
    tl.store(out_ptr + row, tl.sum(z_a, 0) + tl.sum(z_b, 0) + tl.sum(k_a, 0) + tl.sum(k_b, 0))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=129_280)
    ap.add_argument("--configs", default="512x4,256x4,256x2,128x4,128x2,1024x8")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sweep", default=None,
                    help="instead of --configs' table: kernel variants BLOCKxWARPS[rREGS]:top2|top1v|top5:pf0|pf1|pf2:"
                         "f2f|bits[:e6|e8][:lean][:u1|u2], comma-separated (the first is the baseline; variants of its "
                         "exp table must equal it bit for bit, e8 (256 entries, Taylor to r^4) to float64 rounding; "
                         "lean: no clamp (with bits), u2: two blocks per loop iteration)")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(args.device)
    n, v = args.positions, args.vocab
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, v, device=device, generator=g) * 3
    b = a + 0.05 * torch.randn(n, v, device=device, generator=g)
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    nbytes = 2 * a.numel() * 4
    res = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "positions": n,
        "vocab": v,
        "GB_read": nbytes / 1e9,
    }
    dst = torch.empty_like(a)
    copy_s = timed(lambda: (dst.copy_(a), dst.copy_(b)), args.repeat)      # reads and writes nbytes each
    res["copy_GBps"] = 2 * nbytes / copy_s / 1e9
    rows_out = []
    sink = torch.empty(n, device=device, dtype=torch.float32)
    consts, table = metrics._exp_constants(device, MetricKernel().exp_table_bits)
    sink64 = torch.empty(n, device=device, dtype=torch.float64)
    want = metrics.device_metrics_columns(a, b, targets, MetricKernel(backend="torch"))
    if args.sweep:
        return sweep(args, res, a, b, targets, want, consts, table, sink64, nbytes)
    for config in args.configs.split(","):
        block, warps = (int(x) for x in config.split("x"))
        s_read = timed(lambda: read_only_kernel[(n,)](a, b, sink, a.stride(0), V=v, BLOCK=block, num_warps=warps),
                       args.repeat)
        s_math = timed(lambda: fp64_math_kernel[(n,)](sink64, consts, table, V=v, BLOCK=block, num_warps=warps),
                       args.repeat)
        row = {"config": config, "read_only_ms": s_read * 1e3, "fp64_math_ms": s_math * 1e3}
        plain = None           # the plain loop's result, which the prefetching run must equal bit for bit
        for (topk, name), prefetch in [(t, p) for t in (("fused", "kernel_top5"), ("fused-top2", "kernel_top2"),
                                                        ("torch", "kernel_alone")) for p in (0, 1, 2)]:
            name += ("", "_prefetch", "_ahead2")[prefetch]
            try:
                kernel = MetricKernel(backend="triton", block=block, warps=warps, topk=topk, prefetch=prefetch)
                if topk != "torch":
                    run = lambda: metrics.device_metrics_columns(a, b, targets, kernel)  # noqa: E731
                    got = run()
                    row[f"{name}_max_kl_diff_vs_torch"] = float((got[0][:, :2] - want[0][:, :2]).abs().max())
                    row[f"{name}_top1_topk_equal_torch"] = bool(torch.equal(got[1], want[1]))
                    if plain is None:
                        plain = got
                    else:  # the same arithmetic in the same order, other top lists: bit-identical to the first run
                        row[f"{name}_bit_identical"] = bool(
                            torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
                        )
                else:
                    cols = (torch.empty(n, 6, dtype=torch.float64, device=device),
                            torch.empty(n, 2, dtype=torch.int64, device=device))
                    run = lambda: metrics.triton_rows(a, b, targets, *cols, kernel=kernel)  # noqa: E731
                row[f"{name}_ms"] = timed(run, args.repeat) * 1e3
            except Exception as e:          # a configuration that does not build is reported, not fatal
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    res["rows"] = rows_out
    bw = res["copy_GBps"] * 1e9

    def cell(ms):
        return "-" if ms is None else f"{ms:.2f} ms ({nbytes / (ms / 1e3) / bw * 100:.0f} %)"

    print(
        f"{res['device']}, torch {res['torch']}, Triton {res['triton']}: {n} x {v} float32 x 2 = {nbytes / 1e9:.2f} GB "
        f"read; copy baseline {res['copy_GBps']:.0f} GB/s = {nbytes / bw * 1e3:.2f} ms for these bytes"
    )
    variants = ("kernel_alone", "kernel_top5", "kernel_top2")
    names = {"kernel_alone": "alone", "kernel_top5": "+ top-5 (lists of 5)", "kernel_top2": "+ top-5 (lists of 2)"}
    ahead = {"": "", "_prefetch": ", 1 block ahead", "_ahead2": ", 2 ahead"}
    heads = [f"{names[v]}{ahead[p]}" for v in variants for p in ahead]
    print("| BLOCK x warps | read-only (memory floor) | fp64 math only (ALU floor) | " + " | ".join(heads)
          + " | max KL diff vs torch | top-1 / topk_match equal | bit-identical across variants |")
    print("| --- " * (len(heads) + 6) + "|")
    for r in rows_out:
        listed = [f"{v}{p}" for v in ("kernel_top5", "kernel_top2") for p in ahead]
        diff = max(r.get(f"{k}_max_kl_diff_vs_torch", float("nan")) for k in listed)
        equal = all(r.get(f"{k}_top1_topk_equal_torch") for k in listed)
        same = all(r.get(f"{k}_bit_identical") for k in listed[1:])
        cells = " | ".join(cell(r.get(f"{v}{p}_ms")) for v in variants for p in ahead)
        print(f"| {r['config']} | {cell(r['read_only_ms'])} | {cell(r['fp64_math_ms'])} | {cells} | {diff:.1e} "
              f"| {equal} | {same} |")
    print("(percentages: the bytes read over the time, against the copy baseline)")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "metric_kernel_roofline.json").write_text(json.dumps(res, indent=1))
    return 0


LISTS = {"top2": "fused-top2", "top1v": "fused-top1v", "top5": "fused"}


def parse_variant(spec: str) -> MetricKernel:
    shape, lists, ahead, convert, *extras = spec.split(":")
    block, rest = shape.split("x")
    warps, _, regs = rest.partition("r")
    unknown = set(extras) - {"e6", "e8", "lean", "u1", "u2"}
    if unknown:
        raise SystemExit(f"--sweep {spec!r}: unknown {sorted(unknown)} (after the conversion: e6|e8, lean, u1|u2)")
    return MetricKernel(backend="triton", block=int(block), warps=int(warps), maxnreg=int(regs) if regs else None,
                        topk=LISTS[lists], prefetch=int(ahead.removeprefix("pf")),
                        convert={"f2f": False, "bits": True}[convert], exp_table_bits=8 if "e8" in extras else 6,
                        lean="lean" in extras, unroll=2 if "u2" in extras else 1)


def sweep(args, res, a, b, targets, want, consts, table, sink64, nbytes) -> int:
    """Times the metric step (KL both ways, NLLs, top-1, top-5 match, retries included) per kernel variant, checks each
    against the float64 torch path and, bit for bit, against the first variant."""
    n, v = a.shape
    bw = res["copy_GBps"] * 1e9
    rows_out, first = [], None
    shapes = []
    for spec in args.sweep.split(","):
        kernel = parse_variant(spec)
        row = {"variant": spec}
        try:
            run = lambda: metrics.device_metrics_columns(a, b, targets, kernel)  # noqa: E731
            got = run()
            row["max_kl_diff_vs_torch"] = float((got[0][:, :2] - want[0][:, :2]).abs().max())
            row["top_equal_torch"] = bool(torch.equal(got[1], want[1]))
            if first is None:
                first = got
            row["bit_identical_to_first"] = bool(torch.equal(got[0], first[0]) and torch.equal(got[1], first[1]))
            row["max_rel_diff_vs_first"] = float(((got[0] - first[0]).abs() / first[0].abs().clamp_min(1e-300)).max())
            row["ms"] = timed(run, args.repeat) * 1e3
        except Exception as e:          # a variant that does not build is reported, not fatal
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        shape = (kernel.block, kernel.warps)
        if shape not in shapes:
            shapes.append(shape)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    floors = []
    for block, warps in shapes:
        f = {"shape": f"{block}x{warps}"}
        for convert, bits in ((False, 6), (True, 6), (True, 8)):
            consts_, table_ = metrics._exp_constants(a.device, bits)
            f[f"fp64_math_{'bits' if convert else 'f2f'}_e{bits}_ms"] = timed(
                lambda: fp64_math_kernel[(n,)](sink64, consts_, table_, V=v, BLOCK=block, CONVERT=convert,
                                               EXP_BITS=bits, num_warps=warps),
                args.repeat) * 1e3
        floors.append(f)
        print(json.dumps(f), flush=True)
    res["sweep"], res["floors"] = rows_out, floors

    def cell(ms):
        return "-" if ms is None else f"{ms:.2f} ms ({nbytes / (ms / 1e3) / bw * 100:.0f} %)"

    print(
        f"{res['device']}, torch {res['torch']}, Triton {res['triton']}: {n} x {v} float32 x 2 = {nbytes / 1e9:.2f} GB "
        f"read; copy baseline {res['copy_GBps']:.0f} GB/s = {nbytes / bw * 1e3:.2f} ms for these bytes"
    )
    print(
        "| variant (BLOCKxWARPS[rREGS]:lists:blocks ahead:conversion[:e6|e8][:lean][:u1|u2]) | metric step with top-5 "
        "| max KL diff vs torch "
        "| top-1 / topk_match equal torch | bit-identical to the first (max relative difference) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for r in rows_out:
        if "error" in r:
            print(f"| {r['variant']} | {r['error']} | | | |")
        else:
            print(f"| {r['variant']} | {cell(r['ms'])} | {r['max_kl_diff_vs_torch']:.1e} | {r['top_equal_torch']} "
                  f"| {r['bit_identical_to_first']} ({r['max_rel_diff_vs_first']:.1e}) |")
    for f in floors:
        print(
            f"float64 math alone {f['shape']}: with F2F {cell(f['fp64_math_f2f_e6_ms'])}, with bits "
            f"{cell(f['fp64_math_bits_e6_ms'])}, with bits and the 256-entry exp table "
            f"{cell(f['fp64_math_bits_e8_ms'])}"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "metric_kernel_sweep.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
