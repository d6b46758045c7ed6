"""A process's first computations equal its later ones bit for bit (issue 6: the first parallel call of one of MKL's
vector-math functions, behind torch's exp/log/sin/cos, sometimes ran one thread's share at ~fp16 accuracy, so the first
rope tables or log-sum-exp of a process differed from every later one; `vector_math.warm_up_vector_math` sets VML up on
one thread first)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh process: everything it measures is that process's first use of the kernels involved.
FIRST_CALLS = r"""
import json, sys
import torch
from fidelity.measuring.metrics import topk_logprobs
from fidelity.oracle import Oracle
from testkit.synthetic import SyntheticPack, llama_config

seed, length = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(2)
pack = SyntheticPack(llama_config(hidden_size=128, intermediate_size=256, n_layers=2, vocab_size=49152, n_heads=2,
                                  n_kv_heads=1), seed=seed)
oracle = Oracle(pack)
tokens = torch.randint(0, 49152, (1, length), generator=torch.Generator().manual_seed(seed))
first = oracle.logits(tokens)[0]           # rope tables, softmax, head: each kernel's first parallel call
first_topk = topk_logprobs(first[:4], 20)  # log-sum-exp over [4, 49152]: the first parallel exp and sum
second = oracle.logits(tokens)[0]
second_topk = topk_logprobs(first[:4], 20)
lse = torch.logsumexp(first[:4].double(), -1)
print(json.dumps({
    "logits_equal": torch.equal(first, second),
    "topk_equal": all(torch.equal(a, b) for a, b in zip(first_topk, second_topk)),
    "max_logprob_change": float((first_topk[1] - second_topk[1]).abs().max()),
    "lse_error_vs_float64": float(
        (first_topk[1].double() - (first[:4].double().gather(1, first_topk[0]) - lse[:, None])).abs().max()),
}))
"""


@pytest.mark.slow
def test_first_forward_and_log_sum_exp_of_fresh_processes_equal_later_ones(rng_seed):
    """Four fresh processes at once (they compete for the cores, as `fidelity serve`, `gate` and pytest did): the first
    logits equal the second bit for bit, the first top-K log-probs equal the second, and the first log-sum-exp is
    within float32 rounding of float64's (the bad first exp was 1.5e-4 off relatively; log-probs moved by 2.67e-5)."""
    procs = [subprocess.Popen([sys.executable, "-c", FIRST_CALLS, str(rng_seed + i), "48"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        r = json.loads(out.strip().splitlines()[-1])
        assert r["logits_equal"] and r["topk_equal"], (i, r)
        assert r["max_logprob_change"] == 0.0
        # log-probs near 10 nats: float32 logit rounding plus the log-sum-exp's own is a few 1e-6 at most
        assert r["lse_error_vs_float64"] < 1e-5, (i, r)


def test_forward_on_a_new_thread_equals_the_main_threads(rng_seed):
    """Threads other than the oracle's builder (serve's connection threads) warm up themselves: a forward and head run
    first on a new thread give the main thread's numbers bit for bit."""
    from fidelity.oracle import Oracle
    from testkit.synthetic import SyntheticPack, llama_config

    pack = SyntheticPack(llama_config(hidden_size=64, intermediate_size=128, n_layers=2, vocab_size=4096, n_heads=2,
                                      n_kv_heads=1), seed=rng_seed)
    oracle = Oracle(pack, keep_weights=True)
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(rng_seed))
    got = {}

    def run(key):
        got[key] = oracle.logits(tokens)

    t = threading.Thread(target=run, args=("thread",))
    t.start()
    t.join()
    run("main")
    assert torch.equal(got["thread"], got["main"])
    from fidelity import vector_math
    assert vector_math._warmed.done  # the main thread was warmed by the Oracle's construction or its forward
