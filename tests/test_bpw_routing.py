"""Bits per weight per decoded token weighted by measured expert routing (fidelity.measuring.routing) against HF's own
router, and configs nested under `text_config` read like flat ones."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from fidelity import open_pack
from fidelity.oracle import Oracle, OracleTaps
from fidelity.measuring.routing import RoutingCounts
from test_oracle import COMMON, MOE, MOE_COMMON
from test_oracle_support import build

BF16_EXPERTS = {0, 3, 5}     # stored at 16 bits, the other experts at 32: a token's bits depend on where it routes


def skewed_moe(folder: Path, seed: int, vocab: int = COMMON["vocab_size"]):
    """A tiny Qwen3Moe (8 experts, top-2, every layer MoE) whose experts in BF16_EXPERTS are stored as bf16 (the model
    in memory holds the same bf16-rounded values, so HF and the pack compute the same thing)."""
    extra = {**MOE["qwen3moe-renorm-sparse-step"][2], "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [],
             "vocab_size": vocab}
    model = build(T.Qwen3MoeConfig(**{**MOE_COMMON, **extra}), T.Qwen3MoeForCausalLM, folder, seed)
    weights = load_file(str(folder / "model.safetensors"))
    params = dict(model.named_parameters())
    for name in list(weights):
        if ".experts." in name and int(name.split(".experts.")[1].split(".")[0]) in BF16_EXPERTS:
            weights[name] = weights[name].to(torch.bfloat16)
            with torch.no_grad():
                p = params.get(name)
                if p is not None:
                    p.copy_(weights[name].float())
    # transformers 5 holds each layer's experts fused ([experts, ...] gate_up_proj / down_proj), not under the stored
    # per-expert names: round those experts' slices the same way (elementwise, so their layout does not matter); left
    # in float32 they made HF and the pack differ by bf16 rounding and flip routings decided by 2e-3 (seed 1486810694)
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and p.dim() == 3:
                for e in BF16_EXPERTS:
                    p[e].copy_(p[e].to(torch.bfloat16).float())
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return model


def hf_expert_counts(model, tokens: torch.Tensor, k: int) -> list[np.ndarray]:
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False, output_router_logits=True).router_logits
    return [np.bincount(l.topk(k, dim=-1).indices.flatten().numpy(), minlength=l.shape[-1]) for l in logits]


def router_margin(model, tokens: torch.Tensor, k: int) -> float:
    """The smallest gap, over layers and tokens, between HF's k-th and (k+1)-th router logits."""
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False, output_router_logits=True).router_logits
    return min(float((s[:, k - 1] - s[:, k]).min()) for s in (l.sort(dim=-1, descending=True).values for l in logits))


# Two forwards that agree to ~1e-6 (the oracle and HF in float32, summing in other orders) may route a token whose
# k-th and (k+1)-th router logits lie closer than that either way; both are right. Count tests draw tokens whose
# routing is decided by more than this.
ROUTER_TIE = 1e-4


def well_routed_tokens(models, shape, k: int, vocab: int, generator=None, tries: int = 50) -> torch.Tensor:
    """Random tokens of `shape` on which every model's top-k routing has a margin >= ROUTER_TIE (redrawn until then)."""
    for attempt in range(tries):
        tokens = torch.randint(0, vocab, shape, generator=generator)
        margins = [router_margin(m, tokens, k) for m in models]
        if min(margins) >= ROUTER_TIE:
            if attempt:
                print(f"tokens redrawn {attempt} times for a router margin >= {ROUTER_TIE}")
            return tokens
    raise AssertionError(f"no draw of {shape} tokens in {tries} with every router margin >= {ROUTER_TIE}")


def expected_per_token_bpw(pack, share: dict[str, float] | None, exclude_head: bool = False) -> float:
    """Written out from the storage table: dense projections and the head once per token, expert tensors times the
    share of tokens that read them (k / n when `share` is None)."""
    k_over_n = pack.config["num_experts_per_tok"] / 8
    bits = params = 0.0
    for name in pack.names():
        s = pack.storage(name)
        if name.endswith("norm.weight") or "embed_tokens" in name or name.endswith("mlp.gate.weight"):
            continue
        if exclude_head and name == "lm_head.weight":
            continue
        w = (share[name] if share is not None else k_over_n) if ".experts." in name else 1.0
        bits, params = bits + w * 8 * s.nbytes, params + w * s.numel
    return bits / params


def test_measured_routing_weights_the_experts_as_hf_routes(tmp_path, rng_seed):
    model = skewed_moe(tmp_path / "m", rng_seed)
    pack = open_pack(tmp_path / "m")
    tokens = well_routed_tokens([model], (3, 19), 2, COMMON["vocab_size"])
    counts = RoutingCounts()
    oracle = Oracle(pack)
    with oracle.tapped(OracleTaps(routing_counts=counts)):
        oracle.logits(tokens)
    hf = hf_expert_counts(model, tokens, 2)
    ours = list(counts.layers.values())
    assert len(ours) == len(hf) == COMMON["num_hidden_layers"]
    for layer, (entry, want) in enumerate(zip(ours, hf)):
        assert entry["tokens"] == tokens.numel()
        assert entry["counts"].tolist() == want.tolist(), f"layer {layer}"
        assert entry["modules"][0][0] == f"model.layers.{layer}.mlp.experts.0.gate_proj"
    share = {}
    for layer, want in enumerate(hf):
        for e, c in enumerate(want):
            for w in ("gate_proj", "up_proj", "down_proj"):
                share[f"model.layers.{layer}.mlp.experts.{e}.{w}.weight"] = c / tokens.numel()
    assert counts.fractions() == pytest.approx(share, rel=1e-15)
    rep = pack.bits_per_weight(routing=counts.fractions())
    measured, k_over_n = expected_per_token_bpw(pack, share), expected_per_token_bpw(pack, None)
    print(f"per decoded token: k/n {k_over_n:.4f} bpw, measured routing {measured:.4f} bpw")
    assert rep["per_decoded_token"]["bpw"] == pytest.approx(k_over_n, rel=1e-12)
    assert rep["per_decoded_token_measured"]["bpw"] == pytest.approx(measured, rel=1e-12)
    assert rep["per_decoded_token_measured_excluding_head"]["bpw"] == pytest.approx(
        expected_per_token_bpw(pack, share, exclude_head=True), rel=1e-12)
    assert rep["per_decoded_token_excluding_head"]["bpw"] == pytest.approx(
        expected_per_token_bpw(pack, None, exclude_head=True), rel=1e-12)
    # routed experts alone: the bf16 experts' share of the routed tokens decides it
    bf16_share = sum(c for want in hf for e, c in enumerate(want) if e in BF16_EXPERTS) / sum(w.sum() for w in hf)
    assert rep["routed_experts_per_decoded_token_measured"]["bpw"] == pytest.approx(32 - 16 * bf16_share, rel=1e-12)
    assert rep["routed_experts_per_decoded_token"]["bpw"] == pytest.approx(32 - 16 * len(BF16_EXPERTS) / 8, rel=1e-12)
    assert rep["per_decoded_token_measured"]["unmeasured_params"] == 0
    assert abs(rep["per_decoded_token_measured"]["bpw"] - rep["per_decoded_token"]["bpw"]) > 1e-6   # skewed routing
    # the counts survive the JSON a resumed compare reads back
    again = RoutingCounts.from_json(json.loads(json.dumps(counts.to_json())))
    assert again.fractions() == counts.fractions()


def test_text_config_reads_like_the_flat_config(tmp_path, rng_seed):
    skewed_moe(tmp_path / "m", rng_seed)
    flat = open_pack(tmp_path / "m")
    nested = open_pack(tmp_path / "m")
    cfg = dict(flat.config)
    keep = {k: cfg.pop(k) for k in ("architectures", "model_type") if k in cfg}
    nested.config = {**keep, "text_config": cfg}          # the released V4.1 layout: the language model nested
    assert "num_experts_per_tok" not in nested.config
    share = {n: 0.1 + 0.5 * (hash(n) % 7) / 7 for n in flat.names() if ".experts." in n}
    for routing in (None, share):
        assert nested.bits_per_weight(routing=routing).rows == flat.bits_per_weight(routing=routing).rows
    rows = nested.bits_per_weight().rows
    assert rows["routed_experts_per_decoded_token"]["params"] == pytest.approx(rows["routed_experts"]["params"] * 2 / 8)
    nested.config["text_config"]["tie_word_embeddings"] = True     # read from text_config too
    del nested._entries["lm_head.weight"]
    flat.config["tie_word_embeddings"] = True
    del flat._entries["lm_head.weight"]
    assert nested.bits_per_weight().rows == flat.bits_per_weight().rows
    assert "head" in flat.bits_per_weight().rows


@pytest.mark.slow
def test_compare_reports_measured_routing_bpw(tmp_path, smollm2_gguf, rng_seed):
    """compare counts each pack's routing on the panel and reports the measured per-token bpw next to k / n; HF's
    router on the same tokens gives the same counts."""
    from fidelity.measuring.compare import compare
    from fidelity.packs.tokenizer import load_tokenizer
    from fidelity.panels.panel import PanelRow, write_panel

    tok = load_tokenizer(open_pack(smollm2_gguf))
    model = skewed_moe(tmp_path / "ref", rng_seed, vocab=49152)
    tok.save_pretrained(str(tmp_path / "ref"))
    panel = write_panel(tmp_path / "panel", [PanelRow("a", "text", text="Experts route tokens to a few of many MLPs."),
                                             PanelRow("b", "code", text="for i in range(3):\n    print(i)\n")],
                        name="moe-bpw").path
    res = compare(tmp_path / "ref", [tmp_path / "ref"], panel=panel, noise_floor=False, n_boot=50, progress=False,
                  resume=tmp_path / "passes")
    hf = [sum(c) for c in zip(*(hf_expert_counts(model, torch.tensor([r.tokens]), 2) for r in res.rows))]
    tokens = sum(len(r.tokens) for r in res.rows)
    share = {
        f"model.layers.{layer}.mlp.experts.{e}.{w}.weight": c / tokens
        for layer, want in enumerate(hf)
        for e, c in enumerate(want)
        for w in ("gate_proj", "up_proj", "down_proj")
    }
    pack = open_pack(tmp_path / "ref")
    bits = res.report["results"][0]["bits_per_weight"]
    assert bits["per_decoded_token_measured"]["bpw"] == pytest.approx(expected_per_token_bpw(pack, share), rel=1e-12)
    assert bits["per_decoded_token"]["bpw"] == pytest.approx(expected_per_token_bpw(pack, None), rel=1e-12)
    again = compare(tmp_path / "ref", [tmp_path / "ref"], panel=panel, noise_floor=False, n_boot=50, progress=False,
                    resume=tmp_path / "passes")
    assert any(r.startswith("pack-") for r in again.report["resumed"])
    assert again.report["results"][0]["bits_per_weight"] == bits          # the counts were kept with the pass
