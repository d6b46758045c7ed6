"""Measure an engine's serving speed: decode tok/s per prompt set, aggregate tok/s per concurrency, TTFT, cold prefill
tok/s.

  fidelity bench --engine URL --model NAME [--label NAME] [--sets code,prose,structured] [--streams 1,2,4,8]
                 [--prefill 3k,12k] [--repeats N] [--max-tokens 384] [--json F] [--aa] [--pid PID]

Medians over --repeats with their spread (± half the range, %); --aa runs everything twice and reports the run-to-run
spread per metric, which `fidelity gate`'s [speed] section and `fidelity ladder` decide against. `--label` names the
build in the JSON (`label`) and in `fidelity card` / `report`, which set several benches side by side; the JSON's
`requests.failed` is the number of entries in `errors` (both runs' with --aa), as the console says. Definitions: the
docstring of fidelity/engine/bench.py. After the runs the JSON's `serving` block holds what the engine states about
itself (vLLM's /metrics: KV capacity, speculative-decoding acceptance over the bench's requests; llama.cpp's /props,
/slots), and for a loopback engine the host's MemAvailable and, with --pid, its process group's memory (PSS); a fact
not stated is null with its reason (`serving.null_reasons`). Exit 0 when every request finished, 2 when some failed
(reported, never hidden).
"""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from .. import json_out
from ..errors import ConfigError
from ..engine.bench import SETS, BenchConfig, parse_length, read_prompt_sets, run_bench


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}")


def add_arguments(p: argparse.ArgumentParser):
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--engine", required=True, help="base URL of the OpenAI-compatible engine")
    p.add_argument("--model", required=True, help="model name to send")
    p.add_argument("--label", help="the build's name, recorded in the JSON (`label`) and shown by card / report")
    p.add_argument(
        "--sets",
        default=None,
        help=f"built-in prompt sets for single-stream decode (default {','.join(SETS)}; "
        f"with --prompts: none unless named; empty: none)",
    )
    p.add_argument("--prompts", help='your own prompt sets, measured like the built-in ones: JSON lines {"set": name, '
                                     '"prompt": text}; each set gets its decode tok/s (decode.NAME)')
    p.add_argument("--streams", default="1,2,4,8", help="concurrency levels for aggregate tok/s (empty: none)")
    p.add_argument("--prefill", default="3k,12k", help="cold prefill lengths in tokens (empty: none)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=384, help="tokens generated per request (ignore_eos is sent)")
    p.add_argument("--prompts-per-set", type=int, help="first N prompts of each set only")
    p.add_argument("--suppress-ids", default="", help="token ids to push down with logit_bias -100 (the EOS where the "
                                                      "engine ignores ignore_eos, e.g. llama-cpp-python)")
    p.add_argument("--aa", action="store_true", help="run twice and report the run-to-run spread per metric")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request at most")
    p.add_argument("--stall", type=float, default=60.0, help="seconds without a byte before a request is abandoned")
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--seed", type=int, help="nonces and prompt order (default: fresh)")
    p.add_argument("--pid", type=int, help="the local engine's process: its process group's memory (PSS) goes into "
                                          "the JSON's `serving` block")
    p.add_argument("--json", dest="json_out", help="write the bench document here")


def config_from_args(args) -> BenchConfig:
    custom = read_prompt_sets(args.prompts) if args.prompts else {}
    sets = args.sets if args.sets is not None else ("" if custom else ",".join(SETS))
    return BenchConfig(
        args.engine,
        args.model,
        sets=[s.strip() for s in sets.split(",") if s.strip()],
        custom_sets=custom,
        streams=_ints(args.streams, "--streams"),
        prefill=[parse_length(x) for x in args.prefill.split(",") if x.strip()],
        repeats=args.repeats,
        max_tokens=args.max_tokens,
        prompts_per_set=args.prompts_per_set,
        suppress_ids=_ints(args.suppress_ids, "--suppress-ids"),
        aa=args.aa,
        timeout_s=args.timeout,
        stall_s=args.stall,
        retries=args.retries,
        seed=args.seed,
        server_pid=args.pid,
    )


def bench_table(doc: dict, title: str | None = None):
    from rich.table import Table

    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    aa = (doc.get("aa") or {}).get("spread_pct") or {}
    name = f"{doc['label']}: " if doc.get("label") else ""
    t = Table(title=title or f"fidelity bench: {name}{doc['engine']} ({doc['model']})")
    for c in ("metric", "median", "min", "max", "± %", "A/A %", "unit"):
        t.add_column(c, justify="left" if c == "metric" else "right")
    for name, m in doc["metrics"].items():
        t.add_row(name, f(m["median"], ".4g"), f(m["min"], ".4g"), f(m["max"], ".4g"), f(m["spread_pct"]),
                  f(aa.get(name)), m["unit"])
    return t


def print_report(doc: dict):
    from rich.console import Console

    con = Console()
    con.print(bench_table(doc))
    for n, lv in doc["streams"].items():
        tt = lv["ttft"]
        con.print(
            f"{n} streams: TTFT mean {tt['mean'] or 0:.3f} s, p50 {tt['p50'] or 0:.3f} s, p90 {tt['p90'] or 0:.3f} s; "
            f"in flight together {lv['max_in_flight']}, overlapping {lv['overlap']}"
        )
    for n, pf in doc["prefill"].items():
        def g(x, spec):
            return "-" if x is None else format(x, spec)

        con.print(
            f"prefill {n}: {g(pf['prompt_tokens'], '.0f')} prompt tokens, second cold "
            f"{g(pf['second_cold_gain_pct'], '+.1f')} % vs first, engine cached {pf['engine_cached_tokens'] or '-'}, "
            f"warm/cold {g(pf['warm_over_cold'], '.1f')}x, cache defeated: {pf['cache_defeated']}"
        )
    eos = doc["eos"]
    if eos["stopped_early"]:
        con.print(
            f"[yellow]{eos['stopped_early']} of {eos['of']} requests stopped before {doc['settings']['max_tokens']} "
            f"tokens (the engine did not honour ignore_eos; --suppress-ids may help)[/yellow]"
        )
    for note in doc["usage_check"]["notes"]:
        con.print(f"[dim]usage: {note}[/dim]")
    rq = doc["requests"]
    runs = " (both A/A runs)" if doc.get("aa") else ""
    con.print(f"requests sent {rq['sent']}, retries {rq['retries']}, failed {rq['failed']}{runs}")
    for e in doc["errors"][:10]:
        con.print(f"[red]error: {e['error']}[/red]")
    for line in serving_lines(doc.get("serving")):
        con.print(line)


def serving_lines(sv: dict | None) -> list[str]:
    """The `serving` block in words: each fact, or why it is missing."""
    if not sv:
        return []
    why = sv.get("null_reasons") or {}

    def gib(b):
        return f"{b / 2**30:.2f} GiB"

    def fact(key, text):
        return text if sv.get(key) is not None else f"- ({why.get(key, 'not stated')})"

    out = [f"serving ({sv.get('engine') or 'engine unknown'}): KV capacity "
           + fact("kv_cache_tokens", f"{sv['kv_cache_tokens']} tokens" + (f" ({gib(sv['kv_cache_bytes'])})"
                                                                            if sv.get("kv_cache_bytes") else ""))]
    if sv.get("llama_cpp"):
        out.append(
            f"  llama.cpp: {sv['llama_cpp']['slots']} slot(s) of {sv['llama_cpp']['n_ctx_per_slot']} tokens context"
        )
    sd = sv.get("spec_decode")
    if sd:
        per = ", ".join("-" if a is None else f"{a:.3f}" for a in sd["acceptance_per_position"] or [])

        def g(x):
            return "-" if x is None else f"{x:.3f}"

        out.append(
            f"  speculative decoding: mean accepted length {g(sd['mean_accepted_length'])}, first-draft acceptance "
            f"{g(sd['first_draft_acceptance'])}, per position [{per}] over {sd['drafts']:.0f} drafts"
        )
    else:
        out.append(f"  speculative decoding: - ({why.get('spec_decode', 'not stated')})")
    mem = fact("memory_pss_bytes", f"{gib(sv['memory_pss_bytes'])} PSS over {sv.get('memory_processes')} process(es)"
               if sv.get("memory_pss_bytes") is not None else "")
    out.append(f"  memory after the runs: {mem}; host MemAvailable "
               + fact("mem_available_bytes", gib(sv["mem_available_bytes"]) if sv.get("mem_available_bytes") else ""))
    return out


def run(args) -> int:
    import sys

    cfg = config_from_args(args)
    cfg.progress = lambda text: print(f"bench: {text}", file=sys.stderr, flush=True)
    doc = asyncio.run(run_bench(cfg))
    if args.label:
        doc = {"label": args.label, **doc}
    print_report(doc)
    if args.json_out:
        Path(args.json_out).write_text(json_out.dumps(doc, indent=2))
    return 2 if doc["errors"] else 0
