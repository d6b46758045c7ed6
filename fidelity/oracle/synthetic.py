"""Synthetic models: a Llama pack whose weights are generated on request (seeded by tensor name) and never stored
anywhere (a model of any size for memory tests and benchmarks, with no file pages muddying RSS), and the random init
that tests and miniature packs give tiny transformers models."""
from __future__ import annotations

import math
import zlib
from pathlib import Path

import torch

from ..packs.base import LogicalTensor, Pack, Storage



def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Every floating parameter and buffer random, norms and biases included (a misused weight cannot hide behind
    transformers' ones/zeros init), at scales that give O(1) activations and well-spread logits (the default 0.02 init
    gives near-uniform outputs and KL ~ 0); hash-routing tables (`tid2eid`) get distinct random experts per token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("scale"):            # hyper-connection scales: O(1) so pre/post/comb really vary
                p.copy_(1.0 + 0.5 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
        for module in model.modules():
            table = getattr(module, "tid2eid", None)
            if isinstance(table, torch.Tensor):
                n_experts = model.config.n_routed_experts
                table.copy_(torch.stack([torch.randperm(n_experts, generator=g)[:table.shape[1]]
                                         for _ in range(table.shape[0])]))

def llama_config(hidden_size: int, intermediate_size: int, n_layers: int, vocab_size: int, n_heads: int,
                 n_kv_heads: int, tie_word_embeddings: bool = False) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": tie_word_embeddings,
        "hidden_act": "silu",
    }


def llama_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    H, inner, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
            f"{p}.self_attn.q_proj.weight": (q, H), f"{p}.self_attn.k_proj.weight": (kv, H),
            f"{p}.self_attn.v_proj.weight": (kv, H), f"{p}.self_attn.o_proj.weight": (H, q),
            f"{p}.mlp.gate_proj.weight": (inner, H), f"{p}.mlp.up_proj.weight": (inner, H),
            f"{p}.mlp.down_proj.weight": (H, inner),
        })
    return shapes


class SyntheticPack(Pack):
    """Llama-shaped pack of random fp32 weights; the same name always decodes to the same values."""

    format = "synthetic"

    def __init__(self, config: dict, seed: int = 0):
        super().__init__(Path("<synthetic>"))
        self.config = config
        for name, shape in llama_shapes(config).items():
            self._entries[name] = LogicalTensor(
                Storage(name, "fp32", "F32", shape, 4 * math.prod(shape)),
                lambda name=name, shape=shape: self._generate(name, shape, seed))

    @staticmethod
    def _generate(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        x = torch.randn(shape, generator=g)
        if len(shape) == 1:
            return x.mul_(0.1).add_(1.0)
        return x if "embed" in name else x.div_(math.sqrt(shape[1]))  # in place: no second copy

    def layer_bytes(self, i: int) -> int:
        prefix = f"model.layers.{i}."
        return sum(self.storage(n).nbytes for n in self.names() if n.startswith(prefix))

    def total_bytes(self) -> int:
        return sum(self.storage(n).nbytes for n in self.names())
