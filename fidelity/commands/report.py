"""Write an HTML page (self-contained), PNG figures and a Markdown summary from compare, suite-compare and gate results.

Typical use: `fidelity compare NATIVE Q8 Q4 --json run/compare.json --out run`, then `fidelity report run/compare.json
-o report`.

Compare results from another panel (or against another reference) than the main group are shown as a separate group with
a warning, never in the same plot. The worst positions need per-position records (`compare --out`); the reference's
top-K lists there come from a reference store (`fidelity reference`, used by `compare --reference-store` or given
here)."""
from __future__ import annotations

import argparse
import shlex

from ._results import add_results_arguments, print_warnings


def add_arguments(p: argparse.ArgumentParser):
    add_results_arguments(
        p,
        results_help="compare JSON (records next to it are picked up), a `compare --out` folder, a "
        "reference store folder, suite-compare JSON, gate JSON (any order, any mix)",
        out_help="output folder for index.html, summary.md and the PNG figures",
    )
    p.add_argument("--title", default="Fidelity report")
    p.add_argument("--worst", type=int, default=8, help="worst positions shown per pack (default 8)")
    p.add_argument(
        "--panel", help="the panel folder the results were measured on: full text around the worst positions"
    )
    p.add_argument(
        "--token-ids", action="store_true", help="show token ids instead of loading the reference pack's tokenizer"
    )


def run(args) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from ..errors import FidelityError
        raise FidelityError("fidelity report draws its figures with matplotlib, which is not installed: "
                            "pip install 'fidelity[report]' (or matplotlib>=3.8)") from None
    from ..report import render

    argv = ["fidelity", "report", *args.results, "-o", args.out, "--title", args.title, "--worst", str(args.worst)]
    argv += (["--panel", args.panel] if args.panel else []) + (["--token-ids"] if args.token_ids else [])
    rep = render(
        args.results,
        args.out,
        title=args.title,
        worst=args.worst,
        tokenizer=None if args.token_ids else "auto",
        panel=args.panel,
        command_line=shlex.join(argv),
    )
    print_warnings(rep.warnings)
    print(f"wrote {rep.index_html}, {rep.summary_md} and {len(rep.figures)} figure(s) in {rep.out_dir}")
    return 0
