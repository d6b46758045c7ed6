"""Compare packs against a reference pack on a panel: KL(ref||pack), top-1, PPL per domain, with row-bootstrap CIs.

The first pack is the reference; each further pack is measured against it and every pair of candidates is compared
pairwise (mean per-position KL difference, 95% CI and p-value)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("reference", help="reference pack (folder, .safetensors or .gguf)")
    p.add_argument("packs", nargs="+", help="packs to measure against the reference")
    p.add_argument("--panel", help="panel folder, .jsonl/.parquet file or hf:NAME[:SPLIT] (default: panels/default)")
    p.add_argument("--reference-store", help="a store written by `fidelity reference` (skips the reference run)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--label", action="append", help="display label per pack, in order (repeat)")
    p.add_argument("--json", dest="json_out", help="write the full report as JSON")
    p.add_argument("--markdown", help="write the tables as Markdown")
    p.add_argument("--out", help="folder for per-position records (one Parquet file per pack); finished passes are kept "
                                 "in OUT/passes so a rerun after an interruption resumes (see --resume)")
    p.add_argument("--resume", help="folder keeping every finished pass (reference, noise floor, each pack); a rerun with "
                                    "the same folder recomputes only unfinished ones (default: OUT/passes with --out)")
    p.add_argument("--no-noise-floor", action="store_true", help="skip the perturbed reference run")
    p.add_argument("--truncate", action="store_true", help="truncate rows longer than the model's context instead of failing")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap replicates (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", choices=("rows", "experts"), default="rows",
                   help="under torchrun: split panel rows (default) or MoE experts across ranks")


def fmt(x, spec=".4f") -> str:
    return "-" if x is None else format(x, spec)


def fmt_ci(ci, spec=".4f") -> str:
    return "-" if not ci or ci[0] is None else f"[{format(ci[0], spec)}, {format(ci[1], spec)}]"


def table_rows(result: dict) -> list[list[str]]:
    """One block per pack: per-domain rows, then overall (pooled) and domains-equal."""
    out = []
    for r in result["results"]:
        o = r["overall"]
        for name, d in r["domains"].items():
            out.append([r["label"], name, str(d["positions"]), fmt(d["kld_mean"]), fmt_ci(d["kld_mean_ci95"]),
                        fmt(100 * d["top1"], ".2f") if d["top1"] is not None else "-", fmt(d["ppl"], ".3f"),
                        fmt(d["ppl_ref"], ".3f")])
        out.append([r["label"], "[b]overall[/b]", str(o["positions"]), fmt(o["kld_mean"]), fmt_ci(o["kld_mean_ci95"]),
                    fmt(100 * o["top1"], ".2f") if o["top1"] is not None else "-", fmt(o["ppl"], ".3f"), fmt(o["ppl_ref"], ".3f")])
        out.append([r["label"], "[b]domains equal[/b]", "", fmt(o["kld_domains_equal"]), fmt_ci(o["kld_domains_equal_ci95"]),
                    fmt(100 * o["top1_domains_equal"], ".2f") if o["top1_domains_equal"] is not None else "-", "", ""])
    return out


HEADERS = ["pack", "domain", "positions", "KLD mean", "95% CI", "top-1 %", "PPL", "PPL ref"]
SUMMARY_HEADERS = ["pack", "bpw", "KLD mean", "x noise", "KLD p99", "KLD max", "top-1 %", "flips clear/near-tie",
                   "ln PPL ratio", "non-finite"]


def summary_rows(result: dict) -> list[list[str]]:
    out = []
    for r in result["results"]:
        o = r["overall"]
        out.append([r["label"], fmt(r["bpw"], ".3f"), fmt(o["kld_mean"]), fmt(o.get("x_noise_floor"), ".1f"),
                    fmt(o["kld_p99"]), fmt(o["kld_max"]), fmt(100 * o["top1"], ".2f") if o["top1"] is not None else "-",
                    f"{o['top1_flips_clear']}/{o['top1_flips_near_tie']}", fmt(o["ln_ppl_ratio"]), str(o["nonfinite"])])
    return out


def print_report(result: dict, console: Console | None = None):
    con = console or Console()
    if not con.is_terminal:
        con = Console(width=160, file=con.file)   # pipes and logs default to 80 columns, too narrow for the tables
    p = result["panel"]
    con.print(f"panel [bold]{p['name']}[/bold] ({p['rows']} rows, {p['scored_positions']} scored tokens, sha256 "
              f"{p['sha256'][:12]})  reference [cyan]{result['reference']['path']}[/cyan]  {result['direction']}")
    if result.get("resumed"):
        con.print(f"resumed: {', '.join(result['resumed'])} read back from the resume folder, not recomputed")
    nf = result.get("noise_floor")
    if nf:
        con.print(f"noise floor (reference with ~1 bf16 rounding step of noise on every module output): "
                  f"KLD {fmt(nf['kld_mean'], '.2e')}  top-1 {fmt(100 * nf['top1'], '.2f')}%")
    t = Table(title="per domain")
    for h in HEADERS:
        t.add_column(h, justify="left" if h in ("pack", "domain") else "right")
    for row in table_rows(result):
        t.add_row(*row)
    con.print(t)
    s = Table(title="summary")
    for h in SUMMARY_HEADERS:
        s.add_column(h, justify="left" if h == "pack" else "right")
    for row in summary_rows(result):
        s.add_row(*row)
    con.print(s)
    if result["paired"]:
        pt = Table(title="paired: mean KLD(a) - KLD(b) on the same positions")
        for h in ("a", "b", "difference", "95% CI", "p-value"):
            pt.add_column(h)
        for d in result["paired"]:
            pt.add_row(d["a"], d["b"], fmt(d["kld_mean_diff"], ".5f"), fmt_ci(d["ci95"], ".5f"), fmt(d["p_value"], ".3g"))
        con.print(pt)


def markdown(result: dict) -> str:
    strip = lambda s: s.replace("[b]", "**").replace("[/b]", "**")
    lines = [f"Panel `{result['panel']['name']}` (sha256 `{result['panel']['sha256'][:12]}`), "
             f"{result['panel']['scored_positions']} scored tokens; {result['direction']}.", ""]
    for headers, rows in ((SUMMARY_HEADERS, summary_rows(result)), (HEADERS, table_rows(result))):
        lines += ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
        lines += ["| " + " | ".join(strip(c) for c in r) + " |" for r in rows]
        lines.append("")
    if result["paired"]:
        lines += ["| a | b | KLD(a) - KLD(b) | 95% CI | p |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {d['a']} | {d['b']} | {fmt(d['kld_mean_diff'], '.5f')} | {fmt_ci(d['ci95'], '.5f')} | "
                  f"{fmt(d['p_value'], '.3g')} |" for d in result["paired"]]
    return "\n".join(lines) + "\n"


def write_outputs(res, args) -> None:
    from ..compare import write_records

    res.report.setdefault("command_line", getattr(args, "command_line", None))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res.report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(res.report))
    if args.out:
        write_records(res, args.out)


def run(args) -> int:
    from .. import distributed
    from ..compare import compare

    distributed.configure(parallel=getattr(args, "parallel", "rows"))
    try:
        res = compare(args.reference, args.packs, panel=args.panel, reference_store=args.reference_store,
                      device=args.device, labels=args.label, noise_floor=not args.no_noise_floor, n_boot=args.bootstrap,
                      seed=args.seed, truncate=args.truncate, progress=distributed.is_main(),
                      resume=args.resume or (Path(args.out) / "passes" if args.out else None))
    except BaseException as e:
        distributed.finish(e)
        raise
    distributed.finish()  # every rank got here: the result is complete
    if distributed.is_main():
        print_report(res.report)
        write_outputs(res, args)
    return 0
