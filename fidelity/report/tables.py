"""Tables shared by the HTML page and the Markdown summary, so both print the same numbers the same way."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..measuring.result_schema import PairedBlock, Scope
from .figures import domain_rows
from .inputs import Group


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    note: str = ""
    status_columns: tuple[int, ...] = ()     # pass/fail columns the HTML colours
    classes: list[str] = field(default_factory=list)


def num(x, digits: int = 4) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def pct(x) -> str:
    return "—" if x is None else f"{100 * float(x):.2f}%"


def ci(v) -> str:
    """An interval as written (`[lo, hi]`), or "" where there is none."""
    if isinstance(v, (list, tuple)) and len(v) == 2:
        return f"[{num(v[0])}, {num(v[1])}]"
    return ""


SUPERSCRIPTS = "¹²³⁴⁵⁶⁷⁸⁹"


class Reasons:
    """Why intervals or p-values are absent, numbered once per table: a cell gets the reason's mark, the table's note
    the reasons."""

    def __init__(self):
        self.reasons: list[str] = []

    def mark(self, reason: str | None) -> str:
        reason = reason or "the result does not say why (written by an older fidelity)"
        if reason not in self.reasons:
            self.reasons.append(reason)
        i = self.reasons.index(reason) + 1
        return "".join(SUPERSCRIPTS[int(c) - 1] if c != "0" else "⁰" for c in str(i))

    def note(self) -> str:
        return " ".join(f"{self.mark(r)} no interval: {r}." for r in self.reasons)


def interval_reason(block, ci_key: str) -> str | None:
    """Why `block[ci_key]` is null, as compare recorded it: the field's own reason, else the scope's (a pack's scope
    says `ci_unavailable`, a paired block `unavailable`; a quantile has a reason of its own)."""
    keys = (f"{ci_key}_unavailable", "unavailable", "ci_unavailable")
    return next((getattr(block, k) for k in keys if hasattr(block, k) and getattr(block, k)), None)


def with_ci(block, key: str, reasons: Reasons | None = None) -> str:
    """The estimate `key` of a result block with its interval; a missing interval gets its reason's mark."""
    e = block.estimate(key)
    c = ci(e.ci95)
    if not c and reasons is not None and e.value is not None:
        return f"{num(e.value)}{reasons.mark(interval_reason(block, f'{key}_ci95'))}"
    return f"{num(e.value)} {c}".strip()


def ceil_significant(x: float, digits: int = 2) -> float:
    """`x` rounded up to `digits` significant digits (a bound printed short stays a bound)."""
    if x <= 0:
        return x
    step = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return math.ceil(x / step * (1 - 1e-12)) * step


def p_text(p, floor=None, digits: int = 3) -> str:
    """A p-value; one at the bootstrap's floor (no replicate, or one, beyond 0: compare's `p_value_floor`, computed
    from the replicate count) is "< floor": the replicates bound it, they do not measure it."""
    if p is None:
        return "—"
    if floor is not None and p <= floor * (1 + 1e-9):
        return f"< {ceil_significant(floor):.2g}"
    return num(p, digits)


def times_floor(o: Scope) -> str:
    k, f = o.kld_mean, o.noise_floor_kld
    r = o.x_noise_floor
    if r is None and (k is None or not f):
        return "—"
    r = float(r) if r is not None else float(k) / float(f)
    return f"{r:.0f}×" if r >= 100 else f"{r:.3g}×"


def overall_table(g: Group) -> Table:
    headers = ["pack", "bpw", "KLD mean [95% CI]", "KLD domains equal", "× noise floor", "top-1", "non-finite"]
    flips = any(p.overall.top1_flips_clear is not None for p in g.packs)
    if flips:
        headers.insert(6, "top-1 flips clear / near-tie")
    rows, reasons = [], Reasons()
    for p in g.packs:
        o = p.overall
        row = [p.label, num(p.bpw), with_ci(o, "kld_mean", reasons),
               with_ci(o, "kld_domains_equal", reasons), times_floor(o), pct(o.top1),
               num(o.nonfinite)]
        if flips:
            row.insert(6, f"{num(o.top1_flips_clear)} / {num(o.top1_flips_near_tie)}")
        rows.append(row)
    floor = next((p.overall.noise_floor_kld for p in g.packs if p.overall.noise_floor_kld), None)
    note = "KL(reference ‖ pack) in nats over scored positions; 95% CIs by bootstrap over panel rows."
    tie = next((p.overall.tie_margin for p in g.packs if p.overall.tie_margin is not None), None)
    if flips and tie is not None:
        note += f" A near-tie flip is a top-1 change where the reference's top-2 margin is below {num(tie)} nats."
    if floor:
        note += f" Noise floor (reference re-run with a tiny seeded perturbation): {num(floor)}."
    return Table("Overall", headers, rows, f"{note} {reasons.note()}".strip())


def _rows_worse(o: Scope) -> tuple[str, str, str]:
    rw = o.rows_worse
    if rw is None:
        return "—", "—", "—"
    share = f"{pct(rw.share)} {ci_pct(rw.share_ci95)}".strip()
    return f"{num(rw.worse)} / {num(rw.rows)}", share, num(rw.sign_test_p, 3)


def ci_pct(v) -> str:
    return f"[{pct(v[0])}, {pct(v[1])}]" if isinstance(v, (list, tuple)) and len(v) == 2 else ""


def likelihood_table(g: Group) -> Table:
    """compare's likelihood numbers: absolute NLL on both sides, ΔNLL with its CI and SE, rows worse with its sign test,
    and KL the other way, KL(pack ‖ reference)."""
    rows, reasons = [], Reasons()
    for p in g.packs:
        o = p.overall
        worse, share, sign_p = _rows_worse(o)
        rows.append([p.label, with_ci(o, "nll_ref_mean", reasons), with_ci(o, "nll_mean", reasons),
                     with_ci(o, "delta_nll_mean", reasons), num(o.delta_nll_mean_se),
                     worse, share, sign_p, with_ci(o, "kld_reverse_mean", reasons)])
    note = (
        "NLL: mean −log p of the true next token, nats per scored position (reference / pack); "
        "ΔNLL = pack − reference, "
        "SE its row-bootstrap standard error; rows worse: rows whose mean NLL rose, of the rows scored, with the "
        "two-sided sign test of worse against better rows."
    )
    return Table("Likelihood: NLL, ΔNLL, rows worse",
                 ["pack", "NLL reference", "NLL pack", "ΔNLL [95% CI]", "ΔNLL SE", "rows worse", "share worse [95% CI]",
                  "sign test p", "KLD(pack‖ref) [95% CI]"], rows, f"{note} {reasons.note()}".strip())


def tails_table(g: Group) -> Table:
    """Perplexities and the KL tail compare measured on all scored positions (the overall table's second half)."""
    rows = [[p.label, num(p.overall.ppl), num(p.overall.ppl_ref), num(p.overall.kld_median),
             num(p.overall.kld_p99), num(p.overall.kld_p999), num(p.overall.kld_max)] for p in g.packs]
    return Table(
        "Perplexity and KL tail", ["pack", "PPL", "PPL ref", "KL median", "KL p99", "KL p99.9", "KL max"], rows
    )


def domain_table(g: Group, key: str, title: str, fmt, reasons: Reasons | None = None) -> Table:
    packs = g.packs
    rows = []
    for d in domain_rows(packs):
        cells = [fmt(p.domains[d], key) if d in p.domains else "—" for p in packs]
        n = next((p.domains[d].positions for p in packs if d in p.domains), None)
        rows.append([d, num(n)] + cells)
    return Table(title, ["domain", "positions"] + [p.label for p in packs], rows, reasons.note() if reasons else "")


def per_domain_tables(g: Group) -> list[Table]:
    reasons = Reasons()
    return [
        domain_table(g, "kld_mean", "KLD mean per domain [95% CI]", lambda b, k: with_ci(b, k, reasons), reasons),
        domain_table(g, "top1", "Top-1 agreement per domain", lambda b, k: pct(getattr(b, k))),
        domain_table(g, "ppl", "Perplexity per domain", lambda b, k: num(getattr(b, k))),
    ]


def _paired_cells(v: PairedBlock, reasons: Reasons) -> list[str]:
    """A − B [CI], change % [CI], p (at the bootstrap floor: "< floor") of one scope of a paired block."""
    diff = with_ci(v, "diff", reasons)
    change = num(v.relative_change_pct, 3)
    c = v.relative_change_pct_ci95
    if isinstance(c, (list, tuple)) and len(c) == 2:
        change += f" [{num(c[0], 3)}, {num(c[1], 3)}]"
    elif v.relative_change_pct is not None:
        change += reasons.mark(v.relative_change_pct_unavailable or v.unavailable)
    p = p_text(v.p_value, v.p_value_floor)
    if v.p_value is None and v.diff is not None:
        p += reasons.mark(v.unavailable)
    return [diff, change, p]


def _shown_pairs(g: Group):
    for run in g.runs:
        shown = {r.original_label: r.label for r in run.results}
        for pr in run.paired:
            yield tuple(shown.get(str(x), str(x)) for x in (pr.a, pr.b)), pr


def paired_table(g: Group) -> Table | None:
    rows, reasons = [], Reasons()
    for (a, b), pr in _shown_pairs(g):
        k = pr.kld
        if k is None:    # a result without the per-metric block: its top-level numbers
            k = PairedBlock(diff=pr.kld_mean_diff, diff_ci95=pr.ci95, p_value=pr.p_value, unavailable=pr.unavailable)
        rows.append([a, b, *_paired_cells(k, reasons)])
    if not rows:
        return None
    return Table(
        "Paired, pack A vs pack B (per-row KL difference)",
        ["A", "B", "KLD mean A − B [95% CI]", "change % [95% CI]", "p-value"],
        rows,
        "Negative: A is closer to the reference than B. Change % = 100 (A − B) / B. A p-value at the bootstrap's "
        "floor (no replicate beyond 0) prints as \"< floor\". " + reasons.note(),
    )


def paired_domains_table(g: Group) -> Table | None:
    """Per domain and domains-equal, with the Holm-corrected p across domains, as compare writes them."""
    rows, reasons = [], Reasons()
    for (a, b), pr in _shown_pairs(g):
        k = pr.kld
        if k is None or k.domains is None:
            continue
        for name, v in k.domains.items():
            holm = v.p_holm
            at_floor = v.p_value_floor is not None and v.p_value is not None and \
                v.p_value <= v.p_value_floor * (1 + 1e-9)
            holm_text = "—" if holm is None else (f"< {ceil_significant(holm):.2g}" if at_floor else num(holm, 3))
            rows.append([a, b, name, *_paired_cells(v, reasons), holm_text])
        if k.domains_equal is not None:
            rows.append([a, b, "domains equal", *_paired_cells(k.domains_equal, reasons), ""])
    if not rows:
        return None
    return Table("Paired per domain (Holm across domains)",
                 ["A", "B", "domain", "KLD mean A − B [95% CI]", "change % [95% CI]", "p-value", "p Holm"], rows,
                 "A Holm p whose own p is at the bootstrap floor is an upper bound: \"< bound\". " + reasons.note())


def quantile_table(g: Group, quantiles: dict[str, dict]) -> Table:
    headers = ["pack", "positions", "mean", "median", "p90", "p99", "p99.9", "max"]
    rows = []
    for label, q in quantiles.items():
        rows.append(
            [
                label,
                num(q.get("positions")),
                num(q.get("mean")),
                num(q.get("p50")),
                num(q.get("p90")),
                num(q.get("p99")),
                num(q.get("p99.9")),
                num(q.get("max")),
            ]
        )
    return Table("KL distribution per pack", headers, rows)


def confidence_table(tables: dict) -> Table | None:
    if not tables:
        return None
    labels = list(tables)
    first = tables[labels[0]]
    rows = []
    for i, b in enumerate(first["bucket"]):
        rows.append([b, num(int(first["positions"].iloc[i]))] + [
            num(tables[lb]["kld_mean"].iloc[i]) if tables[lb]["positions"].iloc[i] else "—" for lb in labels])
    return Table(
        "Mean KL by reference confidence (reference probability of its top token)",
        ["bucket", "positions"] + labels,
        rows,
    )


# ---- suites and gates: the JSON of `fidelity suite compare` and `fidelity gate`, read generously ---------------------

_SUITE_COLUMNS = [
    ("suite", "suite"),
    ("mode", "mode"),
    ("b", "candidate"),
    ("n_items", "items"),
    ("pass_rate_a", "pass rate A"),
    ("pass_rate_b", "pass rate B"),
    ("score.score_a", "score A"),
    ("score.score_b", "score B"),
    ("drop", "drop (points)"),
    ("flips_a_to_b", "A✓ B✗"),
    ("flips_b_to_a", "A✗ B✓"),
    ("passed.flip_rate", "flip rate"),
    ("test", "test"),
    ("p_value", "p-value"),
    ("excluded", "excluded / unpaired"),
    ("verdict", "verdict"),
]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, (str, int, float, bool)) or v is None:
            out[f"{prefix}{k}"] = v
    return out


def _cell(v) -> str:
    if isinstance(v, str):
        return v if len(v) <= 60 else v[:57] + "…"
    return num(v)


def _suite_items(data) -> list[dict]:
    if isinstance(data, list):
        return [x for d in data for x in _suite_items(d)]
    if isinstance(data.get("suites"), list):
        return [x for d in data["suites"] for x in _suite_items(d)]
    return [data]


def suite_table(entries: list[tuple[str, dict]]) -> Table | None:
    flat = []
    for _, data in entries:
        for it in _suite_items(data):
            f = _flatten(it)
            errors = it.get("errors") if isinstance(it.get("errors"), dict) else {}
            unpaired = sum(len(it.get(k) or []) for k in ("only_in_a", "only_in_b", "prompt_changed"))
            if errors or unpaired:
                f["excluded"] = f"{errors.get('excluded_pairs', 0)} errors / {unpaired}"
            for side in ("a", "b"):
                if isinstance(f.get(side), str):
                    f[side] = Path(f[side]).name or f[side]
            flat.append(f)
            metrics = it.get("metrics") if isinstance(it.get("metrics"), dict) else {}
            for name, m in metrics.items():  # evalplus base / plus, IFEval's four, MMLU / GSM8K filters: a row each
                if isinstance(m, dict) and "rate_a" in m:
                    flat.append({"suite": f"{it.get('suite', '?')} · {name}", "mode": f.get("mode"), "b": f.get("b"),
                                 "n_items": m.get("of"), "pass_rate_a": m["rate_a"], "pass_rate_b": m.get("rate_b"),
                                 "drop": m.get("drop"), "flips_a_to_b": m.get("flips_a_to_b", m.get("items_worse")),
                                 "flips_b_to_a": m.get("flips_b_to_a", m.get("items_better")), "test": m.get("test"),
                                 "p_value": m.get("p_value"), "verdict": m.get("verdict")})
    if not flat:
        return None
    cols = [(k, h) for k, h in _SUITE_COLUMNS if any(k in f for f in flat)]
    rows = []
    for f in flat:
        row = []
        for k, _ in cols:
            v = f.get(k)
            if (k.startswith("pass_rate") or k.endswith("flip_rate")) and v is not None:
                row.append(pct(v))
            elif k == "p_value":
                row.append(num(v, 3))
            else:
                row.append(_cell(v))
        rows.append(row)
    notes = sorted({f["warning"] for f in flat if f.get("warning")})
    return Table(
        "Suites, candidate (B) paired against the reference build (A)",
        [h for _, h in cols],
        rows,
        note=" ".join(notes) + (" " if notes else "") + "A drop counts in percentage points; the verdict fails a "
        "candidate when the drop is larger than the threshold at p below alpha. Rows 'suite · metric' are the "
        "suite's named metrics (pooled: items = trials; instruction-level rows count items worse / better).",
        status_columns=tuple(i for i, (k, _) in enumerate(cols) if k == "verdict"),
    )


def _gate_list(data) -> list[dict]:
    if isinstance(data, list):
        return data
    gates = data.get("gates", [data])
    if isinstance(gates, dict):
        gates = [{"gate": k, **v} for k, v in gates.items()]
    return gates


def _gate_status(gt: dict) -> str:
    if gt.get("error"):
        return "error"
    if gt.get("status"):
        return str(gt["status"])
    for k in ("passed", "pass", "ok"):
        if k in gt:
            return "pass" if gt[k] else "fail"
    return str(gt.get("verdict") or "?")


def gate_table(entries: list[tuple[str, dict]]) -> Table | None:
    """One line per check: measured value against its threshold, from GateResult.to_dict() (`checks`) or
    measured/thresholds."""
    rows = []
    for _, data in entries:
        for gt in _gate_list(data):
            name, status = str(gt.get("gate") or gt.get("name") or "?"), _gate_status(gt)
            checks = gt.get("checks") or []
            for c in checks:
                ok = c.get("passed")
                rows.append([name, status, str(c.get("metric")), _cell(c.get("value")),
                             f"{c.get('op', '')} {_cell(c.get('threshold'))}".strip(), "pass" if ok else "fail"])
            if not checks:
                measured = _flatten(gt.get("measured") or {})
                limits = _flatten(gt.get("thresholds") or {})
                for m, v in measured.items():
                    limit = next((limits[k] for k in (m, f"{m}_max", f"{m}_min") if k in limits), None)
                    rows.append([name, status, m, _cell(v), _cell(limit) if limit is not None else "—", "—"])
            if gt.get("error"):
                rows.append([name, "error", "error", _cell(str(gt["error"])), "—", "—"])
            elif not checks and not gt.get("measured"):
                rows.append([name, status, "—", "—", "—", "—"])
    if not rows:
        return None
    runs = [
        f"{d['engine']}"
        + (f" ({d['model']})" if d.get("model") else "")
        + (f": {d['status']}" if d.get("status") else "")
        for _, d in entries
        if isinstance(d, dict) and d.get("engine")
    ]
    return Table("Engine gates", ["gate", "gate status", "check", "measured", "threshold", "check status"], rows,
                 note="; ".join(runs), status_columns=(1, 5), classes=["left"])


def gate_worst_tables(entries: list[tuple[str, dict]]) -> list[Table]:
    """Each gate's worst examples (its own columns), so a failing gate shows where it failed."""
    out = []
    for _, data in entries:
        for gt in _gate_list(data):
            worst = [_flatten(w) for w in gt.get("worst") or [] if isinstance(w, dict)]
            if not worst:
                continue
            keys = list(dict.fromkeys(k for w in worst for k in w))[:10]
            notes = " ".join(str(n) for n in gt.get("notes") or [])
            out.append(Table(f"Worst examples: {gt.get('gate') or gt.get('name')}", keys,
                             [[_cell(w.get(k)) for k in keys] for w in worst], note=notes, classes=["left"]))
    return out


def known(block, key: str) -> str:
    """A block's value for `key`, "?" where the result left the key out."""
    return "?" if key in block.absent else getattr(block, key)


def provenance_table(groups: list[Group], report_meta: dict, suites=(), gates=()) -> Table:
    rows = []
    for i, g in enumerate(groups, 1):
        p = g.panel
        rows.append([f"group {i}: panel", f"{known(p, 'name')} · sha256 {known(p, 'sha256')} · rows {num(p.rows)} · "
                     f"scored positions {num(p.scored_positions)}"])
        ref = g.reference
        rows.append([f"group {i}: reference", f"{known(ref, 'path')} · {ref.format or 'format ?'} · fingerprint "
                     f"{known(ref, 'fingerprint')}" + (f" · store {ref.store}" if ref.store else "")])
        for pk in g.packs:
            rows.append([f"group {i}: pack {pk.label}", f"{pk.pack} · {pk.format or 'format ?'} · fingerprint "
                         f"{pk.fingerprint or '—'} · bpw {num(pk.bpw)} · from {Path(pk.source).name}"])
        for run in g.runs:
            # command_line: added by the command after the run; version / command / argv: hand-made results
            extra = run.report.extra
            ver = run.report.fidelity_version or extra.get("version") or extra.get("library_version")
            cmd = extra.get("command_line") or extra.get("command") or extra.get("argv")
            if isinstance(cmd, list):
                cmd = " ".join(map(str, cmd))
            rows.append([f"group {i}: {Path(run.source).name}", f"fidelity {ver or '?'} · command: {cmd or '—'}"])
    for source, data in suites:
        for it in _suite_items(data):
            rows.append(
                [
                    f"suite {it.get('suite', '?')}",
                    f"A {it.get('a', '?')} · B {it.get('b', '?')} · from {Path(source).name}",
                ]
            )
    for source, data in gates:
        d = data if isinstance(data, dict) else {}
        rows.append(["gates", f"engine {d.get('engine', '?')} · model {d.get('model', '?')} · reference store "
                     f"{d.get('reference_store') or '—'} · from {Path(source).name}"])
    rows.append(["this report", f"fidelity {report_meta['version']} · command: {report_meta['command_line']} · "
                 f"generated {report_meta['generated']}"])
    return Table("Provenance", ["what", "value"], rows, classes=["left"])


# ---- speed: `fidelity bench --json` and `fidelity ladder --json` -----------------------------------------------------

def speed_tables(entries: list[tuple[str, dict]]) -> list[Table]:
    """One table per bench (metric medians, spreads, the A/A spread) and per ladder (rungs, deltas, verdicts)."""
    out = []
    for source, d in entries:
        if d.get("kind") == "fidelity-bench":
            aa = (d.get("aa") or {}).get("spread_pct") or {}
            rows = [[k, num(m.get("median")), num(m.get("min")), num(m.get("max")), num(m.get("spread_pct"), 3),
                     num(aa.get(k), 3), str(m.get("unit", ""))] for k, m in d["metrics"].items()]
            s = d.get("settings", {})
            out.append(Table(f"Speed: {d.get('engine')} ({d.get('model')})",
                             ["metric", "median", "min", "max", "± %", "A/A %", "unit"], rows,
                             note=f"{source}; {s.get('repeats')} repeats, {s.get('max_tokens')} tokens per request, "
                                  f"{len(d.get('errors', []))} failed requests", classes=["left"]))
        else:
            rows = []
            for r in d["rungs"]:
                deltas = (
                    "; ".join(
                        f"{m} {v['change_pct']:+.1f} % (± {v['spread_pct']:.1f})"
                        for m, v in r["deltas"].items()
                        if v.get("change_pct") is not None
                    )
                    or "—"
                )
                rows.append(
                    [
                        r["rung"],
                        str(r.get("rank", "—")),
                        num(r["metrics"].get(d["accept"]["single_stream_metric"])),
                        deltas,
                        r["gates"],
                        r["verdict"],
                        r["reason"],
                    ]
                )
            out.append(Table(f"Tuning ladder ({d.get('model')}): best {d.get('best')}",
                             ["rung", "rank", f"{d['accept']['single_stream_metric']} tok/s", "deltas vs best before",
                              "gates", "verdict", "reason"], rows, note=source, status_columns=(4,), classes=["left"]))
    return out
