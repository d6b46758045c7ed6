"""DeepSeek-V3: multi-head latent attention (optional q LoRA, kv LoRA, rope/nope split, interleaved RoPE, YaRN mscale)
and a sigmoid-routed MoE (selection bias, group-limited top-k, routed scaling, shared experts, first k layers dense)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...registry import ARCHITECTURES
from ..common import Family, Fetch, GatedMLP, causal_attention, fetch_tensors, fetched, require, rms_norm
from ..llama import DecoderLayer, norm_names, norm_tensors
from ..moe import RoutedExperts
from ..rope import RopeArgs, cos_sin, rotate_half_split, rotate_interleaved, yarn_mscale
from ..selection import top_k_indices, top_k_mask


@dataclass
class DeepseekV3Args:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    n_layers: int
    n_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    rope: RopeArgs
    rope_interleave: bool = True
    attention_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False

    @classmethod
    def from_config(cls, cfg: dict) -> "DeepseekV3Args":
        arch = "DeepseekV3ForCausalLM"
        rope_dim = require(cfg, "qk_rope_head_dim", arch)
        return cls(
            vocab_size=require(cfg, "vocab_size", arch),
            hidden_size=require(cfg, "hidden_size", arch),
            intermediate_size=require(cfg, "intermediate_size", arch),
            moe_intermediate_size=require(cfg, "moe_intermediate_size", arch),
            n_layers=require(cfg, "num_hidden_layers", arch),
            n_heads=require(cfg, "num_attention_heads", arch),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=require(cfg, "kv_lora_rank", arch),
            qk_nope_head_dim=require(cfg, "qk_nope_head_dim", arch),
            qk_rope_head_dim=rope_dim,
            v_head_dim=require(cfg, "v_head_dim", arch),
            n_routed_experts=require(cfg, "n_routed_experts", arch),
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            top_k=require(cfg, "num_experts_per_tok", arch),
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=cfg.get("first_k_dense_replace", 0) or 0,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeArgs.from_config(cfg, rope_dim),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            hidden_act=cfg.get("hidden_act", "silu"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @property
    def softmax_scale(self) -> float:
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale


# The q and kv latent norms use a fixed eps (DeepSeek's model.py and HF both build them without the config's eps).
LATENT_NORM_EPS = 1e-6


class MLA:
    """Multi-head latent attention, computed naively: expand the kv latent to per-head keys and values."""

    def __init__(self, a: DeepseekV3Args, prefix: str, fetch: Fetch):
        self.a = a
        self.q_a_bias = self.kv_a_bias = self.o_bias = None
        fetch_tensors(self, self.tensors(a, prefix), fetch)
        self.rotate = rotate_interleaved if a.rope_interleave else rotate_half_split

    @staticmethod
    def tensors(a: DeepseekV3Args, prefix: str) -> dict[str, str]:
        q = ({"q_a": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight", "q_b": "q_b_proj.weight"} if a.q_lora_rank
             else {"q": "q_proj.weight"})
        out = {**q, "kv_a": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight",
               "kv_b": "kv_b_proj.weight", "o": "o_proj.weight"}
        if a.attention_bias:
            out.update({"q_a_bias": "q_a_proj.bias"} if a.q_lora_rank else {})
            out.update(kv_a_bias="kv_a_proj_with_mqa.bias", o_bias="o_proj.bias")
        return {attr: f"{prefix}.{name}" for attr, name in out.items()}

    @staticmethod
    def names(a: DeepseekV3Args, prefix: str) -> list[str]:
        return list(MLA.tensors(a, prefix).values())

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v, _ = self.project(x, rope)
        out = causal_attention(q, k, v, self.a.softmax_scale)
        return self.output(out)

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """(q [B, T, H, Dqk], k [B, T, H, Dqk], v [B, T, H, Dv], q latent after its norm or None without q LoRA)."""
        a = self.a
        B, T, _ = x.shape
        q_latent = None
        if a.q_lora_rank:
            q_latent = rms_norm(F.linear(x, self.q_a, self.q_a_bias), self.q_a_norm, LATENT_NORM_EPS)
            q = F.linear(q_latent, self.q_b)
        else:
            q = F.linear(x, self.q)
        q = q.view(B, T, a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim)
        q_nope, q_rot = q.split((a.qk_nope_head_dim, a.qk_rope_head_dim), dim=-1)
        latent, k_rot = F.linear(x, self.kv_a, self.kv_a_bias).split((a.kv_lora_rank, a.qk_rope_head_dim), dim=-1)
        kv = F.linear(rms_norm(latent, self.kv_a_norm, LATENT_NORM_EPS), self.kv_b)
        k_nope, v = kv.view(B, T, a.n_heads, a.qk_nope_head_dim + a.v_head_dim).split(
            (a.qk_nope_head_dim, a.v_head_dim), dim=-1)
        cos, sin = rope
        q_rot = self.rotate(q_rot, cos, sin)
        k_rot = self.rotate(k_rot.view(B, T, 1, a.qk_rope_head_dim), cos, sin)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(B, T, a.n_heads, a.qk_rope_head_dim)), dim=-1)
        return q, k, v.contiguous(), q_latent

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [B, T, H, Dv] -> [B, T, hidden]."""
        return F.linear(out.reshape(*out.shape[:2], -1), self.o, self.o_bias)


def group_limited_top_k(scores: torch.Tensor, selection_bias: torch.Tensor, a: DeepseekV3Args) -> torch.Tensor:
    """Expert indices [N, k]: biased scores choose; only experts of the topk_group best groups (a group's score is the
    sum of its two best biased scores) compete; the others are excluded with -inf."""
    biased = scores + selection_bias
    N = biased.shape[0]
    per_group = biased.view(N, a.n_group, -1)
    group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)
    keep = top_k_mask(group_scores, a.topk_group)
    biased = per_group.masked_fill(~keep[:, :, None], float("-inf")).view(N, -1)
    return top_k_indices(biased, a.top_k)


class SigmoidMoE:
    def __init__(self, a: DeepseekV3Args, prefix: str, fetch: Fetch, experts: RoutedExperts):
        self.a, self.experts = a, experts
        fetch_tensors(self, self.tensors(prefix), fetch)
        self.shared = GatedMLP.load(f"{prefix}.shared_experts", fetch, a.hidden_act) if a.n_shared_experts else None

    @staticmethod
    def tensors(prefix: str) -> dict[str, str]:
        """The router's (the experts' are the family's expert_names, the shared expert's GatedMLP's)."""
        return {"router": f"{prefix}.gate.weight", "selection_bias": f"{prefix}.gate.e_score_correction_bias"}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        flat = x.reshape(-1, x.shape[-1])
        scores = torch.sigmoid(F.linear(flat, self.router))
        indices = group_limited_top_k(scores, self.selection_bias, a)
        weights = scores.gather(1, indices)  # the bias picks experts but never weighs them
        if a.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * a.routed_scaling_factor
        out = self.experts(flat, indices, weights).view_as(x)
        return out + self.shared(x) if self.shared is not None else out


@ARCHITECTURES.register("DeepseekV3ForCausalLM")
class DeepseekV3Family(Family):
    def __init__(self, config: dict):
        super().__init__(config)
        self.args = a = DeepseekV3Args.from_config(config)
        self.n_layers, self.hidden_size, self.vocab_size = a.n_layers, a.hidden_size, a.vocab_size
        self.rms_norm_eps, self.tie_word_embeddings = a.rms_norm_eps, a.tie_word_embeddings

    def is_moe(self, i: int) -> bool:
        return i >= self.args.first_k_dense_replace

    @staticmethod
    def expert_names(i: int, e: int) -> tuple[str, str, str]:
        return GatedMLP.modules(f"model.layers.{i}.mlp.experts.{e}")

    def layer_names(self, i: int) -> list[str]:
        p = f"model.layers.{i}"
        names = norm_names(p) + MLA.names(self.args, f"{p}.self_attn")
        if not self.is_moe(i):
            return names + GatedMLP.names(f"{p}.mlp")
        names += list(SigmoidMoE.tensors(f"{p}.mlp").values())
        if self.args.n_shared_experts:
            names += GatedMLP.names(f"{p}.mlp.shared_experts")
        for e in range(self.args.n_routed_experts):
            names += [f"{m}.weight" for m in self.expert_names(i, e)]
        return names

    def load_attention(self, i: int, fetch: Fetch) -> MLA:
        return MLA(self.args, f"model.layers.{i}.self_attn", fetch)

    def load_mlp(self, i: int, fetch: Fetch) -> SigmoidMoE | GatedMLP:
        a, p = self.args, f"model.layers.{i}.mlp"
        if not self.is_moe(i):
            return GatedMLP.load(p, fetch, a.hidden_act)
        experts = RoutedExperts(a.n_routed_experts, lambda e: self.expert_names(i, e), fetch, a.hidden_act)
        return SigmoidMoE(a, p, fetch, experts)

    def load_layer(self, i: int, fetch: Fetch) -> DecoderLayer:
        p = f"model.layers.{i}"
        mlp = self.load_mlp(i, fetch)  # before the attention: the order tensors are fetched in stays as it was
        return DecoderLayer(self.load_attention(i, fetch), mlp, **fetched(norm_tensors(p), fetch),
                            eps=self.args.rms_norm_eps)

    def rope_tables(self, length: int, dtype: torch.dtype, device):
        return cos_sin(self.args.rope, length, dtype, device)
