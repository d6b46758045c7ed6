"""The reference's layers streamed over row batches with each layer's input kept (`Trunk`), so a variant of the
reference (`Reader`: some tensors from the pack, or with noise) re-runs only from the first layer it changes."""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..oracle.common import Fetch, OracleTaps, layer_call_args, rms_norm
from ..oracle.deepseek.quant import rounds_stored_input
from ..oracle.runner import _slice_rope
from .metrics import MetricKernel, position_metrics

# Reference layers are kept in memory (built once, reused by every re-run) when all of them fit in this many bytes.
KEEP_LAYERS_BYTES = 8 * 2**30

class Reader:
    """read(name) for a variant, `name` in the reference's spelling: the pack's tensor for names in `swapped` (under
    the pack's name for it, `names`), the reference's otherwise; `noise` adds a fixed tensor to a reference tensor
    (the isotropic control). `tables`: layer -> the Engram table that layer reads instead of the reference's."""

    def __init__(self, ref, pack=None, swapped=(), noise: dict[str, torch.Tensor] | None = None,
                 names: dict[str, str] | None = None, tables: dict | None = None):
        self.ref, self.pack, self.swapped, self.noise = ref, pack, set(swapped), noise or {}
        self.names, self.tables = names or {}, tables or {}

    def __call__(self, name: str, **where) -> torch.Tensor:
        if name in self.swapped:
            return self.pack.tensor(self.names.get(name, name), **where)
        t = self.ref.tensor(name, **where)
        return t + self.noise[name].to(t.device) if name in self.noise else t

def variant_rounding(rounding, fam, read: Reader):
    """`rounding` (the reference's, quant.DeepSeekRounding) with its linear-input rule bound to a variant's storage: a
    swapped tensor's input is rounded where the pack stores it FP8/FP4, every other where the reference does (what
    DeepSeek's model.py does with the hybrid's weights)."""
    pack_rounds = rounds_stored_input(read.pack, lambda official: read.names.get(fam.n(official), fam.n(official)))
    return replace(rounding, rounds_input=lambda official: pack_rounds(official)
                               if fam.n(official) in read.swapped else rounding.rounds_input(official))

class Trunk:
    """The reference's layers streamed over row batches, each layer's input kept; `run(start, ...)` re-runs from a
    layer on with any layer built from another reader or wrapped."""

    def __init__(self, oracle, rows: list[list[int]], scored: list[torch.Tensor], keep_layers: bool | None,
                 kernel: MetricKernel = MetricKernel()):
        self.oracle, self.fam, self.ref = oracle, oracle.family, oracle.pack
        self.kernel = kernel       # measures KL where the logits are on a GPU
        self.taps = OracleTaps()   # the observers of every layer this trunk builds, set for the calls that record
        tokens = [oracle._validate_row(r, i) for i, r in enumerate(rows)]
        self.batches = oracle._batches(tokens)
        self.ids = [torch.stack([tokens[i] for i in idx]).to(oracle.device) for idx in self.batches]
        self.rope = self.fam.rope_tables(max(len(r) for r in rows), oracle.dtype, oracle.device)
        # scored positions and true next tokens per batch, in batch order (flattened b, t)
        self.scored, self.targets = [], []
        self.row_of = [torch.cat([torch.full((len(scored[i]),), i) for i in idx]) for idx in self.batches]
        self.n_rows = len(rows)
        for idx, t in zip(self.batches, self.ids):
            T = t.shape[1]
            pos = torch.cat([scored[i] + j * T for j, i in enumerate(idx)])
            self.scored.append(pos)
            self.targets.append(t.reshape(-1).cpu()[pos + 1])   # scored positions stop before a row's last token
        if keep_layers is None:
            keep_layers = sum(oracle._layer_bytes(i) for i in range(self.fam.n_layers)) <= KEEP_LAYERS_BYTES
        self.keep = keep_layers
        self._layers: dict[int, object] = {}
        self.inputs: list[list[torch.Tensor]] = []      # inputs[i][b]: layer i's input of batch b
        self.states_in: list[list] = []                  # states_in[i][b]: the pass state layer i got (new_pass_state)
        self.final_states: list = []
        self.ref_logits: list[torch.Tensor] = []

    def fetch(self, read):
        return Fetch(read, lambda n: tuple(self.ref.storage(n).shape), self.oracle.device, self.oracle.dtype,
                          taps=self.taps)

    def build_layer(self, i: int, read: Reader):
        """Layer i with its tensors read through `read` and, where `read.tables` has one, that Engram table. Under a
        reference rounding (numerics "deepseek"), the layer is built with it bound to the variant's storage."""
        rounding = getattr(self.fam, "rounding", None)
        if rounding is not None and read.swapped:
            self.fam.rounding = variant_rounding(rounding, self.fam, read)
        try:
            layer = self.fam.load_layer(i, self.fetch(read))
        finally:
            if rounding is not None:
                self.fam.rounding = rounding
        table = read.tables.get(i)
        if table is not None:
            layer.engram.table = table
        return layer

    def ref_layer(self, i: int):
        layer = self._layers.get(i)
        if layer is None:
            layer = self.build_layer(i, Reader(self.ref))
            if self.keep:
                self._layers[i] = layer
        return layer

    def embed(self, read) -> list[torch.Tensor]:
        w = self.fetch(read)(self.fam.embed_name)
        return [self.fam.embed_hook(F.embedding(t, w)) for t in self.ids]

    def call(self, layer, x: torch.Tensor, b: int, state) -> torch.Tensor:
        return layer(x.clone(), _slice_rope(self.rope, x.shape[1]), *layer_call_args(self.fam, self.ids[b], state))

    def new_states(self) -> list:
        """A fresh pass state per batch (Family.new_pass_state; None for families without one)."""
        return [self.fam.new_pass_state() for _ in self.ids]

    def logits(self, xs: list[torch.Tensor], read, states: list) -> list[torch.Tensor]:
        """The final norm and head (read through `read`) at the scored positions of each batch: [n, vocab] float32."""
        fetch = self.fetch(read)
        norm, head = fetch(self.fam.norm_name), fetch(self.fam.head_name)
        out = []
        for x, pos, state in zip(xs, self.scored, states):
            h = rms_norm(self.fam.final_hook(x, fetch, state), norm, self.fam.rms_norm_eps)
            h = h.reshape(-1, h.shape[-1])[pos]
            logits = torch.empty(h.shape[0], head.shape[0], dtype=self.oracle.dtype, device=self.oracle.device)
            self.oracle._head_blocks(h, head, logits)
            out.append(logits.float().cpu())
        return out

    def reference_pass(self, recorder=None, keep_outputs: bool = False, engram_access=None, keep_inputs: bool = True,
                       each_output: Callable[[int, list], None] | None = None) -> list[list[torch.Tensor]]:
        """The oracle's pass over its own pack (logits in `ref_logits`), keeping each layer's input and pass state for
        re-runs (`keep_inputs`); `each_output(i, xs)` sees the embeddings (i = -1) and each layer's output."""
        xs = self.embed(Reader(self.ref))
        if each_output is not None:
            each_output(-1, xs)
        states = self.new_states()
        outputs = []
        for i in range(self.fam.n_layers):
            if keep_inputs:
                self.inputs.append(xs)
                self.states_in.append([copy.copy(s) for s in states])   # a re-run from layer i starts from these
            layer = self.ref_layer(i)
            if recorder is not None:
                recorder.current_layer = i
            self.taps.engram_access = engram_access     # V4.1 Engram layers count their rows on this pass only
            try:
                xs = self._with_recorder(layer, xs, recorder, states)
            finally:
                self.taps.engram_access = None
            if keep_outputs:
                outputs.append(xs)
            if each_output is not None:
                each_output(i, xs)
        self.final, self.final_states = xs, states
        self.ref_logits = self.logits(xs, Reader(self.ref), states)
        return outputs

    def _with_recorder(self, layer, xs, recorder, states):
        self.taps.expert_outputs = recorder
        try:
            return [self.call(layer, x, b, state) for b, (x, state) in enumerate(zip(xs, states))]
        finally:
            self.taps.expert_outputs = None

    def run(self, start: int, build: Callable[[int], object | None] | None = None, read_head=None,
            recorder=None, each_output: Callable[[int, list], None] | None = None,
            embed_read=None, xs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Logits of a variant: from the embeddings (start -1, read through `embed_read`), a layer's kept input (or
        `xs` in its place), or the final hidden states (start = n_layers). `build(i)` gives layer i's replacement or
        None for the reference's."""
        n = self.fam.n_layers
        if start < 0:
            xs = xs if xs is not None else self.embed(embed_read or Reader(self.ref))
            states, start = self.new_states(), 0
        else:   # the reference pass's input (or xs in its place) and its pass state there
            at_end = start >= n
            xs = xs if xs is not None else self.final if at_end else self.inputs[start]
            states = [copy.copy(s) for s in (self.final_states if at_end else self.states_in[start])]
        for i in range(start, n):
            layer = (build(i) if build else None) or self.ref_layer(i)
            if recorder is not None:
                recorder.current_layer = i
            xs = self._with_recorder(layer, xs, recorder, states)
            if each_output is not None:
                each_output(i, xs)
        return self.logits(xs, read_head or Reader(self.ref), states)

    def kld(self, logits: list[torch.Tensor]) -> float:
        return self.kld_rows(logits)[0]

    def kld_rows(self, logits: list[torch.Tensor]) -> tuple[float, np.ndarray]:
        """(mean KL over the scored positions, each row's sum of KL over its scored positions)."""
        if all(torch.equal(r, q) for r, q in zip(self.ref_logits, logits)):
            return 0.0, np.zeros(self.n_rows)   # the same distributions (exp/log rounding leaves ~1e-16 per position)
        pm = [position_metrics(r, q, t, kernel=self.kernel) for r, q, t in zip(self.ref_logits, logits, self.targets)]
        k = torch.cat([p.kld for p in pm])
        sums = torch.zeros(self.n_rows, dtype=torch.float64).index_add_(0, torch.cat(self.row_of), k.double())
        return float(k.mean()), sums.numpy()
