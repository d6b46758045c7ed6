"""DeepSeek-V4.1 oracle (fidelity/oracle/deepseek/v41.py) against formulations written here, on tiny random packs:
every layer's attention output recomputed query by query (pools recomputed from the owning layer's input, index scores
and top-k by Python loops, the candidate-block filter from sorted block maxima), the Engram-wired layer against a naive
per-position lookup, FP8 Engram rows against a float8 cast x scale, and a V4.1 config whose every compressing layer
owns its pool reducing exactly to the V4 oracle. Bad configs fail naming the layer."""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from fidelity import open_pack
from fidelity.errors import ConfigError, PackError
from fidelity.oracle import Oracle, family_for
from fidelity.oracle.deepseek import v41
from fidelity.oracle.deepseek.v4 import DeepseekV4Family
from fidelity.packs.safetensors_io import write_safetensors

H, HC, HEADS, D, RD, Q, G, R, E, I, IH, ID, VOCAB = 32, 2, 2, 16, 4, 16, 2, 8, 4, 32, 2, 8, 64
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
TOKENS = ["<pad>", "<s>"] + LETTERS + [c.upper() for c in LETTERS] + [str(d) for d in range(10)]


def base_config(**over) -> dict:
    cfg = dict(architectures=["DeepseekV41ForCausalLM"], vocab_size=VOCAB, hidden_size=H, num_hidden_layers=5,
               num_attention_heads=HEADS, num_key_value_heads=1, head_dim=D, qk_rope_head_dim=RD, q_lora_rank=Q,
               o_groups=G, o_lora_rank=R, sliding_window=4, index_n_heads=IH, index_head_dim=ID, index_topk=3,
               hc_mult=HC, hc_sinkhorn_iters=4, hc_eps=1e-6, n_routed_experts=E, num_experts_per_tok=2,
               n_shared_experts=1, moe_intermediate_size=I, routed_scaling_factor=1.5, swiglu_limit=10.0,
               scoring_func="sqrtsoftplus", rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
               max_position_embeddings=256, tie_word_embeddings=False,
               compress_ratios=[0, 2, 2, 1, 1], kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 4],
               candidate_source_layer_id=3, candidate_topk_blocks=2, candidate_block_size=3,
               engram_layer_ids=[0], engram_vocab_size=40, engram_max_ngram_size=3, engram_n_heads=2,
               engram_head_dim=8, engram_pad_token_id=0, engram_compressed_vocab_size=38)
    cfg.update(over)
    if cfg.get("engram_layer_ids"):
        from testkit.minipacks_v41 import engram_rows
        cfg["engram_num_embeddings"] = engram_rows(cfg)
    return cfg


def shape_of(name: str, cfg: dict) -> tuple:
    """The shape of an official-named tensor of the tiny configs here."""
    layer = int(name.split(".")[1]) if name.startswith("layers.") else None
    sizes = {"embed.weight": (VOCAB, H), "head.weight": (VOCAB, H), "norm.weight": (H,), "hc_head_fn": (HC, HC * H),
             "hc_head_base": (HC,), "hc_head_scale": (1,)}
    if name in sizes:
        return sizes[name]
    tail = name.split(".", 2)[2]
    D, Q, R = cfg["head_dim"], cfg["q_lora_rank"], cfg["o_lora_rank"]
    if tail.startswith("hc_"):
        return {"fn": ((2 + HC) * HC, HC * H), "base": ((2 + HC) * HC,), "scale": (3,)}[tail.rsplit("_", 1)[1]]
    table = {
        "attn_norm.weight": (H,),
        "ffn_norm.weight": (H,),
        "attn.wq_a.weight": (Q, H),
        "attn.q_norm.weight": (Q,),
        "attn.wq_b.weight": (HEADS * D, Q),
        "attn.wkv.weight": (D, H),
        "attn.kv_norm.weight": (D,),
        "attn.wo_a.weight": (G * R, HEADS * D // G),
        "attn.wo_b.weight": (H, G * R),
        "attn.attn_sink": (HEADS,),
        "attn.compressor.wkv.weight": (D, H),
        "attn.compressor.wgate.weight": (D, H),
        "attn.compressor.norm.weight": (D,),
        "attn.compressor.ape": (cfg["compress_ratios"][layer or 0], D),
        "attn.indexer.wk.weight": (ID, D),
        "attn.indexer.k_norm.weight": (ID,),
        "attn.indexer.wq_b.weight": (IH * ID, Q),
        "attn.indexer.weights_proj.weight": (IH, H),
        "ffn.gate.weight": (E, H),
        "ffn.gate.bias": (E,),
        "engram.wkv.weight": (
            (HC + 1) * H,
            (cfg.get("engram_max_ngram_size", 3) - 1) * cfg.get("engram_n_heads", 2) * cfg.get("engram_head_dim", 8),
        ),
        "engram.k_weight": (HC * H,),
        "engram.q_weight": (HC * H,),
    }
    if tail in table:
        return table[tail]
    if ".experts." in tail or ".shared_experts." in tail:
        return (H, I) if tail.endswith("w2.weight") else (I, H)
    raise KeyError(name)


def random_tensor(name: str, shape: tuple, g: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=g)
    if "norm" in name or name.endswith(("k_weight", "q_weight")):
        return 1.0 + 0.2 * noise
    if name.endswith("scale"):
        return 1.0 + 0.5 * noise
    if len(shape) == 1:
        return 0.1 * noise
    if name == "embed.weight" or ".engram.embed." in name:
        return noise
    return noise / math.sqrt(shape[-1])


def tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOKENS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def write_pack(root: Path, cfg: dict, seed: int, extra_names=(), dtype=torch.float32, tables: bool = True) -> Path:
    """A random pack for cfg in official names (plus extra_names), engram tables (unless not `tables`) in their own
    file."""
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    fam = family_for(cfg)
    names = list(dict.fromkeys([*fam.official_names(), *extra_names]))
    if isinstance(fam, v41.DeepseekV41Family):
        names = [n for n in names if not n.startswith("hc_head_") or n in extra_names]
        names = [n for n in names if not n.endswith(".compressor.ape") or n in extra_names]
    main, engram = {}, {}
    for name in names:
        main[name] = random_tensor(name, shape_of(name, cfg), g).to(dtype)
    for layer, rows in zip(cfg.get("engram_layer_ids") or [] if tables else [], cfg.get("engram_num_embeddings") or []):
        engram[f"layers.{layer}.engram.embed.weight"] = torch.randn(rows, cfg["engram_head_dim"], generator=g).to(dtype)
    write_safetensors(root / "model.safetensors", main)
    if engram:
        write_safetensors(root / "model-engram.safetensors", engram)
    (root / "config.json").write_text(json.dumps(cfg))
    tokenizer_json(root / "tokenizer.json")
    return root


def random_tokens(g: torch.Generator, B: int, T: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=g)


# ---------------------------------------------------------------------------------------------------------------------
# formulations written here
# ---------------------------------------------------------------------------------------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def rotate(x: torch.Tensor, pos: float, theta: float) -> torch.Tensor:
    """Rotates the trailing RD dims of a vector in adjacent pairs by pos * theta^(-2i/RD), as complex numbers."""
    inv = theta ** (-(torch.arange(0, RD, 2, dtype=torch.float64) / RD))
    tail = x[-RD:].double()
    z = torch.complex(tail[0::2], tail[1::2]) * torch.polar(torch.ones_like(inv), pos * inv)
    out = x.clone()
    out[-RD:] = torch.stack((z.real, z.imag), dim=-1).flatten().to(x.dtype)
    return out


def naive_pool(w: dict, p: str, x: torch.Tensor, ratio: int, theta: float):
    """(entries, index keys or None) of layer p's compressor from its attention input x [T, H]."""
    entries, keys = [], []
    for win in range(x.shape[0] // ratio):
        rows = x[win * ratio:(win + 1) * ratio]
        kv = rows @ w[f"{p}.compressor.wkv.weight"].T
        if ratio > 1:
            gate = rows @ w[f"{p}.compressor.wgate.weight"].T
            if f"{p}.compressor.ape" in w:
                gate = gate + w[f"{p}.compressor.ape"]
            kv = kv * torch.softmax(gate, dim=0)
        latent = rms(kv.sum(0), w[f"{p}.compressor.norm.weight"])
        entries.append(rotate(latent, win * ratio, theta))
        if f"{p}.indexer.wk.weight" in w:
            keys.append(
                rotate(rms(w[f"{p}.indexer.wk.weight"] @ latent, w[f"{p}.indexer.k_norm.weight"]), win * ratio, theta)
            )
    return torch.stack(entries), (torch.stack(keys) if keys else None)


def naive_index_scores(w: dict, p: str, x: torch.Tensor, keys: torch.Tensor, ratio: int, theta: float) -> list[list]:
    """scores[t][e] for finished entries e of every query t (python floats)."""
    out = []
    for t in range(x.shape[0]):
        q_latent = rms(x[t] @ w[f"{p}.wq_a.weight"].T, w[f"{p}.q_norm.weight"])
        q = (w[f"{p}.indexer.wq_b.weight"] @ q_latent).view(IH, ID)
        q = torch.stack([rotate(q[h], t, theta) for h in range(IH)])
        head_w = (w[f"{p}.indexer.weights_proj.weight"] @ x[t]) * IH ** -0.5
        row = []
        for e in range((t + 1) // ratio):
            row.append(sum(float(head_w[h]) * max(float(q[h] @ keys[e]), 0.0) * ID ** -0.5 for h in range(IH)))
        out.append(row)
    return out


def block_best(row: list, block: int, n_blocks: int) -> list[float]:
    return [max(row[b * block:(b + 1) * block], default=-math.inf) for b in range(n_blocks)]


def check_candidates(drop: torch.Tensor, scores: list[list], ratio: int, block: int, keep: int, W: int) -> list[set]:
    """The oracle's dropped-block mask [T, blocks] is a valid candidate choice for these scores (ties at equal block
    maxima may go either way): the query's newest block kept, `keep` blocks at most, none with no finished entry,
    and no dropped block better than a kept one. Returns, per query, the entries inside its kept blocks."""
    n_blocks = W // block + 1
    assert drop.shape[-1] == n_blocks
    allowed = []
    for t, row in enumerate(scores):
        best = block_best(row, block, n_blocks)
        newest = max((t + 1) // ratio - 1, 0) // block
        kept = {b for b in range(n_blocks) if not bool(drop[t, b])}
        eligible = {b for b in range(n_blocks) if best[b] > -math.inf} | {newest}
        assert newest in kept and kept <= eligible and len(kept) == min(keep, len(eligible)), t
        others = kept - {newest}
        dropped = [best[b] for b in eligible - kept]
        if others and dropped:
            assert min(best[b] for b in others) >= max(dropped) - 1e-5, t
        allowed.append({e for b in kept for e in range(b * block, min((b + 1) * block, W))})
    return allowed


def check_topk(got: list[set], scores: list[list], k: int, allowed: list[set] | None = None) -> None:
    """Each query's chosen entries are a top-k of its finished (and allowed) entries' scores (ties either way)."""
    for t, row in enumerate(scores):
        cand = {e for e in range(len(row)) if allowed is None or e in allowed[t]}
        assert got[t] <= cand and len(got[t]) == min(k, len(cand)), t
        rest = cand - got[t]
        if got[t] and rest:
            assert min(row[e] for e in got[t]) >= max(row[e] for e in rest) - 1e-5, t


def selection_sets(mask: torch.Tensor) -> list[set]:
    return [set(torch.nonzero(mask[t]).flatten().tolist()) for t in range(mask.shape[0])]


def naive_attention(w: dict, p: str, x: torch.Tensor, ratio: int, window: int, theta: float,
                    entries: torch.Tensor | None, visible: list[set] | None) -> torch.Tensor:
    """One layer's attention, query by query, over the window's shared K=V rows and the visible pool entries."""
    T = x.shape[0]
    kv = torch.stack([rotate(rms(w[f"{p}.wkv.weight"] @ x[j], w[f"{p}.kv_norm.weight"]), j, theta) for j in range(T)])
    out = torch.zeros(T, H)
    for t in range(T):
        q_latent = rms(x[t] @ w[f"{p}.wq_a.weight"].T, w[f"{p}.q_norm.weight"])
        q = (w[f"{p}.wq_b.weight"] @ q_latent).view(HEADS, D)
        rows = [kv[j] for j in range(max(0, t - window + 1), t + 1)]
        if entries is not None:
            rows += [entries[e] for e in sorted(visible[t])]
        keys = torch.stack(rows)
        heads = []
        for h in range(HEADS):
            qh = rotate(q[h], t, theta)
            logits = torch.cat((keys @ qh * D ** -0.5, w[f"{p}.attn_sink"][h:h + 1]))
            probs = torch.softmax(logits, dim=0)[:-1]
            heads.append(rotate(probs @ keys, -t, theta))
        flat = torch.cat(heads).view(G, -1)
        wo_a = w[f"{p}.wo_a.weight"].view(G, R, -1)
        out[t] = w[f"{p}.wo_b.weight"] @ torch.cat([wo_a[g] @ flat[g] for g in range(G)])
    return out


def capture_attention(monkeypatch) -> list:
    """Records (layer, attention input [B, T, H], output, state) of every V4.1 attention call."""
    calls = []
    original = v41.Attention.__call__

    def record(self, x, rope, state):
        y = original(self, x, rope, state)
        calls.append(
            (self.layer, x.clone(), y.clone(), state, None if state.selection is None else state.selection.clone())
        )
        return y

    monkeypatch.setattr(v41.Attention, "__call__", record)
    return calls


# ---------------------------------------------------------------------------------------------------------------------
# attention parts
# ---------------------------------------------------------------------------------------------------------------------
def test_every_attention_layer_matches_query_by_query_formulation(tmp_path, rng_seed, monkeypatch):
    """Pools recomputed from the owner's input (ratio 2 gated with ape, ratio 1 gateless), index keys on owners, the
    shared selection of a non-index layer, the candidate filter of layer 3 applied in layer 4: every layer's attention
    output equals a query-by-query loop, and layer 2 attends with layer 1's selection."""
    cfg = base_config(engram_layer_ids=[])
    root = write_pack(tmp_path / "p", cfg, rng_seed, extra_names=["layers.1.attn.compressor.ape"])
    pack = open_pack(root)
    w = {n: pack.tensor(n).float() for n in pack.names()}
    calls = capture_attention(monkeypatch)
    g = torch.Generator().manual_seed(rng_seed)
    tokens = random_tokens(g, 1, 24)
    Oracle(pack).logits(tokens)
    theta_main, theta_c = cfg["rope_theta"], cfg["compress_rope_theta"]
    inputs = {layer: x[0] for layer, x, *_ in calls}
    pools = {1: naive_pool(w, "layers.1.attn", inputs[1], 2, theta_c),
             3: naive_pool(w, "layers.3.attn", inputs[3], 1, theta_c)}
    allowed = last = None
    worst = 0.0
    for layer, x, y, state, used_selection in calls:
        p, ratio = f"layers.{layer}.attn", cfg["compress_ratios"][layer]
        entries = visible = None
        if ratio:
            owner = max(s for s in cfg["kv_source_layer_ids"] if s <= layer)
            entries, keys = pools[owner]
            W = entries.shape[0]
            got = state.pools[owner].entries[0]
            assert (got - entries).abs().max() < 1e-5, f"layer {layer}: pool of layer {owner}"
            chosen = selection_sets(used_selection[0])
            if layer in cfg["index_source_layer_ids"]:
                scores = naive_index_scores(w, p, x[0], keys, ratio, theta_c)
                if layer == 3:
                    allowed = check_candidates(state.candidates[0], scores, ratio, 3, 2, W)
                check_topk(chosen, scores, cfg["index_topk"], allowed if layer > 3 else None)
                last = chosen
            assert chosen == last, f"layer {layer}: reuses the last index source's choice"
            visible = chosen
        want = naive_attention(
            w, p, x[0], ratio, cfg["sliding_window"], theta_c if ratio else theta_main, entries, visible
        )
        delta = (y[0] - want).abs().max().item()
        worst = max(worst, delta)
        assert delta < 1e-4, f"layer {layer}: attention output off by {delta:.3g}"
    print(f"V4.1 attention vs query-by-query loop: max |d| {worst:.3g} over {len(calls)} layers")
    assert [c[0] for c in calls] == [0, 1, 2, 3, 4]
    # layer 2 is no index source: it attends with exactly layer 1's choice
    assert torch.equal(calls[2][4], calls[1][4])


def test_candidate_filter_changes_the_selection(tmp_path, rng_seed, monkeypatch):
    """Layer 4's choice with the candidate filter differs from its unfiltered top-k somewhere (so the test above tests
    a filter that acts), and every chosen entry lies in a kept block."""
    cfg = base_config(engram_layer_ids=[])
    pack = open_pack(write_pack(tmp_path / "p", cfg, rng_seed))
    w = {n: pack.tensor(n).float() for n in pack.names()}
    calls = capture_attention(monkeypatch)
    tokens = random_tokens(torch.Generator().manual_seed(rng_seed + 1), 1, 36)
    Oracle(pack).logits(tokens)
    x3, x4 = calls[3][1][0], calls[4][1][0]
    theta = cfg["compress_rope_theta"]
    _, keys = naive_pool(w, "layers.3.attn", x3, 1, theta)
    allowed = check_candidates(calls[3][3].candidates[0], naive_index_scores(w, "layers.3.attn", x3, keys, 1, theta),
                               1, 3, 2, 36)
    scores4 = naive_index_scores(w, "layers.4.attn", x4, keys, 1, theta)
    got = selection_sets(calls[4][4][0])
    check_topk(got, scores4, 3, allowed)
    unfiltered = [set(sorted(range(len(row)), key=lambda e: -row[e])[:3]) for row in scores4]
    assert got != unfiltered
    assert all(s <= a for s, a in zip(got, allowed))
    assert all(len(a) <= 6 for a in allowed) and any(len(r) > 6 for r in scores4)   # 2 blocks of 3 of more


def test_self_owned_pools_reduce_to_v4(tmp_path, rng_seed):
    """Every compressing layer its own KV source (and index source, with index_topk above the pool size), q head norm
    and same-site mHC switched to V4's: logits equal the V4 oracle's on the same tensors. With V4.1's own numerics
    (no q head norm, carried pre) they differ."""
    common = dict(compress_ratios=[0, 2, 3], num_hidden_layers=3, num_hash_layers=0, engram_layer_ids=[])
    v4cfg = {**base_config(**common), "architectures": ["DeepseekV4ForCausalLM"], "index_topk": 1000}
    v41cfg = base_config(**common, kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2], index_topk=1000,
                         candidate_source_layer_id=-1)
    v4_names = DeepseekV4Family(v4cfg).official_names()
    root4 = write_pack(tmp_path / "v4", v4cfg, rng_seed, extra_names=v41.DeepseekV41Family(v41cfg).official_names())
    root41 = tmp_path / "v41"
    shutil.copytree(root4, root41)
    (root41 / "config.json").write_text(json.dumps(v41cfg))
    assert {n for n in v4_names if ".compressor.ape" in n} == {
        "layers.1.attn.compressor.ape",
        "layers.2.attn.compressor.ape",
    }
    tokens = random_tokens(torch.Generator().manual_seed(rng_seed), 2, 30)
    want = Oracle(open_pack(root4)).logits(tokens)
    oracle = Oracle(open_pack(root41))
    own = oracle.logits(tokens)
    oracle.family.v41.q_head_norm, oracle.family.v41.carry_pre = True, False
    oracle.release()
    got = oracle.logits(tokens)
    delta = (got - want).abs().max().item()
    print(f"V4.1 (self-owned pools, V4 numerics) vs V4: max |dlogit| {delta:.3g}; V4.1 numerics: "
          f"{(own - want).abs().max().item():.3g}")
    assert delta <= 1e-6
    assert (own - want).abs().max() > 1e-2


def test_rows_batched_together_equal_rows_alone(tmp_path, rng_seed):
    """Rows of two lengths (two batches, each with its own pools, selections and carried pre) give the same final
    hidden states as each row alone."""
    oracle = Oracle(open_pack(write_pack(tmp_path / "p", base_config(), rng_seed)))
    g = torch.Generator().manual_seed(rng_seed)
    rows = [random_tokens(g, 1, n)[0].tolist() for n in (20, 13, 20)]
    together = oracle.hidden_states(rows, progress=False)
    for row, got in zip(rows, together):
        alone = oracle.hidden_states([row], progress=False)[0]
        assert (got - alone).abs().max() < 1e-5
    again = oracle.hidden_states(rows, progress=False)          # a new pass starts from a new state
    assert all(torch.equal(a, b) for a, b in zip(together, again))


def test_attribution_reruns_from_any_layer_with_that_layers_pass_state(tmp_path, rng_seed):
    """fidelity.measuring.attribute re-runs a variant from a layer's kept input with the state the reference pass handed
    that layer (pools of earlier layers, the last selection and candidate blocks, the carried pre): with every layer the
    reference's, a re-run from any layer (or from the final hidden states) gives the reference's logits bit for bit."""
    from fidelity.measuring.attribute_trunk import Trunk
    oracle = Oracle(open_pack(write_pack(tmp_path / "p", base_config(), rng_seed)))
    g = torch.Generator().manual_seed(rng_seed)
    rows = [random_tokens(g, 1, n)[0].tolist() for n in (20, 13, 20)]
    trunk = Trunk(oracle, rows, [torch.arange(len(r) - 1) for r in rows], keep_layers=True)
    trunk.reference_pass()
    for start in range(-1, oracle.family.n_layers + 1):
        got = trunk.run(start)
        assert all(torch.equal(a, b) for a, b in zip(got, trunk.ref_logits)), f"re-run from layer {start}"


RELEASED_V41 = dict(    # DeepSeek-V4.1-Flash's text_config, as the checkpoint's notes quote it
    architectures=["DeepseekV41ForCausalLM"], num_hidden_layers=40, vocab_size=129280, hidden_size=5120,
    num_attention_heads=64, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_groups=8,
    o_lora_rank=1024, sliding_window=128, index_n_heads=32, index_head_dim=128, index_topk=512,
    compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [1] * 3, kv_source_layer_ids=[2, 8, 14, 20],
    index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], candidate_source_layer_id=20, candidate_topk_blocks=2048,
    candidate_block_size=8, hc_mult=4, hc_sinkhorn_iters=20, n_routed_experts=384, num_experts_per_tok=6,
    n_shared_experts=1, moe_intermediate_size=2304, rms_norm_eps=1e-20, engram_layer_ids=[1, 14],
    engram_num_embeddings=[384006168, 384016682], engram_vocab_size=16000000, engram_max_ngram_size=4,
    engram_n_heads=8, engram_head_dim=256, engram_pad_token_id=2, engram_compressed_vocab_size=99092)


def test_released_v41_config_gives_the_checkpoints_tensor_counts():
    """The release's config, nested under text_config, yields what its index holds: 4 compressors (3 with a gate:
    the decoder's ratio-1 pool has none), 8 indexers of which the 4 pool owners hold index keys, 2 Engram layers whose
    24 prime buckets sum to the stated rows, and the encoder/decoder pool and selection sharing."""
    fam = family_for({"architectures": RELEASED_V41["architectures"], "text_config": RELEASED_V41})
    names = [n for i in range(40) for n in fam.official_layer_names(i)]

    def count(suffix):
        return sum(n.endswith(suffix) for n in names)

    assert (count(".attn.compressor.wkv.weight"), count(".attn.compressor.wgate.weight")) == (4, 3)
    assert (count(".attn.indexer.wq_b.weight"), count(".attn.indexer.wk.weight")) == (8, 4)
    assert count(".engram.wkv.weight") == 2 and count(".ffn.experts.0.w1.weight") == 40
    a = fam.v41
    assert [a.kv_source[i] for i in (0, 2, 7, 8, 19, 20, 39)] == [None, 2, 2, 8, 14, 20, 20]
    assert [a.candidate_mode(i) for i in (14, 20, 21, 24, 25)] == [None, "source", None, "use", None]
    from fidelity.oracle.deepseek.engram import EngramArgs
    assert [sum(EngramArgs.from_config(fam.text, i).head_sizes) for i in (1, 14)] == [384006168, 384016682]
    assert len(EngramArgs.from_config(fam.text, 14).head_sizes) == 24


def fp8_block_ok(block: torch.Tensor) -> bool:
    """An fp8-e4m3 block with a power-of-two scale: some 2^k makes every value / 2^k an e4m3 value with |.| <= 448."""
    amax = block.abs().max().item()
    if amax == 0:
        return True
    s = 2.0 ** math.ceil(math.log2(amax / 448.0))
    return torch.equal((block / s).to(torch.float8_e4m3fn).float() * s, block)


def test_v41_deepseek_numerics_round_where_the_reference_does(tmp_path, rng_seed, monkeypatch):
    """numerics "deepseek" on V4.1: window KV whole-vector fp8 in blocks of 32 with power-of-two scales, pool entries
    whole-vector fp4 (blocks of 16, e4m3 scales), rotary dims included, indexer q/k fp4 (blocks of 32, power-of-two
    scales); a bf16 pack's linears take their inputs unrounded (the reference's linear() rounds only FP8/FP4
    weights)."""
    from fidelity.oracle.deepseek import quant
    cfg = base_config(head_dim=64, q_lora_rank=32, o_lora_rank=16)
    pack = open_pack(write_pack(tmp_path / "p", cfg, rng_seed))
    tokens = random_tokens(torch.Generator().manual_seed(rng_seed), 1, 20)
    exact = Oracle(pack).logits(tokens)
    seen = {"fp8": [], "fp4_e4m3": [], "fp4_pow2": []}
    for key, fn in (("fp8", "fake_fp8"), ("fp4_e4m3", "fake_fp4_e4m3_scales"), ("fp4_pow2", "fake_fp4_pow2_scales")):
        real = getattr(quant, fn)
        monkeypatch.setattr(quant, fn, (lambda key, real: lambda x, block, *a: (
            seen[key].append((block, out := real(x, block, *a))), out)[1])(key, real))
    oracle = Oracle(pack, numerics="deepseek")
    assert (
        "V4.1" in oracle.family.numerics_label
        and "fp8-e4m3/32 (whole post-RoPE vector)" in oracle.family.numerics_label
    )
    calls = capture_attention(monkeypatch)
    rounded = oracle.logits(tokens)
    assert (rounded - exact).abs().max() > 1e-4
    grid = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    pool = calls[1][3].pools[1].entries[0]
    for block in pool.reshape(-1, 16):                       # all 64 dims, rotary ones included
        s = block.abs().max().item() / 6.0
        assert s == torch.tensor(s).to(torch.float8_e4m3fn).float().item()
        assert {abs(v) / s for v in block.tolist()} <= grid
    # fp8 only for the window KV ([.., 64] wide, 5 layers): no linear input of this bf16 pack is rounded
    assert len(seen["fp8"]) == 5 and all(block == 32 and x.shape[-1] == 64 for block, x in seen["fp8"])
    assert all(fp8_block_ok(b) for _, kv in seen["fp8"] for b in kv.reshape(-1, 32))
    assert seen["fp4_e4m3"] and all(block == 16 for block, _ in seen["fp4_e4m3"])
    assert seen["fp4_pow2"] and all(block == 32 for block, _ in seen["fp4_pow2"])
    for _, x in seen["fp4_pow2"]:        # e2m1 values times a power of two per 32 values (or the shorter last block)
        for block in (b for row in x.reshape(-1, x.shape[-1]) for b in row.split(32)):
            amax = block.abs().max().item()
            if amax:
                s = 2.0 ** math.ceil(math.log2(amax / 6.0))
                assert {abs(v) / s for v in block.tolist()} <= grid
def test_a_pool_reader_run_before_its_source_is_named(tmp_path, rng_seed):
    from fidelity.errors import FidelityError
    oracle = Oracle(open_pack(write_pack(tmp_path / "p", base_config(engram_layer_ids=[]), rng_seed)))
    tokens = random_tokens(torch.Generator().manual_seed(rng_seed), 1, 8)
    streams = torch.randn(1, 8, HC, H)
    with pytest.raises(FidelityError, match=r"layer 2 reads the pool of layer 1, which has not run"):
        oracle.load_layer(2)(streams, oracle.family.rope_tables(8, torch.float32, "cpu"), tokens,
                             oracle.family.new_pass_state())


def test_text_config_nesting_and_v41_defaults(rng_seed):
    cfg = base_config()
    nested = {"architectures": cfg["architectures"], "model_type": "deepseek_v41",
              "text_config": {k: v for k, v in cfg.items() if k != "architectures"}}
    fam = family_for(nested)
    assert isinstance(fam, v41.DeepseekV41Family) and fam.n_layers == 5 and fam.hidden_size == H
    a = fam.v41
    assert a.kv_source == [None, 1, 1, 3, 3] and a.index_source == [False, True, False, True, True]
    assert a.base.hash_layers == [False] * 5                   # V4.1 routes no layer by token hash unless told
    assert [a.candidate_mode(i) for i in range(5)] == [None, None, None, "source", "use"]
    assert "layers.3.attn.compressor.wgate.weight" not in fam.official_layer_names(3)   # ratio 1: no gate
    assert "layers.2.attn.compressor.wkv.weight" not in fam.official_layer_names(2)     # reads layer 1's pool
    assert "layers.2.attn.indexer.wq_b.weight" not in fam.official_layer_names(2)       # reuses layer 1's choice
    assert not any(n.startswith("hc_head_") for n in fam.required_names())
    # compress_ratios running on into the drafter's blocks: ids there are the drafter's, not the backbone's
    fam = family_for(base_config(compress_ratios=[0, 2, 2, 1, 1, 1, 1], index_source_layer_ids=[1, 3, 4, 6]))
    assert fam.v41.index_source == [False, True, False, True, True] and fam.v41.base.swiglu_limit == 10.0


def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A site's pre weights [B, T, hc]: sigmoid of the first hc mixes of the RMS-normed flattened streams."""
    flat = rms(streams.flatten(2), None)
    return torch.sigmoid(flat @ fn[:HC].T * scale[0] + base[:HC]) + 1e-6


def test_single_pass_hyper_connections(tmp_path, rng_seed):
    """The first site collapses to stream 0; the FFN site collapses with the attention site's pre (computed from the
    streams entering the layer); the final collapse uses the FFN site's pre (no hc_head tensors)."""
    cfg = base_config(num_hidden_layers=1, compress_ratios=[0], kv_source_layer_ids=[], index_source_layer_ids=[],
                      candidate_source_layer_id=-1, engram_layer_ids=[])
    pack = open_pack(write_pack(tmp_path / "p", cfg, rng_seed))
    w = {n: pack.tensor(n).float() for n in pack.names()}
    oracle = Oracle(pack)
    g = torch.Generator().manual_seed(rng_seed)
    tokens, streams = random_tokens(g, 1, 12), torch.randn(1, 12, HC, H, generator=g)
    layer = oracle.load_layer(0)
    seen = {}
    attn, ffn, ffn_weights = layer.attn, layer.ffn, layer.ffn_hc.weights
    layer.attn = lambda x, rope, state: (seen.setdefault("attn_in", x), attn(x, rope, state))[1]
    layer.ffn = lambda x, tok: (seen.setdefault("ffn_in", x), ffn(x, tok))[1]
    layer.ffn_hc.weights = lambda s: (seen.setdefault("mid", s), ffn_weights(s))[1]
    state = oracle.family.new_pass_state()
    out = layer(streams, oracle.family.rope_tables(12, torch.float32, "cpu"), tokens, state)
    p = "layers.0"
    assert torch.allclose(seen["attn_in"], rms(streams[:, :, 0], w[f"{p}.attn_norm.weight"]), atol=1e-6)
    pre_attn = mhc_pre(streams, w[f"{p}.hc_attn_fn"], w[f"{p}.hc_attn_base"], w[f"{p}.hc_attn_scale"])
    want_ffn_in = rms((pre_attn.unsqueeze(-1) * seen["mid"]).sum(2), w[f"{p}.ffn_norm.weight"])
    assert (seen["ffn_in"] - want_ffn_in).abs().max() < 1e-5
    pre_ffn = mhc_pre(seen["mid"], w[f"{p}.hc_ffn_fn"], w[f"{p}.hc_ffn_base"], w[f"{p}.hc_ffn_scale"])
    final = oracle.family.final_hook(out, oracle.fetch, state)
    assert (final - (pre_ffn.unsqueeze(-1) * out).sum(2)).abs().max() < 1e-5
    assert not (pre_ffn - pre_attn).abs().max() < 1e-3          # the two sites' weights really differ


# ---------------------------------------------------------------------------------------------------------------------
# Engram wired into the forward
# ---------------------------------------------------------------------------------------------------------------------
def naive_engram(streams: torch.Tensor, tokens: list[int], w: dict, cfg: dict, layer: int) -> torch.Tensor:
    """Compressed ids from the tokenizer's lower-casing, n-gram XOR hashes per position, rows from the whole table."""
    from fidelity.oracle.deepseek.engram import head_vocab_sizes, layer_multipliers
    compressed = {}
    ids = [compressed.setdefault(TOKENS[t].lower(), len(compressed)) for t in range(len(TOKENS))]
    pad = ids[cfg["engram_pad_token_id"]]
    ids = [ids[t] for t in tokens]
    sizes = head_vocab_sizes(cfg)[layer]
    mult = layer_multipliers(layer, cfg["engram_max_ngram_size"], cfg["engram_compressed_vocab_size"])
    table = w[f"layers.{layer}.engram.embed.weight"]
    wkv = w[f"layers.{layer}.engram.wkv.weight"]
    kw, qw = w[f"layers.{layer}.engram.k_weight"].view(HC, H), w[f"layers.{layer}.engram.q_weight"].view(HC, H)

    def wrap(v):
        v &= (1 << 64) - 1
        return v - (1 << 64) if v >= 1 << 63 else v

    out = streams.clone()
    for t in range(len(ids)):
        rows, head = [], 0
        for n in range(2, cfg["engram_max_ngram_size"] + 1):
            mixed = 0
            for s in range(n):
                mixed ^= wrap((ids[t - s] if t - s >= 0 else pad) * mult[s])
            for _ in range(cfg["engram_n_heads"]):
                rows.append(table[wrap(mixed) % sizes[head] + sum(sizes[:head])])
                head += 1
        kv = wkv @ torch.cat(rows)
        value = kv[HC * H:]
        for k in range(HC):
            key = rms(kv[k * H:(k + 1) * H], kw[k])
            dot = float(rms(streams[t, k], qw[k]) @ key) / math.sqrt(H)
            out[t, k] += value / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
    return out


def test_engram_layer_is_wired_before_its_block(tmp_path, rng_seed, monkeypatch):
    """Layer 0 with its Engram layer = layer 0 without it, applied to streams a naive per-position lookup produced
    from the compressed token ids (tokenizer.json's case folding) and the whole table."""
    cfg = base_config()
    pack = open_pack(write_pack(tmp_path / "p", cfg, rng_seed))
    w = {n: pack.tensor(n).float() for n in pack.names()}
    oracle = Oracle(pack)
    tokens = random_tokens(torch.Generator().manual_seed(rng_seed), 1, 20)
    streams = torch.randn(1, 20, HC, H, generator=torch.Generator().manual_seed(rng_seed + 7))
    rope = oracle.family.rope_tables(20, torch.float32, "cpu")
    layer = oracle.load_layer(0)
    assert layer.engram is not None and layer.engram.table.rows_read == 0
    got = layer(streams, rope, tokens, oracle.family.new_pass_state())
    assert 0 < layer.engram.table.rows_read <= 20 * 4
    layer.engram = None
    want = layer(naive_engram(streams[0], tokens[0].tolist(), w, cfg, 0)[None], rope, tokens,
                 oracle.family.new_pass_state())
    delta = (got - want).abs().max().item()
    print(f"Engram-wired layer vs naive lookup: max |d| {delta:.3g}")
    assert delta < 1e-5


def test_engram_gate_floors_a_zero_dot_like_the_reference(tmp_path, rng_seed):
    """A stream orthogonal to its key (q_weight 0: dot exactly 0) is gated by sigmoid(sqrt(1e-6)) = sigmoid(1e-3), as
    DeepSeek's reference floors |dot| at 1e-6 before the signed square root, not by sigmoid(0)."""
    from fidelity.oracle.deepseek.engram import EngramArgs, EngramLayer, RowTable
    g = torch.Generator().manual_seed(rng_seed)
    a = EngramArgs(layer=0, ngram_size=2, heads_per_ngram=1, head_sizes=[7], multipliers=[3, 5], pad_id=0, hc_mult=HC,
                   hidden_size=H, eps=1e-6)
    write_safetensors(tmp_path / "t.safetensors", {"table": torch.randn(7, 4, generator=g)})
    wkv = torch.randn((HC + 1) * H, 4, generator=g)
    layer = EngramLayer(
        a, RowTable([(tmp_path / "t.safetensors", "table")]), wkv, torch.ones(HC * H), torch.zeros(HC * H)
    )
    streams, ids = torch.randn(1, 5, HC, H, generator=g), torch.randint(0, 7, (1, 5), generator=g)
    got = layer(streams, ids) - streams
    rows = layer.table.rows(
        torch.remainder(ids * 3 ^ torch.cat((torch.zeros(1, 1, dtype=torch.long), ids[:, :-1]), 1) * 5, 7)
    )
    values = (rows @ wkv.T)[..., HC * H:]
    assert torch.allclose(got, torch.sigmoid(torch.tensor(1e-3)) * values.unsqueeze(-2).expand_as(got), atol=1e-6)
    assert not torch.allclose(got, 0.5 * values.unsqueeze(-2).expand_as(got), atol=1e-6)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc for resident memory")
def test_oracle_with_multi_gb_fp8_engram_table_reads_only_rows_touched(tmp_path, rng_seed):
    """A V4.1 pack whose Engram table is the release's layout at 3.9 GiB (FP8 e4m3 rows of 64, e8m0 scales per 32: a
    sparse file, the rows this forward hashes to written, holes elsewhere): the oracle's resident memory grows by
    megabytes, the table is read row by row, and the rows it read are the written ones dequantized."""
    from fidelity.oracle.deepseek.engram import EngramArgs, ngram_rows
    cfg = base_config(engram_vocab_size=16_000_000, engram_head_dim=64)
    rows, dim = cfg["engram_num_embeddings"][0], 64
    root = write_pack(tmp_path / "p", cfg, rng_seed, tables=False)
    weight, scale = "layers.0.engram.embed.weight", "layers.0.engram.embed.scale"
    header = json.dumps(
        {
            weight: {"dtype": "F8_E4M3", "shape": [rows, dim], "data_offsets": [0, rows * dim]},
            scale: {"dtype": "F8_E8M0", "shape": [rows, 2], "data_offsets": [rows * dim, rows * (dim + 2)]},
        }
    )
    header = header.encode() + b" " * (-len(header) % 8)
    path, start = root / "model-engram.safetensors", 8 + len(header)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(start + rows * (dim + 2))
    assert path.stat().st_size > 3.9 * 2 ** 30
    oracle = Oracle(open_pack(root))
    g = torch.Generator().manual_seed(rng_seed)
    warm, tokens = random_tokens(g, 1, 24), random_tokens(g, 1, 24)
    ids = oracle.family.token_map()[tokens]
    touched = ngram_rows(ids, EngramArgs.from_config(oracle.family.text, 0, oracle.family.token_map())).unique()
    values = (torch.randn(touched.numel(), dim, generator=g) * 30).to(torch.float8_e4m3fn)
    exps = torch.randint(120, 130, (touched.numel(), 2), generator=g).to(torch.uint8)
    with open(path, "r+b") as f:
        for r, v, e in zip(touched.tolist(), values, exps):
            f.seek(start + r * dim)
            f.write(v.view(torch.uint8).numpy().tobytes())
            f.seek(start + rows * dim + r * 2)
            f.write(e.numpy().tobytes())
    first = resident_bytes()
    oracle.logits(warm)                                # loads the small weights, warms allocator and file machinery
    before = resident_bytes()
    logits = oracle.logits(tokens)
    grown, total = resident_bytes() - before, resident_bytes() - first
    table = oracle.family.table(0)
    print(f"Engram table {path.stat().st_size / 2**30:.1f} GiB, rows touched {touched.numel()}, oracle resident "
          f"growth {grown / 2**20:.1f} MiB ({total / 2**20:.1f} MiB over both forwards, weights included)")
    assert torch.isfinite(logits).all() and grown < 64 * 2 ** 20 and total < 512 * 2 ** 20
    scales = torch.tensor([[2.0 ** (int(e) - 127) for e in row for _ in range(32)] for row in exps])
    assert torch.equal(table.rows(touched), values.float() * scales)


def test_engram_without_tokenizer_is_named(tmp_path, rng_seed):
    root = write_pack(tmp_path / "p", base_config(), rng_seed)
    (root / "tokenizer.json").unlink()
    with pytest.raises(PackError, match=r"tokenizer\.json"):
        Oracle(open_pack(root)).logits(torch.zeros(1, 4, dtype=torch.long))


def test_engram_vocabulary_mismatch_is_named(tmp_path, rng_seed):
    root = write_pack(tmp_path / "p", base_config(engram_compressed_vocab_size=50), rng_seed)
    with pytest.raises(PackError, match=r"38 compressed tokens, but engram_compressed_vocab_size is 50"):
        Oracle(open_pack(root)).logits(torch.zeros(1, 4, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------------------------
# FP8 Engram rows
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reads", ["nearby rows in one pread", "one pread per row", "preads of at most 3 rows"])
@pytest.mark.parametrize("scales", ["per-row F32", "block 32x32 e8m0", "row groups of 32 e8m0 (the release)"])
def test_fp8_engram_rows_dequantize_exactly(tmp_path, rng_seed, scales, reads, monkeypatch):
    from fidelity.oracle.deepseek import engram
    from fidelity.oracle.deepseek.engram import RowTable
    if reads == "one pread per row":
        monkeypatch.setattr(engram, "MAX_GAP_BYTES", 1)
    elif reads != "nearby rows in one pread":
        monkeypatch.setattr(engram, "MAX_READ_BYTES", 3 * 64)     # rows of 64 fp8 bytes; scale rows are shorter
    g = torch.Generator().manual_seed(rng_seed)
    rows, dim = 100, 64
    values = (torch.randn(rows, dim, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    if scales == "per-row F32":
        scale = torch.rand(rows, generator=g) + 0.01
        full = scale[:, None].expand(rows, dim)
        stored = scale
        qc = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    elif scales.startswith("block"):
        exps = torch.randint(120, 134, (4, 2), generator=g)
        full = torch.tensor([[2.0 ** (int(exps[r // 32, c // 32]) - 127) for c in range(dim)] for r in range(rows)])
        stored = exps.to(torch.uint8).view(torch.float8_e8m0fnu)
        qc = {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}
    else:           # layers.L.engram.embed.scale F8_E8M0 [rows, 256 / 32] next to F8_E4M3 [rows, 256]
        exps = torch.randint(120, 134, (rows, 2), generator=g)
        full = torch.tensor([[2.0 ** (int(exps[r, c // 32]) - 127) for c in range(dim)] for r in range(rows)])
        stored = exps.to(torch.uint8).view(torch.float8_e8m0fnu)
        qc = {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}
    write_safetensors(tmp_path / "model-engram.safetensors", {"layers.1.engram.embed.weight": values,
                                                              "layers.1.engram.embed.scale": stored})
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], "quantization_config": qc}))
    table = RowTable.from_pack(open_pack(tmp_path), "layers.1.engram.embed")
    index = torch.randint(0, rows, (3, 7), generator=g)
    index[0, :4] = torch.arange(4) + int(index[0, 4]) % (rows - 4)      # a run of adjacent rows too
    want = values.float()[index] * full[index]            # float8 cast x its scale, per element
    got = table.rows(index)
    assert torch.equal(got, want) and table.rows_read == index.unique().numel()


def test_fp8_engram_rows_without_scales_are_named(tmp_path, rng_seed):
    from fidelity.oracle.deepseek.engram import RowTable
    write_safetensors(tmp_path / "t.safetensors",
                      {"layers.1.engram.embed.weight": torch.randn(10, 8).to(torch.float8_e4m3fn)})
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    with pytest.raises(PackError, match=r"no scale tensor") as err:
        RowTable.from_pack(open_pack(tmp_path), "layers.1.engram.embed")
    assert "layers.1.engram.embed.weight" in str(err.value) and "t.safetensors" in str(err.value)


def test_fp8_engram_rows_with_bad_scales_are_named(tmp_path, rng_seed):
    """Scales of an integer dtype are refused at open; a NaN scale is refused when its row is read, naming the file."""
    from fidelity.oracle.deepseek.engram import RowTable
    g = torch.Generator().manual_seed(rng_seed)
    values = torch.randn(10, 8, generator=g).to(torch.float8_e4m3fn)
    write_safetensors(
        tmp_path / "int.safetensors", {"t.weight": values, "t.scale": torch.ones(10, 1, dtype=torch.int32)}
    )
    with pytest.raises(PackError, match=r"scale dtype I32 is not a float or e8m0 type") as err:
        RowTable([(tmp_path / "int.safetensors", "t.weight")], [(tmp_path / "int.safetensors", "t.scale", (1, 8))])
    assert "t.scale" in str(err.value) and "int.safetensors" in str(err.value)
    bad_row = int(torch.randint(0, 10, (1,), generator=g))
    scales = torch.ones(10, 1)
    scales[bad_row] = float("nan")
    write_safetensors(tmp_path / "nan.safetensors", {"t.weight": values, "t.scale": scales})
    table = RowTable([(tmp_path / "nan.safetensors", "t.weight")], [(tmp_path / "nan.safetensors", "t.scale", (1, 8))])
    good = (bad_row + 1) % 10
    assert torch.equal(table.rows(torch.tensor([good])), values.float()[[good]])
    with pytest.raises(PackError, match=r"scales hold NaN or inf") as err:
        table.rows(torch.tensor([bad_row]))
    assert "nan.safetensors" in str(err.value)


# ---------------------------------------------------------------------------------------------------------------------
# bad configs
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("over, message", [
    (dict(kv_source_layer_ids=[1, 7]), r"kv_source_layer_ids names layer 7, outside the model's 5 layers"),
    (dict(kv_source_layer_ids=[3], index_source_layer_ids=[3, 4]),
     r"layer 1 compresses \(ratio 2\) but no kv_source_layer_ids entry is at or before it \(its pool would come "
     r"from layer 3, a later layer\)"),
    (dict(kv_source_layer_ids=[1]), r"layer 3 \(ratio 1\) would read the pool of layer 1, whose ratio is 2"),
    (dict(kv_source_layer_ids=[0, 1, 3]), r"kv_source_layer_ids names layer 0, which compresses nothing"),
    (dict(index_source_layer_ids=[2, 3, 4]), r"layer 2 runs the indexer over the pool of layer 1, which is not in "
                                             r"index_source_layer_ids"),
    (dict(index_source_layer_ids=[1], candidate_source_layer_id=-1),
     r"layer 3 reuses an index selection, but the last index source before it does not read the same pool"),
    (dict(candidate_source_layer_id=2), r"candidate_source_layer_id 2 is not an index source layer"),
    (dict(index_source_layer_ids=[-1]), r"index_source_layer_ids names layer -1"),
    (dict(compress_ratios=[0, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 3, 6]),
     r"kv_source_layer_ids names layer 6, outside the model's 5 layers and 1 drafter blocks"),
])
def test_bad_configs_name_the_layer(over, message):
    with pytest.raises(ConfigError, match=message):
        family_for(base_config(**over))
