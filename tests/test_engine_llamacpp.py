"""Gates against a real engine: llama-cpp-python's OpenAI server on loopback, serving SmolLM2 GGUFs written by
write_gguf."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fidelity.engine.gates.invariance import batch_invariance, decode_vs_prefill, prefix_cache
from fidelity.engine.gates.kinds import run_gate
from fidelity.engine.gates.oracle_kl import oracle_kl
from fidelity.engine.gates.settings import GateSettings
from fidelity.engine.client import ClientConfig, EngineClient

from _llamacpp import llama_server

pytestmark = pytest.mark.slow
llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("uvicorn")

CHATS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name a primary color.", "Red is a primary color."),
    ("What is 2 plus 3?", "2 plus 3 equals 5."),
    ("Say hello in Spanish.", "Hola!"),
    ("What do bees make?", "Bees make honey."),
    ("Which planet is largest?", "Jupiter is the largest planet."),
]
# these panels have 2 rows and 10-19 scored positions, below oracle-kl's default evidence minimums (3 rows, 20
# positions)
TWO_ROWS = {"min_rows": 2, "min_positions": 4}
SERVER_FLAGS = ["--n_ctx", "1024", "--n_threads", "1", "--logits_all", "true", "--verbose", "false", "--type_k", "0",
                "--type_v", "0"]


@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory):
    from fidelity.packs import open_pack
    from fidelity.packs.tokenizer import load_tokenizer
    from fidelity.packs.writers import write_gguf

    pack = open_pack(smollm2_gguf)
    out = tmp_path_factory.mktemp("gguf")
    # the Q4_1 weights dequantized to F32: the same function the oracle computes from the Q4_1 pack
    return {"pack": pack, "tok": load_tokenizer(pack), "F32": write_gguf(pack, out / "smol-F32.gguf", "F32"),
            "Q2_K": write_gguf(pack, out / "smol-Q2_K.gguf", "Q2_K")}


def chat_rows(tok, seed: int, n: int = 2) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for j, i in enumerate(rng.choice(len(CHATS), size=n, replace=False)):
        q, a = CHATS[i]
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        rows.append({"id": f"chat{i}", "domain": "chat", "tokens": ids})
    return rows


def gate(url, fn, *args, **kw):
    async def go():
        async with EngineClient(ClientConfig(url, model="smol", concurrency=4, timeout_s=300)) as c:
            return await run_gate(fn.__name__, fn, c, *args, **kw)
    return asyncio.run(go())


def llama_full_logprobs(model_path, rows) -> list[np.ndarray]:
    """The same engine's full-vocabulary distributions, in-process (what the server's top-k only samples)."""
    m = llama_cpp.Llama(str(model_path), logits_all=True, n_ctx=1024, n_threads=1, verbose=False, type_k=0, type_v=0)
    out = []
    for r in rows:
        m.reset()
        m.eval(r["tokens"])
        s = np.asarray(m.scores[: len(r["tokens"])], dtype=np.float64)
        out.append(s - (s.max(1, keepdims=True) + np.log(np.exp(s - s.max(1, keepdims=True)).sum(1, keepdims=True))))
    del m
    return out


def full_vocab_kl(model_path, ref, rows, top_k: int, bos: int) -> tuple[float, float, int]:
    """Mean full-vocabulary KL(ref || engine) over the positions the gate scores through llama-cpp-python's echo (it
    skips BOS tokens and gives no logprob for the first echoed one), and the mean of the stated gap tail_mass *
    KL(tails)."""
    full, gaps = [], []
    mappable = ref.piece_ids()  # text keys the gate can attribute to one id; the rest of the engine's top-k is tail
    for r, lq in zip(ref.rows, llama_full_logprobs(model_path, rows)):
        for j, t in enumerate(r.scored):
            if r.tokens[t] == bos or t == 1:
                continue
            lp, q = r.logprobs[j], lq[t - 1]
            p = np.exp(lp)
            full.append(float(np.sum(p * (lp - q))))
            # llama-cpp-python names special tokens "" in top_logprobs, so only the actual token's entry keeps its id
            seen = {
                int(i) for i in np.argsort(-q)[:top_k] if mappable.get(ref.pieces[i]) == i and i not in ref.special_ids
            }
            seen.add(r.tokens[t])
            tail = np.array(sorted(set(range(len(q))) - seen))
            pt, qt = p[tail].sum(), np.exp(q[tail]).sum()
            gaps.append(float(pt * np.sum(p[tail] / pt * (lp[tail] - np.log(pt) - q[tail] + np.log(qt)))))
    return float(np.mean(full)), float(np.mean(gaps)), len(full)


def test_oracle_kl_f32_passes_q2k_fails_and_matches_full_vocab_kl(smol, tmp_path, rng_seed):
    from fidelity.commands.reference import build_store
    from fidelity.measuring.compare import compare
    from fidelity.engine.reference import reference_from_store
    from fidelity.packs import open_pack
    from fidelity.panels.panel import PanelRow, write_panel

    rng = np.random.default_rng(rng_seed)
    chats = [CHATS[i] for i in rng.choice(len(CHATS), size=2, replace=False)]
    panel = write_panel(tmp_path / "panel", [PanelRow(f"chat{i}", "chat", messages=[{"role": "user", "content": q},
                        {"role": "assistant", "content": a}]) for i, (q, a) in enumerate(chats)], name="gate-test")
    store = tmp_path / "store"
    build_store(smol["pack"], panel.path, store, progress=False)
    ref = reference_from_store(store, smol["pack"], panel.path)
    s = GateSettings(top_k=20)
    with llama_server(smol["F32"], tmp_path, SERVER_FLAGS) as srv:
        f32 = gate(srv.url, oracle_kl, ref, s, TWO_ROWS)
    with llama_server(smol["Q2_K"], tmp_path, SERVER_FLAGS) as srv:
        q2k = gate(srv.url, oracle_kl, ref, s, TWO_ROWS)
    print("F32", f32.measured, "\nQ2_K", q2k.measured)
    assert f32.status == "pass", f32
    assert q2k.status == "fail" and q2k.measured["kl_mean"] > 100 * f32.measured["kl_mean"]

    # the same engines' full-vocabulary distributions in-process: the estimate is the full KL minus the stated gap. The
    # server
    # rounds logprobs through float32 log-softmax, which puts a floor of a few 1e-6 under the F32 estimate.
    bos = smol["tok"].convert_tokens_to_ids("<|im_start|>")
    rows = [{"tokens": r.tokens} for r in ref.rows]
    full = {}
    for name, res in (("F32", f32), ("Q2_K", q2k)):
        full[name], gap, n = full_vocab_kl(smol[name], ref, rows, s.top_k, bos)
        print(
            f"{name}: full-vocab KL {full[name]:.4e}, gate estimate {res.measured['kl_mean']:.4e}, stated gap {gap:.4e}"
        )
        assert res.measured["positions"] == n
        assert res.measured["kl_mean"] <= full[name] * 1.02 + 2e-5
        assert abs(full[name] - gap - res.measured["kl_mean"]) <= 0.02 * full[name] + 2e-5

    # `compare` on the same panel and store: the oracle's exact KL for the Q2_K pack (dequantized, fp32), next to
    # llama.cpp's
    # Q2_K kernels (which also quantize activations): same order, the gate's lower-bound estimate not above either
    cmp = compare(smol["pack"], [open_pack(smol["Q2_K"])], panel=panel.path, reference_store=store, noise_floor=False,
                  n_boot=100, progress=False).report["results"][0]["overall"]
    print(
        f"compare Q2_K kld_mean {cmp['kld_mean']:.4e} (scored {cmp.get('positions')}), "
        f"llama.cpp full {full['Q2_K']:.4e}, "
        f"gate {q2k.measured['kl_mean']:.4e}"
    )
    assert 0.5 < full["Q2_K"] / cmp["kld_mean"] < 2.0
    assert q2k.measured["kl_mean"] <= max(full["Q2_K"], cmp["kld_mean"]) * 1.02


def test_three_gates_on_llamacpp_report_what_they_measure(smollm2_gguf, tmp_path):
    s = GateSettings(prompts=["The capital of France is", "Bees make"], prompt_prefix="<|im_start|>", max_tokens=4,
                       top_k=3, batch_sizes=[2], long_prompt_repeats=2)
    no_bos = GateSettings(**{**s.__dict__, "prompt_prefix": ""})
    with llama_server(smollm2_gguf, tmp_path, SERVER_FLAGS) as srv:
        results = {fn.__name__: gate(srv.url, fn, s) for fn in (batch_invariance, decode_vs_prefill, prefix_cache)}
        dvp_no_bos = gate(srv.url, decode_vs_prefill, no_bos)
    for name, r in results.items():
        print(name, r.status, r.measured)
        assert r.status in ("pass", "fail") and r.error is None
        assert all(np.isfinite(c.value) for c in r.checks)
        assert r.status == ("pass" if all(c.passed for c in r.checks) else "fail")
    # llama-cpp-python 0.3.x shifts echoed prompt logprobs by one position when the prompt has no BOS token: the
    # decode-vs-prefill gate sees it (logprob changes of whole nats), while with a BOS the two paths agree closely
    print("decode-vs-prefill without BOS", dvp_no_bos.measured)
    assert results["decode_vs_prefill"].measured["max_abs_dlogprob"] < 0.5
    assert dvp_no_bos.status == "fail" and dvp_no_bos.measured["max_abs_dlogprob"] > 1.0
    # and names it, with the fix (the BOS prompt_prefix that makes the first run agree)
    assert dvp_no_bos.measured["echo_shift"] == 1 and "echo_shift" not in results["decode_vs_prefill"].measured
    assert (
        "shifted by +1 position" in dvp_no_bos.notes[0]
        and "start every prompt with the BOS token" in dvp_no_bos.notes[0]
    )


def test_oracle_kl_names_the_misaligned_echo_of_text_rows_without_bos(smol, tmp_path):
    """The seen case: text rows (no BOS) through llama-cpp-python's server on an F32 GGUF that matches the oracle: the
    echo comes one position early, oracle-kl fails and says so, against the reference and the engine's own answer."""
    from fidelity.commands.reference import build_store
    from fidelity.engine.reference import reference_from_store
    from fidelity.panels.panel import PanelRow, write_panel

    panel = write_panel(
        tmp_path / "panel",
        [
            PanelRow("t0", "text", text="The river flows through the old town towards the sea."),
            PanelRow("t1", "text", text="Bees make honey from the nectar of flowers."),
        ],
        name="text-no-bos",
    )
    build_store(smol["pack"], panel.path, tmp_path / "store", progress=False)
    ref = reference_from_store(tmp_path / "store")  # the pack and panel the store records
    assert all(r.tokens[0] not in ref.special_ids for r in ref.rows)
    with llama_server(smol["F32"], tmp_path, SERVER_FLAGS) as srv:
        res = gate(srv.url, oracle_kl, ref, GateSettings(top_k=20), TWO_ROWS)
    print(res.measured, res.notes)
    assert res.status == "fail" and res.measured["kl_mean"] > 0.5 and res.measured["echo_shift"] == 1
    assert "shifted by +1 position" in res.notes[0] and "Confirmed by the engine itself" in res.notes[0]
