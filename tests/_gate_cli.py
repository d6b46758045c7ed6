"""`fidelity gate` run as the user runs it, in a subprocess: what the gate command tests share."""
from __future__ import annotations

import subprocess
import sys


def gate_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m fidelity gate ARGS`, its stdout and stderr captured as text."""
    return subprocess.run([sys.executable, "-m", "fidelity", "gate", *args], capture_output=True, text=True,
                          timeout=timeout)
