"""The oracle on GPUs: exactness and speed, one GPU and several (torchrun), float32 with TF32 off.

    python benchmarks/oracle_gpu.py single [--out DIR]                       # GPU 0: checks + timings
    torchrun --nproc-per-node 2 benchmarks/oracle_gpu.py dist [--out DIR]     # after `single`: 2 GPUs
    (--tiny: small shapes, any device, for a quick run of the script itself)

single:
  - roofline: a large fp32 matmul with TF32 off (TFLOP/s);
  - SmolLM2-135M-shaped Llama (random weights; the real GGUF does not fit the device's 64 MiB carry) and a ~1B Llama:
    oracle CUDA vs oracle CPU (max |dlogit| / max |logit|), oracle vs HF transformers fp32 on the same GPU;
  - tokens/s: HF transformers fp32 base model (in GPU memory, sdpa) vs the oracle streaming its weights from host
    memory, stored as fp32 or as int8 + per-row scale dequantized on the fly on the CPU, with and without prefetch;
  - tiny DeepSeek-V3 and Qwen3Moe: CUDA vs CPU.
dist (torchrun, one GPU per rank): row-parallel hidden states of both stacks equal to `single`'s (torch.equal) and
  their tokens/s and scaling over `single`'s prefetching oracle, with every rank reading every layer and with sharded
  loads (each rank reads ~1/N of a layer, NCCL broadcasts the rest); expert-parallel tiny DeepSeek-V3 / Qwen3Moe
  logits equal to one GPU's. torchrun sets OMP_NUM_THREADS=1 unless told otherwise: give each rank its share of the
  cores (OMP_NUM_THREADS=16 on 32 cores and 2 GPUs), since a rank copies its weights into pinned memory with them.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fidelity.oracle import parallel  # noqa: E402
from fidelity.oracle import LoadChain, Oracle  # noqa: E402
from testkit.synthetic import llama_config, llama_shapes  # noqa: E402
from fidelity.packs.base import LogicalTensor, Pack, Storage  # noqa: E402

WORK = Path("/tmp/oracle_gpu_work")  # large intermediate files (single-GPU hidden states, MoE packs)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, n_layers=30, vocab_size=49152, n_heads=9, n_kv_heads=3,
               tie_word_embeddings=True)
ONE_B = dict(hidden_size=2048, intermediate_size=5632, n_layers=18, vocab_size=32000, n_heads=16, n_kv_heads=4)
TINY = dict(hidden_size=64, intermediate_size=96, n_layers=3, vocab_size=211, n_heads=4, n_kv_heads=2)


class HostPack(Pack):
    """Weights held in host memory: fp32, or int8 rows with a float32 scale each, dequantized when read."""

    format = "host"

    def __init__(self, config: dict, weights: dict[str, torch.Tensor], int8: bool = False):
        super().__init__(Path("<host>"))
        self.config = config
        for name, w in weights.items():
            if int8 and w.dim() == 2:
                scale = w.abs().amax(dim=1, keepdim=True) / 127
                q = torch.round(w / scale).to(torch.int8)
                entry = (lambda q=q, s=scale: q.to(torch.float32).mul_(s)), "Q8R", q.numel() + 4 * scale.numel()
            else:
                entry = (lambda w=w: w), "F32", 4 * w.numel()
            self._entries[name] = LogicalTensor(Storage(name, "fp32", entry[1], tuple(w.shape), entry[2]), entry[0])

    def dequantized(self) -> dict[str, torch.Tensor]:
        return {n: self.tensor(n) for n in self.names()}


def make_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in llama_shapes(cfg).items():
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        x = torch.randn(shape, generator=g)
        out[name] = (
            x.mul_(0.1).add_(1.0) if len(shape) == 1 else (x if "embed" in name else x.div_(math.sqrt(shape[1])))
        )
    return out


def hf_model(cfg: dict, weights: dict[str, torch.Tensor], device):
    """HF transformers' Llama with exactly these weights, fp32, built without a random init."""
    import transformers as T
    config = T.LlamaConfig(**cfg)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(config)
    model = model.to_empty(device=device)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.get("tie_word_embeddings"):
        model.tie_weights()
    with torch.device(device):  # its buffers were on meta
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.to(torch.float32).eval()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best, out


def rel_gap(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double().cpu(), got.double().cpu()
    return ((got - ref).abs().max() / ref.abs().max()).item()


def roofline(device, n: int) -> float:
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    torch.backends.cuda.matmul.allow_tf32 = False
    seconds, _ = timed(lambda: [a @ b for _ in range(5)], 3)
    return 5 * 2 * n ** 3 / seconds / 1e12


def bench_stack(name: str, cfg: dict, device, rows: int, length: int, repeats: int, cpu_check: bool, out: Path,
                no_int8: bool = False) -> dict:
    weights = make_weights(cfg)
    tokens = torch.randint(0, cfg["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(1))
    res = {"model": name, "params": sum(w.numel() for w in weights.values()), "tokens": rows * length}
    model = hf_model(cfg, weights, device)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        res["hf_sdpa_s"], _ = timed(
            lambda: model.model(input_ids=tokens.to(device), use_cache=False),  # noqa: F821 (runs before the del)
            repeats)
        small = tokens[:2, :64]
        hf_logits = model(input_ids=small.to(device), use_cache=False).logits.float().cpu()
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    for fmt in ("fp32",) if no_int8 else ("fp32", "int8"):
        pack = HostPack(cfg, weights, int8=fmt == "int8")
        for pre in (False, True):
            oracle = Oracle(pack, device=device, chain=LoadChain(prefetch=parallel.Prefetcher if pre else None))
            seconds, hidden = timed(
                lambda: oracle.hidden_states(tokens.tolist(), progress=False),  # noqa: F821 (runs before the del)
                repeats)
            res[f"oracle_{fmt}{'_prefetch' if pre else ''}_s"] = seconds
        torch.save(torch.stack(hidden).cpu(), WORK / f"{name}_{fmt}_hidden.pt")
        if fmt == "fp32":
            gpu_logits = oracle.logits(small)
            res["oracle_vs_hf_rel"] = rel_gap(hf_logits, gpu_logits)
            if cpu_check:
                res["cuda_vs_cpu_rel"] = rel_gap(Oracle(pack).logits(small), gpu_logits)
        del oracle, hidden
    for key in [k for k in res if k.endswith("_s")]:
        res[key[:-2] + "_tok_per_s"] = res["tokens"] / res[key]
    flops = 2 * (res["params"] - cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg.get("tie_word_embeddings") else 2))
    res["layer_flop_per_token"] = flops
    return res


def tiny_moe_checks(device) -> dict:
    import tempfile
    from test_oracle import COMMON, make_moe
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in ("deepseek-v3-qlora-yarn", "qwen3moe-renorm-sparse-step"):
            _, pack = make_moe(Path(tmp), case, 1234)
            tokens = torch.randint(0, COMMON["vocab_size"], (3, 29), generator=torch.Generator().manual_seed(2))
            out[case] = rel_gap(Oracle(pack).logits(tokens), Oracle(pack, device=device).logits(tokens))
    return out


def single(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    import transformers
    report["transformers"] = transformers.__version__
    report["fp32_matmul_tflops"] = roofline(device, 256 if args.tiny else 8192)
    report["tiny_moe_cuda_vs_cpu_rel"] = tiny_moe_checks(device)
    report["stacks"] = []
    for n, c, r, t in stack_list(args):
        try:
            report["stacks"].append(bench_stack(n, llama_config(**c), device, r, t, args.repeats, True, out,
                                                args.no_int8))
        except Exception as e:  # report what ran; the failure is in the output
            report["stacks"].append({"model": n, "error": repr(e)})
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    for s in (s for s in report["stacks"] if "error" not in s):
        s["hf_tflops"] = s["layer_flop_per_token"] * s["hf_sdpa_tok_per_s"] / 1e12
        s["oracle_best_tflops"] = s["layer_flop_per_token"] * max(v for k, v in s.items() if k.startswith("oracle_")
                                                                 and k.endswith("tok_per_s")) / 1e12
    (out / "single.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


def dist_run(args) -> None:
    """Row parallel on every stack `single` ran, each layer read by every rank (as before sharded loads) and sharded
    (each rank reads ~1/N and the ranks broadcast); hidden states compared with `single`'s; then expert parallel."""
    from fidelity import open_pack
    from test_oracle import COMMON, make_moe
    g = parallel.current_group("cuda" if torch.cuda.is_available() else "cpu")
    device, out = g.device, Path(args.out)
    one_gpu = json.loads((out / "single.json").read_text()) if (out / "single.json").exists() else {"stacks": []}
    report = {"world_size": g.world_size, "rank": g.rank, "torch_threads": torch.get_num_threads(), "stacks": []}
    for name, c, rows, length in stack_list(args):
        cfg = llama_config(**c)
        weights = make_weights(cfg)
        tokens = torch.randint(0, cfg["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(1))
        res = {"model": name, "tokens": rows * length}
        single_res = next((s for s in one_gpu["stacks"] if s.get("model") == name), {})
        for fmt in ("fp32",) if args.no_int8 else ("fp32", "int8"):
            pack = HostPack(cfg, weights, int8=fmt == "int8")
            want_path = WORK / f"{name}_{fmt}_hidden.pt"
            want = torch.load(want_path) if want_path.exists() else None
            for sharded in (False, True):
                oracle = parallel.make_oracle(pack, device, parallel.RunSettings(parallel="rows", shard_loads=sharded))
                seconds, hidden = timed(
                    lambda: oracle.hidden_states(tokens.tolist(), progress=False),  # noqa: F821 (runs before the del)
                    args.repeats)
                key = f"{fmt}_{'sharded' if sharded else 'every_rank_reads_all'}"
                res[f"{key}_tok_per_s"] = rows * length / seconds
                res[f"{key}_equal_single_gpu"] = None if want is None else bool(torch.equal(torch.stack(hidden).cpu(),
                                                                                             want))
                one = single_res.get(f"oracle_{fmt}_prefetch_tok_per_s")
                if one and single_res.get("tokens") == rows * length:
                    res[f"{key}_scaling_vs_1_gpu"] = res[f"{key}_tok_per_s"] / one
                del oracle, hidden
        report["stacks"].append(res)
        del weights
    cases = ("deepseek-v3-qlora-yarn", "qwen3moe-renorm-sparse-step")
    if g.rank == 0:  # transformers' save_pretrained writes on rank 0 only
        for case in cases:
            make_moe(WORK / "moe", case, 1234)
    g.checkpoint("the MoE packs")
    for case in cases:
        moe = open_pack(WORK / "moe" / case)
        toks = torch.randint(0, COMMON["vocab_size"], (3, 29), generator=torch.Generator().manual_seed(2))
        one = Oracle(moe, device=device).logits(toks)
        ep = Oracle(moe, device=device, chain=LoadChain(experts=parallel.ExpertParallel(g)))
        report[f"expert_parallel_equal_single_gpu_{case}"] = bool(torch.equal(ep.logits(toks), one))
    parallel.finish()
    if g.rank == 0:
        (out / "dist.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))


def stack_list(args) -> list[tuple]:
    stacks = [("tiny", TINY, 4, 32)] if args.tiny else [("smollm2_shape", SMOLLM2, args.rows, 512),
                                                         ("llama_1b", ONE_B, args.rows, 512)]
    return [s for s in stacks if not args.only or s[0] == args.only]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("single", "dist"))
    p.add_argument("--out", default="/tmp/oracle_gpu")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--rows", type=int, default=32, help="rows of 512 tokens (16 rows make one oracle batch)")
    p.add_argument("--only", help="single: just this stack (smollm2_shape or llama_1b)")
    p.add_argument("--no-int8", action="store_true", help="single: skip the int8-dequantized variants")
    args = p.parse_args()
    single(args) if args.mode == "single" else dist_run(args)
