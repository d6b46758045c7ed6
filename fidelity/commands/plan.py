"""Per-expert EXL3 bit plan from measured sensitivity x routing share x per-K error, under a byte budget.

Candidates per routed expert: our EXL3 encoder at each --candidates K, and with --donors each donor pack's own stored
tensors (seed 003: their bytes, their error decoded against the reference). Budget: --budget over every routed expert,
or --stage-budgets, one per contiguous layer range. Writes DIR/plan.json (summary: budget arithmetic per stage,
predicted KL with its interval, the curve prediction and its calibration, every unit at one candidate for
comparison; `tensors`: the per-tensor recipe, each tensor's source: encoder K or donor tensor) and
DIR/exl3_moe_plan.json (the deepseek_v41_exl3 layout: per layer one digit per expert) where every chosen tensor is
EXL3 at one K per expert; otherwise plan.json's `exl3_moe_plan_not_written` says why. Method and assumptions:
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
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", type=float, help="routed-expert bits per weight")
    budget.add_argument("--stage-budgets", action="append", metavar="LAYERS:BUDGET[,...]",
                        help="one budget per stage (a contiguous layer range) on its routed-expert tensors, in bytes "
                             "(B, KB, MB, GB, KiB, MiB, GiB) or bpw, e.g. 0-19:24.37GiB,20-39:22GiB; every MoE layer "
                             "in exactly one stage")
    p.add_argument("--donors", nargs="+", metavar="[LABEL=]PACK", default=[],
                   help="packs of the same model whose routed-expert tensors are candidates as they are stored (their "
                        "bytes, their error measured against the reference); with --donors the encoder K are "
                        "candidates only where --candidates is given")
    p.add_argument("--per-decoded-token", action="store_true",
                   help="the budget is per decoded token (each expert weighted by its measured token share), not in "
                        "memory")
    p.add_argument("--keep-super-experts", type=int, metavar="K", help="fix super experts (attribute's energy-share "
                   "threshold) at this K")
    p.add_argument("--min-k", action="append", default=[], metavar="LAYERS:K",
                   help="lowest K for these layers, e.g. 37-39:3 (drafter-read layers); repeatable")
    p.add_argument("--candidates", help="candidate K of our EXL3 encoder, e.g. 2-5 or 2,3,4 (default 1-8; none "
                   "with --donors)")
    p.add_argument("--per-tensor", action="store_true", help="one K per matrix (gate / up / down), not per expert")
    p.add_argument("--encodings", help="EncodingCache safetensors file: its encodings give measured errors; new "
                   "encodings (--measure) are added to it")
    p.add_argument("--measure", default="2", help="encode this many expert tensors (spread over the layers) at every "
                   "candidate K, or 'all' (default 2; the rest use the rate model)")
    p.add_argument("--calibrate", metavar="PLAN=KL", help="scale the curve prediction to one measured plan: K2=0.088 "
                   "(uniform K2 encoded) or DONOR=KL (a whole donor), KL the experts-only KL measured on it (the sum "
                   "of attribute's `.experts` swaps), e.g. K2=0.088")
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


def parse_calibration(text: str | None) -> tuple[str, float] | None:
    from ..errors import ConfigError

    if text is None:
        return None
    which, sep, kl = text.rpartition("=")
    try:
        value = float(kl)
    except ValueError:
        value = None
    if not sep or not which or value is None:
        raise ConfigError(f"--calibrate {text!r}: expected PLAN=KL, e.g. K2=0.088 or DONOR=0.05")
    return which, value


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


def read_donors(ref, ref_tensors: list, specs: list[str], device: str = "cpu", measure: bool = True,
                progress=None) -> list:
    """Open each donor, match its routed-expert matrices to the reference's by (layer, expert, role), and measure
    each one's relative error against the reference (decoding both; `measure=False`: errors 0, for checking budgets
    before any decode)."""
    from ..errors import ConfigError, PackError
    from ..packs import open_pack
    from ..plan import expert_tensors, relative_error
    from ..plan_donors import Donor, DonorTensor, exl3_k, parse_donor

    want = {(t.layer, t.expert, t.role): t for t in ref_tensors}
    donors, labels = [], set()
    for spec in specs:
        label, path = parse_donor(spec)
        if label in labels:
            raise ConfigError(f"--donors: label {label!r} names two donors (give LABEL=PATH)")
        labels.add(label)
        pack = open_pack(path, ref.settings)   # the reference's settings (the command line's)
        held: dict[tuple[int, int, str], DonorTensor] = {}
        for d in expert_tensors(pack):
            key = (d.layer, d.expert, d.role)
            t = want.get(key)
            storage = pack.storage(d.name)
            file = storage.files[0] if storage.files else path
            if t is None:
                raise PackError(f"donor {label}: routed expert {d.name} (layer {d.layer}, expert {d.expert}, "
                                f"{d.role}) has no counterpart in the reference {ref.path}: another model?",
                                file=file, tensor=d.name)
            if d.shape != t.shape:
                raise PackError(f"donor {label}: {d.name} has shape {list(d.shape)}, the reference's {t.name} "
                                f"{list(t.shape)}", file=file, tensor=d.name)
            error = 0.0
            if measure:
                got = pack.tensor(d.name, device)
                if not bool(got.isfinite().all()):
                    raise PackError(f"donor {label}: {d.name} decodes to non-finite values", file=file, tensor=d.name)
                error = relative_error(ref.tensor(t.name, device), got)
            held[key] = DonorTensor(label, d.name, int(storage.nbytes), storage.format, exl3_k(storage), error,
                                    tuple(storage.files))
            if progress is not None:
                progress(label, d.name)
        if not held:
            raise ConfigError(f"--donors {spec!r}: the pack holds no routed-expert matrices")
        donors.append(Donor(label, str(Path(path).resolve()), held))
    return donors


def run(args) -> int:
    from ..measuring.attribute import NOISE_LEVELS, Settings, attribute
    from ..errors import ConfigError
    from ..packs import open_pack
    from ..plan import (CANDIDATES, QUANTIZATION_LEVELS, Budget, Constraints, ErrorTable, Evidence, expert_tensors,
                        make_plan, parse_min_k)
    from ..plan_donors import parse_stage_budgets

    ref = open_pack(args.reference, args.environment.pack_settings())
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
                         settings=Settings(modules="layer", noise_control=False,
                                           noise_levels=NOISE_LEVELS + QUANTIZATION_LEVELS)).to_json()
        source = "attribute run on the reference itself"
    candidates = parse_candidates(args.candidates) if args.candidates else () if args.donors else CANDIDATES
    tensors = expert_tensors(ref)
    evidence = Evidence.from_attribution(data)
    constraints = Constraints(candidates, args.keep_super_experts, parse_min_k(args.min_k), args.per_tensor,
                              args.codebook)
    budget = Budget(args.budget, args.per_decoded_token,
                    parse_stage_budgets(args.stage_budgets) if args.stage_budgets else ())
    # the budget and constraints are checked before any encode or decode: a refused budget costs nothing
    make_plan(tensors, evidence, ErrorTable({(t.name, K): 4.0 ** -K for t in tensors for K in candidates}), budget,
              constraints, donors=read_donors(ref, tensors, args.donors, measure=False))
    donors = read_donors(ref, tensors, args.donors, args.device)
    errors = ErrorTable(measured_errors(ref, tensors, candidates, args) if candidates else {})
    plan = make_plan(tensors, evidence, errors, budget, constraints, donors=donors,
                     calibration=parse_calibration(args.calibrate), seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    moe = plan.moe_plan()
    summary = {**plan.summary, "reference": str(Path(args.reference).resolve()), "attribution": source,
               "exl3_moe_plan": "exl3_moe_plan.json" if moe is not None else None}
    if moe is None:
        summary["exl3_moe_plan_not_written"] = plan.moe_plan_refusal()
    else:
        (out / "exl3_moe_plan.json").write_text(json.dumps(moe, indent=1))
    (out / "plan.json").write_text(json_out.dumps({"summary": summary, "tensors": plan.recipe}, indent=1))
    print_plan(summary, Console())
    return 0


def _f(x, spec=".4g"):
    return "-" if x is None else format(x, spec)


def print_plan(s: dict, con: Console) -> None:
    b = s["budget"]
    basis = f"{b['bpw']:g} bpw {b['basis']}" if b["bpw"] is not None else f"per stage, {b['basis']}"
    con.print(f"budget {basis}: {b['allowed_bytes']:.0f} bytes over {b['params']:.0f} params; "
              f"planned {b['planned_bytes']:.0f} bytes = {b['planned_bpw']:.5g} bpw (possible "
              f"{b['smallest_plan_bpw']:.4g}-{b['largest_plan_bpw']:.4g})")
    for st in b.get("stages", []):
        con.print(f"  stage {st['layers']} ({st['budget']}): {st['allowed_bytes']:.0f} bytes allowed, "
                  f"{st['planned_bytes']:.0f} planned ({st['planned_bpw']:.5g} bpw over {st['params']:.0f} params), "
                  f"predicted KL {st['predicted_kl']:.5g}")
    ci = s["predicted_kl_ci95"]
    con.print(f"predicted KL {s['predicted_kl']:.5g} nats" + (f" (95% CI {ci[0]:.4g}-{ci[1]:.4g})" if ci else
              f" (no interval: {s['predicted_kl_ci95_unavailable']})") +
              f"; lower bound of any plan {s['kl_lower_bound']:.5g}; units per K {s['units_per_K']}")
    curve, cal = s.get("predicted_kl_curve"), s.get("calibration")
    if curve:
        con.print(f"curve prediction (each layer's measured KL at its load) {curve['kl']:.5g} nats; loads " +
                  ", ".join(f"L{L} {v['load']:.3g} ({v['where']})" for L, v in curve["layers"].items()))
    if cal:
        con.print(f"calibrated on {cal['on']} (measured {cal['measured_kl']:.5g}, curve {cal['predicted_kl_curve']:.5g}"
                  f": scale {cal['scale']:.4g}): predicted KL {cal['predicted_kl_calibrated']:.5g} nats")
    con.print(f"errors: {s['errors']['sources']}" + (f"; rate model {s['errors']['rate_model']}"
                                                     if s['errors']['rate_model'] else ""))
    t = Table(title="every unit at one candidate (constraints ignored)")
    for c in ("candidate", "bpw", "predicted KL", "95% CI", "curve", "calibrated", "fits budget"):
        t.add_column(c, justify="right")
    for u in s["uniform"] + s.get("donors_whole", []):
        uci = u.get("predicted_kl_ci95")
        name = f"K{u['K']}" if "K" in u else f"donor {u['donor']}"
        t.add_row(name, _f(u.get("bpw")), _f(u["predicted_kl"]), f"{uci[0]:.3g}-{uci[1]:.3g}" if uci else "-",
                  _f(u.get("predicted_kl_curve")), _f(u.get("predicted_kl_calibrated")),
                  "yes" if u["fits_budget"] else u.get("missing", "no"))
    con.print(t)
