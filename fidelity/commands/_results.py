"""What `fidelity card` and `fidelity report` share: result files in, a folder out, warnings on stderr."""
from __future__ import annotations

import argparse
import sys


def add_results_arguments(p: argparse.ArgumentParser, *, results_help: str, out_help: str) -> None:
    p.add_argument("results", nargs="+", metavar="RESULT", help=results_help)
    p.add_argument("-o", "--out", required=True, help=out_help)


def print_warnings(warnings: list[str]) -> None:
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
