"""Run a benchmark suite (humaneval, humaneval+, mbpp+, ifeval, mmlu, gsm8k, needle, toolcall) against an engine, or
compare two runs item by item.

  fidelity suite run SUITE --engine URL --model NAME -o RUN_DIR [--limit N | --sample N --seed S] [--concurrency C]
  fidelity suite compare RUN_A RUN_B [--json FILE] [--threshold 1.0] [--alpha 0.05] [--aa]

`run` prints the pooled metrics and the suite's own figures (the manifest's `summary`): needle's pass rate per length x
depth cell, toolcall's call integrity (calls, well formed, right function, right arguments) and pass rate per BFCL
category, and in chat mode the reasoning length (tokens of `reasoning_content`). `--thinking on|off` sends both
`enable_thinking` and `thinking` in chat_template_kwargs (`fidelity.engine.chat_options`). `compare` adds McNemar per
group (BFCL category, needle cell) and the paired change in reasoning length.

Code suites run the generated code in a sandbox (bubblewrap, see README); where none can start, `run` stops with exit
code 2 and says why, unless --unsafe-no-sandbox is given.

A run folder holds manifest.json, records.parquet and the journals that let a killed run resume. `compare` pairs items,
tests (McNemar / paired t + Wilcoxon) and applies "fail if the drop is larger than THRESHOLD points at p < ALPHA"; exit
code 1 on fail.
"""
from __future__ import annotations

import argparse
import asyncio

from rich.console import Console

from .. import json_out
from ..errors import ConfigError

CODE_SUITES = ("humaneval", "humaneval+", "mbpp+")   # the suites that run generated code in the sandbox


def add_arguments(p: argparse.ArgumentParser):
    from ..registry import SUITES

    sub = p.add_subparsers(dest="suite_command", metavar="{run,compare}", required=True)
    r = sub.add_parser("run", help="run one suite against an OpenAI-compatible engine")
    r.add_argument("suite", choices=list(SUITES))
    r.add_argument("--engine", required=True, help="base URL of the OpenAI-compatible server")
    r.add_argument("--model", required=True, help="model name to send")
    r.add_argument(
        "-o", "--out", required=True, help="run folder (resumes if it holds an unfinished run of the same settings)"
    )
    r.add_argument("--limit", type=int, help="first N items only")
    r.add_argument(
        "--sample",
        type=int,
        help="a random subset of N items (seeded by --seed, kept in dataset order; the items go into the manifest)",
    )
    r.add_argument("--seed", type=int, default=0, help="seed of --sample's subset (default 0)")
    r.add_argument("--concurrency", type=int, default=4)
    r.add_argument("--mode", choices=["chat", "completion"], default="chat")
    r.add_argument("--max-tokens", type=int, help="per-item generation budget (default: the suite's)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 (greedy) by default")
    r.add_argument(
        "--thinking",
        choices=["on", "off"],
        help="the chat template's thinking switch: chat_template_kwargs "
        "enable_thinking and thinking (DeepSeek V3.1+) both set",
    )
    r.add_argument("--data", help="local data file or folder instead of the default source (see the suite's docs)")
    r.add_argument("--shots", type=int, help="mmlu, gsm8k: few-shot examples per prompt (default 5, as lm-eval)")
    r.add_argument(
        "--lengths",
        help="needle: context lengths in the engine's tokens, comma-separated; k = 1024, 'max' = "
        "the engine's context (default 1024,2048)",
    )
    r.add_argument("--depths", help="needle: needle depths in [0, 1], comma-separated (default 0,0.5,1)")
    r.add_argument("--seeds", type=int, help="needle: seeds per (length, depth) cell (default 2)")
    r.add_argument("--keys", type=int, help="needle: needles per prompt, all asked for (default 1)")
    r.add_argument(
        "--haystack",
        choices=["generated", "stdlib"],
        help="needle: filler text, Python docstrings (default) or seeded generated prose (any length); --data a folder",
    )
    r.add_argument("--haystack-seed", type=int, help="needle: seed of the generated haystack (default 0)")
    r.add_argument(
        "--context",
        type=int,
        help="needle: the engine's context length, for --lengths max where the engine does not state it",
    )
    r.add_argument("--tokenizer", help="needle: a pack whose tokenizer counts lengths where the engine has no tokenize "
                                       "endpoint (default: usage.prompt_tokens probes)")
    r.add_argument(
        "--categories", help="toolcall: BFCL v3 categories, comma-separated (default the 13 single-turn ones)"
    )
    r.add_argument(
        "--unsafe-no-sandbox",
        action="store_true",
        help="code suites: run the generated code WITHOUT the sandbox, with your rights (recorded in the "
        "manifest and reports); only for machines you are willing to lose. Without it a missing sandbox "
        "stops the run (exit 2)",
    )
    c = sub.add_parser("compare", help="paired comparison of two runs of one suite")
    c.add_argument("run_a", help="reference run folder (native)")
    c.add_argument("run_b", help="candidate run folder")
    c.add_argument("--json", dest="json_out", help="write the report as JSON to this file")
    c.add_argument("--threshold", type=float, default=1.0, help="largest tolerated drop in points (default 1)")
    c.add_argument("--alpha", type=float, default=0.05)
    c.add_argument(
        "--aa", action="store_true", help="A/A mode: the same build twice; reports the engine's own noise floor"
    )


def _suite_options(args) -> dict:
    opts = {"data": args.data}
    needle_only = {"keys": args.keys, "haystack": args.haystack, "haystack_seed": args.haystack_seed,
                   "context": args.context, "tokenizer": args.tokenizer}
    if args.suite == "needle":
        from ..suites.needle import parse_lengths

        if args.lengths:
            opts["lengths"] = parse_lengths(args.lengths)
        if args.depths:
            opts["depths"] = [float(x) for x in args.depths.split(",")]
        if args.seeds:
            opts["seeds"] = args.seeds
        opts.update({k: v for k, v in needle_only.items() if v is not None})
    elif any(v is not None for v in needle_only.values()):
        given = [k for k, v in needle_only.items() if v is not None]
        raise ConfigError(f"--{', --'.join(k.replace('_', '-') for k in given)}: needle options, not for {args.suite}")
    if args.shots is not None:
        if args.suite not in ("mmlu", "gsm8k"):
            raise ConfigError(f"--shots is for mmlu and gsm8k, not {args.suite}")
        opts["shots"] = args.shots
    if args.suite == "toolcall" and args.categories:
        opts["categories"] = args.categories.split(",")
    if args.unsafe_no_sandbox:
        if args.suite not in CODE_SUITES:
            raise ConfigError(f"--unsafe-no-sandbox is for the code suites; {args.suite} runs no generated code")
        opts["unsafe_no_sandbox"] = True
    if args.suite in CODE_SUITES and args.environment.bwrap:
        opts["bwrap"] = args.environment.bwrap       # FIDELITY_BWRAP
    return opts


def run_command(args) -> int:
    from ..suites import make_suite
    from ..suites.runner import Settings, run_suite

    suite = make_suite(args.suite, **_suite_options(args))
    settings = Settings(mode=args.mode, max_tokens=args.max_tokens, temperature=args.temperature, limit=args.limit,
                        sample=args.sample, sample_seed=args.seed,
                        thinking=None if args.thinking is None else args.thinking == "on")
    con = Console(stderr=True)
    isolation = getattr(suite, "isolation", None)
    if isolation and isolation.startswith("UNSAFE"):
        con.print(f"[bold red]warning: {isolation}[/bold red]")
    elif isolation:
        con.print(f"generated code runs in {isolation}")
    done = [0]

    def progress(rec):
        done[0] += 1
        if done[0] % 10 == 0:
            con.print(f"{done[0]} items scored")

    summary = asyncio.run(run_suite(suite, args.out, engine=args.engine, model=args.model, settings=settings,
                                    concurrency=args.concurrency, progress=progress))
    ok = summary.items - summary.errors
    line = f"{suite.name}: {summary.items} items ({summary.resumed} resumed), {summary.errors} engine errors"
    if summary.passed is not None:
        line += f", passed {summary.passed}/{ok}"
    if summary.mean_score is not None:
        line += f", mean score {summary.mean_score:.4f}"
    print(line)
    for name, m in summary.metrics.items():
        print(f"  {name}: {m['rate']:.4f} ({m['followed']}/{m['of']})" if m["rate"] is not None else f"  {name}: -")
    print(f"  cut by the token limit (finish_reason length): {summary.cut_by_limit}/{summary.items - summary.errors}; "
          f"finish reasons: {', '.join(f'{k or None}: {v}' for k, v in summary.finish_reasons.items()) or '-'}")
    for line in reasoning_lines(summary.reasoning) + suite_summary_lines(summary.suite):
        print(line)
    print(f"records: {summary.run_dir}/records.parquet")
    return 0


def reasoning_lines(r: dict | None) -> list[str]:
    if not r:
        return []
    mean = "-" if r["tokens_mean"] is None else f"{r['tokens_mean']:.1f}"
    med = "-" if r["tokens_median"] is None else f"{r['tokens_median']:g}"
    return [
        f"  reasoning: {r['with_reasoning']}/{r['items']} replies carried reasoning; tokens mean {mean}, median {med}, "
        f"total {r['tokens_total']} (over {r['tokens_items']} items; from {r['tokens_from']}); chars mean "
        f"{r['chars_mean']:.1f}"
    ]


def suite_summary_lines(s: dict) -> list[str]:
    """needle's length x depth table, toolcall's call integrity and categories."""
    out = []
    if "cells" in s:
        depths, lengths = s["depths"], s["lengths"]
        cell = {(c["length"], c["depth"]): c for c in s["cells"]}
        out.append(
            f"  needle, {s['keys_per_prompt']} key(s) per prompt: passed / items per length (rows) x depth (columns)"
        )
        out.append("    " + "length".rjust(8) + "".join(f"{d:>10g}" for d in depths))
        for n in lengths:
            row = "".join(f"{cell[(n, d)]['passed']:>6}/{cell[(n, d)]['items']:<3}" if (n, d) in cell else f"{'-':>10}"
                          for d in depths)
            out.append("    " + f"{n:>8}" + row)
        if s.get("errors"):
            out.append(f"    ({s['errors']} items with engine errors not in the table)")
    if "calls" in s:
        c = s["calls"]
        out.append(f"  tool calls: {c['calls']} calls, {c['well_formed']} well formed, {c['right_function']} right "
                   f"function, {c['right_arguments']} right arguments")
        for cat, v in s.get("categories", {}).items():
            rate = "-" if v["pass_rate"] is None else f"{100 * v['pass_rate']:.2f}%"
            out.append(
                f"    {cat}: {v['passed']}/{v['items']} ({rate})"
                + (f", {v['errors']} engine errors" if v["errors"] else "")
            )
    return out


def compare_command(args) -> int:
    from ..suites.paired import compare_runs

    rep = compare_runs(args.run_a, args.run_b, threshold_points=args.threshold, alpha=args.alpha, aa=args.aa)
    con = Console()
    con.print(
        f"[bold]{rep['suite']}[/bold] {rep['mode']}: {rep['n_items']} paired items "
        f"(only in A: {len(rep['only_in_a'])}, only in B: {len(rep['only_in_b'])}, prompt changed: "
        f"{len(rep['prompt_changed'])}, engine errors A/B: {rep['errors']['a']}/{rep['errors']['b']}, excluded pairs: "
        f"{rep['errors']['excluded_pairs']})"
    )
    for metric in ("passed", "score"):
        m = rep.get(metric)
        if not m:
            continue
        rates = (f"pass rate {m['pass_rate_a']:.4f} -> {m['pass_rate_b']:.4f}" if metric == "passed"
                 else f"mean score {m['score_a']:.4f} -> {m['score_b']:.4f}")
        if metric == "score":
            lo, hi = m["drop_ci95"]
            extra = f" (95% CI {lo:+.2f}..{hi:+.2f}), Wilcoxon p={m['wilcoxon']['p_value']:.4g}"
        else:
            lo, hi = m["flip_rate_ci95"]
            extra = f", flip rate {100 * m['flip_rate']:.2f}% (95% CI {100 * lo:.2f}..{100 * hi:.2f}%)"
        con.print(f"  {metric}: {rates}, drop {m['drop']:+.2f} points, flips A->B {m['flips_a_to_b']} / B->A "
                  f"{m['flips_b_to_a']}, {m['test']} p={m['p_value']:.4g}{extra}: {m['verdict']}")
    for name, m in rep.get("metrics", {}).items():
        if "error" in m:
            con.print(f"  {name}: {m['error']}")
            continue
        if "flips_a_to_b" in m:
            extra = f"flips A->B {m['flips_a_to_b']} / B->A {m['flips_b_to_a']}"
        else:
            lo, hi = m["drop_ci95"]
            extra = (
                f"95% CI {lo:+.2f}..{hi:+.2f}, items worse/better {m['items_worse']}/{m['items_better']}, Wilcoxon "
                f"p={m['wilcoxon']['p_value']:.4g}"
            )
        con.print(
            f"  {name}: {m['rate_a']:.4f} -> {m['rate_b']:.4f} (of {m['of']}), drop {m['drop']:+.2f} points, {extra}, "
            f"{m['test']} p={m['p_value']:.4g}: {m['verdict']}"
        )
    for g, m in (rep.get("groups") or {}).items():
        con.print(f"  {rep['group_by']} {g}: {m['passed_a']}/{m['items']} -> {m['passed_b']}/{m['items']}, flips A->B "
                  f"{m['flips_a_to_b']} / B->A {m['flips_b_to_a']}, {m['test']} p={m['p_value']:.4g}")
    rs = rep.get("reasoning")
    if rs and "change_mean" in rs:
        lo, hi = rs["change_ci95"]
        pct = (
            ""
            if rs["change_pct"] is None
            else (
                f", {rs['change_pct']:+.1f}% (95% CI {rs['change_pct_ci95'][0]:+.1f}..{rs['change_pct_ci95'][1]:+.1f}%)"
            )
        )
        con.print(
            f"  reasoning {rs['unit']}: mean {rs['mean_a']:.1f} -> {rs['mean_b']:.1f}, change {rs['change_mean']:+.1f} "
            f"(95% CI {lo:+.1f}..{hi:+.1f}){pct}, longer/shorter {rs['items_longer']}/{rs['items_shorter']}, "
            f"paired-t p={rs['p_value']:.4g}, Wilcoxon p={rs['wilcoxon']['p_value']:.4g}"
        )
    elif rs:
        con.print(f"  reasoning: {rs.get('note')}")
    cut = rep.get("cut_by_limit")
    if cut:
        con.print(f"  cut by the token limit: A {cut['a']}, B {cut['b']} of {rep['n_items']}")
    if rep.get("warning"):
        con.print(f"[yellow]warning: {rep['warning']}[/yellow]")
    con.print(f"verdict: {rep['verdict']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(json_out.dumps(rep, indent=2))
    return 1 if rep["verdict"] == "fail" else 0


def run(args) -> int:
    return run_command(args) if args.suite_command == "run" else compare_command(args)
