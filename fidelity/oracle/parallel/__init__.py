"""The oracle across processes, GPUs and nodes with torch.distributed (launched by `torchrun`).

    torchrun --nproc-per-node N [--nnodes M ...] -m fidelity compare REF PACK ... [--device cuda] [--parallel experts]

Row parallel (default): the oracle's row batches (rows grouped by length, exactly as a single process groups them) are
dealt to ranks; each rank streams every layer for its batches only; results are broadcast batch by batch, so every rank
ends with the same tensors a single process computes (same batch shapes, same kernels, same numbers).

Expert parallel (`parallel="experts"`): every rank runs every row, but a MoE layer's routed experts are split across
ranks (each rank reads only its own experts); per-expert outputs are exchanged with one all_reduce into per-(token,
slot) buffers where exactly one rank contributes a value and the others zeros, then summed in ascending expert order,
exactly as `RoutedExperts` sums them in one process.

Failure: every exchange is preceded by a checkpoint on the process group's store. A rank that raises posts its error
there; a rank that dies stops its heartbeat. The others fail with a message naming that rank instead of waiting on a
collective forever, and nothing is written by rank 0 unless every exchange completed.

Sharded layer loads (row parallel, on by default): every rank needs every layer, but reading, dequantizing and copying
a layer to the GPU is the streaming cost, so each rank does that for about 1/N of the layer's tensors (whole tensors,
dealt largest first) and receives the rest by broadcast from the rank that read them (NVLink between GPUs of one host).
The bits each rank ends with are the reader's, which are the bits it would have read itself: numbers unchanged.

Layer prefetch: `Prefetcher` loads layer i+1 in a background thread while layer i computes (on CUDA on a side
stream, synchronised before hand-over), the sharded exchange included: the layer's stored bytes are read into pinned
host memory, sent as stored bytes, and decoded on the device.

Each of these is a stage of the oracle's declared load chain (`fidelity.oracle.runner.LoadChain`: prefetch, shards,
experts, layer transforms, in that fixed order); `load_chain()` picks the stages a run uses, `make_oracle()` builds
the oracle with them and wraps it for row parallel.
"""
from __future__ import annotations

from functools import partial

from ..runner import LoadChain, Oracle
from .experts import ExpertParallel
from .group import Group, RankFailed, RunSettings, current_group, finish, is_main, launched, local_device
from .prefetch import (STAGE_HOST_FRACTION, STAGE_MAX_TENSOR_BYTES, LayerTiming, Prefetcher, available_host_bytes,
                       held_host_bytes)
from .rows import RowParallel, deal
from .shards import ShardedLoads, deal_tensors

__all__ = [
    "load_chain", "make_oracle", "ExpertParallel", "Group", "RankFailed", "RunSettings", "current_group", "finish",
    "is_main", "launched", "local_device", "STAGE_HOST_FRACTION", "STAGE_MAX_TENSOR_BYTES", "LayerTiming",
    "Prefetcher", "available_host_bytes", "held_host_bytes", "RowParallel", "deal", "ShardedLoads", "deal_tensors",
]


def load_chain(device: str = "cpu", settings: RunSettings = RunSettings(), layer: tuple = ()) -> LoadChain:
    """The load chain a run with `settings` uses: prefetching (unless `settings.prefetch` is off; staging within
    `settings.stage_budget_bytes`), and under a launcher each layer read 1/N per rank (row parallel, unless
    `settings.shard_loads` is off) or the routed experts split across ranks (`settings.parallel == "experts"`);
    `layer`: transforms of every built layer (the noise floor's)."""
    g = current_group(device, settings)
    experts = settings.parallel == "experts"
    return LoadChain(prefetch=partial(Prefetcher, budget_bytes=settings.stage_budget_bytes) if settings.prefetch
                     else None,
                     shards=partial(ShardedLoads, group=g) if g is not None and not experts and settings.shard_loads
                     else None,
                     experts=ExpertParallel(g) if g is not None and experts else None,
                     layer=tuple(layer))


def make_oracle(pack, device: str = "cpu", settings: RunSettings = RunSettings(), layer: tuple = (), **options):
    """An Oracle of `pack` on this rank's device, loading through `load_chain(device, settings, layer)`; under row
    parallel wrapped in RowParallel (each rank computes its own row batches). `options`: the Oracle's (dtype=,
    keep_weights=, ...; `activation_budget` defaults to `settings.activation_budget_bytes`)."""
    device = local_device(device)
    options.setdefault("activation_budget", settings.activation_budget_bytes)
    oracle = Oracle(pack, device=device, chain=load_chain(device, settings, layer), **options)
    g = current_group(device, settings)
    if g is None or settings.parallel == "experts":
        return oracle
    return RowParallel(oracle, g)
