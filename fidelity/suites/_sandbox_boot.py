"""Runs inside the sandbox's namespaces, before the untrusted program: make every mount read-only except a fresh tmpfs work
dir, set resource limits, drop to an unprivileged user, then exec the program. Standard library only (run with `python -I`)."""
import ctypes
import json
import os
import signal
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 8192, 16384, 1 << 18
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
               "relatime": 1 << 21}
SETUP_FAILED = 97

libc = ctypes.CDLL(None, use_errno=True)


def fail(msg):
    sys.stderr.write(f"sandbox setup failed: {msg}\n")
    sys.exit(SETUP_FAILED)


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def mount_points():
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            yield parts[4].encode().decode("unicode_escape"), parts[5].split(",")


def reachable_by_others(path, parking):
    """An unprivileged user must reach the interpreter, which may live under a 0700 directory such as /root: cover that
    directory with an empty tmpfs and move just the interpreter's subtree back into it (in this mount namespace only)."""
    parts = path.strip("/").split("/")
    for i in range(len(parts) - 1):
        above = "/" + "/".join(parts[:i])
        if os.stat(above).st_mode & 0o001:
            continue
        child = "/" + "/".join(parts[:i + 1])
        if parking.startswith(above.rstrip("/") + "/"):
            fail(f"cannot expose {path}: the work dir lies under the closed directory {above}")
        for err in (mount(child, parking, None, MS_BIND | MS_REC),
                    mount("tmpfs", above, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")):
            if err:
                fail(f"cannot expose {path} under {above}: {err}")
        os.mkdir(child)
        err = mount(parking, child, None, MS_MOVE)
        if err:
            fail(f"cannot move {path} back under {above}: {err}")


def read_only_everywhere_but(workdir):
    err = mount(None, "/", None, MS_REC | MS_PRIVATE)
    if err:
        fail(f"cannot make mounts private: {err}")
    if CONFIG.get("uid") is not None and os.getuid() == 0:
        reachable_by_others(os.path.realpath(sys.base_prefix), workdir)
    err = mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={CONFIG['workdir_mb']}m,mode=0777")
    if err:
        fail(f"cannot mount a tmpfs work dir on {workdir}: {err}")
    for point, options in reversed(list(mount_points())):
        if point == workdir or "ro" in options:
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for o in options:
            flags |= MOUNT_FLAGS.get(o, 0)
        mount(None, point, None, flags)  # failures are caught by the probe below
    for probe_dir in ("/tmp", "/var/tmp", "/dev/shm", os.path.dirname(workdir), os.path.expanduser("~")):
        probe = os.path.join(probe_dir, f".fidelity-sandbox-probe-{os.getpid()}")
        try:
            open(probe, "w").close()
        except OSError:
            continue
        os.unlink(probe)
        fail(f"{probe_dir} is still writable")


def set_limits(lim):
    mb = 1 << 20
    for what, value in ((resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["memory_mb"] * mb),
                        (resource.RLIMIT_FSIZE, lim["file_mb"] * mb), (resource.RLIMIT_NPROC, lim["processes"]),
                        (resource.RLIMIT_NOFILE, lim["open_files"]), (resource.RLIMIT_CORE, 0)):
        # the CPU hard limit sits 1 s above the soft one so the kernel sends SIGXCPU (reported as the CPU limit) first
        resource.setrlimit(what, (value, value + 1 if what == resource.RLIMIT_CPU else value))


CONFIG = json.loads(sys.argv[1])


def main():
    workdir = CONFIG["workdir"]
    files = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as f:
            files[name] = f.read()
    if CONFIG["mode"] in ("namespaced", "userns"):
        read_only_everywhere_but(workdir)
        for name, data in files.items():
            with open(os.path.join(workdir, name), "wb") as f:
                f.write(data)
    os.chdir(workdir)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    if CONFIG["mode"] not in ("namespaced", "userns"):
        become_program(files)
    # PID 1 of the sandbox's PID namespace: run the program as a child and pass on how it ended as an exit code, because
    # unshare cannot always re-raise a child's fatal signal itself (seen: SIGXCPU -> "sigprocmask unblock failed").
    pid = os.fork()
    if pid == 0:
        become_program(files)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        sys.stderr.write(f"sandbox: program killed by signal {signal.Signals(sig).name}\n")
        sys.stderr.flush()
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def become_program(files):
    """Drop to the unprivileged user, apply the limits and exec the program (never returns)."""
    uid = CONFIG.get("uid")
    if uid is not None and os.getuid() == 0:
        for name in files:
            os.chown(name, uid, uid)
        os.chown(CONFIG["workdir"], uid, uid)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    set_limits(CONFIG["limits"])
    argv = [sys.executable, "-I", "-B", CONFIG["program"], *CONFIG.get("args", [])]
    os.execve(sys.executable, argv, CONFIG["env"])

main()
