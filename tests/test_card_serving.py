"""The card's speed table carries the engine's serving facts (bench's `serving` block) where a bench has them: KV
capacity, memory, spec-decode acceptance, each linked to its JSON field; a bench without them shows '—'."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from fidelity.report.card import card_markdown

FIXTURES = Path(__file__).parent / "fixtures" / "card"


def test_serving_facts_in_the_speed_table(tmp_path, rng_seed):
    import random
    r = random.Random(rng_seed)
    for name in ("compare.json", "bench-native.json", "bench-q4-mix.json"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    facts = {"kv_cache_tokens": r.randrange(10_000, 900_000), "memory_pss_bytes": r.randrange(2**30, 2**36),
             "spec_decode": {"mean_accepted_length": 1 + 3 * r.random(), "first_draft_acceptance": r.random()}}
    doc = json.loads((tmp_path / "bench-q4-mix.json").read_text())
    doc["serving"] = {"engine": "vllm", **facts}
    (tmp_path / "bench-q4-mix.json").write_text(json.dumps(doc))
    text, _, _ = card_markdown([tmp_path / n for n in ("compare.json", "bench-native.json", "bench-q4-mix.json")],
                               build="q4-mix")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    kv = rows["KV cache capacity, tokens"]
    assert f"{facts['kv_cache_tokens']:,}" in kv and "| —" in kv                      # the native bench has none
    assert "bench-q4-mix.json#/serving/kv_cache_tokens" in kv
    mem = rows["memory after the runs, GiB (PSS of the server's processes)"]
    assert f"{facts['memory_pss_bytes'] / 2**30:.2f}" in mem
    spec = rows["spec-decode mean accepted length"]
    assert f"{facts['spec_decode']['mean_accepted_length']:.2f}" in spec
    assert "bench-q4-mix.json#/serving/spec_decode/mean_accepted_length" in spec
    first = rows["spec-decode first-draft acceptance"]
    assert f"{facts['spec_decode']['first_draft_acceptance']:.1%}" in first
    without = card_markdown([tmp_path / "compare.json", FIXTURES / "bench-native.json"], build="q4-mix")[0]
    assert not re.search(r"KV cache capacity|spec-decode", without)
