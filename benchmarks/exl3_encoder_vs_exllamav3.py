"""Our reference EXL3 encoder against exllamav3 1.6.5's quantizer on the golden linears (../shared/golden/exl3).

For every golden (codebook, K, shape): exllamav3's decoded weight error (its `recon`, with the Hessian it was given)
against ours, both without a Hessian (plain weight MSE, what `encode(w, K, cb)` optimises) and with the same Hessian
(rebuilt from the golden README's recipe; it reproduces the recorded proxy errors to 4 digits). Ratios ours/exllamav3:

    python benchmarks/exl3_encoder_vs_exllamav3.py [--golden DIR] [--device cuda] [--json out.json] \
        [--only k4.mul1.s256x128]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fidelity.packs.exl3 import encoder as exl3_encoder

SHAPES = ["s256x128", "s384x256", "s200x100p"]


def golden_hessian(shape_index: int, in_features: int) -> torch.Tensor:
    """H = X^T X, X (2048, in) = randn * exp(0.5 randn per channel), seed 7 + shape index, rounded to fp16."""
    g = torch.Generator().manual_seed(7 + shape_index)
    X = torch.randn(2048, in_features, generator=g) * torch.exp(0.5 * torch.randn(in_features, generator=g))
    X = X.half().float()
    return X.t() @ X


def errors(w: torch.Tensor, w_hat: torch.Tensor, H: torch.Tensor) -> tuple[float, float]:
    """(plain MSE, proxy tr(E^T H E) / tr(W^T H W)) for w, w_hat in [in, out] orientation."""
    e = (w - w_hat).double()
    Hd = H.double()
    return e.pow(2).mean().item(), (torch.trace(e.t() @ Hd @ e) / torch.trace(w.double().t() @ Hd @ w.double())).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--golden", default=str(Path(__file__).resolve().parents[2] / "shared" / "golden" / "exl3"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="comma-separated prefixes like k4.mul1.s256x128")
    ap.add_argument("--no-hessian-runs", action="store_true")
    args = ap.parse_args()
    rows = []
    for cb, fname in (("3inst", "linears_3inst.safetensors"), ("mul1", "linears_mul1.safetensors")):
        path = Path(args.golden) / fname
        d = load_file(path)
        meta = json.loads(safe_open(str(path), "pt").metadata()["json"])["entries"]
        for prefix, e in meta.items():
            name = prefix.rstrip(".")
            if args.only and name not in args.only.split(","):
                continue
            shape = e["shape_name"]
            w = d[f"weight.{shape}"].float()                       # [in, out] (unpadded)
            inn, out = w.shape
            H = golden_hessian(SHAPES.index(shape), inn)
            theirs = d[f"{prefix}recon"].float()[:inn, :out]
            mse_x, proxy_x = errors(w, theirs, H)
            row = {"name": name, "codebook": cb, "K": e["K"], "shape": shape, "exl3_mse": mse_x, "exl3_proxy": proxy_x}
            t0 = time.perf_counter()
            enc = exl3_encoder.encode(w.t().to(args.device), e["K"], cb)
            row["ours_mse"], row["ours_proxy_noH"] = errors(w, enc.weight.t().cpu(), H)
            row["t_noH"] = time.perf_counter() - t0
            if not args.no_hessian_runs:
                t0 = time.perf_counter()
                enc_h = exl3_encoder.encode(w.t().to(args.device), e["K"], cb, hessian=H.to(args.device))
                row["oursH_mse"], row["oursH_proxy"] = errors(w, enc_h.weight.t().cpu(), H)
                row["t_H"] = time.perf_counter() - t0
            rows.append(row)
            msg = f"{name:22s} mse ours/exl3 {row['ours_mse'] / mse_x:5.3f}"
            if "oursH_proxy" in row:
                msg += (
                    f"  proxy(H) ours/exl3 {row['oursH_proxy'] / proxy_x:5.3f}"
                    f"  mse(H) ours/exl3 {row['oursH_mse'] / mse_x:5.3f}"
                )
            print(msg + f"  ({row['t_noH']:.1f}s)", flush=True)
    worst = max(r["ours_mse"] / r["exl3_mse"] for r in rows)
    print(f"worst plain-MSE ratio ours/exllamav3 without a Hessian: {worst:.3f} over {len(rows)} linears")
    if any("oursH_proxy" in r for r in rows):
        print(f"worst proxy ratio with the Hessian: {max(r['oursH_proxy'] / r['exl3_proxy'] for r in rows):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
