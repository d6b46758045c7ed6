"""Run a reference pack over a panel once and keep the result (hidden states, top-K, NLL) as a reference store."""
from __future__ import annotations

import argparse

from rich.console import Console

from ..pack_settings import PackSettings


def add_arguments(p: argparse.ArgumentParser):
    from .compare import add_numerics_argument

    p.add_argument("pack", help="reference pack")
    p.add_argument("--panel", help="panel folder, .jsonl/.parquet file or hf:NAME[:SPLIT] (default: panels/default)")
    p.add_argument("-o", "--out", required=True, help="folder to write the store into")
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--truncate", action="store_true", help="truncate rows longer than the model's context")
    add_numerics_argument(p)
    p.add_argument("--parallel", choices=("rows", "experts"), default="rows",
                   help="under torchrun: split panel rows (default) or MoE experts across ranks")


def build_store(
    pack,
    panel,
    out,
    *,
    top_k: int = 20,
    device: str = "cpu",
    truncate: bool = False,
    progress: bool = True,
    numerics: str = "exact",
    settings=None,
    pack_settings: PackSettings = PackSettings(),
):
    """`settings`: the oracle's parallel.RunSettings (None: the defaults); `pack_settings`: how the pack is
    opened."""
    from ..measuring.compare import _oracle, prepare
    from ..measuring.store import run_reference, write_store

    ref_pack, panel, rows, tok_fp = prepare(pack, panel, truncate=truncate, pack_settings=pack_settings)
    oracle = _oracle(ref_pack, device, numerics, settings)
    ref = run_reference(oracle, rows, progress=progress)
    from ..oracle import parallel
    if not parallel.is_main():  # under torchrun rank 0 writes the store
        return None
    return write_store(out, ref, oracle, panel, pack_fingerprint=ref_pack.fingerprint(), tokenizer_fingerprint=tok_fp,
                       k=top_k)


def run(args) -> int:
    from ..oracle import parallel

    settings = parallel.RunSettings(parallel=args.parallel, **args.environment.run_settings())
    try:
        m = build_store(args.pack, args.panel, args.out, top_k=args.top_k, device=args.device, truncate=args.truncate,
                        progress=parallel.is_main(), numerics=args.numerics, settings=settings,
                        pack_settings=args.environment.pack_settings())
    except BaseException as e:
        parallel.finish(e)
        raise
    parallel.finish()
    if m is None:
        return 0
    Console().print(f"wrote {args.out}: {m['panel']['scored_positions']} scored positions, {m['bytes'] / 1e6:.2f} MB, "
                    f"{m['bytes_per_scored_position']:.0f} bytes per scored position")
    return 0
