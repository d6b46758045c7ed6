"""The streaming runner: every row through layer i, then layer i+1, so peak memory is one layer's weights plus the
activations, never the whole model."""
from __future__ import annotations

import math
import numbers
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Callable, Iterator
import ctypes

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..blas import set_reproducible_gemm
from ..errors import FidelityError, NonFiniteActivations, PackError
from ..vector_math import warm_up_vector_math
from .families import family_for_pack, missing_tensors
from .common import Family, Fetch, OracleTaps, layer_call_args, rms_norm
from ..numerics import check_numerics
from . import moe
from .moe import ExpertDecodes

# Target bytes of one logits chunk in apply_head / iter_logits.
HEAD_CHUNK_BYTES = 256 * 2**20
# Every head GEMM multiplies exactly this many positions (a short block is zero-padded). BLAS picks kernels by shape
# (MKL sums fewer than 16 rows in another order: last-bit differences), so with one shape a position's logits depend on
# its hidden state alone, never on how many positions were computed with it; the reference store's exact re-derivation
# and `fidelity serve` vs a store rely on that.
HEAD_ROWS = 64
# Rows of equal length are batched together up to this many tokens.
BATCH_TOKENS = 8192
# Activation memory when the device's free memory decides what stays there: a batch in flight through a layer needs
# about this many times its activations for the layer's intermediates (attention scores, expert inputs, ...), and two
# layers' weights are resident (the prefetcher's); the rest of the free memory holds resident batches.
WORK_FACTOR = 16
# Streaming trims the heap once layers totalling this many fp32 bytes were let go, not after every layer: a trim hands
# the activations' freed blocks back too, and their next allocation faults them in again (SmolLM2-135M, 1024 tokens:
# 415k page faults and 3.0 s CPU per pass trimming every 14 MiB layer). Layers this large are trimmed after each one.
TRIM_AFTER_BYTES = 64 * 2**20
# A routed expert's tensor, in every family's spellings (`...experts.<e>.<matrix>`; shared experts are
# `shared_experts`): group 1 names the expert.
ROUTED_EXPERT_NAME = re.compile(r"^(.*\.experts\.\d+)\.")


def _malloc_trim() -> Callable[[], None]:
    """glibc keeps freed blocks below its (self-raising) mmap threshold in the heap; trimming after each layer hands a
    released layer's memory back to the OS, so peak RSS tracks one layer, not a few."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
        return lambda: trim(0) and None
    except (OSError, AttributeError):
        return lambda: None


release_freed_memory = _malloc_trim()


def exact_math(device: torch.device) -> None:
    """No TF32 or reduced-precision reductions anywhere, and MKL's vector math set up before any parallel use."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cudnn.deterministic = True
    warm_up_vector_math()


@dataclass(frozen=True)
class LoadChain:
    """How the oracle turns a pack's stored bytes into layer i: one declared chain, in this order, whatever order the
    stages were chosen in (every slot optional; the oracle builds each stage once, at its construction):

        prefetch   (oracle) -> stage(i) -> layer: when and where loads run. `parallel.Prefetcher`: layer i+1 loads
                   on a loader thread while layer i computes, its stored bytes staged ahead in host memory; it calls
                   `oracle.build_layer` for the rest of the chain
        (cache)    keep_weights: a layer built once is handed out again, nothing below runs
        shards     (oracle) -> stage(i, build) -> layer: place/shard. `parallel.ShardedLoads`: this rank reads its
                   share of the layer, every share is broadcast into `fetch.ready`, then `build(i)`
        read       `pack.tensor(name, device=)`: stored bytes (staged or memory-mapped) -> exact fp32, decoded on the
                   oracle's device (`Fetch`; a tensor in `fetch.ready` is taken instead)
        decode     `family.load_layer(i, fetch)`: the layer's module objects from its tensors
        experts    object RoutedExperts hands its calls to (`fetch.expert_parallel`; `parallel.ExpertParallel`: this
                   rank computes its own experts, one all_reduce per MoE call); experts are read when first routed to
                   (a call's new experts together: `RoutedExperts.read_ahead`, one batched decode per stored kind)
                   and kept within `fetch.expert_budget_bytes` per layer (`Oracle(expert_budget_bytes=)`; None: all
                   kept; over it an expert is decoded for each call, with the next ones over it within
                   min(budget, moe.READ_AHEAD_BYTES), and freed after it)
        layer      ((i, layer) -> layer, ...), applied in order to every built layer (the noise floor's perturbation,
                   `fidelity.measuring.noise_floor.Perturbation`)

    Observing a pass is not loading: `with oracle.tapped(OracleTaps(...))` hands the passes inside it to observers
    (`OracleTaps.layer_outputs` {i: fn}: layer i's outputs, the DeepSeek drafters' trunk pass; routing counts, expert
    outputs, Engram row access). No stage replaces an oracle attribute; `Oracle.load_layer` is the chain's one entry."""

    prefetch: Callable | None = None
    shards: Callable | None = None
    experts: object | None = None
    layer: tuple = ()


class Oracle:
    """Exact reference forward of a pack.

    Oracle(pack, device="cpu", dtype=torch.float32). `dtype=torch.float64` runs everything in float64 (outputs too).
    `keep_weights=True` keeps layers in memory after the first pass (for repeated small runs of a model that fits).
    `chain`: the LoadChain of stages layers load through (default: none, layers built on demand on the calling thread;
    `fidelity.oracle.parallel.load_chain` gives the one a run uses).
    `expert_budget_bytes`: None keeps every decoded routed expert for its layer's lifetime; an int >= 0 keeps at most
    that many bytes of decoded routed-expert weights per layer (in the oracle's dtype; first fit in the order experts
    are first used), the others are decoded for each call (together, within min(budget, moe.READ_AHEAD_BYTES)) and freed
    after it. Same numbers either way; a budget trades memory for repeated decodes (`last_forward["experts"]` counts
    them). Settable later (`oracle.expert_budget_bytes = n`): layers built from then on use it (a layer kept by
    keep_weights keeps what it kept; `release()` drops it).
    `numerics`: "exact" (default: fp32/fp64 math, what transformers computes) or "deepseek" (DeepSeek-V4/V4.1 only: the
    rounding DeepSeek's own inference/model.py applies, fidelity/oracle/deepseek/quant.py); fixed for the oracle's life.
    """

    def __init__(self, pack, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 keep_weights: bool = False, activation_budget: int | None = None, chain: LoadChain | None = None,
                 expert_budget_bytes: int | None = None, numerics: str = "exact"):
        if dtype not in (torch.float32, torch.float64):
            raise FidelityError(f"the oracle computes in float32 or float64, not {dtype}")
        set_reproducible_gemm()  # before the oracle's first matrix product (fidelity/blas.py; the CLI's is earlier)
        expert_budget_bytes = checked_expert_budget(expert_budget_bytes)
        self.pack = pack
        self.device = torch.device(device)
        self.dtype = dtype
        self.keep_weights = keep_weights
        self.family: Family = family_for_pack(pack)
        exact_math(self.device)
        self._check_names()
        self.family.set_numerics(check_numerics(numerics), pack)
        self.numerics = numerics
        self.chain = LoadChain() if chain is None else chain
        if not isinstance(self.chain, LoadChain):
            raise FidelityError(f"chain must be a LoadChain, not {type(self.chain).__name__}")
        self.fetch = Fetch(
            lambda name, **where: self.pack.tensor(name, **where),
            self._stored_shape,
            self.device,
            dtype,
            read_many=(lambda names, **where: self.pack.tensors(names, **where))
            if hasattr(self.pack, "tensors")
            else None,
            expert_budget_bytes=expert_budget_bytes,
            expert_parallel=self.chain.experts,
        )
        self._head: torch.Tensor | None = None
        self._norm: torch.Tensor | None = None
        self._layers: dict[int, object] = {}
        # bytes of row activations kept on the device between layers (None: every batch on a CPU oracle; what the
        # device's free memory allows on a GPU, or FIDELITY_DEVICE_ACTIVATIONS_GIB); the other batches wait in host
        # memory (pinned) and travel to the device for each layer
        self.activation_budget = activation_budget
        self.last_forward: dict = {}   # what the last forward kept where, and its peaks (see ActivationStore.report)
        self.shards = self.chain.shards(self) if self.chain.shards is not None else None
        self.prefetcher = self.chain.prefetch(self) if self.chain.prefetch is not None else None

    @property
    def expert_budget_bytes(self) -> int | None:
        """Bytes of decoded routed experts each layer keeps (None: all); read by a layer when it is built."""
        return self.fetch.expert_budget_bytes

    @expert_budget_bytes.setter
    def expert_budget_bytes(self, value: int | None) -> None:
        self.fetch.expert_budget_bytes = checked_expert_budget(value)

    # -- weights -------------------------------------------------------------------------------------------
    def _check_names(self) -> None:
        missing = missing_tensors(self.family, self.pack.names())
        if missing:
            raise PackError(f"pack lacks {len(missing)} tensor(s) the {self.pack.config['architectures'][0]} oracle "
                            f"needs, first {missing[0]!r}" + (f" (also {missing[1:4]})" if len(missing) > 1 else ""),
                            file=getattr(self.pack, "path", None), tensor=missing[0])

    def _stored_shape(self, name: str) -> tuple:
        return tuple(self.pack.storage(name).shape)

    def _layer_bytes(self, i: int) -> int:
        """Bytes of layer i's weights in the oracle's dtype (every expert counted: an upper bound)."""
        return sum(self._tensor_bytes(n) for n in self.family.layer_names(i))

    def _tensor_bytes(self, name: str) -> int:
        """Bytes of one weight decoded in the oracle's dtype."""
        return math.prod(self._stored_shape(name)) * self.dtype.itemsize

    def _resident_layer_bytes(self, i: int) -> int:
        """Bytes of layer i's weights it can hold at once: `_layer_bytes`, except that under an expert budget its routed
        experts count as at most the budget plus the experts decoded for a call over it: one, or a batch of at most
        min(budget, READ_AHEAD_BYTES) (RoutedExperts.read_transients; DecodedExperts.peak_bytes' bound)."""
        total, budget = self._layer_bytes(i), self.expert_budget_bytes
        if budget is None:
            return total
        experts: dict[str, int] = defaultdict(int)
        for n in self.family.layer_names(i):
            m = ROUTED_EXPERT_NAME.match(n)
            if m is not None:
                experts[m.group(1)] += self._tensor_bytes(n)
        routed = sum(experts.values())
        transient = max(max(experts.values(), default=0), min(budget, moe.READ_AHEAD_BYTES))
        return total - routed + min(routed, budget + transient)

    def load_layer(self, i: int):
        """Layer i through the load chain (LoadChain): the one place a layer's weights are read."""
        return self.build_layer(i) if self.prefetcher is None else self.prefetcher(i)

    def build_layer(self, i: int):
        """Layer i below the prefetch stage, on the calling thread: cached, else sharded, read, decoded, transformed."""
        layer = self._layers.get(i)
        if layer is None:
            layer = self._build(i) if self.shards is None else self.shards(i, self._build)
            if self.keep_weights:
                self._layers[i] = layer
        return layer

    def _build(self, i: int):
        layer = self.family.load_layer(i, self.fetch)
        for transform in self.chain.layer:
            layer = transform(i, layer)
        return layer

    def head_weight(self) -> torch.Tensor:
        if self._head is None:
            self._head = self.fetch(self.family.head_name)
        return self._head

    def release(self) -> None:
        """Drop cached head and layer weights."""
        self._head, self._norm, self._layers = None, None, {}

    def drafter(self, **options):
        """The pack's own drafter over this oracle's trunk (DeepSeek-V4/V4.1 DSpark, V3/V3.2 MTP module); the oracle's
        outputs are unchanged. See fidelity.oracle.deepseek.mtp."""
        from .deepseek.mtp import drafter  # noqa: PLC0415 (DeepSeek modules load on demand)
        return drafter(self, **options)

    # -- forward -------------------------------------------------------------------------------------------
    @contextmanager
    def tapped(self, taps: OracleTaps) -> Iterator[OracleTaps]:
        """The passes run inside the block tell `taps` (OracleTaps) what they see; the observers before it are back
        after it (also when it raises)."""
        if not isinstance(taps, OracleTaps):
            raise FidelityError(f"taps must be an OracleTaps, not {type(taps).__name__}")
        before, self.fetch.taps = self.fetch.taps, taps
        try:
            yield taps
        finally:
            self.fetch.taps = before

    def hidden_states(self, rows: list[list[int]], progress: bool = True) -> list[torch.Tensor]:
        """Final hidden state (after the last norm) of every row: list of [T_i, hidden] in the oracle's dtype."""
        batches, acts = self._forward(rows, progress)
        out: list[torch.Tensor | None] = [None] * len(rows)
        for idx, x in zip(batches, acts):
            for j, row in enumerate(idx):
                out[row] = x[j]
        return out

    def logits(self, tokens: torch.Tensor, progress: bool = False) -> torch.Tensor:
        """tokens LongTensor [B, T] -> logits [B, T, vocab] (float32, or float64 in float64 mode)."""
        if tokens.dim() != 2:
            raise FidelityError(f"tokens must be a [batch, length] tensor, got shape {list(tokens.shape)}")
        B, T = tokens.shape
        batches, acts = self._forward(tokens.tolist(), progress)
        head = self.head_weight() if B * T else None
        out = torch.empty(B, T, self.family.vocab_size if head is None else head.shape[0], dtype=self.dtype)
        for idx, x in zip(batches, acts):  # equal-length rows batch as consecutive index ranges
            self._head_into(x, out[idx[0]:idx[-1] + 1])
        return out

    def _forward(self, rows: list[list[int]], progress: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        """All rows through every layer and the final norm: (row-index batches, activations [b, T, hidden] each).
        The observers of `tapped` see it (`layer_outputs` {layer: fn}: fn(output) of that layer for each batch, in
        batch order)."""
        warm_up_vector_math()
        rows = [self._validate_row(r, i) for i, r in enumerate(rows)]
        batches = self._batches(rows)
        fam = self.family
        embed = self.fetch(fam.embed_name)
        ids = [torch.stack([rows[i] for i in idx]).to(self.device) for idx in batches]
        store = ActivationStore(self.device, self._activation_budget(batches, rows))
        self.fetch.expert_decodes = decodes = ExpertDecodes()   # this pass's routed-expert decodes
        layer_outputs = self.fetch.taps.layer_outputs
        states = [fam.new_pass_state() for _ in batches]   # what each batch's pass carries from layer to layer
        for b, (idx, t) in enumerate(zip(batches, ids)):
            x = store.arrived(fam.embed_hook(F.embedding(t, embed)))
            self._check_finite(x, idx, None)
            store.put(b, x)
        del embed
        release_freed_memory()
        max_len = max((len(r) for r in rows), default=0)
        rope = fam.rope_tables(max_len, self.dtype, self.device) if rows else None
        bar = tqdm(total=fam.n_layers * len(rows), disable=not progress, desc="oracle", unit="row-layer")
        released = 0
        out: list[torch.Tensor | None] = [None] * len(batches)
        norm = None

        def finish(b: int, x: torch.Tensor) -> None:
            # the final norm straight after the last layer: a batch waiting in host memory comes back once
            y = rms_norm(fam.final_hook(x, self.fetch, states[b]), norm, fam.rms_norm_eps)
            states[b] = None
            out[b] = y if store.is_resident(b) else store.to_host(y, store.host.get(b))   # x's buffer, when y fits it
            store.left(x)

        for layer_index in range(fam.n_layers):
            layer = self.load_layer(layer_index)
            last = layer_index == fam.n_layers - 1
            if last:
                norm = self.fetch(fam.norm_name)
            for b, idx in enumerate(batches):
                x = store.take(b)
                x = layer(x, _slice_rope(rope, x.shape[1]), *layer_call_args(fam, ids[b], states[b]))
                self._check_finite(x, idx, layer_index)
                if layer_outputs and layer_index in layer_outputs:
                    layer_outputs[layer_index](x)
                if last:
                    finish(b, x)
                else:
                    store.put(b, x)
                del x
                bar.update(len(idx))
            del layer
            if not self.keep_weights:  # trimming costs page faults later, so only when weights were really let go
                released += self._layer_bytes(layer_index)
                if released >= TRIM_AFTER_BYTES:
                    release_freed_memory()
                    released = 0
        bar.close()
        if fam.n_layers == 0:
            norm = self.fetch(fam.norm_name)
            for b in range(len(batches)):
                finish(b, store.take(b))
        self.last_forward = {**store.report(),
                             "experts": {"budget_bytes": self.expert_budget_bytes, **decodes.report()}}
        if progress and store.offloaded:
            tqdm.write(f"oracle: {store.describe()}")
        return batches, out

    def _activation_budget(self, batches: list[list[int]], rows: list[torch.Tensor]) -> int | None:
        """Bytes of activations that stay on the device between layers: the caller's (`activation_budget`; the
        command line's FIDELITY_DEVICE_ACTIVATIONS_GIB through parallel.RunSettings), or on a
        GPU what its free memory (torch's cached blocks included: `device_free_bytes`) leaves after the weights still
        to come and one batch's working memory; None keeps all. The weights still to come: two layers (routed
        experts within the expert budget, when set: `_resident_layer_bytes`), or under keep_weights every layer not
        yet kept (the kept ones are in use already). On an integrated GPU (unified memory: GB10) everything stays."""
        if self.activation_budget is not None:
            return int(self.activation_budget)
        if self.device.type != "cuda" or not batches:
            return None
        if getattr(torch.cuda.get_device_properties(self.device), "is_integrated", False):
            return None   # one memory for GPU and host (GB10): a batch moved to "host memory" would free nothing
        free = device_free_bytes(self.device)
        streams = getattr(getattr(self.family, "args", None), "hc_mult", 1)   # V4: hyper-connection streams
        per_token = self.family.hidden_size * streams * self.dtype.itemsize
        biggest = max(len(idx) * len(rows[idx[0]]) for idx in batches) * per_token
        if self.keep_weights:
            weights = sum(self._resident_layer_bytes(i) for i in range(self.family.n_layers) if i not in self._layers)
        else:
            weights = 2 * max((self._resident_layer_bytes(i) for i in range(self.family.n_layers)), default=0)
        return max(0, int(0.9 * (free - weights - WORK_FACTOR * biggest)))

    # -- head ----------------------------------------------------------------------------------------------
    def iter_logits(self, hidden: torch.Tensor, chunk_positions: int | None = None,
                    into: torch.Tensor | None = None) -> Iterator[tuple[slice, torch.Tensor]]:
        """Yields (positions slice, logits [n, vocab]) over hidden flattened to [N, hidden]; never all logits at once.
        `into` [N, vocab] (CPU, same device as the oracle): chunks are computed straight into it."""
        warm_up_vector_math()
        head = self.head_weight()
        flat = hidden.reshape(-1, hidden.shape[-1])
        if chunk_positions is None:
            blocks = HEAD_CHUNK_BYTES // (HEAD_ROWS * head.shape[0] * head.element_size())
            chunk_positions = max(1, blocks) * HEAD_ROWS
        for start in range(0, flat.shape[0], chunk_positions):
            end = min(flat.shape[0], start + chunk_positions)
            out = into[start:end] if into is not None else torch.empty(end - start, head.shape[0], dtype=self.dtype,
                                                                         device=self.device)
            self._head_blocks(flat[start:end], head, out)
            yield slice(start, end), out

    def head_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [n, vocab] (on the oracle's device) = the head's logits of x [n, hidden], as `apply_head` computes them
        (HEAD_ROWS-row GEMMs): for callers that keep logits on the device, chunk by chunk (store.device_row_metrics)."""
        self._head_blocks(x, self.head_weight(), out)

    def _head_blocks(self, x: torch.Tensor, head: torch.Tensor, out: torch.Tensor) -> None:
        """out [n, vocab] = x [n, hidden] @ head.T as GEMMs of exactly HEAD_ROWS rows each."""
        for start in range(0, x.shape[0], HEAD_ROWS):
            block = x[start:start + HEAD_ROWS].to(device=self.device, dtype=self.dtype)
            n = block.shape[0]
            if n == HEAD_ROWS:
                torch.matmul(block.contiguous(), head.t(), out=out[start:start + n])
                continue
            padded = torch.zeros(HEAD_ROWS, x.shape[1], dtype=self.dtype, device=self.device)
            padded[:n] = block
            padded_out = torch.empty(HEAD_ROWS, head.shape[0], dtype=self.dtype, device=self.device)
            torch.matmul(padded, head.t(), out=padded_out)
            out[start:start + n] = padded_out[:n]

    def map_logits(self, hidden: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor],
                   chunk_positions: int | None = None) -> torch.Tensor:
        """fn(logits chunk [n, vocab]) -> [n, ...] per chunk; results concatenated and shaped like hidden's leading
        dims."""
        parts = [fn(chunk).cpu() for _, chunk in self.iter_logits(hidden, chunk_positions)]
        out = torch.cat(parts) if parts else torch.empty(0)
        return out.reshape(*hidden.shape[:-1], *out.shape[1:])

    def apply_head(self, hidden: torch.Tensor, chunk_positions: int | None = None) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., vocab] on the CPU, computed chunk by chunk."""
        head = self.head_weight()
        out = torch.empty(*hidden.shape[:-1], head.shape[0], dtype=self.dtype)
        self._head_into(hidden, out, chunk_positions)
        return out

    def _head_into(self, hidden: torch.Tensor, out: torch.Tensor, chunk_positions: int | None = None) -> None:
        """Writes logits of hidden [..., hidden] into the contiguous CPU tensor out [..., vocab], chunk by chunk."""
        flat_out = out.view(-1, out.shape[-1])
        if self.device.type == "cpu":
            for _ in self.iter_logits(hidden, chunk_positions, into=flat_out):
                pass
        else:
            for where, chunk in self.iter_logits(hidden, chunk_positions):
                flat_out[where] = chunk.cpu()


    # -- helpers -------------------------------------------------------------------------------------------
    def _validate_row(self, row, i: int) -> torch.Tensor:
        t = torch.as_tensor(row, dtype=torch.long)
        if t.dim() != 1 or t.numel() == 0:
            raise FidelityError(f"row {i} must be a non-empty list of token ids")
        bad = (t < 0) | (t >= self.family.vocab_size)
        if bad.any():
            pos = int(bad.nonzero()[0])
            raise FidelityError(f"row {i} position {pos}: token id {int(t[pos])} is outside the vocabulary "
                                f"(size {self.family.vocab_size})")
        return t

    @staticmethod
    def _batches(rows: list[torch.Tensor]) -> list[list[int]]:
        """Row indices grouped by length (no padding anywhere), each group at most BATCH_TOKENS tokens."""
        by_len: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_len.setdefault(len(r), []).append(i)
        batches = []
        for length, idx in by_len.items():
            per = max(1, BATCH_TOKENS // length)
            batches += [idx[s:s + per] for s in range(0, len(idx), per)]
        return batches

    @staticmethod
    def _check_finite(x: torch.Tensor, rows: list[int], layer: int | None) -> None:
        """`layer` None: the embeddings. Raises NonFiniteActivations (compare names the pack, row id and tensor)."""
        if bool(torch.isfinite(x.sum())):  # one cheap pass; NaN and Inf both survive a sum
            return
        finite = torch.isfinite(x).flatten(1).all(dim=1)
        if not bool(finite.all()):
            j = int((~finite).nonzero()[0])
            kind = "NaN" if bool(torch.isnan(x[j]).any()) else "Inf"
            pos = int((~torch.isfinite(x[j])).flatten(1).any(dim=-1).nonzero()[0])
            where = "the embeddings" if layer is None else f"layer {layer}"
            raise NonFiniteActivations(
                f"{kind} in the activations after {where}, row {rows[j]} (first at position {pos})",
                kind=kind,
                layer=layer,
                row=rows[j],
                position=pos,
            )


def device_free_bytes(device: torch.device) -> int:
    """Memory a CUDA device can still give this process: the driver's free memory plus the blocks torch's caching
    allocator holds unused (reserved, not allocated), which it hands out again first. Without the latter a budget
    read after a pass came out smaller than the same budget read before it (that pass's freed blocks stay reserved),
    so a second identical forward kept fewer batches on the device."""
    free, _ = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    return int(free + stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0))


def checked_expert_budget(value) -> int | None:
    """None, or the expert budget as an int >= 0 (bytes); anything else raises FidelityError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise FidelityError(f"expert_budget_bytes must be None (keep every decoded routed expert) or an int >= 0 "
                            f"(bytes of decoded routed experts kept per layer), not {value!r}")
    return int(value)


class ActivationStore:
    """Row batches' activations between layers: on the device while they fit in `budget` bytes (first come, first kept),
    the rest in host memory (pinned when the device is a GPU), travelling to the device one batch at a time for each
    layer. Results do not depend on where a batch waited (copies are exact). Reports the bytes it held on the device at
    most (`peak_device_bytes`: resident batches plus the one in flight), the host buffers it allocated and the seconds
    that took (a batch's buffer is allocated once per forward and reused by every later layer; page-locking is the
    costly part on a GPU: 0.23-0.5 s per GiB on the H200 hosts of benchmarks/RESULTS.md) and, on CUDA, the allocator's
    peak and what torch's pinned-memory pool had to grow by during the forward (`pinned_pool`: blocks it could not serve
    from its cache, all pinned allocations of the forward counted, weight staging included)."""

    def __init__(self, device: torch.device, budget: int | None):
        self.device, self.budget = device, budget
        self.resident: dict[int, torch.Tensor] = {}
        self.host: dict[int, torch.Tensor] = {}
        self.kept_bytes = 0          # bytes of the resident batches
        self.in_flight = 0           # bytes of batches handed out by take() and not put back
        self.peak_device_bytes = 0
        self.offloaded: set[int] = set()
        self.seen: set[int] = set()
        self.moved_bytes = 0
        self.host_allocs = 0
        self.host_alloc_bytes = 0
        self.host_alloc_seconds = 0.0
        self.pinned_pool_at_start = pinned_pool_stats() if device.type == "cuda" else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def is_resident(self, b: int) -> bool:
        return b not in self.offloaded

    def put(self, b: int, x: torch.Tensor) -> None:
        nbytes = x.numel() * x.element_size()
        self.in_flight = max(0, self.in_flight - nbytes)
        self.seen.add(b)
        if b not in self.offloaded and (self.budget is None or self.kept_bytes + nbytes <= self.budget):
            self.resident[b] = x
            self.kept_bytes += nbytes
        else:
            self.offloaded.add(b)
            self.host[b] = self.to_host(x, self.host.get(b))
            self.moved_bytes += nbytes
        self._note()

    def arrived(self, x: torch.Tensor) -> torch.Tensor:
        """A batch's new activations on the device (the embeddings), before put()."""
        self.in_flight += x.numel() * x.element_size()
        self._note()
        return x

    def left(self, x: torch.Tensor) -> None:
        """A batch taken and not put back (the final norm's input) is done with."""
        self.in_flight = max(0, self.in_flight - x.numel() * x.element_size())

    def take(self, b: int) -> torch.Tensor:
        if b in self.resident:
            x = self.resident.pop(b)
            self.kept_bytes -= x.numel() * x.element_size()
        else:
            x = self.host[b].to(self.device, non_blocking=True)
            self.moved_bytes += x.numel() * x.element_size()
        self.in_flight += x.numel() * x.element_size()
        self._note()
        return x

    def to_host(self, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """x in host memory: into the batch's own buffer when it has one of that shape (reused layer after layer, and
        by the final output, whose input is done with), else a new one (pinned for a GPU, a copy on the CPU so that
        nothing aliases the caller's tensor)."""
        if into is None or into.shape != x.shape or into.dtype != x.dtype:
            started = time.perf_counter()
            into = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.device.type == "cuda")
            self.host_alloc_seconds += time.perf_counter() - started
            self.host_allocs += 1
            self.host_alloc_bytes += x.numel() * x.element_size()
        return into.copy_(x, non_blocking=self.device.type == "cuda")

    def _note(self) -> None:
        self.peak_device_bytes = max(self.peak_device_bytes, self.kept_bytes + self.in_flight)

    def report(self) -> dict:
        out = {"budget_bytes": self.budget, "resident_batches": len(self.seen - self.offloaded),
               "offloaded_batches": len(self.offloaded), "peak_device_activation_bytes": self.peak_device_bytes,
               "host_activation_bytes": sum(x.numel() * x.element_size() for x in self.host.values()),
               "moved_bytes": self.moved_bytes, "host_allocs": self.host_allocs,
               "host_alloc_bytes": self.host_alloc_bytes, "host_alloc_seconds": self.host_alloc_seconds}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            now = pinned_pool_stats()
            if now is not None and self.pinned_pool_at_start is not None:
                out["pinned_pool"] = {k: now[k] - self.pinned_pool_at_start[k] for k in now}
        return out

    def describe(self) -> str:
        r = self.report()
        gib = 2**30
        text = (f"{r['offloaded_batches']} of {r['offloaded_batches'] + r['resident_batches']} row batches waited in "
                f"host memory ({r['host_activation_bytes'] / gib:.2f} GiB); device activations peaked at "
                f"{r['peak_device_activation_bytes'] / gib:.2f} GiB of a {self.budget / gib:.2f} GiB budget")
        if "cuda_peak_allocated_bytes" in r:
            text += f", device memory at {r['cuda_peak_allocated_bytes'] / gib:.2f} GiB"
        if r["host_allocs"]:
            text += (f"; {r['host_allocs']} host buffers ({r['host_alloc_bytes'] / gib:.2f} GiB) allocated in "
                     f"{r['host_alloc_seconds']:.2f} s")
        return text


def pinned_pool_stats() -> dict | None:
    """Blocks torch's pinned-memory pool has created so far and the seconds that took (None where this torch does not
    report them): a forward's difference says how many pinned allocations its cache could not serve.
    `reserved_bytes`: bytes of pinned blocks the pool owns, in use or cached (torch's `allocated_bytes`)."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    if "num_host_alloc" not in stats:
        return None
    return {"new_blocks": int(stats["num_host_alloc"]),
            "new_block_seconds": float(stats.get("host_alloc_time.total", 0)) / 1e6,
            "reserved_bytes": int(stats.get("allocated_bytes.current", 0))}


def _slice_rope(rope, length: int):
    """Rope tables are [max_len, ...] tensors or tuples of them; rows of length T use the first T positions."""
    if isinstance(rope, torch.Tensor):
        return rope[:length]
    return tuple(_slice_rope(r, length) for r in rope)
