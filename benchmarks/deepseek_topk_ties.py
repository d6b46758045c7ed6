"""Where CUDA and the CPU keep different top-k entries in the DeepSeek oracles (diagnostic, device machine).

Runs a pack's oracle on the CPU and on CUDA (float64) while recording every torch.topk call, then, call by call, counts
the rows whose kept index sets differ and how many of those had a tie at the k-th best value (more entries equal to it
than places left), and which rule each device's choice among the tied entries follows. Prints a table and the
per-position logit gap.

    python benchmarks/deepseek_topk_ties.py [--length 103] [--v32]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # testkit
sys.path.insert(0, str(ROOT / "tests"))

from fidelity import open_pack  # noqa: E402
from fidelity.oracle import Oracle  # noqa: E402


class TopkRecorder:
    def __init__(self):
        self.calls = []
        self.method, self.function = torch.Tensor.topk, torch.topk

    def __enter__(self):
        method = self.method

        def recorded(x, k, dim=-1, largest=True, sorted=True):
            out = method(x, k, dim, largest, sorted)
            self.calls.append((x.detach().cpu().clone(), int(k), dim, out.indices.detach().cpu().clone()))
            return out

        torch.Tensor.topk = recorded
        torch.topk = recorded
        return self

    def __exit__(self, *exc):
        torch.Tensor.topk, torch.topk = self.method, self.function


def lowest_index_set(row: torch.Tensor, k: int) -> set:
    order = torch.sort(row, descending=True, stable=True).indices[:k]
    return set(order.tolist())


def compare(cpu_calls, gpu_calls) -> list[dict]:
    out = []
    for n, ((x, k, dim, ci), (y, _, _, gi)) in enumerate(zip(cpu_calls, gpu_calls)):
        xs, ci, gi, ys = x.movedim(dim, -1), ci.movedim(dim, -1), gi.movedim(dim, -1), y.movedim(dim, -1)
        rows = xs.reshape(-1, xs.shape[-1])
        cset, gset = ci.reshape(-1, k), gi.reshape(-1, k)
        differ = tied = cpu_low = gpu_low = 0
        for r in range(rows.shape[0]):
            a, b = set(cset[r].tolist()), set(gset[r].tolist())
            if a == b:
                continue
            differ += 1
            row = rows[r]
            kth = row.sort(descending=True).values[k - 1]
            if (row == kth).sum() > k - (row > kth).sum():
                tied += 1
            low = lowest_index_set(row, k)
            cpu_low += a == low
            gpu_low += b == lowest_index_set(ys.reshape(-1, ys.shape[-1])[r], k)
        out.append(dict(call=n, shape=tuple(x.shape), k=k, rows=rows.shape[0], differ=differ, tied=tied,
                        cpu_lowest=cpu_low, cuda_lowest=gpu_low,
                        input_gap=(x - y).abs().max().item() if x.shape == y.shape else float("nan")))
    return out


def probe(label: str, pack, T: int, seed: int = 0) -> None:
    tokens = torch.randint(
        0, pack.config.get("vocab_size") or 256, (2, T), generator=torch.Generator().manual_seed(seed)
    )
    with TopkRecorder() as rc:
        cpu = Oracle(pack, dtype=torch.float64).logits(tokens)
    with TopkRecorder() as rg:
        gpu = Oracle(pack, device="cuda", dtype=torch.float64).logits(tokens)
    per_pos = ((gpu - cpu).abs().amax(-1) / cpu.abs().max()).amax(0)
    over = (per_pos > 1e-10).nonzero().flatten().tolist()
    print(f"\n## {label}: T={T}, float64, max gap {per_pos.max().item():.3g}"
          + (f", first position over 1e-10: {over[0]}" if over else ""))
    print("gap by position (every 8th):", " ".join(f"{p}:{per_pos[p].item():.1e}" for p in range(0, T, 8)))
    print(f"topk calls: CPU {len(rc.calls)}, CUDA {len(rg.calls)}")
    print("| call | input shape | k | rows | sets differ | tied at k-th | CPU = lowest-index | CUDA = lowest-index |"
          " max input gap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in compare(rc.calls, rg.calls):
        if r["differ"] or r["call"] < 3:
            print(f"| {r['call']} | {r['shape']} | {r['k']} | {r['rows']} | {r['differ']} | {r['tied']} | "
                  f"{r['cpu_lowest']} | {r['cuda_lowest']} | {r['input_gap']:.2g} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=103)
    ap.add_argument("--v32", action="store_true", help="also the tiny V3.2 of test_oracle_deepseek_v32 (transformers)")
    args = ap.parse_args(argv)
    fixtures = ROOT / "tests" / "fixtures" / "v4"
    probe("V4 native fixture", open_pack(fixtures / "tiny_v4"), args.length)
    with tempfile.TemporaryDirectory() as tmp:
        from testkit.minipacks_v41 import build_native_v41
        probe("V4.1 native", open_pack(build_native_v41(fixtures / "tiny_v4", Path(tmp) / "v41")), args.length)
        if args.v32:
            from test_oracle_deepseek_v32 import make
            for case in ("default-rope", "yarn-no-renorm-two-dense"):
                _, pack = make(Path(tmp), case, 1234)
                probe(f"V3.2 {case}", pack, 200)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
