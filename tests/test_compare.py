"""compare() end to end on tiny Llama packs that carry SmolLM2's real tokenizer (fast), checked against HF
transformers."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fidelity.measuring.compare import compare
from fidelity.errors import PackError
from fidelity.panels.panel import PanelRow, write_panel
from fidelity.measuring.store import StoreError

VOCAB = 49152


def _config(vocab=VOCAB):
    from testkit.synthetic import llama_config
    return llama_config(hidden_size=64, intermediate_size=128, n_layers=2, vocab_size=vocab, n_heads=4, n_kv_heads=2)


def _weights(cfg, gen):
    from testkit.synthetic import llama_shapes
    out = {}
    for name, shape in llama_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            out[name] = (
                torch.randn(shape, generator=gen)
                / shape[-1] ** 0.5
                * (3.0 if "embed" in name or "lm_head" in name else 1.0)
            )
    return out


def _save(path, cfg, weights, tokenizer=None):
    from safetensors.torch import save_file
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def tiny_setting(tmp_path_factory, smollm2_gguf, name: str):
    """(a fresh folder `name`, SmolLM2's tokenizer, a generator on a fresh seed printed as "`name` seed N";
    FIDELITY_TEST_MODULE_SEED=N replays one): what the module fixtures building tiny packs start from."""
    from fidelity.packs import open_pack
    from fidelity.packs.tokenizer import load_tokenizer
    seed = int(os.environ.get("FIDELITY_TEST_MODULE_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"{name} seed {seed}")
    return tmp_path_factory.mktemp(name), load_tokenizer(open_pack(smollm2_gguf)), torch.Generator().manual_seed(seed)


def noisy_packs(root: Path, tok, gen: torch.Generator, noise: dict[str, float]):
    """(config, reference weights, {"ref": path, name: path…}): a random tiny reference and, per name, a pack whose
    every weight carries Gaussian noise of `noise[name]` x that tensor's mean |w|."""
    cfg = _config()
    w = _weights(cfg, gen)
    packs = {"ref": _save(root / "ref", cfg, w, tok)}
    for name, scale in noise.items():
        packs[name] = _save(root / name, cfg, {k: v + scale * v.abs().mean() * torch.randn(v.shape, generator=gen)
                                                for k, v in w.items()}, tok)
    return cfg, w, packs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf):
    root, tok, gen = tiny_setting(tmp_path_factory, smollm2_gguf, "tiny")
    cfg, w, packs = noisy_packs(root, tok, gen, {"small": 0.01, "large": 0.05})
    nan_w = dict(w)
    nan_w["lm_head.weight"] = w["lm_head.weight"].clone()
    nan_w["lm_head.weight"][VOCAB - 7] = float("nan")
    packs["nan"] = _save(root / "nan", cfg, nan_w, tok)
    small_cfg = _config(vocab=1000)
    packs["vocab1000"] = _save(root / "vocab1000", small_cfg, _weights(small_cfg, gen))
    rows = [PanelRow("c1", "chat", messages=[{"role": "user", "content": "Name three colors."},
                                             {"role": "assistant", "content": "Red, green and blue."}]),
            PanelRow("c2", "chat", messages=[{"role": "user", "content": "What is 3 times 4?"},
                                             {"role": "assistant", "content": "3 times 4 is 12."},
                                             {"role": "user", "content": "And plus one?"},
                                             {"role": "assistant", "content": "13."}]),
            PanelRow("t1", "text", text="The river flows through the old town towards the sea."),
            PanelRow("t2", "text", text="def square(x):\n    return x * x\n")]
    packs["panel"] = write_panel(root / "panel", rows, name="tiny-test").path
    packs["tokenizer"] = tok
    return packs


TIE_TOLERANCE = 1e-4   # the oracle's logits match HF's to 1e-4


def _top2_margin(logp: torch.Tensor) -> torch.Tensor:
    top2 = logp.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def _hf_logits(path, tokens):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double()


@pytest.fixture(scope="module")
def live(tiny):
    return compare(tiny["ref"], [tiny["small"], tiny["large"]], panel=tiny["panel"], n_boot=300, progress=False)


def test_compare_matches_transformers(tiny, live):
    """KL(ref||pack), top-1 and PPL equal plain-torch numbers on HF transformers' fp32 logits, to 1e-4 relative."""
    from fidelity.panels.panel import load_panel, tokenize_panel
    rows = tokenize_panel(load_panel(tiny["panel"]), tiny["tokenizer"])
    for label in ("small", "large"):
        kl, agree, near_tie, nll_ref, nll_pack = [], [], [], [], []
        for r in rows:
            pos = torch.tensor([t - 1 for t, s in enumerate(r.scored) if s])
            tgt = torch.tensor(r.tokens)[pos + 1]
            lp = torch.log_softmax(_hf_logits(tiny["ref"], r.tokens)[pos], -1)
            lq = torch.log_softmax(_hf_logits(tiny[label], r.tokens)[pos], -1)
            kl.append((lp.exp() * (lp - lq)).sum(-1))
            agree.append(lp.argmax(-1) == lq.argmax(-1))
            near_tie.append((_top2_margin(lp) < TIE_TOLERANCE) | (_top2_margin(lq) < TIE_TOLERANCE))
            nll_ref.append(-lp.gather(1, tgt[:, None])[:, 0])
            nll_pack.append(-lq.gather(1, tgt[:, None])[:, 0])
        res = next(r for r in live.report["results"] if r["label"] == label)["overall"]
        assert res["positions"] == sum(len(k) for k in kl) == live.report["panel"]["scored_positions"]
        assert res["kld_mean"] == pytest.approx(float(torch.cat(kl).mean()), rel=1e-4)
        # A position whose top two logits lie within the oracle's tolerance of HF's may pick either: count it both ways.
        agree_all, tie = torch.cat(agree), torch.cat(near_tie)
        print(label, "top-1", res["top1"], "HF", float(agree_all.double().mean()), "near-tie positions", int(tie.sum()))
        assert int(tie.sum()) <= 2, f"{label}: {int(tie.sum())} near-tie positions (the seed printed above)"
        n = len(agree_all)
        assert int((agree_all & ~tie).sum()) / n - 1e-12 <= res["top1"] <= int((agree_all | tie).sum()) / n + 1e-12
        if not tie.any():
            assert res["top1"] == pytest.approx(float(agree_all.double().mean()), rel=1e-4)
        assert res["ppl"] == pytest.approx(float(torch.cat(nll_pack).mean().exp()), rel=1e-4)
        assert res["ppl_ref"] == pytest.approx(float(torch.cat(nll_ref).mean().exp()), rel=1e-4)
    small, large = (next(r for r in live.report["results"] if r["label"] == k)["overall"] for k in ("small", "large"))
    assert small["kld_mean"] < large["kld_mean"]
    (pair,) = live.report["paired"]
    assert pair["a"] == "small" and pair["b"] == "large"
    assert pair["kld_mean_diff"] == pytest.approx(small["kld_mean"] - large["kld_mean"], rel=1e-9)
    nf = live.report["noise_floor"]["kld_mean"]
    assert 0 < nf < small["kld_mean"] and small["noise_floor_kld"] == nf


def test_reference_logits_are_computed_once_and_change_no_number(tiny, live, monkeypatch):
    """On a CPU oracle the reference's logits are kept across the noise floor and the packs when they fit in
    REF_LOGITS_CACHE_BYTES: the reference head runs once per row, and the report is the one recomputing them gives."""
    import fidelity.measuring.compare as C
    import fidelity.measuring.passes as passes

    calls = []
    check = C._check_reference_logits
    monkeypatch.setattr(C, "_check_reference_logits", lambda ref, i, *a: (calls.append(i), check(ref, i, *a))[1])
    kept = compare(tiny["ref"], [tiny["small"], tiny["large"]], panel=tiny["panel"], n_boot=300, progress=False)
    assert sorted(calls) == list(range(len(kept.rows)))
    calls.clear()
    monkeypatch.setattr(passes, "REF_LOGITS_CACHE_BYTES", 0)
    fresh = compare(tiny["ref"], [tiny["small"], tiny["large"]], panel=tiny["panel"], n_boot=300, progress=False)
    assert len(calls) == 3 * len(fresh.rows)   # the noise floor and each pack computed them again
    assert json.dumps(kept.report, sort_keys=True) == json.dumps(fresh.report, sort_keys=True) == \
        json.dumps(live.report, sort_keys=True)


def test_store_equals_live_exactly(tiny, live, tmp_path):
    from fidelity.commands.reference import build_store
    m = build_store(tiny["ref"], tiny["panel"], tmp_path / "store", progress=False)
    assert m["bytes_per_scored_position"] < 2 * VOCAB / 20
    stored = compare(
        tiny["ref"],
        [tiny["small"], tiny["large"]],
        panel=tiny["panel"],
        reference_store=tmp_path / "store",
        n_boot=300,
        progress=False,
    )
    a, b = dict(live.report), dict(stored.report)
    a["reference"] = {k: v for k, v in a["reference"].items() if k != "store"}
    b["reference"] = {k: v for k, v in b["reference"].items() if k != "store"}
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    for label in live.metrics:
        assert np.array_equal(live.metrics[label].kld.numpy(), stored.metrics[label].kld.numpy(), equal_nan=True)


def test_interrupted_compare_resumes_without_recomputing_finished_passes(tiny, live, tmp_path, monkeypatch):
    """A run killed while measuring its second pack, rerun with the same resume folder: the reference, the noise floor
    and the first pack are read back (never recomputed), only the second pack runs, and the report equals an
    uninterrupted run's."""
    import fidelity.measuring.compare as C

    built, real_oracle, real_reference = [], C._oracle, C.run_reference

    def counting_oracle(pack, device, numerics="exact", settings=None):
        built.append(Path(pack.path).name)
        if Path(pack.path).name == "large" and fail["now"]:
            raise KeyboardInterrupt("killed while loading the second pack")
        return real_oracle(pack, device, numerics, settings)

    references = []
    fail = {"now": True}
    monkeypatch.setattr(C, "_oracle", counting_oracle)
    monkeypatch.setattr(C, "run_reference", lambda *a, **k: references.append(1) or real_reference(*a, **k))
    keep = tmp_path / "passes"
    with pytest.raises(KeyboardInterrupt):
        compare(
            tiny["ref"], [tiny["small"], tiny["large"]], panel=tiny["panel"], n_boot=300, progress=False, resume=keep
        )
    assert built == ["ref", "small", "large"] and len(references) == 1
    done = sorted(p.name for p in keep.glob("*.done.json"))
    assert len(done) == 3 and "noise-floor.done.json" in done and "reference-store.done.json" in done

    built.clear()
    fail["now"] = False
    noisy = []
    monkeypatch.setattr(C, "perturbed_oracle", lambda *a, **k: noisy.append(1))
    resumed = compare(tiny["ref"], [tiny["small"], tiny["large"]], panel=tiny["panel"], n_boot=300, progress=False,
                      resume=keep)
    assert built == ["ref", "large"] and len(references) == 1 and not noisy   # ref: its head re-derives the store
    from fidelity.packs import open_pack
    small_fp = open_pack(tiny["small"]).fingerprint()
    assert resumed.report["resumed"] == ["reference", "noise-floor", f"pack-{small_fp}"]
    a, b = dict(live.report), dict(resumed.report)
    a.pop("resumed"), b.pop("resumed")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    for label in live.metrics:
        for name, x in live.metrics[label].to_numpy().items():
            assert np.array_equal(x, resumed.metrics[label].to_numpy()[name], equal_nan=True), (label, name)

    # a third run reuses everything; another pack in the same folder is measured, not mistaken for a kept one
    built.clear()
    again = compare(
        tiny["ref"], [tiny["large"], tiny["small"]], panel=tiny["panel"], n_boot=300, progress=False, resume=keep
    )
    assert built == ["ref"] and len(again.report["resumed"]) == 4
    built.clear()
    other = compare(tiny["ref"], [tiny["nan"]], panel=tiny["panel"], n_boot=100, progress=False, resume=keep)
    assert built == ["ref", "nan"] and other.report["resumed"] == ["reference", "noise-floor"]


def test_resume_folder_refuses_a_damaged_pass_and_ignores_a_stale_one(tiny, tmp_path):
    keep = tmp_path / "passes"
    compare(
        tiny["ref"], [tiny["small"]], panel=tiny["panel"], noise_floor=False, n_boot=50, progress=False, resume=keep
    )
    (data,) = keep.glob("pack-*.parquet")
    done = data.with_name(data.name.replace(".parquet", ".done.json"))
    key = json.loads(done.read_text())
    done.write_text(json.dumps({**key, "fidelity_version": "0.0.0"}))   # made by another version: recomputed
    res = compare(tiny["ref"], [tiny["small"]], panel=tiny["panel"], noise_floor=False, n_boot=50, progress=False,
                  resume=keep)
    assert res.report["resumed"] == ["reference"] and json.loads(done.read_text()) == key
    import pyarrow.parquet as pq
    from fidelity.content_hash import tree_digest
    table = pq.read_table(data)
    pq.write_table(table.slice(1), data)  # a table for other positions under its identity
    with pytest.raises(
        PackError,
        match=r"finished pass 'pack-.*changed after it was written .*BLAKE3 checksum differs.*"
        r"delete it to recompute it.*pack-.*\.parquet",
    ):
        compare(tiny["ref"], [tiny["small"]], panel=tiny["panel"], noise_floor=False, n_boot=50, progress=False,
                resume=keep)
    routing = data.with_name(data.name.replace(".parquet", ".routing.json"))   # the pass's other file, checksummed too
    # ...even with a checksum that matches it
    done.write_text(json.dumps({**key, "checksum": {**tree_digest(data), **tree_digest(routing)}}))
    with pytest.raises(PackError, match=r"finished pass 'pack-.*holds other positions than this panel's; delete it to "
                                        r"recompute it.*pack-.*\.parquet"):
        compare(tiny["ref"], [tiny["small"]], panel=tiny["panel"], noise_floor=False, n_boot=50, progress=False,
                resume=keep)
    data.write_bytes(data.read_bytes()[:100])                            # damaged after it was finished
    done.write_text(json.dumps({**key, "checksum": {**tree_digest(data), **tree_digest(routing)}}))
    with pytest.raises(
        PackError, match=r"cannot read the finished pass 'pack-.*delete it to recompute.*pack-.*\.parquet"
    ):
        compare(tiny["ref"], [tiny["small"]], panel=tiny["panel"], noise_floor=False, n_boot=50, progress=False,
                resume=keep)


def test_store_is_refused_for_another_panel_pack_or_tokenizer(tiny, tmp_path):
    from fidelity.commands.reference import build_store
    store = tmp_path / "store"
    build_store(tiny["ref"], tiny["panel"], store, progress=False)
    other = write_panel(tmp_path / "other", [PanelRow("x", "text", text="Something else entirely here.")], name="other")
    with pytest.raises(StoreError, match=r"built for panel 'tiny-test' .* not for panel 'other'"):
        compare(tiny["ref"], [tiny["small"]], panel=other.path, reference_store=store, progress=False)
    with pytest.raises(StoreError, match="built from reference pack"):
        compare(tiny["small"], [tiny["large"]], panel=tiny["panel"], reference_store=store, progress=False)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["tokenizer_fingerprint"] = "0123456789abcdef"
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="built with tokenizer 0123456789abcdef"):
        compare(tiny["ref"], [tiny["small"]], panel=tiny["panel"], reference_store=store, progress=False)


def test_gate_reference_defaults_to_the_stores_pack_and_panel(tiny, tmp_path):
    """The manifest records the reference pack and panel (paths and fingerprints); the gate's reference defaults to
    them, an override still works, another pack or panel is still refused, a moved pack is named."""
    import shutil

    from fidelity.commands.reference import build_store
    from fidelity.engine.reference import reference_from_store
    from fidelity.errors import FidelityError
    from fidelity.packs import open_pack
    store = tmp_path / "store"
    build_store(tiny["ref"], tiny["panel"], store, progress=False)
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["reference_pack"] == {"path": str(Path(tiny["ref"]).resolve()),
                                          "fingerprint": open_pack(tiny["ref"]).fingerprint()}
    assert manifest["panel"]["path"] == str(Path(tiny["panel"]).resolve())
    default = reference_from_store(store)
    explicit = reference_from_store(store, tiny["ref"], tiny["panel"])
    assert [r.id for r in default.rows] == [r.id for r in explicit.rows] == ["c1", "c2", "t1", "t2"]
    for a, b in zip(default.rows, explicit.rows):
        assert a.tokens == b.tokens and a.scored == b.scored and np.array_equal(a.logprobs, b.logprobs)
    other = write_panel(tmp_path / "other", [PanelRow("x", "text", text="Something else entirely here.")], name="other")
    with pytest.raises(StoreError, match=r"built for panel 'tiny-test' .* not for panel 'other'"):
        reference_from_store(store, panel=other.path)
    with pytest.raises(StoreError, match="built from reference pack"):
        reference_from_store(store, tiny["small"])
    moved = tmp_path / "moved"
    shutil.copytree(tiny["ref"], moved)
    manifest["reference_pack"]["path"] = str(tmp_path / "gone")
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FidelityError, match=r"built from reference pack .*gone, which is not there any more: pass .*"
                                            r"--reference-pack"):
        reference_from_store(store)
    assert reference_from_store(store, moved).rows[0].tokens == explicit.rows[0].tokens  # the override
    del manifest["reference_pack"]  # a store written before the manifest recorded its sources
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FidelityError, match=r"needs the reference pack it was built from \(--reference-pack\)"):
        reference_from_store(store)


def test_store_topk_check_catches_a_changed_head(tiny, tmp_path):
    """Hidden states tampered with in the store no longer reproduce the stored top-K: refused, naming row and
    position."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from fidelity.commands.reference import build_store
    store = tmp_path / "store"
    build_store(tiny["ref"], tiny["panel"], store, progress=False)
    t = pq.read_table(store / "records.parquet")
    hidden = t.column("hidden").to_pylist()
    j = next(i for i, h in enumerate(hidden) if h is not None)
    h = np.frombuffer(hidden[j], np.float32).copy()
    h[:] = h[::-1]
    hidden[j] = h.tobytes()
    t = t.set_column(t.schema.get_field_index("hidden"), "hidden", pa.array(hidden, pa.binary()))
    pq.write_table(t, store / "records.parquet")
    with pytest.raises(
        StoreError, match=r"row 'c1' position \d+: logits re-derived .* do not reproduce the stored top-20"
    ):
        compare(
            tiny["ref"], [tiny["small"]], panel=tiny["panel"], reference_store=store, noise_floor=False, progress=False
        )


def test_nan_logits_are_counted_and_reported(tiny):
    res = compare(tiny["ref"], [tiny["nan"]], panel=tiny["panel"], noise_floor=False, n_boot=100, progress=False)
    o = res.report["results"][0]["overall"]
    assert o["nonfinite"] == res.report["panel"]["scored_positions"] and o["positions"] == 0
    assert o["kld_mean"] is None


def test_different_vocabularies_are_refused_naming_both(tiny):
    with pytest.raises(PackError, match=rf"reference {tiny['ref']} has 49152 tokens, {tiny['vocab1000']} has 1000"):
        compare(tiny["ref"], [tiny["vocab1000"]], panel=tiny["panel"], progress=False)


def test_cli_writes_json_markdown_and_records(tiny, tmp_path, capsys):
    from fidelity.cli import main
    j, md, out = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "records"
    rc = main(["compare", str(tiny["ref"]), str(tiny["small"]), str(tiny["large"]), "--panel", str(tiny["panel"]),
               "--json", str(j), "--markdown", str(md), "--out", str(out), "--bootstrap", "100", "--no-noise-floor"])
    assert rc == 0
    rep = json.loads(j.read_text())
    assert set(rep["panel"]) >= {"name", "sha256", "rows", "scored_positions"}
    assert set(rep["reference"]) >= {"path", "fingerprint"}
    for r in rep["results"]:
        assert set(r) >= {"pack", "label", "bpw", "overall", "domains"}
        assert set(r["overall"]) >= {
            "kld_mean",
            "kld_mean_ci95",
            "kld_domains_equal",
            "top1",
            "ppl",
            "ppl_ref",
            "kld_median",
            "kld_p99",
            "kld_p999",
            "kld_max",
            "nonfinite",
            "noise_floor_kld",
        }
        for d in r["domains"].values():
            assert set(d) >= {"kld_mean", "kld_mean_ci95", "top1", "ppl", "positions"}
    assert set(rep["paired"][0]) >= {"a", "b", "kld_mean_diff", "ci95", "p_value"}
    assert rep["command_line"].startswith("fidelity compare ") and str(tiny["small"]) in rep["command_line"]
    assert rep["results"][0]["pack"] == str(Path(tiny["small"]).resolve())
    text = md.read_text()
    assert "| small |" in text and "| small | **domains equal** |" in text
    assert "overall" in capsys.readouterr().out
    import pyarrow.parquet as pq
    recs = pq.read_table(out / "small.parquet").to_pandas()
    assert len(recs) == rep["panel"]["scored_positions"]
    assert recs["kld"].mean() == pytest.approx(rep["results"][0]["overall"]["kld_mean"], rel=1e-12)


def test_panel_build_answers_are_the_oracles_greedy_tokens(tiny, tmp_path):
    """Each answer equals a token-by-token greedy decode through the oracle (no transformers draft involved)."""
    from fidelity.commands.panel import build_panel
    from fidelity.oracle import Oracle
    from fidelity.packs import open_pack
    from fidelity.panels.panel import load_panel
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "p1", "domain": "chat", "prompt": "Say something about rivers."})
        + "\n"
        + json.dumps({"id": "p2", "domain": "math", "messages": [{"role": "user", "content": "2+2?"}]})
        + "\n"
    )
    panel = build_panel(prompts, tiny["ref"], tmp_path / "built", max_new_tokens=6, progress=False)
    assert load_panel(tmp_path / "built").sha256 == panel.sha256
    tok = tiny["tokenizer"]
    oracle = Oracle(open_pack(tiny["ref"]), keep_weights=True)
    stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    for row in panel.rows:
        ids = tok(tok.apply_chat_template(row.messages[:-1], add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        new, stopped = [], False
        while len(new) < 6:
            nxt = int(oracle.logits(torch.tensor([ids + new]))[0, -1].argmax())
            if nxt in stop:
                stopped = True
                break
            new.append(nxt)
        want = {"role": "assistant", "content": tok.decode(new, skip_special_tokens=True).strip()}
        assert row.messages[-1] == (want if stopped else {**want, "truncated": True})
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "b1", "domain": "x", "messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    from fidelity.panels.panel import PanelError

    with pytest.raises(
        PanelError, match=r"bad\.jsonl line 1 \(row 'b1'\): needs a string 'prompt' or 'messages' ending"
    ):
        build_panel(bad, tiny["ref"], tmp_path / "nope", progress=False)


def test_noise_floor_perturbation_is_seeded_and_small(tiny):
    from fidelity.measuring.noise_floor import NOISE_REL, perturbed_oracle
    from fidelity.oracle import Oracle
    from fidelity.packs import open_pack
    pack = open_pack(tiny["ref"])
    rows = [[1, 50, 900, 7, 3000], [5, 6]]
    exact = Oracle(pack).hidden_states(rows, progress=False)
    zero = perturbed_oracle(pack, rel=0.0).hidden_states(rows, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(exact, zero))
    one = perturbed_oracle(pack, seed=3).hidden_states(rows, progress=False)
    again = perturbed_oracle(pack, seed=3).hidden_states(rows, progress=False)
    other = perturbed_oracle(pack, seed=4).hidden_states(rows, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(one, again))
    assert not torch.equal(one[0], other[0])
    rel = max(float(((a - b).norm() / a.norm())) for a, b in zip(exact, one))
    assert NOISE_REL / 100 < rel < NOISE_REL * 10
