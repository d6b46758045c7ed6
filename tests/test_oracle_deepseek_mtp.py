"""DeepSeek-V4's DSpark drafter (fidelity.oracle.deepseek.mtp) against a composition written here from transformers'
own V4 modules: the trunk taps come from hooks on transformers' DeepseekV4ForCausalLM; the drafter blocks are the
layers of a second transformers V4 model (sliding attention, biased MoE) whose saved weights are the pack's `mtp.i.*`
tensors: its hyper-connections, norms, MoE, q/kv projections, RoPE, grouped output and hc_head are transformers'
modules; only the drafter's non-causal attention over [context rows ++ block] with sinks, the tap projection and the
Markov/confidence heads are written out below, per query and per head."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from fidelity import open_pack
from fidelity.errors import ConfigError, FidelityError, PackError
from fidelity.oracle import Oracle
from fidelity.oracle.deepseek.mtp import DSparkDrafter, acceptance
from testkit.minipacks_v4 import official_name
from _deepseek_configs import random_v4, reference_ties_to_lower_index, tiny_v4  # noqa: F401 (autouse: ties)

TOL = 1e-4
TRUNK = tiny_v4(["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                ["hash_moe", "moe", "moe"])
N_BLOCKS, BLOCK, TARGETS, MARKOV_RANK = 2, 4, [0, 2], 6
NOISE = TRUNK["vocab_size"] - 1


def hf_model(config: dict, seed: int):
    return random_v4(T.DeepseekV4Config(**config), seed)


def saved_official(model, folder) -> dict[str, torch.Tensor]:
    model.save_pretrained(folder)
    return {official_name(k): v for k, v in load_file(folder / "model.safetensors").items()}


def build(root, seed: int, drop: tuple = (), config_over: dict | None = None):
    """Trunk + drafter pack in official names. Returns (trunk model, drafter-body model, extra tensors, pack dir)."""
    trunk = hf_model(TRUNK, seed)
    body_cfg = {**TRUNK, "num_hidden_layers": N_BLOCKS, "layer_types": ["sliding_attention"] * N_BLOCKS,
                "mlp_layer_types": ["moe"] * N_BLOCKS}
    body = hf_model(body_cfg, seed + 7)
    tensors = saved_official(trunk, root / "trunk")
    last = N_BLOCKS - 1
    for name, t in saved_official(body, root / "body").items():
        if name.startswith("layers."):
            i, rest = name[len("layers."):].split(".", 1)
            tensors[f"mtp.{i}.{rest}"] = t
        elif name.startswith("hc_head_"):
            tensors[f"mtp.{last}.{name}"] = t
        elif name == "norm.weight":
            tensors[f"mtp.{last}.norm.weight"] = t
    g = torch.Generator().manual_seed(seed + 3)
    h, V = TRUNK["hidden_size"], TRUNK["vocab_size"]
    extra = {"mtp.0.main_proj.weight": torch.randn(h, len(TARGETS) * h, generator=g) / (len(TARGETS) * h) ** 0.5,
             "mtp.0.main_norm.weight": 1 + 0.2 * torch.randn(h, generator=g),
             f"mtp.{last}.markov_head.markov_w1.weight": torch.randn(V, MARKOV_RANK, generator=g),
             f"mtp.{last}.markov_head.markov_w2.weight": torch.randn(V, MARKOV_RANK, generator=g) / MARKOV_RANK ** 0.5,
             f"mtp.{last}.confidence_head.proj.weight": torch.randn(1, h + MARKOV_RANK, generator=g) / h ** 0.5}
    tensors.update(extra)
    for name in drop:
        del tensors[name]
    folder = root / "pack"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "trunk" / "config.json").read_text())
    config.update({"dspark_block_size": BLOCK, "dspark_noise_token_id": NOISE, "dspark_target_layer_ids": TARGETS,
                   "dspark_markov_rank": MARKOV_RANK, **(config_over or {})})
    config = {k: v for k, v in config.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return trunk, body, extra, folder


# ---------------------------------------------------------------------------------------------------------------------
# the composition written here
# ---------------------------------------------------------------------------------------------------------------------
def rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def drafter_attention(attn, rotary, x, ctx_x, ctx_pos, pos):
    """Non-causal: every block query sees the context rows and the whole block, one softmax with the head's sink."""
    cfg = attn.config
    H, D, S = cfg.num_attention_heads, cfg.head_dim, x.shape[1]
    cos_b, sin_b = rotary(x, position_ids=pos[None], layer_type="main")
    cos_c, sin_c = rotary(x, position_ids=ctx_pos[None], layer_type="main")
    q = attn.q_b_norm(attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(x))).view(1, S, H, D).transpose(1, 2))
    q = apply_rotary_pos_emb(q, cos_b, sin_b)[0]                                          # [H, S, D]
    k_block = apply_rotary_pos_emb(attn.kv_norm(attn.kv_proj(x)).view(1, S, 1, D).transpose(1, 2), cos_b, sin_b)
    k_ctx = apply_rotary_pos_emb(attn.kv_norm(attn.kv_proj(ctx_x[None])).view(1, -1, 1, D).transpose(1, 2),
                                 cos_c, sin_c)
    keys = torch.cat((k_ctx[0, 0], k_block[0, 0]))                                       # [C + S, D]
    out = torch.empty(1, H, S, D)
    for h in range(H):
        for s in range(S):
            scores = torch.cat((keys @ q[h, s] * D ** -0.5, attn.sinks[h].view(1)))
            out[0, h, s] = torch.softmax(scores, 0)[:-1] @ keys
    out = apply_rotary_pos_emb(out, cos_b, -sin_b).transpose(1, 2)                      # [1, S, H, D]
    return attn.o_b_proj(attn.o_a_proj(out.reshape(1, S, cfg.o_groups, -1)).flatten(2))


@torch.no_grad()
def reference(trunk, body, extra, tokens, starts):
    taps = {}
    hooks = [trunk.model.layers[t].register_forward_hook(lambda m, i, o, t=t: taps.__setitem__(t, o)) for t in TARGETS]
    main = trunk(tokens).logits
    for hook in hooks:
        hook.remove()
    cat = torch.cat([taps[t].mean(dim=2) for t in TARGETS], dim=-1)
    main_x = rms(cat @ extra["mtp.0.main_proj.weight"].T, extra["mtp.0.main_norm.weight"])
    last = N_BLOCKS - 1
    w1, w2 = extra[f"mtp.{last}.markov_head.markov_w1.weight"], extra[f"mtp.{last}.markov_head.markov_w2.weight"]
    proj = extra[f"mtp.{last}.confidence_head.proj.weight"]
    rotary, W, hc = trunk.model.rotary_emb, TRUNK["sliding_window"], TRUNK["hc_mult"]
    B = tokens.shape[0]
    logits = torch.empty(B, len(starts), BLOCK, TRUNK["vocab_size"])
    biased, drafts, conf = torch.empty_like(logits), torch.empty(B, len(starts), BLOCK, dtype=torch.long), \
        torch.empty(B, len(starts), BLOCK)
    for b in range(B):
        for si, p0 in enumerate(starts):
            ids = torch.tensor([[int(tokens[b, p0])] + [NOISE] * (BLOCK - 1)])
            streams = trunk.model.embed_tokens(ids).unsqueeze(2).expand(-1, -1, hc, -1).contiguous()
            pos = p0 + 1 + torch.arange(BLOCK)            # model.py: the block after the seed's own row
            ctx_pos = torch.arange(max(0, p0 + 1 - W), p0 + 1)   # the last W rows up to the seed's, its own included
            for layer in body.model.layers:
                post, comb, collapsed = layer.attn_hc(streams)
                y = drafter_attention(layer.self_attn, rotary, layer.input_layernorm(collapsed), main_x[b, ctx_pos],
                                      ctx_pos, pos)
                streams = post.unsqueeze(-1) * y.unsqueeze(-2) + comb.transpose(-1, -2) @ streams
                post, comb, collapsed = layer.ffn_hc(streams)
                y = layer.mlp(layer.post_attention_layernorm(collapsed))
                streams = post.unsqueeze(-1) * y.unsqueeze(-2) + comb.transpose(-1, -2) @ streams
            prenorm = body.model.hc_head(streams)[0]
            logits[b, si] = trunk.lm_head(body.model.norm(prenorm))
            prev = int(tokens[b, p0])
            for j in range(BLOCK):
                biased[b, si, j] = logits[b, si, j] + w2 @ w1[prev]
                conf[b, si, j] = proj[0] @ torch.cat((prenorm[j], w1[prev]))   # raw, as model.py returns it
                prev = int(biased[b, si, j].argmax())
                drafts[b, si, j] = prev
    return main, logits, biased, drafts, conf


# ---------------------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"module model seed {seed}")
    return build(tmp_path_factory.mktemp("dspark"), seed)


def test_drafter_matches_composition(built, rng_seed):
    trunk, body, extra, folder = built
    T_len = 14
    tokens = torch.randint(0, TRUNK["vocab_size"] - 1, (2, T_len))
    starts = [0, 4, 6, 9, 12, 13]   # contexts shorter and longer than the window (5); blocks running past the row
    out = Oracle(open_pack(folder)).drafter().draft(tokens, starts)
    main, logits, biased, drafts, conf = reference(trunk, body, extra, tokens, starts)
    print("max |d main|", float((out.main_logits - main).abs().max()), "max |d draft|",
          float((out.logits - logits).abs().max()), "logit std", float(logits.std()))
    assert out.logits.shape == (2, len(starts), BLOCK, TRUNK["vocab_size"])
    assert (out.main_logits - main).abs().max() <= TOL
    assert (out.logits - logits).abs().max() <= TOL
    assert (out.biased_logits - biased).abs().max() <= TOL
    assert (out.confidence - conf).abs().max() <= 1e-5
    assert torch.equal(out.drafts, drafts)
    assert logits.std() > 0.3  # spread logits: the comparison is not of near-constants


def test_seed_reaches_every_block_position(built, rng_seed):
    """The block attention is non-causal: changing the seed changes the logits of every block position."""
    _, _, _, folder = built
    drafter = DSparkDrafter(Oracle(open_pack(folder), keep_weights=True))
    tokens = torch.randint(0, TRUNK["vocab_size"] - 1, (1, 12))
    base = drafter.draft(tokens, [10]).logits
    other = tokens.clone()
    other[0, 10] = (other[0, 10] + 1) % (TRUNK["vocab_size"] - 1)   # the seed
    changed = drafter.draft(other, [10]).logits
    assert ((changed - base).abs().amax(-1) > 1e-3).all()   # every block position sees the seed (non-causal)


def test_main_outputs_unchanged(built, rng_seed):
    _, _, _, folder = built
    oracle = Oracle(open_pack(folder))
    tokens = torch.randint(0, TRUNK["vocab_size"], (3, 9))
    before = oracle.logits(tokens)
    out = oracle.drafter().draft(tokens, [2, 5])
    after = oracle.logits(tokens)
    assert torch.equal(before, after)
    assert torch.equal(out.main_logits, before)
    assert "load_layer" not in oracle.__dict__


def test_trunk_pass_runs_through_the_oracles_load_chain(built, rng_seed):
    """An oracle loading through prefetch keeps its chain: the drafter's trunk pass taps the layers' outputs (a
    forward argument) without touching how they load, and gives the same drafts."""
    from fidelity.oracle import LoadChain
    from fidelity.oracle.parallel import Prefetcher
    _, _, _, folder = built
    tokens = torch.randint(0, TRUNK["vocab_size"], (1, 8))
    want = DSparkDrafter(Oracle(open_pack(folder))).draft(tokens, [4]).logits
    oracle = Oracle(open_pack(folder), chain=LoadChain(prefetch=Prefetcher))
    loader = oracle.prefetcher
    got = DSparkDrafter(oracle).draft(tokens, [4]).logits
    assert oracle.prefetcher is loader and "load_layer" not in oracle.__dict__
    assert [t.layer for t in loader.timeline] == list(range(oracle.family.n_layers))   # one trunk pass, prefetched
    assert torch.equal(got, want)


def test_acceptance_against_hand_count(built, rng_seed):
    trunk, body, extra, folder = built
    tokens = torch.randint(0, TRUNK["vocab_size"] - 1, (1, 11))
    starts = [2, 5, 8, 10]
    out = DSparkDrafter(Oracle(open_pack(folder))).draft(tokens, starts)
    acc = acceptance(out)
    main, _, _, drafts, _ = reference(trunk, body, extra, tokens, starts)
    want = main.argmax(-1)[0]
    for si, p0 in enumerate(starts):
        n = 0
        for j in range(BLOCK):
            valid = p0 + j < tokens.shape[1]
            assert bool(acc.valid[0, si, j]) == valid
            hit = valid and int(drafts[0, si, j]) == int(want[p0 + j])
            assert bool(acc.match[0, si, j]) == hit
        for j in range(BLOCK):
            if not acc.match[0, si, j]:
                break
            n += 1
        assert int(acc.accepted[0, si]) == n
    rate = acc.per_position_rate
    assert rate.shape == (BLOCK,)
    assert torch.allclose(rate, acc.match.float().sum((0, 1)) / acc.valid.float().sum((0, 1)))


def test_acceptance_of_a_perfect_drafter(built):
    """Drafts equal to the trunk's greedy tokens are all accepted (checks the offsets: draft j vs position p0 + j)."""
    from fidelity.oracle.deepseek.mtp import DraftOutput
    main = torch.randn(1, 10, 7)
    greedy = main.argmax(-1)
    starts = [1, 4, 8]
    drafts = torch.stack([torch.stack([greedy[0, min(p + j, 9)] for j in range(BLOCK)]) for p in starts])[None]
    acc = acceptance(DraftOutput(starts, main[:, :1].expand(1, 3, BLOCK, 7), None, drafts, None, main))
    assert acc.accepted.tolist() == [[4, 4, 2]]
    assert acc.per_position_rate.tolist() == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("drop", [("mtp.1.ffn.experts.4.w3.weight",), ("mtp.0.main_proj.weight",),
                                  ("mtp.1.hc_head_fn",)])
def test_incomplete_drafter_names_the_tensor(tmp_path, drop):
    *_, folder = build(tmp_path, 5, drop=drop)
    oracle = Oracle(open_pack(folder))
    assert oracle.logits(torch.tensor([[1, 2, 3]])).shape == (1, 3, TRUNK["vocab_size"])   # the trunk still works
    with pytest.raises(PackError, match=drop[0].replace(".", r"\.")) as err:
        DSparkDrafter(oracle)
    assert err.value.tensor == drop[0]


def test_pack_without_drafter(tmp_path):
    names = [f"mtp.{i}." for i in range(N_BLOCKS)]
    *_, folder = build(tmp_path, 6)
    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items() if not k.startswith(tuple(names))}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PackError, match=r"no complete DSpark drafter.*mtp\.0\."):
        DSparkDrafter(Oracle(open_pack(folder)))


def test_config_errors(tmp_path):
    *_, folder = build(tmp_path, 7, config_over=dict(dspark_target_layer_ids=[]))
    with pytest.raises(ConfigError, match="dspark_target_layer_ids"):
        DSparkDrafter(Oracle(open_pack(folder)))
    *_, folder = build(tmp_path / "b", 7, config_over=dict(dspark_target_layer_ids=[0, 3]))
    with pytest.raises(ConfigError, match=r"\[0, 3\]"):
        DSparkDrafter(Oracle(open_pack(folder)))


def test_chunked_drafts_equal_unchunked(built, rng_seed, monkeypatch):
    import fidelity.oracle.deepseek.mtp as mtp
    _, _, _, folder = built
    drafter = DSparkDrafter(Oracle(open_pack(folder), keep_weights=True))
    tokens = torch.randint(0, TRUNK["vocab_size"], (2, 10))
    whole = drafter.draft(tokens)
    monkeypatch.setattr(mtp, "ATTENTION_CHUNK_BYTES", 1)   # one draft per attention chunk
    pieces = drafter.draft(tokens)
    assert torch.allclose(whole.logits, pieces.logits, atol=1e-5, rtol=0)


def test_block_count_from_compress_ratios(tmp_path):
    """The official config's compress_ratios run past the trunk layers, one 0 per MTP block."""
    *_, folder = build(tmp_path, 8, config_over=dict(compress_ratios=[0, 4, 3] + [0] * N_BLOCKS, layer_types=None))
    config = json.loads((folder / "config.json").read_text())
    assert DSparkDrafter(Oracle(open_pack(folder))).args.n_blocks == N_BLOCKS
    config["compress_ratios"] = [0, 4, 3, 0]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PackError, match=r"mtp\.0\.hc_head_fn"):   # one block: its exit head would be mtp.0's
        DSparkDrafter(Oracle(open_pack(folder)))
    config["compress_ratios"] = [0, 4, 3, 0, 4]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"compress_ratios past the trunk \(\[0, 4\]\)"):
        DSparkDrafter(Oracle(open_pack(folder)))


def test_model_prefixed_drafter_names(built, tmp_path, rng_seed):
    """A pack that stores the drafter under `model.mtp.*` drafts exactly as one with the official names."""
    import shutil
    _, _, _, folder = built
    prefixed = tmp_path / "prefixed"
    shutil.copytree(folder, prefixed)
    tensors = load_file(prefixed / "model.safetensors")
    save_file({("model." + k if k.startswith("mtp.") else k): v for k, v in tensors.items()},
              prefixed / "model.safetensors", metadata={"format": "pt"})
    tokens = torch.randint(0, TRUNK["vocab_size"], (1, 9))
    a = DSparkDrafter(Oracle(open_pack(folder))).draft(tokens, [3, 7])
    b = DSparkDrafter(Oracle(open_pack(prefixed))).draft(tokens, [3, 7])
    assert torch.equal(a.logits, b.logits)


def test_refuses_deepseek_numerics(built):
    _, _, _, folder = built
    with pytest.raises(ConfigError, match="numerics 'deepseek'"):
        DSparkDrafter(Oracle(open_pack(folder), numerics="deepseek")).draft(torch.tensor([[1, 2, 3]]), [1])
    drafter = DSparkDrafter(Oracle(open_pack(folder)))
    assert drafter.draft(torch.tensor([[1, 2, 3]]), [1]).logits.shape == (1, 1, BLOCK, TRUNK["vocab_size"])


def test_bad_starts(built):
    _, _, _, folder = built
    drafter = DSparkDrafter(Oracle(open_pack(folder)))
    with pytest.raises(FidelityError, match=r"0\.\.4.*\[-1, 5\]"):
        drafter.draft(torch.tensor([[1, 2, 3, 4, 5]]), [-1, 2, 5])


# ---------------------------------------------------------------------------------------------------------------------
# exllamav3's own DeepSeek-V4 forward (benchmarks/exllamav3_forward.py; needs CUDA and an importable exllamav3)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_exllamav3_forward_agrees_with_oracle(tmp_path):
    import importlib.util
    import sys
    from pathlib import Path
    if not torch.cuda.is_available():
        pytest.skip("exllamav3's forward needs CUDA")
    if importlib.util.find_spec("exllamav3") is None:
        pytest.skip("missing tool: exllamav3 is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import exllamav3_forward as bench
    bench.build(tmp_path)
    result = bench.run(tmp_path, tmp_path / "out")
    ours, control = result["exllamav3_vs_oracle"], result["exllamav3_vs_control"]
    # fp16 kernels vs fp32 (H200, exllamav3 1.6.5: top-1 99.5%, KL 2.0e-6; a one-field config change: KL 2.5e-2)
    assert ours["top1_agreement"] >= 0.98 and ours["kl_mean"] <= 1e-4
    assert control["kl_mean"] >= 100 * ours["kl_mean"]


# ---------------------------------------------------------------------------------------------------------------------
# DeepSeek-V3's next-token-prediction module: transformers' own decoder layer (a V3 model one layer deeper supplies
# the MTP layer's weights and module), the input projection and shared head written out here
# ---------------------------------------------------------------------------------------------------------------------
V3 = dict(vocab_size=67, hidden_size=32, intermediate_size=44, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
          moe_intermediate_size=16, first_k_dense_replace=1, routed_scaling_factor=1.7, norm_topk_prob=True,
          q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
          rope_interleave=True, tie_word_embeddings=False, max_position_embeddings=256, rms_norm_eps=1e-6)


def v32_config() -> dict:
    from test_oracle_deepseek_v32 import BASE
    return {**BASE, "num_hidden_layers": 2}


ARCHS = {"v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, lambda: V3),
         "v32": (T.DeepseekV32Config, T.DeepseekV32ForCausalLM, v32_config)}


def build_v3_mtp(root, seed: int, drop: tuple = (), nextn: int = 1, arch: str = "v3"):
    from test_oracle_support import build as hf_build
    config_cls, model_cls, base = ARCHS[arch]
    base = base()
    n = base["num_hidden_layers"]
    deep = hf_build(config_cls(**{**base, "num_hidden_layers": n + 1}), model_cls, root / "deep", seed)
    trunk = model_cls(config_cls(**base)).float().eval()
    trunk.config._attn_implementation = "eager"
    trunk.set_experts_implementation("eager")
    trunk.load_state_dict(deep.state_dict(), strict=False)
    g = torch.Generator().manual_seed(seed + 11)
    h, p = base["hidden_size"], f"model.layers.{n}"
    extra = {f"{p}.enorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
             f"{p}.hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
             f"{p}.eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
             f"{p}.shared_head.norm.weight": 1 + 0.2 * torch.randn(h, generator=g)}
    tensors = {**load_file(root / "deep" / "model.safetensors"), **extra}
    for name in drop:
        del tensors[name]
    save_file(tensors, root / "deep" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "deep" / "config.json").read_text())
    config.update(num_hidden_layers=n, num_nextn_predict_layers=nextn)
    if config.get("mlp_layer_types"):
        config["mlp_layer_types"] = config["mlp_layer_types"][:n]
    (root / "deep" / "config.json").write_text(json.dumps(config))
    return trunk, deep, extra, root / "deep"


@torch.no_grad()
def v3_reference(trunk, deep, extra, tokens, hidden):
    n = trunk.config.num_hidden_layers
    p = f"model.layers.{n}"
    out = trunk.model(tokens, output_hidden_states=True)
    if hidden == "post_norm":
        h = out.last_hidden_state
    else:
        grabbed = {}
        hook = trunk.model.layers[-1].register_forward_hook(lambda m, i, o: grabbed.setdefault("h", o))
        trunk.model(tokens)
        hook.remove()
        h = grabbed["h"][0] if isinstance(grabbed["h"], tuple) else grabbed["h"]
    x = torch.cat((rms(trunk.model.embed_tokens(tokens[:, 1:]), extra[f"{p}.enorm.weight"]),
                   rms(h[:, :-1], extra[f"{p}.hnorm.weight"])), dim=-1) @ extra[f"{p}.eh_proj.weight"].T
    L = x.shape[1]
    pos = torch.arange(L)[None]
    mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
    y = deep.model.layers[n](x, attention_mask=mask, position_ids=pos,
                             position_embeddings=deep.model.rotary_emb(x, pos))
    y = y[0] if isinstance(y, tuple) else y
    return deep.lm_head(rms(y, extra[f"{p}.shared_head.norm.weight"])), trunk(tokens).logits


@pytest.mark.parametrize("arch,hidden", [("v3", "post_norm"), ("v3", "pre_norm"), ("v32", "post_norm")])
def test_v3_mtp_matches_composition(tmp_path, rng_seed, arch, hidden):
    """V3.2: 22 tokens, more than index_topk (7), so the MTP layer's own indexer selects."""
    from fidelity.oracle.deepseek.mtp import NextNDrafter
    trunk, deep, extra, folder = build_v3_mtp(tmp_path, rng_seed, arch=arch)
    vocab = trunk.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 22 if arch == "v32" else 11))
    oracle = Oracle(open_pack(folder))
    before = oracle.logits(tokens)
    mtp = oracle.drafter(hidden=hidden)
    assert isinstance(mtp, NextNDrafter)
    got = mtp.logits(tokens)
    want, main = v3_reference(trunk, deep, extra, tokens, hidden)
    delta = float((got - want).abs().max())
    print(f"{hidden}: max |d mtp| {delta:.3g}, logit std {float(want.std()):.3g}; main vs HF "
          f"{float((before - main).abs().max()):.3g}")
    assert got.shape == (2, tokens.shape[1] - 1, vocab) and delta <= TOL
    assert want.std() > 0.3
    assert torch.equal(oracle.logits(tokens), before)
    accepted = mtp.acceptance(tokens)
    assert torch.equal(accepted, want[:, :-1].argmax(-1) == main[:, 1:-1].argmax(-1))


def test_v3_mtp_absent_or_incomplete(tmp_path):
    from fidelity.oracle.deepseek.mtp import NextNDrafter
    n = V3["num_hidden_layers"]
    *_, folder = build_v3_mtp(tmp_path / "a", 3, drop=(f"model.layers.{n}.hnorm.weight",))
    with pytest.raises(PackError, match=rf"model\.layers\.{n}\.hnorm\.weight"):
        NextNDrafter(Oracle(open_pack(folder)))
    *_, folder = build_v3_mtp(tmp_path / "b", 3, nextn=0)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers is 0"):
        NextNDrafter(Oracle(open_pack(folder)))


def test_v3_mtp_bad_options_and_inputs(tmp_path):
    from fidelity.oracle.deepseek.mtp import NextNDrafter
    *_, folder = build_v3_mtp(tmp_path / "a", 3)
    oracle = Oracle(open_pack(folder))
    with pytest.raises(FidelityError, match=r"hidden must be 'post_norm' or 'pre_norm', not 'final'"):
        NextNDrafter(oracle, hidden="final")
    with pytest.raises(FidelityError, match=r"length >= 2\] tensor, got shape \[1, 1\]"):
        NextNDrafter(oracle).logits(torch.tensor([[5]]))


# ---------------------------------------------------------------------------------------------------------------------
# DeepSeek-V4.1's drafter: the tiny V4.1 (minipacks_v41) as trunk, its layers run one by one here for the taps (the
# inputs of the target layers); drafter blocks from transformers' V4 modules with V4.1's single-pass hyper-connections
# (pre carried from the previous site) and no q head norm written out here
# ---------------------------------------------------------------------------------------------------------------------
V41_TARGETS, V41_EXPERTS, V41_TOP_K = [1, 2], 6, 3


def build_v41(root, seed: int, **over):
    from testkit.minipacks_v4 import TINY_V4, build_native
    from testkit.minipacks_v41 import build_native_v41
    v4 = build_native(root / "v4", seed=seed, dtype=torch.float32)
    dspark = dict(dspark_block_size=BLOCK, dspark_noise_token_id=5, dspark_target_layer_ids=V41_TARGETS,
                  dspark_num_experts=V41_EXPERTS, dspark_num_experts_per_tok=V41_TOP_K)
    folder = build_native_v41(v4, root / "v41", seed=seed + 1, **{**dspark, **over})
    body_cfg = {**TINY_V4, "num_hidden_layers": N_BLOCKS, "layer_types": ["sliding_attention"] * N_BLOCKS,
                "mlp_layer_types": ["moe"] * N_BLOCKS, "n_routed_experts": V41_EXPERTS,
                "num_experts_per_tok": V41_TOP_K}
    body = hf_model(body_cfg, seed + 7)
    tensors = load_file(folder / "model.safetensors")
    last = N_BLOCKS - 1
    for name, t in saved_official(body, root / "body").items():
        if name.startswith("layers."):
            i, rest = name[len("layers."):].split(".", 1)
            tensors[f"mtp.{i}.{rest}"] = t
        elif name == "norm.weight":
            tensors[f"mtp.{last}.norm.weight"] = t
    g = torch.Generator().manual_seed(seed + 3)
    h = TINY_V4["hidden_size"]
    extra = {"mtp.0.main_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
             "mtp.0.main_norm.weight": 1 + 0.2 * torch.randn(h, generator=g)}
    tensors.update(extra)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return body, extra, folder


def hc_pre(hc, streams, n, eps=1e-6, hc_eps=1e-6):
    """A transformers V4 hyper-connection's collapse weights (n streams), from its fn/base/scale."""
    flat = streams.flatten(2)
    mixes = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)) @ hc.fn.T
    return torch.sigmoid(mixes[..., :n] * hc.scale[0] + hc.base[:n]) + hc_eps


@torch.no_grad()
def reference_v41(oracle, body, extra, tokens, starts):
    import torch.nn.functional as F
    fam = oracle.family
    x = fam.embed_hook(F.embedding(tokens, oracle.fetch(fam.embed_name)))
    rope = fam.rope_tables(tokens.shape[1], torch.float32, "cpu")
    outputs, state = [], fam.new_pass_state()
    for i in range(fam.n_layers):
        x = fam.load_layer(i, oracle.fetch)(x, rope, tokens, state)
        outputs.append(x)
    taps = torch.cat([outputs[t - 1].mean(dim=2) for t in V41_TARGETS], dim=-1)
    main_x = rms(taps @ extra["mtp.0.main_proj.weight"].T, extra["mtp.0.main_norm.weight"])
    head, embed = oracle.fetch("head.weight"), oracle.fetch("embed.weight")
    cfg = oracle.pack.config
    W, hc, H, D = cfg["sliding_window"], cfg["hc_mult"], cfg["num_attention_heads"], cfg["head_dim"]
    rotary = body.model.rotary_emb
    logits = torch.empty(tokens.shape[0], len(starts), BLOCK, cfg["vocab_size"])
    for b in range(tokens.shape[0]):
        for si, p0 in enumerate(starts):
            ids = torch.tensor([int(tokens[b, p0])] + [5] * (BLOCK - 1))
            streams = embed[ids][None].unsqueeze(2).expand(-1, -1, hc, -1).contiguous()
            pos = p0 + 1 + torch.arange(BLOCK)            # model.py: the block after the seed's own row
            ctx_pos = torch.arange(max(0, p0 + 1 - W), p0 + 1)   # the last W rows up to the seed's, its own included
            carried = None
            for layer in body.model.layers:
                for site in ("attn", "ffn"):
                    module = layer.attn_hc if site == "attn" else layer.ffn_hc
                    post, comb, _ = module(streams)
                    pre = hc_pre(module, streams, hc)
                    x = streams[:, :, 0] if carried is None else (carried.unsqueeze(-1) * streams).sum(2)
                    carried = pre
                    if site == "attn":
                        y = v41_attention(layer.self_attn, rotary, layer.input_layernorm(x), main_x[b, ctx_pos],
                                          ctx_pos, pos, H, D)
                    else:
                        y = layer.mlp(layer.post_attention_layernorm(x))
                    streams = post.unsqueeze(-1) * y.unsqueeze(-2) + comb.transpose(-1, -2) @ streams
            prenorm = (carried.unsqueeze(-1) * streams).sum(2)[0]
            logits[b, si] = body.model.norm(prenorm) @ head.T
    return logits


def v41_attention(attn, rotary, x, ctx_x, ctx_pos, pos, H, D):
    """drafter_attention without the per-head q norm."""
    S = x.shape[1]
    cos_b, sin_b = rotary(x, position_ids=pos[None], layer_type="main")
    cos_c, sin_c = rotary(x, position_ids=ctx_pos[None], layer_type="main")
    q = attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(x))).view(1, S, H, D).transpose(1, 2)
    q = apply_rotary_pos_emb(q, cos_b, sin_b)[0]
    k_block = apply_rotary_pos_emb(attn.kv_norm(attn.kv_proj(x)).view(1, S, 1, D).transpose(1, 2), cos_b, sin_b)
    k_ctx = apply_rotary_pos_emb(attn.kv_norm(attn.kv_proj(ctx_x[None])).view(1, -1, 1, D).transpose(1, 2),
                                 cos_c, sin_c)
    keys = torch.cat((k_ctx[0, 0], k_block[0, 0]))
    out = torch.empty(1, H, S, D)
    for h in range(H):
        for s in range(S):
            scores = torch.cat((keys @ q[h, s] * D ** -0.5, attn.sinks[h].view(1)))
            out[0, h, s] = torch.softmax(scores, 0)[:-1] @ keys
    out = apply_rotary_pos_emb(out, cos_b, -sin_b).transpose(1, 2)
    return attn.o_b_proj(attn.o_a_proj(out.reshape(1, S, attn.config.o_groups, -1)).flatten(2))


def test_v41_drafter_matches_composition(tmp_path, rng_seed):
    body, extra, folder = build_v41(tmp_path, rng_seed % 100000)
    oracle = Oracle(open_pack(folder))
    tokens = torch.randint(6, oracle.family.vocab_size, (1, 14))
    starts = [1, 5, 9, 13]
    before = oracle.logits(tokens)
    out = DSparkDrafter(oracle).draft(tokens, starts)
    want = reference_v41(oracle, body, extra, tokens, starts)
    delta = float((out.logits - want).abs().max())
    print(f"V4.1 drafter: max |d| {delta:.3g}, logit std {float(want.std()):.3g}")
    assert delta <= TOL and want.std() > 0.3
    assert torch.equal(out.main_logits, before) and torch.equal(oracle.logits(tokens), before)


def test_v41_drafter_config_errors(tmp_path):
    *_, folder = build_v41(tmp_path, 9, dspark_target_layer_ids=[0, 2])
    with pytest.raises(ConfigError, match=r"\[0, 2\].*layers 1\.\.2 that carry no Engram"):
        DSparkDrafter(Oracle(open_pack(folder)))
