"""Miniature DeepSeek-V4 packs: a tiny random-init V4 model in official naming, written in each of the five EXL3 seed layouts
(see exl3_layouts.py) plus an official-style FP8/MXFP4 pack with no EXL3 at all.

    from fidelity.packs.minipacks_v4 import build_native, write_v4_minipack, V4MiniSpec, LAYOUTS
    python -m fidelity.packs.minipacks_v4 NATIVE OUT_ROOT [--layouts a,b] [--cache enc.safetensors] [--device cuda]

    build_native("tiny-v4/")                                    # transformers DeepseekV4ForCausalLM, official names, bf16
    write_v4_minipack("tiny-v4/", "deepseek_v41_exl3", "out/", V4MiniSpec(), EncodingCache("enc.safetensors"))

What each pack stores (names: official, or the Hugging Face names official_to_hf gives for the `exllamav3` layout):
- routed experts `layers.L.ffn.experts.E.w1/w2/w3`: EXL3 at mixed K (expert E of every layer: K = spec.expert_k[E % len]);
  in `cuda-exl3` layer 0 states one K for the whole layer (spec.layer_k), the other layers one K per expert; in
  `fp8-mxfp4` (not an EXL3 layout) they are MXFP4 as in DeepSeek's own V4 release;
- shared experts: MXFP4 (`.weight` int8 [out, in/2], low nibble = even element, `.scale` e8m0 [out, in/32]);
- attention / compressor / indexer linears and the head: FP8 e4m3 `.weight` with a ue8m0 `.scale` (F8_E8M0, one per 128x128
  block); `deepseek_v41_exl3` keeps the head and the `wo_a` head-group slices in EXL3 as that layout does;
- norms, router, hash table `tid2eid`, sinks, compressor position biases, `hc_*`, embeddings: bf16 (int64 for tid2eid).

V4 (transformers' DeepseekV4Config, the oracle's DeepseekV4ForCausalLM) has no Engram layers, so no Engram shards are
written; `exl3-expert-packs` keeps the official index's entry for an Engram shard that is absent, as its seed card has.
EXL3 encodings come from an `EncodingCache` (minipacks.py), so fixtures can be pre-encoded on a GPU.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from .base import Pack
from .exl3_layouts import PLAN_FILE, official_to_hf, routed_expert
from ..oracle.synthetic import randomize_weights
from .minipacks import EncodingCache, shard_for
from .safetensors_io import write_safetensors

LAYOUTS = ("exllamav3", "cuda-exl3", "deepseek_v41_exl3", "exl3-expert-packs", "exl3-mixed", "fp8-mxfp4")
EXL3_LAYOUTS = LAYOUTS[:5]
FP8_MAX = 448.0
FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MX_GROUP = 32
BLOCK = 128


@dataclass(frozen=True)
class V4MiniSpec:
    codebook: str = "mul1"
    expert_k: str = "1234"   # expert e of every MoE layer gets K = int(expert_k[e % len])
    layer_k: int = 2         # cuda-exl3: the one K stated for all routed experts of layer 0
    dense_k: int = 4         # deepseek_v41_exl3: wo_a head-group slices
    head_k: int = 6          # deepseek_v41_exl3 and exllamav3: the output head
    fp8_block: int = BLOCK   # FP8 scale blocks (DeepSeek-V4: 128; V4.1 releases 32)

    @property
    def fp8_qc(self) -> dict:
        return {**FP8_QC, "weight_block_size": [self.fp8_block, self.fp8_block]}

    def expert_bits(self, layout: str, layer: int, expert: int) -> int:
        if layout == "cuda-exl3" and layer == 0:
            return self.layer_k
        return int(self.expert_k[expert % len(self.expert_k)])


# ---------------------------------------------------------------------------------------------------------------------
# the native model
# ---------------------------------------------------------------------------------------------------------------------
TINY_V4 = dict(
    vocab_size=256, hidden_size=64, moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, head_dim=32,
    partial_rotary_factor=0.25, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, hc_mult=2,
    hc_sinkhorn_iters=5, sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4,
    swiglu_limit=10.0, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    mlp_layer_types=["hash_moe", "moe", "moe"])


def official_name(saved: str) -> str:
    """transformers' save_pretrained V4 name -> DeepSeek's official checkpoint name."""
    special = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    if saved in special:
        return special[saved]
    return saved.removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm.")


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: the 256 byte symbols are the vocabulary (ids 0..255)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: ord(c))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return fast


def build_native(out: str | Path, seed: int = 20261130, dtype: torch.dtype = torch.bfloat16, **over) -> Path:
    """transformers' DeepseekV4ForCausalLM at TINY_V4 (+ over), random weights, saved in official names (one
    model.safetensors in `dtype`; tid2eid int64) with its config.json and a byte-level tokenizer."""
    import transformers as T
    from safetensors.torch import load_file

    out = Path(out)
    torch.manual_seed(seed)
    model = T.DeepseekV4ForCausalLM(T.DeepseekV4Config(**{**TINY_V4, **over})).to(torch.float32).eval()
    randomize_weights(model, seed)
    model.save_pretrained(out)
    saved = load_file(out / "model.safetensors")
    tensors = {official_name(k): (v.to(dtype) if v.is_floating_point() else v) for k, v in saved.items()}
    if len(tensors) != len(saved):
        raise AssertionError("official renaming merged two tensors")
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    byte_tokenizer().save_pretrained(str(out))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# quantizers (the writer's side; tests check the pack decoders against their own formulation)
# ---------------------------------------------------------------------------------------------------------------------
def fp8_ue8m0(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 values and power-of-two multipliers (stored as e8m0) per block x block tile: scale = 2^ceil(log2(amax/448))."""
    rows, cols = w.shape
    gr, gc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(gr * block, gc * block)
    padded[:rows, :cols] = w.float()
    amax = padded.reshape(gr, block, gc, block).abs().amax(dim=(1, 3)).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (w.float() / full).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 rows with one fp32 multiplier per row (amax / 448), as V4.1 stores its Engram tables."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-30) / FP8_MAX
    return (w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4: per 32 inputs an e8m0 scale 2^(floor(log2 amax) - 2), values rounded to the nearest e2m1 value (ties to
    the even code, saturating at 6), packed two per int8 byte, low nibble = even element. Returns (int8 [out, in/2], e8m0 [out, in/32])."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // MX_GROUP, MX_GROUP)
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -126)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 2)
    x = (groups / scale[..., None]).reshape(rows, cols)
    dist = (x.abs()[..., None] - FP4_GRID).abs()
    idx = (dist + 1e-6 * (torch.arange(8) % 2)).argmin(-1)        # ties go to the even code (round half to even)
    codes = (idx | ((x < 0) & (idx > 0)).to(torch.int64) << 3).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


# ---------------------------------------------------------------------------------------------------------------------
# what goes where
# ---------------------------------------------------------------------------------------------------------------------
def kind_of(name: str, t: torch.Tensor) -> str:
    """expert | shared | head | wo_a | dense | engram (a V4.1 Engram table) | plain."""
    if t.dim() != 2 or not name.endswith(".weight"):
        return "plain"
    if re.match(r"layers\.\d+\.engram\.embed\.", name):
        return "engram"
    if routed_expert(name) is not None:
        return "expert"
    if ".ffn.shared_experts." in name:
        return "shared"
    if name == "head.weight":
        return "head"
    if name.endswith(".attn.wo_a.weight"):
        return "wo_a"
    if re.match(r"layers\.\d+\.(attn|engram)\.", name) and not name.endswith("norm.weight"):
        return "dense"
    return "plain"


def exl3_k(layout: str, name: str, kind: str, spec: V4MiniSpec) -> int | None:
    """The K a layout stores this tensor at in EXL3, else None."""
    if layout == "fp8-mxfp4":
        return None
    if kind == "expert":
        _, layer, e = routed_expert(name)
        return spec.expert_bits(layout, layer, e)
    if kind == "head" and layout in ("exllamav3", "deepseek_v41_exl3"):
        return spec.head_k
    if kind == "wo_a" and layout == "deepseek_v41_exl3":
        return spec.dense_k
    return None


def _wo_a_slices(w: torch.Tensor, config: dict) -> list[torch.Tensor]:
    groups = int(config["o_groups"])
    return list(w.reshape(groups, w.shape[0] // groups, w.shape[1]).unbind(0))


def _pieces(name: str, kind: str, w: torch.Tensor, config: dict) -> list[tuple[str, torch.Tensor]]:
    """(cache / stored base, weight) of the EXL3 linears a tensor is stored as: wo_a as head-group slices."""
    base = name[: -len(".weight")]
    if kind == "wo_a":
        return [(f"{base}.{g}", part) for g, part in enumerate(_wo_a_slices(w, config))]
    return [(base, w)]


def required_encodings(native: Pack, spec: V4MiniSpec = V4MiniSpec(), layouts=EXL3_LAYOUTS) -> list[tuple[str, torch.Tensor, int]]:
    """(cache name, weight, K) of every EXL3 encoding the layouts need (cache names are official names)."""
    need = {}
    for name in native.names():
        w = native.tensor(name)
        kind = kind_of(name, w)
        for layout in layouts:
            K = exl3_k(layout, name, kind, spec)
            if K is not None:
                for base, piece in _pieces(name, kind, w, native.config):
                    need[(base, K)] = piece
    return [(n, w, K) for (n, K), w in need.items()]


FP8_DECLARED = ("cuda-exl3", "exl3-expert-packs", "fp8-mxfp4")    # layouts whose metadata states the FP8 block


def fp8_block(layout: str, spec: V4MiniSpec) -> int:
    """The block a layout's FP8 tensors use: spec.fp8_block where its metadata states it, else DeepSeek's default 128
    (what a reader assumes without a `weight_block_size`)."""
    return spec.fp8_block if layout in FP8_DECLARED else BLOCK


FP8_QC = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
          "weight_block_size": [BLOCK, BLOCK]}


def write_v4_minipack(native: Pack | str | Path, layout: str, out_dir: str | Path, spec: V4MiniSpec = V4MiniSpec(),
                      cache: EncodingCache | None = None, device: str | None = None) -> Path:
    """Write the official-named V4 pack `native` in one of LAYOUTS to out_dir (created). Returns the folder."""
    from . import open_pack

    if layout not in LAYOUTS:
        raise ConfigError(f"unknown miniature V4 layout {layout!r}; one of {', '.join(LAYOUTS)}")
    native = open_pack(native) if not isinstance(native, Pack) else native
    cache = cache if cache is not None else EncodingCache()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in native.config.items() if k != "quantization_config"}
    n_experts = int(cfg["n_routed_experts"])
    rename = official_to_hf if layout == "exllamav3" else (lambda n: n)
    files: dict[str, dict[str, torch.Tensor]] = {}
    tensor_storage: dict[str, dict] = {}
    stated: dict[int, dict[int, int]] = {}          # layer -> expert -> K

    def add(file: str, name: str, t: torch.Tensor):
        files.setdefault(file, {})[name] = t.contiguous()

    for name in native.names():
        w = native.tensor(name)
        kind = kind_of(name, w)
        K = exl3_k(layout, name, kind, spec)
        if K is not None:
            if kind == "expert":
                _, layer, e = routed_expert(name)
                stated.setdefault(layer, {})[e] = K
            for base, piece in _pieces(name, kind, w, native.config):
                enc = cache.get(base, piece, K, spec.codebook, device)
                stored_base = rename(f"{base}.weight")[: -len(".weight")]
                for part, t in enc.items():
                    add(shard_for(layout, name, kind, True, n_experts), f"{stored_base}.{part}", t)
                tensor_storage[stored_base] = {"quant_format": "exl3", "bits_per_weight": K}
            continue
        stored = rename(name)
        base = stored[: -len(".weight")]
        file = shard_for(layout, name, kind, False, n_experts)
        if kind in ("expert", "shared"):
            q, s = mxfp4(w)
        elif kind == "engram":
            q, s = fp8_rows(w)
        elif kind in ("dense", "head", "wo_a"):
            q, s = fp8_ue8m0(w, fp8_block(layout, spec))
        else:
            raw = native.raw.get(name)           # tid2eid stays int64
            add(file, stored, raw.to(torch.bfloat16) if raw.is_floating_point() else raw)
            continue
        add(file, f"{base}.weight", q)
        add(file, f"{base}.scale", s)

    index = None
    if layout == "exllamav3":
        qc = {"quant_method": "exl3", "version": "fidelity-minipack-v4", "bits": int(spec.expert_k[0]),
              "head_bits": spec.head_k, "codebook": spec.codebook}
        cfg["quantization_config"] = qc
        (out / "quantization_config.json").write_text(json.dumps({**qc, "tensor_storage": tensor_storage}, indent=1))
    elif layout == "cuda-exl3":
        bits = {str(L): (ks[0] if L == 0 else "".join(str(ks[e]) for e in range(n_experts)))
                for L, ks in sorted(stated.items())}
        (out / "quantization_config.json").write_text(json.dumps({
            "quant_method": "exl3", "format": "cuda-exl3", "codebook": spec.codebook, "expert_bits": bits,
            "original_quantization_config": spec.fp8_qc}, indent=1))
        index = {}
    elif layout == "deepseek_v41_exl3":
        cfg["quantization_config"] = {"quant_method": "deepseek_v41_exl3", "dense_bits": spec.dense_k,
                                      "head_bits": spec.head_k,
                                      "exl3_moe": {"plan": PLAN_FILE, "codebook": spec.codebook, "parts": 2}}
        plan = {"layers": {str(L): "".join(str(ks[e]) for e in range(n_experts)) for L, ks in sorted(stated.items())},
                "drafter": {"layers": {}}}
        (out / PLAN_FILE).write_text(json.dumps(plan, indent=1))
        index = {}
    elif layout == "exl3-expert-packs":
        cfg["quantization_config"] = spec.fp8_qc
        plan = {"layers": [{"k": "".join(str(stated[L][e]) for e in range(n_experts))} if L in stated else None
                           for L in range(int(cfg["num_hidden_layers"]))]}
        (out / PLAN_FILE).write_text(json.dumps(plan, indent=1))
        # the official index names the Engram shard V4.1 packs carry; this V4 pack has none (absent shard, never requested)
        index = {"engram.tables.0.weight": "model-00003-of-00003.safetensors"}
    elif layout == "fp8-mxfp4":
        cfg["quantization_config"] = spec.fp8_qc
        index = {}
    for file, tensors in files.items():
        write_safetensors(out / file, tensors, metadata={"format": "pt"})
        if index is not None and not (layout == "exl3-expert-packs" and file.startswith("model-experts-")):
            index.update({n: file for n in tensors})
    if index is not None:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    root = Path(getattr(native, "root", native.path))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "generation_config.json"):
        if (root / f).exists():
            (out / f).write_bytes((root / f).read_bytes())
    return out


def write_all(native: Pack | str | Path, out_root: str | Path, spec: V4MiniSpec = V4MiniSpec(),
              cache: EncodingCache | None = None, device: str | None = None, layouts=LAYOUTS) -> dict[str, Path]:
    """One miniature pack per layout under out_root/<layout>."""
    from . import open_pack

    native = open_pack(native) if not isinstance(native, Pack) else native
    cache = cache if cache is not None else EncodingCache()
    return {layout: write_v4_minipack(native, layout, Path(out_root) / layout, spec, cache, device) for layout in layouts}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m fidelity.packs.minipacks_v4",
                                 description="Write miniature DeepSeek-V4 packs from a small official-named V4 pack.")
    ap.add_argument("native", help="a small native V4 pack in official names (see build_native)")
    ap.add_argument("out_root", help="one folder per layout is written under it")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--cache", default=None, help="safetensors file of encodings: read if present, updated after")
    ap.add_argument("--device", default=None, help="where to run the EXL3 encoder (cuda is much faster)")
    ap.add_argument("--expert-k", default=V4MiniSpec.expert_k, help="K digits cycled over the experts")
    args = ap.parse_args(argv)
    cache = EncodingCache(args.cache)
    out = write_all(args.native, args.out_root, V4MiniSpec(expert_k=args.expert_k), cache, args.device,
                    layouts=args.layouts.split(","))
    for path in out.values():
        print(path)
    if args.cache and cache.misses:
        cache.save(args.cache)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
