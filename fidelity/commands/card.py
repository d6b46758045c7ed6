"""Write a model-card section (Markdown) from compare, suite-compare and bench results: every table the seed cards
print.

Typical use: `fidelity card run/compare.json suites/humaneval.json bench-native.json bench-build.json -o card --build
Q4`. Each number in `DIR/card.md` is followed by an HTML comment naming its result file and JSON field (invisible on
Hugging Face and GitHub); results from another panel get their own section."""
from __future__ import annotations

import argparse
import shlex

from ._results import add_results_arguments, print_warnings


def add_arguments(p: argparse.ArgumentParser):
    add_results_arguments(p, results_help="compare JSON or a `compare --out` folder, suite-compare JSON, bench JSON "
                                          "(any order, any mix); the first bench is the one the others' %% changes "
                                          "are against", out_help="output folder for card.md")
    p.add_argument(
        "--build", help="the label of the build the card is about (default: the first build of the main panel)"
    )
    p.add_argument("--title", default="Fidelity to the original model", help="the section's heading")


def run(args) -> int:
    from ..errors import FidelityError

    try:
        from ..report.card import render_card
    except ImportError as e:
        raise FidelityError(f"fidelity card needs the report extra ({e.name} is not installed): "
                            "pip install 'fidelity[report]'") from None
    argv = ["fidelity", "card", *args.results, "-o", args.out] + (["--build", args.build] if args.build else [])
    card = render_card(args.results, args.out, build=args.build, title=args.title, command_line=shlex.join(argv))
    print_warnings(card.warnings)
    print(f"wrote {card.path} (this build: {card.build})")
    return 0
