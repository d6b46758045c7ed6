"""The oracle: an exact fp32 reference forward, streamed layer by layer, for every architecture family we support.

    from fidelity.oracle import Oracle
    oracle = Oracle(pack, device="cpu")
    logits = oracle.logits(tokens)                 # [B, T] -> [B, T, vocab], float32
    hidden = oracle.hidden_states(rows)            # list of [T_i, hidden] after the final norm
    for where, chunk in oracle.iter_logits(h): ... # the head, chunk by chunk
"""
from __future__ import annotations

from importlib import import_module

from ..errors import ConfigError
from .common import Family
from .runner import Oracle

# architecture (config.json "architectures"[0]) -> "module:FamilyClass"
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama:LlamaFamily",
    "MistralForCausalLM": "llama:LlamaFamily",
    "Qwen2ForCausalLM": "llama:LlamaFamily",
    "Qwen3ForCausalLM": "llama:LlamaFamily",
    "Qwen3MoeForCausalLM": "moe:MoeFamily",
    "MixtralForCausalLM": "moe:MoeFamily",
    "DeepseekV3ForCausalLM": "deepseek_v3:DeepseekV3Family",
    "DeepseekV32ForCausalLM": "deepseek_v32:DeepseekV32Family",
    "DeepseekV4ForCausalLM": "deepseek_v4:DeepseekV4Family",
    "DeepseekV41ForCausalLM": "deepseek_v41:DeepseekV41Family",
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def family_for(config: dict) -> Family:
    archs = config.get("architectures") or []
    if not archs:
        raise ConfigError(f"config.json names no architecture; supported: {supported_architectures()}")
    arch = archs[0]
    target = ARCHITECTURES.get(arch)
    if target is None:
        raise ConfigError(f"architecture {arch!r} is not supported by the oracle; supported: {supported_architectures()}")
    module, cls = target.split(":")
    return getattr(import_module(f".{module}", __name__), cls)(config)


__all__ = ["Oracle", "ARCHITECTURES", "supported_architectures", "family_for", "Family"]
