"""Helpers for the oracle tests (no tests here): tiny random-init HF models. Every parameter (norms and biases included)
gets a random value so a misused
weight cannot hide behind HF's ones/zeros init."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

from fidelity.oracle import Oracle
from testkit.synthetic import randomize_weights as randomize


def build(config: transformers.PretrainedConfig, model_cls, folder: Path, seed: int):
    """Random-init model in fp32 with eager attention, saved as safetensors to folder. Returns the model (eval)."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the per-expert loop, not grouped_mm
    randomize(model, seed)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.save_pretrained(folder)
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits.to(torch.float32)


def assert_oracle_matches_hf(model, pack, tokens: torch.Tensor, tol: float, label: str) -> torch.Tensor:
    """The oracle's logits on `tokens` against the HF model's: the same shape, max |dlogit| <= tol, and HF's logits of a
    meaningful size (not a near-zero model). Returns the oracle's logits."""
    want = hf_logits(model, tokens)
    got = Oracle(pack).logits(tokens)
    delta = (got - want).abs().max().item()
    print(f"{label}: max |dlogit| = {delta:.3g}, logit scale {want.abs().max().item():.3g}")
    assert got.shape == want.shape and delta <= tol
    assert want.abs().max() > 1.0
    return got


def write_word_panel(path: Path, words: list[str], rows: int, words_per_row: int, seed: int) -> Path:
    """A text panel of `rows` random word sequences, domains alternating prose/code."""
    import json

    g = torch.Generator().manual_seed(seed)
    lines = [{"id": f"r{i}", "domain": ("prose", "code")[i % 2],
              "text": " ".join(words[j] for j in torch.randint(0, len(words), (words_per_row,), generator=g).tolist())}
             for i in range(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def compare_cli_kl(native: Path, packs: dict[str, Path], labels: list[str], words: list[str], *, rows: int,
                   words_per_row: int, bootstrap: int, tmp_path: Path, seed: int) -> tuple[dict, dict[str, float]]:
    """`fidelity compare NATIVE PACK... --label ...` (no noise floor) on a word panel: (the JSON report,
    {label: mean KL})."""
    import json

    from fidelity.cli import main

    panel = write_word_panel(tmp_path / "panel.jsonl", words, rows=rows, words_per_row=words_per_row, seed=seed)
    out = tmp_path / "report.json"
    rc = main(
        [
            "compare",
            str(native),
            *(str(packs[lab]) for lab in labels),
            *(a for lab in labels for a in ("--label", lab)),
            "--panel",
            str(panel),
            "--json",
            str(out),
            "--no-noise-floor",
            "--bootstrap",
            str(bootstrap),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    return report, {r["label"]: r["overall"]["kld_mean"] for r in report["results"]}
