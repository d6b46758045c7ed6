"""vLLM serving a lossy SmolLM2 (the Q2_K-derived weights, fp32) with the original fp32 weights as its draft model:
oracle-kl fails by the KL the lossy weights have (computed with transformers over the whole vocabulary), and vLLM's
speculative-decoding counters (/metrics) equal a greedy draft-and-verify simulation with transformers. One server for
the module, started without torch.compile (--enforce-eager: ~20 s instead of ~80 s on 2 cores)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from _vllm import CHATS, MODEL, completion, fidelity_cli, reference, serving
from fidelity.engine.vllm import VllmServe, read_facts

pytestmark = pytest.mark.slow
DRAFT_TOKENS = 3
TOP_K = 20


@pytest.fixture(scope="module")
def lossy(smollm2_gguf, tmp_path_factory):
    serve_of = lambda py, folders: VllmServe(
        str(folders["q2k"]), MODEL, python=str(py), kv_cache_gib=1, enforce_eager=True,
        speculative={"model": str(folders["f32"]), "num_speculative_tokens": DRAFT_TOKENS})
    with serving(smollm2_gguf, tmp_path_factory, "vllm-lossy", serve_of) as s:
        yield s


@pytest.fixture(scope="module")
def hf(lossy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load = lambda name: AutoModelForCausalLM.from_pretrained(lossy.folders[name], dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    # one torch thread beside the running server: with two, every parallel region waits on the thread that shares a
    # core with vLLM's worker (14x slower measured on a loaded 2-core machine)
    torch.set_num_threads(1)
    yield SimpleNamespace(q2k=load("q2k"), f32=load("f32"), tok=AutoTokenizer.from_pretrained(lossy.folders["f32"]))
    torch.set_num_threads(threads)


@torch.no_grad()
def logprobs(model, ids: list[int]) -> np.ndarray:
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


@torch.no_grad()
def greedy_last(model, ids: list[int], n: int) -> list[int]:
    """The greedy choices after each of the last n positions."""
    return model(torch.tensor([ids]), logits_to_keep=n).logits[0].argmax(-1).tolist()


def test_oracle_kl_fails_on_the_lossy_weights_by_the_kl_transformers_gives(lossy, hf):
    out = lossy.work / "gate.json"
    cfg = lossy.work / "gate.toml"
    cfg.write_text(f"[settings]\nprompt_logprobs = true\ntop_k = {TOP_K}\n")
    r = fidelity_cli("gate", "--engine", lossy.url, "--model", MODEL, "--reference-store", str(lossy.store),
                     "--config", str(cfg), "--only", "oracle-kl", "--json", str(out))
    print(r.stdout[-3000:])
    g = json.loads(out.read_text())["gates"][0]
    assert r.returncode == 1 and g["status"] == "fail", r.stderr
    # the whole-vocabulary KL(reference || the lossy weights) at the positions the gate scored, from transformers, and
    # the gate's estimator recomputed from it: the engine's top-k ids and the token itself, plus one tail bucket
    ref = reference(lossy.store)
    full, estimate = [], []
    for row in ref.rows:
        lq_row = logprobs(hf.q2k, row.tokens)
        for j, t in enumerate(row.scored):
            lp, lq = row.logprobs[j].astype(np.float64), lq_row[t - 1]
            full.append(float(np.sum(np.exp(lp) * (lp - lq))))
            seen = np.union1d(np.argsort(-lq)[:TOP_K], [row.tokens[t]])
            p, q = np.exp(lp[seen]), np.exp(lq[seen])
            estimate.append(
                float(np.sum(p * (lp[seen] - lq[seen])) + (1 - p.sum()) * np.log((1 - p.sum()) / (1 - q.sum())))
            )
    m = g["measured"]
    print(
        f"gate KL {m['kl_mean']:.4f} (top-{TOP_K} estimator, reference tail mass mean {m['ref_tail_mass_mean']:.3f}), "
        f"the same estimator from transformers {np.mean(estimate):.4f}, full-vocabulary KL {np.mean(full):.4f}, "
        f"top-1 {m['top1']:.3f}"
    )
    assert m["positions"] == len(full) and m["kl_mean"] > 100 * 1e-3
    # vLLM's fp32 logprobs are transformers' to ~1e-4: the same number, and a lower bound of the full KL
    assert abs(m["kl_mean"] / np.mean(estimate) - 1) < 0.01
    assert m["kl_mean"] <= np.mean(full) * 1.001 + 1e-4


def greedy_speculation(
    target, draft, prompt_ids: list[int], max_tokens: int, k: int
) -> tuple[list[int], int, list[int]]:
    """Greedy draft-and-verify as vLLM runs it: the first token from the prefill, then per step the draft model
    proposes k tokens greedily, the target keeps the longest prefix equal to its own greedy choices plus its next
    token. Returns (tokens, drafts, accepted per draft position)."""
    out = greedy_last(target, prompt_ids, 1)
    drafts, per = 0, [0] * k
    while len(out) < max_tokens:
        proposed = []
        for _ in range(k):
            proposed += greedy_last(draft, prompt_ids + out + proposed, 1)
        choice = greedy_last(target, prompt_ids + out + proposed, k + 1)
        n = 0
        while n < k and proposed[n] == choice[n]:
            per[n] += 1
            n += 1
        out += proposed[:n] + [choice[n]]
        drafts += 1
    return out[:max_tokens], drafts, per


def test_speculative_decoding_acceptance_equals_a_greedy_simulation(lossy, hf):
    rng = np.random.default_rng(lossy.seed)
    questions = [CHATS[i][0] for i in rng.choice(len(CHATS), size=2, replace=False)]
    max_tokens = 16
    before = read_facts(lossy.url).spec_decode
    want_drafts, want_per, texts = 0, [0] * DRAFT_TOKENS, []
    for q in questions:
        ids = hf.tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        got = completion(lossy.url, prompt=ids, max_tokens=max_tokens, ignore_eos=True, logprobs=1,
                         return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["tokens"]
        tokens, drafts, per = greedy_speculation(hf.q2k, hf.f32, ids, max_tokens, DRAFT_TOKENS)
        texts.append(([int(t.removeprefix("token_id:")) for t in got], tokens))
        want_drafts += drafts
        want_per = [a + b for a, b in zip(want_per, per)]
    spec = read_facts(lossy.url).spec_decode.minus(before)
    s = spec.summary()
    print(f"vLLM: {spec}; simulated: drafts {want_drafts}, accepted per position {want_per}; summary {s}")
    assert all(a == b for a, b in texts), texts
    assert spec.drafts == want_drafts and spec.draft_tokens == DRAFT_TOKENS * want_drafts
    assert spec.accepted_per_position == want_per and spec.accepted == sum(want_per)
    assert s["mean_accepted_length"] == 1 + sum(want_per) / want_drafts
    assert s["first_draft_acceptance"] == want_per[0] / want_drafts
