"""Compute of one DeepSeek-V4-Flash-geometry oracle layer on the GPU against the fp32 matmul rate measured in the same
run.

Random fp32 weights are made on the device by name (no pack, no reading: this times the layer's compute only), for
transformers' DeepseekV4Config defaults (hidden 4096, 64 heads x 512, q/o LoRA 1024 in 8 groups, 256 experts x 2048
top-6 + 1 shared, CSA ratio 4 with a 64-head indexer keeping 512, HCA ratio 128, window 128, hc 4, 20 Sinkhorn
iterations). For each layer kind and batch shape it prints seconds per pass (after a warm-up pass that also makes the
experts), tokens/s, the FLOPs the layer needs (GEMMs, the window and the selected or finished entries, the indexer's
scoring of every finished entry; none of the masked work), and that over the matmul rate (the "floor" share: 100 % =
the layer at the rate of one big fp32 GEMM). `--save`/`--against`: a sample of the outputs, to compare two versions of
the code on the same weights.

    python benchmarks/deepseek_v4_layer.py [--shapes 16x2048,1x32768] [--kinds csa,hca] [--save F | --against F]
"""
from __future__ import annotations

import argparse
import time
from functools import partial
import zlib

import torch

from fidelity.oracle.common import Fetch, rms_norm
from fidelity.oracle.deepseek.dsv4_ops import CSA, HCA
from fidelity.oracle.deepseek.v4 import DeepseekV4Family
from fidelity.oracle.runner import exact_math

GEOMETRY = dict(
    architectures=["DeepseekV4ForCausalLM"], vocab_size=129280, hidden_size=4096, num_hidden_layers=2,
    num_attention_heads=64, head_dim=512, partial_rotary_factor=0.125, qk_rope_head_dim=64, q_lora_rank=1024,
    o_groups=8, o_lora_rank=1024, sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6,
    moe_intermediate_size=2048, routed_scaling_factor=1.5, swiglu_limit=10.0, scoring_func="sqrtsoftplus",
    rms_norm_eps=1e-6, max_position_embeddings=1 << 20, rope_theta=10000.0, compress_rope_theta=160000.0,
    compress_rates={CSA: 4, HCA: 128}, layer_types=[CSA, HCA], mlp_layer_types=["moe", "moe"])


def shape_of(name: str, c: dict) -> tuple:
    hidden, H, D, hc = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["hc_mult"]
    q, g, r = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    E, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    Hi, Di = c["index_n_heads"], c["index_head_dim"]
    layer = int(name.split(".")[1])
    kind = c["layer_types"][layer]
    ratio = c["compress_rates"][kind]
    tail = name.split(".", 2)[2]
    if tail.startswith("hc_"):
        return {"fn": ((2 + hc) * hc, hc * hidden), "base": ((2 + hc) * hc,), "scale": (3,)}[tail.rsplit("_", 1)[1]]
    if tail in ("attn_norm.weight", "ffn_norm.weight"):
        return (hidden,)
    if ".compressor." in tail:
        width = Di if ".indexer." in tail else D
        wide = 2 * width if (kind == CSA) else width
        leaf = tail.split(".compressor.")[1]
        return {"wkv.weight": (wide, hidden), "wgate.weight": (wide, hidden), "ape": (ratio, wide),
                "norm.weight": (width,)}[leaf]
    fixed = {"attn.wq_a.weight": (q, hidden), "attn.q_norm.weight": (q,), "attn.wq_b.weight": (H * D, q),
             "attn.wkv.weight": (D, hidden), "attn.kv_norm.weight": (D,), "attn.wo_a.weight": (g * r, H * D // g),
             "attn.wo_b.weight": (hidden, g * r), "attn.attn_sink": (H,), "attn.indexer.wq_b.weight": (Hi * Di, q),
             "attn.indexer.weights_proj.weight": (Hi, hidden), "ffn.gate.weight": (E, hidden), "ffn.gate.bias": (E,)}
    if tail in fixed:
        return fixed[tail]
    w = tail.rsplit(".", 2)[-2]
    return (hidden, inter) if w == "w2" else (inter, hidden)


def random_fetch(c: dict, device) -> Fetch:
    def read(name: str, device=None) -> torch.Tensor:
        shape = shape_of(name, c)
        g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        t = torch.randn(shape, generator=g, device=device)
        if name.endswith(("norm.weight", "_scale")):
            return 1.0 + 0.1 * t
        if name.endswith(("_base", "ape", "attn_sink", "gate.bias")):
            return 0.1 * t
        return t / shape[-1] ** 0.5

    return Fetch(read, lambda n: shape_of(n, c), device, torch.float32)


def needed_flops(c: dict, kind: str, B: int, T: int) -> dict[str, float]:
    """FLOPs the layer needs (multiply-adds x 2), by part."""
    hidden, H, D, hc = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["hc_mult"]
    q, g, r = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    E, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    Hi, Di, topk, window = c["index_n_heads"], c["index_head_dim"], c["index_topk"], c["sliding_window"]
    ratio = c["compress_rates"][kind]
    t = torch.arange(T, dtype=torch.float64)
    finished = torch.div(t + 1, ratio, rounding_mode="floor")
    local = torch.clamp(t + 1, max=window).sum().item()
    far = (torch.clamp(finished, max=topk) if kind == CSA else finished).sum().item()
    wide = 2 if kind == CSA else 1
    per_token_proj = 2 * (hidden * q + q * H * D + hidden * D + H * D * r + g * r * hidden)
    out = {
        "projections": B * T * per_token_proj,
        "compressor": B * T * 2 * 2 * hidden * wide * D,
        "attention": B * 2 * 2 * H * D * (local + far),
        "moe": B * T * (2 * hidden * E + (c["num_experts_per_tok"] + c["n_shared_experts"]) * 2 * 3 * hidden * inter),
        "hc": B * T * 2 * (2 * hc * hidden * (2 + hc) * hc + 2 * hc * hc * hidden),
    }
    if kind == CSA and T // ratio > topk:     # with no more entries than the top-k, all are kept: no indexer needed
        out["indexer"] = B * (T * 2 * (2 * 2 * hidden * Di + q * Hi * Di + hidden * Hi)
                              + 2 * (Hi * Di + Hi) * finished.sum().item())
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_rate(device, n: int = 8192, reps: int = 5) -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def timed(fn, reps: int):
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync()
    return out, (time.perf_counter() - t0) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16x2048,1x32768", help="rows x tokens, comma-separated")
    ap.add_argument("--kinds", default="csa,hca")
    ap.add_argument("--reps", type=int, default=2, help="timed passes of the whole layer (parts: one each)")
    ap.add_argument(
        "--profile", action="store_true", help="the heaviest operators of one pass of the first layer/shape"
    )
    ap.add_argument("--save", help="write output samples here")
    ap.add_argument("--against", help="compare output samples with this file")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--geometry", default="{}", help="JSON of config keys to override (smaller models for a smoke test)"
    )
    args = ap.parse_args(argv)
    import json
    device = torch.device(args.device)
    exact_math(device)
    rate = matmul_rate(device, 8192 if device.type == "cuda" else 512)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"fp32 matmul rate (8192^3, TF32 off): {rate / 1e12:.1f} TFLOP/s; {name}, torch {torch.__version__}")
    geometry = {**GEOMETRY, **json.loads(args.geometry)}
    fam = DeepseekV4Family(geometry)
    fetch = random_fetch(geometry, device)
    a = fam.args
    samples, reference = {}, torch.load(args.against) if args.against else {}
    print("| layer | rows x tokens | s/pass | attention s | of which indexer s | MoE s | tokens/s | needed TFLOP |"
          " TFLOP/s | of matmul rate | peak GiB | vs saved |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        index = {"csa": 0, "hca": 1}[kind]
        layer = fam.load_layer(index, fetch)
        for shape in args.shapes.split(","):
            B, T = (int(v) for v in shape.split("x"))
            g = torch.Generator(device=device).manual_seed(B * 100003 + T)
            streams = torch.randn(B, T, a.hc_mult, a.hidden_size, generator=g, device=device)
            tokens = torch.randint(0, a.vocab_size, (B, T), generator=g, device=device)
            rope = fam.rope_tables(T, torch.float32, device)
            layer(streams, rope, tokens)                       # warm-up: makes the experts, grows the allocator
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            out, seconds = timed(partial(layer, streams, rope, tokens), args.reps)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            post, comb, x = layer.attn_hc(streams)
            x = rms_norm(x, layer.attn_norm, a.rms_norm_eps)
            _, attn_s = timed(partial(layer.attn, x, rope), 1)
            index_s = 0.0
            if layer.attn.indexer is not None:
                q_latent = rms_norm(torch.nn.functional.linear(x, layer.attn.wq_a), layer.attn.q_norm, a.rms_norm_eps)
                _, index_s = timed(partial(layer.attn.indexer.selected, x, q_latent, rope[2:]), 1)
            _, moe_s = timed(partial(layer.ffn, x, tokens), 1)
            if args.profile and not samples:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    layer(streams, rope, tokens)
                    sync()
                averages = prof.key_averages()
                try:
                    profiled = averages.table(sort_by="device_time_total", row_limit=14, max_name_column_width=48)
                except Exception:   # older torch names it cuda_time_total
                    profiled = averages.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=48)
            flops = needed_flops(geometry, a.layer_types[index], B, T)
            total = sum(flops.values())
            key = f"{kind}-{shape}"
            samples[key] = out[:, ::97, :, ::61].cpu()
            versus = ""
            if key in reference:
                want = reference[key]
                versus = f"{((samples[key] - want).abs().max() / want.abs().max()).item():.2g}"
            print(f"| {kind} | {B} x {T} | {seconds:.3f} | {attn_s:.3f} | {index_s:.3f} | {moe_s:.3f} | "
                  f"{B * T / seconds:,.0f} | {total / 1e12:.1f} | {total / seconds / 1e12:.1f} | "
                  f"{100 * total / seconds / rate:.0f} % | {peak:.1f} | {versus} |")
            print("  needed TFLOP by part: " + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in flops.items()))
            if args.profile and len(samples) == 1:
                print(profiled)
            del out, streams, post, comb, x
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.save:
        torch.save(samples, args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
