"""DeepSeek-V4, as transformers' `models/deepseek_v4` computes it (fp32, full-sequence prefill, no cache):

- shared-KV multi-query attention: one KV head (`wkv`) read as both key and value, head_dim 512 in the real models;
  q through a LoRA (`wq_a`, `q_norm`, `wq_b`) and a weightless per-head RMSNorm; partial RoPE on each head's *trailing*
  `qk_rope_head_dim` dims in DeepSeek's interleaved pairs; the output's rope slice is rotated back (position -t);
- per layer, a sliding window (`sliding_window` keys) plus, for compressing layers, entries that pool `ratio` tokens
  each: `compressed_sparse_attention` (CSA: overlapping windows, a lightning indexer keeps `index_topk` entries per
  query) or `heavily_compressed_attention` (HCA: non-overlapping windows, all finished entries visible);
- a learned attention sink per head (a logit that joins the softmax and is then dropped);
- grouped low-rank output: heads in `o_groups` groups, each projected to `o_lora_rank` (`wo_a`), then `wo_b`;
- manifold-constrained hyper-connections: the residual is `hc_mult` streams [B, T, hc, hidden]; before each block a
  small map gives pre (collapse), post (expand) and comb (stream mixing, Sinkhorn-normalised) weights; `hc_head`
  collapses the streams before the final norm;
- MoE on every layer: sqrt(softplus) router scores, a bias that only picks experts, weights renormalised then scaled;
  the first layers route by a frozen token->experts table (`tid2eid`); SwiGLU with clamped gate/up (`swiglu_limit`)
  in routed and shared experts.

Tensor names are DeepSeek's official ones (`layers.L.attn.wq_a.weight`, `layers.L.ffn.experts.E.w1.weight`,
`layers.L.hc_attn_fn`, `hc_head_fn`, `embed.weight`, `head.weight`...). A pack may store them with a `model.` prefix,
with the names transformers' `save_pretrained` writes, or with the Hugging Face names the EXL3 layouts map official
ones to; `resolve_names` finds whichever is there.

This module is V4's architecture: its args from config.json, its layer and its family. The ops above (attention,
compressor, indexer, hyper-connections, MoE, RoPE) are dsv4_ops.py, shared with V4.1 (v41.py) and the drafters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...registry import ARCHITECTURES
from ..common import Family, Fetch, require, rms_norm
from ..rope import RopeArgs
from .dsv4_ops import (CSA, HCA, ROUTER_SCORES, SLIDING, Attention, HyperConnection, LayerLoad, MoE, block_input_names,
                       fetch_block_inputs, hc_names, rope_table, unweighted_rms_norm)
from .quant import DeepSeekRounding, rounds_stored_input
from ...packs.exl3.layouts import official_to_hf

ARCH = "DeepseekV4ForCausalLM"
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
DEFAULT_HASH_LAYERS = 3  # transformers' default when a config states neither mlp_layer_types nor num_hash_layers


# ---------------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class DeepseekV4Args:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: list
    ratios: list                  # per layer: 0 (sliding only) or tokens pooled per compressed entry
    hash_layers: list             # per layer: True when experts are chosen by tid2eid
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    top_k: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float | None
    scoring_func: str
    rms_norm_eps: float
    main_rope: RopeArgs
    compress_rope: RopeArgs
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False

    @classmethod
    def from_config(cls, cfg: dict, arch: str = ARCH) -> "DeepseekV4Args":
        n = require(cfg, "num_hidden_layers", arch)
        head_dim = require(cfg, "head_dim", arch)
        types, ratios = layer_schedule(cfg, n, arch)
        partial = cfg.get("partial_rotary_factor")
        rope_dim = int(head_dim * partial) if partial else cfg.get("qk_rope_head_dim") or head_dim // 8
        main, compress = rope_parameters(cfg, rope_dim / head_dim)
        mpe = cfg.get("max_position_embeddings")
        a = cls(
            vocab_size=require(cfg, "vocab_size", arch),
            hidden_size=require(cfg, "hidden_size", arch),
            n_layers=n,
            n_heads=require(cfg, "num_attention_heads", arch),
            head_dim=head_dim,
            rope_dim=rope_dim,
            q_lora_rank=require(cfg, "q_lora_rank", arch),
            o_groups=require(cfg, "o_groups", arch),
            o_lora_rank=require(cfg, "o_lora_rank", arch),
            sliding_window=require(cfg, "sliding_window", arch),
            layer_types=types,
            ratios=ratios,
            hash_layers=hash_schedule(cfg, n, arch),
            index_n_heads=cfg.get("index_n_heads") or 0,
            index_head_dim=cfg.get("index_head_dim") or 0,
            index_topk=cfg.get("index_topk") or 0,
            hc_mult=require(cfg, "hc_mult", arch),
            hc_sinkhorn_iters=require(cfg, "hc_sinkhorn_iters", arch),
            hc_eps=float(cfg.get("hc_eps", 1e-6)),
            n_routed_experts=require(cfg, "n_routed_experts", arch),
            top_k=require(cfg, "num_experts_per_tok", arch),
            moe_intermediate_size=require(cfg, "moe_intermediate_size", arch),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            swiglu_limit=cfg.get("swiglu_limit"),
            scoring_func=cfg.get("scoring_func", "sqrtsoftplus"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            main_rope=RopeArgs.from_config({"rope_parameters": main, "max_position_embeddings": mpe}, head_dim),
            compress_rope=RopeArgs.from_config({"rope_parameters": compress, "max_position_embeddings": mpe}, head_dim),
            hidden_act=cfg.get("hidden_act", "silu"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
        if CSA in types and not (a.index_n_heads and a.index_head_dim and a.index_topk):
            raise ConfigError(f"config.json of {arch} has compressed_sparse_attention layers but no "
                              f"index_n_heads/index_head_dim/index_topk")
        if a.scoring_func not in ROUTER_SCORES:
            raise ConfigError(f"config.json of {arch}: scoring_func {a.scoring_func!r} is not supported; "
                              f"supported: {sorted(ROUTER_SCORES)}")
        if (a.n_heads * a.head_dim) % a.o_groups:
            raise ConfigError(f"config.json of {arch}: o_groups {a.o_groups} does not divide heads x head_dim")
        return a


def layer_schedule(cfg: dict, n: int, arch: str) -> tuple[list[str], list[int]]:
    """Per-layer attention type and compression ratio, from `layer_types` + `compress_rates` (transformers) or the
    official per-layer `compress_ratios` (0 = sliding only, 4 = CSA, any other ratio = HCA)."""
    rates = {**DEFAULT_COMPRESS_RATES, **(cfg.get("compress_rates") or {})}
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if cfg.get(key):
            rates[kind] = cfg[key]
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])[:n]
        bad = [t for t in types if t not in (SLIDING, CSA, HCA)]
        if len(types) != n or bad:
            raise ConfigError(f"config.json of {arch}: layer_types must name one of {[SLIDING, CSA, HCA]} for each "
                              f"of the {n} layers, got {cfg['layer_types']}")
        return types, [0 if t == SLIDING else int(rates[t]) for t in types]
    if cfg.get("compress_ratios") is not None:
        ratios = [int(r) for r in cfg["compress_ratios"]][:n]
        if len(ratios) != n or any(r < 0 for r in ratios):
            raise ConfigError(f"config.json of {arch}: compress_ratios must give a ratio >= 0 for each of the {n} "
                              f"layers, got {cfg['compress_ratios']}")
        return [SLIDING if r == 0 else CSA if r == 4 else HCA for r in ratios], ratios
    types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]  # transformers' default
    return types, [int(rates[t]) for t in types]


def hash_schedule(cfg: dict, n: int, arch: str) -> list[bool]:
    if cfg.get("mlp_layer_types"):
        types = list(cfg["mlp_layer_types"])[:n]
        if len(types) != n or set(types) - {"hash_moe", "moe"}:
            raise ConfigError(f"config.json of {arch}: mlp_layer_types must be 'hash_moe' or 'moe' for each of the "
                              f"{n} layers, got {cfg['mlp_layer_types']}")
        return [t == "hash_moe" for t in types]
    n_hash = cfg.get("num_hash_layers")
    n_hash = DEFAULT_HASH_LAYERS if n_hash is None else int(n_hash)
    return [i < n_hash for i in range(n)]


def rope_parameters(cfg: dict, partial: float) -> tuple[dict, dict]:
    """(main, compress) rope parameter dicts. Sliding layers rotate with plain RoPE at `rope_theta`; compressing layers
    (and their compressors and indexers) at `compress_rope_theta` with the config's scaling (YaRN), whose
    attention factor V4 leaves at 1."""
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return rp["main"], rp["compress"]
    flat = {k: v for k, v in {**(cfg.get("rope_scaling") or {}), **rp}.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0), "partial_rotary_factor": partial}
    compress = {**flat, "rope_theta": cfg.get("compress_rope_theta", 160000.0), "partial_rotary_factor": partial}
    compress["rope_type"] = compress.get("rope_type", compress.get("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


# ---------------------------------------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------------------------------------
def name_candidates(name: str) -> list[str]:
    """Where a pack may hold the official tensor `name`: as is, under `model.`, as transformers' save_pretrained writes
    V4 (`model.embed_tokens.weight`, `model.hc_head.hc_fn`, `attn.norm` for the attention's `kv_norm`), or under the
    Hugging Face name the EXL3 layouts map official DeepSeek names to."""
    saved = {"embed.weight": "model.embed_tokens.weight", "hc_head_fn": "model.hc_head.hc_fn",
             "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
    out = [name, f"model.{name}"]
    if name in saved:
        out.append(saved[name])
    if ".attn.kv_norm." in name:
        out.append("model." + name.replace(".attn.kv_norm.", ".attn.norm."))
    out.append(official_to_hf(name))
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------------------------------------------------
# layers (the module ops are dsv4_ops.py's)
# ---------------------------------------------------------------------------------------------------------------------
class DecoderLayer:
    """Both blocks read and write the hc streams through their own hyper-connection."""
    SUB_BLOCKS = {"attention": "attn", "mlp": "ffn"}   # role -> attribute (the noise floor perturbs by role)

    def __init__(self, load: LayerLoad):
        self.a = load.args
        fetch_block_inputs(self, load)
        self.attn = Attention(load)
        self.ffn = MoE(load)

    def __call__(self, streams: torch.Tensor, rope, tokens: torch.Tensor) -> torch.Tensor:
        eps = self.a.rms_norm_eps
        post, comb, x = self.attn_hc(streams)
        streams = HyperConnection.merge(streams, self.attn(rms_norm(x, self.attn_norm, eps), rope), post, comb)
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.merge(streams, self.ffn(rms_norm(x, self.ffn_norm, eps), tokens), post, comb)


def layer_names(a: DeepseekV4Args, layer: int) -> list[str]:
    norms, sites = block_input_names(layer)
    names = list(norms.values()) + [x for prefix in sites.values() for x in hc_names(prefix)]
    return names + Attention.names(a, layer) + MoE.names(a, layer)


@ARCHITECTURES.register("DeepseekV4ForCausalLM")
class DeepseekV4Family(Family):
    wants_tokens = True  # hash-routed layers pick experts from the token ids

    def __init__(self, config: dict, args: DeepseekV4Args | None = None):
        """args: the V4 blocks' arguments when a variant read them from its own config (V4.1)."""
        super().__init__(config)
        self.args = a = args if args is not None else DeepseekV4Args.from_config(config, self.arch())
        self.n_layers, self.hidden_size, self.vocab_size = a.n_layers, a.hidden_size, a.vocab_size
        self.rms_norm_eps, self.tie_word_embeddings = a.rms_norm_eps, a.tie_word_embeddings
        self.stored: dict[str, str] = {}
        self.embed_name, self.norm_name = "embed.weight", "norm.weight"
        self.numerics = "exact"
        self.rounding: DeepSeekRounding | None = None   # under numerics "deepseek": what the reference rounds

    def set_numerics(self, numerics: str, pack) -> None:
        """"deepseek": DeepSeek's reference rounding of this version, the linear-input rule bound to how `pack`
        stores each weight (quant.py). Layers built before keep theirs: set it before the first forward."""
        self.numerics = numerics
        self.rounding = self.reference_rounding(rounds_stored_input(pack, self.n)) if numerics == "deepseek" else None

    @staticmethod
    def reference_rounding(rounds_input) -> DeepSeekRounding:
        return DeepSeekRounding.v4(rounds_input)

    @property
    def numerics_label(self) -> str:
        return "exact (fp32 math, no reference rounding)" if self.rounding is None else self.rounding.label

    @classmethod
    def arch(cls) -> str:
        return ARCH

    # -- names ------------------------------------------------------------------------------------------------
    def resolve_names(self, available) -> None:
        """Maps each official name to the name the pack stores it under (first candidate present)."""
        have = set(available)
        self.stored = {}
        for name in self.official_names():
            found = next((c for c in name_candidates(name) if c in have), None)
            if found is not None:
                self.stored[name] = found
        self.embed_name, self.norm_name = self.n("embed.weight"), self.n("norm.weight")

    def n(self, name: str) -> str:
        return self.stored.get(name, name)

    @property
    def head_name(self) -> str:
        return self.n("embed.weight" if self.tie_word_embeddings else "head.weight")

    def official_names(self) -> list[str]:
        names = ["embed.weight", "norm.weight", "head.weight", *hc_names("hc_head")]
        for i in range(self.n_layers):
            names += self.official_layer_names(i) + self.optional_layer_names(i)
        return names

    def official_layer_names(self, i: int) -> list[str]:
        return layer_names(self.args, i)

    def optional_layer_names(self, i: int) -> list[str]:
        """Layer i's tensors a pack may store (resolved where present, never required)."""
        return []

    def layer_names(self, i: int) -> list[str]:
        return [self.n(x) for x in self.official_layer_names(i)]

    def required_names(self) -> list[str]:
        return super().required_names() + self.exit_names()

    def exit_names(self) -> list[str]:
        """The final collapse's tensors (hc_head)."""
        return [self.n(x) for x in hc_names("hc_head")]

    # -- compute ----------------------------------------------------------------------------------------------
    def load_layer(self, i: int, fetch: Fetch) -> DecoderLayer:
        return DecoderLayer(LayerLoad(self.args, i, fetch, self.n, self.rounding))

    def rope_tables(self, length: int, dtype: torch.dtype, device):
        positions = torch.arange(length)
        return (*rope_table(self.args.main_rope, positions, dtype, device),
                *rope_table(self.args.compress_rope, positions, dtype, device))

    def embed_hook(self, x: torch.Tensor) -> torch.Tensor:
        """Embeddings [B, T, hidden] -> hc_mult identical streams [B, T, hc, hidden]."""
        return x.unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1).contiguous()

    def final_hook(self, streams: torch.Tensor, fetch: Fetch, state=None) -> torch.Tensor:
        """hc_head: collapse the streams with sigmoid weights from their normed concatenation."""
        fn, base, scale = (fetch(self.n(x)) for x in hc_names("hc_head"))
        mixes = F.linear(unweighted_rms_norm(streams.flatten(2), self.args.rms_norm_eps), fn)
        pre = torch.sigmoid(mixes * scale + base) + self.args.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2)
