"""benchmarks/flagship.py: the device MXFP4 rounding it writes the reference's routed experts with equals the fixture
writer's, byte for byte; and `--smoke` runs the whole chain on the CPU (build, realscale's baseline, `fidelity
reference`, `fidelity compare`, `fidelity report`, transformers' V4), prints every stage's numbers, and the compare
JSON's KLD is what a direct Oracle run on the same two packs gives."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def flagship():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import flagship
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return flagship


def test_device_mxfp4_equals_the_writers_bytes(rng_seed):
    from testkit.minipacks_v4 import mxfp4

    g = torch.Generator().manual_seed(rng_seed)
    w = torch.randn(48, 256, generator=g) * torch.exp2(torch.randint(-6, 6, (48, 1), generator=g).float())
    w[0, :32] = 0.0                                                       # an all-zero group
    w[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)   # halfway values: the tie rule
    w[2, 5] = -7.9                                                        # saturates at -6 x scale
    want_q, want_s = mxfp4(w)
    got_q, got_s = flagship().mxfp4_on_device(w)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_s.view(torch.uint8), want_s.view(torch.uint8))


def direct_kld(ref_dir: Path, pack_dir: Path, panel: Path) -> tuple[float, int]:
    """Mean KL(ref || pack) in float64 over every scored position (all tokens after each row's first), from each
    pack's own Oracle logits: nothing of compare's metric or store code."""
    from fidelity import open_pack
    from fidelity.oracle import Oracle

    rows = [json.loads(line) for line in (panel / "panel.jsonl").read_text().splitlines()]
    assert all(r.get("score_from") == 1 for r in rows)
    tokens = torch.tensor([r["tokens"] for r in rows])
    lr = Oracle(open_pack(ref_dir)).logits(tokens).double().log_softmax(-1)[:, :-1]
    lp = Oracle(open_pack(pack_dir)).logits(tokens).double().log_softmax(-1)[:, :-1]
    kl = (lr.exp() * (lr - lp)).sum(-1)
    return float(kl.mean()), kl.numel()


@pytest.mark.slow
def test_flagship_smoke_chain_numbers_and_kld(tmp_path):
    from fidelity import open_pack
    from fidelity.packs.exl3.layouts import official_to_hf

    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "flagship.py"), "--smoke", "--out", str(out),
                           "--work", str(work)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["failed"] == {} or set(r["failed"]) == {"report"} and importlib.util.find_spec("matplotlib") is None
    stages = ["build", "baseline", "reference", "compare", "transformers"] + \
        (["report"] if importlib.util.find_spec("matplotlib") else [])
    for name in stages:
        s = r["stages"][name]
        assert s["rc"] == 0 and s["wall_s"] > 0 and s["host_peak_rss_GiB"] > 0, name
        assert s["gpu_peak_GiB"] is None, name                           # the CPU: nothing to poll
    p = r["predicted"]
    assert p["head_included"] and 0 < p["reference_s"] < p["reference_with_overheads_s"]
    assert 0 < p["compare_s"] < p["compare_with_overheads_s"] and p["pass_s"] > 0
    assert r["sizes"]["store_bytes"] > 0 and r["sizes"]["records_bytes"] > 0
    assert r["build"]["ref_bytes"] > 0 and r["build"]["pack_bytes"] > 0

    # the printed table carries the numbers: wall, prediction (with overheads), ratios, host peak
    number = r"\d+\.\d+"
    for label in ("fidelity reference", r"fidelity compare \(3 passes[^|]*\)"):
        assert re.search(rf"\| {label} \| {number} \| {number} \({number}\) \| {number} / {number} \| - \| {number} \|",
                         proc.stdout), label
    assert re.search(rf"\| build packs \(--child build\) \| {number} \|", proc.stdout)
    t = r["transformers"]
    assert t["available"] and len(t["hf_layer_s"]) == len(t["ours_layer_s"]) == 3 and t["ours_x_hf"] > 0
    assert t["max_rel_diff_same_ties"] < 1e-4       # the same weights, read the same way by both
    assert "oracle / transformers" in proc.stdout

    # both packs are what they claim: REF's routed experts MXFP4, PACK's EXL3
    ref, pack = open_pack(work / "ref"), open_pack(work / "pack")
    assert ref.format != pack.format
    assert ref.storage("layers.0.ffn.experts.0.w1.weight").format == "mxfp4"
    assert pack.storage(official_to_hf("layers.0.ffn.experts.0.w1.weight")).format == "exl3"

    compared = json.loads((out / "compare" / "compare.json").read_text())
    kld = compared["results"][0]["overall"]["kld_mean"]
    want, positions = direct_kld(work / "ref", work / "pack", work / "panel")
    assert compared["panel"]["scored_positions"] == positions == 4 * 63
    assert kld > 1e-4                                                    # the packs differ
    assert abs(kld - want) <= 1e-6, (kld, want)
    assert r["compare"]["kld_mean"] == kld


def test_transformers_without_deepseek_v4_is_said_and_skipped(monkeypatch, tmp_path):
    """transformers 5.17 (the device machine's) has no DeepSeek-V4: the comparison says so, names the version, and
    the table carries the reason instead of a crash."""
    import types

    fs = flagship()
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="5.17.0"))
    got = fs.transformers_child(fs.parse(["--smoke", "--out", str(tmp_path)]), torch.device("cpu"), tmp_path)
    assert got == {"available": False, "reason": "transformers 5.17.0 has no DeepseekV4ForCausalLM"}
    assert fs.transformers_line(got) == ("transformers comparison: not available (transformers 5.17.0 has no "
                                         "DeepseekV4ForCausalLM)")


def test_predictions_from_a_realscale_json(tmp_path):
    """--baseline-json: realscale.py's own results scaled to this run's layers, experts and tokens."""
    fs = flagship()
    path = tmp_path / "realscale.json"
    path.write_text(json.dumps({"layers": [
        {"arch": "v4", "experts": 48, "tokens": 1, "compute_s": 9.0, "load_s": 9.0, "expert_matrix_load_ms": 9.0},
        {"arch": "v41", "experts": 48, "tokens": 32768, "compute_s": 1.2, "load_s": 0.5, "expert_matrix_load_ms": 2.0}],
        "head": {"positions": 8192, "vocab": 129280, "head_blocks_s": 0.4, "head_metrics_s": 0.5}}))
    p = fs.predictions(fs.baseline_from_realscale_json(path), layers=40, experts=16, tokens=16384, scored=16376,
                       compare_passes=3, python_start_s=None)
    compute, load = 1.2 / 2, 0.5 - 0.002 * 3 * 32             # half the tokens; 32 experts fewer at 2 ms a matrix
    assert p["layer_compute_s"] == pytest.approx(compute) and p["layer_load_s"] == pytest.approx(load)
    assert p["pass_s"] == pytest.approx(40 * compute) and p["pass_serial_s"] == pytest.approx(40 * (compute + load))
    assert p["reference_s"] == pytest.approx(40 * compute + 0.2 * 16376 / 8192)
    assert p["compare_s"] == pytest.approx(3 * (40 * compute + 0.5 * 16376 / 8192))
    assert p["head_included"]
