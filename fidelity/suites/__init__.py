"""Benchmark suites run over HTTP against any OpenAI-compatible engine and compared item by item between two builds.

`make_suite(name, **options)` builds one; `runner.run_suite` runs it into a run folder; `compare.compare_runs` pairs two runs."""
from __future__ import annotations

from ..errors import ConfigError

SUITE_NAMES = ["humaneval", "humaneval+", "mbpp+", "ifeval", "needle", "toolcall"]


def make_suite(name: str, **options):
    options = {k: v for k, v in options.items() if v is not None}
    if name in ("humaneval", "humaneval+", "mbpp+"):
        from .humaneval import make_code_suite

        return make_code_suite(name, **options)
    if name == "ifeval":
        from .ifeval import IFEval

        return IFEval(**options)
    if name == "needle":
        from .needle import Needle

        return Needle(**options)
    if name == "toolcall":
        from .toolcall import ToolCall

        return ToolCall(**options)
    raise ConfigError(f"unknown suite {name!r}; known: {', '.join(SUITE_NAMES)}")
