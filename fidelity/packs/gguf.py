"""GGUF packs: one memory-mapped .gguf file, decoded tensor by tensor to exact float32 in Hugging Face naming.

Exactness: every tensor is decoded by gguf-py's own `gguf.quants.dequantize` (the reference), applied to the raw
blocks as stored. gguf-py widens each fp16/bf16 scale to float32 *before* multiplying and returns float32, so no fp16
rounding happens on the way; we only slice rows (one expert of a stacked tensor) before it and move rows (undoing
llama.cpp's Q/K permutation) after it, both exact. tests/test_packs_gguf.py checks `torch.equal` against gguf-py for
every type we can write.

Naming: gguf-py's `TensorNameMap` for the architecture maps HF module names to llama.cpp names; we invert it, choosing
among its candidates the one in the HF llama-family convention (`model.layers.N.self_attn...`, `mlp...`).
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import _type_traits

from ..errors import PackError
from .base import LogicalTensor, Pack, Storage
from .gguf_file import GGUFFile
from ..pack_settings import PackSettings
from .staging import to_device

# gguf architecture name -> (HF model_type, HF architectures[0])
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
# llama.cpp's convert_hf_to_gguf permutes the rows of q_proj / k_proj for these (LlamaModel.permute) so that its
# rope kernel can rotate adjacent pairs; HF rotates halves.
PERMUTED_QK_ARCHS = {"llama"}
MISTRAL = ("mistral", "MistralForCausalLM")  # llama.cpp writes Mistral models as arch "llama"
# llama.cpp metadata names for tensors that are not model parameters
NON_PARAMETER_TENSORS = {"rope_freqs.weight"}


def supported_types() -> set[str]:
    """GGML type names gguf-py can dequantize."""
    return {"F32", "F16"} | {t.name for t in _type_traits}


# -- decoding on a device --------------------------------------------------------------------------------------------
# Types whose gguf-py dequantizer is a few fp32 operations that torch repeats in the same order on any device (bit for
# bit: F32/F16/BF16, the legacy Q4_0..Q8_0, the K-quants Q2_K..Q6_K); every other type (IQ*, TQ*, MXFP4, Q8_K...) is
# dequantized by gguf-py on the CPU and its fp32 values are moved.
def stored_bytes(data: np.ndarray) -> torch.Tensor:
    """A GGUF tensor's stored bytes (a read-only memory map) as a flat uint8 host tensor, copied once."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    out = torch.empty(flat.size, dtype=torch.uint8)
    out.numpy()[:] = flat
    return out


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 fields [n, 2] (bytes) -> float32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32]: the 16 low nibbles, then the 16 high ones (ggml's order)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32] bits 0..31, as uint8."""
    word = qh.to(torch.int64)
    word = word[:, 0] | word[:, 1] << 8 | word[:, 2] << 16 | word[:, 3] << 24
    return ((word[:, None] >> torch.arange(32, device=qh.device)) & 1).to(torch.uint8)


def _blocks(b: torch.Tensor, type_size: int) -> torch.Tensor:
    return b.view(-1, type_size)


def _q8_0(b):
    x = _blocks(b, 34)
    return x[:, 2:].view(torch.int8).float() * _f16(x[:, :2])


def _q4_0(b):
    x = _blocks(b, 18)
    return _f16(x[:, :2]) * (_nibbles(x[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b):
    x = _blocks(b, 20)
    return _f16(x[:, :2]) * _nibbles(x[:, 4:]).float() + _f16(x[:, 2:4])


def _q5_0(b):
    x = _blocks(b, 22)
    q = (_nibbles(x[:, 6:]) | (_high_bits(x[:, 2:6]) << 4)).to(torch.int8) - 16
    return _f16(x[:, :2]) * q.float()


def _q5_1(b):
    x = _blocks(b, 24)
    q = _nibbles(x[:, 8:]) | (_high_bits(x[:, 4:8]) << 4)
    return _f16(x[:, :2]) * q.float() + _f16(x[:, 2:4])


def _shifted(x: torch.Tensor, shifts: tuple[int, ...], dim: int) -> torch.Tensor:
    """x >> s for each s, stacked at `dim` (gguf-py's broadcast shift by an array of shifts)."""
    return torch.stack([x >> s for s in shifts], dim=dim)


def _q2_k(b):
    x = _blocks(b, 84)
    n = x.shape[0]
    scales, qs, d, dmin = x[:, :16], x[:, 16:80], _f16(x[:, 80:82]), _f16(x[:, 82:84])
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (_shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 2) & 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b):
    x = _blocks(b, 110)
    n = x.shape[0]
    hmask, qs, scales, d = x[:, :32], x[:, 32:96], x[:, 96:108], _f16(x[:, 108:110])
    low = _shifted(scales[:, :8], (0, 4), 1).reshape(n, 16)
    high = _shifted(scales[:, 8:], (0, 2, 4, 6), 1).reshape(n, 16)
    sc = (((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32).float()
    dl = (d * sc).reshape(n, 16, 1)
    ql = _shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 2).reshape(n, 16, 16) & 3
    qh = (_shifted(hmask.reshape(n, 1, 32), tuple(range(8)), 2).reshape(n, 16, 16) & 1) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, 256)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (gguf-py's Q4_K.get_scale_min)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_multipliers(x):
    """Q4_K/Q5_K super-blocks x [n, bytes]: (n, each sub-block's scale d * sc and min dmin * m, [n, 8, 1])."""
    n = x.shape[0]
    sc, mn = _k_scales(x[:, 4:16])
    return n, (_f16(x[:, 0:2]) * sc.float()).reshape(n, -1, 1), (_f16(x[:, 2:4]) * mn.float()).reshape(n, -1, 1)


def _q4_k(b):
    x = _blocks(b, 144)
    n, d, dm = _k_multipliers(x)
    q = (_shifted(x[:, 16:].reshape(n, 4, 32), (0, 4), 2) & 0x0F).reshape(n, -1, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b):
    x = _blocks(b, 176)
    n, d, dm = _k_multipliers(x)
    ql = (_shifted(x[:, 48:].reshape(n, 4, 32), (0, 4), 2) & 0x0F).reshape(n, -1, 32)
    qh = (_shifted(x[:, 16:48].reshape(n, 1, 32), tuple(range(8)), 2) & 1).reshape(n, -1, 32)
    q = (ql | (qh << 4)).float()
    return (d * q - dm).reshape(n, 256)


def _q6_k(b):
    x = _blocks(b, 210)
    n = x.shape[0]
    d = (_f16(x[:, 208:210]) * x[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    ql = (_shifted(x[:, :128].reshape(n, 2, 64), (0, 4), 2) & 0x0F).reshape(n, -1, 32)
    qh = (_shifted(x[:, 128:192].reshape(n, 2, 32), (0, 2, 4, 6), 2) & 3).reshape(n, -1, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, -1).float()
    return (d * q).reshape(n, 256)


TORCH_DECODERS = {
    "F32": lambda b: b.view(torch.float32),
    "F16": lambda b: b.view(torch.float16).float(),
    "BF16": lambda b: b.view(torch.bfloat16).float(),
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def field_value(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


# -- name mapping -------------------------------------------------------------------------------------------------
# the llama-family HF convention our archs share: the leaf module names and the module they sit in
_HF_LEAVES = {"embed_tokens", "norm", "lm_head", "input_layernorm", "post_attention_layernorm", "q_proj", "k_proj",
              "v_proj", "o_proj", "q_norm", "k_norm", "gate_proj", "up_proj", "down_proj", "gate", "shared_expert_gate"}
_HF_PARENTS = re.compile(r"^(model|lm_head|model\.layers\.\d+(\.(self_attn|mlp|mlp\.experts|mlp\.shared_expert))?)$")


def _hf_style(name: str) -> bool:
    parent, _, leaf = name.rpartition(".")
    return (leaf or parent) in _HF_LEAVES and (not parent or bool(_HF_PARENTS.match(parent)))


@lru_cache(maxsize=None)
def gguf_to_hf_names(arch: str, n_blocks: int) -> dict[str, str]:
    """llama.cpp base name (no .weight/.bias) -> HF module name, by inverting gguf-py's TensorNameMap."""
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, n_blocks)
    candidates: dict[str, list[str]] = {}
    for hf, (_, gg) in name_map.mapping.items():
        candidates.setdefault(gg, []).append(hf)
    out = {}
    for gg, hfs in candidates.items():
        ok = [h for h in hfs if (h.startswith("model.") or h.startswith("lm_head")) and "layers.layers" not in h
              and "_no_perm" not in h]
        if not ok:
            continue
        styled = [h for h in ok if _hf_style(h)]
        out[gg] = (styled or ok)[0]
    return out


def _split_suffix(name: str) -> tuple[str, str]:
    if name.endswith(".weight") or name.endswith(".bias"):
        base, suffix = name.rsplit(".", 1)
        return base, "." + suffix
    return name, ""


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's LlamaModel.permute: rows grouped (head, pair, 2) back to HF's (head, 2, half)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute (HF -> GGUF row order)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# -- config -------------------------------------------------------------------------------------------------------
def recover_config(reader, arch: str, tensor_names: set[str], path: Path) -> dict:
    """An HF config.json dict from GGUF metadata (llama-family architectures)."""
    def meta(key, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    def need(key):
        v = meta(key)
        if v is None:
            raise PackError(f"GGUF metadata lacks {arch}.{key}", file=path)
        return v

    model_type, hf_arch = ARCHITECTURES[arch]
    name = str(field_value(reader, "general.name", "") or "")
    if arch == "llama" and "mistral" in name.lower():
        model_type, hf_arch = MISTRAL
    hidden = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_kv = meta("attention.head_count_kv", n_head)
    head_dim = meta("attention.key_length") or meta("rope.dimension_count") or hidden // n_head
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta("vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        embd = [t for t in reader.tensors if t.name == "token_embd.weight"]
        if not embd:
            raise PackError(f"cannot tell the vocabulary size: no {arch}.vocab_size, tokenizer or token_embd.weight",
                            file=path)
        vocab = int(embd[0].shape[1])
    cfg = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(n_kv),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        # GGUF stores float32; the exact float32 value, as llama.cpp and transformers' GGUF loader use it
        "rms_norm_eps": float(np.float32(need("attention.layer_norm_rms_epsilon"))),
        "rope_theta": float(np.float32(meta("rope.freq_base", 10000.0))),
        "rope_scaling": _rope_scaling(meta),
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        v = field_value(reader, f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[hf_key] = int(v)
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    if model_type == "mistral":
        cfg["sliding_window"] = None
    if model_type == "qwen3_moe":
        cfg.update(num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                   moe_intermediate_size=int(need("expert_feed_forward_length")),
                   norm_topk_prob=True,  # llama.cpp's qwen3moe graph always renormalises the top-k weights
                   decoder_sparse_step=1, mlp_only_layers=[])
    return cfg


# (low_freq_factor, high_freq_factor, original_max_position_embeddings) of the Llama 3.x releases
_LLAMA3_ROPE_CANDIDATES = [(1.0, 4.0, 8192)]


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """The per-frequency factors llama.cpp's converter stores as rope_freqs.weight for rope_type "llama3"."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    wavelen = 2 * np.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid)).astype(np.float32)


def recover_llama3_scaling(factors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict:
    """rope_freqs.weight -> HF rope_scaling, accepted only when it reproduces the stored factors."""
    factor = float(factors.max())
    for low, high, orig in _LLAMA3_ROPE_CANDIDATES:
        if np.allclose(llama3_rope_factors(theta, head_dim, factor, low, high, orig), factors, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": orig}
    raise PackError("rope_freqs.weight matches no llama3 rope_scaling we can name; refusing to guess RoPE",
                    file=path, tensor="rope_freqs.weight")


def _rope_scaling(meta) -> dict | None:
    kind = meta("rope.scaling.type")
    factor = meta("rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None
    out = {"rope_type": str(kind), "factor": float(np.float32(factor))}
    orig = meta("rope.scaling.original_context_length")
    if orig:
        out["original_max_position_embeddings"] = int(orig)
    return out


# -- the pack -----------------------------------------------------------------------------------------------------
class GGUFPack(Pack):
    """A single .gguf file. Tensors are decoded on request from the memory map."""

    format = "gguf"

    def __init__(self, path: str | Path, settings: PackSettings = PackSettings()):
        super().__init__(path, settings)
        try:
            self.reader = GGUFFile(self.path)
        except Exception as e:  # ValueError names what is malformed; numpy/OS errors on unreadable files
            raise PackError(
                f"cannot read GGUF file ({type(e).__name__}: {e}); truncated or corrupt?", file=self.path
            ) from None
        r = self.reader
        self.arch = str(field_value(r, "general.architecture", ""))
        if self.arch not in ARCHITECTURES:
            raise PackError(f"unsupported GGUF architecture {self.arch!r}; supported: {sorted(ARCHITECTURES)}",
                            file=self.path)
        self.gguf_tensors = {t.name: t for t in r.tensors}
        self.config = recover_config(r, self.arch, set(self.gguf_tensors), self.path)
        if "rope_freqs.weight" in self.gguf_tensors:  # Llama 3.x RoPE scaling lives in a tensor, not in metadata
            factors = np.asarray(self.gguf_tensors["rope_freqs.weight"].data, dtype=np.float32)
            self.config["rope_scaling"] = recover_llama3_scaling(factors, self.config["rope_theta"],
                                                                 self.config["head_dim"], self.path)
        self.metadata_chat_template = field_value(r, "tokenizer.chat_template")
        ok_types = supported_types()
        file_size = self.path.stat().st_size
        names = gguf_to_hf_names(self.arch, self.config["num_hidden_layers"])
        self.skipped: list[str] = []  # GGUF tensors that are no model parameter (e.g. rope_freqs)
        for t in r.tensors:
            if t.name in NON_PARAMETER_TENSORS:
                self.skipped.append(t.name)
                continue
            base, suffix = _split_suffix(t.name)
            hf_base = names.get(base)
            if hf_base is None:
                raise PackError(f"no Hugging Face name for GGUF tensor of architecture {self.arch!r}",
                                file=self.path, tensor=t.name)
            if t.tensor_type.name not in ok_types:
                raise PackError(
                    f"GGUF tensor type {t.tensor_type.name} is not supported (gguf-py cannot dequantize it; "
                    f"supported: {sorted(ok_types)})",
                    file=self.path,
                    tensor=t.name,
                )
            self._check_extent(t, file_size)
            if base.endswith("_exps"):  # stacked experts [E, out, in] -> one HF tensor per expert
                stem, proj = hf_base.rsplit(".", 1)
                for e in range(int(t.shape[-1])):
                    self._add(f"{stem}.{e}.{proj}{suffix}", t, expert=e)
            else:
                self._add(hf_base + suffix, t)

    def _check_extent(self, t, size: int):
        if t.data_offset + t.n_bytes > size:
            raise PackError(f"tensor data runs past the end of the file ({t.data_offset + t.n_bytes} > {size} bytes); "
                            "truncated?", file=self.path, tensor=t.name)

    def _add(self, name: str, t, expert: int | None = None):
        block = gguf.GGML_QUANT_SIZES[t.tensor_type][0]
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        nbytes = int(t.n_bytes)
        if expert is not None:
            shape = shape[1:]
            nbytes //= int(t.shape[-1])
        storage = Storage(name, "gguf", t.tensor_type.name, shape, nbytes, block=(block,) if block > 1 else None,
                          files=(str(self.path),), raw=(t.name,))
        self._entries[name] = LogicalTensor(storage, lambda device: self._decode(t, name, shape, expert, device),
                                            on_device=True)

    def _decode(self, t, name: str, shape: tuple[int, ...], expert: int | None, device: torch.device) -> torch.Tensor:
        data = t.data if expert is None else t.data[expert]
        kind = t.tensor_type.name
        if device.type != "cpu" and kind in TORCH_DECODERS:   # the stored bytes travel, torch decodes them there
            w = TORCH_DECODERS[kind](to_device(stored_bytes(data), device)).reshape(shape)
        else:
            try:
                values = gguf.quants.dequantize(data, t.tensor_type)
            except Exception as e:
                raise PackError(f"gguf-py could not dequantize {kind}: {e}", file=self.path, tensor=name) from None
            w = torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(shape).to(device)
        if self.arch in PERMUTED_QK_ARCHS and ".attn_q." in t.name:
            w = unpermute_qk(w, self.config["num_attention_heads"])
        elif self.arch in PERMUTED_QK_ARCHS and ".attn_k." in t.name:
            w = unpermute_qk(w, self.config["num_key_value_heads"])
        return w

    def tokenizer_source(self) -> Path | None:
        return self.path if "tokenizer.ggml.tokens" in self.reader.fields else None
