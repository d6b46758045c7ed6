"""`fidelity attribute --json` documents in the report: tables and figures (per-layer KL bars by block, routing heat
map, per-layer sensitivity, Engram coverage curve)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from .figures import DPI, _color, _save  # noqa: F401  (DPI: same resolution as the other figures)
from .tables import Table, num
from ..measuring.engram_access import coverage_rows

BLOCKS = ("attention", "router", "experts", "shared_experts", "mlp", "other")


@dataclass
class AttributionView:
    heading: str
    tables: list[Table]
    figures: list = field(default_factory=list)     # render.FigureFile


def attribution_tables(doc: dict, top: int = 20) -> list[Table]:
    s = doc["summary"]
    out = [Table("Swap-one-in attribution", ["quantity", "value"], [
        ["pack KL (nats)", num(s["pack_kld_mean"])], ["sum of the groups' KL", num(s["sum_of_parts_kld"])],
        ["additivity (sum of parts / whole)", num(s["additivity"])], ["scored positions", num(s["scored_positions"])],
        ["module groups", str(s["modules"])]], classes=["left"])]
    swaps = sorted(doc["swaps"], key=lambda r: -r["kld_mean"])[:top]
    out.append(
        Table(
            f"Largest groups (of {len(doc['swaps'])})",
            [
                "group",
                "KL",
                "share",
                "noise-control KL",
                "x noise",
                "95 % CI",
                "by KL",
                "error ~ |w| r (z)",
                "control z",
                "x activation noise",
                "weight error ‖ΔW‖",
            ],
            [
                [
                    r["group"],
                    num(r["kld_mean"]),
                    f"{100 * r['share']:.1f} %",
                    num(r.get("noise_kld_mean")),
                    num(r.get("x_noise")),
                    f"{num(r['x_noise_ci'][0])}–{num(r['x_noise_ci'][1])}" if r.get("x_noise_ci") else "—",
                    r.get("kl_vs_noise") or "—",
                    f"{num(r['err_scale_corr'])} ({num(r['err_scale_z'])})"
                    if r.get("err_scale_corr") is not None
                    else "—",
                    num(r.get("noise_err_scale_z")),
                    num(r.get("x_act")),
                    num(r["weight_err_norm"]),
                ]
                for r in swaps
            ],
            note="KL of the reference with only that group's tensors from the pack; the noise control "
            "replaces them by isotropic noise of the same Frobenius norm (CI: rows and draws "
            "bootstrapped). By KL the two are often not separable; the error's structure is: r of "
            "the error's RMS against max |w| over 16-weight groups, z ~ N(0, 1) for noise. x activation noise: "
            "KL / KL of exllamav3's control (noise of the error's per-position norm at the layer's "
            "output), when measured.",
        )
    )
    out.append(Table("Layer divergence", ["where", "relative Frobenius error", "cosine", "SQNR dB"],
                     [[r["where"], num(r["rel_fro"]), num(r["cosine"], 6), num(r["sqnr_db"])] for r in doc["layers"]]))
    if doc.get("layer_streams"):
        out.append(Table("Layer divergence per hyper-connection stream",
                         ["where", "stream", "relative Frobenius error", "cosine", "SQNR dB"],
                         [[r["where"], str(r["stream"]), num(r["rel_fro"]), num(r["cosine"], 6), num(r["sqnr_db"])]
                          for r in doc["layer_streams"]]))
    if doc.get("routing_layers"):
        out.append(Table("Routing agreement", ["layer", "Jaccard mean", "same top-k set", "super experts (ref)",
                                               "super experts (pack)"],
                         [[str(r["layer"]), num(r["jaccard_mean"]), f"{100 * r['same_set']:.1f} %",
                           ",".join(map(str, r["super_experts_ref"])) or "—",
                           ",".join(map(str, r["super_experts_pack"])) or "—"] for r in doc["routing_layers"]]))
    if doc.get("sensitivity"):
        levels = s["noise_levels"]
        out.append(Table("Sensitivity (noise at each layer's MLP / routed output)",
                         ["layer", *[f"KL @ {e:.3g}" for e in levels], "dKL/d(eps²)", "log-log slope"],
                         [[str(r["layer"]), *[num(k) for k in r["kld_mean"]], num(r["dkl_deps2"]),
                           num(r["loglog_slope"])] for r in doc["sensitivity"]]))
    if doc.get("engram_access"):
        out.append(
            Table(
                "Engram row access (coverage: top N rows' share of lookups)",
                ["layer", "lookups", "distinct rows", "table rows", "top N rows", "share of lookups"],
                [
                    [
                        str(r["layer"]),
                        num(r["lookups"]),
                        num(r["distinct_rows"]),
                        num(r["table_rows"]),
                        num(r["n"]) + (f" ({r['of']})" if r["of"] else ""),
                        f"{100 * r['share']:.2f} %",
                    ]
                    for r in coverage_rows(doc["engram_access"])
                ],
                note="counted on the reference's pass: rows hash token ids only, so the pack reads the same rows.",
            )
        )
    return out


def draw_layer_bars(doc: dict, path: Path) -> Path | None:
    rows = [r for r in doc["swaps"] if r.get("layer") is not None]
    if not rows:
        return None
    n = max(r["layer"] for r in rows) + 1
    per = {b: np.zeros(n) for b in BLOCKS}
    for r in rows:
        block = r["group"].split(".")[2] if r["group"].count(".") >= 2 else "other"
        per[block if block in per else "other"][r["layer"]] += r["kld_mean"]
    fig = Figure(figsize=(9, 3.4))
    ax = fig.add_subplot()
    bottom = np.zeros(n)
    for i, b in enumerate(BLOCKS):
        if per[b].any():
            ax.bar(np.arange(n), per[b], bottom=bottom, label=b, color=_color(i))
            bottom += per[b]
    ax.set_xlabel("layer")
    ax.set_ylabel("swap-one-in KL, nats")
    ax.legend(fontsize=8)
    return _save(fig, path)


def draw_routing_heatmap(doc: dict, path: Path) -> Path | None:
    routing = doc.get("routing") or []
    if not routing:
        return None
    layers = sorted({r["layer"] for r in routing})
    experts = max(r["expert"] for r in routing) + 1
    fig = Figure(figsize=(9, 1.2 + 0.35 * len(layers) * 2))
    for k, side in enumerate(("ref", "pack")):
        grid = np.zeros((len(layers), experts))
        for r in routing:
            grid[layers.index(r["layer"]), r["expert"]] = r[f"energy_share_{side}"]
        ax = fig.add_subplot(2, 1, k + 1)
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0)
        ax.set_yticks(range(len(layers)), [str(l) for l in layers])
        ax.set_ylabel(f"layer ({'reference' if side == 'ref' else 'pack'})")
        fig.colorbar(im, ax=ax, label="routed-energy share")
    ax.set_xlabel("expert")
    return _save(fig, path)


def draw_sensitivity(doc: dict, path: Path) -> Path | None:
    sens = doc.get("sensitivity") or []
    if not sens:
        return None
    fig = Figure(figsize=(9, 3.2))
    ax = fig.add_subplot()
    values = [r["dkl_deps2"] for r in sens]
    ax.bar([r["layer"] for r in sens], values, color=_color(0))
    if all(v > 0 for v in values):   # one layer can be 1000x the others (SmolLM2's massive-activation layer 11)
        ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("dKL / d(eps²), nats")
    return _save(fig, path)


def draw_engram_coverage(doc: dict, path: Path) -> Path | None:
    tables = doc.get("engram_access") or []
    if not tables:
        return None
    fig = Figure(figsize=(9, 3.2))
    ax = fig.add_subplot()
    for i, t in enumerate(tables):
        ax.plot([c["top_rows"] for c in t["coverage"]], [c["share"] for c in t["coverage"]], marker="o",
                color=_color(i), label=f"layer {t['layer']} ({t['distinct_rows']} distinct of {t['table_rows']} rows)")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("top N rows (by lookups)")
    ax.set_ylabel("share of lookups")
    ax.legend(fontsize=8)
    return _save(fig, path)


FIGURES = (
    ("attribution_layers", draw_layer_bars, "swap-one-in KL per layer, stacked by block"),
    ("attribution_routing", draw_routing_heatmap, "routed-energy share per layer and expert, reference and pack"),
    (
        "attribution_sensitivity",
        draw_sensitivity,
        "per-layer sensitivity: KL per unit eps² of noise at the layer's MLP / routed output",
    ),
    (
        "attribution_engram_coverage",
        draw_engram_coverage,
        "Engram row access: share of each table's lookups served by its top N rows",
    ),
)
