"""Benchmark suites run over HTTP against any OpenAI-compatible engine and compared item by item between two builds.

A suite is a module here whose factory (a `runner.Suite` class, or a function returning one) is decorated
`@SUITES.register("name")` (`fidelity.registry.SUITES`: names read from the source, so listing them imports nothing).
`make_suite(name, **options)` builds one; `runner.run_suite` runs it into a run folder; `paired.compare_runs` pairs two
runs."""
from __future__ import annotations

from ..errors import ConfigError
from ..registry import SUITES


def make_suite(name: str, **options):
    options = {k: v for k, v in options.items() if v is not None}
    if name not in SUITES:
        raise ConfigError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    return SUITES[name](**options)
