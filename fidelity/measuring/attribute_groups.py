"""Module groups for `attribute`: which tensors (in the reference's spelling) a swap-one-in group names, and where in
the pass a group is first read."""
from __future__ import annotations

import re

from ..errors import ConfigError

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
MODULES = ("layer", "block", "expert")

def block_of(name: str) -> str:
    """The block kind of a layer tensor: engram, attention, router, experts, shared_experts, mlp or other."""
    if ".engram." in name:
        return "engram"
    if ".experts." in name:
        return "experts"
    if "shared_expert" in name:
        return "shared_experts"
    if re.search(r"\.gate\.(weight|bias|e_score_correction_bias)$", name) or "e_score_correction_bias" in name:
        return "router"
    if "attn" in name or "input_layernorm" in name:
        return "attention"
    if "mlp" in name or "ffn" in name or "post_attention_layernorm" in name:
        return "mlp"
    return "other"

def table_name(layer: int) -> str:
    """The name a group gives layer `layer`'s Engram table (V4.1): read row by row from the pack its family is bound
    to, never through fetch, so it is swapped as a whole (`Reader.tables`)."""
    return f"layers.{layer}.engram.embed"

def reads_table(family, layer: int) -> bool:
    """Whether the family's layer reads an Engram table (its Engram tensors are among the layer's names)."""
    return hasattr(family, "table") and any(".engram." in n for n in family.layer_names(layer))

def table_layer(name: str) -> int | None:
    m = re.fullmatch(r"layers\.(\d+)\.engram\.embed", name)
    return int(m.group(1)) if m else None

def module_groups(family, modules: str = "block") -> dict[str, list[str]]:
    """Group name -> the tensor names the oracle reads for it (in the reference's spelling; an Engram table as
    `table_name(layer)`). Layer groups are `layers.{i}.{block}` (block mode), `layers.{i}` (layer mode) or also
    `layers.{i}.experts.{e}` (expert mode); then `embedding` and `head` (the final norm and the untied head; with tied
    embeddings the embedding group is the head too)."""
    if modules not in MODULES:
        raise ConfigError(f"--modules {modules!r}: expected one of {list(MODULES)}")
    groups: dict[str, list[str]] = {}
    for i in range(family.n_layers):
        for name in family.layer_names(i) + ([table_name(i)] if reads_table(family, i) else []):
            if modules == "layer":
                key = f"layers.{i}"
            else:
                key = f"layers.{i}.{block_of(name)}"
                if modules == "expert" and ".experts." in name:
                    key += "." + name.split(".experts.")[1].split(".")[0]
            groups.setdefault(key, []).append(name)
    groups["embedding"] = [family.embed_name]
    groups["head"] = [family.norm_name] + ([] if family.tie_word_embeddings else [family.head_name])
    return groups

def first_layer(names: list[str], n_layers: int) -> int:
    """The first place a group's tensors are read: -1 the embeddings, a layer index, or n_layers (norm and head)."""
    where = []
    for n in names:
        m = LAYER.search(n)
        where.append(int(m.group(1)) if m else (-1 if "embed" in n else n_layers))
    return min(where)

def one_layer(names: list[str]) -> int | None:
    """The layer a group's tensors all belong to, or None (embedding, head, or several layers)."""
    where = {int(m.group(1)) if m else None for m in (LAYER.search(n) for n in names)}
    return where.pop() if len(where) == 1 and None not in where else None
