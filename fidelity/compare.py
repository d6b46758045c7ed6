"""compare(): how far each pack is from the reference on a panel, per domain, with honest uncertainty.

The reference pack is run through the exact fp32 oracle (or read from a reference store); every candidate pack is run
through the same oracle code on the same tokens; per position the full-vocabulary KL(P_ref || Q_pack), top-1 agreement
and true-token NLLs are computed (`fidelity.metrics`) and summarised with row-bootstrap CIs (`fidelity.stats`). Every pair
of candidates is compared on the same positions. A noise floor (the reference re-run with a tiny seeded perturbation of
every attention and MLP output, about one bf16 rounding step) says what KL means "indistinguishable from the reference".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from . import __version__
from .errors import PackError
from .metrics import PositionMetrics, position_metrics
from .panels import Panel, TokenizedRow, load_panel, tokenize_panel, tokenizer_fingerprint
from .stats import RowGroups, paired_difference, summarize
from .store import ReferenceRun, check_topk, load_store, run_reference, scored_index

NOISE_REL = 2.0 ** -8   # one bf16 rounding step is at most 2^-8 relative (half of its 2^-7 spacing near 1)


@dataclass
class CompareResult:
    report: dict                                   # the JSON document
    metrics: dict[str, PositionMetrics] = field(default_factory=dict)   # label -> per scored position
    rows: list[TokenizedRow] = field(default_factory=list)
    groups: RowGroups | None = None


def vocab_size(pack) -> int:
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        if name in pack:
            return int(pack.storage(name).shape[0])
    return int(pack.config.get("vocab_size", 0))


def check_same_vocab(ref, pack) -> None:
    a, b = vocab_size(ref), vocab_size(pack)
    if a != b:
        raise PackError(f"packs have different vocabularies: reference {ref.path} has {a} tokens, {pack.path} has {b}; "
                        f"KL needs one vocabulary", file=pack.path)


def _oracle(pack, device: str):
    from . import distributed
    from .oracle import Oracle
    return distributed.parallelize(Oracle(pack, device=distributed.local_device(device)))


def perturbed_oracle(pack, device: str = "cpu", seed: int = 0, rel: float = NOISE_REL):
    """An Oracle whose every layer's attention and MLP outputs are multiplied by (1 + rel * u), u ~ U(-1, 1), from a
    generator seeded per (seed, layer, module): a reproducible stand-in for bf16 rounding of each module output. It hooks
    `Oracle.load_layer` (the one place layers are built) and wraps the layer's `attn` / `mlp` callables, or the whole
    layer for families without them."""
    from .oracle import Oracle

    class PerturbedOracle(Oracle):
        def load_layer(self, i: int):
            layer = super().load_layer(i)
            wrapped = False
            for j, attr in enumerate(("attn", "mlp")):
                fn = getattr(layer, attr, None)
                if callable(fn):
                    setattr(layer, attr, _perturb(fn, seed * 1_000_003 + 2 * i + j, rel))
                    wrapped = True
            return layer if wrapped else _perturb(layer, seed * 1_000_003 + 2 * i, rel)

    from . import distributed  # prefetch, and row/expert parallel under torchrun, as for every oracle here
    return distributed.parallelize(PerturbedOracle(pack, device=distributed.local_device(device)))


def _perturb(fn, seed: int, rel: float):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        g = torch.Generator(device="cpu").manual_seed(seed)
        u = torch.rand(out.shape, generator=g, dtype=out.dtype).to(out.device).mul_(2).sub_(1)
        return out + out * u * rel
    return wrapped


def _row_metrics(ref: ReferenceRun, ref_oracle, pack_hidden: list[torch.Tensor], pack_oracle, *, store_path=None,
                 desc: str = "metrics", progress: bool = True) -> PositionMetrics:
    parts = []
    for i in tqdm(range(len(ref.rows)), desc=desc, disable=not progress, unit="row", leave=False):
        ref_logits = ref_oracle.apply_head(ref.hidden[i]).float()
        if ref.topk is not None:
            check_topk(ref, i, ref_logits, store_path)
        pack_logits = pack_oracle.apply_head(pack_hidden[i]).float()
        parts.append(position_metrics(ref_logits, pack_logits, ref.targets[i], reverse=True))
    return PositionMetrics.concat(parts)


def _pack_hidden(oracle, rows: list[TokenizedRow], progress: bool) -> list[torch.Tensor]:
    full = oracle.hidden_states([r.tokens for r in rows], progress=progress)
    return [h[scored_index(r)[0]].to(torch.float32) for r, h in zip(rows, full)]


def _label(path, labels, i) -> str:
    if labels and i < len(labels):
        return labels[i]
    p = Path(path)
    return p.stem if p.is_file() else p.name


def prepare(reference, panel: Panel | str | Path | None, *, truncate: bool = False):
    """(reference pack, panel, tokenized rows, tokenizer fingerprint)."""
    from .packs import open_pack
    from .packs.tokenizer import load_tokenizer

    ref_pack = reference if hasattr(reference, "names") else open_pack(reference)
    panel = panel if isinstance(panel, Panel) else load_panel(panel)
    tok = load_tokenizer(ref_pack)
    max_len = ref_pack.config.get("max_position_embeddings")
    rows = tokenize_panel(panel, tok, max_len=max_len, truncate=truncate)
    return ref_pack, panel, rows, tokenizer_fingerprint(tok)


def compare(reference, packs: list, *, panel: Panel | str | Path | None = None, reference_store: str | Path | None = None,
            device: str = "cpu", labels: list[str] | None = None, noise_floor: bool = True, n_boot: int = 2000,
            seed: int = 0, truncate: bool = False, progress: bool = True) -> CompareResult:
    """Measure each pack in `packs` against `reference` (paths or Pack objects) on `panel` (default: panels/default)."""
    from .packs import open_pack

    ref_pack, panel, rows, tok_fp = prepare(reference, panel, truncate=truncate)
    cand = [p if hasattr(p, "names") else open_pack(p) for p in packs]
    for p in cand:
        check_same_vocab(ref_pack, p)
    ref_oracle = _oracle(ref_pack, device)
    if reference_store is not None:
        ref = load_store(reference_store, panel, rows, pack_fingerprint=ref_pack.fingerprint(), tokenizer_fingerprint=tok_fp,
                         oracle=ref_oracle)
    else:
        ref = run_reference(ref_oracle, rows, progress=progress)
    groups = RowGroups.build(np.repeat(np.arange(len(rows)), [len(t) for t in ref.targets]), [r.domain for r in rows])

    noise = None
    if noise_floor:
        noisy = perturbed_oracle(ref_pack, device=device, seed=seed)
        noise_pm = _row_metrics(ref, ref_oracle, _pack_hidden(noisy, rows, progress), ref_oracle,
                                store_path=reference_store, desc="noise floor", progress=progress)
        noise = summarize(noise_pm, groups, n_boot=n_boot, seed=seed)["overall"]

    results, metrics = [], {}
    for i, pack in enumerate(cand):
        label = _label(pack.path, labels, i)
        if label in metrics:
            label = f"{label}#{i}"
        oracle = _oracle(pack, device)
        pm = _row_metrics(ref, ref_oracle, _pack_hidden(oracle, rows, progress), oracle, store_path=reference_store,
                          desc=label, progress=progress)
        oracle.release()
        metrics[label] = pm
        summary = summarize(pm, groups, n_boot=n_boot, seed=seed)
        ov = summary["overall"]
        ov["noise_floor_kld"] = noise["kld_mean"] if noise else None
        ov["x_noise_floor"] = (ov["kld_mean"] / noise["kld_mean"]) if noise and noise["kld_mean"] and ov["kld_mean"] is not None else None
        bits = pack.bits_per_weight().rows
        results.append({"pack": str(Path(pack.path).resolve()), "label": label, "format": pack.format,
                        "fingerprint": pack.fingerprint(),
                        "bpw": (bits.get("all_linear") or bits.get("total") or {}).get("bpw"),
                        "overall": ov, "domains": summary["domains"]})
    labels_ = list(metrics)
    paired = []
    for a in range(len(labels_)):
        for b in range(a + 1, len(labels_)):
            d = paired_difference(metrics[labels_[a]], metrics[labels_[b]], groups, n_boot=n_boot, seed=seed)
            paired.append({"a": labels_[a], "b": labels_[b], **d})
    report = {
        "fidelity_version": __version__,
        "direction": "KL(P_reference || Q_pack), nats per scored token",
        "panel": {"name": panel.name, "sha256": panel.sha256, "rows": len(rows), "scored_positions": ref.scored_positions,
                  "domains": panel.domains},
        "reference": {"path": str(Path(ref_pack.path).resolve()), "fingerprint": ref_pack.fingerprint(), "format": ref_pack.format,
                      "store": str(Path(reference_store).resolve()) if reference_store else None},
        "noise_floor": noise,
        "results": results,
        "paired": paired,
    }
    return CompareResult(report, metrics, rows, groups)


def write_records(result: CompareResult, out_dir: str | Path) -> list[Path]:
    """Per-position records of every pack (Parquet): row id, domain, position, target token and every metric."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    row_ids, domains, positions, targets = [], [], [], []
    for r in result.rows:
        pos, tgt = scored_index(r)
        row_ids += [r.id] * len(pos)
        domains += [r.domain] * len(pos)
        positions += (pos + 1).tolist()
        targets += tgt.tolist()
    written = []
    for label, pm in result.metrics.items():
        cols = {"row_id": row_ids, "domain": domains, "position": positions, "token": targets}
        cols.update({k: v for k, v in pm.to_numpy().items()})
        path = out / f"{label}.parquet"
        pq.write_table(pa.table(cols), path)
        written.append(path)
    return written
