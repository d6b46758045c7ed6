"""exllamav3's DeepSeek-V4.1 port vs the oracle, on the tiny V4.1 pack, in the pieces of the port that run without
exllamav3's CUDA extension.

No runnable exllamav3 with V4.1 exists here: PyPI's newest wheel (1.6.5) has no V4.1 architecture, the newest stored
snapshot of the repository is v1.4.1, and the stored index holds single versions of single files of the V4.1 port
(`architecture/deepseek_v41.py` @13b31a6, `modules/arch_specific/deepseek_v41.py` @6ae6d710), not a tree that builds:
the V4.1-aware `modules/dsv4.py` (shared pools, index sharing, candidate blocks) and `hyperconnections.py` are not
stored, and the stored `ngram_embedding.py` predates the constructor arguments the V4.1 Engram layer passes. So this
runs exllamav3's own Python code where it is self-contained, on the same inputs as the oracle:

- config: `DeepseekV41Config.__init__` (their code; `Config` base replaced by a reader of config.json through their
  `util.file.read_dict`): each Engram head's prime table size and each layer's hash multipliers;
- topology: `DeepseekV41Model.__init__` (their code; module classes replaced by recorders of their constructor
  arguments): per layer, the attention type and ratio, which layer's KV pool it reads, whether it runs the indexer
  ("full") or takes the pool owner's selection ("shared"), its candidate-block role and sizes, Engram placement;
- the compressed vocabulary: their `engram_token_map(tokenizer.json)`, as is;
- n-gram hashing: their `NGramEmbedding.compute_ngram_ids` / `_shift_right_ignore_eos` on the history their
  `EngramLayer.forward` builds (token map, pad id), rows of `LENGTH` tokens;
- the Engram layer: their `EngramLayer.forward` (key-first wkv split, per-stream norms, dot, scale, residual add) with
  `Linear` / grouped `RMSNorm` as plain fp32 torch (their `RMSNorm.forward_torch` formula), table rows gathered by
  their hash ids, and `ext.ple_gate` as exllamav3's ple.cu documents it (sigmoid(sign(g) sqrt(max(|g|, 1e-6))) * v);
- candidate blocks (with --candidate-src): `select_candidate_blocks` of a V4.1 Ascend NPU port (Huawei header; a
  pure-torch function there, the rest of its indexer needs torch_npu) on the index scores the oracle computes at its
  candidate source layer during a forward over the same rows, against the oracle's own block filter. Queries whose
  kept blocks differ are split into those explained by a tie at the cut (the oracle keeps the lower block index, its
  stated rule; the port whatever torch.topk returns) and the rest, which must be none.

Not compared (needs the V4.1 `dsv4.py` / extension, which are not available): the attention numerics (pool
compression, index scores, the index top-k, sparse attention), single-pass mHC, MoE, the logits. Each check has a
control: the same code with one config field (or argument) changed must disagree with the oracle.

    python benchmarks/exllamav3_forward_v41.py SRC [--candidate-src DIR] [--json OUT.json]

SRC holds exllamav3/architecture/deepseek_v41.py, exllamav3/modules/arch_specific/deepseek_v41.py,
exllamav3/modules/ngram_embedding.py and exllamav3/util/file.py (see SRC/PROVENANCE.md); DIR holds
select_candidate_blocks.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from _tables import header, present_lines

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY_V4 = ROOT / "tests" / "fixtures" / "v4" / "tiny_v4"
TOKENS_SEED = 20261201
ROWS, LENGTH = 2, 64      # 32 ratio-2 entries per row: > 3 candidate blocks x 2 entries > index_topk 4
TOPOLOGY_CONTROL = {"candidate_source_layer_id": 2}
ENGRAM_CONTROL = {"engram_pad_token_id": 3}
CANDIDATE_FILE = "select_candidate_blocks.py"
SOURCE_FILES = ("exllamav3/architecture/deepseek_v41.py", "exllamav3/modules/arch_specific/deepseek_v41.py",
                "exllamav3/modules/ngram_embedding.py", "exllamav3/util/file.py")


def default_source() -> Path | None:
    import os
    for p in (os.environ.get("FIDELITY_EXLLAMAV3_V41_SRC"), ROOT / ".devcarry" / "v41indep" / "exl3src"):
        if p and all((Path(p) / f).is_file() for f in SOURCE_FILES):
            return Path(p)
    return None


def default_candidate_source() -> Path | None:
    import os
    for p in (os.environ.get("FIDELITY_V41_CANDIDATE_SRC"), ROOT / ".devcarry" / "v41indep" / "ascend_src"):
        if p and (Path(p) / CANDIDATE_FILE).is_file():
            return Path(p)
    return None


# ---------------------------------------------------------------------------------------------------------------------
# exllamav3's files under stand-ins for the parts they import that need the extension or the rest of the package
# ---------------------------------------------------------------------------------------------------------------------
class Recorder:
    """A module class stand-in: keeps its constructor arguments."""
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def ple_gate(gate, value, out, scale):
    """ext.ple_gate as exllamav3's ple.cu documents it: out[b,s,h,:] = sigmoid(ss(gate*scale)) * value[b,s,:],
    ss(g) = sign(g) sqrt(max(|g|, 1e-6)), sign(0) = 0."""
    g = gate * scale
    ss = torch.sign(g) * g.abs().clamp_min(1e-6).sqrt()
    out.copy_(torch.sigmoid(ss).unsqueeze(-1) * value.float().unsqueeze(-2))


def load_exllamav3(src: Path, row_dim: int) -> types.SimpleNamespace:
    """exllamav3's V4.1 files from `src`, imported under their own package names, the rest stood in."""
    for name in [k for k in sys.modules if k == "exllamav3" or k.startswith("exllamav3.")]:
        del sys.modules[name]

    def package(name):
        m = types.ModuleType(name)
        m.__path__ = []
        sys.modules[name] = m
        return m

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    def real(name, rel):
        spec = importlib.util.spec_from_file_location(name, src / rel)
        m = importlib.util.module_from_spec(spec)
        sys.modules[name] = m
        spec.loader.exec_module(m)
        return m

    for p in ("exllamav3", "exllamav3.model", "exllamav3.util", "exllamav3.architecture", "exllamav3.cache",
              "exllamav3.modules.quant", "exllamav3.modules.quant.exl3_lib"):
        package(p)
    file_mod = real("exllamav3.util.file", "exllamav3/util/file.py")

    class Config:
        """Reads config.json through exllamav3's read_dict (the base's standard fields only)."""
        def __init__(self, directory, model_classes, **kwargs):
            self.directory = str(directory)
            self.config_dict = json.loads((Path(directory) / "config.json").read_text())
            self.vocab_size = self.read_cfg(int, ["vocab_size", "text_config->vocab_size"], None)
            self.weights = kwargs.get("weights", {})

        def read_cfg(self, *args):
            return file_mod.read_dict(self.config_dict, *args)

        def assert_cfg(self, expected_type, keys, expected_value=file_mod.no_value, optional=False):
            value = self.read_cfg(expected_type, keys, file_mod.no_value)
            if value is file_mod.no_value and not optional:
                raise ValueError(f"Key {keys} expected but not present.")
            if value is not file_mod.no_value and value != expected_value:
                raise ValueError(f"Key {keys} expected to have value {expected_value} but was {value}")

    class Model:
        def __init__(self, config, **kwargs):
            self.config, self.modules, self.caps = config, [], {}

    class Module:
        def __init__(self, config, key, qmap=None, **kwargs):
            self.config, self.key, self.caps, self.submodules = config, key, {}, []

        def register_submodule(self, m):
            self.submodules.append(m)

        def load(self, device, **kwargs):
            pass

    class Linear(Module):
        def __init__(self, config, key, in_features, out_features, **kwargs):
            super().__init__(config, key)
            self.weight = config.weights.get(f"{key}.weight")

        def forward(self, x, params):
            return F.linear(x.float(), self.weight.float())

    class RMSNorm(Module):
        """exllamav3's RMSNorm.forward_torch (x * rsqrt(mean x^2 + eps) * w), weight [groups, dim] for grouped norms."""
        def __init__(self, config, key, rms_norm_eps, tensor_weight_suffix=True, groups=1, **kwargs):
            super().__init__(config, key)
            w = config.weights.get(f"{key}.weight" if tensor_weight_suffix else key)
            self.weight = None if w is None else w.float().view(groups, -1) if groups > 1 else w.float()
            self.rms_norm_eps = rms_norm_eps

        def forward(self, x, params, out_dtype=None):
            x = x.float()
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.rms_norm_eps) * self.weight

    modules = package("exllamav3.modules")
    modules.__dict__.update(Module=Module, Linear=Linear, RMSNorm=RMSNorm, **{
        n: type(n, (Recorder,), {}) for n in ("Embedding", "GatedMLP", "BlockSparseMLP", "TransformerBlock",
                                              "HyperConnection", "ExpandStreams", "HyperHead")})
    module("exllamav3.model.config", Config=Config, no_default=file_mod.no_default)
    module("exllamav3.model.model", Model=Model)
    module("exllamav3.modules.quant.exl3_lib.ngram_codec", ROW_DIM=row_dim)
    module("exllamav3.modules.dsv4", DSV4Attention=type("DSV4Attention", (Recorder,), {}))
    module("exllamav3.modules.hyperconnections", hc_flush=lambda params: None)
    module("exllamav3.modules.attn", prepare_for_attn=lambda ids, params: ids)
    module("exllamav3.ext", exllamav3_ext=types.SimpleNamespace(ple_gate=ple_gate))
    module("exllamav3.cache.recurrent", host_copy=lambda t: t.clone())
    module("exllamav3.cache.dsa", DSV4State=object)
    module("exllamav3.constants", PAGE_SIZE=256)
    ngram = real("exllamav3.modules.ngram_embedding", "exllamav3/modules/ngram_embedding.py")

    class V41NGramEmbedding(ngram.NGramEmbedding):
        """Their NGramEmbedding (stored version) given the V4.1 constructor arguments: the three tensors its
        _load_aux reads from a checkpoint come from the config instead; rows are gathered by their hash ids."""
        def __init__(self, config, key, head_vocab_sizes, layer_multipliers, **kwargs):
            super().__init__(config, key, **kwargs)
            self.head_vocab_sizes = torch.tensor(head_vocab_sizes, dtype=torch.long)
            self.head_offsets = torch.cumsum(torch.tensor([0] + head_vocab_sizes[:-1]), 0)
            self.layer_multipliers = torch.tensor(layer_multipliers, dtype=torch.long)
            self.table = config.weights.get(f"{key}.weight")

        def forward(self, x, params, out_dtype=None):
            ids = self.compute_ngram_ids(x, x.shape[1] - self.context_len)
            return self.table[ids].float().flatten(2)

    modules.NGramEmbedding = V41NGramEmbedding
    arch_specific = real(
        "exllamav3.modules.arch_specific.deepseek_v41", "exllamav3/modules/arch_specific/deepseek_v41.py"
    )
    arch = real("exllamav3.architecture.deepseek_v41", "exllamav3/architecture/deepseek_v41.py")
    return types.SimpleNamespace(arch=arch, arch_specific=arch_specific, ngram=ngram, modules=modules)


# ---------------------------------------------------------------------------------------------------------------------
# the pack, the two sides, the comparison
# ---------------------------------------------------------------------------------------------------------------------
def build_pack(out: Path) -> Path:
    from testkit.minipacks_v41 import build_native_v41
    return build_native_v41(TINY_V4, out / "tiny_v41")


def nested_copy(pack: Path, out: Path, over: dict | None = None) -> Path:
    """The pack's config nested under text_config (as the V4.1 release and exllamav3's reader have it), with `over`."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**json.loads((pack / "config.json").read_text()), **(over or {})}
    (out / "config.json").write_text(json.dumps({"architectures": cfg["architectures"], "text_config": cfg}))
    (out / "tokenizer.json").write_bytes((pack / "tokenizer.json").read_bytes())
    return out


def their_topology(x, folder: Path) -> tuple[dict, object]:
    config = x.arch.DeepseekV41Config(str(folder))
    model = x.arch.DeepseekV41Model(config)
    layers, pending_engram = [], None
    for m in model.modules:
        if isinstance(m, x.arch_specific.EngramLayer):
            pending_engram = m
        elif type(m).__name__ == "TransformerBlock":
            a = m.kwargs["attn"].kwargs
            owner = a["kv_owner"]
            layers.append(
                {
                    "layer": m.kwargs["layer_idx"],
                    "type": a["layer_type"],
                    "ratio": a["compress_rate"],
                    "kv_source": a["kv_source"],
                    "kv_owner": None if owner is None else owner.kwargs["layer_idx"],
                    "indexer": a["indexer_mode"],
                    "candidate": a["candidate_mode"],
                    "index_topk": a["index_topk"],
                    "candidate_blocks": (a["candidate_topk_blocks"], a["candidate_block_size"])
                    if a["candidate_mode"]
                    else None,
                    "q_head_norm": a["q_head_norm"],
                    "carry_pre": m.kwargs["attn_hc"].kwargs["carry_pre"],
                    "engram_before": pending_engram is not None,
                }
            )
            pending_engram = None
    engram = {str(k): {"head_sizes": config.engram_head_vocab_sizes[k], "multipliers": config.engram_multipliers[k]}
              for k in config.engram_layer_ids}
    return {"layers": layers, "engram": engram}, config


def our_topology(cfg: dict) -> dict:
    from fidelity.oracle.deepseek.v41 import DeepseekV41Args, text_config
    from fidelity.oracle.deepseek.engram import head_vocab_sizes, layer_multipliers
    cfg = text_config(cfg)
    a = DeepseekV41Args.from_config(cfg)
    layers = []
    for i, ratio in enumerate(a.base.ratios):
        mode = a.candidate_mode(i)
        layers.append({
            "layer": i, "type": "hca" if ratio else "sliding", "ratio": ratio or None, "kv_source": a.kv_source[i],
            "kv_owner": a.kv_source[i] if ratio and a.kv_source[i] != i else None,
            "indexer": ("full" if a.index_source[i] else "shared") if ratio else None, "candidate": mode,
            "index_topk": a.base.index_topk,
            "candidate_blocks": (a.candidate_topk_blocks, a.candidate_block_size) if mode else None,
            "q_head_norm": a.q_head_norm, "carry_pre": a.carry_pre, "engram_before": i in a.engram_layers})
    sizes = head_vocab_sizes(cfg)
    cvs = int(cfg["engram_compressed_vocab_size"])
    engram = {
        str(k): {"head_sizes": sizes[k], "multipliers": layer_multipliers(k, int(cfg["engram_max_ngram_size"]), cvs)}
        for k in a.engram_layers
    }
    return {"layers": layers, "engram": engram}


def released_topology(x, folder: Path) -> dict:
    """The same topology comparison on DeepSeek-V4.1-Flash's own config (40 layers: 4 pool owners, 8 indexers of
    which 4 take a pool owner's keys, a candidate layer, ratio-1 and ratio-2 pools, two Engram layers with 24 heads):
    the shared index selections ("shared" layers) that the tiny pack does not have. No weights needed."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_oracle_deepseek_v41 import RELEASED_V41
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": RELEASED_V41["architectures"],
                                                    "text_config": RELEASED_V41}))
    row_dim, x.ngram.ROW_DIM = x.ngram.ROW_DIM, RELEASED_V41["engram_head_dim"]   # the stand-in codec's row width
    try:
        theirs, _ = their_topology(x, folder)
    finally:
        x.ngram.ROW_DIM = row_dim
    ours = our_topology({"architectures": RELEASED_V41["architectures"], "text_config": RELEASED_V41})
    modes = [layer["indexer"] for layer in theirs["layers"]]
    return {
        "layers_equal": theirs["layers"] == ours["layers"],
        "engram_config_equal": theirs["engram"] == ours["engram"],
        "layers": len(theirs["layers"]),
        "full": modes.count("full"),
        "shared": modes.count("shared"),
        "pool_readers": sum(layer["kv_owner"] is not None for layer in theirs["layers"]),
        "candidate_use": sum(layer["candidate"] == "use" for layer in theirs["layers"]),
    }


def tokens(seed: int = TOKENS_SEED) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (ROWS, LENGTH), generator=g)


def engram_weights(pack) -> dict:
    return {n: pack.tensor(n) for n in pack.names() if ".engram." in n}


def their_engram(x, folder: Path, weights: dict, layer: int, streams: torch.Tensor, ids: torch.Tensor):
    """Their EngramLayer built by their model constructor, loaded (token map from tokenizer.json), run; plus the
    hash rows its embedding computed."""
    config = x.arch.DeepseekV41Config(str(folder), weights=weights)
    model = x.arch.DeepseekV41Model(config)
    engram = next(
        m for m in model.modules if isinstance(m, x.arch_specific.EngramLayer) and m.key == f"layers.{layer}.engram"
    )
    engram.load("cpu")
    hist = torch.cat((torch.full((ids.shape[0], engram.embed.context_len), engram.pad_id, dtype=torch.long),
                      engram.token_map[ids]), dim=1)
    rows = engram.embed.compute_ngram_ids(hist, ids.shape[1])
    out = engram.forward(streams.clone(), {"input_ids": ids})
    return out, rows, engram.token_map


def our_engram(pack, cfg: dict, layer: int, streams: torch.Tensor, ids: torch.Tensor):
    from fidelity.oracle.deepseek.engram import EngramArgs, EngramLayer, RowTable, compressed_token_map, ngram_rows
    token_map = compressed_token_map(Path(pack.path) / "tokenizer.json")
    a = EngramArgs.from_config(cfg, layer, token_map)
    table = RowTable.from_pack(pack, f"layers.{layer}.engram.embed")
    wkv, k_w, q_w = (pack.tensor(n) for n in EngramLayer.names(layer))
    ours = EngramLayer(a, table, wkv, k_w, q_w)
    return ours(streams, token_map[ids]), ngram_rows(token_map[ids], a), token_map


def load_select_candidate_blocks(src: Path):
    spec = importlib.util.spec_from_file_location("v41_port_select_candidate_blocks", src / CANDIDATE_FILE)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m.select_candidate_blocks


def candidate_blocks(pack_dir: Path, ids: torch.Tensor, select) -> dict:
    """The oracle's forward over `ids`; at the candidate source layer, its index scores go to both its own filter and
    the port's `select_candidate_blocks`: the entries each query may select must be the same. Control: the port's
    function with candidate_topk_blocks one lower."""
    import fidelity.oracle.deepseek.v41 as v41
    from fidelity import open_pack
    from fidelity.oracle import Oracle
    calls, original = [], v41.candidate_drop

    def recording(scores, query_pos, ratio, block, keep):
        drop = original(scores, query_pos, ratio, block, keep)
        calls.append((scores.clone(), query_pos.clone(), ratio, block, keep, drop))
        return drop

    v41.candidate_drop = recording
    try:
        Oracle(open_pack(pack_dir)).logits(ids)
    finally:
        v41.candidate_drop = original
    out = {"queries": 0, "differing": 0, "differing_outside_ties": 0, "tied_queries": 0, "control_differing": 0,
           "control_differing_outside_ties": 0,
           "entries": None, "kept_blocks_mean": 0.0}
    for scores, pos, ratio, block, keep, drop in calls:
        W = scores.shape[-1]
        finished = torch.isfinite(scores)
        ours = ~v41.expand_blocks(drop, block, W) & finished
        lens = ((pos + 1) // ratio).view(1, -1, 1)
        theirs = select(scores, lens, keep, block) & finished
        control = select(scores, lens, keep - 1, block) & finished
        out["queries"] += scores.shape[0] * scores.shape[1]
        differ = (ours != theirs).any(-1)
        out["differing"] += int(differ.sum())
        # a query may differ only where blocks tie at the keep-th best block score: the oracle takes the lower block
        # index (its stated tie rule), the port whatever torch.topk returns
        best = F.pad(scores, (0, -W % block), value=-torch.inf).unflatten(-1, (-1, block)).amax(-1)
        best = best.masked_fill(torch.arange(best.shape[-1]) == (lens - 1) // block, torch.inf)
        threshold = best.topk(min(keep, best.shape[-1]), dim=-1).values[..., -1:]
        tied = (best == threshold).sum(-1) > 1

        def outside_ties(other):
            blocks = F.pad(ours != other, (0, -W % block)).unflatten(-1, (-1, block)).any(-1)
            return int(((blocks & ((best != threshold) | ~tied.unsqueeze(-1))).any(-1)).sum())

        out["differing_outside_ties"] += outside_ties(theirs)
        out["control_differing_outside_ties"] += outside_ties(control)
        out["tied_queries"] += int(tied.sum())
        out["control_differing"] += int((ours != control).any(-1).sum())
        out["entries"] = W
        out["kept_blocks_mean"] += float((~drop).sum())
    out["kept_blocks_mean"] = out["kept_blocks_mean"] / max(out["queries"], 1)
    out["calls"] = len(calls)
    return out


TRTLLM_FILE = "functional.py"


def default_trtllm_source() -> Path | None:
    import os
    for p in (os.environ.get("FIDELITY_V41_TRTLLM_SRC"), ROOT / ".devcarry" / "v41indep" / "trtllm_src"):
        if p and (Path(p) / TRTLLM_FILE).is_file():
            return Path(p)
    return None


def load_trtllm_engram_gate(src: Path):
    """TensorRT-LLM's `engram_gate` (modules/engram/functional.py). Without triton (a CPU-only torch) its import gets a
    stand-in triton whose jit is the identity: only the CUDA path uses the kernel, the CPU fallback is plain torch."""
    if importlib.util.find_spec("triton") is None:
        triton = types.ModuleType("triton")
        language = types.ModuleType("triton.language")
        extra = types.ModuleType("triton.language.extra")
        cuda = types.ModuleType("triton.language.extra.cuda")
        triton.jit, triton.language, language.constexpr, cuda.libdevice = (lambda f: f), language, object, None
        sys.modules.update({"triton": triton, "triton.language": language, "triton.language.extra": extra,
                            "triton.language.extra.cuda": cuda})
    spec = importlib.util.spec_from_file_location("trtllm_engram_functional", src / TRTLLM_FILE)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m.engram_gate


def engram_gate_check(pack, cfg: dict, ids: torch.Tensor, streams: torch.Tensor, gate, device: str) -> dict:
    """TensorRT-LLM's gate (keys-first WKV split, per-stream norms folded into the dot, signed square root with its
    1e-6 floor, residual add) on the oracle's WKV output, against the oracle's Engram layer. Some streams are zero:
    there the dot is exactly 0 and the floor decides the gate (sigmoid(+1e-3)). Control: rms_norm_eps 1e-2."""
    from fidelity.oracle.deepseek.engram import EngramArgs, EngramLayer, RowTable, compressed_token_map, ngram_rows
    layer = cfg["engram_layer_ids"][0]
    token_map = compressed_token_map(Path(pack.path) / "tokenizer.json")
    a = EngramArgs.from_config(cfg, layer, token_map)
    wkv, k_w, q_w = (pack.tensor(n) for n in EngramLayer.names(layer))
    table = RowTable.from_pack(pack, f"layers.{layer}.engram.embed")
    streams = streams.clone()
    streams[:, ::7, 0] = 0.0                               # exact zero dots
    ours = EngramLayer(a, table, wkv, k_w, q_w)(streams, token_map[ids])
    kv = F.linear(table.rows(ngram_rows(token_map[ids], a)).flatten(2), wkv)
    B, T, hc, D = streams.shape

    def theirs(eps):
        out = gate(streams.flatten(0, 1).to(device), kv.flatten(0, 1).to(device), q_w.view(hc, D).to(device),
                   k_w.view(hc, D).to(device), eps, add_residual=True)
        return out.cpu().view(B, T, hc, D)

    got, control = theirs(a.eps), theirs(1e-2)
    zero = torch.zeros(B, T, hc, dtype=torch.bool)
    zero[:, ::7, 0] = True
    d = (got.double() - ours.double()).abs()
    return {"device": device if device == "cpu" else torch.cuda.get_device_name(0), "eps": a.eps,
            "max_abs": float(d.max()), "rel_max": float(d.max() / (ours.double() - streams.double()).abs().max()),
            "zero_dot_max_abs": float(d[zero].max()), "zero_dot_positions": int(zero.sum()),
            "control": {"rms_norm_eps": 1e-2}, "control_max_abs": float((control.double() - ours.double()).abs().max())}


def gate_only(trtllm_src: Path, work: Path, device: str, seed: int = TOKENS_SEED) -> dict:
    """TensorRT-LLM's Engram gate alone (what a GPU run adds: its Triton kernel), on the inputs `run` uses."""
    from fidelity import open_pack
    pack_dir = build_pack(work)
    cfg = json.loads((pack_dir / "config.json").read_text())
    g = torch.Generator().manual_seed(seed + 1)
    streams = torch.randn(ROWS, LENGTH, cfg["hc_mult"], cfg["hidden_size"], generator=g)
    return engram_gate_check(open_pack(pack_dir), cfg, tokens(seed), streams, load_trtllm_engram_gate(trtllm_src),
                             device)


def run(src: Path, work: Path, seed: int = TOKENS_SEED, candidate_src: Path | None = None,
        trtllm_src: Path | None = None, gate_device: str = "cpu") -> dict:
    """Every comparison on one tiny V4.1 pack; `seed` draws the token rows and the Engram layer's input streams."""
    from fidelity import open_pack
    pack_dir = build_pack(work)
    cfg = json.loads((pack_dir / "config.json").read_text())
    x = load_exllamav3(src, row_dim=int(cfg["engram_head_dim"]))
    pack = open_pack(pack_dir)
    ids = tokens(seed)
    g = torch.Generator().manual_seed(seed + 1)
    streams = torch.randn(ROWS, LENGTH, cfg["hc_mult"], cfg["hidden_size"], generator=g)
    weights = engram_weights(pack)
    ours_topo = our_topology(cfg)
    result: dict = {"source": str(src), "pack_config": {k: cfg[k] for k in (
        "num_hidden_layers", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "index_topk",
        "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size", "engram_layer_ids",
        "engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "hc_mult", "hidden_size")},
        "rows": [ROWS, LENGTH], "seed": seed}

    theirs_topo, _ = their_topology(x, nested_copy(pack_dir, work / "exl3"))
    control_topo, _ = their_topology(x, nested_copy(pack_dir, work / "exl3_topology_control", TOPOLOGY_CONTROL))
    table_control = {"engram_compressed_vocab_size": cfg["engram_compressed_vocab_size"] + 1}
    control_tables, _ = their_topology(x, nested_copy(pack_dir, work / "exl3_table_control", table_control))
    result["topology"] = {"exllamav3": theirs_topo, "oracle": ours_topo,
                          "layers_equal": theirs_topo["layers"] == ours_topo["layers"],
                          "engram_config_equal": theirs_topo["engram"] == ours_topo["engram"],
                          "control": TOPOLOGY_CONTROL,
                          "control_layers_equal": control_topo["layers"] == ours_topo["layers"],
                          "engram_control": table_control,
                          "control_engram_equal": control_tables["engram"] == ours_topo["engram"]}

    result["released_topology"] = released_topology(x, work / "exl3_released")

    layer = cfg["engram_layer_ids"][0]
    out, rows, their_map = their_engram(x, work / "exl3", weights, layer, streams, ids)
    ours, our_rows, our_map = our_engram(pack, cfg, layer, streams, ids)
    c_out, c_rows, _ = their_engram(x, nested_copy(pack_dir, work / "exl3_engram_control", ENGRAM_CONTROL),
                                    weights, layer, streams, ids)

    def delta(a, b):
        d = (a.double() - b.double()).abs()
        return {"max_abs": float(d.max()), "mean_abs": float(d.mean()),
                "rel_max": float(d.max() / (b.double() - streams.double()).abs().max())}

    result["token_map"] = {"equal": bool(torch.equal(their_map, our_map)), "size": int(our_map.numel()),
                           "compressed": int(our_map.max()) + 1}
    result["hash_rows"] = {"equal": bool(torch.equal(rows, our_rows)), "shape": list(rows.shape),
                           "control": ENGRAM_CONTROL, "control_rows_differing": int((c_rows != our_rows).sum()),
                           "control_positions_differing": int((c_rows != our_rows).any(-1).sum())}
    result["engram_layer"] = {"exllamav3_vs_oracle": delta(out, ours), "control_vs_oracle": delta(c_out, ours)}
    if trtllm_src is not None:
        result["trtllm_engram_gate"] = engram_gate_check(pack, cfg, ids, streams, load_trtllm_engram_gate(trtllm_src),
                                                         gate_device)
    if candidate_src is not None:
        result["candidate_blocks"] = candidate_blocks(pack_dir, ids, load_select_candidate_blocks(candidate_src))
    return result


def table(r: dict) -> str:
    t, h, e = r["topology"], r["hash_rows"], r["engram_layer"]
    released = r["released_topology"]
    lines = header("piece (exllamav3's code vs the oracle)", "agreement", "control: exllamav3 with one field changed")
    lines += [
        f"| layer topology ({len(t['oracle']['layers'])} layers: type, ratio, KV pool source/owner, indexer "
        f"full/shared, candidate role + blocks, index_topk, q-head norm, carry_pre, Engram placement) | "
        f"{'equal' if t['layers_equal'] else 'DIFFERENT'} | {t['control']}: "
        f"{'equal (control failed)' if t['control_layers_equal'] else 'differs'} |",
        f"| the same on DeepSeek-V4.1-Flash's config ({released['layers']} layers: "
        f"{released['full']} full / {released['shared']} shared indexers, "
        f"{released['pool_readers']} pool readers, {released['candidate_use']} "
        f"candidate users; 2 x 24 Engram heads) | "
        f"{'equal' if released['layers_equal'] and released['engram_config_equal'] else 'DIFFERENT'} | |",
        f"| Engram head table sizes + hash multipliers | {'equal' if t['engram_config_equal'] else 'DIFFERENT'} | "
        f"{t['engram_control']}: {'equal (control failed)' if t['control_engram_equal'] else 'differs'} |",
        f"| compressed vocabulary ({r['token_map']['size']} -> {r['token_map']['compressed']}) | "
        f"{'equal' if r['token_map']['equal'] else 'DIFFERENT'} | |",
        f"| n-gram hash rows {h['shape']} | {'equal' if h['equal'] else 'DIFFERENT'} | {h['control']}: "
        f"{h['control_rows_differing']} rows at {h['control_positions_differing']} positions differ |",
        f"| Engram layer output (fp32) | max abs {e['exllamav3_vs_oracle']['max_abs']:.2e} (rel "
        f"{e['exllamav3_vs_oracle']['rel_max']:.1e}) | max abs {e['control_vs_oracle']['max_abs']:.2e} |",
    ]
    lines += present_lines(r, {"trtllm_engram_gate": engram_gate_row, "candidate_blocks": candidate_blocks_row})
    return "\n".join(lines)


def engram_gate_row(g: dict) -> str:
    return (f"| Engram gate: TensorRT-LLM's `engram_gate` on the oracle's WKV output ({g['device']}; "
            f"{g['zero_dot_positions']} stream rows with an exact zero dot) | max abs {g['max_abs']:.2e} (rel "
            f"{g['rel_max']:.1e}); at the zero dots {g['zero_dot_max_abs']:.1e} | rms_norm_eps 1e-2: "
            f"{g['control_max_abs']:.1e} |")


def candidate_blocks_row(c: dict) -> str:
    return (f"| candidate blocks (Ascend port's select_candidate_blocks on the oracle's index scores, "
            f"{c['queries']} queries x {c['entries']} entries) | {c['queries'] - c['differing']}/{c['queries']} "
            f"queries equal, {c['differing_outside_ties']} differ outside a tie at the cut (the other "
            f"{c['differing'] - c['differing_outside_ties']} differ only among blocks tied there; "
            f"{c['tied_queries']} queries have such a tie) | candidate_topk_blocks - 1: "
            f"{c['control_differing_outside_ties']} differ outside ties |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, nargs="?", help="folder with exllamav3's V4.1 sources (default: "
                    "$FIDELITY_EXLLAMAV3_V41_SRC or .devcarry/v41indep/exl3src)")
    ap.add_argument("--candidate-src", type=Path, help="folder with the Ascend port's select_candidate_blocks.py "
                    "(default: $FIDELITY_V41_CANDIDATE_SRC or .devcarry/v41indep/ascend_src)")
    ap.add_argument("--trtllm-src", type=Path, help="folder with TensorRT-LLM's modules/engram/functional.py "
                    "(default: $FIDELITY_V41_TRTLLM_SRC or .devcarry/v41indep/trtllm_src)")
    ap.add_argument("--gate-device", default="cpu", help="where TensorRT-LLM's gate runs (cuda: its Triton kernel)")
    ap.add_argument(
        "--gate-only", action="store_true", help="only TensorRT-LLM's Engram gate (e.g. with --gate-device cuda)"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.gate_only:
        with tempfile.TemporaryDirectory() as tmp:
            r = gate_only(args.trtllm_src or default_trtllm_source(), Path(tmp), args.gate_device)
        if args.json:
            args.json.write_text(json.dumps(r, indent=1))
        print(json.dumps(r, indent=1))
        return 0
    src = args.src or default_source()
    if src is None:
        ap.error("no exllamav3 V4.1 source folder (give SRC)")
    with tempfile.TemporaryDirectory() as tmp:
        r = run(src, Path(tmp), candidate_src=args.candidate_src or default_candidate_source(),
                trtllm_src=args.trtllm_src or default_trtllm_source(), gate_device=args.gate_device)
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    print(table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
