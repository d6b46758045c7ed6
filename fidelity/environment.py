"""Every `FIDELITY_*` environment variable fidelity reads, read here, once, by the command line (`fidelity/cli.py`:
`Environment.from_environ(os.environ)`, handed to the commands as `args.environment`). The commands pass the values on
as arguments and settings objects (`MetricKernel`, `parallel.RunSettings`, ...). A value that cannot be read is a
ConfigError naming the variable. The variables and what they set: DEVELOPERS.md, "Environment variables".
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .errors import ConfigError
from .pack_settings import PackSettings

# the accepted values (torch-free copies: tests/test_environment.py holds them equal to MetricKernel.CHOICES["backend"]
# without None and to packs.exl3.codec.HADAMARD_SUMS)
METRICS_KERNELS = ("torch", "triton")
EXL3_SUMS = ("float64", "int64", "int8")


def _float(environ: Mapping[str, str], name: str, default: float | None, what: str = "a number") -> float | None:
    value = environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected {what}") from None


def _choice(environ: Mapping[str, str], name: str, accepted: tuple[str, ...]) -> str | None:
    value = environ.get(name)
    if not value:
        return None
    if value not in accepted:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(map(repr, accepted))}")
    return value


@dataclass(frozen=True)
class Environment:
    """The FIDELITY_* variables' values (see the module docstring); the defaults are those of an empty environment."""

    cache: Path | None = None                   # FIDELITY_CACHE
    metrics_kernel: str | None = None           # FIDELITY_METRICS_KERNEL
    exl3_sums: str | None = None                # FIDELITY_EXL3_SUMS
    device_activations_bytes: int | None = None  # FIDELITY_DEVICE_ACTIVATIONS_GIB, in bytes
    prefetch: bool = True                       # FIDELITY_PREFETCH (only "0" turns it off)
    shard_loads: bool = True                    # FIDELITY_SHARD_LOADS (only "0" turns it off)
    stage_budget_bytes: float | None = None     # FIDELITY_STAGE_BUDGET_BYTES
    dist_stale_s: float = 120.0                 # FIDELITY_DIST_STALE_S
    dist_timeout_s: float | None = None         # FIDELITY_DIST_TIMEOUT_S
    smollm2_gguf: Path | None = None            # FIDELITY_SMOLLM2_GGUF
    bwrap: str | None = None                    # FIDELITY_BWRAP

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "Environment":
        gib = _float(environ, "FIDELITY_DEVICE_ACTIVATIONS_GIB", None, "a number of GiB")
        return cls(
            cache=Path(environ["FIDELITY_CACHE"]) if "FIDELITY_CACHE" in environ else None,
            metrics_kernel=_choice(environ, "FIDELITY_METRICS_KERNEL", METRICS_KERNELS),
            exl3_sums=_choice(environ, "FIDELITY_EXL3_SUMS", EXL3_SUMS),
            device_activations_bytes=None if gib is None else int(gib * 2**30),
            prefetch=environ.get("FIDELITY_PREFETCH", "1") != "0",
            shard_loads=environ.get("FIDELITY_SHARD_LOADS", "1") != "0",
            stage_budget_bytes=_float(environ, "FIDELITY_STAGE_BUDGET_BYTES", None),
            dist_stale_s=_float(environ, "FIDELITY_DIST_STALE_S", 120.0),
            dist_timeout_s=_float(environ, "FIDELITY_DIST_TIMEOUT_S", None),
            smollm2_gguf=Path(environ["FIDELITY_SMOLLM2_GGUF"]) if environ.get("FIDELITY_SMOLLM2_GGUF") else None,
            bwrap=environ.get("FIDELITY_BWRAP") or None)

    def cache_dir(self) -> Path:
        """fidelity's cache folder: FIDELITY_CACHE, else ~/.cache/fidelity."""
        return self.cache if self.cache is not None else Path.home() / ".cache" / "fidelity"

    def pack_settings(self) -> PackSettings:
        """How `open_pack` opens the command's packs: the content-hash cache in the cache folder, the EXL3 sums."""
        return PackSettings(hash_cache=self.cache_dir() / "content-hash", exl3_sums=self.exl3_sums)

    def run_settings(self) -> dict:
        """The keyword arguments of `fidelity.oracle.parallel.RunSettings` that come from the environment (the
        command adds `parallel=`; this module stays free of torch, which that one imports)."""
        return dict(prefetch=self.prefetch, shard_loads=self.shard_loads, stage_budget_bytes=self.stage_budget_bytes,
                    stale_s=self.dist_stale_s, timeout_s=self.dist_timeout_s,
                    activation_budget_bytes=self.device_activations_bytes)
