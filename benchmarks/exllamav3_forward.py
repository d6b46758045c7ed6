"""exllamav3's own DeepSeek-V4 forward vs the oracle, on a tiny random V4 in the official layout (bf16 weights).

exllamav3 runs the model in fp16 with its CUDA/Triton kernels (`attn_mode="flash_attn_nc"`, the stateless prefill its
own eval scripts use); the oracle runs it in fp32 on the CPU. Exact agreement is not expected: the numbers to read are
max |delta logit| against the logits' scale, top-1 agreement and KL(oracle || exllamav3), next to a control (the
oracle with one config field changed) that shows how far a real modelling difference moves them.

    python benchmarks/exllamav3_forward.py build OUT_DIR            # CPU: pack + oracle logits (+ control, + HF check)
    python benchmarks/exllamav3_forward.py run OUT_DIR --out RES    # CUDA + exllamav3: compare, RES/result.json

The shapes follow the real V4 where exllamav3's kernels may depend on them (head_dim 512 with a 64-dim RoPE slice,
hc_mult 4, index_head_dim 128, sliding window 128, compress ratios 0/4/128); the rest is small.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENS_SEED = 20261201
LENGTH = 320          # > sliding window (128), > index_topk CSA entries (320 / 4 = 80 > 32), 2 HCA entries
ROWS = 2

OFFICIAL = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", torch_dtype="bfloat16",
    vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=1,
    head_dim=512, qk_rope_head_dim=64, q_lora_rank=256, o_groups=4, o_lora_rank=128, sliding_window=128,
    index_n_heads=8, index_head_dim=128, index_topk=32, compress_ratios=[0, 4, 128, 4],
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128, num_hash_layers=2,
    routed_scaling_factor=1.5, swiglu_limit=10.0, scoring_func="sqrtsoftplus", topk_method="noaux_tc",
    rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=4096,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)

# the same model as transformers' DeepseekV4Config describes it (weights come from transformers' own init)
HF_CONFIG = dict(
    vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, head_dim=512,
    partial_rotary_factor=64 / 512, q_lora_rank=256, o_groups=4, o_lora_rank=128, sliding_window=128,
    index_n_heads=8, index_head_dim=128, index_topk=32,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=4, hc_sinkhorn_iters=20,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
    routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-6, max_position_embeddings=4096,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
                     "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.125}})
CONTROL = {"sliding_window": 96}   # the oracle with this changed: what a real modelling difference looks like


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(TOKENS_SEED)
    return torch.randint(2, OFFICIAL["vocab_size"], (ROWS, LENGTH), generator=g)


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict:
    ref, other = ref.double(), other.double()
    lp, lq = ref.log_softmax(-1), other.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"max_abs_delta": float((ref - other).abs().max()), "mean_abs_delta": float((ref - other).abs().mean()),
            "logit_std": float(ref.std()),
            "top1_agreement": float((ref.argmax(-1) == other.argmax(-1)).double().mean()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}


def oracle_logits(folder: Path, over: dict | None = None) -> torch.Tensor:
    from fidelity import open_pack
    from fidelity.oracle import Oracle
    pack = open_pack(folder)
    if over:
        pack.config.update(over)
    return Oracle(pack).logits(tokens())


def build(out: Path) -> dict:
    """The pack (official names, bf16, official-format config.json) and the oracle's logits on the fixed tokens."""
    import transformers as T
    from safetensors.torch import save_file

    from testkit.minipacks_v4 import build_native

    out.mkdir(parents=True, exist_ok=True)
    pack = out / "pack"
    build_native(pack, dtype=torch.bfloat16, **HF_CONFIG)
    hf_config = json.loads((pack / "config.json").read_text())
    (pack / "config.json").write_text(json.dumps(OFFICIAL, indent=1))
    ref = oracle_logits(pack)
    control = oracle_logits(pack, CONTROL)
    save_file({"tokens": tokens(), "oracle": ref.contiguous(), "control": control.contiguous()},
              out / "oracle_logits.safetensors")
    # the same weights through transformers (fp32, its own config spelling): the oracle reads the official config right
    from safetensors.torch import load_file
    from testkit.minipacks_v4 import official_name
    hf = T.DeepseekV4ForCausalLM(T.DeepseekV4Config(**HF_CONFIG)).float().eval()
    hf.config._attn_implementation = "eager"
    hf.set_experts_implementation("eager")
    saved_names = {official_name(k): k for k in hf_state_names(hf, out / "hf")}
    weights = load_file(pack / "model.safetensors")
    state = {saved_names[k]: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    reload = out / "hf_reload"
    reload.mkdir(exist_ok=True)
    save_file(state, reload / "model.safetensors", metadata={"format": "pt"})
    (reload / "config.json").write_text(json.dumps(hf_config))
    hf = T.DeepseekV4ForCausalLM.from_pretrained(reload, dtype=torch.float32).eval()
    hf.set_experts_implementation("eager")
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        hf_logits = hf(tokens()).logits
    summary = {"oracle_vs_transformers_fp32": compare(hf_logits, ref), "oracle_vs_control": compare(ref, control)}
    (out / "build.json").write_text(json.dumps(summary, indent=1))
    return summary


def hf_state_names(model, folder: Path) -> list[str]:
    """The names transformers' save_pretrained writes for this model (its conversion mapping applied)."""
    from safetensors import safe_open
    model.save_pretrained(folder)
    with safe_open(folder / "model.safetensors", "pt") as f:
        return list(f.keys())


def save_extension(path: str, out: Path, part_bytes: int = 15 * 2**20, max_parts: int = 4) -> list[str]:
    """The built extension, in parts small enough to bring back from a device run (and carry to the next one)."""
    data = Path(path).read_bytes()
    if len(data) > part_bytes * max_parts:
        return []
    names = []
    for i in range(0, len(data), part_bytes):
        name = f"ext.part{i // part_bytes}"
        (out / name).write_bytes(data[i:i + part_bytes])
        names.append(name)
    return names


def run(folder: Path, out: Path, save_ext: bool = False) -> dict:
    """exllamav3 (JIT-builds its extension on first import) on the pack; compared with the stored oracle logits."""
    from safetensors.torch import load_file
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    t0 = time.time()
    import exllamav3
    from exllamav3 import Config, Model
    from exllamav3.ext import exllamav3_ext
    result["exllamav3"] = getattr(exllamav3, "__version__", None) or sys.modules["exllamav3.version"].__version__
    result["import_and_build_s"] = round(time.time() - t0, 1)
    result["extension"] = getattr(exllamav3_ext, "__file__", None)
    print("built/imported in", result["import_and_build_s"], "s", flush=True)
    if save_ext and result["extension"]:
        result["extension_bytes"] = Path(result["extension"]).stat().st_size
        result["extension_parts"] = save_extension(result["extension"], out)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    stored = load_file(folder / "oracle_logits.safetensors")
    config = Config.from_directory(str(folder / "pack"))
    model = Model.from_config(config)
    model.load("cuda:0")
    logits = []
    with torch.inference_mode():
        for row in stored["tokens"]:
            y = model.forward(row[None].clone(), {"attn_mode": "flash_attn_nc"})
            logits.append(y.float().cpu())
    exl = torch.cat(logits)
    result["exllamav3_vs_oracle"] = compare(stored["oracle"], exl)
    result["exllamav3_vs_control"] = compare(stored["control"], exl)
    result["shape"] = list(exl.shape)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), flush=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["build", "run"])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--save-ext", action="store_true", help="write the built extension into --out in 15 MiB parts")
    args = ap.parse_args(argv)
    if args.what == "build":
        print(json.dumps(build(args.folder), indent=1))
    else:
        run(args.folder, args.out or args.folder, args.save_ext)
    return 0


if __name__ == "__main__":
    sys.exit(main())
