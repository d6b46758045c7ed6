"""Importing fidelity changes nothing outside it: not the environment (MKL_CBWR is asked for by the command line and
the Oracle, fidelity/blas.py), not the global `random` (the IFEval scorer seeds it for its checks alone and puts the
caller's state back), not another package's globals."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fidelity import blas

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, env: dict | None = None) -> dict:
    env = {k: v for k, v in (env or os.environ).items() if k != "MKL_CBWR"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_importing_fidelity_leaves_the_environment_and_random_unchanged(rng_seed):
    # third-party modules first: some draw from the global random when imported (rich.style: getrandbits(24))
    out = _run(f"""
import json, os, random, sys
import httpx, numpy, pyarrow, rich, rich.style, torch, tqdm, transformers
random.seed({rng_seed})
environ, state = dict(os.environ), random.getstate()
import fidelity, fidelity.cli, fidelity.environment, fidelity.oracle
import fidelity.measuring.compare, fidelity.measuring.metrics, fidelity.suites.ifeval, fidelity.suites.humaneval
from fidelity.oracle import parallel
changed = sorted(k for k in set(environ) | set(os.environ) if environ.get(k) != os.environ.get(k))
print(json.dumps({{"changed": changed, "random_same": random.getstate() == state}}))
""")
    assert out == {"changed": [], "random_same": True}


@pytest.mark.skipif(blas.strict_mode(*blas.cpu_info()) is None, reason="MKL's strict mode needs AVX2")
def test_the_oracle_asks_for_reproducible_gemms_before_its_first_product():
    """The library's way to every measured GEMM: an Oracle, made in a process that set nothing, sets MKL_CBWR (the
    reference store records it) before its first matrix product; a mode already in the environment is kept."""
    script = """
import json, os
import fidelity
before = os.environ.get("MKL_CBWR")
from fidelity.oracle import Oracle
from testkit.synthetic import SyntheticPack, llama_config
Oracle(SyntheticPack(llama_config(hidden_size=16, intermediate_size=8, n_layers=1, vocab_size=40, n_heads=2,
                                  n_kv_heads=2), seed=0))
print(json.dumps({"before": before, "after": os.environ.get("MKL_CBWR")}))
"""
    assert _run(script) == {"before": None, "after": blas.strict_mode(*blas.cpu_info())}
    kept = _run(script.replace("import fidelity\n", "import fidelity\nos.environ['MKL_CBWR'] = 'COMPATIBLE'\n"))
    assert kept["after"] == "COMPATIBLE"


def test_the_command_line_asks_for_reproducible_gemms_first():
    out = _run("""
import json, os, sys
from fidelity import cli
try:
    cli.main(["--version"])
except SystemExit:
    pass
print(json.dumps({"after": os.environ.get("MKL_CBWR")}))
""")
    assert out == {"after": blas.strict_mode(*blas.cpu_info())}


def test_scoring_ifeval_leaves_the_callers_random_state_and_langdetect_seed(rng_seed):
    """lm-eval's checkers draw from the global `random` (keys 1122 / 1129: letter_frequency's letter): the scorer seeds
    it for the check, as documented, and gives the caller its state back (it used to leave random seeded with 0)."""
    langdetect = pytest.importorskip("langdetect")
    from fidelity.suites.ifeval import load_checkers, score_response
    try:
        load_checkers()
    except Exception as e:        # lm-eval's checker files are an optional install (the suites' extra)
        pytest.skip(f"missing tool: lm-eval's IFEval checkers ({e})")
    row = {"key": 1122, "prompt": "Use the letter # at least 3 times.", "instruction_id_list":
           ["keywords:letter_frequency"], "kwargs": [{"letter": "#", "let_frequency": 3, "let_relation": "at least"}]}
    answer = " ".join(c * 9 for c in "abcdefghijklm")
    own_seed = langdetect.DetectorFactory.seed
    try:
        langdetect.DetectorFactory.seed = 7
        random.seed(rng_seed)
        state = random.getstate()
        first = score_response(row, answer)
        assert random.getstate() == state and langdetect.DetectorFactory.seed == 7
        random.seed(rng_seed + 1)
        assert score_response(row, answer).details == first.details     # the checks' own draws do not depend on it
    finally:
        langdetect.DetectorFactory.seed = own_seed
