"""The flagship through the CLI: a 40-layer DeepSeek-V4.1-Flash-geometry native pack and its EXL3 pack, built where
the script runs, then `fidelity reference`, `fidelity compare` and `fidelity report` as a user types them (each a
`python -m fidelity ...` subprocess), measured per stage and set against realscale.py's one-layer extrapolation; and
the same layers in transformers' DeepSeek-V4 model in fp32 on the same dequantized weights (issue 42, item 3).

    python benchmarks/flagship.py --out DIR [--work DIR] [--layers 40 --experts 16 --rows 16 --length 2048]
    python benchmarks/flagship.py --smoke --out DIR        # tiny geometry, 3 layers, CPU: the whole chain in seconds

What is built (random weights; realscale.py's builders, at vocabulary 129,280 instead of its 256):
- the bf16 official-named V4 at FLASH geometry (hidden 4096, 64 heads x 512, top-6 of `--experts` routed experts x
  2048, hc 4) with `--layers` CSA/MoE layers (realscale.v4_native_without_experts: routed experts only named), its
  V4.1 (fixtures.minipacks_v41.build_native_v41 with realscale.v41_layers: every layer owns its compressed pool and
  indexer, the last is the candidate-block source, layer 0 the Engram layer) and a word-level tokenizer of
  `vocab` tokens (the Engram hash reads the compressed vocabulary from tokenizer.json; the panel's ids must be ids
  of the pack's tokenizer);
- PACK: `deepseek_v41_exl3` (minipacks_v4.write_v4_minipack as realscale writes it: routed experts EXL3 mul1 at the
  seed card's K mix 2-5 as random valid trellises, `wo_a` and the head EXL3 K4, FP8 e4m3 ue8m0 dense on 128 blocks,
  MXFP4 shared experts, Engram rows FP8 per row);
- REF: `fp8-mxfp4`, DeepSeek's own release format (FP8 ue8m0 dense on the V4.1 release's 32 x 32 blocks, MXFP4
  shared experts, FP8 Engram rows), written by the same writer from the same bf16 model, except that what PACK
  stores in EXL3 is PACK's decoded weight rounded to REF's format: head and `wo_a` to FP8 (the writer), routed
  experts to MXFP4 (`mxfp4_on_device`: the writer's MXFP4 on the GPU, where the CPU one would take minutes).
  A random trellis is no encoding of a given weight, so REF is derived from PACK, not PACK from REF: the two differ
  by a 4-bit-sized rounding of the same weights (and FP8 block sizes), as a quantized pack differs from its source.

Stages, each a child process (wall time; GPU peak = the most `nvidia-smi --query-gpu=memory.used` read while it ran,
polled every 0.1 s, minus what was in use when it started: the device's view, CUDA context and torch's cached
blocks included, because torch.cuda.max_memory_allocated cannot see another process; host peak = the child's own
ru_maxrss from os.wait4):
  build (this script, --child build)
  -> baseline (this script: realscale.bench_layer for one V4.1 layer of the same geometry and experts over the
  panel's rows x length, the head + metric step at the vocabulary, and the overheads a CLI process pays before its
  layers: pack fingerprints with an empty hash cache, the Engram token map, embedding + head loads, python start)
  -> `fidelity reference REF --panel P -o STORE --device D` -> `fidelity compare REF PACK --panel P
  --reference-store STORE --device D --out O --json O/compare.json --markdown O/compare.md` (defaults: noise floor
  and numerics floor on, as a user gets them) -> `fidelity report O/compare.json -o R` (skipped, and said, without
  matplotlib) -> transformers (this script, --child transformers: skipped, and said, where transformers has no
  DeepseekV4ForCausalLM). The CLI children get an empty FIDELITY_CACHE (a first run's hashing); the packs were just
  written, so their bytes come from the page cache (a pack on a cold disk adds its read time). results.json is
  rewritten after every stage, with the table, so a run cut short keeps what finished.

realscale's extrapolation for the same shape (from the baseline stage, or `--baseline-json realscale.json`): one
layer's compute c at the panel's tokens, its load l (read + decode + copy at the same routed experts), per pass
L x max(c, l) (loads behind compute; L x (c + l) serial is printed too); reference = one pass + the reference head and
top-K over the scored positions; compare = (1 + noise floor + numerics floor) passes + as many head + metric steps;
"+ overheads" adds what the baseline measured outside the layers: python start, fingerprints, and per oracle the
Engram token map and the embedding + head loaded on the device (EXL3 / FP8 decodes of a 129,280 x 4096 head).

Estimated at full size on one H100, 40 layers x 16 experts, 16 x 2048 tokens (from benchmarks/RESULTS.md, "Real-geometry
benchmark" and the sections after it: a V4.1-Flash layer computes 32k tokens in 0.93-1.17 s fp32 on the H200; the head
+ metric step takes 0.376 s per 8,192 positions at vocabulary 129,280 on an H100; a routed-expert matrix decodes in
~0.58 ms. Not recorded there, measured here on the 2-core CPU machine: FP8 ue8m0 ~170 M weights/s, MXFP4 ~9 M
weights/s, assumed 4-8x on 16 cores. Sizes from the shapes: 16.1 G routed-expert, 5.1 G dense, 1.0 G shared-expert
and 1.1 G embedding + head weights):
  build        ~1.5-3 min: V4 and V4.1 bf16 folders (14.3 GB each), PACK (~11.7 GB: FP8 dense, EXL3 experts at 2.7
               bits on average) and REF (~15.8 GB: MXFP4 experts) written; FP8 of 5.1 G and MXFP4 of 1.0 G weights on
               the CPU per pack (~1 min of it), 1,920 expert decodes + MXFP4 on the GPU (~10 s), ~56 GB of file writes
  baseline     ~40 s: a one-layer pack built and timed, the head step, 27.5 GB hashed
  reference    ~50-70 s: 40 x ~1.1 s + head/top-K + python start, REF fingerprint, store
  compare      ~150-190 s at the defaults (three 40-layer passes: pack, noise floor, numerics floor);
               ~55-70 s with --no-noise-floor --no-numerics-floor
  report       ~10-20 s
  transformers ~40-60 s: 3 layers as a 10.9 GB fp32 folder written and loaded, 2 x 2048 tokens through both
so ~7-9 min in all at the defaults: tight for one 10-minute call. `--no-numerics-floor` (~-50 s), `--layers 24`
(~-40 % of every stage but the baseline's) or `--rows 8` (~-half of each pass) shrink it; `--work` on a warm machine
plus `--reuse` keeps a build for the next call. Disk: at most ~39 GB at once (V4.1 bf16 + PACK + REF's non-expert
part while REF is written; PACK + REF + the 10.9 GB transformers folder at the end), plus the store (~0.6 GB).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import realscale as rs  # noqa: E402
from _tables import header, present_lines  # noqa: E402

VOCAB = rs.VOCAB
SMOKE_VOCAB = 1280          # a multiple of 128, as 129,280 is (the head is an EXL3 linear)
BUILD_FILE = "build.json"


# -- the packs ------------------------------------------------------------------------------------------------------
def word_tokenizer(vocab: int):
    """A word-level tokenizer whose ids are 0..vocab-1 (token i is the word `t<i>`), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return fast


def flagship_config(geometry: dict, experts: int, layers: int, vocab: int) -> dict:
    return {**rs.v4_config(geometry, experts, layers), "vocab_size": vocab}


def mxfp4_on_device(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fixtures.minipacks_v4.mxfp4 computed where `w` is (its grid lives on the CPU): the same operations, so on the
    CPU the same bytes (tests/test_flagship_smoke.py). On a GPU its log2 may round a group whose amax lies within an
    ulp below a power of two the other way (another exponent, still a valid MXFP4 group: the oracle reads what is
    stored). Returns (int8 codes on w's device, e8m0 scales on the CPU: exact powers of two, converted there)."""
    from testkit.minipacks_v4 import FP4_GRID, MX_GROUP

    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // MX_GROUP, MX_GROUP)
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -126)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 2)
    x = (groups / scale[..., None]).reshape(rows, cols)
    dist = (x.abs()[..., None] - FP4_GRID.to(w.device)).abs()
    idx = (dist + 1e-6 * (torch.arange(8, device=w.device) % 2)).argmin(-1)
    codes = (idx | ((x < 0) & (idx > 0)).to(torch.int64) << 3).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.cpu().to(torch.float8_e8m0fnu)


def exl3_stored_names(native, spec) -> list[str]:
    """The non-expert tensors the `deepseek_v41_exl3` layout stores in EXL3 (the head, `wo_a`)."""
    from testkit.minipacks_v4 import exl3_k, kind_of
    from fidelity.packs.exl3.layouts import routed_expert

    out = []
    for name in native.names():
        kind = kind_of(name, torch.empty(native.storage(name).shape, device="meta"))
        if routed_expert(name) is None and exl3_k("deepseek_v41_exl3", name, kind, spec) is not None:
            out.append(name)
    return out


class DecodedFrom(rs.Pack):
    """The bf16 native pack with `names` read from another pack instead (decoded on `device`, handed over on the CPU):
    what the native writer rounds into the reference's format."""

    def __init__(self, base, other, names: list[str], device):
        from fidelity.packs.base import LogicalTensor

        super().__init__(base.path)
        self.base, self.config, self.raw, self.root = base, base.config, base.raw, getattr(base, "root", base.path)
        self.format = base.format
        for name in base.names():
            decode = (lambda n=in_pack(other, name): other.tensor(n, device=device).cpu()) if name in names else \
                (lambda n=name: base.tensor(n))
            self._entries[name] = LogicalTensor(base.storage(name), decode)


def in_pack(pack, official: str) -> str:
    """The name a pack gives an official tensor (EXL3 claimers name the head and embeddings the Hugging Face way)."""
    from fidelity.packs.exl3.layouts import official_to_hf

    for name in (official, official_to_hf(official)):
        if name in pack.names():
            return name
    raise KeyError(f"{pack.path} has no tensor {official!r} under its official or Hugging Face name")


def write_reference(native_dir: Path, pack_dir: Path, out: Path, spec, device, remove_native: bool = False) -> Path:
    """REF in the `fp8-mxfp4` layout: the writer on the bf16 V4.1 with PACK's head and `wo_a`, then PACK's routed
    experts decoded on `device` and rounded to MXFP4 there, one shard per layer, added to the index.
    `remove_native`: the bf16 folder is deleted once the writer is done with it (before the experts: less disk)."""
    from testkit.minipacks_v4 import write_v4_minipack
    from fidelity.packs import open_pack
    from fidelity.packs.exl3.layouts import hf_to_official, routed_expert
    from fidelity.packs.safetensors_io import write_safetensors

    native, pack = open_pack(native_dir), open_pack(pack_dir)
    write_v4_minipack(DecodedFrom(native, pack, exl3_stored_names(native, spec), device), "fp8-mxfp4", out, spec)
    if remove_native:
        shutil.rmtree(native_dir)
    by_layer: dict[int, list[str]] = {}
    for name in pack.names():
        e = routed_expert(name)
        if e is not None:
            by_layer.setdefault(e[1], []).append(name)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for layer, names in sorted(by_layer.items()):
        shard, tensors = f"model-experts-L{layer:02d}.safetensors", {}
        for name, w in pack.tensors(sorted(names), device=device).items():
            q, s = mxfp4_on_device(w)
            base = hf_to_official(name)[: -len(".weight")]
            tensors[f"{base}.weight"], tensors[f"{base}.scale"] = q.cpu(), s.cpu()
        write_safetensors(out / shard, tensors, metadata={"format": "pt"})
        index["weight_map"].update({n: shard for n in tensors})
    index_path.write_text(json.dumps(index, indent=1))
    return out


def v4_only_tensors(v4_dir: Path, layers: int) -> dict[str, torch.Tensor]:
    """What the V4 has and the V4.1 replaced (compressors, hc_head), for the transformers comparison's first layers."""
    from safetensors import safe_open

    keep = {}
    with safe_open(str(v4_dir / "model.safetensors"), "pt") as f:
        for k in f.keys():
            layer = int(k.split(".")[1]) if k.startswith("layers.") else None
            if k.startswith("hc_head_") or (".compressor." in k and layer is not None and layer < layers):
                keep[k] = f.get_tensor(k)
    return keep


def build_params(args) -> dict:
    return {"smoke": args.smoke, "layers": args.layers, "experts": args.experts, "vocab": args.vocab,
            "hf_layers": args.hf_layers}


def packs_built(work: Path, params: dict) -> bool:
    f = work / BUILD_FILE
    return f.is_file() and json.loads(f.read_text()).get("params") == params and \
        (work / "ref" / "config.json").is_file() and (work / "pack" / "config.json").is_file()


def build_child(args, device, work: Path) -> dict:
    from testkit.minipacks_v4 import V4MiniSpec, write_v4_minipack
    from testkit.minipacks_v41 import build_native_v41
    from fidelity.packs import open_pack
    from fidelity.packs.safetensors_io import write_safetensors

    geometry, v41_extra = (rs.SMOKE, rs.V41_SMOKE) if args.smoke else (rs.FLASH, rs.V41_FLASH)
    for d in ("v4-native", "v41-native", "pack", "ref"):
        shutil.rmtree(work / d, ignore_errors=True)
    steps, t = {}, time.perf_counter()

    def step(name):
        nonlocal t
        now = time.perf_counter()
        steps[name] = now - t
        t = now
        print(f"build: {name} {steps[name]:.1f} s", flush=True)

    cfg = flagship_config(geometry, args.experts, args.layers, args.vocab)
    v4_dir, expert_shapes = rs.v4_native_without_experts(cfg, work / "v4-native", device)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (v4_dir / f).unlink(missing_ok=True)
    word_tokenizer(args.vocab).save_pretrained(str(v4_dir))
    write_safetensors(work / "v4-only.safetensors", v4_only_tensors(v4_dir, min(args.hf_layers, args.layers)),
                      metadata={"format": "pt"})
    step("v4_bf16")
    v41_dir = build_native_v41(v4_dir, work / "v41-native", index_topk=geometry["index_topk"],
                               **rs.v41_layers(v41_extra, args.layers))
    shutil.rmtree(v4_dir)
    step("v41_bf16")
    spec = V4MiniSpec(expert_k=rs.expert_k_string(args.experts), dense_k=4, head_k=4, fp8_block=32)
    pack_dir = write_v4_minipack(rs.WithExperts(open_pack(v41_dir), expert_shapes), "deepseek_v41_exl3",
                                 work / "pack", spec, rs.RandomTrellis(device))
    step("pack_exl3")
    ref_dir = write_reference(v41_dir, pack_dir, work / "ref", spec, device, remove_native=True)
    step("ref_fp8_mxfp4")
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))   # noqa: E731
    return {"params": build_params(args), "steps_s": steps, "ref_bytes": size(ref_dir), "pack_bytes": size(pack_dir),
            "expert_k_mix": {k: spec.expert_k.count(str(k)) for k in rs.SEED_K_COUNTS}}


def write_token_panel(out: Path, rows: int, length: int, vocab: int, seed: int = 42):
    """Token-exact rows of uniformly random ids, every token after the first scored, two domains."""
    from fidelity.panels.panel import PanelRow, write_panel

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g).tolist()
    panel_rows = [PanelRow(f"r{i:03d}", "random-a" if i % 2 == 0 else "random-b", tokens=r,
                           scored=[False] + [True] * (length - 1)) for i, r in enumerate(ids)]
    shutil.rmtree(out, ignore_errors=True)
    return write_panel(out, panel_rows, name="flagship-random-tokens",
                       description=f"{rows} rows x {length} uniformly random token ids of {vocab} (seed {seed})",
                       sources=[{"name": "torch.randint", "license": "CC0-1.0"}])


# -- measuring a child process --------------------------------------------------------------------------------------
class GpuMemoryPeak:
    """The most memory.used (MiB, summed over the visible GPUs) nvidia-smi reports while it runs, polled in a thread."""

    def __init__(self, interval_s: float = 0.1):
        self.interval_s, self.peak, self._stop = interval_s, None, threading.Event()
        self.query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        if visible and all(v.strip().isdigit() for v in visible.split(",")):
            self.query += ["-i", visible]
        self.start_mib = self.read()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def read(self) -> float | None:
        try:
            out = subprocess.run(self.query, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode != 0:
            return None
        return sum(float(x) for x in out.stdout.split())

    def _poll(self):
        while not self._stop.is_set():
            v = self.read()
            if v is not None:
                self.peak = v if self.peak is None else max(self.peak, v)
            self._stop.wait(self.interval_s)

    def __enter__(self):
        if self.start_mib is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def stage_gib(self) -> float | None:
        return None if self.peak is None or self.start_mib is None else max(0.0, self.peak - self.start_mib) / 1024


class StageFailed(RuntimeError):
    pass


def run_stage(name: str, cmd: list[str], env: dict, logs: Path, gpu: bool) -> dict:
    """Runs cmd with its output in logs/<name>.log: wall seconds, GPU and host peaks. Raises StageFailed (with the
    log's tail) when it exits non-zero."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    with open(log, "w") as f, (GpuMemoryPeak() if gpu else _NoGpu()) as peak:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)         # this child's own rusage (RUSAGE_CHILDREN pools them)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
    out = {"command": shlex.join(cmd), "wall_s": wall, "rc": proc.returncode, "gpu_peak_GiB": peak.stage_gib(),
           "host_peak_rss_GiB": usage.ru_maxrss / 2**20, "log": str(log)}
    print(f"[{name}] {wall:.1f} s, exit {proc.returncode}, host peak {out['host_peak_rss_GiB']:.2f} GiB"
          + (f", GPU peak {out['gpu_peak_GiB']:.2f} GiB" if out["gpu_peak_GiB"] is not None else ""), flush=True)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-6000:]
        print(tail, flush=True)
        raise StageFailed(f"{name} exited {proc.returncode}; log {log}")
    return out


class _NoGpu:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def stage_gib(self):
        return None


def folder_bytes(path: Path, pattern: str = "**/*") -> int:
    return sum(f.stat().st_size for f in Path(path).glob(pattern) if f.is_file())


# -- the baseline: realscale's one layer, the head step, the overheads ---------------------------------------------
def head_seconds(positions: int, vocab: int, hidden: int, device) -> dict:
    """compare's per-pass device step (both heads in HEAD_ROWS blocks + metrics, store.device_row_metrics) and the
    reference's own head with its top-20, on `positions` random positions (realscale.bench_head's first part)."""
    from fidelity.measuring import metrics
    from fidelity.measuring.store import ReferenceRun, device_row_metrics

    w_ref, w_pack, x, x_pack, targets = rs.head_inputs(positions, vocab, hidden, device)
    ref_head, pack_head = rs.DeviceHead(w_ref), rs.DeviceHead(w_pack)
    logits = torch.empty(positions, vocab, device=device)
    one_head = partial(ref_head.head_into, x, logits)
    one_head()
    head_s, _ = rs.timed(one_head, device)
    topk = partial(metrics.topk_logprobs, logits, 20)
    topk()
    topk_s, _ = rs.timed(topk, device)
    del logits, one_head, topk
    per_row = 512 if positions >= 512 else 64
    rows, hid, hid_pack, tgt = rs.split_rows(x, x_pack, targets, per_row)
    run = ReferenceRun(rows, hid, tgt, device=str(device))
    step = lambda: device_row_metrics(run, ref_head, hid_pack, pack_head, progress=False)   # noqa: E731
    step()
    step_s, _ = rs.timed(step, device)
    return {"positions": positions, "vocab": vocab, "ref_head_s": head_s, "ref_topk_s": topk_s, "metric_step_s": step_s}


def baseline_child(args, device, work: Path) -> dict:
    from fidelity.oracle.deepseek.engram import compressed_token_map
    from fidelity.pack_settings import PackSettings
    from fidelity.packs import open_pack

    rs.exact_math(device)
    ns = argparse.Namespace(smoke=args.smoke, experts=args.experts, activation_gib=None, expert_gib=None,
                            rows=args.rows, length=args.length, shapes=[], shape_budgets="", profile=0,
                            numerics_cost=False, repeat=1)
    ns.matmul_rate = rs.matmul_rate(device, 512 if args.smoke else 8192 if device.type == "cuda" else 2048)
    scratch = work / "baseline"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        layer = rs.bench_layer("v41", ns, device, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    hidden = (rs.SMOKE if args.smoke else rs.FLASH)["hidden_size"]
    head = head_seconds(256 if args.smoke else args.head_positions, args.vocab, hidden, device)
    cache = work / "fingerprint-cache"          # an empty hash cache: the hashing a first CLI run pays
    shutil.rmtree(cache, ignore_errors=True)
    overheads = {}
    for which in ("ref", "pack"):
        pack = open_pack(work / which, PackSettings(hash_cache=cache / "content-hash"))
        t = time.perf_counter()
        pack.fingerprint()
        overheads[f"fingerprint_{which}_s"] = time.perf_counter() - t
        ends = [in_pack(pack, "embed.weight"), in_pack(pack, "head.weight")]
        overheads[f"embed_head_{which}_s"], _ = rs.timed(lambda: [pack.tensor(n, device=device) for n in ends], device)
    shutil.rmtree(cache, ignore_errors=True)
    t = time.perf_counter()
    compressed_token_map(work / "ref" / "tokenizer.json")
    overheads["token_map_s"] = time.perf_counter() - t
    keep = ("experts", "tokens", "compute_s", "load_s", "read_s", "expert_matrix_load_ms", "build_s", "x_floor",
            "compute_x_matmul_floor", "tflops", "gpu_peak_GiB", "engram_rows_s", "finite")
    return {"source": "realscale.bench_layer (this run)", "layer": {k: layer.get(k) for k in keep}, "head": head,
            "overheads": overheads, "matmul_TFLOPs": ns.matmul_rate / 1e12}


def baseline_from_realscale_json(path: Path) -> dict:
    """realscale.py --out's realscale.json: its V4.1 layer and head (the overheads are not in it)."""
    r = json.loads(Path(path).read_text())
    layer = next((x for x in r.get("layers", []) if x["arch"] == "v41"), None)
    if layer is None:
        raise SystemExit(f"{path}: no V4.1 layer among its 'layers' (run realscale.py with --archs v41)")
    h = r.get("head") or {}
    head = None if not h else {"positions": h["positions"], "vocab": h["vocab"], "ref_head_s": h["head_blocks_s"] / 2,
                                "ref_topk_s": 0.0, "metric_step_s": h["head_metrics_s"]}
    return {"source": str(path), "layer": layer, "head": head, "overheads": {}}


def predictions(base: dict, layers: int, experts: int, tokens: int, scored: int, compare_passes: int,
                python_start_s: float | None) -> dict:
    """realscale's extrapolation of the reference and compare stages to this run's layers, experts and tokens."""
    lay, head, over = base["layer"], base.get("head"), base.get("overheads") or {}
    compute = lay["compute_s"] * tokens / lay["tokens"]
    load = max(0.0, lay["load_s"] + lay["expert_matrix_load_ms"] / 1e3 * 3 * (experts - lay["experts"]))
    per_pass, per_pass_serial = layers * max(compute, load), layers * (compute + load)
    ref_head = 0.0 if not head else (head["ref_head_s"] + head["ref_topk_s"]) * scored / head["positions"]
    step = 0.0 if not head else head["metric_step_s"] * scored / head["positions"]
    start = python_start_s or 0.0
    token_map = over.get("token_map_s", 0.0)
    reference = per_pass + ref_head
    compare = compare_passes * (per_pass + step)
    return {"layer_compute_s": compute, "layer_load_s": load, "pass_s": per_pass, "pass_serial_s": per_pass_serial,
            "reference_s": reference, "reference_serial_s": per_pass_serial + ref_head,
            "reference_with_overheads_s": reference + start + over.get("fingerprint_ref_s", 0.0) + token_map
                                          + over.get("embed_head_ref_s", 0.0),
            "compare_s": compare, "compare_serial_s": compare_passes * (per_pass_serial + step),
            # the reference's hash is cached by then; every oracle builds its own token map and loads its own
            # embedding and head (the floors' oracles run on REF)
            "compare_with_overheads_s": compare + start + over.get("fingerprint_pack_s", 0.0)
                                        + (1 + compare_passes) * token_map + over.get("embed_head_pack_s", 0.0)
                                        + compare_passes * over.get("embed_head_ref_s", 0.0),
            "head_included": head is not None}


# -- transformers' DeepSeek-V4 on the same weights -----------------------------------------------------------------
HF_SPECIAL = {"embed.weight": "model.embed_tokens.weight", "hc_head_fn": "model.hc_head.hc_fn",
              "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale",
              "head.weight": "head.weight"}


def saved_name(official: str) -> str:
    """DeepSeek's official name -> transformers' save_pretrained V4 name (minipacks_v4.official_name inverted)."""
    return HF_SPECIAL.get(official) or "model." + official.replace(".attn.kv_norm.", ".attn.norm.")


def write_v4_folder(ref_dir: Path, v4_only: Path, out: Path, cfg: dict, device) -> Path:
    """The first cfg['num_hidden_layers'] layers as a DeepSeek-V4 in fp32 (save_pretrained names, which both
    transformers and the oracle read): REF's dequantized weights, and the V4's own compressors and hc_head where
    the V4.1 replaced them."""
    from safetensors.torch import load_file

    from testkit.minipacks_v4 import official_name
    from fidelity.packs import open_pack
    from fidelity.packs.safetensors_io import write_safetensors

    ref, extra = open_pack(ref_dir), load_file(str(v4_only))
    tensors = {}
    for name, shape in rs.v4_shapes(cfg).items():
        if official_name(saved_name(name)) != name:
            raise AssertionError(f"saved_name({name!r}) = {saved_name(name)!r} does not map back")
        t = extra[name].float() if name in extra else ref.tensor(name, device=device).cpu()
        if tuple(t.shape) != tuple(shape):
            raise AssertionError(f"{name}: {tuple(t.shape)} from {'the V4' if name in extra else ref_dir}, "
                                 f"the V4 config wants {tuple(shape)}")
        tensors[saved_name(name)] = t.contiguous()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


@contextlib.contextmanager
def ties_to_lower_index():
    """torch.topk with equal values ranked by index, lower first: the oracle's selection rule (fidelity.oracle.
    deepseek.selection), under which transformers' indexer picks what the oracle picks (tests/_deepseek_configs)."""
    def topk(x, k, dim=-1, largest=True, sorted=True):
        order = torch.sort(x, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))
    saved = torch.topk, torch.Tensor.topk
    torch.topk, torch.Tensor.topk = topk, topk
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = saved


def median_spans(one_pass, ends: dict[int, float], repeat: int, device) -> tuple[float, list[float], object]:
    """`repeat` timed runs of one_pass(), whose hooks write each layer's end time into `ends`: the median pass, each
    layer's median span (end of the layer before, or the pass's start, to its end) and the last run's output."""
    passes, spans, out = [], [], None
    for _ in range(repeat):
        ends.clear()
        rs.sync(device)
        start = time.perf_counter()
        out = one_pass()
        rs.sync(device)
        passes.append(time.perf_counter() - start)
        spans.append([ends[i] - (ends[i - 1] if i else start) for i in range(len(ends))])
    median = lambda xs: sorted(xs)[len(xs) // 2]        # noqa: E731
    return median(passes), [median(layer) for layer in zip(*spans)], out


def transformers_child(args, device, work: Path) -> dict:
    import transformers as T

    if not hasattr(T, "DeepseekV4ForCausalLM"):
        return {"available": False, "reason": f"transformers {T.__version__} has no DeepseekV4ForCausalLM"}
    from fidelity.oracle import Oracle, OracleTaps
    from fidelity.packs import open_pack

    rs.exact_math(device)       # both sides in true fp32 (no TF32)
    n = min(args.hf_layers, args.layers)
    cfg = flagship_config(rs.SMOKE if args.smoke else rs.FLASH, args.experts, n, args.vocab)
    t = time.perf_counter()
    folder = write_v4_folder(work / "ref", work / "v4-only.safetensors", work / "hf-v4", cfg, device)
    folder_s = time.perf_counter() - t
    panel = [json.loads(line) for line in (work / "panel" / "panel.jsonl").read_text().splitlines()]
    rows = [r["tokens"] for r in panel[:args.hf_rows]]
    ids = torch.tensor(rows, device=device)
    t = time.perf_counter()
    model, info = T.DeepseekV4ForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise AssertionError(f"transformers read {folder} with {bad}")
    model = model.to(device).eval()
    load_s = time.perf_counter() - t
    ends: dict[int, float] = {}

    def mark(i):
        def hook(*_):
            rs.sync(device)
            ends[i] = time.perf_counter()
        return hook
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(mark(i))
    with torch.no_grad():
        model.model(input_ids=ids[:1, : min(64, ids.shape[1])])               # warm-up
        hf_pass, hf_spans, want = median_spans(
            lambda: model.model(input_ids=ids).last_hidden_state,  # noqa: F821 (runs before the del)
            ends, args.hf_repeat, device)
        want = want.cpu()
        with ties_to_lower_index():       # untimed: the same weights give the oracle's numbers under its tie rule
            tied = model.model(input_ids=ids).last_hidden_state.cpu()
    impl = {"attention": model.config._attn_implementation,
            "experts": getattr(model.config, "_experts_implementation", None)}
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    oracle = Oracle(open_pack(folder), device=device, keep_weights=True)
    oracle.hidden_states([rows[0][:64]], progress=False)                        # warm-up: every layer built and kept
    taps = OracleTaps(layer_outputs={i: mark(i) for i in range(n)})

    def tapped_pass():
        with oracle.tapped(taps):
            return oracle._forward(rows, False)[1]
    ours_pass, ours_spans, outs = median_spans(tapped_pass, ends,
                                               args.hf_repeat, device)
    got = torch.cat([o.cpu() for o in outs])
    steady = slice(1 if n > 1 else 0, None)   # layer 0's span also holds the embedding, masks and rope tables
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())      # noqa: E731
    return {"available": True, "transformers": T.__version__, "layers": n, "rows": len(rows), "length": len(rows[0]),
            "implementation": impl, "folder_s": folder_s, "hf_load_s": load_s, "folder_bytes": folder_bytes(folder),
            "repeat": args.hf_repeat, "hf_pass_s": hf_pass, "hf_layer_s": hf_spans, "ours_pass_s": ours_pass,
            "ours_layer_s": ours_spans,
            "ours_x_hf": sum(ours_spans[steady]) / sum(hf_spans[steady]), "max_rel_diff": rel(got, want),
            "max_rel_diff_same_ties": rel(got, tied)}


# -- the run --------------------------------------------------------------------------------------------------------
def child_env(work: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["FIDELITY_CACHE"] = str(work / "fidelity-cache")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def compare_passes(args) -> int:
    return 1 + (not args.no_noise_floor) + (not args.no_numerics_floor)


def run_chain(args, argv: list[str], work: Path, out: Path) -> int:
    results = {"settings": {**build_params(args), "rows": args.rows, "length": args.length, "device": args.device,
                            "noise_floor": not args.no_noise_floor, "numerics_floor": not args.no_numerics_floor},
               "machine": machine(), "stages": {}, "failed": {}}

    def save():                  # after every stage, with its table: a run cut short keeps what finished
        results["table"] = table(results)
        (out / "results.json").write_text(json.dumps(results, indent=1))

    env, logs, gpu = child_env(work), out / "logs", args.device.startswith("cuda")
    me = [sys.executable, str(Path(__file__).resolve()), *argv]
    py, fid = sys.executable, [sys.executable, "-m", "fidelity"]
    ref, pack, panel = work / "ref", work / "pack", work / "panel"
    store, cmp_dir, report = work / "store", out / "compare", out / "report"

    def stage(name, cmd, needs=()) -> dict | None:
        if any(n in results["failed"] or n not in results["stages"] for n in needs):
            results["failed"][name] = f"not run: needs {', '.join(needs)}"
            save()
            return None
        try:
            results["stages"][name] = run_stage(name, cmd, env, logs, gpu)
        except StageFailed as e:
            results["failed"][name] = str(e)
        save()
        return results["stages"].get(name)

    if args.reuse and packs_built(work, build_params(args)):
        print(f"[build] reusing the packs in {work} ({BUILD_FILE} matches)", flush=True)
        results["build"] = json.loads((work / BUILD_FILE).read_text())
        results["stages"]["build"] = {"reused": True, **results["build"].get("stage", {})}
    elif stage("build", me + ["--child", "build"]):
        results["build"] = json.loads((work / "child-build.json").read_text())
        (work / BUILD_FILE).write_text(json.dumps({**results["build"], "stage": results["stages"]["build"]}))
    if "build" in results["failed"]:
        return finish(results, out, save)
    write_token_panel(panel, args.rows, args.length, args.vocab)
    results["panel"] = {"rows": args.rows, "length": args.length, "scored": args.rows * (args.length - 1)}
    stage("python_start", [py, "-c", "import torch, fidelity"])
    if args.baseline_json:
        results["baseline"] = baseline_from_realscale_json(Path(args.baseline_json))
    elif stage("baseline", me + ["--child", "baseline"]):
        results["baseline"] = json.loads((work / "child-baseline.json").read_text())
    if results.get("baseline"):
        start = (results["stages"].get("python_start") or {}).get("wall_s")
        results["predicted"] = predictions(results["baseline"], args.layers, args.experts, args.rows * args.length,
                                           results["panel"]["scored"], compare_passes(args), start)
    for d in (store, cmp_dir, report, work / "fidelity-cache"):
        shutil.rmtree(d, ignore_errors=True)
    stage("reference", fid + ["reference", str(ref), "--panel", str(panel), "-o", str(store), "--device", args.device])
    floors = (["--no-noise-floor"] if args.no_noise_floor else []) + \
        (["--no-numerics-floor"] if args.no_numerics_floor else [])
    if stage("compare", fid + ["compare", str(ref), str(pack), "--panel", str(panel), "--reference-store", str(store),
                               "--device", args.device, "--out", str(cmp_dir), "--json", str(cmp_dir / "compare.json"),
                               "--markdown", str(cmp_dir / "compare.md"), *floors], needs=("reference",)):
        numbers = compare_numbers(json.loads((cmp_dir / "compare.json").read_text()))
        if "error" in numbers:
            results["failed"]["compare"] = numbers["error"]
        else:
            results["compare"] = numbers
    results["sizes"] = {"store_bytes": folder_bytes(store) if store.exists() else None,
                        "records_bytes": folder_bytes(cmp_dir, "*.parquet") if cmp_dir.exists() else None,
                        "compare_out_bytes": folder_bytes(cmp_dir) if cmp_dir.exists() else None}
    if importlib.util.find_spec("matplotlib") is None:
        results["failed"]["report"] = "skipped: matplotlib is not installed (fidelity report draws with it)"
        print(f"[report] {results['failed']['report']}", flush=True)
    elif stage("report", fid + ["report", str(cmp_dir / "compare.json"), "-o", str(report)], needs=("compare",)):
        results["sizes"]["report_bytes"] = folder_bytes(report)
    if args.skip_transformers:
        results["transformers"] = {"available": False, "reason": "--skip-transformers"}
    elif stage("transformers", me + ["--child", "transformers"]):
        results["transformers"] = json.loads((work / "child-transformers.json").read_text())
    shutil.rmtree(work / "hf-v4", ignore_errors=True)
    return finish(results, out, save)


def compare_numbers(report: dict) -> dict:
    r = report["results"][0]
    if r.get("status") == "failed":
        return {"error": f"compare measured no numbers for {r['pack']}: {r.get('error')}"}
    o = r["overall"]
    return {"label": r["label"], "positions": o.get("positions"), "kld_mean": o["kld_mean"],
            "kld_mean_ci95": o.get("kld_mean_ci95"), "top1": o["top1"], "x_noise_floor": o.get("x_noise_floor"),
            "noise_floor_kld": (report.get("noise_floor") or {}).get("kld_mean"),
            "numerics_floor_kld": ((report.get("numerics_floor") or {}).get("overall") or {}).get("kld_mean")}


def machine() -> dict:
    import platform
    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = None
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                         text=True) if shutil.which("nvidia-smi") else None
    return {"gpu": gpu.stdout.strip() if gpu and gpu.returncode == 0 else None, "cpus": os.cpu_count(),
            "torch": torch.__version__, "transformers": tf, "python": platform.python_version(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def finish(results: dict, out: Path, save) -> int:
    save()
    print(results["table"], flush=True)
    return 1 if any(not v.startswith("skipped") for v in results["failed"].values()) else 0


# -- the table ------------------------------------------------------------------------------------------------------
def byte_size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _f(x, spec=".1f", none="-") -> str:
    return none if x is None else format(x, spec)


def prediction_line(r: dict, p: dict) -> str:
    s = r["settings"]
    return (f"\nrealscale's inputs: one V4.1 layer computes {s['rows'] * s['length']:,} tokens in "
            f"{p['layer_compute_s']:.3f} s and loads in {p['layer_load_s']:.3f} s at {s['experts']} experts (source: "
            f"{r['baseline']['source']}); a pass = {s['layers']} x max(compute, load) = {p['pass_s']:.1f} s "
            f"({p['pass_serial_s']:.1f} s serial); head + metrics "
            + ("included" if p["head_included"] else "NOT included (no head in the baseline)")
            + f"; reference serial {p['reference_serial_s']:.1f} s, compare serial {p['compare_serial_s']:.1f} s")


def compare_line(c: dict) -> str:
    ci = c.get("kld_mean_ci95") or [None, None]
    return (f"compare: KLD mean {c['kld_mean']:.4g} [{_f(ci[0], '.4g')}, {_f(ci[1], '.4g')}] over "
            f"{c['positions']} positions, top-1 {100 * c['top1']:.2f} %, noise floor KLD "
            f"{_f(c['noise_floor_kld'], '.3g')}, numerics floor KLD {_f(c['numerics_floor_kld'], '.3g')}")


def transformers_line(t: dict) -> str:
    if not t.get("available"):
        return f"transformers comparison: not available ({t['reason']})"
    per = " / ".join(f"{a:.3f}" for a in t["hf_layer_s"])
    ours = " / ".join(f"{a:.3f}" for a in t["ours_layer_s"])
    impl = t["implementation"]
    return (f"transformers {t['transformers']} DeepseekV4ForCausalLM (fp32, attention {impl['attention']}, experts "
            f"{impl['experts']}) vs the oracle on the same dequantized weights in memory (REF's; the V4 compressors "
            f"where V4.1 has its own), {t['layers']} layer(s), {t['rows']} x {t['length']} tokens, medians of "
            f"{t['repeat']} passes: per layer transformers {per} s, oracle {ours} s (layer 0's spans include the "
            f"embedding, masks and rope tables): **oracle / transformers = {t['ours_x_hf']:.2f}** over layers "
            f"{'1+' if t['layers'] > 1 else '0'}; final hidden states differ by {t['max_rel_diff']:.2e} of their "
            f"largest magnitude ({t['max_rel_diff_same_ties']:.2e} with transformers' top-k ties broken to the lower "
            f"index, as the oracle's)")


def table(r: dict) -> str:
    s, b, p = r["settings"], r.get("build") or {}, r.get("predicted") or {}
    stages, sizes = r["stages"], r.get("sizes") or {}
    gb = byte_size
    m = r["machine"]
    lines = [f"{s['layers']} layers of V4.1-{'smoke' if s['smoke'] else 'Flash'} geometry, vocabulary {s['vocab']:,}, "
             f"{s['experts']} routed experts per layer (K mix {b.get('expert_k_mix')}); REF fp8-mxfp4 "
             f"{gb(b.get('ref_bytes'))}, PACK deepseek_v41_exl3 {gb(b.get('pack_bytes'))}; panel {s['rows']} x "
             f"{s['length']} random token ids ({s['rows'] * (s['length'] - 1):,} scored); device {s['device']} "
             f"({m['gpu'] or 'no GPU'}), {m['cpus']} CPUs, torch {m['torch']}, transformers {m['transformers']}, "
             f"{m['date_utc']}", ""]
    lines += header(
        "stage",
        "wall s",
        "realscale predicts s (+ measured overheads)",
        "measured / predicted (/ with overheads)",
        "GPU peak GiB (nvidia-smi)",
        "host peak RSS GiB",
        "writes",
    )
    passes = 1 + s["noise_floor"] + s["numerics_floor"]
    rows = [("build", "build packs (--child build)", None, None,
             f"REF {gb(b.get('ref_bytes'))}, PACK {gb(b.get('pack_bytes'))}"),
            ("baseline", "realscale one V4.1 layer + head step + overheads (--child baseline)", None, None, ""),
            ("reference", "fidelity reference", p.get("reference_s"), p.get("reference_with_overheads_s"),
             f"store {gb(sizes.get('store_bytes'))}"),
            ("compare", f"fidelity compare ({passes} pass{'es' if passes > 1 else ''}: pack"
                        + (" + noise floor" if s["noise_floor"] else "") + (" + numerics floor" if s["numerics_floor"]
                                                                           else "") + ")",
             p.get("compare_s"), p.get("compare_with_overheads_s"),
             f"records {gb(sizes.get('records_bytes'))} (folder {gb(sizes.get('compare_out_bytes'))})"),
            ("report", "fidelity report", None, None, f"report {gb(sizes.get('report_bytes'))}"),
            ("transformers", f"transformers V4 vs oracle, layers 0-{min(s['hf_layers'], s['layers']) - 1} "
                             f"(--child transformers)", None, None,
             "")]
    for key, label, pred, pred_over, writes in rows:
        st = stages.get(key)
        if st is None:
            lines.append(f"| {label} | {r['failed'].get(key, 'not run')} | | | | | |")
            continue
        wall = st.get("wall_s")
        ratio = "-" if pred is None or wall is None else \
            f"{wall / pred:.2f}" + (f" / {wall / pred_over:.2f}" if pred_over else "")
        predicted = "-" if pred is None else f"{pred:.1f}" + (f" ({pred_over:.1f})" if pred_over else "")
        lines.append(f"| {label} | {_f(wall)}{' (reused)' if st.get('reused') else ''} | {predicted} | {ratio} | "
                     f"{_f(st.get('gpu_peak_GiB'), '.1f')} | {_f(st.get('host_peak_rss_GiB'), '.1f')} | {writes} |")
    if p:
        lines.append(prediction_line(r, p))
        over = (r.get("baseline") or {}).get("overheads") or {}
        if over:
            st = (stages.get("python_start") or {}).get("wall_s")
            lines.append(f"overheads measured apart: python + torch + fidelity start {_f(st)} s, REF fingerprint "
                         f"(empty hash cache) {over['fingerprint_ref_s']:.1f} s, PACK {over['fingerprint_pack_s']:.1f} "
                         f"s, Engram token map {over['token_map_s']:.2f} s per oracle, embedding + head loaded on the "
                         f"device REF {over['embed_head_ref_s']:.2f} s, PACK {over['embed_head_pack_s']:.2f} s")
    lines += present_lines(r, {"compare": compare_line, "transformers": transformers_line})
    for name, why in r["failed"].items():
        lines.append(f"- {name}: {why}")
    return "\n".join(lines)


# -- entry ----------------------------------------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny geometry, 3 layers, 4 x 64 tokens, CPU")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--layers", type=int, default=None, help="default 40 (3 with --smoke)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per layer (default 16; 8 with --smoke)")
    ap.add_argument("--rows", type=int, default=None, help="panel rows (default 16; 4 with --smoke)")
    ap.add_argument("--length", type=int, default=None, help="tokens per row (default 2048; 64 with --smoke)")
    ap.add_argument("--vocab", type=int, default=None, help=f"default {VOCAB:,} ({SMOKE_VOCAB} with --smoke)")
    ap.add_argument("--hf-layers", type=int, default=3, help="layers run in transformers and the oracle (default 3)")
    ap.add_argument("--hf-rows", type=int, default=2, help="panel rows run there (default 2)")
    ap.add_argument("--hf-repeat", type=int, default=3, help="timed passes there, medians (default 3)")
    ap.add_argument("--head-positions", type=int, default=8192, help="positions of the baseline's head step")
    ap.add_argument("--no-noise-floor", action="store_true", help="passed to compare")
    ap.add_argument("--no-numerics-floor", action="store_true", help="passed to compare")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--baseline-json", help="realscale.py --out's realscale.json instead of the baseline stage")
    ap.add_argument("--work", help="scratch folder for packs, panel and store (default: a temporary one, removed)")
    ap.add_argument("--reuse", action="store_true", help="keep the packs --work holds when built with these settings")
    ap.add_argument("--out", required=True, help="folder for results.json, logs, compare records and report")
    ap.add_argument("--child", choices=("build", "baseline", "transformers"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    small = args.smoke
    args.device = args.device or ("cpu" if small else "cuda")
    args.layers = args.layers or (3 if small else rs.LAYERS)
    args.experts = args.experts or (rs.SMOKE["n_routed_experts"] if small else 16)
    args.rows = args.rows or (4 if small else 16)
    args.length = args.length or (64 if small else 2048)
    args.vocab = args.vocab or (SMOKE_VOCAB if small else VOCAB)
    if args.layers < 1 or args.experts < (rs.SMOKE if small else rs.FLASH)["num_experts_per_tok"] or args.length < 2:
        ap.error("--layers >= 1, --experts >= the geometry's top-k and --length >= 2")
    return args


def without_option(argv: list[str], option: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


CHILDREN = {"build": build_child, "baseline": baseline_child, "transformers": transformers_child}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.child:
        work = Path(args.work)
        result = CHILDREN[args.child](args, torch.device(args.device), work)
        (work / f"child-{args.child}.json").write_text(json.dumps(result, indent=1))
        return 0
    temporary = args.work is None
    work = Path(args.work or tempfile.mkdtemp(prefix="flagship-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    argv = without_option(argv, "--work") + ["--work", str(work)]     # the children's scratch, absolute
    try:
        return run_chain(args, argv, work, out)
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
