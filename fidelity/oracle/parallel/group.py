"""This process's place in a distributed run (torchrun): rank, world size, settings, and store-based checkpoints that
name a rank that died, hung or raised."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ...errors import FidelityError

STORE_PREFIX = "fidelity"
HEARTBEAT_S = 1.0


class RankFailed(FidelityError):
    """Another rank of a distributed run died, hung or raised."""


@dataclass(frozen=True)
class RunSettings:
    """How `load_chain` and `make_oracle` spread and stage the oracle's work, passed in (the command line fills it from
    its flags and FIDELITY_* variables, fidelity/environment.py); the defaults are an empty environment's."""

    parallel: str = "rows"                   # "rows" or "experts" (under torchrun)
    prefetch: bool = True                    # layer i+1 loads while layer i computes (False: one layer resident)
    shard_loads: bool = True                 # row parallel: each rank reads 1/N of a layer, the rest broadcast
    # host bytes the prefetcher may hold read ahead (None: STAGE_HOST_FRACTION of the memory available at its start)
    stage_budget_bytes: float | None = None
    stale_s: float = 120.0                   # a rank without a heartbeat this long has failed
    timeout_s: float | None = None           # the longest a checkpoint waits for the other ranks (None: no limit)
    activation_budget_bytes: int | None = None   # Oracle(activation_budget=) where the caller gives none

    def __post_init__(self):
        if self.parallel not in ("rows", "experts"):
            raise FidelityError(f"parallel must be 'rows' or 'experts', not {self.parallel!r}")
        for name in ("stale_s", "timeout_s", "stage_budget_bytes", "activation_budget_bytes"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise FidelityError(f"RunSettings.{name}={value!r}: expected a number >= 0")


def launched() -> bool:
    """True when this process is one rank of several (torchrun or an env:// launcher set WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class Group:
    """This process's view of the run: rank, world size, backend, and store-based checkpoints with failure detection."""

    def __init__(self, device: str | torch.device = "cpu", timeout_s: float = 1800.0,
                 settings: RunSettings = RunSettings()):
        self.dist = dist
        self.settings = settings
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
        checkpoints (the prefetch thread's layer exchanges use their own, so they never interleave with the main
        one's)."""
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
                if self.settings.timeout_s is not None and now - started > self.settings.timeout_s:
                    missing = self._missing(here)
                    raise RankFailed(f"rank(s) {missing} did not reach {what} within {self.settings.timeout_s:.0f} s "
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
            elif now - since > self.settings.stale_s:
                raise RankFailed(f"rank {r} stopped responding before {what} (no heartbeat for {now - since:.0f} s, "
                                 f"FIDELITY_DIST_STALE_S={self.settings.stale_s:g}): it died or hangs; see its log or "
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
        deadline = time.monotonic() + self.settings.stale_s + 3 * HEARTBEAT_S
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


def current_group(device: str | torch.device = "cpu", settings: RunSettings | None = None) -> Group | None:
    """The run's Group (created, and the process group initialised, on first call), or None in a single process. The
    process group is one per process, so the Group is too: `settings` (its stale_s / timeout_s), where given, are
    the ones it keeps from then on (each oracle `make_oracle` builds gives its own)."""
    global _GROUP
    if _GROUP is None and launched():
        _GROUP = Group(device, settings=settings or RunSettings())
    elif _GROUP is not None and settings is not None:
        _GROUP.settings = settings
    return _GROUP


def is_main() -> bool:
    """Rank 0, or a single process: the one that prints and writes results."""
    return int(os.environ.get("RANK", "0")) == 0


def local_device(device: str | torch.device) -> torch.device:
    """`cuda` means this rank's GPU (LOCAL_RANK) under a launcher; anything else is returned as is."""
    g = current_group(device)
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
