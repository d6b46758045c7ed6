"""`fidelity card`: a model-card section in Markdown, every table the seed cards print filled from fidelity's results
alone.

Sections, each from what `fidelity report` reads (`inputs.load_inputs`: compare JSON or `compare --out` folders grouped
by panel, suite-compare JSON, bench JSON):

- quality vs native: per build KLD (domains equal in parentheses) with its CI, top-1, PPL and NLL native -> build,
  paired ΔNLL ± SE, rows worse (seed 000's pre-serving table, seed 001's Results);
- this build against each other build on the same panel: "closer on N of M domains", and per domain KL · top-1 of both,
  the change in KL with its CI and the paired p (Holm) (seed 001's comparison, seed 002's per-set KL table);
- suites: one row per suite, base / plus and prompt / instruction pairs on one row, pass/fail differences as questions
  gained or lost, paired p-values and the verdict rule (seeds 001 and 002);
- speed: one column per labelled bench, % change against the first with the spread a change must exceed (seed 002);
- methods: panel, reference, numerics and its floor, noise floor, bootstrap.

Every number is followed by an HTML comment naming where it comes from:
`<!-- compare.json#/results/0/overall/kld_mean -->` (the file as given, then an RFC 6901 JSON Pointer in its
URI-fragment form), or, for a number the card derives (a count, a % change of two benches), the formula over such
pointers. Why comments: Hugging Face renders model cards as Markdown with HTML comments dropped (its own model-card
template is full of them), as GitHub does, so the card reads as the seed cards do while its source keeps the trail from
each number to its field; footnotes or links on every number would bury the tables, and neither the Hub nor GitHub can
open a JSON Pointer anyway.
"""
from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from .inputs import Group, PackResult, ReportInputError, _find_compare_json, load_inputs
from .markdown import escape
from ..measuring.result_schema import PairedBlock, PairedDifference, Scope
from .tables import Reasons, ceil_significant, interval_reason, known
from ..engine.bench import compare_bench

MINUS = "−"


class CardError(ReportInputError):
    """What the card is asked for is not in the results given (a --build no result holds)."""


# ---- numbers and where they come from --------------------------------------------------------------------------------

def pointer(*path) -> str:
    """RFC 6901 JSON Pointer in its URI-fragment form (`~0`, `~1`, percent-encoding); no `--` (it would end the
    comment)."""
    raw = "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)
    return urllib.parse.quote(raw, safe="/~!$&'()*+,;=:@").replace("--", "-%2D")


@dataclass(frozen=True)
class Source:
    """One input file as the card names it."""

    name: str

    def at(self, *path) -> str:
        return f"{self.name.replace('--', '-%2D')}#{pointer(*path)}"


def note(text: str) -> str:
    """An HTML comment; `--`, `<`, `>` and `|` (which would end it, or the table cell it is in) percent-encoded."""
    for c, code in (("--", "-%2D"), ("|", "%7C"), ("<", "%3C"), (">", "%3E")):
        text = text.replace(c, code)
    return f"<!-- {text} -->"


def fixed(x: float, sig: int = 3) -> str:
    """`sig` significant digits in plain decimals (no exponent: 0.0000140, not 1.4e-05)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:.{sig - 1}f}" if x == 0 else str(x)
    decimals = max(0, sig - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}".replace("-", MINUS)


def signed(text: str, x: float) -> str:
    return text if text.startswith(MINUS) or x == 0 else "+" + text


def p_value(p: float | None, floor: float | None = None) -> str:
    if p is None:
        return "—"
    if floor is not None and p <= floor * (1 + 1e-9):
        return f"< {ceil_significant(floor):.2g}"
    if p < 0.001:
        return "< 0.001"
    return f"{p:.2g}" if p < 0.1 else f"{p:.2f}"


@dataclass
class Num:
    """A value printed its way, with the source comment that follows it."""

    text: str
    source: str

    def __str__(self) -> str:
        return f"{self.text}{note(self.source)}"


def get(block: dict, *path):
    for p in path:
        if not isinstance(block, (dict, list)):
            return None
        try:
            block = block[p]
        except (KeyError, IndexError, TypeError):
            return None
    return block


# ---- compare: quality vs native, and against the other builds --------------------------------------------------------

@dataclass
class Located:
    """A pack's result with the file and JSON path of its entry."""

    pack: PackResult
    src: Source
    path: tuple

    def at(self, *rest) -> str:
        return self.src.at(*self.path, *rest)


def _sources(items) -> dict[str, str]:
    """Input -> the name the card gives it: the file name (a folder: folder/compare.json), the path given where names
    clash."""
    names = {}
    for item in items:
        p = Path(item)
        name = f"{p.name}/{_find_compare_json(p).name}" if p.is_dir() and _find_compare_json(p) else p.name
        names[str(p)] = name
    clashes = {n for n in names.values() if list(names.values()).count(n) > 1}
    return {k: (str(k) if v in clashes else v) for k, v in names.items()}


def _ci(block: Scope, key: str, src: str, fmt, reasons: Reasons, reason: str | None = None) -> str:
    v = getattr(block, key)
    if isinstance(v, (list, tuple)) and len(v) == 2 and None not in v:
        return f"[{Num(fmt(v[0]), f'{src}/0')}, {Num(fmt(v[1]), f'{src}/1')}]"
    return "no CI" + reasons.mark(reason or interval_reason(block, key))


def _quality_table(g: Group, located: list[Located], this: str) -> list[str]:
    reasons = Reasons()
    rows = []
    for loc in located:
        o, p = loc.pack.overall, loc.pack
        label = f"**{escape(p.label)}** (this build)" if p.label == this else escape(p.label)

        def at(*k):
            return loc.at("overall", *k)

        kld = o.kld_mean
        kld_cell = "—" if kld is None else f"{Num(fixed(kld), at('kld_mean'))}"
        if kld is not None and o.kld_domains_equal is not None:
            kld_cell += f" ({Num(fixed(o.kld_domains_equal), at('kld_domains_equal'))})"
        ci = "—" if kld is None else _ci(o, "kld_mean_ci95", at("kld_mean_ci95"), fixed, reasons)
        top1 = "—" if o.top1 is None else str(Num(f"{100 * o.top1:.2f}%", at("top1")))
        ppl = _arrow(o, "ppl_ref", "ppl", at, lambda x: f"{x:.4f}")
        nll = _arrow(o, "nll_ref_mean", "nll_mean", at, lambda x: f"{x:.4f}")
        d = o.delta_nll_mean
        dnll = "—"
        if d is not None:
            dnll = str(Num(signed(f"{d:.4f}".replace("-", MINUS), d), at("delta_nll_mean")))
            se = o.delta_nll_mean_se
            dnll += f" ± {Num(f'{se:.4f}', at('delta_nll_mean_se'))}" if se is not None else \
                " ± no SE" + reasons.mark(o.ci_unavailable)
        rw = o.rows_worse
        worse = "—" if rw is None else f"{Num(str(rw.worse), at('rows_worse', 'worse'))} / " \
                                       f"{Num(str(rw.rows), at('rows_worse', 'rows'))}"
        bpw = "—" if p.bpw is None else str(Num(f"{p.bpw:.2f}", loc.at("bpw")))
        rows.append([label, bpw, kld_cell, ci, top1, ppl, nll, dnll, worse])
    head = ["build", "bpw", "KLD vs native (domains equal)", "KLD 95% CI", "top-1 agreement", "PPL native → build",
            "NLL native → build", "paired ΔNLL ± SE", "rows worse"]
    n_dom = len(g.packs[0].domains) if g.packs else 0
    out = _table(head, rows)
    out.append("")
    out.append(
        f"KLD: KL(native ‖ build) in nats, the mean over {_scored(g)} scored positions; in parentheses the mean of "
        f"the {n_dom} domains' means (domains weighted equally). Top-1 agreement: the share of positions where "
        "both argmax tokens match. NLL: −log p of the panel's next token, nats per position. Paired ΔNLL: NLL "
        "build − native on the same positions ± its row-bootstrap standard error. Rows worse: panel rows whose "
        "mean NLL rose, of the rows scored." + _reasons_note(reasons)
    )
    return out


def _scored(g: Group) -> str:
    n = g.panel.scored_positions
    return f"{n:,}" if isinstance(n, int) else "the"


def _reasons_note(reasons: Reasons) -> str:
    return (" " + reasons.note()) if reasons.reasons else ""


def _arrow(o: Scope, ref_key: str, key: str, at, fmt) -> str:
    if getattr(o, ref_key) is None or getattr(o, key) is None:
        return "—"
    return f"{Num(fmt(getattr(o, ref_key)), at(ref_key))} → {Num(fmt(getattr(o, key)), at(key))}"


def _table(head: list[str], rows: list[list[str]], align: list[str] | None = None) -> list[str]:
    align = align or ["---"] + ["---:"] * (len(head) - 1)
    return ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"] + ["| " + " | ".join(r) + " |" for r in rows]


@dataclass
class Pair:
    """This build against another, from compare's paired entry (this build is A or B there)."""

    this: Located
    other: Located
    entry: PairedDifference
    src: Source
    index: int
    this_is_a: bool

    def at(self, *rest) -> str:
        return self.src.at("paired", self.index, "kld", *rest)


def _pairs(g: Group, located: list[Located], this: Located) -> list[Pair]:
    by_label = {(loc.src.name, loc.pack.original_label): loc for loc in located}
    out = []
    for run in g.runs:
        src = next(loc.src for loc in located if loc.pack.source == run.source)
        for j, pr in enumerate(run.paired):
            a, b = by_label.get((src.name, str(pr.a))), by_label.get((src.name, str(pr.b)))
            if a is None or b is None or (a is not this and b is not this) or pr.kld is None:
                continue
            out.append(Pair(this, b if a is this else a, pr, src, j, a is this))
    return out


def _change(pair: Pair, block: PairedBlock, path: tuple, reasons: Reasons) -> str:
    """Change in KL of this build against the other, %, with its CI: compare's 100 (A − B) / B when this build is A;
    when it is B, 100 (B / A − 1) = −100 r / (100 + r) of compare's r (and the CI's ends swap)."""
    r = block.relative_change_pct
    if r is None:
        return "—"
    at = pair.at(*path, "relative_change_pct")
    ci = block.relative_change_pct_ci95
    if pair.this_is_a:
        text = str(Num(signed(f"{r:.1f}".replace("-", MINUS), r) + "%", at))
        if isinstance(ci, list) and None not in ci:
            text += f" [{Num(_pct1(ci[0]), pair.at(*path, 'relative_change_pct_ci95', 0))}, " \
                    f"{Num(_pct1(ci[1]), pair.at(*path, 'relative_change_pct_ci95', 1))}]"
        else:
            text += reasons.mark(block.relative_change_pct_unavailable or block.unavailable)
        return text

    def inv(x):
        return -100 * x / (100 + x)

    def formula(p):
        return f"−100 × {p} ÷ (100 + {p})"

    text = f"{_pct1(inv(r))}{note(formula(at))}"
    if isinstance(ci, list) and None not in ci:
        lo, hi = (pair.at(*path, "relative_change_pct_ci95", k) for k in (1, 0))
        text += f" [{_pct1(inv(ci[1]))}{note(formula(lo))}, {_pct1(inv(ci[0]))}{note(formula(hi))}]"
    else:
        text += reasons.mark(block.relative_change_pct_unavailable or block.unavailable)
    return text


def _pct1(x: float) -> str:
    return signed(f"{x:.1f}".replace("-", MINUS), x) + "%"


def _closer(pair: Pair) -> tuple[list[str], list[str], list[str]]:
    """Domains where this build is closer to native (its KL lower on the positions finite in both), those where the
    other is, and those where this build is closer at Holm p < 0.05."""
    closer, farther, significant = [], [], []
    for name, v in (pair.entry.kld.domains or {}).items():
        d = v.diff
        if d is None or d == 0:
            continue
        mine = d < 0 if pair.this_is_a else d > 0
        (closer if mine else farther).append(name)
        if mine and v.p_holm is not None and v.p_holm < 0.05:
            significant.append(name)
    return closer, farther, significant


def _pair_section(g: Group, pair: Pair) -> list[str]:
    k = pair.entry.kld
    domains = k.domains or {}
    closer, farther, significant = _closer(pair)
    this, other = escape(pair.this.pack.label), escape(pair.other.pack.label)
    sign = "below 0" if pair.this_is_a else "above 0"
    count = note(f"count of {pair.at('domains', '*', 'diff')} {sign}")
    eq = k.domains_equal
    eq_d = eq.diff if eq is not None else None
    eq_text = ""
    if eq_d is not None:
        eq_closer = (eq_d < 0) == pair.this_is_a
        eq_text = (
            " and with the domains weighted equally"
            if eq_closer
            else "; with the domains weighted equally it is farther"
        ) + note(f"sign of {pair.at('domains_equal', 'diff')}")
    line = (f"Against **{other}**: {this} is closer to native on {len(closer)}{count} of the {len(domains)} domains"
            f"{eq_text}")
    if significant:
        line += f" (Holm-corrected paired p < 0.05 on {len(significant)}: {', '.join(map(escape, significant))})"
    line += "."
    if farther:
        line += f" {other} is closer on {', '.join(map(escape, farther))}."
    out = [line, ""]
    reasons = Reasons()
    rows = []
    for name in domains:
        v = domains[name]
        rows_n = pair.this.pack.domains[name].rows if name in pair.this.pack.domains else None
        rows.append(
            [
                f"{escape(name)}" + (f" ({rows_n} rows)" if rows_n is not None else ""),
                _kl_top1(pair.this, name),
                _kl_top1(pair.other, name),
                _change(pair, v, ("domains", name), reasons),
                _p(pair, v, ("domains", name), holm=True, reasons=reasons),
            ]
        )
    rows.append(["all positions", _kl_top1(pair.this, None), _kl_top1(pair.other, None), _change(pair, k, (), reasons),
                 _p(pair, k, (), holm=False, reasons=reasons)])
    if eq is not None:
        rows.append(["domains weighted equally", _kl_eq(pair.this), _kl_eq(pair.other),
                     _change(pair, eq, ("domains_equal",), reasons), _p(pair, eq, ("domains_equal",), False, reasons)])
    out += _table(["domain", f"{this}: KL · top-1", f"{other}: KL · top-1", "change in KL [95% CI]",
                   "paired p (Holm)"], rows)
    out += [
        "",
        f"Change in KL: 100 × ({this} − {other}) ÷ {other}, on the positions finite in both, with its 95% row-"
        "bootstrap interval (the analytic one on log ratio where the bootstrap cannot resolve a domain's tails). "
        "Paired p: the per-row KL difference is 0, read off the same bootstrap, Holm-corrected across the "
        "domains; one at the bootstrap's floor prints as \"< floor\"." + _reasons_note(reasons),
        "",
    ]
    return out


def _kl_top1(loc: Located, domain: str | None) -> str:
    block = loc.pack.overall if domain is None else loc.pack.domains.get(domain, Scope())
    path = ("overall",) if domain is None else ("domains", domain)
    kl, top1 = block.kld_mean, block.top1
    if kl is None:
        return "—"
    text = str(Num(fixed(kl), loc.at(*path, "kld_mean")))
    if top1 is not None:
        text += f" · {Num(f'{100 * top1:.1f}%', loc.at(*path, 'top1'))}"
    return text


def _kl_eq(loc: Located) -> str:
    o = loc.pack.overall
    if o.kld_domains_equal is None:
        return "—"
    text = str(Num(fixed(o.kld_domains_equal), loc.at("overall", "kld_domains_equal")))
    if o.top1_domains_equal is not None:
        share = 100 * o.top1_domains_equal
        text += f" · {Num(f'{share:.1f}%', loc.at('overall', 'top1_domains_equal'))}"
    return text


def _p(pair: Pair, v: PairedBlock, path: tuple, holm: bool, reasons: Reasons) -> str:
    p, floor = v.p_value, v.p_value_floor
    if p is None:
        return "—" + (reasons.mark(v.unavailable) if v.diff is not None else "")
    if not holm:
        return str(Num(p_value(p, floor), pair.at(*path, "p_value_floor" if _at_floor(p, floor) else "p_value")))
    ph = v.p_holm
    if ph is None:
        return "—"
    if _at_floor(p, floor):   # its own p is a bound, so its Holm p is one too
        return str(Num(f"< {ceil_significant(ph):.2g}", pair.at(*path, "p_holm")))
    return str(Num(p_value(ph), pair.at(*path, "p_holm")))


def _at_floor(p, floor) -> bool:
    return p is not None and floor is not None and p <= floor * (1 + 1e-9)


def _single_domains(located: list[Located]) -> list[str]:
    """Per domain KL · top-1 of every build, where there is no other build to pair with."""
    loc = located[0]
    rows = [[escape(d), _kl_top1(loc, d)] for d in loc.pack.domains] + [["all positions", _kl_top1(loc, None)]]
    return _table(["domain", f"{escape(loc.pack.label)}: KL · top-1"], rows) + [""]


def _group_sections(g: Group, index: int, names: dict[str, str], build: str | None) -> tuple[list[str], str | None]:
    located = []
    for run in g.runs:
        src = Source(names.get(run.source, Path(run.source).name))
        for res in run.results:
            located.append(Located(res, src, ("results", res.index)))
    labels = [loc.pack.label for loc in located]
    this_label = build if build in labels else labels[0]
    this = next(loc for loc in located if loc.pack.label == this_label)
    located = [this] + [loc for loc in located if loc is not this]
    panel = g.panel
    title = f"Quality vs native on panel `{escape(known(panel, 'name'))}`"
    out = [f"### {title}", ""]
    if g.warning:
        out += [f"> {escape(g.warning)}", ""]
    out += _quality_table(g, located, this_label) + [""]
    pairs = _pairs(g, located, this)
    if pairs:
        out += ["#### Against the other builds on the same panel", ""]
        for pair in pairs:
            out += _pair_section(g, pair)
    else:
        out += _single_domains(located)
    return out, this_label


# ---- suites ----------------------------------------------------------------------------------------------------------

SUITE_NAMES = {
    "humaneval": "HumanEval",
    "humaneval+": "HumanEval+",
    "mbpp+": "MBPP+",
    "ifeval": "IFEval",
    "mmlu": "MMLU",
    "gsm8k": "GSM8K",
    "needle": "Needle",
    "toolcall": "Tool calls",
}
# the metrics a seed card prints on one row, and what it calls them
SUITE_PAIRS = {"humaneval+": (("base", "plus"), "base / plus"), "humaneval": (("base", "plus"), "base / plus"),
               "mbpp+": (("base", "plus"), "base / plus"),
               "ifeval": (("prompt_level_strict_acc", "inst_level_strict_acc"), "prompt strict / instruction strict"),
               "mmlu": (("exact_match",), ""), "gsm8k": (("strict-match",), "")}


def _suite_items(data, path=()):
    if isinstance(data, list):
        for i, d in enumerate(data):
            yield from _suite_items(d, (*path, i))
    elif isinstance(data.get("suites"), list):
        yield from _suite_items(data["suites"], (*path, "suites"))
    else:
        yield data, path


def _metric_blocks(it: dict, path: tuple) -> list[tuple[str, dict, tuple]]:
    """(name, block, JSON path) of the metrics the suite's row shows: the seed cards' pair where the run has it, else
    the primary metric (compare's top-level copy of it)."""
    metrics = it.get("metrics") if isinstance(it.get("metrics"), dict) else {}
    names, _ = SUITE_PAIRS.get(str(it.get("suite")), ((), ""))
    if names and all(n in metrics and "rate_a" in metrics[n] for n in names):
        return [(n, metrics[n], (*path, "metrics", n)) for n in names]
    for key in ("passed", "score"):
        if isinstance(it.get(key), dict):
            b = dict(it[key])
            b.setdefault("rate_a", b.get("pass_rate_a", b.get("score_a")))
            b.setdefault("rate_b", b.get("pass_rate_b", b.get("score_b")))
            return [(key, b, (*path, key))]
    return []


def _rate(b: dict, side: str, src: Source, path: tuple) -> str:
    v = b.get(f"rate_{side}")
    if v is None:
        return "—"
    key = f"rate_{side}" if f"rate_{side}" in b and path[-1] not in ("passed", "score") else \
        {"a": "pass_rate_a", "b": "pass_rate_b"}[side] if path[-1] == "passed" else f"score_{side}"
    return str(Num(f"{100 * v:.1f}", src.at(*path, key)))


def _difference(b: dict, src: Source, path: tuple) -> str:
    """B − A: questions gained or lost where each item is one question (McNemar), points otherwise; with the paired
    p."""
    p = b.get("p_value")
    p_text = f"p {Num(p_value(p), src.at(*path, 'p_value'))}" if p is not None else "no test"
    if "flips_a_to_b" in b and "flips_b_to_a" in b and b.get("test", "").startswith(("mcnemar", "no discordant")):
        lost, gained = b["flips_a_to_b"], b["flips_b_to_a"]
        net = gained - lost
        count = note(f"{src.at(*path, 'flips_b_to_a')} − {src.at(*path, 'flips_a_to_b')}")
        word = "question" if abs(net) == 1 else "questions"
        text = f"{'+' if net > 0 else MINUS if net < 0 else ''}{abs(net)}{count} {word}"
        if net == 0:
            text += f" ({Num(str(lost), src.at(*path, 'flips_a_to_b'))} lost, " \
                    f"{Num(str(gained), src.at(*path, 'flips_b_to_a'))} gained)"
        return f"{text}, {p_text}"
    drop = b.get("drop")
    if drop is None:
        return p_text
    d = -drop
    return f"{signed(f'{d:.2f}'.replace('-', MINUS), d)}{note('−1 × ' + src.at(*path, 'drop'))} pp, {p_text}"


def _suite_rows(suites: list[tuple[str, object]], names: dict[str, str]) -> tuple[list[list[str]], list[dict]]:
    rows, items = [], []
    for source, data in suites:
        src = Source(names.get(source, Path(source).name))
        for it, path in _suite_items(data):
            blocks = _metric_blocks(it, path)
            suite = str(it.get("suite", "?"))
            _, pair_name = SUITE_PAIRS.get(suite, ((), ""))
            name = SUITE_NAMES.get(suite, suite)
            if len(blocks) > 1 and pair_name:
                name += f", {pair_name}"
            n = it.get("n_items")
            items_cell = "—" if n is None else str(Num(f"{n:,}", src.at(*path, "n_items")))
            verdict = it.get("verdict")
            verdict_cell = "—" if verdict is None else str(Num(str(verdict), src.at(*path, "verdict")))
            rows.append([name, items_cell, " / ".join(_rate(b, "b", src, p) for _, b, p in blocks) or "—",
                         " / ".join(_rate(b, "a", src, p) for _, b, p in blocks) or "—",
                         " / ".join(_difference(b, src, p) for _, b, p in blocks) or "—", verdict_cell])
            items.append(
                {
                    "item": it,
                    "name": name,
                    "suite": SUITE_NAMES.get(suite, suite),
                    "blocks": blocks,
                    "src": src,
                    "path": path,
                }
            )
    return rows, items


def _suite_section(suites, names: dict[str, str]) -> list[str]:
    rows, items = _suite_rows(suites, names)
    if not rows:
        return []
    out = ["### Suites, paired per item against native", ""]
    out += _table(["suite", "items", "this build", "native", "this build − native", "verdict"], rows,
                  ["---", "---:", "---:", "---:", "---", "---"])
    rules = {(i["item"].get("threshold_points"), i["item"].get("alpha")) for i in items}
    rule = "; ".join(f"a suite fails when its drop from native is larger than {t:g} point{'s' if t != 1 else ''} at "
                     f"p < {a:g}" for t, a in sorted(r for r in rules if None not in r))
    significant = []
    for i in items:
        for name, b, _ in i["blocks"]:
            alpha = i["item"].get("alpha", 0.05)
            if b.get("p_value") is not None and b["p_value"] < alpha:
                significant.append(f"{i['name']} ({name}, p {p_value(b['p_value'])})")
    failed = [i["suite"] for i in items if i["item"].get("verdict") == "fail"]
    smallest = min(((b["p_value"], i["name"], name) for i in items for name, b, _ in i["blocks"]
                    if b.get("p_value") is not None), default=None)
    if failed:
        summary = f"{len(failed)} suite{'s' if len(failed) > 1 else ''} fail{'s' if len(failed) == 1 else ''}: " \
                  f"{'; '.join(map(escape, failed))}."
    elif significant:
        summary = f"No suite fails; significant at its alpha: {'; '.join(map(escape, significant))}."
    elif smallest is not None:
        summary = (f"No suite differs significantly from native (smallest paired p: {escape(smallest[1])}, "
                   f"{escape(smallest[2])}, p = {p_value(smallest[0])}).")
    else:
        summary = "No paired test."
    cut = [(i["name"], get(i["item"], "cut_by_limit", "b"), get(i["item"], "cut_by_limit", "a")) for i in items]
    cut_text = "; ".join(f"{escape(n)}: {b} / {a}" for n, b, a in cut if b or a)
    runs = sorted({(Path(str(i["item"].get("b", "?"))).name, Path(str(i["item"].get("a", "?"))).name) for i in items})
    out += ["", summary + " " + (rule[0].upper() + rule[1:] + "." if rule else ""),
            "Pass rates in %, pooled over items (instruction-level: over instructions). A difference in questions is "
            "the items the build answers right and native wrong, minus the reverse (McNemar's test on those items); in "
            "points where an item holds several trials (paired t on the per-item counts)."
            + (f" Replies cut by the token limit, this build / native: {cut_text}." if cut_text else "")
            + " Runs: " + "; ".join(f"this build `{escape(b)}`, native `{escape(a)}`" for b, a in runs) + ".", ""]
    return out


# ---- speed -----------------------------------------------------------------------------------------------------------

def _bench_label(source: str, doc: dict) -> str:
    return str(doc.get("label") or get(doc, "settings", "label") or Path(source).stem)


def _metric_name(key: str) -> str:
    kind, _, arg = key.partition(".")
    if kind == "decode":
        return "decode tok/s, all sets" if arg == "all" else f"decode tok/s, {arg}"
    if kind == "aggregate":
        return f"aggregate tok/s, {arg} stream{'s' if arg != '1' else ''}"
    if kind == "ttft_mean":
        return f"mean TTFT s, {arg} stream{'s' if arg != '1' else ''}"
    if kind == "prefill":
        return f"cold prefill tok/s, {arg} tokens"
    return key


def _speed_section(speed: list[tuple[str, dict]], names: dict[str, str]) -> list[str]:
    benches = [(Source(names.get(s, Path(s).name)), d) for s, d in speed if d.get("kind") == "fidelity-bench"]
    if not benches:
        return []
    base_src, base = benches[0]
    labels = [escape(_bench_label(src.name, d)) for src, d in benches]
    keys = list(dict.fromkeys(k for _, d in benches for k in d.get("metrics", {})))
    rows = []
    for key in keys:
        row = [escape(_metric_name(key))]
        for j, (src, d) in enumerate(benches):
            m = d["metrics"].get(key) or {}
            med = m.get("median")
            if med is None:
                row.append("—")
                continue
            cell = str(Num(f"{med:.3f}" if key.startswith("ttft") else f"{med:.1f}", src.at("metrics", key, "median")))
            if j:
                c = compare_bench(base, d, [key])[key]
                if c["change_pct"] is not None:
                    formula = (
                        f"100 × ({base_src.at('metrics', key, 'median')} ÷ {src.at('metrics', key, 'median')} − 1)"
                        if key.startswith("ttft")
                        else f"100 × ({src.at('metrics', key, 'median')} ÷ {base_src.at('metrics', key, 'median')} − 1)"
                    )
                    cell += f" ({_pct1(c['change_pct'])}{note(formula)} ± {c['spread_pct']:.1f})"
            row.append(cell)
        rows.append(row)
    rows.append(
        ["failed requests"]
        + [
            str(
                Num(
                    str(
                        get(d, "requests", "failed")
                        if get(d, "requests", "failed") is not None
                        else len(d.get("errors", []))
                    ),
                    src.at("requests", "failed") if get(d, "requests", "failed") is not None else src.at("errors"),
                )
            )
            for src, d in benches
        ]
    )
    rows += _serving_rows(benches)
    settings = "; ".join(
        f"{lab}: {get(d, 'settings', 'repeats')} repeats, {get(d, 'settings', 'max_tokens')} tokens per "
        f"reply{', A/A measured' if d.get('aa') else ''}"
        for lab, (_, d) in zip(labels, benches)
    )
    out = ["### Speed", ""] + _table(["metric"] + labels, rows)
    out += [
        "",
        f"Medians over repeats (`fidelity bench`). In parentheses: the change against {labels[0]} (positive = "
        "faster; TTFT counted as its inverse) ± the run-to-run spread a change must exceed (the A/A spread where "
        f"measured, else the repeats'). {settings}.",
        "",
    ]
    return out


SERVING_ROWS = (   # (row name, path in the bench JSON's `serving` block, format, scale)
    ("KV cache capacity, tokens", ("kv_cache_tokens",), "{:,.0f}", 1),
    ("memory after the runs, GiB (PSS of the server's processes)", ("memory_pss_bytes",), "{:.2f}", 2 ** -30),
    ("spec-decode mean accepted length", ("spec_decode", "mean_accepted_length"), "{:.2f}", 1),
    ("spec-decode first-draft acceptance", ("spec_decode", "first_draft_acceptance"), "{:.1%}", 1),
)


def _serving_rows(benches) -> list[list[str]]:
    """The engine's serving facts (bench's `serving` block) where any bench has them; '—' where one lacks them."""
    rows = []
    for name, path, fmt, scale in SERVING_ROWS:
        values = [get(d, "serving", *path) for _, d in benches]
        if all(v is None for v in values):
            continue
        rows.append([name] + ["—" if v is None else str(Num(fmt.format(v * scale), src.at("serving", *path)))
                              for (src, _), v in zip(benches, values)])
    return rows


# ---- methods ---------------------------------------------------------------------------------------------------------

def _methods(groups: list[Group], names: dict[str, str]) -> list[str]:
    out = ["### Methods", ""]
    for g in groups:
        run = g.runs[0]
        src = Source(names.get(run.source, Path(run.source).name))
        p, ref, report = g.panel, g.reference, run.report
        domains = p.domains
        dom_names = list(domains) if isinstance(domains, (list, dict)) else list(g.packs[0].domains if g.packs else [])
        out.append(f"- Panel `{escape(known(p, 'name'))}`: sha256 `{p.sha256}`{note(src.at('panel', 'sha256'))}, "
                   f"{_maybe(p.rows, src.at('panel', 'rows'))} rows, "
                   f"{_maybe(p.scored_positions, src.at('panel', 'scored_positions'))} scored positions, "
                   f"{len(dom_names)} domains ({', '.join(map(escape, dom_names))}).")
        cut = p.truncation.rows_cut if p.truncation is not None else None
        if cut:
            out.append(f"- Truncation: {Num(str(cut), src.at('panel', 'truncation', 'rows_cut'))} rows cut to "
                       f"{p.truncation.max_len} tokens.")
        out.append(f"- Reference: `{escape(Path(str(known(ref, 'path'))).name)}` ({escape(str(ref.format or '?'))}), "
                   f"fingerprint `{ref.fingerprint}`{note(src.at('reference', 'fingerprint'))}; every build's "
                   "logits from fidelity's own oracle on its stored weights, KL over the full vocabulary.")
        numerics = report.numerics
        line = "- Numerics: " + (f"`{numerics}`{note(src.at('numerics'))}" if numerics else "not recorded")
        if report.numerics_label:
            line += f" ({Num(escape(str(report.numerics_label)), src.at('numerics_label'))})"
        floor = report.numerics_floor
        if floor is not None and floor.overall is not None and floor.overall.kld_mean is not None:
            o = floor.overall
            line += (f"; numerics floor {escape(str(floor.direction if floor.direction is not None else ''))}: KLD "
                     f"{Num(fixed(o.kld_mean), src.at('numerics_floor', 'overall', 'kld_mean'))}")
            if o.top1 is not None:
                share = 100 * o.top1
                line += f", top-1 {Num(f'{share:.2f}%', src.at('numerics_floor', 'overall', 'top1'))}"
        elif "numerics_floor" not in report.absent:
            line += (
                "; numerics floor: none (the reference's family defines one numerics only, or it was not asked for)"
                + note(src.at("numerics_floor"))
            )
        else:
            line += "; numerics floor: not recorded (a compare before it existed)"
        out.append(line + ".")
        nf = report.noise_floor
        if nf is not None and nf.kld_mean is not None:
            out.append(
                f"- Noise floor (the reference re-run with about one bf16 rounding step of seeded noise on every "
                f"module output): KLD {Num(fixed(nf.kld_mean), src.at('noise_floor', 'kld_mean'))}."
            )
        else:
            out.append("- Noise floor: not measured.")
        reps = next(((r.overall.bootstrap_replicates, loc_src, ("results", r.index, "overall", "bootstrap_replicates"))
                     for loc_src, r in ((src, r) for r in run.results) if r.overall.bootstrap_replicates), None)
        boot = (f"{Num(f'{reps[0]:,}', reps[1].at(*reps[2]))} replicates" if reps else "replicate count not recorded")
        out.append(
            f"- Uncertainty: 95% intervals by a bootstrap over panel rows stratified by domain ({boot}, expanded "
            "percentile; the analytic interval on the quantity's own scale where the replicates cannot resolve "
            "the tails; none under 3 rows). Paired p-values are read off the same bootstrap, Holm-corrected across "
            "domains."
        )
        version = report.fidelity_version
        if version:
            out.append(f"- Measured with fidelity {Num(escape(str(version)), src.at('fidelity_version'))}.")
    return out + [""]


def _maybe(v, at: str) -> str:
    return "?" if v is None else str(Num(f"{v:,}" if isinstance(v, int) else str(v), at))


# ---- the card --------------------------------------------------------------------------------------------------------

@dataclass
class Card:
    path: Path
    text: str
    build: str | None
    warnings: list[str] = field(default_factory=list)


def card_markdown(results, *, build: str | None = None, title: str = "Fidelity to the original model",
                  command_line: str | None = None) -> tuple[str, str | None, list[str]]:
    """The card's Markdown for `results` (what `fidelity report` takes); `build`: the label of this card's build
    (default: the first build of the main group). Returns (markdown, the build's label, warnings)."""
    items = [results] if isinstance(results, (str, Path, dict)) else list(results)
    inputs = load_inputs(items)
    names = _sources([i for i in items if isinstance(i, (str, Path))])
    warnings = list(inputs.warnings)
    if inputs.gates or inputs.attributions:
        warnings.append("gate and attribute results are not part of the card (fidelity report shows them)")
    labels = [p.label for g in inputs.groups for p in g.packs]
    if build is not None and build not in labels:
        raise CardError(f"--build {build!r} is no build of the results given (builds: {', '.join(labels) or 'none'})")
    out = [f"## {title}", ""]
    this = None
    for i, g in enumerate(inputs.groups, 1):
        if not g.packs:
            continue
        lines, label = _group_sections(g, i, names, build if build in [p.label for p in g.packs] else None)
        this = this or label
        out += lines
    out += _suite_section(inputs.suites, names)
    out += _speed_section(inputs.speed, names)
    if inputs.groups:
        out += _methods([g for g in inputs.groups if g.packs], names)
    out.append(
        "Every number above is followed, in this file's source, by an HTML comment naming the result file and the "
        "JSON Pointer of its field (or the formula over such fields); written by `fidelity card`"
        + (f": `{escape(command_line)}`" if command_line else "")
        + "."
    )
    return "\n".join(out).rstrip() + "\n", this, warnings


def render_card(results, out_dir, *, build: str | None = None, title: str = "Fidelity to the original model",
                command_line: str | None = None) -> Card:
    """Write `card.md` into `out_dir`."""
    text, this, warnings = card_markdown(results, build=build, title=title, command_line=command_line)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "card.md"
    path.write_text(text, encoding="utf-8")
    return Card(path, text, this, warnings)
