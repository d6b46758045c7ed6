"""The DeepSeek-V4 family's module ops, shared by V4 (v4.py), V4.1 (v41.py) and their DSpark drafters (mtp.py): RoPE
on the trailing interleaved pairs, manifold-constrained hyper-connections (Sinkhorn-normalised stream mixing), the
clamped-SwiGLU MoE with sqrt-softplus / hash routing, the compressor that pools `ratio` tokens per entry, CSA's
lightning indexer, the shared-KV sink attention over a sliding window plus compressed entries, and the reference
roundings' hooks into them (quant.py). The architectures (their args from config.json, layers and families) are
v4.py and v41.py; what each op computes is described in v4.py's docstring and at the op. `a` is the model's args
(v4.DeepseekV4Args, or the V4 blocks' args V4.1 reads from its config). A layer's modules are built from one
`LayerLoad`: the args, the layer's index, where its tensors come from and the reference rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ..common import ATTENTION_CHUNK_BYTES, Fetch, GatedMLP, fetch_tensors, rms_norm
from ..moe import RoutedExperts
from ..rope import RopeArgs, inverse_frequencies
from ..selection import mask_indices, top_k_indices, top_k_mask
from .quant import DeepSeekRounding, identity as no_rounding

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass(frozen=True)
class LayerLoad:
    """What one layer's modules are built from: the model's `args`, the `layer`'s index, the pack's tensors (`fetch`
    by stored name; `stored_name` maps an official name to the one the pack stores it under; `has` tells whether the
    pack stores an optional tensor, where a model has those) and DeepSeek's reference `rounding` (quant.py), or None
    (exact)."""
    args: Any
    layer: int
    fetch: Fetch
    stored_name: Callable[[str], str]
    rounding: DeepSeekRounding | None = None
    has: Callable[[str], bool] | None = None

    def tensor(self, name: str) -> torch.Tensor:
        """The official tensor `name`."""
        return self.fetch(self.stored_name(name))

    def optional(self, name: str) -> torch.Tensor | None:
        """The official tensor `name`, or None where the pack does not store it."""
        return self.tensor(name) if self.has(name) else None

    def fetch_into(self, module, tensors: dict[str, str]) -> None:
        """module.<attribute> = the tensor, for each attribute: official name of `tensors`."""
        fetch_tensors(module, tensors, self.fetch, self.stored_name)

    def stored_modules(self, modules) -> tuple[str, ...]:
        """The stored names of official modules (`layers.L.ffn.experts.E.w1`, ...), without `.weight`."""
        return tuple(self.stored_name(f"{m}.weight")[:-len(".weight")] for m in modules)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the trailing 2 * cos.shape[-1] dims of x [..., T, (heads,) D] in interleaved pairs (2i, 2i+1), in place
    (no de-interleaving: V4's values carry the rotated slice into the output). cos/sin [T, pairs], or [N, pairs]
    positions that line up with x's T axis; x's head axis, if any, is the one after T."""
    pairs = cos.shape[-1]
    if x.dim() == 4:  # [B, T, H, D]
        cos, sin = cos[:, None], sin[:, None]
    tail = x[..., -2 * pairs:]
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-2 * pairs], rotated), dim=-1)


def rope_table(a: RopeArgs, positions: torch.Tensor, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, dim/2] at the given positions (one angle per interleaved pair), moved to `device`. `positions`
    (a CPU tensor) and the angles are computed on the CPU whatever the device, so every device rotates by the same
    floats."""
    inv_freq, attention_factor = inverse_frequencies(a, torch.float32)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return ((freqs.cos() * attention_factor).to(device=device, dtype=dtype),
            (freqs.sin() * attention_factor).to(device=device, dtype=dtype))


def sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x).sqrt()


ROUTER_SCORES = {"sqrtsoftplus": sqrt_softplus, "sigmoid": torch.sigmoid, "softmax": lambda x: x.softmax(-1)}


@dataclass
class HyperConnection:
    """mHC weights of one site: fn [(2 + hc) * hc, hc * hidden], base [(2 + hc) * hc], scale [3]."""
    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor
    hc: int
    sinkhorn_iters: int
    hc_eps: float
    norm_eps: float

    def __call__(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, T, hc, hidden] -> (post [B, T, hc], comb [B, T, hc, hc],
        collapsed block input [B, T, hidden])."""
        pre, post, comb = self.weights(streams)
        return post, comb, collapse(streams, pre)

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, T, hc, hidden] -> (pre [B, T, hc], post [B, T, hc], comb [B, T, hc, hc])."""
        hc = self.hc
        mixes = F.linear(unweighted_rms_norm(streams.flatten(2), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split((hc, hc, hc * hc), dim=-1)
        pre_b, post_b, comb_b = self.base.split((hc, hc, hc * hc))
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * self.scale[2] + comb_b.view(hc, hc), dim=-1)
        comb = sinkhorn(comb + self.hc_eps, self.sinkhorn_iters, self.hc_eps)
        return pre, post, comb

    @staticmethod
    def merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New streams: stream k = post_k * block_out + sum_j comb[j, k] * streams_j."""
        return post.unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_k pre_k * stream_k: streams [B, T, hc, hidden], pre [B, T, hc] -> [B, T, hidden]."""
    return (pre.unsqueeze(-1) * streams).sum(dim=2)


def sinkhorn(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternating column / row normalisation towards a doubly-stochastic matrix (columns first, then iters - 1
    row-then-column rounds), each with eps in the denominator."""
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


class ClampedGatedMLP(GatedMLP):
    """SwiGLU with the gate clamped from above and the up projection to [-limit, limit] (no clamp when limit is 0
    or None). `round_in` / `round_down`: the reference rounding of the gate/up and the down projection's inputs
    (quant.py), or identity. Given `weights` (a routed expert's routing weights), they scale the SwiGLU output before
    the down projection, as DeepSeek's `Expert.forward` does."""

    limit: float | None = None
    round_in = staticmethod(no_rounding)
    round_down = staticmethod(no_rounding)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = F.linear(self.round_in(x), self.gate_up, self.gate_up_bias).split(self.inner, dim=-1)
        if self.limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        h = self.act(gate) * up
        if weights is not None:
            h = h * weights
        return F.linear(self.round_down(h), self.down, self.down_bias)

    def round_like(self, rounding, gate: str, up: str, down: str) -> "ClampedGatedMLP":
        """Sets the rounding of its inputs from the official weight names (gate/up/down with `.weight`)."""
        if rounding is not None:
            if rounding.rounds_input(gate) != rounding.rounds_input(up):
                raise ConfigError(f"{gate} and {up} are stored in different formats (one FP8/FP4, one not): the "
                                  f"reference rounding of their shared input is not defined")
            self.round_in, self.round_down = rounding.linear_input(gate), rounding.linear_input(down)
        return self


class ClampedExperts(RoutedExperts):
    """A layer's routed clamped-SwiGLU experts; under the reference rounding each expert is weighted inside (before
    `w2`)."""

    def __init__(self, load: LayerLoad):
        a, layer = load.args, load.layer
        self.official = lambda e: expert_modules(layer, f"experts.{e}")
        super().__init__(a.n_routed_experts, lambda e: load.stored_modules(self.official(e)), load.fetch, a.hidden_act)
        self.limit, self.rounding = a.swiglu_limit, load.rounding

    def decode(self, e: int) -> GatedMLP:
        mlp = ClampedGatedMLP.from_names(self.fetch, *self.names(e), self.act)
        mlp.limit = self.limit
        return mlp.round_like(self.rounding, *(f"{m}.weight" for m in self.official(e))) if self.rounding else mlp

    def weighted(self, mlp: GatedMLP, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return super().weighted(mlp, x, weights) if self.rounding is None else mlp(x, weights)


class MoE:
    """Routed experts (sqrt-softplus scores, selection bias or token hash) plus one shared expert."""

    def __init__(self, load: LayerLoad):
        a, layer = load.args, load.layer
        self.a, self.hashed = a, a.hash_layers[layer]
        load.fetch_into(self, self.tensors(a, layer))
        if self.hashed:
            self.tid2eid = self.tid2eid.round().long()
        self.experts = ClampedExperts(load)
        shared = expert_modules(layer, "shared_experts")
        self.shared = ClampedGatedMLP.from_names(load.fetch, *load.stored_modules(shared), a.hidden_act)
        self.shared.limit = a.swiglu_limit
        self.shared.round_like(load.rounding, *(f"{x}.weight" for x in shared))

    @staticmethod
    def tensors(a, layer: int) -> dict[str, str]:
        """The router's tensors (the experts' are expert_modules')."""
        p = f"layers.{layer}.ffn.gate"
        return {"router": f"{p}.weight", **({"tid2eid": f"{p}.tid2eid"} if a.hash_layers[layer] else
                                            {"selection_bias": f"{p}.bias"})}

    @staticmethod
    def names(a, layer: int) -> list[str]:
        # each expert's w1, w2, w3 (sorted), the order names were always listed in: random test packs draw in it
        experts = [f"experts.{e}" for e in range(a.n_routed_experts)]
        return list(MoE.tensors(a, layer).values()) + [f"{x}.weight" for which in ("shared_experts", *experts)
                                                       for x in sorted(expert_modules(layer, which))]

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores = ROUTER_SCORES[self.a.scoring_func](F.linear(flat, self.router))
        if self.hashed:
            indices = self.tid2eid[tokens.reshape(-1)]
        else:
            indices = top_k_indices(scores + self.selection_bias, self.a.top_k)
        weights = scores.gather(1, indices)  # the bias (or hash) picks experts, the scores weigh them
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.a.routed_scaling_factor
        return self.experts(flat, indices, weights).view_as(x) + self.shared(x)


def expert_modules(layer: int, which: str) -> tuple[str, str, str]:
    """(gate, up, down) official module names of an expert (`which`: experts.E or shared_experts)."""
    return tuple(f"layers.{layer}.ffn.{which}.{w}" for w in ("w1", "w3", "w2"))


class Compressor:
    """Pools every `ratio` tokens into one entry: a softmax over the window (gate + learned position bias `ape`) weighs
    the projected rows, then RMSNorm and RoPE at the window's first position. `overlap` (CSA and the indexer): the
    projections are 2 * width wide; entry w pools window w's second half with window w-1's first half (2 * ratio
    rows)."""

    def __init__(self, prefix: str, load: LayerLoad, width: int, ratio: int, overlap: bool, eps: float,
                 rope: RopeArgs, round_kv=None):
        """round_kv: the reference rounding of the roped entries (or None); the load's rounding's linear-input rule
        applies to wkv and wgate."""
        load.fetch_into(self, self.tensors(prefix))
        self.width, self.ratio, self.overlap, self.eps, self.rope = width, ratio, overlap, eps, rope
        self.round_kv = round_kv or no_rounding
        self.round_wkv, self.round_wgate = input_rounding(load.rounding, f"{prefix}.wkv.weight",
                                                          f"{prefix}.wgate.weight")

    @staticmethod
    def tensors(prefix: str) -> dict[str, str]:
        return {"wkv": f"{prefix}.wkv.weight", "wgate": f"{prefix}.wgate.weight", "ape": f"{prefix}.ape",
                "norm": f"{prefix}.norm.weight"}

    @staticmethod
    def names(prefix: str) -> list[str]:
        return list(Compressor.tensors(prefix).values())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> entries [B, T // ratio, width] (a trailing partial window makes no entry)."""
        B, T, _ = x.shape
        m, d = self.ratio, self.width
        n_win = T // m
        if n_win == 0:
            return x.new_zeros(B, 0, d)
        kv = F.linear(self.round_wkv(x[:, :n_win * m]), self.wkv).view(B, n_win, m, -1)
        gate = F.linear(self.round_wgate(x[:, :n_win * m]), self.wgate).view(B, n_win, m, -1) + self.ape
        if self.overlap:
            pooled_kv = kv.new_zeros(B, n_win, 2 * m, d)
            pooled_gate = gate.new_full((B, n_win, 2 * m, d), float("-inf"))
            pooled_kv[:, :, m:], pooled_gate[:, :, m:] = kv[..., d:], gate[..., d:]
            pooled_kv[:, 1:, :m], pooled_gate[:, 1:, :m] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
            kv, gate = pooled_kv, pooled_gate
        entries = rms_norm((kv * gate.softmax(dim=2)).sum(dim=2), self.norm, self.eps)
        cos, sin = rope_table(self.rope, torch.arange(n_win) * m, x.dtype, x.device)
        return self.round_kv(rope_tail(entries, cos, sin))


def finished_entries(T: int, ratio: int, device) -> torch.Tensor:
    """Entries a query may use: query t sees entry w when the whole window ended at or before t, i.e.
    w < (t + 1) // ratio. [T, T // ratio] bool."""
    t = torch.arange(T, device=device)[:, None]
    w = torch.arange(T // ratio, device=device)[None, :]
    return w < (t + 1) // ratio


class Indexer:
    """CSA's lightning indexer: its own overlapping compressor at index_head_dim, queries from the q latent (RoPE'd
    at the compress theta), score[t, w] = sum_h weight_h(x_t) * relu(q_h(t) . k_w) / sqrt(d); each query keeps the
    index_topk best of its finished entries (equal scores: the earlier entries, on every device)."""

    def __init__(self, prefix: str, load: LayerLoad, ratio: int):
        self.a = a = load.args
        rounding = load.rounding
        self.round_qk = rounding.index_qk if rounding is not None else no_rounding
        self.compressor = Compressor(f"{prefix}.compressor", load, a.index_head_dim, ratio, True, a.rms_norm_eps,
                                     a.compress_rope, self.round_qk)
        load.fetch_into(self, self.tensors(prefix))
        self.round_wq_b, self.round_weights = input_rounding(rounding, f"{prefix}.wq_b.weight",
                                                             f"{prefix}.weights_proj.weight")

    @staticmethod
    def tensors(prefix: str) -> dict[str, str]:
        """Its own (its compressor's are Compressor's)."""
        return {"wq_b": f"{prefix}.wq_b.weight", "weights_proj": f"{prefix}.weights_proj.weight"}

    @staticmethod
    def names(prefix: str) -> list[str]:
        return Compressor.names(f"{prefix}.compressor") + list(Indexer.tensors(prefix).values())

    def selected(self, x: torch.Tensor, q_latent: torch.Tensor, compress_rope) -> torch.Tensor:
        """Bool [B, T, n_entries]: entries each query attends to (finished and among its top-k)."""
        a = self.a
        B, T, _ = x.shape
        keys = self.compressor(x)                                     # [B, W, d]
        n_entries, ratio = keys.shape[1], self.compressor.ratio
        q = F.linear(self.round_wq_b(q_latent), self.wq_b).view(B, T, a.index_n_heads, a.index_head_dim)
        q = self.round_qk(rope_tail(q, *compress_rope))
        head_weights = F.linear(self.round_weights(x), self.weights_proj) * a.index_n_heads ** -0.5
        finished = finished_entries(T, ratio, x.device)
        keep = torch.zeros(B, T, n_entries, dtype=torch.bool, device=x.device)
        chunk = max(1, min(T, ATTENTION_CHUNK_BYTES // max(B * a.index_n_heads * n_entries * 4, 1)))
        for start in range(0, T, chunk):
            end = min(T, start + chunk)
            n_vis = min(n_entries, end // ratio)       # entries any of these queries may see; the rest are not scored
            if n_vis == 0:
                continue
            scores = torch.einsum("bthd,bwd->bthw", q[:, start:end], keys[:, :n_vis]).relu_() * a.index_head_dim ** -0.5
            index = torch.matmul(head_weights[:, start:end].unsqueeze(-2), scores).squeeze(-2)   # sum over heads
            index = index.masked_fill(~finished[start:end, :n_vis], float("-inf"))
            keep[:, start:end, :n_vis] = top_k_mask(index, a.index_topk)
        return keep


@dataclass(frozen=True)
class AttentionRounding:
    """An attention layer's reference roundings (quant.py; identity each under exact numerics): its projections'
    inputs by the linear-input rule, the window KV and the compressed entries."""
    wq_a: Callable = no_rounding
    wq_b: Callable = no_rounding
    wkv: Callable = no_rounding
    wo_b: Callable = no_rounding
    window_kv: Callable = no_rounding
    compressed_kv: Callable = no_rounding

    @classmethod
    def of(cls, rounding, p: str, rope_dim: int) -> "AttentionRounding":
        """p: the layer's official attention prefix (layers.L.attn)."""
        if rounding is None:
            return cls()
        return cls(*input_rounding(rounding, *(f"{p}.{w}.weight" for w in ("wq_a", "wq_b", "wkv", "wo_b"))),
                   window_kv=lambda kv: rounding.window_kv(kv, rope_dim),
                   compressed_kv=lambda kv: rounding.compressed_kv(kv, rope_dim))


def input_rounding(rounding, *weights: str) -> tuple[Callable, ...]:
    """The input rounding of each linear (official weight names) under `rounding`, identity under exact numerics."""
    return tuple(no_rounding if rounding is None else rounding.linear_input(w) for w in weights)


def attention_tensors(p: str) -> dict[str, str]:
    """The projections, norms and sinks every V4-style attention layer stores under `p` (= layers.L.attn)."""
    return {"wq_a": f"{p}.wq_a.weight", "q_norm": f"{p}.q_norm.weight", "wq_b": f"{p}.wq_b.weight",
            "wkv": f"{p}.wkv.weight", "kv_norm": f"{p}.kv_norm.weight", "wo_a": f"{p}.wo_a.weight",
            "wo_b": f"{p}.wo_b.weight", "sinks": f"{p}.attn_sink"}


class Attention:
    def __init__(self, load: LayerLoad):
        a, layer = load.args, load.layer
        p = f"layers.{layer}.attn"
        self.a, self.kind, self.ratio = a, a.layer_types[layer], a.ratios[layer]
        self.round = AttentionRounding.of(load.rounding, p, a.rope_dim)
        load.fetch_into(self, attention_tensors(p))
        self.compressor = self.indexer = None
        if self.kind != SLIDING:
            self.compressor = Compressor(f"{p}.compressor", load, a.head_dim, self.ratio, self.kind == CSA,
                                         a.rms_norm_eps, a.compress_rope, self.round.compressed_kv)
        if self.kind == CSA:
            self.indexer = Indexer(f"{p}.indexer", load, self.ratio)

    @staticmethod
    def names(a, layer: int) -> list[str]:
        p = f"layers.{layer}.attn"
        names = list(attention_tensors(p).values())
        if a.layer_types[layer] != SLIDING:
            names += Compressor.names(f"{p}.compressor")
        if a.layer_types[layer] == CSA:
            names += Indexer.names(f"{p}.indexer")
        return names

    def __call__(self, x: torch.Tensor, rope) -> torch.Tensor:
        a = self.a
        B, T, _ = x.shape
        main_rope, compress_rope = rope[:2], rope[2:]
        cos, sin = main_rope if self.kind == SLIDING else compress_rope
        r = self.round
        q_latent = rms_norm(F.linear(r.wq_a(x), self.wq_a), self.q_norm, a.rms_norm_eps)
        q = F.linear(r.wq_b(q_latent), self.wq_b).view(B, T, a.n_heads, a.head_dim)
        q = rope_tail(unweighted_rms_norm(q, a.rms_norm_eps), cos, sin)
        kv = rms_norm(F.linear(r.wkv(x), self.wkv), self.kv_norm, a.rms_norm_eps)
        kv = r.window_kv(rope_tail(kv, cos, sin))   # [B, T, D]
        entries = visible = gather = None
        if self.compressor is not None:
            entries = self.compressor(x)
            if self.indexer is not None and entries.shape[1] > a.index_topk:
                visible, gather = self.indexer.selected(x, q_latent, compress_rope), a.index_topk
            else:                                      # every finished entry is among the top-k
                visible = finished_entries(T, self.ratio, x.device).expand(B, T, -1)
        out = sink_attention(q, kv, entries, visible, self.sinks, a.head_dim ** -0.5, a.sliding_window, self.ratio,
                             gather)
        out = rope_tail(out, cos, -sin)  # undo the rotation the values carried, at the query's position
        groups = out.reshape(B, T, a.o_groups, -1)
        # wo_a goes through an einsum in DeepSeek's reference, which never rounds its input
        low_rank = torch.einsum("btgi,gri->btgr", groups, self.wo_a.view(a.o_groups, a.o_lora_rank, -1))
        return F.linear(r.wo_b(low_rank.flatten(2)), self.wo_b)


def sink_attention(q: torch.Tensor, kv: torch.Tensor, entries: torch.Tensor | None, visible: torch.Tensor | None,
                   sinks: torch.Tensor, scale: float, window: int, ratio: int = 1,
                   gather: int | None = None) -> torch.Tensor:
    """q [B, T, H, D] over the shared keys/values kv [B, T, D] (query t sees t - window < j <= t) and the compressed
    entries [B, W, D] `visible` [B, T, W] allows, with a per-head sink logit in the softmax. -> [B, T, H, D].

    Entries pool `ratio` tokens each, so queries up to t only score the first (t + 1) // ratio (the later ones are
    invisible to all of them). `gather` (a CSA top-k of at most `gather` entries per query out of many more): each
    query's visible entries are gathered and scored, not every entry masked."""
    B, T, H, D = q.shape
    n_entries = 0 if entries is None else entries.shape[1]
    n_far = min(n_entries, gather) if gather else n_entries
    chunk = attention_chunk(T, B * H * 4, B * H * 4 * (window + n_far + 1) + (B * n_far * D * 4 if gather else 0))
    out = q.new_empty(B, T, H, D)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        first = max(0, start - window + 1)
        qc = q[:, start:end]
        i = torch.arange(start, end, device=q.device)[:, None]
        j = torch.arange(first, end, device=q.device)[None, :]
        local = torch.einsum("bshd,btd->bhst", qc, kv[:, first:end]) * scale
        local.masked_fill_(~((j <= i) & (j > i - window)), float("-inf"))
        logits = [local]
        if n_entries and gather:
            index, valid = mask_indices(visible[:, start:end], n_far)                       # [B, s, k]
            far_kv = entries.gather(1, index.reshape(B, -1, 1).expand(-1, -1, D)).view(B, end - start, n_far, D)
            far = torch.einsum("bshd,bskd->bhsk", qc, far_kv) * scale
            logits.append(far.masked_fill_(~valid[:, None], float("-inf")))
        elif n_entries:
            far_kv = entries[:, :min(n_entries, end // ratio)]
            far = torch.einsum("bshd,bwd->bhsw", qc, far_kv) * scale
            logits.append(far.masked_fill_(~visible[:, None, start:end, :far_kv.shape[1]], float("-inf")))
        logits.append(sinks.view(1, H, 1, 1).expand(B, H, end - start, 1))
        probs = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
        ctx = torch.einsum("bhst,btd->bshd", probs[..., :end - first], kv[:, first:end])
        if n_entries:
            far_probs = probs[..., end - first:-1]
            ctx += torch.einsum("bhsk,bskd->bshd" if gather else "bhsw,bwd->bshd", far_probs, far_kv)
        out[:, start:end] = ctx
    return out


def attention_chunk(T: int, pair_bytes: int, query_bytes: int) -> int:
    """Queries per chunk so that a chunk of c queries, each scoring its c-query block plus `query_bytes` worth of
    other keys and buffers (c * (c * pair_bytes + query_bytes)), stays within ATTENTION_CHUNK_BYTES."""
    c = (math.sqrt(query_bytes ** 2 + 4 * pair_bytes * ATTENTION_CHUNK_BYTES) - query_bytes) / (2 * pair_bytes)
    return max(1, min(T, int(c)))


def hc_names(prefix: str) -> list[str]:
    """A hyper-connection site's fn, base and scale (`layers.L.hc_attn`, `hc_head`, ...)."""
    return [f"{prefix}_{w}" for w in ("fn", "base", "scale")]


def hyper_connection(prefix: str, load: LayerLoad) -> HyperConnection:
    a = load.args
    return HyperConnection(*(load.tensor(x) for x in hc_names(prefix)), a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps,
                           a.rms_norm_eps)


def block_input_names(layer: int) -> tuple[dict[str, str], dict[str, str]]:
    """What a V4-style layer reads before its blocks: ({attribute: norm}, {attribute: hyper-connection prefix})."""
    p = f"layers.{layer}"
    return ({"attn_norm": f"{p}.attn_norm.weight", "ffn_norm": f"{p}.ffn_norm.weight"},
            {"attn_hc": f"{p}.hc_attn", "ffn_hc": f"{p}.hc_ffn"})


def fetch_block_inputs(block, load: LayerLoad) -> None:
    norms, sites = block_input_names(load.layer)
    for attr, prefix in sites.items():
        setattr(block, attr, hyper_connection(prefix, load))
    load.fetch_into(block, norms)
