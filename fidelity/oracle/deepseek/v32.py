"""DeepSeek-V3.2: DeepSeek-V3 (MLA, sigmoid group-limited MoE) plus DeepSeek Sparse Attention. Every attention layer has
a lightning indexer that scores each query against every earlier token and keeps the `index_topk` best; the MLA then
attends only to those (and never to the future). With a context of at most `index_topk` tokens every earlier token is
kept, so the layer is plain causal MLA and the indexer is not computed.

The reference kernels score in FP8 after a Hadamard rotation; the rotation preserves dot products and the oracle scores
in fp32, as transformers does. Ties in the indexer's top-k (equal scores: an index of exactly 0 where every head's relu
is 0) go to the earlier token (selection.top_k_mask), on every device; transformers leaves them to `torch.topk`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...registry import ARCHITECTURES
from ..common import ATTENTION_CHUNK_BYTES, Fetch, fetch_tensors, require
from ..rope import rotate_half_split
from ..selection import top_k_mask
from .v3 import MLA, DeepseekV3Args, DeepseekV3Family

ARCH = "DeepseekV32ForCausalLM"
# The indexer's key LayerNorm has a fixed eps (DeepSeek's model.py and transformers both hard-code it).
INDEXER_NORM_EPS = 1e-6


@dataclass
class IndexerArgs:
    n_heads: int
    head_dim: int
    topk: int
    rope_dim: int

    @classmethod
    def from_config(cls, cfg: dict) -> "IndexerArgs":
        a = cls(n_heads=require(cfg, "index_n_heads", ARCH), head_dim=require(cfg, "index_head_dim", ARCH),
                topk=require(cfg, "index_topk", ARCH), rope_dim=require(cfg, "qk_rope_head_dim", ARCH))
        if a.rope_dim > a.head_dim or a.topk < 1:
            raise ConfigError(f"config.json of {ARCH}: index_head_dim {a.head_dim} must be >= qk_rope_head_dim "
                              f"{a.rope_dim} and index_topk {a.topk} >= 1")
        return a


def query_chunk(B: int, T: int, per_key_values: int) -> int:
    """Queries per chunk so that one chunk's [B, n, T, per_key_values] scores stay within ATTENTION_CHUNK_BYTES."""
    return max(1, min(T, ATTENTION_CHUNK_BYTES // max(B * T * per_key_values * 4, 1)))


class LightningIndexer:
    """index[s, t] = sum_h w_h(x_s) * relu(scale * q_h(s) . k(t)), with q from the MLA's normed q latent, k a
    LayerNorm'd single head; both get half-split RoPE on their first `rope_dim` dims (the MLA itself is interleaved)."""

    def __init__(self, a: IndexerArgs, prefix: str, fetch: Fetch):
        self.a = a
        fetch_tensors(self, self.tensors(prefix), fetch)
        self.scale = a.head_dim ** -0.5

    @staticmethod
    def tensors(prefix: str) -> dict[str, str]:
        return {attr: f"{prefix}.{name}" for attr, name in (
            ("wq_b", "wq_b.weight"), ("wk", "wk.weight"), ("k_norm", "k_norm.weight"), ("k_norm_bias", "k_norm.bias"),
            ("weights_proj", "weights_proj.weight"))}

    @staticmethod
    def names(prefix: str) -> list[str]:
        return list(LightningIndexer.tensors(prefix).values())

    def keys_and_queries(self, x: torch.Tensor, q_latent: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
        a = self.a
        B, T, _ = x.shape
        cos, sin = rope
        q = F.linear(q_latent, self.wq_b).view(B, T, a.n_heads, a.head_dim)
        k = F.layer_norm(F.linear(x, self.wk), (a.head_dim,), self.k_norm, self.k_norm_bias, INDEXER_NORM_EPS)
        q = torch.cat((rotate_half_split(q[..., :a.rope_dim], cos, sin), q[..., a.rope_dim:]), dim=-1)
        k = k.view(B, T, 1, a.head_dim)
        k = torch.cat((rotate_half_split(k[..., :a.rope_dim], cos, sin), k[..., a.rope_dim:]), dim=-1)[:, :, 0]
        head_weights = F.linear(x, self.weights_proj) * a.n_heads ** -0.5
        return q, k, head_weights

    def selected(self, x: torch.Tensor, q_latent: torch.Tensor, rope) -> torch.Tensor:
        """Bool [B, T, T]: key t is kept for query s (causal and among s's top-k)."""
        B, T, _ = x.shape
        q, k, head_weights = self.keys_and_queries(x, q_latent, rope)
        keep = torch.zeros(B, T, T, dtype=torch.bool, device=x.device)
        chunk = query_chunk(B, T, self.a.n_heads)
        for start in range(0, T, chunk):
            end = min(T, start + chunk)
            scores = torch.einsum("bshd,btd->bsht", q[:, start:end], k).mul_(self.scale).relu_()
            index = torch.einsum("bsh,bsht->bst", head_weights[:, start:end], scores)
            future = torch.arange(T, device=x.device)[None, :] > torch.arange(start, end, device=x.device)[:, None]
            keep[:, start:end] = top_k_mask(index.masked_fill(future, float("-inf")), self.a.topk)
        return keep


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     keep: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the keys `keep` [B, T, T] allows per query; q, k [B, T, H, D], v [B, T, H, Dv]."""
    B, T, H, _ = q.shape
    out = q.new_empty(B, T, H, v.shape[-1])
    chunk = query_chunk(B, T, H)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        scores = torch.einsum("bshd,bthd->bhst", q[:, start:end], k).mul_(scale)
        scores.masked_fill_(~keep[:, None, start:end], float("-inf"))
        out[:, start:end] = torch.einsum("bhst,bthd->bshd", torch.softmax(scores, dim=-1), v)
    return out


class IndexedMLA(MLA):
    """MLA whose keys are limited, per query, to the lightning indexer's top-k."""

    def __init__(self, a: DeepseekV3Args, index: IndexerArgs, prefix: str, fetch: Fetch, indexer_prefix: str):
        super().__init__(a, prefix, fetch)
        self.index = index
        self.indexer = LightningIndexer(index, indexer_prefix, fetch)

    def __call__(self, x: torch.Tensor, rope) -> torch.Tensor:
        if x.shape[1] <= self.index.topk:  # every earlier token is selected: dense causal MLA
            return super().__call__(x, rope)
        q, k, v, q_latent = self.project(x, rope)
        keep = self.indexer.selected(x, q_latent, rope)
        return self.output(masked_attention(q, k, v, self.a.softmax_scale, keep))


@ARCHITECTURES.register("DeepseekV32ForCausalLM")
class DeepseekV32Family(DeepseekV3Family):
    def __init__(self, config: dict):
        super().__init__(config)
        if not self.args.q_lora_rank:
            raise ConfigError(f"config.json of {ARCH} has no q_lora_rank (the indexer reads the q latent)")
        self.index = IndexerArgs.from_config(config)
        n = self.args.n_layers
        dense = self.args.first_k_dense_replace
        self.mlp_types = list(
            config.get("mlp_layer_types") or ["dense"] * min(dense, n) + ["sparse"] * max(0, n - dense)
        )
        if len(self.mlp_types) != n or set(self.mlp_types) - {"dense", "sparse"}:
            raise ConfigError(f"config.json of {ARCH}: mlp_layer_types must list 'dense'/'sparse' for each of the "
                              f"{n} layers, got {self.mlp_types}")

    def is_moe(self, i: int) -> bool:
        return self.mlp_types[i] == "sparse"

    def resolve_names(self, available) -> None:
        """Indexer tensors under DeepSeek's official names (`layers.L.attn.indexer.*`, which the EXL3 layouts leave
        unmapped) are used where the Hugging Face ones are absent."""
        have = set(available)
        self.indexer_prefix = {}
        for i in range(self.n_layers):
            official = f"layers.{i}.attn.indexer"
            hf_present = any(n in have for n in LightningIndexer.names(f"model.layers.{i}.self_attn.indexer"))
            if not hf_present and any(n in have for n in LightningIndexer.names(official)):
                self.indexer_prefix[i] = official

    def indexer_of(self, i: int) -> str:
        return getattr(self, "indexer_prefix", {}).get(i, f"model.layers.{i}.self_attn.indexer")

    def layer_names(self, i: int) -> list[str]:
        return super().layer_names(i) + LightningIndexer.names(self.indexer_of(i))

    def load_attention(self, i: int, fetch: Fetch) -> IndexedMLA:
        return IndexedMLA(self.args, self.index, f"model.layers.{i}.self_attn", fetch, self.indexer_of(i))
