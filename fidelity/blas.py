"""MKL's strict conditional numerical reproducibility, asked for before torch's first matrix product.

Without it MKL's float32 GEMMs may sum in an order that depends on the thread count and, on some CPUs, on the operands'
alignment: on MKL's AVX2 code path (`MKL_ENABLE_INSTRUCTIONS=AVX2` on an Intel Xeon) a [99, 48] x [48, 97] product
differed in the last bits between one and two threads. MKL's strict CNR mode (`MKL_CBWR=<branch>,STRICT`) makes ?gemm
results independent of alignment, and on Intel CPUs of the thread count, for a fixed code branch; it needs an
AVX2-or-later branch. MKL reads `MKL_CBWR` at its first BLAS call, so `set_reproducible_gemm()` sets it before the
first matrix product of a run, unless the environment already names a mode. Importing fidelity sets nothing; the
command line calls it first thing (`fidelity.cli.main`), and so does every `Oracle` when it is made (the library's
way to every measured GEMM; a program that runs GEMMs of its own before it makes one calls it itself, first). The mode
it chooses:

- Intel CPU with AVX2: `AUTO,STRICT` (the CPU's own best branch; measured as fast as MKL's default on a Xeon);
- another x86-64 CPU with AVX2 (AMD): `AVX2,STRICT` (a branch strict mode supports, named explicitly);
- no AVX2: left unset (strict mode does not exist there).

Measured on an AMD EPYC (2 cores, MKL 2024.2, 2026-12-01): strict mode keeps results independent of alignment and of
the process, but GEMMs with few rows per thread (3-22 rows at 2 threads) still differ in the last bits between one and
two threads, in every MKL_CBWR mode tried (tests/test_blas.py prints how many). So fidelity's bit-equality claims hold
at one thread count per process (torchrun ranks vs one process with the ranks' thread count), not across thread counts.

Set `MKL_CBWR` yourself to choose otherwise (`MKL_CBWR=AUTO` is MKL's default behaviour). A process that ran a matrix
product before the call keeps the mode MKL started with. The reference store records the mode in force (`mkl_cbwr`).
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
