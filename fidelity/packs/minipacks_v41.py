"""Miniature DeepSeek-V4.1 packs: a tiny random V4.1 model in official naming, derived from the tiny V4 (same embeddings,
mHC, experts, attention projections), then written in the seed layouts by minipacks_v4's writer.

    from fidelity.packs.minipacks_v41 import build_native_v41, write_all_v41
    build_native_v41("tests/fixtures/v4/tiny_v4", "tiny-v41/")
    write_all_v41("tiny-v41/", "out/", cache=EncodingCache("tests/fixtures/v4/tiny_v4_encodings.safetensors"))

The model (3 layers, hc_mult 2): layer 0 slides only and carries an Engram layer (its table in its own shard); layer 1
owns a ratio-2 compressed KV pool (no gate position bias, as exllamav3 reads V4.1) with index keys
(`indexer.wk`, `indexer.k_norm`), runs the indexer and is the candidate-block source; layer 2 reads layer 1's pool and
runs its own indexer inside layer 1's candidate blocks. No hash routing, no `hc_head_*`. Routed experts, the head
and the `wo_a` slices keep the tiny V4's weights, so the V4 fixture's EXL3 encodings serve both.

In every layout the Engram table is FP8 e4m3 with one fp32 scale per row (`layers.0.engram.embed.weight` / `.scale`,
in `model-engram-L00.safetensors`) and `engram.wkv` is block FP8 like the attention projections, on the V4.1 release's
32 x 32 grid (V41_SPEC).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .minipacks import EncodingCache
from .minipacks_v4 import LAYOUTS, V4MiniSpec, write_v4_minipack
from .safetensors_io import write_safetensors

ENGRAM = dict(engram_layer_ids=[0], engram_vocab_size=200, engram_max_ngram_size=3, engram_n_heads=2,
              engram_head_dim=16, engram_pad_token_id=2)
V41 = dict(compress_ratios=[0, 2, 2], kv_source_layer_ids=[1], index_source_layer_ids=[1, 2], index_topk=4,
           candidate_source_layer_id=1, candidate_topk_blocks=3, candidate_block_size=2, num_hash_layers=0)
DROPPED_V4_KEYS = ("layer_types", "compress_rates", "mlp_layer_types", "model_type", "transformers_version")


def engram_rows(cfg: dict) -> list[int]:
    """Each Engram layer's table rows: the sum of its heads' prime sizes (engram.head_vocab_sizes' rule)."""
    from ..oracle.engram import next_prime
    p, out = int(cfg["engram_vocab_size"]) - 1, []
    for _ in cfg["engram_layer_ids"]:
        total = 0
        for _ in range((int(cfg["engram_max_ngram_size"]) - 1) * int(cfg["engram_n_heads"])):
            p = next_prime(p)
            total += p
        out.append(total)
    return out


def build_native_v41(v4_native: str | Path, out: str | Path, seed: int = 20261201, **over) -> Path:
    """The tiny V4.1 (bf16, official names) from the official-named tiny V4 folder `v4_native`; `over` overrides
    config keys. Writes model.safetensors, model-engram-L00.safetensors, config.json and the V4's tokenizer files."""
    from safetensors.torch import load_file

    from ..oracle.engram import compressed_token_map

    src, out = Path(v4_native), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in json.loads((src / "config.json").read_text()).items() if k not in DROPPED_V4_KEYS}
    cfg.update(architectures=["DeepseekV41ForCausalLM"], model_type="deepseek_v41", **V41, **ENGRAM)
    cfg["engram_compressed_vocab_size"] = int(compressed_token_map(src / "tokenizer.json").max()) + 1
    cfg.update(over)
    cfg["engram_num_embeddings"] = engram_rows(cfg)
    v4 = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    hidden, hc, head_dim = cfg["hidden_size"], cfg["hc_mult"], cfg["head_dim"]
    idx_dim, idx_heads, q_rank = cfg["index_head_dim"], cfg["index_n_heads"], cfg["q_lora_rank"]

    def linear(rows, cols):
        return (torch.randn(rows, cols, generator=g) / math.sqrt(cols)).to(torch.bfloat16)

    def norm(n):
        return (1.0 + 0.2 * torch.randn(n, generator=g)).to(torch.bfloat16)

    tensors = {k: v for k, v in v4.items()
               if not k.startswith("hc_head_") and ".attn.compressor." not in k and ".indexer.compressor." not in k
               and not k.endswith(".tid2eid")}
    n_layers = cfg["num_hidden_layers"]
    for layer in range(n_layers):
        p = f"layers.{layer}"
        tensors.setdefault(f"{p}.ffn.gate.bias", (0.1 * torch.randn(cfg["n_routed_experts"], generator=g)).to(torch.bfloat16))
        if layer not in cfg["index_source_layer_ids"]:
            tensors.pop(f"{p}.attn.indexer.wq_b.weight", None)
            tensors.pop(f"{p}.attn.indexer.weights_proj.weight", None)
        else:
            tensors.setdefault(f"{p}.attn.indexer.wq_b.weight", linear(idx_heads * idx_dim, q_rank))
            tensors.setdefault(f"{p}.attn.indexer.weights_proj.weight", linear(idx_heads, hidden))
    for owner in cfg["kv_source_layer_ids"]:
        p = f"layers.{owner}.attn"
        tensors[f"{p}.compressor.wkv.weight"] = linear(head_dim, hidden)
        tensors[f"{p}.compressor.norm.weight"] = norm(head_dim)
        if cfg["compress_ratios"][owner] > 1:
            tensors[f"{p}.compressor.wgate.weight"] = linear(head_dim, hidden)
        if owner in cfg["index_source_layer_ids"]:
            tensors[f"{p}.indexer.wk.weight"] = linear(idx_dim, head_dim)
            tensors[f"{p}.indexer.k_norm.weight"] = norm(idx_dim)
    engram = {}
    n_heads = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
    for layer, rows in zip(cfg["engram_layer_ids"], cfg["engram_num_embeddings"]):
        p = f"layers.{layer}.engram"
        engram[f"{p}.embed.weight"] = torch.randn(rows, cfg["engram_head_dim"], generator=g).to(torch.bfloat16)
        tensors[f"{p}.wkv.weight"] = linear((hc + 1) * hidden, n_heads * cfg["engram_head_dim"])
        tensors[f"{p}.k_weight"] = norm(hc * hidden)
        tensors[f"{p}.q_weight"] = norm(hc * hidden)
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    write_safetensors(out / "model-engram-L00.safetensors", engram, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / f).exists():
            (out / f).write_bytes((src / f).read_bytes())
    return out


V41_SPEC = V4MiniSpec(fp8_block=32)      # the V4.1 release's FP8 grid: 32 x 32 blocks, ue8m0 scales


def write_all_v41(native: str | Path, out_root: str | Path, spec: V4MiniSpec = V41_SPEC,
                  cache: EncodingCache | None = None, layouts=LAYOUTS) -> dict[str, Path]:
    """One miniature V4.1 pack per layout under out_root/<layout> (minipacks_v4's writer: Engram tables FP8 per-row
    in their own shard)."""
    from . import open_pack

    pack = open_pack(native)
    cache = cache if cache is not None else EncodingCache()
    return {layout: write_v4_minipack(pack, layout, Path(out_root) / layout, spec, cache) for layout in layouts}
