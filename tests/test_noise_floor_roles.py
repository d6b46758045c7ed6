"""The compare noise floor perturbs every layer's sub-blocks by declared role (`SUB_BLOCKS`): on the tiny DeepSeek-V4
and V4.1 packs it perturbs the MoE (`ffn`) as well as the attention, and a layer class that declares no roles is refused
by name instead of being left unperturbed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fidelity.measuring.noise_floor as C
from fidelity import open_pack
from fidelity.errors import ConfigError
from _deepseek_configs import reference_ties_to_lower_index  # noqa: F401 (autouse)

V4_NATIVE = Path(__file__).parent / "fixtures" / "v4" / "tiny_v4"


@pytest.fixture(scope="module")
def v41_native(tmp_path_factory):
    from testkit.minipacks_v41 import build_native_v41
    return build_native_v41(V4_NATIVE, tmp_path_factory.mktemp("v41") / "native")


def _rows(pack, gen) -> list[list[int]]:
    vocab = int(pack.config["vocab_size"])
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (7, 4)]


def _counted(monkeypatch) -> dict[str, int]:
    """Calls of each perturbed module, by the module's own class name (Attention, MoE...)."""
    calls: dict[str, int] = {}
    inner = C._perturb

    def perturb(fn, seed, rel):
        wrapped = inner(fn, seed, rel)

        def counting(*args, **kwargs):
            calls[type(fn).__name__] = calls.get(type(fn).__name__, 0) + 1
            return wrapped(*args, **kwargs)
        return counting
    monkeypatch.setattr(C, "_perturb", perturb)
    return calls


def _selections(monkeypatch) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """(scores, k, choice) of every top-k choice the V4/V4.1 oracles make (MoE router, indexer), in call order."""
    import fidelity.oracle.deepseek.dsv4_ops as V4
    import fidelity.oracle.deepseek.v41 as V41
    made: list[tuple[torch.Tensor, int, torch.Tensor]] = []

    def recording(select):
        def record(scores, k):
            made.append((scores.clone(), k, select(scores, k)))
            return made[-1][2]
        return record
    for module, name in ((V4, "top_k_indices"), (V4, "top_k_mask"), (V41, "top_k_mask")):
        monkeypatch.setattr(module, name, recording(getattr(module, name)))
    return made


def _per_row(oracle, rows, made: list) -> list[tuple[torch.Tensor, list]]:
    """(hidden state, top-k choices made) of each row run alone."""
    out = []
    for row in rows:
        made.clear()
        out.append((oracle.hidden_states([row], progress=False)[0], list(made)))
    return out


def _first_change_gap(made: list, other: list) -> float | None:
    """None where two runs made the same top-k choices; else, at the first choice that differs (later ones may follow
    from it), the largest gap between the k-th and (k+1)-th best score in `other`, relative to the k-th, over the
    tokens that chose differently."""
    for (_, _, choice), (scores, k, other_choice) in zip(made, other):
        if not torch.equal(choice, other_choice):
            differ = (choice != other_choice).reshape(-1, choice.shape[-1]).any(dim=-1)
            top = scores.reshape(-1, scores.shape[-1])[differ].sort(dim=-1, descending=True).values
            return float(((top[:, k - 1] - top[:, k]) / top[:, k - 1].abs()).max())
    assert len(made) == len(other)
    return None


@pytest.mark.parametrize("which", ["v4", "v41"])
def test_deepseek_v4_noise_floor_moves_the_moe_output(which, v41_native, monkeypatch, rng_seed):
    from fidelity.oracle import Oracle
    pack = open_pack(V4_NATIVE if which == "v4" else v41_native)
    n_layers = int(pack.config["num_hidden_layers"])
    rows = _rows(pack, torch.Generator().manual_seed(rng_seed))
    exact = Oracle(pack).hidden_states(rows, progress=False)

    calls = _counted(monkeypatch)
    made = _selections(monkeypatch)
    both = _per_row(C.perturbed_oracle(pack, seed=rng_seed % 1000), rows, made)
    # every layer's attention and MoE output went through a perturbation, once per row
    assert calls == {"Attention": n_layers * len(rows), "MoE": n_layers * len(rows)}

    roles = C.sub_blocks
    monkeypatch.setattr(C, "sub_blocks", lambda layer: {"attention": roles(layer)["attention"]})
    attention_only = _per_row(C.perturbed_oracle(pack, seed=rng_seed % 1000), rows, made)
    # moe_part: how far the MoE perturbation alone (the attention's is the same in both runs) moves a row's output.
    # Measured over seeds 0..199 (2 rows each): where no top-k choice changes, V4 [0.415, 0.874] x NOISE_REL, V4.1
    # [0.450, 0.774]. The perturbed MoE output also moves later layers' router scores, and a token whose k-th and
    # (k+1)-th expert scores are nearer than that changes experts: its row then moves by 17 .. 49 x NOISE_REL (6 of the
    # 200 V4 seeds, seed 8 among them; 4 of the V4.1 ones); the gaps crossed were 0.04 .. 0.35 x NOISE_REL of the k-th.
    for e, (b, b_made), (a, a_made) in zip(exact, both, attention_only):
        assert not torch.equal(e, a)
        moe_part = float((b - a).norm() / e.norm())
        assert moe_part > C.NOISE_REL / 10   # the MoE perturbation reaches the output
        gap = _first_change_gap(b_made, a_made)
        if gap is None:
            assert moe_part < C.NOISE_REL   # and is small where it changes no top-k choice
        else:
            assert gap < C.NOISE_REL   # and changes one only where two scores were nearly tied


def _tiny_llama(root: Path, gen: torch.Generator) -> Path:
    from safetensors.torch import save_file

    from testkit.synthetic import llama_config, llama_shapes
    cfg = llama_config(hidden_size=32, intermediate_size=64, n_layers=2, vocab_size=300, n_heads=4, n_kv_heads=2)
    w = {k: (1 + 0.1 * torch.randn(s, generator=gen)) if k.endswith("norm.weight") else torch.randn(s, generator=gen)
         / s[-1] ** 0.5 for k, s in llama_shapes(cfg).items()}
    root.mkdir()
    save_file(w, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def test_llama_noise_floor_perturbs_attention_and_mlp(tmp_path, monkeypatch, rng_seed):
    pack = open_pack(_tiny_llama(tmp_path / "llama", torch.Generator().manual_seed(rng_seed)))
    calls = _counted(monkeypatch)
    C.perturbed_oracle(pack).hidden_states([[1, 2, 3]], progress=False)
    assert calls == {"Attention": 2, "GatedMLP": 2}


def test_a_layer_without_declared_roles_is_refused_by_name(tmp_path, monkeypatch, rng_seed):
    from fidelity.oracle.llama import DecoderLayer
    pack = open_pack(_tiny_llama(tmp_path / "llama", torch.Generator().manual_seed(rng_seed)))
    monkeypatch.delattr(DecoderLayer, "SUB_BLOCKS")
    with pytest.raises(
        ConfigError, match=r"layer class fidelity\.oracle\.llama\.DecoderLayer: it declares no SUB_BLOCKS"
    ):
        C.perturbed_oracle(pack).hidden_states([[1, 2, 3]], progress=False)
    monkeypatch.setattr(DecoderLayer, "SUB_BLOCKS", {"attention": "attn", "mlp": "feed_forward"}, raising=False)
    with pytest.raises(ConfigError, match=r"DecoderLayer: roles \['mlp'\] are not declared"):
        C.perturbed_oracle(pack).hidden_states([[1, 2, 3]], progress=False)
