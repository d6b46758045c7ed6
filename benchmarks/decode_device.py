"""Decoding where the oracle runs (issue 24, items 2 and 3), at DeepSeek-V4-Flash geometry.

    python benchmarks/decode_device.py [--threads 16] [--repeat 5] [--tokens 32768] [--no-layers]

Table 1, per format: one matrix of random stored bytes in a pack written to a temporary folder; the CPU decode
(`pack.tensor(name)`, torch on --threads threads: today's path, whose fp32 result was then copied to the GPU) against
the device decode (`pack.tensor(name, device="cuda")`: the stored bytes go through pinned memory to the GPU and torch
decodes them there; synchronised, the copy included); bytes sent to the GPU (stored bytes) against the fp32 bytes the
old path copied; whether the two decodes are bit-identical. EXL3 also with the integer Hadamard sums (the exact path
for GPUs with slow float64) to show what that path costs on this GPU.

Table 2 (CUDA only): Llama-shaped bf16 layers (hidden 4096, intermediate 11008) streamed by the prefetching oracle over
--tokens tokens: per layer the loader thread's stage (stored bytes -> pinned host memory) and build (copy + decode +
layer construction) seconds, the compute thread's visible wait, and the layer's compute time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fidelity import open_pack  # noqa: E402
from fidelity.packs import staging  # noqa: E402
from fidelity.packs.exl3 import codec  # noqa: E402
from fidelity.packs.safetensors_io import write_safetensors  # noqa: E402

HIDDEN, EXPERT = 4096, 2048          # DeepSeek-V4-Flash hidden size and routed/shared expert width


def rand_fp8(*shape):
    b = torch.randint(0, 256, shape, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3C
    return b.view(torch.float8_e4m3fn)


def write(root: Path, tensors: dict, config: dict) -> Path:
    root.mkdir(parents=True)
    write_safetensors(root / "model.safetensors", tensors)
    (root / "config.json").write_text(json.dumps({"architectures": ["X"], **config}))
    return root


def exl3_case(K: float):
    """A routed expert w1 [2048, 4096] in exllamav3 naming (mul1)."""
    out, inp = EXPERT, HIDDEN
    t = {
        "e.trellis": torch.randint(-32768, 32768, (inp // 16, out // 16, codec.Bitrate.of(K).words), dtype=torch.int16),
        "e.suh": (torch.randn(inp) * 0.05).half(),
        "e.svh": (torch.randn(out) * 0.05).half(),
        **{f"e.{k}": v for k, v in codec.codebook_marker("mul1").items()},
    }
    return t, {"quantization_config": {"quant_method": "exl3"}}, "e.weight"


def cases():
    """(label, tensors, config, logical name)."""
    for K in (2, 2.5, 3, 4, 5):
        yield (f"EXL3 K{K:g} mul1 routed expert {EXPERT}x{HIDDEN}", *exl3_case(K))
    e = torch.randint(120, 130, (HIDDEN // 128, HIDDEN // 128), dtype=torch.uint8)
    yield (f"FP8 e4m3 ue8m0 128x128 dense {HIDDEN}x{HIDDEN}",
           {"d.weight": rand_fp8(HIDDEN, HIDDEN), "d.weight_scale_inv": e.view(torch.float8_e8m0fnu)},
           {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}},
           "d.weight")
    yield (f"FP8 e4m3 fp32 128x128 dense {HIDDEN}x{HIDDEN}",
           {"d.weight": rand_fp8(HIDDEN, HIDDEN), "d.weight_scale_inv": torch.rand(HIDDEN // 128, HIDDEN // 128)},
           {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "d.weight")
    yield (f"MXFP4 shared expert {EXPERT}x{HIDDEN}",
           {"s.weight": torch.randint(-128, 128, (EXPERT, HIDDEN // 2), dtype=torch.int8),
            "s.scale": torch.randint(115, 130, (EXPERT, HIDDEN // 32), dtype=torch.uint8).view(torch.float8_e8m0fnu)},
           {}, "s.weight")
    s = torch.randint(0x08, 0x7F, (HIDDEN, HIDDEN // 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    yield (f"NVFP4 (ModelOpt) {HIDDEN}x{HIDDEN}",
           {"n.weight": torch.randint(0, 256, (HIDDEN, HIDDEN // 2), dtype=torch.uint8), "n.weight_scale": s,
            "n.weight_scale_2": torch.tensor(1e-3)},
           {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}, "n.weight")
    b = torch.randint(-32768, 32768, (HIDDEN, HIDDEN), dtype=torch.int16).view(torch.bfloat16)
    yield (
        f"bf16 cast {HIDDEN}x{HIDDEN}",
        {"b.weight": torch.where(torch.isfinite(b), b, torch.zeros((), dtype=b.dtype))},
        {},
        "b.weight",
    )
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": {"g": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
              "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}}}}
    yield (
        f"compressed-tensors int4 g128 asym {HIDDEN}x{HIDDEN}",
        {
            "c.weight_packed": torch.randint(-(2**31), 2**31, (HIDDEN, HIDDEN // 8), dtype=torch.int64).to(torch.int32),
            "c.weight_shape": torch.tensor([HIDDEN, HIDDEN]),
            "c.weight_scale": (torch.rand(HIDDEN, HIDDEN // 128) * 1e-2).bfloat16(),
            "c.weight_zero_point": torch.randint(-(2**31), 2**31, (HIDDEN // 8, HIDDEN // 128), dtype=torch.int64).to(
                torch.int32
            ),
        },
        {"quantization_config": qc},
        "c.weight",
    )


def gguf_cases(root: Path):
    try:
        import gguf
        from testkit.raw_gguf import write_gguf_tensors
    except ImportError:
        print("(gguf-py not installed: GGUF rows skipped)")
        return
    hp = {"block_count": 2, "context_length": 4096, "embedding_length": HIDDEN, "feed_forward_length": HIDDEN,
          "attention.head_count": 32, "attention.head_count_kv": 8, "attention.layer_norm_rms_epsilon": 1e-6,
          "rope.freq_base": 1e6, "vocab_size": 1000}
    from fidelity.packs.gguf import TORCH_DECODERS
    for qtype, f16_fields in (("Q8_0", (0,)), ("Q4_K", (0, 2)), ("Q6_K", (208,)), ("IQ4_XS", (0,))):
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
        b = torch.randint(0, 256, (HIDDEN, HIDDEN // block, size), dtype=torch.uint8)
        for off in f16_fields:
            b[..., off:off + 2] = (torch.rand(HIDDEN, HIDDEN // block) * 0.02).half().view(torch.uint8).view(
                HIDDEN, HIDDEN // block, 2)
        path = write_gguf_tensors(root / f"{qtype}.gguf", "qwen3", hp,
                                  {"blk.0.ffn_down.weight": (b.reshape(HIDDEN, -1).numpy(), qtype)})
        torch_path = "torch on the device" if qtype in TORCH_DECODERS else "gguf-py on the CPU, fp32 moved"
        yield f"GGUF {qtype} {HIDDEN}x{HIDDEN} ({torch_path})", open_pack(path), "model.layers.0.mlp.down_proj.weight"


def timed(fn, repeat: int, cuda: bool) -> tuple[float, torch.Tensor]:
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def decode_table(args, root: Path) -> list[dict]:
    cuda = torch.cuda.is_available()
    rows = []
    items = []
    for i, (label, tensors, config, name) in enumerate(cases()):
        items.append((label, open_pack(write(root / f"c{i}", tensors, config)), name))
    items += list(gguf_cases(root))
    print(f"| format | CPU decode ({args.threads} threads) | device decode | speed-up | sent to device | fp32 bytes "
          f"(old copy) | bit-identical |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, pack, name in items:
        torch.set_num_threads(args.threads)
        cpu_s, cpu = timed(lambda: pack.tensor(name), args.repeat, False)
        row = {"format": label, "cpu_s": cpu_s, "numel": cpu.numel(), "stored": pack.storage(name).nbytes}
        if cuda:
            before = staging.bytes_sent()
            dev_s, dev = timed(lambda: pack.tensor(name, device="cuda"), args.repeat, True)
            row.update(dev_s=dev_s, sent=(staging.bytes_sent() - before) // (args.repeat + 1),
                       equal=torch.equal(dev.cpu(), cpu))
        rows.append(row)
        print_row(row)
        if label.startswith("EXL3") and cuda:
            lin = pack.raw
            tr, suh, svh = (lin.get(f"e.{k}").cuda() for k in ("trellis", "suh", "svh"))
            for sums in codec.HADAMARD_SUMS:
                s, w = timed(lambda: codec.decode_weight(tr, suh, svh, "mul1", sums=sums), args.repeat, True)
                print(f"|   decode_weight on the device, {sums} Hadamard sums (trellis already there) | | "
                      f"{s * 1e3:.3f} ms | | | | {torch.equal(w.cpu(), cpu)} |")
    return rows


def print_row(r: dict) -> None:
    fp32 = 4 * r["numel"]
    if "dev_s" not in r:
        print(f"| {r['format']} | {r['cpu_s'] * 1e3:.2f} ms | (no CUDA) | | | {fp32 / 2**20:.1f} MiB | |")
        return
    print(f"| {r['format']} | {r['cpu_s'] * 1e3:.2f} ms | {r['dev_s'] * 1e3:.3f} ms | {r['cpu_s'] / r['dev_s']:.0f}x | "
          f"{r['sent'] / 2**20:.1f} MiB | {fp32 / 2**20:.1f} MiB | {r['equal']} |")


def layer_table(args, root: Path) -> None:
    from fidelity.oracle import LoadChain, Oracle
    from fidelity.oracle.parallel import Prefetcher
    from testkit.synthetic import llama_config, llama_shapes

    n = 4
    cfg = llama_config(HIDDEN, 11008, n, 1024, 32, 8)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for name, shape in llama_shapes(cfg).items():
        w = torch.randn(shape, generator=g, device="cuda")
        tensors[name] = (w.add_(1.0) if len(shape) == 1 else w / shape[-1] ** 0.5).bfloat16().cpu()
    pack = open_pack(write(root / "llama", tensors, cfg))
    del tensors
    rows = args.tokens // 4096
    tokens = torch.randint(0, 1024, (rows, 4096), generator=torch.Generator().manual_seed(0)).tolist()
    marks: dict[tuple[str, int], float] = {}

    class Marked(Prefetcher):
        def __call__(self, i):
            torch.cuda.synchronize()         # layer i-1's kernels done: its compute ends here
            marks[("call", i)] = time.perf_counter()
            layer = super().__call__(i)
            marks[("ret", i)] = time.perf_counter()
            return layer
    oracle = Oracle(pack, device="cuda", chain=LoadChain(prefetch=Marked))
    loader = oracle.prefetcher
    oracle.hidden_states(tokens[:1], progress=False)      # warm-up: kernels, page cache
    marks.clear()
    t0 = time.perf_counter()
    oracle.hidden_states(tokens, progress=False)
    torch.cuda.synchronize()
    end = time.perf_counter()
    timeline = {t.layer: t for t in list(loader.timeline)[-n:]}
    print(
        f"\nLayer prefetch: {n} bf16 Llama layers (hidden {HIDDEN}, intermediate 11008, "
        f"{timeline[0].staged_bytes / 2**20:.0f} MiB stored each), {rows} rows x 4096 tokens, pass {end - t0:.3f} s\n"
    )
    print("| layer | stage (loader thread) | build: copy + decode (loader thread) | visible wait (compute thread) | "
          "compute |")
    print("| --- | --- | --- | --- | --- |")
    for i in range(n):
        compute = (marks[("call", i + 1)] if i + 1 < n else end) - marks[("ret", i)]
        t = timeline[i]
        print(f"| {i} | {t.stage_s:.3f} s | {t.build_s:.3f} s | {t.wait_s:.3f} s | {compute:.3f} s |")
    print(f"\n(peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB; layer 0's load is not overlapped: "
          f"nothing computes before it)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--no-layers", action="store_true")
    args = p.parse_args()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    print(f"torch {torch.__version__}, {dev}, CPU threads {args.threads}; medians of {args.repeat} after a warm-up\n")
    torch.backends.cuda.matmul.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        decode_table(args, Path(tmp))
        if torch.cuda.is_available() and not args.no_layers:
            layer_table(args, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
