"""summary.md: the report's tables as GitHub-flavoured Markdown, ready to paste into a model card."""
from __future__ import annotations

from .tables import Table, num


def escape(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "⏎").replace("`", "ˋ")


def table(t: Table | None, level: int = 3) -> str:
    if t is None:
        return ""
    lines = [f"{'#' * level} {t.title}", "", "| " + " | ".join(escape(h) for h in t.headers) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(t.headers))) + "|"]
    lines += ["| " + " | ".join(escape(c) for c in r) + " |" for r in t.rows]
    if t.note:
        lines += ["", t.note]
    return "\n".join(lines) + "\n"


def _token(text: str, prob: float | None) -> str:
    return f"`{escape(text)}`" + (f" {prob:.2f}" if prob is not None else "")


def worst_table(worst) -> str:
    if not worst:
        return ""
    lines = [
        "### Worst positions (highest KL)",
        "",
        "The token in **bold** is the one predicted at that position.",
        "",
        "| pack | row | domain | pos | KL | text | reference top | pack top |",
        "|---|---|---|---:|---:|---|---|---|",
    ]
    for w in worst:
        ref = ", ".join(_token(t, p) for t, p in w.reference_top[:3]) or "—"
        pack = ", ".join(_token(t, p) for t, p in (w.pack_top or [])[:3]) or "—"
        text = f"…{escape(w.before[-80:])}**{escape(w.token)}**{escape(w.after[:30])}…"
        cells = [escape(w.label), escape(w.row_id), escape(w.domain), str(w.position), num(w.kl), text, ref, pack]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary(title: str, warnings: list[str], groups: list, suites: Table | None, gates: Table | None, provenance: Table,
            gate_worst: list[Table] = (), speed: list[Table] = (), attributions: list = ()) -> str:
    out = [
        f"# {title}",
        "",
        "KL is KL(reference ‖ pack) in nats over scored positions (full vocabulary); 95% CIs are bootstrap "
        "intervals over panel rows.",
        "",
    ]
    out += [f"> **Warning:** {escape(w)}\n" for w in warnings]
    for g in groups:
        out += [f"## {g.heading}", ""]
        if g.warning:
            out += [f"> **Warning:** {escape(g.warning)}", ""]
        out.append(table(g.overall))
        out.append(table(g.tails))
        out.append(table(g.likelihood))
        out += [f"![{f.caption}]({f.name})\n" for f in g.figures_top]
        out += [table(t) for t in g.domain_tables]
        out.append(table(g.paired))
        out.append(table(g.paired_domains))
        out += [f"![{f.caption}]({f.name})\n" for f in g.figures_records]
        out.append(table(g.quantiles))
        out.append(table(g.confidence))
        out += [n + "\n" for n in g.notes]
        out.append(worst_table(g.worst))
        out += [table(t) for t in g.worst_rows]
    for a in attributions:
        out += (
            [f"## {a.heading}", ""] + [table(t) for t in a.tables] + [f"![{f.caption}]({f.name})\n" for f in a.figures]
        )
    if suites:
        out.append(table(suites, 2))
    if gates:
        out.append(table(gates, 2))
        out += [table(t) for t in gate_worst]
    out += [table(t, 2) for t in speed]
    out.append(table(provenance, 2))
    return "\n".join(s for s in out if s is not None).rstrip() + "\n"
