"""Per-expert EXL3 bit plan from measured sensitivity x routing share x per-K error, under a byte budget.

Writes DIR/exl3_moe_plan.json (the deepseek_v41_exl3 layout: per layer one digit per expert; not written when a
per-tensor plan gives an expert's matrices different K) and DIR/plan.json (summary: budget arithmetic, predicted KL
with its interval, the uniform-K plans for comparison; `tensors`: the per-tensor recipe). Method and assumptions:
fidelity/plan.py's docstring. Per-K errors: decoded from --encodings (an EncodingCache file) where it holds them,
encoded by the EXL3 reference encoder for --measure tensors, else the rate model fitted to those points (each
tensor's `error_source` says which)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .. import json_out


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("reference", help="reference pack (its routed-expert weights are what the plan encodes)")
    p.add_argument("--from", dest="attribution", help="an `attribute --json` result (sensitivity, routing); without "
                   "it attribute runs on the reference itself over --panel / --rows")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--panel", help="panel for the attribute run (without --from; default: panels/default)")
    src.add_argument("--rows", help="JSON list of token-id rows for the attribute run (without --from)")
    p.add_argument("--budget", type=float, required=True, help="routed-expert bits per weight")
    p.add_argument("--per-decoded-token", action="store_true",
                   help="the budget is per decoded token (each expert weighted by its measured token share), not in "
                        "memory")
    p.add_argument("--keep-super-experts", type=int, metavar="K", help="fix super experts (attribute's energy-share "
                   "threshold) at this K")
    p.add_argument("--min-k", action="append", default=[], metavar="LAYERS:K",
                   help="lowest K for these layers, e.g. 37-39:3 (drafter-read layers); repeatable")
    p.add_argument("--candidates", default="1-8", help="candidate K, e.g. 2-5 or 2,3,4 (default 1-8)")
    p.add_argument("--per-tensor", action="store_true", help="one K per matrix (gate / up / down), not per expert")
    p.add_argument("--encodings", help="EncodingCache safetensors file: its encodings give measured errors; new "
                   "encodings (--measure) are added to it")
    p.add_argument("--measure", default="2", help="encode this many expert tensors (spread over the layers) at every "
                   "candidate K, or 'all' (default 2; the rest use the rate model)")
    p.add_argument("--codebook", default="mul1", choices=("mul1", "mcg", "3inst"))
    p.add_argument("--device", default="cpu", help="where the encoder and the attribute run go")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("-o", "--out", required=True, help="output folder")


def parse_candidates(text: str) -> tuple[int, ...]:
    from ..errors import ConfigError
    from ..plan import parse_min_k

    try:
        return tuple(sorted(parse_min_k([f"{text}:0"])))
    except ConfigError:
        raise ConfigError(f"--candidates {text!r}: expected e.g. 2-5 or 2,3,4") from None


def sample(tensors: list, n: str) -> list:
    """`n` tensors spread evenly over the list (layer, expert, role order), or all."""
    from ..errors import ConfigError

    if n == "all":
        return list(tensors)
    try:
        k = int(n)
    except ValueError:
        raise ConfigError(f"--measure {n!r}: a number of tensors or 'all'") from None
    if k <= 0:
        return []
    step = max(len(tensors) / k, 1.0)
    return [tensors[int(i * step)] for i in range(min(k, len(tensors)))]


def measured_errors(ref, tensors, candidates, args) -> dict:
    """Errors decoded from the cache where present, plus fresh encodes of the --measure sample."""
    from ..packs.exl3.encoder import EncodingCache
    from ..packs.exl3.codec import decode_weight
    from ..plan import relative_error

    cache = EncodingCache(args.encodings)
    base = {t.name: t.name.removesuffix(".weight") for t in tensors}

    def decoded(t, w, K):
        enc = cache.get(base[t.name], w, K, args.codebook, args.device)
        return decode_weight(enc["trellis"], enc["suh"], enc["svh"], args.codebook, shape=t.shape)

    out = {}
    chosen = {t.name for t in sample(tensors, args.measure)}
    for t in tensors:
        if t.name not in chosen and not cache.entries:
            continue
        w = ref.tensor(t.name)
        for K in candidates:
            if t.name in chosen or EncodingCache.key(base[t.name], w, K, args.codebook) in cache.entries:
                out[(t.name, K)] = relative_error(w, decoded(t, w, K))
    if args.encodings and cache.misses:
        cache.save(args.encodings)
    return out


def run(args) -> int:
    from ..attribute import Settings, attribute
    from ..errors import ConfigError
    from ..packs import open_pack
    from ..plan import Budget, Constraints, ErrorTable, Evidence, expert_tensors, make_plan, parse_min_k

    ref = open_pack(args.reference)
    if args.attribution:
        if args.panel or args.rows:
            raise ConfigError("--panel / --rows are for the attribute run; --from already gives its result")
        try:
            data = json.loads(Path(args.attribution).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--from {args.attribution}: not a readable attribute JSON ({e})") from None
        source = str(Path(args.attribution).resolve())
    else:
        from .attribute import read_rows
        rows = read_rows(args.rows) if args.rows else None
        data = attribute(ref, ref, panel=args.panel, rows=rows, device=args.device, progress=True,
                         settings=Settings(modules="layer", noise_control=False)).to_json()
        source = "attribute run on the reference itself"
    candidates = parse_candidates(args.candidates)
    tensors = expert_tensors(ref)
    evidence = Evidence.from_attribution(data)
    constraints = Constraints(candidates, args.keep_super_experts, parse_min_k(args.min_k), args.per_tensor,
                              args.codebook)
    budget = Budget(args.budget, args.per_decoded_token)
    # the budget and constraints are checked before any encode: a refused budget costs nothing
    make_plan(tensors, evidence, ErrorTable({(t.name, K): 4.0 ** -K for t in tensors for K in candidates}), budget,
              constraints)
    errors = ErrorTable(measured_errors(ref, tensors, candidates, args))
    plan = make_plan(tensors, evidence, errors, budget, constraints, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    moe = plan.moe_plan()
    summary = {**plan.summary, "reference": str(Path(args.reference).resolve()), "attribution": source,
               "exl3_moe_plan": "exl3_moe_plan.json" if moe is not None else None}
    if moe is None:
        summary["exl3_moe_plan_not_written"] = ("an expert's matrices have different K; the deepseek_v41_exl3 layout "
                                                "states one K per expert (write the recipe in a self-describing "
                                                "layout)")
    else:
        (out / "exl3_moe_plan.json").write_text(json.dumps(moe, indent=1))
    (out / "plan.json").write_text(json_out.dumps({"summary": summary, "tensors": plan.recipe}, indent=1))
    print_plan(summary, Console())
    return 0


def _f(x, spec=".4g"):
    return "-" if x is None else format(x, spec)


def print_plan(s: dict, con: Console) -> None:
    b = s["budget"]
    con.print(f"budget {b['bpw']:g} bpw {b['basis']}: {b['allowed_bytes']:.0f} bytes over {b['params']:.0f} params; "
              f"planned {b['planned_bytes']:.0f} bytes = {b['planned_bpw']:.5g} bpw (possible "
              f"{b['smallest_plan_bpw']:.4g}-{b['largest_plan_bpw']:.4g})")
    ci = s["predicted_kl_ci95"]
    con.print(f"predicted KL {s['predicted_kl']:.5g} nats" + (f" (95% CI {ci[0]:.4g}-{ci[1]:.4g})" if ci else
              f" (no interval: {s['predicted_kl_ci95_unavailable']})") +
              f"; lower bound of any plan {s['kl_lower_bound']:.5g}; units per K {s['units_per_K']}")
    con.print(f"errors: {s['errors']['sources']}" + (f"; rate model {s['errors']['rate_model']}"
                                                     if s['errors']['rate_model'] else ""))
    t = Table(title="uniform K over every unit")
    for c in ("K", "bpw", "predicted KL", "95% CI", "fits budget"):
        t.add_column(c, justify="right")
    for u in s["uniform"]:
        uci = u["predicted_kl_ci95"]
        t.add_row(str(u["K"]), _f(u["bpw"]), _f(u["predicted_kl"]), f"{uci[0]:.3g}-{uci[1]:.3g}" if uci else "-",
                  "yes" if u["fits_budget"] else "no")
    con.print(t)
