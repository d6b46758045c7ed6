"""`torchrun --nproc-per-node 2 benchmarks/realscale.py --parallel experts,rows --device cpu --smoke` (gloo): the
equality with one rank that the script reports is checked here against a one-process Oracle run by the test on the
same pack and rows, at the ranks' thread count; under expert parallelism each rank read only its own routed experts."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fidelity import open_pack
from fidelity.oracle import Oracle, runner
from test_distributed import RANK_THREADS, free_port, rank_threads

ROOT = Path(__file__).resolve().parent.parent
BATCH_TOKENS = 128   # the script's --smoke default under --parallel: 2 rows of 64 per batch, 8 batches
MODES = ("experts", "rows")


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tmp_path, monkeypatch):
    work, out = tmp_path / "work", tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": str(RANK_THREADS), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "benchmarks" / "realscale.py"), "--parallel", ",".join(MODES), "--device", "cpu", "--smoke",
           "--archs", "v41", "--batch-tokens", str(BATCH_TOKENS), "--work", str(work), "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    print(done.stdout[-2000:])
    report = json.loads((out / "realscale-parallel.json").read_text())
    assert report["machine"]["ranks"] == 2 and report["machine"]["backend"] == "gloo"
    runs = {r["mode"]: r for r in report["runs"]}
    assert sorted(runs) == sorted(MODES)
    assert all(r["equal_one_rank"] for r in runs.values())
    experts = runs["experts"]
    # 8 routed experts, owners in contiguous blocks: 4 each, no expert read by both ranks
    assert experts["experts_read_per_rank"] == [4, 4] and not experts["experts_read_overlap"]

    rows = torch.load(out / "rows.pt")
    assert len(rows) == 16 and {len(r) for r in rows} == {64}
    monkeypatch.setattr(runner, "BATCH_TOKENS", BATCH_TOKENS)
    with rank_threads():
        want = Oracle(open_pack(work / "v41-exl3"), device="cpu").hidden_states(rows, progress=False)
    assert all(bool(torch.isfinite(h).all()) and float(h.std()) > 0 for h in want)
    for mode in MODES:
        got = torch.load(out / f"hidden-v41-{mode}.pt")
        assert len(got) == len(want)
        unequal = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
        assert not unequal, f"{mode}: rows {unequal} differ, max |diff| " \
                            f"{max(float((got[i] - want[i]).abs().max()) for i in unequal):.3g}"
