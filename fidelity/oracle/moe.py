"""Softmax-routed mixture-of-experts decoders: Qwen3Moe (top-k, renormalised when norm_topk_prob) and Mixtral (top-k,
always renormalised). Attention is the Llama family's. Experts are read from the pack only when a token routes to them,
and kept within the oracle's expert budget (`Oracle(expert_budget_bytes=)`, DecodedExperts)."""
from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..registry import ARCHITECTURES
from .common import Family, Fetch, GatedMLP, fetch_tensors, fetched, require
from .llama import Attention, AttentionArgs, DecoderLayer, attention_args, norm_names, norm_tensors, sliding_windows
from .rope import cos_sin


# Decoded bytes of the experts one batched read-ahead decodes at most (RoutedExperts.read_ahead). In float32 the
# batch's buffers become the experts' weights (views, nothing copied); a float64 oracle copies them, so a batch's
# float32 decode is held on top until its experts are built
READ_AHEAD_BYTES = 2 << 30


class DecodedExperts(Mapping):
    """The decoded experts one layer's RoutedExperts keeps (`RoutedExperts.loaded`): expert index -> module, read-only.

    `offer(e, mlp)` hands it an expert just decoded and returns the module. `budget` None keeps every one; an int keeps
    at most that many bytes of decoded weights, first fit in the order experts are first decoded (one is kept when its
    bytes fit in what the budget has left). An expert not kept belongs to the caller alone: used for one call, freed
    when the caller drops it, decoded again at its next use (same bytes, same numbers). Counters: `decodes` (offers),
    `used` (distinct experts decoded), `kept_bytes`, `peak_bytes` (the most held at once: the kept experts plus the one
    transient expert, which the caller drops before it decodes the next)."""

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self._kept: dict[int, object] = {}
        self._used: set[int] = set()
        self.decodes = self.kept_bytes = self.peak_bytes = 0

    @staticmethod
    def nbytes(mlp) -> int:
        """Bytes of a decoded expert's tensors (its weights and biases)."""
        return sum(t.numel() * t.element_size() for t in vars(mlp).values() if isinstance(t, torch.Tensor))

    def offer(self, e: int, mlp, held: int = 0):
        """`held`: bytes of other decoded experts the caller holds outside the table at this moment (read ahead)."""
        nbytes = self.nbytes(mlp)
        self.decodes += 1
        self._used.add(e)
        if self.budget is None or self.kept_bytes + nbytes <= self.budget:
            self._kept[e] = mlp
            self.kept_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.kept_bytes + held)
        else:
            self.peak_bytes = max(self.peak_bytes, self.kept_bytes + held + nbytes)
        return mlp

    def note(self, held: int) -> None:
        """The caller holds `held` bytes of decoded experts outside the table now (a read-ahead batch)."""
        self.peak_bytes = max(self.peak_bytes, self.kept_bytes + held)

    @property
    def used(self) -> int:
        return len(self._used)

    def get(self, e: int, default=None):
        return self._kept.get(e, default)

    def __getitem__(self, e: int):
        return self._kept[e]

    def __iter__(self):
        return iter(self._kept)

    def __len__(self) -> int:
        return len(self._kept)


class ExpertDecodes:
    """A tally over every layer's DecodedExperts (`fetch.expert_decodes`; the Oracle starts a new one per forward and
    reports it in `last_forward["experts"]`): `decodes` over all layers, `used` the distinct (layer, expert) pairs
    among them; `kept_bytes` and `peak_bytes` the largest of one layer's (its DecodedExperts' at its calls in the pass:
    a layer kept by keep_weights brings the experts it kept before). Counted under a lock: the prefetcher's loader
    thread may decode (a layer transform) while the compute thread does."""

    def __init__(self):
        self.lock = threading.Lock()
        self.decodes = self.kept_bytes = self.peak_bytes = 0
        self.pairs: set[tuple] = set()

    @property
    def used(self) -> int:
        return len(self.pairs)

    def decoded(self, layer: tuple, e: int) -> None:
        """`layer`: a key of the layer's experts (their expert 0's module names, as measuring.routing keys them)."""
        with self.lock:
            self.decodes += 1
            self.pairs.add((layer, e))

    def saw(self, table: DecodedExperts) -> None:
        with self.lock:
            self.kept_bytes = max(self.kept_bytes, table.kept_bytes)
            self.peak_bytes = max(self.peak_bytes, table.peak_bytes)

    def report(self) -> dict:
        with self.lock:
            return {"decodes": self.decodes, "used": len(self.pairs), "kept_bytes": self.kept_bytes,
                    "peak_bytes": self.peak_bytes}


class RoutedExperts:
    """Experts of one layer, decoded on first use and kept for the layer's lifetime, within `fetch.expert_budget_bytes`
    when one is set (read when the layer is built; see DecodedExperts: an expert over the budget is decoded for each
    call and freed after it). A call's new experts decode together where the pack can (`read_ahead` for the ones the
    table keeps, `read_transients` for the ones over the budget).

    `names(e)` gives expert e's (gate, up, down) module names (without `.weight`); `decode(e)` builds expert e from
    the pack (a family with other expert math overrides it)."""

    def __init__(self, n_experts: int, names: Callable[[int], tuple[str, str, str]], fetch: Fetch, act: str):
        self.n_experts, self.names, self.fetch, self.act = n_experts, names, fetch, act
        self.loaded = DecodedExperts(fetch.expert_budget_bytes)

    def decode(self, e: int) -> GatedMLP:
        return GatedMLP.from_names(self.fetch, *self.names(e), self.act)

    def weight_names(self, e: int) -> list[str]:
        """The stored weights decode(e) reads."""
        return [f"{m}.weight" for m in self.names(e)]

    def decoded_bytes(self, e: int) -> int | None:
        """Bytes expert e takes decoded (DecodedExperts.nbytes of its module), None where the shapes are not known."""
        shape_of = self.fetch.shape_of
        if shape_of is None:
            return None
        return sum(math.prod(shape_of(n)) for n in self.weight_names(e)) * self.fetch.dtype.itemsize

    def read_ahead(self, experts: list[int]) -> dict[int, GatedMLP]:
        """The experts among `experts` (a call's, in its order) that the table will keep and does not hold yet, decoded
        in batches of at most READ_AHEAD_BYTES (`Fetch.read_ahead`: one batched decode per stored kind where the pack
        has one, e.g. one EXL3 kernel launch per codebook, rate and shape), not yet offered: `expert(e, decoded)`
        offers them in the call's order, so the table keeps what it would keep one by one. Nothing where the fetch has
        no `read_many`."""
        if self.fetch.read_many is None:
            return {}
        budget, kept = self.loaded.budget, self.loaded.kept_bytes
        batches: list[list[int]] = [[]]
        batch_bytes = 0
        for e in experts:
            nbytes = self.decoded_bytes(e)
            if e in self.loaded or nbytes is None or (budget is not None and kept + nbytes > budget):
                continue
            kept += nbytes
            if batches[-1] and batch_bytes + nbytes > READ_AHEAD_BYTES:
                batches.append([])
                batch_bytes = 0
            batches[-1].append(e)
            batch_bytes += nbytes
        decoded = {}
        for batch in batches:
            if batch:
                decoded.update(self._decode_together(batch))
        return decoded

    def read_transients(self, experts: list[int]) -> dict[int, GatedMLP]:
        """Under a budget, the next experts of a call that the table will not keep (`experts`, in the call's order,
        the first one due now): as many as fit in min(budget, READ_AHEAD_BYTES), at least the first, decoded together
        (`Fetch.read_ahead`). They share the batch's buffers, which are freed once the last of them has run, so a layer
        holds at most budget + max(one expert, min(budget, READ_AHEAD_BYTES)). Nothing for fewer than two, or where
        the fetch has no `read_many` (then each decodes alone, `expert(e)`)."""
        budget = self.loaded.budget
        if budget is None or self.fetch.read_many is None:
            return {}
        room, chunk, total = min(budget, READ_AHEAD_BYTES), [], 0
        for e in experts:
            nbytes = self.decoded_bytes(e)
            if nbytes is None or (chunk and total + nbytes > room):
                break
            chunk.append(e)
            total += nbytes
        return self._decode_together(chunk) if len(chunk) > 1 else {}

    def _decode_together(self, experts: list[int]) -> dict[int, GatedMLP]:
        names = [n for e in experts for n in self.weight_names(e)]
        self.fetch.read_ahead(names)
        try:
            return {e: self.decode(e) for e in experts}
        finally:                                  # a weight decode(e) did not take must not outlive the call
            for n in names:
                self.fetch.ready.pop(n, None)

    def expert(self, e: int, decoded: GatedMLP | None = None, held: int = 0) -> GatedMLP:
        """Expert e: kept, else `decoded` (read ahead) or decoded now, and offered to the table (`held`: bytes of
        other experts read ahead and not yet offered)."""
        mlp = self.loaded.get(e)
        if mlp is None:
            mlp = self.loaded.offer(e, decoded if decoded is not None else self.decode(e), held)
            tally = self.fetch.expert_decodes
            if tally is not None:
                tally.decoded(tuple(self.names(0)), e)
        return mlp

    def __call__(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]; indices, weights [N, k] -> sum_k weights * expert_k(x), experts applied in ascending order."""
        out = self._combine(x, indices, weights)
        tally = self.fetch.expert_decodes
        if tally is not None:
            tally.saw(self.loaded)
        return out

    def _combine(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        taps = self.fetch.taps
        if taps.routing_counts is not None:
            taps.routing_counts.add(self, indices)
        outputs = taps.expert_outputs
        if outputs is not None:
            outputs.routed(self, indices, weights)
        parallel = self.fetch.expert_parallel   # the load chain's experts slot (experts across ranks)
        if parallel is not None:
            return parallel.combine(self, x, indices, weights)
        out = torch.zeros_like(x)
        for e, rows, y in self.routed_outputs(x, indices, weights):
            if outputs is not None:
                outputs.expert_output(e, y)
            out.index_add_(0, rows, y)
        return out

    def routed_outputs(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                       mine: Callable[[int], bool] | None = None):
        """Yields (e, rows, y) in ascending expert order for every routed expert (`mine`: only those it accepts, e.g.
        a rank's share): rows ascending, y = weights * expert_e(x[rows]). One stable sort groups the token-expert pairs
        by expert, one host sync reads the group sizes; the new experts are decoded together (`read_ahead`,
        `read_transients`). An expert over the budget lives only while its output is computed, before the next one
        decodes."""
        N, k = indices.shape
        flat = indices.flatten()
        order = torch.sort(flat, stable=True).indices
        sizes = torch.bincount(flat, minlength=self.n_experts).tolist()
        starts = list(itertools.accumulate(sizes, initial=0))     # expert e's pairs: order[starts[e]:starts[e + 1]]
        tokens, pair_weights = order // k, weights.flatten()[order]
        routed = [e for e, n in enumerate(sizes) if n and (mine is None or mine(e))]
        ahead = self.read_ahead(routed)                 # the new experts the table keeps, decoded together
        held = sum(DecodedExperts.nbytes(m) for m in ahead.values())
        self.loaded.note(held)
        for i, e in enumerate(routed):
            start, n = starts[e], sizes[e]
            rows = tokens[start:start + n]
            if e not in ahead and e not in self.loaded:  # over the budget: this one and the next ones like it together
                chunk = self.read_transients([f for f in routed[i:] if f not in ahead and f not in self.loaded])
                ahead.update(chunk)
                held += sum(DecodedExperts.nbytes(m) for m in chunk.values())
                self.loaded.note(held)
            mlp = ahead.pop(e, None)
            held -= 0 if mlp is None else DecodedExperts.nbytes(mlp)
            yield e, rows, self.weighted(self.expert(e, mlp, held), x[rows], pair_weights[start:start + n, None])

    def weighted(self, mlp: GatedMLP, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """weights [n, 1] * expert(x) [n, hidden] (a family whose reference weighs inside the expert overrides it)."""
        return mlp(x) * weights


def layer_routed_experts(layer) -> RoutedExperts | None:
    """The layer's RoutedExperts, wherever its MLP keeps it (`mlp`, `ffn` or `moe`, itself or its `experts`); None
    for a dense layer."""
    for attr in ("mlp", "ffn", "moe"):
        block = getattr(layer, attr, None)
        for inner in (block, getattr(block, "experts", None)):
            if isinstance(inner, RoutedExperts):
                return inner
    return None


def softmax_top_k(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1)
    weights, indices = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices


class SoftmaxMoE:
    def __init__(self, prefix: str, fetch: Fetch, experts: RoutedExperts, k: int, renormalize: bool):
        fetch_tensors(self, self.tensors(prefix), fetch)
        self.experts, self.k, self.renormalize = experts, k, renormalize

    @staticmethod
    def tensors(prefix: str) -> dict[str, str]:
        """The router's (the experts' are the family's expert_names)."""
        return {"router": f"{prefix}.gate.weight"}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = softmax_top_k(F.linear(flat, self.router), self.k, self.renormalize)
        return self.experts(flat, indices, weights).view_as(x)


@dataclass
class MoeArgs:
    arch: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    attention: AttentionArgs
    rms_norm_eps: float
    n_experts: int
    top_k: int
    renormalize: bool
    moe_layers: list          # per layer: True when the MLP is the routed block
    dense_intermediate_size: int | None
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    windows: list = None

    @classmethod
    def from_config(cls, cfg: dict) -> "MoeArgs":
        arch = cfg["architectures"][0]
        n_layers = require(cfg, "num_hidden_layers", arch)
        n_experts = cfg.get("num_experts") or require(cfg, "num_local_experts", arch)
        if arch == "MixtralForCausalLM":
            moe_layers, renormalize, qk_norm = [True] * n_layers, True, False
        else:
            step, dense_only = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
            moe_layers = [i not in dense_only and (i + 1) % step == 0 for i in range(n_layers)]
            renormalize, qk_norm = bool(cfg.get("norm_topk_prob", False)), True
        bias = bool(cfg.get("attention_bias", False)) and arch != "MixtralForCausalLM"
        return cls(
            arch=arch,
            vocab_size=require(cfg, "vocab_size", arch),
            hidden_size=require(cfg, "hidden_size", arch),
            n_layers=n_layers,
            attention=attention_args(cfg, arch, qkv_bias=bias, o_bias=bias, qk_norm=qk_norm),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            n_experts=n_experts,
            top_k=require(cfg, "num_experts_per_tok", arch),
            renormalize=renormalize,
            moe_layers=moe_layers,
            dense_intermediate_size=cfg.get("intermediate_size"),
            hidden_act=cfg.get("hidden_act", "silu"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            windows=sliding_windows(cfg, arch, n_layers),
        )


@ARCHITECTURES.register("Qwen3MoeForCausalLM", "MixtralForCausalLM")
class MoeFamily(Family):
    def __init__(self, config: dict):
        super().__init__(config)
        self.args = a = MoeArgs.from_config(config)
        self.n_layers, self.hidden_size, self.vocab_size = a.n_layers, a.hidden_size, a.vocab_size
        self.rms_norm_eps, self.tie_word_embeddings = a.rms_norm_eps, a.tie_word_embeddings
        self.mixtral = a.arch == "MixtralForCausalLM"

    def _moe_prefix(self, i: int) -> str:
        return f"model.layers.{i}.block_sparse_moe" if self.mixtral else f"model.layers.{i}.mlp"

    def expert_names(self, i: int, e: int) -> tuple[str, str, str]:
        p = f"{self._moe_prefix(i)}.experts.{e}"
        return (f"{p}.w1", f"{p}.w3", f"{p}.w2") if self.mixtral else GatedMLP.modules(p)

    def layer_names(self, i: int) -> list[str]:
        p = f"model.layers.{i}"
        names = norm_names(p) + Attention.names(self.args.attention, f"{p}.self_attn")
        if not self.args.moe_layers[i]:
            return names + GatedMLP.names(f"{p}.mlp")
        names += list(SoftmaxMoE.tensors(self._moe_prefix(i)).values())
        for e in range(self.args.n_experts):
            names += [f"{m}.weight" for m in self.expert_names(i, e)]
        return names

    def load_layer(self, i: int, fetch: Fetch) -> DecoderLayer:
        a, p = self.args, f"model.layers.{i}"
        if a.moe_layers[i]:
            experts = RoutedExperts(a.n_experts, lambda e: self.expert_names(i, e), fetch, a.hidden_act)
            mlp = SoftmaxMoE(self._moe_prefix(i), fetch, experts, a.top_k, a.renormalize)
        else:
            mlp = GatedMLP.load(f"{p}.mlp", fetch, a.hidden_act)
        return DecoderLayer(Attention(a.attention, f"{p}.self_attn", fetch, a.windows[i]), mlp,
                            **fetched(norm_tensors(p), fetch), eps=a.rms_norm_eps)

    def rope_tables(self, length: int, dtype: torch.dtype, device):
        return cos_sin(self.args.attention.rope, length, dtype, device)
