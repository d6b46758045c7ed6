"""Our DeepSeek-V4.1 candidate-block filter and index top-k against DeepSeek's own `inference/model.py`, on the cases
HartsyInference dumped from it (`select_candidate_blocks` and the Indexer's final top-k, run unmodified on CPU through
their pure-torch kernel ports): tests/python-reference/deepseek_v41/fixtures/candidate_select.json of
github.com/HartsyAI/HartsyInference (download it where there is a network; nothing of it is in this repository).

    python benchmarks/deepseek_v41_upstream_selection.py PATH/candidate_select.json

Blocks: upstream ranks the blocks of one query whose newest finished entry is compressLen - 1 (ours: a query at
position compressLen - 1 over a ratio-1 pool) and returns the entries it keeps. Where every block fits
(topk_blocks x block_size >= width) ours filters nothing while upstream also drops the blocks with no finished entry;
what a layer can select is the same (an unfinished entry is never selected), so both masks are printed and the
comparison is on the finished entries. Picks: the entries `top_k_mask` keeps vs upstream's indices (offset, -1 for
none)."""
from __future__ import annotations

import json
import sys

import torch

from fidelity.oracle.deepseek.v41 import candidate_drop, expand_blocks
from fidelity.oracle.selection import top_k_mask


def values(raw: list) -> torch.Tensor:
    return torch.tensor([float("-inf") if v is None else v for v in raw], dtype=torch.float32)


def main(path: str) -> int:
    fixture = json.load(open(path))
    rows, equal = [], True
    for case in fixture["blocks"]:
        W, lens, keep, block = case["width"], case["compressLen"], case["topkBlocks"], case["blockSize"]
        scores = values(case["logits"]).view(1, 1, W)
        if W > keep * block:
            kept = ~expand_blocks(candidate_drop(scores, torch.tensor([lens - 1]), 1, block, keep), block, W).view(-1)
        else:
            kept = torch.ones(W, dtype=torch.bool)
        want = torch.tensor(case["mask"])
        finished = torch.arange(W) < lens
        same = torch.equal(kept & finished, want & finished)
        equal &= same
        rows.append(
            f"| blocks | W {W}, finished {lens}, keep {keep} x {block} | {''.join('1' if v else '.' for v in kept)} "
            f"| {''.join('1' if v else '.' for v in want)} | {same} |"
        )
    for case in fixture["picks"]:
        n, k, offset = case["positions"], case["indexTopk"], case["offset"]
        kept = top_k_mask(values(case["scores"]).view(1, 1, n), k).view(-1)
        ours = sorted(i + offset for i in torch.nonzero(kept).view(-1).tolist())
        want = sorted(i for i in case["indices"] if i >= 0)
        equal &= ours == want
        rows.append(f"| index top-k | {n} entries, finished {case['compressLen']}, top {k} | {ours} | {want} | "
                    f"{ours == want} |")
    print("| case | shape | ours | upstream | equal on finished entries |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print("all equal" if equal else "SOME DIFFER")
    return 0 if equal else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    raise SystemExit(main(sys.argv[1]))
