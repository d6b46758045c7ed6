"""The oracle's named choice of numerics (`Oracle(pack, numerics=...)`, CLI `--numerics`; torch-free, so the CLI can
offer it without importing the oracle):

- "exact": fp32 (or fp64) math everywhere, what transformers computes: the weights' own error, nothing else;
- "deepseek": DeepSeek's reference rounding, what DeepSeek's own `inference/model.py` rounds (FP8 window KV, FP4
  compressed KV and indexer queries/keys, FP8 inputs of FP8/FP4-stored linears; `deepseek/quant.py`), defined for
  DeepSeek-V4 and V4.1; other families refuse it.
"""
from __future__ import annotations

from .errors import ConfigError

NUMERICS = ("exact", "deepseek")
DEFAULT_NUMERICS = "exact"


def check_numerics(numerics: str) -> str:
    if numerics not in NUMERICS:
        raise ConfigError(f"numerics {numerics!r} is not one of {', '.join(NUMERICS)}")
    return numerics
