"""DeepSeek-V4.1 (`DeepseekV41ForCausalLM`), as exllamav3's `architecture/deepseek_v41.py` and its modules
(`modules/dsv4.py`, `modules/hyperconnections.py`, `modules/arch_specific/deepseek_v41.py`) describe it, cross-checked
against DeepSeek's own `inference/model.py` of the release: DeepSeek-V4 blocks (v4.py: shared-KV MQA, sinks,
grouped low-rank output, clamped SwiGLU MoE) with

- shared compressed KV pools: only the layers in `kv_source_layer_ids` own a compressor; a compressing layer reads the
  pool of the last source at or before it (same ratio). Every compressor pools non-overlapping windows (the V4 HCA
  form); a ratio-1 compressor has no gate (`norm(wkv(x))` per token, roped at its position);
- shared index selection: layers in `index_source_layer_ids` run the lightning indexer (their own `indexer.wq_b`,
  `indexer.weights_proj`) over index keys the pool's source owns (`indexer.wk`, `indexer.k_norm` applied to the
  pool's latent); the other compressing layers reuse the last selection. The indexer only runs when the pool holds
  more than `index_topk` entries (otherwise every finished entry is visible);
- a two-level candidate filter: from `candidate_source_layer_id` on, that layer picks, per query, the
  `candidate_topk_blocks` blocks of `candidate_block_size` entries with the best maximum index score (the block
  holding the query's newest finished entry always kept); later index layers score only inside them;
- no per-head RMSNorm on q (V4 normalises each head);
- single-pass hyper-connections: each mHC site computes pre/post/comb from its streams, but collapses them with the
  previous site's pre (the first site takes stream 0); the final collapse uses the last site's pre (no `hc_head_*`);
- Engram layers (engram.py) before the blocks in `engram_layer_ids`, on the hc streams, with tables read row by row
  from the pack (FP8 rows with their scales, exactly);
- no hash-routed MoE layers unless the config says `num_hash_layers`.

The compressor has no position bias in the reference (exllamav3 uses none where a pool has index keys); a pack that
stores `compressor.ape` gets it added to the gate as in V4. Under `numerics="deepseek"` (quant.py,
`DeepSeekRounding.v41`) the oracle rounds as the reference does: window KV fp8 (blocks of 32) and compressed KV fp4
(groups of 16, e4m3 scales) over whole post-RoPE vectors, the indexer's queries and keys fp4 (blocks of 32,
power-of-two scales), and the inputs of FP8/FP4-stored linears fp8 in blocks of 32.

The config may nest the model under `text_config` (the released one does, next to a vision tower). Tensor names are
the official ones (`layers.L.attn.compressor.wkv.weight`, `layers.L.attn.indexer.wk.weight`,
`layers.L.engram.embed.weight`...), resolved per pack as for V4.

The state that crosses layers (pools, selections, candidate masks, the carried pre) lives in a `CrossLayerState`, one
per pass of a batch of rows (`DeepseekV41Family.new_pass_state`), which the runner hands every layer and the final
collapse.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ...errors import ConfigError, FidelityError, PackError
from ...registry import ARCHITECTURES
from ..common import ATTENTION_CHUNK_BYTES, Fetch, rms_norm
from ..selection import top_k_mask
from .quant import DeepSeekRounding, identity as no_rounding
from .dsv4_ops import (HCA, SLIDING, AttentionRounding, HyperConnection, LayerLoad, MoE, attention_tensors,
                       collapse, fetch_block_inputs, finished_entries, input_rounding, rope_table, rope_tail,
                       sink_attention, unweighted_rms_norm)
from .v4 import DeepseekV4Args, DeepseekV4Family
from .v4 import layer_names as v4_layer_names
from .engram import EngramArgs, EngramLayer, RowTable, compressed_token_map

ARCH = "DeepseekV41ForCausalLM"


# ---------------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------------
def text_config(cfg: dict) -> dict:
    """The language model's config: `text_config` over the top level (which keeps architectures and quantisation)."""
    inner = cfg.get("text_config")
    return {**cfg, **inner} if isinstance(inner, dict) else dict(cfg)


@dataclass
class DeepseekV41Args:
    base: DeepseekV4Args
    kv_source: list              # per layer: the layer whose pool it reads (None: sliding only)
    index_source: list           # per layer: True when it runs the indexer itself
    candidate_layer: int         # -1: no candidate filter
    candidate_topk_blocks: int
    candidate_block_size: int
    engram_layers: list
    q_head_norm: bool = False    # V4 normalises each q head; V4.1 does not
    carry_pre: bool = True       # single-pass mHC: a site collapses with the previous site's pre

    @classmethod
    def from_config(cls, cfg: dict, arch: str = ARCH) -> "DeepseekV41Args":
        cfg = text_config(cfg)
        cfg.setdefault("num_hash_layers", 0)
        cfg.setdefault("swiglu_limit", 10.0)         # exllamav3's V4.1 default
        cfg.pop("layer_types", None)        # V4.1 states per-layer ratios; every compressing layer pools like HCA
        base = DeepseekV4Args.from_config({**cfg, "compress_ratios": _ratios(cfg, arch)}, arch)
        base.layer_types = [SLIDING if r == 0 else HCA for r in base.ratios]
        n = base.n_layers
        kv_ids = _layer_ids(cfg, "kv_source_layer_ids", n, arch)
        index_ids = _layer_ids(cfg, "index_source_layer_ids", n, arch)
        candidate = int(cfg.get("candidate_source_layer_id", -1))
        a = cls(base=base, kv_source=[None] * n, index_source=[i in index_ids for i in range(n)],
                candidate_layer=candidate, candidate_topk_blocks=int(cfg.get("candidate_topk_blocks", 0)),
                candidate_block_size=int(cfg.get("candidate_block_size", 1)),
                engram_layers=_layer_ids(cfg, "engram_layer_ids", n, arch))
        for s in kv_ids:
            if base.ratios[s] == 0:
                raise ConfigError(f"config.json of {arch}: kv_source_layer_ids names layer {s}, which compresses "
                                  f"nothing (compress_ratios[{s}] = 0)")
        for i, ratio in enumerate(base.ratios):
            if ratio == 0:
                continue
            owners = [s for s in kv_ids if s <= i]
            if not owners:
                later = [s for s in kv_ids if s > i]
                raise ConfigError(f"config.json of {arch}: layer {i} compresses (ratio {ratio}) but no "
                                  f"kv_source_layer_ids entry is at or before it"
                                  + (f" (its pool would come from layer {min(later)}, a later layer)" if later else ""))
            owner = max(owners)
            if base.ratios[owner] != ratio:
                raise ConfigError(f"config.json of {arch}: layer {i} (ratio {ratio}) would read the pool of layer "
                                  f"{owner}, whose ratio is {base.ratios[owner]}")
            a.kv_source[i] = owner
        a._check_index_sources(arch)
        return a

    def _check_index_sources(self, arch: str) -> None:
        ratios = self.base.ratios
        for i, full in enumerate(self.index_source):
            if full and ratios[i] == 0:
                raise ConfigError(f"config.json of {arch}: index_source_layer_ids names layer {i}, which has no "
                                  f"compressed pool to index (compress_ratios[{i}] = 0)")
        for i, ratio in enumerate(ratios):
            if ratio and self.index_source[i] and not self.index_source[self.kv_source[i]]:
                raise ConfigError(f"config.json of {arch}: layer {i} runs the indexer over the pool of layer "
                                  f"{self.kv_source[i]}, which is not in index_source_layer_ids (only an index "
                                  f"source that owns a pool has its index keys)")
        for i, ratio in enumerate(ratios):
            if ratio and not self.index_source[i]:
                full = [j for j in range(i) if self.index_source[j]]
                if not full or self.kv_source[full[-1]] != self.kv_source[i]:
                    raise ConfigError(f"config.json of {arch}: layer {i} reuses an index selection, but the last "
                                      f"index source before it does not read the same pool (layer "
                                      f"{self.kv_source[i]}'s)")
        c = self.candidate_layer
        if c < -1:
            raise ConfigError(
                f"config.json of {arch}: candidate_source_layer_id {c} is neither a layer nor -1 (no filter)"
            )
        if c >= 0:
            if c >= len(ratios) or not self.index_source[c]:
                raise ConfigError(f"config.json of {arch}: candidate_source_layer_id {c} is not an index source layer")
            if self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0:
                raise ConfigError(f"config.json of {arch}: candidate_source_layer_id {c} needs candidate_topk_blocks "
                                  f"and candidate_block_size > 0, got {self.candidate_topk_blocks} and "
                                  f"{self.candidate_block_size}")
            for i in range(c + 1, len(ratios)):
                if self.index_source[i] and self.kv_source[i] != self.kv_source[c]:
                    raise ConfigError(f"config.json of {arch}: layer {i} would filter by layer {c}'s candidate "
                                      f"blocks but reads another pool (layer {self.kv_source[i]}'s)")

    def candidate_mode(self, layer: int) -> str | None:
        c = self.candidate_layer
        if c < 0 or not self.index_source[layer]:
            return None
        return "source" if layer == c else "use" if layer > c else None


def _ratios(cfg: dict, arch: str) -> list:
    if cfg.get("compress_ratios") is None:
        raise ConfigError(f"config.json of {arch} has no compress_ratios")
    return cfg["compress_ratios"]


def _layer_ids(cfg: dict, key: str, n: int, arch: str) -> list[int]:
    """The backbone layers a per-model id list names. compress_ratios may continue past the backbone into the drafter's
    blocks (43 entries for 40 layers in the release); ids there belong to the drafter and are left to it."""
    ids = [int(i) for i in (cfg.get(key) or [])]
    limit = max(n, len(cfg.get("compress_ratios") or []))
    bad = [i for i in ids if not 0 <= i < limit]
    if bad:
        raise ConfigError(f"config.json of {arch}: {key} names layer {bad[0]}, outside the model's {n} layers"
                          + (f" and {limit - n} drafter blocks" if limit > n else ""))
    return [i for i in ids if i < n]


# ---------------------------------------------------------------------------------------------------------------------
# state carried from layer to layer
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Pool:
    entries: torch.Tensor              # [B, W, head_dim], roped, what attention reads
    index_keys: torch.Tensor | None    # [B, W, index_head_dim], roped, what the indexer scores


@dataclass
class CrossLayerState:
    """What one pass of a batch of rows carries from layer to layer; a fresh one per pass, from layer 0."""
    pools: dict = field(default_factory=dict)   # owner layer -> Pool
    selection: torch.Tensor | None = None       # [B, T, W] bool: the last index source's choice
    candidates: torch.Tensor | None = None      # [B, T, blocks] bool: blocks the candidate layer dropped
    pre: torch.Tensor | None = None             # [B, T, hc]: the last mHC site's pre

    def __copy__(self) -> "CrossLayerState":
        """The state at this point of the pass, for a re-run from here (fidelity.measuring.attribute): a layer replaces
        these tensors (writing only into ones it made) and adds its pool to the dict, which is the copy's own."""
        return CrossLayerState(dict(self.pools), self.selection, self.candidates, self.pre)


# ---------------------------------------------------------------------------------------------------------------------
# compressor, index keys and selection
# ---------------------------------------------------------------------------------------------------------------------
class PoolCompressor:
    """Non-overlapping windows of `ratio` tokens -> one entry each: softmax over the window of (wgate + ape) weighs the
    wkv rows (ratio 1: no gate, the row itself), then RMSNorm; `latent` is that, `entries` adds RoPE at the window's
    first position. A pack without `ape` gets no position bias (exllamav3 uses none where the pool has index keys)."""

    def __init__(self, prefix: str, load: LayerLoad, width: int, ratio: int, eps: float, rope, round_kv):
        """round_kv: the reference rounding of the roped entries, or identity; the load's rounding's linear-input rule
        applies to wkv and wgate."""
        self.wgate = None
        load.fetch_into(self, self.tensors(prefix, ratio))
        self.ape = load.optional(f"{prefix}.ape") if ratio > 1 else None
        self.width, self.ratio, self.eps, self.rope, self.round_kv = width, ratio, eps, rope, round_kv
        self.round_wkv, self.round_wgate = input_rounding(load.rounding, f"{prefix}.wkv.weight",
                                                          f"{prefix}.wgate.weight")

    @staticmethod
    def tensors(prefix: str, ratio: int) -> dict[str, str]:
        """Its required tensors (`ape` is optional: LayerLoad.optional)."""
        return {"wkv": f"{prefix}.wkv.weight", "norm": f"{prefix}.norm.weight",
                **({"wgate": f"{prefix}.wgate.weight"} if ratio > 1 else {})}

    @staticmethod
    def names(prefix: str, ratio: int) -> list[str]:
        return list(PoolCompressor.tensors(prefix, ratio).values())

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> normed pooled rows [B, T // ratio, width] (a trailing partial window makes none)."""
        B, T, _ = x.shape
        m = self.ratio
        n_win = T // m
        kv = F.linear(self.round_wkv(x[:, :n_win * m]), self.wkv).view(B, n_win, m, -1)
        if self.wgate is not None:
            gate = F.linear(self.round_wgate(x[:, :n_win * m]), self.wgate).view(B, n_win, m, -1)
            if self.ape is not None:
                gate = gate + self.ape
            kv = kv * gate.softmax(dim=2)
        return rms_norm(kv.sum(dim=2), self.norm, self.eps)

    def positions(self, n_win: int) -> torch.Tensor:
        """The windows' first positions (on the CPU, where rope_table computes its angles)."""
        return torch.arange(n_win) * self.ratio

    def entries(self, latent: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_table(self.rope, self.positions(latent.shape[1]), latent.dtype, latent.device)
        return self.round_kv(rope_tail(latent, cos, sin))


def index_scores(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, finished: torch.Tensor
) -> torch.Tensor:
    """q [B, t, h, d], keys [B, W, d], head_weights [B, t, h] (already scaled), finished [t, W] ->
    sum_h w_h relu(q_h . k_w) / sqrt(d), -inf where the entry is not finished. [B, t, W]."""
    scores = torch.einsum("bthd,bwd->bthw", q, keys).relu_() * q.shape[-1] ** -0.5
    return torch.einsum("bthw,bth->btw", scores, head_weights).masked_fill(~finished, float("-inf"))


def candidate_drop(scores: torch.Tensor, query_pos: torch.Tensor, ratio: int, block: int, keep: int) -> torch.Tensor:
    """The candidate layer's filter: scores [B, t, W] -> blocks dropped [B, t, W // block + 1] (bool). Blocks are
    ranked by their best score (the trailing partial block is the last one); the block holding the query's newest
    finished entry is always kept; of the `keep` best, those whose best is -inf count as dropped too."""
    W = scores.shape[-1]
    n_full = W // block
    full = scores[..., :n_full * block].unflatten(-1, (n_full, block)).amax(dim=-1)
    tail = scores[..., n_full * block:]
    tail_best = (
        tail.amax(dim=-1, keepdim=True) if tail.shape[-1] else full.new_full((*full.shape[:-1], 1), -float("inf"))
    )
    best = torch.cat((full, tail_best), dim=-1)
    newest = (((query_pos + 1) // ratio - 1).clamp(min=0) // block).view(1, -1, 1).expand(best.shape[0], -1, 1)
    best = best.scatter(-1, newest, float("inf"))
    return ~top_k_mask(best, keep)


def expand_blocks(drop: torch.Tensor, block: int, W: int) -> torch.Tensor:
    """[.., blocks] -> [.., W]: entry w takes block w // block's flag."""
    return drop.repeat_interleave(block, dim=-1)[..., :W]


# ---------------------------------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------------------------------
class Attention:
    def __init__(self, load: LayerLoad):
        """load.args: DeepseekV41Args."""
        a, layer, rounding = load.args, load.layer, load.rounding
        b = a.base
        p = f"layers.{layer}.attn"
        self.a, self.layer, self.ratio = a, layer, b.ratios[layer]
        self.owner = a.kv_source[layer]
        self.index_source = a.index_source[layer]
        self.candidate_mode = a.candidate_mode(layer)
        self.round = AttentionRounding.of(rounding, p, b.rope_dim)
        self.round_qk = rounding.index_qk if rounding is not None else no_rounding
        self.round_index_wk, self.round_index_wq_b, self.round_index_weights = input_rounding(
            rounding, *(f"{p}.indexer.{w}.weight" for w in ("wk", "wq_b", "weights_proj")))
        load.fetch_into(self, attention_tensors(p))
        self.compressor = self.index_wk = None
        if self.owner == layer:
            self.compressor = PoolCompressor(f"{p}.compressor", load, b.head_dim, self.ratio, b.rms_norm_eps,
                                             b.compress_rope, self.round.compressed_kv)
        load.fetch_into(self, self.index_tensors(a, layer))

    @staticmethod
    def index_tensors(a: DeepseekV41Args, layer: int) -> dict[str, str]:
        """The indexer's: the index keys' projection and norm where the layer owns the pool it indexes, the queries'
        projection and head weights where it runs the indexer."""
        p = f"layers.{layer}.attn.indexer"
        out = {}
        if a.index_source[layer] and a.kv_source[layer] == layer:
            out.update(index_wk=f"{p}.wk.weight", index_k_norm=f"{p}.k_norm.weight")
        if a.index_source[layer]:
            out.update(index_wq_b=f"{p}.wq_b.weight", index_weights=f"{p}.weights_proj.weight")
        return out

    @staticmethod
    def names(a: DeepseekV41Args, layer: int) -> list[str]:
        p = f"layers.{layer}.attn"
        names = list(attention_tensors(p).values())
        if a.kv_source[layer] == layer:
            names += PoolCompressor.names(f"{p}.compressor", a.base.ratios[layer])
        return names + list(Attention.index_tensors(a, layer).values())

    def build_pool(self, x: torch.Tensor) -> Pool:
        latent = self.compressor.latent(x)
        keys = None
        if self.index_wk is not None:
            keys = rms_norm(F.linear(self.round_index_wk(latent), self.index_wk), self.index_k_norm,
                            self.a.base.rms_norm_eps)
            cos, sin = rope_table(self.a.base.compress_rope, self.compressor.positions(latent.shape[1]), x.dtype,
                                  x.device)
            keys = self.round_qk(rope_tail(keys, cos, sin))
        return Pool(self.compressor.entries(latent), keys)

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor, compress_rope,
               state: CrossLayerState) -> torch.Tensor:
        """Bool [B, T, W]: the entries each query attends to (its top index_topk finished entries, inside the candidate
        blocks from the candidate layer on)."""
        b = self.a.base
        B, T, _ = x.shape
        W = keys.shape[1]
        q = F.linear(self.round_index_wq_b(q_latent), self.index_wq_b).view(B, T, b.index_n_heads, b.index_head_dim)
        q = self.round_qk(rope_tail(q, *compress_rope))
        head_weights = F.linear(self.round_index_weights(x), self.index_weights) * b.index_n_heads ** -0.5
        finished = finished_entries(T, self.ratio, x.device)
        block, n_blocks = self.a.candidate_block_size, self.a.candidate_topk_blocks
        filtering = self.candidate_mode is not None and W > n_blocks * block
        if filtering and self.candidate_mode == "source":
            state.candidates = torch.empty(B, T, W // block + 1, dtype=torch.bool, device=x.device)
        keep = torch.zeros(B, T, W, dtype=torch.bool, device=x.device)
        chunk = max(1, min(T, ATTENTION_CHUNK_BYTES // max(B * b.index_n_heads * W * 4, 1)))
        for start in range(0, T, chunk):
            end = min(T, start + chunk)
            # entries none of these queries may see score -inf: they are neither scored nor selected, and the
            # blocks wholly past them are dropped, so the chunk scores only the first n_vis
            n_vis = min(W, end // self.ratio)
            scores = index_scores(q[:, start:end], keys[:, :n_vis], head_weights[:, start:end],
                                  finished[start:end, :n_vis])
            if filtering and self.candidate_mode == "source":
                positions = torch.arange(start, end, device=x.device)
                drop = candidate_drop(scores, positions, self.ratio, block, n_blocks)
                state.candidates[:, start:end, :drop.shape[-1]] = drop
                state.candidates[:, start:end, drop.shape[-1]:] = True
            elif filtering:
                scores = scores.masked_fill(expand_blocks(state.candidates[:, start:end], block, n_vis), float("-inf"))
            if n_vis:
                keep[:, start:end, :n_vis] = top_k_mask(scores, b.index_topk)
        return keep

    def __call__(self, x: torch.Tensor, rope, state: CrossLayerState) -> torch.Tensor:
        a, b = self.a, self.a.base
        B, T, _ = x.shape
        main_rope, compress_rope = rope[:2], rope[2:]
        cos, sin = main_rope if self.ratio == 0 else compress_rope
        r = self.round
        q_latent = rms_norm(F.linear(r.wq_a(x), self.wq_a), self.q_norm, b.rms_norm_eps)
        q = F.linear(r.wq_b(q_latent), self.wq_b).view(B, T, b.n_heads, b.head_dim)
        if a.q_head_norm:
            q = unweighted_rms_norm(q, b.rms_norm_eps)
        q = rope_tail(q, cos, sin)
        kv = r.window_kv(rope_tail(rms_norm(F.linear(r.wkv(x), self.wkv), self.kv_norm, b.rms_norm_eps), cos, sin))
        entries = visible = gather = None
        if self.ratio:
            if self.compressor is not None:
                state.pools[self.layer] = self.build_pool(x)
            pool = state.pools.get(self.owner)
            if pool is None:
                raise FidelityError(f"layer {self.layer} reads the pool of layer {self.owner}, which has not run for "
                                    f"these rows (V4.1 layers run in order, from layer 0, on one pass state)")
            entries = pool.entries
            visible = finished_entries(T, self.ratio, x.device).expand(B, T, -1)
            if entries.shape[1] > b.index_topk:
                if self.index_source:
                    state.selection = self.select(x, q_latent, pool.index_keys, compress_rope, state)
                visible, gather = visible & state.selection, b.index_topk   # at most index_topk per query: gathered
        out = sink_attention(q, kv, entries, visible, self.sinks, b.head_dim ** -0.5, b.sliding_window,
                             max(self.ratio, 1), gather)
        out = rope_tail(out, cos, -sin)
        groups = out.reshape(B, T, b.o_groups, -1)
        # wo_a goes through an einsum in DeepSeek's reference, which never rounds its input
        low_rank = torch.einsum("btgi,gri->btgr", groups, self.wo_a.view(b.o_groups, b.o_lora_rank, -1))
        return F.linear(r.wo_b(low_rank.flatten(2)), self.wo_b)


# ---------------------------------------------------------------------------------------------------------------------
# layer and family
# ---------------------------------------------------------------------------------------------------------------------
class DecoderLayer:
    SUB_BLOCKS = {"attention": "attn", "mlp": "ffn"}   # role -> attribute (the noise floor perturbs by role)
    def __init__(self, load: LayerLoad, engram=None, token_map=None):
        """load.args: DeepseekV41Args; the hyper-connections and the MoE are V4's, over its base args."""
        self.a, self.layer, self.engram, self.token_map = load.args, load.layer, engram, token_map
        v4_load = replace(load, args=load.args.base)
        fetch_block_inputs(self, v4_load)
        self.attn = Attention(load)
        self.ffn = MoE(v4_load)

    def mix(self, hc: HyperConnection, streams: torch.Tensor, state: CrossLayerState):
        pre, post, comb = hc.weights(streams)
        if not self.a.carry_pre:
            return post, comb, collapse(streams, pre)
        previous, state.pre = state.pre, pre
        return post, comb, streams[:, :, 0] if previous is None else collapse(streams, previous)

    def __call__(self, streams: torch.Tensor, rope, tokens: torch.Tensor, state: CrossLayerState) -> torch.Tensor:
        """state: this pass's (DeepseekV41Family.new_pass_state), which every layer of the pass reads and updates."""
        eps = self.a.base.rms_norm_eps
        if self.engram is not None:
            ids = self.token_map[tokens.cpu()] if self.token_map is not None else tokens.cpu()
            streams = self.engram(streams, ids)
        post, comb, x = self.mix(self.attn_hc, streams, state)
        streams = HyperConnection.merge(streams, self.attn(rms_norm(x, self.attn_norm, eps), rope, state), post, comb)
        post, comb, x = self.mix(self.ffn_hc, streams, state)
        return HyperConnection.merge(streams, self.ffn(rms_norm(x, self.ffn_norm, eps), tokens), post, comb)


@ARCHITECTURES.register("DeepseekV41ForCausalLM")
class DeepseekV41Family(DeepseekV4Family):
    wants_tokens = True

    def __init__(self, config: dict):
        a = DeepseekV41Args.from_config(config, self.arch())
        super().__init__(config, a.base)
        self.text, self.v41 = text_config(config), a
        self.available: set = set()
        self.pack = None
        self._token_map = None
        self._tables: dict[int, RowTable] = {}
        for layer in a.engram_layers:       # config errors (table sizes, vocabulary) now, not at the first forward
            EngramArgs.from_config(self.text, layer)

    @classmethod
    def arch(cls) -> str:
        return ARCH

    def bind_pack(self, pack) -> None:
        self.pack = pack

    def resolve_names(self, available) -> None:
        super().resolve_names(available)
        self.available = set(available)

    def has(self, name: str) -> bool:
        return self.n(name) in self.available

    def official_layer_names(self, i: int) -> list[str]:
        a = self.v41
        names = [x for x in v4_layer_names(a.base, i) if ".attn." not in x]
        names += Attention.names(a, i)
        if i in a.engram_layers:
            names += EngramLayer.names(i)
        return names

    def optional_layer_names(self, i: int) -> list[str]:
        return [f"layers.{i}.attn.compressor.ape"] if self.v41.kv_source[i] == i else []

    def exit_names(self) -> list[str]:
        return [] if self.v41.carry_pre else super().exit_names()   # single-pass mHC: the exit needs no hc_head

    # -- Engram ---------------------------------------------------------------------------------------------------
    def token_map(self) -> torch.Tensor:
        """Token id -> Engram's compressed id, from the pack's tokenizer.json."""
        if self._token_map is None:
            if self.pack is None:
                raise PackError("DeepSeek-V4.1 Engram layers read tokenizer.json from the pack, but no pack is bound "
                                "(Oracle binds its pack; a bare family needs bind_pack)")
            root = getattr(self.pack, "root", None) or getattr(self.pack, "path", None)
            path = Path(root) / "tokenizer.json" if root is not None else None
            if path is None or not path.is_file():
                raise PackError(
                    "DeepSeek-V4.1 Engram layers hash the compressed vocabulary, built from tokenizer.json, "
                    "which the pack lacks",
                    file=path,
                )
            self._token_map = compressed_token_map(path)
            want = int(self.text.get("engram_compressed_vocab_size") or 0)
            if int(self._token_map.max()) + 1 != want:
                raise PackError(f"tokenizer.json gives {int(self._token_map.max()) + 1} compressed tokens, but "
                                f"engram_compressed_vocab_size is {want}", file=path)
        return self._token_map

    def table(self, layer: int) -> RowTable:
        if layer not in self._tables:
            if self.pack is None:
                raise PackError(f"Engram layer {layer} reads its table from the pack, but no pack is bound")
            prefix = next((p for p in (f"layers.{layer}.engram.embed", f"model.layers.{layer}.engram.embed")
                           if f"{p}.weight" in self.available or f"{p}.shard_0.weight" in self.available),
                          f"layers.{layer}.engram.embed")
            self._tables[layer] = RowTable.from_pack(self.pack, prefix)
        return self._tables[layer]

    def engram(self, layer: int, fetch: Fetch) -> EngramLayer:
        token_map = self.token_map()
        a = EngramArgs.from_config(self.text, layer, token_map)
        table = self.table(layer)
        names = [self.n(x) for x in EngramLayer.names(layer)]   # wkv, k_weight, q_weight
        wkv_name = names[0]
        width = fetch.shape_of(wkv_name)[1]
        if table.dim * a.n_heads != width:
            raise PackError(f"Engram layer {layer}: {a.n_heads} heads x table rows of {table.dim} (the table in "
                            f"{table.parts[0][0]}) do not match wkv's input width {width}", tensor=wkv_name)
        wkv, k_weight, q_weight = (fetch(x) for x in names)
        return EngramLayer(a, table, wkv, k_weight, q_weight, fetch)

    # -- compute ----------------------------------------------------------------------------------------------------
    def load_layer(self, i: int, fetch: Fetch) -> DecoderLayer:
        engram = self.engram(i, fetch) if i in self.v41.engram_layers else None
        if engram is not None and self.rounding is not None:
            engram.act_quant = self.rounding.linear_input(EngramLayer.names(i)[0])   # wkv's input
        load = LayerLoad(self.v41, i, fetch, self.n, self.rounding, self.has)
        return DecoderLayer(load, engram, self._token_map if engram is not None else None)

    @staticmethod
    def reference_rounding(rounds_input) -> DeepSeekRounding:
        return DeepSeekRounding.v41(rounds_input)

    def new_pass_state(self) -> CrossLayerState:
        return CrossLayerState()

    def final_hook(self, streams: torch.Tensor, fetch: Fetch, state: CrossLayerState | None = None) -> torch.Tensor:
        if not self.v41.carry_pre:
            return super().final_hook(streams, fetch)
        if state is None or state.pre is None:
            raise FidelityError("DeepSeek-V4.1 final collapse: these streams did not come out of the last layer of a "
                                "pass (V4.1 layers run in order, from layer 0, on one pass state, which the final "
                                "collapse takes too), so no hyper-connection weights were carried to it")
        return collapse(streams, state.pre)
