"""A tuning ladder: rungs are named engine configurations (a start command or a running URL); each is benched and gated,
and accepted or rejected against the best rung so far.

LADDER.toml:

    [ladder]
    model = "smol"                 # sent in requests
    gates = "gate.toml"            # gate config for every rung (optional; relative paths from this file's folder)
    only = ["batch-invariance"]    # which gates (default: every gate the config defines, or none without a config)
    aa = true                      # the first rung is benched twice: its A/A spread is the noise every verdict must
    exceed start_timeout_s = 300
    [bench]                        # fidelity bench settings (BenchConfig fields): sets, streams, prefill, repeats,
    max_tokens... [accept]                       # defaults: seed 000's rule
    single_stream_gain_pct = 3.0   # accept on +3 % single-stream decode...
    aggregate_gain_pct = 3.0       # ...or +3 % aggregate at `aggregate_streams` (default 6, else the largest level
    measured) prefill_loss_max_pct = 5.0     # ...with at most 5 % cold prefill loss at every length...
                                   # ...and every gate passing. Each margin is max(the number above, the spread).
    [[rung]]
    name = "threads-2"
    command = ["python", "-m", "llama_cpp.server", "--model", "m.gguf", "--port", "{port}", "--n_threads", "2"]
    # or: url = "http://127.0.0.1:8080"
    gates = "other.toml"           # this rung's own gate config / gate list (optional)
    only = ["decode-vs-prefill"]

The first rung is the base (accepted as such). Each later rung is compared with the best accepted rung before it; an
accepted rung becomes the new best. `{port}` in a command is replaced by a free loopback port; the server is stopped
after its rung. A gate that fails or cannot run rejects the rung whatever its speed. Each row carries its bench's
`serving` facts (KV capacity, speculative-decoding acceptance; for a started rung its process group's memory), and the
Markdown table a KV-capacity and a memory column where any rung has them.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .bench import BenchConfig, compare_bench, run_bench, spread_of
from .gates.config import load_config, read_toml, run_gates, select_gates
from .spawn import Spawned, free_port

LADDER_KEYS = {"model", "gates", "only", "aa", "start_timeout_s"}
RUNG_KEYS = {"name", "command", "url", "gates", "only"}


@dataclass
class AcceptRule:
    single_stream_gain_pct: float = 3.0
    aggregate_gain_pct: float = 3.0
    aggregate_streams: int | None = 6
    prefill_loss_max_pct: float = 5.0
    single_stream_metric: str = "decode.all"


@dataclass
class Rung:
    name: str
    command: list[str] | None = None
    url: str | None = None
    gates: str | None = None
    only: list[str] | None = None


@dataclass
class Ladder:
    model: str
    rungs: list[Rung]
    bench: dict = field(default_factory=dict)
    accept: AcceptRule = field(default_factory=AcceptRule)
    gates: str | None = None
    only: list[str] | None = None
    aa: bool = True
    start_timeout_s: float = 300.0
    folder: Path = Path(".")


def load_ladder(path) -> Ladder:
    p = Path(path)
    cfg = read_toml(p, "ladder")
    bad = set(cfg) - {"ladder", "bench", "accept", "rung"}
    if bad:
        raise ConfigError(f"ladder {p}: unknown section(s) {sorted(bad)} (known: ladder, bench, accept, rung)")
    head = cfg.get("ladder", {})
    if set(head) - LADDER_KEYS or "model" not in head:
        raise ConfigError(f"ladder {p}: [ladder] needs 'model' and knows {sorted(LADDER_KEYS)}; got {sorted(head)}")
    bench_keys = set(BenchConfig.__dataclass_fields__) - {"url", "model", "progress", "server_pid"}
    if set(cfg.get("bench", {})) - bench_keys:
        raise ConfigError(f"ladder {p}: unknown [bench] key(s) {sorted(set(cfg['bench']) - bench_keys)} "
                          f"(known: {sorted(bench_keys)})")
    try:
        accept = AcceptRule(**cfg.get("accept", {}))
    except TypeError:
        raise ConfigError(
            f"ladder {p}: [accept] knows {sorted(AcceptRule.__dataclass_fields__)}; got {sorted(cfg['accept'])}"
        )
    rungs = []
    for i, r in enumerate(cfg.get("rung", [])):
        where = f"ladder {p}: rung {i + 1} ({r.get('name', 'unnamed')})"
        if set(r) - RUNG_KEYS or "name" not in r:
            raise ConfigError(f"{where}: needs 'name' and knows {sorted(RUNG_KEYS)}; got {sorted(r)}")
        if ("command" in r) == ("url" in r):
            raise ConfigError(f"{where}: give exactly one of 'command' (a start command) and 'url' (a running engine)")
        cmd = r.get("command")
        rungs.append(Rung(r["name"], shlex.split(cmd) if isinstance(cmd, str) else cmd, r.get("url"), r.get("gates"),
                          r.get("only")))
    if len(rungs) < 2:
        raise ConfigError(f"ladder {p}: needs at least two [[rung]] tables (a base and a change)")
    if len({r.name for r in rungs}) != len(rungs):
        raise ConfigError(f"ladder {p}: rung names repeat")
    return Ladder(head["model"], rungs, cfg.get("bench", {}), accept, head.get("gates"), head.get("only"),
                  bool(head.get("aa", True)), float(head.get("start_timeout_s", 300)), p.resolve().parent)


class _Engine:
    """A rung's engine: started from its command on a free port (and stopped after), or a URL already running."""

    def __init__(self, rung: Rung, ladder: Ladder, log_dir: Path):
        self.rung, self.ladder, self.log_dir, self.proc = rung, ladder, log_dir, None

    @property
    def pid(self) -> int | None:
        """The started server's process (its process group's memory goes into the rung's serving facts)."""
        return self.proc.proc.pid if self.proc else None

    def __enter__(self) -> "_Engine":
        if self.rung.url:
            self.url = self.rung.url
            return self
        port = free_port()
        cmd = [a.replace("{port}", str(port)) for a in self.rung.command]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.proc = Spawned(
            cmd, port, timeout_s=self.ladder.start_timeout_s, log=str(self.log_dir / f"{self.rung.name}.log")
        )
        self.url = self.proc.url
        return self

    def __exit__(self, *exc):
        if self.proc:
            self.proc.close()


async def _gates(url: str, ladder: Ladder, rung: Rung, bwrap: str | None = None) -> dict | None:
    config = rung.gates or ladder.gates
    only = rung.only if rung.only is not None else ladder.only
    if not config and not only:
        return None
    cfg = load_config(str(ladder.folder / config) if config else None)
    names = select_gates(",".join(only) if only else None, cfg)
    return await run_gates(url, ladder.model, names, cfg, bwrap=bwrap)


def aggregate_level(ladder: Ladder, doc: dict) -> str | None:
    levels = sorted(int(k.split(".")[1]) for k in doc["metrics"] if k.startswith("aggregate."))
    if not levels:
        return None
    want = ladder.accept.aggregate_streams
    return f"aggregate.{want if want in levels else levels[-1]}"


def verdict(ladder: Ladder, best: dict, new: dict, gates: dict | None, aa: dict) -> dict:
    """Accept or reject `new` against `best` (bench documents) under the ladder's rule; margins against the spread."""
    rule = ladder.accept
    agg = aggregate_level(ladder, best)
    wanted = (
        [rule.single_stream_metric] + ([agg] if agg else []) + [k for k in best["metrics"] if k.startswith("prefill.")]
    )
    rows = compare_bench(best, new, [m for m in wanted if m in best["metrics"]])
    for m, r in rows.items():
        r["spread_pct"] = max(r["spread_pct"], aa.get(m, 0.0))
    reasons, gains = [], []
    for m, need in ((rule.single_stream_metric, rule.single_stream_gain_pct), (agg, rule.aggregate_gain_pct)):
        r = rows.get(m)
        if r and r["change_pct"] is not None:
            margin = max(need, r["spread_pct"])
            if r["change_pct"] > margin:
                gains.append(f"{m} {r['change_pct']:+.1f} % > {margin:.1f} %")
    losses = []
    for m, r in rows.items():
        if m.startswith("prefill.") and r["change_pct"] is not None:
            margin = max(rule.prefill_loss_max_pct, r["spread_pct"])
            if -r["change_pct"] > margin:
                losses.append(f"{m} {r['change_pct']:+.1f} % loses more than {margin:.1f} %")
    missing = [m for m, r in rows.items() if r["change_pct"] is None]
    gate_status = "none" if gates is None else gates["status"]
    if new["errors"] or missing:
        reasons.append(
            f"bench incomplete: {len(new['errors'])} failed request(s)" + (f", no {missing}" if missing else "")
        )
    if gate_status in ("fail", "error"):
        bad = [g["gate"] for g in gates["gates"] if g["status"] != "pass"]
        reasons.append(f"gates {gate_status}: {', '.join(bad)}")
    if losses:
        reasons += losses
    if not gains:
        reasons.append("no gain beyond its margin (" + "; ".join(
            f"{m} {rows[m]['change_pct']:+.1f} %" for m in (rule.single_stream_metric, agg)
            if m in rows and rows[m]["change_pct"] is not None) + ")")
    accepted = not reasons
    return {
        "verdict": "accepted" if accepted else "rejected",
        "reason": "; ".join(gains) if accepted else "; ".join(reasons),
        "against": None,
        "deltas": rows,
        "gates": gate_status,
    }


async def run_ladder(ladder: Ladder, log_dir: Path, progress=None, bwrap: str | None = None) -> dict:
    """`bwrap`: the code suites' bubblewrap for [suite.*] gates (the command line's FIDELITY_BWRAP)."""
    rows, docs, best = [], {}, None
    aa: dict = {}
    for i, rung in enumerate(ladder.rungs):
        with _Engine(rung, ladder, log_dir) as engine:
            url = engine.url
            cfg = BenchConfig(url, ladder.model, **{**ladder.bench, "aa": ladder.aa and i == 0}, server_pid=engine.pid)
            doc = await run_bench(cfg)
            gates = await _gates(url, ladder, rung, bwrap)
        docs[rung.name] = doc
        if i == 0:
            aa = {m: spread_of(doc, m) for m in doc["metrics"]} if ladder.aa else {}
            v = {"verdict": "base", "reason": "first rung", "against": None, "deltas": {},
                 "gates": "none" if gates is None else gates["status"]}
            if gates is not None and gates["status"] != "pass":
                v["reason"] += f" (its gates {gates['status']}: later rungs are still compared with it)"
            best = rung.name
        else:
            v = verdict(ladder, docs[best], doc, gates, aa)
            v["against"] = best
            if v["verdict"] == "accepted":
                best = rung.name
        row = {"rung": rung.name, "engine": rung.url or shlex.join(rung.command), **v,
               "metrics": {k: m["median"] for k, m in doc["metrics"].items()},
               "spread_pct": {k: m["spread_pct"] for k, m in doc["metrics"].items()},
               "serving": doc.get("serving"), "errors": doc["errors"], "gate_results": gates}
        rows.append(row)
        if progress:
            progress(row)
    metric = ladder.accept.single_stream_metric
    ranked = sorted((r for r in rows if r["metrics"].get(metric)), key=lambda r: -r["metrics"][metric])
    for k, r in enumerate(ranked, 1):
        r["rank"] = k
    return {"kind": "fidelity-ladder", "model": ladder.model, "accept": ladder.accept.__dict__, "aa_spread_pct": aa,
            "best": best, "rungs": rows, "benches": docs}


def _number(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def _delta(r: dict, metric: str) -> str:
    """A rung's change of `metric` against the baseline, with the spread it must exceed ("" where there is none)."""
    if metric not in r["deltas"] or r["deltas"][metric]["change_pct"] is None:
        return ""
    return f" ({r['deltas'][metric]['change_pct']:+.1f} % ± {r['deltas'][metric]['spread_pct']:.1f})"


def _fact(r: dict, key: str) -> str:
    value = (r.get("serving") or {}).get(key)
    if value is None:
        return "-"
    return f"{value / 2**30:.2f}" if key == "memory_pss_bytes" else str(value)


def markdown(doc: dict) -> str:
    metric = doc["accept"]["single_stream_metric"]
    first = doc["rungs"][0]["metrics"]
    levels = sorted(int(k.split(".")[1]) for k in first if k.startswith("aggregate."))
    want = doc["accept"]["aggregate_streams"]
    agg = f"aggregate.{want if want in levels else levels[-1]}" if levels else None
    prefill = [k for k in first if k.startswith("prefill.")]
    cols = [metric] + ([agg] if agg else []) + prefill
    # serving facts where any rung has them: KV capacity (tokens) and the started server's memory (PSS, GiB)
    facts = [(k, title) for k, title in (("kv_cache_tokens", "KV tokens"), ("memory_pss_bytes", "memory GiB"))
             if any((r.get("serving") or {}).get(k) is not None for r in doc["rungs"])]
    heads = [c + " tok/s" for c in cols] + [title for _, title in facts]
    out = [f"| rung | rank | {' | '.join(heads)} | gates | verdict | reason |",
           "|" + " --- |" * (len(heads) + 5)]
    for r in doc["rungs"]:
        cells = [f"{_number(r['metrics'].get(c))}{_delta(r, c)}" for c in cols] + [_fact(r, k) for k, _ in facts]
        out.append(f"| {r['rung']} | {r.get('rank', '-')} | {' | '.join(cells)} | {r['gates']} | {r['verdict']} | "
                   f"{r['reason'].replace('|', '/')} |")
    return "\n".join(out) + f"\n\nbest: {doc['best']}\n"
