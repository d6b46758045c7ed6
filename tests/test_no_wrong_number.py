"""No wrong number without a loud warning (issue 16), compare side, on tiny Llama packs with SmolLM2's tokenizer: pack
identity over every byte, kept passes checksummed, the config check before any work, non-finite values named, results
written before printing, `--out` locked, labels kept inside `--out`, `fidelity report` on NaN and hand-edited JSON."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from fidelity.measuring.compare import compare
from fidelity.errors import PackError
from fidelity.panels.panel import PanelRow, write_panel
from test_compare import _save, noisy_packs, tiny_setting

OLD_SAMPLES, OLD_WINDOW = 64, 64 * 1024   # the sampled fingerprint this replaces: 64 windows of 64 KiB per file


@pytest.fixture(scope="module")
def packs(tmp_path_factory, smollm2_gguf):
    root, tok, gen = tiny_setting(tmp_path_factory, smollm2_gguf, "wrongnum")
    cfg, w, built = noisy_packs(root, tok, gen, {"small": 0.01})
    out = {"cfg": cfg, "w": w, "tok": tok, "root": root, **built}
    rows = [PanelRow("c1", "chat", messages=[{"role": "user", "content": "Name three colors."},
                                             {"role": "assistant", "content": "Red, green and blue."}]),
            PanelRow("c2", "chat", messages=[{"role": "user", "content": "What is 3 times 4?"},
                                             {"role": "assistant", "content": "3 times 4 is 12."}]),
            PanelRow("t1", "text", text="The river flows through the old town towards the sea."),
            PanelRow("t2", "text", text="def square(x):\n    return x * x\n")]
    out["panel"] = write_panel(root / "panel", rows, name="wrongnum").path
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def _unsampled_offset(path: Path, lo: int, hi: int) -> int:
    """A byte offset in [lo, hi) that none of the old fingerprint's 64 windows of 64 KiB covered."""
    size = path.stat().st_size
    step = (size - OLD_WINDOW) // (OLD_SAMPLES - 1)
    for off in range(lo, hi, 4):
        if off % step >= OLD_WINDOW + 8:
            return off
    raise AssertionError("no unsampled offset")


def _head_float_offset(path: Path) -> tuple[int, int]:
    """(file offset of lm_head.weight's data, its byte length)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    b, e = header["lm_head.weight"]["data_offsets"]
    return 8 + n + b, e - b


def _flip_exponent(path: Path, offset: int):
    """One byte changed: the exponent byte of the float32 at `offset` (x 2^16 or so), so the pack computes
    differently."""
    data = bytearray(path.read_bytes())
    data[offset + 3] = (data[offset + 3] + 8) % 256
    path.write_bytes(bytes(data))


def test_packs_differing_in_one_unsampled_byte_are_told_apart(packs, tmp_path):
    """The issue's case: two packs that differ in one byte outside every sampled window shared a fingerprint, so a fresh
    `compare --out` run read the second pack's numbers back from the first's pass. Now each is measured."""
    from fidelity.packs import open_pack
    twin = _copy(packs["small"], tmp_path / "twin")
    f = twin / "model.safetensors"
    start, length = _head_float_offset(f)
    off = _unsampled_offset(f, start, start + length)
    _flip_exponent(f, off - (off - start) % 4)
    assert f.stat().st_size == (packs["small"] / "model.safetensors").stat().st_size
    assert open_pack(twin).fingerprint() != open_pack(packs["small"]).fingerprint()
    res = compare(packs["ref"], [packs["small"], twin], panel=packs["panel"], noise_floor=False, n_boot=50,
                  progress=False, resume=tmp_path / "passes")
    assert res.report["resumed"] == []
    a, b = (r["overall"]["kld_mean"] for r in res.report["results"])
    assert a != b and res.report["results"][0]["fingerprint"] != res.report["results"][1]["fingerprint"]
    # the twin measured for itself: its KL equals a run with it alone
    alone = compare(packs["ref"], [twin], panel=packs["panel"], noise_floor=False, n_boot=50, progress=False)
    assert alone.report["results"][0]["overall"]["kld_mean"] == b


def test_a_pack_edited_in_place_is_measured_again(packs, tmp_path):
    edited = _copy(packs["small"], tmp_path / "edited")
    keep = tmp_path / "passes"
    first = compare(packs["ref"], [edited], panel=packs["panel"], noise_floor=False, n_boot=50, progress=False,
                    resume=keep)
    f = edited / "model.safetensors"
    start, length = _head_float_offset(f)
    _flip_exponent(f, start + 4 * (length // 8))
    again = compare(packs["ref"], [edited], panel=packs["panel"], noise_floor=False, n_boot=50, progress=False,
                    resume=keep)
    assert again.report["resumed"] == ["reference"]          # the pack was measured again, not read back
    assert again.report["results"][0]["fingerprint"] != first.report["results"][0]["fingerprint"]
    assert again.report["results"][0]["overall"]["kld_mean"] != first.report["results"][0]["overall"]["kld_mean"]


def test_manifest_sha256_is_verified(packs, tmp_path):
    import hashlib
    from fidelity.packs import open_pack
    pack = _copy(packs["small"], tmp_path / "withmanifest")
    f = pack / "model.safetensors"
    (pack / "MANIFEST.sha256").write_text(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  model.safetensors\n")
    open_pack(pack).fingerprint()                          # verified: the manifest's sha256 is the file's
    start, length = _head_float_offset(f)
    _flip_exponent(f, start + 4 * (length // 8))
    with pytest.raises(PackError, match=r"sha256 [0-9a-f]{64} differs from [0-9a-f]{64} in .*MANIFEST\.sha256.*"
                                        r"file .*model\.safetensors"):
        open_pack(pack).fingerprint()


def flip_bit(path: Path, divisor: int, mask: int) -> None:
    """XORs `mask` into the byte at len // divisor of the file."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // divisor] ^= mask
    path.write_bytes(bytes(raw))


def test_a_flipped_bit_in_a_kept_pass_is_refused(packs, tmp_path):
    keep = tmp_path / "passes"
    resume = lambda: compare(packs["ref"], [packs["small"]], panel=packs["panel"], noise_floor=False,  # noqa: E731
                             n_boot=50, progress=False, resume=keep)
    resume()
    (data,) = keep.glob("pack-*.parquet")
    flip_bit(data, 2, 0x04)
    with pytest.raises(PackError, match=r"finished pass 'pack-.*changed after it was written.*delete it to recompute"):
        resume()
    data.unlink()
    flip_bit(keep / "reference-store" / "records.parquet", 3, 0x01)
    with pytest.raises(PackError, match=r"finished pass 'reference-store' .*changed.*records\.parquet"):
        resume()


@pytest.mark.parametrize("field,value,pattern", [
    ("num_hidden_layers", 1, r"says num_hidden_layers=1 but the pack has layers up to 1"),
    ("hidden_size", 96, r"shape \[49152, 64\] disagrees with .*config\.json: vocab_size x hidden_size = \[49152, 96\]"),
    ("vocab_size", 1000, r"shape \[49152, 64\] disagrees with .*config\.json: vocab_size x hidden_size = \[1000, 64\]"),
])
def test_compare_refuses_a_config_its_tensors_contradict(packs, tmp_path, field, value, pattern, monkeypatch):
    import fidelity.measuring.compare as C
    bad = _copy(packs["small"], tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg[field] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(C, "_oracle", lambda *a: pytest.fail("work started before the config check"))
    with pytest.raises(PackError, match=pattern) as e:
        compare(packs["ref"], [bad], panel=packs["panel"], noise_floor=False, progress=False)
    assert str(bad) in str(e.value) and "tensor '" in str(e.value)


def test_nan_in_the_reference_head_is_a_clear_error_and_the_json_says_so(packs, tmp_path, capsys):
    from fidelity.cli import main
    w = dict(packs["w"])
    w["lm_head.weight"] = w["lm_head.weight"].clone()
    w["lm_head.weight"][123, 5] = float("nan")
    ref = _save(tmp_path / "nanref", packs["cfg"], w, packs["tok"])
    j = tmp_path / "r.json"
    rc = main(["compare", str(ref), str(packs["small"]), "--panel", str(packs["panel"]), "--json", str(j),
               "--bootstrap", "50"])
    err = capsys.readouterr()
    assert rc == 2
    assert re_search(r"the reference's logits are not finite \(row 'c1', scored position \d+, vocabulary entry 123\): "
                     r"the head 'lm_head.weight' turns finite hidden states into a non-finite logit", err.err)
    assert "Traceback" not in err.err + err.out and "KLD" not in err.out
    doc = json.loads(j.read_text())
    assert doc["status"] == "error" and "vocabulary entry 123" in doc["error"]


def re_search(pattern, text):
    import re
    return re.search(pattern, text) is not None


def test_nonfinite_activations_name_pack_layer_tensor_and_row_and_the_run_goes_on(packs, tmp_path, capsys):
    from fidelity.cli import main
    w = dict(packs["w"])
    w["model.layers.1.mlp.down_proj.weight"] = w["model.layers.1.mlp.down_proj.weight"].clone()
    w["model.layers.1.mlp.down_proj.weight"][3, 7] = float("inf")
    broken = _save(tmp_path / "broken", packs["cfg"], w, packs["tok"])
    j, out = tmp_path / "r.json", tmp_path / "out"
    rc = main(["compare", str(packs["ref"]), str(broken), str(packs["small"]), "--panel", str(packs["panel"]),
               "--json", str(j), "--out", str(out), "--bootstrap", "50", "--no-noise-floor"])
    printed = capsys.readouterr().out
    assert rc == 1
    doc = json.loads(j.read_text())
    failed, ok = doc["results"]
    assert failed["status"] == "failed" and doc["failed"] == ["broken"]
    assert re_search(r"(NaN|Inf) in the activations after layer 1, row 'c1' \(index 0, first at position \d+\): "
                     r"non-finite weights in 'model.layers.1.mlp.down_proj.weight'", failed["error"])
    assert str(broken) in failed["error"] and "overall" not in failed
    assert ok["status"] == "measured" and ok["overall"]["kld_mean"] > 0
    assert (out / "small.parquet").is_file() and not (out / "broken.parquet").exists()
    assert "FAILED" in printed and "broken" in printed


def test_results_are_written_before_anything_is_printed(packs, tmp_path, monkeypatch):
    import fidelity.commands.compare as CC
    from fidelity.cli import main
    j, md = tmp_path / "r.json", tmp_path / "r.md"

    def printing_fails(report, console=None, full=False):
        assert j.is_file() and md.is_file()
        raise RuntimeError("the terminal went away")

    monkeypatch.setattr(CC, "print_report", printing_fails)
    with pytest.raises(RuntimeError, match="terminal went away"):
        main(["compare", str(packs["ref"]), str(packs["small"]), "--panel", str(packs["panel"]), "--json", str(j),
              "--markdown", str(md), "--bootstrap", "50", "--no-noise-floor"])
    assert json.loads(j.read_text())["results"][0]["overall"]["kld_mean"] > 0


def test_two_compares_into_one_out_folder_the_second_is_refused(packs, tmp_path, capsys):
    from fidelity.cli import main
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom fidelity.commands.compare import OutLock\n"
            "held = OutLock(sys.argv[1]).__enter__()\nprint('locked', flush=True)\ntime.sleep(120)\n",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc = main(["compare", str(packs["ref"]), str(packs["small"]), "--panel", str(packs["panel"]),
                   "--out", str(out), "--bootstrap", "50", "--no-noise-floor"])
        err = capsys.readouterr().err
        assert rc == 2 and f"{out} is in use by another fidelity compare (pid {holder.pid})" in err
        assert not (out / "passes").exists()
    finally:
        holder.kill()
        holder.wait()
    rc = main(["compare", str(packs["ref"]), str(packs["small"]), "--panel", str(packs["panel"]), "--out", str(out),
               "--bootstrap", "50", "--no-noise-floor"])
    assert rc == 0 and (out / "small.parquet").is_file()   # the lock goes with the process that held it


def test_labels_cannot_leave_the_out_folder(packs, tmp_path):
    from fidelity.cli import main
    out = tmp_path / "a" / "out"
    j = tmp_path / "r.json"
    rc = main(["compare", str(packs["ref"]), str(packs["small"]), str(packs["small"]), "--panel", str(packs["panel"]),
               "--label", "../..", "--label", "x/y", "--out", str(out), "--json", str(j), "--bootstrap", "50",
               "--no-noise-floor"])
    assert rc == 0
    files = sorted(p.name for p in out.glob("*.parquet"))
    assert files == ["_.parquet", "x_y.parquet"]
    assert not list((tmp_path / "a").glob("*.parquet")) and not list(tmp_path.glob("*.parquet"))
    doc = json.loads(j.read_text())
    assert [r["label"] for r in doc["results"]] == ["../..", "x/y"]
    assert [r["records"] for r in doc["results"]] == ["_.parquet", "x_y.parquet"]


def test_report_reads_records_beside_compare_json_and_warns_on_nonfinite(packs, tmp_path):
    from fidelity.cli import main
    from fidelity.report import render
    from fidelity.report.inputs import ReportInputError, load_inputs
    run = tmp_path / "run"
    run.mkdir()
    rc = main(["compare", str(packs["ref"]), str(packs["small"]), "--panel", str(packs["panel"]), "--label", "x/y",
               "--json", str(run / "compare.json"), "--out", str(run), "--bootstrap", "50", "--no-noise-floor"])
    assert rc == 0
    inputs = load_inputs([run / "compare.json"])
    (r,) = inputs.groups[0].runs
    assert "x/y" in r.pack_positions and len(r.pack_positions["x/y"]) == r.panel["scored_positions"]
    doc = json.loads((run / "compare.json").read_text())
    doc["results"][0]["overall"]["kld_max"] = float("inf")
    doc["results"][0]["domains"]["chat"]["top1"] = float("nan")
    (run / "nan.json").write_text(json.dumps(doc))
    rep = render([run / "nan.json"], tmp_path / "report", tokenizer=None)
    assert any("overall.kld_max is inf (not finite)" in w for w in rep.warnings)
    assert any("domains.chat.top1 is nan (not finite)" in w for w in rep.warnings)
    for edit, pattern in [(lambda d: d["results"][0]["overall"].update(kld_mean="abc"),
                           r"results\[0\] \(x/y\)\.overall\.kld_mean must be a number or null, got 'abc'"),
                          (lambda d: d.update(results={"a": 1}), r"results is not a list"),
                          (lambda d: d["results"][0].update(overall=[1, 2]), r"overall is not an object"),
                          (lambda d: d["results"][0]["overall"].update(kld_mean_ci95=[0.1]),
                           r"overall\.kld_mean_ci95 must be null or \[low, high\] numbers")]:
        d = json.loads((run / "compare.json").read_text())
        edit(d)
        (run / "edited.json").write_text(json.dumps(d))
        with pytest.raises(ReportInputError, match=r"edited\.json: .*" + pattern):
            load_inputs([run / "edited.json"])
    # through the CLI: an error naming file and item, exit 2, no traceback
    proc = subprocess.run([sys.executable, "-m", "fidelity", "report", str(run / "edited.json"), "-o",
                           str(tmp_path / "rep2")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == 2 and "edited.json" in proc.stderr and "Traceback" not in proc.stderr


def test_small_panel_prints_not_available_instead_of_a_zero_width_interval(packs, tmp_path, capsys):
    from fidelity.cli import main
    one = write_panel(tmp_path / "one", [PanelRow("only", "text", text="A single row of text is all there is.")],
                      name="one-row").path
    j = tmp_path / "r.json"
    rc = main(["compare", str(packs["ref"]), str(packs["small"]), str(packs["small"]), "--panel", str(one),
               "--json", str(j), "--bootstrap", "200", "--no-noise-floor"])
    printed = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(j.read_text())
    o = doc["results"][0]["overall"]
    assert o["kld_mean"] > 0 and o["kld_mean_ci95"] is None and "1 row" in o["ci_unavailable"]
    assert doc["paired"][0]["p_value"] is None and doc["paired"][0]["ci95"] is None
    assert "95% CI not available: 1 row" in printed and "p-value not available" in printed
