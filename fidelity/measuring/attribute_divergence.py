"""How far a pack is from its reference, tensor by tensor (`weight_error`, Engram tables row by row: `table_error`,
and the error's structure: `error_scale_corr`) and layer by layer along a pass (`hidden_divergence`, per
hyper-connection stream `stream_divergence`); the definitions are `fidelity.measuring.attribute`'s."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import PackError
from .attribute_groups import LAYER, block_of, table_layer, table_name

ERROR_GROUP = 16      # err_scale_corr's group: the k-quants' sub-block (Q2_K..Q6_K: 16; Q4_K/Q5_K's 32 are two of them)

def weight_error(ref_w: torch.Tensor, pack_w: torch.Tensor) -> dict:
    r, d = ref_w.double(), pack_w.double() - ref_w.double()
    ref2, err2 = float((r * r).sum()), float((d * d).sum())
    corr, groups = error_scale_corr(r, d) if err2 else (None, 0)
    return {"ref_norm": math.sqrt(ref2), "err_norm": math.sqrt(err2),
            "rel_fro": math.sqrt(err2 / ref2) if ref2 else (0.0 if err2 == 0 else math.inf),
            "sqnr_db": 10 * math.log10(ref2 / err2) if err2 else math.inf,
            "err_scale_corr": corr, "err_scale_groups": groups}

def error_scale_corr(w: torch.Tensor, d: torch.Tensor, group: int = ERROR_GROUP) -> tuple[float | None, int]:
    """Pearson r between the error's RMS and the weight's max |w| over groups of `group` consecutive weights along the
    last axis, and the number of groups; (None, 0) for a tensor that is not 2-D, whose rows do not split into groups,
    or whose error or weights are constant over the groups."""
    if w.dim() != 2 or w.shape[1] % group or w.numel() < 2 * group:
        return None, 0
    e = d.double().reshape(-1, group).pow(2).mean(1).sqrt()
    m = w.double().reshape(-1, group).abs().amax(1)
    e, m = e - e.mean(), m - m.mean()
    den = float(e.norm() * m.norm())
    return (float((e * m).sum()) / den if den else None), e.numel()

TABLE_CHUNK_ROWS = 1 << 16     # Engram table rows read at once for its weight error

def table_error(ref_table, pack_table, chunk_rows: int = TABLE_CHUNK_ROWS, group: int = ERROR_GROUP) -> dict:
    """weight_error of an Engram table ([rows, dim], `RowTable`s of each pack), read `chunk_rows` rows at a time (a
    table need not fit in memory at once); err_scale_corr from running sums over the groups."""
    if (ref_table.n_rows, ref_table.dim) != (pack_table.n_rows, pack_table.dim):
        raise PackError(f"the pack's Engram table is [{pack_table.n_rows}, {pack_table.dim}], the reference's "
                        f"[{ref_table.n_rows}, {ref_table.dim}]", file=pack_table.parts[0][0])
    ref2 = err2 = 0.0
    sums = np.zeros(5)                      # sum e, sum m, sum e^2, sum m^2, sum e m over the groups
    grouped = ref_table.dim % group == 0 and ref_table.n_rows * ref_table.dim >= 2 * group
    for start in range(0, ref_table.n_rows, chunk_rows):
        index = torch.arange(start, min(start + chunk_rows, ref_table.n_rows))
        r = ref_table.rows(index).double()
        d = pack_table.rows(index).double() - r
        ref2 += float((r * r).sum())
        err2 += float((d * d).sum())
        if grouped:
            e = d.reshape(-1, group).pow(2).mean(1).sqrt()
            m = r.reshape(-1, group).abs().amax(1)
            sums += [float(e.sum()), float(m.sum()), float((e * e).sum()), float((m * m).sum()), float((e * m).sum())]
    n = ref_table.n_rows * ref_table.dim // group if grouped and err2 else 0
    corr = None
    if n:
        se, sm, see, smm, sem = sums
        den = math.sqrt(max(see - se * se / n, 0.0) * max(smm - sm * sm / n, 0.0))
        corr = (sem - se * sm / n) / den if den else None
    return {"ref_norm": math.sqrt(ref2), "err_norm": math.sqrt(err2),
            "rel_fro": math.sqrt(err2 / ref2) if ref2 else (0.0 if err2 == 0 else math.inf),
            "sqnr_db": 10 * math.log10(ref2 / err2) if err2 else math.inf,
            "err_scale_corr": corr, "err_scale_groups": n}

def pooled_scale_corr(stats: list[tuple[float | None, int]]) -> tuple[float | None, float | None]:
    """(sum r_i n_i / sum n_i, sum r_i n_i / sqrt(sum n_i)) over the tensors that have r."""
    stats = [(r, n) for r, n in stats if r is not None]
    n = sum(k for _, k in stats)
    if not n:
        return None, None
    s = sum(r * k for r, k in stats)
    return s / n, s / math.sqrt(n)

@dataclass
class WeightErrors:
    """Per tensor the oracle reads (Engram tables row by row): `tensors` (the report's rows), `norm` (name ->
    ||W_pack - W_ref||_F) and `scale_corr` (name -> (err_scale_corr, its groups))."""
    tensors: list[dict]
    norm: dict[str, float]
    scale_corr: dict[str, tuple]

    @classmethod
    def measure(cls, ref, pack, fam, names_in_pack: dict[str, str], tables: dict, progress: bool) -> "WeightErrors":
        out = cls([], {}, {})
        for name in tqdm(fam.required_names() + [table_name(i) for i in tables], desc="weights", disable=not progress,
                         leave=False):
            if name in out.norm:
                continue
            stored = names_in_pack.get(name, name)
            layer = table_layer(name)
            if layer is not None:
                e, numel = table_error(*tables[layer]), tables[layer][0].n_rows * tables[layer][0].dim
            else:
                w_ref, w_pack = ref.tensor(name), pack.tensor(stored)
                if tuple(w_ref.shape) != tuple(w_pack.shape):
                    raise PackError(f"pack tensor shape {list(w_pack.shape)} differs from the reference's "
                                    f"{list(w_ref.shape)} (the reference's {name!r})",
                                    file=getattr(pack, "path", None), tensor=stored)
                e, numel = weight_error(w_ref, w_pack), w_ref.numel()
            m = LAYER.search(name)
            out.tensors.append({"tensor": name, "pack_tensor": stored, "layer": int(m.group(1)) if m else None,
                                "block": block_of(name) if m else ("embedding" if "embed" in name else "head"),
                                "numel": numel, **e})
            out.norm[name] = e["err_norm"]
            out.scale_corr[name] = (e["err_scale_corr"], e["err_scale_groups"])
        return out

    def group_norm(self, names: list[str]) -> float:
        return math.sqrt(sum(self.norm.get(n, 0.0) ** 2 for n in names))

def hidden_divergence(ref_h: list[torch.Tensor], pack_h: list[torch.Tensor]) -> dict:
    """ref_h / pack_h: the batches' activations [..., hidden], same shapes; positions = every leading index."""
    ref2 = err2 = 0.0
    cos_sum, n = 0.0, 0
    for r, p in zip(ref_h, pack_h):
        r, p = r.double().reshape(-1, r.shape[-1]), p.double().reshape(-1, p.shape[-1])
        d = p - r
        ref2 += float((r * r).sum())
        err2 += float((d * d).sum())
        cos_sum += float(F.cosine_similarity(p, r, dim=-1, eps=1e-300).sum())
        n += r.shape[0]
    return {"rel_fro": math.sqrt(err2 / ref2) if ref2 else math.nan,
            "sqnr_db": 10 * math.log10(ref2 / err2) if err2 else math.inf, "cosine": cos_sum / n if n else math.nan}

def stream_divergence(ref_h: list[torch.Tensor], pack_h: list[torch.Tensor]) -> list[dict]:
    """Hyper-connection streams [B, T, hc, hidden]: hidden_divergence of each stream alone; [] for [B, T, hidden]."""
    if not ref_h or ref_h[0].dim() != 4:
        return []
    return [{"stream": s, **hidden_divergence([r[:, :, s] for r in ref_h], [p[:, :, s] for p in pack_h])}
            for s in range(ref_h[0].shape[2])]
