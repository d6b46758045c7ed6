"""The report's figures, drawn with matplotlib's object API on the Agg canvas (no pyplot state, no display needed)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib import colormaps

from ..measuring.result_schema import Scope
from .inputs import PackResult

DPI = 110
KL_LABEL = "KL(reference ‖ pack), nats"


def _color(i: int):
    return colormaps["tab10"](i % 10)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return path


def _ci(block, key: str):
    ci = getattr(block, key)
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and ci[0] is not None and ci[1] is not None:
        return float(ci[0]), float(ci[1])
    return None


def _positive(values) -> bool:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=np.float64)
    return v.size > 0 and bool((v > 0).all())


def domain_rows(packs: list[PackResult]) -> list[str]:
    domains: list[str] = []
    for p in packs:
        for d in p.domains:
            if d not in domains:
                domains.append(d)
    return domains


def per_domain_kld(packs: list[PackResult], path: Path, title: str) -> Path:
    """KLD mean per domain as points with 95% CI whiskers (honest on a log axis, unlike bars), then pooled and
    domains-equal rows."""
    cats = domain_rows(packs) + ["pooled (all positions)", "domains weighted equally"]
    height = 0.8 / max(len(packs), 1)
    fig = Figure(figsize=(8.5, 1.2 + len(cats) * (0.3 + 0.12 * len(packs))))
    ax = fig.add_subplot()
    values = []
    for i, p in enumerate(packs):
        blocks = [p.domains.get(d, Scope()) for d in cats[:-2]]
        mean = [b.kld_mean for b in blocks] + [p.overall.kld_mean, p.overall.kld_domains_equal]
        cis = [_ci(b, "kld_mean_ci95") for b in blocks] + [
            _ci(p.overall, "kld_mean_ci95"),
            _ci(p.overall, "kld_domains_equal_ci95"),
        ]
        y = np.arange(len(cats)) + (i - (len(packs) - 1) / 2) * height
        m = np.array([np.nan if v is None else float(v) for v in mean])
        lo = np.array([m[j] - c[0] if c else 0.0 for j, c in enumerate(cis)])
        hi = np.array([c[1] - m[j] if c else 0.0 for j, c in enumerate(cis)])
        ax.errorbar(
            m, y, xerr=[lo, hi], fmt="o", color=_color(i), ecolor=_color(i), elinewidth=1.2, capsize=3, label=p.label
        )
        values += [v for v in m if np.isfinite(v)]
    ax.set_yticks(np.arange(len(cats)), cats)
    ax.invert_yaxis()
    ax.axhline(len(cats) - 2.5, color="grey", lw=0.8, ls=":")
    if _positive(values):
        ax.set_xscale("log")
    ax.set_xlabel(f"mean {KL_LABEL} (whiskers: 95% CI)")
    ax.set_title(title)
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path)


def kld_vs_bpw(packs: list[PackResult], path: Path, title: str) -> Path | None:
    """KLD and top-1 disagreement against bits per weight, both log-scaled, with the noise floor drawn on the KLD
    panel."""
    with_bpw = [p for p in packs if p.bpw is not None and p.overall.kld_mean is not None]
    if not with_bpw:
        return None
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_kl, ax_t1 = fig.subplots(1, 2)
    by_bpw = sorted(with_bpw, key=lambda p: p.bpw)
    if len(by_bpw) > 1:
        ax_kl.plot([p.bpw for p in by_bpw], [p.overall.kld_mean for p in by_bpw], color="lightgrey", zorder=0)
    floors = sorted({float(p.overall.noise_floor_kld) for p in with_bpw if p.overall.noise_floor_kld})
    for i, p in enumerate(with_bpw):
        k = p.overall.kld_mean
        ci = _ci(p.overall, "kld_mean_ci95")
        err = [[k - ci[0]], [ci[1] - k]] if ci and k is not None else None
        ax_kl.errorbar([p.bpw], [k], yerr=err, fmt="o", color=_color(packs.index(p)), capsize=3, label=p.label)
        if p.overall.kld_domains_equal is not None:
            ax_kl.plot(
                [p.bpw], [p.overall.kld_domains_equal], marker="D", mfc="none", color=_color(packs.index(p)), ls="none"
            )
        ax_kl.annotate(p.label, (p.bpw, k), textcoords="offset points", xytext=(5, 4), fontsize=8)
        t1 = p.overall.top1
        if t1 is not None:
            ax_t1.plot([p.bpw], [max(1.0 - t1, 1e-6)], "o", color=_color(packs.index(p)))
            ax_t1.annotate(f"{p.label} ({100 * t1:.2f}%)", (p.bpw, max(1.0 - t1, 1e-6)), textcoords="offset points",
                           xytext=(5, 4), fontsize=8)
    for f in floors:
        ax_kl.axhline(f, color="grey", ls="--", lw=1)
        ax_kl.annotate(
            f"noise floor {f:.3g}",
            (0.01, f),
            xycoords=("axes fraction", "data"),
            textcoords="offset points",
            xytext=(0, 3),
            fontsize=8,
            color="grey",
        )
    ax_kl.set_yscale("log")
    ax_t1.set_yscale("log")
    for ax in (ax_kl, ax_t1):
        ax.set_xlabel("bits per weight")
        ax.grid(which="both", alpha=0.3)
        lo, hi = min(p.bpw for p in with_bpw), max(p.bpw for p in with_bpw)
        pad = max(0.25, 0.08 * (hi - lo))
        ax.set_xlim(lo - pad, hi + 3 * pad)
    ax_kl.set_ylabel(f"mean {KL_LABEL}\n(o pooled with 95% CI, ◇ domains equal)")
    ax_t1.set_ylabel("top-1 disagreement with reference (1 − top-1)")
    fig.suptitle(title)
    return _save(fig, path)


def kl_distribution(samples: dict[str, np.ndarray], quantiles: dict[str, dict], colors: dict[str, int], path: Path,
                    title: str) -> Path | None:
    """Survival function P(KL > x) per pack down to 1e-3 (p99.9) from per-position KL; JSON quantiles as markers
    otherwise."""
    if not samples and not quantiles:
        return None
    fig = Figure(figsize=(8.5, 4.5))
    ax = fig.add_subplot()
    marks = {"p50": 0.5, "p99": 0.01, "p99.9": 0.001}
    for label, kl in samples.items():
        kl = np.sort(np.asarray(kl, dtype=np.float64))
        kl = np.clip(kl, 1e-12, None)
        surv = np.maximum(1.0 - np.arange(1, kl.size + 1) / kl.size, 1.0 / kl.size)   # the max drawn at 1/n, not at 0
        keep = surv >= min(1e-3, 1.0 / kl.size)
        ax.step(kl[keep], surv[keep], where="post", color=_color(colors[label]), label=label)
    for label, q in quantiles.items():
        xs = [q.get(k) for k in marks]
        ax.plot([x for x in xs if x], [marks[k] for k, x in zip(marks, xs) if x], "o", color=_color(colors[label]),
                label=None if label in samples else label)
    for k, s in marks.items():
        ax.axhline(s, color="grey", lw=0.6, ls=":")
        ax.annotate(
            k, (0.995, s), xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=8, color="grey"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"per-position {KL_LABEL}")
    ax.set_ylabel("fraction of scored positions with KL > x")
    ax.set_title(title)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def kl_by_confidence(tables: dict[str, pd.DataFrame], colors: dict[str, int], path: Path, title: str) -> Path | None:
    """Mean KL per reference top-1 probability bucket: where (confident or uncertain tokens) a pack diverges."""
    if not tables:
        return None
    buckets = next(iter(tables.values()))["bucket"].tolist()
    width = 0.8 / len(tables)
    fig = Figure(figsize=(8.5, 4.2))
    ax = fig.add_subplot()
    vals = []
    for i, (label, t) in enumerate(tables.items()):
        x = np.arange(len(buckets)) + (i - (len(tables) - 1) / 2) * width
        ax.bar(x, t["kld_mean"].to_numpy(), width=width * 0.9, color=_color(colors[label]), label=label)
        vals += [v for v in t["kld_mean"] if np.isfinite(v)]
    counts = next(iter(tables.values()))["positions"].tolist()
    ax.set_xticks(np.arange(len(buckets)), [f"{b}\nn={c}" for b, c in zip(buckets, counts)], fontsize=8)
    if _positive(vals):
        ax.set_yscale("log")
    ax.set_xlabel("reference probability of its own top token")
    ax.set_ylabel(f"mean {KL_LABEL}")
    ax.set_title(title)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
