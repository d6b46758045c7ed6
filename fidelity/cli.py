"""`fidelity` command line. Each subcommand is a module in `fidelity/commands/` with `add_arguments(parser)` and
`run(args) -> int`; the module's docstring's first line is its help."""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import shlex
import sys

from . import __version__
from .blas import set_reproducible_gemm
from .environment import Environment
from .errors import FidelityError


def _command_modules():
    from . import commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            yield info.name.replace("_", "-"), f"{commands.__name__}.{info.name}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fidelity",
        description="Measure how far a quantized LLM pack is from its reference, and gate serving engines against an "
        "exact fp32 oracle.",
    )
    parser.add_argument("--version", action="version", version=f"fidelity {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, modname in _command_modules():
        mod = importlib.import_module(modname)
        doc = (mod.__doc__ or name).strip().splitlines()[0]
        p = sub.add_parser(name, help=doc, description=(mod.__doc__ or doc).strip())
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    set_reproducible_gemm()  # before any matrix product: MKL reads MKL_CBWR at its first (see fidelity/blas.py)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["fidelity", *(sys.argv[1:] if argv is None else argv)])
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    # exit 2 is "could not run" for every command (`gate`: 1 is "a gate failed", so nothing that stopped the run may
    # exit 1): bad input is a FidelityError naming its file; a file the system would not read or write (a full disk,
    # a vanished folder) an OSError, named by its message where the system gave the file
    try:
        args.environment = Environment.from_environ(os.environ)  # the one read of FIDELITY_* (fidelity/environment.py)
        return int(args._run(args) or 0)
    except (FidelityError, OSError) as e:
        print(f"fidelity {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
