"""Turn compare / suite / gate results into index.html (self-contained), PNG figures and summary.md."""
from __future__ import annotations

import base64
import datetime
import struct
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import pandas as pd

from .. import __version__
from ..errors import FidelityError
from . import analysis, figures, markdown, tables
from .inputs import Group, load_inputs
from .templates import INDEX_HTML
from ..panels.panel import load_panel, tokenize_panel
from .attribution import FIGURES, AttributionView, attribution_tables


@dataclass
class FigureFile:
    name: str
    caption: str
    path: Path

    @property
    def base64(self) -> str:
        return base64.b64encode(self.path.read_bytes()).decode("ascii")

    @property
    def size(self) -> tuple[int, int]:
        head = self.path.read_bytes()[16:24]      # PNG IHDR: width, height
        return struct.unpack(">II", head)

    @property
    def width(self) -> int:
        return self.size[0]

    @property
    def height(self) -> int:
        return self.size[1]


@dataclass
class GroupView:
    heading: str
    warning: str | None
    overall: tables.Table
    tails: tables.Table
    domain_tables: list[tables.Table]
    paired: tables.Table | None
    likelihood: tables.Table | None = None
    paired_domains: tables.Table | None = None
    figures_top: list[FigureFile] = field(default_factory=list)
    figures_records: list[FigureFile] = field(default_factory=list)
    quantiles: tables.Table | None = None
    confidence: tables.Table | None = None
    notes: list[str] = field(default_factory=list)
    worst: list[analysis.WorstPosition] = field(default_factory=list)
    worst_rows: list[tables.Table] = field(default_factory=list)


@dataclass
class Report:
    out_dir: Path
    index_html: Path
    summary_md: Path
    figures: list[Path]
    warnings: list[str]
    groups: list[GroupView]

    def _repr_html_(self) -> str:
        """Notebooks show the page itself: its style and body (figures are data: URIs already)."""
        html = self.index_html.read_text(encoding="utf-8")
        style = html[html.index("<style>"):html.index("</style>") + 8]
        body = html[html.index("<body>") + 6:html.index("</body>")]
        return f'<div class="fidelity-report">{style}{body}</div>'


def _reference_tokenizer(group: Group):
    """The reference pack's own tokenizer, when its path is readable here; None otherwise (token ids are shown
    instead)."""
    path = next((p for p in (r.local_path(group.reference.path) for r in group.runs) if p is not None), None)
    if path is None:
        return None
    try:
        from ..packs.tokenizer import tokenizer_of  # noqa: PLC0415 (optional: a report needs no packs)

        return tokenizer_of(path)
    except (ImportError, FidelityError, OSError, ValueError):
        return None


def _panel_positions(panel_source, group: Group, tokenizer) -> tuple[pd.DataFrame | None, str | None]:
    """Every token of every panel row (row_id, domain, position, token, scored), tokenized as compare did, so the worst
    positions get their prompt text too. The panel must be the one the results were measured on (same sha256)."""
    panel = load_panel(panel_source)
    if panel.sha256 != group.panel.sha256:
        return None, (f"panel {panel_source} (sha256 {panel.sha256[:12]}) is not the panel of this group "
                      f"(sha256 {str(group.panel.sha256)[:12]}); not used for context")
    rows = tokenize_panel(panel, tokenizer)
    return pd.DataFrame(
        {
            "row_id": [r.id for r in rows for _ in r.tokens],
            "domain": [r.domain for r in rows for _ in r.tokens],
            "position": [t for r in rows for t in range(len(r.tokens))],
            "token": [t for r in rows for t in r.tokens],
            "scored": [s for r in rows for s in r.scored],
        }
    ), None


def _auto(tokenizer) -> bool:
    return isinstance(tokenizer, str) and tokenizer == "auto"


def _figure(out: Path, name: str, caption: str, draw) -> FigureFile | None:
    path = draw(out / name)
    return FigureFile(name, caption, path) if path is not None else None


@dataclass
class _Distributions:
    """What the record figures and tables of one group draw from, per pack label."""

    samples: dict = field(default_factory=dict)          # label -> per-position KL (records)
    quantiles: dict = field(default_factory=dict)        # label -> {p50, p90, p99, p99.9, max, mean, positions}
    confidence: dict = field(default_factory=dict)       # label -> KL by reference-confidence bucket
    without_records: list = field(default_factory=list)
    top1_only: list = field(default_factory=list)        # labels whose worst positions lack the reference's top-K


def _from_json(d: _Distributions, res):
    o = res.overall
    d.without_records.append(res.label)
    d.quantiles[res.label] = {"p50": o.kld_median, "p90": o.kld_p90, "p99": o.kld_p99, "p99.9": o.kld_p999,
                              "max": o.kld_max, "mean": o.kld_mean, "positions": o.positions}
    conf = analysis.confidence_from_json(o.kld_by_ref_confidence)
    if conf is not None:
        d.confidence[res.label] = conf


def _from_records(d: _Distributions, view: GroupView, run, res, df, text: analysis.TokenText, n_worst: int):
    kl = df["kl"].to_numpy()
    d.samples[res.label] = kl
    d.quantiles[res.label] = {**analysis.kl_quantiles(kl), "positions": int(kl.size)}
    conf = analysis.kl_by_confidence(df)
    if conf is None:
        conf = analysis.confidence_from_json(res.overall.kld_by_ref_confidence)
    if conf is not None:
        d.confidence[res.label] = conf
    if run.positions is None or "ref_top_ids" not in run.positions.columns:
        d.top1_only.append(res.label)
    view.worst += analysis.worst_positions(run, res.label, text, n=n_worst)
    wr = analysis.worst_rows(run, res.label)
    view.worst_rows.append(tables.Table(
        f"Worst rows by mean KL: {res.label}", ["row", "domain", "positions", "KLD mean", "KLD max"],
        [[str(r.row_id), str(getattr(r, "domain", "")), tables.num(int(r.positions)), tables.num(r.kld_mean),
          tables.num(r.kld_max)] for r in wr.itertuples()]))


def _panel_context(g: Group, view: GroupView, panel_source, tokenizer):
    """Runs with pack records but no reference store get every token of their rows from the panel, when we have it and
    the reference tokenizer. Returns the tokenizer (resolved from "auto" if it had to be)."""
    panel_source = panel_source or next(
        (p for p in (r.local_path(g.panel.extra.get("path")) for r in g.runs) if p), None
    )
    if not panel_source or not Path(panel_source).exists() or \
            not any(r.positions is None and r.pack_positions for r in g.runs):
        return tokenizer
    if _auto(tokenizer):
        tokenizer = _reference_tokenizer(g)
    if tokenizer is None:
        return tokenizer
    positions, problem = _panel_positions(panel_source, g, tokenizer)
    if problem:
        view.notes.append(problem)
    for run in g.runs:
        if run.positions is None:
            run.positions = positions
    return tokenizer


def _group_view(g: Group, index: int, out: Path, tokenizer, n_worst: int, panel_source=None) -> GroupView:
    suffix = "" if index == 1 else f"-group{index}"
    panel = tables.known(g.panel, "name")
    heading = (f"Panel {panel} (sha256 {str(tables.known(g.panel, 'sha256'))[:12]}), "
               f"reference {tables.known(g.reference, 'fingerprint')}")
    if index > 1:
        heading = f"Separate group {index}: {heading}"
    packs = g.packs
    colors = {p.label: i for i, p in enumerate(packs)}
    view = GroupView(heading=heading, warning=g.warning, overall=tables.overall_table(g), tails=tables.tails_table(g),
                     domain_tables=tables.per_domain_tables(g), paired=tables.paired_table(g),
                     likelihood=tables.likelihood_table(g), paired_domains=tables.paired_domains_table(g))
    view.figures_top = [
        f
        for f in (
            _figure(
                out,
                f"per_domain_kld{suffix}.png",
                f"KLD per domain, pooled and domains weighted equally, 95% CI ({panel})",
                lambda p: figures.per_domain_kld(packs, p, f"KLD per domain — panel {panel}"),
            ),
            _figure(
                out,
                f"kld_vs_bpw{suffix}.png",
                f"KLD and top-1 disagreement against bits per weight, noise floor dashed ({panel})",
                lambda p: figures.kld_vs_bpw(packs, p, f"Packs against bits per weight — panel {panel}"),
            ),
        )
        if f
    ]

    tokenizer = _panel_context(g, view, panel_source, tokenizer)
    d = _Distributions()
    for run in g.runs:
        for res in run.results:
            df = analysis.scored_kl(run, res.label)
            if df is None or df.empty:
                _from_json(d, res)
                continue
            if _auto(tokenizer) and run.token_text is None:
                tokenizer = _reference_tokenizer(g)         # loaded once per group, only when records need text
            text = analysis.TokenText(None if _auto(tokenizer) else tokenizer, run.token_text)
            _from_records(d, view, run, res, df, text, n_worst)
    view.figures_records = [
        f
        for f in (
            _figure(
                out,
                f"kl_distribution{suffix}.png",
                f"Per-position KL distribution to p99.9 ({panel})",
                lambda p: figures.kl_distribution(
                    d.samples, d.quantiles, colors, p, f"KL distribution — panel {panel}"
                ),
            ),
            _figure(
                out,
                f"kl_by_confidence{suffix}.png",
                f"Mean KL by reference confidence ({panel})",
                lambda p: figures.kl_by_confidence(
                    d.confidence, colors, p, f"KL by reference confidence — panel {panel}"
                ),
            ),
        )
        if f
    ]
    view.quantiles = tables.quantile_table(g, d.quantiles)
    view.confidence = tables.confidence_table(d.confidence)
    _notes(view, g, d)
    return view


def _notes(view: GroupView, g: Group, d: _Distributions):
    if d.without_records:
        view.notes.append(
            f"No per-position records for {', '.join(d.without_records)}: give the `fidelity compare --out` "
            "folder with the JSON to see the full KL distribution and the worst positions (the distribution "
            "shows compare's quantiles as dots)."
        )
    if d.top1_only and view.worst:
        context = "" if all(r.positions is not None for r in g.runs) else \
            ", and scored tokens only as context (give --panel for the prompt text)"
        view.notes.append(
            f"Worst positions of {', '.join(d.top1_only)}: the reference's and the pack's top-1 only{context}; "
            "put the reference store (`fidelity reference`) in the run folder, or keep the JSON's "
            "reference.store path readable, for the top-K lists."
        )
    if view.worst and all(w.token.startswith("⟨") for w in view.worst):
        view.notes.append("Token text is shown as ⟨id⟩: the reference pack's tokenizer was not available here.")


def render(results, out_dir, *, title: str = "Fidelity report", tokenizer="auto", worst: int = 8, panel=None,
           command_line: str | None = None) -> Report:
    """Write index.html, the PNG figures and summary.md for `results` (paths to compare JSON / run folders,
    suite-compare and gate JSON, or loaded dicts) into `out_dir`. `tokenizer`: "auto" loads the reference pack's when
    readable, None shows token ids.
    `panel`: the panel folder the results were measured on, for the full text around the worst positions."""
    if isinstance(results, (str, Path, dict)):
        results = [results]
    inputs = load_inputs(list(results))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    views = [_group_view(g, i, out, tokenizer, worst, panel) for i, g in enumerate(inputs.groups, 1)]
    attributions = [_attribution_view(src, doc, i, out) for i, (src, doc) in enumerate(inputs.attributions, 1)]
    meta = {"version": __version__, "command_line": command_line or "fidelity.report.render(...) (Python API)",
            "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    suites, gates = tables.suite_table(inputs.suites), tables.gate_table(inputs.gates)
    gate_worst = tables.gate_worst_tables(inputs.gates)
    speed = tables.speed_tables(inputs.speed)
    provenance = tables.provenance_table(inputs.groups, meta, inputs.suites, inputs.gates)

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.globals.update(num=tables.num, status_class=_status_class)
    html = env.from_string(INDEX_HTML).render(
        title=title,
        warnings=inputs.warnings,
        groups=views,
        suites=suites,
        gates=gates,
        gate_worst=gate_worst,
        speed=speed,
        provenance=provenance,
        attributions=attributions,
    )
    index = out / "index.html"
    index.write_text(html, encoding="utf-8")
    summary = out / "summary.md"
    summary.write_text(markdown.summary(title, inputs.warnings, views, suites, gates, provenance, gate_worst, speed,
                                        attributions), encoding="utf-8")
    figs = [f.path for v in views for f in v.figures_top + v.figures_records] + \
        [f.path for a in attributions for f in a.figures]
    return Report(
        out_dir=out, index_html=index, summary_md=summary, figures=figs, warnings=inputs.warnings, groups=views
    )


def _attribution_view(source: str, doc: dict, index: int, out: Path):
    s = doc["summary"]
    view = AttributionView(f"Attribution {index}: {Path(s.get('pack') or source).name} vs "
                           f"{Path(s.get('reference') or '?').name}", attribution_tables(doc))
    for name, draw, caption in FIGURES:
        f = _figure(out, f"{name}_{index}.png", caption, lambda path, draw=draw: draw(doc, path))
        if f is not None:
            view.figures.append(f)
    return view


def _status_class(cell: str) -> str:
    c = str(cell).lower()
    if c in ("pass", "passed", "ok", "no significant drop") or c.startswith("pass"):
        return "pass"
    if c.startswith("fail"):
        return "fail"
    return "error" if c.startswith("error") else ""
