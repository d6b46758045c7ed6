"""Llama-style dense decoders: Llama, Mistral, Qwen2, Qwen3 (per-head q/k RMSNorm). GQA, RoPE, optional biases and
sliding windows, tied or untied head."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F

from ..registry import ARCHITECTURES
from .common import (ATTENTION_CHUNK_BYTES, Family, Fetch, GatedMLP, fetch_tensors, fetched, head_dim_of, mask_bias,
                     require, rms_norm, softmax_scale, tensor_names)
from .rope import RopeArgs, cos_sin


# Attention runs in blocks of query positions; a block scores only the keys up to its last query, so more blocks skip
# more of the causally masked half of the score matrix, but every block is five more ops (kernel launches on CUDA,
# parallel regions on CPU). A row is split into at most QUERY_BLOCKS blocks of at least MIN_QUERY_BLOCK positions.
# SmolLM2 rows of 256, one CPU thread: attention 4.9 ms per layer in blocks of 32, 5.1 (64), 6.7 (128), 10.2 (256).
QUERY_BLOCKS = 4
MIN_QUERY_BLOCK = 32


@dataclass
class AttentionArgs:
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False          # Qwen3: RMSNorm over each head's dims, before RoPE
    rope: RopeArgs = None


def sliding_windows(cfg: dict, arch: str, n_layers: int) -> list[int | None]:
    """Per-layer window, following each HF config class's rule."""
    window = cfg.get("sliding_window")
    if arch.startswith(("Qwen2", "Qwen3")):
        if not cfg.get("use_sliding_window", False):
            return [None] * n_layers
        types = cfg.get("layer_types")
        if types is None:
            start = cfg.get("max_window_layers", n_layers)
            types = [
                "sliding_attention" if window is not None and i >= start else "full_attention" for i in range(n_layers)
            ]
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * n_layers


@dataclass
class LlamaArgs:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    attention: AttentionArgs
    rms_norm_eps: float
    hidden_act: str = "silu"
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    windows: list = field(default_factory=list)

    @classmethod
    def from_config(cls, cfg: dict) -> "LlamaArgs":
        arch = cfg["architectures"][0]
        require(cfg, "num_attention_heads", arch)  # checked first, as before the other keys
        head_dim_of(cfg)
        bias = bool(cfg.get("attention_bias", False))
        qkv_bias, o_bias = {"Qwen2ForCausalLM": (True, False), "MistralForCausalLM": (False, False)}.get(
            arch, (bias, bias)
        )
        n_layers = require(cfg, "num_hidden_layers", arch)
        return cls(
            arch=arch,
            vocab_size=require(cfg, "vocab_size", arch),
            hidden_size=require(cfg, "hidden_size", arch),
            intermediate_size=require(cfg, "intermediate_size", arch),
            n_layers=n_layers,
            attention=attention_args(cfg, arch, qkv_bias=qkv_bias, o_bias=o_bias,
                                     qk_norm=arch.startswith("Qwen3")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            hidden_act=cfg.get("hidden_act", "silu"),
            mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            windows=sliding_windows(cfg, arch, n_layers),
        )


def attention_args(cfg: dict, arch: str, *, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> AttentionArgs:
    n_heads = require(cfg, "num_attention_heads", arch)
    head_dim = head_dim_of(cfg)
    return AttentionArgs(
        hidden_size=require(cfg, "hidden_size", arch),
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm,
        rope=RopeArgs.from_config(cfg, head_dim),
    )


class Attention:
    """GQA self-attention with RoPE; q, k, v projections fused into one matmul."""

    def __init__(self, a: AttentionArgs, prefix: str, fetch: Fetch, window: int | None):
        self.a, self.window = a, window
        self.qkv_bias = self.o_bias = None
        fetch_tensors(self, self.tensors(a, prefix), fetch)
        self.split = (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim)
        self.scale = softmax_scale(a.head_dim)

    @staticmethod
    def tensors(a: AttentionArgs, prefix: str) -> dict[str, str | list[str]]:
        qkv = [f"{prefix}.{p}_proj" for p in "qkv"]
        out = {"qkv": [f"{x}.weight" for x in qkv], "o": f"{prefix}.o_proj.weight"}
        if a.qkv_bias:
            out["qkv_bias"] = [f"{x}.bias" for x in qkv]
        if a.o_bias:
            out["o_bias"] = f"{prefix}.o_proj.bias"
        if a.qk_norm:
            out.update(q_norm=f"{prefix}.q_norm.weight", k_norm=f"{prefix}.k_norm.weight")
        return out

    @staticmethod
    def names(a: AttentionArgs, prefix: str) -> list[str]:
        return tensor_names(Attention.tensors(a, prefix))

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a = self.a
        B, T, _ = x.shape
        Hkv, group, D = a.n_kv_heads, a.n_heads // a.n_kv_heads, a.head_dim
        q, k, v = F.linear(x, self.qkv, self.qkv_bias).split(self.split, dim=-1)
        q = q.view(B, T, Hkv, group, D)
        k = k.view(B, T, Hkv, D)
        if a.qk_norm:
            q, k = rms_norm(q, self.q_norm, a.rms_norm_eps), rms_norm(k, self.k_norm, a.rms_norm_eps)
        # RoPE writes q and k straight into the head-major layouts the attention matmuls read, so no copies follow.
        queries = x.new_empty(B, Hkv, T, group, D)
        keys = x.new_empty(B, Hkv, T, D)
        cos, sin = rope
        rope_into(q, cos, sin, queries.transpose(1, 2))
        rope_into(k, cos, sin, keys.transpose(1, 2))
        values = v.view(B, T, Hkv, D).transpose(1, 2)
        out = grouped_causal_attention(queries, keys, values, self.scale, self.window)
        return F.linear(out, self.o, self.o_bias)


def rope_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE of x [B, T, *heads, dim] written into out (same shape, any strides). cos/sin [T, rotary]; dims
    past `rotary` pass through. Same multiplies and adds as HF (no FMA), so the result is HF's bit for bit."""
    rotary, half = cos.shape[-1], cos.shape[-1] // 2
    broadcast = (cos.shape[0],) + (1,) * (x.dim() - 3)
    cos, sin = cos.view(*broadcast, rotary), sin[:, :half].reshape(*broadcast, half)  # sin's two halves are equal
    turned, into = x[..., :rotary], out[..., :rotary]
    torch.mul(turned, cos, out=into)
    into[..., :half].sub_(turned[..., half:] * sin)
    into[..., half:].add_(turned[..., :half] * sin)
    if rotary < x.shape[-1]:
        out[..., rotary:] = x[..., rotary:]
    return out


def grouped_causal_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                             window: int | None = None) -> torch.Tensor:
    """Causal softmax attention, plain matmul + mask + softmax, with the query heads that share a KV head batched
    into one matmul against it (no repeated keys).

    queries [B, Hkv, T, group, D] contiguous, keys [B, Hkv, T, D], values [B, Hkv, T, Dv] -> [B, T, Hkv * group * Dv].
    A query block [start, end) scores only keys first..end-1 (causal, and the sliding window when set).
    """
    B, Hkv, T, group, D = queries.shape
    Dv = values.shape[-1]
    rows = queries.view(B * Hkv, T * group, D)             # rows ordered (position, head in group)
    keys_t = keys.reshape(B * Hkv, T, D).transpose(1, 2)    # [B*Hkv, D, T]
    values = values.reshape(B * Hkv, T, Dv)
    block = min(T, max(MIN_QUERY_BLOCK, -(-T // QUERY_BLOCKS)))
    block = max(1, min(block, ATTENTION_CHUNK_BYTES // max(B * Hkv * group * T * queries.element_size(), 1)))
    out = queries.new_empty(B, T, Hkv, group, Dv)
    unused = queries.new_zeros(())
    for start in range(0, T, block):
        end = min(T, start + block)
        first = 0 if window is None else max(0, start - window + 1)
        block_rows = rows[:, start * group:end * group]
        if window is None:
            # keys before `start` are all visible: only the diagonal block gets a mask (adding 0 changes nothing)
            scores = torch.baddbmm(unused, block_rows, keys_t[:, :, :end], beta=0, alpha=scale)
            scores[:, :, start:].add_(diagonal_mask(end - start, group, queries.dtype, queries.device))
        else:
            mask = grouped_mask(start, end, first, window, group, queries.dtype, queries.device)
            scores = torch.baddbmm(mask, block_rows, keys_t[:, :, first:end], alpha=scale)
        probs = torch.softmax(scores, dim=-1)
        context = torch.bmm(probs, values[:, first:end])
        out[:, start:end] = context.view(B, Hkv, end - start, group, Dv).transpose(1, 2)
    return out.view(B, T, Hkv * group * Dv)


@lru_cache(maxsize=64)
def grouped_mask(start: int, end: int, first: int, window: int | None, group: int, dtype, device) -> torch.Tensor:
    """mask_bias with rows ordered (position, head in group): each query position's row repeated `group` times."""
    return mask_bias(start, end, first, window, 1, dtype, device).repeat_interleave(group, dim=0)


@lru_cache(maxsize=16)
def diagonal_mask(n: int, group: int, dtype, device) -> torch.Tensor:
    """[n * group, n]: 0 on and below the diagonal, -inf above; rows ordered (position, head in group)."""
    return grouped_mask(0, n, 0, None, group, dtype, device)


class DecoderLayer:
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). `mlp` is any callable on [B, T, hidden]."""
    SUB_BLOCKS = {"attention": "attn", "mlp": "mlp"}   # role -> attribute (the noise floor perturbs by role)

    def __init__(self, attn, mlp, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float):
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm, self.eps = input_norm, post_norm, eps

    def __call__(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.attn(rms_norm(x, self.input_norm, self.eps), rope)
        return x.add_(self.mlp(rms_norm(x, self.post_norm, self.eps)))


def norm_tensors(prefix: str) -> dict[str, str]:
    """A decoder layer's two norms, as DecoderLayer's arguments."""
    return {"input_norm": f"{prefix}.input_layernorm.weight", "post_norm": f"{prefix}.post_attention_layernorm.weight"}


def norm_names(prefix: str) -> list[str]:
    return list(norm_tensors(prefix).values())


@ARCHITECTURES.register("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaFamily(Family):
    def __init__(self, config: dict):
        super().__init__(config)
        self.args = a = LlamaArgs.from_config(config)
        self.n_layers, self.hidden_size, self.vocab_size = a.n_layers, a.hidden_size, a.vocab_size
        self.rms_norm_eps, self.tie_word_embeddings = a.rms_norm_eps, a.tie_word_embeddings

    def layer_names(self, i: int) -> list[str]:
        p = f"model.layers.{i}"
        return norm_names(p) + Attention.names(self.args.attention, f"{p}.self_attn") + \
            GatedMLP.names(f"{p}.mlp", self.args.mlp_bias)

    def load_layer(self, i: int, fetch: Fetch) -> DecoderLayer:
        a, p = self.args, f"model.layers.{i}"
        return DecoderLayer(
            Attention(a.attention, f"{p}.self_attn", fetch, a.windows[i]),
            GatedMLP.load(f"{p}.mlp", fetch, a.hidden_act, a.mlp_bias), **fetched(norm_tensors(p), fetch),
            eps=a.rms_norm_eps)

    def rope_tables(self, length: int, dtype: torch.dtype, device):
        return cos_sin(self.args.attention.rope, length, dtype, device)
