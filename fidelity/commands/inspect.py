"""Show a pack's format, tensors per storage type, bits-per-weight table and problems found (tensors that do not
decode, shapes config.json contradicts, tensors the architecture's oracle family loads that the pack lacks)."""
from __future__ import annotations

import argparse
import json
from collections import Counter

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..pack_settings import PackSettings


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("pack", help="pack folder, .safetensors or .gguf file")
    p.add_argument("--json", dest="json_out", help="also write the report as JSON to this file")
    p.add_argument(
        "--decode", action="store_true", help="decode every tensor and check it is finite (reads the whole pack)"
    )


def inspect_pack(path: str, decode: bool = False, pack_settings: PackSettings = PackSettings()) -> dict:
    """`pack_settings`: how the pack is opened."""
    import torch

    from ..packs import open_pack
    from ..errors import FidelityError

    pack = open_pack(path, pack_settings)
    kinds = Counter()
    problems = []
    for name in pack.names():
        s = pack.storage(name)
        kinds[(s.format, s.dtype)] += 1
        if s.format == "unclaimed":
            problems.append(f"{name}: {s.dtype} weight with no scales any format module recognises (refused on decode)")
        elif s.format == "absent":
            problems.append(f"{name}: its shard {s.files[0]} is absent (an error only if the model needs it)")
        elif decode:
            try:
                t = pack.tensor(name)
            except FidelityError as e:
                problems.append(str(e))
                continue
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                problems.append(f"{name}: {bad} non-finite values")
    from ..packs.config_check import config_problems

    problems.extend(str(e) for e in config_problems(pack))
    required = required_tensors(pack)
    problems.extend(required.pop("problems"))
    sources = {k: len(v) for k, v in pack.sources().items()} if hasattr(pack, "sources") else None
    return {
        "path": str(pack.path),
        "format": pack.format,
        "architecture": (pack.config.get("architectures") or ["?"])[0],
        "tensors": len(pack.names()),
        "storage": [{"format": f, "dtype": d, "count": c} for (f, d), c in sorted(kinds.items())],
        "bits_per_weight": pack.bits_per_weight().table(),
        "fingerprint": pack.fingerprint(),
        "required_tensors": required,
        "problems": problems,
        **({"sources": sources} if sources is not None else {}),
    }


MISSING_LISTED = 20   # missing tensors listed one by one; the rest are counted


def required_tensors(pack) -> dict:
    """The tensors the oracle family of the pack's architecture loads (`Family.required_names`, what the oracle checks
    before it runs), checked against the pack's names: {"checked": count or None, "missing": count, "not_checked": why
    or None, "problems": one line per missing tensor}. An architecture without an oracle family is not checked (not a
    problem of the pack: compare says so)."""
    from ..errors import ConfigError
    from ..oracle.families import family_for_pack, missing_tensors

    try:
        family = family_for_pack(pack)
        required = list(dict.fromkeys(family.required_names()))
    except ConfigError as e:
        return {"checked": None, "missing": 0, "not_checked": str(e), "problems": []}
    missing = missing_tensors(family, pack.names())
    arch = pack.config["architectures"][0]
    problems = [f"{name}: absent, and the {arch} oracle loads it" for name in missing[:MISSING_LISTED]]
    if len(missing) > MISSING_LISTED:
        problems.append(f"... and {len(missing) - MISSING_LISTED} more tensors the {arch} oracle loads are absent")
    return {"checked": len(required), "missing": len(missing), "not_checked": None, "problems": problems}


def run(args) -> int:
    rep = inspect_pack(args.pack, decode=args.decode, pack_settings=args.environment.pack_settings())
    con = Console()
    con.print(f"[bold]{rep['path']}[/bold]  format=[cyan]{rep['format']}[/cyan]  arch={rep['architecture']}  "
              f"tensors={rep['tensors']}  fingerprint={rep['fingerprint']}")
    if rep.get("sources"):
        con.print("overlay: " + ", ".join(f"{n} tensors from the {k}" for k, n in rep["sources"].items()))
    t = Table(title="tensors per storage type")
    for c in ("format", "dtype", "count"):
        t.add_column(c)
    for r in rep["storage"]:
        t.add_row(r["format"], r["dtype"], str(r["count"]))
    con.print(t)
    b = Table(title="bits per weight")
    for c in ("category", "params", "GB", "bpw"):
        b.add_column(c, justify="right")
    for r in rep["bits_per_weight"]:
        b.add_row(r["category"], f"{r['params']:,.0f}", f"{r['bytes'] / 1e9:.3f}", f"{r['bpw']:.3f}")
    con.print(b)
    req = rep["required_tensors"]
    if req["not_checked"]:
        con.print(f"[yellow]required tensors not checked: {escape(req['not_checked'])}[/yellow]")
    else:
        con.print(f"required tensors: {req['checked']} the {escape(rep['architecture'])} oracle loads, "
                  f"{req['missing']} absent")
    if rep["problems"]:
        con.print(f"[red]{len(rep['problems'])} problem(s):[/red]")
        for pr in rep["problems"]:
            con.print(f"  - {escape(pr)}")  # problems quote "[tensor ..., file ...]": not rich markup
    else:
        con.print("[green]no problems found[/green]")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rep, f, indent=2)
    return 1 if rep["problems"] else 0
