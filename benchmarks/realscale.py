"""DeepSeek V4-Flash / V4.1-Flash geometry, one layer at a time, in the seeds' storage; and the head + metrics step at
the real vocabulary. Everything is built where the script runs (random weights, nothing carried).

    python benchmarks/realscale.py [--device cuda] [--archs v4,v41] [--rows 8 --length 2048] [--out DIR]
    python benchmarks/realscale.py --smoke          # tiny sizes, any device (CPU here): checks the script itself
    python benchmarks/realscale.py --archs v41 --shapes 1x32768   # also time the built layer at other rows x lengths
    torchrun --nproc-per-node N benchmarks/realscale.py --parallel experts,rows [--archs v41 --experts 48]
    torchrun --nproc-per-node 2 benchmarks/realscale.py --parallel experts,rows --device cpu --smoke   # gloo, seconds

`--parallel` (under torchrun, or in one process as world size 1): the one layer through fidelity.oracle.parallel's own
paths,
`make_oracle(pack, settings=RunSettings(parallel="experts"))` (the routed experts split across ranks, per-(token,
slot) outputs exchanged with one all_reduce) and `parallel="rows"` (row batches dealt to ranks, each layer read 1/N per
rank, hidden states broadcast), timed against one rank running the plain Oracle on the same rows in the same run, and
compared with it by torch.equal (see parallel_main).

Layers (transformers 5.24 DeepseekV4Config defaults: hidden 4096, 64 heads x 512, q/o LoRA 1024 (8 output groups),
a CSA layer (ratio 4, indexer 64 x 128, top-512, window 128), 256 routed experts x 2048 for V4-Flash and 384 for
V4.1-Flash, top-6, one shared expert, hc 4; V4.1 adds its shared pool/indexer/candidate blocks and an Engram layer),
written by testkit.minipacks_v4's writer in the `deepseek_v41_exl3` layout: routed experts EXL3 at mixed K 2-5
(the seed cards' K mix) as random valid trellises (any bits are a valid trellis; decode costs the same), `wo_a` and the
head EXL3 too, FP8 e4m3 ue8m0 dense/attention, MXFP4 shared experts, V4.1's Engram table FP8 per row. Per layer:
read (the layer's stored bytes from the page cache), load (Oracle.load_layer: read + decode + copy to the device, as
main does it), compute (the layer over rows x length tokens), tokens/s, the floor (dense + routed + attention FLOPs
over the fp32 matmul rate measured here, plus the device decode of the layer's matrices measured here), GPU peak, and
the extrapolation to a 317k-token panel over 40 layers of 384 experts. Then the head + metrics at vocabulary 129,280:
the two heads' plain GEMMs vs compare's device step (store.device_row_metrics) with and without a stored top-K, and the
metric kernel alone against the measured device copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fidelity import open_pack  # noqa: E402
from fidelity.oracle import Oracle, OracleTaps  # noqa: E402
from fidelity.oracle.runner import exact_math  # noqa: E402
from fidelity.packs.base import LogicalTensor, Pack, Storage  # noqa: E402

PANEL_TOKENS = 317_000
LAYERS = 40
EXPERTS_V41 = 384
VOCAB = 129_280
SEED_K_COUNTS = {2: 6157, 3: 7689, 4: 1479, 5: 35}   # a seed card's routed-expert K histogram (V4.1-Flash, 40 x 384)

FLASH = dict(hidden_size=4096, num_attention_heads=64, head_dim=512, q_lora_rank=1024, o_lora_rank=1024, o_groups=8,
             n_routed_experts=256, moe_intermediate_size=2048, num_experts_per_tok=6, n_shared_experts=1,
             index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128, hc_mult=4)
SMOKE = dict(hidden_size=256, num_attention_heads=4, head_dim=64, q_lora_rank=64, o_lora_rank=64, o_groups=2,
             n_routed_experts=8, moe_intermediate_size=128, num_experts_per_tok=2, n_shared_experts=1, index_n_heads=2,
             index_head_dim=32, index_topk=8, sliding_window=16, hc_mult=2, partial_rotary_factor=0.25)
V41_FLASH = dict(compress_ratios=[4], kv_source_layer_ids=[0], index_source_layer_ids=[0], candidate_source_layer_id=0,
                 candidate_topk_blocks=16, candidate_block_size=64, num_hash_layers=0, engram_layer_ids=[0],
                 engram_vocab_size=20_000, engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=64,
                 engram_pad_token_id=2)
V41_SMOKE = {**V41_FLASH, "candidate_topk_blocks": 2, "candidate_block_size": 4, "engram_vocab_size": 300,
             "engram_n_heads": 2, "engram_head_dim": 16}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat: int = 1):
    sync(device)
    t = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    sync(device)
    return (time.perf_counter() - t) / repeat, out


# -- the layer packs ------------------------------------------------------------------------------------------------
# transformers 5.24's DeepseekV4Config() defaults that the one-layer config keeps (the device machine's transformers
# may predate DeepseekV4Config, so they are written out)
V4_DEFAULTS = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", attention_bias=False, attention_dropout=0.0,
    compress_rope_theta=160000.0, hc_eps=1e-6, hc_sinkhorn_iters=20, hidden_act="silu", max_position_embeddings=1048576,
    norm_topk_prob=True, num_key_value_heads=1, partial_rotary_factor=0.125, qk_rope_head_dim=64, rms_norm_eps=1e-6,
    rope_theta=10000.0, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=10.0,
    rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
                     "compress": {"rope_theta": 160000.0, "rope_type": "default", "partial_rotary_factor": 0.125}},
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})


def v4_config(geometry: dict, experts: int, layers: int = 1) -> dict:
    cfg = {
        **V4_DEFAULTS,
        **geometry,
        "n_routed_experts": experts,
        "num_hidden_layers": layers,
        "vocab_size": 256,
        "layer_types": ["compressed_sparse_attention"] * layers,
        "mlp_layer_types": ["moe"] * layers,
        "bos_token_id": None,
        "eos_token_id": None,
        "tie_word_embeddings": False,
    }
    rot = cfg["partial_rotary_factor"]
    for site in cfg["rope_parameters"].values():
        site["partial_rotary_factor"] = rot
    cfg["qk_rope_head_dim"] = int(cfg["head_dim"] * rot)
    return cfg


def v4_shapes(cfg: dict) -> dict[str, tuple]:
    """Official names and shapes of the V4 (every layer a CSA layer with a routed MoE), as transformers' save_pretrained
    and DeepSeek's release name them (tests/fixtures/v4/tiny_v4 holds the same names at its own sizes)."""
    h, hc, V = cfg["hidden_size"], cfg["hc_mult"], cfg["vocab_size"]
    out = {"embed.weight": (V, h), "head.weight": (V, h), "norm.weight": (h,), "hc_head_base": (hc,),
           "hc_head_fn": (hc, hc * h), "hc_head_scale": (1,)}
    for layer in range(cfg["num_hidden_layers"]):
        out.update(v4_layer_shapes(cfg, f"layers.{layer}"))
    return out


def v4_layer_shapes(cfg: dict, p: str) -> dict[str, tuple]:
    h, heads, hd, hc = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["hc_mult"]
    q_rank, o_rank, groups = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
    ih, ihd, inter, E = (
        cfg["index_n_heads"],
        cfg["index_head_dim"],
        cfg["moe_intermediate_size"],
        cfg["n_routed_experts"],
    )
    ratio = cfg["compress_rates"]["compressed_sparse_attention"]
    mix = (2 + hc) * hc
    out = {
        f"{p}.attn.attn_sink": (heads,),
        f"{p}.attn.kv_norm.weight": (hd,),
        f"{p}.attn.q_norm.weight": (q_rank,),
        f"{p}.attn.wkv.weight": (hd, h),
        f"{p}.attn.wq_a.weight": (q_rank, h),
        f"{p}.attn.wq_b.weight": (heads * hd, q_rank),
        f"{p}.attn.wo_a.weight": (groups * o_rank, heads * hd // groups),
        f"{p}.attn.wo_b.weight": (h, groups * o_rank),
        f"{p}.attn.indexer.weights_proj.weight": (ih, h),
        f"{p}.attn.indexer.wq_b.weight": (ih * ihd, q_rank),
        f"{p}.attn_norm.weight": (h,),
        f"{p}.ffn_norm.weight": (h,),
        f"{p}.ffn.gate.bias": (E,),
        f"{p}.ffn.gate.weight": (E, h),
    }
    for comp, width in ((f"{p}.attn.compressor", hd), (f"{p}.attn.indexer.compressor", ihd)):
        out.update({f"{comp}.ape": (ratio, 2 * width), f"{comp}.norm.weight": (width,),
                    f"{comp}.wgate.weight": (2 * width, h), f"{comp}.wkv.weight": (2 * width, h)})
    for site in ("attn", "ffn"):
        out.update({f"{p}.hc_{site}_base": (mix,), f"{p}.hc_{site}_fn": (mix, hc * h), f"{p}.hc_{site}_scale": (3,)})
    for e in [*range(E), "shared"]:
        q = f"{p}.ffn.shared_experts" if e == "shared" else f"{p}.ffn.experts.{e}"
        out.update({f"{q}.w1.weight": (inter, h), f"{q}.w2.weight": (h, inter), f"{q}.w3.weight": (inter, h)})
    return out


def v4_native_without_experts(cfg: dict, out: Path, device) -> tuple[Path, dict[str, tuple]]:
    """The official-named V4 as minipacks_v4.build_native writes it (bf16, randomize_weights' scales),
    except the routed experts, which are only named (their [out, in] shapes returned): their bytes come as random
    EXL3 trellises later, never as bf16 weights."""
    from fidelity.packs.exl3.layouts import routed_expert
    from testkit.minipacks_v4 import byte_tokenizer
    from fidelity.packs.safetensors_io import write_safetensors

    tensors, experts = {}, {}
    g = torch.Generator(device=device).manual_seed(20261201)
    for name, shape in v4_shapes(cfg).items():
        if routed_expert(name) is not None:
            experts[name] = shape
            continue
        x = torch.randn(shape, generator=g, device=device)
        if "norm" in name:
            x = 1.0 + 0.2 * x
        elif name.endswith("scale"):
            x = 1.0 + 0.5 * x
        elif x.dim() == 1:
            x = 0.1 * x
        elif "embed" not in name:
            x = x / math.sqrt(x.shape[-1])
        tensors[name] = x.to(torch.bfloat16).cpu()
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    byte_tokenizer().save_pretrained(str(out))
    return out, experts


class WithExperts(Pack):
    """A native pack plus routed experts that exist only by name and shape (the writer asks each tensor's kind; the
    random-trellis cache below supplies their stored bytes)."""

    def __init__(self, base: Pack, experts: dict[str, tuple]):
        super().__init__(base.path)
        self.base, self.config, self.raw, self.root = base, base.config, base.raw, getattr(base, "root", base.path)
        self.format = base.format
        self._experts = experts
        for name in base.names():
            if name not in experts and not (".ffn.experts." in name and name.endswith(("gate_up_proj", "down_proj"))):
                self._entries[name] = LogicalTensor(base.storage(name), lambda n=name: base.tensor(n))
        for name, shape in experts.items():
            self._entries[name] = LogicalTensor(Storage(name, "none", "none", shape, 0),
                                                lambda s=shape: torch.empty(s))


class RandomTrellis:
    """EncodingCache's interface with random valid EXL3 tensors (mul1 codebook) instead of encodings, scaled so a
    decoded weight has about the std 1/sqrt(in) of the native init. Generated on `device`."""

    def __init__(self, device, seed: int = 7):
        from fidelity.packs.exl3.codec import HAD, codebook_marker, decode_weight
        self.device, self.misses, self.HAD, self.marker = device, 0, HAD, codebook_marker("mul1")
        self.g = torch.Generator(device=device).manual_seed(seed)
        probe = self._trellis(256, 256, 3)
        ones = torch.ones(256, dtype=torch.float16, device=device)
        self.unit_std = float(decode_weight(probe, ones, ones, "mul1").std())

    def _trellis(self, k_p: int, n_p: int, K: float) -> torch.Tensor:
        words = int(16 * K) if float(K).is_integer() else int(16 * (K - 0.5) + 8)
        return torch.randint(-32768, 32768, (k_p // 16, n_p // 16, words), generator=self.g, device=self.device,
                             dtype=torch.int32).to(torch.int16)

    def _signs(self, n: int) -> torch.Tensor:
        return torch.randint(0, 2, (n,), generator=self.g, device=self.device).float() * 2 - 1

    def get(self, name: str, weight: torch.Tensor, K: float, codebook: str, device=None) -> dict[str, torch.Tensor]:
        if codebook != "mul1":
            raise ValueError("random trellises are written for the mul1 codebook")
        out_f, in_f = weight.shape
        k_p, n_p = -(-in_f // self.HAD) * self.HAD, -(-out_f // self.HAD) * self.HAD
        su = self._signs(k_p) / (math.sqrt(in_f) * self.unit_std)
        return {
            "trellis": self._trellis(k_p, n_p, K).cpu(),
            "suh": su.half().cpu(),
            "svh": self._signs(n_p).half().cpu(),
            **{k: v.clone() for k, v in self.marker.items()},
        }


def expert_k_string(n_experts: int, seed: int = 3) -> str:
    """n_experts K digits (2..5) drawn with the seed card's K proportions."""
    g = torch.Generator().manual_seed(seed)
    ks, counts = zip(*SEED_K_COUNTS.items())
    weights = torch.tensor(counts, dtype=torch.float64)
    picks = torch.multinomial(weights, n_experts, replacement=True, generator=g)
    return "".join(str(ks[int(i)]) for i in picks)


def v41_layers(v41_extra: dict, layers: int) -> dict:
    """V4.1's per-layer lists for `layers` layers alike: each owns its compressed pool and runs its own indexer (the
    one-layer benchmark's cost in every layer); the last layer is the candidate source (a later index layer would have
    to read its pool), layer 0 the one Engram layer."""
    if layers == 1:
        return v41_extra
    ratio = v41_extra["compress_ratios"][0]
    return {**v41_extra, "compress_ratios": [ratio] * layers, "kv_source_layer_ids": list(range(layers)),
            "index_source_layer_ids": list(range(layers)), "candidate_source_layer_id": layers - 1}


def build_layer_pack(arch: str, geometry: dict, v41_extra: dict, experts: int, work: Path, device,
                     layers: int = 1) -> tuple[Path, dict]:
    from testkit.minipacks_v4 import V4MiniSpec, write_v4_minipack

    cfg = v4_config(geometry, experts, layers)
    v4_dir, expert_shapes = v4_native_without_experts(cfg, work / f"{arch}-native-v4", device)
    native_dir = v4_dir
    if arch == "v41":
        from testkit.minipacks_v41 import build_native_v41
        native_dir = build_native_v41(v4_dir, work / f"{arch}-native", index_topk=geometry["index_topk"],
                                      **v41_layers(v41_extra, layers))
    spec = V4MiniSpec(expert_k=expert_k_string(experts), dense_k=4, head_k=4, fp8_block=32 if arch == "v41" else 128)
    native = WithExperts(open_pack(native_dir), expert_shapes)
    out = write_v4_minipack(native, "deepseek_v41_exl3", work / f"{arch}-exl3", spec, RandomTrellis(device))
    mix = {k: spec.expert_k.count(str(k)) for k in SEED_K_COUNTS}
    return out, {
        "experts": experts,
        "expert_k_mix": mix,
        "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
    }


# -- measuring ------------------------------------------------------------------------------------------------------
def matmul_rate(device, n: int) -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    s, _ = timed(lambda: a @ b, device, repeat=3)
    return 2 * n ** 3 / s


def copy_bandwidth(device, elements: int) -> float:
    """Bytes read + written per second of a device-to-device copy."""
    x = torch.empty(elements, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    s, _ = timed(lambda: y.copy_(x), device, repeat=5)
    return 2 * 4 * elements / s


def read_seconds(pack_dir: Path) -> tuple[float, int]:
    """The layer's stored bytes through safetensors into host memory (files just written: the page cache)."""
    from safetensors import safe_open
    t, nbytes = time.perf_counter(), 0
    for f in sorted(pack_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                nbytes += sf.get_tensor(k).nbytes
    return time.perf_counter() - t, nbytes


def layer_flops_per_token(cfg: dict, length: int) -> float:
    """Matmul FLOPs per token: every dense linear of the layer once, top-k routed experts, the attention core over the
    window plus the selected compressed entries, and the indexer's scores over the compressed entries (causal mean)."""
    h, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    inter, topk = cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    q_rank, o_rank, groups = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
    ih, ihd, itop, window = cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"], cfg["sliding_window"]
    ratio = 4
    dense = (h * q_rank + q_rank * heads * hd + h * hd            # wq_a, wq_b, wkv
             + groups * o_rank * (heads * hd // groups) + groups * o_rank * h   # wo_a (grouped), wo_b
             + 2 * h * 2 * hd                                      # compressor wkv + wgate (overlapping: 2 x width)
             + q_rank * ih * ihd + h * ih + 2 * h * 2 * ihd       # indexer wq_b, weights_proj, its compressor
             + 3 * h * inter * cfg.get("n_shared_experts", 1)      # shared expert
             + h * cfg["n_routed_experts"])                        # router
    routed = topk * 3 * h * inter
    entries = length / ratio / 2
    attention = 2 * heads * hd * (min(window, length) + min(itop, entries))      # q.k and p.v
    indexer = ih * ihd * entries
    return 2 * (dense + routed + attention + indexer)


def device_decode_seconds(cfg: dict, device) -> float:
    """EXL3 decode of one [inter, hidden] K3 mul1 matrix with the project's functions on `device`."""
    from fidelity.packs.exl3.codec import decode_weight
    rt = RandomTrellis(device)
    t = rt.get("x", torch.empty(cfg["moe_intermediate_size"], cfg["hidden_size"]), 3, "mul1")
    parts = [t["trellis"].to(device), t["suh"].to(device), t["svh"].to(device)]
    decode_weight(*parts, "mul1")
    s, _ = timed(lambda: decode_weight(*parts, "mul1"), device, repeat=3)
    return s


def bench_layer(arch: str, args, device, work: Path) -> dict:
    geometry = SMOKE if args.smoke else FLASH
    experts = args.experts or (geometry["n_routed_experts"] if arch == "v4" else
                               (geometry["n_routed_experts"] if args.smoke else EXPERTS_V41))
    t0 = time.perf_counter()
    pack_dir, info = build_layer_pack(arch, geometry, V41_SMOKE if args.smoke else V41_FLASH, experts, work, device)
    build_s = time.perf_counter() - t0
    read_s, read_bytes = read_seconds(pack_dir)
    pack = open_pack(pack_dir)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    budget = None if args.activation_gib is None else int(args.activation_gib * 2**30)
    oracle = Oracle(pack, device=device, keep_weights=True, activation_budget=budget,
                    expert_budget_bytes=expert_budget(args))
    load_s, _ = timed(lambda: oracle.load_layer(0), device)
    from fidelity.packs.exl3.layouts import routed_expert
    sample = [n for n in pack.names() if routed_expert(n) is not None or (".experts." in n and "shared" not in n)][:6]
    if not sample:
        raise AssertionError(f"no routed expert among the pack's names, e.g. {sorted(pack.names())[:5]}")
    per_matrix_s = timed(lambda: [oracle.fetch(n) for n in sample], device)[0] / len(sample)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 256, (args.rows, args.length), generator=g).tolist()
    oracle.hidden_states(rows[:1], progress=False)                 # warm-up: kernels, rope tables, masks
    compute_s, hidden = timed(lambda: oracle.hidden_states(rows, progress=False), device)
    expert_decodes = (oracle.last_forward or {}).get("experts")
    tokens = args.rows * args.length
    finite = all(bool(torch.isfinite(h).all()) for h in hidden)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    profile = profile_pass(oracle, rows, device, args.profile) if args.profile else None
    engram_s = None
    if arch == "v41":         # the Engram rows of the batch alone: hashing, distinct rows, reads, decode, gather
        from fidelity.oracle.deepseek.engram import EngramArgs, ngram_rows
        family = oracle.family
        engram_args = EngramArgs.from_config(family.text, 0, family.token_map())
        ids = family.token_map()[torch.tensor(rows)].to(device)
        engram_s, _ = timed(lambda: family.table(0).rows(ngram_rows(ids, engram_args)), device)
    flops = layer_flops_per_token(pack.config, args.length) * tokens
    rate = args.matmul_rate
    decode_one = device_decode_seconds(pack.config, device)
    decode_floor = decode_one * experts * 3
    floor = flops / rate + decode_floor
    scale = EXPERTS_V41 / experts                                   # loads grow with the experts, compute does not
    panel_compute = compute_s * PANEL_TOKENS / tokens
    panel_load = load_s + per_matrix_s * 3 * (EXPERTS_V41 - experts)   # the missing experts at the measured rate
    serial = LAYERS * (panel_load + panel_compute)
    overlapped = LAYERS * max(panel_load, panel_compute)
    floor_panel = LAYERS * (flops / rate * PANEL_TOKENS / tokens + decode_floor * scale)
    shapes = []
    budgets = [None if b in ("", "auto") else float(b) for b in args.shape_budgets.split(",")] if args.shape_budgets \
        else [args.activation_gib]
    for (n_rows, length), gib in [(shape, b) for shape in args.shapes for b in budgets]:   # other rows x lengths
        more = torch.randint(0, 256, (n_rows, length), generator=g).tolist()
        oracle.activation_budget = None if gib is None else int(gib * 2**30)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # two passes: the first allocates the offloaded batches' pinned host buffers, the second may find them in
        # torch's pinned-memory cache. A whole-model pass allocates them once (layer 0) and its later layers reuse
        # them, so the store's allocation seconds (last_forward) are counted once per forward, not once per layer.
        first_s, h = timed(lambda: oracle.hidden_states(more, progress=False), device)
        first_activations = dict(oracle.last_forward or {})
        del h
        s, h = timed(lambda: oracle.hidden_states(more, progress=False), device)
        activations = dict(oracle.last_forward or {})
        alloc_s = activations.get("host_alloc_seconds", 0.0)
        finite_more = all(bool(torch.isfinite(x).all()) for x in h)
        h_bytes = sum(x.numel() * x.element_size() for x in h)
        h_device = h[0].device.type if h else None
        del h
        n_tok = n_rows * length
        f = layer_flops_per_token(pack.config, length) * n_tok
        shapes.append(
            {
                "rows": n_rows,
                "length": length,
                "activation_gib": gib,
                "first_pass_s": first_s,
                "compute_s": s,
                "tokens_per_s": n_tok / s,
                "tflops": f / s / 1e12,
                "compute_x_matmul_floor": s / (f / rate),
                "finite": finite_more,
                "gpu_peak_GiB": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                "host_peak_rss_GiB": host_peak_rss_gib(),
                "activations": activations,
                "first_pass_activations": first_activations,
                "host_alloc_s": alloc_s,
                "output_GiB": h_bytes / 2**30,
                "output_on": h_device,
                "panel_40_layers_compute_min": (LAYERS * (s - alloc_s) + alloc_s) * PANEL_TOKENS / n_tok / 60,
                "panel_40_layers_compute_min_allocs_every_layer": LAYERS * s * PANEL_TOKENS / n_tok / 60,
            }
        )
    oracle.activation_budget = budget
    numerics_cost = None
    if args.numerics_cost:
        oracle.release()
        del oracle
        numerics_cost = time_numerics(pack, rows, device, budget, args)
    return {
        "arch": arch,
        **info,
        "shapes": shapes,
        "numerics_cost": numerics_cost,
        "build_s": build_s,
        "read_s": read_s,
        "read_GiB": read_bytes / 2**30,
        "engram_rows_s": engram_s,
        "experts_pass": expert_decodes,
        "load_s": load_s,
        "decode_s": max(0.0, load_s - read_s),
        "expert_matrix_load_ms": per_matrix_s * 1e3,
        "layer_load_at_384_s": panel_load,
        "compute_s": compute_s,
        "tokens": tokens,
        "tokens_per_s": tokens / compute_s,
        "tflops": flops / compute_s / 1e12,
        "floor_s": floor,
        "x_floor": (load_s + compute_s) / floor,
        "compute_x_matmul_floor": compute_s / (flops / rate),
        "device_decode_one_matrix_ms": decode_one * 1e3,
        "gpu_peak_GiB": peak / 2**30 if peak else None,
        "finite": finite,
        "profile": profile,
        "panel_40x384_serial_min": serial / 60,
        "panel_40x384_overlapped_min": overlapped / 60,
        "panel_floor_min": floor_panel / 60,
    }


def time_numerics(pack, rows, device, budget, args) -> dict:
    """The layer under numerics "deepseek" (DeepSeek's reference rounding) against "exact" on the same rows, each
    oracle alone on the device, alternating exact / deepseek / exact / deepseek (median of each): seconds, the ratio,
    and how far the rounding moves the layer's output."""
    runs: dict[str, list[float]] = {"exact": [], "deepseek": []}
    outputs = {}
    for numerics in ("exact", "deepseek") * max(1, args.repeat // 2 + 1):
        oracle = Oracle(pack, device=device, keep_weights=True, activation_budget=budget,
                        expert_budget_bytes=expert_budget(args), numerics=numerics)
        oracle.hidden_states(rows[:1], progress=False)                       # warm-up, layer built and kept
        s, hidden = timed(partial(oracle.hidden_states, rows, progress=False), device)
        runs[numerics].append(s)
        outputs[numerics] = torch.cat([h.flatten().double().cpu() for h in hidden])
        oracle.release()
        del oracle, hidden
    med = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
    moved = float((outputs["deepseek"] - outputs["exact"]).abs().max() / outputs["exact"].abs().max())
    return {"exact_s": med["exact"], "deepseek_s": med["deepseek"], "x": med["deepseek"] / med["exact"],
            "runs": runs, "output_moved_rel": moved}


def bench_pipeline(arch: str, args, device, work: Path) -> dict:
    """`args.layers` layers of the geometry through one pass with the load chain's Prefetcher (layer i+1 staged, read
    and decoded on the loader thread while layer i computes; routed experts decode on the compute thread when first
    routed to, from bytes staged ahead), against the same pass with every layer already decoded and resident
    (keep_weights, second pass). Per layer: stage and build seconds on the loader thread, the compute thread's wait for
    the layer, and the layer's span (end of layer i-1 to end of layer i, synchronized) in both passes; visible load =
    span with prefetch - span resident (the wait plus the experts' decode and whatever the loader's work slowed)."""
    from fidelity.oracle import LoadChain
    from fidelity.oracle.parallel import Prefetcher

    geometry = SMOKE if args.smoke else FLASH
    experts = args.experts or (geometry["n_routed_experts"] if arch == "v4" or args.smoke else EXPERTS_V41)
    t0 = time.perf_counter()
    pack_dir, info = build_layer_pack(arch, geometry, V41_SMOKE if args.smoke else V41_FLASH, experts, work, device,
                                      layers=args.layers)
    build_s = time.perf_counter() - t0
    read_s, read_bytes = read_seconds(pack_dir)
    pack = open_pack(pack_dir)
    n = pack.config["num_hidden_layers"]
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 256, (args.rows, args.length), generator=g).tolist()
    budget = None if args.activation_gib is None else int(args.activation_gib * 2**30)

    def measured_pass(warm_up: list, **options) -> dict:
        """A fresh oracle: `warm_up` rows first (untimed), then one timed pass over `rows` with each layer's end
        marked."""
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        oracle = Oracle(pack, device=device, activation_budget=budget, expert_budget_bytes=expert_budget(args),
                        **options)
        warm_up_s, _ = timed(lambda: oracle.hidden_states(warm_up, progress=False), device)
        ends: dict[int, float] = {}

        def tap(i):
            def mark(_):
                sync(device)
                ends[i] = time.perf_counter()
            return mark
        sync(device)
        start = time.perf_counter()
        with oracle.tapped(OracleTaps(layer_outputs={i: tap(i) for i in range(n)})):
            _, out = oracle._forward(rows, False)
        sync(device)
        loads = {t.layer: t for t in list(oracle.prefetcher.timeline)[-n:]} if oracle.prefetcher else None
        return {
            "warm_up_s": warm_up_s,
            "pass_s": time.perf_counter() - start,
            "spans": [ends[i] - (ends[i - 1] if i else start) for i in range(n)],
            "out": [x.cpu() for x in out],
            "loads": loads,
            "offloaded": (oracle.last_forward or {}).get("offloaded_batches", 0),
            "experts": (oracle.last_forward or {}).get("experts"),
            "gpu_peak_GiB": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        }

    eager = None
    if args.eager_experts:
        # the same pass with every routed expert decoded on the loader thread (a layer transform of the load chain,
        # run in the Prefetcher's side stream) instead of on the compute thread when first routed to
        from fidelity.oracle.moe import layer_routed_experts

        def decode_every_expert(i, layer):
            experts = layer_routed_experts(layer)
            for e in range(experts.n_experts if experts is not None else 0):
                experts.expert(e)
            return layer
        eager = measured_pass(rows[:1], chain=LoadChain(prefetch=Prefetcher, layer=(decode_every_expert,)))
    # warm-up: kernels, rope tables, page cache, pinned buffers
    lazy = measured_pass(rows[:1], chain=LoadChain(prefetch=Prefetcher))
    rss_prefetch = host_peak_rss_gib()
    variants_after_prefetch = exl3_kernel_variants()
    # the warm-up pass over the same rows loads and decodes every layer once, kept
    resident = measured_pass(rows, keep_weights=True)
    timeline = lazy["loads"]
    per_layer = [{"layer": i, "stage_s": timeline[i].stage_s, "build_s": timeline[i].build_s,
                  "wait_s": timeline[i].wait_s, "staged_GiB": timeline[i].staged_bytes / 2**30,
                  "unstaged_GiB": timeline[i].unstaged_bytes / 2**30, "span_prefetch_s": lazy["spans"][i],
                  "span_resident_s": resident["spans"][i], "visible_load_s": lazy["spans"][i] - resident["spans"][i]}
                 for i in range(n)]
    if eager is not None:
        eager = {"pass_s": eager["pass_s"], "spans": eager["spans"], "gpu_peak_GiB": eager["gpu_peak_GiB"],
                 "experts": eager["experts"],
                 "wait_s": [eager["loads"][i].wait_s for i in range(n)],
                 "build_s": [eager["loads"][i].build_s for i in range(n)],
                 "equals_prefetch": all(torch.equal(a, b) for a, b in zip(eager["out"], lazy["out"]))}
    return {
        "arch": arch,
        **info,
        "layers": n,
        "rows": args.rows,
        "length": args.length,
        "build_s": build_s,
        "read_s": read_s,
        "read_GiB": read_bytes / 2**30,
        "pass_prefetch_s": lazy["pass_s"],
        "pass_first_resident_s": resident["warm_up_s"],
        "pass_resident_s": resident["pass_s"],
        "per_layer": per_layer,
        "exl3_kernel_variants": {"after_prefetch_pass": variants_after_prefetch, "after_all": exl3_kernel_variants()},
        "prefetch_equals_resident": all(torch.equal(a, b) for a, b in zip(lazy["out"], resident["out"])),
        "finite": all(bool(torch.isfinite(a).all()) for a in lazy["out"]),
        "eager_experts": eager,
        # spans compare alike only when neither pass held activation batches in host memory: [0, 0]
        "offloaded_batches_prefetch_resident": [lazy["offloaded"], resident["offloaded"]],
        "experts_prefetch": lazy["experts"],
        "experts_resident": resident["experts"],
        "later_layers_visible_below_compute": all(r["visible_load_s"] < r["span_resident_s"] for r in per_layer[1:]),
        "gpu_peak_prefetch_GiB": lazy["gpu_peak_GiB"],
        "gpu_peak_resident_GiB": resident["gpu_peak_GiB"],
        "host_peak_rss_GiB": rss_prefetch,
    }


def pipeline_table(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines += [
            "",
            f"{r['arch']}: {r['layers']} layers x {r['experts']} experts, {r['rows']} x {r['length']} tokens, "
            f"{r['read_GiB']:.1f} GiB stored; pass with prefetch {r['pass_prefetch_s']:.2f} s, resident "
            f"(every layer decoded, second pass) {r['pass_resident_s']:.2f} s; GPU peak "
            + (
                f"{r['gpu_peak_prefetch_GiB']:.1f} / {r['gpu_peak_resident_GiB']:.1f} GiB"
                if r["gpu_peak_prefetch_GiB"] is not None
                else "-"
            )
            + f", host peak RSS {r['host_peak_rss_GiB']:.1f} GiB; outputs of both passes equal: "
            f"{r['prefetch_equals_resident']}; activation batches in host memory (prefetch, resident): "
            f"{r['offloaded_batches_prefetch_resident']}"
            + expert_line(r.get("experts_prefetch"), "; routed experts, prefetch pass")
            + expert_line(r.get("experts_resident"), "; resident pass"),
            "",
            "| layer | staged GiB (left out) | stage s (loader) | build s (loader) | wait s (compute thread) | "
            "span with prefetch s | span resident s (compute) | visible load s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for x in r["per_layer"]:
            lines.append(f"| {x['layer']} | {x['staged_GiB']:.2f} ({x['unstaged_GiB']:.2f}) | {x['stage_s']:.3f} | "
                         f"{x['build_s']:.3f} | {x['wait_s']:.3f} | {x['span_prefetch_s']:.3f} | "
                         f"{x['span_resident_s']:.3f} | {x['visible_load_s']:.3f} |")
        lines.append(f"layers 1+: visible load below the layer's compute: {r['later_layers_visible_below_compute']} "
                     f"(layer 0 has nothing to hide behind)")
        e = r.get("eager_experts")
        if e:
            lines.append(f"experts decoded on the loader thread: pass {e['pass_s']:.2f} s, spans "
                         + " / ".join(f"{x:.3f}" for x in e["spans"]) + " s, waits "
                         + " / ".join(f"{x:.3f}" for x in e["wait_s"]) + " s, builds "
                         + " / ".join(f"{x:.3f}" for x in e["build_s"]) + " s, visible load (span - resident) "
                         + " / ".join(f"{x - y['span_resident_s']:.3f}" for x, y in zip(e["spans"], r["per_layer"]))
                         + (f" s, GPU peak {e['gpu_peak_GiB']:.1f} GiB" if e["gpu_peak_GiB"] is not None else " s")
                         + f"; outputs equal the lazy pass's: {e['equals_prefetch']}"
                         + expert_line(e.get("experts"), "; routed experts"))
    return "\n".join(lines)


def exl3_kernel_variants() -> int | None:
    """Compiled variants of the EXL3 Triton decode so far (None without it): one per bitrate, a new one mid-pass is a
    compile inside the timed pass."""
    from fidelity.packs.exl3 import codec
    kernel = codec._triton_decode() if torch.cuda.is_available() else None
    caches = getattr(kernel, "device_caches", None)
    return None if caches is None else sum(len(c[0]) for c in caches.values())


def host_peak_rss_gib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20     # Linux: KiB


def profile_pass(oracle, rows, device, top: int) -> list[dict]:
    """One more compute pass under torch.profiler: the `top` operators by self device time (self CPU time on the CPU),
    each with its share of the pass, calls, and self CPU time (where host work, syncs and Python sit)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        oracle.hidden_states(rows, progress=False)
        sync(device)
    events = prof.key_averages()
    dev = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    key = dev if device.type == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events) or 1
    rows_out = [{"op": e.key[:60], "calls": e.count, "self_device_ms": getattr(e, dev) / 1e3,
                 "self_cpu_ms": e.self_cpu_time_total / 1e3, "share": getattr(e, key) / total}
                for e in sorted(events, key=lambda e: -getattr(e, key))[:top]]
    print(f"profile ({key}, total {total / 1e3:.1f} ms):")
    for r in rows_out:
        print(f"  {r['share'] * 100:5.1f} %  {r['self_device_ms']:9.2f} ms dev  {r['self_cpu_ms']:9.2f} ms cpu  "
              f"{r['calls']:6d}x  {r['op']}")
    return rows_out


class DeviceHead:
    """The oracle's head on given weights: Oracle's own HEAD_ROWS-block GEMMs (head_into) without a pack."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.device, self.dtype = weight, weight.device, weight.dtype

    def head_weight(self) -> torch.Tensor:
        return self.weight

    def head_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        Oracle._head_blocks(self, x, self.weight, out)


def head_inputs(n: int, vocab: int, hidden: int, device):
    """The head step's random problem (seed 5): REF's head weights and `n` hidden states, PACK's 1 % off them, and
    target ids: (w_ref, w_pack, x, x_pack, targets)."""
    g = torch.Generator(device=device).manual_seed(5)
    w_ref = torch.randn(vocab, hidden, generator=g, device=device) / math.sqrt(hidden)
    w_pack = w_ref + 0.01 * torch.randn(vocab, hidden, generator=g, device=device) / math.sqrt(hidden)
    x = torch.randn(n, hidden, generator=g, device=device)
    x_pack = x + 0.01 * torch.randn(n, hidden, generator=g, device=device)
    targets = torch.randint(0, vocab, (n,), generator=g, device=device)
    return w_ref, w_pack, x, x_pack, targets


def split_rows(x: torch.Tensor, x_pack: torch.Tensor, targets: torch.Tensor, per_row: int):
    """The positions as panel rows of `per_row` scored tokens (after a dummy first token), with their slices of both
    sides' hidden states and of the targets: (rows, hid, hid_pack, tgt)."""
    from fidelity.panels.panel import TokenizedRow

    n = len(targets)
    rows, hid, hid_pack, tgt = [], [], [], []
    for i, s in enumerate(range(0, n, per_row)):
        e = min(n, s + per_row)
        rows.append(TokenizedRow(f"r{i}", "d", [0] + targets[s:e].tolist(), [False] + [True] * (e - s)))
        hid.append(x[s:e])
        hid_pack.append(x_pack[s:e])
        tgt.append(targets[s:e])
    return rows, hid, hid_pack, tgt


def bench_head(args, device) -> dict:
    from fidelity.measuring import metrics
    from fidelity.measuring.metrics import MetricKernel
    from fidelity.measuring.store import ReferenceRun, device_row_metrics

    n, vocab, hidden = (256, 1000, 64) if args.smoke else (args.head_positions, VOCAB, FLASH["hidden_size"])
    w_ref, w_pack, x, x_pack, targets = head_inputs(n, vocab, hidden, device)
    plain = lambda: (x @ w_ref.t(), x_pack @ w_pack.t())           # noqa: E731
    plain()
    plain_s, _ = timed(plain, device)
    ref_head, pack_head = DeviceHead(w_ref), DeviceHead(w_pack)
    bufs = torch.empty(n, vocab, device=device), torch.empty(n, vocab, device=device)
    blocks = lambda: (ref_head.head_into(x, bufs[0]), pack_head.head_into(x_pack, bufs[1]))   # noqa: E731
    blocks()
    blocks_s, _ = timed(blocks, device)
    per_row = 512 if not args.smoke else 64
    rows, hid, hid_pack, tgt = split_rows(x, x_pack, targets, per_row)
    run = ReferenceRun(rows, hid, tgt, device=str(device))
    step = lambda r: device_row_metrics(r, ref_head, hid_pack, pack_head, progress=False)  # noqa: E731
    step(run)
    step_s, pm = timed(lambda: step(run), device)
    topk = [metrics.topk_logprobs(ref_head_logits, 20) for ref_head_logits in
            (bufs[0][s:s + len(h)] for s, h in zip(range(0, n, per_row), hid))]
    stored = ReferenceRun(rows, hid, tgt, [(i.cpu(), lp.cpu()) for i, lp in topk], device=str(device))
    try:                     # a stored top-K the device does not reproduce is a finding to print, not a crash
        step(stored)
        store_s, _ = timed(lambda: step(stored), device)
    except Exception as e:
        store_s = float("nan")
        print(f"stored top-K re-derivation failed: {type(e).__name__}: {e}"[:2000], flush=True)
    out = {"positions": n, "vocab": vocab, "plain_gemms_s": plain_s, "head_blocks_s": blocks_s,
           "head_metrics_s": step_s, "head_metrics_with_store_s": store_s,
           "x_plain_gemms": step_s / plain_s, "x_head_blocks": step_s / blocks_s,
           "with_store_x_plain_gemms": store_s / plain_s, "finite_positions": int(pm.finite.sum()),
           "panel_317k_head_metrics_min": step_s * PANEL_TOKENS / n / 60}
    a, b = bufs
    bytes_read = 2 * a.numel() * 4
    knobs = ("block", "warps", "topk", "shift", "magic", "prefetch")
    default = tuple(getattr(MetricKernel(), k) for k in knobs)
    variants = [("torch", None)]
    if device.type == "cuda" and metrics._triton_kernel() is not None:
        # (BLOCK, warps, top-5, shift, magic), each with one block loaded ahead; then the former default without it
        variants += [("triton", default)] + [("triton", c + (1,)) for c in (
            (512, 4, "fused", "running", False), (1024, 4, "torch", "running", False),
            (1024, 4, "separate", "running", False), (256, 2, "fused", "fixed", True), (512, 2, "fused", "fixed", True),
            (256, 4, "fused", "fixed", True), (1024, 4, "separate", "running", True),
            (1024, 4, "separate", "fixed", False), (1024, 4, "separate", "fixed", True),
            (2048, 8, "separate", "fixed", True))] + [("triton", (512, 4, "fused", "fixed", True, 0))]
    want = metrics.device_metrics_columns(a, b, targets, MetricKernel(backend="torch"))
    for backend, config in variants:
        kernel = MetricKernel(backend=backend, **dict(zip(knobs, config or default)))
        try:
            run_kernel = lambda: metrics.device_metrics_columns(a, b, targets, kernel)   # noqa: E731
            got = run_kernel()
            s, _ = timed(run_kernel, device, repeat=3)
        except Exception as e:            # a configuration that does not build is reported, not fatal
            out[f"kernel_{backend}_{config}_error"] = f"{type(e).__name__}: {e}"[:300]
            continue
        name = backend if config is None else (f"{backend}_{config[0]}x{config[1]}_top5_{config[2]}_shift_{config[3]}"
                                               + ("_magic" if config[4] else "") + ("_prefetch" if config[5] else ""))
        out[f"kernel_{name}_s"] = s
        out[f"kernel_{name}_GBps"] = bytes_read / s / 1e9
        out[f"kernel_{name}_x_copy_bw"] = bytes_read / s / args.copy_bw
        out[f"kernel_{name}_max_kl_diff_vs_torch"] = float((got[0][:, :2] - want[0][:, :2]).abs().max())
        out[f"kernel_{name}_top1_equal_torch"] = bool(torch.equal(got[1], want[1]))
        out[f"kernel_{name}_topk_match_equal_torch"] = bool(torch.equal(got[1][:, 2], want[1][:, 2]))
    if device.type == "cuda" and metrics._triton_kernel() is not None:  # the fused kernel alone (no top-K lists)
        cols = (
            torch.empty(n, 6, dtype=torch.float64, device=device),
            torch.empty(n, 2, dtype=torch.int64, device=device),
        )
        for shift, magic in (("running", False), ("running", True), ("fixed", False), ("fixed", True)):
            key = "fused_kernel_only" + ("" if (shift, magic) == ("running", False) else
                                         f"_shift_{shift}" + ("_magic" if magic else ""))
            kernel = MetricKernel(backend="triton", shift=shift, magic=magic)
            try:
                only = lambda: metrics.triton_rows(a, b, targets, *cols, kernel=kernel)     # noqa: E731
                only()
                s, _ = timed(only, device, repeat=3)
                out[f"{key}_s"] = s
                out[f"{key}_x_copy_bw"] = bytes_read / s / args.copy_bw
            except Exception as e:
                out[f"{key}_error"] = f"{type(e).__name__}: {e}"[:300]
    out["device_copy_GBps"] = args.copy_bw / 1e9
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--archs", default="v4,v41")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--length", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None, help="routed experts built (default: the geometry's)")
    ap.add_argument("--shapes", default="", help="more ROWSxLENGTH to time the same layers at, e.g. 1x32768")
    ap.add_argument("--head-positions", type=int, default=8192)
    ap.add_argument("--skip-head", action="store_true")
    ap.add_argument("--activation-gib", type=float, default=None,
                    help="activations kept on the device between layers (GiB; default: from free device memory)")
    ap.add_argument("--shape-budgets", default="",
                    help="--shapes once per activation budget in GiB, e.g. 8,auto (auto: from free device memory)")
    ap.add_argument("--profile", type=int, default=0, help="profile one more pass per layer: print the top N operators")
    ap.add_argument("--layers", type=int, default=1,
                    help=">= 2: build that many layers and time one pass with the prefetcher against the resident pass")
    ap.add_argument("--eager-experts", action="store_true",
                    help="--layers: also a pass with every routed expert decoded on the loader thread")
    ap.add_argument("--expert-gib", type=float, default=None,
                    help="decoded routed experts kept per layer (GiB; Oracle(expert_budget_bytes=)); default: all; "
                         "the others are decoded for each call")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script on any device")
    ap.add_argument("--numerics-cost", action="store_true",
                    help="also time each layer under numerics 'deepseek' against 'exact' (same rows, alternating)")
    ap.add_argument("--out", default=None, help="folder for results.json")
    ap.add_argument("--work", default=None, help="scratch folder for the packs (default: a temporary one)")
    ap.add_argument("--repeat", type=int, default=3, help="timed passes per measurement, median (--parallel)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per process (--parallel)")
    ap.add_argument("--parallel", default="", help="experts,rows: the layer across torchrun's ranks vs one rank")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="the oracle's batch size in tokens (runner.BATCH_TOKENS; --parallel --smoke: 128)")
    args = ap.parse_args(argv)
    if args.parallel:
        return parallel_main(args)
    device = torch.device(args.device)
    exact_math(device)
    args.rows = args.rows or (2 if args.smoke else 8)
    args.length = args.length or (64 if args.smoke else 2048)
    args.shapes = [tuple(int(v) for v in x.split("x")) for x in args.shapes.split(",") if x]
    args.matmul_rate = matmul_rate(device, 512 if args.smoke else 8192)
    args.copy_bw = copy_bandwidth(device, 1 << (20 if args.smoke else 30))
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "fp32_matmul_TFLOPs": args.matmul_rate / 1e12,
            "copy_GBps": args.copy_bw / 1e9, "smoke": args.smoke,
            "device_decode_on_main": "device" in __import__("inspect").signature(Pack.tensor).parameters}
    print(json.dumps(info))
    results = {"machine": info, "layers": [], "pipeline": [], "head": None}
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="realscale-"))
    try:
        for arch in [a for a in args.archs.split(",") if a]:
            try:
                r = (bench_pipeline if args.layers > 1 else bench_layer)(arch, args, device, work)
            except Exception:      # a part that fails is reported; the others still run
                import traceback
                traceback.print_exc()
                continue
            results["pipeline" if args.layers > 1 else "layers"].append(r)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
            for built in work.glob(f"{arch}-*"):
                shutil.rmtree(built, ignore_errors=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if not args.skip_head:
            try:
                results["head"] = bench_head(args, device)
            except Exception:
                import traceback
                traceback.print_exc()
            else:
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in results["head"].items()}))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(table(results) + pipeline_table(results["pipeline"]))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "realscale.json").write_text(json.dumps(results, indent=1))
    return 0


# -- the layer across ranks ---------------------------------------------------------------------------------------
def parallel_main(args) -> int:
    """Every rank opens the one layer pack rank 0 built (in --work, or a folder named by torchrun's run id). Rank 0
    alone runs the plain Oracle (keep_weights) over the rows: the one-rank time and the result. Then, per mode, every
    rank runs `parallel.make_oracle(pack, device, RunSettings(parallel=mode), keep_weights=True)` on the same rows; the
    N-rank time
    is the slowest rank's. Each time is the median of --repeat passes after one warm-up pass (which loads the layer and
    this rank's experts); ranks start each pass together after a checkpoint. Rank 0 compares its last pass with the
    one-rank result by torch.equal (bit equality holds at one thread count per process: on the CPU every rank and the
    one-rank run use --threads, torchrun's 1 by default)."""
    from fidelity.oracle import parallel
    from fidelity.oracle import runner
    from fidelity.packs.exl3.layouts import routed_expert

    modes = [m for m in args.parallel.split(",") if m]
    if any(m not in ("experts", "rows") for m in modes):
        raise SystemExit(f"--parallel takes experts and/or rows, not {args.parallel!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    runner.BATCH_TOKENS = args.batch_tokens or (128 if args.smoke else runner.BATCH_TOKENS)
    g = parallel.current_group(args.device)                 # None in one process (world size 1)
    rank, world = (g.rank, g.world_size) if g else (0, 1)
    device = parallel.local_device(args.device)
    exact_math(device)
    run_id = f"{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}-{os.environ.get('MASTER_PORT', '')}"
    work = Path(args.work) if args.work else Path(tempfile.gettempdir()) / f"realscale-parallel-{run_id}"
    if rank == 0 and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    length = args.length or (64 if args.smoke else 2048)
    per_batch = max(1, runner.BATCH_TOKENS // length)
    n_rows = args.rows or per_batch * 8                # 8 batches: an equal deal over 1, 2, 4 or 8 ranks
    rows = torch.randint(0, 256, (n_rows, length), generator=torch.Generator().manual_seed(1)).tolist()
    geometry = SMOKE if args.smoke else FLASH
    results = {"machine": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "torch": torch.__version__, "ranks": world, "threads_per_rank": torch.get_num_threads(),
                           "backend": g.backend if g else None, "smoke": args.smoke,
                           "batch_tokens": runner.BATCH_TOKENS}, "runs": []}
    failure = None
    try:
        for arch in [a for a in args.archs.split(",") if a]:
            experts = args.experts or (geometry["n_routed_experts"] if arch == "v4" or args.smoke else EXPERTS_V41)
            pack_dir = work / f"{arch}-exl3"
            if rank == 0 and not (pack_dir / "config.json").exists():
                build_layer_pack(arch, geometry, V41_SMOKE if args.smoke else V41_FLASH, experts, work, device)
            if g:
                g.checkpoint(f"rank 0's {arch} layer pack")

            def timed_pass(oracle, together: bool):
                """The median of --repeat timed passes after one warm-up pass (the layer, the experts, kernels)."""
                oracle.hidden_states(rows, progress=False)
                times = []
                for _ in range(args.repeat):
                    if together:
                        g.checkpoint("the start of a timed pass")
                    s, out = timed(lambda: oracle.hidden_states(rows, progress=False), device)
                    times.append(s)
                return sorted(times)[len(times) // 2], out

            want, one_s = None, None
            if rank == 0:
                one_s, want = timed_pass(Oracle(open_pack(pack_dir), device=device, keep_weights=True,
                                                expert_budget_bytes=expert_budget(args)), False)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if g:
                g.checkpoint("the one-rank baseline")
            for mode in modes:
                pack = open_pack(pack_dir)
                read = set()
                tensor, tensors = pack.tensor, pack.tensors        # one by one, and decoded together (read ahead)
                pack.tensor = lambda name, tensor=tensor, **where: (read.add(name), tensor(name, **where))[1]
                pack.tensors = lambda names, tensors=tensors, **where: (read.update(names), tensors(names, **where))[1]
                oracle = parallel.make_oracle(pack, device, parallel.RunSettings(parallel=mode), keep_weights=True,
                                              expert_budget_bytes=expert_budget(args))
                seconds, got = timed_pass(oracle, g is not None)
                mine = sorted({routed_expert(n)[2] for n in read if routed_expert(n) is not None})
                slowest, per_rank = seconds, [mine]
                if g:
                    gathered = [None] * world
                    g.checkpoint("the gathering of the ranks' times")
                    g.dist.all_gather_object(gathered, (seconds, mine))
                    slowest, per_rank = max(s for s, _ in gathered), [m for _, m in gathered]
                del oracle
                if rank != 0:
                    continue
                equal = len(got) == len(want) and all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want))
                tokens = n_rows * length
                run = {"arch": arch, "mode": mode, "ranks": world, "experts": experts, "rows": n_rows,
                       "length": length, "tokens": tokens, "one_rank_s": one_s, "ranks_s": slowest,
                       "tokens_per_s": tokens / slowest, "one_rank_tokens_per_s": tokens / one_s,
                       "speedup": one_s / slowest, "target_speedup": 0.9 * world if mode == "rows" else None,
                       "equal_one_rank": equal, "experts_read_per_rank": [len(m) for m in per_rank],
                       "experts_read_overlap": mode == "experts" and len(per_rank) > 1
                                               and bool(set.intersection(*map(set, per_rank)))}
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
                if args.out:
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    torch.save(rows, Path(args.out) / "rows.pt")
                    torch.save([h.cpu() for h in got], Path(args.out) / f"hidden-{arch}-{mode}.pt")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del want
    except BaseException as e:
        failure = e
        raise
    finally:
        parallel.finish(failure)
        if rank == 0 and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if rank == 0:
        print(parallel_table(results))
        if args.out:
            (Path(args.out) / "realscale-parallel.json").write_text(json.dumps(results, indent=1))
        if not all(r["equal_one_rank"] for r in results["runs"]):
            print("NOT EQUAL to one rank (torch.equal)", flush=True)
            return 1
    return 0


def parallel_table(results: dict) -> str:
    m = results["machine"]
    lines = [f"{m['ranks']} rank(s) on {m['device']} ({m['backend'] or 'one process'}, {m['threads_per_rank']} "
             f"thread(s) per rank, torch {m['torch']}, BATCH_TOKENS {m['batch_tokens']})",
             "| layer | parallel | ranks | experts | rows x length | 1 rank s | N ranks s | tokens/s per layer | "
             "1 rank tokens/s | x 1 rank | target | torch.equal(1 rank) | routed experts read per rank |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["runs"]:
        target = "none set" if r["target_speedup"] is None else \
            f">= {r['target_speedup']:.1f}: {'met' if r['speedup'] >= r['target_speedup'] else 'NOT met'}"
        reads = "/".join(map(str, r["experts_read_per_rank"])) + (" (overlap!)" if r["experts_read_overlap"] else "")
        lines.append(f"| {r['arch']} | {r['mode']} | {r['ranks']} | {r['experts']} | {r['rows']} x {r['length']} | "
                     f"{r['one_rank_s']:.3f} | {r['ranks_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['one_rank_tokens_per_s']:.0f} | {r['speedup']:.2f} | {target} | {r['equal_one_rank']} | "
                     f"{reads} |")
    return "\n".join(lines)


def expert_budget(args) -> int | None:
    """--expert-gib as the Oracle's expert_budget_bytes (None: every decoded expert kept)."""
    return None if args.expert_gib is None else int(args.expert_gib * 2**30)


def expert_line(e: dict | None, what: str) -> str:
    """A pass's routed-expert decodes (Oracle.last_forward["experts"]): decodes of how many distinct experts, and
    the most one layer held (kept + the one decoded for a call)."""
    if not e:
        return ""
    gib = 2**30
    budget = "all kept" if e.get("budget_bytes") is None else f"budget {e['budget_bytes'] / gib:.3g} GiB per layer"
    return (f"{what} ({budget}): {e['decodes']} decodes of {e['used']} distinct experts, a layer kept "
            f"{e['kept_bytes'] / gib:.3g} GiB, peak {e['peak_bytes'] / gib:.3g} GiB")


def host_alloc_line(a: dict) -> str:
    """A pass's host-buffer allocations (ActivationStore's own, and what torch's pinned pool could not serve)."""
    if not a.get("host_allocs"):
        return ""
    pool = a.get("pinned_pool")
    grew = (
        ""
        if not pool
        else (
            f"; pinned pool grew by {pool['new_blocks']} blocks in {pool['new_block_seconds']:.2f} s,"
            f" holds {pool['reserved_bytes'] / 2**30:.1f} GiB more"
        )
    )
    return (f" ({a['host_allocs']} host buffers, {a['host_alloc_bytes'] / 2**30:.1f} GiB, allocated in "
            f"{a['host_alloc_seconds']:.2f} s{grew})")


def activation_line(a: dict) -> str:
    if not a:
        return ""
    gib = 2**30
    budget = "all" if a.get("budget_bytes") is None else f"{a['budget_bytes'] / gib:.1f} GiB"
    return (
        f"; activations: {a.get('offloaded_batches', 0)} of "
        f"{a.get('offloaded_batches', 0) + a.get('resident_batches', 0)}"
        f" batches in host memory ({a.get('host_activation_bytes', 0) / gib:.1f} GiB), device peak "
        f"{a.get('peak_device_activation_bytes', 0) / gib:.1f} GiB of budget {budget}, moved "
        f"{a.get('moved_bytes', 0) / gib:.1f} GiB"
    )


def table(results: dict) -> str:
    lines = (
        []
        if not results["layers"]
        else [
            "| layer | experts | read s | load s (read+decode+copy) | compute s | tokens/s | TFLOP/s | x floor | "
            "GPU peak GiB | 317k x 40 layers x 384: serial / overlapped / floor min |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
    )
    for r in results["layers"]:
        peak = f"{r['gpu_peak_GiB']:.1f}" if r["gpu_peak_GiB"] is not None else "-"
        lines.append(f"| {r['arch']} | {r['experts']} | {r['read_s']:.2f} | {r['load_s']:.2f} | {r['compute_s']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {r['tflops']:.1f} | {r['x_floor']:.1f} | {peak} | "
                     f"{r['panel_40x384_serial_min']:.1f} / {r['panel_40x384_overlapped_min']:.1f} / "
                     f"{r['panel_floor_min']:.1f} |")
    for r in results["layers"]:
        c = r.get("numerics_cost")
        if c:
            lines.append(f"  {r['arch']}: numerics deepseek {c['deepseek_s']:.3f} s vs exact {c['exact_s']:.3f} s = "
                         f"{c['x']:.3f}x (medians of {len(c['runs']['exact'])}); the rounding moves the layer's output "
                         f"by {c['output_moved_rel']:.2e} of its largest magnitude")
        if r.get("experts_pass"):
            lines.append(f"  {r['arch']}" + expert_line(r["experts_pass"], ": routed experts, the timed pass"))
        if r.get("engram_rows_s") is not None:
            lines.append(f"  {r['arch']}: the batch's Engram rows alone (hash, distinct rows, reads, decode, gather) "
                         f"{r['engram_rows_s']:.3f} s of the {r['compute_s']:.2f} s compute")
        for x in r.get("shapes", []):
            budget = "" if x.get("activation_gib") is None else f", activation budget {x['activation_gib']:g} GiB"
            lines.append(
                f"  {r['arch']} at {x['rows']} x {x['length']}{budget}: first pass {x['first_pass_s']:.2f} s"
                + host_alloc_line(x.get("first_pass_activations") or {})
                + f", then compute {x['compute_s']:.2f} s"
                + host_alloc_line(x.get("activations") or {})
                + ", "
                f"{x['tokens_per_s']:.0f} tokens/s, {x['tflops']:.1f} TFLOP/s, {x['compute_x_matmul_floor']:.1f}x "
                f"the matmul floor, 40 layers' compute at 317k tokens {x['panel_40_layers_compute_min']:.1f} min"
                + (
                    f" (host allocations once per forward; {x['panel_40_layers_compute_min_allocs_every_layer']:.1f}"
                    f" min if every layer paid them)"
                    if x.get("host_alloc_s")
                    else ""
                )
                + (f", GPU peak {x['gpu_peak_GiB']:.1f} GiB" if x["gpu_peak_GiB"] is not None else "")
                + f", host peak RSS (process) {x['host_peak_rss_GiB']:.1f} GiB"
                + (
                    f" (GPU + host {x['gpu_peak_GiB'] + x['host_peak_rss_GiB']:.1f} GiB: one pool on a "
                    f"unified-memory machine)"
                    if x["gpu_peak_GiB"] is not None
                    else ""
                )
                + activation_line(x.get("activations") or {})
                + expert_line((x.get("activations") or {}).get("experts"), "; routed experts")
            )
    h = results["head"]
    if h:
        lines += ["", f"head + metrics, {h['positions']} positions x vocab {h['vocab']}: plain GEMMs "
                  f"{h['plain_gemms_s']:.3f} s, HEAD_ROWS GEMMs {h['head_blocks_s']:.3f} s, device step "
                  f"{h['head_metrics_s']:.3f} s ({h['x_plain_gemms']:.2f}x plain, {h['x_head_blocks']:.2f}x blocks), "
                  f"with a stored top-K {h['head_metrics_with_store_s']:.3f} s ({h['with_store_x_plain_gemms']:.2f}x); "
                  f"317k positions: {h['panel_317k_head_metrics_min']:.2f} min"]
        for name in [k[len("kernel_"):-len("_s")] for k in h if k.startswith("kernel_") and k.endswith("_s")]:
            lines.append(
                f"metric kernel ({name}): {h[f'kernel_{name}_s'] * 1e3:.2f} ms, "
                f"{h[f'kernel_{name}_GBps']:.0f} GB/s = {100 * h[f'kernel_{name}_x_copy_bw']:.0f} % "
                f"of the measured copy bandwidth ({h['device_copy_GBps']:.0f} GB/s); KL vs torch path "
                f"{h[f'kernel_{name}_max_kl_diff_vs_torch']:.1e}, top-1 equal: {h[f'kernel_{name}_top1_equal_torch']}"
                f", topk_match equal: {h.get(f'kernel_{name}_topk_match_equal_torch')}"
            )
        for key in [k[:-len("_s")] for k in h if k.startswith("fused_kernel_only") and k.endswith("_s")]:
            lines.append(
                f"fused Triton kernel alone (KL both ways, top-1/2, NLL; no top-5 lists)"
                f"{key[len('fused_kernel_only') :]}: "
                f"{h[f'{key}_s'] * 1e3:.2f} ms = {100 * h[f'{key}_x_copy_bw']:.0f} % of "
                f"the measured copy bandwidth"
            )
        lines += [f"{k}: {v}" for k, v in h.items() if k.endswith("_error")]
        layers = {r["arch"]: r for r in results["layers"]}
        if "v41" in layers:
            total = layers["v41"]["panel_40x384_overlapped_min"] + h["panel_317k_head_metrics_min"]
            serial = layers["v41"]["panel_40x384_serial_min"] + h["panel_317k_head_metrics_min"]
            lines.append(f"V4.1-Flash EXL3 pack, 317k tokens, 40 layers, head+metrics: {total:.1f} min with loads "
                         f"hidden behind compute, {serial:.1f} min without (target <= 15)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
