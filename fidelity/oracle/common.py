"""Pieces every architecture family shares: exact-math primitives and the streamed-model base class.

A family describes one architecture as data the runner can stream: which tensors each layer needs (checked up front)
and how to build a layer from a `fetch(name) -> tensor` function. Layers take activations `[B, T, hidden]` of rows that
all have length T (no padding), so causal masks never see another row's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import ConfigError



@dataclass(slots=True)
class OracleTaps:
    """What a pass tells its observers, each optional (None: nobody listens). The oracle's passes hand them to a
    `with oracle.tapped(OracleTaps(...))` block; the layers read them from their `Fetch.taps`.

    `layer_outputs` {layer: fn}: fn(output) of that layer for each batch, in batch order (the DeepSeek drafters' trunk
    pass). `routing_counts` (a `RoutingCounts`: `add(experts, indices)`): every `RoutedExperts` call's expert choices
    (compare's measured routing). `expert_outputs` (`routed(experts, indices, weights)` and `expert_output(e, y)`): each
    call's routing and each expert's weighted outputs (attribute's `RoutingRecorder`). `engram_access` (an
    `EngramAccess`: `add(layer, n_rows, rows)`): every V4.1 Engram call's table rows."""

    layer_outputs: dict[int, Callable] | None = None
    routing_counts: object | None = None
    expert_outputs: object | None = None
    engram_access: object | None = None


class Fetch:
    """Reads weights for a family: `fetch(name)` -> tensor on the oracle's device and dtype; `fetch.concat(names)`
    stacks tensors along dim 0 into one preallocated buffer, so fusing never holds the parts and the whole at once.

    `read(name)` gives the exact float32 tensor decoded on the CPU; off the CPU it is called `read(name, device=d)` and
    decodes on `d` (`Pack.tensor`: the host sends stored bytes, the decode runs there, bit for bit the CPU's).
    `read_many(names[, device=d])` (optional, `Pack.tensors`) gives several at once, decoded together where the format
    can; `read_ahead(names)` puts them in `ready`, where the next `fetch(name)` of each takes it.

    The oracle's load chain (`fidelity.oracle.runner.LoadChain`) fills `ready`: tensors already placed on the device
    for the layer being built (sharded loads: received from the rank that read them), each handed out once instead of
    being read. Loading settings, read by `RoutedExperts`: `expert_parallel` (the chain's `experts` slot, which it hands
    its calls to) and `expert_budget_bytes` (the Oracle's `expert_budget_bytes=`, read when a layer is built): None
    keeps every decoded routed expert for the layer's lifetime; an int keeps at most that many bytes of them per layer
    (first fit in the order they are first used; the others are decoded for each call, together within
    min(budget, READ_AHEAD_BYTES), and freed after it: `moe.DecodedExperts`). `expert_decodes`: the oracle's tally of
    their decodes (a `moe.ExpertDecodes`, a new one per forward). `taps`: the observers of the pass (`OracleTaps`).
    Slots: an attribute it does not declare is refused, never silently ignored."""

    __slots__ = ("read", "shape_of", "device", "dtype", "read_many", "ready", "expert_budget_bytes", "expert_parallel",
                 "expert_decodes", "taps")

    def __init__(self, read: Callable[..., torch.Tensor], shape_of: Callable[[str], tuple] | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 read_many: Callable[..., dict] | None = None, expert_budget_bytes: int | None = None,
                 expert_parallel: object | None = None, taps: OracleTaps | None = None):
        self.read, self.shape_of, self.device, self.dtype = read, shape_of, torch.device(device), dtype
        self.read_many = read_many
        self.ready: dict[str, torch.Tensor] = {}
        self.expert_budget_bytes = expert_budget_bytes
        self.expert_parallel = expert_parallel
        self.expert_decodes = None
        self.taps = OracleTaps() if taps is None else taps

    def _decoded(self, read: Callable, what):
        """read(what) on the CPU, read(what, device=d) elsewhere (the readers' convention above)."""
        return read(what) if self.device.type == "cpu" else read(what, device=self.device)

    def read_ahead(self, names: list[str]) -> None:
        """Decode `names` together now (`read_many`; one by one without it) and hold them in `ready` for their fetch."""
        got = ({n: self._decoded(self.read, n) for n in names} if self.read_many is None
               else self._decoded(self.read_many, names))
        self.ready.update({n: t.to(device=self.device, dtype=self.dtype) for n, t in got.items()})

    def __call__(self, name: str) -> torch.Tensor:
        if self.ready:
            t = self.ready.pop(name, None)
            if t is not None:
                return t
        return self._decoded(self.read, name).to(device=self.device, dtype=self.dtype)

    def concat(self, names: list[str]) -> torch.Tensor:
        if self.ready and all(n in self.ready for n in names):
            parts = [self.ready.pop(n) for n in names]
            joined = adjacent_rows(parts)
            return joined if joined is not None else torch.cat(parts, dim=0)
        shapes = [tuple(self.shape_of(n)) if self.shape_of else () for n in names]
        if any(len(s) == 0 for s in shapes) or len({s[1:] for s in shapes}) != 1:
            return torch.cat([self(n) for n in names], dim=0)
        out = torch.empty((sum(s[0] for s in shapes), *shapes[0][1:]), device=self.device, dtype=self.dtype)
        start = 0
        for name, shape in zip(names, shapes):
            out[start:start + shape[0]] = self(name)
            start += shape[0]
        return out

def adjacent_rows(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The parts' concatenation along dim 0 as one view, when they already lie one after the other in one storage
    (a batched decode wrote them so: `read_ahead` of an expert's gate and up); else None."""
    first = parts[0]
    offset = first.storage_offset()
    for t in parts:
        if (t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:]
                or not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset):
            return None
        offset += t.numel()
    shape = (sum(t.shape[0] for t in parts), *first.shape[1:])
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape,
                                   torch.empty(shape, device="meta").stride())


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# Bytes of attention scores one query chunk may hold; longer rows are processed in query chunks.
ATTENTION_CHUNK_BYTES = 256 * 2**20
# Queries per chunk at most: a chunk only scores the keys up to its last query, so smaller chunks skip more of the
# causally masked half of the score matrix.
QUERY_BLOCK = 128


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(f"hidden_act {name!r} is not supported; supported: {sorted(ACTIVATIONS)}") from None


def require(cfg: dict, key: str, arch: str):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"config.json of {arch} has no {key!r}")
    return cfg[key]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Softmax attention with grouped KV heads, computed as plain matmul + mask + softmax.

    q [B, T, H, D], k [B, T, Hkv, D], v [B, T, Hkv, Dv] -> [B, T, H, Dv]. Query head h uses KV head h // (H / Hkv),
    as HF's repeat_kv does, without materialising the repeated keys. `window`: a key j is visible from query i when
    i - window < j <= i (HF's sliding-window rule). Long rows are processed in query chunks.
    """
    B, T, H, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    group = H // Hkv
    keys = k.transpose(1, 2).reshape(B * Hkv, T, D).transpose(1, 2)   # [B*Hkv, D, T]
    values = v.transpose(1, 2).reshape(B * Hkv, T, Dv)
    queries = q.view(B, T, Hkv, group, D).permute(0, 2, 3, 1, 4)        # [B, Hkv, group, T, D]
    chunk = max(1, min(T, QUERY_BLOCK, ATTENTION_CHUNK_BYTES // max(B * H * T * q.element_size(), 1)))
    out = q.new_empty(B, T, Hkv, group, Dv)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        first = 0 if window is None else max(0, start - window + 1)
        n = end - start
        qi = queries[:, :, :, start:end].reshape(B * Hkv, group * n, D)
        mask = mask_bias(start, end, first, window, group, q.dtype, q.device)
        scores = torch.baddbmm(mask, qi, keys[:, :, first:end], alpha=scale)  # scale * q.k + (0 or -inf)
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.bmm(probs, values[:, first:end]).view(B, Hkv, group, n, Dv)
        out[:, start:end] = ctx.permute(0, 3, 1, 2, 4)
    return out.view(B, T, H, Dv)


@lru_cache(maxsize=64)
def mask_bias(start: int, end: int, first: int, window: int | None, group: int, dtype, device) -> torch.Tensor:
    """[group * (end - start), end - first]: 0 where query i (start <= i < end) sees key j (first <= j < end), else
    -inf; repeated for the `group` query heads that share a KV head (rows ordered (group, i)). Cached: every layer of
    a forward asks for the same masks."""
    i = torch.arange(start, end, device=device)[:, None]
    j = torch.arange(first, end, device=device)[None, :]
    visible = j <= i
    if window is not None:
        visible = visible & (j > i - window)
    bias = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return bias.repeat(group, 1)


class GatedMLP:
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul (`gate_up` = [gate; up])."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: str,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None):
        self.inner = gate_up.shape[0] // 2
        self.gate_up, self.gate_up_bias = gate_up, gate_up_bias
        self.down, self.down_bias = down, down_bias
        self.act = activation(act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up, self.gate_up_bias).split(self.inner, dim=-1)
        return F.linear(self.act(gate).mul_(up), self.down, self.down_bias)

    @staticmethod
    def tensors(gate: str, up: str, down: str, bias: bool = False) -> dict[str, str | list[str]]:
        """gate/up/down: module names (without `.weight`)."""
        out = {"gate_up": [f"{gate}.weight", f"{up}.weight"], "down": f"{down}.weight"}
        return {**out, "gate_up_bias": [f"{gate}.bias", f"{up}.bias"], "down_bias": f"{down}.bias"} if bias else out

    @staticmethod
    def modules(prefix: str) -> tuple[str, str, str]:
        return f"{prefix}.gate_proj", f"{prefix}.up_proj", f"{prefix}.down_proj"

    @staticmethod
    def names(prefix: str, bias: bool = False) -> list[str]:
        return tensor_names(GatedMLP.tensors(*GatedMLP.modules(prefix), bias))

    @classmethod
    def load(cls, prefix: str, fetch: Fetch, act: str, bias: bool = False) -> "GatedMLP":
        return cls.from_names(fetch, *GatedMLP.modules(prefix), act, bias)

    @classmethod
    def from_names(cls, fetch: Fetch, gate: str, up: str, down: str, act: str, bias: bool = False) -> "GatedMLP":
        """gate/up/down: module names (without `.weight`)."""
        return cls(act=act, **fetched(GatedMLP.tensors(gate, up, down, bias), fetch))


class Family:
    """One architecture, as the runner streams it. Subclasses set `args` and implement the layer methods."""

    embed_name = "model.embed_tokens.weight"
    norm_name = "model.norm.weight"

    def __init__(self, config: dict):
        self.config = config

    # sizes the runner needs
    n_layers: int
    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool

    @property
    def head_name(self) -> str:
        return self.embed_name if self.tie_word_embeddings else "lm_head.weight"

    def layer_names(self, i: int) -> list[str]:
        raise NotImplementedError

    def load_layer(self, i: int, fetch: Fetch):
        """A callable layer(x [B, T, hidden], rope) -> [B, T, hidden]."""
        raise NotImplementedError

    def rope_tables(self, length: int, dtype: torch.dtype, device) -> object:
        raise NotImplementedError

    # Optional hooks; the defaults keep the residual stream a plain [B, T, hidden] tensor.
    wants_tokens = False  # True: layers are called layer(x, rope, tokens [B, T])

    def new_pass_state(self):
        """The state one pass of a batch of rows carries from layer to layer, or None (the default: layers share
        nothing). A family that has one (DeepSeek-V4.1: shared pools, index selections, the carried hyper-connection
        weights) gets a fresh one per batch per pass, handed to every layer after its other arguments
        (`layer_call_args`) and to final_hook."""
        return None

    numerics = "exact"

    def set_numerics(self, numerics: str, pack) -> None:
        """The oracle's numerics (`Oracle(numerics=)`): "exact" (fp32/fp64 as transformers computes) everywhere;
        "deepseek" (DeepSeek's reference rounding, deepseek/quant.py) where the family defines it. Called once, after
        the pack's names are resolved; `pack` tells how each weight is stored."""
        if numerics != "exact":
            raise ConfigError(f"numerics {numerics!r} is not defined for {type(self).__name__} (its reference code "
                              f"rounds nothing the oracle would emulate): use 'exact'")

    def bind_pack(self, pack) -> None:
        """Called once with the pack before its names are resolved (families that read more than whole tensors
        through fetch, e.g. DeepSeek-V4.1's Engram tables, row by row)."""

    def resolve_names(self, available) -> None:
        """Called once with the pack's tensor names before they are checked (families whose stored names vary)."""

    def embed_hook(self, x: torch.Tensor) -> torch.Tensor:
        """The embeddings [B, T, hidden] -> the residual stream the first layer reads."""
        return x

    def final_hook(self, x: torch.Tensor, fetch: Fetch, state=None) -> torch.Tensor:
        """The last layer's residual stream (and the pass's state, new_pass_state) -> [B, T, hidden] for the final
        norm."""
        return x

    def required_names(self) -> list[str]:
        names = [self.embed_name, self.norm_name, self.head_name]
        for i in range(self.n_layers):
            names += self.layer_names(i)
        return names


def fetched(tensors: dict[str, str | list[str]], fetch: Fetch, n=None) -> dict[str, torch.Tensor]:
    """{attribute: fetch(n(name))} for each attribute: name of the tensors a module declares (once, in a `tensors()`
    whose values are also its `names()`); a list of names is one tensor fused along dim 0 (`fetch.concat`); n maps
    official names to stored ones, where they differ."""
    n = n or (lambda name: name)
    return {attr: fetch.concat([n(x) for x in name]) if isinstance(name, list) else fetch(n(name))
            for attr, name in tensors.items()}


def fetch_tensors(module, tensors: dict[str, str | list[str]], fetch: Fetch, n=None) -> None:
    """module.<attribute> = its tensor, for each of `tensors` (see `fetched`)."""
    for attr, t in fetched(tensors, fetch, n).items():
        setattr(module, attr, t)


def tensor_names(tensors: dict[str, str | list[str]]) -> list[str]:
    """The names a `tensors()` table reads, in its order (a fused entry's parts in theirs)."""
    return [x for name in tensors.values() for x in (name if isinstance(name, list) else [name])]


def layer_call_args(family: Family, tokens: torch.Tensor, state) -> tuple:
    """What the family's layers take after (x, rope): the batch's token ids when it wants_tokens, then the pass's
    state when it has one (Family.new_pass_state)."""
    return (*([tokens] if family.wants_tokens else []), *([state] if state is not None else []))


def head_dim_of(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def softmax_scale(head_dim: int) -> float:
    return head_dim ** -0.5  # the exact float HF multiplies by
