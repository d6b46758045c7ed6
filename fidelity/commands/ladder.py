"""Run a tuning ladder: bench and gate each engine configuration, accept or reject it against the best so far.

  fidelity ladder LADDER.toml [--json F] [--markdown F] [--logs DIR]

The file's format and the accept rule (seed 000's: +3 % single-stream or aggregate, <= 5 % prefill loss, gates pass,
each margin at least the A/A spread): fidelity/engine/ladder.py. Exit 0 when every rung was benched without failed
requests, 2 otherwise (the table still says what was measured).
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from .. import json_out


def add_arguments(p: argparse.ArgumentParser):
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("ladder", help="LADDER.toml")
    p.add_argument("--json", dest="json_out", help="write the ladder document (rungs, verdicts, every bench) here")
    p.add_argument("--markdown", help="write the rung table as Markdown here")
    p.add_argument("--logs", help="folder for started engines' logs (default: a temporary folder)")


def console_table(doc: dict):
    from rich.table import Table

    metric = doc["accept"]["single_stream_metric"]
    t = Table(title=f"fidelity ladder ({doc['model']}): best {doc['best']}")
    keys = list(dict.fromkeys(k for r in doc["rungs"] for k in r["deltas"])) or [metric]
    for c in ["rung", "rank", *keys, "gates", "verdict", "reason"]:
        t.add_column(c)
    for r in doc["rungs"]:
        cells = []
        for k in keys:
            v, dl = r["metrics"].get(k), r["deltas"].get(k)
            cell = "-" if v is None else f"{v:.4g}"
            if dl and dl["change_pct"] is not None:
                cell += f" ({dl['change_pct']:+.1f} % ±{dl['spread_pct']:.1f})"
            cells.append(cell)
        color = {"accepted": "green", "rejected": "red"}.get(r["verdict"], "white")
        t.add_row(r["rung"], str(r.get("rank", "-")), *cells, r["gates"], f"[{color}]{r['verdict']}[/]", r["reason"])
    return t


def run(args) -> int:
    from rich.console import Console

    from ..engine.ladder import load_ladder, markdown, run_ladder

    ladder = load_ladder(args.ladder)
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="fidelity-ladder-"))
    con = Console()
    doc = asyncio.run(
        run_ladder(
            ladder,
            logs,
            progress=lambda r: con.print(f"{r['rung']}: {r['verdict']} ({r['reason']})"),
            bwrap=args.environment.bwrap,
        )
    )
    con.print(console_table(doc))
    if args.json_out:
        Path(args.json_out).write_text(json_out.dumps(doc, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(markdown(doc))
    return 2 if any(r["errors"] for r in doc["rungs"]) else 0
