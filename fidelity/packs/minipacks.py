"""Miniature EXL3 packs in each of the five seed layouts (see exl3_layouts.py), written from a small native pack.

    from fidelity.packs.minipacks import write_minipack, MiniPackSpec, EncodingCache
    write_minipack("tiny-native/", "deepseek_v41_exl3", "out/", MiniPackSpec(), EncodingCache("enc.safetensors"))

    python -m fidelity.packs.minipacks NATIVE OUT_ROOT [--layouts a,b] [--cache enc.safetensors] [--device cuda]

The native pack is a Hugging Face DeepSeek-V3-style checkpoint (HF names, e.g. from `DeepseekV3ForCausalLM.save_pretrained`);
tensors with official names (e.g. `layers.L.attn.wo_a.weight`) pass through. Encoding runs the reference Viterbi encoder
(`exl3.encode`), which is slow on a CPU: an EncodingCache (optionally backed by a safetensors file) keeps every
(tensor, K, codebook) encoding, keyed by a hash of the weight, so the five layouts share encodings and fixtures can be
pre-encoded on a GPU (`required_encodings` lists what a spec needs).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .base import Pack, tensor_role
from .exl3 import encode
from .exl3_layouts import PLAN_FILE, hf_to_official, routed_expert
from .safetensors_io import write_safetensors

LAYOUTS = ("exllamav3", "cuda-exl3", "deepseek_v41_exl3", "exl3-expert-packs", "exl3-mixed")
FP8_MAX = 448.0


@dataclass(frozen=True)
class MiniPackSpec:
    codebook: str = "mul1"
    dense_k: int = 4          # attention, dense MLPs, shared experts (where the layout makes them EXL3)
    head_k: int = 6
    layer_k: int = 3          # cuda-exl3: one K for all routed experts of a layer
    expert_k: str = "2345"    # plans and mixed-K packs: expert e of every MoE layer gets K = int(expert_k[e % len])

    def expert_bits(self, expert: int) -> int:
        return int(self.expert_k[expert % len(self.expert_k)])


class EncodingCache:
    """(name, K, codebook, weight hash) -> exllamav3-stored tensors; `save` writes it as one safetensors file."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self.entries: dict[str, dict[str, torch.Tensor]] = {}
        self.misses = 0
        if self.path is not None and self.path.exists():
            from safetensors.torch import load_file

            for full, t in load_file(str(self.path)).items():
                key, part = full.rsplit("::", 1)
                self.entries.setdefault(key, {})[part] = t

    @staticmethod
    def key(name: str, weight: torch.Tensor, K: float, codebook: str) -> str:
        digest = hashlib.sha256(weight.detach().float().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]
        return f"{name}|K{K:g}|{codebook}|{digest}"

    def get(self, name: str, weight: torch.Tensor, K: float, codebook: str, device: str | None = None) -> dict[str, torch.Tensor]:
        key = self.key(name, weight, K, codebook)
        if key not in self.entries:
            self.misses += 1
            w = weight.to(device) if device else weight
            self.entries[key] = {k: v.cpu() for k, v in encode(w, K, codebook).tensors.items()}
        return self.entries[key]

    def save(self, path: str | Path | None = None):
        path = Path(path or self.path)
        write_safetensors(path, {f"{k}::{p}": t for k, parts in self.entries.items() for p, t in parts.items()})


# ---------------------------------------------------------------------------------------------------------------------
# what goes where
# ---------------------------------------------------------------------------------------------------------------------
def _kind(name: str, shape: tuple[int, ...]) -> str:
    """head | expert | wo_a | linear | other."""
    if name == "lm_head.weight":
        return "head"
    if name.endswith(".wo_a.weight"):
        return "wo_a"
    if routed_expert(name) is not None and name.endswith(".weight") and len(shape) == 2:
        return "expert"
    if name.endswith(".weight") and len(shape) == 2 and tensor_role(name, shape) == "linear":
        return "linear"
    return "other"


def _exl3_plan(layout: str, name: str, shape: tuple[int, ...], spec: MiniPackSpec) -> float | None:
    """The K a layout stores this native tensor at, or None when it stays unquantized / FP8."""
    kind = _kind(name, shape)
    if kind == "expert":
        e = routed_expert(name)[2]
        return spec.layer_k if layout == "cuda-exl3" else spec.expert_bits(e)
    if layout == "exllamav3":
        return {"head": spec.head_k, "linear": spec.dense_k}.get(kind)
    if layout == "deepseek_v41_exl3":
        return {"head": spec.head_k, "linear": spec.dense_k, "wo_a": spec.dense_k}.get(kind)
    return None


def _wo_a_slices(w: torch.Tensor, config: dict) -> list[torch.Tensor]:
    groups = int(config.get("o_groups") or 1)
    return list(w.reshape(groups, w.shape[0] // groups, w.shape[1]).unbind(0))


def required_encodings(native: Pack, spec: MiniPackSpec, layouts=LAYOUTS) -> list[tuple[str, torch.Tensor, float]]:
    """(stored name, weight, K) of every EXL3 encoding the given layouts need."""
    need = {}
    for name in native.names():
        shape = native.storage(name).shape
        for layout in layouts:
            K = _exl3_plan(layout, name, shape, spec)
            if K is None:
                continue
            w = native.tensor(name)
            if _kind(name, shape) == "wo_a":
                for g, part in enumerate(_wo_a_slices(w, native.config)):
                    need[(f"{name}.{g}", K)] = part
            else:
                need[(name, K)] = w
    return [(n, w, K) for (n, K), w in need.items()]


# ---------------------------------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------------------------------
def _fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 values and the fp32 multiplier per 128x128 block (DeepSeek weight_scale_inv semantics)."""
    rows, cols = w.shape
    gr, gc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(gr * block, gc * block)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(gr, block, gc, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).reshape(gr * block, gc * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


class _Writer:
    """Collects tensors per output file and writes them, with an index when there are several files."""

    def __init__(self, out: Path):
        self.out = out
        self.files: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, file: str, name: str, t: torch.Tensor):
        self.files.setdefault(file, {})[name] = t.contiguous()

    def finish(self, index: bool, extra_index: dict[str, str] | None = None):
        weight_map = {}
        for file, tensors in self.files.items():
            write_safetensors(self.out / file, tensors, metadata={"format": "pt"})
            weight_map.update({n: file for n in tensors})
        if index:
            weight_map.update(extra_index or {})
            (self.out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def shard_for(layout: str, name: str, kind: str, exl3: bool, n_experts: int) -> str:
    """The safetensors file a layout puts a tensor in (V3-style and V4 miniature packs alike)."""
    e = routed_expert(name)
    if kind == "engram":                         # V4.1's tables: their own shard in every layout
        return f"model-engram-L{int(name.split('.')[1]):02d}.safetensors"
    if layout in ("exllamav3", "exl3-mixed"):
        return "model.safetensors"
    if layout in ("cuda-exl3", "fp8-mxfp4"):
        return "model-00002-of-00002.safetensors" if kind == "expert" else "model-00001-of-00002.safetensors"
    if layout == "deepseek_v41_exl3":
        if kind == "expert":
            return f"model-exl3-L{e[1]:02d}-p{int(e[2] >= n_experts // 2)}.safetensors"
        if kind == "head" and exl3:
            return "model-exl3-head.safetensors"
        return "model-exl3-dense.safetensors" if exl3 else "model-rest.safetensors"
    return f"model-experts-L{e[1]:02d}.safetensors" if kind == "expert" else "model-00001-of-00003.safetensors"


def write_minipack(native: Pack | str | Path, layout: str, out_dir: str | Path, spec: MiniPackSpec = MiniPackSpec(),
                   cache: EncodingCache | None = None, device: str | None = None) -> Path:
    """Write `native` in one of LAYOUTS to out_dir (created). Returns the folder."""
    from . import open_pack

    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")
    native = open_pack(native) if not isinstance(native, Pack) else native
    cache = cache or EncodingCache()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in native.config.items() if k != "quantization_config"}
    official = layout != "exllamav3"
    writer = _Writer(out)
    tensor_storage: dict[str, dict] = {}
    moe_layers: set[int] = set()
    n_experts = int(cfg.get("n_routed_experts") or 0)
    fp8_qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

    for name in native.names():
        shape = tuple(native.storage(name).shape)
        kind = _kind(name, shape)
        stored = hf_to_official(name) if official else name
        K = _exl3_plan(layout, name, shape, spec)
        if kind == "expert":
            moe_layers.add(routed_expert(name)[1])
        w = native.tensor(name)
        if K is not None:
            base = stored[: -len(".weight")]
            pieces = ([(f"{base}.{g}", f"{name}.{g}", part) for g, part in enumerate(_wo_a_slices(w, native.config))]
                      if kind == "wo_a" else [(base, name, w)])
            for piece_base, cache_name, piece in pieces:
                enc = cache.get(cache_name, piece, K, spec.codebook, device)
                for part, t in enc.items():
                    writer.add(shard_for(layout, name, kind, True, n_experts), f"{piece_base}.{part}", t)
                tensor_storage[piece_base] = {
                    "stored_tensors": {f"{piece_base}.{p}": {"shape": list(t.shape), "dtype": str(t.dtype)} for p, t in enc.items()},
                    "quant_format": "exl3", "bits_per_weight": K}
        elif layout in ("cuda-exl3", "exl3-expert-packs") and kind == "linear":
            q, scale = _fp8_block(w)
            base = stored[: -len(".weight")]
            writer.add(shard_for(layout, name, kind, False, n_experts), f"{base}.weight", q)
            writer.add(shard_for(layout, name, kind, False, n_experts), f"{base}.scale", scale)
        else:
            dtype = torch.float16 if layout == "exllamav3" else torch.bfloat16
            writer.add(shard_for(layout, name, kind, False, n_experts), stored, w.to(dtype))

    extra_index = {}
    if layout == "exllamav3":
        qc = {"quant_method": "exl3", "version": "fidelity-minipack", "bits": spec.dense_k, "head_bits": spec.head_k,
              "codebook": spec.codebook}
        cfg["quantization_config"] = qc
        (out / "quantization_config.json").write_text(json.dumps({**qc, "tensor_storage": tensor_storage}, indent=1))
    elif layout == "cuda-exl3":
        (out / "quantization_config.json").write_text(json.dumps({
            "quant_method": "exl3", "format": "cuda-exl3", "codebook": spec.codebook,
            "expert_bits": {str(L): spec.layer_k for L in sorted(moe_layers)},
            "original_quantization_config": fp8_qc}, indent=1))
    elif layout == "deepseek_v41_exl3":
        cfg["quantization_config"] = {"quant_method": "deepseek_v41_exl3", "dense_bits": spec.dense_k,
                                      "head_bits": spec.head_k,
                                      "exl3_moe": {"plan": PLAN_FILE, "codebook": spec.codebook, "parts": 2}}
        plan = {"layers": {str(L): "".join(str(spec.expert_bits(e)) for e in range(n_experts)) for L in sorted(moe_layers)},
                "drafter": {"layers": {}}}
        (out / PLAN_FILE).write_text(json.dumps(plan, indent=1))
    elif layout == "exl3-expert-packs":
        cfg["quantization_config"] = fp8_qc
        n_layers = int(cfg.get("num_hidden_layers") or (max(moe_layers) + 1 if moe_layers else 0))
        plan = {"layers": [{"k": "".join(str(spec.expert_bits(e)) for e in range(n_experts))} if L in moe_layers else None
                           for L in range(n_layers)]}
        (out / PLAN_FILE).write_text(json.dumps(plan, indent=1))
        # the official index also names Engram tables in a shard this pack does not carry
        extra_index = {"engram.tables.0.weight": "model-00003-of-00003.safetensors"}
    writer.finish(index=layout in ("cuda-exl3", "deepseek_v41_exl3", "exl3-expert-packs"), extra_index=extra_index)
    if layout == "exl3-expert-packs":      # the index lists the official shards only; expert packs sit beside it
        idx = json.loads((out / "model.safetensors.index.json").read_text())
        idx["weight_map"] = {n: f for n, f in idx["weight_map"].items() if not re.match(r"model-experts-L\d+", f)}
        (out / "model.safetensors.index.json").write_text(json.dumps(idx, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src = getattr(native, "root", native.path) / f if Path(getattr(native, "root", native.path)).is_dir() else None
        if src is not None and src.exists():
            (out / f).write_bytes(src.read_bytes())
    return out


def write_all(native: Pack | str | Path, out_root: str | Path, spec: MiniPackSpec = MiniPackSpec(),
              cache: EncodingCache | None = None, device: str | None = None) -> dict[str, Path]:
    """One miniature pack per layout under out_root/<layout>."""
    cache = cache or EncodingCache()
    return {layout: write_minipack(native, layout, Path(out_root) / layout, spec, cache, device) for layout in LAYOUTS}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m fidelity.packs.minipacks", description="Write miniature EXL3 packs.")
    ap.add_argument("native", help="a small native (HF-named) pack")
    ap.add_argument("out_root", help="one folder per layout is written under it")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--cache", default=None, help="safetensors file of encodings: read if present, updated after")
    ap.add_argument("--device", default=None, help="where to run the encoder (cuda is much faster)")
    ap.add_argument("--codebook", default=MiniPackSpec.codebook)
    ap.add_argument("--expert-k", default=MiniPackSpec.expert_k, help="K digits cycled over the experts")
    args = ap.parse_args(argv)
    from . import open_pack

    spec = MiniPackSpec(codebook=args.codebook, expert_k=args.expert_k)
    cache = EncodingCache(args.cache)
    native = open_pack(args.native)
    for layout in args.layouts.split(","):
        print(write_minipack(native, layout, Path(args.out_root) / layout, spec, cache, args.device))
    if args.cache and cache.misses:
        cache.save(args.cache)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
