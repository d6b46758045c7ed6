"""Peak resident memory of a child process (no tests here): the memory tests run their workload in a fresh
interpreter that resets VmHWM after its warm-up and prints one JSON line; `run_child` runs it and returns that line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Prepended to every child script: `status(field)` reads /proc/self/status in bytes; `reset_peak()` sets VmHWM to the
# current RSS and says whether it could.
CHILD_HELPERS = r"""
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)

def reset_peak():
    try:
        open("/proc/self/clear_refs", "w").write("5")
        return True
    except OSError:
        return False
"""


def run_child(script: str, seed: int, timeout: float, **env) -> dict:
    """Runs CHILD_HELPERS + script with argv[1] = seed and returns its last stdout line as JSON (which must have
    "reset"); skips where VmHWM cannot be reset. glibc's self-raising mmap threshold would let freed blocks linger in
    the heap at random; it is pinned so the numbers measure the code's allocations."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20), **env}
    out = subprocess.run([sys.executable, "-c", CHILD_HELPERS + script, str(seed)], capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["reset"]:
        pytest.skip("cannot reset VmHWM here (/proc/self/clear_refs not writable)")
    return r
