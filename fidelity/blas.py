"""MKL's strict conditional numerical reproducibility, asked for before torch's first matrix product.

Without it MKL's float32 GEMMs may sum in an order that depends on the thread count and, on some CPUs, on the operands'
alignment: on MKL's AVX2 code path (what AMD EPYC runs; `MKL_ENABLE_INSTRUCTIONS=AVX2` shows it on an Intel Xeon) a
[99, 48] x [48, 97] product differs in the last bits between one and two threads, so a torchrun rank (one thread) and
one process (two) disagreed. MKL's strict CNR mode (`MKL_CBWR=<branch>,STRICT`) makes ?gemm results independent of the
thread count and alignment for a fixed code branch; it needs an AVX2-or-later branch. MKL reads `MKL_CBWR` at its first
BLAS call, so `fidelity` sets it when imported, unless the environment already names a mode:

- Intel CPU with AVX2: `AUTO,STRICT` (the CPU's own best branch; measured as fast as MKL's default on a Xeon);
- another x86-64 CPU with AVX2 (AMD): `AVX2,STRICT` (a branch strict mode supports, named explicitly: MKL's automatic
  choice on a non-Intel CPU need not be one);
- no AVX2: left unset (strict mode does not exist there; equality across thread counts is then not claimed).

Set `MKL_CBWR` yourself to choose otherwise (`MKL_CBWR=AUTO` is MKL's default behaviour). A process that ran a matrix
product before importing fidelity keeps the mode MKL started with.
"""
from __future__ import annotations

import os

VARIABLE = "MKL_CBWR"


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(vendor id, instruction-set flags) of the first CPU, ("", set()) where /proc/cpuinfo is not readable."""
    vendor, flags = "", set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if vendor and flags:
                    break
    except OSError:
        pass
    return vendor, flags


def strict_mode(vendor: str, flags: set[str]) -> str | None:
    """The MKL_CBWR value fidelity asks for on this CPU (see the module docstring), None where there is none."""
    if "avx2" not in flags:
        return None
    return "AUTO,STRICT" if vendor == "GenuineIntel" else "AVX2,STRICT"


def set_reproducible_gemm(environ=os.environ) -> str | None:
    """Set MKL_CBWR for this process (and the processes it starts) unless already set; returns the mode in force."""
    if VARIABLE not in environ:
        mode = strict_mode(*cpu_info())
        if mode is not None:
            environ[VARIABLE] = mode
    return environ.get(VARIABLE)
