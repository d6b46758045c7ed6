"""Pack writers for tests and the demo: a native safetensors pack from any pack, and a GGUF quantized from a native
pack in llama.cpp's layout (names, Q/K row permutation, tokenizer metadata) so that llama.cpp can load it."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from ..errors import PackError
from .base import Pack

DEFAULT_SHARD_BYTES = 2 * 1024**3
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# -- native safetensors -------------------------------------------------------------------------------------------
def write_native(pack: Pack, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write every tensor of `pack` as plain `dtype` safetensors (sharded with an index when large), its config.json
    and its tokenizer files (chat template included). Returns the folder."""
    from safetensors.torch import save_file

    if dtype not in _DTYPE_NAMES:
        raise PackError(f"write_native writes float32, bfloat16 or float16, not {dtype}", file=out_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in pack.names():
        t = pack.tensor(name).to(dtype)
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            for name, t in shard.items():
                weight_map[name] = fname
                total += t.numel() * t.element_size()
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = {k: v for k, v in pack.config.items() if k != "quantization_config"}
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(pack, out)
    return out


def _write_tokenizer(pack: Pack, out: Path):
    from .tokenizer import load_tokenizer

    if pack.tokenizer_source() is None:
        return
    tok = load_tokenizer(pack)
    tok.save_pretrained(str(out))


# -- GGUF ---------------------------------------------------------------------------------------------------------
# quantized by gguf-py's numpy reference (bit-exact with ggml's *_ref for these); everything else by libgguf (llama.cpp's
# own quantizers)
_GGUF_PY_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
# HF model_type -> (gguf architecture, llama.cpp permutes q/k rows)
_GGUF_ARCH = {"llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False),
              "qwen3": ("qwen3", False), "qwen3_moe": ("qwen3moe", False)}
# llama.cpp (llama-quant.cpp) falls back to these when a row is not a multiple of the 256-wide super-block
_K_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "IQ4_XS": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# llama-quantize file types that mix tensor types: file type -> base type (the rules are in `choose_type`)
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q2_K": "Q2_K"}


def _ggml_type(name: str):
    from gguf import GGMLQuantizationType
    try:
        return GGMLQuantizationType[name]
    except KeyError:
        raise PackError(f"unknown GGML type {name!r}") from None


def _fits(qtype: str, cols: int) -> str:
    """llama.cpp's choice when the row length is not a multiple of the type's block."""
    from gguf import GGML_QUANT_SIZES
    if cols % GGML_QUANT_SIZES[_ggml_type(qtype)][0] == 0:
        return qtype
    fallback = _K_FALLBACK.get(qtype, "F16")
    return fallback if cols % GGML_QUANT_SIZES[_ggml_type(fallback)][0] == 0 else "F16"


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def choose_type(hf_name: str, shape: tuple[int, ...], ftype: str, n_layers: int, n_gqa: int, tied: bool) -> str:
    """The GGML type llama-quantize gives this tensor for file type `ftype` (a plain type or one of MIXES); the
    writers tests check the result byte for byte against llama.cpp's own `llama_model_quantize`."""
    if len(shape) < 2 or "norm" in hf_name or hf_name.endswith(".bias") or hf_name.endswith("mlp.gate.weight"):
        return "F32"
    base = MIXES.get(ftype, ftype)
    cols = shape[-1]
    if base in ("F32", "F16", "BF16"):  # llama.cpp applies its per-tensor rules to quantized file types only
        return base
    if hf_name == "lm_head.weight" or (tied and hf_name == "model.embed_tokens.weight"):
        # llama.cpp's output rule: Q8_0 when the row is not a 256 multiple, else Q6_K unless the type is Q8_0
        if cols % 256 != 0:
            return "Q8_0"
        return base if base in ("Q8_0", "F16", "BF16", "F32") else "Q6_K"
    m = re.search(r"\.layers\.(\d+)\.", hf_name)
    more_bits = bool(m) and _use_more_bits(int(m.group(1)), n_layers)
    chosen = base
    if ".v_proj." in hf_name:
        if ftype == "Q2_K":
            chosen = "Q4_K" if n_gqa >= 4 else "Q3_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and more_bits:
            chosen = "Q6_K"
    elif ".down_proj." in hf_name:
        if ftype == "Q2_K":
            chosen = "Q3_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and more_bits:
            chosen = "Q6_K"
    elif ".o_proj." in hf_name and ftype == "Q2_K":
        chosen = "Q3_K"
    return _fits(chosen, cols)


def quantize_array(w: np.ndarray, qtype: str) -> np.ndarray:
    """float32 rows -> GGUF bytes of `qtype` (uint8 [..., bytes per row]) or F32/F16 values."""
    import gguf
    t = _ggml_type(qtype)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == "F32":
        return w
    if qtype in _GGUF_PY_TYPES:
        return gguf.quants.quantize(w, t)
    import libgguf
    return libgguf.quantize_rows(w, int(t))


def write_gguf(pack: Pack, out_path: str | Path, qtype: str, *, types: dict[str, str] | None = None,
               tokenizer_from: Pack | None = None, tokenizer_pre: str = "default") -> Path:
    """Quantize `pack` (read through its exact fp32 tensors) into a llama.cpp-loadable GGUF.

    `qtype` is a llama-quantize file type: a GGML type name (Q8_0, Q6_K, Q4_0, IQ4_XS, ...) or a mix in MIXES
    (Q4_K_M, Q5_K_M, Q2_K), with llama.cpp's per-tensor rules (output / tied embedding, fallbacks for rows that are
    not 256 multiples, norms and router F32); for Q4_0..Q8_0, Q6_K, Q4_K_M and Q2_K the tests check the file equals
    what llama.cpp's own `llama_model_quantize` writes from the F32 GGUF, tensor for tensor and byte for byte.
    `types` overrides the type per HF tensor name. Tokenizer metadata is copied verbatim from `tokenizer_from` (or
    `pack` itself) when that is a GGUF, else built from the HF tokenizer files (byte-level BPE; `tokenizer_pre` names
    llama.cpp's pre-tokenizer, e.g. "smollm", "llama-bpe", "qwen2")."""
    import gguf
    from .gguf import permute_qk

    cfg = pack.config
    model_type = cfg.get("model_type")
    if model_type not in _GGUF_ARCH:
        raise PackError(f"write_gguf supports model_type {sorted(_GGUF_ARCH)}, not {model_type!r}", file=pack.path)
    if qtype not in MIXES:
        _ggml_type(qtype)
    arch, permuted = _GGUF_ARCH[model_type]
    n_layers = int(cfg["num_hidden_layers"])
    tied = bool(cfg.get("tie_word_embeddings", False)) and "lm_head.weight" not in pack
    n_gqa = int(cfg["num_attention_heads"]) // int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])

    def choose(name, shape):
        return choose_type(name, shape, qtype, n_layers, n_gqa, tied)

    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n_layers)
    out_path = Path(out_path)
    writer = gguf.GGUFWriter(str(out_path), arch)
    _write_model_metadata(writer, cfg, arch, qtype, pack)
    _write_tokenizer_metadata(writer, pack, tokenizer_from, tokenizer_pre)

    experts: dict[str, dict[int, str]] = {}  # stacked name -> expert -> HF name
    for name in pack.names():
        m = re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if m:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = name
            continue
        if name == "lm_head.weight" and tied:
            continue
        w = pack.tensor(name)
        if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            w = permute_qk(w, int(cfg["num_attention_heads"]))
        elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            w = permute_qk(w, int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])))
        _add(writer, name_map, name, w, (types or {}).get(name) or choose(name, tuple(w.shape)))
    scaling = cfg.get("rope_scaling") or {}
    if (scaling.get("rope_type") or scaling.get("type")) == "llama3":  # as llama.cpp's converter writes it
        from .gguf import llama3_rope_factors
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        factors = llama3_rope_factors(float(cfg.get("rope_theta", 10000.0)), head_dim, float(scaling["factor"]),
                                      float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0)),
                                      int(scaling.get("original_max_position_embeddings", 8192)))
        writer.add_tensor("rope_freqs.weight", factors)
    for stacked, by_expert in experts.items():
        w = torch.stack([pack.tensor(by_expert[e]) for e in sorted(by_expert)])
        first = by_expert[min(by_expert)]
        _add(writer, name_map, stacked + ".weight", w,
             (types or {}).get(first) or choose(first, tuple(w.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add(writer, name_map, hf_name: str, w: torch.Tensor, qtype: str):
    base, _, suffix = hf_name.rpartition(".")
    gguf_base = name_map.get_name(base)
    if gguf_base is None:
        raise PackError("no llama.cpp name for this tensor", tensor=hf_name)
    data = quantize_array(w.numpy(), qtype)
    raw_dtype = None if qtype in ("F32", "F16") else _ggml_type(qtype)
    writer.add_tensor(f"{gguf_base}.{suffix}", data, raw_dtype=raw_dtype)


_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_K": "MOSTLY_Q4_K_S",
               "Q5_K": "MOSTLY_Q5_K_S", "Q3_K": "MOSTLY_Q3_K_S"}


def _write_model_metadata(writer, cfg: dict, arch: str, qtype: str, pack: Pack):
    import gguf
    n_head = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_head)
    writer.add_name(str(cfg.get("_name_or_path") or Path(pack.path).stem))
    writer.add_context_length(int(cfg["max_position_embeddings"]))
    writer.add_embedding_length(int(cfg["hidden_size"]))
    writer.add_block_count(int(cfg["num_hidden_layers"]))
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(int(cfg.get("num_key_value_heads", n_head)))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(int(cfg["vocab_size"]))
    scaling = cfg.get("rope_scaling")
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if scaling and kind != "llama3":  # llama3 scaling goes in as the rope_freqs.weight tensor (see write_gguf)
        if kind not in ("linear", "yarn"):
            raise PackError(f"write_gguf cannot express rope_scaling type {kind!r}", file=pack.path)
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        if scaling.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    if arch == "qwen3moe":
        writer.add_expert_count(int(cfg["num_experts"]))
        writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        writer.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    ftype = _FILE_TYPES.get(qtype, f"MOSTLY_{qtype}")
    if ftype in gguf.LlamaFileType.__members__:
        writer.add_file_type(int(gguf.LlamaFileType[ftype]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_tokenizer_metadata(writer, pack: Pack, tokenizer_from: Pack | None, pre: str):
    import gguf
    from .gguf import GGUFPack

    source = tokenizer_from or pack
    if isinstance(source, GGUFPack):
        for key, field in source.reader.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
        return
    from .tokenizer import load_tokenizer

    if source.tokenizer_source() is None or not (Path(source.tokenizer_source()) / "tokenizer.json").exists():
        return  # no tokenizer to carry: the GGUF opens in our reader, llama.cpp needs one
    root = Path(source.tokenizer_source())
    spec = json.loads((root / "tokenizer.json").read_text())
    model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        raise PackError("write_gguf builds byte-level BPE (gpt2-style) tokenizers only; for SentencePiece-style ones "
                        "pass tokenizer_from=<a GGUF of this model>", file=root / "tokenizer.json")
    tok = load_tokenizer(source)
    n = max(len(tok), int(pack.config.get("vocab_size", 0)))
    specials = {tid for t, tid in tok.get_added_vocab().items() if t in set(tok.all_special_tokens)}
    added = set(tok.get_added_vocab().values())
    id_to_token = {v: k for k, v in tok.get_vocab().items()}
    tokens, kinds = [], []
    for i in range(n):
        text = id_to_token.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            kinds.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(text)
        kinds.append(gguf.TokenType.CONTROL if i in specials else
                     gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    special = gguf.SpecialVocab(root, load_merges=True, n_vocab=n)
    if not special.merges:
        raise PackError("write_gguf builds GGUF tokenizers for BPE (tokenizer.json with merges) only", file=root)
    special.chat_template = tok.chat_template or special.chat_template
    special.add_to_gguf(writer, quiet=True)


def write_gguf_tensors(path: str | Path, arch: str, hparams: dict, tensors: dict[str, tuple[np.ndarray, str]],
                       extra: dict[str, object] | None = None) -> Path:
    """A raw GGUF for tests: `hparams` become `{arch}.{key}` metadata (ints -> uint32, floats -> float32),
    `tensors` maps llama.cpp names to (stored array, GGML type name): uint8 bytes [..., bytes per row] for quantized
    types, the values for F32/F16. `extra` adds string/int metadata under its full key."""
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in hparams.items():
        if isinstance(value, bool):
            writer.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_string(f"{arch}.{key}", str(value))
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, int(value))
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=None if qtype in ("F32", "F16") else _ggml_type(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
