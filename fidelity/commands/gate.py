"""Gate a running OpenAI-compatible engine: oracle KL, batch invariance, decode vs prefill, prefix cache; exit 0 pass, 1
fail, 2 could not run.

Default thresholds (nats for KL, logprob units for deltas), overridable per gate in --config TOML:

  oracle-kl          kl_mean_max = 1e-3   top1_min = 0.95
  batch-invariance   identical_min = 1.0  max_abs_dlogprob_max = 1e-5
  decode-vs-prefill  max_abs_dlogprob_max = 1e-3   kl_mean_max = 1e-5
  prefix-cache       identical_min = 1.0  max_abs_dlogprob_max = 1e-5

gate.toml:
  [settings]            # prompts, prompt_prefix, max_tokens, top_k, batch_sizes, long_prompt_repeats, prompt_as,
                        # prompt_logprobs (vLLM), concurrency, timeout_s (one request's deadline, retries
                        # included; --timeout), retries, journal
  [oracle-kl]           # any threshold above, and the evidence a verdict needs (fewer: could not run, exit 2):
  kl_mean_max = 0.02    # min_rows / min_positions, default 3 panel rows / 20 scored positions for oracle-kl,
  min_rows = 10         # 2 (prompt, batch size) pairs / prompts / cases and 4 positions for the other three

Speed and suites (run only when their section is present, or named in --only):
  [speed]               # baseline = "bench.json" (fidelity bench --json, ideally --aa), drop_max_pct = 5,
                        # metrics = ["decode.all", "aggregate.4", ...] (default: every tok/s metric), repeats = N
                        # the baseline's bench is re-run; a metric fails when it drops by more than
                        # max(drop_max_pct, the A/A spread or, without one, the repeats' spread)
  [suite.humaneval]     # baseline = "runs/q8" (a `fidelity suite run` folder), threshold = 1.0 (points), alpha = 0.05,
                        # out = "runs/gate-humaneval" (the new run; resumes), data, unsafe_no_sandbox, concurrency
                        # the suite runs with the baseline's settings and items; fail = `suite compare`'s verdict
Relative paths are taken from the config file's folder. The speed gate re-measures on a rerun (timings cannot be
journaled); a suite gate's run folder resumes like `suite run`.

oracle-kl reads the store with the pack it was built from (its head re-derives the exact distributions) and the panel it
was built on; both default to the paths the store's manifest records (--reference-pack, --panel override them; another
pack or panel than the store's is refused); --rows-per-domain N keeps the run short.

Exit code: 1 when any gate failed, else 2 when any gate could not run (engine errors, malformed replies, no reference),
else 0.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from .. import json_out
# the config reader and runner live in the engine layer (the tuning ladder uses them too)
from ..engine.gates.config import always_run_gates, load_config, run_gates, select_gates


def add_arguments(p: argparse.ArgumentParser):
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the thresholds table
    p.add_argument("--engine", required=True, help="base URL of the engine, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name to send in requests")
    p.add_argument("--reference-store", help="reference store folder from `fidelity reference` (needed by oracle-kl)")
    p.add_argument(
        "--reference-pack",
        help="the pack the store was built from (its head re-derives the exact distributions; "
        "default: the path the store records)",
    )
    p.add_argument("--panel", help="the panel the store was built on (default: the path the store records)")
    p.add_argument("--rows-per-domain", type=int, help="oracle-kl on the first N rows of each domain only")
    p.add_argument("--config", help="gate.toml with [settings] and per-gate thresholds")
    p.add_argument("--only", help=f"comma-separated subset of: {','.join(always_run_gates())}")
    p.add_argument("--junit", help="write JUnit XML here")
    p.add_argument("--json", dest="json_out", help="write the results as JSON here")
    p.add_argument(
        "--journal", help="request journal (JSONL): a rerun after an interruption resumes without re-sending"
    )
    p.add_argument(
        "--timeout",
        type=float,
        help="seconds one request may take in all: every attempt, read and backoff "
        "(default 120; an engine that trickles bytes cannot hold a gate longer)",
    )
    p.add_argument("--retries", type=int, help="extra attempts on 5xx / connection errors / timeouts (default 3)")
    p.add_argument("--concurrency", type=int, help="requests in flight at most (default: the largest batch size)")


def junit_xml(report: dict) -> str:
    gates = report["gates"]
    fails = sum(g["status"] == "fail" for g in gates)
    errors = sum(g["status"] == "error" for g in gates)
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<testsuite name="fidelity gate" tests="{len(gates)}" failures="{fails}" errors="{errors}" '
           f'time="{sum(g["seconds"] for g in gates):.3f}">']
    for g in gates:
        out.append(f'  <testcase classname="fidelity.gate" name={quoteattr(g["gate"])} time="{g["seconds"]:.3f}">')
        if g["status"] == "fail":
            bad = "; ".join(
                f'{c["metric"]}={c["value"]:.6g} not {c["op"]} {c["threshold"]:.6g}'
                for c in g["checks"]
                if not c["passed"]
            )
            out.append(f'    <failure message={quoteattr(bad)}/>')
        elif g["status"] == "error":
            out.append(f'    <error message={quoteattr(g["error"] or "error")}/>')
        out.append(f'    <system-out>{escape(json_out.dumps(g["measured"]))}</system-out>')
        out.append('  </testcase>')
    out.append('</testsuite>')
    return "\n".join(out) + "\n"


def print_summary(report: dict):
    from rich.console import Console
    from rich.table import Table

    numerics = report.get("reference_numerics")
    t = Table(title=f"fidelity gate: {report['engine']} ({report['model']})"
                    + (f"; reference store under numerics {numerics}" if numerics else ""))
    for c in ("gate", "status", "check", "measured", "threshold"):
        t.add_column(c)
    color = {"pass": "green", "fail": "red", "error": "yellow"}
    for g in report["gates"]:
        st = f"[{color[g['status']]}]{g['status']}[/]"
        if g["status"] == "error":
            t.add_row(g["gate"], st, "error", str(g["error"])[:160], "")
        for c in g["checks"]:
            mark = "" if c["passed"] else " ✗"
            t.add_row(g["gate"], st, c["metric"], f"{c['value']:.6g}{mark}", f"{c['op']} {c['threshold']:.6g}")
    con = Console()
    con.print(t)
    for g in report["gates"]:
        if g["gate"] == "oracle-kl" and g["measured"].get("statistics"):
            con.print(oracle_kl_table(g["measured"]["statistics"]))
        if g["gate"] == "decode-vs-prefill" and "worst_prompt_kl_mean" in g["measured"]:
            m = g["measured"]
            con.print(f"decode-vs-prefill: worst prompt's mean KL {m['worst_prompt_kl_mean']:.3g} (prompt "
                      f"{m['worst_prompt']}), over all positions {m['kl_mean']:.3g}")
        for n in g["notes"]:
            con.print(f"[dim]{g['gate']}: {n}[/dim]")
    for line in request_counts(report):
        con.print(line)
    con.print(f"exit {report['exit_code']} ({report['status']})")


def request_counts(report: dict) -> list[str]:
    """What each kind of gate sent: the logprob gates share the report's client; the speed and suite gates run their
    own requests (a bench, a suite run), counted in their measured blocks."""
    cl, parts = report["client"], []
    if any(g["gate"] != "speed" and not g["gate"].startswith("suite.") for g in report["gates"]):
        parts.append(f"logprob gates: requests sent {cl['sent']}, retries {cl['retries']}, from journal "
                     f"{cl['journal_hits']}, errors {cl['errors']}")
    for g in report["gates"]:
        m = g["measured"]
        if g["gate"] == "speed" and "bench" in m:
            rq = m["bench"]["requests"]
            parts.append(f"speed: requests sent {rq['sent']}, retries {rq['retries']}, failed {rq['failed']}")
        elif g["gate"].startswith("suite.") and "items" in m:
            parts.append(f"{g['gate']}: {m['items']} items asked, engine errors {m['engine_errors']}")
    return parts or ["no requests sent"]


def oracle_kl_table(st: dict):
    """oracle-kl per domain, overall and domains-equal, with 95% row-bootstrap intervals."""
    from rich.table import Table

    def f(x, spec=".4g"):
        return "-" if x is None else format(x, spec)

    def ci(c, spec=".4g"):
        return "-" if not c or c[0] is None else f"[{format(c[0], spec)}, {format(c[1], spec)}]"

    t = Table(title="oracle-kl by domain (KL(ref||engine), top-k estimator; ΔNLL = engine - reference)")
    for c in ("domain", "positions", "KL mean", "95% CI", "top-1 %", "engine PPL", "ref PPL", "ΔNLL", "95% CI",
              "rows worse"):
        t.add_column(c, justify="left" if c == "domain" else "right")
    scopes = list(st["domains"].items()) + [("overall", st["overall"]), ("domains equal", st["domains_equal"])]
    for name, d in scopes:
        rw = d.get("rows_worse")
        worse = (f"{rw['worse']}/{rw['rows']} (p {f(rw['sign_test_p'], '.2g')})" if rw
                 else f(100 * d["rows_worse_share"], ".0f") + "%" if d.get("rows_worse_share") is not None else "-")
        t.add_row(name, str(d.get("positions", "")), f(d["kl_mean"]), ci(d["kl_mean_ci95"]),
                  f(100 * d["top1"], ".2f") if d["top1"] is not None else "-", f(d["engine_ppl"], ".4f"),
                  f(d["ref_ppl"], ".4f"), f(d["delta_nll_mean"]), ci(d["delta_nll_mean_ci95"]), worse)
    return t


def run(args) -> int:
    cfg = load_config(args.config)
    names = select_gates(args.only, cfg)
    t0 = time.time()
    report = asyncio.run(
        run_gates(
            args.engine,
            args.model,
            names,
            cfg,
            store=args.reference_store,
            reference_pack=args.reference_pack,
            panel=args.panel,
            rows_per_domain=args.rows_per_domain,
            journal=args.journal,
            timeout=args.timeout,
            retries=args.retries,
            concurrency=args.concurrency,
            bwrap=args.environment.bwrap,
            pack_settings=args.environment.pack_settings(),
        )
    )
    report["seconds"] = round(time.time() - t0, 3)
    print_summary(report)
    if args.json_out:
        Path(args.json_out).write_text(json_out.dumps(report, indent=2))
    if args.junit:
        Path(args.junit).write_text(junit_xml(report))
    sys.stdout.flush()
    return report["exit_code"]
