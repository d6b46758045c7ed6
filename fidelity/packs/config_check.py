"""Do a pack's tensor shapes agree with its config.json? (embeddings, head, attention and dense-MLP projections, norms,
layer count). `config_problems` lists disagreements for `fidelity inspect`; `check_against_config` raises the first."""
from __future__ import annotations

import re

from ..errors import PackError
from .base import Pack

# the language model's own tensors (not a vision or audio tower's): optional multimodal prefix, then the HF names
_LM = r"^(?:model\.language_model\.|language_model\.model\.|language_model\.|model\.)?"
_LAYER = re.compile(_LM + r"layers\.(\d+)\.")


def _dims(cfg: dict) -> dict[str, int]:
    """Named sizes the checks below use; a size the config does not give is left out (its checks are skipped)."""
    d = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads") if cfg.get(k)}
    heads = d.get("num_attention_heads")
    if heads and "hidden_size" in d:
        if cfg.get("kv_lora_rank") is not None:  # MLA (DeepSeek): q heads carry nope+rope dims, o_proj reads v dims
            d["q_out"] = heads * (cfg.get("qk_nope_head_dim", 0) + cfg.get("qk_rope_head_dim", 0))
            d["o_in"] = heads * cfg.get("v_head_dim", 0)
        else:
            head_dim = cfg.get("head_dim") or d["hidden_size"] // heads
            d["q_out"] = heads * head_dim * (2 if cfg.get("attn_output_gate") else 1)  # Qwen3-Next gates from q_proj
            d["o_in"] = heads * head_dim
            d["kv_out"] = (cfg.get("num_key_value_heads") or heads) * head_dim
    return d


# logical-name pattern -> expected shape as config size names
_EXPECTED: list[tuple[re.Pattern, tuple[str, ...]]] = [(re.compile(p), s) for p, s in [
    (_LM + r"embed_tokens\.weight$", ("vocab_size", "hidden_size")),
    (r"^(?:language_model\.)?lm_head\.weight$", ("vocab_size", "hidden_size")),
    (_LM + r"layers\.\d+\.self_attn\.q_proj\.weight$", ("q_out", "hidden_size")),
    (_LM + r"layers\.\d+\.self_attn\.[kv]_proj\.weight$", ("kv_out", "hidden_size")),
    (_LM + r"layers\.\d+\.self_attn\.o_proj\.weight$", ("hidden_size", "o_in")),
    (_LM + r"layers\.\d+\.mlp\.(gate|up)_proj\.weight$", ("intermediate_size", "hidden_size")),
    (_LM + r"layers\.\d+\.mlp\.down_proj\.weight$", ("hidden_size", "intermediate_size")),
    (_LM + r"(layers\.\d+\.(input_layernorm|post_attention_layernorm)|norm)\.weight$", ("hidden_size",)),
]]


def _config_file(pack: Pack) -> str:
    root = getattr(pack, "root", None) or pack.path
    return str(root / "config.json") if root.is_dir() else str(root)


def config_problems(pack: Pack) -> list[PackError]:
    """Every disagreement, each a PackError naming the tensor and its file."""
    return [PackError(msg, file=file, tensor=tensor) for msg, file, tensor in _disagreements(pack)]


def _disagreements(pack: Pack) -> list[tuple[str, str, str]]:
    cfg = pack.config.get("text_config") or pack.config
    if not cfg:
        return []
    dims = _dims(cfg)
    where = _config_file(pack)
    problems = []
    layers = set()
    for name in pack.names():
        m = _LAYER.match(name)
        if m:
            layers.add(int(m.group(1)))
        s = pack.storage(name)
        if s.format == "absent":
            continue
        for pattern, sizes in _EXPECTED:
            if not pattern.search(name) or not all(k in dims for k in sizes):
                continue
            want = tuple(dims[k] for k in sizes)
            if tuple(s.shape) != want:
                problems.append((f"shape {list(s.shape)} disagrees with {where}: {' x '.join(sizes)} = {list(want)}",
                                 s.files[0] if s.files else str(pack.path), name))
            break
    n_layers = cfg.get("num_hidden_layers")
    if n_layers and layers:
        extra = cfg.get("num_nextn_predict_layers") or 0  # DeepSeek's multi-token-prediction layers follow the stack
        missing = sorted(set(range(n_layers)) - layers)
        beyond = sorted(i for i in layers if i >= n_layers + extra)
        if missing:
            problems.append((f"{where} says num_hidden_layers={n_layers} but the pack has no tensors for layers "
                             f"{missing[:5]}{'...' if len(missing) > 5 else ''}", str(pack.path),
                             f"model.layers.{missing[0]}"))
        if beyond:
            problems.append((f"{where} says num_hidden_layers={n_layers} but the pack has layers up to {beyond[-1]}",
                             str(pack.path), f"model.layers.{beyond[0]}"))
    return problems


def check_against_config(pack: Pack) -> None:
    """Raise the first disagreement between the pack's tensor shapes and its config (a PackError naming the tensor)."""
    problems = _disagreements(pack)
    if problems:
        msg, file, tensor = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PackError(msg + more, file=file, tensor=tensor)
