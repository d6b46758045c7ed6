"""What every gate shares: default thresholds and the evidence a verdict needs, `GateSettings` ([settings] of
gate.toml), `GateResult` with its `Check`s, and the could-not-run results for too little evidence or coverage.

Default thresholds (`DEFAULT_THRESHOLDS`, overridden per gate from TOML) assume the engine serves the reference weights
in fp32/fp16 and claims determinism; a bf16 or quantized engine should raise `kl_mean_max` in its gate.toml.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

DEFAULT_THRESHOLDS: dict[str, dict[str, float]] = {
    # mean KL(reference || engine) in nats over scored positions (top-k estimator, see oracle_kl), and top-1 agreement
    "oracle-kl": {"kl_mean_max": 1e-3, "top1_min": 0.95},
    # fraction of (prompt, batch size) pairs whose greedy continuation equals the alone one; max |delta
    # logprob| on equal tokens
    "batch-invariance": {"identical_min": 1.0, "max_abs_dlogprob_max": 1e-5},
    # generated tokens' logprobs from decode vs from prefill (echo): max |delta| and mean KL over the returned top-k
    "decode-vs-prefill": {"max_abs_dlogprob_max": 1e-3, "kl_mean_max": 1e-5},
    # cold vs warm: identical outputs, max |delta logprob| over the generated tokens
    "prefix-cache": {"identical_min": 1.0, "max_abs_dlogprob_max": 1e-5},
}

# A verdict needs evidence: with fewer scored positions or rows than these a gate could not run (status "error",
# exit 2), never passes; set per gate in gate.toml ([oracle-kl] min_rows = 10). oracle-kl: 3 panel rows (fewer have
# no interval, stats.MIN_ROWS) and 20 positions (1 / (1 - top1_min): fewer cannot hold one top-1 disagreement and
# still pass, so the check cannot tell 95 % from 100 %); the self-consistency gates: 2 of their units (one prompt is
# an anecdote) and 4 compared positions.
DEFAULT_MINIMUMS: dict[str, dict[str, int]] = {
    "oracle-kl": {"min_rows": 3, "min_positions": 20},
    "batch-invariance": {"min_rows": 2, "min_positions": 4},
    "decode-vs-prefill": {"min_rows": 2, "min_positions": 4},
    "prefix-cache": {"min_rows": 2, "min_positions": 4},
}
ROWS_ARE = {"oracle-kl": "panel rows", "batch-invariance": "(prompt, batch size) pairs", "decode-vs-prefill": "prompts",
            "prefix-cache": "cases"}

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
]


@dataclass


class Check:
    metric: str
    value: float
    op: str  # "<=" or ">="
    threshold: float

    @property
    def passed(self) -> bool:
        if self.value is None or math.isnan(self.value):
            return False
        return self.value <= self.threshold if self.op == "<=" else self.value >= self.threshold


@dataclass


class GateResult:
    gate: str
    status: str  # "pass" | "fail" | "error"
    checks: list[Check] = field(default_factory=list)
    measured: dict = field(default_factory=dict)
    worst: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["checks"] = [{**asdict(c), "passed": c.passed} for c in self.checks]
        return d


@dataclass


class GateSettings:
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    prompt_prefix: str = ""  # e.g. the BOS text; some servers misalign echo logprobs without a BOS (see notes)
    max_tokens: int = 16
    top_k: int = 5
    batch_sizes: list[int] = field(default_factory=lambda: [2, 4])
    long_prompt_repeats: int = 4  # prefix-cache: the long prompt is this many prompts joined
    worst: int = 5
    prompt_logprobs: bool = False  # oracle-kl: ask for vLLM's prompt_logprobs (token ids) instead of echo + logprobs
    bootstrap: int = 2000  # oracle-kl: row-bootstrap replicates of its per-domain intervals
    # fraction of positions that must carry logprobs (oracle-kl: of scored positions compared)
    min_coverage: float = 0.99


def verdict(name: str, checks: list[Check], **kw) -> GateResult:
    return GateResult(name, "pass" if all(c.passed for c in checks) else "fail", checks=checks, **kw)


def gate_thresholds(name: str, overrides: dict | None) -> dict[str, float]:
    th = dict(DEFAULT_THRESHOLDS[name])
    th.update({k: v for k, v in (overrides or {}).items() if k not in DEFAULT_MINIMUMS[name]})
    return th


def too_little_evidence(gate: str, rows: int, positions: int, overrides: dict | None, what: str) -> GateResult | None:
    """An error result (could not run) when the gate compared fewer `what` (positions) or rows than its minimums
    (`DEFAULT_MINIMUMS`, overridden from its gate.toml section); None when there is enough to decide on."""
    need = {k: int((overrides or {}).get(k, v)) for k, v in DEFAULT_MINIMUMS[gate].items()}
    if rows >= need["min_rows"] and positions >= need["min_positions"]:
        return None
    unit = ROWS_ARE[gate]
    return GateResult(gate, "error", measured={"rows": rows, "positions": positions, **need},
                      error=f"could not run: {positions} {what} in {rows} {unit} were compared; a verdict needs at "
                            f"least {need['min_positions']} positions and {need['min_rows']} {unit} (gate.toml "
                            f"[{gate}] min_positions / min_rows)")


def threshold_checks(th: dict[str, float], measured: dict) -> list[Check]:
    out = []
    for key, limit in th.items():
        metric, kind = key.rsplit("_", 1)
        out.append(Check(metric, measured.get(metric, float("nan")), "<=" if kind == "max" else ">=", float(limit)))
    return out


def coverage_error(gate: str, items: list[tuple[str, int, int]], s: GateSettings, what: str) -> GateResult | None:
    """An error result when fewer than `s.min_coverage` of the positions that should carry logprobs do, naming the
    items (prompt, case or row; compared, expected) short of it; None when coverage is enough. A gate measured on
    a sliver of its positions would pass on no evidence."""
    compared, expected = sum(c for _, c, _ in items), sum(e for _, _, e in items)
    frac = compared / expected if expected else 0.0
    if expected and frac >= s.min_coverage:
        return None
    short = [f"{name} ({c}/{e})" for name, c, e in items if e and c / e < s.min_coverage]
    more = f" and {len(short) - 8} more" if len(short) > 8 else ""
    return GateResult(gate, "error", measured={"coverage": frac, "compared": compared, "expected": expected},
                      error=f"only {compared} of {expected} {what} ({100 * frac:.1f} %) could be compared, below the "
                            f"minimum coverage {100 * s.min_coverage:g} %: the engine left out logprobs; short: "
                            f"{', '.join(short[:8])}{more}")

