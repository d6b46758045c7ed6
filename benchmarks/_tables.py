"""The benchmarks' Markdown tables: a table's header with its rule, and the lines of a result's optional parts (a check
that did not run, or a stage that failed, has none)."""
from __future__ import annotations

from collections.abc import Callable


def header(*columns: str) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def present_lines(result: dict, line_of: dict[str, Callable[[dict], str]]) -> list[str]:
    """`line_of[key](result[key])` for each key whose part `result` holds, in `line_of`'s order."""
    return [line(result[key]) for key, line in line_of.items() if result.get(key)]
