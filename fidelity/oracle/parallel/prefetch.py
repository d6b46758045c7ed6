"""Layer prefetch: layer i+1 loads on a loader thread while layer i computes; stored bytes staged ahead."""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ...errors import FidelityError
from ...packs.exl3.layouts import routed_expert

@dataclass
class LayerTiming:
    """One layer through the prefetcher: seconds its stored bytes took to stage and its build (decode included) took
    on the loader thread, and the seconds the compute thread waited for it (its visible load time)."""

    layer: int
    staged_bytes: int = 0
    unstaged_bytes: int = 0     # stored bytes of its tensors left to be read at decode time (over the staging budget)
    stage_s: float = 0.0
    build_s: float = 0.0
    wait_s: float = 0.0


# Tensors larger than this are not read ahead (their decode reads the file): tables read row by row, such as
# DeepSeek-V4.1's Engram embeddings, would otherwise be copied whole.
STAGE_MAX_TENSOR_BYTES = 1 << 30
STAGE_HOST_FRACTION = 0.5    # default staging budget: this share of the host memory available when a prefetcher starts


def available_host_bytes() -> int:
    """Host memory available now: MemAvailable of /proc/meminfo (Linux: free plus reclaimable page cache), else the
    free physical pages; 0 when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def held_host_bytes(nbytes: int, pin: bool) -> int:
    """Host bytes a staged copy of `nbytes` takes: torch's pinned (caching host) allocator rounds each block up to a
    power of two, so a pinned copy is counted at that size."""
    return 1 << max(0, nbytes - 1).bit_length() if pin and nbytes > 0 else nbytes


class Prefetcher:
    """The load chain's prefetch stage (`Oracle(pack, chain=LoadChain(prefetch=Prefetcher))`, `partial(Prefetcher,
    stage=True)` to stage on the CPU too): handing out layer i starts loading layer i+1 in a background thread.

    Loading a layer, on the loader thread: stage (when `stage`: every stored tensor of the layer, routed experts too,
    read from the memory-mapped files into host memory, pinned for CUDA, by `pack.stage`), then build (the rest of the
    chain, `oracle.build_layer`: cache, shards, read, decode, layer transforms; each tensor decodes from the staged
    bytes on the oracle's device, on a side stream on CUDA). Experts decode when a token first routes to them, on the
    compute thread, from bytes already staged (a MoE call's new experts in batches, RoutedExperts.read_ahead). A layer's
    staged bytes are released once the next layer is handed out (the last layer's when the next pass starts).
    Device-independent: the CPU runs the same steps (no pinning, no streams). `timeline` records a LayerTiming per load.

    Host memory: at most two layers' staged bytes are held (the computing layer's, whose experts still decode from
    them, and the next one's), and together they never exceed `budget_bytes` (default, and where `load_chain` passes
    RunSettings.stage_budget_bytes None: STAGE_HOST_FRACTION of the host memory available at the start; pinned copies
    counted as the allocator rounds them). A layer stages at most half the budget, routed experts first (they decode
    on the compute thread, where a file read would be visible); what does not fit is read from the file when it
    decodes (same bytes, same numbers)."""

    def __init__(self, oracle, stage: bool | None = None, budget_bytes: int | None = None):
        self.oracle, self.load = oracle, oracle.build_layer
        self.n_layers = oracle.family.n_layers
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fidelity-prefetch")
        self.pending: dict[int, object] = {}
        self.failed: int | None = None
        cuda = oracle.device.type == "cuda"
        self.stream = torch.cuda.Stream(oracle.device) if cuda else None
        self.stage = cuda if stage is None else stage
        self.pin = cuda
        self.staged: dict[int, list] = {}           # layer -> keys of its staged bytes (for pack.unstage)
        self.staged_host_bytes: dict[int, int] = {}  # layer -> host bytes its staged copies hold
        if budget_bytes is None:
            budget_bytes = STAGE_HOST_FRACTION * available_host_bytes()
        if not budget_bytes >= 0:
            raise FidelityError(f"the staging budget must be >= 0 bytes, not {budget_bytes!r}")
        self.budget_bytes = int(budget_bytes)
        self.lock = threading.Lock()
        self.timeline: deque[LayerTiming] = deque(maxlen=100_000)

    def stage_names(self, i: int) -> list[str]:
        """Layer i's tensors this process decodes: under sharded loads not the shares other ranks read, under expert
        parallelism not the experts other ranks own."""
        oracle, pack = self.oracle, self.oracle.pack
        names = [
            n for n in oracle.family.layer_names(i) if n in pack and pack.storage(n).nbytes <= STAGE_MAX_TENSOR_BYTES
        ]
        sharded = oracle.shards
        if sharded is not None:
            shared, owners = sharded.plan(i)
            others = {n for n, o in zip(shared, owners) if o != sharded.group.rank}
            names = [n for n in names if n not in others]
        parallel = oracle.fetch.expert_parallel
        if parallel is not None:
            experts = {n: e[2] for n in names if (e := routed_expert(n)) is not None}
            if experts:
                n_experts = max(experts.values()) + 1
                names = [
                    n for n in names if n not in experts or parallel.owner(experts[n], n_experts) == parallel.group.rank
                ]
        return names

    def within_budget(self, names: list[str]) -> tuple[list[str], int]:
        """The names to stage now (in their order) and the stored bytes left out: routed experts first, then the rest,
        each taken if it fits in min(half the budget, the budget less what other layers hold)."""
        storage = self.oracle.pack.storage
        with self.lock:
            held = sum(b for j, b in self.staged_host_bytes.items())
        room = min(self.budget_bytes // 2, self.budget_bytes - held)
        taken, left_out = set(), 0
        for n in sorted(names, key=lambda n: routed_expert(n) is None):     # stable: experts, then the rest
            cost = held_host_bytes(storage(n).nbytes, self.pin)
            if cost <= room:
                taken.add(n)
                room -= cost
            else:
                left_out += storage(n).nbytes
        return [n for n in names if n in taken], left_out

    def _load(self, i: int):
        if self.failed is not None:  # loads already queued behind a failed one must not run (nor exchange anything)
            raise FidelityError(f"layer {i} was not loaded: loading layer {self.failed} failed first")
        timing = LayerTiming(i)
        try:
            t0 = time.perf_counter()
            if self.stage and i not in self.staged:
                names, timing.unstaged_bytes = self.within_budget(self.stage_names(i))
                keys = self.oracle.pack.stage(names, pin=self.pin)
                nbytes = [self.oracle.pack.storage(n).nbytes for n in names]
                with self.lock:
                    self.staged[i] = keys
                    self.staged_host_bytes[i] = sum(held_host_bytes(b, self.pin) for b in nbytes)
                timing.staged_bytes = sum(nbytes)
            t1 = time.perf_counter()
            if self.stream is None:
                layer = self.load(i)
            else:
                with torch.cuda.stream(self.stream):
                    layer = self.load(i)
                self.stream.synchronize()  # weights complete before another stream reads them
            timing.stage_s, timing.build_s = t1 - t0, time.perf_counter() - t1
            with self.lock:   # the caller reads the timeline while layer i+1 loads
                self.timeline.append(timing)
            return layer
        except BaseException:
            self.failed = i
            raise

    def release(self, keep: int | None) -> None:
        """Release the staged bytes of every layer but `keep` (None: all)."""
        with self.lock:
            done = {j: self.staged.pop(j) for j in list(self.staged) if j != keep}
        for keys in done.values():
            self.oracle.pack.unstage(keys)
        with self.lock:                     # counted until released, so the loader never overshoots the budget
            for j in done:
                self.staged_host_bytes.pop(j, None)

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
        with self.lock:   # the loader thread appended layer i's before returning it, and may be appending i+1's
            for timing in reversed(self.timeline):
                if timing.layer == i:
                    timing.wait_s = wait
                    break
        return layer
