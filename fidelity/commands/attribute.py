"""Where a pack's error comes from: swap-one-in KL per module group, layer divergence, weight error, MoE routing and
per-layer sensitivity, on the streamed oracle.

Definitions: fidelity/attribute.py's docstring (also in the JSON's summary.definitions). Tables go to the console,
`--json F` writes the whole document, `--out DIR` one parquet file per table (swaps, layers, layer_streams, tensors,
routing, routing_layers, sensitivity, and engram_access: the V4.1 Engram row-access ledger, one row per table and
coverage point); the ledger is also in the JSON and a console line."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .. import json_out


def add_arguments(p: argparse.ArgumentParser):
    from .compare import add_numerics_argument
    p.add_argument("reference", help="reference pack")
    p.add_argument("pack", help="pack to attribute")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--panel", help="panel (default: panels/default); its scored positions are measured")
    src.add_argument("--rows", help="JSON file with a list of token-id rows instead of a panel (all positions scored)")
    p.add_argument("--modules", choices=("layer", "block", "expert"), default="block",
                   help="module groups: a whole layer, its blocks (attention / router / experts / shared / MLP, the "
                        "default), or each routed expert alone")
    p.add_argument("--groups", help="comma-separated group names to measure (default: all)")
    p.add_argument("--no-noise-control", action="store_true", help="skip the isotropic-noise control")
    p.add_argument(
        "--noise-repeats",
        type=int,
        default=1,
        help="isotropic-noise draws per group (default 1; >= 2 gives x_noise's bootstrap interval)",
    )
    p.add_argument("--activation-control", action="store_true",
                   help="also exllamav3's control: noise of the real error's per-position norm at the group's layer "
                        "output (one-layer groups)")
    p.add_argument("--no-sensitivity", action="store_true", help="skip the per-layer noise sensitivity")
    p.add_argument("--sensitivity-layers", help="comma-separated layer indices for the sensitivity (default all)")
    p.add_argument(
        "--noise-levels", default=None, help="comma-separated relative noise RMS levels (default 2^-10,2^-8,2^-6)"
    )
    p.add_argument("--super-expert-share", type=float, default=None, help="routed-energy share of a super expert (0.2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    add_numerics_argument(p)
    p.add_argument("--json", dest="json_out", help="write the whole result as JSON")
    p.add_argument("--out", help="folder for one parquet file per table (Engram ledger: engram_access.parquet)")
    p.add_argument("--top", type=int, default=15, help="groups shown in the console table (largest share first)")


def read_rows(path: str) -> list:
    """`--rows FILE`: a JSON list of token-id rows (attribute, plan)."""
    from ..errors import ConfigError
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--rows {path}: not a readable JSON list of token-id rows ({e})") from None


def run(args) -> int:
    from ..measuring.attribute import NOISE_LEVELS, SUPER_EXPERT_SHARE, Settings, attribute
    from ..measuring.metrics import MetricKernel

    rows = read_rows(args.rows) if args.rows else None
    settings = Settings(
        modules=args.modules, groups=args.groups.split(",") if args.groups else None,
        noise_control=not args.no_noise_control, noise_repeats=args.noise_repeats,
        activation_control=args.activation_control, sensitivity=not args.no_sensitivity,
        noise_levels=tuple(float(x) for x in args.noise_levels.split(",")) if args.noise_levels else NOISE_LEVELS,
        sensitivity_layers=[int(x) for x in args.sensitivity_layers.split(",")] if args.sensitivity_layers else None,
        super_expert_share=SUPER_EXPERT_SHARE if args.super_expert_share is None else args.super_expert_share,
        seed=args.seed, numerics=args.numerics)
    res = attribute(args.reference, args.pack, panel=args.panel, rows=rows, settings=settings, device=args.device,
                    progress=True, activation_budget=args.environment.device_activations_bytes,
                    metric_kernel=MetricKernel(backend=args.environment.metrics_kernel),
                    pack_settings=args.environment.pack_settings())
    print_tables(res, Console(), top=args.top)
    if args.json_out:
        Path(args.json_out).write_text(json_out.dumps(res.to_json(), indent=1))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name in ("swaps", "layers", "layer_streams", "tensors", "routing", "routing_layers", "sensitivity"):
            if getattr(res, name):
                res.table(name).to_parquet(out / f"{name}.parquet")
        if res.engram_access:
            import pandas as pd

            from ..measuring.engram_access import coverage_rows
            pd.DataFrame(coverage_rows(res.engram_access)).to_parquet(out / "engram_access.parquet")
    return 0


def _f(x, spec=".4g"):
    return "-" if x is None else format(x, spec)


def _table(title: str, columns, rows, left: tuple[str, ...] = ()) -> Table:
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="left" if c in left else "right")
    for r in rows:
        t.add_row(*r)
    return t


def print_tables(res, con: Console, top: int = 15) -> None:
    s = res.summary
    con.print(f"pack KL {s['pack_kld_mean']:.5g} nats over {s['scored_positions']} positions; sum of the parts "
              f"{s['sum_of_parts_kld']:.5g}; additivity {_f(s['additivity'])}")
    act = any("x_act" in r for r in res.swaps)
    con.print(_table(
        "swap-one-in (reference with one group from the pack)",
        ("group", "KL", "share", "noise KL", "x noise", "95% CI", "by KL", *(("x act", "act CI") if act else ()),
         "err~|w| r", "z", "noise z", "weight err"),
        (_swap_row(r, act) for r in sorted(res.swaps, key=lambda r: -r["kld_mean"])[:top]), left=("group",)))
    con.print(_table("layer divergence (pack pass vs reference pass)", ("where", "rel Frobenius", "cosine", "SQNR dB"),
                     ((r["where"], _f(r["rel_fro"]), _f(r["cosine"], ".6f"), _f(r["sqnr_db"], ".2f"))
                      for r in res.layers)))
    if res.layer_streams:
        con.print(_table("layer divergence per hyper-connection stream",
                         ("where", "stream", "rel Frobenius", "cosine", "SQNR dB"),
                         ((r["where"], str(r["stream"]), _f(r["rel_fro"]), _f(r["cosine"], ".6f"),
                           _f(r["sqnr_db"], ".2f")) for r in res.layer_streams)))
    if res.routing_layers:
        con.print(_table("routing (top-k sets, own passes)",
                         ("layer", "Jaccard mean", "same set", "super experts ref", "super experts pack"),
                         ((str(r["layer"]), _f(r["jaccard_mean"]), _f(r["same_set"], ".1%"),
                           ",".join(map(str, r["super_experts_ref"])), ",".join(map(str, r["super_experts_pack"])))
                          for r in res.routing_layers)))
        bpw = s.get("bits_per_weight_routed") or {}
        if "per_decoded_token_measured" in bpw:
            con.print(f"routing-weighted bpw per decoded token: {bpw['per_decoded_token_measured']['bpw']:.4f}")
    if res.sensitivity:
        con.print(_table("sensitivity: KL per noise level at each layer's MLP / routed output",
                         ("layer", *(f"KL @ {eps:.3g}" for eps in s["noise_levels"]), "dKL/d(eps^2)", "log-log slope"),
                         ((str(r["layer"]), *[_f(k) for k in r["kld_mean"]], _f(r["dkl_deps2"]),
                           _f(r["loglog_slope"], ".3f")) for r in res.sensitivity)))
    for r in res.engram_access:
        curve = ", ".join(f"top {c['top_rows']} = {c['share']:.1%}" for c in r["coverage"])
        con.print(f"Engram layer {r['layer']}: {r['lookups']} lookups, {r['distinct_rows']} distinct of "
                  f"{r['table_rows']} rows; {curve}")


def _swap_row(r: dict, act: bool) -> tuple[str, ...]:
    ci, aci = r.get("x_noise_ci"), r.get("x_act_ci")
    return (r["group"], _f(r["kld_mean"]), _f(r["share"], ".1%"), _f(r.get("noise_kld_mean")),
            _f(r.get("x_noise"), ".3g"), f"{ci[0]:.3g}-{ci[1]:.3g}" if ci else "-", r.get("kl_vs_noise") or "-",
            *((_f(r.get("x_act"), ".3g"), f"{aci[0]:.3g}-{aci[1]:.3g}" if aci else "-") if act else ()),
            _f(r.get("err_scale_corr"), ".3f"), _f(r.get("err_scale_z"), ".1f"),
            _f(r.get("noise_err_scale_z"), ".1f"), _f(r["weight_err_norm"]))
