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

Layer prefetch: `prefetch(oracle)` loads layer i+1 in a background thread while layer i computes (behind the oracle's
`load_layer` seam; on CUDA on a side stream, synchronised before hand-over), the sharded exchange included: the layer's
stored bytes are read into pinned host memory, sent as stored bytes, and decoded on the device (`Prefetcher`).
"""
from __future__ import annotations

import math
import os
import re
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from .errors import FidelityError
from .oracle.common import Fetch
from .packs.exl3_layouts import routed_expert

STORE_PREFIX = "fidelity"
HEARTBEAT_S = 1.0


class RankFailed(FidelityError):
    """Another rank of a distributed run died, hung or raised."""


def _env_float(name: str, default: float | None) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else default


@dataclass
class Settings:
    parallel: str = "rows"                   # "rows" or "experts"
    stale_s: float = field(default_factory=lambda: _env_float("FIDELITY_DIST_STALE_S", 120.0))
    timeout_s: float | None = field(default_factory=lambda: _env_float("FIDELITY_DIST_TIMEOUT_S", None))
    prefetch: bool = field(default_factory=lambda: os.environ.get("FIDELITY_PREFETCH", "1") != "0")
    shard_loads: bool = field(default_factory=lambda: os.environ.get("FIDELITY_SHARD_LOADS", "1") != "0")


SETTINGS = Settings()


def configure(**kwargs) -> Settings:
    """Set how `parallelize` spreads the work (`parallel="rows"|"experts"`, `prefetch=`, `shard_loads=`, `stale_s=`,
    `timeout_s=`)."""
    for key in kwargs:
        if not hasattr(SETTINGS, key):
            raise FidelityError(f"unknown distributed setting {key!r}")
    if kwargs.get("parallel", "rows") not in ("rows", "experts"):
        raise FidelityError(f"parallel must be 'rows' or 'experts', not {kwargs['parallel']!r}")
    for key, value in kwargs.items():
        setattr(SETTINGS, key, value)
    return SETTINGS


def launched() -> bool:
    """True when this process is one rank of several (torchrun or an env:// launcher set WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class Group:
    """This process's view of the run: rank, world size, backend, and store-based checkpoints with failure detection."""

    def __init__(self, device: str | torch.device = "cpu", timeout_s: float = 1800.0):
        import torch.distributed as dist

        self.dist = dist
        try:
            self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        except (KeyError, ValueError) as e:
            raise FidelityError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} asks for a distributed run but RANK is "
                                f"missing or not a number ({e}); launch with torchrun") from None
        requested = torch.device(device)
        if requested.type == "cuda":
            self.device = torch.device("cuda", self.local_rank if requested.index is None else requested.index)
            torch.cuda.set_device(self.device)
            self.backend = "nccl"
        else:
            self.device, self.backend = requested, "gloo"
        if not dist.is_initialized():
            try:
                dist.init_process_group(self.backend, timeout=timedelta(seconds=timeout_s), rank=self.rank,
                                        world_size=self.world_size)
            except Exception as e:
                where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
                raise FidelityError(f"rank {self.rank} of {self.world_size} could not join the {self.backend} process "
                                    f"group at MASTER_ADDR:MASTER_PORT={where}: {e}") from None
        self.store = dist.distributed_c10d._get_default_store()
        self._steps: dict[str, int] = {}
        self._stop = threading.Event()
        self._beats: dict[int, tuple[int, float]] = {}
        self._heart = threading.Thread(target=self._heartbeat, daemon=True, name=f"fidelity-heartbeat-{self.rank}")
        self._heart.start()

    # -- liveness ------------------------------------------------------------------------------------------
    def _key(self, *parts) -> str:
        return "/".join([STORE_PREFIX, *map(str, parts)])

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.store.add(self._key("beat", self.rank), 1)
            except Exception:   # the store's host is gone; the main thread reports it at its next checkpoint
                return

    def post_error(self, message: str) -> None:
        """Tell the other ranks why this one is about to stop (best effort; the first reason posted stays)."""
        try:
            if not self.store.check([self._key("error", self.rank)]):
                self.store.set(self._key("error", self.rank), message)
        except Exception:
            pass

    def _store_call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:
            raise RankFailed(f"rank {self.rank} lost the distributed store (hosted by rank 0 or the torchrun agent): "
                             f"{e}; rank 0 or the launcher probably died, no result was written") from None

    def checkpoint(self, what: str, channel: str = "main") -> None:
        """Wait until every rank reaches this point. Raises RankFailed naming a rank that posted an error, stopped its
        heartbeat for `stale_s` seconds, or (with `timeout_s`) did not arrive in time. Each channel counts its own
        checkpoints (the prefetch thread's layer exchanges use their own, so they never interleave with the main one's)."""
        step = self._steps[channel] = self._steps.get(channel, 0) + 1
        place = (step,) if channel == "main" else (channel, step)
        here = [self._key("at", *place, r) for r in range(self.world_size)]
        self._store_call(self.store.set, here[self.rank], "1")
        started, pause = time.monotonic(), 0.001
        last_look = 0.0
        while not self._store_call(self.store.check, here):
            now = time.monotonic()
            if now - last_look >= HEARTBEAT_S:
                last_look = now
                self._look_for_failures(what, self._missing(here), now)
                if SETTINGS.timeout_s is not None and now - started > SETTINGS.timeout_s:
                    missing = self._missing(here)
                    raise RankFailed(f"rank(s) {missing} did not reach {what} within {SETTINGS.timeout_s:.0f} s "
                                     f"(FIDELITY_DIST_TIMEOUT_S); the run is abandoned, no result was written")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def _missing(self, here: list[str]) -> list[int]:
        return [r for r, key in enumerate(here) if not self._store_call(self.store.check, [key])]

    def _others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _look_for_failures(self, what: str, ranks: list[int], now: float) -> None:
        for r in ranks:
            if self._store_call(self.store.check, [self._key("error", r)]):
                message = self._store_call(self.store.get, self._key("error", r)).decode(errors="replace")
                raise RankFailed(f"rank {r} failed before {what}: {message}")
            beats = self._store_call(self.store.add, self._key("beat", r), 0)
            seen, since = self._beats.get(r, (None, now))
            if beats != seen:
                self._beats[r] = (beats, now)
            elif now - since > SETTINGS.stale_s:
                raise RankFailed(f"rank {r} stopped responding before {what} (no heartbeat for {now - since:.0f} s, "
                                 f"FIDELITY_DIST_STALE_S={SETTINGS.stale_s:g}): it died or hangs; see its log or "
                                 f"torchrun's failure summary. The run is abandoned, no result was written")

    def watch(self, what: str, done) -> None:
        """Poll `done()` until true, naming another rank that fails meanwhile (a dead peer leaves an NCCL collective
        pending forever; this turns that into RankFailed after `stale_s`)."""
        pause, last_look = 0.0001, time.monotonic()
        while not done():
            now = time.monotonic()
            if now - last_look >= HEARTBEAT_S:
                last_look = now
                try:
                    self._look_for_failures(what, self._others(), now)
                except RankFailed:
                    # At once: the pending NCCL kernel never ends, and CUDA's lazy loading of a kernel the compute
                    # thread launches for the first time waits for every running kernel, so the compute would hang.
                    self.abort()
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.0005)

    def diagnose(self, what: str, error: BaseException) -> None:
        """A collective raised (gloo notices a peer that died): name the rank that failed if one did, else the error."""
        deadline = time.monotonic() + SETTINGS.stale_s + 3 * HEARTBEAT_S
        while time.monotonic() < deadline:
            self._look_for_failures(what, self._others(), time.monotonic())
            time.sleep(HEARTBEAT_S / 4)
        raise RankFailed(f"rank {self.rank}: {what} failed ({type(error).__name__}: {error}) and no other rank "
                         f"reported why; the run is abandoned, no result was written")

    # -- collectives ---------------------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """In place on the backend's device; a CPU tensor under NCCL travels through the GPU and comes back."""
        if self.backend == "nccl" and tensor.device.type != "cuda":
            staged = tensor.to(self.device)
            self.dist.broadcast(staged, src=src)
            if self.rank != src:
                tensor.copy_(staged)
            return tensor
        self.dist.broadcast(tensor, src=src)
        return tensor

    def broadcast_all(self, what: str, items: list[tuple[torch.Tensor, int]]) -> None:
        """Broadcast each (tensor, source rank), in place, in list order (the same on every rank), and wait for all
        of them on this thread's stream while watching the other ranks."""
        try:
            works = [self.dist.broadcast(t, src=src, async_op=True) for t, src in items]
            for w in works:
                w.wait()  # gloo: until done (raises if a peer vanished); NCCL: this stream waits for the copies
        except Exception as e:
            self.diagnose(what, e)
        if self.backend == "nccl":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.watch(what, done.query)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.dist.all_reduce(tensor, op=self.dist.ReduceOp.SUM)
        return tensor

    def close(self, failed: bool = False) -> None:
        self._stop.set()
        if not self.dist.is_initialized():  # never joined, or aborted after a failure
            return
        if failed and self.backend == "nccl":  # a collective may be pending on a dead peer: destroying would wait
            self.abort()
        else:
            self.dist.destroy_process_group()

    def abort(self) -> None:
        """Tear the NCCL communicators down without waiting for pending collectives (they end with it)."""
        try:
            if self.dist.is_initialized():
                self.dist.distributed_c10d._abort_process_group()
        except Exception:  # already aborted, or this torch has no abort: exiting ends the process group as well
            pass


_GROUP: Group | None = None


def group(device: str | torch.device = "cpu") -> Group | None:
    """The run's Group (created, and the process group initialised, on first call), or None in a single process."""
    global _GROUP
    if _GROUP is None and launched():
        _GROUP = Group(device)
    return _GROUP


def is_main() -> bool:
    """Rank 0, or a single process: the one that prints and writes results."""
    return int(os.environ.get("RANK", "0")) == 0


def local_device(device: str | torch.device) -> torch.device:
    """`cuda` means this rank's GPU (LOCAL_RANK) under a launcher; anything else is returned as is."""
    g = group(device)
    return g.device if g is not None else torch.device(device)


def finish(error: BaseException | None = None) -> None:
    """End the run: post this rank's error (so others name it), wait for everyone on success, tear the group down."""
    global _GROUP
    g, _GROUP = _GROUP, None
    if g is None:
        return
    failed = error is not None
    try:
        if failed:
            g.post_error(f"{type(error).__name__}: {error}")
        else:
            g.checkpoint("the end of the run")
    except BaseException:
        failed = True
        raise
    finally:
        g.close(failed=failed)


# -- row parallel ------------------------------------------------------------------------------------------------

def deal(batches: list[list[int]], lengths: list[int], world_size: int) -> list[int]:
    """Owner rank of each batch: largest batches (in tokens) first, each to the least-loaded rank (lowest on ties)."""
    load = [0] * world_size
    owner = [0] * len(batches)
    sizes = [len(b) * lengths[b[0]] for b in batches]
    for b in sorted(range(len(batches)), key=lambda b: (-sizes[b], b)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[b], load[r] = r, load[r] + sizes[b]
    return owner


class RowParallel:
    """An Oracle whose `hidden_states` and `logits` split the row batches across ranks; everything else delegates."""

    def __init__(self, oracle, g: Group):
        self.oracle, self.group = oracle, g

    def __getattr__(self, name):
        return getattr(self.oracle, name)

    def _plan(self, rows) -> tuple[list[list[int]], list[int], list[int]]:
        tensors = [self.oracle._validate_row(r, i) for i, r in enumerate(rows)]
        lengths = [len(t) for t in tensors]
        batches = self.oracle._batches(tensors)
        return batches, deal(batches, lengths, self.group.world_size), lengths

    def _local(self, rows, batches, owner, lengths, progress: bool) -> dict[int, torch.Tensor]:
        """Hidden states of this rank's rows. Its batches keep their global order, so the oracle regroups them into
        exactly the same batches (only a length's last batch is partial, and it stays last). Rope tables are built
        for the longest row of all ranks, as one process builds them: an elementwise kernel may round the tail of a
        tensor differently from its vectorised body, so a shorter table could differ in the last ulp."""
        g = self.group
        mine = [i for b, o in zip(batches, owner) if o == g.rank for i in b]
        family = self.oracle.family
        own_tables = vars(family).get("rope_tables")
        build = family.rope_tables
        family.rope_tables = lambda length, dtype, device: build(max(lengths, default=length), dtype, device)
        try:
            if mine:
                hidden = self.oracle.hidden_states([rows[i] for i in mine], progress=progress and g.rank == 0)
            else:
                hidden = []
                if getattr(self.oracle, "sharded_loads", None) is not None:  # no rows here, but its share is needed
                    for i in range(family.n_layers):
                        self.oracle.load_layer(i)
        except RankFailed:
            raise
        except FidelityError as e:  # the oracle counted this rank's rows; name them as the caller numbers them
            message = re.sub(r"\brow (\d+)", lambda m: f"row {mine[int(m.group(1))]}", str(e))
            g.post_error(message)
            raise FidelityError(f"rank {g.rank}: {message}") from None
        finally:
            if own_tables is None:
                del family.rope_tables
            else:
                family.rope_tables = own_tables
        return dict(zip(mine, hidden))

    def hidden_states(self, rows, progress: bool = True) -> list[torch.Tensor]:
        g = self.group
        batches, owner, lengths = self._plan(rows)
        local = self._local(rows, batches, owner, lengths, progress)
        g.checkpoint("the exchange of hidden states")
        out: list[torch.Tensor | None] = [None] * len(rows)
        for b, o in zip(batches, owner):
            if o == g.rank:
                buf = torch.stack([local[i] for i in b])
            else:
                buf = torch.empty(len(b), lengths[b[0]], self.oracle.family.hidden_size, dtype=self.oracle.dtype,
                                  device=self.oracle.device)
            g.broadcast(buf, src=o)
            for j, i in enumerate(b):
                out[i] = buf[j]
        return out

    def logits(self, tokens: torch.Tensor, progress: bool = False) -> torch.Tensor:
        """As Oracle.logits: each rank applies the head to its own batches (same shapes as one process), then the
        logits are broadcast batch by batch."""
        if tokens.dim() != 2:
            raise FidelityError(f"tokens must be a [batch, length] tensor, got shape {list(tokens.shape)}")
        g = self.group
        rows = tokens.tolist()
        batches, owner, lengths = self._plan(rows)
        local = self._local(rows, batches, owner, lengths, progress)
        B, T = tokens.shape
        vocab = self.oracle.head_weight().shape[0] if B * T else self.oracle.family.vocab_size
        out = torch.empty(B, T, vocab, dtype=self.oracle.dtype)
        for b, o in zip(batches, owner):
            if o == g.rank:
                self.oracle._head_into(torch.stack([local[i] for i in b]), out[b[0]:b[-1] + 1])
        g.checkpoint("the exchange of logits")
        for b, o in zip(batches, owner):
            g.broadcast(out[b[0]:b[-1] + 1], src=o)
        return out


# -- sharded layer loads ---------------------------------------------------------------------------------------

def deal_tensors(sizes: list[int], world_size: int) -> list[int]:
    """Reader rank of each tensor: largest first, each to the least-loaded rank (lowest on ties)."""
    load = [0] * world_size
    owner = [0] * len(sizes)
    for t in sorted(range(len(sizes)), key=lambda t: (-sizes[t], t)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[t], load[r] = r, load[r] + sizes[t]
    return owner


class ShardedFetch(Fetch):
    """The oracle's Fetch, except that tensors already exchanged for the layer being built come from `ready`."""

    def __init__(self, fetch: Fetch):
        self.__dict__.update(vars(fetch))
        self.ready: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        t = self.ready.pop(name, None)
        return super().__call__(name) if t is None else t


class ShardedLoads:
    """Wraps a `load_layer`: before layer i is built, this rank reads its share of the layer's tensors (routed experts
    excepted: they are read only when a token routes to them), every share is broadcast, and the layer is built from
    the exchanged tensors. Every rank must load the same layers in the same order (row parallel does)."""

    def __init__(self, oracle, g: Group, load):
        self.oracle, self.group, self.load = oracle, g, load

    def plan(self, i: int) -> tuple[list[str], list[int]]:
        fetch = self.oracle.fetch
        names = [n for n in self.oracle.family.layer_names(i) if ".experts." not in n and fetch.shape_of
                 and len(fetch.shape_of(n)) > 0]
        sizes = [math.prod(fetch.shape_of(n)) for n in names]
        return names, deal_tensors(sizes, self.group.world_size)

    def __call__(self, i: int):
        oracle, g = self.oracle, self.group
        if i in getattr(oracle, "_layers", {}):  # keep_weights: built once already, on every rank alike
            return self.load(i)
        fetch: ShardedFetch = oracle.fetch
        names, owners = self.plan(i)
        mine = {n: fetch(n) for n, o in zip(names, owners) if o == g.rank}
        ready = {n: mine[n] if o == g.rank else torch.empty(fetch.shape_of(n), device=fetch.device, dtype=fetch.dtype)
                 for n, o in zip(names, owners)}
        what = f"the exchange of layer {i}'s weights"
        if g.backend != "nccl":  # gloo blocks inside the collective: first make sure every share was read. NCCL's
            g.checkpoint(what, channel=f"layer{i}")  # wait is watched (broadcast_all), which names a reader that failed
        g.broadcast_all(what, [(ready[n], o) for n, o in zip(names, owners)])
        fetch.ready.update(ready)
        del mine, ready
        try:
            return self.load(i)
        finally:
            for n in names:  # any the family did not ask for
                fetch.ready.pop(n, None)


def shard_loads(oracle, g: Group):
    """The same oracle, each layer read 1/N per rank and exchanged (numbers unchanged). Before or after `prefetch`."""
    if getattr(oracle, "sharded_loads", None) is None:
        oracle.fetch = ShardedFetch(oracle.fetch)
        current = oracle.__dict__.get("load_layer")
        if isinstance(current, Prefetcher):
            current.load = oracle.sharded_loads = ShardedLoads(oracle, g, current.load)
        else:
            oracle.load_layer = oracle.sharded_loads = ShardedLoads(oracle, g, oracle.load_layer)
    return oracle


# -- expert parallel ---------------------------------------------------------------------------------------------

class ExpertParallel:
    """Plugged into `oracle.fetch.expert_parallel`; `RoutedExperts` hands its call to `combine`."""

    def __init__(self, g: Group):
        self.group = g

    def owner(self, expert: int, n_experts: int) -> int:
        """Contiguous blocks of experts per rank."""
        return expert * self.group.world_size // n_experts

    def combine(self, experts, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Same result, bit for bit, as RoutedExperts.__call__ in one process: out = 0, then each token's weighted
        expert outputs added in ascending expert order. Slot j of a token holds its j-th smallest expert's output;
        only that expert's owner writes it, so the all_reduce adds zeros to it and changes nothing."""
        g = self.group
        N, k = indices.shape
        slots = x.new_zeros(N, k, x.shape[-1])
        for e in torch.unique(indices).tolist():
            if self.owner(e, experts.n_experts) != g.rank:
                continue
            token, slot = torch.where(indices == e)
            y = experts.expert(e)(x[token]) * weights[token, slot, None]
            order = (indices[token] < e).sum(dim=1)  # e's position among the token's experts, ascending
            slots[token, order] = y
        g.checkpoint("an expert exchange")
        g.all_reduce_sum(slots)
        out = torch.zeros_like(x)
        for j in range(k):
            out += slots[:, j]
        return out


# -- layer prefetch ----------------------------------------------------------------------------------------------

@dataclass
class LayerTiming:
    """One layer through the prefetcher: seconds its stored bytes took to stage and its build (decode included) took
    on the loader thread, and the seconds the compute thread waited for it (its visible load time)."""

    layer: int
    staged_bytes: int = 0
    stage_s: float = 0.0
    build_s: float = 0.0
    wait_s: float = 0.0


# Tensors larger than this are not read ahead (their decode reads the file): tables read row by row, such as
# DeepSeek-V4.1's Engram embeddings, would otherwise be copied whole.
STAGE_MAX_TENSOR_BYTES = 1 << 30


class Prefetcher:
    """Wraps an oracle's `load_layer`: handing out layer i starts loading layer i+1 in a background thread.

    Loading a layer, on the loader thread: stage (when `stage`: every stored tensor of the layer, routed experts too,
    read from the memory-mapped files into host memory, pinned for CUDA, by `pack.stage`), then build (the family's
    `load_layer`; each tensor decodes from the staged bytes on the oracle's device, on a side stream on CUDA). Experts
    decode when a token first routes to them, on the compute thread, from bytes already staged. A layer's staged bytes
    are released once the next layer is handed out (the last layer's when the next pass starts). Device-independent:
    the CPU runs the same steps (no pinning, no streams). `timeline` records a LayerTiming per load."""

    def __init__(self, oracle, stage: bool | None = None):
        self.oracle, self.load = oracle, oracle.load_layer
        self.n_layers = oracle.family.n_layers
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fidelity-prefetch")
        self.pending: dict[int, object] = {}
        self.failed: int | None = None
        cuda = oracle.device.type == "cuda"
        self.stream = torch.cuda.Stream(oracle.device) if cuda else None
        self.stage = cuda if stage is None else stage
        self.pin = cuda
        self.staged: dict[int, list] = {}           # layer -> keys of its staged bytes (for pack.unstage)
        self.lock = threading.Lock()
        self.timeline: deque[LayerTiming] = deque(maxlen=100_000)

    def stage_names(self, i: int) -> list[str]:
        """Layer i's tensors this process decodes: under sharded loads not the shares other ranks read, under expert
        parallelism not the experts other ranks own."""
        oracle, pack = self.oracle, self.oracle.pack
        names = [n for n in oracle.family.layer_names(i) if n in pack and pack.storage(n).nbytes <= STAGE_MAX_TENSOR_BYTES]
        sharded = getattr(oracle, "sharded_loads", None)
        if sharded is not None:
            shared, owners = sharded.plan(i)
            others = {n for n, o in zip(shared, owners) if o != sharded.group.rank}
            names = [n for n in names if n not in others]
        parallel = getattr(oracle.fetch, "expert_parallel", None)
        if parallel is not None:
            experts = {n: e[2] for n in names if (e := routed_expert(n)) is not None}
            if experts:
                n_experts = max(experts.values()) + 1
                names = [n for n in names if n not in experts or parallel.owner(experts[n], n_experts) == parallel.group.rank]
        return names

    def _load(self, i: int):
        if self.failed is not None:  # loads already queued behind a failed one must not run (nor exchange anything)
            raise FidelityError(f"layer {i} was not loaded: loading layer {self.failed} failed first")
        timing = LayerTiming(i)
        try:
            t0 = time.perf_counter()
            if self.stage and i not in self.staged:
                names = self.stage_names(i)
                keys = self.oracle.pack.stage(names, pin=self.pin)
                with self.lock:
                    self.staged[i] = keys
                timing.staged_bytes = sum(self.oracle.pack.storage(n).nbytes for n in names)
            t1 = time.perf_counter()
            if self.stream is None:
                layer = self.load(i)
            else:
                with torch.cuda.stream(self.stream):
                    layer = self.load(i)
                self.stream.synchronize()  # weights complete before another stream reads them
            timing.stage_s, timing.build_s = t1 - t0, time.perf_counter() - t1
            self.timeline.append(timing)
            return layer
        except BaseException:
            self.failed = i
            raise

    def release(self, keep: int | None) -> None:
        """Release the staged bytes of every layer but `keep` (None: all)."""
        with self.lock:
            done = [self.staged.pop(j) for j in list(self.staged) if j != keep]
        for keys in done:
            self.oracle.pack.unstage(keys)

    def __call__(self, i: int):
        future = self.pending.pop(i, None)
        for stale in list(self.pending):  # a new pass started (the last one stopped early): let its load finish unused
            self.pending.pop(stale).exception()
        if self.stream is not None:
            # Layer i-1's kernels must finish before its freed blocks can be handed to the side stream's next load.
            torch.cuda.current_stream(self.oracle.device).synchronize()
        self.release(keep=i)  # layer i-1 has computed: its experts' bytes are no longer read
        if future is None:  # a pass starts; on the loader thread too: loads run in layer order (sharded loads
            self.failed = None  # exchange in it). The queue is empty here, so the loader thread is idle
            future = self.pool.submit(self._load, i)
        if i + 1 < self.n_layers:
            self.pending[i + 1] = self.pool.submit(self._load, i + 1)
        t0 = time.perf_counter()
        layer = future.result()
        wait = time.perf_counter() - t0
        for timing in reversed(self.timeline):  # the loader thread appended layer i's before returning it
            if timing.layer == i:
                timing.wait_s = wait
                break
        return layer

def prefetch(oracle, stage: bool | None = None):
    """The same oracle, its `load_layer` replaced by a prefetching one (numbers unchanged). `stage`: read each layer's
    stored bytes ahead into host memory (default: on CUDA, pinned)."""
    if not isinstance(oracle.__dict__.get("load_layer"), Prefetcher):
        oracle.load_layer = Prefetcher(oracle, stage=stage)
    return oracle


def parallelize(oracle, parallel: str | None = None):
    """The oracle as this run spreads it: prefetching (unless disabled), and under a launcher row parallel (each layer
    read 1/N per rank unless `shard_loads` is off) or expert parallel."""
    g = group(oracle.device)
    experts = (parallel or SETTINGS.parallel) == "experts"
    if g is not None and not experts and SETTINGS.shard_loads:
        shard_loads(oracle, g)
    if SETTINGS.prefetch:
        prefetch(oracle)
    if g is None:
        return oracle
    if experts:
        oracle.fetch.expert_parallel = ExpertParallel(g)
        return oracle
    return RowParallel(oracle, g)
