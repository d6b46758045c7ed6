"""The five EXL3 pack layouts of the seed cards, recognised automatically, with one consistency rule: a K that a plan or
config states for a tensor must equal the K its trellis shape implies (last dim / 16), else a PackError naming both.

Every EXL3 linear is stored as `<base>.trellis` int16 [k/16, n/16, 16K], `<base>.suh` fp16 [k] (or legacy sign bits
`<base>.su`), `<base>.svh` fp16 [n] (or `<base>.sv`), an optional marker `<base>.mcg` / `<base>.mul1` and an optional
`<base>.bias`; it decodes to the logical `<base>.weight` [out, in] (+ `<base>.bias`), padding cut to the shape the
model config implies (see `logical_shape`). Layouts:

1. `exllamav3` - a standard exllamav3 checkpoint: `quantization_config.quant_method == "exl3"`, Hugging Face names. The
   stated K is `quantization_config.json`'s `tensor_storage[module].bits_per_weight` where present.
2. `cuda-exl3` - DeepSeek official names (`layers.L.ffn.experts.E.w1/w3/w2.{trellis,suh,svh,mul1}`) inside
   release-numbered shards (`model-0000i-of-0000n.safetensors` + index) next to untouched official tensors (FP8 e4m3
   weights with `.scale` or `.weight_scale_inv` block scales, MXFP4 int8 [out, in/2] with e8m0 `.scale` [out, in/32],
   bf16 norms...). `quantization_config.json` = `{"quant_method": "exl3", "format": "cuda-exl3",
   "expert_bits": {"<L>": K, ...}, "original_quantization_config": {...the official fp8 block...}}`; config.json carries
   no quantization_config. Stated K: expert_bits[L] for every routed expert of layer L (or expert_bits[L][E] when a
   layer lists one K per expert; a layer with EXL3 experts but no entry is an error).
3. `deepseek_v41_exl3` - config.json `quantization_config = {"quant_method": "deepseek_v41_exl3", "exl3_moe": {"plan":
   "exl3_moe_plan.json", "codebook": ..., "parts": 2}, ...}`. `exl3_moe_plan.json` = `{"layers": {"<L>": "<one digit per
   expert = its K>"}, "drafter": {"layers": {"<i>": "<digits>"}}}` (drafter = `mtp.<i>.ffn.experts.*`). Routed experts
   of layer L live in `model-exl3-L<LL>-p0.safetensors` (experts 0..E/2-1) and `-p1` (the rest); other EXL3 linears
   (attention, dense MLPs, shared experts) in `model-exl3-dense.safetensors`; the head `head.{trellis,...}` in
   `model-exl3-head.safetensors`; everything else (norms, embeddings, router) in `model-rest.safetensors`. `wo_a`
   (grouped low-rank output) is stored as head-group slices `layers.L.attn.wo_a.<g>.{trellis,...}`, g = 0..o_groups-1,
   each an EXL3 linear [o_lora_rank, in/o_groups]; the logical `layers.L.attn.wo_a.weight` stacks them along the
   output dim.
4. `expert-packs` - `model-experts-L<NN>.safetensors` per MoE layer holding its routed experts (official names),
   `exl3_moe_plan.json` = `{"layers": [null | {"k": "<one digit per expert>"}, ...]}` indexed by layer; dense tensors
   from the official shards listed in `model.safetensors.index.json`, which may name shards that are absent (e.g. Engram
   tables): an absent shard is an error only when one of its tensors is requested.
5. `exl3-mixed` - self-describing mixed-K: official names, EXL3 routed experts at any K per expert, no plan and no
   stated K (K comes from each trellis alone); any pack holding `.trellis` tensors that none of the above claims lands
   here.

Plans must list exactly `n_routed_experts` digits per layer. In every layout a tensor with a part in a shard that the
index names but that is absent is an error only when requested. The pack's `format` becomes the layout's name
(`exl3` for layout 1). Official names map to
the Hugging Face DeepSeek names the oracle uses (w1/w3/w2 = gate_proj/up_proj/down_proj,
`layers.L.ffn.experts.E.w1` -> `model.layers.L.mlp.experts.E.gate_proj.weight`; names without an HF counterpart, such
as `wo_a`, `hc_*`, `engram.*`, stay as they are).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ...errors import PackError
from ..base import BatchDecode, LogicalTensor, Storage
from .codec import HAD, Bitrate, bitrate_from_trellis, decode_weight, decode_weights, unpack_sign_bits
from ..folder import KNOWN_QUANT_METHODS
from ...registry import CLAIMERS
from ..staging import CPU, stack_to_device, to_device
from .. import fp4, fp8, native

PLAN_FILE = "exl3_moe_plan.json"
EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")

# ---------------------------------------------------------------------------------------------------------------------
# names: DeepSeek official <-> Hugging Face
# ---------------------------------------------------------------------------------------------------------------------
_ATTN = {"wq": "q_proj", "wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa", "wkv_b": "kv_b_proj",
         "wo": "o_proj", "q_norm": "q_a_layernorm", "kv_norm": "kv_a_layernorm"}
_MLP = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_LAYER_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def _params(official_prefix: str, hf_prefix: str, modules: dict[str, str], params=("weight", "bias")) -> dict[str, str]:
    return {f"{official_prefix}{off}.{p}": f"{hf_prefix}{hf}.{p}" for off, hf in modules.items() for p in params}


# official -> HF: whole names, names inside layer L, names inside routed expert E; the inverse is derived below
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
_IN_LAYER = (_params("", "", _LAYER_NORMS, ("weight",)) | _params("attn.", "self_attn.", _ATTN)
             | _params("ffn.", "mlp.", _MLP) | _params("ffn.shared_experts.", "mlp.shared_experts.", _MLP)
             | {"ffn.gate.weight": "mlp.gate.weight", "ffn.gate.bias": "mlp.gate.e_score_correction_bias"})
_IN_EXPERT = _params("", "", _MLP)
_TO_HF = (_TOP, _IN_LAYER, _IN_EXPERT)
_TO_OFFICIAL = tuple({hf: off for off, hf in table.items()} for table in _TO_HF)


@dataclass(frozen=True)
class _Naming:
    layer_prefix: str    # + "<L>." + a name inside the layer
    experts_prefix: str  # inside a layer: + "<E>." + a name inside the expert


_OFFICIAL = _Naming("layers.", "ffn.experts.")
_HF = _Naming("model.layers.", "mlp.experts.")


def _rename(name: str, tables: tuple[dict[str, str], ...], src: _Naming, dst: _Naming) -> str:
    top, in_layer, in_expert = tables
    if name in top:
        return top[name]
    m = re.fullmatch(rf"{re.escape(src.layer_prefix)}(\d+)\.(.+)", name)
    if not m:
        return name
    layer, rest = m.groups()
    renamed = in_layer.get(rest)
    if renamed is None and (e := re.fullmatch(rf"{re.escape(src.experts_prefix)}(\d+)\.(.+)", rest)):
        expert, param = e.groups()
        renamed = f"{dst.experts_prefix}{expert}.{in_expert[param]}" if param in in_expert else None
    return name if renamed is None else f"{dst.layer_prefix}{layer}.{renamed}"


def official_to_hf(name: str) -> str:
    """DeepSeek official name -> Hugging Face name (unchanged when there is no HF counterpart)."""
    return _rename(name, _TO_HF, _OFFICIAL, _HF)


def hf_to_official(name: str) -> str:
    """Inverse of official_to_hf."""
    return _rename(name, _TO_OFFICIAL, _HF, _OFFICIAL)


_EXPERT = re.compile(r"(?:model\.)?(layers|mtp)\.(\d+)\.(?:ffn|mlp)\.experts\.(\d+)\.")


def routed_expert(name: str) -> tuple[str, int, int] | None:
    """('layers' | 'mtp', layer, expert) of a routed-expert tensor name (either naming)."""
    m = _EXPERT.match(name)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


# ---------------------------------------------------------------------------------------------------------------------
# logical shapes (the padding exllamav3 adds is cut to what the config implies)
# ---------------------------------------------------------------------------------------------------------------------
def _round_up(x: int, m: int = HAD) -> int:
    return -(-x // m) * m


def logical_shape(hf_name: str, config: dict, padded: tuple[int, int]) -> tuple[int, int]:
    """[out, in] of a linear weight (HF name) from an HF config; the padded shape when the name is not recognised."""
    c = {**(config.get("text_config") or {}), **config}     # multimodal configs nest the language model's fields
    hidden = c.get("hidden_size")
    heads = c.get("num_attention_heads")
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or (hidden // heads if hidden and heads else None)
    qk_head = (c.get("qk_nope_head_dim") or 0) + (c.get("qk_rope_head_dim") or 0) or head_dim
    v_head = c.get("v_head_dim") or head_dim
    inter = c.get("intermediate_size")
    moe_inter = c.get("moe_intermediate_size") or inter
    shared_inter = moe_inter * (c.get("n_shared_experts") or 1) if moe_inter else None
    leaf = hf_name.rsplit(".", 2)[-2] if hf_name.endswith(".weight") else ""
    if ".experts." in hf_name:
        ff = moe_inter
    elif ".shared_experts." in hf_name:
        ff = shared_inter
    else:
        ff = inter
    mla = c.get("kv_lora_rank") is not None
    table = {
        "q_proj": (heads * (qk_head if mla else head_dim) if heads and (qk_head or head_dim) else None, hidden),
        "k_proj": (kv_heads * head_dim if kv_heads and head_dim else None, hidden),
        "v_proj": (kv_heads * head_dim if kv_heads and head_dim else None, hidden),
        "o_proj": (hidden, heads * (v_head if mla else head_dim) if heads and (v_head or head_dim) else None),
        "gate_proj": (ff, hidden),
        "up_proj": (ff, hidden),
        "down_proj": (hidden, ff),
        "q_a_proj": (c.get("q_lora_rank"), hidden),
        "q_b_proj": (heads * qk_head if heads and qk_head else None, c.get("q_lora_rank")),
        "kv_a_proj_with_mqa": ((c.get("kv_lora_rank") or 0) + (c.get("qk_rope_head_dim") or 0) or None, hidden),
        "kv_b_proj": (
            heads * ((c.get("qk_nope_head_dim") or 0) + (v_head or 0)) if heads else None,
            c.get("kv_lora_rank"),
        ),
        "lm_head": (c.get("vocab_size"), hidden),
        "head": (c.get("vocab_size"), hidden),
    }
    if c.get("o_groups") and not mla:
        # DeepSeek-V4 (no kv LoRA): one shared KV head of head_dim (RoPE part included), grouped low-rank output
        groups, o_rank = c["o_groups"], c.get("o_lora_rank")
        q_out = heads * head_dim if heads and head_dim else None
        v4 = {"q_b_proj": (q_out, c.get("q_lora_rank")),
              "wkv": (head_dim, hidden),
              "wo_a": (groups * o_rank if o_rank else None, q_out // groups if q_out else None),
              "wo_b": (hidden, groups * o_rank if o_rank else None)}
        v4.update({"kv_proj": v4["wkv"], "o_a_proj": v4["wo_a"], "o_b_proj": v4["wo_b"]})  # HF's names for them
        # only the attention's own projections (the compressor and indexer inside it reuse some leaf names)
        if re.search(r"\.(attn|self_attn)\.\w+\.weight$", hf_name):
            table.update(v4)
        else:
            for leaf_name in v4:
                table.pop(leaf_name, None)
    if hf_name == "lm_head.weight":
        leaf = "lm_head"
    shape = table.get(leaf)
    if shape is None or None in shape:
        return padded
    out, inp = int(shape[0]), int(shape[1])
    if (
        (_round_up(out), _round_up(inp)) != (_round_up(padded[0]), _round_up(padded[1]))
        or out > padded[0]
        or inp > padded[1]
    ):
        return padded       # the config does not describe this tensor (e.g. another architecture's field names)
    return out, inp


# ---------------------------------------------------------------------------------------------------------------------
# one EXL3 linear
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class StoredLinear:
    """The stored tensors of one EXL3 linear (stored names)."""

    base: str
    parts: dict[str, str] = field(default_factory=dict)   # suffix -> stored name

    @property
    def trellis(self) -> str:
        return self.parts["trellis"]

    def codebook(self, pack) -> str:
        markers = [m for m in ("mcg", "mul1") if m in self.parts]
        if len(markers) > 1:
            raise PackError("EXL3 linear carries both the mcg and mul1 codebook markers",
                            file=pack.raw.file_path(self.trellis), tensor=self.base)
        return markers[0] if markers else "3inst"


def find_linears(pool: set) -> dict[str, StoredLinear]:
    """Group the pool's EXL3 tensors by base name (every base that has a `.trellis`)."""
    bases = {n[: -len(".trellis")] for n in pool if n.endswith(".trellis")}
    out = {b: StoredLinear(b) for b in bases}
    for b, lin in out.items():
        for s in EXL3_SUFFIXES:
            if f"{b}.{s}" in pool:
                lin.parts[s] = f"{b}.{s}"
    return out


@dataclass(frozen=True)
class CheckedLinear:
    lin: StoredLinear
    codebook: str
    rate: Bitrate
    padded: tuple[int, int]     # (out_p, in_p)
    nbytes: int
    files: tuple[str, ...]


def check_linear(pack, lin: StoredLinear, stated_k: tuple[float, str] | None) -> CheckedLinear:
    """Header-only validation of one EXL3 linear; raises PackError naming the tensor and file."""
    raw = pack.raw
    tname = lin.trellis
    tfile = raw.file_path(tname)
    codebook = lin.codebook(pack)
    info = raw.info(tname)
    if info.dtype not in ("I16", "U16"):
        raise PackError(f"EXL3 trellis must be int16, got {info.dtype}", file=tfile, tensor=tname)
    rate = bitrate_from_trellis(info.shape, codebook, file=tfile, tensor=tname)
    k_p, n_p = info.shape[0] * 16, info.shape[1] * 16
    for side, dense, bits, want in (("input", "suh", "su", k_p), ("output", "svh", "sv", n_p)):
        if dense in lin.parts:
            shape = raw.info(lin.parts[dense]).shape
            if shape != (want,):
                raise PackError(
                    f"EXL3 {dense} has shape {list(shape)}; the trellis {list(info.shape)} needs [{want}] "
                    f"({side} features, padded)",
                    file=raw.file_path(lin.parts[dense]),
                    tensor=lin.parts[dense],
                )
        elif bits in lin.parts:
            shape = raw.info(lin.parts[bits]).shape
            if shape != (want // 16,):
                raise PackError(f"EXL3 sign bitfield {bits} has shape {list(shape)}; the trellis needs [{want // 16}]",
                                file=raw.file_path(lin.parts[bits]), tensor=lin.parts[bits])
        else:
            raise PackError(f"EXL3 linear has a trellis but no {dense} (nor legacy {bits}) tensor",
                            file=tfile, tensor=f"{lin.base}.{dense}")
    if stated_k is not None:
        K, where = stated_k
        if float(K) != float(rate.K):
            raise PackError(f"{where} states K={K:g} but the trellis last dim {info.shape[-1]} implies K={rate.K:g}",
                            file=tfile, tensor=tname)
    names = [n for s, n in lin.parts.items() if s != "bias"]
    nbytes = sum(raw.info(n).nbytes for n in names)
    return CheckedLinear(lin, codebook, rate, (n_p, k_p), nbytes, raw.files_of(*names))


def _read_scale(pack, lin: StoredLinear, dense: str, bits: str, device: torch.device) -> torch.Tensor:
    if dense in lin.parts:
        return to_device(pack.raw.get(lin.parts[dense]), device)
    return unpack_sign_bits(to_device(pack.raw.get(lin.parts[bits]), device))


def linear_weight(pack, c: CheckedLinear, shape: tuple[int, int], device: torch.device = CPU) -> torch.Tensor:
    """The decoded weight [out, in] on `device` (the stored trellis and scales travel, the decode runs there, with the
    pack's `settings.exl3_sums`)."""
    lin, raw = c.lin, pack.raw
    return decode_weight(to_device(raw.get(lin.trellis), device), _read_scale(pack, lin, "suh", "su", device),
                         _read_scale(pack, lin, "svh", "sv", device), c.codebook, shape=shape,
                         file=raw.file_path(lin.trellis), tensor=lin.trellis, sums=pack.settings.exl3_sums)


def linear_weights(device: torch.device, parts: list) -> list[torch.Tensor]:
    """BatchDecode of EXL3 linears of one codebook, trellis shape, scale encoding, logical shape and sums: parts (pack,
    CheckedLinear, shape) -> their decoded weights, every stored tensor sent once into one buffer per kind and all
    decoded in one `decode_weights` (one kernel launch with the fused int8 sums), each bit for bit `linear_weight`'s."""
    pack0, c0, shape = parts[0]

    def scales(dense: str, bits: str) -> torch.Tensor:
        if dense in c0.lin.parts:                   # one encoding per batch: it is part of the kind
            return stack_to_device([pack.raw.get(c.lin.parts[dense]) for pack, c, _ in parts], device)
        return torch.stack([_read_scale(pack, c.lin, dense, bits, device) for pack, c, _ in parts])

    trellis = stack_to_device([pack.raw.get(c.lin.trellis) for pack, c, _ in parts], device)
    w = decode_weights(trellis, scales("suh", "su"), scales("svh", "sv"), c0.codebook, shape=shape,
                       files=[pack.raw.file_path(c.lin.trellis) for pack, c, _ in parts],
                       tensors=[c.lin.trellis for _, c, _ in parts], sums=pack0.settings.exl3_sums)
    return list(w.unbind(0))


def linear_entries(pack, c: CheckedLinear, logical: str, shape: tuple[int, int]) -> dict[str, LogicalTensor]:
    """The logical weight (and bias) of one checked EXL3 linear."""
    lin, raw = c.lin, pack.raw
    storage = Storage(logical, "exl3", f"exl3 K={c.rate.K:g} {c.codebook}", tuple(shape), c.nbytes,
                      block=(16, 16), files=c.files, raw=tuple(n for s, n in lin.parts.items() if s != "bias"))
    kind = (c.codebook, pack.raw.info(lin.trellis).shape, tuple(shape), "suh" in lin.parts, "svh" in lin.parts,
            pack.settings.exl3_sums)
    out = {logical: LogicalTensor(storage, lambda device: linear_weight(pack, c, shape, device), on_device=True,
                                  batch=BatchDecode(linear_weights, kind, (pack, c, shape)))}
    if "bias" in lin.parts:
        bname = lin.parts["bias"]
        binfo = raw.info(bname)
        if len(binfo.shape) != 1 or binfo.shape[0] not in (shape[0], c.padded[0]):
            raise PackError(f"EXL3 bias has shape {list(binfo.shape)}; expected [{shape[0]}] or padded [{c.padded[0]}]",
                            file=raw.file_path(bname), tensor=bname)
        blogical = logical[: -len(".weight")] + ".bias"
        bstorage = Storage(blogical, binfo.dtype.lower(), binfo.dtype, (shape[0],), binfo.nbytes,
                           files=raw.files_of(bname), raw=(bname,))
        out[blogical] = LogicalTensor(
            bstorage, lambda device: to_device(raw.get(bname), device)[: shape[0]].to(torch.float32), on_device=True)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------------------------------
StatedK = Callable[[str], "tuple[float, str] | None"]   # stored base name -> (K, where it is stated)


@dataclass
class Layout:
    name: str
    official_names: bool
    stated_k: StatedK
    original_quant_config: dict | None = None


def _is_official(names) -> bool:
    names = list(names)
    if any(n.startswith("model.layers.") or n == "lm_head.weight" or n.startswith("lm_head.") for n in names):
        return False
    return any(n.startswith("layers.") or n in ("embed.weight", "head.weight") or n.startswith("head.") for n in names)


def _n_experts(pack, where_file) -> int:
    n = pack.config.get("n_routed_experts") or pack.config.get("num_local_experts") or pack.config.get("num_experts")
    if not n:
        raise PackError("the config does not say how many routed experts there are (n_routed_experts)", file=where_file)
    return int(n)


def _digits_plan(plan_path: Path, entries: dict[tuple[str, int], str], n_experts: int) -> dict[tuple[str, int], str]:
    """Validate 'one digit per expert' strings: length n_experts, digits 1..8."""
    for (kind, layer), digits in entries.items():
        item = f"{kind}[{layer}]"
        if not isinstance(digits, str) or len(digits) != n_experts:
            got = len(digits) if isinstance(digits, str) else type(digits).__name__
            raise PackError(f"plan entry {item} lists {got} experts; the config has n_routed_experts={n_experts}",
                            file=plan_path, tensor=item)
        bad = [ch for ch in digits if ch not in "12345678"]
        if bad:
            raise PackError(
                f"plan entry {item} has K digits outside 1..8: {sorted(set(bad))}", file=plan_path, tensor=item
            )
    return entries


def _plan_stated_k(plan_path: Path, entries: dict[tuple[str, int], str], what: str) -> StatedK:
    def stated(base: str):
        e = routed_expert(base)
        if e is None:
            return None
        kind, layer, expert = e
        digits = entries.get((kind, layer))
        if digits is None:
            raise PackError(f"{what} {plan_path.name} has no entry for {kind} {layer}, whose routed experts are EXL3",
                            file=plan_path, tensor=base)
        if expert >= len(digits):
            raise PackError(f"{what} {plan_path.name} lists {len(digits)} experts for {kind} {layer}; expert {expert} "
                            f"is beyond it", file=plan_path, tensor=base)
        return int(digits[expert]), f"{what} {plan_path.name} ({kind} {layer}, expert {expert})"
    return stated


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PackError(f"invalid JSON: {e}", file=path) from None


def detect_layout(pack, pool: set) -> Layout | None:
    qc = pack.quant_config or {}
    method = qc.get("quant_method")
    has_trellis = any(n.endswith(".trellis") for n in pool)
    plan_path = pack.root / PLAN_FILE
    if method == "deepseek_v41_exl3":
        moe = qc.get("exl3_moe") or {}
        plan_path = pack.root / moe.get("plan", PLAN_FILE)
        if not plan_path.exists():
            raise PackError("deepseek_v41_exl3 pack without its expert plan", file=plan_path)
        plan = _read_json(plan_path)
        n = _n_experts(pack, pack.root / "config.json")
        entries = {("layers", int(k)): v for k, v in (plan.get("layers") or {}).items()}
        entries.update({("mtp", int(k)): v for k, v in ((plan.get("drafter") or {}).get("layers") or {}).items()})
        _digits_plan(plan_path, entries, n)
        return Layout("deepseek_v41_exl3", True, _plan_stated_k(plan_path, entries, "expert plan"))
    if method == "exl3" and "expert_bits" in qc:
        qc_path = pack.root / "quantization_config.json"
        bits = {int(k): v for k, v in qc["expert_bits"].items()}

        def stated(base: str):
            e = routed_expert(base)
            if e is None or e[0] != "layers":
                return None
            if e[1] not in bits:
                raise PackError(
                    f"quantization_config.json expert_bits has no entry for layer {e[1]}, whose routed experts "
                    f"are EXL3",
                    file=qc_path,
                    tensor=base,
                )
            entry = bits[e[1]]
            if isinstance(entry, (list, str)):          # one K per expert instead of one per layer
                if e[2] >= len(entry):
                    raise PackError(f"quantization_config.json expert_bits[{e[1]}] lists {len(entry)} experts; expert "
                                    f"{e[2]} is beyond it", file=qc_path, tensor=base)
                return float(entry[e[2]]), f"quantization_config.json expert_bits[{e[1]}][{e[2]}]"
            return float(entry), f"quantization_config.json expert_bits[{e[1]}]"
        return Layout("cuda-exl3", True, stated, qc.get("original_quantization_config"))
    if plan_path.exists() and method != "exl3":
        plan = _read_json(plan_path)
        layers = plan.get("layers")
        if isinstance(layers, dict):
            layers = {int(k): v for k, v in layers.items()}
        elif isinstance(layers, list):
            layers = dict(enumerate(layers))
        else:
            raise PackError("expert plan has no 'layers' list", file=plan_path)
        entries = {}
        for layer, entry in layers.items():
            if entry is None:
                continue
            if not isinstance(entry, dict) or "k" not in entry:
                raise PackError(
                    f"plan entry layers[{layer}] has no 'k' string", file=plan_path, tensor=f"layers[{layer}]"
                )
            entries[("layers", layer)] = entry["k"]
        _digits_plan(plan_path, entries, _n_experts(pack, pack.root / "config.json"))
        return Layout("exl3-expert-packs", True, _plan_stated_k(plan_path, entries, "expert plan"), qc or None)
    if method == "exl3":
        official = _is_official(pool)
        if official:
            return Layout("exl3-mixed", True, lambda base: None)
        storage = _tensor_storage(pack)

        def stated(base: str):
            bpw = (storage.get(base) or {}).get("bits_per_weight")
            return (float(bpw), f"quantization_config.json tensor_storage[{base!r}].bits_per_weight") if bpw else None
        return Layout("exllamav3", False, stated)
    if has_trellis:
        return Layout("exl3-mixed", _is_official(pool), lambda base: None, qc or None)
    return None


def _tensor_storage(pack) -> dict:
    ts = (pack.quant_config or {}).get("tensor_storage")
    if ts is None:
        f = pack.root / "quantization_config.json"
        if f.exists():
            ts = _read_json(f).get("tensor_storage")
    return ts or {}


# ---------------------------------------------------------------------------------------------------------------------
# the claimer
# ---------------------------------------------------------------------------------------------------------------------
_WO_A_SLICE = re.compile(r"(.*\.wo_a)\.(\d+)$")


@CLAIMERS.register("exl3")
def claim(pack, pool: set) -> dict[str, LogicalTensor]:
    """EXL3 linears of any of the five layouts; for official-named layouts also every other tensor, renamed to HF."""
    layout = detect_layout(pack, pool)
    if layout is None:
        return {}
    if layout.name != "exllamav3":
        pack.format = layout.name
    rename = official_to_hf if layout.official_names else (lambda n: n)
    out: dict[str, LogicalTensor] = {}
    linears = find_linears(pool)
    slices: dict[str, list[tuple[int, CheckedLinear]]] = {}
    for base in sorted(linears):
        lin = linears[base]
        pool.difference_update(lin.parts.values())
        absent = fp8.absent_entry(pack, rename(f"{base}.weight"), tuple(lin.parts.values()))
        if absent is not None:      # a shard the index names is not here: an error only if this tensor is requested
            out[absent.storage.name] = absent
            continue
        checked = check_linear(pack, lin, layout.stated_k(base))
        if m := _WO_A_SLICE.fullmatch(base):
            slices.setdefault(m.group(1), []).append((int(m.group(2)), checked))
            continue
        logical = rename(f"{base}.weight")
        shape = logical_shape(logical, pack.config, checked.padded)
        out.update(linear_entries(pack, checked, logical, shape))
    for base, parts in slices.items():
        out[f"{base}.weight"] = _stacked_slices(pack, base, sorted(parts, key=lambda p: p[0]))
    if layout.official_names:
        out.update(_claim_official_rest(pack, pool, layout))
    return out


def _slice_shape(pack, c: CheckedLinear) -> tuple[int, int]:
    cfg = pack.config
    groups, rank = cfg.get("o_groups"), cfg.get("o_lora_rank")
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or cfg.get("v_head_dim")
    if groups and rank and heads and head_dim:
        shape = (int(rank), int(heads * head_dim // groups))
        if shape[0] <= c.padded[0] and shape[1] <= c.padded[1]:
            return shape
    return c.padded


def _stacked_slices(pack, base: str, parts: list[tuple[int, CheckedLinear]]) -> LogicalTensor:
    """wo_a stored as head-group slices <base>.<g>: the logical weight stacks the slices along the output dim."""
    groups = [g for g, _ in parts]
    first = parts[0][1]
    if groups != list(range(len(groups))):
        raise PackError(f"head-group slices of {base} are {groups}, not 0..{len(groups) - 1}",
                        file=pack.raw.file_path(first.lin.trellis), tensor=base)
    want = pack.config.get("o_groups")
    if want and int(want) != len(groups):
        raise PackError(f"{len(groups)} head-group slices of {base} but the config has o_groups={want}",
                        file=pack.raw.file_path(first.lin.trellis), tensor=base)
    shapes = [_slice_shape(pack, c) for _, c in parts]
    if len(set(shapes)) != 1:
        raise PackError(
            f"head-group slices of {base} differ in shape: {shapes}",
            file=pack.raw.file_path(first.lin.trellis),
            tensor=base,
        )
    rows, cols = shapes[0]
    checked = [c for _, c in parts]
    rates = sorted({f"{c.rate.K:g}" for c in checked})
    storage = Storage(f"{base}.weight", "exl3", f"exl3 K={'/'.join(rates)} {checked[0].codebook} x{len(parts)} slices",
                      (rows * len(parts), cols), sum(c.nbytes for c in checked), block=(16, 16),
                      files=tuple(sorted({f for c in checked for f in c.files})),
                      raw=tuple(n for c in checked for s, n in c.lin.parts.items() if s != "bias"))
    return LogicalTensor(
        storage,
        lambda device: torch.cat([linear_weight(pack, c, (rows, cols), device) for c in checked], dim=0),
        on_device=True,
    )


def _claim_official_rest(pack, pool: set, layout: Layout) -> dict[str, LogicalTensor]:
    """Every other tensor of an official-named pack, renamed to HF: scaled weights (`.weight` + `.scale` or
    `.weight_scale_inv`: FP8 e4m3 with block scales, or MXFP4 packed int8/uint8 with per-32 e8m0 scales), the rest
    native. A tensor with a part in an absent shard is absent (an error only when requested)."""
    qc = layout.original_quant_config or {}
    block = tuple(qc["weight_block_size"]) if qc.get("weight_block_size") else fp8.DEFAULT_BLOCK
    power_of_two = qc.get("scale_fmt") == "ue8m0"
    raw = pack.raw
    out = {}
    for name in sorted(n for n in pool if n.endswith(".weight")):
        base = name[: -len(".weight")]
        scale = next(
            (f"{base}.{s}" for s in ("scale", "weight_scale_inv", "weight_scale") if f"{base}.{s}" in pool), None
        )
        if scale is None:
            continue
        logical = official_to_hf(name)
        pool.difference_update({name, scale})
        absent = fp8.absent_entry(pack, logical, (name, scale))
        if absent is not None:
            out[logical] = absent
        elif raw.info(name).dtype in fp8.FP8_DTYPES:
            out[logical] = fp8.fp8_entry(pack, name, scale, block, power_of_two=power_of_two, logical_name=logical)
        elif raw.info(name).dtype in ("I8", "U8") and raw.info(scale).dtype in fp8.E8M0_DTYPES:
            out[logical] = _mxfp4_entry(pack, name, scale, logical)
        else:
            raise PackError(
                f"scaled weight of dtype {raw.info(name).dtype} with {raw.info(scale).dtype} scales: neither "
                f"FP8 e4m3/e5m2 nor MXFP4 (int8/uint8 + e8m0)",
                file=raw.file_path(name),
                tensor=name,
            )
    for name in sorted(pool):
        logical = official_to_hf(name)
        entry = native._entry(pack, name)
        out[logical] = replace(entry, storage=replace(entry.storage, name=logical))
        pool.discard(name)
    return out


def _mxfp4_entry(pack, name: str, scale: str, logical: str) -> LogicalTensor:
    return fp4.mxfp4_entry(pack, name, scale, logical)


KNOWN_QUANT_METHODS.update({"exl3", "deepseek_v41_exl3"})
# first: official-named EXL3 packs hold FP8 tensors that this claimer renames, so the fp8 claimer must not take them
