"""Compare packs against a reference pack on a panel: KL(ref||pack), top-1, PPL per domain, with row-bootstrap CIs.

The first pack is the reference; each further pack is measured against it and every pair of candidates is compared
pairwise (mean per-position KL difference, 95% CI and p-value)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .. import json_out


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("reference", help="reference pack (folder, .safetensors or .gguf)")
    p.add_argument("packs", nargs="+", help="packs to measure against the reference")
    p.add_argument("--panel", help="panel folder, .jsonl/.parquet file or hf:NAME[:SPLIT] (default: panels/default)")
    p.add_argument("--reference-store", help="a store written by `fidelity reference` (skips the reference run)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--label", action="append", help="display label per pack, in order (repeat)")
    p.add_argument("--json", dest="json_out", help="write the full report as JSON")
    p.add_argument("--markdown", help="write the tables as Markdown")
    p.add_argument(
        "--out",
        help="folder for per-position records (one Parquet file per pack); finished passes are kept "
        "in OUT/passes so a rerun after an interruption resumes (see --resume)",
    )
    p.add_argument(
        "--resume",
        help="folder keeping every finished pass (reference, noise floor, each pack); a rerun with "
        "the same folder recomputes only unfinished ones (default: OUT/passes with --out)",
    )
    p.add_argument("--no-noise-floor", action="store_true", help="skip the perturbed reference run")
    add_numerics_argument(p)
    p.add_argument("--no-numerics-floor", action="store_true",
                   help="skip the numerics floor (DeepSeek V4/V4.1: the reference under the other numerics)")
    p.add_argument(
        "--truncate", action="store_true", help="truncate rows longer than the model's context instead of failing"
    )
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap replicates (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--full",
        action="store_true",
        help="also print KLD quantiles, top-K agreement, delta p, KLD by "
        "reference confidence, bpw rows and per-domain paired differences",
    )
    p.add_argument("--parallel", choices=("rows", "experts"), default="rows",
                   help="under torchrun: split panel rows (default) or MoE experts across ranks")


def fmt(x, spec=".4f") -> str:
    return "-" if x is None else format(x, spec)


def fmt_ci(ci, spec=".4f") -> str:
    return "-" if not ci or ci[0] is None else f"[{format(ci[0], spec)}, {format(ci[1], spec)}]"


def pct(x, spec=".2f") -> str:
    return "-" if x is None else format(100 * x, spec)


def pct_ci(ci, spec=".2f") -> str:
    return "-" if not ci or ci[0] is None else f"[{format(100 * ci[0], spec)}, {format(100 * ci[1], spec)}]"


def _scopes(r: dict):
    """(label, scope name, scope dict) per domain, then overall and domains-equal (the nested `domains_equal` dict)."""
    o = r["overall"]
    for name, d in r["domains"].items():
        yield name, d
    yield "[b]overall[/b]", o
    yield "[b]domains equal[/b]", o.get("domains_equal") or {}


def _rows_worse(d: dict) -> str:
    rw = d.get("rows_worse")
    if not rw:
        return "-" if d.get("rows_worse_share") is None else pct(d["rows_worse_share"], ".0f") + "%"
    return f"{rw['worse']}/{rw['rows']} (p {fmt(rw['sign_test_p'], '.2g')})"


def measured(result: dict) -> list[dict]:
    """The results that hold numbers (a pack that failed has only its error)."""
    return [r for r in result["results"] if r.get("status", "measured") != "failed"]


def table_rows(result: dict) -> list[list[str]]:
    """One block per pack: per-domain rows, then overall (pooled) and domains-equal."""
    out = []
    for r in measured(result):
        for name, d in _scopes(r):
            out.append([r["label"], name, str(d["positions"]) if "positions" in d else "", fmt(d.get("kld_mean")),
                        fmt_ci(d.get("kld_mean_ci95")), fmt(d.get("kld_reverse_mean")), pct(d.get("top1")),
                        fmt(d.get("delta_nll_mean")), fmt_ci(d.get("delta_nll_mean_ci95")), _rows_worse(d),
                        fmt(d.get("ppl"), ".3f"), fmt(d.get("ppl_ref"), ".3f")])
    return out


HEADERS = ["pack", "domain", "positions", "KLD mean", "95% CI", "KLD(pack‖ref)", "top-1 %", "ΔNLL", "ΔNLL 95% CI",
           "rows worse", "PPL", "PPL ref"]
SUMMARY_HEADERS = ["pack", "bpw", "bpw/token", "KLD mean", "x noise", "KLD p99", "KLD max", "top-1 %",
                   "flips clear/near-tie", "ΔNLL (SE)", "rows worse", "non-finite"]


def _per_token_bpw(r: dict) -> float | None:
    bits = r.get("bits_per_weight") or {}
    row = bits.get("per_decoded_token_measured") or bits.get("per_decoded_token") or {}
    return row.get("bpw")


def summary_rows(result: dict) -> list[list[str]]:
    out = []
    for r in measured(result):
        o = r["overall"]
        out.append([r["label"], fmt(r["bpw"], ".3f"), fmt(_per_token_bpw(r), ".3f"), fmt(o["kld_mean"]),
                    fmt(o.get("x_noise_floor"), ".1f"), fmt(o["kld_p99"]), fmt(o["kld_max"]), pct(o["top1"]),
                    f"{o['top1_flips_clear']}/{o['top1_flips_near_tie']}",
                    f"{fmt(o.get('delta_nll_mean'))} ({fmt(o.get('delta_nll_mean_se'))})", _rows_worse(o),
                    str(o["nonfinite"])])
    return out


def _full_tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """The tables `--full` prints and the Markdown always carries: (title, headers, rows)."""
    dist, agree, conf, bits, paired = [], [], [], [], []
    for r in measured(result):
        for name, d in _scopes(r):
            dist.append(
                [r["label"], name]
                + [
                    f"{fmt(d.get(k))} {fmt_ci(d.get(k + '_ci95'))}"
                    for k in ("kld_median", "kld_p90", "kld_p99", "kld_p999")
                ]
                + [fmt(d.get("kld_max")), f"{fmt(d.get('kld_reverse_mean'))} {fmt_ci(d.get('kld_reverse_mean_ci95'))}"]
            )
            agree.append(
                [r["label"], name]
                + [f"{pct(t['value'])} {pct_ci(t['ci95'])}" for t in d.get("topk_agreement", [])]
                + [
                    f"{pct(d.get('delta_p_mean'), '.3f')} {pct_ci(d.get('delta_p_mean_ci95'), '.3f')}",
                    f"{pct(d.get('rms_delta_p'), '.3f')} {pct_ci(d.get('rms_delta_p_ci95'), '.3f')}",
                ]
            )
            for b in d.get("kld_by_ref_confidence", []):
                lo, hi = b["ref_confidence"]
                conf.append([r["label"], name, f"[{lo:g}, {hi:g}{']' if hi >= 1 else ')'}", str(b.get("positions", "")),
                             pct(b.get("share"), ".1f"), f"{fmt(b.get('kld_mean'))} {fmt_ci(b.get('kld_mean_ci95'))}",
                             fmt(b.get("kld_reverse_mean"))])
        for cat, row in (r.get("bits_per_weight") or {}).items():
            bits.append([r["label"], cat, f"{row['params']:,.0f}", f"{row['bytes']:,.0f}", fmt(row["bpw"], ".3f")])
    for d in result["paired"]:
        for metric, title in (("kld", "KLD(ref‖pack)"), ("kld_reverse", "KLD(pack‖ref)")):
            m = d.get(metric)
            if not m:
                continue
            scopes = [(n, v) for n, v in m["domains"].items()] + [
                ("[b]overall[/b]", m),
                ("[b]domains equal[/b]", m["domains_equal"]),
            ]
            for name, v in scopes:
                paired.append([d["a"], d["b"], title, name, fmt(v["diff"], ".5f"), fmt_ci(v["diff_ci95"], ".5f"),
                               fmt(v["relative_change_pct"], "+.1f"), fmt_ci(v["relative_change_pct_ci95"], "+.1f"),
                               fmt(v["p_value"], ".3g"), fmt(v.get("p_holm"), ".3g")])
    return [
        (
            "KLD distribution (95% CI)",
            ["pack", "domain", "median", "p90", "p99", "p99.9", "max", "KLD(pack‖ref)"],
            dist,
        ),
        (
            "agreement (%, 95% CI): top-K lists equal, Δp = p_pack - p_ref of the true token",
            ["pack", "domain"] + [f"top-{k}" for k in range(1, 6)] + ["mean Δp", "RMS Δp"],
            agree,
        ),
        (
            "KLD by reference top-1 probability",
            ["pack", "domain", "ref p(top-1)", "positions", "share %", "KLD mean", "KLD(pack‖ref)"],
            conf,
        ),
        ("bits per weight", ["pack", "category", "params", "bytes", "bpw"], bits),
        (
            "paired: A - B on the same positions, per domain (Holm across domains)",
            ["a", "b", "metric", "domain", "A - B", "95% CI", "change %", "95% CI", "p", "p Holm"],
            paired,
        ),
    ]


def _rich_table(title: str, headers: list[str], rows: list[list[str]]) -> Table:
    t = Table(title=title)
    for h in headers:
        t.add_column(h, justify="left" if h in ("pack", "domain", "a", "b", "metric", "category") else "right")
    for row in rows:
        t.add_row(*row)
    return t


def add_numerics_argument(p: argparse.ArgumentParser) -> None:
    from ..numerics import DEFAULT_NUMERICS, NUMERICS
    p.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                   help="the oracle's numerics: exact (fp32 math, the weights' error alone; default) or deepseek "
                        "(DeepSeek-V4/V4.1: what DeepSeek's inference/model.py rounds, as the seed cards measure)")


def numerics_floor_lines(floor: dict | None) -> list[str]:
    """The numerics floor, overall and per domain with its 95% CIs: what the choice of numerics alone does."""
    if not floor:
        return []
    o = floor["overall"]
    out = [f"numerics floor ({floor['direction']}): KLD {fmt(o['kld_mean'], '.3e')} "
           f"{fmt_ci(o.get('kld_mean_ci95'), '.2e')}  top-1 {pct(o['top1'])}% {pct_ci(o.get('top1_ci95'))}"]
    for name, d in (floor.get("domains") or {}).items():
        out.append(f"  {name}: KLD {fmt(d['kld_mean'], '.3e')} {fmt_ci(d.get('kld_mean_ci95'), '.2e')}  "
                   f"top-1 {pct(d['top1'])}% {pct_ci(d.get('top1_ci95'))}")
    return out


def truncation_line(panel: dict) -> str | None:
    """What --truncate cut from the panel, where it cut anything."""
    t = panel.get("truncation") or {}
    if not t.get("rows_cut"):
        return None
    return (f"--truncate cut {t['rows_cut']} row(s) to {t['max_len']} tokens: {t['tokens_cut']} tokens "
            f"({t['scored_tokens_cut']} scored) not measured")


def print_report(result: dict, console: Console | None = None, full: bool = False):
    con = console or Console()
    if not con.is_terminal:
        con = Console(width=200 if full else 160, file=con.file)   # pipes and logs default to 80 columns, too narrow
    p = result["panel"]
    con.print(f"panel [bold]{p['name']}[/bold] ({p['rows']} rows, {p['scored_positions']} scored tokens, sha256 "
              f"{p['sha256'][:12]})  reference [cyan]{result['reference']['path']}[/cyan]  {result['direction']}")
    if truncation_line(p):
        con.print(f"[yellow]{truncation_line(p)}[/yellow]")
    if result.get("resumed"):
        con.print(f"resumed: {', '.join(result['resumed'])} read back from the resume folder, not recomputed")
    con.print(f"numerics [bold]{result.get('numerics', 'exact')}[/bold]: {result.get('numerics_label', 'exact')}")
    nf = result.get("noise_floor")
    if nf:
        top1 = fmt(100 * nf["top1"], ".2f") if nf.get("top1") is not None else "-"
        con.print(f"noise floor (reference with ~1 bf16 rounding step of noise on every module output): "
                  f"KLD {fmt(nf['kld_mean'], '.2e')}  top-1 {top1}%")
    for line in numerics_floor_lines(result.get("numerics_floor")):
        con.print(line)
    con.print(_rich_table("per domain (ΔNLL = NLL pack - NLL ref; rows worse: rows whose mean NLL rose, sign test p)",
                          HEADERS, table_rows(result)))
    con.print(_rich_table("summary", SUMMARY_HEADERS, summary_rows(result)))
    for note in uncertainty_notes(result):
        con.print(f"[yellow]{note}[/yellow]", markup=True)
    for r in result["results"]:
        if r.get("status") == "failed":
            con.print(f"[bold red]FAILED[/bold red] {r['label']} ({r['pack']}): {r['error']}", markup=True)
    if result["paired"]:
        pt = Table(title="paired: mean KLD(a) - KLD(b) on the same positions")
        for h in ("a", "b", "difference", "95% CI", "change %", "p-value"):
            pt.add_column(h)
        for d in result["paired"]:
            rel = (d.get("kld") or {}).get("relative_change_pct")
            pt.add_row(d["a"], d["b"], fmt(d["kld_mean_diff"], ".5f"), fmt_ci(d["ci95"], ".5f"), fmt(rel, "+.1f"),
                       fmt(d["p_value"], ".3g"))
        con.print(pt)
    if full:
        for title, headers, rows in _full_tables(result):
            if rows:
                con.print(_rich_table(title, headers, rows))
    else:
        con.print("[dim]--full: KLD quantiles, top-K agreement, Δp, KLD by reference confidence, bpw rows and "
                  "per-domain paired differences (the JSON and Markdown always carry them)[/dim]")


def uncertainty_notes(result: dict) -> list[str]:
    """Why intervals or p-values are shown as '-' (too few rows, no finite position), once per reason."""
    notes = []
    for r in measured(result):
        for where, block in [("overall", r["overall"]), *r["domains"].items()]:
            why = block.get("ci_unavailable")
            if why and f"95% CI not available: {why}" not in notes:
                notes.append(f"95% CI not available: {why}")
    for d in result.get("paired") or []:
        if d.get("unavailable"):
            note = f"paired {d['a']} - {d['b']}: CI and p-value not available: {d['unavailable']}"
            if note not in notes:
                notes.append(note)
    return notes


def markdown(result: dict) -> str:
    def strip(s):
        return s.replace("[b]", "**").replace("[/b]", "**")

    lines = [f"Panel `{result['panel']['name']}` (sha256 `{result['panel']['sha256'][:12]}`), "
             f"{result['panel']['scored_positions']} scored tokens; {result['direction']}. Definitions: fidelity's "
             f"README, \"What compare reports\".", "",
             f"Numerics: `{result.get('numerics', 'exact')}` ({result.get('numerics_label', 'exact')}).", ""]
    if truncation_line(result["panel"]):
        lines += [truncation_line(result["panel"]) + ".", ""]
    floor = numerics_floor_lines(result.get("numerics_floor"))
    if floor:
        lines += [f"- {line.strip()}" for line in floor] + [""]
    for headers, rows in ((SUMMARY_HEADERS, summary_rows(result)), (HEADERS, table_rows(result))):
        lines += ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
        lines += ["| " + " | ".join(strip(c) for c in r) + " |" for r in rows]
        lines.append("")
    if result["paired"]:
        lines += ["| a | b | KLD(a) - KLD(b) | 95% CI | change % | p |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {d['a']} | {d['b']} | {fmt(d['kld_mean_diff'], '.5f')} | {fmt_ci(d['ci95'], '.5f')} | "
                  f"{fmt((d.get('kld') or {}).get('relative_change_pct'), '+.1f')} | {fmt(d['p_value'], '.3g')} |"
                  for d in result["paired"]]
        lines.append("")
    for title, headers, rows in _full_tables(result):
        if not rows:
            continue
        lines += [f"**{title}**", "", "| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
        lines += ["| " + " | ".join(strip(c) for c in r) + " |" for r in rows]
        lines.append("")
    lines += [f"- {n}" for n in uncertainty_notes(result)]
    lines += [f"- **FAILED** {r['label']} (`{r['pack']}`): {r['error']}" for r in result["results"]
              if r.get("status") == "failed"]
    return "\n".join(lines).rstrip("\n") + "\n"


def _write_text(path: str, text: str) -> None:
    import os

    p = Path(path)
    tmp = p.with_name(p.name + ".partial")
    tmp.write_text(text)
    os.replace(tmp, p)


def write_outputs(res, args) -> None:
    from ..measuring.compare import write_records

    res.report.setdefault("command_line", getattr(args, "command_line", None))
    if args.json_out:
        _write_text(args.json_out, json_out.dumps(res.report, indent=2) + "\n")
    if args.markdown:
        _write_text(args.markdown, markdown(res.report))
    if args.out:
        write_records(res, args.out)


class OutLock:
    """An exclusive lock on a folder compare writes into (`--out`, `--resume`): a second compare into it is refused at
    once, naming the folder and the process holding it, instead of racing on its files. Released when the process
    ends, however it ends (flock)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._file = None

    def __enter__(self):
        import fcntl
        import os

        from ..errors import FidelityError

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / ".fidelity-compare.lock"
        self._file = open(path, "a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise FidelityError(
                f"{self.folder} is in use by another fidelity compare ({holder}); wait for it to finish "
                f"or give another --out / --resume folder"
            ) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()}\n")
        self._file.flush()
        return self

    def __exit__(self, *exc):
        if self._file is not None:
            self._file.close()


def _write_error(args, error: BaseException) -> None:
    """The JSON asked for is written even when the run fails: the error in place of the numbers."""
    if getattr(args, "json_out", None):
        from .. import __version__

        _write_text(args.json_out, json.dumps({"fidelity_version": __version__, "status": "error",
                                               "error": f"{type(error).__name__}: {error}",
                                               "command_line": getattr(args, "command_line", None)}, indent=2) + "\n")


def run(args) -> int:
    from contextlib import ExitStack

    from ..oracle import parallel
    from ..measuring.compare import compare
    from ..measuring.metrics import MetricKernel
    from ..errors import FidelityError

    settings = parallel.RunSettings(parallel=args.parallel, **args.environment.run_settings())
    resume = args.resume or (Path(args.out) / "passes" if args.out else None)
    with ExitStack() as locks:
        try:
            if parallel.is_main():
                for folder in dict.fromkeys(f for f in (args.out, resume) if f):
                    locks.enter_context(OutLock(folder))
            res = compare(args.reference, args.packs, panel=args.panel, reference_store=args.reference_store,
                          device=args.device, labels=args.label, noise_floor=not args.no_noise_floor,
                          n_boot=args.bootstrap, seed=args.seed, truncate=args.truncate,
                          progress=parallel.is_main(), resume=resume, numerics=args.numerics,
                          numerics_floor=not args.no_numerics_floor, run_settings=settings,
                          metric_kernel=MetricKernel(backend=args.environment.metrics_kernel),
                          pack_settings=args.environment.pack_settings())
        except BaseException as e:
            parallel.finish(e)
            if parallel.is_main() and isinstance(e, FidelityError):
                _write_error(args, e)
            raise
        parallel.finish()  # every rank got here: the result is complete
        if parallel.is_main():
            write_outputs(res, args)   # every result on disk before anything is printed
            print_report(res.report, full=args.full)
    return 1 if res.report.get("failed") else 0
